"""Load generator pieces that need no server: schedules, workloads, URL policy, failure paths."""

from __future__ import annotations

import socket
import statistics

import pytest

from llmopt.bench.loadgen import (
    LoadSpec,
    LoadTargetError,
    Workload,
    arrival_offsets,
    check_url,
    make_prompts,
    run_load,
)
from llmopt.bench.sweep import headline_values, parse_points


def test_constant_rate_and_concurrency_schedules():
    assert arrival_offsets(LoadSpec("rate", 4.0), 4) == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert arrival_offsets(LoadSpec("concurrency", 3), 5) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_mean_rate(burstiness):
    off = arrival_offsets(LoadSpec("poisson", 10.0, burstiness=burstiness, seed=1), 2000)
    # Rescaled as vLLM does: the last request lands at n / rate exactly.
    assert off[-1] == pytest.approx(200.0)
    assert all(b >= a for a, b in zip(off, off[1:], strict=False))


def test_burstiness_orders_the_gap_variance():
    def cv(b: float) -> float:
        off = arrival_offsets(LoadSpec("poisson", 10.0, burstiness=b, seed=2), 3000)
        gaps = [y - x for x, y in zip(off, off[1:], strict=False)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    # Gamma(k): coefficient of variation 1/sqrt(k): 2 for k=0.25, 1 for Poisson, 0.5 for k=4.
    assert cv(0.25) == pytest.approx(2.0, rel=0.15)
    assert cv(1.0) == pytest.approx(1.0, rel=0.1)
    assert cv(4.0) == pytest.approx(0.5, rel=0.1)


@pytest.mark.parametrize(
    "kw",
    [
        dict(mode="burst", value=1),
        dict(mode="rate", value=0),
        dict(mode="concurrency", value=1.5),
        dict(mode="poisson", value=1, burstiness=0),
        dict(mode="rate", value=1, num_requests=0),
        dict(mode="rate", value=1, max_seconds=0),
    ],
)
def test_spec_validation_says_what_to_do(kw):
    with pytest.raises(ValueError):
        LoadSpec(**kw)


def test_synthetic_lengths_and_jsonl(tmp_path):
    prompts = make_prompts(Workload(input_len=20, output_len=8, range_ratio=0.5), 50, seed=3)
    assert all(10 <= len(p.split()) <= 30 and 4 <= m <= 12 for p, m in prompts)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi", "max_tokens": 3}\n\n{"prompt": "yo"}\n')
    assert make_prompts(Workload(output_len=7, prompts_file=f), 3) == [
        ("hi", 3),
        ("yo", 7),
        ("hi", 3),
    ]
    f.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="line 1"):
        make_prompts(Workload(prompts_file=f), 1)


def test_loopback_only_by_default():
    assert check_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    with pytest.raises(LoadTargetError, match="--allow-remote"):
        check_url("http://example.com:8000")
    assert check_url("http://example.com:8000", allow_remote=True) == "http://example.com:8000"
    with pytest.raises(LoadTargetError):
        check_url("ftp://127.0.0.1")


def test_no_server_is_a_typed_error_not_a_crash():
    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LoadTargetError, match="start the server"):
        run_load(f"http://127.0.0.1:{port}", LoadSpec("concurrency", 1, num_requests=1))


def test_refused_requests_are_recorded_as_failures():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # With the model given, no /v1/models probe happens: every request fails and is recorded.
    res = run_load(
        f"http://127.0.0.1:{port}",
        LoadSpec("concurrency", 2, num_requests=3),
        model="m",
        warmups=0,
        timeout_s=5,
    )
    assert res["metrics"]["failed"] == 3 and res["metrics"]["completed"] == 0
    assert res["errors"] and "Connect" in res["errors"][0]


def test_parse_points_and_headline():
    pts = parse_points("poisson", "0.5,2", burstiness=0.5, num_requests=4)
    assert [p.label for p in pts] == ["poisson 0.5 req/s b=0.5", "poisson 2 req/s b=0.5"]
    with pytest.raises(ValueError, match="commas"):
        parse_points("rate", "a,b")
    assert headline_values({"ttft_ms": {"median": 3.0}, "failed": 0})["ttft_ms.median"] == 3.0


def test_first_arrival_past_the_deadline_sends_nothing():
    spec = LoadSpec("rate", 0.5, num_requests=3, max_seconds=0.5)  # first send at 2 s
    res = run_load("http://127.0.0.1:9", spec, model="m", warmups=0)
    assert res["unsent"] == 3 and res["requests"] == [] and res["metrics"]["completed"] == 0


def test_bench_serve_warmups_reach_every_run(monkeypatch, tmp_path):
    """`llmopt bench serve --warmups N` sends N untimed requests before each run (default 1)."""
    from typer.testing import CliRunner

    import llmopt.bench.sweep as sweep
    from llmopt.cli.main import app

    seen = []

    def fake_run_load(base_url, spec, w, model, slo, timeout_s, warmups=1, allow_remote=False, **_):
        seen.append(warmups)
        return run_load(base_url, spec, w, model, slo, timeout_s, warmups=0)  # refused: failures

    monkeypatch.setattr(sweep, "run_load", fake_run_load)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [
        "bench",
        "serve",
        "--url",
        f"http://127.0.0.1:{port}",
        "--model",
        "m",
        "--values",
        "1",
        "--num-requests",
        "1",
        "--repeats",
        "2",
        "--timeout",
        "2",
        "--out",
        str(tmp_path),
    ]
    CliRunner().invoke(app, [*args, "--warmups", "0"])
    CliRunner().invoke(app, args)
    assert seen == [0, 0, 1, 1]


def test_embeddings_workload_batches_and_validation():
    from llmopt.bench.loadgen import make_batches
    from llmopt.bench.sweep import headline_for

    w = Workload(input_len=5, endpoint="embeddings", batch_sizes=(1, 3))
    batches = make_batches(w, make_prompts(w, 40), seed=0)
    assert len(batches) == 40 and {len(b) for b in batches} == {1, 3}
    assert all(len(t.split()) == 5 for b in batches for t in b)
    with pytest.raises(ValueError, match="endpoint 'rerank'"):
        Workload(endpoint="rerank")
    with pytest.raises(ValueError, match="batch sizes"):
        Workload(endpoint="embeddings", batch_sizes=(0,))
    keys = [k for k, _, _ in headline_for("embeddings")]
    assert "e2el_ms.p95" in keys and "output_throughput" not in keys
    assert "ttft_ms.p95" in [k for k, _, _ in headline_for("chat")]


def test_refused_embeddings_requests_are_recorded_as_failures():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = Workload(endpoint="embeddings", batch_sizes=(2,))
    with pytest.raises(LoadTargetError):  # no /v1/models: a typed error before any load
        run_load(f"http://127.0.0.1:{port}", LoadSpec("concurrency", 1, num_requests=1), w)
