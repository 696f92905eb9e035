"""Fixtures the integration tests share: `llmopt serve` as a real server process (`serve_process`
for any model, `minilm_server` for the built-in MiniLM shared by a session)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

MINILM = "minilm-l6"


def _httpx():
    import httpx  # lazy: the serve extra's client, skipped where it is missing

    return httpx


class ServeProcess:
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
                if _httpx().get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except _httpx().HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise AssertionError(f"server not healthy in 180 s:\n{log.read_text()[-3000:]}")

    def client(self):
        import openai  # lazy: only the tests that talk to the server need the client

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def serve_process() -> Iterator[type[ServeProcess]]:
    """`ServeProcess(model, args, log)`: a `llmopt serve` subprocess on a free loopback port."""
    yield ServeProcess


@pytest.fixture(scope="session")
def minilm_server(
    llmopt_test_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The URL of `llmopt serve minilm-l6` on a free local port, started once per session (the
    embeddings server and bench tests share it; they read its metrics as differences). A 20 ms
    batching window, so that requests sent together surely meet in one batch."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from llmopt.assets import prepare_builtin

    prepare_builtin(MINILM)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve-minilm") / "server.log"
    cmd = [sys.executable, "-m", "llmopt.cli.main", "serve", MINILM, "--port", str(port)]
    cmd += ["--embed-batch-window-ms", "20", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield url
    finally:
        proc.kill()
        proc.wait(10)
