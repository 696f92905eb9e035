"""`optimize`: the main job, top to bottom.

    inspect -> plan -> search (build, screen, verify, bench per candidate) -> select -> best/ -> report

The search (`llmopt.optimize.loop`) screens every candidate cheaply, then fully verifies and
benchmarks the survivors, within `--time-budget`. Each candidate stage runs in its own process
(`llmopt.optimize.worker`), locally or as Ray tasks, and leaves its JSON in the run directory; re-running
the same command skips every stage whose JSON exists, so a killed run resumes where it stopped and
a finished one returns at once.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt import __version__
from llmopt.core.atomic import read_json, write_json
from llmopt.core.schema import BenchResult, Candidate, Selection, VerifyResult
from llmopt.rundir.best import write_best
from llmopt.rundir.paths import RunDir

__all__ = ["optimize", "reverify", "OptimizeResult", "PROFILES", "SCREEN", "versions"]

log = logging.getLogger(__name__)


def reverify(run_dir: str | Path, progress: Progress | None = None, ray_address: str | None = None):
    """Re-check a finished run's choice with today's libraries (`llmopt.optimize.reverify`)."""
    from llmopt.optimize.reverify import reverify as _reverify

    return _reverify(run_dir, progress, ray_address)


# Sizes of the verification and benchmark work. "full" is the default; "quick" is for tests and
# smoke runs (still >= 1000 sentences for embeddings, so the cosine statistics mean something).
PROFILES: dict[str, dict[str, Any]] = {
    "full": {
        "eval_windows": 16,
        "window": 512,
        "sentences": 2000,
        "bench_sentences": 512,
        "bench_repeats": 3,  # x (1 + 1 warm-up); 3 keeps a 15-minute search within budget
        "prompt_tokens": 100,
        "new_tokens": 64,
        "bench_batch_sizes": [1, 4],  # throughput vs concurrency for the throughput objective
    },
    "quick": {
        "eval_windows": 4,
        "window": 256,
        "sentences": 1000,
        "bench_sentences": 128,
        "bench_repeats": 3,
        "prompt_tokens": 64,
        "new_tokens": 32,
        "bench_batch_sizes": [1],
    },
}
# The search's cheap first rung (fidelity 1) for each profile: a quarter of the evaluation
# tokens or sentences, short benchmarks. Full fidelity (2) is the profile itself.
SCREEN: dict[str, dict[str, Any]] = {
    "full": {
        "eval_windows": 4,
        "window": 256,
        "sentences": 500,
        "bench_sentences": 128,
        "bench_repeats": 2,
        "prompt_tokens": 64,
        "new_tokens": 24,
        "generation_prompts": 0,  # greedy-match generation is left to full fidelity
        "bench_batch_sizes": [1],
    },
    "quick": {
        "eval_windows": 2,
        "window": 128,
        "sentences": 250,
        "bench_sentences": 64,
        "bench_repeats": 2,
        "prompt_tokens": 32,
        "new_tokens": 12,
        "generation_prompts": 0,  # greedy-match generation is left to full fidelity
        "bench_batch_sizes": [1],
    },
}

# progress(event, candidate_id, stage, detail): event is "start", "done", "skip" or "fail".
Progress = Callable[[str, str, str, str], None]


@dataclass
class OptimizeResult:
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
        time_budget: wall-clock budget of this call ("15m", "1h", seconds); None: unlimited.
        search: "halving" (screen all, fully verify the survivors) or "exhaustive".
        ray_address: None (local worker processes), "local" (start a Ray instance here) or the
            address of a Ray cluster; candidates then run as Ray tasks.
        price_per_hour: the target's price, for the cost objective (default: relative units).
        deploy: write the deploy bundle into best/deploy (causal LMs).
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
    from llmopt.model.info import inspect_model
    from llmopt.optimize.budget import Budget, parse_duration
    from llmopt.optimize.executor import make_executor
    from llmopt.optimize.loop import MODES, run_search
    from llmopt.optimize.objective import get_objective
    from llmopt.optimize.plan import detect_target, make_plan

    if not 0 <= max_quality_drop < 1:
        raise ValueError(f"--max-quality-drop must be a fraction in [0, 1), got {max_quality_drop}")
    from llmopt.verify.gates import GATE_PRESETS

    if gates not in GATE_PRESETS:
        raise ValueError(f"unknown gate preset {gates!r}; choose one of {', '.join(GATE_PRESETS)}")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if search not in MODES:
        raise ValueError(f"unknown search {search!r}; choose one of {', '.join(MODES)}")
    obj = get_objective(objective)
    budget = Budget.since(parse_duration(time_budget), budget_started_at)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # preparing a built-in: our progress, not per-tensor bars
    info = inspect_model(model)  # resolves (and prepares) a built-in name; keeps the name
    path = Path(info.path)
    tgt = detect_target(target, threads)
    settings = {
        **PROFILES[profile],
        "profile": profile,
        "max_quality_drop": max_quality_drop,
        "gates": gates,
        "threads": tgt.threads,
        "fidelities": {"screen": SCREEN[profile]},
    }  # part of the run's identity: a resume must not mix them
    run = RunDir(out)
    resumed = run.open(_run_meta(model, path, info, tgt, settings), force=force)
    write_json(run.model_json, info.to_dict())
    _doctor(run, target)
    plan = make_plan(info, tgt, only=candidates, settings={"threads": tgt.threads})
    write_json(run.plan_json, plan.to_dict())
    for cand in plan.candidates:
        f = run.candidate(cand.id).stage_file("candidate")
        if not f.exists():
            write_json(f, cand.to_dict())

    ctx = {"price_per_hour": price_per_hour}
    executor = make_executor(ray_address, tgt.threads, progress)
    try:
        state = run_search(run, plan.candidates, executor, budget, obj, max_quality_drop,
                           search, ctx)  # fmt: skip
        where = executor.describe()
    finally:
        executor.close()
    result = OptimizeResult(run.root, selection=None, resumed=resumed)  # type: ignore[arg-type]
    for rec in state.tasks:
        result.ran += rec.get("ran", [])
        result.skipped += rec.get("skipped", [])
    result.selection = _select(run, plan.candidates, max_quality_drop, obj.name, ctx, state.cut)
    if result.selection.chosen:
        chosen = next(c for c in plan.candidates if c.id == result.selection.chosen)
        _write_best(run, chosen, tgt.threads, deploy)
    result.search = {
        "objective": obj.name,
        "search": search,
        "budget": budget.to_dict(),
        "executor": where,
        "profile": profile,
        "fidelities": {"1 (screen)": SCREEN[profile], "2 (full)": PROFILES[profile]},
        **state.to_dict(),
    }
    write_json(run.search_json, result.search)
    from llmopt.report import write_report

    result.report_md, result.report_html = write_report(run.root)
    return result


def _run_meta(model, path: Path, info, tgt, settings: dict[str, Any]) -> dict[str, Any]:
    """run.json: identity (model fingerprint, target, settings) plus what reproduces the run."""
    argv = " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "llmopt" else None
    from llmopt.verify.stats import DEFAULT_SEED

    return {
        "llmopt_version": __version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": f"llmopt {argv}" if argv else f"optimize({str(model)!r}, target={tgt.device!r})",
        "model": str(model),
        "model_path": str(path),
        "model_fingerprint": info.fingerprint,
        "target": tgt.device,
        "max_quality_drop": settings["max_quality_drop"],
        "settings": settings,
        "versions": versions(),
        "seeds": {
            "bootstrap": DEFAULT_SEED,
            "data": "fixed article split (llmopt.assets.text)",
            "decoding": "greedy",
        },  # fmt: skip
        "hardware": hardware_fingerprint(tgt),
    }


def versions() -> dict[str, str | None]:
    """Versions of llmopt, Python and every library a candidate's numbers depend on."""
    from importlib import metadata

    out: dict[str, str | None] = {"llmopt": __version__, "python": platform.python_version()}
    for dist in ("torch", "transformers", "numpy", "onnxruntime", "onnx", "safetensors",
                 "llama-cpp-python", "vllm", "ray"):  # fmt: skip
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def hardware_fingerprint(tgt) -> dict[str, Any]:
    """The facts that make two machines comparable, and a short hash of them."""
    facts = {"device": tgt.device, "cpu": tgt.cpu, "threads": tgt.threads,
             "cores": os.cpu_count(), "memory_gib": round(tgt.memory_bytes / 2**30),
             "features": sorted(tgt.features), "gpu": (tgt.gpu or {}).get("name"),
             "machine": platform.machine()}  # fmt: skip
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return {**facts, "fingerprint": digest}


def _doctor(run: RunDir, target: str) -> None:
    """doctor.json once per run: the environment section of the report."""
    if run.doctor_json.exists():
        return
    try:
        from llmopt.doctor import run_doctor

        write_json(run.doctor_json, run_doctor(target if target in ("cpu", "cuda") else "auto")
                   .to_dict())  # fmt: skip
    except Exception as e:  # the report says the environment is unknown; the run goes on
        log.warning("doctor failed: %s", e)
        write_json(run.doctor_json, {"error": f"{type(e).__name__}: {e}", "findings": []})


def _results(run: RunDir, cands: list[Candidate], fidelity: str = "full"):
    """verify, bench and errors ("stage (fidelity): message") by candidate id at `fidelity`
    (the full selection also counts failures at the screen)."""
    allowed = (fidelity,) if fidelity == "reverify" else ("full", "screen")
    verify, bench, errors = {}, {}, {}
    for c in cands:
        cdir = run.candidate(c.id)
        e = cdir.read("error")
        if e is not None and e.get("fidelity", "full") in allowed:
            fid = e.get("fidelity", "full")
            errors[c.id] = (
                f"{e['stage']}" + ("" if fid == "full" else f" ({fid})") + f": {e['error']}"
            )
        if (v := cdir.read("verify", fidelity)) is not None:
            verify[c.id] = VerifyResult.from_dict(v)
        if (b := cdir.read("bench", fidelity)) is not None:
            bench[c.id] = BenchResult.from_dict(b)
    return verify, bench, errors


def _select(run: RunDir, cands: list[Candidate], max_quality_drop: float, objective: str,
            ctx: dict[str, Any], cut: dict[str, str]) -> Selection:  # fmt: skip
    from llmopt.optimize.select import select

    verify, bench, errors = _results(run, cands)
    screen = {c.id: BenchResult.from_dict(b) for c in cands
              if (b := run.candidate(c.id).read("bench", "screen")) is not None}  # fmt: skip
    sel = select(cands, verify, bench, errors, max_quality_drop, objective, ctx, cut, screen)
    write_json(run.selection_json, sel.to_dict())
    return sel


def _write_best(run: RunDir, cand: Candidate, threads: int, deploy: bool) -> None:
    """best/ = the chosen artifact (hard links where possible: no second copy on disk), its
    launch configuration, and the deploy bundle (llmopt.deploy) for causal LMs."""
    info = read_json(run.model_json)
    bench = run.candidate(cand.id).read("bench")
    launch = _launch(cand, info, run.best.resolve(), bench)
    write_best(run.best, cand, run.candidate(cand.id).artifact, run.model_json, launch)
    if deploy:
        write_json(run.best / "deploy.json", _deploy(run, threads))


def _launch(
    cand: Candidate, info: dict[str, Any], best: Path, bench: dict | None
) -> dict[str, Any]:
    """How to run the chosen candidate: in Python, and served (`llmopt serve`), with the
    scheduler's batch limit set to the batch size that measured the most throughput."""
    import re

    out: dict[str, Any] = {
        "engine": cand.engine,
        "recipe": cand.recipe,
        "settings": cand.settings,
        "artifact": "artifact",
        "python": f"from llmopt.engines import load_best; runner = load_best({str(best)!r})",
    }
    threads = cand.settings.get("threads")
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
        why = (f"--max-num-seqs {b}: the batch size with the most decode throughput measured "
               f"({', '.join(f'b{k} {v:.1f}/s' for k, v in sorted(per_b.items()))})")  # fmt: skip
    api = "/v1/completions, /v1/chat/completions" if info.get("task") == "causal-lm" else (
        "/v1/embeddings")  # fmt: skip
    out["serve"] = {"command": cmd, "env": env, "api": f"OpenAI-compatible {api}",
                    "scheduler": why}  # fmt: skip
    return out


def _deploy(run: RunDir, threads: int) -> dict[str, Any]:
    """Write best/deploy (llmopt.deploy.write_bundle); return what happened, never raise."""
    try:
        from llmopt.deploy import resolve_source, write_bundle
        from llmopt.planning.target import ServingTarget

        src = resolve_source(run.root)
        res = write_bundle(src, run.best / "deploy", ServingTarget.cpu(threads), validate=True)
        return {"written": True, "path": "deploy", "ok": res.ok,
                "checks": [c.to_dict() for c in res.checks], "files": res.files}  # fmt: skip
    except Exception as e:  # e.g. embedders: bundles serve causal LMs today
        hint = getattr(e, "hint", None)
        return {"written": False, "reason": f"{type(e).__name__}: {e}", "hint": hint}
