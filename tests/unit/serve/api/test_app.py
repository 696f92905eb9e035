"""The serve API in process (Starlette's TestClient) over tiny random models: OpenAI response
shapes, error bodies and status codes, the guard (API key, body size), detokenization, stops."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from llmopt.serve.api.detok import IncrementalDetokenizer, StopChecker  # noqa: E402
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


def _fake_run(root, tiny_llama_dir, run_target="cpu", deploy_kind="cpu"):
    """A run folder as optimize writes it (JSON only: the settings are resolved from these)."""
    from llmopt.model.info import inspect_model

    best = root / "best"
    (best / "deploy").mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"target": run_target}))
    (best / "candidate.json").write_text(
        json.dumps({"id": "torch-fp32", "engine": "torch", "recipe": "fp32", "settings": {}})
    )
    (best / "model.json").write_text(json.dumps(inspect_model(tiny_llama_dir).to_dict()))
    cmd = f"llmopt serve {best} --host 127.0.0.1 --port 8000 --max-num-seqs 3"
    (best / "launch.json").write_text(
        json.dumps(
            {"serve": {"command": cmd, "scheduler": "--max-num-seqs 3: most decode throughput"}}
        )
    )
    plan = {
        "target": {"kind": deploy_kind, "name": "CPU"},
        "max_num_seqs": 64,
        "max_num_batched_tokens": 1024,
        "max_model_len": 96,
        "memory": {"block_size": 8, "kv_tokens": 200, "kv_bytes_per_token_per_gpu": 2048},
    }
    (best / "deploy" / "plan.json").write_text(json.dumps(plan))
    return root


def test_settings_come_from_the_plan_unless_given(tiny_llama_dir):
    from llmopt.serve.defaults import plan_values, resolve_settings

    # A folder: planned for this machine. 2 CPU threads: 4 sequences per thread, vLLM's
    # 8192-token step capped to 2048; the tiny model's 128-token context; the KV cache (small:
    # the budget is far larger) holds what 8 sequences of 128 tokens use, plus scratch.
    r = plan_values(str(tiny_llama_dir), {}, threads=2)
    assert set(r.sources.values()) == {"plan"}, r.sources
    assert r.values == {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "block_size": 16,
        "max_seq_len": 128,
        "num_blocks": 8 * 8 + 1,
    }
    assert "capped to 2048 for 2 CPU threads" in r.notes["max_num_batched_tokens"]
    # More threads, more sequences; flags win, and the cache follows the effective values.
    assert plan_values(str(tiny_llama_dir), {}, threads=4).values["max_num_seqs"] == 16
    r = plan_values(
        str(tiny_llama_dir), {"max_num_seqs": 3, "block_size": 4, "max_seq_len": 64}, threads=2
    )
    assert r.sources == {
        "max_num_seqs": "flag",
        "block_size": "flag",
        "max_seq_len": "flag",
        "max_num_batched_tokens": "plan",
        "num_blocks": "plan",
    }
    assert r.values["num_blocks"] == 3 * 16 + 1
    s = resolve_settings(str(tiny_llama_dir), {"num_blocks": 40}, threads=2)
    assert (s.num_blocks, s.source("num_blocks"), s.source("max_num_seqs")) == (40, "flag", "plan")
    # decode-batch-sizes are checked against the planned max-num-seqs, and the error says so.
    with pytest.raises(ValueError, match=r"max-num-seqs \(8, from the plan\)"):
        resolve_settings(str(tiny_llama_dir), {}, threads=2, decode_batch_sizes=(16,))
    s = resolve_settings(
        str(tiny_llama_dir), {"max_num_seqs": 16}, threads=2, decode_batch_sizes=(16,)
    )
    assert s.batch_sizes() == [16]


def test_settings_come_from_the_run_plan(tiny_llama_dir, tmp_path):
    from llmopt.serve.defaults import plan_values

    run = _fake_run(tmp_path / "run", tiny_llama_dir)
    for arg in (run, run / "best"):
        r = plan_values(str(arg), {}, threads=2)
        assert set(r.sources.values()) == {"run plan"}, r.sources
        # launch.json's measured max-num-seqs (3) over the bundle's 64; the bundle's budget,
        # blocks and length; its 200 KV tokens = 25 blocks of 8 (3 x 96 tokens would use 36).
        assert r.values == {
            "max_num_seqs": 3,
            "max_num_batched_tokens": 1024,
            "block_size": 8,
            "max_seq_len": 96,
            "num_blocks": 25 + 1,
        }
        assert "most decode throughput" in r.notes["max_num_seqs"]
    r = plan_values(str(run), {"block_size": 4}, threads=2)
    assert r.sources["block_size"] == "flag" and r.values["num_blocks"] == 200 // 4 + 1
    # Measured on another device, planned for a GPU: not this server's numbers; planned here.
    other = _fake_run(tmp_path / "gpu-run", tiny_llama_dir, run_target="cuda", deploy_kind="gpu")
    r = plan_values(str(other), {}, threads=2)
    assert set(r.sources.values()) == {"plan"} and r.values["max_num_seqs"] == 8


def test_settings_planned_for_a_cuda_gpu(tiny_llama_dir, monkeypatch):
    import types

    import torch

    from llmopt.serve.defaults import plan_values

    # An H100 with 60 GiB free, as torch reports it (no GPU needed for the arithmetic).
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    r = plan_values(str(tiny_llama_dir), {}, device="cuda", recipe="bf16")
    assert set(r.sources.values()) == {"plan"}, r.sources
    # No CPU caps: vLLM's 256 sequences and 8192-token step; the cache what 256 x 128 use.
    assert r.values == {
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "block_size": 16,
        "max_seq_len": 128,
        "num_blocks": 256 * 8 + 1,
    }
    assert "NVIDIA H100 80GB HBM3, 60.0 of 80.0 GiB free, bfloat16 weights" in r.notes["block_size"]


def test_embedding_models_keep_the_defaults(tiny_bert_dir):
    from llmopt.serve.defaults import DEFAULTS, plan_values

    r = plan_values(str(tiny_bert_dir), {"max_num_seqs": 2})
    assert r.sources["max_num_seqs"] == "flag" and r.sources["block_size"] == "default"
    assert r.values["num_blocks"] is DEFAULTS["num_blocks"]


@pytest.fixture
def client(tiny_llama_dir):
    from starlette.testclient import TestClient

    from llmopt.serve.api.app import create_app
    from llmopt.serve.server import load_context

    s = ServeSettings(
        max_num_seqs=2,
        num_blocks=32,
        block_size=4,
        max_seq_len=96,
        api_key="k",
        max_body_bytes=2048,
    )
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
    r = client.post(
        "/v1/completions",
        json={
            "model": name,
            "prompt": "abc",
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": 2,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and d["usage"]["completion_tokens"] == 5
    lp = d["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and all(len(t) >= 1 for t in lp["top_logprobs"])
    assert d["choices"][0]["finish_reason"] == "length"
    # echo with logprobs: prompt tokens first, the first without a log-probability
    r = client.post(
        "/v1/completions",
        json={
            "model": name,
            "prompt": [97, 98, 99],
            "max_tokens": 2,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        },
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:]) and len(lp["tokens"]) == 5
    assert r.json()["choices"][0]["text"].startswith(client.ctx.tokenizer.decode([97, 98, 99]))
    # n=2 and a token-id prompt
    r = client.post(
        "/v1/completions",
        json={
            "model": name,
            "prompt": [97, 98],
            "max_tokens": 3,
            "n": 2,
            "temperature": 0.8,
            "seed": 1,
        },
    )
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": name,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 1,
        },
    )
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["message"]["role"] == "assistant" and len(c["logprobs"]["content"]) >= 1


def test_echo_prompt_logprobs_match_the_model(client, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    name, tok = client.ctx.served_name, client.ctx.tokenizer
    prompt = [257, *tok("Hello, world", add_special_tokens=False)["input_ids"]]
    # Byte-level tokens that are not whole characters all read "\ufffd": not a dict key to test.
    clear = {i for i in range(len(tok)) if client.ctx.token_text(i) not in ("\ufffd", "")}
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    body = {
        "model": name,
        "prompt": prompt,
        "max_tokens": 3,
        "echo": True,
        "logprobs": 2,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 3 and ch["text"].startswith(tok.decode(prompt))
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for t in range(1, len(prompt)):
            want = float(ref[t - 1, prompt[t]])
            assert lp["token_logprobs"][t] == pytest.approx(want, abs=1e-4)
            top = lp["top_logprobs"][t]
            best = torch.topk(ref[t - 1], 2)
            for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True):
                if i in clear:
                    assert top[client.ctx.token_text(i)] == pytest.approx(v, abs=1e-4)
            assert top[lp["tokens"][t]] == pytest.approx(want, abs=1e-4)  # the prompt's own token
        assert lp["text_offset"][: len(prompt)] == [
            sum(len(x) for x in lp["tokens"][:i]) for i in range(len(prompt))
        ]
    # Streamed: the prompt and its log-probabilities arrive once, with each choice's first token.
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
        chunks = [
            json.loads(x[6:])
            for x in resp.iter_lines()
            if x.startswith("data: ") and x != "data: [DONE]"
        ]
    streamed = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            streamed[ch["index"]].extend(ch["logprobs"]["token_logprobs"])
    full = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed[0] == pytest.approx(full) and streamed[1] == pytest.approx(full)
    # Without echo, no prompt log-probabilities (and the engine computes none).
    r = client.post("/v1/completions", json=body | {"echo": False})
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 3
    # max_tokens 0 with echo: the prompt scored, nothing generated (lm-eval's loglikelihood).
    score = body | {"max_tokens": 0, "n": 1}
    r = client.post("/v1/completions", json=score)
    assert r.status_code == 200, r.text
    ch, usage = r.json()["choices"][0], r.json()["usage"]
    assert ch["text"] == tok.decode(prompt) and ch["finish_reason"] == "length"
    assert ch["logprobs"]["token_logprobs"] == pytest.approx(full[: len(prompt)])
    assert usage == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 0,
        "total_tokens": len(prompt),
    }
    stream = score | {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=stream) as resp:
        chunks = [
            json.loads(x[6:])
            for x in resp.iter_lines()
            if x.startswith("data: ") and x != "data: [DONE]"
        ]
    assert "".join(c["text"] for x in chunks for c in x["choices"]) == tok.decode(prompt)
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    e = _err(client.post("/v1/completions", json=score | {"echo": False}), 400)
    assert e["param"] == "max_tokens"


def test_stream_chunks_end_with_done_and_usage(client):
    name = client.ctx.served_name
    body = {
        "model": name,
        "prompt": "abc",
        "max_tokens": 4,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
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
    e = _err(
        client.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
    )
    assert "JSON" in e["message"]
    _err(client.post("/v1/completions", json={"model": name, "prompt": "x" * 5000}), 413)
    r = client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert _err(r, 401)["code"] == "invalid_api_key"
    health = client.get("/health")  # health and metrics need no key
    assert health.status_code == 200
    # The effective scheduler/cache settings and where they came from (set in code: default).
    assert health.json()["settings"]["num_blocks"] == {"value": 32, "source": "default"}
    assert health.json()["settings"]["max_seq_len"] == {"value": 96, "source": "default"}
    _err(client.post("/v1/embeddings", json={"model": name, "input": "x"}), 400)
    m = client.get("/metrics").text
    assert "llmopt_kv_cache_usage_ratio" in m and "llmopt_requests_rejected_total" in m


def test_request_timeout_gives_504_and_frees_the_sequence(tiny_llama_dir):
    import time

    from starlette.testclient import TestClient

    from llmopt.serve.api.app import create_app
    from llmopt.serve.server import load_context

    s = ServeSettings(
        max_num_seqs=2, num_blocks=32, block_size=4, max_seq_len=96, request_timeout_s=1e-4
    )
    ctx = load_context(str(tiny_llama_dir), s)
    with TestClient(create_app(ctx)) as c:
        body = {"model": ctx.served_name, "prompt": "hello there", "max_tokens": 40}
        e = _err(c.post("/v1/completions", json=body), 504)
        assert e["code"] == "timeout" and "--request-timeout" in e["message"]
        r = c.post("/v1/completions", json=body | {"stream": True})  # headers sent: in-band
        assert r.status_code == 200 and '"code": "timeout"' in r.text
        assert r.text.rstrip().endswith("data: [DONE]")
        for _ in range(100):  # the engine thread processes the aborts
            if ctx.outstanding == 0 and not ctx.engine.sched.has_work():
                break
            time.sleep(0.05)
        assert ctx.outstanding == 0 and not ctx.engine.sched.has_work()


def test_chunked_prefill_setting_reaches_the_scheduler(tiny_llama_dir):
    from llmopt.serve.server import load_context

    for on, want in ((True, True), (False, False), (None, False)):  # None: the native default
        s = ServeSettings(
            max_num_seqs=2, num_blocks=32, block_size=4, max_seq_len=96, enable_chunked_prefill=on
        )
        ctx = load_context(str(tiny_llama_dir), s)
        assert ctx.engine.sched.chunked_prefill is want
        assert ctx.effective["enable_chunked_prefill"]["value"] is want
        assert ctx.effective["enable_chunked_prefill"]["source"] == (
            "default" if on is None else "flag"
        )
    # The CPU defaults: the engine in a thread, the prefill eager.
    assert ctx.effective["engine_process"] == {"value": False, "source": "default"}
    assert ctx.effective["compile_prefill"] == {"value": False, "source": "default"}
    assert ctx.engine.sched.gen.steps.prefill_forward is ctx.engine.sched.gen.model


def _metric(text: str, name: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


def test_prefix_caching_on_by_default_with_hits_in_metrics_and_health(
    tiny_llama_dir, make_client, settle
):
    shared = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 10 blocks of 4
    body = {"model": "tiny-llama", "max_tokens": 3, "temperature": 0}
    with make_client(tiny_llama_dir) as c:
        ctx = c.ctx
        assert ctx.effective["enable_prefix_caching"] == {"value": True, "source": "default"}
        assert ctx.engine.sched.gen.prefix_caching
        texts = []
        for tail in ([11, 12], [21, 22, 23]):
            r = c.post("/v1/completions", json=body | {"prompt": shared + tail})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        settle(ctx)
        m = c.get("/metrics").text
        # 42 + 43 prompt tokens looked up; the second found the 10 shared blocks.
        assert _metric(m, "llmopt_prefix_cache_queries_total") == 85
        assert _metric(m, "llmopt_prefix_cache_hits_total") == 40
        assert _metric(m, "llmopt_prefix_cache_hit_rate") == pytest.approx(40 / 85)
        health = c.get("/health").json()
        assert health["settings"]["enable_prefix_caching"]["value"] is True
        assert health["engine"]["prefix_cache"] == {
            "enabled": True,
            "queries": 85,
            "hits": 40,
            "hit_rate": round(40 / 85, 4),
        }
    with make_client(tiny_llama_dir, enable_prefix_caching=False) as c:
        assert c.ctx.effective["enable_prefix_caching"] == {"value": False, "source": "flag"}
        assert not c.ctx.engine.sched.gen.prefix_caching
        for tail, text in zip(([11, 12], [21, 22, 23]), texts, strict=True):
            r = c.post("/v1/completions", json=body | {"prompt": shared + tail})
            assert r.json()["choices"][0]["text"] == text  # the same output without the cache
        settle(c.ctx)
        m = c.get("/metrics").text
        assert _metric(m, "llmopt_prefix_cache_queries_total") == 0
        assert c.get("/health").json()["engine"]["prefix_cache"]["enabled"] is False


def test_native_switches_default_on_for_cuda_and_flags_win():
    from llmopt.serve.server import native_switches

    assert native_switches(ServeSettings(device="cuda")) == (True, True)
    assert native_switches(ServeSettings(device="cpu")) == (False, False)
    assert native_switches(ServeSettings(device="cuda", engine_process=False)) == (False, True)
    assert native_switches(ServeSettings(device="cpu", compile_prefill=True)) == (False, True)


def test_engine_process_start_failure_is_a_clear_error(tmp_path):
    """A model the engine process cannot load: an EngineProcessError naming the cause and the
    fix, not a hang (the child reports the failure and exits)."""
    from llmopt.engines.generation import GeneratorSpec
    from llmopt.serve.engine.process import EngineProcess, EngineProcessError
    from llmopt.serve.metrics import ServeMetrics

    bad = GeneratorSpec(model=str(tmp_path / "no-such-model"), recipe="fp32", device="cpu")
    with pytest.raises(EngineProcessError, match="failed to start") as ei:
        EngineProcess(bad, {}, 2, 64, False, ServeMetrics(), start_timeout=120)
    assert "no-such-model" in str(ei.value) and "fix:" in str(ei.value)
