"""Inspect a model folder: what it is, how big it is, and whether its files are intact.

`inspect_model` is the first stage of every run. It reads config.json and the safetensors
headers only (never the tensors), so it takes milliseconds even for large models, and it turns
every way a folder can be unusable into a typed error that says how to fix it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.assets.models import Progress, resolve_model
from llmopt.core.errors import (
    CorruptWeightsError,
    NotAModelFolderError,
    PickleWeightsError,
    UnsupportedModelError,
)
from llmopt.core.schema import SCHEMA_VERSION, Serializable, Task
from llmopt.core.units import DTYPE_BYTES, SAFETENSORS_DTYPES, dtype_bytes
from llmopt.model.config import (
    attention_layers,
    attention_pattern,
    config_shape,
    estimate_parameters,
    get_key,
    is_config_only,
)
from llmopt.model.files import ST_FILES
from llmopt.model.pooling import read_embedding_head

__all__ = [
    "ModelInfo",
    "SUPPORTED_ARCHITECTURES",
    "inspect_model",
    "info_from_config",
    "check_weights",
    "kv_bytes_per_token",
    "CONFIG_ONLY",
]

log = logging.getLogger(__name__)

# Architecture (config.json "architectures"[0]) -> task. Only architectures whose code ships with
# transformers: a folder that needs trust_remote_code runs the author's Python, which llmopt
# never enables on its own.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "causal-lm",
    "MistralForCausalLM": "causal-lm",
    "Qwen2ForCausalLM": "causal-lm",
    "Qwen3ForCausalLM": "causal-lm",
    "GemmaForCausalLM": "causal-lm",
    "Gemma2ForCausalLM": "causal-lm",
    "Gemma3ForCausalLM": "causal-lm",
    "Phi3ForCausalLM": "causal-lm",
    "BertModel": "embedding",
    "RobertaModel": "embedding",
    "XLMRobertaModel": "embedding",
    "MPNetModel": "embedding",
    "Qwen2Model": "embedding",
    "Qwen3Model": "embedding",
}
# Masked-LM heads are embedders only when sentence-transformers files say so.
_EMBEDDER_IF_ST = {
    "BertForMaskedLM",
    "RobertaForMaskedLM",
    "XLMRobertaForMaskedLM",
    "MPNetForMaskedLM",
}
_DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # transformers' causal-LM heads
_ENCODERS = {"bert", "roberta", "xlm-roberta", "mpnet"}  # model_type; others are decoders
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_NOT_WEIGHTS = ("training_args", "optimizer", "scheduler", "rng_state")
# Persistent buffers some checkpoints store; they are not parameters.
_BUFFER_SUFFIXES = ("position_ids", "token_type_ids", "inv_freq")
_DTYPE_BYTES = {code: dtype_bytes(name) for code, name in SAFETENSORS_DTYPES.items()}
# KV-cache element types worth planning for; bf16 and fp16 cost the same.
_KV_DTYPES = ("float32", "bfloat16", "float16", "fp8", "int8")
CONFIG_ONLY = "none (config only)"  # weight_format of a ModelInfo built from config.json alone
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


@dataclass
class ModelInfo(Serializable):
    """What `inspect_model` learned about a model folder. Sizes in bytes, counts in elements."""

    name: str  # built-in name, else the folder name
    path: str
    builtin: str | None
    task: Task
    architecture: str
    model_type: str
    num_parameters: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None
    vocab_size: int
    max_context: int | None
    dtype: str  # what the config says the model runs in, else the stored dtype
    weights_dtype: str  # dominant dtype (by bytes) of the stored tensors
    bytes_on_disk: int
    weight_files: list[str]
    weight_format: str  # "safetensors" | "pickle"
    tied_embeddings: bool
    kv_bytes_per_token: dict[str, int] = field(default_factory=dict)  # empty for embedders
    pooling: str | None = None  # "mean" | "cls" | "last" for embedders
    normalize: bool = False  # embedders: L2-normalize the pooled vector
    max_seq_length: int | None = None  # sentence-transformers' truncation length, if set
    query_prompt: str | None = None  # embedders: instruction prepended to queries (model.pooling)
    document_prompt: str | None = None  # embedders: prefix of corpus texts
    fingerprint: str = ""
    # Decoders with local attention: the window (tokens) and how many layers use it; the other
    # layers attend to the whole context. A sliding layer's KV cache holds at most the window.
    sliding_window: int | None = None
    sliding_layers: int = 0

    @property
    def attention_pattern(self) -> str:
        """E.g. '15 sliding-window layers (512 tokens) + 3 full-attention layers'."""
        return attention_pattern(self.num_layers, self.sliding_window, self.sliding_layers)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelInfo:
        if d.get("schema_version", SCHEMA_VERSION) > SCHEMA_VERSION:
            raise ValueError(f"ModelInfo written by a newer llmopt (schema {d['schema_version']})")
        return super().from_dict(d)


def _corrupt(path: Path, what: str) -> CorruptWeightsError:
    return CorruptWeightsError(
        f"{path.name} is damaged: {what}",
        hint=f"copy or download {path} again (it is incomplete or overwritten)",
    )


def _read_header(path: Path) -> dict[str, Any]:
    """Parse and validate one safetensors header without reading any tensor data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, f"{size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)  # little-endian u64: length of the JSON header
        if n > min(_MAX_HEADER, size - 8):
            raise _corrupt(path, f"header length {n} does not fit in a file of {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise _corrupt(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in t["data_offsets"])
            numel = math.prod(int(d) for d in t["shape"])
            dtype = t["dtype"]
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"entry {name!r} lacks dtype/shape/data_offsets") from None
        width = _DTYPE_BYTES.get(dtype)  # sub-byte dtypes (F4, F6) are not size-checked
        if start < 0 or end < start or (width and end - start != numel * width):
            raise _corrupt(
                path, f"tensor {name!r} has offsets {start}..{end} for shape {t['shape']}"
            )
        spans.append((start, end))
    # Tensors must tile the data area exactly, as the safetensors library itself requires.
    spans.sort()
    pos = 0
    for start, end in spans:
        if start != pos:
            raise _corrupt(path, f"tensor data has a gap or overlap at byte {pos}")
        pos = end
    expected = 8 + n + pos
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise _corrupt(path, f"{what}: expected {expected} bytes, found {size}")
    return header


def _index_shards(folder: Path, index_name: str) -> list[Path] | None:
    index = folder / index_name
    if not index.is_file():
        return None
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _corrupt(index, f"not a valid index ({e})") from None
    for shard in shards:
        if not (folder / shard).is_file():
            raise CorruptWeightsError(
                f"{index_name} names the shard {shard}, which is missing from {folder}",
                hint=f"copy {shard} into the folder (the download or copy was incomplete)",
            )
    return [folder / s for s in shards]


def _safetensors_files(folder: Path) -> list[Path]:
    shards = _index_shards(folder, "model.safetensors.index.json")
    return shards if shards is not None else sorted(folder.glob("*.safetensors"))


def check_weights(folder: str | os.PathLike) -> list[Path]:
    """Validate every safetensors file of a model folder; return their paths.

    Checks each header (valid JSON, consistent offsets, file size = 8 + header + data) and that
    a sharded index names no missing shard. Reads headers only, so it is fast.

    Args:
        folder: a Hugging Face model folder.

    Raises:
        CorruptWeightsError: a file is truncated or damaged, or a shard is missing.

    >>> [p.name for p in check_weights(prepare_builtin("minilm-l6"))]  # doctest: +SKIP
    ['model.safetensors']
    """
    return [f for f, _ in _checked_headers(Path(folder))]


def _checked_headers(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    return [(f, _read_header(f)) for f in _safetensors_files(folder)]


def _pickle_files(folder: Path) -> list[Path]:
    shards = _index_shards(folder, "pytorch_model.bin.index.json")
    if shards is not None:
        return shards
    return sorted(
        p
        for p in folder.iterdir()
        if p.suffix in _PICKLE_SUFFIXES and p.is_file() and not p.name.startswith(_NOT_WEIGHTS)
    )


def _pickle_tensors(files: list[Path]) -> list[tuple[str, str, int, int]]:
    import torch

    out, seen = [], set()
    for f in files:
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            sd = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise _corrupt(f, f"torch.load failed ({type(e).__name__}: {e})") from None
        for name, t in sd.items():
            if not isinstance(t, torch.Tensor):
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in seen:  # tied weights share storage: count once, as stored
                continue
            seen.add(key)
            dtype = str(t.dtype).removeprefix("torch.")
            out.append((name, dtype, t.numel(), t.numel() * t.element_size()))
    return out


def _unsupported(arch: str, config: dict[str, Any]) -> UnsupportedModelError:
    remote = " It ships custom code (auto_map)," if "auto_map" in config else ""
    return UnsupportedModelError(
        f"architecture {arch!r} is not supported.{remote}",
        hint="supported: any decoder whose code ships with transformers (*ForCausalLM, "
        f"*LMHeadModel), and {', '.join(SUPPORTED_ARCHITECTURES)}. Models that need custom code "
        "(trust_remote_code) run the author's Python; llmopt does not enable that by default.",
    )


def _read_config(folder: Path) -> tuple[dict[str, Any], bytes]:
    path = folder / "config.json"
    if not path.is_file():
        raise NotAModelFolderError(
            f"{folder} has no config.json, so it is not a Hugging Face model folder",
            hint="pass the folder that holds config.json (save a model with save_pretrained)",
        )
    raw = path.read_bytes()
    try:
        config = json.loads(raw)
    except ValueError as e:
        config, error = None, str(e)
    else:
        error = "not a JSON object"
    if not isinstance(config, dict):
        raise NotAModelFolderError(
            f"{path} is not valid JSON ({error})", hint="repair or re-download config.json"
        )
    return config, raw


def _task(folder: Path, config: dict[str, Any]) -> str:
    arch = (config.get("architectures") or [""])[0]
    has_st = any((folder / f).is_file() for f in ST_FILES)
    if arch in SUPPORTED_ARCHITECTURES or (has_st and arch in _EMBEDDER_IF_ST):
        # sentence-transformers files make any supported model an embedder (decoder embedders
        # such as e5-mistral ship a CausalLM architecture).
        return "embedding" if has_st else SUPPORTED_ARCHITECTURES[arch]
    if arch.endswith(_DECODER_SUFFIXES) and "auto_map" not in config and not has_st:
        # Any other decoder whose code ships with transformers: the hf engine runs it (and
        # serves it); the native engine says itself whether it does.
        return "causal-lm"
    raise _unsupported(arch or f"(none; model_type {config.get('model_type')!r})", config)


Tensors = list[tuple[str, str, int, int]]  # (name, dtype, numel, bytes) per stored tensor


def _stored_tensors(folder: Path, allow_pickle: bool) -> tuple[list[Path], str, Tensors]:
    headers = _checked_headers(folder)
    if headers:
        # Tied weights are stored once, so this counts them once.
        tensors = [
            (name, SAFETENSORS_DTYPES.get(t["dtype"], t["dtype"]), math.prod(t["shape"]), hi - lo)
            for _, header in headers
            for name, t in header.items()
            if name != "__metadata__"
            for lo, hi in [t["data_offsets"]]
        ]
        return [f for f, _ in headers], "safetensors", tensors
    files = _pickle_files(folder)
    if not files:
        gguf = (
            " It holds a .gguf file; llmopt reads HF folders." if any(folder.glob("*.gguf")) else ""
        )
        raise NotAModelFolderError(
            f"{folder} has config.json but no weights (*.safetensors).{gguf}",
            hint="save the model into the folder with save_pretrained (safetensors)",
        )
    if not allow_pickle:
        raise PickleWeightsError(
            f"{folder} has only pickled weights ({', '.join(p.name for p in files)}); "
            "loading a pickle can run arbitrary code hidden in the file",
            hint="convert them to safetensors (load once, save_pretrained), or pass "
            "--allow-pickle if you trust the source",
        )
    return files, "pickle", _pickle_tensors(files)


def kv_bytes_per_token(shape: dict[str, Any]) -> dict[str, int]:
    """KV-cache bytes per token for each KV dtype: K and V, layers x kv_heads x head_dim each."""
    elems = shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * 2
    return {k: int(elems * dtype_bytes(k)) for k in _KV_DTYPES}


def info_from_config(
    config: dict[str, Any],
    *,
    num_parameters: int | None = None,
    name: str = "config",
    path: str = "",
    builtin: str | None = None,
    task: str | None = None,
    tied: bool | None = None,
    stored: dict[str, Any] | None = None,
    fingerprint: str | None = None,
) -> ModelInfo:
    """A `ModelInfo` from a config.json dict: the one code path of every `ModelInfo` built here.

    `inspect_model` calls it with what it read from the weights (`num_parameters`, `tied`,
    `stored`: dtype, files, format, size); without them the facts come from the config alone:
    the parameter count from `estimate_parameters`, no files, the size the checkpoint would take.

    Args:
        config: a config.json dict.
        num_parameters: the parameter count; default: `estimate_parameters(config)`.
        name: shown in reports.
        path: the folder it came from, if any.
        builtin: the built-in name, if it is one.
        task: "causal-lm" or "embedding"; default: by architecture (decoders unless known).
        tied: embeddings tied to the LM head; default: the config's flag.
        stored: `weights_dtype`, `bytes_on_disk`, `weight_files`, `weight_format` and, for
            embedders, `pooling`, `normalize`, `max_seq_length`, as read from the folder.
        fingerprint: identity; default: a hash of the config.

    >>> info = info_from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    ...     "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    ...     "torch_dtype": "bfloat16", "max_position_embeddings": 131072})
    >>> info.num_parameters, info.kv_bytes_per_token["bfloat16"]
    (8030261248, 131072)
    """
    cfg = config.get("text_config") or config  # multimodal configs nest the LM
    arch = (config.get("architectures") or [""])[0]
    task = task or SUPPORTED_ARCHITECTURES.get(arch, "causal-lm")
    shape = config_shape(config, f"{path}/config.json" if path else "config.json")
    params = int(num_parameters) if num_parameters else estimate_parameters(config)
    facts = dict(stored or {})
    weights_dtype = facts.pop("weights_dtype", None)
    dtype = str(get_key(config, "dtype", "torch_dtype") or weights_dtype or "bfloat16")
    if "bytes_on_disk" not in facts:  # what the checkpoint would take; nothing is on disk
        facts.update(
            bytes_on_disk=int(params * DTYPE_BYTES.get(dtype, 2)),
            weight_files=[],
            weight_format=CONFIG_ONLY,
        )
    if tied is None:
        tied = bool(cfg.get("tie_word_embeddings", False))
    if fingerprint is None:
        fingerprint = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    window, sliding = attention_layers(config)
    return ModelInfo(
        name=name,
        path=path,
        builtin=builtin,
        task=task,  # type: ignore[arg-type]
        architecture=arch,
        model_type=str(config.get("model_type", "")),
        num_parameters=params,
        **shape,
        dtype=dtype,
        weights_dtype=weights_dtype or dtype,
        tied_embeddings=tied if task == "causal-lm" else False,
        kv_bytes_per_token=kv_bytes_per_token(shape) if task == "causal-lm" else {},
        fingerprint=fingerprint,
        sliding_window=window if task == "causal-lm" and sliding else None,
        sliding_layers=sliding if task == "causal-lm" else 0,
        **facts,
    )


def inspect_model(
    model: str | os.PathLike,
    *,
    params: float | None = None,
    config_only: bool | str = False,
    allow_pickle: bool = False,
    progress: Progress = None,
) -> ModelInfo:
    """Describe a model folder or built-in from config.json and the weight headers.

    Args:
        model: a built-in name ("smollm2-135m", "minilm-l6") or a Hugging Face model folder.
        params: parameter count override (e.g. 8.03e9), for a checkpoint the config formula
            does not cover.
        config_only: False: the weights must be there (every run needs them); True: read
            config.json alone; "auto": config.json alone when the folder holds no weights
            (planning: `info.weight_format == CONFIG_ONLY` then).
        allow_pickle: accept .bin/.pt weights when no safetensors exist. Loading pickle can run
            code hidden in the file, so this is off unless the user passes --allow-pickle.
        progress: optional callable(str), used when a built-in is prepared for the first time.

    Raises:
        ModelNotFoundError, NotAModelFolderError, UnsupportedModelError, CorruptWeightsError,
        PickleWeightsError: each with a `hint` saying how to fix it.

    >>> info = inspect_model("smollm2-135m")  # doctest: +SKIP
    >>> info.num_layers, info.num_kv_heads, info.kv_bytes_per_token["bfloat16"]  # doctest: +SKIP
    (30, 3, 23040)
    """
    if config_only not in (True, False, "auto"):
        raise ValueError(f"config_only={config_only!r}: use True, False or 'auto'")
    if config_only and Path(model).is_dir() and (config_only is True or is_config_only(model)):
        folder = Path(model)
        config, _ = _read_config(folder)
        return info_from_config(
            config,
            num_parameters=int(params) if params else None,
            name=folder.name,
            path=str(folder.resolve()),
        )
    folder, builtin = resolve_model(model, progress=progress)
    config, config_bytes = _read_config(folder)
    task = _task(folder, config)
    files, weight_format, tensors = _stored_tensors(folder, allow_pickle)

    by_bytes: Counter[str] = Counter()
    for _, dtype, _, nbytes in tensors:
        by_bytes[dtype] += nbytes
    num_parameters = sum(n for name, _, n, _ in tensors if not name.endswith(_BUFFER_SUFFIXES))
    stored: dict[str, Any] = {
        "weights_dtype": by_bytes.most_common(1)[0][0] if by_bytes else "unknown",
        "bytes_on_disk": sum(f.stat().st_size for f in files),
        "weight_files": [str(f.relative_to(folder)) for f in files],
        "weight_format": weight_format,
    }
    cfg = config.get("text_config") or config  # multimodal configs nest the LM
    tied = False
    if task == "causal-lm":
        # config.json may omit the flag (it is then the class default, which varies by model);
        # the weights tell the truth: a tied model stores no separate LM head.
        explicit = get_key(cfg, "tie_word_embeddings")
        stored_head = any(name.endswith("lm_head.weight") for name, *_ in tensors)
        tied = bool(explicit) if explicit is not None else not stored_head
    else:
        head = read_embedding_head(folder, str(config.get("model_type", "")) in _ENCODERS)
        stored.update(dataclasses.asdict(head))

    # Cheap identity: config bytes plus weight names and sizes (no hashing of gigabytes).
    digest = hashlib.sha256(config_bytes)
    for f in files:
        digest.update(f"\0{f.name}\0{f.stat().st_size}".encode())
    return info_from_config(
        config,
        num_parameters=int(params) if params else num_parameters,
        name=builtin or folder.name,
        path=str(folder),
        builtin=builtin,
        task=task,
        tied=tied,
        stored=stored,
        fingerprint=digest.hexdigest(),
    )
