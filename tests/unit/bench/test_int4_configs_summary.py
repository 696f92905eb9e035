"""`benchmarks/int4_gemv_configs.py`'s summary: per shape and fusion, the fastest config of each
family of variant bits, against the fastest config without any."""

from llmopt.engines.native import cuda_gemv as C


def _first(bits: int) -> int:
    return next(c for c, cfg in enumerate(C.INT4_CONFIGS) if cfg[6] == bits)


def test_summary_puts_each_config_in_its_family(benchmark_script):
    m = benchmark_script("int4_gemv_configs")
    base, vec, fit, all_bits = _first(0), _first(C.VEC_STAGE), _first(C.FIT), _first(7)
    rows = [
        {"shape": "gate_up", "fusion": "decode", "config": base, "us": 32.0},
        {"shape": "gate_up", "fusion": "decode", "config": _first(0) + 1, "us": 33.0},
        {"shape": "gate_up", "fusion": "decode", "config": vec, "us": 34.0},
        {"shape": "gate_up", "fusion": "decode", "config": all_bits, "us": 30.4},
        {"shape": "gate_up", "fusion": "decode", "config": fit, "us": 31.0},
        {"shape": "gate_up", "fusion": "decode", "config": 3, "failed": "launch"},
        {"shape": "o", "fusion": "plain", "config": vec, "us": 10.0},
    ]
    got = m.summary(rows)
    assert got == [
        f"gate_up decode: base {base} 32.00 us, variants {vec} 34.00 us (x1.062), "
        f"fitted {all_bits} 30.40 us (x0.950)",
        f"o plain: variants {vec} 10.00 us",
    ]
