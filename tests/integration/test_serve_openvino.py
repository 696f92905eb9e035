"""`llmopt serve RUN` of a run that chose an OpenVINO causal-LM candidate, as a real process: the
run's own artifact on the openvino engine's generator with the candidate's settings (not the
source model on the native engine), completions and chat, streamed and not, over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("openvino")
pytest.importorskip("nncf")

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def openvino_run(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A run directory whose best/ is the openvino fp32 candidate of the tiny Llama, measured
    with one thread and OpenVINO's u8 KV cache (a setting the server must apply)."""
    from llmopt.core.recipes import get_recipe
    from llmopt.core.schema import Candidate
    from llmopt.engines import get_engine
    from llmopt.model.info import inspect_model
    from llmopt.rundir.best import write_best

    info = inspect_model(tiny_llama_dir)
    art = tmp_path / "artifact"
    art.mkdir()
    get_engine("openvino").build(tiny_llama_dir, info, get_recipe("fp32"), art)
    cand = Candidate(
        "openvino-fp32-kv_cacheu8", "openvino", "fp32", {"threads": 1, "kv_cache": "u8"}
    )
    (tmp_path / "model.json").write_text(json.dumps(info.to_dict()))
    run = tmp_path / "run"
    write_best(run / "best", cand, art, tmp_path / "model.json", {})
    (run / "run.json").write_text("{}")
    return run


def test_a_run_that_chose_openvino_is_served_on_openvino(openvino_run, tmp_path, serve_process):
    log = tmp_path / "serve.log"
    args = ["--max-num-seqs", "2", "--max-seq-len", "96", "--log-level", "info"]
    server = serve_process(str(openvino_run), args, log)
    try:
        client = server.client()
        done = client.completions.create(
            model="tiny-llama", prompt="The quick brown fox", max_tokens=8, temperature=0
        )
        assert done.usage.completion_tokens == 8 or done.choices[0].finish_reason == "stop"
        streamed = client.completions.create(
            model="tiny-llama",
            prompt="The quick brown fox",
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        assert text == done.choices[0].text  # greedy: the same tokens, streamed or not
        chat = dict(
            model="tiny-llama",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=8,
            temperature=0,
        )
        first = client.chat.completions.create(**chat).choices[0].message.content
        stream = client.chat.completions.create(**chat, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == first
    finally:
        server.kill()
    out = log.read_text()
    # The candidate's own engine and settings, not the source model on the native engine.
    assert "openvino generator: f32 inference, KV cache u8, 1 threads" in out
