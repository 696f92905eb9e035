"""In-process benchmark of a causal LM runner: prefill and decode measured separately.

Prefill is timed as one forward over the prompt (tokens/s = batch * prompt length / time); decode
as `new_tokens` greedy steps after an untimed prefill (tokens/s = batch * new_tokens / time).
Both phases can be swept: prefill over prompt lengths, decode over batch sizes (the regime where
weight-only quantization stops paying off). Warm-up runs are timed separately and excluded; CUDA
work is synchronized before every clock read (`timing.device_sync`).

Metric names: the batch-1 / full-prompt numbers keep their historic names (`prefill_tokens_per_s`,
`decode_tokens_per_s`, `decode_ms_per_token`); swept points add `prefill_tokens_per_s_p<P>`,
`decode_tokens_per_s_b<B>` and `decode_ms_per_step_b<B>`; on CUDA `peak_device_mib` is the peak
memory torch allocated over all of it (largest batch included).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmopt.bench.timing import device_sync, time_repeated
from llmopt.core.schema import Stat, summarize

if TYPE_CHECKING:
    import torch

    from llmopt.engines.base import CausalLMRunner

__all__ = ["bench_causal_lm"]


def _decode_times(runner, prompt, new_tokens: int, repeats: int, warmup: int, device: str):
    def once() -> float:
        logits, state = runner.prefill(prompt)
        tok = logits.argmax(-1, keepdim=True)  # (B, 1) greedy
        device_sync(device)
        t = time.perf_counter()
        for _ in range(new_tokens):
            logits, state = runner.decode(tok, state)
            tok = logits.argmax(-1, keepdim=True)
        device_sync(device)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    for _ in range(warmup):
        once()
    return [once() for _ in range(repeats)], time.perf_counter() - t0


def bench_causal_lm(
    runner: CausalLMRunner,
    prompt: torch.Tensor,
    new_tokens: int = 128,
    repeats: int = 5,
    warmup: int = 1,
    device: str = "cpu",
    batch_sizes: Sequence[int] = (1,),
    prompt_lengths: Sequence[int] = (),
) -> tuple[dict[str, Stat], float]:
    """Measure prefill and decode speed, at batch 1 and optionally across batches and lengths.

    Args:
        runner: the candidate.
        prompt: (1, P) token ids (real text, so the work is representative).
        new_tokens: decode steps per repeat.
        repeats: timed repetitions of each phase.
        warmup: untimed repetitions before timing (first-call allocation, lazy init, compilation).
        device: for synchronization.
        batch_sizes: decode batch sizes (the prompt repeated B times); 1 is always measured.
        prompt_lengths: extra prefill lengths (prefixes of `prompt`, each <= P).

    Returns:
        ({metric name: Stat}, total warm-up seconds). Always has "prefill_tokens_per_s",
        "decode_tokens_per_s", "decode_ms_per_token" (batch 1, full prompt).

    Example:
        >>> stats, warm = bench_causal_lm(runner, prompt, new_tokens=16, repeats=2)  # doctest: +SKIP
        >>> stats, warm = bench_causal_lm(runner, prompt, 16, 2, batch_sizes=(1, 8))  # doctest: +SKIP
        >>> stats["decode_tokens_per_s_b8"].median  # doctest: +SKIP
    """
    assert prompt.dim() == 2 and prompt.shape[0] == 1, "prompt must be (1, P)"
    p = prompt.shape[1]
    assert all(1 <= n <= p for n in prompt_lengths), f"prompt lengths must be in 1..{p}"
    assert all(b >= 1 for b in batch_sizes), "batch sizes must be >= 1"
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()
    pre, warm = time_repeated(lambda: runner.prefill(prompt), repeats, warmup, device)
    stats = {"prefill_tokens_per_s": summarize([p / s for s in pre], "tokens/s")}
    for n in sorted(set(prompt_lengths) - {p}):
        sub = prompt[:, :n]
        t, w = time_repeated(lambda sub=sub: runner.prefill(sub), repeats, warmup, device)
        stats[f"prefill_tokens_per_s_p{n}"] = summarize([n / s for s in t], "tokens/s")
        warm += w
    for b in sorted(set(batch_sizes) | {1}):
        batch = prompt.expand(b, p).contiguous()  # (B, P)
        dec, w = _decode_times(runner, batch, new_tokens, repeats, warmup, device)
        warm += w
        if b == 1:
            stats["decode_tokens_per_s"] = summarize([new_tokens / s for s in dec], "tokens/s")
            stats["decode_ms_per_token"] = summarize([1000 * s / new_tokens for s in dec], "ms")
        else:
            tps = [b * new_tokens / s for s in dec]
            stats[f"decode_tokens_per_s_b{b}"] = summarize(tps, "tokens/s")
            stats[f"decode_ms_per_step_b{b}"] = summarize(
                [1000 * s / new_tokens for s in dec], "ms"
            )
    if device.startswith("cuda"):  # host peak is the process's RSS, recorded by the caller
        peak = torch.cuda.max_memory_allocated() / 2**20
        stats["peak_device_mib"] = summarize([peak], "MiB")
    return stats, warm
