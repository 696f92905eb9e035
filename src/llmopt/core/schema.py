"""The typed results every stage returns and the run directory stores as JSON.

Each result is a dataclass with `to_dict()` / `from_dict()`; the JSON carries `schema_version` so a
later llmopt can refuse (or migrate) a run directory written by an incompatible one.
Stages build these; the CLI and the report only read them.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

from llmopt.core.settings import EngineSettings

__all__ = [
    "SCHEMA_VERSION",
    "Task",
    "Candidate",
    "Metric",
    "VerifyResult",
    "Stat",
    "BenchResult",
    "Selection",
    "summarize",
]

SCHEMA_VERSION = 1

Task = Literal["causal-lm", "embedding"]


class Serializable:
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)  # type: ignore[call-overload]
        d["schema_version"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class Candidate(Serializable):
    """One thing to build, verify and benchmark: a recipe run by an engine with settings.

    `id` names the folder `candidates/<id>/`. Exactly one candidate per run is the reference
    (the model as its owner has it, run plainly); every other is compared against it.
    """

    id: str
    engine: str  # registry name, e.g. "torch", "onnxruntime"
    recipe: str  # recipe preset name, e.g. "fp32", "bf16", "w8a16", "ort-int8"
    settings: EngineSettings = field(default_factory=EngineSettings)
    reference: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        # candidate.json stores the settings as a flat object; construction accepts one too.
        self.settings = EngineSettings.from_dict(self.settings)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["settings"] = self.settings.to_dict()
        return d


@dataclass
class Metric(Serializable):
    """One quality number of a candidate next to the reference's, and its gate (if any).

    `higher_is_better` orients `delta` and the threshold: for perplexity it is False and the
    threshold is the largest candidate value allowed; for cosine it is True and the threshold
    is the smallest value allowed. `passed` is None for metrics that are reported, not gated.
    """

    name: str
    reference: float | None
    candidate: float
    higher_is_better: bool
    threshold: float | None = None
    passed: bool | None = None
    n: int = 0  # samples behind the number (tokens, sentences, pairs)
    unit: str = ""
    note: str = ""
    # 95% paired-bootstrap interval of `delta` (None when not computed); `noise` is True when
    # that interval contains 0, i.e. the delta is within sampling noise.
    ci_low: float | None = None
    ci_high: float | None = None
    noise: bool | None = None

    @property
    def delta(self) -> float | None:
        return None if self.reference is None else self.candidate - self.reference

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.pop("schema_version")
        d["delta"] = self.delta
        return d


@dataclass
class VerifyResult(Serializable):
    """Does the candidate compute what the reference computes? `passed` is the AND of all gates."""

    candidate_id: str
    task: str
    metrics: list[Metric]
    passed: bool
    # The single number the quality budget is judged on, as a fraction (0.004 = 0.4% worse);
    # for LMs the relative perplexity increase, for embeddings 1 - mean cosine.
    quality_drop: float
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # The work behind the numbers: {"level": "screen"|"full"|"reverify", "rung": 1|2, sizes...}.
    fidelity: dict[str, Any] = field(default_factory=dict)
    # How the text was fed to the model (causal LMs: whether each window starts with the
    # tokenizer's BOS), so a score is read with the input convention it was measured under.
    inputs: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VerifyResult:
        d = dict(d)
        d["metrics"] = [Metric.from_dict(m) for m in d["metrics"]]
        return super().from_dict(d)

    def metric(self, name: str) -> Metric:
        for m in self.metrics:
            if m.name == name:
                return m
        raise KeyError(f"{name!r} not in {[m.name for m in self.metrics]}")


@dataclass
class Stat(Serializable):
    """Summary of repeated measurements of one quantity (e.g. decode tokens/s over 5 runs)."""

    median: float
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float
    n: int
    unit: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.pop("schema_version")
        return d

    @property
    def spread(self) -> float:
        """Relative spread (max - min) / median: the run-to-run noise of this measurement."""
        return (self.max - self.min) / self.median if self.median else 0.0


def summarize(values: list[float], unit: str = "") -> Stat:
    """Median, mean, percentiles (nearest-rank on sorted values), min and max of `values`.

    >>> summarize([1.0, 2.0, 3.0]).median
    2.0
    """
    assert values, "summarize() needs at least one value"
    v = sorted(float(x) for x in values)

    def pct(p: float) -> float:
        # Linear interpolation between closest ranks, as numpy.percentile's default.
        k = (len(v) - 1) * p / 100.0
        lo, hi = int(k), min(int(k) + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return Stat(
        median=statistics.median(v),
        mean=statistics.fmean(v),
        p50=pct(50),
        p90=pct(90),
        p99=pct(99),
        min=v[0],
        max=v[-1],
        n=len(v),
        unit=unit,
    )


@dataclass
class BenchResult(Serializable):
    """How fast and how big a candidate is. `primary` names the metric selection ranks on."""

    candidate_id: str
    task: str
    metrics: dict[str, Stat]  # e.g. "decode_tokens_per_s", "sentences_per_s_b32"
    primary: str
    peak_rss_bytes: int  # peak resident memory of the benchmark process
    model_rss_bytes: int  # peak RSS minus the RSS before the model was loaded
    artifact_bytes: int  # size of the candidate's artifact on disk
    load_seconds: float
    warmup_seconds: float  # warm-up (and any compilation), excluded from `metrics`
    settings: dict[str, Any] = field(default_factory=dict)  # threads, batch sizes, lengths
    env: dict[str, Any] = field(default_factory=dict)  # torch version, CPU, threads...
    notes: list[str] = field(default_factory=list)
    # Measured ceilings and per-phase attribution (llmopt.bench.roofline); {} in older runs.
    roofline: dict[str, Any] = field(default_factory=dict)
    fidelity: dict[str, Any] = field(default_factory=dict)  # as VerifyResult.fidelity

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        d = dict(d)
        d["metrics"] = {k: Stat.from_dict(v) for k, v in d["metrics"].items()}
        return super().from_dict(d)

    @property
    def primary_value(self) -> float:
        return self.metrics[self.primary].median


@dataclass
class Selection(Serializable):
    """The chosen candidate and why every other one was kept, dropped, cut or failed."""

    objective: str  # latency | throughput | memory | cost (llmopt.optimize.objective)
    chosen: str | None
    max_quality_drop: float
    reasons: dict[str, str]  # candidate id -> one line: why chosen / kept / dropped / cut
    ranking: list[str]  # candidate ids, best first (only fully verified ones that passed)
    pareto: list[str] = field(default_factory=list)  # ids on the quality/speed Pareto front
    # ids on the quality/speed/memory front (not dominated on all three at once)
    pareto_memory: list[str] = field(default_factory=list)
    objective_unit: str = ""
    objective_values: dict[str, float] = field(default_factory=dict)  # full fidelity, by id
    higher_is_better: bool = True
    cut: dict[str, str] = field(default_factory=dict)  # id -> why the search never finished it
    # id -> the finalist's ratio to the reference measured side by side (llmopt.optimize.paired)
    side_by_side: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the chosen one's runtime settings measured side by side (llmopt.optimize.tune)
    tuned: dict[str, Any] = field(default_factory=dict)
