"""Atomic writes, the run directory's resume rules, planning and selection."""

from __future__ import annotations

import json

import pytest

from llmopt.core.atomic import atomic_dir, write_json
from llmopt.core.errors import RunDirError
from llmopt.core.schema import BenchResult, Candidate, Metric, VerifyResult, summarize
from llmopt.hardware.target import Target
from llmopt.model.info import inspect_model
from llmopt.optimize.select import SelectionInput, pareto_front, select
from llmopt.optimize.space import make_plan
from llmopt.rundir.paths import RunDir

CPU = Target(device="cpu", threads=2, cpu="test cpu", memory_bytes=8 * 2**30)


def test_atomic_dir_failure_leaves_nothing(tmp_path):
    final = tmp_path / "artifact"
    with pytest.raises(RuntimeError), atomic_dir(final) as d:
        (d / "half.bin").write_bytes(b"x" * 100)
        raise RuntimeError("killed mid-way")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == [], "no temporary leftovers"


def test_atomic_dir_replaces_and_clears_stale_tmp(tmp_path):
    final = tmp_path / "artifact"
    stale = tmp_path / ".tmp-artifact.dead"
    stale.mkdir()
    (stale / "junk").write_text("from a killed run")
    with atomic_dir(final) as d:
        (d / "a").write_text("1")
    with atomic_dir(final) as d:
        (d / "b").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert not stale.exists()


def test_write_json_is_complete_or_absent(tmp_path):
    p = write_json(tmp_path / "x.json", {"a": [1, 2]})
    assert json.loads(p.read_text()) == {"a": [1, 2]}
    with pytest.raises(TypeError):
        write_json(tmp_path / "y.json", {"bad": object()})
    assert not (tmp_path / "y.json").exists()
    assert [q.name for q in tmp_path.iterdir()] == ["x.json"]


def test_rundir_resumes_same_run_and_refuses_another(tmp_path):
    meta = {"model_fingerprint": "abc", "target": "cpu", "settings": {"window": 512}}
    run = RunDir(tmp_path / "run")
    assert run.open(meta) is False
    assert run.open(dict(meta)) is True
    with pytest.raises(RunDirError, match="model_fingerprint"):
        run.open({**meta, "model_fingerprint": "other"})
    with pytest.raises(RunDirError, match="settings"):
        run.open({**meta, "settings": {"window": 256}})
    assert run.open({**meta, "target": "cuda"}, force=True) is False
    other = tmp_path / "not-a-run"
    other.mkdir()
    (other / "precious.txt").write_text("user data")
    with pytest.raises(RunDirError, match="not empty"):
        RunDir(other).open(meta)
    assert (other / "precious.txt").read_text() == "user data"


def test_plan_lists_reference_first_and_skips_with_reasons(tiny_llama_dir):
    plan = make_plan(inspect_model(tiny_llama_dir), CPU)
    ids = [c.id for c in plan.candidates]
    assert ids[0] == "hf-fp32" and plan.candidates[0].reference
    assert {"hf-bf16", "hf-w8a16"} <= set(ids)
    skipped = {s["id"]: s["reason"] for s in plan.skipped}
    assert "bf16" in skipped["hf-fp16"]  # fp16 on CPU: use bf16
    assert "causal-lm" in skipped["onnxruntime-fp32"]
    assert plan.memory["weights_bytes"]["float32"] == 4 * plan.memory["weights_bytes"]["int8"]
    assert plan.memory["max_sequences_at_context"]["float32"] > 0


def test_plan_only_and_unknown_ids(tiny_llama_dir):
    info = inspect_model(tiny_llama_dir)
    plan = make_plan(info, CPU, only=["hf-bf16"])
    assert [c.id for c in plan.candidates] == ["hf-fp32", "hf-bf16"]
    with pytest.raises(ValueError, match="torch-int3"):
        make_plan(info, CPU, only=["torch-int3"])


def _verify(cid: str, drop: float, budget: float = 0.01) -> VerifyResult:
    ref = 10.0
    m = Metric("perplexity", ref, ref * (1 + drop), False, ref * (1 + budget), drop <= budget, 100)
    return VerifyResult(cid, "causal-lm", [m], m.passed, drop)


def _bench(cid: str, values: list[float]) -> BenchResult:
    return BenchResult(
        cid,
        "causal-lm",
        {"decode_tokens_per_s": summarize(values)},
        "decode_tokens_per_s",
        1,
        1,
        1,
        0.0,
        0.0,
    )


def test_select_fastest_within_budget_with_reasons():
    cands = [
        Candidate("ref", "torch", "fp32", reference=True),
        Candidate("fast-bad", "torch", "x"),
        Candidate("fast-ok", "torch", "y"),
        Candidate("broken", "torch", "z"),
        Candidate("same", "torch", "w"),
    ]
    verify = {
        "ref": _verify("ref", 0.0),
        "fast-bad": _verify("fast-bad", 0.05),
        "fast-ok": _verify("fast-ok", 0.004),
        "same": _verify("same", 0.0),
    }
    bench = {
        "ref": _bench("ref", [10, 10.5, 11]),
        "fast-bad": _bench("fast-bad", [40, 41, 42]),
        "fast-ok": _bench("fast-ok", [20, 21, 22]),
        "same": _bench("same", [19, 20.5, 23]),
    }
    sel = select(
        SelectionInput(cands, verify, bench, 0.01, errors={"broken": "build: OSError: disk full"})
    )
    assert sel.chosen == "fast-ok"
    assert sel.ranking == ["fast-ok", "same", "ref"]
    assert (
        sel.reasons["fast-ok"].startswith("chosen")
        and "2.00x the reference" in sel.reasons["fast-ok"]
    )
    assert sel.reasons["fast-bad"].startswith("dropped: quality gate failed (perplexity")
    assert sel.reasons["broken"] == "failed at build: OSError: disk full"
    assert "noise" in sel.reasons["same"] and "noise" not in sel.reasons["ref"]
    # ref is dominated by "same" (as accurate, faster).
    assert set(sel.pareto) == {"same", "fast-ok", "fast-bad"}


def test_select_nothing_passes():
    cands = [Candidate("ref", "torch", "fp32", reference=True)]
    sel = select(SelectionInput(cands, {}, {}, 0.01, errors={"ref": "verify: boom"}))
    assert sel.chosen is None and sel.ranking == [] and "boom" in sel.reasons["ref"]


def test_pareto_front():
    assert pareto_front({"a": (1, 0.0), "b": (2, 0.0), "c": (3, 0.5)}) == ["b", "c"]


def test_peak_rss_is_the_process_own_not_inherited():
    import subprocess
    import sys

    from llmopt.hardware.runtime import peak_rss_bytes

    ballast = bytearray(400 * 2**20)  # the parent touches 400 MiB
    ballast[::4096] = b"x" * len(ballast[::4096])
    assert peak_rss_bytes() > 400 * 2**20
    code = "from llmopt.hardware.runtime import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    assert child < 200 * 2**20, (
        f"child reports {child / 2**20:.0f} MiB: inherited the parent's peak"
    )
    del ballast


def test_select_says_what_the_engine_bought_over_eager_transformers():
    cands = [
        Candidate("hf-fp32", "hf", "fp32", reference=True),
        Candidate("hf-bf16", "hf", "bf16", {"threads": 16, "device": "cuda"}),
        Candidate("torch-bf16", "torch", "bf16", {"threads": 16, "device": "cuda"}),
    ]
    verify = {c.id: _verify(c.id, 0.001) for c in cands}
    bench = {
        "hf-fp32": _bench("hf-fp32", [8, 8, 8]),
        "hf-bf16": _bench("hf-bf16", [16, 16, 16]),
        "torch-bf16": _bench("torch-bf16", [190, 194, 196]),
    }
    sel = select(SelectionInput(cands, verify, bench, 0.01))
    assert sel.chosen == "torch-bf16"
    assert "batch-1 decode 12.1x hf-bf16" in sel.reasons["torch-bf16"]
    assert "measured in this run" in sel.reasons["torch-bf16"]
    screen = {
        "hf-bf16": _bench("hf-bf16", [30, 31, 30]),
        "torch-bf16": _bench("torch-bf16", [149] * 3),
    }
    del bench["hf-bf16"]  # no eager twin measured: nothing claimed
    assert "hf-bf16" not in select(SelectionInput(cands, verify, bench, 0.01)).reasons["torch-bf16"]
    # The twin cut at the screen: both compared there, and the reason says so.
    at_screen = SelectionInput(cands, verify, bench, 0.01, screen_bench=screen)
    reason = select(at_screen).reasons["torch-bf16"]
    assert "batch-1 decode 5.0x hf-bf16 (149 vs 30 tokens/s" in reason
    assert "at the screen fidelity" in reason
    del screen["torch-bf16"]  # the chosen one has no screen numbers: no mixed-fidelity ratio
    at_screen = SelectionInput(cands, verify, bench, 0.01, screen_bench=screen)
    assert "hf-bf16" not in select(at_screen).reasons["torch-bf16"]


def test_stage_settings_read_back_the_run_json_they_write():
    from llmopt.optimize.profiles import PROFILES, SCREEN, StageSettings

    # The JSON form is what run.json and search.json held before the sizes were typed.
    assert PROFILES["full"].to_dict() == {
        "eval_windows": 16,
        "window": 512,
        "sentences": 2000,
        "bench_sentences": 512,
        "bench_repeats": 3,
        "prompt_tokens": 100,
        "new_tokens": 64,
        "bench_batch_sizes": [1, 4],
    }
    assert SCREEN["quick"].to_dict()["generation_prompts"] == 0
    settings = StageSettings.for_run("quick", 0.02, "loose", 2).run_json("quick")
    assert settings["profile"] == "quick" and settings["threads"] == 2
    assert "generation_prompts" not in settings  # full fidelity: the verifier's default
    for fidelity, sizes in (
        ("full", PROFILES["quick"]),
        ("screen", SCREEN["quick"]),
        ("reverify", PROFILES["quick"]),
    ):
        got = StageSettings.from_run_json(settings, fidelity)
        assert got.sizes == sizes and got.max_quality_drop == 0.02 and got.gates == "loose"
    # A run written before --gates existed reads as the default preset.
    older = {k: v for k, v in settings.items() if k != "gates"}
    assert StageSettings.from_run_json(older).gates == "default"
    record = SCREEN["full"].fidelity_record("screen", SCREEN["full"].VERIFY_FIELDS)
    assert record == {
        "level": "screen",
        "rung": 1,
        "eval_windows": 4,
        "window": 256,
        "sentences": 500,
        "generation_prompts": 0,
    }
