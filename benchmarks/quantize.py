"""Wall time, peak memory and perplexity of every quantization recipe (issue 3).

    python benchmarks/quantize.py                                  # smollm2-135m on the CPU
    python benchmarks/quantize.py --recipes w8a16,fp8-dynamic --samples 16 --seq-len 256
    python benchmarks/quantize.py --shape llama-3.1-8b --device cuda --recipes w4a16-gptq,fp8-dynamic

Each recipe runs in its own process (`--worker`), so the peak memory it reports is its own:
`torch.cuda.max_memory_allocated` on a GPU, VmHWM (peak RSS) on the CPU. The worker times the
sequential calibration exactly as `llmopt.quant.quantize` runs it (`fake_quantized_model`: load,
checks, calibration windows, layer by layer), then scores the fake-quantized model (dequantized
weights, activation / KV fake-quant hooks: what the deployed kernels compute, evaluated by torch on
the CPU) on held-out Wikipedia windows; `fp32` is the reference. Writing the compressed folder is
not included (seconds; see `llmopt quantize --json`).

`--shape llama-3.1-8b` builds a Llama-3.1-8B-shaped model from its config with seeded random
bf16 weights (std 0.02, never zero) and random calibration tokens, and times calibration only
(perplexity of random weights means nothing). Use it on the H200; `--layers N` cuts the depth.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as `python benchmarks/quantize.py`
from shapes import SHAPES  # noqa: E402

RECIPES = [
    "fp32",
    "w8a16",
    "w8a8-int8",
    "fp8-dynamic",
    "fp8-static",
    "kv-fp8",
    "w4a16-rtn-g64",
    "w4a16-awq-g64",
    "w4a16-gptq-g64",
]


def _peak(device: str) -> int:
    import torch

    from llmopt.hardware.runtime import peak_rss_bytes

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return peak_rss_bytes()


def worker_model(args) -> dict:
    import torch

    from llmopt.assets import resolve_model
    from llmopt.assets.text import token_windows
    from llmopt.core.recipes import get_recipe
    from llmopt.quant import CalibrationConfig, fake_quantized_model
    from llmopt.quant.api import held_out_nll

    torch.manual_seed(0)
    source, _ = resolve_model(args.model)
    cal = CalibrationConfig(None, args.samples, args.seq_len, args.seed)
    t0 = time.perf_counter()
    if args.worker == "fp32":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        fake = None
    else:
        model, fake = fake_quantized_model(source, args.worker, calibration=cal, device=args.device)
    seconds = time.perf_counter() - t0
    peak = _peak(args.device)
    from transformers import AutoTokenizer

    from llmopt.assets.text import evaluation_text

    tok = AutoTokenizer.from_pretrained(source)
    text = evaluation_text()[: 8 * args.eval_len * args.eval_windows]
    windows = token_windows(tok, text, args.eval_len, args.eval_windows)
    nll = held_out_nll(model, windows, "cpu")
    recipe = get_recipe(args.worker)
    return {
        "recipe": args.worker,
        "algorithm": recipe.algorithm,
        "seconds": seconds,
        "peak_bytes": peak,
        "perplexity": math.exp(nll / (args.eval_len - 1)),
        "quantized_linears": 0 if fake is None else len(fake.linears),
        "min_linear_sqnr_db": None
        if not fake or not fake.linears
        else min(q.sqnr_db for q in fake.linears.values()),
    }


def worker_shape(args) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmopt.core.recipes import get_recipe
    from llmopt.quant.checks import plan_specs
    from llmopt.quant.sequential import run_sequential

    cfg = dict(SHAPES[args.shape])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    config = AutoConfig.for_model(**cfg)
    config._attn_implementation = "sdpa"
    recipe = get_recipe(args.worker).with_changes(dtype="bfloat16")
    torch.manual_seed(args.seed)
    t_build = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():  # seeded N(0, 0.02); norms stay 1
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    build_s = time.perf_counter() - t_build
    g = torch.Generator().manual_seed(args.seed)
    windows = torch.randint(0, cfg["vocab_size"], (args.samples, args.seq_len), generator=g)
    plan = plan_specs(model, recipe)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:  # to stderr, so a timeout shows how far it got
        print(f"layer {done}/{total} at {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    print(f"built in {build_s:.1f} s; calibrating on {args.device}", file=sys.stderr)
    res = run_sequential(model, windows, recipe, plan.specs, device=args.device, progress=progress)
    seconds = time.perf_counter() - t0
    return {
        "recipe": args.worker,
        "shape": args.shape,
        "layers": cfg["num_hidden_layers"],
        "seconds": seconds,
        "seconds_per_layer": seconds / cfg["num_hidden_layers"],
        "build_seconds": build_s,
        "peak_bytes": _peak(args.device),
        "quantized_linears": len(res.linears),
        "median_linear_sqnr_db": sorted(q.sqnr_db for q in res.linears.values())[
            len(res.linears) // 2
        ],
    }


def add_data_args(ap: argparse.ArgumentParser) -> None:
    """Calibration and evaluation settings, shared with benchmarks/reference_llmcompressor.py so
    both score on the same tokens."""
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random-weight model from a config")
    ap.add_argument("--layers", type=int, default=0, help="--shape: fewer decoder layers")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--device", default="cpu")
    add_data_args(ap)
    args = ap.parse_args()

    import torch

    torch.set_flush_denormal(True)  # before the thread pool starts (see docs/verify.md)
    if args.worker:
        out = worker_shape(args) if args.shape else worker_model(args)
        print("RESULT " + json.dumps(out), flush=True)
        return

    recipes = [r for r in args.recipes.split(",") if r]
    if args.shape:
        recipes = [r for r in recipes if r != "fp32"]
    rows = []
    for r in recipes:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", r]
        t0 = time.perf_counter()
        # stderr passes through (progress, warnings); the result is the RESULT line on stdout.
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            row = {"recipe": r, "error": [f"worker exited with {p.returncode}; see stderr"]}
        else:
            row = json.loads(line[7:])
        row["process_seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
    ref = next((x["perplexity"] for x in rows if x["recipe"] == "fp32" and "perplexity" in x), None)
    print()
    print("| recipe | calibration wall s | peak memory GiB | perplexity | vs fp32 |")
    print("| --- | --- | --- | --- | --- |")
    for x in rows:
        if "error" in x:
            print(f"| {x['recipe']} | error: {' '.join(x['error'])[:80]} | | | |")
            continue
        ppl = x.get("perplexity")
        delta = f"{ppl / ref - 1:+.2%}" if ppl and ref else "-"
        ppl_s = f"{ppl:.3f}" if ppl else "-"
        print(
            f"| {x['recipe']} | {x['seconds']:.1f} | {x['peak_bytes'] / 2**30:.2f} | {ppl_s} | {delta} |"
        )
    env = {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "argv": sys.argv,
    }
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
