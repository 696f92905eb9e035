"""Write a Hugging Face folder with seeded random weights in a benchmark shape.

    python benchmarks/random_model.py --shape llama-3.1-8b --out /tmp/llama-8b-random \
        --tokenizer smollm2-135m

For the runs that need a model *folder* (`llmopt serve`, `llmopt optimize`) at a size no built-in
has, on a machine that reaches no model hub. Weights: N(0, 0.02), norms 1, bf16 by default,
written in ~4 GB safetensors shards plus an index, as transformers writes them; generated on the
GPU when there is one (8B normal samples take minutes on a CPU). The tokenizer files come from
another folder or built-in: ids it does not know decode to nothing, which is fine for speed runs.
Speed does not depend on the values; quality numbers of such a model mean nothing.
The folder is written under a temporary name and renamed, so a killed run leaves no half folder.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES  # noqa: E402

SHARD_BYTES = 4 * 2**30


def write_random_model(
    shape: str,
    out: Path,
    tokenizer: str,
    dtype: str = "bfloat16",
    seed: int = 0,
    layers: int = 0,
    vocab: int = 0,
) -> Path:
    """Write the folder (unless `out` already holds one of this shape) and return it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmopt.assets.models import resolve_model

    cfg = copy.deepcopy(SHAPES[shape]) | ({"num_hidden_layers": layers} if layers else {})
    cfg |= {"vocab_size": vocab} if vocab else {}
    marker = out / "llmopt-random.json"
    want = {"shape": shape, "config": cfg, "dtype": dtype, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return out
    # A copy: transformers adds keys to the nested rope_scaling dict it is given, which made the
    # marker written below differ from the next call's `want` (the 8B folder was rewritten, 16 GB,
    # on every call).
    config = AutoConfig.for_model(**copy.deepcopy(cfg))
    with torch.device("meta"):
        names = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    tdtype = getattr(torch, dtype)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, p in names.items():
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=tdtype)
        else:
            t = torch.randn(p.shape, device=dev, dtype=torch.float32, generator=g) * 0.02
            t = t.to(tdtype).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    index, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )
    config.dtype = tdtype
    # inspect/serve read the architecture from config.json, as transformers writes it for models.
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    config.save_pretrained(tmp)
    tok_dir, _ = resolve_model(tokenizer)
    for f in Path(tok_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy2(f, tmp / f.name)
    (tmp / "llmopt-random.json").write_text(json.dumps(want))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", default="smollm2-135m", help="folder or built-in name")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=0, help="fewer decoder layers (smoke runs)")
    ap.add_argument(
        "--vocab", type=int, default=0, help="another vocabulary size (the tokenizer's)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = write_random_model(
        args.shape, args.out, args.tokenizer, args.dtype, args.seed, args.layers, args.vocab
    )
    print(f"{out} ready in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
