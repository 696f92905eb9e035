"""`llmopt serve` as a real process under faults (issue 21): the drain window ends with every cut
stream told so (an error event and `[DONE]`) for SIGTERM and SIGINT alike; text that is not
Unicode, in a prompt, a chat message or an embeddings input, escaped or as raw bytes, is a 400
that leaves the keep-alive connection usable; the API key read from `LLMOPT_API_KEY` stays out of
the process's command line (`ps`), and `--api-key` is warned about."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from .test_serve_openai import COMMON, MODEL, Server  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _stream_lines(url: str, body: dict, started: threading.Event, out: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                started.set()
        out.append((r.status_code, lines))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_drain_window_cuts_streams_with_an_error_and_done(tmp_path, sig):
    from llmopt.assets import prepare_builtin

    prepare_builtin(MODEL)
    s = Server(MODEL, [*COMMON, "--drain-timeout", "1"], tmp_path / "server.log")
    try:
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 480,
            "stream": True,
            "ignore_eos": True,
        }
        outs: list = []
        events = [threading.Event() for _ in range(2)]
        threads = [
            threading.Thread(target=_stream_lines, args=(s.url, body, e, outs)) for e in events
        ]
        for t in threads:
            t.start()
        for e in events:
            assert e.wait(120)
        t0 = time.monotonic()
        os.kill(s.proc.pid, sig)
        for t in threads:
            t.join(60)
        assert len(outs) == 2
        for status, lines in outs:
            assert status == 200 and lines[-1] == "[DONE]", lines[-3:]
            err = json.loads(lines[-2])["error"]
            assert err["code"] == "shutting_down" and "--drain-timeout" in err["message"]
            tokens = sum(1 for x in lines[:-2] if json.loads(x).get("choices"))
            assert 0 < tokens < 480  # cut mid-way, not finished
        assert s.proc.wait(30) in (0, -sig, 128 + sig)  # exited, by itself, promptly
        assert time.monotonic() - t0 < 15
    finally:
        s.kill()


def test_bad_text_keeps_the_connection_usable(tmp_path):
    from llmopt.assets import prepare_builtin

    prepare_builtin(MODEL)
    s = Server(MODEL, COMMON, tmp_path / "server.log")
    try:
        raw = b'{"model": "%s", "prompt": "a\\ud800", "max_tokens": 2}' % MODEL.encode()
        with httpx.Client(base_url=s.url, timeout=60) as c:  # one keep-alive connection
            for _ in range(7):
                r = c.post(
                    "/v1/completions", content=raw, headers={"content-type": "application/json"}
                )
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
                ok = c.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}
                )
                assert ok.status_code == 200, ok.text
    finally:
        s.kill()


TINY = ["--max-num-seqs", "2", "--max-seq-len", "128", "--log-level", "warning"]


def _keep_alive_rounds(port: int, bad: list[tuple[str, bytes, str]], good: tuple[str, dict]):
    """On ONE HTTP/1.1 connection: each bad body gets 400 naming its field, and the good
    request after it is served on the same socket (the server did not drop the connection)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"content-type": "application/json"}
    try:
        conn.connect()
        sock = conn.sock
        for _ in range(3):
            for path, body, param in bad:
                conn.request("POST", path, body=body, headers=headers)
                r = conn.getresponse()
                err = json.loads(r.read())["error"]
                assert r.status == 400 and err["param"] == param, (path, body, err)
                assert err["code"] == "invalid_text"
                assert r.getheader("connection", "").lower() != "close"
                conn.request("POST", good[0], body=json.dumps(good[1]), headers=headers)
                r = conn.getresponse()
                assert r.status == 200, r.read()
                r.read()
                assert conn.sock is sock, "the server closed the keep-alive connection"
    finally:
        conn.close()


def test_bad_text_keeps_every_endpoint_usable(
    tiny_llama_dir, tiny_bert_dir, serve_process, tmp_path
):
    lm = serve_process(str(tiny_llama_dir), TINY, tmp_path / "lm.log")
    try:
        name = tiny_llama_dir.name.encode()
        bad = [
            ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800"}' % name, "prompt"),
            ("/v1/completions", b'{"model": "%s", "prompt": "a\xed\xa0\x80"}' % name, "prompt"),
            (
                "/v1/chat/completions",
                b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}' % name,
                "messages.0.content",
            ),
            (
                "/v1/chat/completions",
                b'{"model": "%s", "messages": [{"role": "user", "content": "\xed\xb0\x80"}]}'
                % name,
                "messages.0.content",
            ),
        ]
        good = {"model": tiny_llama_dir.name, "prompt": "Hi", "max_tokens": 1}
        _keep_alive_rounds(lm.port, bad, ("/v1/completions", good))
    finally:
        lm.kill()
    emb = serve_process(str(tiny_bert_dir), ["--log-level", "warning"], tmp_path / "emb.log")
    try:
        name = tiny_bert_dir.name.encode()
        bad = [
            ("/v1/embeddings", b'{"model": "%s", "input": "\\ud800"}' % name, "input"),
            (
                "/v1/embeddings",
                b'{"model": "%s", "input": ["ok", "\xed\xa0\x80"]}' % name,
                "input.1",
            ),
        ]
        good = {"model": tiny_bert_dir.name, "input": ["hello"]}
        _keep_alive_rounds(emb.port, bad, ("/v1/embeddings", good))
    finally:
        emb.kill()


def test_api_key_from_the_environment_stays_out_of_ps(
    tiny_llama_dir, serve_process, tmp_path, monkeypatch
):
    """`--api-key KEY` shows in `ps` to every user of the machine; LLMOPT_API_KEY is the route
    the docs give, and it guards /v1 the same. The flag still works, with a warning."""
    secret = "sk-from-the-environment"
    monkeypatch.setenv("LLMOPT_API_KEY", secret)
    s = serve_process(str(tiny_llama_dir), TINY, tmp_path / "env.log")
    try:
        assert secret.encode() not in Path(f"/proc/{s.proc.pid}/cmdline").read_bytes()
        assert httpx.get(s.url + "/v1/models").status_code == 401
        auth = {"Authorization": f"Bearer {secret}"}
        assert httpx.get(s.url + "/v1/models", headers=auth).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # open, for load balancers
    finally:
        s.kill()
    assert "visible to every user" not in (tmp_path / "env.log").read_text()
    monkeypatch.delenv("LLMOPT_API_KEY")
    s = serve_process(str(tiny_llama_dir), [*TINY, "--api-key", "sk-flag"], tmp_path / "flag.log")
    try:
        auth = {"Authorization": "Bearer sk-flag"}
        assert httpx.get(s.url + "/v1/models", headers=auth).status_code == 200
    finally:
        s.kill()
    log = (tmp_path / "flag.log").read_text()
    assert "--api-key is visible to every user" in log and "LLMOPT_API_KEY" in log
