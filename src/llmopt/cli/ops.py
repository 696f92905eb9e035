"""CLI commands for environment and serving operations: `doctor`, `plan` and `deploy`.

Wiring only: each command builds its inputs, calls one library function and renders the result
(tables, or JSON with --json). Library imports happen inside the commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from llmopt.hardware.host import usable_cores
from llmopt.hardware.target import Target
from llmopt.model.info import CONFIG_ONLY, inspect_model
from llmopt.optimize.space import make_plan
from llmopt.planning.serving import plan_serving
from llmopt.planning.workload import Workload

__all__ = ["doctor", "plan", "deploy", "register"]

ModelArg = Annotated[
    str,
    typer.Argument(
        help="A built-in name, a Hugging Face folder, or a folder with only config.json."
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")
]
TargetOpt = Annotated[str, typer.Option(help="cpu or cuda (cuda: the GPUs doctor finds here).")]
GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu", help="Plan for a GPU model you may not have: H200, H100, A100, L40S, L4, B200, ..."
    ),
]
GpusOpt = Annotated[
    int | None,
    typer.Option(
        "--gpus", help="Number of GPUs (default: 1 with --gpu, all found with --target cuda)."
    ),
]
CpuOpt = Annotated[bool, typer.Option("--cpu", help="Shorthand for --target cpu.")]
ThreadsOpt = Annotated[int | None, typer.Option(help="CPU threads (default: all).")]
ParamsOpt = Annotated[
    float | None,
    typer.Option(
        "--params",
        help="Parameter count override, e.g. 8.03e9 (config-only folders are counted from config.json).",
    ),
]
InOpt = Annotated[int, typer.Option("--input-len", help="Typical prompt length, tokens.")]
OutOpt = Annotated[int, typer.Option("--output-len", help="Typical completion length, tokens.")]
ConcOpt = Annotated[int | None, typer.Option("--concurrency", help="Requests in flight at once.")]
RateOpt = Annotated[
    float | None, typer.Option("--rate", help="Arrival rate, requests/s (turned into concurrency).")
]
TtftOpt = Annotated[float | None, typer.Option("--ttft-ms", help="SLO: time to first token, ms.")]
TpotOpt = Annotated[float | None, typer.Option("--tpot-ms", help="SLO: time per output token, ms.")]
MaxLenOpt = Annotated[
    int | None, typer.Option("--max-model-len", help="Longest request to accept, tokens.")
]
PrecOpt = Annotated[
    str | None,
    typer.Option(
        "--precision",
        help="Weights: bfloat16, float16, float32, fp8, int8, int4 (default: bf16 on GPU, fp32 on CPU).",
    ),
]
KvOpt = Annotated[
    str, typer.Option("--kv-dtype", help="KV cache: auto (compute dtype), bfloat16, float16, fp8.")
]
UtilOpt = Annotated[
    float | None,
    typer.Option(
        "--gpu-memory-utilization",
        help="Memory share the engine takes (default 0.90; CPU 0.80 of RAM).",
    ),
]
TpOpt = Annotated[int | None, typer.Option("--tp", help="Force the tensor-parallel size.")]
PpOpt = Annotated[int | None, typer.Option("--pp", help="Force the pipeline-parallel size.")]
StaticOpt = Annotated[
    bool,
    typer.Option(
        "--static-shapes", help="Fixed batch and length (offline jobs): plan a compiled engine."
    ),
]


def _serving_target(
    target: str, gpu: str | None, gpus: int | None, cpu: bool, threads: int | None
) -> Target:
    if gpu:
        return Target.gpu_model(gpu, gpus or 1)
    if cpu or target == "cpu":
        return Target.cpu_host(threads)
    if target != "cuda":
        raise ValueError(f"unknown target {target!r}; use cpu or cuda (or --gpu NAME)")
    from llmopt.doctor import run_doctor

    return Target.from_doctor(run_doctor("cuda"), gpus)


def _workload(**kw: Any) -> Workload:
    return Workload(**kw)


def doctor(
    target: Annotated[
        str,
        typer.Option(help="auto, cpu or cuda: decides whether a missing GPU is ok, warn or fail."),
    ] = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Can this machine run what we plan? Driver, GPUs, CUDA, engines, container: evidence and fixes."""
    from llmopt.cli.options import emit_json
    from llmopt.cli.render import console
    from llmopt.cli.render_ops import render_doctor
    from llmopt.doctor import run_doctor

    if as_json:
        report = run_doctor(target)
        emit_json(report.to_dict())
    else:
        with console.status("checking this machine"):
            report = run_doctor(target)
        render_doctor(report)
    raise typer.Exit(report.exit_code)


def plan(
    model: ModelArg,
    target: TargetOpt = "cpu",
    threads: ThreadsOpt = None,
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    cpu: CpuOpt = False,
    params: ParamsOpt = None,
    input_len: InOpt = 1024,
    output_len: OutOpt = 256,
    concurrency: ConcOpt = None,
    rate: RateOpt = None,
    ttft_ms: TtftOpt = None,
    tpot_ms: TpotOpt = None,
    max_model_len: MaxLenOpt = None,
    precision: PrecOpt = None,
    kv_dtype: KvOpt = "auto",
    gpu_memory_utilization: UtilOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    static_shapes: StaticOpt = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Allocate the planned per-GPU memory on cuda:0 and measure bandwidth (needs the GPU).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """What fits and what should run it? One plan: target, memory math, layout, engine, launch
    flags and the optimizer's candidates, each figure with where it comes from."""
    from llmopt.cli.options import emit_json
    from llmopt.cli.render_ops import render_plan

    info = inspect_model(model, params=params, config_only="auto")
    source = "config" if info.weight_format == CONFIG_ONLY else "weights"
    tgt = _serving_target(target, gpu, gpus, cpu, threads)
    wl = _workload(
        input_len=input_len,
        output_len=output_len,
        concurrency=concurrency,
        request_rate=rate,
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        max_model_len=max_model_len,
        static_shapes=static_shapes,
    )
    serving = plan_serving(
        info,
        tgt,
        wl,
        precision=precision,
        kv_dtype=kv_dtype,
        utilization=gpu_memory_utilization,
        tp=tp,
        pp=pp,
    )
    # Candidates run on the machine that builds them: its threads unless the target names them.
    opt = make_plan(info, tgt, settings={"threads": tgt.threads or threads or usable_cores()})
    if source == "config":
        opt.notes.append("planned from config.json alone: `llmopt optimize` needs the weights")
    checked = None
    if check:
        from llmopt.planning.check import check_plan_on_gpu

        checked = check_plan_on_gpu(serving)
    if as_json:
        extra = {"check": checked} if checked else {}
        emit_json({**opt.to_dict(), "model_source": source, "serving": serving.to_dict(), **extra})
    else:
        render_plan(info, source, params, opt, serving)
        if checked:
            from llmopt.cli.render import console

            console.print_json(data=checked)


def deploy(
    source: Annotated[
        str, typer.Argument(help="A run directory (its best/ candidate) or a model folder.")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Bundle folder to write (replaced if it exists).")
    ],
    target: TargetOpt = "cuda",
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    cpu: CpuOpt = False,
    threads: ThreadsOpt = None,
    params: ParamsOpt = None,
    input_len: InOpt = 1024,
    output_len: OutOpt = 256,
    concurrency: ConcOpt = None,
    rate: RateOpt = None,
    ttft_ms: TtftOpt = None,
    tpot_ms: TpotOpt = None,
    max_model_len: MaxLenOpt = None,
    precision: PrecOpt = None,
    kv_dtype: KvOpt = "auto",
    gpu_memory_utilization: UtilOpt = None,
    tp: TpOpt = None,
    image: Annotated[
        str | None, typer.Option(help="Container image name for compose and Kubernetes.")
    ] = None,
    no_validate: Annotated[
        bool, typer.Option("--no-validate", help="Skip the validators.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a ready-to-run bundle (container, compose, nginx, Kubernetes, start script), validated here."""
    from llmopt.cli.options import emit_json
    from llmopt.cli.render_ops import render_deploy
    from llmopt.deploy import resolve_source, write_bundle

    src = resolve_source(source, params=params)
    st = _serving_target(target, gpu, gpus, cpu, threads)
    wl = _workload(
        input_len=input_len,
        output_len=output_len,
        concurrency=concurrency,
        request_rate=rate,
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        max_model_len=max_model_len,
    )
    kw = {"kv_dtype": kv_dtype, "utilization": gpu_memory_utilization, "tp": tp}
    if precision:
        kw["precision"] = precision
    res = write_bundle(src, out, st, wl, image=image, validate=not no_validate, **kw)
    emit_json(res.to_dict()) if as_json else render_deploy(res)
    if not res.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `llmopt` app."""
    app.command()(doctor)
    app.command()(plan)
    app.command()(deploy)
