"""`llmopt serve smollm2-135m` as a real process under faults (issue 21): the drain window ends
with every cut stream told so (an error event and `[DONE]`) for SIGTERM and SIGINT alike; a bad
request on a keep-alive connection leaves the connection usable."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

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
