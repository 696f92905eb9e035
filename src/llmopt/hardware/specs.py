"""Hardware facts the planner and doctor share: a GPU spec table and compatibility rules.

The GPU table holds datasheet figures (memory bandwidth, dense matrix rates, NVLink) and the
memory `nvidia-smi` reports, with the source of each row. Where doctor finds a real GPU, its
measured memory replaces the table's; the table fills in what NVML cannot tell (bandwidth).

Compatibility rules are data, not code: compute capability to dtypes, engine versions that
dropped older GPUs, driver minimums per CUDA runtime. Each rule names where it comes from.

>>> lookup_gpu("h200").compute_capability
'9.0'
>>> dtype_support("8.0")["fp8"]
False
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from llmopt.core.errors import LlmoptError

__all__ = [
    "GpuSpec",
    "GPUS",
    "lookup_gpu",
    "match_gpu",
    "cc_tuple",
    "dtype_support",
    "DTYPE_MIN_CC",
    "ENGINE_MIN_CC",
    "CUDA_DRIVER_MIN",
    "cuda_driver_minimum",
    "version_at_least",
    "UnknownGpuError",
]

MIB = 2**20


class UnknownGpuError(LlmoptError):
    """`--gpu NAME` is not in the spec table."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. Rates are dense (no sparsity), per GPU.

    Args:
        name: short name used on the command line (`--gpu H200`).
        match: substrings of the name NVML / nvidia-smi report, lower case.
        memory_bytes: total memory as nvidia-smi reports it (slightly above the usable amount).
        bandwidth_gbs: datasheet memory bandwidth, GB/s.
        compute_capability: "major.minor".
        bf16_tflops / fp8_tflops: dense tensor-core rates; None where the dtype is unsupported.
        nvlink_gbs: NVLink bandwidth per GPU (None: PCIe only).
        source: where the figures come from.
    """

    name: str
    match: tuple[str, ...]
    memory_bytes: int
    bandwidth_gbs: float
    compute_capability: str
    bf16_tflops: float | None
    fp8_tflops: float | None
    nvlink_gbs: float | None
    source: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["match"] = list(self.match)
        return d


_DS = "vendor datasheet"
_SMI = "memory: nvidia-smi total as commonly reported; rates: vendor datasheet"
# Most specific names first: "h100 pcie" must win over "h100".
GPUS: dict[str, GpuSpec] = {
    g.name.lower(): g
    for g in (
        GpuSpec("B200", ("b200",), 180 * 10**9, 8000, "10.0", 2250, 4500, 1800, _DS),
        GpuSpec("H200", ("h200",), 143771 * MIB, 4800, "9.0", 989, 1979, 900, _SMI),
        GpuSpec("H100-PCIe", ("h100 pcie",), 81559 * MIB, 2000, "9.0", 756, 1513, None, _SMI),
        GpuSpec("H100", ("h100",), 81559 * MIB, 3350, "9.0", 989, 1979, 900, _SMI),
        GpuSpec(
            "A100-40GB",
            ("a100-sxm4-40gb", "a100-pcie-40gb", "a100 40gb"),
            40960 * MIB,
            1555,
            "8.0",
            312,
            None,
            600,
            _SMI,
        ),
        GpuSpec("A100", ("a100",), 81920 * MIB, 2039, "8.0", 312, None, 600, _SMI),
        GpuSpec("L40S", ("l40s",), 46068 * MIB, 864, "8.9", 362, 733, None, _SMI),
        GpuSpec("L4", ("l4",), 23034 * MIB, 300, "8.9", 121, 242, None, _SMI),
        GpuSpec("A10", ("a10",), 23028 * MIB, 600, "8.6", 125, None, None, _SMI),
        GpuSpec("RTX4090", ("4090",), 24564 * MIB, 1008, "8.9", 165, 330, None, _SMI),
        GpuSpec("T4", ("t4",), 15360 * MIB, 320, "7.5", None, None, None, _SMI),
        GpuSpec("V100", ("v100",), 32768 * MIB, 900, "7.0", None, None, 300, _SMI),
    )
}

# Lowest compute capability with native support (tensor-core matmuls) for each dtype.
# bf16: Ampere (8.0); fp8: Ada/Hopper (8.9); fp4 (NVFP4/MXFP4): Blackwell (10.0); int8 tensor
# cores: Turing (7.5); fp16 tensor cores: Volta (7.0).
DTYPE_MIN_CC: dict[str, tuple[int, int]] = {
    "float32": (0, 0),
    "float16": (7, 0),
    "int8": (7, 5),
    "bfloat16": (8, 0),
    "fp8": (8, 9),
    "fp4": (10, 0),
}

# (engine, first version of the rule, min compute capability, why). Checked by doctor against
# installed versions, and by the planner against the target GPU.
ENGINE_MIN_CC: list[tuple[str, str, tuple[int, int], str]] = [
    ("vllm", "0", (7, 0), "vLLM's GPU requirements: compute capability 7.0 or higher"),
    (
        "tensorrt",
        "10.0",
        (7, 0),
        "TensorRT 10 is built for SM 7.0+ (Pascal 6.x dropped); TensorRT 10.0 support matrix",
    ),
    ("tensorrt", "10.5", (7, 5), "TensorRT 10.5 removed Volta (7.0); TensorRT 10.5 release notes"),
    ("torch-cuda", "13.0", (7, 5), "CUDA 13 dropped Maxwell, Pascal and Volta (below 7.5)"),
    ("flash-attn", "2.0", (8, 0), "FlashAttention-2 needs Ampere (8.0) or newer"),
]

# CUDA runtime major -> minimum Linux driver under minor-version compatibility (NVIDIA's CUDA
# compatibility guide: 11.x >= 450.80.02, 12.x >= 525.60.13, 13.x >= 580).
CUDA_DRIVER_MIN: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def cc_tuple(cc: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """ "9.0" -> (9, 0); tuples pass through; None stays None."""
    if cc is None or isinstance(cc, tuple):
        return cc
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def dtype_support(cc: str | tuple[int, int]) -> dict[str, bool]:
    """Which dtypes a GPU of compute capability `cc` runs natively.

    Args:
        cc: "9.0" or (9, 0).

    >>> dtype_support("9.0")["fp8"], dtype_support("9.0")["fp4"]
    (True, False)
    """
    t = cc_tuple(cc)
    assert t is not None, "compute capability required"
    return {dt: t >= need for dt, need in DTYPE_MIN_CC.items()}


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def cuda_driver_minimum(cuda_runtime: str) -> str | None:
    """The minimum Linux driver for a CUDA runtime version ("12.8" -> "525.60.13")."""
    v = _version_tuple(cuda_runtime)
    return CUDA_DRIVER_MIN.get(v[0]) if v else None


def version_at_least(version: str, floor: str) -> bool:
    """True when `version` >= `floor`, comparing numeric parts ("10.13.2" >= "10.5")."""
    return _version_tuple(version) >= _version_tuple(floor)


def match_gpu(reported_name: str) -> GpuSpec | None:
    """The table row for a name as NVML reports it ("NVIDIA H200" -> H200), else None."""
    low = reported_name.lower()
    for spec in GPUS.values():
        # Whole words only: "NVIDIA L40S" must not match L4, nor "A100" match A10.
        if any(re.search(rf"\b{re.escape(m)}\b", low) for m in spec.match):
            return spec
    return None


def lookup_gpu(name: str) -> GpuSpec:
    """The spec of a GPU given on the command line (`--gpu H200`), case-insensitive.

    Args:
        name: a table name (H200, H100, A100, L40S, L4, B200...) or a reported name.

    Raises:
        UnknownGpuError: with the list of known names.

    >>> lookup_gpu("H100").bandwidth_gbs
    3350
    """
    spec = GPUS.get(name.lower()) or match_gpu(name)
    if spec is None:
        raise UnknownGpuError(
            f"unknown GPU {name!r}",
            hint=f"use one of {', '.join(g.name for g in GPUS.values())}, or run on the "
            "machine itself with --target cuda so doctor reads the GPU",
        )
    return spec
