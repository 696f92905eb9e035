"""Roofline attribution: is each phase limited by memory bandwidth, compute, or neither?

The ceilings are measured in the same process and run as the phases (not read from a datasheet):
a large buffer copy gives the memory bandwidth (bytes read + written per second), square matrix
multiplies give FLOP/s per dtype. For a transformer phase the work is known from the model's size:

    FLOPs  ~= 2 * params * tokens            (one multiply-add per weight per token)
    bytes  ~= weight_bytes + kv_bytes         (every weight read once per forward; KV cache read)

Achieved bandwidth and FLOP/s are those divided by the measured phase time; the share of each
ceiling says how close the phase runs to it. The verdict compares the phase's arithmetic intensity
(FLOPs per byte) with the machine's ridge point (peak FLOP/s / bandwidth); when neither share
reaches `overhead_share` the phase is overhead-bound (per-step Python, kernel launch, threading).
A phase above a ceiling (share > 100%) is bound by nothing measured: the ceiling measurement was
low, and the verdict says so ("above-ceiling") instead of naming a bound it exceeds.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from llmopt.bench.timing import device_sync

__all__ = [
    "Ceilings",
    "measure_ceilings",
    "PhaseWork",
    "attribute",
    "attribute_lm",
    "IMPLICATIONS",
    "above_ceiling",
    "best_ceilings",
]

IMPLICATIONS = {
    "memory-bound": (
        "time is spent streaming weights/KV: fewer bytes per token help (weight-only int8/int4 "
        "quantization, smaller KV cache); more FLOP/s (bf16 matmuls) will not"
    ),
    "compute-bound": (
        "time is spent in matrix multiplies: faster math helps (bf16/int8 GEMMs, AMX/tensor "
        "cores, activation quantization); weight-only quantization will not, and may slow it "
        "down by adding dequantization work"
    ),
    "above-ceiling": (
        "the phase ran faster than a ceiling measured in this run, so that ceiling measurement "
        "was low (a busy machine while it was measured, or a working set that fits in cache): "
        "no bound is claimed; re-measure with `llmopt bench roofline` on an idle machine"
    ),
    "overhead-bound": (
        "neither ceiling is near: per-step overhead (Python, kernel launches, small ops) "
        "dominates; fuse or compile the step (torch.compile, CUDA graphs, a native engine) "
        "before changing precision"
    ),
}


@dataclass
class Ceilings:
    """Measured machine ceilings: copy bandwidth (bytes/s) and matmul FLOP/s per dtype."""

    copy_bytes_per_s: float
    matmul_flops_per_s: dict[str, float]
    device: str
    threads: int
    seconds: float  # time spent measuring

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _best_time(fn, repeats: int, sync) -> float:
    fn()  # warm-up: page faults on the first touch, thread-pool start
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _copy_bandwidth(torch, n_elem: int, device: str, repeats: int, sync) -> float:
    src = torch.ones(n_elem, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), repeats, sync)
    return 2 * n_elem * 4 / t  # bytes read from src + bytes written to dst


def measure_ceilings(
    device: str = "cpu",
    copy_mib: int = 256,
    matmul_n: int = 1024,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    repeats: int = 5,
) -> Ceilings:
    """Measure copy bandwidth and matmul FLOP/s per dtype on `device` (about 1-3 s on 2 CPUs).

    Args:
        device: "cpu" or "cuda".
        copy_mib: buffer size; it must exceed the last-level cache so DRAM is measured.
        matmul_n: side of the square matrices (2 * n**3 FLOPs per multiply).
        dtypes: matmul dtypes to measure ("float16" is skipped on CPU, where it is emulated).
        repeats: timed repetitions; the best is kept (a ceiling is the best the machine does).

    Example:
        >>> c = measure_ceilings(copy_mib=64, matmul_n=256, repeats=2)  # doctest: +SKIP
        >>> c.copy_bytes_per_s > 1e9  # doctest: +SKIP
        True
    """
    import torch

    t0 = time.perf_counter()

    def sync() -> None:
        device_sync(device)

    copy_bw = _copy_bandwidth(torch, copy_mib * 2**20 // 4, device, repeats, sync)
    flops: dict[str, float] = {}
    for name in dtypes:
        if device == "cpu" and name == "float16":
            continue
        dt = getattr(torch, name)
        a = torch.randn(matmul_n, matmul_n, device=device).to(dt)
        b = torch.randn(matmul_n, matmul_n, device=device).to(dt)
        t = _best_time(lambda a=a, b=b: torch.mm(a, b), repeats, sync)
        flops[name] = 2 * matmul_n**3 / t
    return Ceilings(copy_bw, flops, device, torch.get_num_threads(), time.perf_counter() - t0)


@dataclass(frozen=True)
class PhaseWork:
    """The work of one timed phase, from the model's size (see the module docstring).

    Example:
        >>> w = PhaseWork.decode(params=1e8, weight_bytes=4e8, kv_bytes_per_token=1e4, batch=1, context=100)
        >>> w.flops, w.bytes
        (200000000.0, 401000000.0)
    """

    name: str
    flops: float
    bytes: float
    tokens: int
    dtype: str = "float32"

    @classmethod
    def prefill(
        cls,
        params: float,
        weight_bytes: float,
        kv_bytes_per_token: float,
        tokens: int,
        batch: int = 1,
        dtype: str = "float32",
    ) -> PhaseWork:
        n = tokens * batch
        return cls(
            f"prefill b{batch} p{tokens}",
            2.0 * params * n,
            weight_bytes + kv_bytes_per_token * n,
            n,
            dtype,
        )

    @classmethod
    def decode(
        cls,
        params: float,
        weight_bytes: float,
        kv_bytes_per_token: float,
        batch: int,
        context: int,
        dtype: str = "float32",
    ) -> PhaseWork:
        # One step: every weight once, plus each sequence's KV cache so far.
        return cls(
            f"decode b{batch}",
            2.0 * params * batch,
            weight_bytes + kv_bytes_per_token * batch * context,
            batch,
            dtype,
        )


def attribute(
    work: PhaseWork, seconds: float, ceilings: Ceilings, overhead_share: float = 0.25
) -> dict[str, Any]:
    """Achieved bandwidth/FLOP/s of one phase, share of the ceilings, verdict and implication.

    Args:
        work: the phase's FLOPs and bytes (per timed unit: one prefill, or one decode step).
        seconds: measured time of that unit (median).
        ceilings: from `measure_ceilings` in the same run.
        overhead_share: below this share of both ceilings the phase is called overhead-bound.

    Example:
        >>> c = Ceilings(10e9, {"float32": 100e9}, "cpu", 2, 0.0)
        >>> attribute(PhaseWork("decode b1", 2e8, 4e8, 1), 0.05, c)["verdict"]
        'memory-bound'
    """
    assert seconds > 0, "phase time must be positive"
    peak = ceilings.matmul_flops_per_s.get(work.dtype) or max(ceilings.matmul_flops_per_s.values())
    bw, fl = work.bytes / seconds, work.flops / seconds
    intensity = work.flops / work.bytes if work.bytes else float("inf")
    ridge = peak / ceilings.copy_bytes_per_s
    bw_share, fl_share = bw / ceilings.copy_bytes_per_s, fl / peak
    bound = "memory-bound" if intensity < ridge else "compute-bound"
    verdict = "overhead-bound" if max(bw_share, fl_share) < overhead_share else bound
    if max(bw_share, fl_share) > 1.0:  # past a measured ceiling: that measurement was low
        verdict = "above-ceiling"
    return {
        "phase": work.name,
        "dtype": work.dtype,
        "seconds": seconds,
        "achieved_bytes_per_s": bw,
        "achieved_flops_per_s": fl,
        "bandwidth_share": bw_share,
        "flops_share": fl_share,
        "intensity_flops_per_byte": intensity,
        "ridge_flops_per_byte": ridge,
        "roofline_bound": bound,  # where the roofline says it would sit at full efficiency
        "verdict": verdict,
        "implication": IMPLICATIONS[verdict],
    }


def above_ceiling(rows: list[dict[str, Any]]) -> list[str]:
    """The metrics of `rows` that ran above a measured ceiling (share over 100%).

    >>> above_ceiling([{"metric": "a", "bandwidth_share": 1.6, "flops_share": 0.1}])
    ['a']
    """
    return [r["metric"] for r in rows if max(r["bandwidth_share"], r["flops_share"]) > 1.0]


def best_ceilings(a: Ceilings, b: Ceilings) -> Ceilings:
    """The higher of two measurements of each ceiling (a ceiling is the best the machine did)."""
    flops = {
        k: max(a.matmul_flops_per_s.get(k, 0.0), b.matmul_flops_per_s.get(k, 0.0))
        for k in {*a.matmul_flops_per_s, *b.matmul_flops_per_s}
    }
    return Ceilings(
        max(a.copy_bytes_per_s, b.copy_bytes_per_s),
        flops,
        a.device,
        a.threads,
        a.seconds + b.seconds,
    )


def attribute_lm(
    metrics: dict[str, Any],
    prompt_tokens: int,
    new_tokens: int,
    params: float,
    weight_bytes: float,
    kv_bytes_per_token: float,
    ceilings: Ceilings,
    dtype: str = "float32",
) -> list[dict[str, Any]]:
    """Roofline rows for every prefill/decode metric `bench_causal_lm` returned.

    Args:
        metrics: {name: Stat} from `bench_causal_lm`.
        prompt_tokens: P of the full prompt; new_tokens: decode steps per repeat.
        params: parameter count; weight_bytes: bytes of weights read per forward.
        kv_bytes_per_token: KV cache bytes per token (all layers, K and V).
        ceilings: measured in the same run; dtype: compute dtype (selects the FLOP/s ceiling).

    Example:
        >>> rows = attribute_lm(stats, 100, 128, 1.35e8, 5.4e8, 9216, ceilings)  # doctest: +SKIP
    """
    rows = []
    for name, st in metrics.items():
        med = st.median if hasattr(st, "median") else st["median"]
        if name == "prefill_tokens_per_s" or name.startswith("prefill_tokens_per_s_p"):
            n = prompt_tokens if name == "prefill_tokens_per_s" else int(name.rsplit("_p", 1)[1])
            w = PhaseWork.prefill(params, weight_bytes, kv_bytes_per_token, n, 1, dtype)
            rows.append(attribute(w, n / med, ceilings) | {"metric": name})
        elif name == "decode_tokens_per_s" or name.startswith("decode_tokens_per_s_b"):
            b = 1 if name == "decode_tokens_per_s" else int(name.rsplit("_b", 1)[1])
            ctx = prompt_tokens + new_tokens // 2  # mean context over the decoded steps
            w = PhaseWork.decode(params, weight_bytes, kv_bytes_per_token, b, ctx, dtype)
            rows.append(attribute(w, b / med, ceilings) | {"metric": name})
    return rows
