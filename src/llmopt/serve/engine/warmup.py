"""Warm a batch generator up before the server accepts requests (in the engine process too).

Compiles the decode shapes up to the warm-up context (where the generator compiles them: CUDA
for the native engine) and the compiled prefill, then runs one short generation, so no request
waits for a compile; then freezes the heap (`collector.freeze`), so no request waits for a full
garbage collection over the model's objects.
"""

from __future__ import annotations

import logging
import time

from llmopt.engines.generation import BatchGenerator, SamplingParams
from llmopt.serve import collector

__all__ = ["warm_generator"]

log = logging.getLogger(__name__)


def warm_generator(gen: BatchGenerator, warmup_tokens: int, device: str) -> None:
    """Compile the decode shapes up to `warmup_tokens` of context (CUDA), then one short
    generation, so no request waits for a compile (in the engine process too)."""
    if warmup_tokens and device == "cpu":
        # The CPU decode step is eager (load_generator compiles on CUDA only): nothing to
        # compile, and running every shape up to a long context takes minutes on a few cores.
        log.info("decode warm-up skipped: the CPU decode step is not compiled")
        if secs := gen.warmup_prefill():
            log.info("compiled prefill warm-up took %.1f s", secs)
    elif warmup_tokens:
        upto = min(warmup_tokens, int(gen.max_seq_len))
        widths = gen.warmup_widths(upto)
        log.info(
            "warming up the decode step for contexts up to %d tokens: batch sizes %s x %d "
            "length buckets (on CUDA each is compiled once: about a minute for an 8B model; "
            "longer contexts compile on first use)",
            upto,
            gen.batch_sizes,
            len(widths),
        )
        log.info("decode warm-up took %.1f s", gen.warmup(upto))
    t0 = time.perf_counter()
    gen.generate(gen.tokenizer("Hello")["input_ids"] or [0], SamplingParams(max_tokens=2))
    log.info("warm-up generation %.2f s", time.perf_counter() - t0)
    if (pc := getattr(gen, "prefix_cache", None)) is not None:  # the warm-up is not traffic
        pc.queries = pc.hits = 0
    # The model, its compiled steps and their guards live as long as the process: out of the
    # garbage collector's way before the first request (serve/collector.py)
    collector.freeze("engine warm")
    collector.watch()
