"""A phase measured above a ceiling is never called bound by it; `bench lm` re-measures and says
what it measured in a header."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from llmopt.bench.roofline import Ceilings, PhaseWork, above_ceiling, attribute, best_ceilings

C = Ceilings(10e9, {"float32": 100e9}, "cpu", 2, 0.0)


def test_a_phase_above_the_measured_ceiling_claims_no_bound():
    w = PhaseWork.prefill(1e8, 4e8, 0, tokens=512)  # compute-heavy
    row = attribute(w, 2 * 1e8 * 512 / 161e9, C) | {"metric": "prefill"}  # 161% of the peak
    assert row["flops_share"] > 1.0
    assert row["verdict"] == "above-ceiling" and "compute-bound" not in row["verdict"]
    assert "measurement was low" in row["implication"]
    assert above_ceiling([row]) == ["prefill"]
    best = best_ceilings(C, Ceilings(8e9, {"float32": 200e9}, "cpu", 2, 1.0))
    assert best.copy_bytes_per_s == 10e9 and best.matmul_flops_per_s["float32"] == 200e9
    assert attribute(w, 2 * 1e8 * 512 / 161e9, best)["verdict"] == "compute-bound"


def test_bench_lm_prints_what_it_measured(tiny_llama_dir):
    from llmopt.cli.main import app

    args = ["bench", "lm", str(tiny_llama_dir), "--batch-sizes", "1", "--prompt-lengths", ""]
    args += ["--prompt-tokens", "16", "--new-tokens", "4", "--repeats", "1", "--threads", "1"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    first = r.stdout.splitlines()[0]
    assert first.startswith("model tiny-llama, engine hf, recipe fp32; prompt 16 tokens")
    assert "4 new tokens" in first and "1 threads" in first
    assert any(line.startswith("ceilings") for line in r.stdout.splitlines())
    j = CliRunner().invoke(app, [*args, "--json"])
    res = json.loads(j.stdout)
    assert (res["engine"], res["recipe"]) == ("hf", "fp32")
    for row in res["roofline"]:  # never a bound past 100% of a ceiling
        over = max(row["bandwidth_share"], row["flops_share"]) > 1.0
        assert (row["verdict"] == "above-ceiling") == over
