"""Verification of causal LMs against the reference: perplexity, top-1 agreement, KL divergence.

All three come from one teacher-forced pass over held-out text: the same token windows go through
the reference and the candidate, so the numbers compare like with like. Perplexity is the gate
(relative increase within the quality budget); agreement and KL say *how* the distributions moved,
which perplexity alone can hide (a candidate can keep perplexity and still change its greedy picks).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from llmopt.schema import Metric, VerifyResult

if TYPE_CHECKING:
    import torch

    from llmopt.engines.base import CausalLMRunner

__all__ = ["token_windows", "verify_causal_lm"]


def token_windows(tokenizer, text: str, window: int = 512, count: int = 16) -> torch.Tensor:
    """Cut `text` into `count` non-overlapping windows of `window` tokens, in order.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: held-out prose (llmopt.assets.text.evaluation_text()).
        window: tokens per window (the context each token is predicted from is at most this).
        count: number of windows; fewer are returned if the text runs out (never padded).

    Returns:
        (N, window) int64 tensor.
    """
    import torch

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = min(count, len(ids) // window)
    if n == 0:
        raise ValueError(
            f"evaluation text has {len(ids)} tokens, fewer than one window of {window}"
        )
    return torch.tensor(ids[: n * window], dtype=torch.long).view(n, window)


def verify_causal_lm(
    candidate_id: str,
    runner: CausalLMRunner,
    windows: torch.Tensor,
    reference: CausalLMRunner | None = None,
    max_quality_drop: float = 0.01,
    progress=None,
) -> VerifyResult:
    """Score `runner` on `windows` and compare it with `reference` token by token.

    Args:
        candidate_id: for the result.
        runner: the candidate.
        windows: (N, T) token ids from `token_windows`.
        reference: the reference runner; None when the candidate *is* the reference.
        max_quality_drop: allowed relative perplexity increase (0.01 = +1%).
        progress: optional callable(done, total) after each window.

    Returns:
        VerifyResult with `perplexity` (gated), `top1_agreement` and `kl_divergence_mean`.
    """
    import torch
    import torch.nn.functional as F

    t0 = time.perf_counter()
    nll_c = nll_r = kl = 0.0
    agree = tokens = 0
    nonfinite = False
    for i, w in enumerate(windows):
        ids = w.unsqueeze(0)  # (1, T)
        target = ids[:, 1:]
        logp_c = F.log_softmax(runner.logits(ids)[:, :-1].float(), dim=-1)  # (1, T-1, V)
        nonfinite |= not bool(torch.isfinite(logp_c).all())
        nll_c += -logp_c.gather(-1, target.unsqueeze(-1)).sum().item()
        tokens += target.numel()
        if reference is not None:
            logp_r = F.log_softmax(reference.logits(ids)[:, :-1].float(), dim=-1)
            nll_r += -logp_r.gather(-1, target.unsqueeze(-1)).sum().item()
            agree += (logp_r.argmax(-1) == logp_c.argmax(-1)).sum().item()
            # KL(reference || candidate), summed over the vocabulary, per position.
            kl += (logp_r.exp() * (logp_r - logp_c)).sum().item()
        if progress:
            progress(i + 1, len(windows))

    ppl_c = math.exp(nll_c / tokens) if not nonfinite else float("nan")
    if reference is None:
        ppl_r, top1, kl_mean = ppl_c, 1.0, 0.0
    else:
        ppl_r, top1, kl_mean = math.exp(nll_r / tokens), agree / tokens, kl / tokens
    limit = ppl_r * (1.0 + max_quality_drop)
    ppl_ok = (not nonfinite) and ppl_c <= limit
    metrics = [
        Metric(
            "perplexity",
            ppl_r,
            ppl_c,
            higher_is_better=False,
            threshold=limit,
            passed=ppl_ok,
            n=tokens,
            note=f"{len(windows)} windows x {windows.shape[1]} tokens",
        ),
        Metric(
            "top1_agreement",
            1.0,
            top1,
            higher_is_better=True,
            n=tokens,
            note="share of positions where candidate and reference pick the same next token",
        ),
        Metric(
            "kl_divergence_mean",
            0.0,
            kl_mean,
            higher_is_better=False,
            n=tokens,
            unit="nats",
            note="KL(reference || candidate) per position",
        ),
    ]
    notes = (
        ["non-finite log-probabilities in the candidate's output (NaN/Inf)"] if nonfinite else []
    )
    if reference is None:
        notes.append("this is the reference: comparison metrics are 1.0/0.0 by definition")
    drop = (ppl_c / ppl_r - 1.0) if not nonfinite else float("inf")
    return VerifyResult(
        candidate_id,
        "causal-lm",
        metrics,
        passed=ppl_ok,
        quality_drop=drop,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )
