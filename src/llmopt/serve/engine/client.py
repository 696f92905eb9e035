"""What the API layer uses of an engine: `EngineLoop` (a thread) and `EngineProcess` (a child
process) both satisfy `EngineClient`, so `Generation`, the app and `/health` do not know which
one runs.

Events arrive in the asyncio queue `submit` returns: `TokenEvent`s (the last with its
`finish_reason` set), or an exception (a ValueError when the engine refused the request).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

from llmopt.engines.generation import SamplingParams

__all__ = ["EngineClient"]


@runtime_checkable
class EngineClient(Protocol):
    """An engine behind the API: requests in, per-request event queues out."""

    error: BaseException | None  # the last engine error (shown by /health)

    @property
    def max_num_seqs(self) -> int:
        """Sequences in the batch at most."""
        ...

    @property
    def chunked_prefill(self) -> bool:
        """Whether prompts are split into chunks that fit a step's token budget."""
        ...

    @property
    def capacity_blocks(self) -> int:
        """Usable KV-cache blocks."""
        ...

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine reuses the KV blocks of cached prompt prefixes."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start stepping; events are delivered on `loop`."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping and release the engine."""
        ...

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> tuple[int, asyncio.Queue]:
        """Queue a sequence: (its id, the queue its events arrive in)."""
        ...

    def abort(self, seq_id: int) -> None:
        """Drop a sequence wherever it is (its KV blocks are freed)."""
        ...

    def describe(self) -> dict[str, Any]:
        """For /health: where the engine runs, whether it is alive, its last error."""
        ...
