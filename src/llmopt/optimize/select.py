"""Selection: the best candidate for the objective among those whose verified quality loss is
within the budget, from full-fidelity results only.

Every candidate gets a one-line reason (chosen / kept / dropped / failed / cut by the search), so
the report can say why each one did not win. Differences smaller than the measured run-to-run
spread are called out as noise rather than treated as a real ranking. Two Pareto fronts are kept:
quality vs speed (the primary bench metric), and quality vs speed vs peak memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmopt.core.schema import BenchResult, Candidate, Selection, VerifyResult
from llmopt.optimize.objective import get_objective
from llmopt.optimize.paired import PairedRatio, paired_ratios
from llmopt.rundir.paths import RunDir

__all__ = [
    "select",
    "SelectionInput",
    "StageResults",
    "read_results",
    "pareto_front",
    "pareto_front_nd",
]


@dataclass
class StageResults:
    """Verify and bench results of one fidelity by candidate id, and the failures
    (candidate id -> "stage (fidelity): message")."""

    verify: dict[str, VerifyResult] = field(default_factory=dict)
    bench: dict[str, BenchResult] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def read_results(run: RunDir, cands: list[Candidate], fidelity: str = "full") -> StageResults:
    """The results of `cands` at `fidelity` in the run directory. A failure counts at its own
    fidelity; the full selection also counts failures at the screen (a candidate that failed
    there never reached full fidelity)."""
    allowed = (fidelity,) if fidelity == "reverify" else ("full", "screen")
    out = StageResults()
    for c in cands:
        cdir = run.candidate(c.id)
        e = cdir.read("error")
        if e is not None and e.get("fidelity", "full") in allowed:
            fid = e.get("fidelity", "full")
            out.errors[c.id] = (
                f"{e['stage']}" + ("" if fid == "full" else f" ({fid})") + f": {e['error']}"
            )
        if (v := cdir.read("verify", fidelity)) is not None:
            out.verify[c.id] = VerifyResult.from_dict(v)
        if (b := cdir.read("bench", fidelity)) is not None:
            out.bench[c.id] = BenchResult.from_dict(b)
    return out


@dataclass
class SelectionInput:
    """Everything selection decides from.

    Attributes:
        candidates: all planned candidates.
        verify, bench: full-fidelity results by candidate id (missing ids are incomplete).
        max_quality_drop: the budget the gates were set from (recorded in the selection).
        objective: latency | throughput | memory | cost (llmopt.optimize.objective).
        errors: candidate id -> "stage: message" for candidates whose stage failed.
        context: objective context (price_per_hour for cost).
        cut: candidate id -> why the search stopped it before full fidelity.
        screen_bench: screen-fidelity bench results by id; they never rank anything, but when the
            chosen candidate's eager `hf` twin was cut at the screen, the reason compares the
            two there (both measured alike, in this run).
        paired: the finalists' ratios to the reference measured side by side
            (`llmopt.optimize.paired`); a trusted one ranks its candidate instead of the ratio
            of two full-fidelity numbers taken minutes apart.
    """

    candidates: list[Candidate]
    verify: dict[str, VerifyResult]
    bench: dict[str, BenchResult]
    max_quality_drop: float
    objective: str = "throughput"
    errors: dict[str, str] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    cut: dict[str, str] = field(default_factory=dict)
    screen_bench: dict[str, BenchResult] = field(default_factory=dict)
    paired: dict[str, PairedRatio] = field(default_factory=dict)

    @classmethod
    def from_run(
        cls,
        run: RunDir,
        cands: list[Candidate],
        max_quality_drop: float,
        objective: str,
        context: dict[str, Any] | None = None,
        cut: dict[str, str] | None = None,
    ) -> SelectionInput:
        """The full-fidelity results (and screen benchmarks) the run directory holds."""
        full = read_results(run, cands)
        screen = read_results(run, cands, "screen").bench
        ref = next((c.id for c in cands if c.reference), None)
        finalists = [
            c.id for c in cands if not c.reference and run.candidate(c.id).done("bench", "pair1")
        ]
        paired = (
            paired_ratios(run, finalists, ref, get_objective(objective), context)
            if ref and finalists
            else {}
        )
        return cls(
            cands,
            full.verify,
            full.bench,
            max_quality_drop,
            objective,
            full.errors,
            dict(context or {}),
            dict(cut or {}),
            screen,
            paired,
        )


def pareto_front_nd(points: dict[str, tuple[float, ...]]) -> list[str]:
    """Ids not dominated when every coordinate is to be minimized (ids in input order).

    >>> pareto_front_nd({"a": (1, 1), "b": (0, 2), "c": (2, 2)})
    ['a', 'b']
    """

    def dominates(p: tuple[float, ...], q: tuple[float, ...]) -> bool:
        return all(x <= y for x, y in zip(p, q, strict=True)) and p != q

    return [
        i
        for i, p in points.items()
        if not any(dominates(q, p) for j, q in points.items() if j != i)
    ]


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Ids not dominated on (speed: higher is better, quality_drop: lower is better).

    >>> pareto_front({"a": (10, 0.0), "b": (20, 0.01), "c": (15, 0.02)})
    ['a', 'b']
    """
    front = pareto_front_nd({i: (-s, q) for i, (s, q) in points.items()})
    return sorted(front, key=lambda i: points[i][0])


def _fmt(v: float, unit: str) -> str:
    if unit == "bytes":
        return f"{v / 2**20:.0f} MiB"
    return f"{v:.4g} {unit}".strip()


def select(inp: SelectionInput) -> Selection:
    """Choose the best candidate for `inp.objective` among those that pass verification.

    Example:
        >>> sel = select(SelectionInput(cands, verify, bench, 0.01, "latency"))  # doctest: +SKIP
        >>> sel.chosen, sel.reasons[sel.chosen]                                 # doctest: +SKIP
    """

    candidates, verify, bench, errors = inp.candidates, inp.verify, inp.bench, inp.errors
    context, cut = inp.context, inp.cut
    obj = get_objective(inp.objective)
    reasons: dict[str, str] = {}
    eligible: list[str] = []
    values: dict[str, float] = {}
    for c in candidates:
        v, b = verify.get(c.id), bench.get(c.id)
        if b is not None and (val := obj.value(b, context)) is not None:
            values[c.id] = val
        if c.id in errors:
            reasons[c.id] = f"failed at {errors[c.id]}"
        elif c.id in cut and (v is None or b is None):
            reasons[c.id] = f"cut: {cut[c.id]}"
        elif v is None or b is None:
            reasons[c.id] = "incomplete: " + ("not verified" if v is None else "not benchmarked")
        elif not v.passed:
            failed = [m for m in v.metrics if m.passed is False]
            why = "; ".join(
                f"{m.name} {m.candidate:.4g} vs limit {m.threshold:.4g}" for m in failed
            )
            reasons[c.id] = f"dropped: quality gate failed ({why or 'integrity check'})"
        elif c.id not in values:
            reasons[c.id] = f"incomplete: bench has no {obj.name} numbers"
        else:
            eligible.append(c.id)

    ref = next((c.id for c in candidates if c.reference), None)
    score = _scores(eligible, values, ref, obj, inp.paired)
    # Best first (side-by-side ratios where measured); equal goes to the smaller quality drop.
    ranking = sorted(eligible, key=lambda i: (-score[i], verify[i].quality_drop))
    chosen = ranking[0] if ranking else None
    task = next(iter(bench.values())).task if bench else ""
    unit = obj.unit_for(task)
    if chosen:
        vs = score[chosen] if ref in values else None
        vs_ref = f", {vs:.2f}x the reference" if vs and chosen != ref else ""
        pr = inp.paired.get(chosen)
        best = f"best {obj.name}"
        if pr and pr.trusted and pr.lo is not None and pr.hi is not None and pr.lo <= 1 <= pr.hi:
            # Its rounds straddle the reference: no speed-up is claimed, and why it still won
            # (a higher median, or less memory) is said by the report from the same numbers.
            best = f"no measurable {obj.name} difference from the reference, highest median"
            vs_ref = ""
        reasons[chosen] = (
            f"chosen: {best} within the quality budget ({_fmt(values[chosen], unit)}"
            f"{vs_ref}; quality drop {verify[chosen].quality_drop:+.2%})"
            + (f"; {pr.note}" if pr and pr.note else "")
            + _vs_eager(chosen, candidates, bench, inp.screen_bench)
            + _compile_payback(chosen, candidates, bench)
        )
        untrusted = [i for i, p in inp.paired.items() if i != chosen and not p.trusted]
        if untrusted and (pr is None or not pr.trusted):
            reasons[chosen] += (
                f"; not confirmed side by side against {', '.join(untrusted)}: the machine's "
                "load changed during every round, so this ranking rests on numbers measured "
                "minutes apart"
            )
        best_noise = _noise(bench[chosen], obj.name)
        for i in ranking[1:]:
            ratio = score[i] / score[chosen] if score[chosen] else 0.0
            noise = max(_noise(bench[i], obj.name), best_noise)
            a, b = inp.paired.get(i), inp.paired.get(chosen) if chosen != ref else None
            if a and a.trusted and (chosen == ref or (b and b.trusted)):
                # Side by side: within noise when the round ratios overlap.
                best_lo = b.lo if b and b.lo is not None else 1.0
                within = (a.hi or 0.0) >= best_lo
            else:
                within = 1 - ratio <= noise
            tag = " (within run-to-run noise of the chosen one)" if within else ""
            if within and not (a and a.trusted) and noise >= NOISY:
                # A spread this wide is a busy machine, not a close race: say which.
                tag = f" (repeats spread {noise:.0%}: too noisy to rank against the chosen one)"
            side = f"; {a.note}" if a and a.note else ""
            reasons[i] = (
                f"kept: passes the gates, {obj.name} {ratio:.2f}x the chosen "
                f"({_fmt(values[i], unit)}){tag}{side}" + _compile_payback(i, candidates, bench)
            )
    full = [i for i in verify if i in bench]
    speed = {i: bench[i].primary_value for i in full}
    return Selection(
        objective=obj.name,
        chosen=chosen,
        max_quality_drop=inp.max_quality_drop,
        reasons=reasons,
        ranking=ranking,
        pareto=pareto_front({i: (speed[i], verify[i].quality_drop) for i in full}),
        pareto_memory=pareto_front_nd(
            {i: (-speed[i], verify[i].quality_drop, bench[i].peak_rss_bytes) for i in full}
        ),
        objective_unit=unit,
        objective_values={i: values[i] for i in full if i in values},
        higher_is_better=obj.higher_is_better,
        cut={i: r for i, r in cut.items()},
        side_by_side={i: p.to_dict() for i, p in inp.paired.items()},
    )


def _scores(
    eligible: list[str],
    values: dict[str, float],
    ref: str | None,
    obj,
    paired: dict[str, PairedRatio],
) -> dict[str, float]:
    """Each eligible candidate's objective relative to the reference, higher is better: the
    side-by-side ratio where one was measured and trusted, else the ratio of the full-fidelity
    values (the reference itself: 1). Without the reference's value, the values themselves."""
    if ref is None or ref not in values:
        sign = 1 if obj.higher_is_better else -1
        return {i: sign * values[i] for i in eligible}
    out = {}
    for i in eligible:
        p = paired.get(i)
        if i == ref:
            out[i] = 1.0
        elif p is not None and p.trusted and p.ratio is not None:
            out[i] = p.ratio
        else:
            out[i] = obj.score(values[i], values[ref]) or 0.0
    return out


def _vs_eager(
    chosen: str,
    candidates: list[Candidate],
    bench: dict[str, BenchResult],
    screen: dict[str, BenchResult],
) -> str:
    """The chosen candidate's batch-1 decode against the same recipe run eagerly by transformers
    (the `hf` engine), when both were benchmarked in this run: what the engine itself bought.

    Full-fidelity numbers when the twin has them; otherwise both at the screen (the search may
    cut a slow eager twin there), said so in the text.
    """
    c = next(o for o in candidates if o.id == chosen)
    if c.engine == "hf":
        return ""
    # A plain twin: same recipe and device, no engine settings beyond where it runs.
    twins = [
        o.id
        for o in candidates
        if o.engine == "hf"
        and o.recipe == c.recipe
        and set(o.settings.to_dict()) <= {"threads", "device"}
        and o.settings.device == c.settings.device
    ]
    key = "decode_tokens_per_s"
    for results, where in (
        (bench, "measured in this run"),
        (screen, "both at the screen fidelity, in this run"),
    ):
        twin = next((t for t in twins if t in results), None)
        if twin is None or chosen not in results:
            continue
        mine, theirs = results[chosen].metrics.get(key), results[twin].metrics.get(key)
        if mine and theirs and theirs.median:
            return (
                f"; batch-1 decode {mine.median / theirs.median:.1f}x {twin} "
                f"({mine.median:.4g} vs {theirs.median:.4g} tokens/s; the same recipe in "
                f"eager transformers, {where})"
            )
    return ""


def _compile_payback(cid: str, candidates: list[Candidate], bench: dict[str, BenchResult]) -> str:
    """For a compiled candidate whose eager twin (same engine, recipe and device, no compile)
    was benchmarked too: how many generated tokens the compilation takes to pay back, from the
    warm-up time it added and the time per token it saved (batch-1 decode).

    Compiling costs seconds to minutes up front (each shape is a C++ build on the CPU); a
    server that generates more tokens than this in its life gains, a short job does not.
    """
    c = next(o for o in candidates if o.id == cid)
    if not c.settings.compile:
        return ""
    twin = next(
        (
            o.id
            for o in candidates
            if o.engine == c.engine
            and o.recipe == c.recipe
            and not o.settings.compile
            and o.settings.device == c.settings.device
            and o.id in bench
        ),
        None,
    )
    key = "decode_ms_per_token"
    if twin is None or cid not in bench:
        return ""
    mine, theirs = bench[cid].metrics.get(key), bench[twin].metrics.get(key)
    if not mine or not theirs:
        return ""
    extra_s = bench[cid].warmup_seconds - bench[twin].warmup_seconds
    saved_ms = theirs.median - mine.median
    if saved_ms <= 0:
        return f"; compiled decode is no faster than {twin} here, so compiling never pays back"
    tokens = max(0.0, extra_s) * 1000 / saved_ms
    return (
        f"; compiling pays back after ~{tokens:,.0f} generated tokens ({extra_s:.0f} s more "
        f"warm-up than {twin}, {saved_ms:.2f} ms saved per token at batch 1)"
    )


NOISY = 0.5  # a repeats' spread from which "within noise" says the machine was busy


def _noise(b: BenchResult, objective: str) -> float:
    """The run-to-run spread behind an objective value (memory is measured once: 0)."""
    if objective == "memory":
        return 0.0
    s = b.metrics.get(b.primary)
    return s.spread if s is not None else 0.0
