"""The search loop: which candidate tasks run, at which fidelity, in which order, within budget.

    rung 0   the reference, fully (build, screen, full): every score is relative to it
    rung 1   build and screen (short verification and benchmark) each other candidate, in waves
             as wide as the executor, while the budget allows
    cut      `halving.screen`: quality, dominated by the reference, successive halving
    rung 2   full verification and benchmark for the survivors, best screen score first, in
             waves as wide as the executor; before each task the early stop ("cannot improve")
             and the time budget are checked, and a task that does not start is recorded as cut
    rung 3   side by side: the reference and the two best that passed, benchmarked again in
             mirrored rounds one right after the other (`llmopt.optimize.paired`), so selection
             compares numbers measured in the same time window

Before a calibrated build starts, `llmopt.optimize.predict` checks whether its RTN sibling's screen
already rules it out; such a candidate is recorded as cut with the prediction, never built.

`exhaustive` skips the screen: every candidate is fully verified and benchmarked (budget checked).
Everything a rung needs that exists already (a resumed run) is skipped by the tasks themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmopt.core.atomic import read_json
from llmopt.core.recipes import get_recipe
from llmopt.core.schema import BenchResult, Candidate, VerifyResult
from llmopt.engines import get_engine
from llmopt.optimize.budget import Budget, typical
from llmopt.optimize.executor import Task, task_seconds
from llmopt.optimize.halving import ScreenEntry, cannot_improve, screen
from llmopt.optimize.objective import Objective
from llmopt.optimize.paired import (
    MAX_ROUNDS,
    PAIR_ROUNDS,
    pair_estimate,
    paired_ratios,
    round_order,
)
from llmopt.optimize.predict import SCREEN_TOLERANCE, ValueModel, predicted_miss, screen_order
from llmopt.rundir.paths import RunDir

__all__ = ["SearchState", "run_search", "MODES"]

MODES = ("halving", "exhaustive")
SCREEN = [("verify", "screen"), ("bench", "screen")]
FULL = [("verify", "full"), ("bench", "full")]


SCREEN_STARTS = 2  # a served candidate's screen verify and screen bench each start its server


@dataclass
class SearchState:
    """What the search did: cut candidates with reasons, screen scores, task records, events."""

    cut: dict[str, str] = field(default_factory=dict)
    screen_scores: dict[str, float | None] = field(default_factory=dict)
    full_scores: dict[str, float | None] = field(default_factory=dict)
    survivors: list[str] = field(default_factory=list)
    tasks: list[dict[str, Any]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    stopped_early: bool = False
    paired: dict[str, Any] = field(default_factory=dict)  # id -> side-by-side ratio record
    # progress(event, candidate_id, stage, detail) of the run, told of every cut as it happens
    notify: Any = field(default=None, repr=False)

    def cut_one(self, cid: str, reason: str) -> None:
        """Record that the search will not finish `cid`, and why (also told to the progress)."""
        self.cut[cid] = reason
        if self.notify:
            self.notify("cut", cid, "search", reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cut": self.cut,
            "screen_scores": self.screen_scores,
            "full_scores": self.full_scores,
            "survivors": self.survivors,
            "events": self.events,
            "stopped_early": self.stopped_early,
            "side_by_side": self.paired,
            "tasks": [
                {
                    k: t.get(k)
                    for k in ("cid", "rung", "ok", "error", "seconds", "host", "pid", "node_id")
                }
                for t in self.tasks
            ],
        }


def _steps_seconds(run: RunDir, cid: str, rung: str) -> float | None:

    return task_seconds(run, cid, rung)


def _value(run: RunDir, cid: str, fid: str, obj: Objective, ctx: dict[str, Any]):
    b = run.candidate(cid).read("bench", fid)
    return obj.value(BenchResult.from_dict(b), ctx) if b else None


def _score(run: RunDir, cid: str, ref: str, fid: str, obj: Objective, ctx: dict[str, Any]):
    return obj.score(_value(run, cid, fid, obj, ctx), _value(run, ref, fid, obj, ctx))


def run_search(
    run: RunDir,
    cands: list[Candidate],
    executor: Any,
    budget: Budget,
    obj: Objective,
    max_quality_drop: float,
    mode: str = "halving",
    context: dict[str, Any] | None = None,
) -> SearchState:
    """Run the search over `cands` (reference first) and return what it did.

    Args:
        run: the run directory (plan, model and candidate.json files written).
        cands: planned candidates, the reference first.
        executor: LocalExecutor or RayExecutor.
        budget: wall-clock budget of this invocation.
        obj: the objective the screen and the early stop rank by.
        max_quality_drop: the quality budget.
        mode: "halving" (screen then full for survivors) or "exhaustive" (full for all).
        context: objective context (price_per_hour).
    """
    assert mode in MODES, f"unknown search mode {mode!r}; use one of {MODES}"
    ctx = context or {}
    st = SearchState(notify=getattr(executor, "progress", None))
    ref, others = cands[0], cands[1:]
    assert ref.reference, "the reference must be the first candidate"

    def run_tasks(tasks: list[Task]) -> list[dict[str, Any]]:
        # Every task but the reference's own evaluation stops at the budget's end.
        for t in tasks:
            t.deadline = None if (t.cid == ref.id and t.rung == "full") else budget.deadline
        recs = executor.run(str(run.root), tasks) if tasks else []
        st.tasks += recs
        for r in recs:
            if r.get("out_of_time") and not r["rung"].startswith("pair"):
                st.cut[r["cid"]] = r["out_of_time"]
        return recs

    # ---- rung 0: the reference (always fully), then the other builds ----
    # An LM candidate's verify scores the reference itself (same windows, KL needs its logits),
    # so the reference's own screen verify is needed only for embedders (shared embeddings file).
    task = read_json(run.model_json).get("task")
    ref_screen = SCREEN if task == "embedding" else [("bench", "screen")]
    ref_steps = [("build", "full")] + (ref_screen if mode == "halving" else []) + FULL
    run_tasks([Task(ref.id, ref_steps, "full")])
    if not run.candidate(ref.id).done("bench", "full"):
        for c in others:
            st.cut_one(c.id, "the reference failed, nothing to compare against")
        st.events.append("stopped: the reference failed")
        return st
    ref_full_s = _steps_seconds(run, ref.id, "full") or 0.0
    ref_build_s = _step_seconds(run, ref.id, "full").get(f"{ref.id}/build", 0.0)

    if mode == "exhaustive":
        _full_rung(
            run,
            others,
            executor,
            budget,
            st,
            obj,
            ctx,
            run_tasks,
            ref,
            ref_full_s,
            max_quality_drop,
            early_stop=False,
        )
        _paired_rung(run, ref.id, st, budget, obj, ctx, run_tasks)
        return st

    # ---- rung 1: build and screen each candidate, in waves, while the budget allows ----
    ref_screen_s = _screen_seconds(run, ref.id, ref_full_s)
    ref_verify_s = _step_seconds(run, ref.id, "full").get(f"{ref.id}/verify", 0.0)
    # Before any candidate has screened: the reference's build and screen bench, plus a screen
    # verify of two models on an eighth of the tokens, no generation (~a quarter of its full verify).
    first_est = ref_build_s + ref_screen_s + (0.25 * ref_verify_s if task != "embedding" else 0.0)
    # What candidate screens actually took, by cost class (calibrated builds take minutes where
    # the others take seconds); their median is the estimate (`typical`: one screen timed under
    # contention does not set it). The cheapest SCREEN_FLOOR are screened whatever it says.
    observed: dict[bool, list[float]] = {False: [], True: []}
    observed_served: dict[str, list[float]] = {}  # served engines' screens, by engine
    by_id = {c.id: c for c in others}
    started = 0
    # Screening stops while there is still time to fully verify the survivors (halving keeps 2)
    # and to compare them side by side (rung 3). Before any screen that is the reference's own
    # times; after, the estimates of the screened candidates that could still win, each scaled
    # by how its screen compared with the reference's.
    keep = min(2, len(others))
    ref_full_est = _full_estimate(run, ref.id, ref_full_s, ref_screen_s)
    screen_scores: dict[str, float] = {}  # passed the screen's quality limit -> screen score

    def reserve_now() -> float:
        ranked = sorted(screen_scores, key=lambda i: -screen_scores[i])
        top = screen_scores[ranked[0]] if ranked else None
        alive = [i for i in ranked if not cannot_improve(screen_scores[i], top)][:keep]
        full = sum(_full_estimate(run, i, ref_full_s, ref_screen_s) for i in alive)
        full += max(0, (1 if ranked else keep) - len(alive)) * ref_full_est
        pair = PAIR_ROUNDS * (
            pair_estimate(run, ref.id) + sum(pair_estimate(run, i) for i in alive)
        )
        return full + pair

    reserve = reserve_now()

    def beats_reference() -> bool:
        return any(v > 1.0 for v in screen_scores.values())

    # Cheap candidates first, then RTN at the calibrated ones' bits: their screens decide what
    # is worth the expensive ones' time (`llmopt.optimize.predict`).
    values = ValueModel()

    def ordered(cands: list[Candidate]) -> list[Candidate]:
        idx = screen_order([c.recipe for c in cands], [c.engine for c in cands], values)
        return [cands[i] for i in idx]

    queue = ordered(others)
    recipe_of = {c.id: c.recipe for c in others}
    engine_of = {c.id: c.engine for c in others}
    screened: dict[str, tuple[str, float]] = {}  # id -> (recipe, screen quality drop)
    while queue:
        wave = []
        while queue and len(wave) < executor.parallel:
            c = queue.pop(0)
            cls = _calibrated(c.recipe)
            est = typical(observed[cls] or observed[not cls], first_est)
            if starts := start_s(c):
                # A served engine's screen starts its server twice (verify, bench): its own
                # screens, once timed, else the in-process estimate plus the starts.
                est = typical(observed_served.get(c.engine, []), est + SCREEN_STARTS * starts)
            cd = run.candidate(c.id)
            finished = all(cd.done(s, f) for s, f in [("build", "full"), *SCREEN])
            if not finished and (why := predicted_miss(c.recipe, screened, max_quality_drop)):
                st.cut_one(c.id, why)
                continue
            if (
                finished
                or budget.fits(est + reserve, executor.parallel)
                # The floor makes sure the search compares something. Once a screened candidate
                # beats the reference it has, and the floor must not spend the time reserved to
                # confirm that candidate; nor is it for a served engine's screen of minutes.
                or (budget.floor_allows(started) and not starts and not beats_reference())
            ):
                wave.append(Task(c.id, [("build", "full"), *SCREEN], "screen", ref.id))
                started += 1
            else:
                st.cut_one(
                    c.id,
                    budget.exhausted(
                        "the build and screen (keeping time to fully verify and compare "
                        "the best so far)",
                        est + reserve,
                        est * (len(queue) + 1) + reserve,
                        executor.parallel,
                    ),
                )
        for r in run_tasks(wave):
            if r.get("ran") and r.get("seconds"):
                if start_s(by_id[r["cid"]]):
                    observed_served.setdefault(engine_of[r["cid"]], []).append(r["seconds"])
                else:
                    observed[_calibrated(recipe_of[r["cid"]])].append(r["seconds"])
            if (v := run.candidate(r["cid"]).read("verify", "screen")) is not None:
                screened[r["cid"]] = (recipe_of[r["cid"]], float(v["quality_drop"]))
                sc = _score(run, r["cid"], ref.id, "screen", obj, ctx)
                values.observe(engine_of[r["cid"]], recipe_of[r["cid"]], sc)
                if (
                    sc is not None
                    and float(v["quality_drop"]) <= SCREEN_TOLERANCE * max_quality_drop
                ):
                    screen_scores[r["cid"]] = sc
        queue = ordered(queue)  # what this wave measured re-ranks the rest
        reserve = reserve_now()
    built = [c for c in others if run.candidate(c.id).done("build")]

    entries = [ScreenEntry(ref.id, 0.0, True, 1.0, reference=True)]
    for c in built:
        v = run.candidate(c.id).read("verify", "screen")
        if v is None or not run.candidate(c.id).done("bench", "screen"):
            continue  # failed (error.json) or cut above
        vr = VerifyResult.from_dict(v)
        score = _score(run, c.id, ref.id, "screen", obj, ctx)
        st.screen_scores[c.id] = score
        entries.append(
            ScreenEntry(c.id, vr.quality_drop, vr.passed, score, quality_name=_quality_name(vr))
        )
    survivors, cut = screen(entries, max_quality_drop, obj.name)
    for cid, why in cut.items():
        st.cut_one(cid, why)
    st.survivors = survivors
    st.events.append(
        f"screen: {len(entries) - 1} screened, {len(survivors) - 1} go on to full fidelity"
    )

    # ---- rung 2: full fidelity for the survivors ----
    order = [c for s in survivors[1:] for c in others if c.id == s]
    _full_rung(
        run,
        order,
        executor,
        budget,
        st,
        obj,
        ctx,
        run_tasks,
        ref,
        ref_full_s,
        max_quality_drop,
        early_stop=True,
    )
    _paired_rung(run, ref.id, st, budget, obj, ctx, run_tasks)
    return st


def start_s(c: Candidate) -> float:
    """The typical server start of the candidate's engine (0 for in-process engines)."""
    return get_engine(c.engine).start_seconds(c.settings.device)


def _calibrated(recipe_name: str) -> bool:
    """Whether the recipe's build runs the calibration pipeline (`Recipe.calibrated`)."""

    return get_recipe(recipe_name).calibrated


def _full_rung(
    run,
    order,
    executor,
    budget,
    st,
    obj,
    ctx,
    run_tasks,
    ref,
    ref_full_s,
    max_quality_drop,
    early_stop: bool,
) -> None:
    st.full_scores[ref.id] = 1.0
    ref_screen_s = _screen_seconds(run, ref.id, ref_full_s)
    queue = list(order)
    confirmed = {ref.id: 1.0}  # passed at full fidelity -> its screen score (same fidelity as
    while queue:  # the scores it is compared with, so one run-to-run noise margin applies)
        best_id = max(confirmed, key=confirmed.get)
        best = confirmed[best_id]
        wave: list[Task] = []
        while queue and len(wave) < executor.parallel:
            c = queue.pop(0)
            done = all(run.candidate(c.id).done(s, f) for s, f in FULL)
            scr = st.screen_scores.get(c.id)
            if not done and early_stop and cannot_improve(scr, best):
                st.cut_one(
                    c.id,
                    (
                        f"stopped early: screen {obj.name} {scr:.2f}x the reference cannot beat "
                        f"{best_id} ({best:.2f}x at the screen, passed at full fidelity) "
                        "even with 10% noise"
                    ),
                )
                st.stopped_early = True
                continue
            est = _full_estimate(run, c.id, ref_full_s, ref_screen_s)
            if c.id not in st.screen_scores:  # no screen timed its server's start
                est += SCREEN_STARTS * start_s(c)  # the full verify and bench start it too
            # Once a candidate has passed, another full verification must leave time for one
            # side-by-side round (rung 3) of the reference, that candidate and this one: a
            # choice made on numbers measured minutes apart is what the rung exists to prevent.
            winners = [i for i in confirmed if i != ref.id]
            keep = (
                sum(pair_estimate(run, i) for i in (ref.id, max(winners, key=confirmed.get), c.id))
                if winners
                else 0.0
            )
            if not done and not budget.fits(est + keep, executor.parallel):
                rest = est * (len(queue) + 1) + keep
                what = "full verification" + (
                    " (keeping time to compare the best so far side by side)" if keep else ""
                )
                st.cut_one(c.id, budget.exhausted(what, est + keep, rest, executor.parallel))
                continue
            wave.append(
                Task(c.id, ([("build", "full")] if not early_stop else []) + FULL, "full", ref.id)
            )
        for rec in run_tasks(wave):
            cdir = run.candidate(rec["cid"])
            v = cdir.read("verify")
            if rec["ok"] and v and VerifyResult.from_dict(v).passed:
                st.full_scores[rec["cid"]] = _score(run, rec["cid"], ref.id, "full", obj, ctx)
                if (sc := st.screen_scores.get(rec["cid"])) is not None:
                    confirmed[rec["cid"]] = sc
    if st.stopped_early:
        st.events.append("stopped early: no remaining candidate could improve the objective")


FINALISTS = 2  # candidates benchmarked side by side with the reference, best full score first


def _paired_rung(
    run: RunDir,
    ref_id: str,
    st: SearchState,
    budget: Budget,
    obj: Objective,
    ctx: dict[str, Any],
    run_tasks,
) -> None:
    """Rung 3: the reference and the best candidates that passed full verification benchmarked
    again one right after the other, in mirrored rounds (`llmopt.optimize.paired`), so selection
    compares numbers measured in the same time window. A round the machine disturbed is measured
    again while rounds and budget remain. Memory is not timed: no rounds for it."""
    if obj.name == "memory":
        return
    passed = [i for i, s in st.full_scores.items() if i != ref_id and s is not None]
    finalists = sorted(passed, key=lambda i: -(st.full_scores[i] or 0.0))[:FINALISTS]
    if not finalists:
        return
    ids = [ref_id, *finalists]
    per = {i: pair_estimate(run, i) for i in ids}
    for r in range(1, MAX_ROUNDS + 1):
        if r > PAIR_ROUNDS:
            pr = paired_ratios(run, finalists, ref_id, obj, ctx)
            if all(p.trusted for p in pr.values()):
                break
        done = all(run.candidate(i).done("bench", f"pair{r}") for i in ids)
        # The side-by-side rounds are the last measurement before the selection, which with
        # best/ and the report takes seconds: they may use half of the reserve (the stage
        # deadline's margin), which the other rungs keep whole.
        if not done and not budget.fits(sum(per.values()), reserve_s=budget.reserve_s / 2):
            st.events.append(
                f"side by side: round {r} not run (needs ~{sum(per.values()):.0f} s, "
                f"{max(0.0, budget.left or 0.0):.0f} s left)"
            )
            break
        for cid in round_order(ids, r):
            for rec in run_tasks([Task(cid, [("bench", f"pair{r}")], f"pair{r}")]):
                if not rec["ok"]:
                    why = rec.get("error") or rec.get("out_of_time")
                    st.events.append(f"side by side: {cid} round {r} failed: {why}")
    res = paired_ratios(run, finalists, ref_id, obj, ctx)
    st.paired = {i: p.to_dict() for i, p in res.items()}
    for i, p in res.items():
        st.events.append(f"{i}: {p.note or 'no side-by-side round finished'}")


def _step_seconds(run: RunDir, cid: str, rung: str) -> dict[str, float]:

    f = run.candidate(cid).task_file(rung)
    return (read_json(f).get("step_seconds") or {}) if f.exists() else {}


def _screen_seconds(run: RunDir, ref_id: str, ref_full_s: float) -> float:
    """The reference's screen time, from its timed steps (else a quarter of its task)."""
    s = sum(v for k, v in _step_seconds(run, ref_id, "full").items() if k.endswith("@screen"))
    return s or ref_full_s / 4


def _full_estimate(run: RunDir, cid: str, ref_full_s: float, ref_screen_s: float) -> float:
    """The reference's full verify+bench time, scaled by how this candidate's screen compared
    with the reference's (clipped to 0.3x-3x)."""
    ref_steps = _step_seconds(run, run_ref_id(run), "full")
    full_only = sum(v for k, v in ref_steps.items() if "@" not in k and "/build" not in k)
    full_only = full_only or max(ref_full_s - ref_screen_s, 1.0)
    ref_id = run_ref_id(run)
    # Like with like: the candidate's screen bench against the reference's.
    mine = _step_seconds(run, cid, "screen").get(f"{cid}/bench@screen")
    theirs = ref_steps.get(f"{ref_id}/bench@screen")
    ratio = min(3.0, max(0.3, mine / theirs)) if mine and theirs else 1.0
    return full_only * ratio


def run_ref_id(run: RunDir) -> str:

    return next(c["id"] for c in read_json(run.plan_json)["candidates"] if c.get("reference"))


def _quality_name(v: VerifyResult) -> str:
    names = [m.name for m in v.metrics]
    return "ppl" if "perplexity" in names else "1 - cosine" if "cosine_mean" in names else "quality"
