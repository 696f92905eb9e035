"""Scheduler and KV-cache settings the user did not pass: from the run's plan, else planned here.

Five settings size the server: `max_num_seqs`, `max_num_batched_tokens`, `block_size`,
`num_blocks` and `max_seq_len`. Each one comes from the first of these that has it:

    flag      given on the command line (always wins)
    run plan  for `runs/NAME[/best]`, what optimize recorded: `best/launch.json`'s serve command
              (the max-num-seqs that measured the most decode throughput), then the deploy
              bundle's serving plan (`best/deploy/plan.json`) when it was planned for this kind
              of device
    plan      `plan_serving` computed now for this device (80% of the free RAM on the CPU; 90%
              of the GPU, never more than is free, on CUDA) and the recipe's precision:
              sequences the KV cache holds at the workload's length, the model's context as far
              as the cache holds it, vLLM's step budget
    default   the fixed fallbacks (8 sequences, 2048 tokens, 16-token blocks, a cache for
              max-num-seqs full sequences, the model's context up to 4096) when nothing plans:
              an embedding model, a plan that finds no room for a KV cache

Whatever the source, the KV cache never gets more blocks than `max_num_seqs` sequences of
`max_seq_len` tokens can use (the rest would be allocated and never touched). On the CPU the
plan's numbers are for vLLM on a big server; a CPU gets at most 4 sequences per thread (at least
4), a step budget of max(2048, 512 per thread) tokens and a KV cache of at most 4 GiB (vLLM CPU's
default `VLLM_CPU_KVCACHE_SPACE`).

>>> s = resolve_settings("smollm2-135m", {"max_num_seqs": 4})   # doctest: +SKIP
>>> s.max_num_seqs, s.sources["max_num_seqs"], s.sources["num_blocks"]   # doctest: +SKIP
(4, 'flag', 'plan')
"""

from __future__ import annotations

import logging
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.core.atomic import read_json
from llmopt.core.recipes import get_recipe
from llmopt.hardware.host import probe_memory, usable_cores
from llmopt.hardware.specs import match_gpu
from llmopt.hardware.target import Target
from llmopt.planning.serving import plan_serving
from llmopt.planning.workload import Workload
from llmopt.serve.settings import ServeSettings
from llmopt.serve.source import describe_source

__all__ = ["PLANNED", "DEFAULTS", "Resolution", "resolve_settings", "plan_values"]

log = logging.getLogger(__name__)

GiB = 2**30
PLANNED = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_seq_len")
# Fallbacks when nothing plans (None: the engine's own default, see ServeSettings).
DEFAULTS: dict[str, int | None] = {
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
    "block_size": 16,
    "num_blocks": None,
    "max_seq_len": None,
}
FLAGS = {name: "--" + name.replace("_", "-") for name in PLANNED}
CPU_SEQS_PER_THREAD = 4  # decode throughput on CPU stops growing long before vLLM's 256 sequences
CPU_MIN_SEQS = 4
CPU_TOKENS_PER_THREAD = 512  # a 2048-token prefill holds a 2-core machine's decodes ~1 s already
CPU_MIN_BATCHED_TOKENS = 2048
CPU_KV_CACHE_BYTES = 4 * GiB  # vLLM CPU's default VLLM_CPU_KVCACHE_SPACE


@dataclass
class Resolution:
    """Effective values, where each came from ("flag", "run plan", "plan", "default"), and why."""

    values: dict[str, int | None] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value: int | None, source: str, note: str = "") -> None:
        self.values[name], self.sources[name], self.notes[name] = value, source, note

    def planned(self, name: str, source: str, value_note: tuple[int, str]) -> None:
        self.set(name, value_note[0], source, value_note[1])


def resolve_settings(
    model: str, requested: dict[str, int | None], recipe: str | None = None, **kw: Any
) -> ServeSettings:
    """`ServeSettings` for serving `model`, the planned settings filled in.

    Args:
        model: what `llmopt serve` was given (`runs/NAME[/best]`, a folder, a built-in name).
        requested: the five planned settings as the user gave them (None or absent: not given).
        recipe: `--recipe` (a run's best brings its own).
        kw: every other `ServeSettings` field (device, threads, host, ...).

    Raises:
        ValueError: a setting is invalid (the message names where a planned value came from).
    """
    device, threads = kw.get("device", "cpu"), kw.get("threads")
    res = plan_values(model, requested, recipe=recipe, device=device, threads=threads)
    return ServeSettings(
        **kw, **res.values, recipe=recipe or "fp32", sources=res.sources, source_notes=res.notes
    )


def plan_values(
    model: str,
    requested: dict[str, int | None],
    *,
    recipe: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
) -> Resolution:
    """The five planned settings for `model` on `device` (see the module docstring)."""
    res = Resolution()
    for name in PLANNED:
        if requested.get(name) is not None:
            res.set(name, int(requested[name]), "flag", FLAGS[name])  # type: ignore[arg-type]
    if len(res.values) == len(PLANNED):
        return res

    best, info, recipe = describe_source(model, recipe)
    if info.task != "causal-lm":
        for name in PLANNED:
            if name not in res.values:
                res.set(
                    name, DEFAULTS[name], "default", f"unused: {info.name} is an embedding model"
                )
        return res
    cpu = device == "cpu"
    threads = threads or usable_cores()
    run = _run_plan(best, device) if best is not None else {}
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_seq_len"):
        if name not in res.values and name in run:
            value, note, measured = run[name]  # measured here: no cap, it is this machine's
            res.planned(
                name, "run plan", _cpu_cap(name, value, note, cpu and not measured, threads)
            )
    kv = run.get("kv_tokens")
    plan_kv: tuple[int, int, str] | None = None  # (kv tokens, bytes per token, note)
    missing = [n for n in PLANNED if n not in res.values]
    if missing and not (missing == ["num_blocks"] and kv is not None):
        try:
            plan, note = _plan_here(info, recipe, device, threads)
        except Exception as e:  # planning must never stop the server: the fallbacks still work
            log.warning(
                "no serving plan for %s on %s (%s: %s): fixed defaults",
                info.name,
                device,
                type(e).__name__,
                e,
            )
            plan = None
        if plan is not None and plan.memory.kv_tokens > 0:
            here = {
                "max_num_seqs": plan.max_num_seqs,
                "max_num_batched_tokens": plan.max_num_batched_tokens,
                "block_size": plan.memory.block_size,
                "max_seq_len": plan.max_model_len,
            }
            wl = plan.workload
            held = plan.memory.sequences_at(wl.input_len + wl.output_len)
            seqs_note = (
                f"the KV cache holds {held} sequences of {wl.input_len}+{wl.output_len} tokens"
            )
            if cpu and wl.concurrency and wl.concurrency < held:
                seqs_note = (
                    f"{wl.concurrency} for {threads} CPU threads "
                    f"({CPU_SEQS_PER_THREAD} per thread); {seqs_note}"
                )
            for name, value in here.items():
                if name not in res.values:
                    why = {
                        "max_num_seqs": f"{note}; {seqs_note}",
                        "max_num_batched_tokens": f"{note}; vLLM's step budget",
                        "block_size": note,
                        "max_seq_len": f"{note}; the model's context as far as the KV cache "
                        "holds it",
                    }[name]
                    res.planned(name, "plan", _cpu_cap(name, value, why, cpu, threads))
            if kv is None:
                m = plan.memory
                plan_kv = (m.kv_tokens, m.kv_bytes_per_token_per_gpu, note)
        elif plan is not None:
            log.warning(
                "the serving plan finds no room for a KV cache for %s on %s (%s): fixed defaults",
                info.name,
                device,
                plan.notes[0] if plan.notes else "",
            )
    for name in PLANNED:
        if name not in res.values and name != "num_blocks":
            res.set(name, DEFAULTS[name], "default")
    if "num_blocks" not in res.values:
        _num_blocks(res, info, kv, plan_kv, cpu)
    return res


def _cpu_cap(name: str, value: int, note: str, cpu: bool, threads: int) -> tuple[int, str]:
    """(value, note) with the CPU caps applied to a plan's vLLM-sized numbers."""
    if not cpu:
        return value, note
    cap = {
        "max_num_seqs": max(CPU_MIN_SEQS, CPU_SEQS_PER_THREAD * threads),
        "max_num_batched_tokens": max(CPU_MIN_BATCHED_TOKENS, CPU_TOKENS_PER_THREAD * threads),
    }.get(name)
    if cap is None or value <= cap:
        return value, note
    return cap, f"{note}; {value} capped to {cap} for {threads} CPU threads"


def _num_blocks(
    res: Resolution,
    info: Any,
    kv: tuple[int, str] | None,
    plan_kv: tuple[int, int, str] | None,
    cpu: bool,
) -> None:
    """KV blocks: the planned KV tokens, at most what max_num_seqs full sequences can use."""
    bs, seqs = int(res.values["block_size"]), int(res.values["max_num_seqs"])  # type: ignore[arg-type]
    max_len = res.values["max_seq_len"] or min(int(info.max_context or 4096), 4096)
    usable = seqs * math.ceil(int(max_len) / bs)
    if kv is not None:
        tokens, note, source = kv[0], kv[1], "run plan"
    elif plan_kv is not None:
        tokens, per_tok, note = plan_kv
        source = "plan"
        if cpu and per_tok and tokens * per_tok > CPU_KV_CACHE_BYTES:
            tokens = CPU_KV_CACHE_BYTES // per_tok
            note += f"; KV cache capped at {CPU_KV_CACHE_BYTES // GiB} GiB on the CPU"
    else:
        res.set(
            "num_blocks",
            DEFAULTS["num_blocks"],
            "default",
            "enough for max-num-seqs sequences of max-seq-len tokens",
        )
        return
    blocks = tokens // bs
    if blocks > usable:
        blocks, note = (
            usable,
            (
                f"{note}; {tokens:,} KV tokens fit, {seqs} sequences of "
                f"{max_len} tokens use {usable} blocks"
            ),
        )
    else:
        note = f"{note}; {tokens:,} KV tokens"
    blocks = max(1, blocks)
    if blocks * bs < int(max_len) and res.sources["max_seq_len"] in ("plan", "run plan"):
        # The (capped) cache cannot hold one sequence of the planned length: shorten it.
        res.set(
            "max_seq_len",
            blocks * bs,
            res.sources["max_seq_len"],
            f"{res.notes['max_seq_len']}; cut to the {blocks * bs} tokens the KV cache holds",
        )
    res.set("num_blocks", blocks + 1, source, note + " (+1 scratch block)")


def _plan_here(info: Any, recipe: str, device: str, threads: int) -> tuple[Any, str]:
    """`plan_serving` for this machine now, with the recipe's weight precision and KV dtype."""
    from dataclasses import replace

    precision, dtype = _precision(recipe, device)
    if device == "cpu":
        avail = int(probe_memory()["available_bytes"])
        target = replace(
            Target.cpu_host(threads), memory_bytes=avail, source="this machine: available RAM"
        )
        # How many requests a CPU batches usefully: the plan's concurrency, so its reserve
        # (logits of max-num-seqs sequences) is sized for what will really run.
        workload = Workload(concurrency=max(CPU_MIN_SEQS, CPU_SEQS_PER_THREAD * threads))
        utilization = None  # the plan's 0.80 of the available RAM
        where = f"{avail / GiB:.1f} GiB RAM available, {threads} threads"
    else:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device cuda asked for, but torch sees no CUDA GPU")
        free, total = torch.cuda.mem_get_info()
        p = torch.cuda.get_device_properties(0)
        spec = match_gpu(p.name)
        # The GPU as it is (its size picks vLLM's step budget); what others already hold lowers
        # the share the engine may take: at most vLLM's 0.90 of it, never more than is free.
        cc = f"{p.major}.{p.minor}"
        gpu = {"name": p.name, "memory_bytes": int(total), "compute_capability": cc}
        bandwidth = spec.bandwidth_gbs if spec else None
        target = Target(
            "cuda", memory_bytes=int(total), gpu=gpu, bandwidth_gbs=bandwidth, source="torch.cuda"
        )
        workload, utilization = None, min(0.90, free / total)
        where = f"{p.name}, {free / GiB:.1f} of {total / GiB:.1f} GiB free"
    plan = plan_serving(
        info,
        target,
        workload,
        precision=precision,
        dtype=dtype,
        kv_dtype=dtype,
        utilization=utilization,
    )
    return plan, f"{where}, {precision} weights, {dtype} KV"


def _precision(recipe: str, device: str) -> tuple[str, str]:
    """(weight precision, compute = KV dtype) of a recipe as the native engine loads it."""

    rec = get_recipe(recipe)
    dtype = str(rec.dtype)
    if device == "cpu" and dtype == "float16":
        dtype = "float32"  # load_generator computes fp16 recipes in fp32 on the CPU
    bits = getattr(rec, "weight_bits", None)
    if bits == 8:
        return ("fp8" if getattr(rec, "weight_type", "int") == "float" else "int8"), dtype
    if bits == 4:
        return "int4", dtype
    return dtype, dtype


def _run_plan(best: Path, device: str) -> dict[str, Any]:
    """What optimize recorded for serving this run's best: {setting: (value, note)}, plus
    "kv_tokens": (tokens, note) from the deploy bundle's plan."""

    out: dict[str, Any] = {}
    root = best.parent if (best.parent / "run.json").is_file() else None
    run_device = None
    if root is not None:
        try:
            run_device = read_json(root / "run.json").get("target")
        except Exception:  # a damaged run.json: the launch flags are still this run's
            run_device = None
    try:
        launch = read_json(best / "launch.json") if (best / "launch.json").is_file() else {}
    except Exception as e:
        log.warning("%s/launch.json unreadable (%s): not used", best, e)
        launch = {}
    serve = launch.get("serve") or {}
    if serve.get("command") and run_device in (None, device):
        argv = shlex.split(serve["command"])
        why = serve.get("scheduler") or "best/launch.json"
        for name, flag in FLAGS.items():
            if flag in argv[:-1] and name != "num_blocks":
                try:
                    out[name] = (int(argv[argv.index(flag) + 1]), f"best/launch.json: {why}", True)
                except ValueError:
                    log.warning(
                        "best/launch.json: %s %s is not a number", flag, argv[argv.index(flag) + 1]
                    )
    elif serve.get("command"):
        log.info(
            "best/launch.json was measured on %s, not %s: its serve flags are not used",
            run_device,
            device,
        )
    deploy = best / "deploy" / "plan.json"
    if deploy.is_file():
        try:
            d = read_json(deploy)
            kind = (d.get("target") or {}).get("kind")
            if (kind == "gpu") != (device == "cuda"):
                log.info("%s was planned for a %s, not %s: not used", deploy, kind, device)
                return out
            note = f"best/deploy/plan.json ({(d.get('target') or {}).get('name', kind)})"
            mem = d.get("memory") or {}
            for name, value in (
                ("max_num_seqs", d.get("max_num_seqs")),
                ("max_num_batched_tokens", d.get("max_num_batched_tokens")),
                ("block_size", mem.get("block_size")),
                ("max_seq_len", d.get("max_model_len")),
            ):
                if value and name not in out:
                    out[name] = (int(value), note, False)
            tokens, per_tok = mem.get("kv_tokens"), mem.get("kv_bytes_per_token_per_gpu")
            if tokens:
                tokens = int(tokens)
                if device == "cpu" and per_tok and tokens * per_tok > CPU_KV_CACHE_BYTES:
                    tokens = CPU_KV_CACHE_BYTES // int(per_tok)
                    note += f"; KV cache capped at {CPU_KV_CACHE_BYTES // GiB} GiB on the CPU"
                out["kv_tokens"] = (tokens, note)
        except Exception as e:  # a damaged bundle must not stop the server
            log.warning("%s unreadable (%s: %s): not used", deploy, type(e).__name__, e)
    if not out:
        log.info(
            "%s records no serving plan for %s (no serve flags in launch.json, no "
            "deploy/plan.json): planning for this machine",
            best,
            device,
        )
    return out
