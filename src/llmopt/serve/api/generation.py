"""One generated choice on the asyncio side: engine events in, text deltas out.

A `Generation` submits its sequence to the engine thread on creation (so capacity is taken
before any response starts), turns the token events into text (incremental detokenization, stop
strings), records TTFT/TPOT, and always gives its sequence back: `close()` aborts it in the
engine (freeing its KV blocks) unless the engine already finished it. `close()` runs when the
stream ends, on an error, on timeout, on client disconnect, and (as a backstop) when the HTTP
request ends, from the guard middleware.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmopt.serve.api.detok import IncrementalDetokenizer, StopChecker
from llmopt.serve.api.protocol import APIError

if TYPE_CHECKING:
    from llmopt.serve.api.context import ServerContext

__all__ = ["Delta", "Generation", "merge"]


@dataclass
class Delta:
    """New output of one choice: text safe to show, the tokens behind it, and their logprobs."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    # With the first delta only, when the request asked for them (echo + logprobs): per prompt
    # token None (the first) or (logprob, top-N [(token id, logprob)]).
    prompt_logprobs: list[Any] | None = None


class Generation:
    """A sequence in the engine, seen as an async stream of `Delta`s."""

    def __init__(
        self,
        ctx: ServerContext,
        prompt_ids: list[int],
        params: Any,
        stops: list[str],
        priority: int,
        deadline: float,
        registry: list[Generation] | None = None,
    ):
        self.ctx = ctx
        self.prompt_ids = prompt_ids
        self.deadline = deadline
        self.seq_id, self._q = ctx.engine.submit(prompt_ids, params, priority)
        ctx.outstanding += 1
        ctx.started[id(self)] = time.monotonic()
        ctx.generations.add(self)
        ctx.metrics.queue_depth.set(ctx.outstanding)
        ctx.metrics.prompt_tokens.inc(len(prompt_ids))
        if registry is not None:
            registry.append(self)
        self._open, self._engine_done = True, False
        # One timer per request puts a sentinel in the queue at the deadline: cheaper than a
        # timeout around every token's wait (asyncio.wait_for costs a timer and a future per call).
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()), self._q.put_nowait, _DEADLINE
        )
        self._detok = IncrementalDetokenizer(ctx.tokenizer, prompt_ids)
        self._stop = StopChecker(stops)
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.n_tokens = 0
        self.finish_reason: str | None = None
        self.outcome = "cancelled"

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield deltas until the choice finishes; raises APIError (engine refusal, timeout)."""
        try:
            while True:
                item = await self._next()
                if isinstance(item, ValueError):
                    self._engine_done = True  # refused at admission: it holds no blocks
                    raise APIError(400, f"the engine refused the request: {item}")
                if isinstance(item, APIError):  # cut by the server (the drain window ended)
                    raise item
                if isinstance(item, BaseException):
                    self._engine_done = True  # the engine loop already dropped it
                    raise APIError(
                        500, f"engine error: {type(item).__name__}: {item}", type="server_error"
                    )
                yield self._on_event(item)
                if self.finish_reason is not None:
                    self.outcome = "ok"
                    return
        finally:
            self.close()

    def cut(self, error: APIError) -> None:
        """End this choice with `error` (delivered after the events already queued): the
        stream reports it in-band and ends with `[DONE]`; close() then aborts the sequence."""
        if self._open:
            self._q.put_nowait(error)

    def ready(self) -> bool:
        """Whether an event is waiting (the stream can take it without waiting)."""
        return not self._q.empty()

    async def _next(self) -> Any:
        item = self._q.get_nowait() if not self._q.empty() else await self._q.get()
        if item is _DEADLINE or time.monotonic() >= self.deadline:
            raise _timeout(self.ctx)
        return item

    def _on_event(self, ev: Any) -> Delta:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.ctx.metrics.ttft.observe(now - self.t0)
        self.last = now
        self.n_tokens += 1
        reason = ev.finish_reason
        text = self._detok.push([ev.token_id])
        if reason is not None:
            self._engine_done = True
            text += self._detok.flush()
        out, hit = self._stop.push(text)
        if hit:
            reason = "stop"  # a stop string: the engine still runs it; close() aborts it
        elif reason is not None:
            out += self._stop.flush()
        self.finish_reason = reason
        lp = [(ev.token_id, float(ev.logprob), list(ev.top_logprobs or []))]
        return Delta(out, [ev.token_id], lp, reason, getattr(ev, "prompt_logprobs", None))

    def close(self) -> None:
        """Give the sequence back (idempotent): abort it in the engine unless it finished."""
        if not self._open:
            return
        self._open = False
        self._timer.cancel()
        ctx = self.ctx
        if not self._engine_done:
            ctx.engine.abort(self.seq_id)
        ctx.outstanding -= 1
        ctx.started.pop(id(self), None)
        ctx.generations.discard(self)
        ctx.metrics.queue_depth.set(ctx.outstanding)
        end = time.monotonic()
        if self.outcome == "ok":
            ctx.metrics.e2e.observe(end - self.t0)
            ctx.note_latency(end - self.t0)
            if self.n_tokens > 1 and self.first is not None and self.last is not None:
                ctx.metrics.tpot.observe((self.last - self.first) / (self.n_tokens - 1))


_DEADLINE = object()  # queued by a request's timer when its deadline passes


def _timeout(ctx: ServerContext) -> APIError:
    return APIError(
        504,
        f"request timed out after {ctx.settings.request_timeout_s:g} s (server --request-timeout)",
        type="timeout_error",
        code="timeout",
    )


async def merge(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """Interleave the deltas of several choices as (choice index, delta), in arrival order."""
    if len(gens) == 1:
        async for d in gens[0].deltas():
            yield 0, d
        return
    out: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for d in g.deltas():
                out.put_nowait((i, d))
        except Exception as e:  # handed to the consumer, which raises it
            out.put_nowait((i, e))
        finally:
            out.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, d = await out.get()
            if d is None:
                left -= 1
            elif isinstance(d, Exception):
                raise d
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            g.close()
