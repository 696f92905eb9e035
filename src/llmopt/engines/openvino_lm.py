"""Causal LMs on OpenVINO: the IR export, its weight compression, and the runner.

The route: OpenVINO's own converter on the transformers model, made stateful as optimum-intel
does it. optimum-intel itself does not install here: its releases that import under
openvino 2026 pin transformers below llmopt's, and the older ones that resolve import
`openvino.runtime`, which openvino 2026 removed. openvino-genai installs, but its pipeline runs
its own generation loop and returns no logits for given token ids, which verification needs.
So the export is written here, after optimum-intel's (`optimum/exporters/openvino/stateful.py`):

1. `openvino.convert_model` traces the HF model wrapped with an explicit signature:
   `input_ids`, `attention_mask` (B, past + T), `position_ids`, `logits_index` (the positions
   whose logits are computed: all of them to verify, the last one to generate) and the past keys
   and values per layer, returning the logits and the present keys and values. The causal mask
   is built in the wrapper from the shapes (a 4-D mask transformers takes as given), so the
   traced graph holds no sequence length of the example.
2. A `beam_idx` input gathers the cache rows, then `apply_make_stateful_transformation` turns
   each past/present pair into a state the plugin keeps between calls, with a zero-length
   initial value: the prompt and each decode step are one `infer` on one request, the cache
   never leaves the plugin (what optimum-intel and openvino-genai run).

Weights: `fp32` is the IR in float32, run in f32. `bf16` is the same IR with OpenVINO's bf16
inference precision (CPUs with native bf16). `w8a16` is NNCF's data-free `compress_weights`
INT8_SYM (per output channel, symmetric, as the recipe says), on the decoder's linears only
(embeddings and the head stay float, the recipe's `ignore`). 4-bit recipes (`w4a16-*`: RTN,
AWQ, GPTQ, symmetric or with zero points) arrive as llmopt's compressed-tensors checkpoint
(`llmopt.quant`), and their integer codes and scales are written into the IR unchanged, in the
int4 decompression pattern NNCF writes (codes -> Convert -> [Subtract zero point] -> Multiply
scale -> Reshape -> MatMul), which the CPU plugin runs as int4 weights: the same numbers as every
other engine running that recipe, with OpenVINO's kernels.

The KV cache is kept in the recipe's float type (OpenVINO's CPU default is u8, a quantized
cache); the `kv_cache` option ("u8", "f16", "bf16") opts into another one as a candidate of its
own, since it changes the numbers.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmopt.core.errors import LlmoptError
from llmopt.core.settings import EngineSettings
from llmopt.hardware.host import usable_cores
from llmopt.model.files import copy_tokenizer_files

if TYPE_CHECKING:
    import torch

    from llmopt.core.recipes import Recipe

__all__ = [
    "IR_FILE",
    "ARCHS",
    "build_lm",
    "compile_lm",
    "lm_feeds",
    "OpenVinoLMRunner",
    "lm_recipe_rule",
]

IR_FILE = "model.xml"
ARCHS = ("LlamaForCausalLM",)  # traced and verified here; others run on torch/hf
_PRECISION = {"float32": "f32", "bfloat16": "bf16"}
_LINEAR = re.compile(r"^self\.m\.(model\.layers\.\d+\..+)\.weight$")  # a decoder linear's constant


def lm_recipe_rule(recipe: Recipe) -> str | None:
    """Why the openvino engine cannot run `recipe` on a causal LM (None when it can).

    >>> from llmopt.core.recipes import get_recipe
    >>> lm_recipe_rule(get_recipe("w4a16-gptq")) is None, lm_recipe_rule(get_recipe("fp8-static"))
    (True, 'OpenVINO runs float or int weight-only recipes here (fp32, bf16, w8a16, w4a16-*)')
    """
    weight_only_int = recipe.activations == "none" and recipe.weight_type == "int"
    if recipe.gguf_type or recipe.kv_cache_dtype or not weight_only_int:
        return "OpenVINO runs float or int weight-only recipes here (fp32, bf16, w8a16, w4a16-*)"
    if recipe.dtype not in _PRECISION:
        return "float16 is emulated on the CPU; use bf16 (CPUs with native bf16) or fp32"
    if recipe.weight_bits == 8 and recipe.calibrated:
        return "8-bit weights run through NNCF's own int8 (w8a16); calibrated 8-bit is not wired"
    return None


# -- export ---------------------------------------------------------------------------------------


@dataclass
class _Codes:
    """One quantized linear of a compressed-tensors checkpoint: integer codes (n, k), scales
    (n, groups) and zero points (n, groups) or None, exactly as stored."""

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    bits: int


def build_lm(source: Path, recipe: Recipe, out: Path) -> dict[str, Any]:
    """Export `source` (an HF folder, or llmopt's compressed-tensors checkpoint for a calibrated
    recipe) as a stateful OpenVINO IR in `out`; return the build facts."""
    import openvino as ov

    t0 = time.perf_counter()
    model, codes = _load_dense(Path(source))
    ov_model = _convert(model)
    facts: dict[str, Any] = {
        "engine": f"OpenVINO {ov.get_version()}",
        "route": "openvino.convert_model + stateful KV cache",
        "convert_seconds": round(time.perf_counter() - t0, 3),
    }
    if codes:
        facts["int_linears"] = _insert_codes(ov_model, codes)
        facts["weights"] = "llmopt checkpoint codes and scales, unchanged"
    elif recipe.weight_bits == 8:
        t = time.perf_counter()
        ov_model, n = _compress_int8(ov_model, recipe)
        facts.update(int_linears=n, weights="NNCF compress_weights INT8_SYM per channel")
        facts["compress_seconds"] = round(time.perf_counter() - t, 3)
    _make_stateful(ov_model)
    ov.save_model(ov_model, out / IR_FILE, compress_to_fp16=False)
    copy_tokenizer_files(source, out)
    for name in ("config.json", "generation_config.json"):
        if (Path(source) / name).is_file():
            (out / name).write_bytes((Path(source) / name).read_bytes())
    facts["ir_bytes"] = sum(f.stat().st_size for f in out.glob("model.*"))
    facts["seconds"] = round(time.perf_counter() - t0, 3)
    return facts


def _load_dense(source: Path) -> tuple[Any, dict[str, _Codes]]:
    """The transformers model in float32 (a checkpoint's quantized linears dequantized exactly,
    so the trace sees the recipe's numbers) and the codes of those linears."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((source / "config.json").read_text())
    if "quantization_config" not in cfg:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        return model.eval(), {}
    from safetensors import safe_open

    # The compressed-tensors unpacker the torch engine uses, so both read checkpoints alike.
    from llmopt.engines.native.weights import _packed_bits, _unpack_int32  # heavy: torch

    config = AutoConfig.from_pretrained(source)
    if hasattr(config, "quantization_config"):  # the dense model is built, then filled
        del config.quantization_config
    state: dict[str, torch.Tensor] = {}
    codes: dict[str, _Codes] = {}
    unpack = _unpack_int32()
    for f in sorted(source.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            keys = set(st.keys())
            for key in keys:
                if key.endswith(".weight_scale"):
                    name = key[: -len(".weight_scale")]
                    q, scale, zero, bits = _read_quantized(st, keys, name, unpack, _packed_bits)
                    codes[name] = _Codes(q.numpy(), scale.numpy(), zero, bits)
                    w = q.float() - (0 if zero is None else _repeat(torch.from_numpy(zero), q))
                    state[name + ".weight"] = w * _repeat(scale, q)
                elif not any(key.endswith(s) for s in _CT_SUFFIXES):
                    state[key] = st.get_tensor(key).float()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise LlmoptError(
            f"{source} does not load as {type(model).__name__}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}",
            hint="rebuild the checkpoint with llmopt quantize",
        )
    model.tie_weights()
    return model.eval(), codes


_CT_SUFFIXES = (".weight_packed", ".weight_shape", ".weight_zero_point", ".weight_scale")


def _read_quantized(st, keys, name, unpack, packed_bits):
    import torch

    scale = st.get_tensor(f"{name}.weight_scale").float()
    if f"{name}.weight_packed" in keys:
        shape = torch.Size(st.get_tensor(f"{name}.weight_shape").tolist())
        packed = st.get_tensor(f"{name}.weight_packed")
        bits = packed_bits(packed.shape[-1], shape[-1]) or 4
        q = unpack(packed, bits, shape).to(torch.int8)
    else:
        q = st.get_tensor(f"{name}.weight").to(torch.int8)
        bits = 8
    n = q.shape[0]
    scale = scale.reshape(n, -1)
    zero = None
    if f"{name}.weight_zero_point" in keys:
        zp = st.get_tensor(f"{name}.weight_zero_point")
        if zp.dtype == torch.int32:  # pack-quantized zero points: packed along the output dim
            zp = unpack(zp, bits, torch.Size((n, scale.shape[1])), packed_dim=0)
        zp = zp.reshape(n, -1).to(torch.int8)
        zero = zp.numpy() if bool(zp.any()) else None
    return q, scale, zero, bits


def _repeat(groups: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return groups.float().repeat_interleave(q.shape[1] // groups.shape[1], 1)


def _wrapper(model: Any) -> Any:
    import torch
    from transformers.cache_utils import DynamicCache

    class Wrapper(torch.nn.Module):
        """The explicit signature the trace records (see the module docstring)."""

        def __init__(self, m: Any):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, logits_index, *past):
            cache = DynamicCache(config=self.m.config)
            for i, layer in enumerate(cache.layers):
                # Set, not `update`d: an update concatenates onto an empty constant, which the
                # trace would record with the example's rank.
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
                layer.device, layer.dtype = past[2 * i].device, past[2 * i].dtype
                layer.is_initialized = True
            q, kv = input_ids.shape[1], attention_mask.shape[1]
            kpos = torch.arange(kv, device=input_ids.device)
            causal = kpos[None, :] <= kpos[kv - q :][:, None]
            mask = causal[None, None] & attention_mask[:, None, None, :].bool()
            out = self.m(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=logits_index,
            )
            flat = []
            for layer in cache.layers:  # updated in place by the forward
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return Wrapper(model).eval()


def _convert(model: Any) -> Any:
    import openvino as ov
    import torch

    cfg = model.config
    layers = cfg.num_hidden_layers
    kvh = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    b, t, p = 2, 3, 2  # any sizes: every dimension below is declared dynamic
    example = (
        torch.ones(b, t, dtype=torch.long),
        torch.ones(b, p + t, dtype=torch.long),
        torch.arange(p, p + t).expand(b, t),
        torch.arange(t),
        *[torch.zeros(b, kvh, p, hd) for _ in range(2 * layers)],
    )
    shapes = [ov.PartialShape([-1, -1])] * 3 + [ov.PartialShape([-1])]
    shapes += [ov.PartialShape([-1, kvh, -1, hd])] * (2 * layers)
    with torch.no_grad():
        ov_model = ov.convert_model(_wrapper(model), example_input=example, input=shapes)
    kv = [f"{i // 2}.{'key' if i % 2 == 0 else 'value'}" for i in range(2 * layers)]
    names = ["input_ids", "attention_mask", "position_ids", "logits_index"]
    for port, name in zip(
        ov_model.inputs, names + [f"past_key_values.{n}" for n in kv], strict=True
    ):
        port.get_tensor().set_names({name})
    for port, name in zip(ov_model.outputs, ["logits"] + [f"present.{n}" for n in kv], strict=True):
        port.get_tensor().set_names({name})
    return ov_model


def _weight_matmuls(ov_model: Any) -> list[tuple[Any, Any, str | None]]:
    """(MatMul, its weight Constant, the HF linear name or None) for every MatMul on a constant."""
    out = []
    for op in ov_model.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        src = op.input_value(1).get_node()
        if src.get_type_name() == "Constant":
            m = _LINEAR.match(src.get_friendly_name())
            out.append((op, src, m.group(1) if m else None))
    return out


def _compress_int8(ov_model: Any, recipe: Recipe) -> tuple[Any, int]:
    import nncf

    def ignored(name: str | None) -> bool:
        return name is None or any(name == p or name.endswith("." + p) for p in recipe.ignore)

    mm = _weight_matmuls(ov_model)
    skip = [op.get_friendly_name() for op, _, name in mm if ignored(name)]
    # Embedding lookups are Gathers on a constant; the recipe quantizes linears only.
    skip += [
        op.get_friendly_name()
        for op in ov_model.get_ordered_ops()
        if op.get_type_name() == "Gather"
        and op.input_value(0).get_node().get_type_name() == "Constant"
    ]
    compressed = nncf.compress_weights(
        ov_model,
        mode=nncf.CompressWeightsMode.INT8_SYM,
        ignored_scope=nncf.IgnoredScope(names=skip, validate=False),
    )
    return compressed, sum(1 for _, _, name in mm if not ignored(name))


def _insert_codes(ov_model: Any, codes: dict[str, _Codes]) -> int:
    """Replace each quantized linear's float constant by its integer codes and scales."""
    import openvino as ov
    from openvino import opset13 as ops

    done = 0
    for op, const, name in _weight_matmuls(ov_model):
        c = codes.get(name or "")
        if c is None:
            continue
        n, k = c.q.shape
        groups = c.scale.shape[1]
        g = k // groups
        if c.zero is None:  # symmetric: signed codes times the scale
            w = ops.convert(
                ops.constant(c.q.reshape(n, groups, g), dtype=_int_type(c.bits, True)), ov.Type.f32
            )
        else:  # with zero points: unsigned codes (both shifted by the same offset) minus the zero
            off = 1 << (c.bits - 1)
            qu = (c.q.astype(np.int16) + off).astype(np.uint8).reshape(n, groups, g)
            zu = (c.zero.astype(np.int16) + off).astype(np.uint8).reshape(n, groups, 1)
            w = ops.subtract(
                ops.convert(ops.constant(qu, dtype=_int_type(c.bits, False)), ov.Type.f32),
                ops.convert(ops.constant(zu, dtype=_int_type(c.bits, False)), ov.Type.f32),
            )
        w = ops.multiply(w, ops.constant(c.scale.reshape(n, groups, 1).astype(np.float32)))
        w = ops.reshape(w, ops.constant(np.array([n, k], dtype=np.int64)), special_zero=False)
        w.set_friendly_name(const.get_friendly_name())
        op.input(1).replace_source_output(w.output(0))
        done += 1
    if done != len(codes):
        raise LlmoptError(
            f"{len(codes) - done} quantized linears of the checkpoint were not found in the IR",
            hint="this architecture's linears are named differently; run it on the torch engine",
        )
    ov_model.validate_nodes_and_infer_types()
    return done


def _int_type(bits: int, signed: bool) -> Any:
    import openvino as ov

    if bits == 4:
        return ov.Type.i4 if signed else ov.Type.u4
    return ov.Type.i8 if signed else ov.Type.u8


def _make_stateful(ov_model: Any) -> None:
    """optimum-intel's `patch_stateful`: a `beam_idx` gather on each past input, the past/present
    pairs made states, each state's initial value zeros of length 0 for the batch of the call."""
    import openvino as ov
    from openvino import opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    past = [p.get_any_name() for p in ov_model.inputs if p.get_any_name().startswith("past_")]
    present = [p.get_any_name() for p in ov_model.outputs if p.get_any_name().startswith("present")]
    beam = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam.output(0).get_tensor().set_names({"beam_idx"})
    ov_model.add_parameters([beam])
    for name in past:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()
        gathered = ops.gather(port, beam, ops.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gathered.output(0))
    ov_model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(ov_model, dict(zip(past, present, strict=True)))
    ids = ov_model.input("input_ids")
    batch = ops.gather(ops.shape_of(ids, output_type="i64"), ops.constant([0]), ops.constant(0))
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.min_length for d in list(op.get_output_partial_shape(0))]
            parts = [batch] + [ops.constant(np.array([d], dtype=np.int64)) for d in dims[1:]]
            zero = ops.constant(0.0, dtype=op.get_output_element_type(0))
            op.set_arguments([ops.broadcast(zero, ops.concat(parts, 0))])
    ov_model.validate_nodes_and_infer_types()


def compile_lm(artifact: Path, settings: EngineSettings, dtype: str = "float32") -> tuple:
    """Compile the artifact's stateful IR for the CPU as `settings` say (see `OpenVinoLMRunner`
    for the options); returns (compiled model, tokenizer, inference precision, threads). The
    runner and the serve generator (`llmopt.engines.openvino_generator`) both load through
    here, so a served candidate runs with the settings it was verified with."""
    import openvino as ov
    from transformers import AutoTokenizer

    opts = dict(settings.options)
    precision = str(opts.get("precision", _PRECISION.get(dtype, "f32")))
    threads = int(settings.threads or usable_cores())
    config: dict[str, Any] = {
        "INFERENCE_PRECISION_HINT": precision,
        "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": int(opts.get("streams", 1)),
        "KV_CACHE_PRECISION": str(opts.get("kv_cache", precision)),
        # 0: activations stay float. The CPU plugin's default quantizes them to int8 per
        # group in front of int weights, which the w*a16 recipes do not (a setting).
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": int(opts.get("dynamic_quant_group", 0)),
    }
    if "cpu_pinning" in opts:
        config["ENABLE_CPU_PINNING"] = bool(opts["cpu_pinning"])
    path = Path(artifact) / IR_FILE
    if not path.is_file():
        raise LlmoptError(f"{path} is missing", hint="rebuild the openvino candidate")
    tokenizer = AutoTokenizer.from_pretrained(str(artifact))
    try:
        compiled = ov.Core().compile_model(str(path), "CPU", config)
    except RuntimeError as e:
        raise LlmoptError(
            f"OpenVINO could not load {path}: {str(e).splitlines()[0]}",
            hint="the IR is damaged or from another OpenVINO: rebuild the openvino candidate",
        ) from e
    return compiled, tokenizer, precision, threads


def lm_feeds(ids: np.ndarray, past: int, keep: np.ndarray) -> dict[str, np.ndarray]:
    """The stateful IR's inputs for `ids` (B, T) following `past` tokens already in the
    request's state: the mask covers past + T, positions continue from `past`, and the logits
    are computed at the positions `keep` (of the T). A prompt may so arrive in pieces (chunked
    prefill): each piece is one infer on the same request."""
    b, t = ids.shape
    return {
        "input_ids": ids.astype(np.int64),
        "attention_mask": np.ones((b, past + t), dtype=np.int64),
        "position_ids": np.broadcast_to(np.arange(past, past + t, dtype=np.int64), (b, t)),
        "logits_index": keep.astype(np.int64),
        "beam_idx": np.arange(b, dtype=np.int32),
    }


# -- runner ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _State:
    """Where a sequence batch stands in the runner's one stateful request."""

    generation: int
    pos: int
    batch: int


class OpenVinoLMRunner:
    """`CausalLMRunner` on the compiled stateful IR: one infer request holds the KV cache.

    Args:
        artifact: folder with model.xml/.bin and the tokenizer files.
        settings: threads (INFERENCE_NUM_THREADS); options: streams (NUM_STREAMS, default 1),
            precision ("f32" or "bf16": INFERENCE_PRECISION_HINT, default the recipe's dtype),
            kv_cache (KV_CACHE_PRECISION, default the inference precision), cpu_pinning
            (ENABLE_CPU_PINNING, default OpenVINO's).
        dtype: the recipe's float type ("float32" or "bfloat16").

    A prefill starts a new cache (`reset_state`); a decode continues the latest prefill only,
    and refuses a state from an earlier one, since the cache of that one is gone.
    """

    def __init__(self, artifact: Path, settings: EngineSettings, dtype: str = "float32"):
        self.compiled, self.tokenizer, self.precision, self.threads = compile_lm(
            artifact, settings, dtype
        )
        self.request = self.compiled.create_infer_request()
        self._generation = 0
        self._at: _State | None = None

    def linear_kernels(self) -> dict[str, int]:
        """How the CPU plugin runs the linears: weight precision of its FullyConnected kernels ->
        count (e.g. {"i4": 210, "f32": 1}), from the compiled model, so a build whose int weights
        were folded back to float cannot pass for a quantized one."""
        counts: dict[str, int] = {}
        for op in self.compiled.get_runtime_model().get_ops():
            rt = op.get_rt_info()
            if "layerType" in rt and rt["layerType"].astype(str) == "FullyConnected":
                kind = rt["runtimePrecision"].astype(str)
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def _infer(self, ids: np.ndarray, past: int, keep: np.ndarray) -> np.ndarray:
        feeds = lm_feeds(ids, past, keep)
        self.request.infer(feeds)
        return np.array(self.request.get_tensor("logits").data, dtype=np.float32)

    def _start(self, ids: np.ndarray, keep: np.ndarray) -> np.ndarray:
        self.request.reset_state()
        self._generation += 1
        out = self._infer(ids, 0, keep)
        self._at = _State(self._generation, ids.shape[1], ids.shape[0])
        return out

    # -- the CausalLMRunner protocol -------------------------------------------------------------
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        import torch

        ids = input_ids.cpu().numpy()
        return torch.from_numpy(self._start(ids, np.arange(ids.shape[1])))

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        import torch

        ids = input_ids.cpu().numpy()
        out = self._start(ids, np.array([ids.shape[1] - 1]))
        return torch.from_numpy(out[:, -1]), self._at

    def decode(self, tokens: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        import torch

        if state != self._at or not isinstance(state, _State):
            raise ValueError(
                "this OpenVINO runner holds one KV cache: decode continues the latest prefill "
                "(or decode) only; prefill again to start another sequence"
            )
        ids = tokens.cpu().numpy().reshape(state.batch, 1)
        out = self._infer(ids, state.pos, np.array([0]))
        self._at = _State(state.generation, state.pos + 1, state.batch)
        return torch.from_numpy(out[:, -1]), self._at
