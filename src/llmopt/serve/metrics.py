"""Prometheus metrics of one server (its own registry, so tests can run several in a process).

Names follow vLLM's (`vllm:num_requests_running` -> `llmopt_num_requests_running`) so existing
dashboards map one to one. Tokens/s is `rate()` of the token counters; `llmopt_tokens_per_second`
is the same over the last few seconds, for a quick look without a Prometheus server.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Protocol

from llmopt.serve import collector

__all__ = ["ServeMetrics", "EngineStats"]

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class EngineStats(Protocol):
    """What `publish` reads after every engine step (the scheduler's `SchedulerStats`)."""

    waiting: int
    running: int
    preempted: int
    free_blocks: int
    swapped: int
    swap_used_bytes: int
    engine_time: Any  # cumulative step timings (EngineTime), or None
    prefix_cache_queries: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of them, found cached
    gc: Any  # the stepping process's garbage collections (`collector.GCPauses`), or None

    @property
    def kv_usage(self) -> float: ...


class ServeMetrics:
    """Every metric the server exports; `render()` gives the Prometheus text format."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.waiting = Gauge(
            "llmopt_num_requests_waiting", "Sequences queued, not yet admitted.", registry=r
        )
        self.running = Gauge(
            "llmopt_num_requests_running", "Sequences in the engine's batch.", registry=r
        )
        self.preempted = Gauge(
            "llmopt_num_requests_preempted",
            "Sequences evicted, waiting to be recomputed or swapped back in.",
            registry=r,
        )
        self.swapped = Gauge(
            "llmopt_num_requests_swapped",
            "Preempted sequences whose KV cache waits in host memory.",
            registry=r,
        )
        self.swap_used = Gauge(
            "llmopt_swap_space_used_bytes", "Host memory holding swapped-out KV caches.", registry=r
        )
        self.queue_depth = Gauge(
            "llmopt_queue_depth",
            "Requests accepted and not finished (running + queued).",
            registry=r,
        )
        self.kv_usage = Gauge(
            "llmopt_kv_cache_usage_ratio", "Share of KV-cache blocks allocated (0-1).", registry=r
        )
        self.kv_free = Gauge(
            "llmopt_kv_cache_free_blocks", "KV-cache blocks not allocated.", registry=r
        )
        self.kv_total = Gauge("llmopt_kv_cache_blocks", "KV-cache blocks in total.", registry=r)
        self.kv_leaked = Gauge(
            "llmopt_kv_cache_leaked_blocks",
            "KV-cache blocks allocated to no running sequence (the block invariant: always 0; "
            "/health degrades otherwise).",
            registry=r,
        )
        # vLLM's prefix-cache counters (`vllm:prefix_cache_queries` / `_hits`), in tokens.
        self.prefix_queries = Counter(
            "llmopt_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (a recomputed sequence's again).",
            registry=r,
        )
        self.prefix_hits = Counter(
            "llmopt_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their KV reused, not computed).",
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "llmopt_prefix_cache_hit_rate",
            "Prefix-cache hits / queries since the start (0-1; rate() of the counters gives it "
            "over a window).",
            registry=r,
        )
        self.tokens_per_s = Gauge(
            "llmopt_tokens_per_second", "Generated tokens/s over the last 5 s.", registry=r
        )
        self.prompt_tokens = Counter("llmopt_prompt_tokens", "Prompt tokens accepted.", registry=r)
        self.generation_tokens = Counter(
            "llmopt_generation_tokens", "Tokens generated.", registry=r
        )
        self.preemptions = Counter(
            "llmopt_num_preemptions", "Sequences preempted (recompute or swap).", registry=r
        )
        self.requests = Counter(
            "llmopt_requests",
            "Finished requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "llmopt_requests_rejected", "Requests refused before any work.", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "llmopt_time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "llmopt_time_per_output_token_seconds",
            "Time per output token after the first (per request mean).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llmopt_e2e_request_latency_seconds",
            "Request latency.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.embed_batch = Histogram(
            "llmopt_embedding_batch_size",
            "Texts per embedding forward pass (dynamic batching).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        # Where the engine's steps spent their time (Generator.time, llmopt's own): prefill
        # and decode forwards, and whole steps; the rest of the wall time is between steps.
        self.engine_time = {
            field: Counter(f"llmopt_engine_{name}", doc, registry=r)
            for field, name, doc in (
                ("prefill_s", "prefill_seconds", "Seconds in prefill forwards (device, launches)."),
                ("prefill_tokens", "prefill_tokens", "Prompt tokens prefilled (no padding)."),
                ("prefill_forwards", "prefill_forwards", "Prefill forward passes."),
                ("decode_s", "decode_seconds", "Seconds in decode forwards (device, launches)."),
                ("decode_steps", "decode_steps", "Decode forwards (a token per running sequence)."),
                ("step_s", "step_seconds", "Seconds in engine steps (forwards, inputs, sampling)."),
            )
        }
        # Garbage collections stop a whole process (serve/collector.py): the engine's process
        # ("engine", the server's own where the engine runs in it) and, where the engine has a
        # process of its own, the HTTP server's ("server")
        gc_labels = ["process", "generation"]
        self.gc_collections = Counter(
            "llmopt_gc_collections",
            "Python garbage collections since the server was ready, by process and generation.",
            gc_labels,
            registry=r,
        )
        self.gc_pause = Counter(
            "llmopt_gc_pause_seconds",
            "Seconds the process stood still in garbage collections, by process and generation.",
            gc_labels,
            registry=r,
        )
        self.gc_longest = Gauge(
            "llmopt_gc_longest_pause_seconds",
            "The longest single garbage-collection pause since the server was ready.",
            ["process"],
            registry=r,
        )
        self.gc_frozen = Gauge(
            "llmopt_gc_frozen_objects",
            "Objects frozen once the process was warm (out of every collection's way).",
            ["process"],
            registry=r,
        )
        self._engine_gc: Any = None  # the engine process's last `collector.GCPauses`
        self._engine_seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()

    def publish(self, st: EngineStats) -> None:
        """Set the scheduler gauges from a `SchedulerStats` (after every engine step)."""
        self.waiting.set(st.waiting)
        self.running.set(st.running)
        self.preempted.set(st.preempted)
        self.kv_free.set(st.free_blocks)
        self.kv_usage.set(st.kv_usage)
        self.swapped.set(st.swapped)
        self.swap_used.set(st.swap_used_bytes)
        self.kv_leaked.set(getattr(st, "leaked_blocks", 0))
        queries, hits = int(st.prefix_cache_queries), int(st.prefix_cache_hits)
        for name, counter, value in (
            ("prefix_queries", self.prefix_queries, queries),
            ("prefix_hits", self.prefix_hits, hits),
        ):  # cumulative in the engine: the counters advance by the difference
            counter.inc(max(0, value - self._engine_seen.get(name, 0)))
            self._engine_seen[name] = value
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        if st.engine_time is not None:  # cumulative: the counters advance by the difference
            for f, counter in self.engine_time.items():
                value = float(getattr(st.engine_time, f))
                counter.inc(max(0.0, value - self._engine_seen.get(f, 0.0)))
                self._engine_seen[f] = value
        if getattr(st, "gc", None) is not None and st.gc != self._engine_gc:  # (rarely moves)
            self._engine_gc = st.gc
            self._publish_gc("engine", st.gc)

    def _publish_gc(self, process: str, p: Any) -> None:
        """Advance the GC counters of `process` to `p` (a cumulative `collector.GCPauses`)."""
        with self._lock:  # (the engine thread and a /metrics request may both publish)
            for gen in range(3):
                for what, counter, value in (
                    ("n", self.gc_collections, float(p.collections[gen])),
                    ("s", self.gc_pause, float(p.seconds[gen])),
                ):
                    key = f"gc/{process}/{what}/{gen}"
                    counter.labels(process, str(gen)).inc(
                        max(0.0, value - self._engine_seen.get(key, 0.0))
                    )
                    self._engine_seen[key] = value
            self.gc_longest.labels(process).set(p.longest_s)
            self.gc_frozen.labels(process).set(p.frozen)

    def count_generated(self, n: int) -> None:
        """Called by the engine thread after each step with the tokens it produced."""
        self.generation_tokens.inc(n)
        t = time.monotonic()
        with self._lock:
            self._recent.append((t, n))
            while self._recent and self._recent[0][0] < t - 5.0:
                self._recent.popleft()
            span = max(t - self._recent[0][0], 1.0) if self._recent else 1.0
            self.tokens_per_s.set(sum(k for _, k in self._recent) / span)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        if self._engine_gc is None or self._engine_gc.pid != os.getpid():  # engine elsewhere
            self._publish_gc("server", collector.pauses())
        return generate_latest(self.registry)
