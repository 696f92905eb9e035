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

Each variation lives beside the candidates as `candidates/<id>+<setting>/` (its artifact hard
links to the chosen one's, its candidate.json holds the settings), measured as
`bench.tune<N>.json`; the report lists them under the chosen candidate, not as candidates.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from llmopt.core.atomic import write_json
from llmopt.core.schema import Candidate
from llmopt.engines import get_engine
from llmopt.model.files import link_tree
from llmopt.optimize.budget import Budget
from llmopt.optimize.executor import LocalExecutor, Task
from llmopt.optimize.objective import Objective
from llmopt.optimize.paired import PAIR_ROUNDS, pair_estimate, paired_ratios, round_order
from llmopt.optimize.space import settings_suffix
from llmopt.rundir.paths import RunDir

__all__ = ["TuneResult", "tune", "decide", "variations", "MARGIN", "VARIANT_SEP"]

MARGIN = 0.03  # a variation must beat the default settings by this much in every round
VARIANT_SEP = "+"  # candidates/<id>+<setting>: a tuning variation, not a planned candidate


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
    return out


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
    there is nothing to tune (no variation, the memory objective, or no budget for a round)."""
    changes = variations(base, info)
    if not changes or obj.name == "memory":
        return None
    variants = [_variant(run, base, c) for c in changes]
    ids = [base.id, *(v.id for v in variants)]
    executor = LocalExecutor(progress)
    per = len(ids) * pair_estimate(run, base.id)  # one round (a variation runs as its base)
    for r in range(1, PAIR_ROUNDS + 1):
        done = all(run.candidate(i).done("bench", f"tune{r}") for i in ids)
        if not done and not budget.fits(per):
            if events is not None:
                events.append(f"settings: round {r} not run (needs ~{per:.0f} s)")
            break
        for cid in round_order(ids, r):
            executor.run(
                str(run.root),
                [Task(cid, [("bench", f"tune{r}")], f"tune{r}", None, budget.deadline)],
            )
    res = paired_ratios(run, [v.id for v in variants], base.id, obj, ctx, prefix="tune")
    return decide(base, variants, res) if res else None


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
