"""The `llamacpp` engine: llama.cpp (through llama-cpp-python) as a measured candidate.

Build: llmopt's GGUF exporter writes the candidate's weights as a float GGUF
(`llmopt.engines.gguf_export`), then llama.cpp's own quantizer (`llama_model_quantize`) turns it
into the block type of the recipe (Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0: the types users pick by
hand). The artifact is `model.gguf` plus the tokenizer files.

Load: a runner on llama.cpp's C API (`llama_decode` over a multi-sequence batch), so the same
harness as every other engine measures it: full-sequence logits for verification (perplexity,
KL and top-1 against the reference on the *same token ids*), prefill and decode at batch 1 and
above. The high-level `llama_cpp.Llama` holds one sequence only, which would leave batch decode
unmeasured; the C calls used here are the ones llama.cpp's own batched example makes.

Before any number is taken, the runner checks that the GGUF's tokenizer encodes text exactly as
the Hugging Face tokenizer does: verification feeds both models the HF tokenizer's ids, and a
mismatch would compare different inputs. It refuses with the first differing position otherwise.

ggml's "extra" buffer types (the AMX matmul and the repacked Q4_0/Q8_0 layouts) are on, except
on CPUs with AMX: llama-cpp-python 0.3.x built there crashes in its AMX kernel, so they are off
unless the candidate's settings ask for them (`options={"extra_bufts": True}`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from llmopt.core.errors import LlmoptError
from llmopt.core.settings import EngineSettings
from llmopt.engines import register_engine
from llmopt.engines.base import Engine
from llmopt.hardware.host import isa_features, usable_cores
from llmopt.model.files import copy_tokenizer_files

if TYPE_CHECKING:
    import torch

    from llmopt.core.recipes import Recipe
    from llmopt.model.info import ModelInfo

__all__ = [
    "LlamaCppEngine",
    "LlamaCppRunner",
    "FLOAT_TYPES",
    "GGUF_FILE",
    "quantize_gguf",
    "use_extra_bufts",
]

log = logging.getLogger(__name__)

GGUF_FILE = "model.gguf"
# The recipes' dtypes as llmopt's exporter writes them (norms stay F32 in every type).
FLOAT_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")  # what llmopt's GGUF exporter writes
_CHECK_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France; 3.14159 is "
    "pi.\nHello, world!  Tabs\tand  double  spaces, émigré naïve café, 日本語, <|im_start|>."
)


def _amx_cpu() -> bool:
    return any(f.startswith("amx") for f in isa_features())


def use_extra_bufts(settings: EngineSettings) -> bool:
    """Whether ggml's extra buffer types (AMX, repacked layouts) are on for these settings: as
    the settings say, else on except on AMX CPUs (see the module docstring)."""
    return bool(settings.options.get("extra_bufts", not _amx_cpu()))


@register_engine
class LlamaCppEngine(Engine):
    """llama.cpp on CPU (GPU where llama-cpp-python was built with CUDA), GGUF artifacts."""

    name = "llamacpp"
    tasks = ("causal-lm",)
    extra = "llamacpp"
    gguf: ClassVar[bool] = True

    def missing(self) -> str | None:
        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python is not installed: pip install 'llmopt[llamacpp]'"
        return None

    def incompatible(self, info: ModelInfo, recipe: Recipe, device: str) -> str | None:
        if info.task != "causal-lm":
            return "llama.cpp runs causal LMs here (embedders run on hf/onnxruntime)"
        if info.architecture not in _ARCHS:
            return (
                f"llmopt's GGUF exporter writes {', '.join(_ARCHS)}, not {info.architecture} "
                "(convert with llama.cpp's convert_hf_to_gguf.py and serve with --engine llamacpp)"
            )
        if not recipe.gguf_type and (recipe.weight_bits or recipe.kv_cache_dtype):
            return "llama.cpp runs its own GGUF types (the gguf-* recipes) or float weights"
        if not recipe.gguf_type and recipe.dtype not in FLOAT_TYPES:
            return f"no GGUF float type for {recipe.dtype}"
        if device == "cpu" and recipe.dtype == "float16" and not recipe.gguf_type:
            return "float16 matmuls are converted to float32 on the CPU (use bf16 or a GGUF type)"
        if device == "cpu" and recipe.dtype == "bfloat16" and "avx512_bf16" not in isa_features():
            return "this CPU has no AVX512-BF16: llama.cpp's BF16 path is emulated here"
        if device == "cuda" and not _gpu_offload():
            return (
                "this llama-cpp-python build has no GPU offload; rebuild it with "
                "CMAKE_ARGS='-DGGML_CUDA=on' pip install --force-reinstall llama-cpp-python"
            )
        return None

    def tune_space(self, info: ModelInfo, recipe: str, device: str) -> list[dict[str, Any]]:
        """Runtime variations of a chosen llama.cpp candidate (rung 4, `llmopt.optimize.tune`):
        flash attention forced on and off against llama.cpp's own automatic choice. Both compute
        the same attention, so no new verification is needed; which is faster depends on the
        CPU, the context length and the batch. (A quantized KV cache changes what is computed:
        that would be a verified candidate, not a runtime variation.)"""
        return [{"flash_attn": True}, {"flash_attn": False}]

    def build(self, source: Path, info: ModelInfo, recipe: Recipe, out: Path) -> dict[str, Any]:
        from llmopt.engines.gguf_export import export_gguf  # heavy: torch

        t0 = time.perf_counter()
        target = out / GGUF_FILE
        if not recipe.gguf_type:
            facts = export_gguf(Path(source), target, FLOAT_TYPES[recipe.dtype])
        else:
            # Quantize from the source's own precision: F32 keeps every bit the quantizer sees.
            base = out / ".base-f32.gguf"
            facts = export_gguf(Path(source), base, "F32")
            try:
                quantize_gguf(base, target, recipe.gguf_type)
            finally:
                base.unlink(missing_ok=True)
        copy_tokenizer_files(Path(source), out)
        for name in ("config.json", "generation_config.json"):
            if (Path(source) / name).is_file() and not (out / name).exists():
                (out / name).write_bytes((Path(source) / name).read_bytes())
        return {
            "engine": "llama.cpp (llama-cpp-python " + _version() + ")",
            "format": f"GGUF {recipe.gguf_type or FLOAT_TYPES[recipe.dtype]}",
            "tensors_before_quantize": facts.get("tensors"),
            "bytes": target.stat().st_size,
            "seconds": round(time.perf_counter() - t0, 3),
        }

    def load(
        self, artifact: Path, info: ModelInfo, recipe: Recipe, settings: EngineSettings
    ) -> LlamaCppRunner:
        return LlamaCppRunner(Path(artifact), settings, max_context=info.max_context)


def _version() -> str:
    try:
        import llama_cpp

        return str(llama_cpp.__version__)
    except ImportError:
        return "?"


def _gpu_offload() -> bool:
    try:
        import llama_cpp

        return bool(llama_cpp.llama_supports_gpu_offload())
    except ImportError:
        return False


def quantize_gguf(source: Path, out: Path, gguf_type: str, threads: int | None = None) -> None:
    """llama.cpp's quantizer: `source` (a float GGUF) -> `out` in `gguf_type` (e.g. "Q4_K_M").

    Written to a temporary name and renamed, so `out` is complete or absent.
    """
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}", None)
    if ftype is None:
        raise ValueError(f"llama.cpp has no GGUF type {gguf_type!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads or usable_cores()
    tmp = out.with_name(f".tmp-{out.name}")
    rc = llama_cpp.llama_model_quantize(
        str(source).encode(), str(tmp).encode(), ctypes.byref(params)
    )
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({source.name} -> {gguf_type}) returned {rc}")
    tmp.replace(out)


class LlamaCppRunner:
    """`CausalLMRunner` over llama.cpp's C API: one context, one sequence per batch row.

    Args:
        artifact: folder with `model.gguf` and the tokenizer files.
        settings: threads, device, max_batch (sequences held at once, default 8), max_seq_len
            (tokens per sequence, default min(model context, 2048)); options: n_batch (tokens
            per llama_decode call, default 512), flash_attn (True/False; default llama.cpp's
            auto), extra_bufts (see the module docstring).
        max_context: the model's context length.
    """

    def __init__(self, artifact: Path, settings: EngineSettings, max_context: int | None = None):
        import llama_cpp as lc
        from transformers import AutoTokenizer

        self._lc = lc
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its per-load chatter
        opts = dict(settings.options)
        self.max_batch = int(settings.max_batch or 8)
        self.per_seq = int(settings.max_seq_len or min(max_context or 2048, 2048))
        self.n_batch = int(opts.get("n_batch", 512))
        self.threads = int(settings.threads or usable_cores())
        self.tokenizer = AutoTokenizer.from_pretrained(artifact)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.use_extra_bufts = use_extra_bufts(settings)
        mp.n_gpu_layers = 999 if settings.device == "cuda" else 0
        path = artifact / GGUF_FILE
        self._model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise LlmoptError(f"llama.cpp could not load {path}", hint="rebuild the candidate")
        cp = lc.llama_context_default_params()
        cp.n_ctx = self.per_seq * self.max_batch
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_seq_max = self.max_batch
        cp.kv_unified = True  # the sequences share one cache of n_ctx cells
        cp.n_threads = cp.n_threads_batch = self.threads
        if "flash_attn" in opts:
            on = bool(opts["flash_attn"])
            cp.flash_attn_type = (
                lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if on else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        self._ctx = lc.llama_init_from_model(self._model, cp)
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise LlmoptError(
                f"llama.cpp could not create a context of {cp.n_ctx} tokens",
                hint="lower max_seq_len or max_batch in the candidate's settings",
            )
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
        self._batch = lc.llama_batch_init(self.n_batch, 0, self.max_batch)
        self.check_tokenizer()

    # -- the CausalLMRunner protocol -------------------------------------------------------------
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        import torch

        rows = []
        for row in input_ids.tolist():
            self._clear()
            rows.append(self._feed([(0, row)], all_logits=True))
        return torch.from_numpy(np.stack(rows)).float()

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        import torch

        rows = input_ids.tolist()
        if len(rows) > self.max_batch:
            raise ValueError(f"batch {len(rows)} > max_batch {self.max_batch} of this runner")
        self._clear()
        last = self._feed(list(enumerate(rows)), all_logits=False)
        return torch.from_numpy(last).float(), {"n_past": len(rows[0]), "rows": len(rows)}

    def decode(self, tokens: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        import torch

        n_past = int(state["n_past"])
        if n_past + 1 > self.per_seq:
            raise ValueError(f"sequence longer than max_seq_len {self.per_seq}")
        toks = [int(t) for t in tokens.view(-1).tolist()]
        self._set_batch([(s, n_past, t, True) for s, t in enumerate(toks)])
        self._decode()
        out = np.stack([self._logits_at(i) for i in range(len(toks))])
        return torch.from_numpy(out).float(), {**state, "n_past": n_past + 1}

    # -- checks ------------------------------------------------------------------------------------
    def check_tokenizer(self, text: str = _CHECK_TEXT) -> None:
        """Refuse when the GGUF's tokenizer and the HF tokenizer encode `text` differently."""
        hf = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        mine = self.tokenize(text)
        if hf != mine:
            at = next((i for i, (a, b) in enumerate(zip(hf, mine, strict=False)) if a != b), None)
            at = min(len(hf), len(mine)) if at is None else at
            raise LlmoptError(
                "the GGUF's tokenizer encodes text differently from the model's Hugging Face "
                f"tokenizer (first difference at token {at}: {hf[at : at + 3]} vs "
                f"{mine[at : at + 3]}); its quality cannot be compared on the same ids",
                hint="export the GGUF from this model folder's own tokenizer.json",
            )

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode("utf-8")
        n = len(raw) + 16
        buf = (self._lc.llama_token * n)()
        got = self._lc.llama_tokenize(self._vocab, raw, len(raw), buf, n, False, True)
        if got < 0:
            raise RuntimeError(f"llama_tokenize needs {-got} tokens")
        return list(buf[:got])

    def close(self) -> None:
        lc = self._lc
        if getattr(self, "_batch", None) is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the library may be gone
            self.close()

    # -- llama.cpp calls ---------------------------------------------------------------------------
    def _clear(self) -> None:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self._ctx), True)

    def _feed(self, seqs: list[tuple[int, list[int]]], all_logits: bool) -> np.ndarray:
        """Decode each (seq_id, tokens) from position 0, in chunks of n_batch tokens. Returns
        (T, V) logits of every position for one sequence (all_logits), else (S, V) last ones."""
        if any(len(t) > self.per_seq for _, t in seqs):
            raise ValueError(f"sequence longer than max_seq_len {self.per_seq}")
        cells = [(s, p, tok) for s, toks in seqs for p, tok in enumerate(toks)]
        ends = {(s, len(toks) - 1) for s, toks in seqs}
        out: list[np.ndarray] = []
        last: dict[int, np.ndarray] = {}
        for start in range(0, len(cells), self.n_batch):
            chunk = cells[start : start + self.n_batch]
            want = [all_logits or (s, p) in ends for s, p, _ in chunk]
            self._set_batch([(s, p, t, w) for (s, p, t), w in zip(chunk, want, strict=True)])
            self._decode()
            for i, ((s, _, _), w) in enumerate(zip(chunk, want, strict=True)):
                if w and all_logits:
                    out.append(self._logits_at(i))
                elif w:
                    last[s] = self._logits_at(i)
        if all_logits:
            return np.stack(out)
        return np.stack([last[s] for s, _ in seqs])

    def _set_batch(self, cells: list[tuple[int, int, int, bool]]) -> None:
        b = self._batch
        for i, (seq, pos, tok, want) in enumerate(cells):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        b.n_tokens = len(cells)

    def _decode(self) -> None:
        rc = self._lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (KV cache full or invalid batch)")

    def _logits_at(self, i: int) -> np.ndarray:
        ptr = self._lc.llama_get_logits_ith(self._ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32)
