"""How long a full garbage collection stops a warm serving process, heap frozen or not.

    python benchmarks/gc_pause.py                               # smollm2-135m, CPU
    python benchmarks/gc_pause.py --model FOLDER --device cuda  # a served GPU model

Loads the model exactly as `llmopt serve` does (`load_context`: the planned settings, the engine
warmed up, which ends with `collector.freeze`), then alternates `--rounds` times: the heap given
back to the collector (`gc.unfreeze`) and one full collection timed, then frozen again and one
timed (A B A B, same process, same objects). A full collection is what a generation-2 collection
costs once serving's allocations trigger one: the stall every stream pays at its next token.
Prints the objects tracked and each side's median [min-max] ms; `--json` writes them.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import time


def timed_collect() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="built-in name or HF folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from llmopt.serve import load_context
    from llmopt.serve.defaults import resolve_settings

    settings = resolve_settings(args.model, {}, device=args.device, threads=args.threads)
    t0 = time.perf_counter()
    ctx = load_context(args.model, settings)
    load_s = time.perf_counter() - t0
    frozen = gc.get_freeze_count()
    unfrozen_ms, frozen_ms = [], []
    for _ in range(args.rounds):
        gc.unfreeze()
        tracked = len(gc.get_objects())
        unfrozen_ms.append(1e3 * timed_collect())
        gc.freeze()
        frozen_ms.append(1e3 * timed_collect())
    ctx.engine.stop()
    out = {
        "model": args.model,
        "device": args.device,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "load_s": load_s,
        "objects_frozen_at_warm": frozen,
        "objects_tracked_unfrozen": tracked,
        "full_collection_ms_unfrozen": unfrozen_ms,
        "full_collection_ms_frozen": frozen_ms,
    }
    for side, ms in (("unfrozen", unfrozen_ms), ("frozen", frozen_ms)):
        print(
            f"full collection, heap {side:8s}: {statistics.median(ms):8.2f} ms "
            f"[{min(ms):.2f}-{max(ms):.2f}] over {len(ms)} rounds"
        )
    print(f"objects tracked: {tracked} ({frozen} frozen when the engine was warm)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
