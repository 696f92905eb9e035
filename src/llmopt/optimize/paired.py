"""Side-by-side benchmarks of the finalists: ratios measured in one time window, and whether the
machine stayed alike while they were measured.

Two benchmark numbers taken minutes apart on a shared machine are not a comparison: a neighbour's
busy loop in between can halve one of them. So after full fidelity the search benchmarks the
reference and the best candidates again in rounds, one right after the other (A B C, then C B A:
mirrored, so a steady drift in the machine's speed cancels out of the pair), and selection ranks
the finalists on the ratio each one measured against the reference *in the same round*.

Every bench records a fixed probe (`llmopt.bench.timing.machine_probe`: a few milliseconds of
single-thread matmuls, with the load average) before and after its timed block. A round whose
probes differ by more than `PROBE_TOLERANCE` was measured on a machine that changed under it; its
ratios are left out, and when no round is left the comparison is reported as not trustworthy
instead of as a speed-up.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from llmopt.core.schema import BenchResult
from llmopt.optimize.objective import Objective
from llmopt.rundir.paths import RunDir

__all__ = [
    "PairedRatio",
    "paired_ratios",
    "round_order",
    "probe_ms",
    "pair_estimate",
    "PAIR_ROUNDS",
    "MAX_ROUNDS",
    "PROBE_TOLERANCE",
]

PAIR_ROUNDS = 2  # mirrored rounds measured by default
MAX_ROUNDS = 4  # with re-measurement of rounds the machine disturbed (paths.FIDELITIES)
# The slowest probe of a round over its fastest: beyond 1 + this, the round is not comparable.
# An idle 2-core machine's probe varies by a few percent; a second busy process on its cores
# makes it 1.5-2x slower.
PROBE_TOLERANCE = 0.25


def round_order(ids: list[str], r: int) -> list[str]:
    """The order of round `r` (1-based): as given on odd rounds, reversed on even ones.

    >>> round_order(["ref", "a", "b"], 1), round_order(["ref", "a", "b"], 2)
    (['ref', 'a', 'b'], ['b', 'a', 'ref'])
    """
    return list(ids) if r % 2 else list(reversed(ids))


def pair_estimate(run: RunDir, cid: str) -> float:
    """Seconds one side-by-side bench of `cid` takes: half its full bench (a round times half
    the decode steps once, where the full bench repeats them), else 1.5 x its screen bench
    (one repeat, but of every batch size), else 30 s."""

    def step(rung: str, key: str) -> float | None:
        f = run.candidate(cid).task_file(rung)
        if not f.exists():
            return None
        return (json.loads(f.read_text()).get("step_seconds") or {}).get(key)

    full = step("full", f"{cid}/bench")
    if full:
        return 0.5 * full
    screen = step("screen", f"{cid}/bench@screen")
    return 1.5 * screen if screen else 30.0


def probe_ms(bench: BenchResult) -> list[float]:
    """The probe times a bench recorded (before and after its timed block; [] for older runs)."""
    p = bench.env.get("probe") or {}
    return [float(x["probe_ms"]) for x in (p.get("before"), p.get("after")) if x]


@dataclass
class PairedRatio:
    """A finalist's objective relative to the reference, measured side by side.

    Attributes:
        ratios: the ratio in each comparable round (higher is better, as `Objective.score`).
        ratio: their geometric mean (None when no round was comparable).
        lo, hi: the smallest and largest round ratio (the spread).
        rounds: rounds measured; `dropped`: rounds left out because the machine changed.
        trusted: whether at least one round was comparable.
        note: one line for the selection and the report.
    """

    cid: str
    ratios: list[float] = field(default_factory=list)
    ratio: float | None = None
    lo: float | None = None
    hi: float | None = None
    rounds: int = 0
    dropped: list[int] = field(default_factory=list)
    trusted: bool = False
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _round_ok(benches: list[BenchResult]) -> tuple[bool, float]:
    """Whether one round's benches were measured on a machine alike throughout, and the ratio of
    its slowest probe to its fastest (1.0 when nothing was probed)."""
    probes = [p for b in benches for p in probe_ms(b)]
    if len(probes) < 2:
        return True, 1.0
    spread = max(probes) / max(min(probes), 1e-9)
    return spread <= 1 + PROBE_TOLERANCE, spread


def paired_ratios(
    run: RunDir,
    ids: list[str],
    ref_id: str,
    obj: Objective,
    ctx: dict[str, Any] | None = None,
    prefix: str = "pair",
) -> dict[str, PairedRatio]:
    """The side-by-side ratios of `ids` against `ref_id` from the rounds the run directory holds
    (`bench.<prefix><N>.json`: "pair" for the finalists against the reference, "tune" for the
    chosen one's settings against its defaults); {} when no round was measured."""
    rounds: list[tuple[int, dict[str, BenchResult]]] = []
    for r in range(1, MAX_ROUNDS + 1):
        got = {
            i: BenchResult.from_dict(d)
            for i in [ref_id, *ids]
            if (d := run.candidate(i).read("bench", f"{prefix}{r}")) is not None
        }
        if ref_id in got and len(got) > 1:
            rounds.append((r, got))
    if not rounds:
        return {}
    out: dict[str, PairedRatio] = {}
    for cid in ids:
        pr = PairedRatio(cid)
        spreads = []
        for r, got in rounds:
            if cid not in got:
                continue
            pr.rounds += 1
            ok, spread = _round_ok([got[ref_id], got[cid]])
            spreads.append(spread)
            s = obj.score(obj.value(got[cid], ctx), obj.value(got[ref_id], ctx))
            if not ok or s is None:
                pr.dropped.append(r)
                continue
            pr.ratios.append(s)
        if pr.ratios:
            pr.ratio = math.exp(sum(math.log(x) for x in pr.ratios) / len(pr.ratios))
            pr.lo, pr.hi = min(pr.ratios), max(pr.ratios)
            pr.trusted = True
            pr.note = (
                f"side by side with {'the reference' if prefix == 'pair' else ref_id}: "
                f"{pr.ratio:.2f}x "
                f"({len(pr.ratios)} round{'s' if len(pr.ratios) > 1 else ''}, "
                f"{pr.lo:.2f}-{pr.hi:.2f}x)"
            )
            if pr.dropped:
                pr.note += f"; {len(pr.dropped)} round(s) left out: the machine's load changed"
        elif pr.rounds:
            pr.note = (
                f"side by side with {'the reference' if prefix == 'pair' else ref_id}: "
                "not comparable, the machine's load changed "
                f"during every round (probe up to {max(spreads):.2f}x slower within a round)"
            )
        out[cid] = pr
    return out
