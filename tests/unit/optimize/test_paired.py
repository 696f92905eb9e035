"""Side-by-side rounds: ratios measured in one time window, rounds the machine disturbed left
out, and selection ranking the finalists on them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from llmopt.bench.timing import machine_probe
from llmopt.core.atomic import write_json
from llmopt.core.schema import BenchResult, Candidate, Metric, VerifyResult, summarize
from llmopt.optimize.objective import get_objective
from llmopt.optimize.paired import PROBE_TOLERANCE, paired_ratios, round_order
from llmopt.optimize.select import SelectionInput, select
from llmopt.rundir.paths import RunDir

THROUGHPUT = get_objective("throughput")


def _bench(cid: str, tok_s: float, probe_ms: float = 10.0) -> BenchResult:
    probe = {"probe_ms": probe_ms, "loadavg_1m": 0.1, "cpu_mhz": None}
    return BenchResult(
        cid,
        "causal-lm",
        {"decode_tokens_per_s": summarize([tok_s])},
        "decode_tokens_per_s",
        1,
        1,
        1,
        0.0,
        0.0,
        env={"probe": {"before": probe, "after": probe}},
    )


def _write_round(run: RunDir, r: int, values: dict[str, float], probes: dict[str, float]):
    for cid, v in values.items():
        write_json(
            run.candidate(cid).stage_file("bench", f"pair{r}"),
            _bench(cid, v, probes.get(cid, 10.0)).to_dict(),
        )


def test_rounds_are_mirrored():
    assert round_order(["ref", "a", "b"], 1) == ["ref", "a", "b"]
    assert round_order(["ref", "a", "b"], 2) == ["b", "a", "ref"]
    assert round_order(["ref", "a", "b"], 3) == ["ref", "a", "b"]


def test_ratios_are_paired_within_rounds(tmp_path):
    run = RunDir(tmp_path)
    # The machine halved its speed between the rounds: absolute numbers disagree by 2x, the
    # ratio measured inside each round does not.
    _write_round(run, 1, {"ref": 40.0, "a": 60.0}, {})
    _write_round(run, 2, {"ref": 20.0, "a": 30.0}, {"ref": 20.0, "a": 20.0})
    pr = paired_ratios(run, ["a"], "ref", THROUGHPUT)["a"]
    assert pr.trusted and pr.rounds == 2 and not pr.dropped
    assert abs(pr.ratio - 1.5) < 1e-9 and pr.lo == pr.hi == 1.5
    assert "1.50x" in pr.note and "2 rounds" in pr.note


def test_a_round_the_machine_disturbed_is_left_out(tmp_path):
    run = RunDir(tmp_path)
    _write_round(run, 1, {"ref": 40.0, "a": 60.0}, {})
    # Round 2: the candidate's probe ran 2x slower than the reference's: a neighbour appeared.
    _write_round(run, 2, {"ref": 40.0, "a": 25.0}, {"ref": 10.0, "a": 20.0})
    pr = paired_ratios(run, ["a"], "ref", THROUGHPUT)["a"]
    assert pr.dropped == [2] and pr.ratios == [1.5] and pr.trusted
    assert "left out" in pr.note
    # Every round disturbed: no ratio, and the note says the comparison cannot be trusted.
    run2 = RunDir(tmp_path / "two")
    _write_round(run2, 1, {"ref": 40.0, "a": 60.0}, {"ref": 10.0, "a": 30.0})
    pr2 = paired_ratios(run2, ["a"], "ref", THROUGHPUT)["a"]
    assert not pr2.trusted and pr2.ratio is None and "not comparable" in pr2.note


def test_the_probe_sees_a_busy_neighbour():
    """A real neighbour: busy processes on every core slow the fixed probe beyond the
    tolerance, so rounds measured beside them are recognized."""
    quiet = min(machine_probe()["probe_ms"] for _ in range(3))

    n = 2 * (os.cpu_count() or 2)
    busy = [
        subprocess.Popen(
            [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<20: pass"]
        )
        for _ in range(n)
    ]
    try:
        time.sleep(0.5)
        loaded = max(machine_probe()["probe_ms"] for _ in range(3))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert loaded > (1 + PROBE_TOLERANCE) * quiet, (quiet, loaded)


def _verify(cid: str, drop: float) -> VerifyResult:
    m = Metric("perplexity", 10.0, 10.0 * (1 + drop), False, 10.1, drop <= 0.01, 100)
    return VerifyResult(cid, "causal-lm", [m], m.passed, drop)


def test_selection_ranks_finalists_on_side_by_side_ratios(tmp_path):
    cands = [
        Candidate("ref", "hf", "fp32", reference=True),
        Candidate("a", "hf", "w8a16"),
        Candidate("b", "torch", "w8a16"),
    ]
    # Full fidelity, minutes apart: "a" was measured on a quiet machine and looks fastest.
    full = {"ref": _bench("ref", 40.0), "a": _bench("a", 80.0), "b": _bench("b", 50.0)}
    verify = {c.id: _verify(c.id, 0.001) for c in cands}
    run = RunDir(tmp_path)
    # Side by side, "b" is faster than "a" in both rounds.
    _write_round(run, 1, {"ref": 40.0, "a": 48.0, "b": 60.0}, {})
    _write_round(run, 2, {"ref": 38.0, "a": 46.0, "b": 58.0}, {})
    paired = paired_ratios(run, ["a", "b"], "ref", THROUGHPUT)
    sel = select(SelectionInput(cands, verify, full, 0.01, "throughput", paired=paired))
    assert sel.chosen == "b" and "side by side with the reference" in sel.reasons["b"]
    assert sel.ranking == ["b", "a", "ref"]
    assert set(sel.side_by_side) == {"a", "b"}
    # Without the rounds, the numbers taken minutes apart would have chosen "a".
    assert select(SelectionInput(cands, verify, full, 0.01, "throughput")).chosen == "a"


def test_settings_adopted_only_when_they_win_every_round(tmp_path):
    from llmopt.optimize.tune import decide

    base = Candidate("llamacpp-gguf-q8_0", "llamacpp", "gguf-q8_0", {"device": "cpu", "threads": 2})
    one = Candidate(base.id + "+threads1", "llamacpp", "gguf-q8_0", {"device": "cpu", "threads": 1})
    run = RunDir(tmp_path)

    def rounds(prefix_values):
        for r, vals in enumerate(prefix_values, 1):
            for cid, v in vals.items():
                write_json(
                    run.candidate(cid).stage_file("bench", f"tune{r}"), _bench(cid, v).to_dict()
                )
        return paired_ratios(run, [one.id], base.id, THROUGHPUT, prefix="tune")

    # One thread won both rounds by 20%+ (a busy machine): adopted, and said why.
    res = rounds([{base.id: 50.0, one.id: 65.0}, {base.id: 52.0, one.id: 63.0}])
    t = decide(base, [one], res)
    assert t.variant == one.id and t.settings["threads"] == 1
    assert t.note.startswith("settings: threads1 measured 1.2") and "2 rounds" in t.note
    # Won one round, lost the other: the defaults stay.
    res = rounds([{base.id: 50.0, one.id: 65.0}, {base.id: 60.0, one.id: 55.0}])
    t = decide(base, [one], res)
    assert t.variant is None and t.settings["threads"] == 2 and "defaults kept" in t.note


def test_a_chosen_one_whose_rounds_straddle_the_reference_claims_no_speed_up(tmp_path):
    cands = [Candidate("ref", "hf", "fp32", reference=True), Candidate("a", "hf", "bf16")]
    full = {"ref": _bench("ref", 40.0), "a": _bench("a", 48.0)}
    verify = {c.id: _verify(c.id, 0.001) for c in cands}
    run = RunDir(tmp_path)
    _write_round(run, 1, {"ref": 40.0, "a": 38.0}, {})
    _write_round(run, 2, {"ref": 40.0, "a": 44.0}, {})
    paired = paired_ratios(run, ["a"], "ref", THROUGHPUT)
    sel = select(SelectionInput(cands, verify, full, 0.01, "throughput", paired=paired))
    assert sel.chosen == "a"
    why = sel.reasons["a"]
    assert why.startswith("chosen: no measurable throughput difference from the reference")
    assert "x the reference;" not in why and "0.95-1.10x" in why
    # Rounds clear of 1.0: the ratio is stated.
    _write_round(run, 1, {"ref": 40.0, "a": 48.0}, {})
    paired = paired_ratios(run, ["a"], "ref", THROUGHPUT)
    why = select(SelectionInput(cands, verify, full, 0.01, "throughput", paired=paired)).reasons
    assert why["a"].startswith("chosen: best throughput") and "1.15x the reference" in why["a"]


def test_a_variation_links_the_base_artifact_once(tmp_path):
    from llmopt.optimize.tune import _variant

    base = Candidate("llamacpp-gguf-q8_0", "llamacpp", "gguf-q8_0", {"device": "cpu", "threads": 2})
    run = RunDir(tmp_path)
    art = run.candidate(base.id).artifact
    art.mkdir(parents=True)
    (art / "model.gguf").write_bytes(b"weights")
    v = _variant(run, base, {"threads": 1})
    assert v.id == base.id + "+threads1" and v.settings.threads == 1 and not v.reference
    linked = run.candidate(v.id).artifact / "model.gguf"
    assert os.path.samefile(linked, art / "model.gguf")  # no second copy on disk
    assert run.candidate(v.id).stage_file("candidate").exists()
    (art / "model.gguf").unlink()  # made once: a second call reuses the variation's folder
    assert _variant(run, base, {"threads": 1}) == v and linked.read_bytes() == b"weights"
