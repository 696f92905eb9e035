"""CLI command of the verify stage: `llmopt verify REFERENCE CANDIDATE`.

Wiring only: build the gates, call `llmopt.verify.api.verify_models`, render the gate table (or
JSON with --json), exit 1 when a gate fails. Library imports happen inside the command so
`llmopt --help` stays instant.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llmopt.cli.render import console
from llmopt.verify.api import verify_models
from llmopt.verify.embedding import RetrievalSpec
from llmopt.verify.gates import Gates, gate_rows

if TYPE_CHECKING:
    from llmopt.verify.api import VerifyReport

__all__ = ["verify", "register", "render_report", "retrieval_spec"]


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
    return str(x)


# The gate table fits an 80-column terminal with every number in full: numbers never wrap or
# shorten (at most 10 characters each, `_fmt`), the CI is split over two lines at its comma,
# and the metric name is the column that folds.
# Headers are short so they take no more room than the numbers under them.
_NUMBER_COLUMNS = ("ref", "candidate", "delta", "95% CI", "limit", "gate", "n")


def render_report(report: VerifyReport) -> None:
    """Print the gate table, notes, integrity problems and layer attribution."""
    from rich import box
    from rich.table import Table

    t = Table(
        title=f"verify {report.candidate}  vs  {report.reference}",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        show_edge=False,
    )
    t.add_column("metric", overflow="fold", min_width=8)
    for col in _NUMBER_COLUMNS:
        if col == "gate":  # a word ("pass", "FAIL", "report"): it may fold, numbers may not
            t.add_column(col, overflow="fold", min_width=4)
        else:
            t.add_column(col, no_wrap=True, justify="right")
    for r in gate_rows(report.result):
        ci = "-" if r["ci"] is None else f"[{_fmt(r['ci'][0])},\n {_fmt(r['ci'][1])}]"
        if r["noise"]:
            ci += "\nnoise"
        style = {"pass": "green", "FAIL": "bold red"}.get(r["status"], "")
        t.add_row(
            r["metric"],
            _fmt(r["reference"]),
            _fmt(r["candidate"]),
            _fmt(r["delta"]),
            ci,
            _fmt(r["threshold"]),
            f"[{style}]{r['status']}[/]" if style else r["status"],
            str(r["n"]),
        )
    console.print(t)
    for note in report.result.notes:
        console.print(f"note: {note}", highlight=False)
    if report.attribution:
        a = report.attribution
        worst = min(a["layers"], key=lambda layer: layer["sqnr_db"])
        where = a["first_jump_name"] or "none"
        console.print(
            f"layer SQNR: first jump at {where}; lowest {worst['sqnr_db']:.1f} dB at "
            f"{worst['name']}",
            highlight=False,
        )
    verdict = "[green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
    console.print(f"{verdict} in {report.result.seconds:.1f} s")


def retrieval_spec(
    pairs: Path | None,
    threshold: float | None,
    queries: Path | None,
    corpus: Path | None,
    top_k: int = 10,
) -> RetrievalSpec:
    """The embedding options of `verify` and `optimize` as one `RetrievalSpec` (files read)."""
    try:
        return RetrievalSpec.from_options(pairs, threshold, queries, corpus, top_k)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


def verify(
    reference: Annotated[str, typer.Argument(help="Reference: built-in name or HF folder.")],
    candidate: Annotated[
        str | None, typer.Argument(help="Candidate folder or built-in (omit with --endpoint).")
    ] = None,
    endpoint: Annotated[
        str | None,
        typer.Option(
            help="OpenAI-compatible server to verify instead, e.g. http://127.0.0.1:8000/v1."
        ),
    ] = None,
    endpoint_model: Annotated[
        str | None, typer.Option(help="Model name to send to the endpoint (default: its first).")
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            help="The candidate folder's recipe (fp32, bf16, w8a16); read from config.json."
        ),
    ] = None,
    gates: Annotated[str, typer.Option(help="Gate preset: default, strict or loose.")] = "default",
    max_quality_drop: Annotated[
        float | None,
        typer.Option(help="Primary budget: relative perplexity increase (LMs) or 1 - mean cosine."),
    ] = None,
    windows: Annotated[int, typer.Option(help="Causal LMs: held-out windows.")] = 8,
    window: Annotated[int, typer.Option(help="Causal LMs: tokens per window.")] = 256,
    sentences: Annotated[int, typer.Option(help="Embeddings: held-out sentences.")] = 1000,
    tasks: Annotated[
        Path | None, typer.Option(help="Causal LMs: multiple-choice JSONL file to score.")
    ] = None,
    no_attribution: Annotated[
        bool, typer.Option("--no-attribution", help="Skip the per-layer SQNR comparison.")
    ] = False,
    pairs: Annotated[
        Path | None,
        typer.Option(help="Embeddings: your sentence pairs (JSONL: text1, text2, optional label)."),
    ] = None,
    threshold: Annotated[
        float | None,
        typer.Option(help="Embeddings: your similarity threshold; recalibrated for the candidate."),
    ] = None,
    queries: Annotated[
        Path | None, typer.Option(help="Embeddings: your queries (JSONL 'text' or one a line).")
    ] = None,
    corpus: Annotated[
        Path | None,
        typer.Option(help="Embeddings: your corpus for the FAISS index check (default: built-in)."),
    ] = None,
    top_k: Annotated[int, typer.Option(help="Embeddings: neighbours of the index check.")] = 10,
    threads: Annotated[int | None, typer.Option(help="CPU threads (default: all).")] = None,
    out: Annotated[Path | None, typer.Option(help="Also write the report as JSON here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Prove a candidate computes what the reference computes: gated metrics, CIs, layer SQNR."""
    import torch

    # Before torch starts its thread pool, so every worker thread inherits it (the flag is per
    # thread): SmolLM2's fp32 forward makes denormals, which cost 6-15x on CPU (docs/verify.md).
    torch.set_flush_denormal(True)

    if candidate is None and endpoint is None:
        raise ValueError("give a CANDIDATE folder or --endpoint URL")
    overrides = {} if max_quality_drop is None else {"max_quality_drop": max_quality_drop}
    g = Gates.preset(gates, **overrides)
    with nullcontext() if as_json else console.status("verifying"):
        report = verify_models(
            reference,
            candidate,
            endpoint=endpoint,
            endpoint_model=endpoint_model,
            recipe=recipe,
            gates=g,
            windows=windows,
            window=window,
            sentences=sentences,
            tasks=tasks,
            attribution=not no_attribution,
            threads=threads,
            retrieval=retrieval_spec(pairs, threshold, queries, corpus, top_k),
        )
    data = report.to_dict() | {"gates": g.to_dict()}
    if out:
        out.write_text(json.dumps(data, indent=2, default=str))
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        render_report(report)
    if not report.passed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `llmopt` app."""
    app.command("verify")(verify)
