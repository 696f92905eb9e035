"""The Python heap of a serving process: frozen once the engine is warm, its collections counted.

CPython's cyclic garbage collector stops the whole process while it runs, and a full (generation
2) collection walks every object the collector tracks. After a model load and its compilation that
is hundreds of thousands of objects (torch, transformers, the compiled graphs and their guards):
a full collection then takes tens to hundreds of milliseconds (docs/serving.md has figures), and
every stream waits that long for its next token. Nearly all of those objects live as long as the
process, so once the engine is warm `freeze()` moves them to the permanent generation
(`gc.freeze`, as vLLM does at the end of its warm-up): the collections serving triggers later walk
only what was allocated since, and the objects frozen are never freed by the cyclic collector
(reference counting still frees those not in a cycle).

`watch()` counts the collections of this process and the time each stopped it, per generation
(`pauses()`): the scheduler reports the engine process's with its stats and the server exports
them (`llmopt_gc_*` in /metrics), so a latency spike can be put down to a collection, or not.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from dataclasses import dataclass

__all__ = ["GCPauses", "FreezeReport", "freeze", "pauses", "watch"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_collections = [0, 0, 0]
_seconds = [0.0, 0.0, 0.0]
_longest = [0.0]
_started: list[float | None] = [None]  # when the running collection started (one at a time)
_watching = [False]
_own = [False]  # freeze()'s own collections are not serving's pauses: not counted


@dataclass(frozen=True)
class GCPauses:
    """Collections of one process since `watch()`, and the time they stopped it, by generation
    (index 0-2); `longest_s` is the longest single pause, `frozen` the objects in the permanent
    generation (`freeze`), which no collection walks."""

    pid: int
    collections: tuple[int, int, int] = (0, 0, 0)
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)
    longest_s: float = 0.0
    frozen: int = 0


@dataclass(frozen=True)
class FreezeReport:
    """What `freeze()` did: objects moved to the permanent generation, and how long a full
    collection took before (the one `freeze` runs first) and after."""

    frozen: int
    full_collection_before_s: float
    full_collection_after_s: float
    context: str = ""


def _callback(phase: str, info: dict) -> None:
    # Runs in the thread that triggered the collection, holding the GIL for the whole
    # collection, so collections never overlap; the lock is for `pauses()` readers in other
    # threads, which must see the three lists agree.
    if _own[0]:
        return
    now = time.perf_counter()
    if phase == "start":
        _started[0] = now
        return
    start, _started[0] = _started[0], None
    if start is None:  # watching began mid-collection
        return
    gen, dt = int(info.get("generation", 2)), now - start
    with _lock:
        _collections[gen] += 1
        _seconds[gen] += dt
        _longest[0] = max(_longest[0], dt)


def watch() -> None:
    """Count this process's collections from now on (once per process; later calls do
    nothing)."""
    with _lock:
        if _watching[0]:
            return
        _watching[0] = True
    gc.callbacks.append(_callback)


def pauses() -> GCPauses:
    """This process's collections since `watch()` (all zero if it was not called)."""
    with _lock:
        return GCPauses(
            os.getpid(),
            (_collections[0], _collections[1], _collections[2]),
            (_seconds[0], _seconds[1], _seconds[2]),
            _longest[0],
            gc.get_freeze_count(),
        )


def freeze(context: str) -> FreezeReport:
    """Collect, then move every object still alive to the permanent generation; log and return
    how long a full collection took before and after. Call it once the process is warm (model
    loaded, steps compiled, first generation done): what is frozen then is what lives as long
    as the process. Calling it again freezes what was allocated since. Its own collections are
    not counted by `watch()`."""
    _own[0] = True
    try:
        t0 = time.perf_counter()
        gc.collect()
        before = time.perf_counter() - t0
        gc.freeze()
        t0 = time.perf_counter()
        gc.collect()
        after = time.perf_counter() - t0
    finally:
        _own[0] = False
    report = FreezeReport(gc.get_freeze_count(), before, after, context)
    log.info(
        "%s: froze %d objects (a full garbage collection took %.0f ms, now %.1f ms)",
        context,
        report.frozen,
        1e3 * before,
        1e3 * after,
    )
    return report
