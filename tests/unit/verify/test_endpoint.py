"""The endpoint path against a small OpenAI-compatible HTTP server on a free loopback port.

The server answers /v1/models, /v1/completions (echo + logprobs, greedy) and /v1/embeddings from
the tiny models in process, so the client, the metrics and the "no logprobs" path are tested
without llama.cpp (tests/integration/test_verify_endpoint_llamacpp.py runs the real llama.cpp server).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from llmopt.verify.api import load_runner
from llmopt.verify.embedding import reference_outputs, verify_embedding
from llmopt.verify.endpoint import EndpointError, OpenAIEndpoint, verify_causal_lm_endpoint
from llmopt.verify.lm import greedy_tokens

TEXT = "The river flows south through farmland and two market towns to the sea. " * 20


def _serve(lm=None, embedder=None, echo=True, ids_ok=True):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

        def _send(self, obj, code=200):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send({"data": [{"id": "tiny"}]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path.endswith("/embeddings"):
                emb = embedder.embed(req["input"])
                self._send(
                    {"data": [{"index": i, "embedding": e.tolist()} for i, e in enumerate(emb)]}
                )
                return
            if isinstance(req["prompt"], list) and not ids_ok:
                # llama-cpp-python's answer to token-id prompts.
                self._send({"error": {"message": "Input should be a valid string"}}, 500)
                return
            prompt = req["prompt"]
            if isinstance(prompt, str):
                prompt = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            ids = torch.tensor(prompt)
            if req.get("echo"):
                if not echo:
                    self._send({"choices": [{"text": "", "logprobs": None}]})
                    return
                logp = torch.log_softmax(lm.logits(ids.view(1, -1))[0, :-1], -1)
                values = [None] + logp.gather(-1, ids[1:, None])[:, 0].tolist()
                tops = [None] + [{lm.tokenizer.decode([int(t)]): 0.0} for t in logp.argmax(-1)]
                lp = {"token_logprobs": values, "top_logprobs": tops}
                self._send({"choices": [{"text": "", "logprobs": lp}]})
                return
            out = greedy_tokens(lm, ids, req["max_tokens"])
            self._send({"choices": [{"text": lm.tokenizer.decode(out)}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _windows(runner, n=4, t=48):
    ids = runner.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[: n * t]).view(n, t)


def test_endpoint_lm_matches_reference(tiny_llama_dir):
    ref = load_runner(tiny_llama_dir, threads=1)[0]
    server, url = _serve(lm=load_runner(tiny_llama_dir, threads=1)[0])
    try:
        ep = OpenAIEndpoint(url)
        assert ep.model == "tiny" and ep.base_url.endswith("/v1")
        r = verify_causal_lm_endpoint("served", ep, _windows(ref), ref)
    finally:
        server.shutdown()
    assert r.passed, r.to_dict()
    assert "adds none" in r.inputs and r.inputs.endswith("sent as token ids")
    assert r.metric("perplexity").delta == pytest.approx(0.0, abs=1e-3)
    assert r.metric("top1_agreement").candidate == 1.0
    assert r.metric("greedy_match_length").candidate == 32.0
    assert any("kl_divergence_mean not measured" in n for n in r.notes)


def test_endpoint_without_prompt_logprobs_says_so(tiny_llama_dir):
    ref = load_runner(tiny_llama_dir, threads=1)[0]
    server, url = _serve(lm=ref, echo=False)
    try:
        r = verify_causal_lm_endpoint("no-echo", OpenAIEndpoint(url), _windows(ref), ref)
    finally:
        server.shutdown()
    assert not r.passed
    assert any("perplexity and top1_agreement not measured" in n for n in r.notes)
    assert r.metric("perplexity").note.startswith("not measured")
    assert r.metric("greedy_match_length").n == 2


def test_endpoint_embeddings_verify_like_in_process(tiny_bert_dir):
    ref = load_runner(tiny_bert_dir, threads=1)[0]
    sentences = [f"Sentence {i} is about the {w} valley." for i, w in enumerate("abcdefghij" * 3)]
    server, url = _serve(embedder=ref)
    try:
        runner = OpenAIEndpoint(url).embedding_runner()
        np.testing.assert_allclose(runner.embed(sentences, 7), ref.embed(sentences), atol=1e-5)
        r = verify_embedding(
            "served", runner, sentences, reference_outputs(ref, sentences), [], None
        )
    finally:
        server.shutdown()
    assert r.passed and r.metric("cosine_mean").candidate == pytest.approx(1.0, abs=1e-5)


def test_unreachable_endpoint_has_a_fix():
    with pytest.raises(EndpointError, match="cannot reach") as e:
        OpenAIEndpoint("http://127.0.0.1:9", timeout=2)
    assert "fix:" in str(e.value)


def test_text_prompt_fallback(tiny_llama_dir):
    ref = load_runner(tiny_llama_dir, threads=1)[0]
    server, url = _serve(lm=ref, ids_ok=False)
    try:
        ep = OpenAIEndpoint(url, tokenizer=ref.tokenizer)
        r = verify_causal_lm_endpoint("text", ep, _windows(ref), ref)
    finally:
        server.shutdown()
    assert ep.text_prompts and r.passed
    assert r.inputs.endswith("sent as text decoded with the reference tokenizer")
    assert r.metric("perplexity").delta == pytest.approx(0.0, abs=1e-3)
