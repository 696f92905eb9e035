"""Real weights through the native engine: perplexity and logits per format against fp32.

    python benchmarks/real_weights.py --model smollm2-135m                # CPU: fp32 bf16 int8 int4
    python benchmarks/real_weights.py --model FOLDER --device cuda        # + fp8 and kv-fp8

For every format the same held-out windows (the built-in Wikipedia's evaluation split, tokenized
by the model's tokenizer) run through the native model on `--device`, and each window's logits
are compared with the fp32 model's on the same device: perplexity and its change, SQNR of the
logits (dB) and top-1 agreement. Each window runs as the engine runs it
(`engines.native.scoring.window_logits`): the first `--split` tokens as a prefill, the rest but
the last `--decode` as a chunk through the paged attention path, which reads the KV cache (so a
KV cache in float8, `kv-fp8`, is part of what is measured), then the last `--decode` tokens one
at a time through the decode kernels (on CUDA: the GEMV linears, the flash-decoding attention),
also scored alone (the `decode` columns). int4 is round-to-nearest with groups
of `--group` (64 divides SmolLM2's 576-wide rows; 128 does not). `--lm-head FORMAT` quantizes the
output projection too, in FORMAT (the engine keeps it dense by default). Results: a table and `--json`.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F


def main() -> None:
    from transformers import AutoTokenizer

    from llmopt.assets.models import resolve_model
    from llmopt.assets.text import evaluation_text, token_windows
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.scoring import window_logits
    from llmopt.engines.native.weights import (
        dense_gemv_,
        load_model,
        quantize_linear,
        quantize_model_,
    )

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--formats", nargs="+", default=None)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--split", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64, help="tokens per window decoded one by one")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument(
        "--lm-head",
        choices=["dense", "int8", "fp8", "int4"],
        default="dense",
        help="the output projection dense (the engine's default) or quantized in this format "
        "in every format but fp32 (kv-fp8 included)",
    )
    ap.add_argument(
        "--fold-norms",
        action="store_true",
        help="fold the RMSNorm weights into the projections before quantizing (what the "
        "engine does on CUDA for its norm-in-the-GEMV path, `linear.FUSE_NORM`, on by default; "
        "this flag folds on any device, bf16 too)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    formats = args.formats or (
        ["bf16", "int8", "int4"] + (["fp8", "kv-fp8"] if cuda and L.fp8_supported() else [])
    )
    folder, _ = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    text = evaluation_text()[: 8 * args.window * args.windows]
    windows = token_windows(tok, text, args.window, args.windows)

    def run(fmt: str) -> list[torch.Tensor]:
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        if fmt in ("int8", "int4", "fp8") and not args.fold_norms:  # as the engine loads
            model = load_model(folder, args.device, dtype, quant=fmt, group=args.group)
        else:
            model = load_model(folder, args.device, dtype)
        if fmt in ("int8", "int4", "fp8") and args.fold_norms:
            quantize_model_(model, fmt, group=args.group, fold=True)
        elif fmt == "bf16" and args.fold_norms:  # the bf16 weights rounded once more
            dense_gemv_(model)
        if fmt != "fp32" and args.lm_head != "dense":
            model.lm_head = quantize_linear(model.lm_head, args.lm_head, args.group)
        kv = torch.float8_e4m3fn if fmt == "kv-fp8" else dtype
        out = [
            window_logits(model, w, args.split, args.decode, kv, args.device).cpu() for w in windows
        ]
        del model
        if cuda:
            torch.cuda.empty_cache()
        return out

    def nll(logits: list[torch.Tensor], tail: int = 0) -> float:
        # mean over each window's predicted tokens; `tail`: only its last `tail` predictions
        lo = -tail - 1 if tail else 0
        tot = sum(
            float(F.cross_entropy(lg[lo:-1], w[lo + 1 :], reduction="sum"))
            for lg, w in zip(logits, windows, strict=True)
        )
        return tot / sum(len(w[lo + 1 :]) for w in windows)

    def agreement(ref: list[torch.Tensor], got: list[torch.Tensor], tail: int = 0):
        r = torch.cat([x[-tail:] for x in ref] if tail else ref)
        g = torch.cat([x[-tail:] for x in got] if tail else got)
        sq = float(10 * torch.log10(r.pow(2).sum() / (r - g).pow(2).sum().clamp(min=1e-30)))
        return sq, float((r.argmax(-1) == g.argmax(-1)).float().mean())

    tail = args.decode
    ref = run("fp32")
    rows = [{"format": "fp32", "ppl": math.exp(nll(ref))}]
    if tail:
        rows[0]["decode_ppl"] = math.exp(nll(ref, tail - 1))
    print(json.dumps({"device": args.device, "model": str(folder), "windows": len(windows)}))
    print(json.dumps(rows[0]))
    for fmt in formats:
        got = run(fmt)
        sq, top1 = agreement(ref, got)
        ppl = math.exp(nll(got))
        row = {
            "format": fmt,
            "ppl": ppl,
            "ppl_change": ppl / rows[0]["ppl"] - 1,
            "logits_sqnr_db": sq,
            "top1_agreement": top1,
        }
        if tail:  # the one-token steps alone (their last logit predicts past the window)
            dsq, dtop1 = agreement(ref, got, tail)
            dppl = math.exp(nll(got, tail - 1))
            row |= {
                "decode_ppl_change": dppl / rows[0]["decode_ppl"] - 1,
                "decode_sqnr_db": dsq,
                "decode_top1": dtop1,
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{'format':8s} {'ppl':>8s} {'vs fp32':>8s} {'SQNR dB':>8s} {'top-1':>6s}"
        f" | decode: {'vs fp32':>8s} {'SQNR dB':>8s} {'top-1':>6s}"
    )

    def pct(x):
        return "-" if x is None else format(100 * x, "+.2f") + "%"

    for r in rows:
        print(
            f"{r['format']:8s} {r['ppl']:8.3f} {pct(r.get('ppl_change')):>8s} "
            f"{r.get('logits_sqnr_db', float('nan')):8.1f} {r.get('top1_agreement', 1.0):6.3f}"
            f" |         {pct(r.get('decode_ppl_change')):>8s} "
            f"{r.get('decode_sqnr_db', float('nan')):8.1f} {r.get('decode_top1', 1.0):6.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
