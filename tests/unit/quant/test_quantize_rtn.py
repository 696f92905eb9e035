"""A weight-only round-to-nearest recipe (w8a16) quantizes without a calibration pass, and writes
exactly what the calibrated path writes; the sensitivity is measured only when asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from llmopt.quant import CalibrationConfig, quantize, sequential

TEXT = "The river rises in the northern hills and flows south through farmland. " * 80


@pytest.fixture
def cal(tmp_path: Path) -> CalibrationConfig:
    f = tmp_path / "cal.jsonl"
    f.write_text("\n".join(json.dumps({"text": TEXT[i * 100 :]}) for i in range(8)))
    return CalibrationConfig(f, num_samples=4, seq_len=64, seed=0)


def test_w8a16_runs_no_forward_and_matches_the_calibrated_codes(
    tiny_llama_dir, tmp_path, cal, monkeypatch
):
    calls = []
    real = sequential.run_sequential
    monkeypatch.setattr(
        "llmopt.quant.api.run_sequential", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    fast = quantize(tiny_llama_dir, "w8a16", tmp_path / "rtn", calibration=cal)
    assert calls == []  # no layer forwards
    assert fast["calibration"]["windows_used"] == 0 and fast["calibration_seconds"] == 0.0
    assert fast["sensitivity"] is None and fast["quantized_linears"] == 14

    slow = quantize(tiny_llama_dir, "w8a16", tmp_path / "cal", calibration=cal, sensitivity=True)
    assert calls == [1]
    assert slow["sensitivity"]["most_sensitive"] and slow["calibration"]["windows_used"] == 4
    a = load_file(tmp_path / "rtn" / "model.safetensors")
    b = load_file(tmp_path / "cal" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].equal(b[k]), k  # the same codes and scales either way
    cfg = lambda d: json.loads((tmp_path / d / "config.json").read_text())["quantization_config"]  # noqa: E731
    assert cfg("rtn") == cfg("cal")
