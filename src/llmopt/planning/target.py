"""The two inputs of a serving plan besides the model: the hardware and the traffic.

`ServingTarget` is a GPU model times a count (from the spec table, `--gpu H200 --gpus 8`), what
doctor found on this machine (`--target cuda`), or the CPU. `Workload` is the request shape
(input/output lengths), the load (concurrency or request rate) and the SLOs.

>>> t = ServingTarget.gpu("H200", 8)
>>> t.count, t.compute_capability, round(t.memory_bytes / 2**30, 1)
(8, '9.0', 140.4)
>>> Workload(input_len=2048, output_len=128).input_len
2048
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from llmopt.core.errors import LlmoptError
from llmopt.hardware.specs import lookup_gpu, match_gpu

if TYPE_CHECKING:
    from llmopt.doctor import DoctorReport

__all__ = ["ServingTarget", "Workload", "NoGpuError"]


class NoGpuError(LlmoptError):
    """--target cuda, but doctor found no usable NVIDIA GPU here."""


@dataclass(frozen=True)
class Workload:
    """Request shape, load and SLOs.

    Args:
        input_len, output_len: typical prompt and completion lengths, tokens.
        concurrency: requests in flight at once (None: as many as fit, up to 256).
        request_rate: arrivals per second; turned into concurrency by Little's law
            (in flight = rate x time per request) when the plan can estimate that time.
        ttft_ms, tpot_ms: SLOs for time to first token and time per output token.
        max_model_len: longest request to accept (default: what one replica's KV cache holds,
            up to the model's context).
        static_shapes: fixed batch and length (offline jobs, embedders): compile for them.
        batch_size: the batch of a static-shape profile.
    """

    input_len: int = 1024
    output_len: int = 256
    concurrency: int | None = None
    request_rate: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    max_model_len: int | None = None
    static_shapes: bool = False
    batch_size: int = 1

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1 token")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("--rate must be > 0 requests per second")
        if self.max_model_len is not None and self.max_model_len < self.input_len + self.output_len:
            raise ValueError(
                f"--max-model-len {self.max_model_len} is shorter than one request "
                f"({self.input_len} + {self.output_len} tokens); raise it or shorten the request"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ServingTarget:
    """Hardware a serving plan is for. Memory is per device (RAM for a CPU target).

    Args:
        kind: "gpu" or "cpu".
        name: GPU model (table name) or CPU model.
        count: GPUs (1 for a CPU target).
        memory_bytes: one device's memory.
        bandwidth_gbs: memory bandwidth per device (None: unknown, no speed estimates).
        compute_capability: "9.0" for GPUs, None for CPUs.
        source: where the figures come from.
    """

    kind: str
    name: str
    count: int
    memory_bytes: int
    bandwidth_gbs: float | None
    compute_capability: str | None
    source: str
    threads: int | None = None
    features: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"target kind {self.kind!r}: use gpu or cpu")
        if self.count < 1:
            raise ValueError("--gpus must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def gpu(cls, name: str, count: int = 1) -> ServingTarget:
        """`count` GPUs of a model in the spec table (`--gpu H200 --gpus 8`)."""
        spec = lookup_gpu(name)
        return cls("gpu", spec.name, count, spec.memory_bytes, spec.bandwidth_gbs,
                   spec.compute_capability, f"spec table ({spec.source})")  # fmt: skip

    @classmethod
    def from_doctor(cls, report: DoctorReport, count: int | None = None) -> ServingTarget:
        """The GPUs doctor found here (memory and compute capability as read from the driver;
        bandwidth from the spec table by name).

        Raises:
            NoGpuError: no GPU was found; the message carries doctor's likely cause.
        """
        if not report.gpus:
            causes = (report.get("gpu.driver").details or {}).get("likely_causes") or [{}]
            raise NoGpuError(
                f"--target cuda: no NVIDIA GPU/driver here ({causes[0].get('cause', 'unknown cause')})",
                hint="run `llmopt doctor --target cuda` for the evidence, plan for a GPU you do not "
                "have with --gpu NAME --gpus N, or use --target cpu",
            )
        g = report.gpus[0]
        spec = match_gpu(g.get("name") or "")
        mem = g.get("memory_total_bytes") or (spec.memory_bytes if spec else 0)
        return cls("gpu", g.get("name") or "GPU", count or len(report.gpus), int(mem),
                   spec.bandwidth_gbs if spec else None,
                   g.get("compute_capability") or (spec.compute_capability if spec else None),
                   f"doctor ({g.get('source')}); bandwidth: {'spec table' if spec else 'unknown'}")  # fmt: skip

    @classmethod
    def cpu(cls, threads: int | None = None) -> ServingTarget:
        """This machine's CPU and RAM."""
        from llmopt.hardware.host import probe_cpu, probe_memory

        cpu, mem = probe_cpu(), probe_memory()
        usable = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        )
        return cls("cpu", cpu.get("model") or platform.processor() or "CPU", 1, mem["total_bytes"],
                   None, None, "this machine (/proc/meminfo, /proc/cpuinfo)",
                   threads or usable, cpu["features"])  # fmt: skip
