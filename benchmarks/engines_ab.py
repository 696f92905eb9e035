"""Interleaved batch-1 decode of candidates from one run directory: A B A B ..., same prompt,
same length, same threads, so the ratios compare engines in one time window.

    python benchmarks/engines_ab.py runs/smollm2-135m llamacpp-gguf-q8_0 hf-w8a16 torch-w8a16 \
        --threads 1 --rounds 5 --prompt-tokens 100 --new-tokens 64

Each round times every candidate once (greedy decode after an untimed prefill, the same loop
`llmopt.bench.lm` uses), in a rotated order. Prints tokens/s per candidate (median and range over
rounds) and each one's ratio to the first candidate, per round, with the ratios' range.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from llmopt.assets.text import evaluation_text
from llmopt.core.atomic import read_json
from llmopt.core.schema import Candidate
from llmopt.engines import load_runner
from llmopt.model.info import ModelInfo


def _decode_rate(runner, prompt: torch.Tensor, new_tokens: int) -> float:
    logits, state = runner.prefill(prompt)
    tok = logits.argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        logits, state = runner.decode(tok, state)
        tok = logits.argmax(-1, keepdim=True)
    return new_tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("candidates", nargs="+")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    info = ModelInfo.from_dict(read_json(a.run / "model.json"))
    runners = {}
    for cid in a.candidates:
        folder = a.run / "candidates" / cid
        cand = Candidate.from_dict(read_json(folder / "candidate.json"))
        settings = cand.settings.with_changes(threads=a.threads)
        runners[cid] = load_runner(cand.engine, folder / "artifact", info, cand.recipe, settings)
    tok = next(iter(runners.values())).tokenizer
    ids = tok(evaluation_text()[:4000])["input_ids"][: a.prompt_tokens]
    prompt = torch.tensor([ids])
    for r in runners.values():  # warm-up, untimed
        _decode_rate(r, prompt, 8)
    rates: dict[str, list[float]] = {c: [] for c in runners}
    for i in range(a.rounds):
        order = a.candidates[i % len(a.candidates) :] + a.candidates[: i % len(a.candidates)]
        for cid in order:
            rates[cid].append(_decode_rate(runners[cid], prompt, a.new_tokens))
    base = a.candidates[0]
    print(f"threads {a.threads}, prompt {len(ids)} tokens, {a.new_tokens} new, {a.rounds} rounds")
    print("| candidate | decode tok/s median [min-max] | ratio to " + base + " median [min-max] |")
    print("| --- | --- | --- |")
    for cid, xs in rates.items():
        ratios = [x / b for x, b in zip(xs, rates[base], strict=True)]
        print(
            f"| {cid} | {statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}] | "
            f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] |"
        )


if __name__ == "__main__":
    main()
