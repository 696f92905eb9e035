"""The serve API in process (Starlette's TestClient) over tiny random models: OpenAI response
shapes, error bodies and status codes, the guard (API key, body size), detokenization, stops."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from llmopt.serve.detok import IncrementalDetokenizer, StopChecker  # noqa: E402
from llmopt.serve.settings import ServeSettings  # noqa: E402


@pytest.mark.parametrize(
    "chunks, stops, want_text, want_stop",
    [
        (["Hello", " wor", "ld"], [], "Hello world", False),
        (["Hel", "lo\n", "\nWorld"], ["\n\n"], "Hello", True),
        (["ab", "cSTO", "P!"], ["STOP"], "abc", True),
        (["ab", "cST", "x"], ["STOP"], "abcSTx", False),  # a held prefix that did not complete
        (["xENDy"], ["END", "y"], "x", True),  # the earliest stop wins
    ],
)
def test_stop_checker(chunks, stops, want_text, want_stop):
    s = StopChecker(stops)
    text, stopped = "", False
    for c in chunks:
        out, stopped = s.push(c)
        text += out
        if stopped:
            break
        assert not any(text.endswith(x[:k]) for x in stops for k in range(1, len(x)) if x[:k])
    if not stopped:
        text += s.flush()
    assert (text, stopped) == (want_text, want_stop)


def test_incremental_detokenizer_multibyte(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = "héllo → wörld ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.push([i]) for i in ids]
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_settings_validate():
    assert ServeSettings().host == "127.0.0.1"
    assert ServeSettings(max_num_seqs=2, max_queue=3).capacity == 5
    with pytest.raises(ValueError, match="max-num-seqs"):
        ServeSettings(max_num_seqs=0)
    with pytest.raises(ValueError, match="api-key"):
        ServeSettings(api_key=" ")
    assert ServeSettings(api_key="s3cret").to_dict()["api_key"] == "***"
    # Decode shapes: fewer (compiled) batch sizes on CUDA; the full batch is always one of them.
    assert ServeSettings(max_num_seqs=64, device="cuda").batch_sizes() == [1, 4, 16, 64]
    assert ServeSettings(max_num_seqs=6).batch_sizes() == [1, 2, 4, 6]
    assert ServeSettings(max_num_seqs=8, decode_batch_sizes=(2,)).batch_sizes() == [2, 8]
    with pytest.raises(ValueError, match="decode-batch-sizes"):
        ServeSettings(max_num_seqs=8, decode_batch_sizes=(16,))


@pytest.fixture
def client(tiny_llama_dir):
    from starlette.testclient import TestClient

    from llmopt.serve.app import create_app
    from llmopt.serve.server import load_context

    s = ServeSettings(max_num_seqs=2, num_blocks=32, block_size=4, max_seq_len=96,
                      api_key="k", max_body_bytes=2048)  # fmt: skip
    ctx = load_context(str(tiny_llama_dir), s)
    with TestClient(create_app(ctx), headers={"Authorization": "Bearer k"}) as c:
        c.ctx = ctx
        yield c


def _err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


def test_completion_and_chat_shapes(client):
    name = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/completions", json={"model": name, "prompt": "abc", "max_tokens": 5,
                                             "temperature": 0, "logprobs": 2, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and d["usage"]["completion_tokens"] == 5
    lp = d["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and all(len(t) >= 1 for t in lp["top_logprobs"])
    assert d["choices"][0]["finish_reason"] == "length"
    # echo with logprobs: prompt tokens first, without log-probabilities
    r = client.post("/v1/completions", json={"model": name, "prompt": [97, 98, 99], "max_tokens": 2,
                                             "echo": True, "logprobs": 1, "temperature": 0})  # fmt: skip
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][:3] == [None] * 3 and len(lp["tokens"]) == 5
    assert r.json()["choices"][0]["text"].startswith(client.ctx.tokenizer.decode([97, 98, 99]))
    # n=2 and a token-id prompt
    r = client.post("/v1/completions", json={"model": name, "prompt": [97, 98], "max_tokens": 3,
                                             "n": 2, "temperature": 0.8, "seed": 1})  # fmt: skip
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    r = client.post("/v1/chat/completions", json={"model": name, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                    "top_logprobs": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["message"]["role"] == "assistant" and len(c["logprobs"]["content"]) >= 1


def test_stream_chunks_end_with_done_and_usage(client):
    name = client.ctx.served_name
    body = {"model": name, "prompt": "abc", "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"prompt": "x"}, 400, "model"),
        ({"model": "M", "prompt": "x", "temperature": 9}, 400, "temperature"),
        ({"model": "M", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "M", "prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
        ({"model": "M", "prompt": "x", "presence_penalty": 1}, 400, "presence_penalty"),
        ({"model": "M", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": "M", "prompt": [99999]}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(client, body, status, param):
    if body.get("model") == "M":
        body["model"] = client.ctx.served_name
    e = _err(client.post("/v1/completions", json=body), status)
    assert e["param"] == param


def test_guard(client):
    name = client.ctx.served_name
    e = _err(client.post("/v1/completions", content=b"{not json",
                         headers={"content-type": "application/json"}), 400)  # fmt: skip
    assert "JSON" in e["message"]
    _err(client.post("/v1/completions", json={"model": name, "prompt": "x" * 5000}), 413)
    r = client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert _err(r, 401)["code"] == "invalid_api_key"
    assert client.get("/health").status_code == 200  # health and metrics need no key
    _err(client.post("/v1/embeddings", json={"model": name, "input": "x"}), 400)
    m = client.get("/metrics").text
    assert "llmopt_kv_cache_usage_ratio" in m and "llmopt_requests_rejected_total" in m
