"""Retrieval (RAG) over the built-in Wikipedia sentences, through a served embedder, checked
against the reference model.

    python examples/rag.py                           # starts `llmopt serve minilm-l6` itself
    python examples/rag.py --run runs/minilm-l6      # serves the run's chosen candidate, and
                                                     # uses its recalibrated threshold
    python examples/rag.py --url http://127.0.0.1:8000 --threshold 0.5

What it does, step by step:

1. Embeds a corpus (held-out Wikipedia sentences) through the OpenAI-compatible endpoint with
   the official `openai` client (`embeddings.create`), in batches.
2. Builds a FAISS index over those vectors (exact inner product on normalized vectors, i.e.
   cosine) in host memory.
3. Answers queries (the second half of some corpus sentences, with the model's query prompt
   prepended) with the top k, and accepts an answer when its similarity reaches the threshold:
   the run's recalibrated one (best/launch.json) when `--run` is given, else `--threshold`.
4. Does the same in process with the reference model (transformers, fp32) at `--threshold`,
   and reports how often the served candidate returns the reference's neighbours (recall@k), the
   same top answer, and the same accept/reject decision; and how often each finds the sentence
   the query was cut from (hit@k).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`llmopt serve MODEL` on a free loopback port; returns (process, base URL) once healthy."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "llmopt.cli.main", "serve", model, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llmopt serve exited: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"llmopt serve not healthy after 300 s: {log}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)


def embed_served(client, model: str, texts: list[str], batch: int = 64) -> np.ndarray:
    """Embeddings of `texts` through the endpoint, in input order (the official client)."""
    out = []
    for i in range(0, len(texts), batch):
        r = client.embeddings.create(model=model, input=texts[i : i + batch])
        out += [d.embedding for d in sorted(r.data, key=lambda d: d.index)]
    return np.asarray(out, dtype=np.float32)


def unit(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)


def search(corpus: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of the top k by cosine from a FAISS flat index in host memory."""
    import faiss

    index = faiss.IndexFlatIP(corpus.shape[1])
    index.add(unit(corpus))
    return index.search(unit(queries), k)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="minilm-l6", help="built-in name or model folder")
    ap.add_argument("--run", type=Path, help="an optimize run: serve its best/, use its threshold")
    ap.add_argument("--url", help="an already running server (default: start one)")
    ap.add_argument("--threshold", type=float, default=0.5, help="the reference's threshold")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--corpus-size", type=int, default=500)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)

    import openai

    from llmopt.assets.text import evaluation_sentences
    from llmopt.engines import load_runner
    from llmopt.model.info import inspect_model
    from llmopt.verify.index import ndcg_at_k, overlap_at_k
    from llmopt.verify.retrieval import retrieval_queries

    info = inspect_model(args.model)
    threshold, source = args.threshold, "--threshold"
    if args.run is not None:
        launch = json.loads((args.run / "best" / "launch.json").read_text())
        if launch.get("similarity_threshold"):
            threshold = launch["similarity_threshold"]["threshold"]
            source = f"{args.run}/best/launch.json (recalibrated)"
    corpus = evaluation_sentences(args.corpus_size)
    queries, target = retrieval_queries(corpus, args.queries)
    qtext = [(info.query_prompt or "") + q for q in queries]
    ctext = [(info.document_prompt or "") + c for c in corpus]

    proc = None
    url = args.url
    if url is None:
        log = Path("rag-server.log").resolve()
        proc, url = start_server(str(args.run / "best") if args.run else args.model, log)
    try:
        client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0)
        served = client.models.list().data[0].id
        t0 = time.perf_counter()
        cand_c, cand_q = embed_served(client, served, ctext), embed_served(client, served, qtext)
        embed_s = time.perf_counter() - t0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

    ref = load_runner("hf", info.path, info, "fp32")
    ref_c, ref_q = ref.embed(ctext), ref.embed(qtext)
    cs, ci = search(cand_c, cand_q, args.k)
    rs, ri = search(ref_c, ref_q, args.k)
    cand_accept, ref_accept = cs[:, 0] >= threshold, rs[:, 0] >= args.threshold
    summary = {
        "model": info.name,
        "served_model": served,
        "corpus": len(corpus),
        "queries": len(queries),
        "k": args.k,
        "threshold": {"reference": args.threshold, "candidate": threshold, "from": source},
        f"recall@{args.k}_vs_reference": float(overlap_at_k(ci, ri).mean()),
        f"ndcg@{args.k}_vs_reference": float(ndcg_at_k(ci, ri).mean()),
        "same_top1": float((ci[:, 0] == ri[:, 0]).mean()),
        "same_decision": float((cand_accept == ref_accept).mean()),
        "accepted": {"candidate": float(cand_accept.mean()), "reference": float(ref_accept.mean())},
        f"hit@{args.k}": {
            "candidate": float((ci == target[:, None]).any(1).mean()),
            "reference": float((ri == target[:, None]).any(1).mean()),
        },
        "embed_seconds_served": round(embed_s, 3),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key, value in summary.items():
            print(f"{key:28s} {value}")
    return summary


if __name__ == "__main__":
    main()
