"""Rung 4: the chosen candidate's runtime settings, measured side by side.

Settings that change how fast an engine runs but not what it computes (the thread count; an
engine's own runtime knobs, `Engine.tune_space`) need no new verification: the chosen
candidate's verified artifact is benchmarked with each variation in mirrored rounds against its
own default settings (`llmopt.optimize.paired`, probes and all), and a variation that wins every
comparable round by more than `MARGIN` becomes the settings `best/` and `llmopt serve` use.

Fewer threads than cores is always a variation on the CPU: on a machine whose cores other work
shares, two OpenMP threads can run many times slower than one (docs/benchmarks.md), and a
memory-bound decode step may not gain from the second core at all. What this rung measures is
this machine as it is during the run; the reason in `selection.json` says so.

The native engine's compiled decode on the CPU is one of its variations: compiled, a decode
step runs faster, but each decode shape costs a C++ build first. It is measured only when the
budget affords its rounds with the compiles in them (`compile_cost`: what this run measured, else
`COMPILE_PRIOR_S` per shape); otherwise the result says `compile not tried: needs ~N s, M s left`.
Measured, it is adopted by the same rule as any variation (faster by `MARGIN` in every round) and
the result says after how many generated tokens its warm-up pays back (`payback`).

Each variation lives beside the candidates as `candidates/<id>+<setting>/` (its artifact hard
links to the chosen one's, its candidate.json holds the settings), measured as
`bench.tune<N>.json`; the report lists them under the chosen candidate, not as candidates.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from llmopt.core.atomic import read_json, write_json
from llmopt.core.schema import BenchResult, Candidate
from llmopt.engines import get_engine
from llmopt.model.files import link_tree
from llmopt.optimize.budget import Budget
from llmopt.optimize.executor import LocalExecutor, Task
from llmopt.optimize.objective import Objective
from llmopt.optimize.paired import (
    MAX_ROUNDS,
    PAIR_ROUNDS,
    pair_estimate,
    paired_ratios,
    round_order,
)
from llmopt.optimize.profiles import StageSettings
from llmopt.optimize.space import settings_suffix
from llmopt.rundir.paths import RunDir

__all__ = [
    "TuneResult",
    "tune",
    "decide",
    "variations",
    "compile_cost",
    "compile_payback",
    "MARGIN",
    "VARIANT_SEP",
    "COMPILE_PRIOR_S",
]

MARGIN = 0.03  # a variation must beat the default settings by this much in every round
VARIANT_SEP = "+"  # candidates/<id>+<setting>: a tuning variation, not a planned candidate
# Seconds to compile one decode shape on the CPU when the run has measured no compile: about a
# minute per shape for SmolLM2-135M on 2 cores (docs/benchmarks.md), rounded to the safe side.
COMPILE_PRIOR_S = 60.0


@dataclass
class TuneResult:
    """What rung 4 measured for the chosen candidate `base`.

    Attributes:
        settings: the settings to deploy with (the base's when nothing beat them).
        variant: the id of the variation adopted, or None.
        note: one line for the selection's reason and the report.
        tried: variation id -> its side-by-side ratio record against the base.
    """

    base: str
    settings: dict[str, Any]
    variant: str | None = None
    note: str = ""
    tried: dict[str, dict[str, Any]] = field(default_factory=dict)
    not_tried: list[str] = field(default_factory=list)  # variations the budget left out, and why
    payback: str = ""  # compiled vs the defaults: after how many tokens the compile pays back

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def variations(cand: Candidate, info: Any) -> list[dict[str, Any]]:
    """The runtime variations worth measuring for `cand`: fewer threads on the CPU, and what its
    engine offers (`Engine.tune_space`), as partial settings.

    >>> from llmopt.core.schema import Candidate
    >>> variations(Candidate("x", "hf", "fp32", {"device": "cpu", "threads": 2}), None)
    [{'threads': 1}]
    >>> variations(Candidate("x", "hf", "fp32", {"device": "cpu", "threads": 1}), None)
    []
    >>> variations(Candidate("x", "vllm", "fp32", {"device": "cpu", "threads": 2}), None)
    []
    """
    s = cand.settings
    out: list[dict[str, Any]] = []
    engine = get_engine(cand.engine)
    # Not for a served engine (vLLM): each of its measurements is a server start of minutes.
    if s.device == "cpu" and not engine.served:
        threads = s.threads or os.cpu_count() or 1
        out += [{"threads": n} for n in sorted({threads // 2, 1}, reverse=True) if 0 < n < threads]
    extra = getattr(engine, "tune_space", None)
    if extra is not None and info is not None:
        out += [v for v in extra(info, cand.recipe, s.device) if v not in out]
    # A variation the candidate already runs with (a compiled candidate chosen) is no variation.
    return [v for v in out if s.with_changes(**v) != s]


def _compiles(base: Candidate, change: dict[str, Any]) -> bool:
    return bool(change.get("compile")) and not base.settings.compile


def _decode_shapes(run: RunDir) -> int:
    """Decode shapes a side-by-side bench compiles: one per batch size it measures."""
    try:
        sizes = StageSettings.from_run_json(read_json(run.run_json)["settings"], "tune1").sizes
        return len(set(sizes.bench_batch_sizes) | {1})
    except (OSError, ValueError, KeyError, TypeError):
        return 2


def _bench_at(run: RunDir, cid: str, fidelity: str) -> BenchResult | None:
    d = run.candidate(cid).read("bench", fidelity)
    return BenchResult.from_dict(d) if d is not None else None


_FIDELITIES = ("full", "screen", *(f"{k}{r}" for k in ("tune", "pair") for r in range(1, 5)))


def compile_cost(run: RunDir, base: Candidate) -> tuple[float, str]:
    """Seconds a compiled bench of `base` adds to an eager one, and where the figure comes from.

    Measured where this run has it: the largest extra warm-up a compiled candidate of the same
    engine and device showed over its eager twin (same settings but `compile`) benchmarked at
    the same fidelity. Else the prior: `COMPILE_PRIOR_S` per decode shape the bench compiles.
    """
    cands = []
    for cdir in run.candidates():
        d = cdir.read("candidate")
        if d is not None:
            cands.append(Candidate.from_dict(d))

    def rest(c: Candidate) -> dict[str, Any]:
        return {k: v for k, v in c.settings.to_dict().items() if k not in ("compile", "opt_in")}

    measured: list[float] = []
    for c in cands:
        if c.engine != base.engine or not c.settings.compile:
            continue
        twins = [
            o
            for o in cands
            if o.engine == c.engine
            and o.recipe == c.recipe
            and not o.settings.compile
            and rest(o) == rest(c)
        ]
        for fid in _FIDELITIES:
            mine = _bench_at(run, c.id, fid)
            theirs = next((b for o in twins if (b := _bench_at(run, o.id, fid))), None)
            if mine is not None and theirs is not None:
                measured.append(mine.warmup_seconds - theirs.warmup_seconds)
    if measured:
        return max(0.0, max(measured)), "the most extra warm-up a compiled bench took in this run"
    shapes = _decode_shapes(run)
    return (
        COMPILE_PRIOR_S * shapes,
        f"no compile measured in this run: {COMPILE_PRIOR_S:.0f} s per decode shape x {shapes}",
    )


def compile_payback(run: RunDir, base_id: str, vid: str, dropped: list[int] | None = None) -> str:
    """After how many generated tokens the compiled variation `vid` pays back its extra warm-up
    over `base_id`, from the side-by-side rounds: the mean extra warm-up over the mean batch-1
    decode time saved per token, both measured in the same rounds. Rounds in `dropped` (the
    machine's load changed during them) are left out, as from the ratios. "" without a round."""
    extra, saved = [], []
    for r in range(1, MAX_ROUNDS + 1):
        if r in (dropped or []):
            continue
        a, b = _bench_at(run, vid, f"tune{r}"), _bench_at(run, base_id, f"tune{r}")
        if a is None or b is None:
            continue
        ma, mb = a.metrics.get("decode_ms_per_token"), b.metrics.get("decode_ms_per_token")
        if ma is None or mb is None:
            continue
        extra.append(a.warmup_seconds - b.warmup_seconds)
        saved.append(mb.median - ma.median)
    if not saved:
        return ""
    extra_s, saved_ms = sum(extra) / len(extra), sum(saved) / len(saved)
    n = len(saved)
    rounds = f"{n} round{'s' if n > 1 else ''} side by side"
    if saved_ms <= 0:
        return (
            f"compiled decode is no faster than the defaults ({rounds}): compiling never pays back"
        )
    tokens = max(0.0, extra_s) * 1000 / saved_ms
    return (
        f"compiling pays back after ~{tokens:,.0f} generated tokens ({extra_s:.0f} s more warm-up, "
        f"{saved_ms:.2f} ms saved per token at batch 1; {rounds})"
    )


def _variant(run: RunDir, base: Candidate, change: dict[str, Any]) -> Candidate:
    """The variation's candidate directory (artifact hard-linked to the base's), made once."""
    vid = base.id + VARIANT_SEP + settings_suffix(change).lstrip("-")
    v = replace(base, id=vid, settings=base.settings.with_changes(**change), reference=False)
    cdir = run.candidate(vid)
    if not cdir.stage_file("candidate").exists():
        cdir.root.mkdir(parents=True, exist_ok=True)
        if not cdir.artifact.exists():
            link_tree(run.candidate(base.id).artifact, cdir.artifact)
        write_json(cdir.stage_file("candidate"), v.to_dict())
    return v


def tune(
    run: RunDir,
    base: Candidate,
    info: Any,
    budget: Budget,
    obj: Objective,
    ctx: dict[str, Any] | None = None,
    progress: Any = None,
    events: list[str] | None = None,
) -> TuneResult | None:
    """Measure `base`'s runtime variations side by side with its default settings; None when
    there is nothing to tune (no variation, the memory objective). A compile the budget cannot
    afford is left out and said so (`TuneResult.not_tried`)."""
    changes = variations(base, info)
    if not changes or obj.name == "memory":
        return None
    bench_s = pair_estimate(run, base.id)  # one bench of the base (a variation runs as its base)
    cost, basis = compile_cost(run, base) if any(_compiles(base, c) for c in changes) else (0, "")
    not_tried: list[str] = []
    plain = [c for c in changes if not _compiles(base, c)]
    rounds_s = PAIR_ROUNDS * (1 + len(plain)) * bench_s  # the base and the other variations
    kept = list(plain)
    for c in changes:
        if not _compiles(base, c):
            continue
        done = all(
            run.candidate(_variant_id(base, c)).done("bench", f"tune{r}")
            for r in range(1, PAIR_ROUNDS + 1)
        )
        need = 0.0 if done else PAIR_ROUNDS * (bench_s + cost)
        if budget.fits(rounds_s + need):
            kept.append(c)
            rounds_s += need
            continue
        left = max(0.0, (budget.left or 0.0) - budget.reserve_s - rounds_s)
        why = (
            f"compile not tried: needs ~{need:.0f} s, {left:.0f} s left "
            f"({PAIR_ROUNDS} rounds with a compile of ~{cost:.0f} s each: {basis})"
        )
        not_tried.append(why)
        if events is not None:
            events.append(f"settings: {why}")
    if not kept:
        return TuneResult(
            base.id,
            base.settings.to_dict(),
            note="settings: " + "; ".join(not_tried),
            not_tried=not_tried,
        )
    variants = [_variant(run, base, c) for c in kept]
    ids = [base.id, *(v.id for v in variants)]
    executor = LocalExecutor(progress)
    for r in range(1, PAIR_ROUNDS + 1):
        todo = [i for i in ids if not run.candidate(i).done("bench", f"tune{r}")]
        # one round: a bench of each (a variation runs as its base), plus each compile in it
        per = len(todo) * bench_s + sum(
            cost for v, c in zip(variants, kept, strict=True) if _compiles(base, c) and v.id in todo
        )
        if todo and not budget.fits(per):
            if events is not None:
                events.append(f"settings: round {r} not run (needs ~{per:.0f} s)")
            break
        for cid in round_order(ids, r):
            executor.run(
                str(run.root),
                [Task(cid, [("bench", f"tune{r}")], f"tune{r}", None, budget.deadline)],
            )
    res = paired_ratios(run, [v.id for v in variants], base.id, obj, ctx, prefix="tune")
    if not res:
        if not not_tried:
            return None
        return TuneResult(
            base.id,
            base.settings.to_dict(),
            note="settings: " + "; ".join(not_tried),
            not_tried=not_tried,
        )
    out = decide(base, variants, res)
    out.not_tried = not_tried
    compiled = [v for v, c in zip(variants, kept, strict=True) if _compiles(base, c)]
    dropped = res[compiled[0].id].dropped if compiled and compiled[0].id in res else []
    if compiled and (pay := compile_payback(run, base.id, compiled[0].id, dropped)):
        out.payback = pay
        out.note += f"; {pay}"
    if not_tried:
        out.note += "; " + "; ".join(not_tried)
    return out


def _variant_id(base: Candidate, change: dict[str, Any]) -> str:
    """The id of `base`'s variation `change` (as `_variant` names its folder)."""
    return base.id + VARIANT_SEP + settings_suffix(change).lstrip("-")


def decide(base: Candidate, variants: list[Candidate], res: dict[str, Any]) -> TuneResult:
    """The settings to deploy from the rounds' ratios (`paired_ratios` of the variants against
    `base`): the variation that beat the defaults by more than `MARGIN` in every comparable
    round, the fastest of those; else the defaults."""
    out = TuneResult(
        base.id, base.settings.to_dict(), tried={k: p.to_dict() for k, p in res.items()}
    )
    winners = [
        (p.ratio, v)
        for v in variants
        if (p := res.get(v.id)) and p.trusted and p.lo is not None and p.lo > 1 + MARGIN
    ]
    if winners:
        ratio, v = max(winners, key=lambda w: w[0])
        out.settings, out.variant = v.settings.to_dict(), v.id
        setting = v.id.split(VARIANT_SEP, 1)[1]
        out.note = (
            f"settings: {setting} measured {ratio:.2f}x the default settings side by side on "
            f"this machine during the run ({res[v.id].note.split(': ', 1)[-1]})"
        )
    else:
        tried = ", ".join(
            f"{k.split(VARIANT_SEP, 1)[1]} "
            + (f"{p.ratio:.2f}x" if p.ratio is not None else "not comparable")
            for k, p in res.items()
        )
        out.note = f"settings: the defaults kept (side by side: {tried})"
    return out
