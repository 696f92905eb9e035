"""The serving process's heap (`serve.collector`): frozen once warm, its collections counted
per generation, and both exported in /metrics per process. (The root conftest unfreezes after
every test.)"""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

from llmopt.serve import collector
from llmopt.serve.metrics import ServeMetrics


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_watch_counts_collections_per_generation():
    collector.watch()
    collector.watch()  # once per process: a second call adds no second callback
    assert gc.callbacks.count(collector._callback) == 1
    before = collector.pauses()
    gc.collect(0)
    gc.collect(2)
    gc.collect(2)
    after = collector.pauses()
    assert after.pid == os.getpid()
    assert after.collections[0] >= before.collections[0] + 1
    assert after.collections[2] >= before.collections[2] + 2
    assert after.seconds[2] > before.seconds[2]
    assert 0 < after.longest_s <= after.seconds[0] + after.seconds[1] + after.seconds[2]


def test_freeze_takes_live_objects_out_of_collections():
    """After `freeze`, what was alive is in the permanent generation (no collection walks it),
    a full collection walks less, garbage made before it was collected first, and its own
    collections are not counted as serving's pauses."""
    collector.watch()
    live = [_Cycle() for _ in range(20000)]  # alive across the freeze: frozen
    garbage = _Cycle()  # unreachable before the freeze: collected, not frozen
    del garbage
    before = collector.pauses()
    report = collector.freeze("test")
    assert report.frozen == gc.get_freeze_count() >= len(live)
    assert collector.pauses().collections == before.collections  # freeze's own: not counted
    assert report.full_collection_after_s < report.full_collection_before_s
    assert collector.pauses().frozen == report.frozen
    # a collection after the freeze no longer walks `live`: it collects new garbage only
    new = _Cycle()
    del new
    assert gc.collect() >= 1
    assert gc.get_freeze_count() == report.frozen


def test_metrics_export_each_process_pauses():
    """The engine's pauses come with its stats (`llmopt_gc_*{process="engine"}`, advanced by
    differences of the cumulative figures); where the engine runs in another process the
    server's own are exported beside them at render time (`process="server"`)."""

    def stats(pid, n2, s2):
        p = collector.GCPauses(pid, (10, 2, n2), (0.01, 0.002, s2), 0.25, 1234)
        return SimpleNamespace(
            waiting=0,
            running=0,
            preempted=0,
            free_blocks=1,
            kv_usage=0.0,
            swapped=0,
            swap_used_bytes=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            engine_time=None,
            gc=p,
        )

    def value(text, name, **labels):
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError((name, labels))

    m = ServeMetrics()
    m.publish(stats(os.getpid() + 1, 1, 0.25))  # an engine in another process
    m.publish(stats(os.getpid() + 1, 3, 0.5))  # cumulative: the counter is 3, not 4
    collector.watch()
    gc.collect(0)
    text = m.render().decode()
    assert value(text, "llmopt_gc_collections_total", process="engine", generation="2") == 3
    assert value(text, "llmopt_gc_pause_seconds_total", process="engine", generation="2") == 0.5
    assert value(text, "llmopt_gc_longest_pause_seconds", process="engine") == 0.25
    assert value(text, "llmopt_gc_frozen_objects", process="engine") == 1234
    assert value(text, "llmopt_gc_collections_total", process="server", generation="0") >= 1
    # an engine in this process: its figures are the server's, exported once, as "engine"
    m2 = ServeMetrics()
    m2.publish(stats(os.getpid(), 1, 0.1))
    assert 'process="server"' not in m2.render().decode()
