"""CLI of `llmopt serve`: an OpenAI-compatible server for a run's best candidate or any model.

Wiring only: settings from flags (`ServeSettings`), then `llmopt.serve.load_context` +
`run_server` (on `--engine torch|hf|openvino`, else chosen by `llmopt.serve.server.batching_engine`), or
with `--engine vllm|llamacpp` the engine's own server (`llmopt.serve.external`).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from llmopt.cli.render import console
from llmopt.serve.defaults import resolve_settings
from llmopt.serve.external import chosen_external_engine, external_command, launch_external
from llmopt.serve.settings import ServeSettings
from llmopt.serve.source import ServeSourceError

__all__ = ["register", "serve"]


def _in_process(engine: str | None) -> bool:
    """Whether llmopt's own server drives `engine` (it has a generator: `Engine.batching`);
    vllm and llamacpp have their own servers."""
    from llmopt.engines import ENGINES  # heavy: the engine registry imports torch

    if not engine:
        return False
    if engine not in ENGINES:
        own = sorted((n for n, e in ENGINES.items() if e.batching), key=lambda n: (n != "torch", n))
        raise ValueError(
            f"unknown engine {engine!r}: llmopt's server runs {', '.join(own)}; "
            "vllm and llamacpp run their own servers"
        )
    return ENGINES[engine].batching


def serve(
    model: Annotated[
        str,
        typer.Argument(
            help="runs/NAME/best (a run's chosen candidate), a Hugging Face folder, "
            "or a built-in name (smollm2-135m, minilm-l6)."
        ),
    ],
    recipe: Annotated[
        str | None, typer.Option(help="Recipe for a folder or built-in (fp32, bf16, w8a16...).")
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            help="torch (the native engine), hf (transformers, every architecture) or openvino "
            "(an OpenVINO IR a run built): llmopt's server on that engine (default: the run's "
            "engine, else torch where it runs the model, else hf); vllm or llamacpp: launch "
            "that engine's own server with the plan's flags."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    http2: Annotated[
        bool,
        typer.Option(
            "--http2",
            help="Serve under hypercorn, which speaks HTTP/2 as well as HTTP/1.1 on the same "
            "port: cleartext h2c (prior knowledge or Upgrade) without a certificate, h2 by ALPN "
            "with --ssl-certfile/--ssl-keyfile. Needs hypercorn (pip install 'llmopt[serve]').",
        ),
    ] = False,
    ssl_certfile: Annotated[
        str | None,
        typer.Option(
            "--ssl-certfile", help="PEM certificate (chain): serve over TLS (with --ssl-keyfile)."
        ),
    ] = None,
    ssl_keyfile: Annotated[
        str | None,
        typer.Option("--ssl-keyfile", help="PEM private key of --ssl-certfile."),
    ] = None,
    served_name: Annotated[
        str | None,
        typer.Option("--served-name", help="Model id clients send (default: model name)."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="LLMOPT_API_KEY",
            help="Require `Authorization: Bearer KEY` on /v1. Prefer the environment variable "
            "LLMOPT_API_KEY: a flag is visible to every user of the machine in `ps`.",
        ),
    ] = None,
    max_num_seqs: Annotated[
        int | None,
        typer.Option("--max-num-seqs", help="Sequences batched together (default: from the plan)."),
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-num-batched-tokens",
            help="Tokens per engine step, prefill + decode (default: from the plan).",
        ),
    ] = None,
    enable_chunked_prefill: Annotated[
        bool | None,
        typer.Option(
            "--enable-chunked-prefill/--no-enable-chunked-prefill",
            help="Prefill long prompts in chunks that fit each step's token budget, beside the "
            "running decodes (as vLLM); off: each admitted prompt is prefilled whole in one step. "
            "Default: off for the native engine (measured slower on an H200, docs/serving.md), "
            "vLLM's own default with --engine vllm.",
        ),
    ] = None,
    prefix_caching: Annotated[
        bool | None,
        typer.Option(
            "--prefix-caching/--no-prefix-caching",
            help="Reuse the KV blocks of prompt prefixes computed before (vLLM's automatic "
            "prefix caching; hit rate in /metrics and /health). Default: on for the native "
            "engine (as vLLM V1); the hf and openvino engines have none. With --engine vllm, "
            "--no-prefix-caching passes --no-enable-prefix-caching.",
        ),
    ] = None,
    swap_space: Annotated[
        float,
        typer.Option(
            "--swap-space",
            help="GiB of host memory for the KV caches of preempted sequences (as vLLM's flag); "
            "used where swapping beats recomputing for the model and device (the log says "
            "which); 0: recompute only.",
        ),
    ] = 4.0,
    engine_process: Annotated[
        bool | None,
        typer.Option(
            "--engine-process/--no-engine-process",
            help="Run the native engine in its own process (as vLLM's engine core), so "
            "streaming many clients never holds up an engine step; off: an engine thread. "
            "Default: on for CUDA, off on the CPU.",
        ),
    ] = None,
    compile_prefill: Annotated[
        bool | None,
        typer.Option(
            "--compile-prefill/--no-compile-prefill",
            help="torch.compile the native engine's prefill forward too (fused norms, RoPE "
            "and activations; compiled during warm-up). Default: on for CUDA, off on the CPU.",
        ),
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option("--block-size", help="KV-cache block, tokens (default: from the plan)."),
    ] = None,
    num_blocks: Annotated[
        int | None,
        typer.Option(
            "--num-blocks",
            help="KV-cache blocks (default: the plan's KV budget, at most what max-num-seqs "
            "full sequences use).",
        ),
    ] = None,
    max_seq_len: Annotated[
        int | None,
        typer.Option(
            "--max-seq-len",
            help="Longest prompt + output (default: from the plan: the model's context as far "
            "as the KV cache holds it).",
        ),
    ] = None,
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests queued beyond the running ones; then 429.")
    ] = 64,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", help="Per-request limit, seconds (504).")
    ] = 600.0,
    max_body_bytes: Annotated[
        int, typer.Option("--max-body-bytes", help="Largest request body (413).")
    ] = 4 * 1024 * 1024,
    drain_timeout: Annotated[
        float,
        typer.Option(
            "--drain-timeout",
            help="On SIGTERM or SIGINT, seconds in-flight requests get to finish; those still "
            "running then end with an error (streams: an error event and [DONE]).",
        ),
    ] = 30.0,
    embed_batch_window_ms: Annotated[
        float,
        typer.Option(
            "--embed-batch-window-ms", help="Embeddings: wait this long for more requests to batch."
        ),
    ] = 5.0,
    embed_max_batch: Annotated[
        int, typer.Option("--embed-max-batch", help="Embeddings: most texts per forward pass.")
    ] = 64,
    embed_max_inputs: Annotated[
        int,
        typer.Option("--embed-max-inputs", help="Embeddings: most inputs per request (400)."),
    ] = 2048,
    embed_max_tokens: Annotated[
        int,
        typer.Option(
            "--embed-max-tokens", help="Embeddings: most tokens per request, all inputs (400)."
        ),
    ] = 300_000,
    decode_batch_sizes: Annotated[
        str | None,
        typer.Option(
            "--decode-batch-sizes",
            help="Batch sizes the decode step runs at, e.g. 1,8,64 (batches pad up; on CUDA one "
            "compiled graph each). Default: 1,4,16,... on CUDA, 1,2,4,... on the CPU.",
        ),
    ] = None,
    warmup_tokens: Annotated[
        int,
        typer.Option(
            "--warmup-tokens",
            help="Before accepting requests, compile the decode step of every batch size for "
            "contexts up to this many tokens (longer ones compile on first use; 0: none). "
            "CUDA only: the CPU decode step is not compiled.",
        ),
    ] = 1024,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    threads: Annotated[int | None, typer.Option(help="CPU threads (default: all).")] = None,
    gguf: Annotated[
        str | None, typer.Option(help="--engine llamacpp: the GGUF file to serve.")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="--engine: print the command instead of running it.")
    ] = False,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
) -> None:
    """Serve a model over the OpenAI API (completions, chat, embeddings) with continuous batching.

    Scheduler and KV-cache settings not given come from the plan (a run's recorded one, else
    `llmopt plan`'s arithmetic for this machine); the log says where each came from.
    """
    import logging
    from contextlib import nullcontext

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    common = dict(
        host=host,
        port=port,
        served_name=served_name,
        api_key=api_key,
        max_queue=max_queue,
        request_timeout_s=request_timeout,
        max_body_bytes=max_body_bytes,
        drain_timeout_s=drain_timeout,
        embed_batch_window_ms=embed_batch_window_ms,
        embed_max_batch=embed_max_batch,
        embed_max_inputs=embed_max_inputs,
        embed_max_tokens=embed_max_tokens,
        device=device,
        threads=threads,
        decode_batch_sizes=_int_list(decode_batch_sizes, "--decode-batch-sizes"),
        warmup_tokens=warmup_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        engine_process=engine_process,
        compile_prefill=compile_prefill,
        enable_prefix_caching=prefix_caching,
        swap_space_gib=swap_space,
        http2=http2,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )
    requested = {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_seq_len": max_seq_len,
    }
    own = engine if _in_process(engine) else None  # llmopt's own server on this engine
    if own:
        engine = None
    chosen = None if engine or own else chosen_external_engine(model)
    if chosen:  # the run chose an engine with its own server: serve what was measured
        sys.stderr.write(f"note: the run chose the {chosen} engine; serving it with its server\n")
        engine = chosen
    if engine and (http2 or ssl_certfile or ssl_keyfile):
        raise ServeSourceError(
            f"--http2 and --ssl-certfile/--ssl-keyfile are options of llmopt's own server, not "
            f"of {engine}'s",
            "serve with --engine torch or --engine hf, or put the deploy bundle's nginx (TLS and "
            "HTTP/2 to clients) in front of the engine's server",
        )
    if engine:  # the engine's own server takes the plan's flags itself (llmopt.serve.external)
        given = {k: v for k, v in requested.items() if v is not None}
        settings = ServeSettings(
            **common,
            **given,
            recipe=recipe or "fp32",  # type: ignore[arg-type]
            sources=dict.fromkeys(given, "flag"),
        )

        cfg = external_command(engine, model, settings, gguf, dry_run=dry_run)
        sys.stderr.write(f"launching: {cfg.command}\n")
        for note in cfg.notes:
            sys.stderr.write(f"note: {note}\n")
        raise typer.Exit(launch_external(cfg, dry_run=dry_run))
    if gguf:
        raise ValueError("--gguf is for --engine llamacpp")
    if http2:  # before the model loads: a missing server is told in a second, with its fix
        from llmopt.serve.hypercorn_server import require_hypercorn  # heavy: starlette

        require_hypercorn()
    from llmopt.serve.server import load_context, run_server  # heavy: starlette

    settings = resolve_settings(model, requested, recipe, **common)
    with console.status(f"loading {model}") if sys.stderr.isatty() else nullcontext():
        ctx = load_context(model, settings, recipe, engine=own)
    if any(a == "--api-key" or a.startswith("--api-key=") for a in sys.argv):
        sys.stderr.write(
            "warning: --api-key is visible to every user of this machine (`ps`); "
            "set LLMOPT_API_KEY in the environment instead\n"
        )
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        sys.stderr.write(f"warning: listening on {host} without --api-key\n")
    if ctx.effective:
        shown = ", ".join(f"{k} {v['value']} ({v['source']})" for k, v in ctx.effective.items())
        sys.stderr.write(f"settings: {shown}\n")
    where = f"{settings.scheme}://{host}:{port}/v1"
    proto = "HTTP/2 and HTTP/1.1, hypercorn" if http2 else "HTTP/1.1, uvicorn"
    sys.stderr.write(f"serving {ctx.served_name} ({ctx.task}) on {where} ({proto})\n")
    run_server(ctx, log_level=log_level.lower())


def _int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(
            f"{text!r}: give whole numbers separated by commas", param_hint=flag
        ) from None


def register(app: typer.Typer) -> None:
    """Add `serve` to the `llmopt` app."""
    app.command("serve")(serve)
