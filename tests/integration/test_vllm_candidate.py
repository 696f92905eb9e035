"""A vLLM candidate in a real `llmopt optimize` run of the built-in SmolLM2: vLLM's own server
started from the managed environment, verified over its endpoint and benchmarked with the load
generator, then stopped. Runs where `llmopt engines install vllm` was done (in the test's
`$LLMOPT_HOME` or the default `~/.cache/llmopt`), skips with the reason elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmopt.engines import vllm_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]


@pytest.fixture(scope="module")
def vllm_home(llmopt_test_home) -> Iterator[Path]:
    link = None
    if not vllm_env.vllm_status(llmopt_test_home)["installed"]:
        default = Path.home() / ".cache" / "llmopt"
        if not vllm_env.vllm_status(default)["installed"]:
            pytest.skip(
                "vLLM is not installed in an llmopt-managed environment: "
                "run `llmopt engines install vllm` (about 1.5 GB; minutes)"
            )
        target = vllm_env.engine_dir(llmopt_test_home)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(vllm_env.engine_dir(default))
            link = target
    try:
        if vllm_env.vllm_status(llmopt_test_home).get("variant") == "gpu":
            pytest.skip("the installed vLLM is the CUDA build; this test runs the CPU one")
        yield llmopt_test_home
    finally:
        # Later tests of the session expect the home as it was: without vLLM.
        if link is not None and link.is_symlink():
            link.unlink()


def _alive_servers(run: Path) -> list[str]:
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm.entrypoints" in text and str(run) in text:
            out.append(text)
    return out


def test_vllm_candidate_is_built_verified_benchmarked_and_stopped(vllm_home, tmp_path):
    from llmopt.assets import prepare_builtin

    prepare_builtin("smollm2-135m")
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            *LLMOPT,
            "optimize",
            "smollm2-135m",
            "--candidates",
            "hf-fp32,vllm-fp32",
            "--quick",
            "--search",
            "exhaustive",
            "--no-deploy",
            # The default budget of a small model (300 s) is less than two vLLM CPU starts.
            "--time-budget",
            "75m",
            "--out",
            str(run),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=4500,
        check=False,
        env=os.environ | {"LLMOPT_HOME": str(vllm_home)},
    )
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-3000:]
    cdir = run / "candidates" / "vllm-fp32"
    assert not (cdir / "error.json").exists(), (cdir / "error.json").read_text()
    verify = json.loads((cdir / "verify.json").read_text())
    metrics = {m["name"]: m for m in verify["metrics"]}
    # fp32 in vLLM computes what fp32 in transformers computes: perplexity within the budget.
    assert metrics["perplexity"]["candidate"] > 1 and verify["quality_drop"] < 0.01, verify
    assert metrics["top1_agreement"]["candidate"] > 0.95
    assert any("kl_divergence_mean not measured" in n for n in verify["notes"])
    bench = json.loads((cdir / "bench.json").read_text())
    for name in ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_ms_per_token"):
        assert bench["metrics"][name]["median"] > 0, name
    assert bench["peak_rss_bytes"] > 100 * 2**20
    assert (cdir / "server.verify.full.log").is_file() and (
        cdir / "server.bench.full.log"
    ).is_file()
    assert not _alive_servers(run), "every stage must stop its vLLM server"
