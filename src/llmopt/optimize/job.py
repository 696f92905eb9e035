"""`optimize`: the main job, top to bottom.

    inspect -> plan -> search (build, screen, verify, bench per candidate) -> select -> best/ -> report

The search (`llmopt.optimize.loop`) screens every candidate cheaply, then fully verifies and
benchmarks the survivors, within `--time-budget`. Each candidate stage runs in its own process
(`llmopt.optimize.worker`), locally or as Ray tasks, and leaves its JSON in the run directory; re-running
the same command skips every stage whose JSON exists, so a killed run resumes where it stopped and
a finished one returns at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmopt.bench.timing import choose_threads
from llmopt.core.atomic import read_json, write_json
from llmopt.core.schema import Candidate, Selection
from llmopt.core.settings import EngineSettings
from llmopt.deploy import resolve_source, write_bundle
from llmopt.engines import served_by_llmopt
from llmopt.hardware.host import usable_cores
from llmopt.hardware.target import Target, detect_target
from llmopt.model.info import inspect_model
from llmopt.optimize.budget import Budget, default_budget, parse_duration
from llmopt.optimize.executor import make_executor
from llmopt.optimize.loop import MODES, run_search
from llmopt.optimize.objective import get_objective
from llmopt.optimize.profiles import PROFILES, SCREEN, StageSettings
from llmopt.optimize.runmeta import run_meta, write_doctor
from llmopt.optimize.select import SelectionInput, select
from llmopt.optimize.space import make_plan
from llmopt.optimize.tune import tune
from llmopt.report import write_report
from llmopt.rundir.best import write_best
from llmopt.rundir.paths import RunDir
from llmopt.verify.embedding import RetrievalSpec
from llmopt.verify.gates import GATE_PRESETS

if TYPE_CHECKING:
    from llmopt.optimize.budget import Budget
    from llmopt.optimize.loop import SearchState
    from llmopt.optimize.objective import Objective
    from llmopt.optimize.space import Plan

__all__ = ["optimize", "OptimizeResult"]

log = logging.getLogger(__name__)

# progress(event, candidate_id, stage, detail): "start", "done", "skip", "fail", "cut" for a
# candidate's stage; "note" (a message) and "budget" (its seconds) for the run.
Progress = Callable[[str, str, str, str], None]


@dataclass
class OptimizeResult:
    """What one `optimize` call did: where, what it chose, and which stages ran or were reused."""

    run_dir: Path
    selection: Selection
    resumed: bool
    ran: list[str] = field(default_factory=list)  # "<id>/<stage>[@fidelity]" executed now
    skipped: list[str] = field(default_factory=list)  # "<id>/<stage>[@fidelity]" already done
    report_html: Path | None = None
    report_md: Path | None = None
    search: dict[str, Any] = field(default_factory=dict)  # what search.json holds


def optimize(
    model: str | Path,
    out: str | Path,
    target: str = "cpu",
    max_quality_drop: float = 0.01,
    candidates: list[str] | None = None,
    threads: int | None = None,
    profile: str = "full",
    force: bool = False,
    progress: Progress | None = None,
    objective: str = "throughput",
    time_budget: str | float | None = None,
    search: str = "halving",
    ray_address: str | None = None,
    price_per_hour: float | None = None,
    deploy: bool = True,
    budget_started_at: float | None = None,
    gates: str = "default",
    retrieval: dict[str, Any] | None = None,
) -> OptimizeResult:
    """Find the best deployment of `model` on `target` for `objective` within the quality budget.

    Args:
        model: a built-in name (`smollm2-135m`, `minilm-l6`) or a Hugging Face folder.
        out: the run directory (created; resumed if it holds the same run).
        target: "cpu" or "cuda".
        max_quality_drop: budget as a fraction: relative perplexity increase for LMs,
            1 - mean cosine to the reference for embedding models.
        candidates: restrict to these candidate ids (the reference always runs).
        threads: CPU threads for candidates (default: all available).
        profile: "full" or "quick" (smaller verification and benchmark work).
        force: discard a different run found in `out` instead of refusing.
        progress: optional callback for stage events.
        objective: latency | throughput | memory | cost (llmopt.optimize.objective).
        time_budget: wall-clock budget of this call ("15m", "1h", seconds); None or "none":
            unlimited (the default here); "auto" (the CLI's default): `budget.default_budget`
            for the model's size.
        search: "halving" (screen all, fully verify the survivors) or "exhaustive".
        ray_address: None (local worker processes), "local" (start a Ray instance here) or the
            address of a Ray cluster; candidates then run as Ray tasks.
        price_per_hour: the target's price, for the cost objective (default: relative units).
        deploy: write the deploy bundle into best/deploy.
        retrieval: embedders: the user's `threshold`, `pairs`, `queries`, `corpus` (file paths)
            and `top_k`, as `llmopt verify` takes them; every candidate is gated on them and
            the chosen one's recalibrated threshold goes into best/launch.json.
        budget_started_at: epoch seconds the time budget counts from (default: now; the CLI
            passes its process's start).
        gates: the verification gates besides the budget (`llmopt.verify.gates` presets:
            default, strict, loose), as `llmopt verify --gates`; `max_quality_drop` overrides
            the preset's budget.

    Example:
        >>> r = optimize("minilm-l6", "runs/minilm", time_budget="10m")   # doctest: +SKIP
        >>> r.selection.chosen                                             # doctest: +SKIP
        'onnxruntime-w8a8-dynamic'
    """

    _check(max_quality_drop, gates, profile, search)
    obj = get_objective(objective)
    budget_s = None if time_budget == "auto" else parse_duration(time_budget)
    ctx = {"price_per_hour": price_per_hour}
    # inspect: the model and the machine; the run directory opens (or resumes) on them
    if threads is None and target == "cpu":
        threads = _threads_for(RunDir(out), progress)
    info, tgt = _inspect(model, target, threads)
    if time_budget == "auto":
        budget_s, why = default_budget(info.num_parameters)
        progress and progress("note", "", "", f"time budget: {why}")
    budget = Budget.since(budget_s, budget_started_at)
    if progress and budget_s:
        progress("budget", "", "", f"{budget_s:.0f}")
    stage = StageSettings.for_run(profile, max_quality_drop, gates, tgt.threads)
    run = RunDir(out)
    settings = stage.run_json(profile)
    if retrieval:  # only when given, so runs without it keep their identity
        settings["retrieval"] = _retrieval_options(retrieval)
    resumed = run.open(run_meta(model, Path(info.path), info, tgt, settings), force=force)
    write_json(run.model_json, info.to_dict())
    if progress:
        progress("rundir", "", "", str(run.root))
    write_doctor(run, target)
    # plan -> search -> select -> best/
    plan = _plan(run, info, tgt, candidates)
    state, where = _search(
        run, plan, budget, obj, max_quality_drop, search, ctx, ray_address, progress
    )
    selection = _select(run, plan, max_quality_drop, obj, ctx, state)
    if selection.chosen:
        chosen = next(c for c in plan.candidates if c.id == selection.chosen)
        # rung 4: the chosen one's runtime settings, side by side with its defaults
        tuned = tune(run, chosen, info, budget, obj, ctx, progress, state.events)
        if tuned is not None:
            selection.tuned = tuned.to_dict()
            selection.reasons[chosen.id] += f"; {tuned.note}"
            if tuned.variant:
                chosen = replace(chosen, settings=EngineSettings.from_dict(tuned.settings))
            write_json(run.selection_json, selection.to_dict())
        _write_best(run, chosen, tgt.threads, deploy)
    # search.json and the report
    result = OptimizeResult(
        run.root,
        selection,
        resumed,
        ran=[k for rec in state.tasks for k in rec.get("ran", [])],
        skipped=[k for rec in state.tasks for k in rec.get("skipped", [])],
        search=_search_record(obj, search, budget, where, profile, state),
    )
    write_json(run.search_json, result.search)

    result.report_md, result.report_html = write_report(run.root)
    return result


def _check(max_quality_drop: float, gates: str, profile: str, search: str) -> None:
    """Refuse bad arguments before any work."""

    if not 0 <= max_quality_drop < 1:
        raise ValueError(f"--max-quality-drop must be a fraction in [0, 1), got {max_quality_drop}")
    if gates not in GATE_PRESETS:
        raise ValueError(f"unknown gate preset {gates!r}; choose one of {', '.join(GATE_PRESETS)}")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if search not in MODES:
        raise ValueError(f"unknown search {search!r}; choose one of {', '.join(MODES)}")


def _threads_for(run: RunDir, progress: Progress | None) -> int:
    """Threads for a CPU run given none: a resumed run keeps the count it started with (its
    identity and its measurements depend on it); a new one probes the machine now."""
    if run.run_json.exists():
        recorded = (read_json(run.run_json).get("settings") or {}).get("threads")
        if isinstance(recorded, int) and recorded > 0:
            return recorded
    threads, why = choose_threads(usable_cores())
    if why and progress:
        progress("note", "", "", why)
    return threads


def _inspect(model: str | Path, target: str, threads: int | None):
    """The model (a built-in name is resolved and prepared; the name is kept) and the target."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # preparing a built-in: our progress, not per-tensor bars
    return inspect_model(model), detect_target(target, threads)


def _plan(run: RunDir, info, tgt, only: list[str] | None) -> Plan:
    """plan.json, and candidates/<id>/candidate.json for each planned candidate."""

    plan = make_plan(info, tgt, only=only, settings={"threads": tgt.threads})
    write_json(run.plan_json, plan.to_dict())
    for cand in plan.candidates:
        f = run.candidate(cand.id).stage_file("candidate")
        if not f.exists():
            write_json(f, cand.to_dict())
    return plan


def _search(
    run: RunDir,
    plan: Plan,
    budget: Budget,
    obj: Objective,
    max_quality_drop: float,
    search: str,
    ctx: dict[str, Any],
    ray_address: str | None,
    progress: Progress | None,
) -> tuple[SearchState, dict[str, Any]]:
    """Run the search on this machine's workers or on Ray; return what it did and where."""

    executor = make_executor(ray_address, plan.target.threads, progress)
    try:
        state = run_search(
            run, plan.candidates, executor, budget, obj, max_quality_drop, search, ctx
        )
        return state, executor.describe()
    finally:
        executor.close()


def _select(
    run: RunDir,
    plan: Plan,
    max_quality_drop: float,
    obj: Objective,
    ctx: dict[str, Any],
    state: SearchState,
) -> Selection:
    """selection.json: the choice from the full-fidelity results, with a reason per candidate."""

    inp = SelectionInput.from_run(run, plan.candidates, max_quality_drop, obj.name, ctx, state.cut)
    sel = select(inp)
    write_json(run.selection_json, sel.to_dict())
    return sel


def _search_record(
    obj: Objective,
    search: str,
    budget: Budget,
    where: dict[str, Any],
    profile: str,
    state: SearchState,
) -> dict[str, Any]:
    """What search.json holds: how the search was set up and what it did."""
    return {
        "objective": obj.name,
        "search": search,
        "budget": budget.to_dict(),
        "executor": where,
        "profile": profile,
        "fidelities": {
            "1 (screen)": SCREEN[profile].to_dict(),
            "2 (full)": PROFILES[profile].to_dict(),
        },
        **state.to_dict(),
    }


def _write_best(run: RunDir, cand: Candidate, threads: int, deploy: bool) -> None:
    """best/ = the chosen artifact (hard links where possible: no second copy on disk), its
    launch configuration, and the deploy bundle (llmopt.deploy)."""
    info = read_json(run.model_json)
    bench = run.candidate(cand.id).read("bench")
    launch = _launch(cand, info, run.best.resolve(), bench)
    if info.get("task") == "embedding" and (
        t := _embedding_threshold(run.candidate(cand.id).read("verify"))
    ):
        launch["similarity_threshold"] = t
    write_best(run.best, cand, run.candidate(cand.id).artifact, run.model_json, launch)
    if deploy:
        write_json(run.best / "deploy.json", _deploy(run, threads))


def _retrieval_options(options: dict[str, Any]) -> dict[str, Any]:
    """The retrieval options with absolute file paths, checked now (a bad file fails here,
    not in every candidate's verify stage)."""
    out = dict(options)
    for key in ("pairs", "queries", "corpus"):
        if out.get(key) is not None:
            out[key] = str(Path(out[key]).resolve())
    RetrievalSpec.from_options(**out)
    return out


def _embedding_threshold(verify: dict | None) -> dict[str, Any] | None:
    """The user's threshold and the chosen candidate's recalibrated one, from its verify.json."""
    metrics = {m["name"]: m for m in (verify or {}).get("metrics", [])}
    rec = metrics.get("recalibrated_threshold")
    if rec is None:
        return None
    agree = metrics.get("recalibrated_agreement") or {}
    lo, hi = rec.get("ci_low"), rec.get("ci_high")  # of the shift from the reference's
    return {
        "threshold": rec["candidate"],
        "reference_threshold": rec["reference"],
        "ci95": None if lo is None else [rec["reference"] + lo, rec["reference"] + hi],
        "agreement": agree.get("candidate"),
        "agreement_as_is": (metrics.get("decision_agreement") or {}).get("candidate"),
        "percentile_threshold": (metrics.get("percentile_threshold") or {}).get("candidate"),
        "why": "compare cosine similarity against this threshold in the application: it keeps "
        "the reference's decisions at reference_threshold best (llmopt verify --threshold)",
    }


def _launch(
    cand: Candidate, info: dict[str, Any], best: Path, bench: dict | None
) -> dict[str, Any]:
    """How to run the chosen candidate: in Python, and served (`llmopt serve`), with the
    scheduler's batch limit set to the batch size that measured the most throughput."""
    import re

    out: dict[str, Any] = {
        "engine": cand.engine,
        "recipe": cand.recipe,
        "settings": cand.settings.to_dict(),
        "artifact": "artifact",
        "python": f"from llmopt.engines import load_best; runner = load_best({str(best)!r})",
    }
    threads = cand.settings.threads
    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    cmd = f"llmopt serve {best} --host 127.0.0.1 --port 8000"
    why = "batch limit left at the server's default (one batch size measured)"
    per_b = {1: 0.0}
    for name, st in ((bench or {}).get("metrics") or {}).items():
        m = re.fullmatch(r"decode_tokens_per_s(?:_b(\d+))?", name)
        if m:
            per_b[int(m.group(1) or 1)] = st["median"]
    if info.get("task") == "causal-lm" and len(per_b) > 1:
        b = max(per_b, key=per_b.get)
        cmd += f" --max-num-seqs {b}"
        why = (
            f"--max-num-seqs {b}: the batch size with the most decode throughput measured "
            f"({', '.join(f'b{k} {v:.1f}/s' for k, v in sorted(per_b.items()))})"
        )
    api = (
        "/v1/completions, /v1/chat/completions"
        if info.get("task") == "causal-lm"
        else ("/v1/embeddings")
    )
    out["serve"] = {"command": cmd, "env": env, "api": f"OpenAI-compatible {api}", "scheduler": why}
    if info.get("task") == "causal-lm" and not served_by_llmopt(cand.engine):
        # `llmopt serve` refuses this artifact (serve.server.batching_engine says why): the
        # closest it serves is the source model on the native engine with the same recipe.
        out["serve"]["command"] = (
            f"llmopt serve {info.get('path')} --recipe {cand.recipe} --host 127.0.0.1 --port 8000"
        )
        out["serve"]["note"] = (
            f"the {cand.engine} engine's artifact is not served by llmopt yet: this serves the "
            f"source model with the {cand.recipe} recipe on the native engine, "
            "not what the run measured for the chosen candidate"
        )
    return out


def _deploy(run: RunDir, threads: int) -> dict[str, Any]:
    """Write best/deploy (llmopt.deploy.write_bundle); return what happened, never raise."""
    try:
        src = resolve_source(run.root)
        res = write_bundle(src, run.best / "deploy", Target.cpu_host(threads), validate=True)
        return {
            "written": True,
            "path": "deploy",
            "ok": res.ok,
            "checks": [c.to_dict() for c in res.checks],
            "files": res.files,
        }
    except Exception as e:  # a bundle that cannot be written must not fail the run
        hint = getattr(e, "hint", None)
        return {"written": False, "reason": f"{type(e).__name__}: {e}", "hint": hint}
