"""`llmopt serve --http2` as a real process (hypercorn) on the tiny random Llama and BERT, driven
by a real HTTP/2 client (httpx with h2): cleartext h2c by prior knowledge and by Upgrade, TLS
with ALPN on a certificate made here, completions, chat streaming, embeddings, /metrics and
/health, concurrent streams multiplexed on one connection, and HTTP/1.1 clients on the same
port. The drain over HTTP/2 is in `test_serve_http2_drain.py`."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("h2")
pytest.importorskip("hypercorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.integration

ARGS = ["--max-num-seqs", "4", "--max-seq-len", "128", "--log-level", "warning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cert(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    from llmopt.deploy.validate import self_signed_cert

    made = self_signed_cert(folder, "cert.pem", "key.pem")
    assert made is not None, "cryptography (a dev dependency) or openssl makes the certificate"
    return made


class Server:
    """A `llmopt serve` subprocess on a free loopback port, healthy before it is returned."""

    def __init__(self, model: str | Path, args: list[str], log: Path, verify=True):
        self.port = free_port()
        self.tls = "--ssl-certfile" in args
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self.verify = verify
        cmd = [sys.executable, "-m", "llmopt.cli.main", "serve", str(model)]
        cmd += ["--port", str(self.port), *args]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{log.read_text()}")
            try:
                r = httpx.get(self.url + "/health", timeout=1, verify=verify)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise AssertionError(f"server not healthy in 180 s:\n{log.read_text()[-3000:]}")

    def h2(self, **kw) -> httpx.Client:
        """An HTTP/2-only client: prior knowledge on cleartext, ALPN h2 over TLS."""
        return httpx.Client(http1=False, http2=True, verify=self.verify, timeout=120, **kw)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def llama_dir(_tiny_llama_master, tmp_path_factory) -> Path:
    return Path(shutil.copytree(_tiny_llama_master, tmp_path_factory.mktemp("m") / "tiny-llama"))


@pytest.fixture(scope="module")
def h2c_server(llama_dir, tmp_path_factory):
    s = Server(llama_dir, [*ARGS, "--http2"], tmp_path_factory.mktemp("h2c") / "server.log")
    yield s
    s.kill()


def _sse(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_h2c_prior_knowledge_completion_health_metrics(h2c_server):
    with h2c_server.h2() as c:
        r = c.post(
            h2c_server.url + "/v1/completions",
            json={"model": "tiny-llama", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True},
        )
        assert r.http_version == "HTTP/2", r.http_version
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        h = c.get(h2c_server.url + "/health")
        assert h.http_version == "HTTP/2" and h.json()["status"] == "ok"
        m = c.get(h2c_server.url + "/metrics")
        assert m.http_version == "HTTP/2" and m.status_code == 200
        assert "llmopt_engine_decode_steps_total" in m.text
        # A request body the server refuses still gets its OpenAI error body over h2.
        bad = c.post(h2c_server.url + "/v1/completions", json={"model": "tiny-llama"})
        assert bad.http_version == "HTTP/2" and bad.status_code == 400
        assert bad.json()["error"]["type"] == "invalid_request_error"


def test_h2c_chat_streaming(h2c_server):
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        h2c_server.h2() as c,
        c.stream("POST", h2c_server.url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.http_version == "HTTP/2" and r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert deltas[0].get("role") == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"


def test_http11_clients_share_the_port(h2c_server):
    r = httpx.post(
        h2c_server.url + "/v1/completions",
        json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2},
        timeout=120,
    )
    assert r.http_version == "HTTP/1.1" and r.status_code == 200


def test_h2c_upgrade_from_http11(h2c_server):
    """A client that starts in HTTP/1.1 and asks `Upgrade: h2c` is switched to HTTP/2: the
    answer to its first request comes back on stream 1 of an HTTP/2 connection (RFC 7540 3.2;
    httpx does not upgrade, so the h2 library drives the exchange by hand)."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    settings = conn.initiate_upgrade_connection()
    request = (
        f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{h2c_server.port}\r\n"
        "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        f"HTTP2-Settings: {settings.decode()}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", h2c_server.port), timeout=30) as sock:
        sock.sendall(request.encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
        head, rest = buf.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head
        assert b"upgrade: h2c" in head.lower()
        sock.sendall(conn.data_to_send())
        status, body, ended = None, b"", False
        pending = rest
        while not ended:
            for ev in conn.receive_data(pending):
                if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == 1:
                    status = dict(ev.headers)[b":status"]
                elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == 1:
                    body += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, 1)
                elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == 1:
                    ended = True
            sock.sendall(conn.data_to_send())
            if not ended:
                pending = sock.recv(65536)
                assert pending, "connection closed before stream 1 ended"
    assert status == b"200"
    assert json.loads(body)["status"] == "ok"


def test_concurrent_streams_multiplexed_on_one_connection(h2c_server):
    """Four streamed completions at once over a pool of ONE connection: all four are generating
    at the same time (each has its first token before any has finished), which one HTTP/1.1
    connection cannot carry, and the server sees one established connection from us."""
    import psutil

    n = 4
    body = {"model": "tiny-llama", "prompt": "Once", "max_tokens": 60, "ignore_eos": True}
    body |= {"stream": True}
    firsts: list[float] = []
    ends: list[float] = []
    conns_seen: list[int] = []

    def server_conns() -> int:
        # Connections the server process holds on its port (the client side is ours only).
        return sum(
            1
            for c in psutil.Process(h2c_server.proc.pid).net_connections("tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == h2c_server.port
        )

    async def one(client) -> tuple[str, list[str]]:
        async with client.stream("POST", h2c_server.url + "/v1/completions", json=body) as r:
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    if not events:
                        firsts.append(time.monotonic())
                        conns_seen.append(server_conns())
                    events.append(line[6:])
            ends.append(time.monotonic())
            return r.http_version, events

    async def main():
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(http1=False, http2=True, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(n)))

    results = asyncio.run(main())
    assert [v for v, _ in results] == ["HTTP/2"] * n
    for _, events in results:
        assert events[-1] == "[DONE]" and len(events) == 61  # 60 tokens, then [DONE]
    assert len(firsts) == n and max(firsts) < min(ends), "the streams did not overlap"
    assert conns_seen and max(conns_seen) == 1, conns_seen


def test_tls_alpn_h2_and_http11(llama_dir, tmp_path):
    cert, key = make_cert(tmp_path)
    ctx = ssl.create_default_context(cafile=str(cert))
    args = [*ARGS, "--http2", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    s = Server(llama_dir, args, tmp_path / "server.log", verify=ctx)
    try:
        body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
        with httpx.Client(http2=True, verify=ctx, timeout=120) as c:  # ALPN offers h2, http/1.1
            r = c.post(s.url + "/v1/completions", json=body)
            assert r.http_version == "HTTP/2" and r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] == 3
        with httpx.Client(verify=ctx, timeout=120) as c:  # ALPN offers http/1.1 only
            r = c.post(s.url + "/v1/completions", json=body)
            assert r.http_version == "HTTP/1.1" and r.status_code == 200
        with pytest.raises(httpx.ConnectError):  # the certificate is checked, not ignored
            httpx.get(s.url + "/health", timeout=10)
    finally:
        s.kill()
    assert "https://127.0.0.1" in s.log.read_text()


def test_tls_without_http2_is_uvicorn_over_tls(llama_dir, tmp_path):
    cert, key = make_cert(tmp_path)
    ctx = ssl.create_default_context(cafile=str(cert))
    args = [*ARGS, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    s = Server(llama_dir, args, tmp_path / "server.log", verify=ctx)
    try:
        with httpx.Client(http2=True, verify=ctx, timeout=120) as c:
            r = c.get(s.url + "/health")
            assert r.status_code == 200 and r.http_version == "HTTP/1.1"  # uvicorn: no h2
    finally:
        s.kill()
    assert "(HTTP/1.1, uvicorn)" in s.log.read_text()


def test_embeddings_over_h2(tiny_bert_dir, tmp_path):
    s = Server(tiny_bert_dir, ["--http2", "--log-level", "warning"], tmp_path / "server.log")
    try:
        with s.h2() as c:
            r = c.post(
                s.url + "/v1/embeddings",
                json={"model": "tiny-bert", "input": ["the cat", "a dog", "it was"]},
            )
        assert r.http_version == "HTTP/2" and r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2]
        assert all(len(d["embedding"]) == 64 for d in data)
    finally:
        s.kill()


def test_early_refusal_keeps_the_h2_connection(llama_dir, tmp_path):
    """A request refused before its body has all arrived (here a wrong API key: 401 on the
    headers) must not take down the HTTP/2 connection when the rest of its body follows: the
    next request on the same connection is answered. (hypercorn alone drops the connection
    there; `RequestBodyFirst` is the fix.) The h2 library drives the frames by hand so that the
    body surely arrives after the refusal was decided."""
    import h2.config
    import h2.connection
    import h2.events

    s = Server(llama_dir, [*ARGS, "--http2", "--api-key", "sk-test"], tmp_path / "server.log")
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:

            def exchange(until_stream: int) -> dict[int, tuple[bytes | None, bytes]]:
                got: dict[int, tuple[bytes | None, bytes]] = {}
                ended: set[int] = set()
                while until_stream not in ended:
                    sock.sendall(conn.data_to_send())
                    data = sock.recv(65536)
                    assert data, f"server closed the connection:\n{s.log.read_text()[-2000:]}"
                    for ev in conn.receive_data(data):
                        if isinstance(ev, h2.events.ResponseReceived):
                            got[ev.stream_id] = (dict(ev.headers)[b":status"], b"")
                        elif isinstance(ev, h2.events.DataReceived):
                            st, body = got[ev.stream_id]
                            got[ev.stream_id] = (st, body + ev.data)
                            conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                        elif isinstance(ev, h2.events.StreamEnded):
                            ended.add(ev.stream_id)
                sock.sendall(conn.data_to_send())
                return got

            body = json.dumps({"model": "tiny-llama", "prompt": "x" * 3000, "max_tokens": 1})
            head = [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http")]
            head += [(":authority", f"127.0.0.1:{s.port}"), ("content-type", "application/json")]
            head += [("authorization", "Bearer wrong")]
            conn.send_headers(1, head)  # headers only: the body comes after the refusal
            sock.sendall(conn.data_to_send())
            time.sleep(0.5)
            conn.send_data(1, body[:1000].encode())
            sock.sendall(conn.data_to_send())
            time.sleep(0.2)
            conn.send_data(1, body[1000:].encode(), end_stream=True)
            got = exchange(1)
            assert got[1][0] == b"401"
            time.sleep(0.3)  # the server has handled the late DATA frames by now
            conn.send_headers(
                3,
                [
                    (":method", "GET"),
                    (":path", "/health"),
                    (":scheme", "http"),
                    (":authority", f"127.0.0.1:{s.port}"),
                ],
                end_stream=True,
            )
            got = exchange(3)
            assert got[3][0] == b"200" and json.loads(got[3][1])["status"] == "ok"
    finally:
        s.kill()
    assert "Unhandled exception" not in s.log.read_text()


def test_bench_serve_http2_multiplexes_one_connection(h2c_server):
    """`llmopt bench serve --http2`: every request over HTTP/2, and the output says so."""
    cmd = [sys.executable, "-m", "llmopt.cli.main", "bench", "serve", "--url", h2c_server.url]
    cmd += ["--http2", "--values", "4", "--num-requests", "8", "--repeats", "1"]
    cmd += ["--input-len", "8", "--output-len", "6", "--ignore-eos", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout)
    assert res["http_version"] == "HTTP/2" and res["connections"] == "one, multiplexed"
    run = res["points"][0]["runs"][0]
    assert run["metrics"]["completed"] == 8 and run["metrics"]["failed"] == 0
    table = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=300, check=False)
    assert table.returncode == 0 and "protocol: HTTP/2, connections: one, multiplexed" in " ".join(
        table.stdout.split()
    )


@pytest.mark.skipif(
    shutil.which("nginx") is None, reason="nginx not installed (apt-get install nginx-light)"
)
def test_bundle_nginx_speaks_h2_to_clients(h2c_server, tmp_path):
    """The deploy bundle's TLS proxy config, run by this machine's nginx in front of a real
    server: clients get HTTP/2 (ALPN), streamed chat arrives through it, and nginx reaches the
    server over HTTP/1.1. Only ports, paths and (for an nginx older than 1.25.1) the spelling of
    the http2 switch are changed, the same mapping the bundle's `nginx -t` check makes."""
    from llmopt.deploy import templates as T
    from llmopt.deploy.validate import _HTTP2_DIRECTIVE, _nginx_version

    exe = shutil.which("nginx")
    cert, key = make_cert(tmp_path)
    shutil.copy(cert, tmp_path / "tls.crt")
    shutil.copy(key, tmp_path / "tls.key")
    port = free_port()
    conf = T.nginx_tls_conf(f"127.0.0.1:{h2c_server.port}").replace(T.NGINX_CERT_DIR, str(tmp_path))
    conf = conf.replace("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;")
    if _nginx_version(exe) < _HTTP2_DIRECTIVE:
        conf = conf.replace("ssl;\n    http2 on;", "ssl http2;")
    temps = "".join(
        f"    {d}_temp_path {tmp_path}/{d};\n"
        for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (tmp_path / "llm.conf").write_text(conf)
    (tmp_path / "nginx.conf").write_text(
        f"events {{}}\nhttp {{\n{temps}    access_log off;\n    include {tmp_path}/llm.conf;\n}}\n"
    )
    glob = (
        f"daemon off; master_process off; pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log;"
    )
    proc = subprocess.Popen(
        [exe, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", glob]
    )
    ctx = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                h = httpx.get(f"https://127.0.0.1:{port}/health", verify=ctx, timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "error.log"
                ).read_text()
                time.sleep(0.2)
        assert h.status_code == 200
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}]}
        body |= {"max_tokens": 8, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(http1=False, http2=True, verify=ctx, timeout=120) as c,
            c.stream("POST", f"https://127.0.0.1:{port}/v1/chat/completions", json=body) as r,
        ):
            assert r.http_version == "HTTP/2" and r.status_code == 200
            events = _sse(r.iter_lines())
        assert events[-1] == "[DONE]" and len(events) == 10  # role chunk, 8 tokens, [DONE]
    finally:
        proc.terminate()
        proc.wait(10)
