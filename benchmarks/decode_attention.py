"""Decode attention alone: the flash-decoding Triton kernel against the torch gather path.

    python benchmarks/decode_attention.py                      # Llama-3.1-8B heads, on a GPU

For each batch and context length it fills a paged cache (random blocks, every sequence at the
full context), times one layer's decode attention both ways with CUDA events (median of
`triton.testing.do_bench`), and reports the KV bytes the step must read (each sequence's keys
and values once) over that time against the device-to-device copy bandwidth measured in the same
run. The gather path is `model.Attention._paged` as the engine runs it on the CPU, over a table
exactly as wide as the context. Correctness (relative error against the fp32 reference) is
printed next to each point.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def copy_rate(dev: str) -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy (median)."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3
    return 2 * src.numel() * 2 / t


def runners(A, attn, caches, q, tables, pos, bs):
    """The kernel and the gather path over `caches` in rotation (each call the next set)."""
    i, j = [0], [0]  # each starts at set 0: its first output is checked against set 0

    def kernel():
        kc, vc = caches[i[0] % len(caches)]
        i[0] += 1
        return A.paged_decode(q, kc, vc, tables, pos, bs)

    def gather():
        attn.k_cache, attn.v_cache = caches[j[0] % len(caches)]
        j[0] += 1
        return attn._paged(q[:, None], pos[:, None], tables, bs)

    return kernel, gather


def main() -> None:
    import triton.testing

    from llmopt.engines.native import attention as A
    from llmopt.engines.native.config import NativeConfig
    from llmopt.engines.native.model import Attention

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 4096])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda"
    assert A.decode_attention_available(), "the kernel failed its check on this GPU"
    copy_bw = copy_rate(dev)
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9}))
    h, kv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    cfg = NativeConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": h * d,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": h,
            "num_key_value_heads": kv,
            "vocab_size": 64,
            "max_position_embeddings": 1 << 17,
        }
    )
    attn = Attention(cfg).to(dev, torch.bfloat16)
    rows = []
    for ctx in args.contexts:
        for b in args.batches:
            nb = math.ceil(ctx / bs)
            n_blocks = b * nb + 1
            # several caches in rotation, so repeated runs do not read from L2
            sets = max(1, min(4, (1 << 30) // (2 * n_blocks * bs * kv * d * 2)))
            caches = [
                (
                    torch.randn(n_blocks * bs, kv, d, device=dev, dtype=torch.bfloat16),
                    torch.randn(n_blocks * bs, kv, d, device=dev, dtype=torch.bfloat16),
                )
                for _ in range(sets)
            ]
            tables = (torch.randperm(b * nb, device=dev) + 1).view(b, nb)
            pos = torch.full((b,), ctx - 1, device=dev)
            q = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16)
            kernel, gather = runners(A, attn, caches, q, tables, pos, bs)
            ref = A.reference(q, *caches[0], tables, pos + 1, bs)
            err = float((kernel().float() - ref).norm() / ref.norm())
            gerr = float((gather().float().reshape(b, h, d) - ref).norm() / ref.norm())
            t_k = triton.testing.do_bench(kernel, return_mode="median") / 1e3
            t_g = triton.testing.do_bench(gather, return_mode="median") / 1e3
            t_k2 = triton.testing.do_bench(kernel, return_mode="median") / 1e3  # spread
            nbytes = 2 * b * ctx * kv * d * 2
            r = {
                "batch": b,
                "ctx": ctx,
                "splits": A.num_splits(b, kv, nb * bs, A.sm_count(torch.device(dev))),
                "kernel_us": 1e6 * t_k,
                "kernel_us_again": 1e6 * t_k2,
                "gather_us": 1e6 * t_g,
                "speedup": t_g / t_k,
                "kv_MB": nbytes / 1e6,
                "kernel_GBps": nbytes / t_k / 1e9,
                "share_of_copy": nbytes / t_k / copy_bw,
                "rel_err": err,
                "gather_rel_err": gerr,
            }
            rows.append(r)
            print(json.dumps(r), flush=True)
            del caches
            torch.cuda.empty_cache()
    print(
        f"\n{'batch':>5s} {'ctx':>6s} {'splits':>6s} {'kernel us':>10s} {'gather us':>10s} "
        f"{'x':>6s} {'GB/s':>7s} {'%copy':>6s} {'err':>8s}"
    )
    for r in rows:
        print(
            f"{r['batch']:5d} {r['ctx']:6d} {r['splits']:6d} {r['kernel_us']:10.1f} "
            f"{r['gather_us']:10.1f} {r['speedup']:6.2f} {r['kernel_GBps']:7.0f} "
            f"{100 * r['share_of_copy']:5.1f}% {r['rel_err']:8.1e}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_GBps": copy_bw / 1e9, "rows": rows}))


if __name__ == "__main__":
    main()
