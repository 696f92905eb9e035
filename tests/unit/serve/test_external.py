"""`llmopt serve --engine vllm|llamacpp`: the plan's launch command with our host/port, and a
clear error (never a crash) when the engine is missing."""

from __future__ import annotations

import pytest

from llmopt.core.errors import EngineUnavailableError
from llmopt.serve import external
from llmopt.serve.settings import ServeSettings


def test_missing_engine_is_a_clear_error(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(external.shutil, "which", lambda name: None)
    monkeypatch.setattr(external.importlib.util, "find_spec", lambda name: None)
    for engine, hint in (("vllm", "pip install"), ("llamacpp", "llama-cpp-python")):
        with pytest.raises(EngineUnavailableError) as ei:
            external.external_command(engine, str(tiny_llama_dir), ServeSettings())
        assert hint in str(ei.value)
    with pytest.raises(ValueError, match="unknown engine"):
        external.external_command("tgi", str(tiny_llama_dir), ServeSettings())


def test_commands_come_from_the_plan(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(external, "_check_installed", lambda engine: None)
    s = ServeSettings(host="127.0.0.1", port=9123, threads=2)
    cfg = external.external_command("vllm", str(tiny_llama_dir), s)
    argv = cfg.argv
    assert (
        argv[argv.index("--port") + 1] == "9123" and argv[argv.index("--host") + 1] == "127.0.0.1"
    )
    assert "--max-model-len" in argv and "--max-num-seqs" in argv  # the plan's numbers
    assert "--no-enable-chunked-prefill" not in argv  # not asked: vLLM's own default stands
    off = ServeSettings(port=9123, enable_chunked_prefill=False)
    assert (
        "--no-enable-chunked-prefill"
        in external.external_command("vllm", str(tiny_llama_dir), off).argv
    )
    with pytest.raises(ValueError, match="GGUF"):
        external.external_command("llamacpp", str(tiny_llama_dir), s)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(external.shutil, "which", lambda name: "/usr/bin/" + name)
    argv = external.external_command("llamacpp", str(tiny_llama_dir), s, gguf=str(gguf)).argv
    assert argv[0] == "llama-server" and argv[argv.index("-m") + 1] == str(gguf)
    assert argv[argv.index("--port") + 1] == "9123"
    # Without llama-server, llama-cpp-python's server gets the same settings in its spelling.
    monkeypatch.setattr(external.shutil, "which", lambda name: None)
    argv = external.external_command("llamacpp", str(tiny_llama_dir), s, gguf=str(gguf)).argv
    assert argv[1:4] == ["-m", "llmopt.engines.llamacpp_server", "--no-extra-bufts"]
    assert argv[argv.index("--model") + 1] == str(gguf) and "--n_ctx" in argv


def test_embedders_are_refused(tiny_bert_dir, monkeypatch):
    monkeypatch.setattr(external, "_check_installed", lambda engine: None)
    with pytest.raises(ValueError, match="embedding model"):
        external.external_command("vllm", str(tiny_bert_dir), ServeSettings())
