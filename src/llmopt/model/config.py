"""Config.json parsing helpers for the one `ModelInfo` builder (`llmopt.model.info`).

Serving plans need sizes (layers, heads, KV heads, hidden, intermediate, vocab) and a parameter
count, not tensors. So `inspect_model(..., config_only=...)` accepts a folder holding only
config.json: the sizes come from `config_shape`, the parameter count from `estimate_parameters`
(exact for the gated-MLP decoders llmopt supports) unless `params` gives it.

>>> cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
...        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
...        "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}
>>> estimate_parameters(cfg)
8030261248
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmopt.core.errors import NotAModelFolderError, UnsupportedModelError

__all__ = ["estimate_parameters", "config_shape", "get_key", "is_config_only"]

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


def get_key(config: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` that `config` sets (not None), else None."""
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return None


def config_shape(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The sizes `ModelInfo` needs, read from a config.json dict (no weights).

    Multimodal configs nest the language model under `text_config`; GPT-2 style key names are
    accepted too. Used by the one `ModelInfo` builder (`llmopt.model.info`).

    Args:
        config: the parsed config.json.
        source: named in the error when a required size is missing.

    >>> config_shape({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
    ...               "vocab_size": 100})["head_dim"]
    16
    """
    cfg = config.get("text_config") or config

    def need(*keys: str) -> int:
        value = get_key(cfg, *keys)
        if value is None:
            raise NotAModelFolderError(
                f"{source} has no {keys[0]}", hint="repair or re-download config.json"
            )
        return int(value)

    hidden, heads = need("hidden_size", "n_embd", "d_model"), need("num_attention_heads", "n_head")
    return {
        "num_layers": need("num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": int(get_key(cfg, "num_key_value_heads", "num_kv_heads") or heads),
        "head_dim": int(get_key(cfg, "head_dim") or hidden // heads),
        "intermediate_size": get_key(cfg, "intermediate_size", "n_inner", "ffn_dim"),
        "vocab_size": need("vocab_size"),
        "max_context": get_key(cfg, "max_position_embeddings", "n_positions", "max_seq_len"),
    }


def is_config_only(folder: str | os.PathLike) -> bool:
    """True for a folder with config.json and no weight files."""
    p = Path(folder)
    if not (p / "config.json").is_file():
        return False
    return not any(f.suffix in _WEIGHT_SUFFIXES for f in p.iterdir())
