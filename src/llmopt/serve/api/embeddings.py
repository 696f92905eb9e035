"""`/v1/embeddings` with dynamic batching: requests that arrive together share a forward pass.

The batcher thread takes the first waiting request, then keeps collecting for up to
`window_ms` (or until `max_batch` texts) and embeds everything in one `runner.embed` call, so
under concurrent load a forward pass carries many requests' texts (see the
`llmopt_embedding_batch_size` histogram) while a lone request waits at most the window.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from llmopt.serve.api.context import ServerContext
from llmopt.serve.api.protocol import APIError, EmbeddingRequest
from llmopt.serve.api.protocol_responses import (
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    json_response,
)
from llmopt.serve.metrics import ServeMetrics

__all__ = ["EmbedBatcher", "embeddings"]

log = logging.getLogger(__name__)


@dataclass
class _Job:
    texts: list[str]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class EmbedBatcher:
    """A thread that batches `embed` calls from many requests.

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

    def _run(self) -> None:
        while not self._stop.is_set():
            first = self._q.get()
            if first is None:
                break
            jobs, n = [first], len(first.texts)
            deadline = time.monotonic() + self.window
            while n < self.max_batch:
                try:
                    job = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    self._stop.set()
                    break
                jobs.append(job)
                n += len(job.texts)
            jobs = [j for j in jobs if not j.future.done()]  # cancelled while queued
            if jobs:
                self._embed(jobs)

    def _embed(self, jobs: list[_Job]) -> None:
        texts = [t for j in jobs for t in j.texts]
        try:
            vecs = self.runner.embed(texts, batch_size=self.max_batch)
        except Exception as e:  # fail these requests, keep serving
            log.exception("embedding batch of %d texts failed", len(texts))
            for j in jobs:
                j.loop.call_soon_threadsafe(_settle, j.future, None, e)
            return
        self.metrics.embed_batch.observe(len(texts))
        i = 0
        for j in jobs:
            part = vecs[i : i + len(j.texts)]
            i += len(j.texts)
            j.loop.call_soon_threadsafe(_settle, j.future, part, None)


def _settle(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if fut.done():  # the request went away meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


async def embeddings(ctx: ServerContext, req: EmbeddingRequest) -> JSONResponse:
    ctx.check_model(req.model)
    ctx.require("embedding", "/v1/embeddings")
    if req.dimensions is not None:
        raise APIError(
            400, "dimensions is not supported (the model's size is fixed)", param="dimensions"
        )
    texts = req.texts(ctx.tokenizer)
    lens = [len(ids) for ids in ctx.tokenizer(texts, add_special_tokens=True)["input_ids"]]
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
    try:
        vecs = await asyncio.wait_for(ctx.embedder.embed(texts), ctx.settings.request_timeout_s)
    except TimeoutError:
        raise APIError(504, "request timed out", type="timeout_error", code="timeout") from None
    except APIError:
        raise
    except Exception as e:
        ctx.metrics.requests.labels("embeddings", "error").inc()
        raise APIError(500, f"embedding failed: {e}", type="server_error") from None
    finally:
        ctx.outstanding -= 1
    ctx.metrics.e2e.observe(time.monotonic() - t0)
    ctx.metrics.prompt_tokens.inc(sum(lens))
    ctx.metrics.requests.labels("embeddings", "ok").inc()
    data = []
    for i, v in enumerate(vecs):
        emb: Any = (
            base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            if req.encoding_format == "base64"
            else [float(x) for x in v]
        )
        data.append(EmbeddingData(index=i, embedding=emb))
    usage = EmbeddingUsage(prompt_tokens=sum(lens), total_tokens=sum(lens))
    return json_response(EmbeddingResponse(data=data, model=ctx.served_name, usage=usage))
