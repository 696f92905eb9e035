"""The engine in its own process (`llmopt serve --engine-process`), as vLLM's engine core runs.

With `EngineLoop` the engine thread shares the API process's interpreter: while the event loop
detokenizes and streams many clients, the engine's Python (the scheduler, block tables, and every
op launch of an eager prefill) waits for the GIL. Here the generator (loaded by
`get_engine(spec.engine).load_generator(spec)` from a pickled `GeneratorSpec`), its scheduler
and the step loop live in a child process started with `spawn` (CUDA cannot be used after
`fork`), and the API process keeps only the tokenizer:

    API process                                  engine process (`_engine_main`)
    submit/abort ── pipe ("add"/"abort") ──────>  drain commands, Scheduler.step()
    reader thread <── pipe ("step": events, ─────  one message per step
    call_soon_threadsafe -> each request's queue   stats, tokens, preemptions)

The interface is `EngineLoop`'s (`EngineClient`: `submit`, `abort`, `start`, `stop`, `error`,
`max_num_seqs`, `chunked_prefill`, `capacity_blocks`, `prefix_caching`), so `Generation` and the
app do not know which one runs.
Messages are pickled by `multiprocessing.Connection` between this process and a child it
started itself (nothing is loaded from a file). An engine exception is sent as its type name and
text and raised again here; if the child dies, every open request fails with a 500 and `/health`
reports the exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
from typing import Any

from llmopt.core.errors import LlmoptError
from llmopt.engines import get_engine
from llmopt.engines.generation import GeneratorSpec, SamplingParams
from llmopt.serve.engine.scheduler import Scheduler, Sequence
from llmopt.serve.engine.warmup import warm_generator
from llmopt.serve.metrics import ServeMetrics

__all__ = ["EngineProcess", "EngineProcessError"]

log = logging.getLogger(__name__)


class EngineProcessError(LlmoptError):
    """The engine process failed to start, or died."""


class EngineProcess:
    """The generator and scheduler in a child process, with `EngineLoop`'s interface.

    Args:
        spec: the generator to load in the child (`get_engine(spec.engine).load_generator`).
        warmup: `warm_generator` arguments (warm-up tokens, threads), run in the child.
        max_num_seqs, max_num_batched_tokens, chunked_prefill, swap_space_bytes: the
            scheduler's settings.
        metrics: gauges and counters, updated from every step's message.
        start_timeout: seconds to wait for the child's model load and warm-up.
    """

    def __init__(
        self,
        spec: GeneratorSpec,
        warmup: dict,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
        metrics: ServeMetrics,
        start_timeout: float = 3600.0,
        swap_space_bytes: int = 0,
    ):
        self.metrics = metrics
        self.error: BaseException | None = None  # the engine process died (nothing served)
        self.last_error: str | None = None  # the last failed step or sequence (still serving)
        self.leaked_blocks = 0  # the block invariant after the last step
        self.prefix_cache: dict[str, Any] = {}  # the prefix cache after the last step
        self._ids = itertools.count(1)
        self._sinks: dict[int, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        sched = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "chunked_prefill": chunked_prefill,
            "swap_space_bytes": swap_space_bytes,
        }
        self._proc = ctx.Process(
            target=_engine_main,
            args=(child, spec, warmup, sched),
            name="llmopt-engine-core",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self.info = self._wait_ready(start_timeout)
        self.max_num_seqs = int(self.info["max_num_seqs"])
        self.chunked_prefill = bool(self.info["chunked_prefill"])
        self.capacity_blocks = int(self.info["capacity_blocks"])
        self.prefix_caching = bool(self.info["prefix_caching"])
        metrics.kv_total.set(self.capacity_blocks)
        self._reader = threading.Thread(target=self._read, name="llmopt-engine-reader", daemon=True)

    def _wait_ready(self, timeout: float) -> dict:
        if not self._conn.poll(timeout):
            self._proc.kill()
            raise EngineProcessError(
                f"the engine process was not ready after {timeout:.0f} s",
                "look at its log lines above (model load, warm-up)",
            )
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineProcessError(
                f"the engine process exited with code {self._proc.exitcode} while loading the "
                "model",
                "its error is in the log above; without --engine-process the same load "
                "runs in this process",
            ) from None
        if kind == "failed":
            self._proc.join(5)
            raise EngineProcessError(
                f"the engine process failed to start: {payload}",
                "the same settings without --engine-process show the full traceback",
            )
        return payload

    def describe(self) -> dict[str, Any]:
        """For /health: the engine process, whether it is alive, and why not."""
        return {
            "mode": "process",
            "pid": self._proc.pid,
            "alive": self.error is None and self._proc.is_alive(),
            "last_error": str(self.error) if self.error is not None else self.last_error,
            "leaked_blocks": self.leaked_blocks,
            "prefix_cache": self.prefix_cache,
        }

    # -- called on the event loop -------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader.start()

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> tuple[int, asyncio.Queue]:
        """Queue a sequence; its events (TokenEvent, or an Exception) arrive in the queue."""
        q: asyncio.Queue = asyncio.Queue()
        seq_id = next(self._ids)
        if self.error is not None:
            q.put_nowait(self.error)
            return seq_id, q
        self._sinks[seq_id] = q
        self._send(("add", (seq_id, list(prompt_ids), params, priority)))
        return seq_id, q

    def abort(self, seq_id: int) -> None:
        if self._sinks.pop(seq_id, None) is not None:
            self._send(("abort", seq_id))

    def stop(self, timeout: float = 10.0) -> None:
        self._send(("stop", None))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._reader.is_alive():
            self._reader.join(timeout)
        self._conn.close()

    def _send(self, msg: tuple) -> None:
        # OSError/ValueError: the child is gone; the reader thread reports it.
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self._conn.send(msg)

    # -- the reader thread --------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "stopped":
                return
            events, stats, tokens, preempted, step_error = payload
            if step_error is not None:
                self.last_error = step_error
            self.leaked_blocks = int(getattr(stats, "leaked_blocks", 0))
            self.prefix_cache = stats.prefix_cache()
            m = self.metrics
            if tokens:
                m.count_generated(tokens)
            m.preemptions.inc(preempted)
            m.publish(stats)
            if events:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._deliver, events)
        self._proc.join(5)
        self.error = EngineProcessError(
            f"the engine process exited (code {self._proc.exitcode})",
            "restart the server; the engine's last log lines say why",
        )
        log.error("%s", self.error)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all)

    def _deliver(self, events: list[tuple[int, Any]]) -> None:
        for seq_id, item in events:
            if isinstance(item, tuple):  # ("error", type name, text) from the child
                _, name, text = item
                item = ValueError(text) if name == "ValueError" else RuntimeError(f"{name}: {text}")
            q = self._sinks.get(seq_id)
            if q is None:
                continue  # aborted here while the event was on its way
            q.put_nowait(item)
            if isinstance(item, BaseException) or item.finish_reason is not None:
                del self._sinks[seq_id]

    def _fail_all(self) -> None:
        for q in self._sinks.values():
            q.put_nowait(self.error)
        self._sinks.clear()


def _engine_main(conn: Any, spec: GeneratorSpec, warmup: dict, sched_kwargs: dict) -> None:
    """The child: load, warm up, then run the scheduler until told to stop or the parent goes."""
    logging.basicConfig(
        level=warmup.get("log_level", logging.WARNING),
        format="%(levelname)s engine-core: %(message)s",
    )
    try:
        if warmup.get("threads"):
            import torch

            torch.set_num_threads(int(warmup["threads"]))
        gen = get_engine(spec.engine).load_generator(spec)
        warm_generator(gen, int(warmup.get("tokens") or 0), spec.device)
        sched = Scheduler(gen, **sched_kwargs)
    except Exception as e:  # the parent shows it and exits
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(
        (
            "ready",
            {
                "max_num_seqs": sched.max_num_seqs,
                "chunked_prefill": sched.chunked_prefill,
                "capacity_blocks": sched.capacity_blocks,
                "block_size": int(gen.block_size),
                "num_blocks": int(gen.num_blocks),
                "max_seq_len": int(gen.max_seq_len),
                "prefix_caching": bool(getattr(gen, "prefix_caching", False)),
            },
        )
    )
    while True:
        # Wait for work when idle; otherwise take whatever arrived and step.
        if not sched.has_work() and not conn.poll(0.5):
            continue
        try:
            while conn.poll():
                op, arg = conn.recv()
                if op == "stop":
                    conn.send(("stopped", None))
                    return
                if op == "add":
                    seq_id, ids, params, priority = arg
                    sched.submit(Sequence(seq_id, ids, params, priority))
                elif op == "abort":
                    sched.abort(arg)
        except (EOFError, OSError):
            return  # the parent is gone
        before = sched.preemptions_total
        step_error = None
        try:
            out = sched.step()
        except Exception as e:  # an engine bug fails its requests, not the server
            logging.getLogger(__name__).exception("engine step failed")
            err = ("error", type(e).__name__, str(e))
            out = [(s, err) for s in sched.fail_all()]
            step_error = f"{type(e).__name__}: {e}"
        for _, x in out:
            if isinstance(x, BaseException) and not isinstance(x, ValueError):
                step_error = f"{type(x).__name__}: {x}"  # a sequence's own fault
        events = [(s.seq_id, _wire(x)) for s, x in out]
        tokens = sum(not isinstance(x, tuple) for _, x in events)
        stats, preempted = sched.stats(), sched.preemptions_total - before
        try:
            conn.send(("step", (events, stats, tokens, preempted, step_error)))
        except (OSError, ValueError):
            return


def _wire(item: Any) -> Any:
    """A step's item as sent: TokenEvents as they are, exceptions as ("error", type, text)."""
    if isinstance(item, BaseException):
        return ("error", type(item).__name__, str(item))
    return item
