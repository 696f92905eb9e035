"""The `torch` engine: llmopt's native decoder (paged KV cache, compiled decode) as an engine plugin.

Builds write dense and int8 folders with the `hf` engine's writers (the same safetensors
layouts); for calibrated recipes (AWQ, GPTQ, FP8...) the build stage has already run
`llmopt.quant`, and `build` only links that compressed-tensors checkpoint in. Models the native
decoder does not implement are refused with the reason, and stay runnable on the `hf` engine.

It serves two ways: `load` returns a `NativeCausalLMRunner` (one batch at a time, for
verification and benchmarks), and `load_generator` a `Generator` (continuous batching: the
`BatchGenerator` that `llmopt serve` drives, see `llmopt.engines.generation`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmopt.assets.models import resolve_model
from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine, register_engine
from llmopt.engines.base import Engine
from llmopt.engines.generation import GeneratorSpec, OutOfBlocks
from llmopt.engines.native.config import NativeConfig, UnsupportedModel
from llmopt.model.files import link_tree

if TYPE_CHECKING:
    import torch

    from llmopt.core.recipes import Recipe
    from llmopt.engines.native.generator import Generator
    from llmopt.model.info import ModelInfo

__all__ = ["NativeEngine", "NativeCausalLMRunner", "load_generator"]

DENSE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Recipes whose weights this engine's kernels run, and the kernel family (see linear.py).
QUANTIZED = {"w8a16": "int8"}


def _kernel_for(recipe: Recipe) -> str | None:
    """The linear kernel a recipe needs: None (dense), "int8", "int4" or "fp8"."""
    if recipe.name in QUANTIZED:
        return QUANTIZED[recipe.name]
    bits = getattr(recipe, "weight_bits", None)
    if bits is None:
        return None
    wtype = getattr(recipe, "weight_type", "int")
    acts = getattr(recipe, "activations", "none")
    if wtype == "float" and bits == 8:
        return "fp8"
    if acts not in ("none", None):
        return "unsupported"
    return {8: "int8", 4: "int4"}.get(bits, "unsupported")


@register_engine
class NativeEngine(Engine):
    name = "torch"
    tasks = ("causal-lm",)
    batching = True

    def incompatible(self, info: ModelInfo, recipe: Recipe, device: str) -> str | None:

        if info.task != "causal-lm":
            return "the native torch engine runs decoder LMs; embeddings run on the hf engine"
        try:
            NativeConfig.from_hf(json.loads((Path(info.path) / "config.json").read_text()))
        except UnsupportedModel as e:
            return e.message
        kernel = _kernel_for(recipe)
        if recipe.name == "fp16" and device == "cpu":
            return "float16 matmuls are emulated on most CPUs (slower than fp32); use bf16 on CPU"
        if kernel == "unsupported":
            return f"no native kernel for {recipe.name!r} (quantized activations other than FP8)"
        if kernel == "fp8" and device == "cpu":
            return "FP8 matmuls need an NVIDIA GPU of compute capability 8.9+; CPUs have none"
        if recipe.name not in DENSE and kernel is None:
            return f"the torch engine does not know recipe {recipe.name!r}"
        group = getattr(recipe, "group_size", None)
        if kernel == "int4" and group:
            widths = {info.hidden_size, info.intermediate_size or info.hidden_size}
            if any(w % group for w in widths) or group not in (32, 64, 128, 256):
                return (
                    f"int4 group size {group} must be 32, 64, 128 or 256 and divide the "
                    f"model's widths {sorted(widths)}"
                )
        return None

    def settings_space(self, info: ModelInfo, recipe: Recipe, device: str) -> list[dict[str, Any]]:
        """Engine settings worth measuring as separate candidates (the first is the default).

        On the CPU the decode step runs eagerly by default. Compiled it is faster, but each
        compiled shape is a C++ build of about a minute there, which in a short search takes the
        time full verification needs (docs/benchmarks.md), so compiled candidates are searched
        only when named (`--candidates torch-fp32-compile`). On CUDA the default already
        compiles (CUDA graphs). Quantized recipes that leave the output projection dense also
        get a candidate with an int8 one (`lm_head: int8`, `_head_variation`).
        """
        if device == "cpu" and (recipe.name in DENSE or recipe.name in QUANTIZED):
            why = "compiled decode on the CPU costs ~1 min per shape (opt-in)"
            out: list[dict[str, Any]] = [{}, {"compile": True, "opt_in": why}]
        else:
            out = [{}]
        if _kernel_for(recipe) in ("int8", "int4", "fp8") and "lm_head" in recipe.ignore:
            out.append(self._head_variation(device))
        return out

    @staticmethod
    def _head_variation(device: str) -> dict[str, Any]:
        """A quantized model with an int8 output projection (`weights.quantize_head_`): fewer
        bytes read per decode step, for a small change in the numbers, so a verified candidate
        of its own. Searched by default on CUDA, where the head is a large share of a quantized
        step's reads; on the CPU each candidate is minutes of verification: opt-in."""
        if device == "cpu":
            return {"lm_head": "int8", "opt_in": "an int8 output projection (opt-in on the CPU)"}
        return {"lm_head": "int8"}

    def tune_space(self, info: ModelInfo, recipe: str, device: str) -> list[dict[str, Any]]:
        """Runtime settings worth measuring on the chosen candidate (`llmopt.optimize.tune`):
        on the CPU, the compiled decode. Compiling changes how fast the same weights run, not
        what they compute, so it needs no verification of its own, only side-by-side rounds;
        the tune rung tries it when the budget affords the compiles. On CUDA the default
        already compiles."""
        if device == "cpu" and (recipe in DENSE or recipe in QUANTIZED):
            return [{"compile": True}]
        return []

    def build(self, source: Path, info: ModelInfo, recipe: Recipe, out: Path) -> dict[str, Any]:
        if recipe.name in DENSE or recipe.name in QUANTIZED:
            facts = get_engine("hf").build(source, info, recipe, out)
        else:
            # Calibrated recipes (AWQ, GPTQ, FP8...): the build stage above the engines ran
            # `llmopt.quant` first and `source` is its compressed-tensors folder, taken in as it
            # is (hard links where the filesystem allows: no second copy on disk).
            config = json.loads((Path(source) / "config.json").read_text())
            if "quantization_config" not in config:
                raise ValueError(
                    f"recipe {recipe.name!r}: the torch engine loads calibrated checkpoints; "
                    f"{source} is not one (quantize it first: llmopt.quant.build_checkpoint)"
                )
            link_tree(Path(source), out, dirs_exist_ok=True)
            facts = {}
        return {**facts, "engine": "torch (native)", "kernel": _kernel_for(recipe) or "dense"}

    def load(self, artifact: Path, info: ModelInfo, recipe: Recipe, settings: EngineSettings):
        import torch

        if settings.threads:
            torch.set_num_threads(int(settings.threads))
        gen = load_generator(
            artifact,
            recipe=recipe,
            device=settings.device,
            max_batch=int(settings.max_batch or 8),
            max_seq_len=settings.max_seq_len,
            compile=settings.compile,
            lm_head=settings.options.get("lm_head"),
        )
        return NativeCausalLMRunner(gen)

    def load_generator(self, spec: GeneratorSpec) -> Generator:
        """The continuous-batching `Generator` a server drives (`llmopt serve`)."""
        return load_generator(
            spec.model,
            spec.recipe,
            spec.device,
            max_batch=spec.max_batch,
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            max_seq_len=spec.max_seq_len,
            batch_sizes=spec.batch_sizes,
            compile_prefill=spec.compile_prefill,
            prefix_caching=spec.prefix_caching,
            lm_head=(spec.settings or {}).get("lm_head"),
        )


def load_generator(
    model: str | Path,
    recipe: str | Recipe = "fp32",
    device: str = "cpu",
    *,
    max_batch: int = 8,
    block_size: int = 16,
    num_blocks: int | None = None,
    max_seq_len: int | None = None,
    compile: bool | None = None,
    batch_sizes: list[int] | tuple[int, ...] | None = None,
    min_bucket_tokens: int | None = None,
    compile_prefill: bool = False,
    overlap: bool | None = None,
    prefix_caching: bool = False,
    lm_head: str | None = None,
) -> Generator:
    """A ready `Generator` for a folder, built-in name or built artifact, with its tokenizer.

    Args:
        model: HF folder (dense or compressed-tensors) or built-in name.
        recipe: dense recipes pick the dtype; `w8a16`/int4/fp8 recipes quantize dense weights on
            load (round-to-nearest) unless the folder is already quantized.
        compile: torch.compile the decode step (default: on for CUDA, off for CPU).
        batch_sizes, min_bucket_tokens: the decode shapes (see `Generator`).
        compile_prefill: torch.compile the prefill forward too (dynamic shapes; see `Generator`).
        overlap: launch the next greedy decode step before reading this one's tokens back
            (default: on for CUDA; see `Generator`).
        prefix_caching: reuse the KV blocks of prompt prefixes computed before (see `Generator`).
        lm_head: "int8" for an int8 (per-channel, weight-only) output projection where the
            recipe leaves it dense (`weights.quantize_head_`); None or "dense" keeps it dense.
    """
    import torch
    from transformers import AutoTokenizer

    from llmopt.engines.native.generator import Generator  # heavy: torch
    from llmopt.engines.native.weights import load_model  # heavy: torch

    folder, _ = resolve_model(model)
    rec = get_recipe(recipe)
    dtype = getattr(torch, rec.dtype)
    if device == "cpu" and dtype == torch.float16:
        dtype = torch.float32
    kernel = _kernel_for(rec)
    group = int(getattr(rec, "group_size", None) or 128)
    head = None if lm_head == "dense" else lm_head  # (an unknown format: load_model refuses it)
    net = load_model(
        folder, device, dtype, quant=kernel, ignore=tuple(rec.ignore), group=group, head=head
    )
    tok = AutoTokenizer.from_pretrained(folder)
    return Generator(
        net,
        tok,
        max_batch=max_batch,
        block_size=block_size,
        num_blocks=num_blocks,
        max_seq_len=max_seq_len,
        compile=(device != "cpu") if compile is None else bool(compile),
        batch_sizes=batch_sizes,
        min_bucket_tokens=min_bucket_tokens,
        compile_prefill=compile_prefill,
        overlap=overlap,
        prefix_caching=prefix_caching,
    )


class NativeCausalLMRunner:
    """The CausalLMRunner protocol (logits / prefill / decode) over a `Generator`'s model.

    One prefill/decode state is live at a time: a new `prefill` releases the previous state's
    KV blocks (verification and benchmarks run one sequence batch at a time).
    """

    def __init__(self, gen):
        self.gen, self.tokenizer = gen, gen.tokenizer
        self._blocks: list[int] = []
        self._rings: list[int] = []  # local-pool blocks (models whose local layers hold rings)

    def _release(self) -> None:
        self.gen.pool.give_back(self._blocks)
        self._blocks = []
        if self._rings:
            self.gen.local_pool.give_back(self._rings)
            self._rings = []

    def _alloc_rings(self, b: int) -> torch.Tensor | None:
        """(b, ring) ring block ids from the generator's local pool; None without one."""
        import torch

        pool, r = self.gen.local_pool, self.gen.ring
        if pool is None:
            return None
        if b * r > pool.free:
            raise OutOfBlocks(
                f"{b} sequences need {b * r} local-layer KV blocks, {pool.free} free; "
                "raise max_batch"
            )
        got = pool.take(b * r)
        self._rings.extend(got)
        return torch.tensor(got, device=self.gen.device).view(b, r)

    def _alloc(self, n: int) -> list[int]:
        pool = self.gen.pool
        if n > pool.free:
            raise OutOfBlocks(f"need {n} KV blocks, {pool.free} free; raise max_batch")
        got = pool.take(n)
        self._blocks.extend(got)
        return got

    def _prefill(self, input_ids: torch.Tensor, last_only: bool):
        import torch

        self._release()
        b, t = input_ids.shape
        nb = self.gen.blocks_needed(t + 1)
        tables = torch.tensor([self._alloc(nb) for _ in range(b)], device=self.gen.device)
        rings = self._alloc_rings(b)
        ids = input_ids.to(self.gen.device)
        pos = torch.arange(t, device=self.gen.device).expand(b, t)
        with torch.inference_mode():
            out = self.gen.model(
                ids, pos, tables, prefill=True, last_only=last_only, local_tables=rings
            )
        return out, {"tables": tables, "len": t, "rings": rings}

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self._prefill(input_ids, last_only=False)
        self._release()
        return out.float().cpu()

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out, state = self._prefill(input_ids, last_only=True)
        return out.float().cpu(), state

    def decode(self, tokens: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        import torch

        gen, tables, n = self.gen, state["tables"], state["len"]
        if n // gen.block_size >= tables.shape[1]:  # grow every row's table by one block
            extra = torch.tensor(
                [self._alloc(1) for _ in range(tables.shape[0])], device=gen.device
            )
            tables = torch.cat([tables, extra], dim=1)
        b = tokens.shape[0]
        pos = torch.full((b, 1), n, dtype=torch.long, device=gen.device)
        # Pad the tables to a length bucket and the rows to a batch size (block 0 is scratch,
        # masked) so a compiled decode sees the generator's few shapes, not one per block.
        width = gen.table_width(tables.shape[1])
        padded = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
        rings = state.get("rings")
        parts = [tokens.to(gen.device), pos, padded] + ([rings] if rings is not None else [])
        packed = torch.cat(parts, dim=1)
        rows = gen.padded_batch(b) if b <= gen.max_batch else b
        packed = torch.nn.functional.pad(packed, (0, 0, 0, rows - b))
        with torch.inference_mode():
            out = gen.decode_packed(packed)[0][:b]
        return out.float().cpu(), {"tables": tables, "len": n + 1, "rings": rings}
