"""GGUF export of the tiny Llama: llama.cpp's names, types, metadata and Q/K row order, read back
with gguf-py's own reader and dequantizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from llmopt.core.errors import UnsupportedModelError
from llmopt.engines.gguf_export import _permute, export_gguf


def _field(reader, key):
    f = reader.fields[key]
    return f.parts[f.data[0]].tolist()


@pytest.mark.parametrize("qtype, rel_err", [("Q8_0", 0.01), ("Q4_0", 0.15)])
def test_gguf_tensors_metadata_and_values(tiny_llama_bpe_dir, tmp_path, qtype, rel_err):
    tiny_llama_dir = tiny_llama_bpe_dir
    import gguf

    facts = export_gguf(tiny_llama_dir, tmp_path, qtype)
    path = tmp_path / f"model-{qtype}.gguf"
    assert facts["path"] == str(path) and path.stat().st_size == facts["bytes"]
    reader = gguf.GGUFReader(path)
    assert bytes(_field(reader, "general.architecture")).decode() == "llama"
    assert _field(reader, "llama.attention.head_count") == [4]
    assert _field(reader, "llama.attention.head_count_kv") == [2]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 264
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 1 + 1 + 2 * 9  # embedding, output norm, 9 per layer (tied head)
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == qtype
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"

    state = load_file(tiny_llama_dir / "model.safetensors")

    def deq(name):
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.data.shape[0], -1)

    def close(a, b):
        return np.abs(a - b).mean() / np.abs(b).mean() < rel_err

    assert close(deq("blk.1.ffn_up.weight"), state["model.layers.1.mlp.up_proj.weight"].numpy())
    q = deq("blk.0.attn_q.weight")
    want = _permute(state["model.layers.0.self_attn.q_proj.weight"].numpy(), 4)
    assert close(q, want)
    assert not close(q, state["model.layers.0.self_attn.q_proj.weight"].numpy())  # rows moved


def test_gguf_refuses_what_it_cannot_write(tiny_llama_dir, tmp_path):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    (tiny_llama_dir / "config.json").write_text(
        json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(UnsupportedModelError, match="Llama-family"):
        export_gguf(tiny_llama_dir, tmp_path, "Q8_0")
    with pytest.raises(ValueError, match="Q8_0"):
        export_gguf(tiny_llama_dir, tmp_path, "Q2_K")
    assert not list(tmp_path.glob("*.gguf"))


def test_permute_is_llamacpp_interleave():
    # 1 head, head_dim 4: rows [x0, x1, y0, y1] -> [x0, y0, x1, y1]
    w = torch.arange(4.0).view(4, 1).numpy()
    assert _permute(w, 1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]
