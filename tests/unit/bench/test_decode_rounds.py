"""`benchmarks/decode.py`'s summary over interleaved rounds: each point's ratio is paired with
the point it is compared with in the same round (one time window), within a format for the
switches, and against the round's first format for a format comparison."""

import pytest


def _row(mode: str, rnd: int, tok_s: float, linear: str = "default", batch: int = 1) -> dict:
    return {
        "mode": mode,
        "batch": batch,
        "round": rnd,
        "tok_s": tok_s,
        "attention": "triton",
        "overlap": True,
        "fuse_silu": False,
        "linear": linear,
        "lm_head": "dense",
        "inductor_pdl": False,
    }


def test_round_summary_pairs_formats_and_switches_by_round(benchmark_script):
    decode = benchmark_script("decode")
    rows = [
        _row("bf16", 0, 1000.0),
        _row("int4", 0, 900.0),
        _row("int4", 0, 450.0, linear="X=off"),
        _row("bf16", 0, 100.0, batch=8),
        _row("int4", 0, 120.0, batch=8),
        _row("bf16", 1, 500.0),  # a slower window: the ratios stay paired
        _row("int4", 1, 475.0),
        _row("int4", 1, 190.0, linear="X=off"),
        _row("bf16", 1, 50.0, batch=8),
        _row("int4", 1, 55.0, batch=8),
    ]
    got = {x["point"]: x for x in decode.round_summary(rows)}
    assert len(got) == 5
    int4 = next(x for p, x in got.items() if p.startswith("int4 b1") and "X=off" not in p)
    assert int4["tok_s_median"] == pytest.approx(687.5)
    assert int4["vs_mode"] == "bf16"
    assert (int4["vs_mode_min"], int4["vs_mode_max"]) == pytest.approx((0.9, 0.95))
    assert int4["ratio_median"] == pytest.approx(1.0)  # the first int4 point of its rounds
    off = next(x for p, x in got.items() if "X=off" in p)
    assert (off["ratio_min"], off["ratio_max"]) == pytest.approx((0.4, 0.5))  # against int4
    assert (off["vs_mode_min"], off["vs_mode_max"]) == pytest.approx((0.38, 0.45))  # bf16
    big = next(x for p, x in got.items() if p.startswith("int4 b8"))
    assert (big["vs_mode_min"], big["vs_mode_max"]) == pytest.approx((1.1, 1.2))  # same batch
    assert big["ratio_median"] == pytest.approx(1.0)  # not against int4 at batch 1
