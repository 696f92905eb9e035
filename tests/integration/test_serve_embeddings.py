"""`llmopt serve minilm-l6` as a real process with the `openai` client: embeddings (float and
base64), equal to the in-process runner, dynamic batching of concurrent requests, wrong endpoint."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest

from llmopt.core.settings import EngineSettings

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.integration

MODEL = "minilm-l6"  # what `minilm_server` (conftest.py) serves


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_embeddings_match_in_process(minilm_server):
    from llmopt.core.recipes import get_recipe
    from llmopt.engines import get_engine
    from llmopt.model.info import inspect_model

    texts = ["The cat sat on the mat.", "Stock markets fell sharply today."]
    r = _client(minilm_server).embeddings.create(model=MODEL, input=texts)
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert got.shape == (2, 384) and [d.index for d in r.data] == [0, 1]
    assert r.usage.prompt_tokens > 0
    info = inspect_model(MODEL)
    ref = get_engine("hf").load(info.path, info, get_recipe("fp32"), EngineSettings()).embed(texts)
    np.testing.assert_allclose(got, ref, atol=1e-4)
    b64 = _client(minilm_server).embeddings.create(
        model=MODEL, input=texts[0], encoding_format="base64"
    )
    vec = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(vec, got[0], atol=1e-6)


def test_concurrent_requests_are_batched(minilm_server):
    def count() -> tuple[float, float]:
        n = s = 0.0
        for line in httpx.get(minilm_server + "/metrics").text.splitlines():
            if line.startswith("llmopt_embedding_batch_size_count"):
                n = float(line.split()[-1])
            if line.startswith("llmopt_embedding_batch_size_sum"):
                s = float(line.split()[-1])
        return n, s

    n0, s0 = count()
    c = _client(minilm_server)
    out, barrier = {}, threading.Barrier(12)

    def one(i: int) -> None:
        barrier.wait()
        out[i] = c.embeddings.create(model=MODEL, input=f"sentence number {i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(out) == list(range(12))
    n1, s1 = count()
    assert s1 - s0 == 12  # every text embedded once
    assert n1 - n0 < 12  # in fewer forward passes than requests: batched


def test_embedding_server_errors(minilm_server):
    c = _client(minilm_server)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as ei:
        c.embeddings.create(model=MODEL, input="")
    assert ei.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="text-embedding-3-small", input="x")
