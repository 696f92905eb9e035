"""Typer options shared by several commands, defined once, and the JSON printer.

The target, workload and layout options (`--gpu`, `--input-len`, `--tp`, ...) that `plan` and
`deploy` both take are the fields of one `ServingOptions`; a command decorated with
`with_serving_options` declares a `serving: ServingOptions` parameter and gets them as one
typed object, whose `target` and `workload` are the library's `Target` and `Workload`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import sys
from collections.abc import Callable
from typing import Annotated, Any, get_type_hints

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
    "ServingOptions",
    "SERVING_DEFAULTS",
    "with_serving_options",
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


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    """The options `plan` and `deploy` share, in their `--help` order (`with_serving_options`
    turns each field into the option its annotation declares, with the field's default)."""

    gpu: GpuOpt = None
    gpus: GpusOpt = None
    cpu: CpuOpt = False
    threads: ThreadsOpt = None
    params: ParamsOpt = None
    input_len: InOpt = 1024
    output_len: OutOpt = 256
    concurrency: ConcOpt = None
    rate: RateOpt = None
    ttft_ms: TtftOpt = None
    tpot_ms: TpotOpt = None
    max_model_len: MaxLenOpt = None
    precision: PrecOpt = None
    kv_dtype: KvOpt = "auto"
    gpu_memory_utilization: UtilOpt = None
    tp: TpOpt = None

    def target(self, target: str) -> Target:
        """The one Target of --gpu/--gpus, --cpu/--threads or `target` (the command's
        --target: cpu, or cuda: what doctor finds)."""
        if self.gpu:
            return Target.gpu_model(self.gpu, self.gpus or 1)
        if self.cpu or target == "cpu":
            return Target.cpu_host(self.threads)
        if target != "cuda":
            raise ValueError(f"unknown target {target!r}; use cpu or cuda (or --gpu NAME)")
        return Target.from_doctor(run_doctor("cuda"), self.gpus)

    def workload(self, **extra: Any) -> Workload:
        """The Workload of --input-len ... --max-model-len (plus `extra` Workload fields)."""
        return Workload(
            input_len=self.input_len,
            output_len=self.output_len,
            concurrency=self.concurrency,
            request_rate=self.rate,
            ttft_ms=self.ttft_ms,
            tpot_ms=self.tpot_ms,
            max_model_len=self.max_model_len,
            **extra,
        )


# The default of a command's `serving` parameter (the command Typer sees has none).
SERVING_DEFAULTS = ServingOptions()


def with_serving_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give `command` the `ServingOptions` options in place of its `serving` parameter.

    Typer builds a command's options from its signature, one parameter each, and has no
    option groups; so the command Typer sees has the signature of `command` with `serving`
    replaced by one parameter per `ServingOptions` field, and it calls `command` with those
    values collected into `serving=ServingOptions(...)`.
    """
    hints = get_type_hints(command, include_extras=True)
    shared = get_type_hints(ServingOptions, include_extras=True)
    fields = dataclasses.fields(ServingOptions)
    sig = inspect.signature(command)
    if "serving" not in sig.parameters:
        raise TypeError(f"{command.__name__} has no `serving: ServingOptions` parameter")
    params = []
    for p in sig.parameters.values():
        if p.name != "serving":
            params.append(p.replace(annotation=hints[p.name]))
            continue
        params += [
            inspect.Parameter(f.name, p.kind, default=f.default, annotation=shared[f.name])
            for f in fields
        ]

    @functools.wraps(command)
    def typer_command(**kwargs: Any) -> Any:
        serving = ServingOptions(**{f.name: kwargs.pop(f.name) for f in fields})
        return command(serving=serving, **kwargs)

    typer_command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    typer_command.__annotations__ = {p.name: p.annotation for p in params}
    return typer_command
