"""`llmopt bench serve --endpoint embeddings` against `llmopt serve minilm-l6`, a real server
process: every request completes with its batch of inputs, percentiles and goodput are the
arithmetic of the recorded requests, and `bench compare` reads the runs."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.integration

MODEL = "minilm-l6"  # what `minilm_server` (conftest.py) serves


def test_embeddings_load_records_every_request(minilm_server):
    from llmopt.bench.loadgen import LoadSpec, Workload, run_load
    from llmopt.bench.serve_metrics import SLO

    w = Workload(input_len=12, endpoint="embeddings", batch_sizes=(1, 4))
    res = run_load(
        minilm_server,
        LoadSpec("concurrency", 4, num_requests=12),
        w,
        slo=SLO(e2el_ms=60_000),
        percentiles=(50.0, 95.0, 99.9),
    )
    m = res["metrics"]
    assert m["completed"] == 12 and m["failed"] == 0, res["errors"]
    sizes = [r["inputs"] for r in res["requests"]]
    assert set(sizes) <= {1, 4} and m["total_inputs"] == sum(sizes)
    assert m["input_throughput"] == pytest.approx(sum(sizes) / m["duration_s"])
    # The server reports the tokens it embedded (usage), not a word count.
    assert all(r["tokens_source"] == "usage" and r["prompt_len"] > 0 for r in res["requests"])
    e2el = m["e2el_ms"]
    assert e2el["p50"] <= e2el["p95"] <= e2el["p99.9"] and e2el["n"] == 12
    assert m["request_goodput"] == pytest.approx(12 / m["duration_s"])  # a 60 s SLO: all good
    assert m["ttft_ms"]["n"] == 12 and m["output_throughput"] == 0.0


def test_cli_bench_serve_embeddings_then_compare(minilm_server, tmp_path):
    from typer.testing import CliRunner

    from llmopt.cli.main import app

    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        args = ["bench", "serve", "--url", minilm_server, "--endpoint", "embeddings"]
        args += ["--values", "1,2", "--num-requests", "4", "--batch-sizes", "1,8"]
        args += ["--repeats", "2", "--percentiles", "50,99", "--out", str(out), "--label", name]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        doc = json.loads((out / "bench.json").read_text())
        assert doc["endpoint"] == "embeddings" and doc["percentiles"] == [50.0, 95.0, 99.0]
        summary = doc["points"][1]["summary"]
        assert {"request_throughput", "input_throughput", "e2el_ms.p95"} <= set(summary)
        # The table shows the embeddings rows, p95 among them, and no token rows.
        assert "e2el_ms.p95" in r.output and "output_throughput" not in r.output
        outs.append(str(out))
    r = CliRunner().invoke(app, ["bench", "compare", *outs])
    assert r.exit_code == 0 and "concurrency 2" in r.output, r.output
