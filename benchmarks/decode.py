"""Decode speed of the native `torch` engine against its memory-bandwidth ceiling and HF generate().

    python benchmarks/decode.py --shape llama-3.1-8b            # on the H200: the issue's targets
    python benchmarks/decode.py --model smollm2-135m --hf       # CPU: real weights, HF side by side

For each weight format (bf16, int8 weight-only, int4 weight-only g128, fp8 W8A8) it builds the
model (seeded random weights, std 0.02, for `--shape`; real weights for `--model`), runs a
`--prompt-len` token prompt and `--new-tokens` greedy tokens at batch 1, and reports decode
tokens/s, the bytes each decode step must read (weights + KV cache), the achieved bandwidth and its
share of the device-to-device copy bandwidth measured in the same run. bf16 is also swept over
`--batches`. `--hf` runs transformers' generate() (dynamic cache, then static cache) on the same
weights and checks the greedy tokens match the native engine's. `--attention triton gather` runs
each point twice, back to back: decode attention through the flash-decoding Triton kernel
(`engines/native/attention.py`, the CUDA default) and through the torch gather path (before it).
`--overlap on off` likewise runs each point with the overlapped decode (the next greedy step
launched before this one's tokens are read back; the CUDA default) and without it. Each point
reports ms per step as timed in the decode loop (wall), the same step replayed back to back
(device-only: the host out of the loop) and their difference (host ms: what the host adds per
step). `--rounds N` runs the whole list of points N times in turn (A B A B: the second round
reuses the compiled steps) and ends with each point's median and range, its ratio to the
first point of its format and batch in the same round (switches), and with several formats its
ratio to the round's first format at that batch (`vs`: int4 against bf16), so a comparison has
its spread. Results go to stdout (a table at the end) and `--json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as `python benchmarks/decode.py`
import step_profile  # noqa: E402
from shapes import SHAPES  # noqa: E402


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes read + written per second of a large device-to-device copy (median of 10)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    del src, dst
    return 2 * nbytes / times[5]


def weight_bytes(model) -> int:
    """Bytes one decode step reads from weights: all linears and norms, one embedding row."""
    total = 0
    emb = model.model.embed_tokens.weight
    # the embedding table counts only where it is also the (tied, dense) lm_head's weight
    seen = set() if getattr(model.lm_head, "weight", None) is emb else {emb.data_ptr()}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or "cache" in name or name == "inv_freq" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def kv_bytes_read(model, ctx: int, batch: int) -> int:
    c = model.cfg
    el = model.model.layers[0].self_attn.k_cache.element_size()
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * el * ctx * batch


def prompt_logits(model, prompt: list[int], device) -> torch.Tensor:
    nb = len(prompt) // 16 + 1
    model.setup_cache(nb + 1, 16, model.model.norm.weight.dtype, device)
    ids = torch.tensor([prompt], device=device)
    pos = torch.arange(len(prompt), device=device).unsqueeze(0)
    table = torch.arange(1, nb + 1, device=device).unsqueeze(0)
    with torch.inference_mode():
        return model(ids, pos, table, prefill=True, last_only=False)


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum().clamp(min=1e-30)))


def build(args, mode: str, dtype, cfg_dict, prompt: list[int], fold: bool = False):
    """The model for `mode`, and by `--lm-head` choice (dense, or a quantized format) the lm_head
    module and the SQNR (dB) of the prompt logits against the unquantized model. `fold`: the
    norms folded into the projections first (`weights.fold_norms_`), for `FUSE_NORM` points."""
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.config import NativeConfig
    from llmopt.engines.native.weights import (
        dense_gemv_,
        fold_norms_,
        load_model,
        quantize_linear,
        quantize_model_,
        random_model,
    )

    base, _, kernel = mode.partition("@")
    quant = None if base in ("bf16", "fp32") else base
    # int4's layout is chosen as the layer is built: int4@triton and int4@gemv take the Triton
    # layout, the first with its tensor-core kernel at one row too, the second with the GEMV;
    # int4@tinygemm tinygemm's; plain int4 the engine's default (`linear.INT4_TRITON` as main()
    # found it)
    if base == "int4":
        layouts = {"triton": True, "gemv": True, "tinygemm": False}
        L.INT4_TRITON = layouts.get(kernel, args.int4_triton_default)
    L.INT4_ONE_ROW = "dot" if base == "int4" and kernel == "triton" else "gemv"
    if args.model:
        from llmopt.assets.models import resolve_model

        folder, _ = resolve_model(args.model)
        model = load_model(folder, args.device, dtype)
    else:
        model = random_model(NativeConfig.from_hf(cfg_dict), args.device, dtype, seed=args.seed)
    dense = model.lm_head
    quant_heads = [h for h in args.lm_head if h != "dense"]
    if not quant and not quant_heads and not fold:
        return model, {"dense": (dense, None)}
    ref = prompt_logits(model, prompt, args.device)
    fold = fold and quant != "int4"  # (int4 takes its norms unfolded, `quantize_model_`)
    if fold:  # (then the points with FUSE_NORM off run the norms as kernels of weight 1)
        fold_norms_(model)
    if quant:
        quantize_model_(model, quant, fold=fold)  # every linear but lm_head (the engine's default)
    elif fold:  # 16-bit: the projections take the GEMV's norm and add (`DenseLinear`)
        dense_gemv_(model)
    heads = {"dense": (dense, sqnr_db(ref, prompt_logits(model, prompt, args.device)))}
    for h in quant_heads:  # a quantized copy of the head, swapped in per point
        model.lm_head = quantize_linear(dense, h)
        heads[h] = (model.lm_head, sqnr_db(ref, prompt_logits(model, prompt, args.device)))
        model.lm_head = dense
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return model, heads


def run_native(
    args,
    model,
    batch: int,
    prompt: list[int],
    compile_: bool,
    overlap: bool | None = None,
    copy_gbps: float = 0.0,
) -> dict:
    from llmopt.engines.native import attention as A
    from llmopt.engines.native.generator import Generator, SamplingParams
    from llmopt.serve import collector

    new = args.new_tokens
    gen = Generator(
        model,
        None,
        max_batch=batch,
        max_seq_len=len(prompt) + new + 1,
        compile=compile_,
        bucket_blocks=False,
        overlap=overlap,
    )
    kernel = model.model.layers[0].self_attn.decode_kernel
    rope = model.model.layers[0].self_attn.fuse_rope and batch <= A.FUSE_ROPE_MAX_ROWS
    params = SamplingParams(
        max_tokens=new, ignore_eos=True, temperature=args.temperature, top_p=args.top_p
    )
    t0 = time.perf_counter()  # warm-up: compilation and CUDA graph capture happen here
    for i in range(batch):
        gen.add(i, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while not all(gen.finished(i) for i in range(batch)):
        gen.step()
    for i in range(batch):
        gen.remove(i)
    sync(args.device)
    warm = time.perf_counter() - t0
    if args.gc_freeze == "on":  # as `llmopt serve` does once warm (serve/collector.py)
        collector.freeze("decode.py point")
    collector.watch()
    gc0 = collector.pauses()
    for i in range(batch):
        gen.add(i, prompt, params)
    t0 = time.perf_counter()
    first = gen.step()  # the prefills
    sync(args.device)
    t1 = time.perf_counter()
    tokens = {i: [e.token_id] for i, e in enumerate(first)}
    steps = 0
    while not all(gen.finished(i) for i in range(batch)):
        for e in gen.step():
            tokens[e.seq_id].append(e.token_id)
        steps += 1
    sync(args.device)
    t2 = time.perf_counter()
    gc1 = collector.pauses()
    for i in range(batch):
        gen.remove(i)
    graph = replay_only(args, gen, batch, len(prompt))
    profiled = None
    if args.profile:
        profiled = profile_steps(args, gen, batch, len(prompt), copy_gbps)
        profile_loop(args, gen, batch, prompt)
    model.setup_cache(1, 1, torch.bfloat16, args.device)  # free the pool
    gc.unfreeze()  # a point's frozen objects (its compiled steps) must be freeable after it
    decode_s = t2 - t1
    return {
        "batch": batch,
        "warmup_s": warm,
        "prefill_s": t1 - t0,
        "decode_s": decode_s,
        "decode_steps": steps,
        "tok_s": batch * steps / decode_s,
        "ms_per_step": 1e3 * decode_s / steps,
        "tokens": tokens[0],
        "ms_per_step_device_only": graph,
        "host_ms_per_step": 1e3 * decode_s / steps - graph,
        "overlap": gen.overlap,
        "attention": ("triton-rope" if rope else "triton") if kernel else "gather",
        # garbage collections during the timed prefill and decode: collections by generation,
        # and the ms they stopped the process (host time that is not the engine's)
        "gc_collections": [b - a for a, b in zip(gc0.collections, gc1.collections, strict=True)],
        "gc_ms": 1e3 * (sum(gc1.seconds) - sum(gc0.seconds)),
    } | ({"profile": profiled} if profiled else {})


def hf_names(model) -> dict[str, torch.Tensor]:
    """The native model's dense weights under HF names (fused q/k/v and gate/up split back)."""
    c, out = model.cfg, {}
    for k, v in model.state_dict().items():
        if k.endswith("qkv_proj.weight"):
            base = k[: -len("qkv_proj.weight")]
            parts = v.split(
                [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
            )
            out.update({f"{base}{n}_proj.weight": t for n, t in zip("qkv", parts, strict=True)})
        elif k.endswith("gate_up_proj.weight"):
            base = k[: -len("gate_up_proj.weight")]
            g, u = v.chunk(2)
            out.update({f"{base}gate_proj.weight": g, f"{base}up_proj.weight": u})
        else:
            out[k] = v
    return out


def _packed(gen, batch: int, ctx: int) -> torch.Tensor:
    rows = [
        [1, ctx] + list(range(1 + i * gen.max_blocks_per_seq, 1 + (i + 1) * gen.max_blocks_per_seq))
        for i in range(batch)
    ]
    return torch.tensor(rows, device=gen.device)


def replay_only(args, gen, batch: int, ctx: int) -> float:
    """ms per decode step with the host out of the loop: the same step back to back."""
    packed = _packed(gen, batch, ctx)
    with torch.inference_mode():
        for _ in range(3):
            gen.decode_packed(packed)
        sync(args.device)
        t0 = time.perf_counter()
        for _ in range(50):
            gen.decode_packed(packed)
        sync(args.device)
    return 1e3 * (time.perf_counter() - t0) / 50


def profile_steps(args, gen, batch: int, ctx: int, copy_gbps: float) -> dict | None:
    """torch.profiler over 20 replayed decode steps: its kernel table, and (on a GPU)
    `step_profile.summary` of it, printed and returned for the point's record."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from llmopt.engines.native import cuda_gemv

    packed = _packed(gen, batch, ctx)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.inference_mode(), profile(activities=acts) as prof:
        for _ in range(20):
            gen.decode_packed(packed)
        sync(args.device)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"--- profile: batch {batch}, 20 decode steps ---")
    print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))
    if not torch.cuda.is_available():
        return None
    kernels = [
        step_profile.Kernel(e.key, getattr(e, "self_device_time_total", 0.0), e.count)
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and getattr(e, "self_device_time_total", 0.0) > 0
    ]
    summary = step_profile.summary(kernels, 20, cuda_gemv.tuned_configs(), copy_gbps)
    for line in step_profile.lines(summary):
        print(line)
    return summary


def profile_loop(args, gen, batch: int, prompt: list[int]) -> None:
    """torch.profiler over 20 steps of the real decode loop (`Generator.step`): the host's own
    work per step (the packed inputs, the copies, reading tokens back) beside the kernels."""
    from torch.profiler import ProfilerActivity, profile

    from llmopt.engines.native.generator import SamplingParams

    n = min(24, args.new_tokens)
    for i in range(batch):
        gen.add(i, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    gen.step()  # the prefills
    for _ in range(2):
        gen.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    steps = 0
    with profile(activities=acts) as prof:
        while steps < 20 and not all(gen.finished(i) for i in range(batch)):
            gen.step()
            steps += 1
        sync(args.device)
    for i in range(batch):
        gen.remove(i)
    print(
        f"--- profile: batch {batch}, {steps} steps of the decode loop (overlap {gen.overlap}) ---"
    )
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60
        )
    )


def run_hf(args, model, prompt: list[int], cache: str) -> dict:
    """transformers generate() on the same weights (shared, not copied)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model:
        from llmopt.assets.models import resolve_model

        folder, _ = resolve_model(args.model)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=model.model.norm.weight.dtype)
    else:
        config = AutoConfig.for_model(**SHAPES[args.shape])
        with torch.device(args.device):  # random init, then replaced by the native weights
            hf = AutoModelForCausalLM.from_config(config, dtype=model.model.norm.weight.dtype)
        missing, _ = hf.load_state_dict(hf_names(model), strict=False, assign=True)
        assert not [k for k in missing if "lm_head" not in k], missing[:4]
        hf.tie_weights()
    hf = hf.to(args.device).eval()
    ids = torch.tensor([prompt], device=args.device)
    with torch.inference_mode():  # logits agreement on the prompt, as SQNR in dB
        ref = hf(ids).logits.float()
        nb = len(prompt) // 16 + 1
        model.setup_cache(nb + 1, 16, model.model.norm.weight.dtype, args.device)
        table = torch.arange(1, nb + 1, device=args.device).unsqueeze(0)
        pos = torch.arange(len(prompt), device=args.device).unsqueeze(0)
        mine = model(ids, pos, table, prefill=True, last_only=False)
        sqnr = float(
            10 * torch.log10(ref.pow(2).sum() / (ref - mine).pow(2).sum().clamp(min=1e-30))
        )
    kw = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False}
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.inference_mode():
        hf.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        sync(args.device)
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        sync(args.device)
        dt = time.perf_counter() - t0
    gen = out[0, len(prompt) :].tolist()
    del hf
    gc.collect()
    return {"cache": cache, "s": dt, "tok_s": len(gen) / dt, "tokens": gen, "logits_sqnr_db": sqnr}


# `llmopt.engines.native.linear`'s module switches that `--linear` may set
LINEAR_SWITCHES = (
    "GEMV_EVEN",
    "FUSE_SILU",
    "FUSE_NORM",
    "GEMV_PDL",
    "GEMV_INT8_F16",
    "GEMV_PREFETCH",
    "GEMV_CUDA",
    "INT4_GEMV_CUDA",
    "INT4_GEMV_TEAMS",
    "INT4_GEMV_EARLY",
    "INT4_GEMV_VARIANTS",
    "INT4_GEMV_FIT",
    "GEMV_PICK",
    "GEMV_PICK_REPLAY",
)


def linear_settings(specs: list[str] | None) -> list[dict[str, bool]]:
    """`--linear` values as switch settings; a bad name or value exits with what is allowed."""
    out = []
    for spec in specs or ["default"]:
        setting = {}
        for item in [] if spec == "default" else spec.split(","):
            name, _, value = item.partition("=")
            if name not in LINEAR_SWITCHES or value not in ("on", "off"):
                sys.exit(
                    f"--linear {spec!r}: expected 'default' or NAME=on|off with NAME one of "
                    f"{', '.join(LINEAR_SWITCHES)}"
                )
            setting[name] = value == "on"
        out.append(setting)
    return out


def config_lines(configs: list[dict]) -> list[str]:
    """`cuda_gemv.tuned_configs()` as printed: each timed shape's config, and every config's
    time alone (do_bench, L2 flushed) in the table's order, '-' for one the point's switches
    left out of the timing (`INT4_GEMV_TEAMS` / `EARLY` / `VARIANTS` / `FIT` off, or a config the GPU
    cannot run at that K)."""
    from llmopt.engines.native.cuda_gemv import INT4_SWITCHES

    out = []
    for t in configs:
        allowed = [f"{d} {t[d]}" for d in INT4_SWITCHES if d in t]
        sets = f" ({', '.join(allowed)})" if allowed else ""
        out.append(
            f"CUDA GEMV config {t['kernel']} {t['n']}x{t['k']} {t['weight']}{sets}: {t['config']}"
        )
        if any(u is not None for u in t["us"]):
            out.append(
                "  configs, us: " + " ".join("-" if u is None else f"{u:.1f}" for u in t["us"])
            )
    return out


def round_summary(rows: list[dict]) -> list[dict]:
    """Per point (mode, batch and switches) over the rounds: tokens/s median and range, its
    ratio to the first point of the same mode, batch and round (paired: one window per round), and
    its ratio to the round's first point of the same batch whatever its mode (`vs_mode`: one
    format against another, e.g. int4 against bf16, paired the same way)."""

    def point(r: dict) -> str:
        head = "" if r["lm_head"] == "dense" else f" lm_head={r['lm_head']}"
        return (
            f"{r['mode']} b{r['batch']} {r['attention']} overlap={'on' if r['overlap'] else 'off'}"
            f" silu={'on' if r['fuse_silu'] else 'off'} {r['linear']}{head}"
            + (" inductor-pdl" if r["inductor_pdl"] else "")
        )

    firsts = {}  # (mode, batch, round) -> the round's first tokens/s
    across = {}  # (batch, round) -> the round's first point at that batch, any mode
    for r in rows:
        firsts.setdefault((r["mode"], r["batch"], r["round"]), r["tok_s"])
        across.setdefault((r["batch"], r["round"]), r)
    by_point: dict[str, list[dict]] = {}
    for r in rows:
        by_point.setdefault(point(r), []).append(r)
    out = []
    for name, rs in by_point.items():
        tok = sorted(r["tok_s"] for r in rs)
        ratio = sorted(r["tok_s"] / firsts[r["mode"], r["batch"], r["round"]] for r in rs)
        base = [across[r["batch"], r["round"]] for r in rs]
        vs = sorted(r["tok_s"] / b["tok_s"] for r, b in zip(rs, base, strict=True))
        out.append(
            {
                "point": name,
                "rounds": len(rs),
                "tok_s": [r["tok_s"] for r in rs],
                "tok_s_median": statistics.median(tok),
                "tok_s_min": tok[0],
                "tok_s_max": tok[-1],
                "ratio_to_first": [
                    r["tok_s"] / firsts[r["mode"], r["batch"], r["round"]] for r in rs
                ],
                "ratio_median": statistics.median(ratio),
                "ratio_min": ratio[0],
                "ratio_max": ratio[-1],
                "vs_mode": base[0]["mode"],
                "vs_mode_median": statistics.median(vs),
                "vs_mode_min": vs[0],
                "vs_mode_max": vs[-1],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    def on_off(flag: str, help: str) -> None:  # a switch run both ways, interleaved per point
        ap.add_argument(flag, nargs="+", choices=["on", "off"], default=None, help=help)

    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="built-in name or HF folder (real weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help="bf16 int8 int4 fp8 (default: all that run here); CUDA kernel variants, each "
        "forcing one kernel where the engine would choose: int4@tinygemm (tinygemm's layout at "
        "every row count), int4@triton (the Triton layout, its tensor-core kernel at one row "
        "too), int4@gemv (the Triton layout with its CUDA-core GEMV at one row: the default), "
        "int8@gemv, int8@dot, int8@dot1, fp8@gemv, fp8@dot, "
        "fp8@dot1 "
        "(CUDA-core GEMV, tensor-core kernel, the same without its K split, at decode rows)",
    )
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument(
        "--quant-batches", nargs="+", type=int, default=[1], help="batches of quantized modes"
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each mode's list of points this many times in turn (A B A B) and report each "
        "point's median, range and ratio to the first point of its round",
    )
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--hf", action="store_true", help="also time HF generate() (dynamic, static)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="native runs: sample at this temperature (0: greedy, the default)",
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="native runs: nucleus sampling")
    ap.add_argument(
        "--attention",
        nargs="+",
        choices=["auto", "triton", "triton-rope", "gather"],
        default=["auto"],
        help="decode attention paths to run, interleaved per point (CUDA; the CPU has gather "
        "only); triton-rope: the kernel with RoPE and the KV write folded in, at every batch "
        "size; auto: the engine's choice (attention.FUSE_ROPE up to FUSE_ROPE_MAX_ROWS rows)",
    )
    on_off(
        "--overlap",
        "overlapped greedy decode on/off, interleaved per point (default: the generator's, "
        "on for CUDA)",
    )
    on_off(
        "--fuse-silu",
        "SiLU x up inside the FP8 down projection's one-row GEMV on/off, interleaved "
        "per point (default: off, the engine's)",
    )
    ap.add_argument(
        "--linear",
        nargs="+",
        default=None,
        help="settings of the quantized linears' switches to run side by side, interleaved per "
        "point: each 'default' or NAME=on|off[,NAME=on|off...] with NAME one of "
        + ", ".join(LINEAR_SWITCHES)
        + " (e.g. --linear default FUSE_NORM=on GEMV_EVEN=off,FUSE_SILU=on; with FUSE_NORM "
        "in any, the norms are folded into the projections for every point)",
    )
    on_off(
        "--inductor-pdl",
        "Inductor's programmatic dependent launch (its kernels start while the previous "
        "kernel drains; CUDA sm_90+) on/off, interleaved per point, each point compiled afresh "
        "(default: Inductor's, off)",
    )
    ap.add_argument(
        "--lm-head",
        nargs="+",
        choices=["dense", "int8", "fp8", "int4"],
        default=["dense"],
        help="the output projection dense (the engine's default) or quantized in these formats, "
        "whatever the mode's, interleaved per point (e.g. --modes fp8 --lm-head dense int8)",
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--gc-freeze",
        choices=("on", "off"),
        default="on",
        help="freeze the heap after each point's warm-up, as `llmopt serve` does once warm "
        "(every point reports the garbage collections during its timed decode: gc ms)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="torch.profiler table of 20 decode steps"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # the engine's INFO lines (which one-row GEMV each weight shape picked, CUDA builds) in the log
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("llmopt.engines.native").setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    from llmopt.engines.native import attention as A
    from llmopt.engines.native import cuda_gemv
    from llmopt.engines.native import linear as L

    args.int4_triton_default = L.INT4_TRITON  # (build() sets it per int4 mode)
    cuda = torch.device(args.device).type == "cuda"
    dtype = (
        getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    )
    linears = linear_settings(args.linear)
    for name, int4 in (("GEMV_CUDA", False), ("INT4_GEMV_CUDA", True)):
        if cuda and any(lin.get(name) for lin in linears):  # built now, not while compiling
            reason = L.prepare_cuda_gemv(args.device, int4=int4)
            if reason:
                sys.exit(f"--linear {name}=on: the CUDA GEMV does not run here ({reason})")
    switch_defaults = {name: getattr(L, name) for name in LINEAR_SWITCHES}
    # layers are built with a CUDA GEMV's switch on where any point turns it on, so that they
    # time it against Triton's per shape (`GEMV_PICK`); each point then routes by its own.
    # GEMV_PICK_REPLAY acts at build time only: on for the build where any point sets it.
    build_switches = {
        name: True
        for name in ("GEMV_CUDA", "INT4_GEMV_CUDA", "GEMV_PICK_REPLAY")
        if any(s.get(name) for s in linears)
    }
    rope_default, rope_rows = A.FUSE_ROPE, A.FUSE_ROPE_MAX_ROWS
    modes = args.modes or (["bf16", "int8", "int4"] + (["fp8"] if L.fp8_supported() else []))
    compile_ = cuda if args.compile == "auto" else args.compile == "on"
    g = torch.Generator().manual_seed(args.seed)
    cfg_dict = SHAPES[args.shape]
    vocab = 49152 if args.model else cfg_dict["vocab_size"]
    prompt = torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist()
    if args.model:  # real text for a real model
        from transformers import AutoTokenizer

        from llmopt.assets.models import resolve_model

        folder, _ = resolve_model(args.model)
        tok = AutoTokenizer.from_pretrained(folder)
        text = "The history of the city began in the early medieval period, when " * 20
        prompt = tok.encode(text)[: args.prompt_len]
    bw = copy_bandwidth(args.device, (2 << 30) if cuda else (256 << 20))
    env = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "copy_GBps": bw / 1e9,
        "dtype": str(dtype),
        "compile": compile_,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(env))
    results: dict = {"env": env, "args": vars(args), "native": [], "hf": []}
    native_tokens = None
    tokens_b1: list[tuple[str, list[int]]] = []
    for mode in modes:
        # the norms folded where the engine folds them: on CUDA, for FUSE_NORM (the default)
        fold = cuda and (any(lin.get("FUSE_NORM") for lin in linears) or L.FUSE_NORM)
        for name, value in {**switch_defaults, **build_switches}.items():
            setattr(L, name, value)
        model, heads = build(args, mode, dtype, cfg_dict, prompt, fold)
        overlaps = [None] if args.overlap is None else [o == "on" for o in args.overlap]
        silus = [None] if args.fuse_silu is None else [o == "on" for o in args.fuse_silu]
        pdls = [None] if args.inductor_pdl is None else [o == "on" for o in args.inductor_pdl]
        points = [
            (b, path, ov, silu, pdl, lin, head)
            for b in (args.batches if mode in ("bf16", "fp32") else args.quant_batches)
            for path in args.attention
            for ov in overlaps
            for silu in silus
            for pdl in pdls
            for lin in range(len(linears))
            for head in heads
        ]
        first_point = points[0][1:]
        for rnd, (b, path, ov, silu, pdl, lin, head) in (
            (rnd, p) for rnd in range(args.rounds) for p in points
        ):
            model.lm_head, sqnr = heads[head]
            wbytes = weight_bytes(model)
            A.ENABLED = path != "gather"
            A.FUSE_ROPE = rope_default if path == "auto" else path == "triton-rope"
            A.FUSE_ROPE_MAX_ROWS = rope_rows if path == "auto" else 1 << 30
            for name, value in {**switch_defaults, "FUSE_SILU": bool(silu), **linears[lin]}.items():
                setattr(L, name, value)
            if pdl is not None:  # an Inductor setting: Dynamo does not guard on it, so recompile
                if not hasattr(inductor_config.triton, "enable_pdl"):
                    sys.exit(f"torch {torch.__version__}'s Inductor has no enable_pdl setting")
                inductor_config.triton.enable_pdl = pdl
                torch._dynamo.reset()
            L.WO8_KERNEL = (
                mode.partition("@")[2] if mode.endswith(("@gemv", "@dot", "@dot1")) else "auto"
            )
            r = run_native(args, model, b, prompt, compile_, ov, bw / 1e9)
            ctx = args.prompt_len + args.new_tokens / 2
            step_bytes = wbytes + kv_bytes_read(model, int(ctx), b)
            r.update(
                round=rnd,
                lm_head=head,
                fuse_silu=L.FUSE_SILU,
                linear=",".join(f"{k}={'on' if v else 'off'}" for k, v in linears[lin].items())
                or "default",
                inductor_pdl=bool(getattr(inductor_config.triton, "enable_pdl", False)),
                mode=mode,
                weight_GB=wbytes / 1e9,
                logits_sqnr_db_vs_dense=sqnr,
                achieved_GBps=step_bytes / (r["ms_per_step"] / 1e3) / 1e9,
            )
            r["share_of_copy_bw"] = r["achieved_GBps"] * 1e9 / bw
            if b == 1 and mode in ("bf16", "fp32") and native_tokens is None:
                native_tokens = r["tokens"]
            if b == 1 and (path, ov, silu, pdl, lin, head) != first_point:  # against the first
                first = next(x for x in tokens_b1 if x[0] == mode)[1]
                r["greedy_equal_to_first_path"] = sum(
                    a == c for a, c in zip(first, r["tokens"], strict=False)
                )
            if b == 1:
                tokens_b1.append((mode, r["tokens"]))
            results["native"].append({k: v for k, v in r.items() if k != "tokens"})
            print(json.dumps(results["native"][-1]), flush=True)
        model.lm_head = heads["dense"][0]  # HF's generate() below runs the dense head
        if args.hf and mode in ("bf16", "fp32"):
            for cache in ("dynamic", "static"):
                try:
                    h = run_hf(args, model, prompt, cache)
                except Exception as e:  # report, keep the native numbers
                    results["hf"].append({"cache": cache, "error": repr(e)[:300]})
                    continue
                n = min(len(h["tokens"]), len(native_tokens or []))
                same = sum(a == c for a, c in zip(h["tokens"], native_tokens or [], strict=False))
                first_diff = next((i for i in range(n) if h["tokens"][i] != native_tokens[i]), None)
                h.update(match_prefix=first_diff if first_diff is not None else n, match_count=same)
                results["hf"].append({k: v for k, v in h.items() if k != "tokens"})
                print(json.dumps(results["hf"][-1]), flush=True)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print(
        f"\n{'mode':6s} {'attn':6s} {'ovl':3s} {'silu':4s} {'pdl':3s} {'batch':>5s} {'tok/s':>9s} {'ms/step':>8s} "
        f"{'dev ms':>7s} {'host ms':>7s} {'gc ms':>6s} {'GB/s':>8s} {'%copy':>6s} {'warm s':>7s} "
        f"{'SQNR dB':>8s}"
    )
    for r in results["native"]:
        q = r.get("logits_sqnr_db_vs_dense")
        print(
            f"{r['mode']:6s} {r['attention']:6s} {'on' if r['overlap'] else 'off':3s} "
            f"{'on' if r['fuse_silu'] else 'off':4s} {'on' if r['inductor_pdl'] else 'off':3s} "
            f"{r['batch']:5d} {r['tok_s']:9.1f} {r['ms_per_step']:8.2f} "
            f"{r['ms_per_step_device_only']:7.2f} {r['host_ms_per_step']:7.2f} "
            f"{r['gc_ms']:6.1f} {r['achieved_GBps']:8.1f} "
            f"{100 * r['share_of_copy_bw']:5.1f}% {r['warmup_s']:7.1f} "
            f"{'-' if q is None else format(q, '.1f'):>8s} {r['linear']}"
            + ("" if r["lm_head"] == "dense" else f" lm_head={r['lm_head']}")
        )
    for h in results["hf"]:
        if "error" in h:
            print(f"hf {h['cache']}: {h['error']}")
        else:
            print(
                f"hf-{h['cache']:7s}     1 {h['tok_s']:9.1f}   greedy tokens equal to native for the first {h['match_prefix']}; logits SQNR {h['logits_sqnr_db']:.1f} dB"
            )
    if args.rounds > 1:
        results["rounds"] = round_summary(results["native"])
        print(
            f"\nover {args.rounds} rounds (median [range]; ratio to the round's first point of the"
            " format; `vs`: to the round's first format at that batch)"
        )
        modes = len({r["mode"] for r in results["native"]}) > 1
        for x in results["rounds"]:
            print(
                f"{x['point']:60s} {x['tok_s_median']:9.1f} [{x['tok_s_min']:.1f}-"
                f"{x['tok_s_max']:.1f}]  x{x['ratio_median']:.3f} [{x['ratio_min']:.3f}-"
                f"{x['ratio_max']:.3f}]"
                + (
                    f"  vs {x['vs_mode']} x{x['vs_mode_median']:.3f} [{x['vs_mode_min']:.3f}-"
                    f"{x['vs_mode_max']:.3f}]"
                    if modes
                    else ""
                )
            )
    results["gemv_picks"] = L.gemv_picks()
    for pick in results["gemv_picks"]:
        print(
            f"one-row GEMV pick {pick['kind']} {pick['shape']} {pick['what']}: CUDA "
            f"{pick['cuda_us']:.1f} us, Triton {pick['triton_us']:.1f} us -> {pick['picked']}"
        )
    results["cuda_gemv_configs"] = cuda_gemv.tuned_configs()
    for line in config_lines(results["cuda_gemv_configs"]):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
