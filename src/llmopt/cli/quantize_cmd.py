"""CLI command `llmopt quantize MODEL --recipe NAME --out DIR`.

Wiring only: build the CalibrationConfig, call `llmopt.quant.quantize` (or the GGUF exporter with
--export), render the facts (or JSON with --json). Library imports happen inside the command so
`llmopt --help` stays instant.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from llmopt.assets import resolve_model
from llmopt.cli.render import console

__all__ = ["quantize", "register", "render_facts"]

EXPORTS = ("gguf-q8_0", "gguf-q4_0")


def render_facts(facts: dict[str, Any], out: Path) -> None:
    from rich.table import Table

    r = facts.get("recipe", {})
    t = Table(title=f"quantize {facts.get('source', '')} -> {out}")
    t.add_column("fact")
    t.add_column("value")
    rows = [
        ("recipe", r.get("name", facts.get("export", ""))),
        ("format", str(facts.get("format"))),
    ]
    if "quantized_linears" in facts:
        rows += [
            ("quantized linears", str(facts["quantized_linears"])),
            ("ignored", ", ".join(facts["ignored"]) or "-"),
            ("excluded (auto)", ", ".join(facts["excluded"]) or "-"),
            ("skipped", "; ".join(f"{k}: {v}" for k, v in facts["skipped"].items()) or "-"),
            ("notes", "; ".join(facts.get("notes") or []) or "-"),
        ]
        if facts["calibration"]["windows_used"]:
            rows += [
                (
                    "calibration",
                    f"{facts['calibration']['windows_used']} x "
                    f"{facts['calibration']['seq_len']} tokens, seed {facts['calibration']['seed']}",
                ),
                ("calibration time", f"{facts['calibration_seconds']:.1f} s"),
            ]
        else:
            rows.append(
                (
                    "calibration",
                    "none: round-to-nearest reads only the weights "
                    f"({facts.get('rounding_seconds') or 0:.1f} s; --sensitivity measures layers)",
                )
            )
        if facts.get("peak_device_memory_bytes"):
            rows.append(("peak GPU memory", f"{facts['peak_device_memory_bytes'] / 2**30:.2f} GiB"))
        if facts.get("sensitivity"):
            worst = facts["sensitivity"]["most_sensitive"][:3]
            rows.append(
                (
                    "most sensitive",
                    ", ".join(f"{w['name']} {w['sqnr_db']:.1f} dB" for w in worst) or "-",
                )
            )
        q = facts.get("quality") or {}
        if q:
            rows.append(
                (
                    "perplexity",
                    f"{q['reference_perplexity']:.3f} -> {q['perplexity']:.3f} "
                    f"({q['quality_drop']:+.2%}, budget {q['max_quality_drop']:.2%})",
                )
            )
    rows += [
        ("total time", f"{facts['seconds']:.1f} s"),
        ("peak RSS", f"{facts.get('peak_rss_bytes', 0) / 2**30:.2f} GiB"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def quantize(
    model: Annotated[str, typer.Argument(help="A built-in name (smollm2-135m) or an HF folder.")],
    recipe: Annotated[
        str,
        typer.Option(
            help="w8a16, w4a16 (GPTQ g128), w4a16-{rtn,awq,gptq}[-g32|-g64|-g128], each w4a16 "
            "name + '-asym' (zero point per group), w8a8-int8, fp8-dynamic, fp8-static, kv-fp8."
        ),
    ] = "w8a16",
    out: Annotated[Path | None, typer.Option(help="Output folder (or .gguf file).")] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(help="Calibration text: .txt, or .jsonl with a 'text' field per line."),
    ] = None,
    samples: Annotated[int, typer.Option(help="Calibration windows.")] = 64,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per window.")] = 512,
    seed: Annotated[int, typer.Option(help="Seed for drawing calibration windows.")] = 0,
    auto_exclude: Annotated[
        bool,
        typer.Option(
            "--auto-exclude",
            help="Keep the most sensitive layers unquantized until the quality budget holds.",
        ),
    ] = False,
    max_quality_drop: Annotated[
        float | None,
        typer.Option(help="Budget: relative perplexity increase on held-out text (0.01 = +1%)."),
    ] = None,
    sensitivity: Annotated[
        bool,
        typer.Option(
            "--sensitivity",
            help="Measure each layer's output SQNR on calibration text (always done by "
            "calibrated recipes; w8a16's round-to-nearest otherwise runs no forward pass).",
        ),
    ] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda: where layers are calibrated.")] = "cpu",
    dtype: Annotated[
        str,
        typer.Option(
            help="Load, calibrate and write in: auto (the checkpoint's bf16/fp16 on a GPU, "
            "float32 on the CPU), float32, bfloat16 or float16."
        ),
    ] = "auto",
    export: Annotated[
        str | None, typer.Option(help="Write GGUF for llama.cpp instead: gguf-q8_0 or gguf-q4_0.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts as JSON.")] = False,
) -> None:
    """Quantize a causal LM with calibration (layer by layer) into a compressed-tensors folder
    that vLLM, transformers and the torch engine load, or a GGUF file for llama.cpp."""
    import torch

    # Before torch starts its thread pool (the flag is per thread): fp32 denormals cost 6-15x.
    torch.set_flush_denormal(True)

    if out is None:
        raise ValueError("give --out DIR (the source folder is never modified)")
    if export is not None and export not in EXPORTS:
        raise ValueError(f"--export must be one of {', '.join(EXPORTS)}, not {export!r}")
    source, _ = resolve_model(model)
    if export is not None:
        from llmopt.engines.gguf_export import export_gguf  # heavy: torch

        with console.status(f"writing {export}"):
            facts = export_gguf(source, out, export.removeprefix("gguf-").upper())
    else:
        from llmopt.quant import CalibrationConfig  # heavy: torch
        from llmopt.quant import quantize as run_quantize  # heavy: torch

        cal = CalibrationConfig(calibration, samples, seq_len, seed)
        run = functools.partial(  # all but the progress callback, which depends on --json
            run_quantize,
            source,
            recipe,
            out,
            calibration=cal,
            device=device,
            auto_exclude=auto_exclude,
            max_quality_drop=max_quality_drop,
            dtype=dtype,
            sensitivity=sensitivity,
        )
        if as_json:  # stdout is the JSON; progress goes to stderr, one line per layer
            t0 = time.perf_counter()

            def line(stage: str, done: int, total: int) -> None:
                print(
                    f"{stage}: layer {done}/{total} at {time.perf_counter() - t0:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )

            facts = run(progress=line)
        else:
            from rich.progress import Progress

            with Progress(console=console, transient=True) as bar:
                task = bar.add_task(f"quantizing ({recipe})", total=None)

                def progress(stage: str, done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total, description=f"{stage} layers")

                facts = run(progress=progress)
    if as_json:
        sys.stdout.write(json.dumps(facts, indent=2, default=str) + "\n")
    else:
        render_facts(facts, out)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `llmopt` app."""
    app.command("quantize")(quantize)
