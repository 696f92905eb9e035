"""What doctor returns: findings (status, evidence, fix) and the raw facts they were drawn from.

The facts are plain JSON, so a report recorded on one machine (an H200, say) can be replayed
through the checks anywhere: that is how the tests exercise GPU logic on a machine without one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from llmopt.core.schema import SCHEMA_VERSION

__all__ = ["Status", "Finding", "DoctorReport", "STATUS_ORDER"]

Status = Literal["ok", "warn", "fail"]
STATUS_ORDER: dict[str, int] = {"ok": 0, "warn": 1, "fail": 2}


@dataclass
class Finding:
    """One check's verdict.

    Args:
        id: stable dotted name, e.g. "gpu.driver", "cuda.runtime", "gpu.0".
        title: a few words for the report's first column.
        status: "ok", "warn" or "fail". Only "fail" makes `llmopt doctor` exit non-zero.
        evidence: what was observed, with numbers and sources.
        fix: what to do about it (None when nothing is needed).
        details: structured extras (likely causes with confirming commands, tables).
    """

    id: str
    title: str
    status: Status
    evidence: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.status in STATUS_ORDER, f"bad status {self.status!r}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DoctorReport:
    """All findings for one machine and target, plus the facts and derived tables.

    `gpus` is the normalized GPU list (from NVML, else nvidia-smi, else torch); `device` says
    which GPU a CUDA program started here would use as cuda:0; `compat` is the compute
    capability -> dtype/engine table for the GPUs found.
    """

    target: str
    findings: list[Finding]
    facts: dict[str, Any]
    gpus: list[dict[str, Any]] = field(default_factory=list)
    device: dict[str, Any] | None = None
    compat: list[dict[str, Any]] = field(default_factory=list)

    @property
    def worst(self) -> Status:
        if not self.findings:
            return "ok"
        return max((f.status for f in self.findings), key=STATUS_ORDER.__getitem__)

    @property
    def exit_code(self) -> int:
        """1 when any finding failed, else 0 (warnings do not fail the command)."""
        return 1 if self.worst == "fail" else 0

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUS_ORDER, 0)
        for f in self.findings:
            out[f.status] += 1
        return out

    def get(self, finding_id: str) -> Finding | None:
        return next((f for f in self.findings if f.id == finding_id), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "target": self.target,
            "status": self.worst,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings],
            "gpus": self.gpus,
            "device": self.device,
            "compat": self.compat,
            "facts": self.facts,
        }
