"""The `openvino` engine: embedding models and causal LMs compiled by OpenVINO for the CPU.

Causal LMs are exported and run by `llmopt.engines.openvino_lm` (a stateful IR through
`openvino.convert_model`, fp32 / bf16 / NNCF int8 / llmopt's int4 codes; why not optimum-intel
is in its docstring). `llmopt serve` drives them through `load_generator`: an
`OpenVinoGenerator` (`llmopt.engines.openvino_generator`, one infer request per running
sequence) compiled with the run's candidate's settings. What follows is the embedder path.

Build: the HF encoder is converted to OpenVINO IR (`openvino.convert_model` on the PyTorch
model, dynamic batch and length), saved in float32. `w8a8-static` quantizes it with NNCF's
post-training quantization: int8 weights per channel and int8 activations with static scales
calibrated on llmopt's calibration sentences (the Wikipedia articles that verification never
scores), with NNCF's transformer preset keeping the accuracy-critical ops (softmax, layer norm)
in floating point. `bf16` is the float32 IR run with OpenVINO's bf16 inference precision, on CPUs
that compute bf16 natively.

Load: an `EmbeddingRunner`: tokenize, infer `last_hidden_state`, pool as the model's
sentence-transformers config says (`llmopt.engines.pooling`), the same pooling every engine uses.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmopt.assets.text import calibration_sentences
from llmopt.core.errors import EngineUnavailableError
from llmopt.core.settings import EngineSettings
from llmopt.engines import register_engine
from llmopt.engines.base import Engine
from llmopt.engines.openvino_lm import ARCHS, OpenVinoLMRunner, build_lm, lm_recipe_rule
from llmopt.engines.pooling import embed_in_batches, encoder_feeds, pool
from llmopt.hardware.host import isa_features, usable_cores
from llmopt.model.files import copy_tokenizer_files

if TYPE_CHECKING:
    from llmopt.core.recipes import Recipe
    from llmopt.engines.generation import GeneratorSpec
    from llmopt.engines.openvino_generator import OpenVinoGenerator
    from llmopt.model.info import ModelInfo

__all__ = ["OpenVinoEngine", "OpenVinoEmbeddingRunner", "RECIPES", "IR_FILE"]

log = logging.getLogger(__name__)

RECIPES = ("fp32", "bf16", "w8a8-static")
IR_FILE = "model.xml"
CALIBRATION_SENTENCES = 300  # NNCF's default subset size; the sentences come in batches of 8
_CAL_BATCH = 8


def _bf16_cpu() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & set(isa_features()))


@register_engine
class OpenVinoEngine(Engine):
    """OpenVINO IR on the CPU. Encoders: float32, bf16 inference, or NNCF static int8. Causal
    LMs: float32, bf16 inference, NNCF int8 weights (w8a16), or llmopt's int4 (w4a16-*)."""

    name = "openvino"
    tasks = ("embedding", "causal-lm")
    extra = "openvino"
    batching = True  # causal LMs: `load_generator` (embedders are served through `load`)

    def missing(self) -> str | None:
        for mod in ("openvino", "nncf"):
            if importlib.util.find_spec(mod) is None:
                return "openvino is not installed: pip install 'llmopt[openvino]'"
        return None

    def incompatible(self, info: ModelInfo, recipe: Recipe, device: str) -> str | None:
        if info.task == "causal-lm":
            return self._lm_incompatible(info, recipe, device)
        if recipe.name not in RECIPES:
            return f"the openvino engine runs recipes {', '.join(RECIPES)}"
        if device != "cpu":
            return "the openvino engine runs on the CPU here (its GPU plugin is Intel GPUs)"
        if recipe.name == "bf16" and not _bf16_cpu():
            return "this CPU has no native bf16 (AVX512-BF16 or AMX): OpenVINO would emulate it"
        return None

    def _lm_incompatible(self, info: ModelInfo, recipe: Recipe, device: str) -> str | None:
        if device != "cpu":
            return "the openvino engine runs on the CPU here (its GPU plugin is Intel GPUs)"
        if info.architecture not in ARCHS:
            return (
                f"the openvino engine's causal-LM export is traced and verified for "
                f"{', '.join(ARCHS)}, not {info.architecture}"
            )
        if why := lm_recipe_rule(recipe):
            return why
        if recipe.dtype == "bfloat16" and not _bf16_cpu():
            return "this CPU has no native bf16 (AVX512-BF16 or AMX): OpenVINO would emulate it"
        return None

    def settings_space(self, info: ModelInfo, recipe: Recipe, device: str) -> list[dict[str, Any]]:
        """Causal LMs: OpenVINO's u8 KV cache (its CPU default, a quantized cache) and, on bf16
        CPUs, bf16 inference for the int-weight recipes. Both change the numbers, so each is a
        verified candidate of its own, searched only when named (each is a separate build)."""
        if info.task != "causal-lm" or device != "cpu":
            return [{}]
        out: list[dict[str, Any]] = [{}]
        out.append({"kv_cache": "u8", "opt_in": "OpenVINO's u8 KV cache quantizes the cache"})
        if recipe.weight_bits and recipe.dtype == "float32" and _bf16_cpu():
            why = "bf16 inference over int weights changes the activations' precision"
            out.append({"precision": "bf16", "opt_in": why})
        return out

    def tune_space(self, info: Any, recipe: str, device: str) -> list[dict[str, Any]]:
        """Runtime knobs that leave the numbers alone: OpenVINO's thread pinning, flipped."""
        if getattr(info, "task", None) != "causal-lm" or device != "cpu":
            return []
        return [{"cpu_pinning": False}]

    def build(self, source: Path, info: ModelInfo, recipe: Recipe, out: Path) -> dict[str, Any]:
        if info.task == "causal-lm":
            return build_lm(Path(source), recipe, Path(out))
        import openvino as ov

        source, out = Path(source), Path(out)
        t0 = time.perf_counter()
        model, tokenizer = _load_encoder(source)
        ov_model = ov.convert_model(model, example_input=_example(tokenizer, model))
        facts: dict[str, Any] = {
            "engine": f"OpenVINO {ov.get_version()}",
            "convert_seconds": round(time.perf_counter() - t0, 3),
        }
        if recipe.name == "w8a8-static":
            t = time.perf_counter()
            ov_model = _quantize(ov_model, tokenizer, model, info)
            facts["quantize_seconds"] = round(time.perf_counter() - t, 3)
            facts["calibration_sentences"] = CALIBRATION_SENTENCES
        ov.save_model(ov_model, out / IR_FILE, compress_to_fp16=False)
        copy_tokenizer_files(source, out)
        if (source / "config.json").is_file():
            (out / "config.json").write_bytes((source / "config.json").read_bytes())
        facts["ir_bytes"] = sum(f.stat().st_size for f in out.glob("model.*"))
        facts["seconds"] = round(time.perf_counter() - t0, 3)
        return facts

    def load(
        self, artifact: Path, info: ModelInfo, recipe: Recipe, settings: EngineSettings
    ) -> OpenVinoEmbeddingRunner | OpenVinoLMRunner:
        if info.task == "causal-lm":
            return OpenVinoLMRunner(Path(artifact), settings, recipe.dtype)
        limit = int(getattr(info, "max_seq_length", None) or info.max_context or 512)
        return OpenVinoEmbeddingRunner(
            Path(artifact),
            pooling=info.pooling,
            normalize=info.normalize,
            max_length=min(int(settings.max_length or limit), limit),
            threads=settings.threads or usable_cores(),
            precision="bf16" if recipe.name == "bf16" else "f32",
            sort_by_length=settings.sort_by_length is not False,
            streams=int(settings.options.get("streams", 1)),
        )

    def load_generator(self, spec: GeneratorSpec) -> OpenVinoGenerator:
        """An `OpenVinoGenerator` over a built causal-LM artifact (`spec.model`), compiled with
        the run's candidate's settings (`spec.settings`)."""
        if why := self.missing():
            raise EngineUnavailableError(why)
        from llmopt.engines.openvino_generator import load_openvino_generator  # heavy: torch

        return load_openvino_generator(spec)


def _load_encoder(source: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(source, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(source)


def _inputs(tokenizer: Any, model: Any, texts: list[str], tensors: str) -> dict[str, Any]:
    """The tokenizer's output restricted to what the encoder's forward takes."""
    import inspect

    enc = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors=tensors)
    takes = set(inspect.signature(model.forward).parameters)
    return {k: v for k, v in enc.items() if k in takes}


def _example(tokenizer: Any, model: Any) -> dict[str, Any]:
    return _inputs(tokenizer, model, ["an example sentence", "and a second, longer one"], "pt")


def _quantize(ov_model: Any, tokenizer: Any, model: Any, info: ModelInfo) -> Any:
    import nncf

    texts = calibration_sentences(CALIBRATION_SENTENCES)
    batches = [
        {
            k: v.astype(np.int64)
            for k, v in _inputs(tokenizer, model, texts[i : i + _CAL_BATCH], "np").items()
        }
        for i in range(0, len(texts), _CAL_BATCH)
    ]
    return nncf.quantize(
        ov_model,
        nncf.Dataset(batches),
        model_type=nncf.ModelType.TRANSFORMER,
        subset_size=len(batches),
    )


class OpenVinoEmbeddingRunner:
    """Tokenize -> OpenVINO compiled model -> pool. Satisfies `llmopt.engines.EmbeddingRunner`.

    Args:
        artifact: folder with model.xml/.bin and the tokenizer files.
        pooling, normalize: the model's sentence pooling (see `pool`).
        max_length: truncate inputs to this many tokens.
        threads: OpenVINO inference threads.
        precision: "f32" or "bf16" (OpenVINO's INFERENCE_PRECISION_HINT).
        sort_by_length: batch texts of similar length together (same output order).
        streams: parallel inference streams (1: one request at a time, the latency setting).
    """

    def __init__(
        self,
        artifact: Path,
        pooling: str,
        normalize: bool,
        max_length: int,
        threads: int,
        precision: str = "f32",
        sort_by_length: bool = True,
        streams: int = 1,
    ):
        import openvino as ov
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(artifact))
        config = {
            "INFERENCE_PRECISION_HINT": precision,
            "INFERENCE_NUM_THREADS": int(threads),
            "NUM_STREAMS": int(streams),
        }
        self.compiled = ov.Core().compile_model(str(artifact / IR_FILE), "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.input_names = [i.get_any_name() for i in self.compiled.inputs]
        self.dim = int(self.compiled.outputs[0].get_partial_shape()[-1].get_length())
        self.pooling, self.normalize, self.max_length = pooling, normalize, max_length
        self.threads, self.sort_by_length, self.precision = int(threads), sort_by_length, precision

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Embed `texts` in batches; returns (len(texts), D) float32 in input order."""
        return embed_in_batches(texts, batch_size, self._embed_batch, self.dim, self.sort_by_length)

    def _embed_batch(self, batch: list[str]) -> np.ndarray:
        feeds, mask = encoder_feeds(self.tokenizer, batch, self.max_length, self.input_names)
        hidden = self.request.infer(feeds)[self.compiled.outputs[0]]  # (B, T, D)
        return pool(np.asarray(hidden, dtype=np.float32), mask, self.pooling, self.normalize)
