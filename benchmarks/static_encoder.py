"""Static-shape compiled embedders against HF eager, side by side (A B A B) in one process.

    python benchmarks/static_encoder.py --shape minilm --tokenizer minilm-l6 --device cuda \
        --dtype bfloat16 --rounds 4 --out /tmp/static_encoder.json

For each round, each runner (HF eager, then the static-shape compiled one: length buckets,
`torch.compile`, CUDA graphs on a GPU; `llmopt.engines.static_encoder`) embeds the same held-out
Wikipedia sentences at batch 1 and at batch 32, in mirrored order (A B, then B A). Reported per
runner and batch size: sentences/s (median and range over rounds), per-batch p95 latency, and the
mean cosine of its embeddings to the float32 eager reference's. Compilation happens in an untimed
warm-up pass over the same sentences, so every bucket the timed passes use is compiled first.

`--shape minilm` is all-MiniLM-L6-v2's shape (BERT, 6 layers, 384 wide, mean pooling);
`--shape qwen3-embedding` a Qwen3-Embedding-0.6B-shaped decoder (28 layers, 1024 wide,
last-token pooling). Weights are seeded random (`--model FOLDER` takes a real embedder instead):
speed does not depend on the values, and the cosine compares the same weights at two precisions
and two execution paths. The tokenizer: a built-in name or a folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "minilm": (
        {
            "model_type": "bert",
            "hidden_size": 384,
            "num_hidden_layers": 6,
            "num_attention_heads": 12,
            "intermediate_size": 1536,
            "max_position_embeddings": 512,
            "vocab_size": 30522,
        },
        "mean",
    ),
    "qwen3-embedding": (
        {
            "model_type": "qwen3",
            "hidden_size": 1024,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 3072,
            "max_position_embeddings": 32768,
            "vocab_size": 151669,
        },
        "lasttoken",
    ),
}


def random_embedder(shape: str, tokenizer: str, out: Path, seed: int = 0) -> Path:
    """A sentence-transformers-style folder: random weights in `shape`, the given tokenizer,
    the pooling the shape's family uses, normalized."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from llmopt.assets.models import resolve_model

    cfg, pooling = SHAPES[shape]
    tok = AutoTokenizer.from_pretrained(resolve_model(tokenizer)[0])
    cfg = dict(cfg) | {"vocab_size": max(cfg["vocab_size"], len(tok))}
    torch.manual_seed(seed)
    model = AutoModel.from_config(AutoConfig.for_model(**cfg))
    model.save_pretrained(out)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.save_pretrained(out)
    (out / "1_Pooling").mkdir(exist_ok=True)
    modes = {
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_cls_token": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
    }
    pool_cfg = {"word_embedding_dimension": cfg["hidden_size"], **modes}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    return out


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import numpy as np
    import torch

    from llmopt.assets.text import evaluation_sentences
    from llmopt.core.recipes import get_recipe
    from llmopt.core.settings import EngineSettings
    from llmopt.engines import load_runner
    from llmopt.model.info import inspect_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="minilm")
    ap.add_argument("--model", help="a real embedder folder instead of random weights")
    ap.add_argument("--tokenizer", default="minilm-l6")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--sentences", type=int, default=512)
    ap.add_argument("--b1-sentences", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    tmp = tempfile.TemporaryDirectory()
    folder = Path(a.model) if a.model else random_embedder(a.shape, a.tokenizer, Path(tmp.name))
    info = inspect_model(folder)
    texts = evaluation_sentences(a.sentences)
    recipe = "bf16" if a.dtype == "bfloat16" else "fp32"
    base = EngineSettings(device=a.device, threads=a.threads or None)
    ref = load_runner("hf", folder, info, get_recipe("fp32"), base)
    want = ref.embed(texts, batch_size=32)
    del ref
    runners = {
        "hf-eager": load_runner("hf", folder, info, get_recipe(recipe), base),
        "static-compiled": load_runner(
            "hf", folder, info, get_recipe(recipe), base.with_changes(compile=True)
        ),
    }
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    facts: dict = {"device": a.device, "dtype": a.dtype, "shape": a.model or a.shape}
    for name, r in runners.items():  # warm-up: every bucket the timed passes use, compiled
        t0 = time.perf_counter()
        got = r.embed(texts, batch_size=32)
        r.embed(texts[: a.b1_sentences], batch_size=1)
        cos = float(np.mean(np.sum(got * want, axis=1)))
        facts[name] = {"warmup_s": round(time.perf_counter() - t0, 1), "cosine_to_fp32": cos}
    rates: dict = {(n, b): [] for n in runners for b in (1, 32)}
    lat: dict = {(n, b): [] for n in runners for b in (1, 32)}
    for rnd in range(a.rounds):
        order = list(runners) if rnd % 2 == 0 else list(reversed(runners))
        for name in order:
            for b in (1, 32):
                subset = texts[: a.b1_sentences] if b == 1 else texts
                per_batch = []
                t0 = time.perf_counter()
                for i in range(0, len(subset), b):
                    t1 = time.perf_counter()
                    runners[name].embed(subset[i : i + b], batch_size=b)
                    sync()
                    per_batch.append(time.perf_counter() - t1)
                rates[(name, b)].append(len(subset) / (time.perf_counter() - t0))
                lat[(name, b)] += per_batch
    for (name, b), v in rates.items():
        p95 = sorted(lat[(name, b)])[int(0.95 * (len(lat[(name, b)]) - 1))]
        facts[name][f"b{b}"] = {
            "sentences_per_s": round(statistics.median(v), 1),
            "range": [round(min(v), 1), round(max(v), 1)],
            "p95_batch_ms": round(p95 * 1e3, 2),
        }
    for b in (1, 32):
        ratios = [
            s / e
            for s, e in zip(rates[("static-compiled", b)], rates[("hf-eager", b)], strict=True)
        ]
        facts[f"speedup_b{b}"] = {
            "median": round(statistics.median(ratios), 2),
            "range": [round(min(ratios), 2), round(max(ratios), 2)],
        }
    text = json.dumps(facts, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
