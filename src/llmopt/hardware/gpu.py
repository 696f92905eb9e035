"""GPU probes: NVML (nvidia-ml-py), `nvidia-smi` as the fallback, and what torch sees.

NVML is read in two steps so tests can replay a real GPU: `record_nvml` calls each NVML function
and keeps the raw answer or the error text (plain JSON, a fixture when saved), and
`interpret_nvml` turns those answers into the normalized GPU records the checks use.

>>> facts = interpret_nvml({"init_error": "NVML Shared Library Not Found"})
>>> facts["ok"], facts["error"]
(False, 'NVML Shared Library Not Found')
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

__all__ = [
    "record_nvml",
    "interpret_nvml",
    "probe_nvml",
    "SMI_FIELDS",
    "parse_nvidia_smi",
    "probe_nvidia_smi",
    "probe_torch",
    "DEVICE_CALLS",
]

GiB = 2**30
# Answer key -> (NVML function, names of pynvml constants passed after the handle).
DEVICE_CALLS: dict[str, tuple[str, tuple[str, ...]]] = {
    "name": ("nvmlDeviceGetName", ()),
    "uuid": ("nvmlDeviceGetUUID", ()),
    "pci": ("nvmlDeviceGetPciInfo", ()),
    "cc": ("nvmlDeviceGetCudaComputeCapability", ()),
    "memory": ("nvmlDeviceGetMemoryInfo", ()),
    "mig_mode": ("nvmlDeviceGetMigMode", ()),
    "ecc_mode": ("nvmlDeviceGetEccMode", ()),
    "ecc_uncorrected_volatile": (
        "nvmlDeviceGetTotalEccErrors",
        ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
    ),
    "ecc_uncorrected_aggregate": (
        "nvmlDeviceGetTotalEccErrors",
        ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
    ),
    "temperature_c": ("nvmlDeviceGetTemperature", ("NVML_TEMPERATURE_GPU",)),
    "power_limit_mw": ("nvmlDeviceGetPowerManagementLimit", ()),
    "processes": ("nvmlDeviceGetComputeRunningProcesses", ()),
}
SYSTEM_CALLS = {
    "driver_version": "nvmlSystemGetDriverVersion",
    "cuda_driver_version": "nvmlSystemGetCudaDriverVersion",
    "nvml_version": "nvmlSystemGetNVMLVersion",
}


def _plain(v: Any) -> Any:
    """NVML answers (bytes, ctypes structs, tuples) as JSON values."""
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if hasattr(v, "_fields_"):
        return {name: _plain(getattr(v, name)) for name, *_ in v._fields_}
    return v


def record_nvml(nvml: Any = None) -> dict[str, Any]:
    """Call every NVML function doctor uses and keep each raw answer or its error text.

    Args:
        nvml: the pynvml module (default: import it). Tests pass a replay of recorded answers.

    Returns:
        {"library": ..., "system": {key: {"value"|"error"}}, "devices": [{key: ...}]}, or
        {"init_error": "..."} when NVML cannot start (no bindings, no driver).
    """
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py's module name
        except ImportError:
            return {"init_error": "nvidia-ml-py is not installed (pip install 'llmopt[gpu]')"}
    try:
        nvml.nvmlInit()
    except Exception as e:  # pynvml raises NVMLError subclasses; the text is the evidence
        return {"init_error": str(e) or type(e).__name__}

    def call(fn: str, *args: Any) -> dict[str, Any]:
        try:
            return {"value": _plain(getattr(nvml, fn)(*args))}
        except Exception as e:
            return {"error": str(e) or type(e).__name__}

    try:
        out: dict[str, Any] = {
            "library": getattr(nvml, "__name__", "pynvml"),
            "system": {k: call(fn) for k, fn in SYSTEM_CALLS.items()},
            "devices": [],
        }
        count = call("nvmlDeviceGetCount")
        out["system"]["count"] = count
        for i in range(count.get("value") or 0):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            dev = {}
            for key, (fn, consts) in DEVICE_CALLS.items():
                dev[key] = call(fn, h, *(getattr(nvml, c) for c in consts))
            out["devices"].append(dev)
        return out
    finally:
        nvml.nvmlShutdown()


def _v(answer: dict[str, Any] | None) -> Any:
    return None if not answer else answer.get("value")


def _mode(answer: dict[str, Any] | None) -> str | None:
    value = _v(answer)  # (current, pending); 1 = enabled
    return None if value is None else ("enabled" if value[0] else "disabled")


def interpret_nvml(answers: dict[str, Any]) -> dict[str, Any]:
    """Normalize recorded NVML answers into the GPU records the checks read.

    Args:
        answers: the output of `record_nvml` (live or loaded from a fixture).
    """
    if "init_error" in answers:
        return {"ok": False, "error": answers["init_error"], "devices": []}
    sysa = answers.get("system", {})
    cuda = _v(sysa.get("cuda_driver_version"))  # e.g. 13000 -> "13.0"
    devices = []
    for i, d in enumerate(answers.get("devices", [])):
        mem = _v(d.get("memory")) or {}
        cc = _v(d.get("cc"))
        procs = _v(d.get("processes")) or []
        devices.append(
            {
                "index": i,
                "name": _v(d.get("name")),
                "uuid": _v(d.get("uuid")),
                "pci_bus_id": (_v(d.get("pci")) or {}).get("busId"),
                "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
                "memory_total_bytes": mem.get("total"),
                "memory_used_bytes": mem.get("used"),
                "mig_mode": _mode(d.get("mig_mode")),
                "ecc_mode": _mode(d.get("ecc_mode")),
                "ecc_uncorrected_volatile": _v(d.get("ecc_uncorrected_volatile")),
                "ecc_uncorrected_aggregate": _v(d.get("ecc_uncorrected_aggregate")),
                "temperature_c": _v(d.get("temperature_c")),
                "power_limit_w": (_v(d.get("power_limit_mw")) or 0) / 1000 or None,
                "processes": len(procs),
                "source": "nvml",
            }
        )
    return {
        "ok": True,
        "error": None,
        "driver_version": _v(sysa.get("driver_version")),
        "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
        "devices": devices,
    }


def probe_nvml(nvml: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(normalized facts, raw answers) from NVML. See `record_nvml` for `nvml`."""
    answers = record_nvml(nvml)
    return interpret_nvml(answers), answers


SMI_FIELDS = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "driver_version",
    "memory.total",
    "memory.used",
    "compute_cap",
    "mig.mode.current",
    "ecc.mode.current",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.uncorrected.aggregate.total",
    "temperature.gpu",
    "power.limit",
)


def _smi_value(raw: str) -> str | None:
    raw = raw.strip()
    return None if raw.strip("[]") in ("N/A", "Not Supported", "Unknown Error", "") else raw


def _mib(row: dict[str, str | None], k: str) -> int | None:
    return int(float(row[k])) * 2**20 if row.get(k) else None  # type: ignore[arg-type]


def _num(row: dict[str, str | None], k: str) -> int | None:
    return int(float(row[k])) if row.get(k) else None  # type: ignore[arg-type]


def parse_nvidia_smi(csv_text: str, fields: tuple[str, ...] = SMI_FIELDS) -> list[dict[str, Any]]:
    """Parse `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits` into GPU records.

    Args:
        csv_text: the command's standard output.
        fields: the fields asked for, in order.

    >>> parse_nvidia_smi("0, NVIDIA H200, GPU-1, 00000000:00:07.0, 580.1, 143771, 0, 9.0, "
    ...                  "[N/A], Enabled, 0, 0, 30, 700.00")[0]["compute_capability"]
    '9.0'
    """
    out = []
    for line in csv_text.strip().splitlines():
        row = dict(zip(fields, (_smi_value(x) for x in line.split(",")), strict=False))
        out.append(
            {
                "index": _num(row, "index"),
                "name": row.get("name"),
                "uuid": row.get("uuid"),
                "pci_bus_id": row.get("pci.bus_id"),
                "driver_version": row.get("driver_version"),
                "compute_capability": row.get("compute_cap"),
                "memory_total_bytes": _mib(row, "memory.total"),
                "memory_used_bytes": _mib(row, "memory.used"),
                "mig_mode": (row.get("mig.mode.current") or "").lower() or None,
                "ecc_mode": (row.get("ecc.mode.current") or "").lower() or None,
                "ecc_uncorrected_volatile": _num(row, "ecc.errors.uncorrected.volatile.total"),
                "ecc_uncorrected_aggregate": _num(row, "ecc.errors.uncorrected.aggregate.total"),
                "temperature_c": _num(row, "temperature.gpu"),
                "power_limit_w": float(row["power.limit"]) if row.get("power.limit") else None,
                "processes": None,
                "source": "nvidia-smi",
            }
        )
    return out


def probe_nvidia_smi(timeout: float = 20.0) -> dict[str, Any]:
    """GPU records from the `nvidia-smi` command (when NVML bindings are missing)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"ok": False, "path": None, "error": "nvidia-smi not found on PATH", "devices": []}
    fields = SMI_FIELDS
    cmd = [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0 and "compute_cap" in proc.stdout + proc.stderr:
            # Drivers before ~510 do not know the compute_cap field; ask without it.
            fields = tuple(f for f in SMI_FIELDS if f != "compute_cap")
            cmd[1] = f"--query-gpu={','.join(fields)}"
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            err = (proc.stdout + proc.stderr).strip().splitlines()
            return {
                "ok": False,
                "path": exe,
                "error": err[0] if err else f"exit {proc.returncode}",
                "devices": [],
            }
        banner = subprocess.run([exe], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "path": exe, "error": f"{type(e).__name__}: {e}", "devices": []}
    devices = parse_nvidia_smi(proc.stdout, fields)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", banner.stdout)
    return {
        "ok": True,
        "path": exe,
        "error": None,
        "driver_version": devices[0]["driver_version"] if devices else None,
        "cuda_driver_version": cuda.group(1) if cuda else None,
        "devices": devices,
    }


def probe_torch() -> dict[str, Any] | None:
    """What torch sees: its CUDA build, devices in CUDA order, and the GPU code it ships."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    out: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": False,
        "device_count": 0,
        "arch_list": [],
        "devices": [],
        "error": None,
    }
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        if out["cuda_available"]:
            out["device_count"] = torch.cuda.device_count()
            out["arch_list"] = list(torch.cuda.get_arch_list())
            for i in range(out["device_count"]):
                p = torch.cuda.get_device_properties(i)
                uuid = str(getattr(p, "uuid", "") or "")
                out["devices"].append(
                    {
                        "index": i,
                        "name": p.name,
                        "compute_capability": f"{p.major}.{p.minor}",
                        "memory_total_bytes": int(p.total_memory),
                        "uuid": ("GPU-" + uuid) if uuid and not uuid.startswith("GPU-") else uuid,
                        "multiprocessors": p.multi_processor_count,
                    }
                )
    except (
        Exception
    ) as e:  # a broken driver surfaces here (e.g. "CUDA driver version is insufficient")
        out["error"] = f"{type(e).__name__}: {e}"
    return out
