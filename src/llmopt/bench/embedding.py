"""Throughput of embedding candidates: sentences per second at fixed batch sizes.

Each batch size embeds a fixed list of sentences end to end (tokenization, model, pooling), as a
user's `embed()` call would, `repeats` times after `warmup` untimed passes. Batch 1 measures
latency-bound serving and uses a prefix of the sentences so it stays short on small CPUs; batch
32 is the bulk-indexing number that selection ranks on (`sentences_per_s_b32`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from llmopt.bench.timing import time_repeated
from llmopt.core.schema import Stat, summarize
from llmopt.engines.base import EmbeddingRunner

__all__ = ["bench_embedding", "PRIMARY_METRIC"]

log = logging.getLogger(__name__)

PRIMARY_METRIC = "sentences_per_s_b32"


def bench_embedding(
    runner: EmbeddingRunner,
    sentences: Sequence[str],
    batch_sizes: Sequence[int] = (1, 32),
    repeats: int = 5,
    warmup: int = 1,
    max_sentences_b1: int = 200,
) -> tuple[dict[str, Stat], float]:
    """Time `runner.embed` over `sentences` at each batch size.

    Args:
        runner: the candidate's embedding runner.
        sentences: the benchmark sentences (all of them are embedded at batch sizes > 1).
        batch_sizes: batch sizes to measure; each gives a metric `sentences_per_s_b<size>`.
        repeats: timed passes per batch size (summarized as median and percentiles).
        warmup: untimed passes before them (thread-pool start-up, allocator, lazy init).
        max_sentences_b1: at batch size 1 only the first this many sentences are embedded
            (about 200 keeps a pass under ~20 s on 2 cores for a MiniLM-sized model).

    Returns:
        ({metric name: Stat in sentences/s}, total warm-up seconds).

    >>> metrics, warm = bench_embedding(runner, sentences, repeats=2)  # doctest: +SKIP
    >>> metrics["sentences_per_s_b32"].median  # doctest: +SKIP
    350.2
    """
    assert sentences, "bench_embedding needs at least one sentence"
    sentences = list(sentences)
    metrics: dict[str, Stat] = {}
    warm_total = 0.0
    for bs in batch_sizes:
        assert bs >= 1, f"batch size must be >= 1, got {bs}"
        subset = sentences[:max_sentences_b1] if bs == 1 else sentences
        times, warm = time_repeated(
            lambda subset=subset, bs=bs: runner.embed(subset, batch_size=bs),
            repeats=repeats,
            warmup=warmup,
        )
        warm_total += warm
        stat = summarize([len(subset) / t for t in times], unit="sentences/s")
        metrics[f"sentences_per_s_b{bs}"] = stat
        log.info(
            "batch %d: %.1f sentences/s (median of %d, %d sentences)",
            bs,
            stat.median,
            repeats,
            len(subset),
        )
    return metrics, warm_total
