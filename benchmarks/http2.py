"""HTTP/1.1 against HTTP/2 for `llmopt serve`: TTFT and request latency at several concurrencies.

    python benchmarks/http2.py --model smollm2-135m --concurrency 1,8,32 --requests 64 --rounds 5
    python benchmarks/http2.py --model TINY_FOLDER --concurrency 1,4 --requests 8 --rounds 2  # check

Starts two `llmopt serve MODEL` processes on loopback ports, on the same model and settings:
one under uvicorn (HTTP/1.1 only, the default server) and one with `--http2` (hypercorn, which
speaks both). Then, `--rounds` times, for every concurrency level, runs the same closed-loop
load (`llmopt.bench.loadgen.run_load`: the same seeded prompts, `--output-len` tokens each with
`ignore_eos`) once per arm, the arms interleaved and their order reversed every other round
(A B C, C B A, ...) so that drift on the machine falls on every arm alike:

- `uvicorn-h1`: the uvicorn server, an HTTP/1.1 client with a keep-alive connection per request
  in flight (what `llmopt serve` and `llmopt bench serve` do by default);
- `hypercorn-h1`: the `--http2` server, the same HTTP/1.1 client (the server alone changes);
- `hypercorn-h2`: the `--http2` server, an HTTP/2 client multiplexing every request in flight
  on ONE connection (`llmopt bench serve --http2`; h2c by prior knowledge, or ALPN h2 with
  `--tls`, which serves both servers over TLS with a self-signed certificate made here).

Per arm and level it reports TTFT (time to the first streamed token, which is the first byte of
the answer's body that matters to a client) and end-to-end request latency, p50 and p95, as the
median over rounds with the [min-max] spread across rounds, and the HTTP/2 arm's ratio to each
HTTP/1.1 arm. JSON (every run) goes to `--out`, a table to stdout. `--arms` picks a subset.
The figures belong in docs/benchmarks.md, measured on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmopt.deploy.validate import self_signed_cert

ARMS = {
    # arm: (server, client speaks HTTP/2)
    "uvicorn-h1": ("uvicorn", False),
    "hypercorn-h1": ("hypercorn", False),
    "hypercorn-h2": ("hypercorn", True),
}
METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p95"), ("e2el_ms", "p50"), ("e2el_ms", "p95"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 and localhost and its key (PEM), for `--tls`."""
    made = self_signed_cert(folder, "cert.pem", "key.pem")
    if made is None:
        raise SystemExit("--tls needs cryptography (pip install cryptography) or openssl")
    return made


class Server:
    """One `llmopt serve` process (killed by `stop`)."""

    def __init__(self, kind: str, args: argparse.Namespace, tls: tuple[Path, Path] | None, log):
        self.kind = kind
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "llmopt.cli.main", "serve", args.model]
        cmd += ["--port", str(self.port), "--device", args.device, "--log-level", "warning"]
        cmd += ["--max-num-seqs", str(args.max_num_seqs or max(args.levels))]
        cmd += ["--max-queue", str(max(64, 2 * max(args.levels)))]
        if args.recipe:
            cmd += ["--recipe", args.recipe]
        if args.max_seq_len:
            cmd += ["--max-seq-len", str(args.max_seq_len)]
        if kind == "hypercorn":
            cmd.append("--http2")
        if tls:
            cmd += ["--ssl-certfile", str(tls[0]), "--ssl-keyfile", str(tls[1])]
        cmd += args.serve_arg
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.kind} server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.kind} server not healthy in {timeout:g} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def one_run(url: str, level: int, args: argparse.Namespace, http2: bool) -> dict:
    from llmopt.bench.loadgen import LoadSpec, Workload, run_load

    spec = LoadSpec("concurrency", level, num_requests=max(args.requests, level), seed=args.seed)
    work = Workload(args.input_len, args.output_len, ignore_eos=True, endpoint=args.endpoint)
    r = run_load(url, spec, work, timeout_s=args.timeout, warmups=1, http2=http2)
    m = r["metrics"]
    out = {f"{k}.{p}": m[k][p] for k, p in METRICS if m.get(k) and p in m[k]}
    return out | {
        "completed": m["completed"],
        "failed": m["failed"],
        "http_version": r["http_version"],
        "errors": r["errors"][:3],
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict], arms: list[str], levels: list[int]) -> dict:
    out: dict = {}
    for level in levels:
        for arm in arms:
            rs = [r for r in runs if r["arm"] == arm and r["level"] == level]
            keys = [f"{k}.{p}" for k, p in METRICS]
            out[f"{arm}@{level}"] = {
                k: spread([r[k] for r in rs]) for k in keys if all(k in r for r in rs) and rs
            } | {"failed": sum(r["failed"] for r in rs), "http_version": rs[0]["http_version"]}
    return out


def table(summary: dict, arms: list[str], levels: list[int]) -> str:
    head = f"{'level':>5} {'arm':<13} {'proto':<8}" + "".join(
        f" {k + '.' + p:>24}" for k, p in METRICS
    )
    lines = [head, "-" * len(head)]
    for level in levels:
        for arm in arms:
            s = summary[f"{arm}@{level}"]
            cells = []
            for k, p in METRICS:
                st = s.get(f"{k}.{p}")
                cells.append(
                    f" {st['median']:>9.1f} [{st['min']:>5.1f}-{st['max']:>6.1f}]" if st else " -"
                )
            fail = f"  ({s['failed']} failed)" if s["failed"] else ""
            lines.append(
                f"{level:>5} {arm:<13} {s['http_version'] or '-':<8}{''.join(cells)}{fail}"
            )
        if "hypercorn-h2" in arms:
            h2 = summary[f"hypercorn-h2@{level}"]
            for base in (a for a in arms if a != "hypercorn-h2"):
                b = summary[f"{base}@{level}"]
                ratios = []
                for k, p in METRICS:
                    key = f"{k}.{p}"
                    ok = key in h2 and key in b and b[key]["median"] > 0
                    ratios.append(f" {h2[key]['median'] / b[key]['median']:>24.2f}" if ok else " -")
                lines.append(f"{'':>5} {'h2 / ' + base:<22}{''.join(ratios)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="folder or built-in name")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipe", default=None)
    ap.add_argument("--concurrency", default="1,8,32", help="levels, e.g. 1,8,32")
    ap.add_argument("--requests", type=int, default=32, help="per run (at least the level)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--endpoint", default="completions", help="completions or chat")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {', '.join(ARMS)}")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the top level")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--tls", action="store_true", help="both servers over TLS (self-signed)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, s")
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `llmopt serve` args")
    ap.add_argument("--out", type=Path, default=Path("http2_bench.json"))
    args = ap.parse_args()
    args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := set(arms) - set(ARMS):
        raise SystemExit(f"--arms: unknown {sorted(unknown)}; use {', '.join(ARMS)}")

    work = Path(tempfile.mkdtemp(prefix="llmopt-http2-"))
    tls = self_signed(work) if args.tls else None
    if tls:  # the load generator's client (httpx) trusts the certificate through this variable
        os.environ["SSL_CERT_FILE"] = str(tls[0])
    kinds = sorted({ARMS[a][0] for a in arms})
    servers: dict[str, Server] = {}
    try:
        for kind in kinds:  # one at a time: two model loads at once would slow both
            s = Server(kind, args, tls, (work / f"{kind}.log").open("wb"))
            servers[kind] = s
            s.wait_healthy(args.server_timeout)
            print(f"{kind} server on {s.url} (log {work / f'{kind}.log'})", file=sys.stderr)
        runs = []
        for rnd in range(args.rounds):
            order = arms if rnd % 2 == 0 else arms[::-1]
            for level in args.levels:
                for arm in order:
                    kind, http2 = ARMS[arm]
                    r = one_run(servers[kind].url, level, args, http2)
                    runs.append({"round": rnd, "level": level, "arm": arm} | r)
                    print(
                        f"round {rnd} c={level} {arm}: {r['http_version']}, TTFT p50 "
                        f"{r.get('ttft_ms.p50', float('nan')):.1f} ms, failed {r['failed']}",
                        file=sys.stderr,
                    )
    finally:
        for s in servers.values():
            s.stop()
    summary = summarize(runs, arms, args.levels)
    doc = {
        "what": "TTFT and E2E latency (ms), HTTP/1.1 vs HTTP/2, llmopt serve",
        "args": {k: v for k, v in vars(args).items() if k != "serve_arg"}
        | {"serve_arg": args.serve_arg},
        "arms": {a: {"server": ARMS[a][0], "client_http2": ARMS[a][1]} for a in arms},
        "summary": summary,
        "runs": runs,
    }
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(args.out)
    print(f"median [min-max] over {args.rounds} rounds, ms; {args.out}")
    print(table(summary, arms, args.levels))


if __name__ == "__main__":
    main()
