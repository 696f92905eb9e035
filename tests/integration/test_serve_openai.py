"""`llmopt serve smollm2-135m` as a real process, driven with the official `openai` client:
completions and chat, streamed and not, concurrency, overload (429), client disconnect (KV
blocks freed), malformed requests (OpenAI error bodies), API key, shutdown during load."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
# Small limits keep the test fast on 2 cores and make capacity easy to exceed: 4 running + 4 queued.
COMMON = [
    "--max-num-seqs",
    "4",
    "--max-queue",
    "4",
    "--num-blocks",
    "160",
    "--max-seq-len",
    "512",
    "--log-level",
    "warning",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `llmopt serve` subprocess on a free loopback port; always killed by its fixture."""

    def __init__(self, model: str, args: list[str], log: Path):
        self.args = args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "llmopt.cli.main",
            "serve",
            model,
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"server exited {self.proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise AssertionError(f"server not healthy in 180 s:\n{log.read_text()[-3000:]}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=kw.pop("api_key", "none"),
            max_retries=0,
            timeout=120,
            **kw,
        )

    def metric(self, name: str, default: float | None = None) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        if default is None:
            raise KeyError(name)
        return default

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def server(request, tmp_path_factory):
    """The same server twice: the engine in a thread of the API process, then in its own."""
    from llmopt.assets import prepare_builtin

    prepare_builtin(MODEL)  # once, in this process, before the server needs it
    extra = ["--engine-process"] if request.param == "engine-process" else []
    s = Server(MODEL, COMMON + extra, tmp_path_factory.mktemp("serve") / "server.log")
    yield s
    s.kill()


def test_models_and_completion(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    engine = ("prefill_tokens", "prefill_seconds", "decode_steps", "step_seconds")
    before = {k: server.metric(f"llmopt_engine_{k}_total") for k in engine}
    r = c.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2
    )
    ch = r.choices[0]
    assert "Paris" in ch.text and ch.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == len(ch.logprobs.tokens)
    assert all(len(t) >= 1 for t in ch.logprobs.top_logprobs)
    # The engine-time counters (in both engine modes) saw this request's prefill and decodes.
    d = {k: server.metric(f"llmopt_engine_{k}_total") - v for k, v in before.items()}
    assert d["prefill_tokens"] >= 5 and d["decode_steps"] >= r.usage.completion_tokens - 1
    assert 0 < d["prefill_seconds"] < d["step_seconds"]
    # Each process froze its heap once warm (the model's objects, out of every collection's
    # way) and its collections are counted: the engine's, and the server's own where the
    # engine has a process of its own
    text = httpx.get(server.url + "/metrics").text
    frozen = {
        p: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        for p in ("engine", "server")
        if line.startswith(f'llmopt_gc_frozen_objects{{process="{p}"}} ')
    }
    assert frozen["engine"] > 50_000, frozen
    assert ("server" in frozen) == ("--engine-process" in server.args), frozen
    assert 'llmopt_gc_collections_total{generation="2",process="engine"}' in text


def test_echo_returns_prompt_logprobs(server):
    c = server.client()
    r = c.completions.create(
        model=MODEL,
        prompt="The capital of France is Paris",
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=3,
    )
    ch, n = r.choices[0], r.usage.prompt_tokens
    lp = ch.logprobs
    assert ch.text.startswith("The capital of France is Paris") and len(lp.tokens) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 3 for t in lp.top_logprobs[1:])
    assert (
        lp.tokens[n - 1] == " Paris"
        and lp.top_logprobs[n - 1][" Paris"] == lp.token_logprobs[n - 1]
    )
    # Scored in the prefill = generated by the decode step: the same log-probability.
    g = c.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=1
    )
    assert g.choices[0].logprobs.tokens == [" Paris"]
    assert lp.token_logprobs[n - 1] == pytest.approx(
        g.choices[0].logprobs.token_logprobs[0], abs=2e-3
    )


def test_settings_not_given_come_from_the_plan(server):
    from llmopt.serve.defaults import plan_values

    got = httpx.get(server.url + "/health").json()["settings"]
    given = {"max_num_seqs": 4, "num_blocks": 160, "max_seq_len": 512}  # COMMON's flags
    want = plan_values(MODEL, given)
    for name, value in given.items():
        assert got[name] == {"value": value, "source": "flag"}
    for name in ("max_num_batched_tokens", "block_size"):
        assert got[name] == {"value": want.values[name], "source": "plan"}
    line = next(x for x in server.log.read_text().splitlines() if x.startswith("settings: "))
    assert (
        f"block_size {want.values['block_size']} (plan)" in line and "max_num_seqs 4 (flag)" in line
    )


def test_chat_stream_with_usage_matches_non_stream(server):
    c = server.client()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    stream = c.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content and "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[
        0
    ].finish_reason


def test_stop_string_seed_and_completion_stream(server):
    c = server.client()
    r = c.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]
    )
    assert r.choices[0].finish_reason == "stop" and " 7" not in r.choices[0].text
    assert r.choices[0].text.startswith(" 5, 6,")
    same = [
        c.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0.9, seed=7
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert same[0] == same[1]
    pieces = [
        ch.choices[0].text
        for ch in c.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=10,
            temperature=0.9,
            seed=7,
            stream=True,
        )
    ]
    assert "".join(pieces) == same[0]


def test_concurrent_clients(server):
    c = server.client()
    out: dict[int, object] = {}

    def one(i: int) -> None:
        out[i] = c.completions.create(
            model=MODEL,
            prompt=f"Item {i}: the",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(out) == list(range(6))
    assert all(r.usage.completion_tokens == 8 for r in out.values())


def test_overload_429_and_no_accepted_request_lost(server):
    c = server.client()
    ok, rejected, errors = [], [], []

    def one(i: int) -> None:
        try:
            r = c.completions.create(
                model=MODEL,
                prompt=f"Count {i}:",
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            ok.append(r)
        except openai.RateLimitError as e:
            rejected.append(e)
        except Exception as e:  # anything else is a lost request
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors[:3]
    assert len(ok) + len(rejected) == 20 and rejected and len(ok) >= 8
    assert all(r.usage.completion_tokens == 16 for r in ok)  # every accepted one completed
    e = rejected[0]
    assert int(e.response.headers["retry-after"]) >= 1
    assert e.body["code"] == "rate_limit_exceeded"


def test_client_disconnect_frees_kv_blocks(server):
    total = server.metric("llmopt_kv_cache_blocks")
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10  # 400 tokens would take far longer than this
    while time.monotonic() < deadline:
        if (
            server.metric("llmopt_num_requests_running") == 0
            and server.metric("llmopt_kv_cache_free_blocks") == total
        ):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the disconnected request kept running or kept its KV blocks")
    assert (
        server.metric('llmopt_requests_total{endpoint="completions",outcome="disconnected"}') >= 1
    )


def test_non_streamed_client_disconnect_cancels(server):
    total = server.metric("llmopt_kv_cache_blocks")
    gone = 'llmopt_requests_total{endpoint="completions",outcome="disconnected"}'
    before = server.metric(gone, default=0.0)
    body = {"model": MODEL, "prompt": "Write a long essay.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (
            server.metric("llmopt_num_requests_running") == 0
            and server.metric("llmopt_kv_cache_free_blocks") == total
            and server.metric(gone, default=0.0) > before
        ):
            return
        time.sleep(0.1)
    pytest.fail("the abandoned request kept running or kept its KV blocks")


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "temperature": 3.5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        # Too long for the context: the prompt alone, or with max_tokens (what to shorten).
        ({"model": MODEL, "prompt": "word " * 600, "max_tokens": 4}, 400, "prompt"),
        ({"model": MODEL, "prompt": "word " * 100, "max_tokens": 500}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "extra_body": {"top_p": 0}}, 400, "top_p"),
    ],
)
def test_malformed_requests(server, kwargs, status, param):
    with pytest.raises(openai.APIStatusError) as ei:
        server.client().completions.create(**kwargs)
    assert ei.value.status_code == status
    err = ei.value.body
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_malformed_json_and_chat_errors(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as ei:
        server.client().chat.completions.create(model=MODEL, messages=[])
    assert ei.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):  # an LM server has no embeddings
        server.client().embeddings.create(model=MODEL, input="x")


def test_shutdown_during_load_drains(tmp_path):
    args = [*COMMON, "--api-key", "sk-test", "--drain-timeout", "120"]  # slow shared CPUs
    s = Server(MODEL, args, tmp_path / "server.log")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        c = s.client(api_key="sk-test")
        started = threading.Semaphore(0)
        results: list[tuple[str | None, int]] = []
        errors: list[Exception] = []

        def one(i: int) -> None:
            try:
                stream = c.completions.create(
                    model=MODEL,
                    prompt=f"Story {i}:",
                    max_tokens=40,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                n, reason, usage = 0, None, None
                for ch in stream:
                    if ch.choices:
                        n += 1
                        reason = ch.choices[0].finish_reason or reason
                        if n == 1:
                            started.release()
                    usage = ch.usage or usage
                results.append((reason, usage.completion_tokens))
            except Exception as e:
                errors.append(e)
                started.release()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=120)
        os.kill(s.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(openai.APIStatusError) as ei:  # new work is refused while draining
            c.completions.create(model=MODEL, prompt="late", max_tokens=2)
        assert ei.value.status_code == 503
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert results == [("length", 40)] * 3  # every in-flight request completed
        assert s.proc.wait(60) == 0
    finally:
        s.kill()


def test_engine_process_death_fails_requests_and_health(tmp_path):
    """`--engine-process`: the engine core killed under the server: open and new requests get a
    500 with the reason (none hangs), /health turns 503 with the exit code."""
    s = Server(MODEL, COMMON + ["--engine-process"], tmp_path / "server.log")
    try:
        h = httpx.get(s.url + "/health").json()
        assert h["engine"]["mode"] == "process" and h["engine"]["alive"]
        pid = h["engine"]["pid"]
        assert pid != s.proc.pid
        c = s.client()
        assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage
        errors: list[Exception] = []

        def long_one() -> None:
            try:
                c.completions.create(
                    model=MODEL, prompt="Go on:", max_tokens=400, extra_body={"ignore_eos": True}
                )
            except Exception as e:
                errors.append(e)

        t = threading.Thread(target=long_one)
        t.start()
        time.sleep(1.0)  # in flight
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        assert not t.is_alive() and len(errors) == 1
        assert isinstance(errors[0], openai.InternalServerError), errors[0]
        with pytest.raises(openai.InternalServerError, match="engine process exited"):
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "engine_dead"
        assert "code -9" in r.json()["engine"]["last_error"]
    finally:
        s.kill()
