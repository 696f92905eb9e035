"""SmolLM2-135M's real weights through the native engine on a CUDA GPU, every GPU format against
the fp32 model on the same GPU: held-out perplexity change and logit SQNR within bounds set from
the measurements (`benchmarks/real_weights.py`, 8 x 512 tokens, docs/benchmarks.md "Real weights
on the H200"; H200 / CPU: bf16 +0.09% / +0.12%, 37.1 / 36.8 dB; int8 +0.10% / +0.17%, 30.6 / 30.6
dB; int4 g64 round-to-nearest +31% / +29%, 7.0 / 6.7 dB; kv-fp8 +0.43% / +0.41%, 30.2 / 30.3 dB;
FP8 weights and activations, GPU only, +1.68%, 22.7 dB), with ~5 dB of margin for this test's
shorter 4 x 256 windows. Each window's last 32 tokens run one per forward, through the decode
kernels, and their logits alone must meet the same SQNR bound. Skipped without a GPU. `SMOLLM2_DIR` names an HF folder of the model
where the built-in package is not installed (the H200 run converts the GGUF itself:
benchmarks/h200_runs.sh realweights)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (format, largest perplexity change, smallest logit SQNR in dB)
BOUNDS = [
    ("bf16", 0.01, 30.0),
    ("int8", 0.01, 25.0),
    ("int4", 0.40, 5.0),
    ("fp8", 0.05, 18.0),
    ("kv-fp8", 0.02, 25.0),
]


DECODE = 32  # each window's last tokens, one per forward: the decode kernels (GEMV, attention)


def _sqnr(ref, got):
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


def test_every_gpu_format_within_the_cpu_measured_quality():
    from transformers import AutoTokenizer

    from llmopt.assets import prepare_builtin
    from llmopt.assets.text import evaluation_text, token_windows
    from llmopt.engines.native import linear as L
    from llmopt.engines.native.scoring import window_logits
    from llmopt.engines.native.weights import load_model

    folder = os.environ.get("SMOLLM2_DIR") or prepare_builtin("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(folder)
    windows = token_windows(tok, evaluation_text()[:40000], 256, 4)

    def run(fmt):
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        quant = fmt if fmt in ("int8", "int4", "fp8") else None
        model = load_model(folder, "cuda", dtype, quant=quant, group=64)  # as the engine loads
        kv = torch.float8_e4m3fn if fmt == "kv-fp8" else dtype
        logits = [window_logits(model, w, 64, DECODE, kv, "cuda") for w in windows]
        nll = sum(
            float(F.cross_entropy(lg[:-1], w[1:].cuda(), reduction="sum"))
            for lg, w in zip(logits, windows, strict=True)
        ) / sum(w.numel() - 1 for w in windows)
        tails = torch.cat([lg[-DECODE:] for lg in logits])
        return torch.cat(logits), math.exp(nll), tails

    ref, ref_ppl, ref_tails = run("fp32")
    failures = []
    for fmt, max_change, min_sqnr in BOUNDS:
        if fmt in ("fp8", "kv-fp8") and not L.fp8_supported():
            continue
        got, ppl, tails = run(fmt)
        sqnr, tail_sqnr = _sqnr(ref, got), _sqnr(ref_tails, tails)
        if abs(ppl / ref_ppl - 1) > max_change or min(sqnr, tail_sqnr) < min_sqnr:
            failures.append(
                f"{fmt}: ppl {ppl:.3f} vs fp32 {ref_ppl:.3f}, SQNR {sqnr:.1f} dB, "
                f"one-token steps alone {tail_sqnr:.1f} dB"
            )
    assert not failures, failures
