"""The faults and bad inputs of issue 21 through the real app (in process, Starlette's
TestClient, tiny random models): each a regression test, each followed by the block invariant
(free + held by the running = capacity, nothing held with nothing running)."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from llmopt.serve.settings import ServeSettings  # noqa: E402


@pytest.fixture
def client(tiny_llama_dir, make_client):
    with make_client(tiny_llama_dir) as c:
        yield c


def _err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


def test_seed_overflow_leaks_no_blocks(client, settle):
    """Fault 1: a seed the random generator cannot take, with a long prompt. It used to reach
    the engine, which took the blocks and then refused: four such requests left the cache
    nearly empty for good while /health said ok."""
    name = client.ctx.served_name
    long_prompt = [40 + i % 50 for i in range(100)]
    bodies = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 15}]}),
        ("/v1/completions", {"prompt": long_prompt}),
    ]
    for path, body in bodies:
        for seed, n in ((2**64, 1), (2**64 - 1, 2), (-(2**63) - 1, 1), (2**70, 1)):
            r = client.post(
                path, json=body | {"model": name, "seed": seed, "n": n, "max_tokens": 4}
            )
            if seed > 2**64 - 1 or seed < -(2**63):
                assert _err(r, 400)["param"] == "seed"
            else:  # the top of the range with n=2: choice 1's seed wraps around
                assert r.status_code == 200, r.text
            settle(client.ctx)
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["engine"]["leaked_blocks"] == 0
    assert "llmopt_kv_cache_leaked_blocks 0.0" in client.get("/metrics").text
    r = client.post("/v1/completions", json={"model": name, "prompt": long_prompt, "max_tokens": 8})
    assert r.status_code == 200, r.text


def test_tiny_temperature_breaks_nobody(client, settle):
    """Fault 2: temperature 1e-40 (allowed: 0-2) gave 500 and cut the streams batched with it.
    Below the floor it is greedy; the streams beside it finish."""
    name = client.ctx.served_name
    base = {"model": name, "max_tokens": 5, "ignore_eos": True}
    greedy = client.post("/v1/completions", json=base | {"prompt": "x", "temperature": 0})
    results: dict[str, object] = {}

    def stream(i):
        body = base | {"prompt": f"stream {i}", "stream": True, "max_tokens": 30}
        with client.stream("POST", "/v1/completions", json=body) as r:
            results[f"s{i}"] = (r.status_code, [x for x in r.iter_lines() if x])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for temp in (1e-40, 1e-38, 5e-324):
        r = client.post("/v1/completions", json=base | {"prompt": "x", "temperature": temp})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    for t in threads:
        t.join()
    for status, lines in results.values():
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert not any('"error"' in x for x in lines), lines
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    settle(client.ctx)


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", '{"model": "M", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            '{"model": "M", "messages": [{"role": "user", "content": "\\udfff"}]}',
            "messages.0.content",
        ),
        ("/v1/completions", '{"model": "M", "prompt": ["ok", "\\ud83d"]}', "prompt.1"),
        ("/v1/completions", '{"model": "M", "prompt": "x", "stop": ["\\ud800"]}', "stop.0"),
    ],
)
def test_lone_surrogates_are_400(client, path, raw, param, settle):
    """A lone surrogate gave 500 TypeError and closed the connection."""
    body = raw.replace('"M"', json.dumps(client.ctx.served_name)).encode()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    e = _err(r, 400)
    assert e["param"] == param and e["code"] == "invalid_text"
    # A valid pair (an emoji spelled as two escapes) is text like any other.
    name = json.dumps(client.ctx.served_name)
    ok = '{"model": ' + name + ', "prompt": "a\\ud83d\\ude00b", "max_tokens": 2}'
    r = client.post(
        "/v1/completions", content=ok.encode(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    settle(client.ctx)


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", b'{"model": M, "prompt": "a\xed\xa0\x80b", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"model": M, "messages": [{"role": "user", "content": "\xed\xbf\xbf"}]}',
            "messages.0.content",
        ),
        # An emoji as CESU-8 (each half of its surrogate pair as raw bytes): not UTF-8 either.
        (
            "/v1/completions",
            b'{"model": M, "prompt": ["ok", "\xed\xa0\xbd\xed\xb8\x80"]}',
            "prompt.1",
        ),
    ],
    ids=["prompt", "chat", "cesu8"],
)
def test_raw_surrogate_bytes_are_400_too(client, path, raw, param, settle):
    """The surrogate as raw bytes (ED A0 80) instead of an escape: not UTF-8, but the JSON parser
    reads bytes with `surrogatepass`, so it reached the tokenizer as a lone surrogate (500)."""
    body = raw.replace(b"M", json.dumps(client.ctx.served_name).encode(), 1)
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    e = _err(r, 400)
    assert e["param"] == param and e["code"] == "invalid_text"
    # A UTF-16 body, which the parser also takes (detected by its zero bytes), alike.
    doc = json.dumps({"model": client.ctx.served_name, "prompt": "x\ud800"}, ensure_ascii=False)
    r = client.post(
        "/v1/completions",
        content=doc.encode("utf-16-le", "surrogatepass"),
        headers={"content-type": "application/json"},
    )
    assert _err(r, 400)["param"] == "prompt"
    # Other bytes that are not UTF-8 fail the parse: 400 with OpenAI's body, `param` null.
    r = client.post(
        "/v1/completions",
        content=b'{"model": "m", "prompt": "\xff"}',
        headers={"content-type": "application/json"},
    )
    assert _err(r, 400)["param"] is None
    # Nested deeper than the parser goes, with a surrogate inside: the guard's own parse
    # raised RecursionError out of the middleware (the connection was dropped).
    deep = b"[" * 100_000 + b'"\\ud800"' + b"]" * 100_000
    r = client.post(
        "/v1/completions",
        content=b'{"model": "m", "prompt": ' + deep + b"}",
        headers={"content-type": "application/json"},
    )
    assert _err(r, 400)["param"] is None
    settle(client.ctx)


def test_requests_that_can_never_fit_are_400_not_429(client, settle):
    """n=16 (inside the documented limit) or 20 prompts, on a server that takes 4 sequences at
    a time (2 running + 2 queued), got a 429 that could never clear."""
    name = client.ctx.served_name
    e = _err(client.post("/v1/completions", json={"model": name, "prompt": "x", "n": 16}), 400)
    assert e["param"] == "n" and e["code"] == "too_many_sequences" and "at most 4" in e["message"]
    e = _err(client.post("/v1/completions", json={"model": name, "prompt": ["x"] * 20}), 400)
    assert e["param"] == "prompt"
    r = client.post("/v1/completions", json={"model": name, "prompt": ["x"] * 4, "max_tokens": 2})
    assert r.status_code == 200, r.text
    settle(client.ctx)


def test_json_errors_have_no_position_as_param(client):
    r = client.post(
        "/v1/completions", content=b'{"model": 1,,}', headers={"content-type": "application/json"}
    )
    e = _err(r, 400)
    assert e["param"] is None and "not valid JSON" in e["message"]


def test_param_is_a_field_of_the_body(client, embed_client):
    """`param` names a field the client sent (or a required one it did not), never the member
    of a union pydantic tried (`messages.0.content.str`), and the field to change: the prompt
    when it alone is longer than the context, else the completion's length."""
    name, emb = client.ctx.served_name, embed_client.ctx.served_name
    long = "hello " * 150  # more tokens than the tiny server's 120
    cases = [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [1, 2]}]},
            "messages.0.content",
        ),
        ("/v1/completions", {"prompt": [[1, 2], "a"]}, "prompt"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        (
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": []}},
            "stream_options.include_usage",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500},
            "max_completion_tokens",
        ),
        ("/v1/completions", {"prompt": ["ok", long], "max_tokens": 2}, "prompt.1"),
        ("/v1/completions", {"prompt": long, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 500}, "max_tokens"),
    ]
    for path, body, param in cases:
        assert _err(client.post(path, json={"model": name} | body), 400)["param"] == param, body
    r = embed_client.post("/v1/embeddings", json={"model": emb, "input": [[1, 2], "a"]})
    assert _err(r, 400)["param"] == "input"


def test_retry_after_comes_from_the_queue(tiny_llama_dir):
    """Retry-After was always 1 (no request had finished yet to estimate from); now the age of
    the oldest request in flight bounds the latency below, one latency per batch queued."""
    from llmopt.serve.api.context import ServerContext
    from llmopt.serve.metrics import ServeMetrics

    s = ServeSettings(max_num_seqs=2, max_queue=4)
    ctx = ServerContext(s, "m", "causal-lm", None, ServeMetrics(), 128)
    assert ctx.retry_after() == 1  # nothing in flight
    ctx.outstanding = 6
    ctx.started = {1: time.monotonic() - 8.0, 2: time.monotonic() - 1.0}
    assert ctx.retry_after() in (24, 25)  # 8 s (and a few ms) x 3 batches in flight
    ctx.note_latency(30.0)
    assert ctx.retry_after() == 60  # capped
    with pytest.raises(Exception) as ei:
        ctx.admit(1, "/v1/completions")
    assert ei.value.status == 429 and ei.value.headers["Retry-After"] == "60"


def test_logprob_bytes_are_the_tokens_own(client):
    """A token that is part of a UTF-8 character decodes to U+FFFD; its `bytes` were those of
    U+FFFD ([239, 191, 189]) instead of its own."""
    from tokenizers import pre_tokenizers

    tok, ctx = client.ctx.tokenizer, client.ctx
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # The tiny tokenizer: token i is the i-th character of the byte-level alphabet.
    from llmopt.serve.api.context import _BYTE_DECODER

    for tid in range(256):
        assert ctx.token_bytes(tid) == [_BYTE_DECODER[alphabet[tid]]]
    e2 = next(i for i, c in enumerate(alphabet) if _BYTE_DECODER[c] == 0xE2)
    assert ctx.token_text(e2) == "\ufffd" and ctx.token_bytes(e2) == [0xE2]
    assert ctx.token_bytes(tok.convert_tokens_to_ids("<|im_end|>")) == list(b"<|im_end|>")
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": ctx.served_name,
            "messages": [{"role": "user", "content": "héllo → wörld"}],
            "max_tokens": 24,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        assert len(entry["bytes"]) == 1 or entry["token"].startswith("<|"), entry
        for alt in entry["top_logprobs"]:
            assert len(alt["bytes"]) == 1 or alt["token"].startswith("<|"), alt


# -- embeddings ---------------------------------------------------------------------------------
@pytest.fixture
def embed_client(tiny_bert_dir, make_client):
    with make_client(tiny_bert_dir, embed_max_batch=16) as c:
        yield c


@pytest.mark.parametrize(
    "inp", [[[-5]], [[2**70]], [[1, 2], [30522]], [-1]], ids=["neg", "huge", "vocab", "flat"]
)
def test_embedding_token_ids_out_of_range_are_400(embed_client, inp):
    """Token ids [[-5]] or [[2**70]] gave 500 OverflowError."""
    name = embed_client.ctx.served_name
    e = _err(embed_client.post("/v1/embeddings", json={"model": name, "input": inp}), 400)
    assert e["param"] == "input" and "vocabulary" in e["message"]


def test_embedding_limits_per_request(tiny_bert_dir, make_client):
    with make_client(tiny_bert_dir, embed_max_inputs=8, embed_max_tokens=40) as c:
        name = c.ctx.served_name
        e = _err(c.post("/v1/embeddings", json={"model": name, "input": ["a"] * 9}), 400)
        assert e["code"] == "too_many_inputs" and "--embed-max-inputs" in e["message"]
        e = _err(c.post("/v1/embeddings", json={"model": name, "input": ["a b c d e f"] * 8}), 400)
        assert e["code"] == "too_many_tokens" and e["param"] == "input"
        r = c.post("/v1/embeddings", json={"model": name, "input": ["a"] * 8})
        assert r.status_code == 200 and len(r.json()["data"]) == 8
        e = _err(
            c.post("/v1/embeddings", content=b'{"model": "x", "input": "\\ud800"}'), 400
        )  # the surrogate is found before the model name is checked
        assert e["param"] == "input"
        raw = b'{"model": "x", "input": ["ok", "a\xed\xb0\x80"]}'  # as raw bytes
        assert _err(c.post("/v1/embeddings", content=raw), 400)["param"] == "input.1"
    # The default: OpenAI's 2048 inputs per request.
    assert ServeSettings().embed_max_inputs == 2048


class Paced:
    """The real embedding runner, paced at 1 ms per text as a real model would take (the tiny
    one is so fast that nobody would wait long enough to tell)."""

    def __init__(self, runner):
        self.runner = runner

    def embed(self, texts, batch_size):
        time.sleep(1e-3 * len(texts))
        return self.runner.embed(texts, batch_size=batch_size)


def test_a_small_embedding_request_overtakes_a_large_one(embed_client):
    """Fault 3: one request with 4,000 inputs held a 1-input request sent beside it for the
    whole of its run (here 2,000, within the default per-request limit; docs/serving.md has the
    measured latencies beside 4,000). Split into forwards of `embed_max_batch` and interleaved, the small one
    finishes while the large one still runs, and both get the vectors they would alone."""
    import numpy as np

    c, name = embed_client, embed_client.ctx.served_name
    big = [f"text number {i} of the large request" for i in range(2000)]
    done: dict[str, float] = {}
    got: dict[str, list] = {}

    def send(key, inp):
        r = c.post("/v1/embeddings", json={"model": name, "input": inp})
        assert r.status_code == 200, r.text
        got[key] = [d["embedding"] for d in r.json()["data"]]
        done[key] = time.monotonic()

    c.ctx.embedder.runner = Paced(c.ctx.embedder.runner)
    t = threading.Thread(target=send, args=("big", big))
    t.start()
    while c.ctx.outstanding < 1:  # the large request is accepted
        time.sleep(0.005)
    time.sleep(0.2)  # and under way (about 2 s of work)
    sent = time.monotonic()
    send("small", ["a small request"])
    t.join()
    # Forwards of 16 texts: the small request waits for about one (16 ms), not for 2,000 texts.
    assert done["small"] - sent < 0.5 and done["small"] < done["big"], (done, sent)
    assert len(got["big"]) == 2000
    alone = c.post("/v1/embeddings", json={"model": name, "input": [big[0], big[1999]]}).json()
    for want, have in zip(alone["data"], (got["big"][0], got["big"][1999]), strict=True):
        np.testing.assert_allclose(want["embedding"], have, atol=1e-5)


def test_an_embedding_client_gone_stops_its_forwards(embed_client):
    """A client that goes away while its 2,000-input request is being embedded: the request
    ends at once (499 in the access log) and the batcher drops its job instead of running the
    rest of its forwards for nobody; the next request is served."""
    import asyncio

    c, ctx = embed_client, embed_client.ctx
    ctx.embedder.runner = Paced(ctx.embedder.runner)  # 2,000 texts: about 2 s of forwards
    inputs = [f"text number {i} of the large request" for i in range(2000)]
    body = json.dumps({"model": ctx.served_name, "input": inputs}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/embeddings",
        "raw_path": b"/v1/embeddings",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }

    async def call():
        sent, calls = [], []

        async def receive():
            calls.append(1)
            if len(calls) == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(0.3)  # then the client goes away, its job under way
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)

        t0 = time.monotonic()
        await c.app(scope, receive, send)
        return sent, time.monotonic() - t0

    sent, took = c.portal.call(call)
    assert sent[0]["status"] == 499 and took < 1.5, (sent[0], took)
    assert ctx.outstanding == 0
    time.sleep(0.05)  # the forward in progress ends
    before = ctx.embedder.forwards
    time.sleep(0.3)
    assert ctx.embedder.forwards == before  # nothing more is computed for it
    r = c.post("/v1/embeddings", json={"model": ctx.served_name, "input": ["a"]})
    assert r.status_code == 200 and len(r.json()["data"]) == 1


def test_nan_in_one_row_fails_one_request_and_shows_in_health(client, settle):
    """Fault injection into the real engine's next decode step (NaN logits in one row): that
    request alone gets a 500 naming the fault, /health keeps "ok" and shows it as last_error,
    nothing leaks, and the next request is served."""
    gen, name = client.ctx.engine.sched.gen, client.ctx.served_name
    real = gen.decode_packed
    calls = []

    def decode(packed):
        logits, best, best_lp = real(packed)
        calls.append(1)
        if len(calls) == 1:
            logits, best_lp = logits.clone(), best_lp.clone()
            logits[0], best_lp[0] = float("nan"), float("nan")
        return logits, best, best_lp

    gen.decode_packed = decode
    body = {"model": name, "prompt": "abc", "max_tokens": 6, "ignore_eos": True}
    e = _err(client.post("/v1/completions", json=body), 500)
    assert "numerical fault" in e["message"] and e["type"] == "server_error"
    settle(client.ctx)
    h = client.get("/health").json()
    assert h["status"] == "ok" and "numerical fault" in h["engine"]["last_error"]
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    settle(client.ctx)


def test_health_degrades_while_blocks_are_lost(client, settle):
    """The block invariant, broken on purpose: blocks taken from the real pool by no sequence
    (what a leak looks like). After the next step /health says `degraded` (503, so a load
    balancer can route elsewhere) and /metrics counts them; once they are back, `ok`."""
    gen, name = client.ctx.engine.sched.gen, client.ctx.served_name
    body = {"model": name, "prompt": "abc", "max_tokens": 2}
    assert client.get("/health").json()["status"] == "ok"
    lost = gen.pool.take(3)  # the engine thread is idle: nothing else touches the pool
    assert client.post("/v1/completions", json=body).status_code == 200
    time.sleep(0.1)  # the step's stats are published
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "degraded"
    assert r.json()["engine"]["leaked_blocks"] == 3
    assert "llmopt_kv_cache_leaked_blocks 3.0" in client.get("/metrics").text
    gen.pool.give_back(lost)
    assert client.post("/v1/completions", json=body).status_code == 200
    time.sleep(0.1)
    assert client.get("/health").json()["status"] == "ok"
    settle(client.ctx)


def test_drain_cut_ends_every_request_truthfully_and_frees_its_blocks(client, settle):
    """The end of the drain window (`serve.drain.cut_generations`, on the server's event loop)
    with a non-streamed request and a stream under way: the first gets 503 `shutting_down`, the
    second its error event and `[DONE]`, and every block they held comes back."""
    from llmopt.serve.drain import cut_generations

    ctx, name = client.ctx, client.ctx.served_name
    gen = ctx.engine.sched.gen
    real_step = gen.step

    def paced(*a, **kw):  # the real step, slowed to a real model's pace: cut mid-way
        time.sleep(0.02)
        return real_step(*a, **kw)

    gen.step = paced
    body = {"model": name, "prompt": "abc", "max_tokens": 100, "ignore_eos": True}
    got: dict = {}

    def plain():
        got["plain"] = client.post("/v1/completions", json=body)

    def stream():
        with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            got["stream"] = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]

    threads = [threading.Thread(target=f) for f in (plain, stream)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(ctx.engine.sched.running) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # both are decoding
    assert client.portal.call(cut_generations, ctx) == 2
    for t in threads:
        t.join(30)
    e = _err(got["plain"], 503)
    assert e["code"] == "shutting_down" and "--drain-timeout" in e["message"]
    lines = got["stream"]
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "shutting_down"
    assert 0 < sum(1 for x in lines[:-2] if json.loads(x).get("choices")) < 100
    gen.step = real_step
    settle(ctx)


@pytest.mark.parametrize("stage", ["queued", "prefill", "decoding"])
def test_client_gone_at_each_stage_frees_everything(client, settle, stage):
    """A client that goes away while its request waits in the queue, right after it was sent,
    or mid-stream: its sequences are aborted and their blocks come back."""
    name = client.ctx.served_name
    long = {"model": name, "prompt": "hold", "max_tokens": 100, "ignore_eos": True}
    hold: list = []
    if stage == "queued":  # both batch slots taken: the next request waits in the queue
        for _ in range(2):
            cm = client.stream("POST", "/v1/completions", json=long | {"stream": True})
            r = cm.__enter__()
            next(r.iter_lines())
            hold.append(cm)
    body = long | {"stream": True, "n": 2}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        if stage == "decoding":
            for _ in range(6):
                next(lines)
        # leaving the block closes the response: the server sees the client go
    for cm in hold:
        cm.__exit__(None, None, None)
    settle(client.ctx)
