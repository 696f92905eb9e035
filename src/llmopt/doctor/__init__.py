"""`llmopt doctor`: can this machine run what we plan? Findings with evidence and fixes.

Two steps, kept apart so a recorded machine replays exactly:

    collect_facts()            probes (files, NVML or nvidia-smi, torch, package metadata) -> JSON
    diagnose(facts, target)    pure checks -> DoctorReport (findings: ok / warn / fail)

>>> report = run_doctor(target="cpu")           # doctest: +SKIP
>>> report.get("gpu.driver").status, report.exit_code   # doctest: +SKIP
('ok', 0)
"""

from __future__ import annotations

import os
from typing import Any

from llmopt.doctor.checks_gpu import NO_GPU_STATUS, gpu_findings, likely_causes
from llmopt.doctor.checks_host import host_findings
from llmopt.doctor.report import DoctorReport, Finding, Status
from llmopt.hardware import gpu
from llmopt.hardware import host as probe

__all__ = [
    "collect_facts",
    "diagnose",
    "run_doctor",
    "DoctorReport",
    "Finding",
    "Status",
    "TARGETS",
    "NO_GPU_STATUS",
    "likely_causes",
]

TARGETS = ("auto", "cpu", "cuda")
_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "LD_LIBRARY_PATH",
)


def collect_facts(*, use_torch: bool = True, nvml: Any = None) -> dict[str, Any]:
    """Probe this machine. Never raises for missing tools or drivers; absence is recorded.

    Args:
        use_torch: also ask torch what it sees (imports torch: ~1-2 s).
        nvml: a pynvml-like module to read instead of the real one (tests replay recordings).

    >>> facts = collect_facts(use_torch=False)      # doctest: +SKIP
    >>> sorted(facts)[:3]                            # doctest: +SKIP
    ['container', 'cpu', 'disk']
    """

    nvml_facts, nvml_answers = gpu.probe_nvml(nvml)
    # nvidia-smi only when NVML did not answer: it reads the same library, so it adds nothing then.
    smi = (
        gpu.probe_nvidia_smi()
        if not nvml_facts["ok"]
        else {"ok": False, "error": "not needed (NVML answered)", "devices": []}
    )
    return {
        "host": probe.probe_host(),
        "cpu": probe.probe_cpu(),
        "memory": probe.probe_memory(),
        "disk": probe.probe_disk(),
        "packages": probe.probe_packages(),
        "container": probe.probe_container(),
        "driver_traces": probe.probe_driver_traces(),
        "env": {k: os.environ.get(k) for k in _ENV},
        "nvml": nvml_facts,
        "nvml_answers": nvml_answers,
        "nvidia_smi": smi,
        "torch": gpu.probe_torch() if use_torch else None,
        "build_tools": probe.probe_build_tools(),
    }


def diagnose(facts: dict[str, Any], target: str = "auto") -> DoctorReport:
    """Judge recorded or live facts for `target`.

    Args:
        facts: from `collect_facts`, or loaded from a recorded JSON file.
        target: "auto" (default), "cpu" or "cuda". It decides how a missing GPU is judged:
            cpu -> ok, auto -> warn, cuda -> fail.

    Raises:
        ValueError: unknown target.

    >>> import json                                              # doctest: +SKIP
    >>> r = diagnose(json.load(open("tests/fixtures/doctor/facts_h200.json")), "cuda")  # doctest: +SKIP
    >>> r.gpus[0]["compute_capability"]                          # doctest: +SKIP
    '9.0'
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")
    g_findings, gpus, device, compat = gpu_findings(facts, target)
    findings = host_findings(facts, target, bool(gpus)) + g_findings
    return DoctorReport(target, findings, facts, gpus, device, compat)


def run_doctor(target: str = "auto", *, use_torch: bool = True) -> DoctorReport:
    """Probe this machine and judge it: `diagnose(collect_facts(), target)`.

    Args:
        target: "auto", "cpu" or "cuda".
        use_torch: ask torch too (slower to start, but says which device cuda:0 is).
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")
    return diagnose(collect_facts(use_torch=use_torch), target)
