"""In-process benchmark of a causal LM runner: prefill and decode measured separately.

Prefill is timed as one forward over the prompt (tokens/s = prompt length / time); decode as
`new_tokens` greedy steps after an untimed prefill (tokens/s = new_tokens / time), at batch 1.
Warm-up runs are timed separately and excluded.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from llmopt.bench.timing import time_repeated
from llmopt.schema import Stat, summarize

if TYPE_CHECKING:
    import torch

    from llmopt.engines.base import CausalLMRunner

__all__ = ["bench_causal_lm"]


def bench_causal_lm(
    runner: CausalLMRunner,
    prompt: torch.Tensor,
    new_tokens: int = 128,
    repeats: int = 5,
    warmup: int = 1,
    device: str = "cpu",
) -> tuple[dict[str, Stat], float]:
    """Measure prefill and batch-1 decode speed.

    Args:
        runner: the candidate.
        prompt: (1, P) token ids (real text, so the work is representative).
        new_tokens: decode steps per repeat.
        repeats: timed repetitions of each phase.
        warmup: untimed repetitions before timing (first-call allocation, lazy init, compilation).
        device: for synchronization.

    Returns:
        ({"prefill_tokens_per_s", "decode_tokens_per_s", "decode_ms_per_token"}: Stat), warm-up s.

    Example:
        >>> stats, warm = bench_causal_lm(runner, prompt, new_tokens=16, repeats=2)  # doctest: +SKIP
    """
    assert prompt.dim() == 2 and prompt.shape[0] == 1, "prompt must be (1, P)"
    p = prompt.shape[1]
    pre, warm_pre = time_repeated(lambda: runner.prefill(prompt), repeats, warmup, device)

    def decode_once() -> float:
        logits, state = runner.prefill(prompt)
        tok = logits.argmax(-1, keepdim=True)  # (1, 1) greedy
        t = time.perf_counter()
        for _ in range(new_tokens):
            logits, state = runner.decode(tok, state)
            tok = logits.argmax(-1, keepdim=True)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    for _ in range(warmup):
        decode_once()
    warm_dec = time.perf_counter() - t0
    dec = [decode_once() for _ in range(repeats)]
    stats = {
        "prefill_tokens_per_s": summarize([p / s for s in pre], "tokens/s"),
        "decode_tokens_per_s": summarize([new_tokens / s for s in dec], "tokens/s"),
        "decode_ms_per_token": summarize([1000 * s / new_tokens for s in dec], "ms"),
    }
    return stats, warm_pre + warm_dec
