"""Which Hugging Face decoders the native engine runs, read from `config.json` alone.

One dataclass holds everything the model code needs; `from_hf` maps each family's config keys onto
it and refuses what the compact decoder does not implement, with the reason and the way out
(the `hf` engine runs every architecture transformers knows).

>>> cfg = NativeConfig.from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
...     "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100})
>>> cfg.head_dim, cfg.n_kv_heads, cfg.rope_theta
(16, 4, 10000.0)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from llmopt.core.errors import UnsupportedModelError

__all__ = ["NativeConfig", "UnsupportedModel", "FAMILIES", "native_refusal"]

# model_type -> what differs from plain Llama.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma": {"gemma": True},
    "phi3": {},  # Llama with fused qkv / gate_up tensors (split on load, `weights.py`)
    "granite": {},  # Llama with embedding / attention / residual / logits multipliers
    # norms after attention and MLP (none before), q/k norms over the whole projection
    "olmo2": {"post_norms": True, "qk_norm_full": True},
    # Gemma norms + pre/post norms around attention and MLP, interleaved local/global layers,
    # query_pre_attn_scalar; Gemma 2 soft-caps attention scores and logits, Gemma 3 has
    # q/k norms and a separate RoPE base for its local layers.
    "gemma2": {"gemma": True, "sandwich_norms": True, "local_every": 2},
    "gemma3_text": {"gemma": True, "sandwich_norms": True, "qk_norm": True, "local_every": 6},
}


# The way out of every refusal, and the flag `llmopt serve` takes (tested to work).
HF_HINT = "use the hf engine (`--engine hf`), which runs every transformers architecture"


class UnsupportedModel(UnsupportedModelError):
    """The native engine cannot run this model; the `hf` engine can."""


@dataclass(frozen=True)
class NativeConfig:
    model_type: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False  # (1 + w) RMSNorm, embeddings scaled by sqrt(dim), tanh-GELU MLP
    # OLMo 2: each block normalizes its attention and MLP outputs (post_attention_layernorm,
    # post_feedforward_layernorm) instead of their inputs; q/k norms span all heads at once.
    post_norms: bool = False
    qk_norm_full: bool = False
    # Gemma 2/3: norms before and after attention and MLP; local layers attend to the last
    # `local_window` tokens only (their RoPE base `local_rope_theta` when it differs); scores and
    # logits soft-capped (tanh(x / cap) * cap) where the family does.
    sandwich_norms: bool = False
    local_window: int | None = None
    local_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Granite's multipliers (1.0 / None elsewhere): embeddings x embedding_multiplier, attention
    # scores x attention_scale (else 1/sqrt(head_dim)), each residual branch x
    # residual_multiplier, logits / logits_scaling. The last two are folded into the weights
    # on load (`weights.fold_multipliers_`), so only the first two cost anything at run time.
    embedding_multiplier: float = 1.0
    attention_scale: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> NativeConfig:
        """Map an HF `config.json` dict to a NativeConfig, or raise UnsupportedModel."""
        mt = cfg.get("model_type", "?")
        if mt not in FAMILIES:
            raise UnsupportedModel(
                f"the native torch engine runs {', '.join(FAMILIES)} decoders, not {mt!r}",
                hint=HF_HINT,
            )
        fam = FAMILIES[mt]
        act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
        want = "gelu_pytorch_tanh" if fam.get("gemma") else "silu"
        if act != want and not (fam.get("gemma") and act in ("gelu", "gelu_pytorch_tanh")):
            raise UnsupportedModel(
                f"{mt} with activation {act!r}: the native engine implements {want}",
                hint=HF_HINT,
            )
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
        local_rope = None
        if "full_attention" in rope or "sliding_attention" in rope:  # per layer type (Gemma 3)
            local_rope = dict(rope.get("sliding_attention") or {})
            rope = dict(rope.get("full_attention") or {})
        rope.update(cfg.get("rope_scaling") or {})  # transformers 4.x
        # transformers 5 moves the factor into rope_parameters (Phi-4-mini: 0.75).
        if float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise UnsupportedModel(
                "partial rotary embeddings are not implemented natively", hint=HF_HINT
            )
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in ("default", "llama3", "linear"):
            raise UnsupportedModel(
                f"RoPE scaling {rope_type!r} is not implemented natively (default, linear, llama3 are)",
                hint=HF_HINT,
            )
        rope["rope_type"] = rope_type
        n_heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        local: dict[str, Any] = {}
        if fam.get("local_every") and cfg.get("sliding_window"):
            n = int(cfg["num_hidden_layers"])
            kinds = cfg.get("layer_types") or [
                "full_attention" if (i + 1) % fam["local_every"] == 0 else "sliding_attention"
                for i in range(n)
            ]
            lt = (local_rope or {}).get("rope_theta", cfg.get("rope_local_base_freq"))
            if (local_rope or {}).get("rope_type", "default") not in ("default", None):
                raise UnsupportedModel("scaled RoPE on local layers", hint=HF_HINT)
            local = {
                "local_window": int(cfg["sliding_window"]),
                "local_layers": tuple(i for i, k in enumerate(kinds) if "sliding" in str(k)),
                "local_rope_theta": None if lt is None else float(lt),
            }
        if fam.get("sandwich_norms"):
            scalar = cfg.get("query_pre_attn_scalar")
            local["attention_scale"] = None if scalar is None else float(scalar) ** -0.5
            local["attn_softcap"] = cfg.get("attn_logit_softcapping")
            local["final_softcap"] = cfg.get("final_logit_softcapping")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=mt,
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),  # transformers' default
            rope_theta=theta,
            rope_scaling=rope,
            max_position=int(cfg.get("max_position_embeddings") or 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", fam.get("gemma", False))),
            qkv_bias=bool(cfg.get("attention_bias", fam.get("qkv_bias", False))),
            qk_norm=bool(fam.get("qk_norm", False)),
            gemma=bool(fam.get("gemma", False)),
            post_norms=bool(fam.get("post_norms", False)),
            qk_norm_full=bool(fam.get("qk_norm_full", False)),
            sliding_window=cfg.get("sliding_window")
            if cfg.get("use_sliding_window", True) and not fam.get("local_every")
            else None,
            eos_token_ids=eos_ids,
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            **(
                {}
                if cfg.get("attention_multiplier") is None
                else {"attention_scale": float(cfg["attention_multiplier"])}
            ),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
            sandwich_norms=bool(fam.get("sandwich_norms", False)),
            **local,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def native_refusal(folder) -> str | None:
    """Why the native engine cannot run the decoder in `folder` (from its `config.json`), or None.

    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    >>> native_refusal(d).startswith("the native torch engine runs")
    True
    """
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    if not path.is_file():
        return None  # nothing to judge by: the loader reports the missing config itself
    try:
        NativeConfig.from_hf(json.loads(path.read_text()))
    except UnsupportedModel as e:
        return e.message
    except (KeyError, TypeError, ValueError) as e:
        return f"its config.json lacks what the native engine reads ({e})"
    return None
