"""A small embeddings request's latency beside a large one (issue 21's head-of-line blocking).

    python benchmarks/serve_embed_fairness.py --model minilm-l6 --big 4000 --reps 3

Starts `llmopt serve MODEL` as a real process on a loopback port (with `--embed-max-inputs`
raised to take the large request), then, `--reps` times, interleaved:

1. **idle**: `--probes` 1-input requests one after another on the idle server;
2. **one batch**: a request of `--embed-max-batch` inputs (the time of one forward);
3. **busy**: a `--big`-input request, and while it runs, 1-input requests one after another.

It prints each figure's median and range over all probes, and the bound the issue sets: a small
request's latency while the large one runs within 2x its idle latency plus one batch. The server
runs the `llmopt` this interpreter imports: `PYTHONPATH=OTHER/src ... --no-limit-flag` measures
another build (one from before the per-request limit) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="minilm-l6")
    ap.add_argument("--big", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--probes", type=int, default=5)
    ap.add_argument("--embed-max-batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--no-limit-flag",
        action="store_true",
        help="a server build without --embed-max-inputs (before the limit existed)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the samples as JSON")
    a = ap.parse_args()

    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "llmopt.cli.main",
        "serve",
        a.model,
        "--port",
        str(port),
        "--embed-max-batch",
        str(a.embed_max_batch),
        "--log-level",
        "warning",
    ]
    if not a.no_limit_flag:
        cmd += ["--embed-max-inputs", str(max(a.big, 2048))]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    proc = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server not healthy in 300 s")
            time.sleep(0.5)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        client = httpx.Client(base_url=url, timeout=600)

        def embed(inputs: list[str]) -> float:
            t0 = time.perf_counter()
            r = client.post("/v1/embeddings", json={"model": name, "input": inputs})
            r.raise_for_status()
            return time.perf_counter() - t0

        big = [f"passage {i}: the quick brown fox jumps over the lazy dog" for i in range(a.big)]
        small = ["a short query about foxes"]
        batch = [f"batch text {i} about dogs and foxes" for i in range(a.embed_max_batch)]
        embed(small)  # warm
        idle: list[float] = []
        one_batch: list[float] = []
        busy: list[float] = []
        big_s: list[float] = []
        for _ in range(a.reps):
            idle += [embed(small) for _ in range(a.probes)]
            one_batch.append(embed(batch))
            done = threading.Event()

            def run_big(done: threading.Event) -> None:
                with httpx.Client(base_url=url, timeout=600) as c2:
                    t0 = time.perf_counter()
                    r = c2.post("/v1/embeddings", json={"model": name, "input": big})
                    r.raise_for_status()
                    big_s.append(time.perf_counter() - t0)
                done.set()

            t = threading.Thread(target=run_big, args=(done,))
            t.start()
            time.sleep(0.5)  # under way
            while not done.is_set():
                lat = embed(small)
                if not done.is_set():
                    busy.append(lat)
                time.sleep(0.1)
            t.join()

        def describe(xs: list[float]) -> str:
            return (
                f"median {statistics.median(xs) * 1e3:.0f} ms, range {min(xs) * 1e3:.0f}-"
                f"{max(xs) * 1e3:.0f} ms (n={len(xs)})"
            )

        bound = 2 * statistics.median(idle) + statistics.median(one_batch)
        print(f"idle 1-input request:      {describe(idle)}")
        print(f"one batch ({a.embed_max_batch} inputs):     {describe(one_batch)}")
        print(f"{a.big}-input request:       {describe(big_s)}")
        print(f"1-input beside it:         {describe(busy)}")
        print(
            f"bound 2 x idle + one batch: {bound * 1e3:.0f} ms; "
            f"probes within it: {sum(x <= bound for x in busy)}/{len(busy)}"
        )
        if a.out:
            a.out.write_text(
                json.dumps(
                    {"idle": idle, "one_batch": one_batch, "big": big_s, "busy": busy}, indent=1
                )
            )
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
