"""The one-row GEMV for int8 and FP8 weights in CUDA C++ (`csrc/wo8_gemv.cu`), built on first
use with PyTorch's extension builder (`torch.utils.cpp_extension.load`: nvcc and ninja).

Why CUDA C++ when every other decode kernel is Triton: Nsight Compute showed the Triton GEMVs
(`triton_kernels.wo8_gemv`) reading 1-byte weights at 58-72% of DRAM peak, stalled on their
loads with few warps resident and ~5.3 instructions issued per weight byte
(docs/native-engine.md, "What the GEMVs wait on"). What would fix both is control Triton does
not give: how many loads each thread has in flight (here 2 x UNROLL x ROWS 16-byte loads,
issued a loop step ahead of their products, whatever the occupancy) and how a byte becomes a
float (here a byte permute and an fp32 add per int8 weight: 4.2 instructions per weight in the
main loop for sm_90, FP8 3.7 through the hardware's f16x2 conversion). It takes the same fused work as the
Triton GEMV (the RMSNorm whose weight is folded into the columns, the residual add, the launch
as a programmatic dependent), so `linear.wo_mm` can route a one-row GEMV to either
(`linear.GEMV_CUDA`); the SiLU x up input (`gated`) stays Triton's.

Where nvcc, ninja or a GPU is missing, or the build or its check fails, `available` is False
with the reason in `unavailable_reason()`, and the engine keeps the Triton GEMV. The build is
cached by PyTorch (`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) under a name that
carries the GPU architecture and a digest of `csrc/`, so it runs once per version of the kernels
and architecture (a minute or two each).

`int4_gemv` is the same design for int4 weights in `linear.pack_int4_planar`'s layout
(`csrc/int4_gemv.cu`: Marlin's dequantization, two codes per f16x2 instruction, products in
f16 per scale group; the RMSNorm before it and the residual add after it, as the Triton int4
GEMV takes them): on by default (`linear.INT4_GEMV_CUDA`). It is a second extension, so that a
failure of one leaves the other.

Each configuration (rows per block, warps, loads per step: `CONFIGS`) is timed once per weight
shape on first use, outside CUDA graph capture, with the L2 cache flushed between calls
(Triton's `do_bench`, as Triton's autotuner times the other kernels); under capture an
untimed shape takes `DEFAULT_CONFIG`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "wo8_gemv.cu"
INT4_SOURCE = Path(__file__).parent / "csrc" / "int4_gemv.cu"
# (rows per block, warps per block, 16-byte loads per row per loop step): csrc/wo8_gemv.cu's
# LLMOPT_WO8_CONFIGS, in its order.
CONFIGS = ((2, 4, 2), (4, 4, 1), (4, 4, 2), (8, 4, 1), (2, 8, 1), (4, 8, 1), (1, 8, 2), (2, 4, 4))
DEFAULT_CONFIG = 2
# (rows per group, warps, loads per row per step, groups of rows per block, teams of warps the
# groups are dealt to, second step requested before the dependency wait, variant bits: 1 the
# activations staged with 16-byte loads, 2 one block barrier per group of rows, 4 the groups per
# block fitted at launch to the blocks the GPU holds at once, the fourth column then unused):
# csrc/int4_gemv.cu's LLMOPT_INT4_CONFIGS, in its order
INT4_CONFIGS = (
    (2, 4, 2, 1, 1, 0, 0),
    (4, 4, 1, 1, 1, 0, 0),
    (4, 4, 2, 1, 1, 0, 0),
    (8, 4, 1, 1, 1, 0, 0),
    (2, 8, 1, 1, 1, 0, 0),
    (2, 8, 2, 1, 1, 0, 0),
    (4, 4, 1, 4, 1, 0, 0),
    (8, 4, 1, 4, 1, 0, 0),
    (4, 8, 1, 4, 1, 0, 0),
    (4, 4, 1, 8, 1, 0, 0),
    (4, 8, 1, 8, 1, 0, 0),
    (4, 8, 1, 4, 2, 0, 0),
    (4, 8, 1, 8, 2, 0, 0),
    (8, 8, 1, 4, 2, 0, 0),
    (4, 16, 1, 8, 4, 0, 0),
    (4, 4, 1, 4, 1, 1, 0),
    (4, 8, 1, 4, 1, 1, 0),
    (4, 8, 1, 4, 2, 1, 0),
    (4, 8, 1, 8, 2, 1, 0),
    (4, 16, 1, 8, 4, 1, 0),
    (4, 4, 1, 8, 1, 0, 1),
    (4, 8, 1, 4, 2, 0, 1),
    (4, 16, 1, 8, 4, 0, 1),
    (4, 4, 1, 8, 1, 0, 3),
    (4, 8, 1, 4, 2, 0, 3),
    (4, 16, 1, 8, 4, 0, 3),
    (4, 8, 1, 4, 2, 1, 3),
    (4, 16, 1, 8, 4, 1, 3),
    (4, 4, 1, 8, 1, 0, 4),
    (4, 4, 1, 8, 1, 0, 5),
    (4, 4, 1, 8, 1, 0, 7),
    (4, 4, 1, 4, 1, 1, 7),
)
# the variant bits (csrc/int4_gemv.cu's kVecStage, kOneBarrier, kFit)
VEC_STAGE, ONE_BARRIER, FIT = 1, 2, 4
# the per-shape timing's switches of the int4 GEMV (`int4_gemv`'s arguments), as its key ends
INT4_SWITCHES = ("teams", "early", "variants", "fit")
WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
ACT_DTYPES = (torch.bfloat16, torch.float16)

_REASON: dict[int, str] = {}  # device index -> why the kernel is not available there
_INT4_REASON: dict[int, str] = {}  # the same for the int4 kernel
_TUNED: dict[tuple, int] = {}  # (kernel, n, k, weight dtype or group, act. dtype, rows) -> config
_TIMES: dict[tuple, dict[int, float]] = {}  # the same keys -> config -> its time (ms), as timed


@functools.cache
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"{major}{minor}"


def missing_tools() -> str | None:
    """What the build needs and this machine lacks (None when nothing): nvcc and ninja."""
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc not found (install the CUDA toolkit matching PyTorch's CUDA, or set CUDA_HOME)"
    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


def _build(name: str, source: Path, arch: str):
    from torch.utils import cpp_extension

    # PyTorch rebuilds when a source changes, not when a header it includes does: the name
    # carries a digest of the whole folder (gemv_common.cuh included)
    files = sorted(SOURCE.parent.iterdir())
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()
    log.info("building %s for sm_%s (once; a minute or two)", name, arch)
    return cpp_extension.load(
        name=f"llmopt_{name}_sm{arch}_{digest[:12]}",
        sources=[str(source)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
        verbose=False,
    )


@functools.cache
def _module(arch: str):
    """Build (or load the cached build of) the 1-byte GEMV for compute capability `arch`."""
    return _build("wo8_gemv", SOURCE, arch)


@functools.cache
def _int4_module(arch: str):
    """Build (or load the cached build of) the int4 GEMV for compute capability `arch`."""
    return _build("int4_gemv", INT4_SOURCE, arch)


# A kernel's check on one GPU: (launch arguments before the config, fp32 reference, label)
# cases, made by the caller that owns the weight layouts (`linear`, which imports this module)
Cases = Callable[[torch.device], Iterable[tuple[tuple, torch.Tensor, str]]]


def available(index: int, cases: Cases) -> bool:
    """The 1-byte kernel is built for GPU `index` and gives the right answer there on `cases`.
    Decided once per device, eagerly (the layers ask at construction), so that inside a
    compiled step this is a dict lookup (`ready`); the reason for a False is in
    `unavailable_reason`."""
    check = functools.partial(_check, index, _module, "wo8_gemv", len(CONFIGS), cases)
    return _decide(_REASON, index, "the CUDA GEMV (int8/FP8)", check)


def ready(index: int = 0) -> bool:
    """`available(index)` as already decided (False when not yet asked): never builds, so it
    may run inside a compiled step."""
    return _REASON.get(index) == ""


def unavailable_reason(index: int, cases: Cases) -> str:
    """Why `available(index)` is False ('' when it is True)."""
    available(index, cases)
    return _REASON[index]


def int4_available(index: int, cases: Cases) -> bool:
    """`available` for the int4 GEMV (`linear.INT4_GEMV_CUDA`)."""
    check = functools.partial(_check, index, _int4_module, "int4_gemv", len(INT4_CONFIGS), cases)
    return _decide(_INT4_REASON, index, "the CUDA int4 GEMV", check)


def int4_ready(index: int = 0) -> bool:
    """`int4_available(index)` as already decided; never builds (see `ready`)."""
    return _INT4_REASON.get(index) == ""


def int4_unavailable_reason(index: int, cases: Cases) -> str:
    int4_available(index, cases)
    return _INT4_REASON[index]


def _decide(reasons: dict[int, str], index: int, what: str, check: Callable[[], str]) -> bool:
    if index not in reasons:
        reasons[index] = check()
        if reasons[index] and reasons[index] != "no CUDA GPU":
            log.warning(
                "%s does not run on GPU %d (%s): the Triton GEMV, slower, runs instead",
                what,
                index,
                reasons[index],
            )
    return reasons[index] == ""


def _check(index: int, module, fn: str, configs: int, cases: Cases) -> str:
    """'' when the extension builds for GPU `index` and its kernel `fn` matches every case's
    reference in every config there, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability(index) < (8, 0):
        return "needs compute capability 8.0 or newer (bf16 arithmetic)"
    tools = missing_tools()
    if tools:
        return tools
    try:
        mod = module(_arch(index))
        if mod.configs != configs:
            return f"the built extension has {mod.configs} configs, this module {configs}"
        for args, ref, label in cases(torch.device("cuda", index)):
            for c in range(configs):
                y = getattr(mod, fn)(*args, c, False)
                err = float((y.float() - ref).norm() / ref.norm())
                if err > 1e-2:
                    return f"wrong result (relative error {err:.2e}, {label}, config {c})"
    except Exception as e:  # a toolkit/driver mismatch must not take the engine down
        return f"build or launch failed: {str(e)[:2000]}"
    return ""


def tuned_configs() -> list[dict]:
    """The configuration each timed shape got, as benchmarks record it: kernel, N, K, the
    weight dtype (int8/FP8) or scale group (int4), rows, the configurations allowed (int4:
    `teams`, `early`, `variants`, `fit`), the chosen configuration's tuple, and every configuration's time in
    microseconds (`us`, in the table's order; None for one not allowed, empty where not
    timed)."""
    out = []
    for key, cfg in _TUNED.items():
        kernel, n, k, what, act, rows, *allowed = key
        table = INT4_CONFIGS if kernel == "int4" else CONFIGS
        times = _TIMES.get(key, {})
        out.append(
            {"kernel": kernel, "n": n, "k": k, "weight": str(what), "act": str(act)}
            | {"rows": rows, "config": list(table[cfg])}
            | (dict(zip(INT4_SWITCHES, allowed, strict=True)) if allowed else {})
            | {"us": [round(1e3 * times[c], 2) if c in times else None for c in range(len(table))]}
        )
    return out


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # the kernels read x, w (and the int4 norm's weight) in 16-byte vectors: a view at an odd
    # offset is copied
    return t if t.data_ptr() % 16 == 0 else t.clone()


# Rounds of the per-shape timing: each config timed once per round, the configs interleaved,
# the median kept. One round per config in turn picked configs a few percent slower than the
# best on the int4 GEMV's largest shape (two processes, two choices: docs/benchmarks.md).
TUNE_ROUNDS = 3


def interleaved_times(run, configs: Iterable[int], rounds: int, **bench) -> dict[int, list[float]]:
    """Each config's times (ms) by `run(config)` over `rounds` rounds, every round timing every
    config in turn (Triton's `do_bench`, the L2 flushed between calls; `bench` its warmup and
    rep), so that a drift in clocks or load falls on all of them alike."""
    from triton.testing import do_bench

    out: dict[int, list[float]] = {c: [] for c in configs}
    for _ in range(rounds):
        for c in out:
            out[c].append(do_bench(lambda c=c: run(c), **bench))
    return out


def _tuned(key: tuple, configs: Iterable[int], run) -> int:
    """The fastest of the configurations `configs` (indices into the table) for `key`: each
    timed by `run(config)` with the L2 flushed between calls, in `TUNE_ROUNDS` interleaved
    rounds, medians compared; under CUDA graph capture an untimed key gets DEFAULT_CONFIG
    (which every kernel's table allows)."""
    if key in _TUNED:
        return _TUNED[key]
    if torch.cuda.is_current_stream_capturing():
        return DEFAULT_CONFIG  # (not stored: the next eager call times it)
    rounds = interleaved_times(run, configs, TUNE_ROUNDS, warmup=2, rep=10)
    times = {c: statistics.median(t) for c, t in rounds.items()}
    _TUNED[key] = min(times, key=times.__getitem__)
    _TIMES[key] = times
    log.debug("CUDA GEMV %s: config %d (%s)", key, _TUNED[key], times)
    return _TUNED[key]


def _config(x, w, scale, r, eps: float, norm: bool, resid: bool) -> int:
    mod = _module(_arch(x.device.index or 0))
    key = ("wo8", w.shape[0], w.shape[1], w.dtype, x.dtype, x.shape[0])
    return _tuned(
        key, range(len(CONFIGS)), lambda c: mod.wo8_gemv(x, w, scale, r, eps, norm, resid, c, False)
    )


# An opaque operator for torch.compile (a C++ launch it cannot trace); CUDA graphs capture it,
# with its programmatic-dependent edge when `pdl`.
@torch.library.custom_op("llmopt::wo8_gemv_cuda", mutates_args=())
def wo8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    r: torch.Tensor,
    eps: float,
    norm: bool,
    resid: bool,
    pdl: bool,
) -> torch.Tensor:
    """y (M, N) = (x (M, K) @ w (N, K)^T) * scale (N,), times rsqrt(mean(x^2) + eps) with
    `norm` (the RMSNorm folded into w's columns), plus `r` (M, N) with `resid` (else `r` is any
    tensor, unread). w int8 or float8_e4m3fn, K a multiple of 16; x bf16 or fp16; scale fp32 or
    x's dtype. `available()` must be True for x's device."""
    x, w = _aligned(x.contiguous()), _aligned(w.contiguous())
    scale = scale.reshape(-1).contiguous()
    r = r.contiguous()
    cfg = _config(x, w, scale, r, eps, norm, resid)
    return _module(_arch(x.device.index or 0)).wo8_gemv(x, w, scale, r, eps, norm, resid, cfg, pdl)


@wo8_gemv.register_fake
def _(x, w, scale, r, eps, norm, resid, pdl):
    return x.new_empty(x.shape[0], w.shape[0])


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernel takes these shapes and dtypes (not whether it is built: `available`)."""
    return (
        w.dtype in WEIGHT_DTYPES
        and x.dtype in ACT_DTYPES
        and x.dim() == 2
        and w.shape[1] % 16 == 0
        and x.shape[1] == w.shape[1]
    )


def int4_supports(x: torch.Tensor, packed: torch.Tensor, group: int, zero) -> bool:
    """The int4 kernel takes these: symmetric codes (no zero point), K a multiple of 256 (whole
    tiles, no padding), a power-of-two group of 32 or more, 16-bit activations."""
    k = x.shape[-1]
    return (
        zero is None
        and x.dtype in ACT_DTYPES
        and x.dim() == 2
        and k % 256 == 0
        and packed.shape[1] * 8 == k
        and group >= 32
        and group & (group - 1) == 0
        and k % group == 0
    )


@torch.library.custom_op("llmopt::int4_gemv_cuda", mutates_args=())
def int4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    g: torch.Tensor,
    r: torch.Tensor,
    group: int,
    eps: float,
    norm: bool,
    resid: bool,
    pdl: bool,
    teams: bool = True,
    early: bool = True,
    variants: bool = True,
    fit: bool = True,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ W^T for int4 codes packed by `linear.pack_int4_planar` (N, K / 8)
    with scales (N, K / group) in x's dtype; `int4_supports` and `int4_available()` hold. With
    `norm`, x is first normalized as RMSNorm(weight g (K,), eps) normalizes it; with `resid`,
    `r` (M, N) is added to y (else `g`, `r` are any tensors, unread). `teams` / `early` /
    `variants` / `fit`: the configurations with teams of warps / the second step requested
    early / variant bit 1 or 2 / the groups per block fitted at launch may be chosen
    (`int4_configs`); they are arguments, not globals, so that each compiled step keeps its own
    choice (a CUDA graph replays the config chosen when it was captured)."""
    x, packed = _aligned(x.contiguous()), _aligned(packed.contiguous())
    scale, g, r = scale.contiguous(), _aligned(g.contiguous()), r.contiguous()
    mod = _int4_module(_arch(x.device.index or 0))
    index = x.device.index or 0
    k = x.shape[1]
    key = ("int4", packed.shape[0], k, group, x.dtype, x.shape[0], teams, early, variants, fit)
    fused = (g, r, group, eps, norm, resid)
    # (the filter only where the shape is still to be timed: an eager step calls this per layer)
    allowed = int4_configs(teams, early, variants, fit)
    configs = [] if key in _TUNED else int4_runnable(index, k, group, allowed)
    cfg = _tuned(key, configs, lambda c: mod.int4_gemv(x, packed, scale, *fused, c, False))
    return mod.int4_gemv(x, packed, scale, *fused, cfg, pdl)


@int4_gemv.register_fake
def _(
    x,
    packed,
    scale,
    g,
    r,
    group,
    eps,
    norm,
    resid,
    pdl,
    teams=True,
    early=True,
    variants=True,
    fit=True,
):
    return x.new_empty(x.shape[0], packed.shape[0])


@functools.cache
def _smem_limit(index: int) -> int:
    """The most shared memory one block may ask for on GPU `index` (opted in)."""
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", 48 * 1024)


def int4_runnable(
    index: int, k: int, group: int, configs: Iterable[int] | None = None
) -> list[int]:
    """Of `configs` (indices of `INT4_CONFIGS`, default all), those GPU `index` runs at this K
    and group: none that needs more shared memory (the staged activations and the block's
    scales, which grow with K) than a block gets. Builds the extension if it is not yet
    built."""
    mod = _int4_module(_arch(index))
    limit = _smem_limit(index)
    return [
        c
        for c in (range(len(INT4_CONFIGS)) if configs is None else configs)
        if mod.int4_smem(c, k, group) <= limit
    ]


def int4_configs(
    teams: bool = True, early: bool = True, variants: bool = True, fit: bool = True
) -> list[int]:
    """The indices of `INT4_CONFIGS` the per-shape timing may choose from: all of them, less
    those with several teams of warps unless `teams`, less those that request their second
    step before the dependency wait unless `early`, less those with variant bit 1 or 2
    (csrc/int4_gemv.cu) unless `variants`, less those whose groups per block are fitted at
    launch (bit 4) unless `fit` (`linear.INT4_GEMV_TEAMS` / `INT4_GEMV_EARLY` /
    `INT4_GEMV_VARIANTS` / `INT4_GEMV_FIT`: an end-to-end A/B of either design, each point
    timing its own set; `int4_gemv` also leaves out any config that needs more shared memory
    at its K than the GPU gives a block).

    >>> len(int4_configs()), len(int4_configs(teams=False)), len(int4_configs(early=False))
    (32, 19, 24)
    >>> len(int4_configs(variants=False)), len(int4_configs(fit=False))
    (21, 28)
    >>> DEFAULT_CONFIG in int4_configs(False, False, False, False)
    True
    """
    return [
        c
        for c, (*_, split, ahead, variant) in enumerate(INT4_CONFIGS)
        if (teams or split == 1)
        and (early or not ahead)
        and (variants or not variant & (VEC_STAGE | ONE_BARRIER))
        and (fit or not variant & FIT)
    ]
