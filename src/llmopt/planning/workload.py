"""The traffic a serving plan is for: request shape (input/output lengths), load (concurrency or
request rate) and SLOs. The hardware is `llmopt.hardware.target.Target`.

>>> Workload(input_len=2048, output_len=128).input_len
2048
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Workload"]


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
