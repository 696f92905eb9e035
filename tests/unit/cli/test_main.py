"""The `llmopt` command as a user runs it: a real process, exit codes, JSON, error messages."""

from __future__ import annotations

import json
import re
import subprocess
import sys

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LLMOPT, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_help_is_instant_and_imports_no_torch():
    code = "import sys; sys.argv=['llmopt','--help']\nfrom llmopt.cli.main import main\ntry: main()\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert "optimize" in proc.stdout
    assert proc.stdout.strip().endswith("False"), "llmopt --help must not import torch"


def test_inspect_json_on_a_folder(tiny_llama_dir):
    proc = _run("inspect", str(tiny_llama_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["task"] == "causal-lm" and info["num_layers"] == 2 and info["num_kv_heads"] == 2
    assert info["kv_bytes_per_token"]["float32"] == 2 * 2 * 16 * 2 * 4


def test_inspect_table_on_a_folder(tiny_bert_dir):
    proc = _run("inspect", str(tiny_bert_dir))
    assert proc.returncode == 0, proc.stderr
    assert "embedding" in proc.stdout and "BertModel" in proc.stdout and "mean" in proc.stdout


def test_missing_model_is_a_clear_error(tmp_path):
    proc = _run("inspect", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert "fix:" in proc.stderr and "smollm2-135m" in proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stdout + proc.stderr


def test_pickle_only_folder_is_refused_without_opt_in(tiny_llama_dir):
    import torch
    from safetensors.torch import load_file

    state = load_file(tiny_llama_dir / "model.safetensors")
    (tiny_llama_dir / "model.safetensors").unlink()
    torch.save(state, tiny_llama_dir / "pytorch_model.bin")
    proc = _run("inspect", str(tiny_llama_dir))
    assert proc.returncode == 2 and "--allow-pickle" in proc.stderr
    ok = _run("inspect", str(tiny_llama_dir), "--allow-pickle", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["weight_format"] == "pickle"


def test_plan_json_lists_skips(tiny_llama_dir):
    proc = _run("plan", str(tiny_llama_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["candidates"][0]["id"] == "hf-fp32"
    assert any(s["id"] == "hf-fp16" for s in plan["skipped"])


def test_bad_quality_budget_is_refused(tiny_llama_dir, tmp_path):
    proc = _run(
        "optimize", str(tiny_llama_dir), "--out", str(tmp_path / "r"), "--max-quality-drop", "2"
    )
    assert proc.returncode == 2 and "max-quality-drop" in proc.stderr
    assert not (tmp_path / "r").exists(), "a refused run writes nothing"
    proc = _run("optimize", str(tiny_llama_dir), "--out", str(tmp_path / "r"), "--gates", "lax")
    assert proc.returncode == 2 and "gate preset" in proc.stdout + proc.stderr
    assert not (tmp_path / "r").exists()


def test_optimize_tiny_llama_end_to_end(tiny_llama_dir, tmp_path, quick_optimize_args):
    out = tmp_path / "run"
    proc = _run(*quick_optimize_args(tiny_llama_dir, out, time_budget="30m"), timeout=600)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    sel = json.loads((out / "selection.json").read_text())
    ids = {"hf-fp32", "hf-bf16", "hf-w8a16"}
    assert set(sel["reasons"]) == ids
    # Not a terminal: one timestamped line per stage start and end.
    lines = proc.stdout.splitlines()
    for cid in ids:
        for stage in ("build", "verify", "bench"):
            assert any(re.search(rf"\bstart +{stage} +{cid}\b", line) for line in lines), (
                cid,
                stage,
            )
            assert any(re.search(rf"\bdone +{stage} +{cid}\b", line) for line in lines)
    assert re.search(r"done +bench +hf-fp32 .*decode_tokens_per_s \d", proc.stdout)
    assert re.search(r"done +verify +hf-bf16 .*quality drop", proc.stdout)
    # The finalists were benchmarked side by side with the reference, in mirrored rounds.
    search = json.loads((out / "search.json").read_text())
    passed = [i for i in sel["ranking"] if i != "hf-fp32"]
    if not search["side_by_side"]:  # never silently: the search says why no round compared
        assert any(e.startswith("side by side") for e in search["events"]), search["events"]
    else:
        assert set(search["side_by_side"]) == set(passed[:2]), search["events"]
    for cid in [*passed[:2], "hf-fp32"] if search["side_by_side"] else []:
        for r in (1, 2):
            b = json.loads((out / "candidates" / cid / f"bench.pair{r}.json").read_text())
            assert b["fidelity"]["rung"] == 3 and b["env"]["probe"]["before"]["probe_ms"] > 0
    assert sel["side_by_side"].keys() == search["side_by_side"].keys()
    # Rung 4: the chosen one's thread count measured side by side with its default; best/
    # deploys whichever settings the rounds chose, and the reason says which.
    # (The run takes all cores unless its thread probe found them busy: then 1, and no fewer.)
    threads = json.loads((out / "run.json").read_text())["settings"]["threads"]
    if sel["chosen"] and threads > 1:
        tuned = sel["tuned"]
        assert tuned["base"] == sel["chosen"] and f"{sel['chosen']}+threads1" in tuned["tried"]
        assert "settings:" in sel["reasons"][sel["chosen"]]
        best = json.loads((out / "best" / "candidate.json").read_text())
        assert best["settings"] == tuned["settings"]
        report = (out / "report.md").read_text()
        assert "+threads1" not in report.split("## Candidates")[-1].split("\n## ")[0]
    for cid in ids:
        for stage in ("build", "verify", "bench"):
            assert (out / "candidates" / cid / f"{stage}.json").is_file(), f"{cid}/{stage}"
    ref = json.loads((out / "candidates" / "hf-fp32" / "verify.json").read_text())
    assert ref["passed"] and ref["quality_drop"] == 0.0
    assert (out / "report.html").is_file()
    # --gates loose: the run records it and the gates use its thresholds (budget stays 1%).
    assert json.loads((out / "run.json").read_text())["settings"]["gates"] == "loose"
    bf16 = json.loads((out / "candidates" / "hf-bf16" / "verify.json").read_text())
    limits = {m["name"]: m["threshold"] for m in bf16["metrics"]}
    assert limits["top1_agreement"] == 0.80 and limits["kl_divergence_mean"] == 0.30
    # The reference's outputs were saved once and the candidates compared against them.
    assert (out / "candidates" / "hf-fp32" / "reference-outputs.full.npz").is_file()


def test_optimize_says_its_default_time_budget_first(tiny_llama_dir, tmp_path):
    proc = _run("optimize", str(tiny_llama_dir), "--out", str(tmp_path / "r"), "--candidates", "x")
    assert proc.returncode == 2 and "unknown candidate" in proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[:3]  # (after a thread-probe note when the cores are busy)
    assert any("time budget: 5 min, the default for a model under 1B" in s for s in first), first
    assert "--time-budget none" in proc.stdout


def test_optimize_on_a_broken_folder_writes_nothing(tiny_llama_dir, tmp_path):
    weights = tiny_llama_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated copy
    out = tmp_path / "run"
    proc = _run("optimize", str(tiny_llama_dir), "--out", str(out))
    assert proc.returncode == 2
    assert "model.safetensors" in proc.stderr and "fix:" in proc.stderr
    assert not out.exists()
