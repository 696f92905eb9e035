"""Real weights through the native engine: perplexity and logits per format against fp32.

    python benchmarks/real_weights.py --model smollm2-135m                # CPU: fp32 bf16 int8 int4
    python benchmarks/real_weights.py --model FOLDER --device cuda        # + fp8 and kv-fp8

For every format the same held-out windows (the built-in Wikipedia's evaluation split, tokenized
by the model's tokenizer) run through the native model on `--device`, and each window's logits
are compared with the fp32 model's on the same device: perplexity and its change, SQNR of the
logits (dB) and top-1 agreement. Each window runs as two chunks, the first `--split` tokens as a
prefill and the rest through the paged attention path, which reads the KV cache: so a KV cache in
float8 (`kv-fp8`, bf16 weights) is part of what is measured. int4 is round-to-nearest with groups
of `--group` (64 divides SmolLM2's 576-wide rows; 128 does not). Results: a table and `--json`.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F


def window_logits(model, ids: torch.Tensor, split: int, kv_dtype, device) -> torch.Tensor:
    """fp32 logits (T, V) of one window: a prefill of `split` tokens, then the rest as a chunk
    through the paged path (which reads the cache, in `kv_dtype`)."""
    t = ids.numel()
    bs = 16
    nb = math.ceil(t / bs)
    model.setup_cache(nb + 1, bs, kv_dtype, device)
    table = torch.arange(1, nb + 1, device=device).unsqueeze(0)
    x = ids.view(1, -1).to(device)
    pos = torch.arange(t, device=device).unsqueeze(0)
    with torch.inference_mode():
        a = model(x[:, :split], pos[:, :split], table, prefill=True, last_only=False)
        b = model(x[:, split:], pos[:, split:], table, prefill=False, last_only=False)
    return torch.cat([a, b], dim=1)[0].float()


def main() -> None:
    from transformers import AutoTokenizer

    from llmopt.assets.models import resolve_model
    from llmopt.assets.text import evaluation_text, token_windows
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.weights import load_model, quantize_model_

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--formats", nargs="+", default=None)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--split", type=int, default=128)
    ap.add_argument("--group", type=int, default=64)
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
        model = load_model(folder, args.device, dtype)
        if fmt in ("int8", "int4", "fp8"):
            quantize_model_(model, fmt, group=args.group)
        kv = torch.float8_e4m3fn if fmt == "kv-fp8" else dtype
        out = [window_logits(model, w, args.split, kv, args.device).cpu() for w in windows]
        del model
        if cuda:
            torch.cuda.empty_cache()
        return out

    def nll(logits: list[torch.Tensor]) -> float:
        tot = sum(
            float(F.cross_entropy(lg[:-1], w[1:], reduction="sum"))
            for lg, w in zip(logits, windows, strict=True)
        )
        return tot / sum(w.numel() - 1 for w in windows)

    ref = run("fp32")
    ref_nll = nll(ref)
    rows = [{"format": "fp32", "ppl": math.exp(ref_nll)}]
    print(json.dumps({"device": args.device, "model": str(folder), "windows": len(windows)}))
    print(json.dumps(rows[0]))
    for fmt in formats:
        got = run(fmt)
        r = torch.cat(ref)
        g = torch.cat(got)
        sq = float(10 * torch.log10(r.pow(2).sum() / (r - g).pow(2).sum().clamp(min=1e-30)))
        top1 = float((r.argmax(-1) == g.argmax(-1)).float().mean())
        ppl = math.exp(nll(got))
        rows.append(
            {
                "format": fmt,
                "ppl": ppl,
                "ppl_change": ppl / rows[0]["ppl"] - 1,
                "logits_sqnr_db": sq,
                "top1_agreement": top1,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'format':8s} {'ppl':>8s} {'vs fp32':>8s} {'SQNR dB':>8s} {'top-1':>6s}")
    for r in rows:
        ch = r.get("ppl_change")
        print(
            f"{r['format']:8s} {r['ppl']:8.3f} "
            f"{'-' if ch is None else format(100 * ch, '+.2f') + '%':>8s} "
            f"{r.get('logits_sqnr_db', float('nan')):8.1f} {r.get('top1_agreement', 1.0):6.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
