"""ONNX Runtime engine for embedding models: export -> fuse -> (quantize) -> run on CPU.

`build` turns an HF encoder folder into a self-contained artifact folder:

    model.onnx                     inputs input_ids/attention_mask[/token_type_ids], (B, T) int64
                                   output last_hidden_state, (B, T, D) float32
    config.json, tokenizer files   copied from the source, so the folder loads on its own
    1_Pooling/, modules.json ...   sentence-transformers files, when the source has them

`load` returns an `OrtEmbeddingRunner`, which tokenizes, runs the session and pools with
`llmopt.engines.pooling.pool`, the same function the hf engine uses.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmopt.core.settings import EngineSettings
from llmopt.engines import register_engine
from llmopt.engines.base import Engine
from llmopt.engines.pooling import embed_in_batches, encoder_feeds, pool

if TYPE_CHECKING:
    from llmopt.core.recipes import Recipe
    from llmopt.model.info import ModelInfo

__all__ = ["OnnxRuntimeEngine", "OrtEmbeddingRunner"]

log = logging.getLogger(__name__)

RECIPES = ("fp32", "w8a8-dynamic")
# Opset 17 (TorchScript exporter) has LayerNormalization as a standard op and is what ORT's BERT
# fusions are tested on; the dynamo fallback exports opset 18. build() records the one used.
OPSET = 17
# Weight-free files that make the artifact folder loadable on its own (tokenizer, config,
# sentence-transformers module description). Weights are not copied: model.onnx holds them.
_AUX_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
_ST_MODULE_DIR = re.compile(r"^\d+_(Pooling|Normalize)$")
# ORT's quantizer turns these into integer ops; we count them to show what got quantized.
_QUANT_OPS = (
    "DynamicQuantizeLinear",
    "MatMulInteger",
    "DynamicQuantizeMatMul",
    "QAttention",
    "QGemm",
    "ConvInteger",
    "QLinearMatMul",
)
# Past this size protobuf cannot hold the weights inline (hard 2 GiB limit), so use external data.
_EXTERNAL_DATA_BYTES = 1_800_000_000


@register_engine
class OnnxRuntimeEngine(Engine):
    """Encoder models exported to ONNX and run by ONNX Runtime on CPU (fp32 or dynamic int8)."""

    name = "onnxruntime"
    tasks = ("embedding",)
    extra = "onnx"

    def missing(self) -> str | None:
        for mod in ("onnxruntime", "onnx"):
            if importlib.util.find_spec(mod) is None:
                return "onnxruntime is not installed: pip install 'llmopt[onnx]'"
        return None

    def incompatible(self, info: ModelInfo, recipe: Recipe, device: str) -> str | None:
        reasons = []
        if info.task not in self.tasks:
            reasons.append(f"task {info.task!r} is not supported (only embedding models)")
        if recipe.name not in RECIPES:
            reasons.append(
                f"recipe {recipe.name!r} is not supported; use one of {', '.join(RECIPES)}"
            )
        if device != "cpu":
            reasons.append(f"device {device!r} is not supported yet (CUDA EP not wired); use cpu")
        return "; ".join(reasons) or None

    def build(self, source: Path, info: ModelInfo, recipe: Recipe, out: Path) -> dict[str, Any]:
        """Export, fuse and optionally quantize; write `out/model.onnx` plus tokenizer/config files."""
        source, out = Path(source), Path(out)
        assert recipe.name in RECIPES, f"build() called with unsupported recipe {recipe.name!r}"
        out.mkdir(parents=True, exist_ok=True)
        facts: dict[str, Any] = {"recipe": recipe.name}
        t_start = time.perf_counter()
        # Intermediate graphs go to a temp dir inside `out` (same filesystem, never the source).
        with tempfile.TemporaryDirectory(dir=out, prefix=".tmp-") as tmp_str:
            tmp = Path(tmp_str)
            t = time.perf_counter()
            raw = tmp / "export.onnx"
            facts.update(_export(source, raw))
            facts["export_seconds"] = round(time.perf_counter() - t, 3)
            facts["export_bytes"] = _onnx_bytes(raw)

            t = time.perf_counter()
            final = out / "model.onnx"
            fused = tmp / "optimized.onnx" if recipe.quantized else final
            facts.update(_optimize(raw, fused, source, info, facts["inputs"]))
            facts["optimize_seconds"] = round(time.perf_counter() - t, 3)
            if recipe.quantized:
                t = time.perf_counter()
                facts.update(_quantize(fused, final))
                facts["quantize_seconds"] = round(time.perf_counter() - t, 3)
        facts["opset"], facts["op_counts"] = _graph_summary(out / "model.onnx")
        facts["model_bytes"] = _onnx_bytes(out / "model.onnx")
        facts["copied_files"] = _copy_aux_files(source, out)
        facts["seconds"] = round(time.perf_counter() - t_start, 3)
        log.info("built %s in %.1f s: %s", recipe.name, facts["seconds"], facts.get("fusions"))
        return facts

    def load(
        self, artifact: Path, info: ModelInfo, recipe: Recipe, settings: EngineSettings
    ) -> OrtEmbeddingRunner:
        """Open `artifact/model.onnx` in a CPU session and return an embedding runner."""
        # The model's own truncation length (sentence-transformers' max_seq_length), as torch uses.
        limit = int(getattr(info, "max_seq_length", None) or info.max_context or 512)
        max_length = min(int(settings.max_length or limit), limit)
        return OrtEmbeddingRunner(
            Path(artifact),
            pooling=info.pooling,
            normalize=info.normalize,
            max_length=max_length,
            threads=settings.threads or os.cpu_count() or 1,
            sort_by_length=settings.sort_by_length is not False,
        )


class OrtEmbeddingRunner:
    """Tokenize -> ONNX Runtime session -> pool. Satisfies `llmopt.engines.EmbeddingRunner`.

    Args:
        artifact: folder with model.onnx and the tokenizer files (what `build` wrote).
        pooling: "mean", "cls" or "last" (see `pool`).
        normalize: L2-normalize the pooled vectors.
        max_length: truncate inputs to this many tokens.
        threads: ORT intra-op threads.
        sort_by_length: batch texts of similar length together (less padding, same output order).

    >>> runner = OrtEmbeddingRunner(Path("artifact"), "mean", True, 256, 2)  # doctest: +SKIP
    >>> runner.embed(["a sentence", "another one"]).shape  # doctest: +SKIP
    (2, 384)
    """

    def __init__(
        self,
        artifact: Path,
        pooling: str,
        normalize: bool,
        max_length: int,
        threads: int,
        sort_by_length: bool = True,
    ):
        import onnxruntime as ort
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(artifact))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(threads)
        # One request at a time: inter-op parallelism only adds thread contention on few cores.
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(
            str(artifact / "model.onnx"), opts, providers=["CPUExecutionProvider"]
        )
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.dim = self.session.get_outputs()[0].shape[-1]  # D, static in exported encoders
        self.pooling, self.normalize, self.max_length = pooling, normalize, max_length
        self.threads, self.sort_by_length = int(threads), sort_by_length

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Embed `texts` in batches; returns (len(texts), D) float32 in input order.

        Args:
            texts: the sentences.
            batch_size: sentences per session run (each batch is padded to its longest text).

        >>> runner.embed(["hello"], batch_size=1).dtype  # doctest: +SKIP
        dtype('float32')
        """
        dim = self.dim if isinstance(self.dim, int) else 0
        return embed_in_batches(texts, batch_size, self._embed_batch, dim, self.sort_by_length)

    def _embed_batch(self, batch: list[str]) -> np.ndarray:
        feeds, mask = encoder_feeds(self.tokenizer, batch, self.max_length, self.input_names)
        (hidden,) = self.session.run(["last_hidden_state"], feeds)  # (B, T, D)
        return pool(hidden, mask, self.pooling, self.normalize)


def _wrap(model: Any, with_token_types: bool) -> Any:
    import torch

    # HF forward() has many keyword arguments (use_cache, ...) and exporters pass inputs
    # positionally, so a thin wrapper pins the order and returns only the tensor we need.
    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            kw = {"token_type_ids": token_type_ids} if with_token_types else {}
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, **kw
            ).last_hidden_state

    # eval(): the exporter warns about and traces training mode (dropout) otherwise.
    return Encoder().eval()


def _export(source: Path, path: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModel

    # attn_implementation="eager": ORT's BERT fuser recognises the eager softmax(QK^T)V pattern
    # and fuses it into one Attention op per layer (6/6 on MiniLM); the SDPA graph fuses 0/6.
    model = AutoModel.from_pretrained(
        str(source), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with_tt = "token_type_ids" in inspect.signature(model.forward).parameters
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if with_tt else [])
    # (B=2, T=8) with a padded second row, so the mask path is traced with real padding.
    ids = torch.full((2, 8), 100, dtype=torch.long)
    mask = torch.ones((2, 8), dtype=torch.long)
    mask[1, 5:] = 0
    args = (ids, mask) + ((torch.zeros_like(ids),) if with_tt else ())
    encoder = _wrap(model, with_tt)
    axes = {0: "batch", 1: "sequence"}
    # The TorchScript exporter (dynamo=False) first: with torch 2.13 it exports BERT in ~1.5 s and
    # its graph is the one ORT's fuser matches (EmbedLayerNormalization + Attention). The dynamo
    # exporter works too but takes ~11 s and its graph gets no Attention fusion; it stays as the
    # fallback for when the deprecated TorchScript exporter is gone or fails.
    errors = []
    for exporter in ("torchscript", "dynamo"):
        try:
            # Known, checked warnings: the TorchScript exporter's deprecation, and tracer notes
            # that the mask-padding branch in transformers' masking_utils is frozen (it is never
            # taken: our attention mask always spans the sequence). `_export_error` re-runs the
            # graph on a different shape against torch, which catches anything frozen wrongly.
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if exporter == "torchscript":
                    torch.onnx.export(
                        encoder,
                        args,
                        str(path),
                        dynamo=False,
                        opset_version=OPSET,
                        input_names=names,
                        output_names=["last_hidden_state"],
                        dynamic_axes={n: axes for n in [*names, "last_hidden_state"]},
                    )
                else:
                    from torch.export import Dim

                    dims = {0: Dim("batch"), 1: Dim("sequence")}
                    # Opset 18: the dynamo exporter has no lower-opset implementations.
                    torch.onnx.export(
                        encoder,
                        args,
                        str(path),
                        dynamo=True,
                        opset_version=18,
                        verbose=False,
                        input_names=names,
                        output_names=["last_hidden_state"],
                        dynamic_shapes=tuple(dims for _ in names),
                    )
            diff = _export_error(encoder, path, names)
            if not diff < 1e-3:
                raise RuntimeError(f"exported graph differs from torch by {diff:.2e}")
            return {"exporter": exporter, "inputs": names, "export_max_abs_diff": diff}
        except Exception as e:  # noqa: BLE001 - record and try the other exporter
            log.warning("ONNX export with %s failed: %s", exporter, e)
            errors.append(f"{exporter}: {type(e).__name__}: {e}")
            for p in path.parent.glob(path.name + "*"):
                p.unlink()
    raise RuntimeError("ONNX export failed with every exporter:\n" + "\n".join(errors))


def _probe(names: Sequence[str]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A padded (B=3, T=13) batch, shaped unlike the export's example, and its mask."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 2000, size=(3, 13), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    return {n: feeds[n] for n in names}, mask.astype(bool)


def _run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["last_hidden_state"], feeds)[0]  # (B, T, D)


def _export_error(encoder: Any, path: Path, names: Sequence[str]) -> float:
    """Largest |onnx - torch| over real tokens of the probe batch."""
    import torch

    feeds, mask = _probe(names)
    with torch.no_grad():
        ref = encoder(*(torch.from_numpy(feeds[n]) for n in names)).numpy()
    return float(np.abs(_run(path, feeds) - ref)[mask].max())


def _optimize(
    raw: Path, dst: Path, source: Path, info: ModelInfo, names: Sequence[str]
) -> dict[str, Any]:
    """Fuse attention/LayerNorm/GELU with ORT's transformer optimizer; fall back to ORT's own."""
    config = _read_config(source)
    heads = int(getattr(info, "num_heads", 0) or config.get("num_attention_heads") or 0)
    hidden = int(getattr(info, "hidden_size", 0) or config.get("hidden_size") or 0)
    try:
        from onnxruntime.transformers.optimizer import optimize_model

        # opt_level=0: only the Python fusions here; ORT applies its own graph optimizations when
        # the session loads (ORT_ENABLE_ALL), so baking them in now would only tie the file to
        # this ORT build.
        opt = optimize_model(
            str(raw), model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0
        )
        fusions = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        opt.save_model_to_file(str(dst), use_external_data_format=_needs_external(raw))
        # A fusion that matched the wrong pattern would silently corrupt outputs: check it.
        diff = _max_abs_diff(raw, dst, names)
        if not diff < 1e-3:
            raise RuntimeError(f"fused graph differs from the export by {diff:.2e}")
        return {
            "optimizer": "onnxruntime.transformers",
            "fusions": fusions,
            "fusion_max_abs_diff": diff,
        }
    except Exception as e:  # noqa: BLE001 - fusion is an optimization; fall back, say why
        log.warning("transformer fusion failed (%s); using ORT offline optimization", e)
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        opts.optimized_model_filepath = str(dst)
        if _needs_external(raw):  # the 2 GiB protobuf limit applies to the saved graph too
            opts.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", dst.name + ".data"
            )
        ort.InferenceSession(str(raw), opts, providers=["CPUExecutionProvider"])
        return {"optimizer": "onnxruntime-offline", "fusions": {}, "fusion_error": str(e)}


def _quantize(src: Path, dst: Path, per_channel: bool = True) -> dict[str, Any]:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # Weights int8 symmetric, activations uint8 quantized per tensor at run time (MatMulInteger /
    # QAttention). per_channel=True: measured on all-MiniLM-L6-v2 (2,000 sentences, 2 cores),
    # per-tensor weights give mean cosine 0.958 to torch fp32 (fails the 0.99 gate), per-channel
    # 0.992 (min 0.984) at the same speed (batch 32: 276 vs 283 sentences/s, within noise).
    quantize_dynamic(
        str(src),
        str(dst),
        per_channel=per_channel,
        weight_type=QuantType.QInt8,
        use_external_data_format=_needs_external(src),
        # ONNX shape inference cannot type the outputs of ORT's fused contrib ops (Attention,
        # SkipLayerNormalization); everything they produce here is float32.
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    _, ops = _graph_summary(dst)
    return {
        "quantizer": "onnxruntime.quantization.quantize_dynamic",
        "weight_type": "QInt8",
        "per_channel": per_channel,
        "quantized_nodes": {k: ops[k] for k in _QUANT_OPS if ops.get(k)},
        # Float MatMuls left: activation x activation products (QK^T, AV) of unfused attention.
        "float_matmuls_left": ops.get("MatMul", 0) + ops.get("Gemm", 0),
    }


def _max_abs_diff(a: Path, b: Path, names: Sequence[str]) -> float:
    """Largest |a - b| over real tokens of the probe batch, for two ONNX graphs."""
    feeds, mask = _probe(names)
    return float(np.abs(_run(a, feeds) - _run(b, feeds))[mask].max())


def _graph_summary(path: Path) -> tuple[int, dict[str, int]]:
    """(default-domain opset, node count per op type) of an ONNX file, without its weights."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return int(opset), dict(Counter(n.op_type for n in model.graph.node))


def _read_config(path: Path) -> dict[str, Any]:
    import json

    with open(path / "config.json", encoding="utf-8") as f:
        return json.load(f)


def _needs_external(path: Path) -> bool:
    return _onnx_bytes(path) > _EXTERNAL_DATA_BYTES


def _onnx_bytes(path: Path) -> int:
    """Size of an ONNX model including its external-data files (`<name>.data` etc.)."""
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


def _copy_aux_files(source: Path, out: Path) -> list[str]:
    copied = []
    for name in _AUX_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
            copied.append(name)
    for d in sorted(source.iterdir()):
        if d.is_dir() and _ST_MODULE_DIR.match(d.name):
            shutil.copytree(d, out / d.name, dirs_exist_ok=True)
            copied.append(d.name + "/")
    return copied
