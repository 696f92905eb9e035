"""Candidates as Ray tasks on a local two-CPU Ray instance: the tasks are shared between two
worker processes, results land in the same run directory, and a task whose Ray worker dies is
retried once and then reported as failed (never lost)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="pip install 'llmopt[ray]'")

from llmopt.core.atomic import write_json  # noqa: E402
from llmopt.hardware.target import Target  # noqa: E402
from llmopt.model.info import inspect_model  # noqa: E402
from llmopt.optimize.executor import RayExecutor, Task  # noqa: E402
from llmopt.optimize.space import make_plan  # noqa: E402
from llmopt.rundir.paths import RunDir  # noqa: E402

pytestmark = pytest.mark.integration


def _run_dir(root: Path, model: Path) -> tuple[RunDir, list[str]]:
    info = inspect_model(model)
    # Two cheap candidates (hf fp32 and bf16 builds: a few seconds each) for two workers.
    plan = make_plan(info, Target("cpu", 1, "test", 8 * 2**30), only=["hf-bf16"])
    run = RunDir(root)
    run.open(
        {
            "model_fingerprint": info.fingerprint,
            "target": "cpu",
            "model_path": str(model),
            "settings": {"threads": 1, "max_quality_drop": 0.01},
        }
    )
    write_json(run.model_json, info.to_dict())
    write_json(run.plan_json, plan.to_dict())
    for c in plan.candidates:
        write_json(run.candidate(c.id).stage_file("candidate"), c.to_dict())
    return run, [c.id for c in plan.candidates]


@pytest.fixture(scope="module")
def ray_exec():
    ex = RayExecutor("local", cpus_per_task=1, num_cpus=2)
    yield ex
    ex.close()


def test_two_ray_workers_share_candidates(ray_exec, tiny_bert_dir, tmp_path):
    run, ids = _run_dir(tmp_path / "run", tiny_bert_dir)
    assert ray_exec.parallel == 2 and ids == ["hf-fp32", "hf-bf16"]
    recs = ray_exec.run(str(run.root), [Task(cid, [("build", "full")], "build") for cid in ids])
    assert [r["cid"] for r in recs] == ids and all(r["ok"] for r in recs), recs
    for cid in ids:  # the same worker stage code wrote the same files as a local run would
        assert run.candidate(cid).done("build") and any(run.candidate(cid).artifact.iterdir())
        rec = json.loads(run.candidate(cid).task_file("build").read_text())
        assert rec["node_id"] and rec["pid"] != os.getpid()
    pids = {r["pid"] for r in recs}
    assert len(pids) == 2, f"both Ray workers should take candidates, got pids {pids}"
    assert len({r["node_id"] for r in recs}) == 1  # one node, two worker processes
    desc = ray_exec.describe()
    assert desc["executor"] == "ray" and desc["parallel"] == 2


def test_dead_worker_is_retried_once_then_reported(ray_exec, tiny_bert_dir, tmp_path):
    import ray

    run, ids = _run_dir(tmp_path / "run", tiny_bert_dir)
    attempts = tmp_path / "attempts"
    attempts.mkdir()

    def die(run_root: str, task: Task) -> dict:
        (attempts / f"{os.getpid()}").write_text(task.cid)
        os._exit(1)  # the Ray worker process dies mid-task, as an OOM kill would

    real = ray_exec._remote
    ray_exec._remote = ray.remote(num_cpus=1, max_retries=1)(die)
    try:
        (rec,) = ray_exec.run(str(run.root), [Task(ids[1], [("build", "full")], "build")])
    finally:
        ray_exec._remote = real
    assert len(list(attempts.iterdir())) == 2, "one try plus exactly one retry"
    assert rec["ok"] is False and "after 1 retry" in rec["error"]
    err = json.loads(run.candidate(ids[1]).stage_file("error").read_text())
    assert err["stage"] == "build" and "Ray task failed" in err["error"]
    assert run.candidate(ids[1]).task_file("build").exists()
