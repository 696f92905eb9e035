"""`llmopt deploy RUN` plans for the run's own target (a CPU run deploys for the CPU)."""

from __future__ import annotations

import json
import shutil

from typer.testing import CliRunner

from llmopt.core.atomic import write_json
from llmopt.deploy.source import run_target
from llmopt.hardware.target import Target
from llmopt.model.info import inspect_model


def _run(tiny_llama_dir, tmp_path, target: Target | None):
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    shutil.copytree(tiny_llama_dir, run / "best" / "artifact")
    write_json(run / "run.json", {"model_fingerprint": "x", "target": "cpu", "settings": {}})
    if target is not None:
        write_json(run / "plan.json", {"target": target.to_dict(), "candidates": []})
    write_json(run / "best" / "model.json", inspect_model(tiny_llama_dir).to_dict())
    write_json(run / "best" / "candidate.json", {"id": "hf-fp32", "engine": "hf", "recipe": "fp32"})
    return run


def test_the_run_target_comes_from_its_plan(tiny_llama_dir, tmp_path):
    recorded = Target(device="cpu", threads=2, cpu="test CPU", memory_bytes=8 * 2**30)
    run = _run(tiny_llama_dir, tmp_path, recorded)
    got = run_target(run / "best" / "artifact")
    assert (got.device, got.threads, got.cpu, got.memory_bytes) == ("cpu", 2, "test CPU", 8 * 2**30)
    (run / "plan.json").unlink()  # older runs: run.json's device, this machine's CPU
    assert run_target(run / "best" / "artifact").device == "cpu"
    assert run_target(tiny_llama_dir) is None  # a plain model folder is no run


def test_deploy_cli_uses_the_run_target_unless_told(tiny_llama_dir, tmp_path):
    from llmopt.cli.main import app

    recorded = Target(device="cpu", threads=2, cpu="test CPU", memory_bytes=8 * 2**30)
    run = _run(tiny_llama_dir, tmp_path, recorded)
    cli = CliRunner()
    args = ["deploy", str(run), "--no-validate", "--json"]
    r = cli.invoke(app, [*args, "--out", str(tmp_path / "b1")])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout[r.stdout.index("{") :])["plan"]
    assert plan["target"]["kind"] == "cpu" and "the run's own (cpu)" in r.stderr
    r = cli.invoke(app, [*args, "--out", str(tmp_path / "b2"), "--gpu", "L4"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout[r.stdout.index("{") :])["plan"]["target"]["kind"] == "gpu"
