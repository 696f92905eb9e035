"""Rung 4's compiled-decode variation: tried when the budget affords its compiles (estimated from
what the run measured, else a prior), said so when not, decided side by side, its payback said."""

from __future__ import annotations

import pytest

from llmopt.core.atomic import write_json
from llmopt.core.schema import BenchResult, Candidate, summarize
from llmopt.model.info import inspect_model
from llmopt.optimize.budget import Budget
from llmopt.optimize.objective import get_objective
from llmopt.optimize.paired import paired_ratios
from llmopt.optimize.profiles import StageSettings
from llmopt.optimize.tune import (
    COMPILE_PRIOR_S,
    compile_cost,
    compile_payback,
    decide,
    tune,
    variations,
)
from llmopt.rundir.paths import RunDir

THROUGHPUT = get_objective("throughput")
BASE = Candidate("torch-fp32", "torch", "fp32", {"device": "cpu", "threads": 1})


def _run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    settings = StageSettings.for_run("full", 0.01, "default", 1).run_json("full")
    write_json(run.run_json, {"settings": settings})
    write_json(run.candidate(BASE.id).stage_file("candidate"), BASE.to_dict())
    return run


def _bench(cid: str, tok_s: float, warmup: float) -> BenchResult:
    probe = {"probe_ms": 10.0, "loadavg_1m": 0.1, "cpu_mhz": None}
    return BenchResult(
        cid,
        "causal-lm",
        {
            "decode_tokens_per_s": summarize([tok_s]),
            "decode_ms_per_token": summarize([1000 / tok_s], "ms"),
        },
        "decode_tokens_per_s",
        1,
        1,
        1,
        0.0,
        warmup,
        env={"probe": {"before": probe, "after": probe}},
    )


def test_the_native_engine_offers_compile_on_the_cpu_only(tiny_llama_dir):
    info = inspect_model(tiny_llama_dir)
    assert variations(BASE, info) == [{"compile": True}]
    two = Candidate("torch-fp32", "torch", "fp32", {"device": "cpu", "threads": 2})
    assert variations(two, info) == [{"threads": 1}, {"compile": True}]
    # Already compiled: no variation of it; on CUDA the default compiles already.
    done = Candidate("torch-fp32-compile", "torch", "fp32", {"device": "cpu", "compile": True})
    assert {"compile": True} not in variations(done, info)
    gpu = Candidate("torch-bf16", "torch", "bf16", {"device": "cuda"})
    assert variations(gpu, info) == []


def test_compile_cost_from_the_run_else_the_prior(tmp_path):
    run = _run(tmp_path)
    cost, basis = compile_cost(run, BASE)
    # The full profile's side-by-side bench decodes at batch 1 and 4: two compiled shapes.
    assert cost == 2 * COMPILE_PRIOR_S and "per decode shape x 2" in basis
    # A compiled twin benchmarked in this run: its extra warm-up is the estimate.
    comp = Candidate(
        "torch-fp32-compile", "torch", "fp32", {**BASE.settings.to_dict(), "compile": True}
    )
    write_json(run.candidate(comp.id).stage_file("candidate"), comp.to_dict())
    write_json(
        run.candidate(comp.id).stage_file("bench", "screen"), _bench(comp.id, 90, 47.0).to_dict()
    )
    write_json(
        run.candidate(BASE.id).stage_file("bench", "screen"), _bench(BASE.id, 50, 2.0).to_dict()
    )
    cost, basis = compile_cost(run, BASE)
    assert cost == pytest.approx(45.0) and "in this run" in basis


def test_a_compile_the_budget_cannot_afford_is_not_tried_and_said_so(tmp_path, tiny_llama_dir):
    run = _run(tmp_path)
    events: list[str] = []
    # 60 s budget, 20 s of it reserved: two rounds of a bench (~30 s) plus a compile (~120 s).
    res = tune(run, BASE, inspect_model(tiny_llama_dir), Budget(60.0), THROUGHPUT, events=events)
    assert res is not None and res.variant is None and res.tried == {}
    assert res.settings == BASE.settings.to_dict()
    (why,) = res.not_tried
    assert why.startswith("compile not tried: needs ~300 s, 0 s left")
    assert "120 s each" in why and why in res.note and events == [f"settings: {why}"]
    assert not run.candidate(BASE.id + "+compile").root.exists()  # nothing was built or run


def _rounds(run: RunDir, vid: str, rounds: list[tuple[float, float, float, float]]):
    for r, (base_tok, base_warm, comp_tok, comp_warm) in enumerate(rounds, 1):
        f = f"tune{r}"
        write_json(
            run.candidate(BASE.id).stage_file("bench", f),
            _bench(BASE.id, base_tok, base_warm).to_dict(),
        )
        write_json(
            run.candidate(vid).stage_file("bench", f), _bench(vid, comp_tok, comp_warm).to_dict()
        )


def test_compiled_adopted_only_when_it_wins_every_round_and_its_payback_is_said(tmp_path):
    run = _run(tmp_path)
    comp = Candidate(
        BASE.id + "+compile", "torch", "fp32", {**BASE.settings.to_dict(), "compile": True}
    )
    # 20 ms -> 10 ms per token for 60 s more warm-up: pays back after 6,000 tokens.
    _rounds(run, comp.id, [(50.0, 2.0, 100.0, 62.0), (50.0, 2.0, 100.0, 62.0)])
    res = paired_ratios(run, [comp.id], BASE.id, THROUGHPUT, prefix="tune")
    t = decide(BASE, [comp], res)
    assert t.variant == comp.id and t.settings["compile"] is True
    pay = compile_payback(run, BASE.id, comp.id)
    assert pay.startswith("compiling pays back after ~6,000 generated tokens (60 s more warm-up")
    assert "10.00 ms saved per token at batch 1; 2 rounds side by side" in pay
    # Faster in one round only: eager stays, and the payback says it was no faster overall.
    _rounds(run, comp.id, [(50.0, 2.0, 100.0, 62.0), (50.0, 2.0, 20.0, 62.0)])
    res = paired_ratios(run, [comp.id], BASE.id, THROUGHPUT, prefix="tune")
    assert decide(BASE, [comp], res).variant is None
    assert "never pays back" in compile_payback(run, BASE.id, comp.id)
    # A round the machine disturbed counts for the payback no more than for the ratio.
    assert "6,000 generated tokens" in compile_payback(run, BASE.id, comp.id, dropped=[2])
    assert compile_payback(run, BASE.id, comp.id, dropped=[1, 2]) == ""


@pytest.mark.slow
def test_a_real_run_measures_the_compiled_decode_side_by_side(tiny_llama_dir, tmp_path):
    from llmopt.optimize.job import optimize
    from llmopt.report.facts_search import search_facts
    from llmopt.report.view import load_run

    out = tmp_path / "run"
    res = optimize(
        tiny_llama_dir,
        out,
        candidates=["torch-fp32"],
        threads=1,  # one thread: the compile is the only variation
        profile="quick",
        search="exhaustive",
        gates="loose",
        time_budget="20m",
        deploy=False,
    )
    run = RunDir(out)
    base = Candidate.from_dict(run.candidate("torch-fp32").read("candidate"))
    if res.selection.chosen == "torch-fp32":
        t = res.selection.tuned
    else:  # the reference won this machine's rounds: tune the native candidate all the same
        t = tune(run, base, inspect_model(tiny_llama_dir), Budget(1200.0), THROUGHPUT).to_dict()
    vid = "torch-fp32+compile"
    assert vid in t["tried"] and t["tried"][vid]["rounds"] == 2, t
    compiled = BenchResult.from_dict(run.candidate(vid).read("bench", "tune1"))
    eager = BenchResult.from_dict(run.candidate("torch-fp32").read("bench", "tune1"))
    assert compiled.warmup_seconds > eager.warmup_seconds  # the compile happened in its warm-up
    assert not t["not_tried"]
    if not t["tried"][vid]["trusted"]:  # a busy machine disturbed every round: no figure
        assert t["payback"] == "" and "compile not comparable" in t["note"], t
        return
    assert "pays back" in t["payback"], t
    if res.selection.chosen == "torch-fp32":  # the report says it too
        facts = dict(search_facts(load_run(out)))
        assert "pays back" in facts["compiled decode"]
