"""The search's pure parts: candidate space, budget parsing, objectives, halving, selection."""

from __future__ import annotations

import pytest

from llmopt.core.schema import BenchResult, Candidate, Metric, VerifyResult, summarize
from llmopt.hardware.target import Target
from llmopt.model.info import inspect_model
from llmopt.optimize.budget import Budget, parse_duration
from llmopt.optimize.halving import ScreenEntry, cannot_improve, screen
from llmopt.optimize.objective import get_objective
from llmopt.optimize.select import SelectionInput, pareto_front_nd, select
from llmopt.optimize.space import candidate_space, make_plan, settings_suffix, task_rule
from llmopt.rundir.paths import RunDir

CPU = Target(device="cpu", threads=2, cpu="test cpu", memory_bytes=8 * 2**30)


def test_space_covers_every_registered_recipe_and_engine(tiny_llama_dir, tiny_bert_dir):
    from llmopt.core.recipes import RECIPES
    from llmopt.engines import ENGINES

    for folder in (tiny_llama_dir, tiny_bert_dir):
        info = inspect_model(folder)
        cands, skipped = candidate_space(info, CPU)
        ids = {c.id for c in cands} | {s["id"] for s in skipped}
        # Every (engine, recipe) pair is either a candidate or skipped with a reason: none lost.
        assert {f"{e}-{r}" for e in ENGINES for r in RECIPES} <= ids
        assert all(s["reason"] for s in skipped)
        assert cands[0].id == "hf-fp32" and cands[0].reference
        assert sum(c.reference for c in cands) == 1


def test_new_recipe_appears_without_code_changes(tiny_llama_dir, monkeypatch):
    from llmopt.core import recipes

    extra = recipes.Recipe("w8-bf16-test", "bfloat16", weight_bits=8, description="test-only")
    monkeypatch.setitem(recipes.RECIPES, extra.name, extra)
    alias = recipes.Recipe("bf16-alias", "bfloat16", description="same numbers as bf16")
    monkeypatch.setitem(recipes.RECIPES, alias.name, alias)
    cands, skipped = candidate_space(inspect_model(tiny_llama_dir), CPU)
    why = {s["id"]: s["reason"] for s in skipped}
    # The hf engine refuses names it does not know: listed with its reason, never attempted.
    assert "hf engine" in why["hf-w8-bf16-test"]
    assert why["hf-bf16-alias"].startswith("alias of bf16")


def test_cpu_searches_one_group_size_per_algorithm(tiny_llama_dir):
    from llmopt.core.recipes import RECIPES

    grouped = [r for r in RECIPES.values() if getattr(r, "group_size", None)]
    if not grouped:
        pytest.skip("no group-quantized recipes registered")
    info = inspect_model(tiny_llama_dir)
    _, skipped = candidate_space(info, CPU)
    small = next(r for r in grouped if r.group_size != 128)
    assert any(s["recipe"] == small.name and "group size" in s["reason"] for s in skipped)
    # Named explicitly, it is searched (if an engine runs it).
    _, skipped2 = candidate_space(info, CPU, only=[f"torch-{small.name}"])
    assert not any(s["recipe"] == small.name and "group size" in s["reason"] for s in skipped2)


def test_cpu_searches_asymmetric_4bit_only_when_named(tiny_llama_dir):
    info = inspect_model(tiny_llama_dir)
    cands, skipped = candidate_space(info, CPU)
    assert not any(c.recipe.endswith("-asym") for c in cands)
    asym = [s for s in skipped if s["id"].startswith("torch-") and s["recipe"].endswith("-asym")]
    fits = [s for s in asym if s["reason"].startswith("asymmetric 4-bit: on cpu")]
    assert fits  # the others: group sizes that do not divide the tiny model, or aliases
    named, _ = candidate_space(info, CPU, only=[fits[0]["id"]])
    assert fits[0]["id"] in {c.id for c in named}
    gpu = Target(device="cuda", threads=2, cpu="test cpu", memory_bytes=8 * 2**30)
    _, skipped_gpu = candidate_space(info, gpu)
    assert not any(s["reason"].startswith("asymmetric") for s in skipped_gpu)


def test_engine_settings_variations_become_candidates(tiny_llama_dir, monkeypatch):
    from llmopt.engines import ENGINES

    hf = ENGINES["hf"]
    monkeypatch.setattr(
        hf, "settings_space", lambda info, recipe, device: [{}, {"compile": True}], raising=False
    )
    cands, _ = candidate_space(inspect_model(tiny_llama_dir), CPU)
    ids = [c.id for c in cands]
    assert "hf-fp32" in ids and "hf-fp32-compile" in ids
    comp = next(c for c in cands if c.id == "hf-fp32-compile")
    assert comp.settings.compile is True and not comp.reference
    assert settings_suffix({"compile": False, "block_size": 16}) == "-nocompile-block_size16"


def test_task_rule_keeps_kv_recipes_off_encoders():
    from llmopt.core.recipes import Recipe

    assert task_rule("embedding", Recipe("kv-fp8")) is not None
    assert task_rule("causal-lm", Recipe("kv-fp8")) is None
    assert task_rule("embedding", Recipe("fp32")) is None


def test_plan_still_lists_skips_and_refuses_unknown(tiny_llama_dir):
    info = inspect_model(tiny_llama_dir)
    plan = make_plan(info, CPU, only=["hf-bf16"])
    assert [c.id for c in plan.candidates] == ["hf-fp32", "hf-bf16"]
    with pytest.raises(ValueError, match="unknown candidate"):
        make_plan(info, CPU, only=["nope-int3"])


@pytest.mark.parametrize(
    ("text", "seconds"), [("15m", 900.0), ("90s", 90.0), ("1h30m", 5400.0), ("2.5h", 9000.0)]
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["15 minutes", "m", "-5m", "0s"])
def test_parse_duration_rejects_with_fix(bad):
    with pytest.raises(ValueError, match="15m|positive"):
        parse_duration(bad)


def test_budget_fits():
    b = Budget(100.0, reserve_s=10.0, started=0.0)
    import time

    b.started = time.monotonic() - 50  # 50 s spent, 40 s usable left
    assert b.fits(30) and not b.fits(45) and b.fits(60, parallel=2)
    assert Budget(None).fits(1e9)


def _bench(cid: str, task: str, **medians: float) -> BenchResult:
    metrics = {k: summarize([v * 0.98, v, v * 1.02]) for k, v in medians.items()}
    primary = "decode_tokens_per_s" if task == "causal-lm" else "sentences_per_s_b32"
    return BenchResult(
        cid,
        task,
        metrics,
        primary,
        100 * 2**20,
        50 * 2**20,
        1,
        0.0,
        0.0,
        settings={"prompt_tokens": 100, "new_tokens": 10},
    )


def test_objectives_read_the_right_numbers():
    b = _bench(
        "x",
        "causal-lm",
        decode_tokens_per_s=20,
        decode_tokens_per_s_b4=50,
        prefill_tokens_per_s=1000,
        decode_ms_per_token=50,
    )
    assert get_objective("throughput").value(b) == pytest.approx(50)  # largest batch measured
    # 100 prompt tokens at 1000/s + 10 tokens x p90 ms/token
    assert get_objective("latency").value(b) == pytest.approx(100 + 10 * 50 * 1.016, rel=1e-3)
    assert get_objective("memory").value(b) == 100 * 2**20
    assert get_objective("cost").value(b, {"price_per_hour": 3.6}) == pytest.approx(20.0)
    lat = get_objective("latency")
    assert lat.score(50, 100) == 2.0 and get_objective("throughput").score(50, 100) == 0.5
    with pytest.raises(ValueError, match="latency"):
        get_objective("speed")


def test_screen_cuts_with_reasons():
    entries = [
        ScreenEntry("ref", 0.0, True, 1.0, reference=True),
        ScreenEntry("bad-quality", 0.07, False, 3.0, quality_name="ppl"),
        ScreenEntry("borderline", 0.012, False, 2.5),
        ScreenEntry("slow", 0.004, True, 0.6),
        ScreenEntry("good", 0.001, True, 1.6),
        ScreenEntry("ok", 0.002, True, 1.2),
    ]
    survivors, cut = screen(entries, 0.01, "throughput")
    assert survivors == ["ref", "borderline", "good"]  # ceil(3 / 2) of the three that qualify
    assert cut["bad-quality"] == ("screened out at fidelity 1 (screen): ppl +7.0% > budget 1.0%")
    assert "reference dominates" in cut["slow"]
    assert "ranks 3/3" in cut["ok"] and "keeps the best 2" in cut["ok"]
    assert cannot_improve(1.0, 1.2) and not cannot_improve(1.15, 1.2)


def _verify(cid: str, drop: float) -> VerifyResult:
    m = Metric("perplexity", 10.0, 10.0 * (1 + drop), False, 10.1, drop <= 0.01, 100)
    return VerifyResult(cid, "causal-lm", [m], m.passed, drop)


def test_select_by_objective_and_cut_reasons():
    cands = [
        Candidate("ref", "hf", "fp32", reference=True),
        Candidate("fast", "hf", "w8a16"),
        Candidate("small", "hf", "bf16"),
        Candidate("cut", "hf", "x"),
    ]
    verify = {
        "ref": _verify("ref", 0),
        "fast": _verify("fast", 0.005),
        "small": _verify("small", 0.002),
    }
    bench = {
        "ref": _bench(
            "ref",
            "causal-lm",
            decode_tokens_per_s=10,
            prefill_tokens_per_s=500,
            decode_ms_per_token=100,
        ),
        "fast": _bench(
            "fast",
            "causal-lm",
            decode_tokens_per_s=30,
            prefill_tokens_per_s=300,
            decode_ms_per_token=33,
        ),
        "small": _bench(
            "small",
            "causal-lm",
            decode_tokens_per_s=20,
            prefill_tokens_per_s=2000,
            decode_ms_per_token=50,
        ),
    }
    bench["small"].peak_rss_bytes = 40 * 2**20
    cut = {"cut": "screened out at fidelity 1 (screen): ppl +7.0% > budget 1.0%"}
    tp = select(SelectionInput(cands, verify, bench, 0.01, "throughput", cut=cut))
    assert tp.chosen == "fast" and "3.00x the reference" in tp.reasons["fast"]
    assert tp.reasons["cut"].startswith("cut: screened out")
    assert tp.objective == "throughput" and tp.objective_unit == "tokens/s"
    mem = select(SelectionInput(cands, verify, bench, 0.01, "memory", cut=cut))
    assert mem.chosen == "small" and mem.ranking[0] == "small"
    lat = select(SelectionInput(cands, verify, bench, 0.01, "latency"))
    # fast: 100/300 s + 10 x 33 ms = 663 ms; small: 50 + 500 = 550 ms -> small wins latency
    assert lat.chosen == "small"
    assert set(tp.pareto) == {"fast", "small", "ref"}
    assert set(tp.pareto_memory) >= {"fast", "small"}


def test_pareto_nd():
    pts = {"a": (1.0, 1.0, 1.0), "b": (2.0, 2.0, 2.0), "c": (0.5, 3.0, 1.0)}
    assert pareto_front_nd(pts) == ["a", "c"]


def test_rundir_fidelity_files(tmp_path):
    cdir = RunDir(tmp_path).candidate("x")
    assert cdir.stage_file("verify").name == "verify.json"
    assert cdir.stage_file("verify", "screen").name == "verify.screen.json"
    assert cdir.stage_file("build", "screen").name == "build.json"  # one build for all rungs
    assert cdir.task_file("screen").name == "task.screen.json"
    with pytest.raises(AssertionError):
        cdir.stage_file("verify", "fidelity-7")


def test_stage_past_the_deadline_is_killed_and_recorded_as_cut(tiny_bert_dir, tmp_path):
    import time

    from llmopt.core.atomic import write_json
    from llmopt.optimize.executor import Task, run_task

    info = inspect_model(tiny_bert_dir)
    plan = make_plan(info, CPU, only=["hf-bf16"])
    run = RunDir(tmp_path / "run")
    run.open(
        {
            "model_fingerprint": info.fingerprint,
            "target": "cpu",
            "model_path": str(tiny_bert_dir),
            "settings": {"threads": 1},
        }
    )
    write_json(run.model_json, info.to_dict())
    write_json(run.plan_json, plan.to_dict())
    write_json(run.candidate("hf-bf16").stage_file("candidate"), plan.candidates[1].to_dict())
    t0 = time.monotonic()
    rec = run_task(
        str(run.root),
        Task("hf-bf16", [("build", "full")], "screen", "hf-fp32", deadline=time.time()),
    )
    assert time.monotonic() - t0 < 30
    assert rec["ok"] is False and rec["out_of_time"] == "time budget exhausted during build (full)"
    cdir = run.candidate("hf-bf16")
    assert not cdir.done("build") and not cdir.stage_file("error").exists()
    assert "killed: time budget exhausted" in cdir.log.read_text()


def test_native_engine_offers_a_compiled_variant_on_cpu_only(tiny_llama_dir):
    info = inspect_model(tiny_llama_dir)
    cands, skipped = candidate_space(info, CPU)  # opt-in: listed with the reason, not searched
    reasons = {s["id"]: s["reason"] for s in skipped}
    for cid in ("torch-fp32-compile", "torch-bf16-compile", "torch-w8a16-compile"):
        assert cid not in {c.id for c in cands} and "--candidates" in reasons[cid]
    cands, _ = candidate_space(info, CPU, only=["torch-fp32-compile"])
    ids = {c.id for c in cands}
    assert ids == {"hf-fp32", "torch-fp32-compile"}
    comp = next(c for c in cands if c.id == "torch-fp32-compile")
    assert comp.settings.compile is True and "opt_in" not in comp.settings.to_dict()
    assert "compile" in comp.description
    cands, _ = candidate_space(info, CPU)
    assert not any(i.endswith("-compile") and not i.startswith("torch-") for i in ids)
    gpu, _ = candidate_space(info, Target("cuda", 8, "test GPU", 80 * 2**30))
    assert not any(c.id.endswith("-compile") for c in gpu)  # compiled there by default


def test_screen_order_puts_calibrated_builds_last():
    from llmopt.optimize.loop import _calibrated

    assert not any(_calibrated(r) for r in ("fp32", "bf16", "w8a16"))
    assert all(
        _calibrated(r) for r in ("w4a16-rtn-g64", "w4a16-gptq-g64", "w8a8-int8", "fp8-dynamic")
    )
