"""`llmopt serve --engine vllm|llamacpp`: the plan's launch command with our host/port, and a
clear error (never a crash) when the engine is missing."""

from __future__ import annotations

import json

import pytest

from llmopt.core.errors import EngineUnavailableError
from llmopt.core.schema import Candidate
from llmopt.core.settings import EngineSettings
from llmopt.engines.llamacpp import use_extra_bufts
from llmopt.model.info import inspect_model
from llmopt.rundir.best import write_best
from llmopt.serve import external
from llmopt.serve.settings import ServeSettings


def test_missing_engine_is_a_clear_error(tiny_llama_dir, tmp_path, monkeypatch):
    # A home of its own: another test may have linked a managed vLLM into the session's home.
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path / "home"))
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
    assert "--no-enable-prefix-caching" not in argv  # vLLM's default (on) stands
    off = ServeSettings(port=9123, enable_prefix_caching=False)
    assert (
        "--no-enable-prefix-caching"
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
    assert argv[1:3] == ["-m", "llmopt.engines.llamacpp_server"]
    # ggml's extra buffers are off only where they crash (AMX CPUs), as in the llamacpp engine.
    assert ("--no-extra-bufts" in argv) == (not use_extra_bufts(EngineSettings()))
    assert argv[argv.index("--model") + 1] == str(gguf) and "--n_ctx" in argv
    assert argv[argv.index("--model_alias") + 1] == "tiny-llama"


def test_a_run_that_chose_llamacpp_is_served_by_llamacpp(tiny_llama_dir, tmp_path, monkeypatch):
    # A run directory whose best/ is a llama.cpp GGUF candidate measured at 1 thread.
    run = tmp_path / "run"
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "model.gguf").write_bytes(b"GGUF")
    cand = Candidate(
        "llamacpp-gguf-q8_0", "llamacpp", "gguf-q8_0", {"threads": 1, "flash_attn": False}
    )
    (tmp_path / "model.json").write_text(json.dumps(inspect_model(tiny_llama_dir).to_dict()))
    write_best(run / "best", cand, art, tmp_path / "model.json", {})
    (run / "run.json").write_text("{}")  # what makes the folder a run directory
    assert external.chosen_external_engine(str(run)) == "llamacpp"
    assert external.chosen_external_engine(str(tiny_llama_dir)) is None  # a folder: no choice
    monkeypatch.setattr(external, "_check_installed", lambda engine: None)
    monkeypatch.setattr(external.shutil, "which", lambda name: "/usr/bin/" + name)
    argv = external.external_command("llamacpp", str(run), ServeSettings(port=9124)).argv
    assert argv[argv.index("-m") + 1] == str(run / "best" / "artifact" / "model.gguf")
    assert argv[argv.index("-t") + 1] == "1"  # the threads it was measured with
    assert argv[argv.index("--alias") + 1] == "tiny-llama"  # the model id clients send
    assert argv[argv.index("-fa") + 1] == "off"  # the settings rung's flash attention choice
    monkeypatch.setattr(external.shutil, "which", lambda name: None)  # llama-cpp-python's server
    argv = external.external_command("llamacpp", str(run), ServeSettings(port=9124)).argv
    assert argv[argv.index("--flash_attn") + 1] == "false"


def test_embedders_are_refused(tiny_bert_dir, monkeypatch):
    monkeypatch.setattr(external, "_check_installed", lambda engine: None)
    with pytest.raises(ValueError, match="embedding model"):
        external.external_command("vllm", str(tiny_bert_dir), ServeSettings())


def test_dry_run_builds_the_command_without_the_engine(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(external, "vllm_python", lambda: None)
    monkeypatch.setattr(external.shutil, "which", lambda name: None)
    cfg = external.external_command(
        "vllm",
        str(tiny_llama_dir),
        ServeSettings(port=9125, max_num_seqs=3, sources={"max_num_seqs": "flag"}),
        dry_run=True,
    )
    assert cfg.argv[0] == "python" and "--max-num-seqs" in cfg.argv
    assert cfg.argv[cfg.argv.index("--max-num-seqs") + 1] == "3"  # the flag given wins
    assert any("llmopt engines install vllm" in n for n in cfg.notes)
    with pytest.raises(EngineUnavailableError, match="not installed"):
        external.external_command("vllm", str(tiny_llama_dir), ServeSettings())


def test_a_run_that_chose_vllm_is_served_as_measured(tiny_llama_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    art = tmp_path / "artifact"
    art.mkdir()
    settings = {"device": "cpu", "threads": 1, "max_batch": 4, "block_size": 32}
    cand = Candidate("vllm-fp32", "vllm", "fp32", settings)
    (tmp_path / "model.json").write_text(json.dumps(inspect_model(tiny_llama_dir).to_dict()))
    write_best(run / "best", cand, art, tmp_path / "model.json", {})
    (run / "run.json").write_text("{}")
    assert external.chosen_external_engine(str(run)) == "vllm"
    monkeypatch.setattr(external, "vllm_python", lambda: "/engines/vllm/venv/bin/python")
    argv = external.external_command("vllm", str(run), ServeSettings(port=9126)).argv
    assert argv[:3] == ["/engines/vllm/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str((run / "best" / "artifact").resolve())
    assert argv[argv.index("--max-num-seqs") + 1] == "4"
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--port") + 1] == "9126"
    assert argv[argv.index("--served-model-name") + 1] == "tiny-llama"


def test_a_run_that_chose_openvino_is_served_by_llmopt_with_its_settings(tiny_llama_dir, tmp_path):
    from llmopt.optimize.job import _launch
    from llmopt.serve.server import batching_engine, candidate_settings

    run = tmp_path / "run"
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "model.xml").write_text("<net/>")
    cand = Candidate(
        "openvino-w8a16-kv_cacheu8", "openvino", "w8a16", {"threads": 1, "kv_cache": "u8"}
    )
    info = inspect_model(tiny_llama_dir).to_dict()
    (tmp_path / "model.json").write_text(json.dumps(info))
    write_best(run / "best", cand, art, tmp_path / "model.json", {})
    (run / "run.json").write_text("{}")
    assert external.chosen_external_engine(str(run)) is None  # llmopt's own server
    best = run / "best"
    assert batching_engine(best, best / "artifact") == "openvino"
    # The generator gets the candidate's settings; --threads replaces only the threads.
    assert candidate_settings(best, "openvino") == {"device": "cpu", "threads": 1, "kv_cache": "u8"}
    assert candidate_settings(best, "openvino", threads=4)["threads"] == 4
    assert candidate_settings(best, "torch") is None  # another engine: not its settings
    # best/launch.json's serve command serves the run itself, like every other engine's.
    launch = _launch(cand, info, best, None)["serve"]
    assert launch["command"].startswith(f"llmopt serve {best} ") and "note" not in launch
