"""Embedder bundles: a run served by llmopt with its recalibrated threshold, a model folder by
vLLM's pooling runner; the same validators as LM bundles; start.sh's device checks."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from llmopt.core.atomic import write_json
from llmopt.deploy import resolve_source, write_bundle
from llmopt.hardware.target import Target
from llmopt.model.info import inspect_model

THRESHOLD = {
    "threshold": 0.8123,
    "reference_threshold": 0.85,
    "agreement": 0.991,
    "agreement_as_is": 0.952,
}


def _run_dir(model: Path, tmp_path: Path) -> Path:
    """A run directory whose best/ holds an embedder candidate, as `llmopt optimize` writes it."""
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    shutil.copytree(model, run / "best" / "artifact")
    write_json(run / "run.json", {"model_fingerprint": "x"})
    write_json(run / "best" / "model.json", inspect_model(model).to_dict())
    write_json(
        run / "best" / "candidate.json",
        {"id": "onnxruntime-w8a8-dynamic", "engine": "onnxruntime", "recipe": "w8a8-dynamic"},
    )
    launch = {"engine": "onnxruntime", "recipe": "w8a8-dynamic", "settings": {"threads": 4}}
    write_json(run / "best" / "launch.json", launch | {"similarity_threshold": THRESHOLD})
    return run


def _start(bundle: Path, tmp_path: Path, model_dir: Path, gpus: int = 0):
    """Run start.sh with stub `llmopt`, `vllm` and `nvidia-smi` commands that print."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "llmopt").write_text('#!/bin/sh\necho "ENGINE llmopt $*"\n')
    (bin_ / "vllm").write_text('#!/bin/sh\necho "ENGINE vllm $*"\n')
    lines = "".join(f"GPU {i}: NVIDIA X (UUID: GPU-{i})\\n" for i in range(gpus))
    (bin_ / "nvidia-smi").write_text(
        f'#!/bin/sh\nprintf "{lines}"\n' if gpus else "#!/bin/sh\nexit 9\n"
    )
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "MODEL_DIR": str(model_dir), "PORT": "9100"}
    return subprocess.run(
        ["bash", str(bundle / "start.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_run_bundle_serves_with_llmopt_and_ships_the_threshold(tiny_bert_cls_dir, tmp_path):
    run = _run_dir(tiny_bert_cls_dir, tmp_path)
    src = resolve_source(run)
    assert src.info.task == "embedding" and src.launch["similarity_threshold"] == THRESHOLD
    out = tmp_path / "bundle"
    res = write_bundle(src, out, Target.gpu_model("H200"))
    checks = {c.name: c for c in res.checks}
    # The validators LM bundles pass, here too; vLLM's flag check has nothing to check.
    assert res.ok, [c.to_dict() for c in res.checks if c.status == "failed"]
    assert {"nginx", "compose", "kubernetes", "dockerfile", "shell", "yaml", "no-weights"} <= set(
        checks
    )
    assert checks["shell"].status == "passed" and checks["no-weights"].status == "passed"
    assert checks["vllm"].status == "skipped" and "llmopt" in checks["vllm"].detail
    plan = json.loads((out / "plan.json").read_text())
    assert plan.get("served_by") == "llmopt", plan
    assert plan["similarity_threshold"] == THRESHOLD
    assert plan["model"]["pooling"] == "cls" and plan["model"]["query_prompt"] == "query: "
    # A CPU artifact asks for no GPU, whatever target was named.
    assert "nvidia" not in (out / "docker-compose.yml").read_text()
    assert "0.8123" in (out / "README.md").read_text()
    assert f"MODEL_DIR={(run / 'best').resolve()}" in (out / ".env").read_text()

    proc = _start(out, tmp_path, run / "best")
    assert proc.returncode == 0, proc.stderr
    assert "similarity threshold 0.8123 (the reference's was 0.85)" in proc.stdout
    engine = next(x for x in proc.stdout.splitlines() if x.startswith("ENGINE"))
    assert engine == f"ENGINE llmopt serve {run / 'best'} --host 0.0.0.0 --port 9100"
    # Nothing mounted: a clear refusal, before any server starts.
    proc = _start(out, tmp_path, tmp_path / "empty")
    assert proc.returncode == 2 and "mount it there" in proc.stderr


def test_model_folder_on_gpu_serves_with_vllm_pooling(tiny_bert_dir, tmp_path):
    out = tmp_path / "bundle"
    res = write_bundle(resolve_source(tiny_bert_dir), out, Target.gpu_model("L4"))
    assert res.ok, [c.to_dict() for c in res.checks if c.status == "failed"]
    plan = json.loads((out / "plan.json").read_text())
    argv = plan["launch"]["vllm"]["argv"]
    assert plan["served_by"] == "vllm" and argv[:2] == ["vllm", "serve"]
    assert argv[argv.index("--runner") + 1] == "pooling"
    assert plan["similarity_threshold"] is None
    assert "No threshold was verified" in (out / "README.md").read_text()
    ok = _start(out, tmp_path, tiny_bert_dir, gpus=1)
    assert ok.returncode == 0 and "--runner pooling" in ok.stdout, ok.stderr
    none = _start(out, tmp_path, tiny_bert_dir, gpus=0)
    assert none.returncode == 3 and "found none" in none.stderr


@pytest.mark.parametrize("target", ["cpu"])
def test_model_folder_on_cpu_serves_with_llmopt(tiny_bert_dir, tmp_path, target):
    res = write_bundle(resolve_source(tiny_bert_dir), tmp_path / "b", Target.cpu_host(2))
    assert res.ok and res.plan.served_by == "llmopt"
