"""The machine a plan is for: one `Target` for the optimizer, `llmopt plan`, deploy and serve.

A target is the CPU (this machine's, `Target.cpu_host()`), the GPUs doctor found here
(`Target.from_doctor(report)`), torch's view of this machine (`detect_target("cuda")`), or a
GPU model from the spec table times a count (`Target.gpu_model("H200", 8)`, a machine you may
not have).
`memory_bytes` is per device: one GPU's memory, or the RAM for a CPU target. `source` says where
the figures come from, so a printed plan can say it.

Run files store `to_dict()`: optimize's plan.json reads `device`, `threads`, `cpu`,
`memory_bytes`, `features`, `gpu`; a deploy bundle's plan.json reads `kind`, `name`, `count`,
`bandwidth_gbs`, `compute_capability`, `source`. Both sets are written; `from_dict` reads either.

>>> t = Target.gpu_model("H200", 8)
>>> t.kind, t.count, t.compute_capability, round(t.memory_bytes / 2**30, 1)
('gpu', 8, '9.0', 140.4)
>>> Target.from_dict(t.to_dict()) == t
True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from llmopt.core.errors import LlmoptError
from llmopt.hardware.host import cpu_name, isa_features, ram_bytes, usable_cores
from llmopt.hardware.specs import lookup_gpu, match_gpu

__all__ = ["Target", "detect_target", "NoGpuError", "DEVICES"]

DEVICES = ("cpu", "cuda")
_KIND = {"cpu": "cpu", "cuda": "gpu"}  # device -> kind, as deploy bundles name it


class NoGpuError(LlmoptError):
    """--target cuda, but doctor found no usable NVIDIA GPU here."""


@dataclass
class Target:
    """Hardware a plan is for.

    Args:
        device: "cpu" or "cuda".
        threads: CPU threads candidates and servers use (None: not known, a remote machine).
        cpu: CPU model ("" when unknown).
        memory_bytes: one device's memory (RAM for a CPU target).
        features: the CPU's ISA flags among `llmopt.hardware.host.ISA_FLAGS`.
        gpu: {"name", "memory_bytes", "compute_capability"} of one GPU; None on CPU.
        count: GPUs (1 for a CPU target).
        bandwidth_gbs: memory bandwidth per device (None: unknown, no speed estimates).
        source: where the figures come from.
    """

    device: str
    threads: int | None = None
    cpu: str = ""
    memory_bytes: int = 0
    features: list[str] = field(default_factory=list)
    gpu: dict[str, Any] | None = None
    count: int = 1
    bandwidth_gbs: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"unknown target {self.device!r}; use cpu or cuda")
        if self.count < 1:
            raise ValueError("--gpus must be >= 1")

    @property
    def kind(self) -> str:
        """`gpu` or `cpu` (how deploy bundles name the device)."""
        return _KIND[self.device]

    @property
    def name(self) -> str:
        """The GPU model, else the CPU model."""
        return str((self.gpu or {}).get("name") or self.cpu or self.kind.upper())

    @property
    def compute_capability(self) -> str | None:
        return (self.gpu or {}).get("compute_capability")

    def to_dict(self) -> dict[str, Any]:
        """Optimize's keys (device ... gpu), then the serving plan's (kind ... source)."""
        d = asdict(self)
        return {
            **{k: d[k] for k in ("device", "threads", "cpu", "memory_bytes", "features", "gpu")},
            "kind": self.kind,
            "name": self.name,
            "count": self.count,
            "bandwidth_gbs": self.bandwidth_gbs,
            "compute_capability": self.compute_capability,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Target:
        """Read `to_dict()` output, or either older form: optimize's plan.json target (no
        `kind`) or a deploy bundle's (no `device`: `kind` "gpu" becomes device "cuda")."""
        device = d.get("device") or {"gpu": "cuda", "cpu": "cpu"}.get(d.get("kind", ""), "")
        gpu = d.get("gpu")
        if gpu is None and device == "cuda":  # a deploy bundle's target: no gpu entry
            gpu = {
                "name": d.get("name"),
                "memory_bytes": d.get("memory_bytes"),
                "compute_capability": d.get("compute_capability"),
            }
        cpu = d.get("cpu")
        if cpu is None:  # a deploy bundle's CPU target names the CPU in `name`
            cpu = d.get("name", "") if device == "cpu" else ""
        return cls(
            device=device,
            threads=d.get("threads"),
            cpu=cpu,
            memory_bytes=int(d.get("memory_bytes") or 0),
            features=list(d.get("features") or []),
            gpu=gpu,
            count=int(d.get("count") or 1),
            bandwidth_gbs=d.get("bandwidth_gbs"),
            source=d.get("source") or "",
        )

    @classmethod
    def gpu_model(cls, name: str, count: int = 1, **host: Any) -> Target:
        """`count` GPUs of a model in the spec table (`--gpu H200 --gpus 8`).

        Args:
            name: a spec-table name ("H200", "L4", ...).
            count: GPUs.
            host: `threads`, `cpu`, `features` of the host, if known.
        """
        spec = lookup_gpu(name)
        gpu = {
            "name": spec.name,
            "memory_bytes": spec.memory_bytes,
            "compute_capability": spec.compute_capability,
        }
        return cls(
            device="cuda",
            memory_bytes=spec.memory_bytes,
            gpu=gpu,
            count=count,
            bandwidth_gbs=spec.bandwidth_gbs,
            source=f"spec table ({spec.source})",
            **host,
        )

    @classmethod
    def from_doctor(cls, report: Any, count: int | None = None, **host: Any) -> Target:
        """The GPUs doctor found here (memory and compute capability as read from the driver;
        bandwidth from the spec table by name).

        Args:
            report: a `llmopt.doctor.DoctorReport`.
            count: GPUs to plan for (default: all doctor found).
            host: `threads`, `cpu`, `features` of this host, if wanted.

        Raises:
            NoGpuError: no GPU was found; the message carries doctor's likely cause.
        """
        if not report.gpus:
            causes = (report.get("gpu.driver").details or {}).get("likely_causes") or [{}]
            raise NoGpuError(
                f"--target cuda: no NVIDIA GPU/driver here "
                f"({causes[0].get('cause', 'unknown cause')})",
                hint="run `llmopt doctor --target cuda` for the evidence, plan for a GPU you do "
                "not have with --gpu NAME --gpus N, or use --target cpu",
            )
        g = report.gpus[0]
        spec = match_gpu(g.get("name") or "")
        mem = int(g.get("memory_total_bytes") or (spec.memory_bytes if spec else 0))
        cc = g.get("compute_capability") or (spec.compute_capability if spec else None)
        gpu = {"name": g.get("name") or "GPU", "memory_bytes": mem, "compute_capability": cc}
        source = f"doctor ({g.get('source')}); bandwidth: {'spec table' if spec else 'unknown'}"
        return cls(
            device="cuda",
            memory_bytes=mem,
            gpu=gpu,
            count=count or len(report.gpus),
            bandwidth_gbs=spec.bandwidth_gbs if spec else None,
            source=source,
            **host,
        )

    @classmethod
    def cpu_host(cls, threads: int | None = None) -> Target:
        """This machine's CPU and RAM."""
        return cls(
            device="cpu",
            threads=threads or usable_cores(),
            cpu=cpu_name(),
            memory_bytes=ram_bytes(),
            features=isa_features(),
            source="this machine (/proc/meminfo, /proc/cpuinfo)",
        )


def detect_target(device: str = "cpu", threads: int | None = None) -> Target:
    """Describe this machine for `device` ("cpu" or "cuda"); cuda asks torch about GPU 0.

    Args:
        device: where candidates run.
        threads: CPU threads to use (default: all cores the process may use).

    Raises:
        ValueError: an unknown device, or cuda without a GPU torch can see.
    """
    if device not in DEVICES:
        raise ValueError(f"unknown target {device!r}; use cpu or cuda")
    host = Target.cpu_host(threads)
    if device == "cpu":
        return host
    import torch

    if not torch.cuda.is_available():
        raise ValueError("target cuda asked for, but torch sees no CUDA GPU; use --target cpu")
    p = torch.cuda.get_device_properties(0)
    spec = match_gpu(p.name)
    gpu = {
        "name": p.name,
        "memory_bytes": p.total_memory,
        "compute_capability": f"{p.major}.{p.minor}",
    }
    return Target(
        device="cuda",
        threads=host.threads,
        cpu=host.cpu,
        memory_bytes=p.total_memory,
        features=host.features,
        gpu=gpu,
        bandwidth_gbs=spec.bandwidth_gbs if spec else None,
        source=f"torch.cuda; bandwidth: {'spec table' if spec else 'unknown'}",
    )
