"""`benchmarks/step_profile.py`: a decode step's profiled kernels by family, and each CUDA GEMV
kernel attributed to the weight shapes whose timing chose its configuration, with the rate
those shapes' bytes give in the step. Kernel names as torch.profiler reports them on an H100."""

import pytest


@pytest.fixture(scope="module")
def sp(benchmark_script):
    return benchmark_script("step_profile")


ARGS = "(const T1 *, const unsigned int *, const T1 *, const T1 *, const T1 *, float, T1 *, int)"
GATE_UP = (
    f"void (anonymous namespace)::int4_gemv_kernel<__nv_bfloat16, 4, 4, 1, 4, 1, false, 0, 1>{ARGS}"
)
QKV = (
    f"void (anonymous namespace)::int4_gemv_kernel<__nv_bfloat16, 4, 4, 1, 8, 1, false, 5, 1>{ARGS}"
)
FP8 = "void (anonymous namespace)::wo8_gemv_kernel<__nv_bfloat16, true, 2, 8, 1>(const T1 *)"


def _int4(n, k, config, **switches):
    return (
        {"kernel": "int4", "n": n, "k": k, "weight": "128", "act": "torch.bfloat16"}
        | {
            "rows": 1,
            "config": list(config),
            "us": [],
        }
        | switches
    )


def test_families_and_int4_shapes(sp):
    tuned = [
        _int4(28672, 4096, (4, 4, 1, 4, 1, 0, 0)),
        _int4(6144, 4096, (4, 4, 1, 8, 1, 0, 5)),
        _int4(6144, 4096, (4, 4, 1, 8, 1, 0, 5), fit=False),  # another point, same shape
        _int4(4096, 4096, (4, 16, 1, 8, 4, 0, 0)),
    ]
    kernels = [
        sp.Kernel(GATE_UP, 17966.0, 640),
        sp.Kernel(QKV, 6041.0, 640),
        sp.Kernel("nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT", 7092.0, 20),
        sp.Kernel("decode_split_rope", 3621.0, 640),
        sp.Kernel("decode_combine", 976.0, 640),
        sp.Kernel("triton_poi_fused_int4_gemv_cuda_mul_silu_split_view_2", 762.0, 640),
        sp.Kernel("void at::native::multi_tensor_apply_kernel<...>", 32.6, 20),
    ]
    s = sp.summary(kernels, 20, tuned, 2987.5)
    fam = s["families"]
    assert fam["int4 GEMV (CUDA)"]["ms_per_step"] == pytest.approx((17966 + 6041) / 20e3, 1e-3)
    assert fam["cuBLAS"]["ms_per_step"] == pytest.approx(0.3546, 1e-3)
    assert fam["decode attention"]["ms_per_step"] == pytest.approx(0.22985, 1e-3)
    assert set(fam) == {"int4 GEMV (CUDA)", "cuBLAS", "decode attention", "Inductor", "other"}
    assert sum(f["share"] for f in fam.values()) == pytest.approx(1.0, abs=1e-3)
    gate_up, qkv = s["gemvs"]
    assert gate_up["shapes"] == ["28672x4096"] and gate_up["us_per_call"] == pytest.approx(28.07)
    # 60.55 MB (codes and scales) per call in 28.07 us: 2.16 TB/s, 72% of copy
    assert gate_up["gbps"] == pytest.approx(2157, rel=1e-3)
    assert gate_up["pct_copy"] == pytest.approx(72.2, abs=0.1)
    assert qkv["shapes"] == ["6144x4096"]  # (once, though two points timed it)
    assert qkv["pct_copy"] == pytest.approx(46.0, abs=0.1)
    text = "\n".join(sp.lines(s))
    assert "28672x4096" in text and "72.2% of copy" in text and "cuBLAS" in text


def test_a_config_shared_by_shapes_reads_all_their_bytes(sp):
    """One 1-byte kernel configuration chosen by three shapes: 96 calls a step (three shapes
    of 32 layers) read the three shapes' bytes; int8 rows do not match an FP8 kernel."""
    tuned = [
        {"kernel": "wo8", "n": n, "k": 4096, "weight": "torch.float8_e4m3fn", "config": [2, 8, 1]}
        for n in (4096, 6144, 28672)
    ] + [{"kernel": "wo8", "n": 4096, "k": 4096, "weight": "torch.int8", "config": [2, 8, 1]}]
    s = sp.summary([sp.Kernel(FP8, 40279.0, 1920)], 20, tuned, 3000.0)
    (row,) = s["gemvs"]
    assert sorted(row["shapes"]) == ["28672x4096", "4096x4096", "6144x4096"]
    nbytes = 32 * sum(n * 4096 + 4 * n for n in (4096, 6144, 28672))
    assert row["gbps"] == pytest.approx(nbytes / (40279.0 / 20 * 1e3), rel=1e-3)


def test_unknown_names_and_configs(sp):
    assert sp.template_args("decode_combine") is None
    assert sp.template_args("int4_gemv_kernel<__half, (int)4, (int)8, 1, 4, 2, true, 3, 1>") == (
        4, 8, 1, 4, 2, 1, 3, 1,
    )  # fmt: skip
    s = sp.summary([sp.Kernel(GATE_UP, 100.0, 20)], 20, [], 3000.0)
    assert s["gemvs"][0]["shapes"] == [] and "gbps" not in s["gemvs"][0]
    assert "no timed shape" in "\n".join(sp.lines(s))
