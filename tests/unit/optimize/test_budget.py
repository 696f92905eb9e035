"""The search budget: median estimates, a floor of screens that always run, cut messages that
name the budget which would allow the rest."""

from __future__ import annotations

import time

from llmopt.optimize.budget import (
    SCREEN_FLOOR,
    Budget,
    default_budget,
    format_duration,
    parse_duration,
    typical,
)


def test_a_contended_measurement_does_not_set_the_estimate():
    # Three screens, one timed while another process held both cores.
    assert typical([40.0, 42.0, 560.0], 100.0) == 42.0
    assert typical([], 100.0) == 100.0


def test_the_floor_screens_the_cheapest_even_when_the_estimate_says_no():
    # 15 minutes, 562 s gone, a contended reference estimates 1150 s per screen.
    b = Budget(900.0, started=time.monotonic() - 562)
    assert not b.fits(1150)
    assert b.floor_allows(0) and b.floor_allows(SCREEN_FLOOR - 1)
    assert not b.floor_allows(SCREEN_FLOOR)
    # ... but never past the reserve kept for selection and the report.
    assert not Budget(900.0, started=time.monotonic() - 890).floor_allows(0)
    assert not Budget(1.0).floor_allows(0)  # a budget smaller than the reserve screens nothing
    assert Budget(None).floor_allows(0)


def test_the_cut_message_names_a_budget_that_allows_the_rest():
    b = Budget(900.0, started=time.monotonic() - 562)
    msg = b.exhausted("the build and screen", 1150, 2300)
    assert msg.startswith("time budget exhausted: the build and screen needs ~1150 s")
    suggested = msg.split("--time-budget ")[1].split()[0]
    # The suggestion really is enough: elapsed + the rest + the reserve fit in it.
    fresh = Budget(parse_duration(suggested), started=time.monotonic() - 562)
    assert fresh.fits(2300)
    assert format_duration(59) == "1m" and format_duration(3601) == "1h1m"


def test_served_engines_carry_their_server_start_into_estimates():
    from llmopt.core.schema import Candidate
    from llmopt.engines.vllm import START_S_CPU, START_S_GPU
    from llmopt.optimize.loop import SCREEN_STARTS, start_s

    vllm = Candidate("vllm-fp32", "vllm", "fp32")
    gpu = Candidate("vllm-bf16", "vllm", "bf16", settings={"device": "cuda"})
    assert start_s(vllm) == START_S_CPU and start_s(gpu) == START_S_GPU
    assert start_s(Candidate("hf-fp32", "hf", "fp32")) == 0.0  # in-process: load is measured
    # Two starts per screen: a vLLM screen on a CPU never fits the small-model default budget.
    assert SCREEN_STARTS * start_s(vllm) > default_budget(135_000_000)[0]


def test_threads_resume_as_recorded_and_a_new_run_probes(tmp_path, monkeypatch):
    from llmopt.core.atomic import write_json
    from llmopt.optimize import job
    from llmopt.rundir.paths import RunDir

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    notes = []
    monkeypatch.setattr(job, "usable_cores", lambda: 2)
    monkeypatch.setattr(job, "choose_threads", lambda n: (1, f"threads: 1 of {n}: busy"))
    # New run: the probe decides, and says why when it takes fewer than all.
    assert job._threads_for(run, lambda *a: notes.append(a[-1])) == 1
    assert notes == ["threads: 1 of 2: busy"]
    # A resumed run keeps what it started with (part of its identity), whatever the probe says.
    write_json(run.run_json, {"settings": {"threads": 2}})
    assert job._threads_for(run, None) == 2
