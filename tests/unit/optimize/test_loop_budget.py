"""The search loop's budget decisions, on a simulated clock.

The executor is the real `LocalExecutor` (task files, step timings, records); only the stage
child is replaced by one that writes the stage's result and advances a clock by the time the
stage is given, so the loop decides exactly as it would after those measurements.
"""

from __future__ import annotations

import time
import types
from pathlib import Path

import pytest

from llmopt.core.atomic import write_json
from llmopt.core.schema import BenchResult, Candidate, Metric, VerifyResult, summarize
from llmopt.optimize import executor as executor_mod
from llmopt.optimize.budget import Budget
from llmopt.optimize.loop import run_search
from llmopt.optimize.objective import get_objective
from llmopt.rundir.paths import RunDir


class Clock:
    def __init__(self, start: float):
        self.now = start

    def perf_counter(self) -> float:
        return self.now


class SimulatedBudget(Budget):
    clock: Clock | None = None

    @property
    def elapsed(self) -> float:
        return self.clock.now


def _simulate(tmp_path: Path, monkeypatch, cands, seconds, speed, budget_s, start_s):
    """Run the search with stage times `seconds[(cid, stage, fidelity)]` (default 1 s) and
    decode speeds `speed[cid]`; return (search state, run dir)."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir(parents=True)
    write_json(run.plan_json, {"candidates": [c.to_dict() for c in cands]})
    write_json(run.model_json, {"task": "causal-lm"})
    for c in cands:
        run.candidate(c.id).root.mkdir(parents=True)
        write_json(run.candidate(c.id).stage_file("candidate"), c.to_dict())
    clock = Clock(start_s)

    def spawn(run_, cid, stage, fid, deadline=None):
        clock.now += seconds.get((cid, stage, fid), 1.0)
        cdir = run_.candidate(cid)
        if stage == "build":
            out = {"seconds": 1.0}
        elif stage == "verify":
            m = Metric("perplexity", 10.0, 10.04, False, 10.1, True, 100)
            out = VerifyResult(cid, "causal-lm", [m], True, 0.004).to_dict()
        else:
            v = speed[cid]
            out = BenchResult(
                cid,
                "causal-lm",
                {"decode_tokens_per_s": summarize([v * 0.99, v, v * 1.01])},
                "decode_tokens_per_s",
                1,
                1,
                1,
                0.0,
                0.0,
            ).to_dict()
        write_json(cdir.stage_file(stage, fid), out)
        return True, ""

    monkeypatch.setattr(executor_mod, "_spawn", spawn)
    monkeypatch.setattr(
        executor_mod, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, time=time.time)
    )
    budget = SimulatedBudget(budget_s)
    budget.clock = clock
    st = run_search(
        run,
        cands,
        executor_mod.LocalExecutor(),
        budget,
        get_objective("throughput"),
        max_quality_drop=0.01,
    )
    return st, run


QUICK_START = [
    Candidate("hf-fp32", "hf", "fp32", reference=True),
    Candidate("llamacpp-gguf-q8_0", "llamacpp", "gguf-q8_0"),
    Candidate("torch-w8a16", "torch", "w8a16"),
    Candidate("hf-bf16", "hf", "bf16"),
]
# The stage times of a default-budget quick start on a busy 2-core machine: the reference's
# evaluation, a fast GGUF screen, and a slow second screen.
QUICK_TIMES = {
    ("hf-fp32", "build", "full"): 2,
    ("hf-fp32", "bench", "screen"): 10,
    ("hf-fp32", "verify", "full"): 34,
    ("hf-fp32", "bench", "full"): 46,
    ("llamacpp-gguf-q8_0", "build", "full"): 4,
    ("llamacpp-gguf-q8_0", "verify", "screen"): 11,
    ("llamacpp-gguf-q8_0", "bench", "screen"): 5,
    ("torch-w8a16", "build", "full"): 6,
    ("torch-w8a16", "verify", "screen"): 15,
    ("torch-w8a16", "bench", "screen"): 57,
}
QUICK_SPEED = {"hf-fp32": 22.0, "llamacpp-gguf-q8_0": 139.0, "torch-w8a16": 2.0, "hf-bf16": 20.0}


def test_the_floor_does_not_spend_the_time_that_confirms_a_winner(tmp_path, monkeypatch):
    st, run = _simulate(tmp_path, monkeypatch, QUICK_START, QUICK_TIMES, QUICK_SPEED, 300, 64)
    q8 = run.candidate("llamacpp-gguf-q8_0")
    # The GGUF beat the reference 6x at the screen: its full verification and bench ran ...
    assert q8.done("verify", "full") and q8.done("bench", "full"), st.cut
    # ... because the second floor screen, which would have eaten that time, was not started.
    assert not run.candidate("torch-w8a16").done("build")
    assert "time budget exhausted" in st.cut["torch-w8a16"]


def test_the_floor_still_screens_two_when_nothing_beats_the_reference(tmp_path, monkeypatch):
    slow = QUICK_SPEED | {"llamacpp-gguf-q8_0": 15.0}
    st, run = _simulate(tmp_path, monkeypatch, QUICK_START, QUICK_TIMES, slow, 300, 64)
    screened = [c.id for c in QUICK_START[1:] if run.candidate(c.id).done("bench", "screen")]
    assert len(screened) >= 2, st.cut


def test_a_served_engine_is_not_started_when_its_server_starts_do_not_fit(tmp_path, monkeypatch):
    cands = [
        Candidate("hf-fp32", "hf", "fp32", reference=True),
        Candidate("vllm-fp32", "vllm", "fp32"),
    ]
    speed = {"hf-fp32": 22.0, "vllm-fp32": 30.0}
    st, run = _simulate(tmp_path, monkeypatch, cands, {}, speed, 300, 10)
    # Its screen would be seconds for an in-process engine; two vLLM CPU starts are minutes.
    assert not run.candidate("vllm-fp32").done("build")
    assert "needs ~5" in st.cut["vllm-fp32"] or "needs ~6" in st.cut["vllm-fp32"], st.cut
    # With room for them it is screened.
    st2, run2 = _simulate(tmp_path / "b", monkeypatch, cands, {}, speed, 1500, 10)
    assert run2.candidate("vllm-fp32").done("bench", "screen"), st2.cut


@pytest.mark.parametrize("budget_s", [None])
def test_no_budget_runs_everything(tmp_path, monkeypatch, budget_s):
    st, run = _simulate(tmp_path, monkeypatch, QUICK_START, QUICK_TIMES, QUICK_SPEED, budget_s, 0)
    for c in QUICK_START[1:]:
        assert run.candidate(c.id).done("bench", "screen"), st.cut


def test_a_second_full_verification_leaves_time_to_compare_side_by_side(tmp_path, monkeypatch):
    """The quick start's default budget on a quiet machine: Q8_0 and Q6_K both screened well and
    Q8_0 passed at full fidelity. Verifying Q6_K fully too would leave too little for the
    side-by-side round, so the choice would rest on separate runs; it is cut instead."""
    cands = [
        Candidate("hf-fp32", "hf", "fp32", reference=True),
        Candidate("llamacpp-gguf-q8_0", "llamacpp", "gguf-q8_0"),
        Candidate("llamacpp-gguf-q6_k", "llamacpp", "gguf-q6_k"),
    ]
    times = {
        ("hf-fp32", "bench", "screen"): 9,
        ("hf-fp32", "verify", "full"): 23,
        ("hf-fp32", "bench", "full"): 32,
        ("llamacpp-gguf-q8_0", "verify", "screen"): 11,
        ("llamacpp-gguf-q8_0", "bench", "screen"): 6,
        ("llamacpp-gguf-q8_0", "verify", "full"): 27,
        ("llamacpp-gguf-q8_0", "bench", "full"): 20,
        ("llamacpp-gguf-q6_k", "verify", "screen"): 7,
        ("llamacpp-gguf-q6_k", "bench", "screen"): 6,
        ("llamacpp-gguf-q6_k", "verify", "full"): 26,
        ("llamacpp-gguf-q6_k", "bench", "full"): 19,
    }
    speed = {"hf-fp32": 29.0, "llamacpp-gguf-q8_0": 74.0, "llamacpp-gguf-q6_k": 71.0}
    st, run = _simulate(tmp_path, monkeypatch, cands, times, speed, 300, 75)
    assert run.candidate("llamacpp-gguf-q8_0").done("bench", "full"), st.cut
    assert run.candidate("llamacpp-gguf-q8_0").done("bench", "pair1"), st.events
    assert "side by side" in st.cut.get("llamacpp-gguf-q6_k", ""), st.cut


def test_the_side_by_side_round_may_use_half_the_reserve(tmp_path, monkeypatch):
    """The quick start again: Q6_K screened faster and was verified first (failing at full
    fidelity), then Q8_0 passed, leaving 36 s of 300 for a 24 s side-by-side round. Selection and
    the report need seconds, so the round runs inside half of the 20 s reserve."""
    cands = [
        Candidate("hf-fp32", "hf", "fp32", reference=True),
        Candidate("llamacpp-gguf-q8_0", "llamacpp", "gguf-q8_0"),
    ]
    times = {
        ("hf-fp32", "bench", "full"): 32,
        ("llamacpp-gguf-q8_0", "bench", "full"): 17,
        ("llamacpp-gguf-q8_0", "verify", "full"): 25,
    }
    speed = {"hf-fp32": 29.0, "llamacpp-gguf-q8_0": 74.0}
    # Started late enough that one round (~16 + ~9 s) fits only within half the reserve.
    st, run = _simulate(tmp_path, monkeypatch, cands, times, speed, 300, 184)
    assert run.candidate("llamacpp-gguf-q8_0").done("bench", "full"), st.cut
    assert run.candidate("llamacpp-gguf-q8_0").done("bench", "pair1"), st.events
