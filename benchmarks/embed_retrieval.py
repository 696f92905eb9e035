"""Retrieval quality of int8 embedder candidates against the fp32 reference: threshold
decisions before and after recalibration, and FAISS neighbours (docs/benchmarks.md).

    python benchmarks/embed_retrieval.py                       # minilm-l6, thresholds 0.5 0.7
    python benchmarks/embed_retrieval.py --thresholds 0.6 --sentences 2000 --json out.json

The reference is the hf engine in fp32; the candidates are the int8 builds llmopt searches for
embedders (ONNX Runtime dynamic int8, OpenVINO NNCF static int8), built into a temporary folder.
Every model embeds the same held-out Wikipedia sentences once; the numbers then come from the
functions `llmopt verify` uses: `threshold_metrics` over neighbouring and random sentence pairs
(`sentence_pairs`), and `index_metrics` with each sentence querying the others. These are quality
figures: they do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from llmopt.assets.text import evaluation_sentences
from llmopt.core.recipes import get_recipe
from llmopt.engines import get_engine, load_runner
from llmopt.model.info import inspect_model
from llmopt.verify.index import index_metrics
from llmopt.verify.retrieval import sentence_pairs
from llmopt.verify.threshold import threshold_metrics

CANDIDATES = (("onnxruntime", "w8a8-dynamic"), ("openvino", "w8a8-static"))


def _cos(emb: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    u = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    return (u[pairs[:, 0]] * u[pairs[:, 1]]).sum(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="minilm-l6")
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7])
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    info = inspect_model(args.model)
    sentences = evaluation_sentences(args.sentences)
    pairs = sentence_pairs(len(sentences))
    settings = {"threads": args.threads}
    ref = load_runner("hf", info.path, info, "fp32", settings).embed(sentences)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine_name, recipe in CANDIDATES:
            engine = get_engine(engine_name)
            if (why := engine.missing()) is not None:
                print(f"{engine_name}: skipped ({why})")
                continue
            out = Path(tmp) / f"{engine_name}-{recipe}"
            out.mkdir()
            engine.build(Path(info.path), info, get_recipe(recipe), out)
            cand = load_runner(engine_name, out, info, recipe, settings).embed(sentences)
            row = {"candidate": f"{engine_name}-{recipe}", "thresholds": {}}
            for t in args.thresholds:
                ms, _ = threshold_metrics(
                    _cos(ref, pairs), _cos(cand, pairs), t, min_agreement=0.95
                )
                row["thresholds"][str(t)] = {m.name: m.to_dict() for m in ms}
            ms, notes = index_metrics(ref, None, cand, None, args.k, min_recall=0.8)
            row["index"] = {m.name: m.to_dict() for m in ms}
            row["index_notes"] = notes
            rows.append(row)
            for t, ms in row["thresholds"].items():
                d, a, th = (
                    ms["decision_agreement"],
                    ms["recalibrated_agreement"],
                    ms["recalibrated_threshold"],
                )
                print(
                    f"{row['candidate']:28s} t={t}: agreement {d['candidate']:.4f} as is "
                    f"[{1 + d['ci_low']:.4f}, {1 + d['ci_high']:.4f}] -> "
                    f"{a['candidate']:.4f} at {th['candidate']:.4f} (out of sample)"
                )
            for name, m in row["index"].items():
                print(f"{row['candidate']:28s} {name}: {m['candidate']:.4f}")
    doc = {
        "model": args.model,
        "sentences": len(sentences),
        "pairs": len(pairs),
        "k": args.k,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
