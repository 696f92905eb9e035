"""`llmopt serve RUN` of a run that chose an OpenVINO causal-LM candidate, as a real process: the
run's own artifact on the openvino engine's generator with the candidate's settings (not the
source model on the native engine), completions and chat, streamed and not, over HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("openvino")
pytest.importorskip("nncf")

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Server:
    """A `llmopt serve` subprocess on a free loopback port (the caller kills it)."""

    def __init__(self, model: str, args: list[str], log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "llmopt.cli.main", "serve", model, "--port", str(self.port)]
        self.proc = subprocess.Popen([*cmd, *args], stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise AssertionError(f"server not healthy in 180 s:\n{log.read_text()[-3000:]}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def openvino_run(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A run directory whose best/ is the openvino fp32 candidate of the tiny Llama, measured
    with one thread and OpenVINO's u8 KV cache (a setting the server must apply)."""
    from llmopt.core.recipes import get_recipe
    from llmopt.core.schema import Candidate
    from llmopt.engines import get_engine
    from llmopt.model.info import inspect_model
    from llmopt.rundir.best import write_best

    info = inspect_model(tiny_llama_dir)
    art = tmp_path / "artifact"
    art.mkdir()
    get_engine("openvino").build(tiny_llama_dir, info, get_recipe("fp32"), art)
    cand = Candidate(
        "openvino-fp32-kv_cacheu8", "openvino", "fp32", {"threads": 1, "kv_cache": "u8"}
    )
    (tmp_path / "model.json").write_text(json.dumps(info.to_dict()))
    run = tmp_path / "run"
    write_best(run / "best", cand, art, tmp_path / "model.json", {})
    (run / "run.json").write_text("{}")
    return run


def test_a_run_that_chose_openvino_is_served_on_openvino(openvino_run, tmp_path):
    log = tmp_path / "serve.log"
    args = ["--max-num-seqs", "2", "--max-seq-len", "96", "--log-level", "info"]
    server = Server(str(openvino_run), args, log)
    try:
        client = server.client()
        done = client.completions.create(
            model="tiny-llama", prompt="The quick brown fox", max_tokens=8, temperature=0
        )
        assert done.usage.completion_tokens == 8 or done.choices[0].finish_reason == "stop"
        streamed = client.completions.create(
            model="tiny-llama",
            prompt="The quick brown fox",
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        assert text == done.choices[0].text  # greedy: the same tokens, streamed or not
        chat = dict(
            model="tiny-llama",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=8,
            temperature=0,
        )
        first = client.chat.completions.create(**chat).choices[0].message.content
        stream = client.chat.completions.create(**chat, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == first
    finally:
        server.kill()
    out = log.read_text()
    # The candidate's own engine and settings, not the source model on the native engine.
    assert "openvino generator: f32 inference, KV cache u8, 1 threads" in out
