"""`optimize`: the main job, top to bottom.

    inspect -> plan -> build -> verify -> bench (per candidate) -> select -> report

Each candidate stage runs in its own process (`llmopt.worker`) and leaves its JSON in the run
directory; re-running the same command skips every stage whose JSON exists, so a killed run
resumes where it stopped and a finished one returns at once.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt import __version__
from llmopt.atomic import atomic_dir, read_json, write_json
from llmopt.rundir import STAGES, RunDir
from llmopt.schema import BenchResult, Candidate, Selection, VerifyResult

__all__ = ["optimize", "OptimizeResult", "PROFILES"]

# Sizes of the verification and benchmark work. "full" is the default; "quick" is for tests and
# smoke runs (still >= 1000 sentences for embeddings, so the cosine statistics mean something).
PROFILES: dict[str, dict[str, Any]] = {
    "full": {
        "eval_windows": 16,
        "window": 512,
        "sentences": 2000,
        "bench_sentences": 512,
        "bench_repeats": 5,
        "prompt_tokens": 100,
        "new_tokens": 128,
    },
    "quick": {
        "eval_windows": 4,
        "window": 256,
        "sentences": 1000,
        "bench_sentences": 128,
        "bench_repeats": 3,
        "prompt_tokens": 64,
        "new_tokens": 32,
    },
}

# progress(event, candidate_id, stage, detail): event is "start", "done", "skip" or "fail".
Progress = Callable[[str, str, str, str], None]


@dataclass
class OptimizeResult:
    run_dir: Path
    selection: Selection
    resumed: bool
    ran: list[str] = field(default_factory=list)  # "<id>/<stage>" executed in this call
    skipped: list[str] = field(default_factory=list)  # "<id>/<stage>" already finished
    report_html: Path | None = None
    report_md: Path | None = None


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
) -> OptimizeResult:
    """Find the fastest deployment of `model` on `target` that keeps quality within budget.

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

    Example:
        >>> r = optimize("minilm-l6", "runs/minilm")        # doctest: +SKIP
        >>> r.selection.chosen                                # doctest: +SKIP
        'onnxruntime-w8a8-dynamic'
    """
    from llmopt.modelinfo import inspect_model
    from llmopt.plan import detect_target, make_plan

    if not 0 <= max_quality_drop < 1:
        raise ValueError(f"--max-quality-drop must be a fraction in [0, 1), got {max_quality_drop}")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # preparing a built-in: our progress, not per-tensor bars
    info = inspect_model(model)  # resolves (and prepares) a built-in name; keeps the name
    path = Path(info.path)
    tgt = detect_target(target, threads)
    settings = {
        **PROFILES[profile],
        "profile": profile,
        "max_quality_drop": max_quality_drop,
        "threads": tgt.threads,
    }  # part of the run's identity: a resume must not mix them
    run = RunDir(out)
    resumed = run.open(_run_meta(model, path, info, tgt.device, settings), force=force)
    write_json(run.model_json, info.to_dict())
    plan = make_plan(info, tgt, only=candidates, settings={"threads": tgt.threads})
    write_json(run.plan_json, plan.to_dict())

    result = OptimizeResult(run.root, selection=None, resumed=resumed)  # type: ignore[arg-type]
    for cand in plan.candidates:
        _run_candidate(run, cand, result, progress)
    result.selection = _select(run, plan.candidates, max_quality_drop)
    from llmopt.report import write_report

    result.report_md, result.report_html = write_report(run.root)
    return result


def _run_meta(model, path: Path, info, device: str, settings: dict[str, Any]) -> dict[str, Any]:
    argv = " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "llmopt" else None
    return {
        "llmopt_version": __version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": f"llmopt {argv}" if argv else f"optimize({str(model)!r}, target={device!r})",
        "model": str(model),
        "model_path": str(path),
        "model_fingerprint": info.fingerprint,
        "target": device,
        "objective": "throughput",
        "max_quality_drop": settings["max_quality_drop"],
        "settings": settings,
    }


def _run_candidate(run: RunDir, cand: Candidate, result: OptimizeResult, progress) -> None:
    cdir = run.candidate(cand.id)
    if not cdir.stage_file("candidate").exists():
        write_json(cdir.stage_file("candidate"), cand.to_dict())
    ref_id = (
        None
        if cand.reference
        else next(
            c.id
            for c in map(Candidate.from_dict, read_json(run.plan_json)["candidates"])
            if c.reference
        )
    )
    for stage in STAGES:
        key = f"{cand.id}/{stage}"
        if cdir.done(stage):
            result.skipped.append(key)
            progress and progress("skip", cand.id, stage, "already finished")
            continue
        if stage == "verify" and ref_id and not run.candidate(ref_id).done("verify"):
            write_json(
                cdir.stage_file("error"),
                {
                    "stage": stage,
                    "error": "the reference failed, nothing to compare against",
                    "traceback": "",
                },
            )
            progress and progress("fail", cand.id, stage, "the reference failed")
            return
        progress and progress("start", cand.id, stage, "")
        ok, detail = _spawn(run, cand.id, stage)
        result.ran.append(key)
        progress and progress("done" if ok else "fail", cand.id, stage, detail)
        if not ok:
            return


def _spawn(run: RunDir, cid: str, stage: str) -> tuple[bool, str]:
    """Run one stage in a child process; its output goes to the candidate's log.txt."""
    cdir = run.candidate(cid)
    cdir.root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(cdir.log, "a", encoding="utf-8") as log:
        log.write(f"\n=== {stage} ===\n")
        log.flush()
        proc = subprocess.run(
            [sys.executable, "-m", "llmopt.worker", str(run.root), cid, stage],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            check=False,
        )
    if proc.returncode == 0 and cdir.done(stage):
        return True, ""
    err = cdir.read("error")
    if err is None:  # killed without a word: most often the kernel's out-of-memory killer
        why = f"worker exited with code {proc.returncode}" + (
            " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
        )
        err = {"stage": stage, "error": why, "traceback": f"see {cdir.log}"}
        write_json(cdir.stage_file("error"), err)
    return False, err["error"]


def _select(run: RunDir, cands: list[Candidate], max_quality_drop: float) -> Selection:
    from llmopt.select import select

    verify, bench, errors = {}, {}, {}
    for c in cands:
        cdir = run.candidate(c.id)
        if (e := cdir.read("error")) is not None:
            errors[c.id] = f"{e['stage']}: {e['error']}"
        if (v := cdir.read("verify")) is not None:
            verify[c.id] = VerifyResult.from_dict(v)
        if (b := cdir.read("bench")) is not None:
            bench[c.id] = BenchResult.from_dict(b)
    sel = select(cands, verify, bench, errors, max_quality_drop)
    write_json(run.selection_json, sel.to_dict())
    if sel.chosen:
        _write_best(run, next(c for c in cands if c.id == sel.chosen))
    return sel


def _write_best(run: RunDir, cand: Candidate) -> None:
    """best/ = the chosen artifact (hard links where possible: no second copy on disk) + launch."""
    src = run.candidate(cand.id).artifact

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    with atomic_dir(run.best) as tmp:
        shutil.copytree(src, tmp / "artifact", copy_function=link_or_copy)
        write_json(tmp / "candidate.json", cand.to_dict())
        shutil.copy2(run.model_json, tmp / "model.json")
        write_json(
            tmp / "launch.json",
            {
                "engine": cand.engine,
                "recipe": cand.recipe,
                "settings": cand.settings,
                "artifact": "artifact",
                "python": "from llmopt.engines import load_best; runner = load_best('RUN/best')",
            },
        )
