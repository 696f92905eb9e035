"""`llmopt engines list|install` and `llmopt serve --engine vllm --dry-run` as a user runs them:
a real process, with an empty llmopt home (no vLLM installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]


def _run(home, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = os.environ | {"LLMOPT_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run(
        [*LLMOPT, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def test_engines_list_says_what_is_installed_and_how_to_install_the_rest(tmp_path):
    proc = _run(tmp_path, "engines", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["engine"]: r for r in json.loads(proc.stdout)}
    assert {"hf", "torch", "vllm"} <= set(rows)
    assert rows["hf"]["installed"] and rows["hf"]["where"]
    # vLLM lives in its own environment, which this fresh home does not have.
    assert rows["vllm"]["installed"] is False
    assert rows["vllm"]["install"] == "llmopt engines install vllm"
    table = _run(tmp_path, "engines", "list")
    assert table.returncode == 0 and "llmopt engines install vllm" in table.stdout


def test_install_dry_run_prints_the_plan_and_installs_nothing(tmp_path):
    proc = _run(tmp_path, "engines", "install", "vllm", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "vllm" in out and "-m venv" in out and "pip install" in out
    assert str(tmp_path / "engines" / "vllm" / "venv") in out.replace("\n", "")
    assert not (tmp_path / "engines").exists()


def test_install_of_an_engine_pip_installs_is_refused_with_the_way(tmp_path):
    proc = _run(tmp_path, "engines", "install", "llamacpp")
    assert proc.returncode == 2 and "engines list" in proc.stderr and "Traceback" not in proc.stderr
    bad = _run(tmp_path, "engines", "install", "vllm", "--variant", "rocm", "--dry-run")
    assert bad.returncode == 2 and "gpu or cpu" in bad.stderr


def test_serve_engine_vllm_dry_run_prints_the_command_without_vllm(tmp_path, tiny_llama_dir):
    proc = _run(tmp_path, "serve", str(tiny_llama_dir), "--engine", "vllm", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.replace("\n", " ")
    assert "launching:" in err and "vllm.entrypoints.openai.api_server" in err
    assert str(tiny_llama_dir) in err and "--max-num-seqs" in err
    assert "not installed" in err and "llmopt engines install vllm" in err
    # Without --dry-run the same call is a clear error, not a crash.
    real = _run(tmp_path, "serve", str(tiny_llama_dir), "--engine", "vllm")
    assert real.returncode == 2 and "llmopt engines install vllm" in real.stderr
    assert "Traceback" not in real.stderr
