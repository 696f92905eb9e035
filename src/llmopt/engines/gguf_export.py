"""GGUF export (F32, F16, BF16, Q8_0, Q4_0) of Llama-family HF folders, for llama.cpp.

Written with the `gguf` package that llama.cpp itself ships (`GGUFWriter`, `gguf.quants`): the
tensor names, the Q/K row permutation and the metadata keys follow llama.cpp's
`convert_hf_to_gguf.py` for `LlamaForCausalLM`. The tokenizer must be a byte-level BPE
`tokenizer.json` (GPT-2 style, as SmolLM2, Llama 3, Qwen2 use); SentencePiece models are refused.

Quantization is llama.cpp's own block format from the float weights (round to nearest, blocks of
32): Q8_0 for every matrix, or Q4_0 for the decoder matrices with the embedding/output kept in
Q8_0 (llama.cpp keeps those in 6 bits or more too; gguf-py cannot write Q6_K). The float types
write the weights as they are (norms in F32): the input llama.cpp's own quantizer takes for its
K-quants (`llmopt.engines.llamacpp`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from llmopt.core.atomic import TMP_PREFIX
from llmopt.core.errors import UnsupportedModelError

__all__ = ["export_gguf", "GGUF_TYPES"]

GGUF_TYPES = ("Q8_0", "Q4_0", "F32", "F16", "BF16")
_FILE_TYPES = {
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "F32": "ALL_F32",
    "F16": "MOSTLY_F16",
    "BF16": "MOSTLY_BF16",
}
_LLAMA_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")
_LAYER_MAP = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # HF stores rotary halves [x0..x(d/2), y0..]; llama.cpp wants interleaved pairs per head.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _rope_theta(cfg: dict[str, Any]) -> float:
    """RoPE's base: `rope_theta`, or inside `rope_parameters` (transformers 5 writes it there).
    Scaled RoPE variants are refused: the exporter writes no scaling metadata.

    >>> _rope_theta({"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    100000.0
    """
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind != "default":
        raise UnsupportedModelError(
            f"GGUF export writes plain RoPE, not {kind!r} scaling",
            hint="use llama.cpp's convert_hf_to_gguf.py for this model",
        )
    return float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def _gguf_name(name: str) -> str | None:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        key = ".".join(parts[3:-1])
        if key in _LAYER_MAP:
            return f"blk.{parts[2]}.{_LAYER_MAP[key]}.weight"
    return None


def _pre_tokenizer(tok: dict[str, Any]) -> str:
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # the GPT-2 split regex, exactly what HF's ByteLevel pre-tokenizer does
    return "default"


def _add_tokenizer(writer, source: Path, n_vocab: int) -> None:
    import gguf

    path = source / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedModelError(
            f"{source} has no tokenizer.json", hint="GGUF export needs a byte-level BPE tokenizer"
        )
    tok = json.loads(path.read_text(encoding="utf-8"))
    if tok.get("model", {}).get("type") != "BPE":
        raise UnsupportedModelError(
            f"GGUF export handles byte-level BPE tokenizers, not {tok['model'].get('type')}",
            hint="use llama.cpp's convert_hf_to_gguf.py for SentencePiece models",
        )
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for i, a in added.items():
        vocab[a["content"]] = i
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(
                gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED
            )
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tok))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(source, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        # A BPE without merges is valid, but llama.cpp refuses a vocabulary without the merges
        # key, and GGUF cannot hold an empty array.
        raise UnsupportedModelError(
            f"{source}'s BPE tokenizer has no merges: llama.cpp cannot load such a vocabulary",
            hint="GGUF export needs a byte-level BPE tokenizer with merges",
        )
    special.add_to_gguf(writer, quiet=True)


def export_gguf(source: Path, out: Path, qtype: str = "Q8_0") -> dict[str, Any]:
    """Write `out` (a .gguf file, or a folder that gets `model-<qtype>.gguf`) from an HF folder.

    Args:
        source: a Llama-family HF folder (float weights).
        out: target file or folder; written atomically.
        qtype: "Q8_0" or "Q4_0", or a float type ("F32", "F16", "BF16").

    Returns:
        Facts: path, type, tensors per GGML type, bytes, seconds.

    Example:
        >>> export_gguf(Path("smollm2"), Path("smollm2.gguf"), "Q8_0")["path"]  # doctest: +SKIP
        'smollm2.gguf'
    """
    import gguf
    import torch
    from safetensors import safe_open

    t0 = time.perf_counter()
    qtype = qtype.upper()
    if qtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type must be one of {GGUF_TYPES}, not {qtype!r}")
    cfg = json.loads((source / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in _LLAMA_ARCHS:
        raise UnsupportedModelError(
            f"GGUF export is for Llama-family models ({', '.join(_LLAMA_ARCHS)}), not {arch}",
            hint="use llama.cpp's convert_hf_to_gguf.py for other architectures",
        )
    if "quantization_config" in cfg:
        raise UnsupportedModelError(
            f"{source} is already quantized", hint="export GGUF from the float model folder"
        )
    path = out if out.suffix == ".gguf" else out / f"model-{qtype}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")

    n_head, n_kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
    )
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // n_head
    main = getattr(gguf.GGMLQuantizationType, qtype)
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(source.name)
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(_rope_theta(cfg))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[qtype]))
    _add_tokenizer(writer, source, cfg["vocab_size"])

    counts: dict[str, int] = {}
    files = sorted(source.glob("*.safetensors"))
    names_written = set()
    for f in files:
        with safe_open(f, "pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not iterable)
                gname = _gguf_name(name)
                if gname is None:
                    continue
                w = sf.get_tensor(name).to(torch.float32).numpy()
                if name.endswith("q_proj.weight"):
                    w = _permute(w, n_head)
                elif name.endswith("k_proj.weight"):
                    w = _permute(w, n_kv)
                if w.ndim == 1 or w.shape[-1] % 32:
                    t = gguf.GGMLQuantizationType.F32
                    data = w.astype(np.float32)
                    writer.add_tensor(gname, data)
                else:
                    big = gname in ("token_embd.weight", "output.weight")
                    t = gguf.GGMLQuantizationType.Q8_0 if big and qtype == "Q4_0" else main
                    writer.add_tensor(gname, gguf.quants.quantize(w, t), raw_dtype=t)
                counts[t.name] = counts.get(t.name, 0) + 1
                names_written.add(gname)
    assert "token_embd.weight" in names_written, "no embedding found in the safetensors files"
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return {
        "export": f"gguf-{qtype.lower()}",
        "format": f"GGUF {qtype}",
        "source": str(source),
        "path": str(path),
        "tensors": counts,
        "bytes": path.stat().st_size,
        "seconds": time.perf_counter() - t0,
    }
