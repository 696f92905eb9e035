"""The engine thread: runs the scheduler and the blocking engine step, talks to asyncio.

`step()` is blocking compute (torch releases the GIL inside it), so it runs in one dedicated
thread. Requests cross over through a thread-safe command queue (add / abort); events come back
to the event loop in one `call_soon_threadsafe` per step, into each request's `asyncio.Queue`.
The thread sleeps on the command queue when there is nothing to do.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import Any

from llmopt.engines.generation import BatchGenerator, SamplingParams
from llmopt.serve.engine.scheduler import Scheduler, Sequence
from llmopt.serve.metrics import ServeMetrics

__all__ = ["EngineLoop"]

log = logging.getLogger(__name__)


class EngineLoop:
    """Owns the generator and its scheduler; `submit`/`abort` are called from the event loop.

    Args:
        gen: the engine's generator (`get_engine(name).load_generator(spec)`).
        max_num_seqs, max_num_batched_tokens: scheduler limits.
        metrics: gauges and counters updated after every step.
        chunked_prefill, swap_space_bytes: the scheduler's prefill chunking and host memory for
            swapped-out KV caches (0: recompute only).
    """

    def __init__(
        self,
        gen: BatchGenerator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        metrics: ServeMetrics,
        chunked_prefill: bool = True,
        swap_space_bytes: int = 0,
    ):
        self.gen = gen
        self.metrics = metrics
        self.sched = Scheduler(
            gen,
            max_num_seqs,
            max_num_batched_tokens,
            chunked_prefill=chunked_prefill,
            swap_space_bytes=swap_space_bytes,
        )
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="llmopt-engine", daemon=True)
        self.error: BaseException | None = None  # last engine error (shown by /health)
        self.leaked_blocks = 0  # the block invariant after the last step (shown by /health)
        self.prefix_cache: dict[str, Any] = {}  # the prefix cache after the last step (/health)
        metrics.kv_total.set(self.sched.capacity_blocks)
        self._publish()

    @property
    def max_num_seqs(self) -> int:
        return self.sched.max_num_seqs

    @property
    def chunked_prefill(self) -> bool:
        return self.sched.chunked_prefill

    @property
    def capacity_blocks(self) -> int:
        return self.sched.capacity_blocks

    @property
    def prefix_caching(self) -> bool:
        """Whether the generator reuses cached prompt prefixes."""
        return bool(getattr(self.gen, "prefix_caching", False))

    def describe(self) -> dict[str, Any]:
        """For /health: where the engine runs, its last error (a failed step), the block
        invariant and the prefix cache's counts."""
        return {
            "mode": "thread",
            "alive": True,
            "last_error": None if self.error is None else repr(self.error),
            "leaked_blocks": self.leaked_blocks,
            "prefix_cache": self.prefix_cache,
        }

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- called on the event loop -------------------------------------------------------------
    def submit(
        self, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> tuple[int, asyncio.Queue]:
        """Queue a sequence; its events (TokenEvent, or an Exception) arrive in the queue."""
        q: asyncio.Queue = asyncio.Queue()
        seq = Sequence(next(self._ids), list(prompt_ids), params, priority, sink=q)
        self._cmds.put(("add", seq))
        return seq.seq_id, q

    def abort(self, seq_id: int) -> None:
        self._cmds.put(("abort", seq_id))

    # -- the thread ---------------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            op, arg = cmd
            if op == "add":
                self.sched.submit(arg)
            elif op == "abort":
                self.sched.abort(arg)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.sched.has_work())
            if self._stop.is_set():
                break
            before = self.sched.preemptions_total
            try:
                out = self.sched.step()
            except Exception as e:  # an engine bug must fail its requests, not the server
                log.exception("engine step failed; failing the requests in flight")
                self.error = e
                out = [(s, e) for s in self.sched.fail_all()]
            for _, x in out:
                if isinstance(x, BaseException) and not isinstance(x, ValueError):
                    self.error = x  # a sequence's own fault too: /health shows the last one
            tokens = sum(not isinstance(x, BaseException) for _, x in out)
            if tokens:
                self.metrics.count_generated(tokens)
            self.metrics.preemptions.inc(self.sched.preemptions_total - before)
            self._publish()  # before delivery: a client that got its tokens sees them counted
            if out:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(_deliver, out)

    def _publish(self) -> None:
        st = self.sched.stats()
        self.leaked_blocks = st.leaked_blocks
        self.prefix_cache = st.prefix_cache()
        self.metrics.publish(st)


def _deliver(out: list[tuple[Sequence, Any]]) -> None:
    for seq, item in out:
        seq.sink.put_nowait(item)
