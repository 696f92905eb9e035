"""The one Target: round trips, old run files and bundles, and doctor's facts."""

from __future__ import annotations

import json

import pytest

from llmopt.hardware.target import NoGpuError, Target, detect_target

GiB = 2**30


def test_target_round_trip_and_old_run_files():
    for t in (
        Target("cpu", threads=2, cpu="test cpu", memory_bytes=8 * GiB, features=["avx2"]),
        Target.gpu_model("H200", 8),
        detect_target("cpu", 3),
    ):
        d = t.to_dict()
        assert Target.from_dict(json.loads(json.dumps(d))) == t
        # optimize's plan.json keys and a deploy bundle's keys are both written
        assert {"device", "threads", "cpu", "memory_bytes", "features", "gpu"} <= set(d)
        assert {"kind", "name", "count", "bandwidth_gbs", "compute_capability", "source"} <= set(d)
    h200 = Target.gpu_model("H200", 8)
    assert (h200.kind, h200.device, h200.name) == ("gpu", "cuda", "H200")
    assert h200.compute_capability == "9.0"
    assert detect_target("cpu", 3).threads == 3
    # a plan.json written before the merge (optimize's Target)
    old = {"device": "cpu", "threads": 2, "cpu": "x", "memory_bytes": 5, "features": []}
    assert Target.from_dict(old) == Target("cpu", 2, "x", 5)
    # a deploy bundle's plan.json target written before the merge (ServingTarget)
    dep = {
        "kind": "gpu",
        "name": "L4",
        "count": 2,
        "memory_bytes": 7,
        "bandwidth_gbs": 300.0,
        "compute_capability": "8.9",
        "source": "spec table",
        "threads": None,
        "features": [],
    }
    t = Target.from_dict(dep)
    assert (t.device, t.name, t.count, t.compute_capability, t.bandwidth_gbs) == (
        "cuda",
        "L4",
        2,
        "8.9",
        300.0,
    )
    with pytest.raises(ValueError, match="use cpu or cuda"):
        Target("tpu")


def test_from_doctor_without_gpu_says_why():
    class Report:
        gpus: list = []

        def get(self, _id):
            class F:
                details = {"likely_causes": [{"cause": "no NVIDIA GPU in this machine"}]}

            return F()

    with pytest.raises(NoGpuError, match="no NVIDIA GPU in this machine"):
        Target.from_doctor(Report())
