"""Load what to serve, build the app, run it under uvicorn (or hypercorn for HTTP/2) with a
draining shutdown.

What can be served (`load_context`):
- a run's chosen candidate: `runs/NAME` or `runs/NAME/best` (candidate.json + model.json +
  artifact/), served with the recipe it was verified with;
- a Hugging Face folder or a built-in name, with an optional recipe (default fp32).
Causal LMs run on a batching engine's generator (`Engine.load_generator`: the run's candidate's
engine when it batches, with the candidate's settings, else the native `torch` engine) behind
the scheduler; embedding models on the candidate's engine or the `hf` engine
(`llmopt.engines.load_runner`), behind the dynamic batcher.

Shutdown: the first SIGTERM or SIGINT (the same) starts draining: new `/v1` requests get 503,
`/health` says "draining" (503, so load balancers stop routing here), and the server exits once
the requests in flight have finished or `drain_timeout_s` (`--drain-timeout`) has passed. At the
end of the window every generation still running is cut with an error the client can see: a
stream gets an in-band error event (code `shutting_down`) and `data: [DONE]`, a non-streamed
request a 503. A second signal exits at once. The drain is `serve.drain.Drain`, the same under
uvicorn (`DrainingServer` here) and hypercorn (`serve.hypercorn_server`, `--http2`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from llmopt.core.recipes import get_recipe
from llmopt.engines import get_engine, load_runner, served_by_llmopt
from llmopt.engines.generation import GeneratorSpec
from llmopt.rundir.best import Best
from llmopt.serve import collector
from llmopt.serve.api.context import ServerContext
from llmopt.serve.api.embeddings import EmbedBatcher
from llmopt.serve.drain import Drain
from llmopt.serve.engine.client import EngineClient
from llmopt.serve.engine.loop import EngineLoop
from llmopt.serve.engine.process import EngineProcess
from llmopt.serve.engine.warmup import warm_generator
from llmopt.serve.hypercorn_server import serve_hypercorn
from llmopt.serve.metrics import ServeMetrics
from llmopt.serve.settings import ServeSettings
from llmopt.serve.source import ServeSourceError, describe_source

__all__ = ["load_context", "run_server"]

log = logging.getLogger(__name__)


def load_context(
    model: str, settings: ServeSettings, recipe: str | None = None, engine: str | None = None
) -> ServerContext:
    """Load the model and everything a request needs.

    Args:
        model: `runs/NAME[/best]`, a Hugging Face folder, or a built-in name.
        settings: limits and engine settings.
        recipe: numeric recipe for a folder or built-in (a run's best brings its own).
        engine: the batching engine a causal LM is served on (`torch`, `hf`); None: chosen by
            `batching_engine`.

    Example:
        >>> ctx = load_context("smollm2-135m", ServeSettings(max_num_seqs=4))  # doctest: +SKIP
    """
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)
    best, info, recipe = describe_source(model, recipe, settings.recipe)
    folder = best / "artifact" if best is not None else Path(info.path)
    name = settings.served_name or info.name
    metrics = ServeMetrics()
    if info.task == "embedding":
        return _embedding_context(best, folder, info, recipe, name, settings, metrics)
    chosen = batching_engine(best, folder, engine)
    engine_settings = candidate_settings(best, chosen, settings.threads)
    return _generation_context(folder, recipe, name, settings, metrics, chosen, engine_settings)


def candidate_settings(
    best: Path | None, engine: str, threads: int | None = None
) -> dict[str, Any] | None:
    """The run's candidate's engine settings when it is served on its own engine (what it was
    verified and measured with: the openvino engine's KV-cache precision, its threads), with
    `threads` (--threads) in place of the candidate's when given; else None."""
    if best is None:
        return None
    cand = Best.read(best).candidate
    if cand.engine != engine:
        return None
    out = cand.settings.to_dict()
    if threads:
        out["threads"] = int(threads)
    return out


# The batching engine causal LMs are served on, unless the run's candidate's engine batches.
GENERATION_ENGINE = "torch"


def batching_engine(
    best: Path | None, folder: Path | None = None, requested: str | None = None
) -> str:
    """The engine whose `load_generator` serves a causal LM: `requested` when given; else the
    run's candidate's engine when it batches (`Engine.batching`) and is not the `hf` fallback;
    else `GENERATION_ENGINE` (which loads `hf` artifacts too), unless it refuses the
    architecture in `folder`: then the `hf` engine, which runs every transformers decoder."""
    if requested:
        if not get_engine(requested).batching:
            raise ServeSourceError(
                f"engine {requested!r} has no generator llmopt's server can drive",
                "use --engine torch or --engine hf (or vllm, llamacpp for their own servers)",
            )
        return requested
    if best is not None:
        cand = Best.read(best).candidate
        name = cand.engine
        if not served_by_llmopt(name):
            raise ServeSourceError(
                f"the run chose {cand.id}, an artifact of the {name} engine, which llmopt's "
                "server cannot drive yet (it is measured and verified, not served)",
                f"serve the model the run started from on the native engine with the same "
                f"recipe: llmopt serve MODEL --recipe {cand.recipe}; or choose another "
                "candidate of the run (its candidates/<id>/ folders)",
            )
        if get_engine(name).batching and name != "hf":
            return name
    if folder is not None:
        from llmopt.engines.native.config import native_refusal  # lazy: reads one config

        if why := native_refusal(folder):
            log.info("serving with the hf engine: %s", why)
            return "hf"
    return GENERATION_ENGINE


def _generation_context(
    folder: Path,
    recipe: str,
    name: str,
    settings: ServeSettings,
    metrics: ServeMetrics,
    engine_name: str = GENERATION_ENGINE,
    engine_settings: dict[str, Any] | None = None,
) -> ServerContext:
    engine_process, compile_prefill = native_switches(settings)
    spec = GeneratorSpec(
        model=str(folder),
        recipe=recipe,
        engine=engine_name,
        device=settings.device,
        max_batch=settings.max_num_seqs,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        max_seq_len=settings.max_seq_len,
        batch_sizes=settings.batch_sizes(),
        compile_prefill=compile_prefill,
        prefix_caching=settings.enable_prefix_caching is not False,
        settings=engine_settings,
    )
    chunked = settings.enable_chunked_prefill
    chunked = NATIVE_CHUNKED_PREFILL if chunked is None else chunked
    swap = int(settings.swap_space_gib * 2**30)
    if engine_process:
        from transformers import AutoTokenizer

        log.info("starting the engine process (model load and warm-up happen there)")
        engine: EngineClient = EngineProcess(
            spec,
            {
                "tokens": settings.warmup_tokens,
                "threads": settings.threads,
                "log_level": log.getEffectiveLevel(),
            },
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
            chunked,
            metrics,
            swap_space_bytes=swap,
        )
        tokenizer = AutoTokenizer.from_pretrained(folder)
        shape = {k: engine.info[k] for k in ("block_size", "num_blocks", "max_seq_len")}
    else:
        gen = get_engine(spec.engine).load_generator(spec)
        warm_generator(gen, settings.warmup_tokens, settings.device)
        engine = EngineLoop(
            gen,
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
            metrics,
            chunked_prefill=chunked,
            swap_space_bytes=swap,
        )
        tokenizer = gen.tokenizer
        shape = {
            "block_size": int(gen.block_size),
            "num_blocks": int(gen.num_blocks),
            "max_seq_len": int(gen.max_seq_len),
        }
    effective = {
        "max_num_seqs": engine.max_num_seqs,
        "enable_chunked_prefill": engine.chunked_prefill,
        "engine_process": engine_process,
        "compile_prefill": compile_prefill,
        "enable_prefix_caching": engine.prefix_caching,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        **shape,
    }
    view = {}
    for key, value in effective.items():
        src, note = settings.source(key), settings.source_notes.get(key, "")
        if key in _DEFAULT_NOTES and getattr(settings, key) is not None:
            src = "flag"  # the switches are not planned: given, or the engine's default
        if src == "default" and getattr(settings, key) is None:
            note = note or _DEFAULT_NOTES.get(key, "the engine's default")
        if (
            key == "enable_prefix_caching"
            and not value
            and settings.enable_prefix_caching is not False
        ):
            note = _NO_PREFIX_CACHE.format(engine=engine_name)  # asked for (or the default)
        log.info("setting %s = %s (%s%s)", key, value, src, f": {note}" if note else "")
        view[key] = {"value": value, "source": src}
    return ServerContext(
        settings,
        name,
        "causal-lm",
        tokenizer,
        metrics,
        shape["max_seq_len"],
        engine=engine,
        num_blocks=engine.capacity_blocks,
        block_size=shape["block_size"],
        effective=view,
    )


def native_switches(settings: ServeSettings) -> tuple[bool, bool]:
    """(engine_process, compile_prefill) as given, else the native engine's defaults: both on
    for CUDA, off on the CPU (see `_DEFAULT_NOTES`)."""
    gpu = settings.device != "cpu"
    return (
        gpu if settings.engine_process is None else bool(settings.engine_process),
        gpu if settings.compile_prefill is None else bool(settings.compile_prefill),
    )


def _embedding_context(
    best: Path | None,
    folder: Path,
    info: Any,
    recipe: str,
    name: str,
    settings: ServeSettings,
    metrics: ServeMetrics,
) -> ServerContext:
    from transformers import AutoTokenizer

    if best is not None:
        cand = Best.read(best).candidate
        runner = load_runner(cand.engine, best / "artifact", info, cand.recipe, cand.settings)
    else:
        engine, rec = get_engine("hf"), get_recipe(recipe)
        why = engine.incompatible(info, rec, settings.device)
        if why:
            raise ServeSourceError(
                f"cannot serve {info.name} with recipe {recipe!r}: {why}",
                "pick another --recipe (fp32, bf16)",
            )
        runner = load_runner(
            "hf", folder, info, rec, {"device": settings.device, "threads": settings.threads}
        )
    tok = getattr(runner, "tokenizer", None) or AutoTokenizer.from_pretrained(folder)
    limit = getattr(runner, "max_length", None) or info.max_seq_length or info.max_context or 512
    runner.embed(["warm-up"], batch_size=1)
    batcher = EmbedBatcher(
        runner, settings.embed_batch_window_ms, settings.embed_max_batch, metrics
    )
    return ServerContext(settings, name, "embedding", tok, metrics, int(limit), embedder=batcher)


def _make_server(config: Any, ctx: ServerContext) -> Any:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, but the first signal drains (`serve.drain`) instead of closing connections
        at once."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.drain = Drain(ctx, stop=self._stop, force=self._force)

        def _stop(self) -> None:
            self.should_exit = True

        def _force(self) -> None:
            self.force_exit = True
            self.should_exit = True

        async def serve(self, sockets: Any = None) -> None:
            self.drain.bind(asyncio.get_running_loop())
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.drain.on_signal(sig)

    return DrainingServer(config)


# Chunked prefill is off unless asked for (--enable-chunked-prefill): the native engine runs a
# step's later chunks (paged path) and first chunks (SDPA) as separate eager forwards, each with a
# large fixed cost (vLLM's single mixed forward has one), and served less with it on a GPU under
# load (docs/benchmarks.md has the runs).
NATIVE_CHUNKED_PREFILL = False

# On CUDA the engine runs in its own process with its prefill forward compiled, unless told
# otherwise (--no-engine-process, --no-compile-prefill): with its own interpreter the engine's
# host work per step no longer waits on the event loop, and a compiled prefill is faster under
# load (docs/benchmarks.md has the served rates). On the CPU both stay off: a compile there is a
# C++ build per graph, and a second process shares the same few cores.
_DEFAULT_NOTES = {
    "enable_chunked_prefill": "off for the native engine: its chunked steps run two prefill "
    "forwards instead of one and served less on a GPU (docs/serving.md)",
    "engine_process": "on for CUDA, off on the CPU (docs/serving.md)",
    "compile_prefill": "on for CUDA, off on the CPU (docs/serving.md)",
    "enable_prefix_caching": "on for the native engine, as vLLM V1; --no-prefix-caching turns "
    "it off (docs/serving.md)",
}
_NO_PREFIX_CACHE = (
    "the {engine} engine has no prefix cache here (the hf and openvino engines have none; the "
    "native engine keeps it off for models whose sliding-window layers hold rings)"
)

# The engine thread and the event loop share one interpreter. When the GPU finishes a step, the
# engine thread needs the GIL back to read the tokens and launch the next step, while the event
# loop may be busy detokenizing and writing 64 streams' chunks. CPython hands the GIL to a waiting
# thread only after the switch interval (5 ms by default): up to 5 ms lost per engine step, a
# sizeable share of a large model's decode step on a fast GPU. 0.5 ms bounds that wait; the cost is more
# frequent switches on the event loop side, which is waiting on sockets most of the time anyway.
SWITCH_INTERVAL_S = 0.0005


def run_server(ctx: ServerContext, log_level: str = "info") -> None:
    """Serve `ctx` on its host and port until SIGTERM/SIGINT (then drain and return): under
    uvicorn (HTTP/1.1), or under hypercorn (HTTP/1.1 and HTTP/2) with `settings.http2`; over TLS
    when the settings carry a certificate."""
    from llmopt.serve.api.app import create_app  # heavy: fastapi

    s = ctx.settings
    app = create_app(ctx)
    # Warm from here on: what is alive now lives as long as the server (serve/collector.py)
    collector.freeze("server ready")
    collector.watch()
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL_S))
    try:
        if s.http2:
            serve_hypercorn(app, ctx, log_level)
        else:
            _run_uvicorn(app, ctx, log_level)
    finally:
        sys.setswitchinterval(before)


def _run_uvicorn(app: Any, ctx: ServerContext, log_level: str) -> None:
    import uvicorn

    s = ctx.settings
    config = uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
        ssl_certfile=s.ssl_certfile,
        ssl_keyfile=s.ssl_keyfile,
    )
    _make_server(config, ctx).run()
