"""vLLM-defined serving metrics on recorded timestamps (pure arithmetic, checked by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from llmopt.bench.serve_metrics import SLO, RequestRecord, serve_metrics


def _rec(ttft: float, itl: list[float], tokens: int, prompt: int = 10) -> RequestRecord:
    return RequestRecord(
        True, 0.0, prompt, tokens, ttft, itl, ttft + sum(itl), tokens_source="usage"
    )


def test_definitions_match_vllm_by_hand():
    a = _rec(0.100, [0.020, 0.030, 0.040], tokens=4)  # e2el 0.19
    b = _rec(0.300, [0.050], tokens=2, prompt=20)  # e2el 0.35
    failed = RequestRecord(False, error="HTTP 500: boom")
    m = serve_metrics([a, b, failed], duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    # TTFT: the two first-chunk times; TPOT: (e2el - ttft) / (tokens - 1) per request.
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(np.mean([90 / 3, 50 / 1]))
    # ITL pools every gap of every request.
    assert m["itl_ms"]["n"] == 4
    assert m["itl_ms"]["median"] == pytest.approx(35.0)
    assert m["e2el_ms"]["p99"] == pytest.approx(np.percentile([190.0, 350.0], 99))
    assert m["request_goodput"] is None


def test_tpot_skips_single_token_requests_but_goodput_counts_them():
    one = _rec(0.2, [], tokens=1)
    many = _rec(0.2, [0.1, 0.1], tokens=3)  # TPOT 100 ms
    m = serve_metrics([one, many], 1.0, SLO(ttft_ms=500, tpot_ms=50))
    assert m["tpot_ms"]["n"] == 1 and m["tpot_ms"]["mean"] == pytest.approx(100.0)
    # vLLM counts TPOT as 0 for a 1-token request, so it passes; the other misses the TPOT SLO.
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(1.0)


def test_goodput_slo_is_inclusive_and_e2el_checked():
    r = _rec(0.5, [0.05, 0.05], tokens=3)  # ttft exactly 500 ms, tpot 50 ms, e2el 600 ms
    assert serve_metrics([r], 1.0, SLO(ttft_ms=500, tpot_ms=50))["good_requests"] == 1
    assert serve_metrics([r], 1.0, SLO(e2el_ms=599))["good_requests"] == 0


def test_all_failed_reports_zeros_not_nan():
    m = serve_metrics([RequestRecord(False, error="refused")] * 3, 1.0)
    assert m["failed"] == 3 and m["ttft_ms"]["mean"] == 0.0 and m["ttft_ms"]["n"] == 0


def test_slo_rejects_non_positive():
    with pytest.raises(ValueError, match="leave it unset"):
        SLO(ttft_ms=0)


def test_embedding_requests_count_inputs_and_p95():
    recs = [
        RequestRecord(True, prompt_len=8, latency=0.1 * (i + 1), inputs=i + 1) for i in range(4)
    ]
    m = serve_metrics(recs + [RequestRecord(False, inputs=5)], duration_s=2.0)
    assert m["total_inputs"] == 10 and m["input_throughput"] == 5.0 and m["failed"] == 1
    assert m["e2el_ms"]["p95"] == pytest.approx(np.percentile([100, 200, 300, 400], 95))
