"""Where candidate tasks run. A task is one candidate's list of (stage, fidelity) steps; each step
runs `python -m llmopt.optimize.worker RUN ID STAGE FIDELITY` in a fresh process, exactly as without Ray,
so a stage's result, error.json and log.txt land in the run directory the same way.

    LocalExecutor   tasks one after another on this machine
    RayExecutor     tasks as Ray tasks (one CPU slot per candidate thread), on a local Ray instance
                    (`--ray local`) or an existing cluster (`--ray-address ADDR`; every node must
                    see the run directory at the same path and have llmopt installed). A task
                    whose Ray worker dies is retried once, then reported as failed with the reason.

Every task leaves `candidates/<id>/task.<fidelity>.json`: where it ran (host, pid, Ray node id),
how long it took, what it ran and skipped; the search reads its estimates from these files.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmopt.core.atomic import read_json, write_json
from llmopt.rundir.paths import RunDir

__all__ = ["Task", "run_task", "LocalExecutor", "RayExecutor", "make_executor", "RAY_MISSING"]

RAY_MISSING = "Ray is not installed: pip install 'llmopt[ray]' (or drop --ray / --ray-address)"

# progress(event, candidate_id, stage, detail): "start", "done", "skip", "fail" or "cut".
Progress = Callable[[str, str, str, str], None]


@dataclass
class Task:
    """One candidate's steps at one rung: [("build", "full"), ("verify", "screen"), ...]."""

    cid: str
    steps: list[tuple[str, str]]
    rung: str  # "screen", "full" or "reverify": names the task file
    reference_id: str | None = None  # None for the reference itself
    # Wall-clock time (epoch seconds) by which the task must end: a stage still running then is
    # killed and the candidate recorded as cut by the time budget (None: no limit).
    deadline: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "cid": self.cid,
            "steps": [list(s) for s in self.steps],
            "rung": self.rung,
            "reference_id": self.reference_id,
            "deadline": self.deadline,
        }


class _OutOfTime(Exception):
    pass


def _spawn(
    run: RunDir, cid: str, stage: str, fidelity: str, deadline: float | None = None
) -> tuple[bool, str]:
    """Run one stage in a child process; its output goes to the candidate's log.txt.

    Raises _OutOfTime when `deadline` passes first (the child is killed; nothing is written, so a
    resumed run with more time runs the stage again).
    """
    cdir = run.candidate(cid)
    cdir.root.mkdir(parents=True, exist_ok=True)
    # The worker ends itself when this process ends (worker._die_with_parent).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMOPT_STAGE_PARENT": str(os.getpid())}
    with open(cdir.log, "a", encoding="utf-8") as log:
        log.write(f"\n=== {stage} ({fidelity}) on {socket.gethostname()} pid {os.getpid()} ===\n")
        log.flush()
        timeout = None if deadline is None else max(1.0, deadline - time.time())
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "llmopt.optimize.worker",
                    str(run.root),
                    cid,
                    stage,
                    fidelity,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                check=False,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            log.write(f"\n=== killed: time budget exhausted during {stage} ({fidelity}) ===\n")
            raise _OutOfTime(f"time budget exhausted during {stage} ({fidelity})") from None
    if proc.returncode == 0 and cdir.done(stage, fidelity):
        return True, ""
    err = cdir.read("error")
    if err is None:  # killed without a word: most often the kernel's out-of-memory killer
        why = f"worker exited with code {proc.returncode}" + (
            " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
        )
        err = {"stage": stage, "fidelity": fidelity, "error": why, "traceback": f"see {cdir.log}"}
        write_json(cdir.stage_file("error"), err)
    return False, err["error"]


def stage_summary(result: dict[str, Any] | None, stage: str) -> str:
    """One short phrase for a finished stage's result, for progress lines: the quality drop of a
    verification, the primary figure of a benchmark ("" for a build or an unreadable result).

    >>> stage_summary({"passed": True, "quality_drop": 0.0049, "metrics": []}, "verify")
    'quality drop 0.49%, passed'
    >>> stage_summary({"primary": "decode_tokens_per_s",
    ...                "metrics": {"decode_tokens_per_s": {"median": 138.1}}}, "bench")
    'decode_tokens_per_s 138.1'
    """
    if not result:
        return ""
    try:
        if stage == "verify":
            verdict = "passed" if result.get("passed") else "failed its gates"
            return f"quality drop {float(result['quality_drop']):.2%}, {verdict}"
        if stage == "bench":
            name = result["primary"]
            return f"{name} {float(result['metrics'][name]['median']):.1f}"
    except (KeyError, TypeError, ValueError):  # an older or partial result: no summary
        return ""
    return ""


def run_task(run_root: str, task: Task, progress: Progress | None = None) -> dict[str, Any]:
    """Run `task`'s steps in order, skipping finished ones; stop at the first failure.

    Returns the task record (also written to `candidates/<id>/task.<rung>.json`).
    """
    run = RunDir(run_root)
    cdir = run.candidate(task.cid)
    t0 = time.perf_counter()
    ran: list[str] = []
    skipped: list[str] = []
    error: str | None = None
    out_of_time: str | None = None
    old = read_json(cdir.task_file(task.rung)) if cdir.task_file(task.rung).exists() else {}
    step_seconds: dict[str, float] = dict(old.get("step_seconds") or {})
    for stage, fid in task.steps:
        key = f"{task.cid}/{stage}" + ("" if fid == "full" else f"@{fid}")
        if cdir.done(stage, fid):
            skipped.append(key)
            progress and progress("skip", task.cid, stage, "already finished")
            continue
        ref = run.candidate(task.reference_id) if task.reference_id else None
        # The reference's verify at this fidelity (an LM's screen may rely on its full one).
        ref_ok = ref is None or ref.done("verify", fid) or ref.done("verify", "full")
        if stage == "verify" and not ref_ok:
            error = "the reference failed, nothing to compare against"
            write_json(
                cdir.stage_file("error"),
                {"stage": stage, "fidelity": fid, "error": error, "traceback": ""},
            )
            progress and progress("fail", task.cid, stage, error)
            break
        progress and progress("start", task.cid, stage, fid)
        t1 = time.perf_counter()
        try:
            ok, detail = _spawn(run, task.cid, stage, fid, task.deadline)
        except _OutOfTime as e:
            out_of_time = str(e)
            progress and progress("cut", task.cid, stage, out_of_time)
            break
        step_seconds[key] = round(time.perf_counter() - t1, 2)
        ran.append(key)
        if ok:
            detail = stage_summary(cdir.read(stage, fid), stage)
        progress and progress("done" if ok else "fail", task.cid, stage, detail)
        if not ok:
            error = f"{stage}: {detail}"
            break
    record = {
        **task.to_dict(),
        "ok": error is None and out_of_time is None,
        "error": error,
        "out_of_time": out_of_time,
        "ran": ran,
        "skipped": skipped,
        "seconds": round(time.perf_counter() - t0, 2),
        "step_seconds": step_seconds,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "node_id": _ray_node_id(),
        "finished": time.time(),
    }
    if ran or not cdir.task_file(task.rung).exists():  # keep the timing of the run that did work
        write_json(cdir.task_file(task.rung), record)
    return record


def _ray_node_id() -> str | None:
    if "ray" not in sys.modules:
        return None
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception as e:  # a record without a node id is still a record
        return f"unknown ({type(e).__name__})"


class LocalExecutor:
    """Tasks one after another in this process's worker children."""

    name = "local"
    parallel = 1

    def __init__(self, progress: Progress | None = None):
        self.progress = progress

    def run(self, run_root: str, tasks: list[Task]) -> list[dict[str, Any]]:
        return [run_task(run_root, t, self.progress) for t in tasks]

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"executor": "local", "parallel": 1, "host": socket.gethostname()}


class RayExecutor:
    """Tasks as Ray tasks; a dead worker is retried once, then reported as failed."""

    name = "ray"

    def __init__(
        self,
        address: str,
        cpus_per_task: int = 1,
        progress: Progress | None = None,
        num_cpus: int | None = None,
    ):
        try:
            import ray
        except ImportError:
            raise ImportError(RAY_MISSING) from None
        self.ray = ray
        self.progress = progress
        self.cpus_per_task = max(1, cpus_per_task)
        self._own = not ray.is_initialized()
        if self._own:
            kw: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "configure_logging": False,
            }
            if address == "local":
                kw.update(num_cpus=num_cpus or os.cpu_count() or 1, object_store_memory=100 * 2**20)
                ray.init(**kw)
            else:
                ray.init(address=address, **kw)
        total = int(ray.cluster_resources().get("CPU", 1))
        self.parallel = max(1, total // self.cpus_per_task)
        self.address = address
        self._remote = ray.remote(num_cpus=self.cpus_per_task, max_retries=1)(run_task)

    def run(self, run_root: str, tasks: list[Task]) -> list[dict[str, Any]]:
        ray = self.ray
        futures = {}
        for i, t in enumerate(tasks):
            self.progress and self.progress("start", t.cid, t.steps[0][0], f"ray ({t.rung})")
            futures[self._remote.remote(str(run_root), t)] = i
        results: list[dict[str, Any]] = [{} for _ in tasks]
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            i = futures[done[0]]
            t = tasks[i]
            try:
                rec = ray.get(done[0])
            except Exception as e:  # the task's worker died twice, or Ray lost it
                rec = self._lost(run_root, t, e)
            event = "done" if rec["ok"] else "fail"
            self.progress and self.progress(event, t.cid, t.steps[-1][0], rec["error"] or "")
            results[i] = rec
        return results

    def _lost(self, run_root: str, t: Task, e: Exception) -> dict[str, Any]:
        why = (
            f"Ray task failed after 1 retry: {type(e).__name__}: " + " ".join(str(e).split())[:300]
        )
        cdir = RunDir(run_root).candidate(t.cid)
        stage = next((s for s, f in t.steps if not cdir.done(s, f)), t.steps[-1][0])
        write_json(cdir.stage_file("error"), {"stage": stage, "error": why, "traceback": ""})
        rec = {
            **t.to_dict(),
            "ok": False,
            "error": f"{stage}: {why}",
            "ran": [],
            "skipped": [],
            "seconds": None,
            "host": None,
            "pid": None,
            "node_id": None,
            "finished": time.time(),
        }
        write_json(cdir.task_file(t.rung), rec)
        return rec

    def close(self) -> None:
        if self._own:
            self.ray.shutdown()

    def describe(self) -> dict[str, Any]:
        nodes = [n["NodeID"] for n in self.ray.nodes() if n.get("Alive")]
        return {
            "executor": "ray",
            "address": self.address,
            "parallel": self.parallel,
            "cpus_per_task": self.cpus_per_task,
            "nodes": nodes,
            "ray_version": self.ray.__version__,
        }


def make_executor(
    ray_address: str | None,
    cpus_per_task: int,
    progress: Progress | None = None,
    num_cpus: int | None = None,
) -> LocalExecutor | RayExecutor:
    """LocalExecutor without an address; RayExecutor for "local" or a cluster address."""
    if not ray_address:
        return LocalExecutor(progress)
    return RayExecutor(ray_address, cpus_per_task, progress, num_cpus)


def task_seconds(run: RunDir, cid: str, rung: str) -> float | None:
    """How long `cid`'s task at `rung` took when it last did work (None if unknown)."""
    f = run.candidate(cid).task_file(rung)
    if not f.exists():
        return None
    rec = read_json(f)
    return sum((rec.get("step_seconds") or {}).values()) or rec.get("seconds")
