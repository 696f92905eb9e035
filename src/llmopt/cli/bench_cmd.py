"""CLI commands of the bench stage: `llmopt bench serve | compare | roofline | lm`.

Wiring only: each command builds typed inputs, calls one library function in `llmopt.bench` and
renders the result (tables, or JSON with --json). Library imports happen inside the commands so
`llmopt --help` stays instant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from llmopt.assets import resolve_model
from llmopt.bench.compare import compare_runs, to_html, to_markdown
from llmopt.bench.lm_run import bench_lm_model
from llmopt.bench.loadgen import Workload
from llmopt.bench.roofline import measure_ceilings
from llmopt.bench.serve_metrics import SLO
from llmopt.bench.sweep import headline_for, parse_points, run_sweep
from llmopt.cli.render import console
from llmopt.core.atomic import write_json, write_text
from llmopt.core.recipes import get_recipe

__all__ = ["register", "bench_app"]

bench_app = typer.Typer(
    help="Benchmarks: online load against an OpenAI-compatible server, in-process LM speed with "
    "roofline attribution, and side-by-side comparison of runs.",
    no_args_is_help=True,
)
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")
]


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _write(out: Path | None, doc: dict[str, Any]) -> Path | None:
    if out is None:
        return None

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench.json", doc)
    return out / "bench.json"


@bench_app.command("serve")
def serve(
    url: Annotated[
        str, typer.Option(help="Server root (loopback unless --allow-remote).")
    ] = "http://127.0.0.1:8000",
    model: Annotated[
        str | None, typer.Option(help="Model id (default: the server's first).")
    ] = None,
    mode: Annotated[str, typer.Option(help="concurrency, rate or poisson.")] = "concurrency",
    values: Annotated[
        str, typer.Option(help="Sweep values: concurrencies or req/s, e.g. 1,2,4.")
    ] = "1",
    burstiness: Annotated[
        float, typer.Option(help="Gamma shape for poisson (1 = Poisson, <1 burstier).")
    ] = 1.0,
    num_requests: Annotated[int, typer.Option("--num-requests", help="Requests per run.")] = 16,
    max_seconds: Annotated[
        float, typer.Option("--max-seconds", help="Wall-time bound per run.")
    ] = 300.0,
    input_len: Annotated[int, typer.Option("--input-len", help="Synthetic prompt tokens.")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", help="max_tokens per request.")] = 64,
    range_ratio: Annotated[
        float, typer.Option("--range-ratio", help="Lengths uniform in len*(1±r).")
    ] = 0.0,
    prompts: Annotated[Path | None, typer.Option(help='JSONL of {"prompt", "max_tokens"}.')] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Ask the server to ignore EOS.")
    ] = False,
    endpoint: Annotated[
        str, typer.Option(help="completions, chat or embeddings (/v1/embeddings).")
    ] = "completions",
    batch_sizes: Annotated[
        str,
        typer.Option("--batch-sizes", help="Embeddings: texts per request, a mix, e.g. 1,8,32."),
    ] = "1",
    percentiles: Annotated[
        str, typer.Option(help="Latency percentiles to report, e.g. 50,90,95,99.")
    ] = "50,90,95,99",
    repeats: Annotated[int, typer.Option(help="Runs per point (>= 2 measures the noise).")] = 3,
    warmups: Annotated[
        int,
        typer.Option(
            help="Untimed requests sent one by one before each run (0: none, e.g. when the "
            "caller warmed the server and reads its counters around the runs)."
        ),
    ] = 1,
    ttft_ms: Annotated[
        float | None, typer.Option("--ttft-ms", help="Goodput SLO: TTFT, ms.")
    ] = None,
    tpot_ms: Annotated[
        float | None, typer.Option("--tpot-ms", help="Goodput SLO: TPOT, ms.")
    ] = None,
    e2el_ms: Annotated[
        float | None, typer.Option("--e2el-ms", help="Goodput SLO: E2E latency, ms.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Per-request timeout, s.")] = 120.0,
    label: Annotated[str, typer.Option(help="Name of this run in comparisons.")] = "",
    out: Annotated[Path | None, typer.Option(help="Folder to write bench.json into.")] = None,
    allow_remote: Annotated[
        bool, typer.Option("--allow-remote", help="Permit a non-loopback host.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed for arrivals and lengths.")] = 0,
    http2: Annotated[
        bool,
        typer.Option(
            "--http2",
            help="Speak HTTP/2 (h2c by prior knowledge on http://, h2 by ALPN on https://) over "
            "one connection that multiplexes every request in flight; default: HTTP/1.1, a "
            "keep-alive connection per request in flight. For a self-signed https server, point "
            "SSL_CERT_FILE at its certificate.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Load an OpenAI-compatible endpoint; TTFT/TPOT/ITL/E2EL and goodput as vLLM defines them."""
    from rich.progress import Progress

    points = parse_points(
        mode,
        values,
        burstiness=burstiness,
        num_requests=num_requests,
        max_seconds=max_seconds,
        seed=seed,
    )
    w = Workload(
        input_len,
        output_len,
        range_ratio,
        prompts,
        ignore_eos,
        endpoint=endpoint,
        batch_sizes=_ints(batch_sizes, "--batch-sizes"),
    )
    pcts = _percentiles(percentiles)
    slo = SLO(ttft_ms, tpot_ms, e2el_ms)
    with Progress(disable=as_json, transient=True) as prog:
        task = prog.add_task("load runs", total=len(points) * repeats)
        res = run_sweep(
            url,
            points,
            w,
            repeats,
            slo,
            model,
            label,
            allow_remote,
            timeout,
            on_run=lambda k, n, r: prog.update(task, completed=k),
            warmups=warmups,
            percentiles=pcts,
            http2=http2,
        )
    path = _write(out, res)
    if as_json:
        _emit(res if path is None else {"bench_json": str(path)} | res)
    else:
        _render_serve(res, path)
    # Failures are data (recorded above), but a run where nothing succeeded must not look green.
    if all(r["metrics"]["completed"] == 0 for pt in res["points"] for r in pt["runs"]):
        raise typer.Exit(1)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"{flag} {text!r}: give whole numbers, e.g. 1,8,32") from None
    if not vals:
        raise typer.BadParameter(f"{flag}: give at least one number")
    return vals


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"--percentiles {text!r}: give numbers, e.g. 50,95,99") from None
    if not vals or any(not 0 < v < 100 for v in vals):
        raise typer.BadParameter(f"--percentiles {text!r}: each must be in (0, 100)")
    # p95 is in every headline table, so it is always computed.
    return tuple(sorted({*vals, 95.0}))


def _render_serve(res: dict[str, Any], path: Path | None) -> None:
    from rich.table import Table

    # Metrics as rows, sweep points as columns: stays readable in 80 columns for a few points.
    proto = f" over {res['http_version']}" if res.get("http_version") else ""
    t = Table(
        title=f"{res['label']} @ {res['url']}{proto}: median \\[min-max] of {res['repeats']} runs"
    )
    t.add_column("metric")
    for pt in res["points"]:
        t.add_column(pt["spec"]["label"], justify="right")
    for key, unit, _ in headline_for(res.get("endpoint", "completions")):
        cells = []
        for pt in res["points"]:
            st = pt["summary"].get(key)
            cells.append(f"{st['median']:.1f} [{st['min']:.1f}-{st['max']:.1f}]" if st else "-")
        t.add_row(f"{key} ({unit})", *cells)
    console.print(t)
    if res.get("http_version"):
        console.print(f"protocol: {res['http_version']}, connections: {res['connections']}")
    for pt in res["points"] if res.get("endpoint") != "embeddings" else []:  # nothing finishes
        reasons = pt["runs"][0].get("finish_reasons", {})
        if set(reasons) - {"length", "stop"}:
            console.print(f"{pt['spec']['label']}: finish reasons {reasons} (streams cut short?)")
    if path:
        console.print(f"wrote {path}")


@bench_app.command("compare")
def compare(
    runs: Annotated[
        list[Path],
        typer.Argument(
            help="Two or more runs: serve bench.json (or its folder) or optimize run dirs."
        ),
    ],
    html: Annotated[
        Path | None, typer.Option(help="Write a self-contained HTML page with plots.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Side-by-side table (the first RUN is the baseline); changes inside the spread say 'noise'."""

    cmp = compare_runs(list(runs))
    if html is not None:
        write_text(html, to_html(cmp))
    if as_json:
        _emit(cmp | {"html": str(html) if html else None})
        return
    sys.stdout.write(to_markdown(cmp))
    if html is not None:
        sys.stdout.write(f"wrote {html}\n")


@bench_app.command("roofline")
def roofline(
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """Measure this machine's ceilings: memory copy bandwidth and matmul FLOP/s per dtype."""

    dtypes = ("float32", "bfloat16") if device == "cpu" else ("float32", "bfloat16", "float16")
    c = measure_ceilings(device, dtypes=dtypes)
    if as_json:
        _emit(c.to_dict())
        return
    sys.stdout.write(f"copy bandwidth: {c.copy_bytes_per_s / 1e9:.1f} GB/s (read + write)\n")
    for k, v in c.matmul_flops_per_s.items():
        sys.stdout.write(
            f"matmul {k}: {v / 1e9:.1f} GFLOP/s; ridge {v / c.copy_bytes_per_s:.1f} FLOP/byte\n"
        )


@bench_app.command("lm")
def lm(
    model: Annotated[
        str, typer.Argument(help="A built-in name or a Hugging Face folder.")
    ] = "smollm2-135m",
    engine: Annotated[str, typer.Option(help="Engine registry name.")] = "hf",
    recipe: Annotated[str, typer.Option(help="Recipe preset (fp32, bf16, w8a16, ...).")] = "fp32",
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="Decode batch sizes.")] = "1,4",
    prompt_lengths: Annotated[
        str, typer.Option("--prompt-lengths", help="Extra prefill lengths.")
    ] = "32",
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens")] = 100,
    new_tokens: Annotated[int, typer.Option("--new-tokens")] = 32,
    repeats: Annotated[int, typer.Option()] = 3,
    threads: Annotated[int | None, typer.Option(help="CPU threads (default: all).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """In-process prefill/decode sweep of one engine+recipe, with roofline attribution."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="llmopt-quant-") as tmp:
        checkpoint = None
        if get_recipe(recipe).calibrated:  # quantized first; the engine only loads checkpoints
            from llmopt.quant import build_checkpoint  # heavy: torch

            checkpoint = Path(tmp) / "checkpoint"
            build_checkpoint(resolve_model(model)[0], recipe, checkpoint)
        res = bench_lm_model(
            model,
            engine,
            recipe,
            [int(b) for b in batch_sizes.split(",") if b],
            [int(p) for p in prompt_lengths.split(",") if p],
            prompt_tokens,
            new_tokens,
            repeats,
            threads,
            checkpoint=checkpoint,
        )
    if as_json:
        _emit(res)
        return
    sys.stdout.write(lm_header(res) + "\n")
    for name, st in res["metrics"].items():
        sys.stdout.write(
            f"{name}: {st['median']:.1f} {st['unit']} [{st['min']:.1f}-{st['max']:.1f}]\n"
        )
    c = res["ceilings"]
    flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in c["matmul_flops_per_s"].items())
    again = (
        " (measured twice: a phase ran above the first)" if res.get("ceilings_remeasured") else ""
    )
    sys.stdout.write(
        f"ceilings{again}: copy {c['copy_bytes_per_s'] / 1e9:.1f} GB/s; matmul {flops}\n"
    )
    for r in res["roofline"]:
        sys.stdout.write(
            f"{r['metric']}: {r['achieved_bytes_per_s'] / 1e9:.1f} GB/s ({100 * r['bandwidth_share']:.0f}% "
            f"of copy), {r['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s ({100 * r['flops_share']:.0f}%): "
            f"{r['verdict']}; {r['implication']}\n"
        )


def lm_header(res: dict) -> str:
    """What `bench lm` measured, before its numbers: model, engine, recipe, lengths, threads.

    >>> print(lm_header({"model": "m", "engine": "hf", "recipe": "fp32", "settings": {
    ...     "prompt_tokens": 100, "new_tokens": 32, "prompt_lengths": [32], "batch_sizes": [1, 4],
    ...     "repeats": 3, "threads": 2}}))
    model m, engine hf, recipe fp32; prompt 100 tokens (+ prefill 32), 32 new tokens, decode batch 1,4; 3 repeats, 2 threads
    """
    s = res["settings"]
    extra = ", ".join(str(p) for p in s.get("prompt_lengths") or [])
    return (
        f"model {res['model']}, engine {res['engine']}, recipe {res['recipe']}; "
        f"prompt {s['prompt_tokens']} tokens{f' (+ prefill {extra})' if extra else ''}, "
        f"{s['new_tokens']} new tokens, decode batch {','.join(map(str, s['batch_sizes']))}; "
        f"{s['repeats']} repeats, {s['threads']} threads"
    )


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `llmopt` app."""
    app.add_typer(bench_app, name="bench")
