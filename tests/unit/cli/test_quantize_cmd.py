"""`llmopt quantize`: wiring, JSON facts, GGUF export, and a clear error with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from llmopt.cli.main import app

TEXT = "A quiet village sits beside the lake, and its people fish there every morning. " * 60


def test_quantize_json_and_gguf(tiny_llama_bpe_dir, tmp_path):
    tiny_llama_dir = tiny_llama_bpe_dir
    cal = tmp_path / "cal.txt"
    cal.write_text(TEXT)
    out = tmp_path / "q"
    args = ["quantize", str(tiny_llama_dir), "--recipe", "w4a16-gptq-g32", "--out", str(out)]
    args += ["--calibration", str(cal), "--samples", "2", "--seq-len", "32", "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    facts = json.loads(r.stdout)  # progress went to stderr, one line per decoder layer
    assert "calibrate: layer 1/" in r.stderr
    assert facts["format"] == "pack-quantized" and facts["calibration"]["windows_used"] == 2
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    g = tmp_path / "m.gguf"
    r = CliRunner().invoke(
        app, ["quantize", str(tiny_llama_dir), "--export", "gguf-q8_0", "--out", str(g), "--json"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tensors"]["Q8_0"] == 15 and g.is_file()


def test_quantize_mismatch_is_a_clear_error(tiny_llama_dir, tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmopt.cli.main",
            "quantize",
            str(tiny_llama_dir),
            "--recipe",
            "w4a16",
            "--out",
            str(tmp_path / "x"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2
    assert "group size 128 does not divide" in p.stderr and "fix:" in p.stderr
    assert p.stdout == "", "errors go to stderr: `--json > facts.json` never holds one"
    assert not (tmp_path / "x").exists()


def test_quantize_with_a_progress_bar_writes_the_same_checkpoint(tiny_llama_dir, tmp_path):
    """Without --json the progress is a bar and the facts a table; the checkpoint is written
    all the same."""
    out = tmp_path / "q"
    args = ["quantize", str(tiny_llama_dir), "--recipe", "w4a16-rtn-g64", "--out", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert "w4a16-rtn-g64" in r.output or "pack-quantized" in r.output
