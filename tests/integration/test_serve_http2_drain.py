"""The draining shutdown of `llmopt serve --http2` (hypercorn), over HTTP/2, as under uvicorn
(`test_serve_robust.py`, `test_serve_openai.py`): on SIGTERM or SIGINT, new requests on the same
HTTP/2 connection get 503 and /health says "draining"; streams still running at the end of the
window end with the `shutting_down` error event and `[DONE]`; streams that finish within it
complete; the process then exits by itself. smollm2-135m, as the uvicorn drain tests, so that a
generation lasts long enough on the CPU to be cut."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("h2")
pytest.importorskip("hypercorn")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from .test_serve_openai import COMMON, MODEL  # noqa: E402
from .test_serve_openai import Server as H1Server  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Server(H1Server):
    """The same subprocess as the uvicorn tests', with `--http2` (its health poll is HTTP/1.1,
    which hypercorn serves on the same port)."""

    def __init__(self, args: list[str], log):
        from llmopt.assets import prepare_builtin

        prepare_builtin(MODEL)
        super().__init__(MODEL, ["--http2", *args], log)


async def _stream(client, url: str, body: dict, started: asyncio.Event) -> tuple[str, list]:
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        lines = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                started.set()
        return r.http_version, lines


def _one_connection() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return httpx.AsyncClient(http1=False, http2=True, limits=limits, timeout=120)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_drain_over_h2_refuses_new_work_and_cuts_streams(tmp_path, sig):
    s = Server([*COMMON, "--drain-timeout", "3", "--log-level", "info"], tmp_path / "server.log")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "stream": True}
    body["ignore_eos"] = True

    async def main():
        async with _one_connection() as c:
            started = [asyncio.Event() for _ in range(2)]
            tasks = [asyncio.create_task(_stream(c, s.url, body, e)) for e in started]
            for e in started:
                await asyncio.wait_for(e.wait(), 120)
            t0 = time.monotonic()
            os.kill(s.proc.pid, sig)
            await asyncio.sleep(0.3)
            late = await c.post(
                s.url + "/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2}
            )
            health = await c.get(s.url + "/health")
            streams = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return t0, late, health, streams

    try:
        t0, late, health, streams = asyncio.run(main())
        assert late.http_version == "HTTP/2" and late.status_code == 503, late.text
        assert health.status_code == 503 and health.json()["status"] == "draining"
        for version, lines in streams:
            assert version == "HTTP/2"
            assert lines[-1] == "[DONE]", lines[-3:]
            err = json.loads(lines[-2])["error"]
            assert err["code"] == "shutting_down" and "--drain-timeout" in err["message"]
            tokens = sum(1 for x in lines[:-2] if json.loads(x).get("choices"))
            assert 0 < tokens < 480  # cut mid-way, not finished
        assert s.proc.wait(30) in (0, -sig, 128 + sig)  # exited by itself, promptly
        assert time.monotonic() - t0 < 20
    finally:
        s.kill()


def test_drain_over_h2_lets_streams_finish(tmp_path):
    s = Server([*COMMON, "--drain-timeout", "120"], tmp_path / "server.log")
    body = {"model": MODEL, "prompt": "Story:", "max_tokens": 40, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}

    async def main():
        async with _one_connection() as c:
            started = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(_stream(c, s.url, body, e)) for e in started]
            for e in started:
                await asyncio.wait_for(e.wait(), 120)
            os.kill(s.proc.pid, signal.SIGTERM)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    try:
        for version, lines in asyncio.run(main()):
            assert version == "HTTP/2" and lines[-1] == "[DONE]"
            chunks = [json.loads(x) for x in lines[:-1]]
            assert not any("error" in ch for ch in chunks)
            assert chunks[-1]["usage"]["completion_tokens"] == 40
        assert s.proc.wait(60) == 0
    finally:
        s.kill()


def test_second_signal_stops_at_once(tmp_path):
    """A second signal during a long drain window stops the server at once: the open stream
    is cut with the `shutting_down` event and [DONE], and the process exits within seconds, not
    the 120 s window."""
    s = Server([*COMMON, "--drain-timeout", "120"], tmp_path / "server.log")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "stream": True}
    body["ignore_eos"] = True

    async def main():
        async with _one_connection() as c:
            started = asyncio.Event()
            task = asyncio.create_task(_stream(c, s.url, body, started))
            await asyncio.wait_for(started.wait(), 120)
            os.kill(s.proc.pid, signal.SIGTERM)
            await asyncio.sleep(0.5)
            assert s.proc.poll() is None  # draining, not gone
            t0 = time.monotonic()
            os.kill(s.proc.pid, signal.SIGTERM)
            _, lines = await asyncio.wait_for(task, 60)
            return t0, lines

    try:
        t0, lines = asyncio.run(main())
        assert s.proc.wait(30) is not None and time.monotonic() - t0 < 15
        assert lines[-1] == "[DONE]", lines[-3:]
        assert json.loads(lines[-2])["error"]["code"] == "shutting_down"
        assert sum(1 for x in lines[:-2] if json.loads(x).get("choices")) < 480
    finally:
        s.kill()
