"""The `hf` engine: Hugging Face transformers models run eagerly in PyTorch.

It runs every supported architecture for both tasks and is the reference engine: the `fp32`
candidate on this engine is what every other candidate is compared against. The native `torch`
engine (`llmopt.engines.native`) is the fast path for decoder LMs; this one is the fallback for
everything it refuses. Recipes: `fp32`,
`bf16`, `fp16` (GPU only), `w8a16` (int8 weight-only linears, see `int8.py`).

Artifacts are plain HF folders (safetensors) in the recipe's dtype; a `w8a16` artifact stores int8
weights with per-channel scales and a compressed-tensors style `quantization_config`, which this
engine loads itself (`_load_state`). The fast native decoder (static KV cache, compiled decode,
CUDA graphs) lives in `native/`; this one is the always-works path.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines import register_engine
from llmopt.engines.base import Engine
from llmopt.engines.pooling import embed_in_batches, pool
from llmopt.model.files import copy_tokenizer_files, link_weights

if TYPE_CHECKING:
    import numpy as np
    import torch

    from llmopt.core.recipes import Recipe
    from llmopt.engines.generation import GeneratorSpec
    from llmopt.engines.hf_generator import HFGenerator
    from llmopt.model.info import ModelInfo

__all__ = [
    "HFEngine",
    "HFCausalLMRunner",
    "HFEmbeddingRunner",
    "load_causal_lm",
    "load_hf_generator",
]

log = logging.getLogger(__name__)

RECIPES = ("fp32", "bf16", "fp16", "w8a16")
# Files of a sentence-transformers folder that describe pooling/normalization; copied verbatim.


@register_engine
class HFEngine(Engine):
    name = "hf"
    tasks = ("causal-lm", "embedding")
    # `llmopt serve` runs causal LMs on `HFGenerator` (engines/hf_generator.py): every
    # architecture transformers runs, one forward per sequence per step.
    batching = True

    def incompatible(self, info: ModelInfo, recipe: Recipe, device: str) -> str | None:
        if recipe.name not in RECIPES:
            return f"the hf engine runs recipes {', '.join(RECIPES)}, not {recipe.name!r}"
        if recipe.name == "fp16" and device == "cpu":
            return "float16 matmuls are emulated on most CPUs (slower than fp32); use bf16 on CPU"
        if recipe.name == "w8a16" and info.task != "causal-lm":
            return "w8a16 on the hf engine is wired for causal LMs only so far"
        return None

    def settings_space(self, info: ModelInfo, recipe: Recipe, device: str) -> list[dict[str, Any]]:
        """An embedder's static-shape compiled runs (`llmopt.engines.static_encoder`): a
        candidate on CUDA, where CUDA graphs remove the launch cost that dominates small
        encoders; opt-in on the CPU, where inductor compiles each length bucket for tens of
        seconds."""
        if info.task != "embedding" or recipe.weight_bits is not None:
            return [{}]
        if device == "cuda":
            return [{}, {"compile": True}]
        why = "static-shape compile on the CPU costs tens of seconds per length bucket (opt-in)"
        return [{}, {"compile": True, "opt_in": why}]

    def build(self, source: Path, info: ModelInfo, recipe: Recipe, out: Path) -> dict[str, Any]:
        import torch

        t0 = time.perf_counter()
        facts: dict[str, Any] = {"recipe": recipe.name, "dtype": recipe.dtype}
        if recipe.weight_bits is None and (linked := link_dense_weights(source, out, recipe.dtype)):
            copy_tokenizer_files(source, out)
            return facts | {"weights": linked, "seconds": time.perf_counter() - t0}
        model = _auto_class(info.task).from_pretrained(source, dtype=torch.float32)
        if recipe.weight_bits == 8:
            from llmopt.engines.int8 import quantize_linears_  # heavy: torch

            names = quantize_linears_(model, recipe.ignore)
            _save_int8(model, names, recipe, out)
            facts["quantized_linears"] = len(names)
            facts["ignored"] = list(recipe.ignore)
        else:
            model.to(_torch_dtype(recipe.dtype)).save_pretrained(out, safe_serialization=True)
        copy_tokenizer_files(source, out)
        facts["seconds"] = time.perf_counter() - t0
        return facts

    def load(self, artifact: Path, info: ModelInfo, recipe: Recipe, settings: EngineSettings):
        import torch
        from transformers import AutoTokenizer

        if settings.threads:
            torch.set_num_threads(int(settings.threads))
        device = settings.device
        model = _load_model(artifact, info.task, recipe).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(artifact)
        if info.task == "embedding" and settings.compile:
            from llmopt.engines.static_encoder import StaticShapeEncoder  # lazy: torch.compile

            return StaticShapeEncoder(model, tokenizer, info, device, settings)
        if info.task == "embedding":
            return HFEmbeddingRunner(model, tokenizer, info, device, settings)
        return HFCausalLMRunner(model, tokenizer, device)

    def load_generator(self, spec: GeneratorSpec) -> HFGenerator:
        """An `HFGenerator` (one forward per sequence per step; see engines/hf_generator.py)."""
        return load_hf_generator(
            spec.model,
            spec.recipe,
            spec.device,
            max_batch=spec.max_batch,
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            max_seq_len=spec.max_seq_len,
        )


class HFCausalLMRunner:
    """CausalLMRunner over a transformers model (dynamic KV cache from transformers)."""

    def __init__(self, model, tokenizer, device: str = "cpu"):
        import inspect

        self.model, self.tokenizer, self.device = model, tokenizer, device
        # transformers 5.2x renamed `past_key_values` to `cache` (input and output); support both.
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        import torch

        with torch.inference_mode():
            out = self.model(input_ids.to(self.device), use_cache=False)
            return out.logits.float().cpu()  # (B, T, V)

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self._step(input_ids.to(self.device), None)

    def decode(self, tokens: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        return self._step(tokens.to(self.device), state)

    def _step(self, ids: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        import torch

        kwargs = {self._cache_kw: state} if state is not None else {}
        with torch.inference_mode():
            # logits_to_keep=1: only the last position's logits are needed (saves a (T, V) GEMM).
            out = self.model(ids, use_cache=True, logits_to_keep=1, **kwargs)
            return out.logits[:, -1].float().cpu(), getattr(out, self._cache_kw)


class HFEmbeddingRunner:
    """EmbeddingRunner over a transformers encoder, pooled by `llmopt.engines.pooling.pool`."""

    def __init__(
        self,
        model,
        tokenizer,
        info: ModelInfo,
        device: str = "cpu",
        settings: EngineSettings | None = None,
    ):
        settings = settings or EngineSettings()
        self.model, self.tokenizer, self.info, self.device = model, tokenizer, info, device
        limit = getattr(info, "max_seq_length", None) or info.max_context or 512
        self.max_length = min(int(settings.max_length or limit), int(limit))
        self.sort_by_length = settings.sort_by_length is not False

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:

        dim = int(self.info.hidden_size)
        return embed_in_batches(texts, batch_size, self._embed_batch, dim, self.sort_by_length)

    def _embed_batch(self, batch: list[str]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            enc = self.tokenizer(
                batch,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**enc).last_hidden_state.float().cpu().numpy()  # (B, T, D)
        return pool(
            hidden, enc["attention_mask"].cpu().numpy(), self.info.pooling, self.info.normalize
        )


def _auto_class(task: str):
    from transformers import AutoModel, AutoModelForCausalLM

    return AutoModelForCausalLM if task == "causal-lm" else AutoModel


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _quantization_config(recipe: Recipe, names: list[str]) -> dict[str, Any]:
    # compressed-tensors' schema for int8 per-channel weight-only ("W8A16", format int-quantized).
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": recipe.weight_granularity,
                    "dynamic": False,
                },
                "input_activations": None,
            }
        },
        "ignore": list(recipe.ignore),
        "llmopt": {"recipe": recipe.name, "quantized_modules": names},
    }


def _save_int8(model, names: list[str], recipe: Recipe, out: Path) -> None:
    from safetensors.torch import save_file

    state = model.state_dict()
    # Tied output head: keep one copy (the embedding), as save_pretrained does.
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", {"format": "pt"}
    )
    config = model.config.to_dict()
    config["quantization_config"] = _quantization_config(recipe, names)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def _load_model(artifact: Path, task: str, recipe: Recipe):
    import torch

    if recipe.weight_bits != 8:
        return _auto_class(task).from_pretrained(artifact, dtype=_torch_dtype(recipe.dtype))
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from llmopt.engines.int8 import install_int8_linears_  # heavy: torch

    raw = json.loads((artifact / "config.json").read_text())
    qcfg = raw.pop("quantization_config")
    config = AutoConfig.for_model(**raw)
    model = _auto_class(task).from_config(config, dtype=torch.float32)
    state = load_file(artifact / "model.safetensors")
    install_int8_linears_(model, state, qcfg["llmopt"]["quantized_modules"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(
            f"{artifact}: parameters did not load: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def load_causal_lm(folder: Path, recipe: Recipe, device: str = "cpu"):
    """A causal LM from an HF folder or an `hf` artifact, in `recipe`'s numbers, on `device`.

    A dense folder with an int8 recipe is quantized on load (round-to-nearest, per channel, as
    `build` does); fp16 on the CPU computes in fp32 (emulated fp16 matmuls are slower).
    """
    import torch

    if recipe.name not in RECIPES:
        raise ValueError(
            f"the hf engine runs recipes {', '.join(RECIPES)}, not {recipe.name!r}; "
            "pick one of those with --recipe"
        )
    quantized = (folder / "config.json").is_file() and "quantization_config" in json.loads(
        (folder / "config.json").read_text()
    )
    if recipe.weight_bits == 8 and not quantized:
        from llmopt.engines.int8 import quantize_linears_  # heavy: torch

        model = _auto_class("causal-lm").from_pretrained(folder, dtype=torch.float32)
        quantize_linears_(model, recipe.ignore)
    else:
        model = _load_model(folder, "causal-lm", recipe)
    if device == "cpu" and next(model.parameters()).dtype == torch.float16:
        model = model.float()
    return model.to(device).eval()


def load_hf_generator(
    model: str | Path,
    recipe: Recipe | str = "fp32",
    device: str = "cpu",
    *,
    max_batch: int = 8,
    block_size: int = 16,
    num_blocks: int | None = None,
    max_seq_len: int | None = None,
) -> HFGenerator:
    """The `hf` engine's batch generator for a folder, built-in name or `hf` artifact."""
    from transformers import AutoTokenizer

    from llmopt.assets.models import resolve_model  # lazy: only serving resolves names here
    from llmopt.engines.hf_generator import HFGenerator  # heavy: torch

    folder, _ = resolve_model(model)
    net = load_causal_lm(Path(folder), get_recipe(recipe), device)
    return HFGenerator(
        net,
        AutoTokenizer.from_pretrained(folder),
        max_batch=max_batch,
        block_size=block_size,
        num_blocks=num_blocks,
        max_seq_len=max_seq_len,
    )


def link_dense_weights(source: Path, out: Path, dtype: str) -> str | None:
    """Give `out` the source's own safetensors when they are stored in `dtype` already.

    Rewriting them would produce the same bytes after a load-and-save round trip that needs the
    whole model in host memory in fp32 (an 8B model: 32 GB of RAM, minutes, and another 16 GB on
    disk per candidate). The files are hard-linked (copied across filesystems): nothing ever
    writes to them in place (artifacts are written to new files and renamed), so the user's folder
    stays as it was. Returns what was done, or None when the weights must be converted (another
    stored dtype, mixed dtypes, pickle `.bin` files, no safetensors).
    """
    from safetensors import safe_open

    want = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(dtype)
    files = sorted(source.glob("*.safetensors"))
    if want is None or not files or any(source.glob("*.bin")):
        return None
    for f in files:
        with safe_open(f, "pt") as st:
            stored = {st.get_slice(k).get_dtype() for k in st.keys()}  # noqa: SIM118
        if stored & {"F32", "BF16", "F16", "F64"} != {want}:
            return None
    how = link_weights(source, out, files)
    return f"{how} from the source ({len(files)} safetensors file(s), already {dtype})"
