"""`/v1/embeddings` with dynamic batching: requests that arrive together share a forward pass,
and a large request never holds the others up for long.

The batcher thread takes the first waiting request, then keeps collecting for up to
`window_ms` (or until `max_batch` texts), and runs forwards of at most `max_batch` texts, so
under concurrent load a forward pass carries many requests' texts (see the
`llmopt_embedding_batch_size` histogram) while a lone request waits at most the window.

Fairness: a request is split into forwards of at most `max_batch` texts, interleaved with the
others'. A request that has had no forward yet goes first, in the next forward, alone with the
other new ones; the forward after that serves the requests already under way (round robin, an
equal share each). So a small request sent beside a 4,000-input one waits for at most the
forward in progress plus its own, and the large one still gets every other forward. Each request
is also bounded up front (`embed_max_inputs` inputs and `embed_max_tokens` tokens, 400 beyond).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from llmopt.serve.api.context import ServerContext, until_done_or_gone
from llmopt.serve.api.protocol import APIError, EmbeddingRequest
from llmopt.serve.api.protocol_responses import (
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    json_response,
)
from llmopt.serve.metrics import ServeMetrics

__all__ = ["EmbedBatcher", "embeddings", "plan_forward"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    texts: list[str]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    done: int = 0  # texts embedded so far
    parts: list[Any] = field(default_factory=list)  # their vectors, in order

    @property
    def left(self) -> int:
        return len(self.texts) - self.done


def plan_forward(
    lefts: list[int], fresh: list[bool], max_batch: int, fresh_turn: bool
) -> list[int]:
    """How many texts each job puts in the next forward (at most `max_batch` in all).

    `lefts`: texts each job has left, oldest job first; `fresh`: whether it has had no forward
    yet. On a fresh turn with fresh jobs, only they run (oldest first): a new request waits
    for no one's backlog. Otherwise the jobs under way share the forward, an equal share each,
    then what is left over goes to the oldest.

    >>> plan_forward([4000, 1], [False, True], 64, fresh_turn=True)
    [0, 1]
    >>> plan_forward([4000, 1], [False, True], 64, fresh_turn=False)
    [63, 1]
    >>> plan_forward([100, 100], [False, False], 64, fresh_turn=True)
    [32, 32]
    """
    take = [0] * len(lefts)
    allowed = list(fresh) if fresh_turn and any(fresh) else [True] * len(lefts)
    room = max_batch
    idx = [i for i, ok in enumerate(allowed) if ok and lefts[i] > 0]
    if not idx:
        return take
    share = max(1, room // len(idx))
    for i in idx:
        n = min(lefts[i], share, room)
        take[i], room = n, room - n
    for i in idx:  # the leftover, oldest first
        n = min(lefts[i] - take[i], room)
        take[i], room = take[i] + n, room - n
    return take


class EmbedBatcher:
    """A thread that batches `embed` calls from many requests, fairly (see the module doc).

    Args:
        runner: an `EmbeddingRunner` (`embed(texts, batch_size) -> (N, D) float32`).
        window_ms: how long to wait for more requests after the first.
        max_batch: most texts per forward pass.
    """

    def __init__(self, runner: Any, window_ms: float, max_batch: int, metrics: ServeMetrics):
        self.runner, self.window, self.max_batch = runner, window_ms / 1e3, max_batch
        self.metrics = metrics
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmopt-embed", daemon=True)
        self.forwards = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._q.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def embed(self, texts: list[str]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put(_Job(texts, fut, loop))
        return await fut

    def _take(self, active: collections.deque, fresh: set, timeout: float | None) -> bool:
        """Move waiting requests into `active` (waiting up to `timeout` for the first one;
        None: forever). False when told to stop."""
        try:
            job = self._q.get(timeout=timeout) if timeout != 0 else self._q.get_nowait()
        except queue.Empty:
            return True
        while True:
            if job is None:
                self._stop.set()
                return False
            active.append(job)
            fresh.add(job)
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return True

    def _run(self) -> None:
        active: collections.deque[_Job] = collections.deque()
        fresh: set[_Job] = set()
        fresh_turn = True
        while not self._stop.is_set():
            if not active:  # idle: wait for a request, then the window for more
                if not self._take(active, fresh, None):
                    break
                deadline = time.monotonic() + self.window
                while sum(j.left for j in active) < self.max_batch:
                    wait = deadline - time.monotonic()
                    if wait <= 0 or not self._take(active, fresh, wait):
                        break
                    if self._stop.is_set():
                        break
            elif not self._take(active, fresh, 0):
                break
            for j in [j for j in active if j.future.done()]:  # cancelled: timed out or gone
                active.remove(j)
                fresh.discard(j)
            if not active:
                continue
            jobs = list(active)
            take = plan_forward(
                [j.left for j in jobs], [j in fresh for j in jobs], self.max_batch, fresh_turn
            )
            fresh_turn = not fresh_turn or not any(j in fresh for j in jobs)
            parts = [(j, n) for j, n in zip(jobs, take, strict=True) if n]
            self._forward(parts)
            fresh.difference_update(j for j, _ in parts)
            for j in [j for j in active if j.left == 0 or j.future.done()]:
                active.remove(j)
            if active:
                active.rotate(-1)  # round robin among those under way

    def _forward(self, parts: list[tuple[_Job, int]]) -> None:
        texts = [t for j, n in parts for t in j.texts[j.done : j.done + n]]
        try:
            vecs = self.runner.embed(texts, batch_size=self.max_batch)
        except Exception as e:  # fail these requests, keep serving
            log.exception("embedding batch of %d texts failed", len(texts))
            for j, _ in parts:
                j.done = len(j.texts)
                j.loop.call_soon_threadsafe(_settle, j.future, None, e)
            return
        self.forwards += 1
        self.metrics.embed_batch.observe(len(texts))
        i = 0
        for j, n in parts:
            j.parts.append(vecs[i : i + n])
            i += n
            j.done += n
            if j.left == 0:
                out = j.parts[0] if len(j.parts) == 1 else np.concatenate(j.parts)
                j.parts = []
                j.loop.call_soon_threadsafe(_settle, j.future, out, None)


def _settle(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if fut.done():  # the request went away meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


async def embeddings(ctx: ServerContext, req: EmbeddingRequest, request: Request) -> Response:
    ctx.check_model(req.model)
    ctx.require("embedding", "/v1/embeddings")
    if req.dimensions is not None:
        raise APIError(
            400, "dimensions is not supported (the model's size is fixed)", param="dimensions"
        )
    s = ctx.settings
    count = req.count()
    if count > s.embed_max_inputs:
        raise APIError(
            400,
            f"input has {count} items; this server takes at most {s.embed_max_inputs} per "
            "request (--embed-max-inputs): split it over several requests",
            param="input",
            code="too_many_inputs",
        )
    texts = req.texts(ctx.tokenizer)
    lens = [len(ids) for ids in ctx.tokenizer(texts, add_special_tokens=True)["input_ids"]]
    if sum(lens) > s.embed_max_tokens:
        raise APIError(
            400,
            f"input has {sum(lens)} tokens in all; this server takes at most "
            f"{s.embed_max_tokens} per request (--embed-max-tokens): split it over several "
            "requests",
            param="input",
            code="too_many_tokens",
        )
    too_long = [i for i, n in enumerate(lens) if n > ctx.max_seq_len]
    if too_long:
        raise APIError(
            400,
            f"input {too_long[0]} has {lens[too_long[0]]} tokens; this model "
            f"takes at most {ctx.max_seq_len}",
            param="input",
            code="context_length_exceeded",
        )
    ctx.admit(1, "/v1/embeddings")
    ctx.outstanding += 1
    t0 = time.monotonic()
    key = object()
    ctx.started[id(key)] = t0
    try:
        # A client that goes away takes its job out of the batcher (its future is cancelled,
        # which the batcher checks before every forward): a large request stops costing
        # forwards the moment nobody waits for it.
        job = asyncio.wait_for(ctx.embedder.embed(texts), ctx.settings.request_timeout_s)
        vecs = await until_done_or_gone(request, job)
    except TimeoutError:
        raise APIError(504, "request timed out", type="timeout_error", code="timeout") from None
    except APIError:
        raise
    except Exception as e:
        ctx.metrics.requests.labels("embeddings", "error").inc()
        raise APIError(500, f"embedding failed: {e}", type="server_error") from None
    finally:
        ctx.outstanding -= 1
        ctx.started.pop(id(key), None)
    if isinstance(vecs, Response):  # the client is gone
        ctx.metrics.requests.labels("embeddings", "disconnected").inc()
        return vecs
    ctx.metrics.e2e.observe(time.monotonic() - t0)
    ctx.note_latency(time.monotonic() - t0)
    ctx.metrics.prompt_tokens.inc(sum(lens))
    ctx.metrics.requests.labels("embeddings", "ok").inc()
    usage = EmbeddingUsage(prompt_tokens=sum(lens), total_tokens=sum(lens))

    def render() -> Response:
        data = []
        for i, v in enumerate(vecs):
            emb: Any = (
                base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                if req.encoding_format == "base64"
                else v.tolist()
            )
            data.append(EmbeddingData(index=i, embedding=emb))
        return json_response(EmbeddingResponse(data=data, model=ctx.served_name, usage=usage))

    if len(vecs) <= RENDER_INLINE:
        return render()
    # Thousands of vectors take the event loop a second or more to render as JSON: done in a
    # worker thread, the small requests' responses go out meanwhile.
    return await asyncio.to_thread(render)


# Responses of up to this many vectors are rendered on the event loop (a thread costs more).
RENDER_INLINE = 64
