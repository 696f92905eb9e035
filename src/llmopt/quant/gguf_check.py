"""Load a GGUF file with llama-cpp-python and score it: greedy text and perplexity on given text.

Run it as a subprocess (`python -m llmopt.quant.gguf_check FILE --text-file T`) so that a crash
inside llama.cpp fails the caller instead of killing it. ggml's AMX "extra" buffers are turned off
(they crash on our CPUs, see `llmopt.engines.llamacpp_server`) and the batch is 1 token.

Prints one JSON object: {"greedy": str, "perplexity": float, "tokens": int, "n_vocab": int}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from llmopt.engines.llamacpp_server import disable_extra_buffers

__all__ = ["score_gguf", "main"]


def score_gguf(path: str, text: str, prompt: str, max_tokens: int = 256, new: int = 16) -> dict:
    import numpy as np
    from llama_cpp import Llama

    disable_extra_buffers()
    llm = Llama(
        model_path=path,
        n_ctx=512,
        n_batch=1,
        n_ubatch=1,
        logits_all=True,
        verbose=False,
        n_threads=1,
    )
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False)[:max_tokens]
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # (T, V)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -sum(logp[i, ids[i + 1]] for i in range(len(ids) - 1))
    llm.reset()
    out = llm.create_completion(prompt, max_tokens=new, temperature=0.0, top_k=1)
    return {
        "greedy": out["choices"][0]["text"],
        "perplexity": math.exp(nll / (len(ids) - 1)),
        "tokens": len(ids),
        "n_vocab": llm.n_vocab(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("gguf")
    p.add_argument("--text-file", required=True)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--max-tokens", type=int, default=256)
    a = p.parse_args(argv)
    with open(a.text_file, encoding="utf-8") as f:
        text = f.read()
    sys.stdout.write(json.dumps(score_gguf(a.gguf, text, a.prompt, a.max_tokens)) + "\n")


if __name__ == "__main__":
    main()
