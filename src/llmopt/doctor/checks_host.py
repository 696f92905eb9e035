"""Checks of the host: OS, CPU features, memory, disk, installed engines, container runtime.

Each check is a pure function of the facts dict (see `llmopt.doctor.collect_facts`), so a recorded
machine replays through it exactly.
"""

from __future__ import annotations

from typing import Any

from llmopt.doctor.report import Finding
from llmopt.hardware.host import PACKAGES

__all__ = ["host_findings"]

GiB = 2**30
MIN_FREE_RAM = 8 * GiB  # below this even a 3B model in bf16 plus its runtime does not fit
MIN_FREE_DISK = 20 * GiB  # one 8B bf16 checkpoint (16 GB) plus a converted candidate


def _os(f: dict[str, Any], target: str) -> Finding:
    h = f["host"]
    ev = f"{h['os']} {h['kernel']} ({h.get('distro') or 'unknown distribution'}), {h['machine']}, Python {h['python']}"
    if h["os"] != "Linux" and target != "cpu":
        return Finding(
            "host.os",
            "operating system",
            "warn",
            ev,
            "vLLM, SGLang and TensorRT-LLM run on Linux only; use Linux (or WSL2) to serve on GPUs",
        )
    return Finding("host.os", "operating system", "ok", ev)


def _cpu(f: dict[str, Any]) -> Finding:
    c = f["cpu"]
    feats = c["features"]
    ev = (
        f"{c.get('model') or 'unknown CPU'}; {c['usable_cpus']} of {c['logical_cpus']} logical CPUs "
        f"usable; features: {', '.join(feats) or 'none of AVX2/AVX-512/VNNI/AMX'}"
    )
    details = {
        "int8_dot_products": any("VNNI" in x for x in feats),
        "bf16_native": "AVX-512 BF16" in feats or "AMX-BF16" in feats,
        "amx": "AMX" in feats,
    }
    if c.get("flags_read") and "AVX2" not in feats and f["host"]["machine"] in ("x86_64", "AMD64"):
        return Finding(
            "host.cpu",
            "CPU",
            "warn",
            ev,
            "CPU engines (llama.cpp, ONNX Runtime, vLLM CPU) need AVX2 for usable speed; "
            "run on a newer CPU or on a GPU",
            details,
        )
    return Finding("host.cpu", "CPU", "ok", ev, None, details)


def _memory(f: dict[str, Any]) -> Finding:
    m = f["memory"]
    ev = f"{m['total_bytes'] / GiB:.1f} GiB RAM, {m['available_bytes'] / GiB:.1f} GiB available"
    if m["available_bytes"] < MIN_FREE_RAM:
        return Finding(
            "host.memory",
            "RAM",
            "warn",
            ev,
            "close other programs or use a larger machine: loading a model needs its "
            "weights in RAM once (8 GiB covers models up to ~3B in bf16)",
        )
    return Finding("host.memory", "RAM", "ok", ev)


def _disk(f: dict[str, Any]) -> Finding:
    d = f["disk"]
    ev = f"{d['free_bytes'] / GiB:.1f} GiB free of {d['total_bytes'] / GiB:.1f} GiB at {d['path']}"
    if d["free_bytes"] < MIN_FREE_DISK:
        return Finding(
            "host.disk",
            "disk",
            "warn",
            ev,
            "free space or point LLMOPT_HOME / --out at a larger disk: each candidate "
            "writes an artifact about the size of the model",
        )
    return Finding("host.disk", "disk", "ok", ev)


def _engines(f: dict[str, Any]) -> Finding:
    pk = f["packages"]
    have = [f"{PACKAGES[d]} {v}" for d, v in pk.items() if v]
    missing = [PACKAGES[d] for d, v in pk.items() if not v]
    t = f.get("torch") or {}
    if t:
        have = [
            h if not h.startswith("torch ") else f"{h} (CUDA {t.get('cuda') or 'none: CPU build'})"
            for h in have
        ]
    ev = f"installed: {'; '.join(have) or 'none'}. Not installed: {', '.join(missing) or 'none'}"
    return Finding(
        "engines",
        "engines and libraries",
        "ok",
        ev,
        None,
        {"versions": pk, "torch_cuda": t.get("cuda")},
    )


def _container(f: dict[str, Any], gpu_present: bool, target: str) -> Finding:
    c = f["container"]
    tools = {k: v for k, v in c["tools"].items() if v}
    where = (
        f"inside a container ({'; '.join(c['evidence'])})" if c["inside"] else "not in a container"
    )
    ev = (
        f"{where}; tools: {', '.join(tools) or 'no docker/podman/kubectl/NVIDIA container toolkit'}"
    )
    runtime = tools.get("docker") or tools.get("podman") or tools.get("nerdctl")
    toolkit = tools.get("nvidia-ctk") or tools.get("nvidia-container-cli")
    if runtime and gpu_present and not toolkit:
        return Finding(
            "container",
            "container runtime",
            "warn",
            ev,
            "containers will not see the GPU: install the NVIDIA Container Toolkit "
            "(nvidia-ctk), then `sudo nvidia-ctk runtime configure --runtime=docker` "
            "and restart docker; confirm with `docker run --rm --gpus all ubuntu nvidia-smi`",
        )
    return Finding("container", "container runtime", "ok", ev)


def host_findings(facts: dict[str, Any], target: str, gpu_present: bool) -> list[Finding]:
    """Findings about the host, in report order.

    Args:
        facts: from `collect_facts` (or a recorded fixture).
        target: "auto", "cpu" or "cuda".
        gpu_present: whether any probe found an NVIDIA GPU.

    >>> # host_findings(collect_facts(), "cpu", False)[0].id  -> 'host.os'
    """
    return [
        _os(facts, target),
        _cpu(facts),
        _memory(facts),
        _disk(facts),
        _engines(facts),
        _container(facts, gpu_present, target),
    ]
