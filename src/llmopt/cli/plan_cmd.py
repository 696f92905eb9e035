"""`llmopt plan`: one plan for a model on a target: memory, layout, engine, launch flags, candidates."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import (
    ConcOpt,
    ConfigModelArg,
    CpuOpt,
    GpuOpt,
    GpusOpt,
    InOpt,
    JsonOpt,
    KvOpt,
    MaxLenOpt,
    OutOpt,
    ParamsOpt,
    PpOpt,
    PrecOpt,
    RateOpt,
    StaticOpt,
    TargetOpt,
    ThreadsOpt,
    TpOpt,
    TpotOpt,
    TtftOpt,
    UtilOpt,
    emit_json,
    serving_target,
    workload,
)
from llmopt.cli.render import console
from llmopt.cli.render_ops import render_plan
from llmopt.hardware.host import usable_cores
from llmopt.model.info import CONFIG_ONLY, inspect_model
from llmopt.optimize.space import make_plan
from llmopt.planning.check import check_plan_on_gpu
from llmopt.planning.serving import plan_serving


def plan(
    model: ConfigModelArg,
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

    info = inspect_model(model, params=params, config_only="auto")
    source = "config" if info.weight_format == CONFIG_ONLY else "weights"
    tgt = serving_target(target, gpu, gpus, cpu, threads)
    wl = workload(
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
        checked = check_plan_on_gpu(serving)
    if as_json:
        extra = {"check": checked} if checked else {}
        emit_json({**opt.to_dict(), "model_source": source, "serving": serving.to_dict(), **extra})
    else:
        render_plan(info, source, params, opt, serving)
        if checked:
            console.print_json(data=checked)


def register(app: typer.Typer) -> None:
    """Add `plan` to the `llmopt` app."""
    app.command("plan")(plan)
