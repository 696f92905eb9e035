"""End to end: `llmopt optimize minilm-l6` as a real CLI process, then resume and crash recovery,
the successive-halving screen, the time budget, and `--reverify`.

The module's run is exhaustive (every candidate fully verified and benchmarked) so the resume
tests can count stages; the search tests reuse copies of it, so only their own work runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Every test shares one optimize run of the built-in model (minutes on 2 cores).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]
STAGES = ("build", "verify", "bench")


def _optimize(out: Path, *extra: str, search: str = "exhaustive") -> tuple[int, dict]:
    proc = subprocess.run(
        [
            *LLMOPT,
            "optimize",
            "minilm-l6",
            "--quick",
            "--out",
            str(out),
            "--json",
            "--search",
            search,
            "--time-budget",  # these runs check completeness; test_time_budget_* sets one
            "none",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    from llmopt.assets import prepare_builtin

    src = prepare_builtin("minilm-l6")
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    out = tmp_path_factory.mktemp("e2e") / "minilm"
    rc, res = _optimize(out)
    assert rc == 0, res
    after = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    assert after == before, "the source model folder must never be written"
    return out, res


def _plan_ids(out: Path) -> list[str]:
    return [c["id"] for c in json.loads((out / "plan.json").read_text())["candidates"]]


def test_run_directory_is_complete_and_consistent(run):
    out, res = run
    for name in (
        "run.json",
        "model.json",
        "plan.json",
        "selection.json",
        "report.md",
        "report.html",
    ):
        assert (out / name).is_file(), name
    model = json.loads((out / "model.json").read_text())
    assert model["builtin"] == "minilm-l6" and model["task"] == "embedding"
    ids = _plan_ids(out)
    assert ids[0] == "hf-fp32"
    assert {"onnxruntime-fp32", "onnxruntime-w8a8-dynamic"} <= set(ids)
    for cid in ids:
        cdir = out / "candidates" / cid
        for stage in STAGES:
            assert (cdir / f"{stage}.json").is_file(), f"{cid}/{stage}"
        assert not (cdir / "error.json").exists(), (cdir / "error.json").read_text()
        assert any((cdir / "artifact").iterdir())
        verify = json.loads((cdir / "verify.json").read_text())
        names = {m["name"] for m in verify["metrics"]}
        assert {"cosine_mean", "cosine_min", "wordsim353_spearman"} <= names
        assert next(m for m in verify["metrics"] if m["name"] == "cosine_mean")["n"] >= 1000
        bench = json.loads((cdir / "bench.json").read_text())
        assert bench["metrics"]["sentences_per_s_b32"]["median"] > 0
        assert bench["metrics"]["sentences_per_s_b1"]["median"] > 0
        assert bench["peak_rss_bytes"] > 0
    sel = json.loads((out / "selection.json").read_text())
    chosen = sel["chosen"]
    assert chosen == res["selection"]["chosen"] and chosen in ids
    cv = json.loads((out / "candidates" / chosen / "verify.json").read_text())
    cos = next(m for m in cv["metrics"] if m["name"] == "cosine_mean")["candidate"]
    assert cv["passed"] and cos >= 1 - sel["max_quality_drop"]
    # The chosen one is the fastest of those that passed: relative to the reference measured
    # side by side where a finalist's rounds were comparable, else from its full bench.
    speed = {
        c: json.loads((out / "candidates" / c / "bench.json").read_text())["metrics"][
            "sentences_per_s_b32"
        ]["median"]
        for c in sel["ranking"]
    }
    side = sel["side_by_side"]
    score = {
        c: side[c]["ratio"] if c in side and side[c]["trusted"] else v / speed["hf-fp32"]
        for c, v in speed.items()
    }
    assert max(score, key=score.get) == chosen, (score, side)
    assert set(sel["reasons"]) == set(ids)
    assert (out / "best" / "artifact").is_dir() and (out / "best" / "launch.json").is_file()
    html = (out / "report.html").read_text()
    for cid in ids:
        assert cid in html
    assert "kept: kept" not in html and "chosen: chosen" not in html


def test_rerun_resumes_without_redoing_anything(run):
    out, _ = run
    before = {p: p.stat().st_mtime_ns for p in (out / "candidates").rglob("*.json")}
    rc, res = _optimize(out)
    assert rc == 0
    assert res["resumed"] is True and res["ran"] == []
    # Every build, verify and bench (and the side-by-side rounds, "@pair<N>") was reused.
    assert len([k for k in res["skipped"] if "@" not in k]) == 3 * len(_plan_ids(out))
    assert {p: p.stat().st_mtime_ns for p in (out / "candidates").rglob("*.json")} == before


def test_partial_and_killed_stages_are_redone(run, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(run[0], out)
    # 1) a finished stage's JSON is missing: only that stage runs again.
    (out / "candidates" / "hf-fp32" / "bench.json").unlink()
    # 2) a build killed mid-way: SIGKILL the worker while it exports the ONNX model.
    cdir = out / "candidates" / "onnxruntime-fp32"
    for stage in STAGES:
        (cdir / f"{stage}.json").unlink()
    shutil.rmtree(cdir / "artifact")
    worker = subprocess.Popen(
        [sys.executable, "-m", "llmopt.optimize.worker", str(out), cdir.name, "build"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not list(cdir.glob(".tmp-artifact.*")) and time.monotonic() < deadline:
        time.sleep(0.05)  # wait until the build is writing its artifact, then kill it mid-way
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    # Whatever moment the kill hit, the build is not taken as finished.
    assert not (cdir / "build.json").exists()
    rc, res = _optimize(out)
    assert rc == 0
    assert "hf-fp32/bench" in res["ran"]
    assert {"onnxruntime-fp32/build", "onnxruntime-fp32/verify", "onnxruntime-fp32/bench"} <= set(
        res["ran"]
    )
    assert not any(k.startswith("onnxruntime-w8a8-dynamic") for k in res["ran"])
    assert json.loads((cdir / "verify.json").read_text())["passed"]
    assert not list(cdir.glob(".tmp-*"))


def test_other_model_in_same_run_dir_is_refused(run):
    out, _ = run
    proc = subprocess.run(
        [*LLMOPT, "optimize", "smollm2-135m", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2
    assert "different" in proc.stderr and "--force" in proc.stderr


def test_halving_screens_every_candidate_and_records_fidelity(run, tmp_path):
    out = tmp_path / "halving"
    shutil.copytree(run[0], out)
    rc, res = _optimize(out, "--objective", "latency", search="halving")
    assert rc == 0, res
    ids = _plan_ids(out)
    # Full results were reused; only the screen (fidelity 1) ran, once per candidate, and the
    # side-by-side rounds of finalists the first run had not compared.
    assert all(k.endswith("@screen") or "@pair" in k for k in res["ran"]), res["ran"]
    for cid in ids:
        v = json.loads((out / "candidates" / cid / "verify.screen.json").read_text())
        b = json.loads((out / "candidates" / cid / "bench.screen.json").read_text())
        assert v["fidelity"]["level"] == "screen" and v["fidelity"]["rung"] == 1
        assert b["fidelity"]["bench_repeats"] == 2
        full = json.loads((out / "candidates" / cid / "verify.json").read_text())
        assert full["fidelity"]["level"] == "full"
    assert (out / "reference" / "embeddings.screen.npy").is_file()
    sel = json.loads((out / "selection.json").read_text())
    assert sel["objective"] == "latency" and sel["objective_unit"] == "ms/sentence"
    search = json.loads((out / "search.json").read_text())
    assert search["objective"] == "latency" and set(search["screen_scores"]) == set(ids[1:])
    # The latency objective chose the candidate with the best latency relative to the
    # reference: measured side by side where a finalist's rounds were comparable, else from
    # the full-fidelity values.
    vals = {i: sel["objective_values"][i] for i in sel["ranking"]}
    side = sel["side_by_side"]
    ref = vals["hf-fp32"]
    score = {
        i: side[i]["ratio"] if i in side and side[i]["trusted"] else ref / v
        for i, v in vals.items()
    }
    assert max(score, key=score.get) == sel["chosen"], (score, side)
    assert set(sel["pareto"]) <= set(ids) and sel["pareto"]
    html = (out / "report.html").read_text()
    assert "Search" in html and "Latency CDF" in html


def test_time_budget_cuts_with_reasons(run, tmp_path):
    out = tmp_path / "budget"
    shutil.copytree(run[0], out)
    rc, res = _optimize(out, "--time-budget", "1s", search="halving")
    assert rc == 0, res
    cut = res["search"]["cut"]
    assert set(cut) == set(_plan_ids(out)[1:]), cut
    assert all(r.startswith("time budget exhausted") for r in cut.values()), cut
    assert res["search"]["budget"]["seconds"] == 1.0


def test_reverify_rechecks_the_choice(run, tmp_path):
    out = tmp_path / "reverify"
    shutil.copytree(run[0], out)
    proc = subprocess.run(
        [*LLMOPT, "optimize", "--reverify", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    res = json.loads(proc.stdout)
    assert proc.returncode == (0 if res["holds"] else 1), proc.stderr
    assert res["chosen"] == json.loads((out / "selection.json").read_text())["chosen"]
    assert res["verdict"].startswith("the choice")
    for cid in {res["chosen"], res["reference"]}:
        v = json.loads((out / "candidates" / cid / "verify.reverify.json").read_text())
        assert v["fidelity"]["level"] == "reverify"
    assert json.loads((out / "reverify.json").read_text())["holds"] == res["holds"]
    assert "Reverify" in (out / "report.html").read_text()
