"""`llmopt plan`: one plan for a model on a target: memory, layout, engine, launch flags, candidates."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import (
    SERVING_DEFAULTS,
    ConfigModelArg,
    JsonOpt,
    PpOpt,
    ServingOptions,
    StaticOpt,
    TargetOpt,
    emit_json,
    with_serving_options,
)
from llmopt.cli.render import console
from llmopt.cli.render_ops import render_plan
from llmopt.hardware.host import usable_cores
from llmopt.model.info import CONFIG_ONLY, inspect_model
from llmopt.optimize.space import make_plan
from llmopt.planning.check import check_plan_on_gpu
from llmopt.planning.serving import plan_serving


@with_serving_options
def plan(
    model: ConfigModelArg,
    target: TargetOpt = "cpu",
    serving: ServingOptions = SERVING_DEFAULTS,  # --gpu ... --tp
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

    o = serving
    info = inspect_model(model, params=o.params, config_only="auto")
    source = "config" if info.weight_format == CONFIG_ONLY else "weights"
    tgt = o.target(target)
    wl = o.workload(static_shapes=static_shapes)
    serving_plan = plan_serving(
        info,
        tgt,
        wl,
        precision=o.precision,
        kv_dtype=o.kv_dtype,
        utilization=o.gpu_memory_utilization,
        tp=o.tp,
        pp=pp,
    )
    # Candidates run on the machine that builds them: its threads unless the target names them.
    opt = make_plan(info, tgt, settings={"threads": tgt.threads or o.threads or usable_cores()})
    if source == "config":
        opt.notes.append("planned from config.json alone: `llmopt optimize` needs the weights")
    checked = None
    if check:
        checked = check_plan_on_gpu(serving_plan)
    if as_json:
        extra = {"check": checked} if checked else {}
        out = {**opt.to_dict(), "model_source": source, "serving": serving_plan.to_dict()}
        emit_json(out | extra)
    else:
        render_plan(info, source, o.params, opt, serving_plan)
        if checked:
            console.print_json(data=checked)


def register(app: typer.Typer) -> None:
    """Add `plan` to the `llmopt` app."""
    app.command("plan")(plan)
