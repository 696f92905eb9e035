"""Fixtures the integration tests share: `llmopt serve minilm-l6` as a real server process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

MINILM = "minilm-l6"


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
