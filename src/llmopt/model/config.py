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

__all__ = [
    "estimate_parameters",
    "config_shape",
    "get_key",
    "is_config_only",
    "attention_layers",
    "attention_pattern",
]

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


def attention_layers(config: dict[str, Any]) -> tuple[int | None, int]:
    """(sliding window in tokens or None, how many layers attend only within it), per config.

    Read the way transformers builds the layers: an explicit `layer_types` list first
    ("sliding_attention" / "full_attention"); else the family's rule: Gemma 2 alternates
    (even layers local), Gemma 3 has one global layer per `sliding_window_pattern` (6), Qwen2 /
    Qwen3 slide from `max_window_layers` on only when `use_sliding_window` is set; any other
    decoder with a `sliding_window` (Mistral, Phi-3) slides in every layer.

    >>> attention_layers({"model_type": "gemma3_text", "num_hidden_layers": 18,
    ...     "sliding_window": 512, "sliding_window_pattern": 6})
    (512, 15)
    >>> attention_layers({"model_type": "llama", "num_hidden_layers": 2})
    (None, 0)
    """
    cfg = config.get("text_config") or config
    n = int(get_key(cfg, "num_hidden_layers", "n_layer", "num_layers") or 0)
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None, 0
    window = int(window)
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and kinds:
        return window, sum("sliding" in str(k) for k in kinds)
    mt = str(cfg.get("model_type", ""))
    if mt == "gemma2":
        return window, (n + 1) // 2
    if mt.startswith("gemma3"):
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return window, n - n // pattern
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not cfg.get("use_sliding_window"):
            return None, 0
        return window, max(0, n - int(cfg.get("max_window_layers") or n))
    return window, n


def attention_pattern(num_layers: int, window: int | None, sliding: int) -> str:
    """The attention pattern in words, as `inspect` shows it.

    >>> attention_pattern(18, 512, 15)
    '15 sliding-window layers (512 tokens) + 3 full-attention layers'
    >>> attention_pattern(2, None, 0)
    'full attention in all 2 layers'
    """
    if not sliding or not window:
        return f"full attention in all {num_layers} layers"
    if sliding >= num_layers:
        return f"sliding-window attention ({window} tokens) in all {num_layers} layers"
    return (
        f"{sliding} sliding-window layers ({window} tokens) + "
        f"{num_layers - sliding} full-attention layers"
    )


def is_config_only(folder: str | os.PathLike) -> bool:
    """True for a folder with config.json and no weight files."""
    p = Path(folder)
    if not (p / "config.json").is_file():
        return False
    return not any(f.suffix in _WEIGHT_SUFFIXES for f in p.iterdir())
