"""Successive halving over two fidelities: a cheap screen for every candidate, then full
verification and benchmarking for the survivors. Pure functions over measured numbers, so the
rules are tested without running a model.

Screen rules, in order (a cut candidate gets the sentence that says which one):
  1. quality: the screen's quality drop is above the budget by more than `QUALITY_MARGIN` (the
     screen sees fewer tokens, so a borderline candidate is re-checked at full fidelity instead);
  2. no better than the reference: its objective score (relative to the reference at the same
     fidelity) is below `1 - NOISE` and it is not more accurate either (the reference dominates);
  3. halving: of the rest, the best ceil(n / ETA) by score survive, and at least `MIN_KEEP`
     (at two or three candidates, halving would otherwise decide on one noisy screen number).
The reference always goes on. In the full rung, a candidate whose screen score, even
`1 + NOISE` times better, cannot beat the best fully verified score so far is stopped early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ScreenEntry", "screen", "cannot_improve", "ETA", "MIN_KEEP", "QUALITY_MARGIN", "NOISE"]

ETA = 2  # keep 1/ETA of the candidates that pass the screen's quality rule
MIN_KEEP = 2  # ... but never fewer than this many (when there are that many)
QUALITY_MARGIN = 1.5  # screen quality drop allowed up to 1.5x the budget before a cut
NOISE = 0.10  # relative speed differences below this are not trusted at screen fidelity


@dataclass
class ScreenEntry:
    """One candidate's screen result: quality drop, gate verdict and objective score."""

    id: str
    quality_drop: float
    passed: bool
    score: float | None  # objective relative to the reference at screen fidelity, higher better
    reference: bool = False
    quality_name: str = "quality drop"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def screen(
    entries: list[ScreenEntry], budget: float, objective: str, eta: int = ETA
) -> tuple[list[str], dict[str, str]]:
    """Who goes on to full fidelity, best first, and why each other one was cut.

    Args:
        entries: screen results (the reference among them).
        budget: the quality budget (max quality drop, a fraction).
        objective: its name, for the reasons.
        eta: halving factor.

    >>> e = [ScreenEntry("ref", 0, True, 1.0, True), ScreenEntry("a", 0.07, False, 3.0),
    ...      ScreenEntry("b", 0.001, True, 1.5), ScreenEntry("c", 0.002, True, 1.2),
    ...      ScreenEntry("d", 0.002, True, 1.1), ScreenEntry("e", 0.0, True, 1.3)]
    >>> survivors, cut = screen(e, 0.01, "throughput")
    >>> survivors, sorted(cut)
    (['ref', 'b', 'e'], ['a', 'c', 'd'])
    """
    cut: dict[str, str] = {}
    ranked: list[ScreenEntry] = []
    ref = next((e for e in entries if e.reference), None)
    for e in entries:
        if e.reference:
            continue
        if not math.isfinite(e.quality_drop) or e.quality_drop > budget * QUALITY_MARGIN:
            cut[e.id] = (
                f"screened out at fidelity 1 (screen): {e.quality_name} {_pct(e.quality_drop)} "
                f"> budget {budget * 100:.1f}%"
            )
        elif e.score is None:
            cut[e.id] = f"screened out at fidelity 1 (screen): no {objective} measurement"
        elif e.score < 1 - NOISE and (ref is None or e.quality_drop >= ref.quality_drop):
            cut[e.id] = (
                f"screened out at fidelity 1 (screen): {objective} {e.score:.2f}x the reference "
                "and no more accurate (the reference dominates it)"
            )
        else:
            ranked.append(e)
    # Best score first; the smaller quality drop breaks ties.
    ranked.sort(key=lambda e: (-(e.score or 0.0), e.quality_drop))
    keep = min(len(ranked), max(MIN_KEEP, math.ceil(len(ranked) / eta)))
    for i, e in enumerate(ranked[keep:], start=keep + 1):
        cut[e.id] = (
            f"screened out at fidelity 1 (screen): {objective} {e.score:.2f}x the reference "
            f"ranks {i}/{len(ranked)}; successive halving keeps the best {keep}"
        )
    survivors = ([ref.id] if ref else []) + [e.id for e in ranked[:keep]]
    return survivors, cut


def cannot_improve(screen_score: float | None, best_full_score: float | None) -> bool:
    """True when a candidate's screen score, even `1 + NOISE` better, cannot beat the best so far.

    >>> cannot_improve(1.1, 1.5), cannot_improve(1.4, 1.5), cannot_improve(None, 1.5)
    (True, False, False)
    """
    if screen_score is None or best_full_score is None:
        return False
    return screen_score * (1 + NOISE) < best_full_score
