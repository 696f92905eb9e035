"""Selection: the fastest candidate within the quality budget, with a reason for each."""

from __future__ import annotations

from llmopt.core.schema import BenchResult, Candidate, Metric, VerifyResult, summarize
from llmopt.optimize.select import SelectionInput, pareto_front, select


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


def test_a_compiled_candidate_says_when_compiling_pays_back():
    cands = [
        Candidate("ref", "hf", "fp32", reference=True),
        Candidate("torch-fp32", "torch", "fp32", {"device": "cpu"}),
        Candidate("torch-fp32-compile", "torch", "fp32", {"device": "cpu", "compile": True}),
    ]
    verify = {c.id: _verify(c.id, 0.0) for c in cands}

    def bench(cid, tok_s, warmup):
        b = _bench(cid, [tok_s])
        b.metrics["decode_ms_per_token"] = summarize([1000 / tok_s], "ms")
        b.warmup_seconds = warmup
        return b

    # 20 ms -> 10 ms per token for 60 s more warm-up: pays back after 6,000 tokens.
    benches = {
        "ref": bench("ref", 20.0, 1.0),
        "torch-fp32": bench("torch-fp32", 50.0, 2.0),
        "torch-fp32-compile": bench("torch-fp32-compile", 100.0, 62.0),
    }
    sel = select(SelectionInput(cands, verify, benches, 0.01, "throughput"))
    assert sel.chosen == "torch-fp32-compile"
    assert "compiling pays back after ~6,000 generated tokens" in sel.reasons[sel.chosen]
    assert "pays back" not in sel.reasons["torch-fp32"]


def test_a_wide_spread_is_called_noisy_not_a_close_race():
    cands = [Candidate("ref", "torch", "fp32", reference=True), Candidate("fast", "torch", "y")]
    verify = {"ref": _verify("ref", 0.0), "fast": _verify("fast", 0.004)}
    # The reference's repeats: 2, 11, 20 tokens/s (a busy machine), the chosen one's steady.
    bench = {"ref": _bench("ref", [2, 11, 20]), "fast": _bench("fast", [50, 51, 52])}
    why = select(SelectionInput(cands, verify, bench, 0.01)).reasons["ref"]
    assert "too noisy to rank" in why and "within run-to-run noise" not in why
