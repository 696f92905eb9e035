"""Served throughput against the engine's own in-process rate (issue 6's H200 target).

    python benchmarks/serve_load.py --shape llama-3.1-8b --device cuda --tokenizer smollm2-135m
    python benchmarks/serve_load.py --model smollm2-135m --device cpu --concurrency 8 \
        --input-len 128 --output-len 64 --requests 32          # a small run on the CPU

Three steps, each its own process, on the same model folder and engine settings:

1. **in-process**: the native generator alone (no HTTP, no scheduler), `concurrency` sequences of
   `input-len`-token prompts decoded together for `output-len` tokens: its decode tokens/s is
   the rate the engine can give at that batch.
2. **server**: `llmopt serve` started with the same batch size, shapes and precision, warmed up
   (every decode shape compiled before the first request).
3. **load**: `llmopt bench serve` at `concurrency` streams (closed loop, `--ignore-eos`, prompts
   of exactly `input-len` tokens from a JSONL file), `--repeats` runs. Output tokens/s over the
   in-process rate is the share the serving layer keeps; TTFT p99 is read from the same runs.

`--shape` writes a seeded random-weight folder first (benchmarks/random_model.py). Results go to
`--out` (JSON) and a short table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def exact_prompts(folder: Path, n: int, tokens: int, seed: int = 0) -> list[str]:
    """`n` different Wikipedia passages that the model's tokenizer encodes to exactly `tokens`.

    Natural text survives a decode/encode round trip almost unchanged (random token ids do not),
    so a window of the built-in held-out text is cut and trimmed until it encodes to `tokens`.
    """
    from transformers import AutoTokenizer

    from llmopt.assets.text import evaluation_text

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(evaluation_text(), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(50 * n):
        if len(out) == n:
            break
        start = rng.randrange(0, len(ids) - 2 * tokens)
        k = tokens
        for _ in range(6):  # specials and merges across the cut move the count by a few tokens
            text = tok.decode(ids[start : start + k], skip_special_tokens=True)
            got = len(tok(text, add_special_tokens=True)["input_ids"])
            if got == tokens:
                out.append(text)
                break
            k += tokens - got
    if len(out) < n:
        raise RuntimeError(f"could not cut {n} prompts of exactly {tokens} tokens")
    return out


def in_process(args, folder: Path) -> dict:
    """The bare generator at batch `concurrency` (run in a child process): the prefill rate of
    a burst of `concurrency` prompts, eager and compiled (`compile_prefill`), the decode
    tokens/s, and a profile of one eager prefill forward (the top kernels by device time)."""
    import torch

    from llmopt.engines.native import SamplingParams, load_generator

    gen = load_generator(
        folder,
        recipe=args.recipe,
        device=args.device,
        max_batch=args.concurrency,
        max_seq_len=args.max_seq_len,
        batch_sizes=[args.concurrency],
    )
    tok = gen.tokenizer
    prompts = [tok(p)["input_ids"] for p in exact_prompts(folder, args.concurrency, args.input_len)]
    print(f"in-process: loaded; warming up {gen.batch_sizes}", file=sys.stderr, flush=True)
    warm = gen.warmup()
    print(f"in-process: warm-up {warm:.0f} s", file=sys.stderr, flush=True)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if gen.device.type == "cuda" else (lambda: None)

    def clear() -> None:
        for k in list(gen.running):
            gen.remove(k)

    def burst() -> float:
        """Prefill every prompt (and sample its first token) in one step(); seconds."""
        for i, p in enumerate(prompts):
            gen.add(i, p, params)
        sync()
        t = time.perf_counter()
        gen.step()
        sync()
        return time.perf_counter() - t

    burst_tokens = sum(map(len, prompts))
    eager_s = burst()
    t1, steps, tokens = time.perf_counter(), 0, 0
    while gen.running and not all(gen.finished(i) for i in gen.running):
        tokens += len(gen.step())
        steps += 1
    sync()
    secs = time.perf_counter() - t1
    out = {
        "decode_tokens_per_s": tokens / secs,
        "decode_steps": steps,
        "ms_per_step": 1000 * secs / steps,
        "warmup_s": warm,
        "burst_prompt_tokens": burst_tokens,
        "max_prefill_tokens": gen.max_prefill_tokens,
        "prefill_eager_s": eager_s,
        "prefill_eager_tokens_per_s": burst_tokens / eager_s,
    }
    clear()
    print(
        f"in-process: burst of {burst_tokens} prompt tokens prefilled in {eager_s:.3f} s eager; "
        f"decode {out['ms_per_step']:.2f} ms/step",
        file=sys.stderr,
        flush=True,
    )
    try:
        profile_and_compile(args, gen, prompts, params, burst, sync, clear, out)
    except Exception as e:  # record it: the decode rate above is still worth reporting
        print(f"in-process: prefill profile/compile failed: {e!r}", file=sys.stderr, flush=True)
        out["prefill_compiled_error"] = repr(e)
    return out


def profile_and_compile(args, gen, prompts, params, burst, sync, clear, out: dict) -> None:
    if args.profile_prefill:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if gen.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        n = max(1, gen.max_prefill_tokens // args.input_len)  # one full forward
        with profile(activities=acts) as prof:
            for i, p in enumerate(prompts[:n]):
                gen.add(i, p, params)
            gen.step()
            sync()
        clear()
        key = "self_cuda_time_total" if gen.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=20)
        print(table, file=sys.stderr, flush=True)
        out["prefill_profile"] = table
    gen.enable_compiled_prefill()
    out["prefill_compile_s"] = gen.warmup_prefill()
    burst()  # once more: any shape-specific compile or autotuning happens outside the timing
    clear()
    out["prefill_compiled_s"] = burst()
    out["prefill_compiled_tokens_per_s"] = out["burst_prompt_tokens"] / out["prefill_compiled_s"]
    # The same requests with no server, composed from the parts measured above: one wave of
    # `concurrency` prompts prefilled (compiled) and then decoded together. The decode-only rate
    # leaves the prompts out, so for long prompts no server can keep a high share of it.
    wave_s = out["prefill_compiled_s"] + out["ms_per_step"] / 1e3 * out["decode_steps"]
    out["end_to_end_tokens_per_s"] = len(prompts) * (out["decode_steps"] + 1) / wave_s
    print(
        f"in-process: compiled prefill {out['prefill_compiled_s']:.3f} s (compile "
        f"{out['prefill_compile_s']:.0f} s)",
        file=sys.stderr,
        flush=True,
    )


def served_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def engine_counters(url: str) -> dict[str, float]:
    """The server's `llmopt_engine_*` counters (Generator.time, cumulative) from /metrics, and
    the seconds its processes stood in garbage collections (`llmopt_engine_gc_<process>_total`,
    summed over generations)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("llmopt_engine_"):
                out[s.name] = s.value
            elif s.name == "llmopt_gc_pause_seconds_total":
                key = f"llmopt_engine_gc_{s.labels['process']}_seconds_total"
                out[key] = out.get(key, 0.0) + s.value
    return out


def attribute(before: dict, after: dict, wall_s: float) -> dict[str, float]:
    """Split the runs' wall time: prefill and decode forwards (device time plus launches), the
    rest of the engine steps (inputs, sampling), and outside the steps (scheduling, the wait
    for requests, streaming when it holds the GIL); beside them, the seconds garbage
    collections stopped the engine's process (and the HTTP server's, where separate)."""
    d = {
        k.removeprefix("llmopt_engine_").removesuffix("_total"): after[k] - before.get(k, 0.0)
        for k in after
    }
    pre, dec, step = d["prefill_seconds"], d["decode_seconds"], d["step_seconds"]
    return {
        "wall_s": wall_s,
        "prefill_s": pre,
        "decode_s": dec,
        "step_other_s": step - pre - dec,
        "outside_steps_s": wall_s - step,
        "prefill_tokens": d["prefill_tokens"],
        "prefill_forwards": d["prefill_forwards"],
        "prefill_tokens_per_s": d["prefill_tokens"] / pre if pre else float("nan"),
        "decode_steps": d["decode_steps"],
        "decode_ms_per_step": 1000 * dec / d["decode_steps"] if d["decode_steps"] else float("nan"),
        "gc_engine_s": d.get("gc_engine_seconds", 0.0),
        "gc_server_s": d.get("gc_server_seconds", 0.0),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="folder or built-in name")
    ap.add_argument(
        "--shape", help="write a random-weight folder of this shape (benchmarks/shapes.py)"
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llmopt-serve-load"))
    ap.add_argument(
        "--tokenizer", default="smollm2-135m", help="--shape: tokenizer folder or built-in"
    )
    ap.add_argument("--vocab", type=int, default=0, help="--shape: vocabulary size override")
    ap.add_argument("--recipe", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--server-timeout", type=float, default=600)
    ap.add_argument(
        "--server-args",
        default="",
        help="more `llmopt serve` flags, e.g. '--no-enable-chunked-prefill'",
    )
    ap.add_argument("--out", type=Path, default=Path("serve_load.json"))
    ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-process-rate", type=float, help="skip step 1: use this tokens/s")
    ap.add_argument(
        "--profile-prefill",
        action="store_true",
        help="step 1: print the top kernels of one eager prefill forward",
    )
    args = ap.parse_args()
    import torch

    # As the CLI does, before torch's thread pool starts (docs/verify.md: SmolLM2's fp32 forward
    # on the CPU makes denormals, 10x slower without this).
    torch.set_flush_denormal(True)
    if args.shape:
        from random_model import write_random_model

        folder = write_random_model(
            args.shape, args.workdir / args.shape, args.tokenizer, vocab=args.vocab
        )
    else:
        from llmopt.assets.models import resolve_model

        folder = Path(resolve_model(args.model)[0])
    if args.in_process:
        print("RESULT " + json.dumps(in_process(args, folder)), flush=True)
        return

    argv = [a for a in sys.argv[1:] if a != "--in-process"]
    t0 = time.perf_counter()
    if args.in_process_rate:
        inproc = {
            "decode_tokens_per_s": args.in_process_rate,
            "ms_per_step": float("nan"),
            "given": True,
        }
    else:
        inproc = None
    p = (
        None
        if inproc
        else subprocess.run(
            [sys.executable, __file__, *argv, "--in-process"], stdout=subprocess.PIPE, text=True
        )
    )
    if p is not None:
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"in-process run failed ({p.returncode}); see stderr")
        inproc = json.loads(line[7:])
    print(
        f"in-process: {inproc['decode_tokens_per_s']:.1f} tokens/s at batch {args.concurrency} "
        f"({inproc['ms_per_step']:.2f} ms/step; {time.perf_counter() - t0:.0f} s)",
        flush=True,
    )

    args.workdir.mkdir(parents=True, exist_ok=True)
    prompts = args.workdir / "prompts.jsonl"
    with prompts.open("w") as f:
        for text in exact_prompts(folder, args.requests, args.input_len, seed=1):
            f.write(json.dumps({"prompt": text, "max_tokens": args.output_len}) + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cli = [sys.executable, "-m", "llmopt.cli.main"]
    server = subprocess.Popen(
        [
            *cli,
            "serve",
            str(folder),
            "--recipe",
            args.recipe,
            "--device",
            args.device,
            "--port",
            str(port),
            "--max-num-seqs",
            str(args.concurrency),
            "--decode-batch-sizes",
            str(args.concurrency),
            "--warmup-tokens",
            str(args.max_seq_len),
            "--max-seq-len",
            str(args.max_seq_len),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--max-queue",
            str(args.requests),
            "--block-size",
            "16",
            "--num-blocks",
            str(args.concurrency * -(-args.max_seq_len // 16) + 1),
            "--log-level",
            "warning",
            *shlex.split(args.server_args),
        ],
        start_new_session=True,
    )
    try:
        ready = wait_healthy(url, server, args.server_timeout)
        print(f"server healthy after {ready:.0f} s (load + warm-up)", flush=True)
        bench_dir = args.workdir / "bench"
        # One untimed request first (what `bench serve` does before each run by default), then
        # none inside the runs: the engine counters then cover the timed requests alone.
        warm = json.dumps({"model": served_name(url), "prompt": "Hello", "max_tokens": 8}).encode()
        req = urllib.request.Request(
            url + "/v1/completions", warm, {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(req, timeout=300).read()
        before = engine_counters(url)
        subprocess.run(
            [
                *cli,
                "bench",
                "serve",
                "--url",
                url,
                "--mode",
                "concurrency",
                "--values",
                str(args.concurrency),
                "--num-requests",
                str(args.requests),
                "--prompts",
                str(prompts),
                "--ignore-eos",
                "--repeats",
                str(args.repeats),
                "--timeout",
                "600",
                "--warmups",
                "0",
                "--label",
                f"llmopt serve {args.recipe}",
                "--out",
                str(bench_dir),
            ],
            check=True,
        )
        after = engine_counters(url)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    bench = json.loads((bench_dir / "bench.json").read_text())
    runs = bench["points"][0]["runs"]
    rows = []
    for i, r in enumerate(runs):
        m = r["metrics"]
        rows.append(
            {
                "run": i + 1,
                "output_tokens_per_s": m["output_throughput"],
                "share_of_in_process": m["output_throughput"] / inproc["decode_tokens_per_s"],
                "share_of_in_process_end_to_end": m["output_throughput"]
                / inproc.get("end_to_end_tokens_per_s", float("nan")),
                "ttft_p99_ms": m["ttft_ms"]["p99"],
                "ttft_median_ms": m["ttft_ms"]["median"],
                "tpot_median_ms": m["tpot_ms"]["median"],
                "completed": m["completed"],
                "failed": m.get("failed"),
                "mean_input_tokens": m["total_input_tokens"] / max(1, m["completed"]),
            }
        )
    engine = attribute(before, after, sum(r["metrics"]["duration_s"] for r in runs))
    import torch

    env_info = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "argv": sys.argv,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    args.out.write_text(
        json.dumps(
            {"env": env_info, "in_process": inproc, "runs": rows, "engine": engine, "bench": bench},
            indent=1,
        )
    )
    print(
        f"\nin-process decode at batch {args.concurrency}: {inproc['decode_tokens_per_s']:.1f} tokens/s"
        f"; end to end (compiled prefill of the wave, then its decode): "
        f"{inproc.get('end_to_end_tokens_per_s', float('nan')):.1f} tokens/s"
    )
    print(
        "| run | served output tok/s | share of in-process decode | share of in-process end to end | TTFT p99 ms | TTFT median ms | TPOT median ms | completed | mean prompt tokens |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['run']} | {r['output_tokens_per_s']:.1f} | {r['share_of_in_process']:.0%} | "
            f"{r['share_of_in_process_end_to_end']:.0%} | "
            f"{r['ttft_p99_ms']:.0f} | {r['ttft_median_ms']:.0f} | {r['tpot_median_ms']:.1f} | "
            f"{r['completed']} | {r['mean_input_tokens']:.0f} |"
        )
    print("\nwhere the served runs' wall time went (the server's llmopt_engine_* counters):")
    for k, v in engine.items():
        print(f"  {k}: {v:.4g}")


if __name__ == "__main__":
    main()
