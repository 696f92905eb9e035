"""Typer options shared by several commands, defined once, and the JSON printer.

The target and workload options (`--gpu`, `--input-len`, ...) are shared by `plan` and `deploy`;
`serving_target` and `workload` turn them into the library's `Target` and `Workload`.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from llmopt.doctor import run_doctor
from llmopt.hardware.target import Target
from llmopt.planning.workload import Workload

__all__ = [
    "DEFAULT_MODEL",
    "ModelArg",
    "ConfigModelArg",
    "JsonOpt",
    "emit_json",
    "serving_target",
    "workload",
]

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
    """Print `obj` as indented JSON on stdout (what every `--json` flag prints)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


ConfigModelArg = Annotated[
    str,
    typer.Argument(
        help="A built-in name, a Hugging Face folder, or a folder with only config.json."
    ),
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


def serving_target(
    target: str, gpu: str | None, gpus: int | None, cpu: bool, threads: int | None
) -> Target:
    """The one Target of --gpu/--gpus, --cpu/--threads or --target (cuda: what doctor finds)."""
    if gpu:
        return Target.gpu_model(gpu, gpus or 1)
    if cpu or target == "cpu":
        return Target.cpu_host(threads)
    if target != "cuda":
        raise ValueError(f"unknown target {target!r}; use cpu or cuda (or --gpu NAME)")
    return Target.from_doctor(run_doctor("cuda"), gpus)


def workload(**kw: Any) -> Workload:
    """The Workload of the --input-len ... --max-model-len options."""
    return Workload(**kw)
