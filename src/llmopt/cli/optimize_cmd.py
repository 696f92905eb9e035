"""`llmopt optimize`: the main job (inspect, plan, search, select, report), resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmopt.cli.options import DEFAULT_MODEL, JsonOpt, emit_json
from llmopt.cli.progress import OptimizeProgress
from llmopt.cli.render import render_reverify, render_selection
from llmopt.optimize.budget import Budget, parse_duration
from llmopt.optimize.executor import RAY_MISSING
from llmopt.optimize.job import optimize as run_optimize
from llmopt.optimize.reverify import reverify


def optimize(
    model: Annotated[
        str, typer.Argument(help="A built-in name or a Hugging Face folder.")
    ] = DEFAULT_MODEL,
    out: Annotated[
        Path | None, typer.Option(help="Run directory (default runs/<model name>).")
    ] = None,
    target: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    max_quality_drop: Annotated[
        float,
        typer.Option(
            help="Quality budget as a fraction: relative perplexity increase (LMs) or 1 - mean cosine (embeddings)."
        ),
    ] = 0.01,
    gates: Annotated[
        str,
        typer.Option(
            help="Verification gate preset besides the budget: default, strict or loose "
            "(top-1 agreement, KL, cosine; see docs/verify.md)."
        ),
    ] = "default",
    candidates: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated candidate ids to try (see `llmopt plan`); the reference always runs."
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            help="CPU threads per candidate (default: all cores, fewer when a probe finds them busy)."
        ),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Smaller verification and benchmark work (smoke runs).")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Discard a different run found in --out.")
    ] = False,
    objective: Annotated[
        str, typer.Option(help="What to optimize: latency, throughput, memory or cost.")
    ] = "throughput",
    time_budget: Annotated[
        str,
        typer.Option(
            "--time-budget",
            help="Wall-clock budget of this call, e.g. 15m, 1h, 90s, or none (no limit). "
            "Default: 5m for a model under 1B parameters, 30m otherwise.",
        ),
    ] = "auto",
    search: Annotated[
        str,
        typer.Option(
            help="halving: cheap screen for all, full verify+bench for survivors; exhaustive: full for all."
        ),
    ] = "halving",
    ray: Annotated[
        bool, typer.Option("--ray", help="Evaluate candidates as tasks on a local Ray instance.")
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option("--ray-address", help="Evaluate candidates on this Ray cluster (or 'local')."),
    ] = None,
    price_per_hour: Annotated[
        float | None,
        typer.Option(
            help="Price of the target per hour, for --objective cost (default: relative)."
        ),
    ] = None,
    no_deploy: Annotated[
        bool, typer.Option("--no-deploy", help="Do not write the deploy bundle into best/deploy.")
    ] = False,
    reverify_run: Annotated[
        Path | None,
        typer.Option(
            "--reverify",
            help="Re-verify and re-bench the chosen candidate and the reference of this run "
            "directory, and say whether the choice still holds.",
        ),
    ] = None,
    pairs: Annotated[
        Path | None,
        typer.Option(help="Embedders: your sentence pairs (JSONL: text1, text2, optional label)."),
    ] = None,
    threshold: Annotated[
        float | None,
        typer.Option(help="Embedders: your similarity threshold; gated and recalibrated."),
    ] = None,
    queries: Annotated[
        Path | None, typer.Option(help="Embedders: your queries (JSONL 'text' or one a line).")
    ] = None,
    corpus: Annotated[
        Path | None, typer.Option(help="Embedders: your corpus for the FAISS index check.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """The main job: inspect, plan, search (screen, verify, bench), select, report. Resumes if re-run."""

    address = ray_address or ("local" if ray else None)
    if address:
        try:
            import ray as _ray  # noqa: F401
        except ImportError:
            raise ValueError(RAY_MISSING) from None
    if reverify_run is not None:
        with OptimizeProgress(enabled=not as_json) as prog:
            res = reverify(reverify_run, progress=prog, ray_address=address)
        emit_json(res) if as_json else render_reverify(res)
        raise typer.Exit(0 if res["holds"] else 1)
    out = out or Path("runs") / Path(model).name
    only = [c.strip() for c in candidates.split(",")] if candidates else None
    started = Budget.process_start()
    budget_s = None if time_budget == "auto" else parse_duration(time_budget)
    with OptimizeProgress(enabled=not as_json, budget_s=budget_s, started_at=started) as prog:
        res = run_optimize(
            model,
            out,
            target=target,
            max_quality_drop=max_quality_drop,
            gates=gates,
            candidates=only,
            threads=threads,
            profile="quick" if quick else "full",
            force=force,
            progress=prog,
            objective=objective,
            time_budget=time_budget,
            search=search,
            ray_address=address,
            price_per_hour=price_per_hour,
            deploy=not no_deploy,
            budget_started_at=started,
            retrieval=_retrieval(pairs, threshold, queries, corpus),
        )
    if as_json:
        emit_json(
            {
                "run_dir": str(res.run_dir),
                "selection": res.selection.to_dict(),
                "resumed": res.resumed,
                "ran": res.ran,
                "skipped": res.skipped,
                "search": res.search,
                "report_html": str(res.report_html),
                "report_md": str(res.report_md),
            }
        )
    else:
        render_selection(res)
    if res.selection.chosen is None:
        raise typer.Exit(1)


def _retrieval(pairs, threshold, queries, corpus) -> dict | None:
    options = {"pairs": pairs, "threshold": threshold, "queries": queries, "corpus": corpus}
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in options.items()}
    return options if any(v is not None for v in options.values()) else None


def register(app: typer.Typer) -> None:
    """Add `optimize` to the `llmopt` app."""
    app.command("optimize")(optimize)
