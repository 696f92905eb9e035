"""`llmopt optimize --reverify RUN`: does a finished run's choice still hold?

The chosen candidate and the reference are verified and benchmarked again at full fidelity with
the libraries installed now (`verify.reverify.json`, `bench.reverify.json`); the verdict, the
objective ratio then and now, and the library versions that changed go to `reverify.json`.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from llmopt.core.atomic import read_json, write_json
from llmopt.core.errors import RunDirError
from llmopt.core.schema import BenchResult, Candidate, Selection
from llmopt.hardware.target import detect_target
from llmopt.optimize.executor import Task, make_executor
from llmopt.optimize.objective import get_objective
from llmopt.optimize.runmeta import hardware_fingerprint, versions
from llmopt.optimize.select import read_results
from llmopt.report import write_report
from llmopt.rundir.paths import RunDir

__all__ = ["reverify"]


def reverify(
    run_dir: str | Path, progress: Any = None, ray_address: str | None = None
) -> dict[str, Any]:
    """Re-verify and re-benchmark the chosen candidate and the reference of a finished run, with
    the libraries installed now, and say whether the choice still holds. Writes `reverify.json`.

    Args:
        run_dir: a run directory `llmopt optimize` finished (it has selection.json).
        progress: optional callback for stage events.
        ray_address: run the two tasks on Ray (see `optimize`).

    Example:
        >>> r = reverify("runs/smollm2-135m")      # doctest: +SKIP
        >>> r["holds"], r["verdict"]               # doctest: +SKIP
        (True, 'the choice still holds: ...')
    """

    run = RunDir(run_dir)
    if not run.selection_json.exists():
        raise RunDirError(
            f"{run.root} has no selection.json", hint="run `llmopt optimize` to the end first"
        )
    meta = read_json(run.run_json)
    sel = Selection.from_dict(read_json(run.selection_json))
    if not sel.chosen:
        raise RunDirError(
            f"{run.root}: nothing was chosen, so there is no choice to re-check",
            hint="look at report.html; relax --max-quality-drop and re-run",
        )
    cands = [Candidate.from_dict(c) for c in read_json(run.plan_json)["candidates"]]
    ref = next(c for c in cands if c.reference)
    ids = [ref.id] + ([sel.chosen] if sel.chosen != ref.id else [])
    for cid in ids:  # a re-check is always measured afresh
        for stage in ("verify", "bench"):
            run.candidate(cid).stage_file(stage, "reverify").unlink(missing_ok=True)
    # The reference's saved outputs are recomputed too: its libraries may have changed.
    (run.candidate(ref.id).root / "reference-outputs.reverify.npz").unlink(missing_ok=True)
    steps = [("verify", "reverify"), ("bench", "reverify")]
    tasks = [Task(cid, steps, "reverify", None if cid == ref.id else ref.id) for cid in ids]
    executor = make_executor(ray_address, int(meta["settings"].get("threads") or 1), progress)
    try:
        executor.run(str(run.root), tasks[:1])  # the reference's outputs first
        executor.run(str(run.root), tasks[1:])
    finally:
        executor.close()
    obj = get_objective(sel.objective)
    by_id = {c.id: c for c in cands}
    now_res = read_results(run, [by_id[i] for i in ids], "reverify")
    v_now, b_now, errors = now_res.verify, now_res.bench, now_res.errors
    b_then = read_results(run, [by_id[i] for i in ids], "full").bench

    def score(b: dict[str, BenchResult]) -> float | None:
        if sel.chosen not in b or ref.id not in b:
            return None
        return obj.score(obj.value(b[sel.chosen]), obj.value(b[ref.id]))

    was, now = score(b_then), score(b_now)
    v = v_now.get(sel.chosen)
    spread = (
        b_now[sel.chosen].metrics[b_now[sel.chosen].primary].spread if sel.chosen in b_now else 0
    )
    problems = [f"{cid}: {e}" for cid, e in errors.items()]
    if v is None:
        problems.append(f"{sel.chosen} could not be re-verified")
    elif not v.passed:
        problems.append(
            f"{sel.chosen} now fails its quality gate (quality drop {v.quality_drop:+.2%})"
        )
    if now is not None and sel.chosen != ref.id and now < 1 - max(spread, 0.05):
        problems.append(f"{sel.chosen} is now {now:.2f}x the reference on {obj.name}")
    holds = not problems
    hw_now = hardware_fingerprint(
        detect_target(meta.get("target", "cpu"), meta["settings"].get("threads"))
    )
    notes = []
    if (meta.get("hardware") or {}).get("fingerprint") not in (None, hw_now["fingerprint"]):
        notes.append("measured on different hardware than the run (see hardware_then/now)")
    then_v = meta.get("versions") or {}
    changed = {k: [then_v.get(k), x] for k, x in versions().items() if then_v.get(k) != x}
    verdict = (
        f"the choice still holds: {sel.chosen} passes its gates"
        + (f" (quality drop {v.quality_drop:+.2%})" if v else "")
        + (f" and is {now:.2f}x the reference on {obj.name}" if now else "")
        + (f" (was {was:.2f}x)" if was else "")
        if holds
        else "the choice no longer holds: " + "; ".join(problems)
    )
    out = {
        "checked": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "chosen": sel.chosen,
        "reference": ref.id,
        "objective": obj.name,
        "holds": holds,
        "verdict": verdict,
        "score_then": was,
        "score_now": now,
        "quality_drop_then": (run.candidate(sel.chosen).read("verify") or {}).get("quality_drop"),
        "quality_drop_now": v.quality_drop if v else None,
        "versions_changed": changed,
        "hardware_then": (meta.get("hardware") or {}).get("fingerprint"),
        "hardware_now": hw_now["fingerprint"],
        "problems": problems,
        "notes": notes,
    }
    write_json(run.reverify_json, out)

    write_report(run.root)
    return out
