"""`llmopt serve`: an OpenAI-compatible server with continuous batching (see docs/serving.md).

Modules, in reading order: `settings` (the typed limits), `defaults` (the scheduler and
KV-cache settings not given, from the run's plan or planned for this machine), `api.protocol`
(OpenAI request models and error bodies), `engine.scheduler` (waiting / running / preempted
queues over a `BatchGenerator`, `llmopt.engines.generation`), `engine.swap` (swap or recompute),
`engine.warmup` (compiling shapes before serving), `collector` (the heap frozen once warm, the
garbage collector's pauses counted), `engine.loop` (the engine thread and its bridge to
asyncio), `engine.process` (the same in a child process), `engine.client` (the `EngineClient`
protocol both satisfy), `api.detok` (incremental detokenization, stop strings),
`api.generation` (one choice as an async stream of text deltas), `api.completions` and
`api.embeddings` (the endpoints), `metrics` (Prometheus), `api.app` (FastAPI app and the guard
middleware), `drain` (the draining shutdown), `server` (what to load, uvicorn),
`hypercorn_server` (`--http2`: hypercorn, HTTP/2 and HTTP/1.1), `external`
(`--engine vllm|llamacpp`).

The engine is reached only through `llmopt.engines`: `get_engine(name).load_generator(spec)`
for causal LMs, `load_runner` for embedders.

>>> from llmopt.serve import ServeSettings, load_context, run_server      # doctest: +SKIP
>>> run_server(load_context("smollm2-135m", ServeSettings(port=8000)))    # doctest: +SKIP
>>> from llmopt.serve.defaults import resolve_settings                    # doctest: +SKIP
>>> planned = resolve_settings("smollm2-135m", {}, port=8000)  # as `llmopt serve` # doctest: +SKIP
"""

from __future__ import annotations

from llmopt.serve.settings import ServeSettings

__all__ = ["ServeSettings", "load_context", "run_server"]


def __getattr__(name: str):
    # The server pulls in torch, FastAPI and uvicorn: import it only when asked for.
    if name in ("load_context", "run_server"):
        from llmopt.serve import server  # heavy: starlette

        return getattr(server, name)
    raise AttributeError(name)
