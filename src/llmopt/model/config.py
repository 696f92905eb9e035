"""Model facts for planning without the weights: `ModelInfo` from a config.json dict.

Serving plans need sizes (layers, heads, KV heads, hidden, intermediate, vocab) and a parameter
count, not tensors. So `llmopt plan` accepts a folder holding only config.json (the parameter
count is then computed from the config, exactly for the gated-MLP decoders llmopt supports), or
`--params` to give the count. A folder with weights goes through `inspect_model` as before.

>>> cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
...        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
...        "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}
>>> estimate_parameters(cfg)
8030261248
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmopt.core.errors import NotAModelFolderError, UnsupportedModelError

if TYPE_CHECKING:
    from llmopt.model.info import ModelInfo

__all__ = ["estimate_parameters", "info_from_config", "load_model_info", "is_config_only"]

_KV_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}  # as modelinfo
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _need(cfg: dict[str, Any], *keys: str) -> int:
    for k in keys:
        if cfg.get(k) is not None:
            return int(cfg[k])
    raise NotAModelFolderError(
        f"config has no {keys[0]}", hint="pass a complete Hugging Face config.json"
    )


def estimate_parameters(config: dict[str, Any]) -> int:
    """Parameter count of a gated-MLP decoder (Llama, Mistral, Qwen, Gemma, Phi-3) from its config.

    Counts embeddings, the LM head unless tied, per layer Q/K/V/O projections (with Q/K/V biases
    where the family has them), gate/up/down projections and the two norms, and the final norm.
    Exact for Llama-3.1-8B (8,030,261,248) and -70B (70,553,706,496).

    Args:
        config: a config.json dict (multimodal configs: the `text_config` part is used).

    Raises:
        UnsupportedModelError: for encoders (BERT-like), whose layout differs; use --params.
    """
    cfg = config.get("text_config") or config
    if cfg.get("model_type") in ("bert", "roberta", "xlm-roberta", "mpnet"):
        raise UnsupportedModelError(
            f"cannot count parameters of a {cfg['model_type']} encoder from its config",
            hint="plan it from the folder with its weights, or pass --params",
        )
    h, layers = _need(cfg, "hidden_size"), _need(cfg, "num_hidden_layers")
    heads = _need(cfg, "num_attention_heads")
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    inter, vocab = _need(cfg, "intermediate_size"), _need(cfg, "vocab_size")
    tied = bool(cfg.get("tie_word_embeddings", False))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h  # (H, nh*hd) q, k, v, o
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        attn += heads * hd + 2 * kv * hd  # Qwen2 always has Q/K/V biases
    mlp = 3 * h * inter  # gate, up, down
    per_layer = attn + mlp + 2 * h  # + input and post-attention RMSNorm weights
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def info_from_config(
    config: dict[str, Any],
    *,
    num_parameters: int | None = None,
    name: str = "config",
    path: str = "",
) -> ModelInfo:
    """A `ModelInfo` built from a config dict alone (no weights), for planning.

    Args:
        config: a config.json dict.
        num_parameters: the parameter count; default: `estimate_parameters(config)`.
        name: shown in reports.
        path: the folder it came from, if any.

    >>> info = info_from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    ...     "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    ...     "torch_dtype": "bfloat16", "max_position_embeddings": 131072})
    >>> info.kv_bytes_per_token["bfloat16"]
    131072
    """
    from llmopt.model.info import (
        SUPPORTED_ARCHITECTURES,
        ModelInfo,
        config_shape,
        kv_bytes_per_token,
    )

    cfg = config.get("text_config") or config
    arch = (config.get("architectures") or [""])[0]
    task = SUPPORTED_ARCHITECTURES.get(arch, "causal-lm")
    shape = config_shape(config, name)
    params = int(num_parameters) if num_parameters else estimate_parameters(config)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    width = _KV_DTYPES.get(dtype, 2)
    return ModelInfo(
        name=name,
        path=path,
        builtin=None,
        task=task,  # type: ignore[arg-type]
        architecture=arch,
        model_type=str(config.get("model_type", "")),
        num_parameters=params,
        **shape,
        dtype=dtype,
        weights_dtype=dtype,
        bytes_on_disk=params * width,  # what the checkpoint would take; nothing is on disk
        weight_files=[],
        weight_format="none (config only)",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        kv_bytes_per_token=kv_bytes_per_token(shape) if task == "causal-lm" else {},
        fingerprint=hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
    )


def is_config_only(folder: str | os.PathLike) -> bool:
    """True for a folder with config.json and no weight files."""
    p = Path(folder)
    if not (p / "config.json").is_file():
        return False
    return not any(f.suffix in _WEIGHT_SUFFIXES for f in p.iterdir())


def load_model_info(model: str, *, params: float | None = None) -> tuple[ModelInfo, str]:
    """(ModelInfo, source) for planning: "weights" via `inspect_model`, or "config".

    A folder with only config.json is planned from the config; `params` overrides the parameter
    count in either case (e.g. a checkpoint whose count the config formula does not cover).

    Args:
        model: a built-in name or a Hugging Face folder (with or without weights).
        params: parameter count override, e.g. 8.03e9.
    """
    from llmopt.model.info import inspect_model

    if Path(model).is_dir() and is_config_only(model):
        config = json.loads((Path(model) / "config.json").read_text())
        info = info_from_config(config, num_parameters=int(params) if params else None,
                                name=Path(model).name, path=str(Path(model).resolve()))  # fmt: skip
        return info, "config"
    info = inspect_model(model)
    if params:
        info.num_parameters = int(params)
    return info, "weights"
