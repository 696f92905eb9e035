"""The `openvino` engine's batch generator: a run that chose an OpenVINO causal LM, behind
`llmopt serve`.

`OpenVinoGenerator` is a `llmopt.engines.generation.BatchGenerator` over the stateful IR that
`llmopt.engines.openvino_lm` builds. That IR keeps the KV cache inside the plugin, one cache per
infer request, so each running sequence gets an infer request of its own (from one compiled
model: the weights are shared, the state is not):

- **One infer per sequence per step**, as the hf engine's `HFGenerator`, whose scheduling this
  generator inherits (prefill what was admitted, chunked under `prefill_budget`, then one decode
  per running sequence; blocks as an account only). The IR's batch dimension would take several
  sequences in one infer only if they shared one cache length, which continuous batching does
  not give: sequences join and leave between steps.
- **Chunked prefill** is exact: the IR takes the positions and an attention mask over past +
  new tokens, so a prompt given in pieces continues the same request's state
  (`openvino_lm.lm_feeds`).
- **Prompt logprobs** come from the logits of every prompt position (the IR's `logits_index`
  input asks for them) when a request wants them; otherwise only the last position's.
- **Swap** copies the request's state tensors (`InferRequest.query_state`) to host arrays and
  resets the request; `swap_in` sets them on a free request. A quantized KV cache (the `u8`
  option) comes back as float and is quantized again on the way in.
- **Remove** resets the request's state and keeps the request for the next sequence.

Settings are the run's candidate's (`GeneratorSpec.settings`: threads, KV-cache and inference
precision), compiled as the runner that was verified compiles them (`openvino_lm.compile_lm`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmopt.core.errors import LlmoptError
from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines.generation import GeneratorSpec, eos_token_ids
from llmopt.engines.hf_generator import DEFAULT_MAX_SEQ_LEN, HFGenerator, _Seq
from llmopt.engines.native.blocks import BlockPool
from llmopt.engines.native.generator import EngineTime
from llmopt.engines.openvino_lm import IR_FILE, compile_lm, lm_feeds

__all__ = ["OpenVinoGenerator", "load_openvino_generator"]

log = logging.getLogger(__name__)

# The host copy of a swapped-out cache: the plugin hands its state out as float32 arrays,
# whatever precision it keeps the cache in.
_HOST_BYTES = 4


@dataclass
class _Slot:
    """A sequence's infer request (its KV cache) and the tokens that cache holds."""

    request: Any
    pos: int = 0


@dataclass
class _Swapped:
    """A decoding sequence's cache in host memory (`OpenVinoGenerator.swap_out`)."""

    seq: _Seq
    state: dict[str, np.ndarray]
    pos: int
    num_blocks: int
    nbytes: int


def load_openvino_generator(spec: GeneratorSpec) -> OpenVinoGenerator:
    """An `OpenVinoGenerator` for `spec`: `spec.model` is an openvino causal-LM artifact,
    compiled with `spec.settings` (the run's candidate's)."""
    if spec.device != "cpu":
        raise LlmoptError(
            f"the openvino engine serves on the CPU, not {spec.device!r}",
            hint="serve with --device cpu",
        )
    if not (Path(spec.model) / IR_FILE).is_file():
        raise LlmoptError(
            f"{spec.model} is not an openvino causal-LM artifact (it has no {IR_FILE})",
            hint="the openvino engine serves what it built: llmopt serve runs/NAME, for a run "
            "that chose an openvino candidate",
        )
    settings = EngineSettings.from_dict(spec.settings or {})
    dtype = get_recipe(spec.recipe).dtype
    compiled, tokenizer, precision, threads = compile_lm(Path(spec.model), settings, dtype)
    log.info(
        "openvino generator: %s inference, KV cache %s, %d threads, one infer request per sequence",
        precision,
        compiled.get_property("KV_CACHE_PRECISION").get_type_name(),
        threads,
    )
    config = _read_json(Path(spec.model) / "config.json")
    generation = _read_json(Path(spec.model) / "generation_config.json")
    return OpenVinoGenerator(
        compiled,
        tokenizer,
        config,
        eos=generation.get("eos_token_id", config.get("eos_token_id")),
        max_batch=spec.max_batch,
        block_size=spec.block_size,
        num_blocks=spec.num_blocks,
        max_seq_len=spec.max_seq_len,
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class OpenVinoGenerator(HFGenerator):
    """Continuous batching at step granularity over a compiled stateful OpenVINO IR, one infer
    request per running sequence (see the module docstring)."""

    def __init__(
        self,
        compiled: Any,
        tokenizer: Any,
        config: dict[str, Any],
        *,
        eos: Any = None,
        max_batch: int = 8,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_seq_len: int | None = None,
    ):
        # HFGenerator's __init__ reads a torch model; the same fields are set from the IR's
        # config here, and the stepping, sampling and accounting are HFGenerator's.
        self.compiled, self.tokenizer, self.config = compiled, tokenizer, config
        self.device = torch.device("cpu")
        limit = config.get("max_position_embeddings")
        self.max_seq_len = int(max_seq_len or min(limit or DEFAULT_MAX_SEQ_LEN, 4096))
        if limit:
            self.max_seq_len = min(self.max_seq_len, int(limit))
        self.max_batch, self.block_size = int(max_batch), int(block_size)
        per_seq = math.ceil(self.max_seq_len / self.block_size)
        self.num_blocks = int(num_blocks or self.max_batch * per_seq + 1)  # +1: scratch block 0
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.seqs: dict[Hashable, _Seq] = {}
        self.eos_ids = eos_token_ids(eos, tokenizer)
        self.time = EngineTime()
        # What `add` checks ids and sampling parameters against (`HFGenerator.add`, before
        # anything is taken). The ids matter most here: the IR's embedding is a Gather, which
        # gives zeros for an id past the vocabulary instead of failing, so a bad id would
        # generate from garbage without a word.
        self.vocab_size = int(config["vocab_size"])
        self._idle: list[Any] = []  # infer requests with an empty state, for the next sequence

    # --- infer requests: one KV cache each -------------------------------------------------------
    def _take_request(self) -> Any:
        return self._idle.pop() if self._idle else self.compiled.create_infer_request()

    def _give_back(self, slot: _Slot | None) -> None:
        if slot is not None:
            slot.request.reset_state()
            self._idle.append(slot.request)

    def remove(self, seq_id: Hashable) -> list[int]:
        self._give_back(self.seqs[seq_id].cache)
        return super().remove(seq_id)

    @torch.inference_mode()
    def _forward(self, s: _Seq, ids: list[int], all_logits: bool) -> torch.Tensor:
        if s.cache is None:
            s.cache = _Slot(self._take_request())
        slot: _Slot = s.cache
        keep = np.arange(len(ids)) if all_logits else np.array([len(ids) - 1])
        slot.request.infer(lm_feeds(np.array([ids]), slot.pos, keep))
        slot.pos += len(ids)
        logits = np.array(slot.request.get_tensor("logits").data, dtype=np.float32)
        return torch.from_numpy(logits[0])  # (T or 1, V)

    # --- swapping: the request's state tensors to host arrays and back ----------------------------
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token across all layers, as the host copy holds them."""
        return 2 * self._layers() * self._kv_heads() * self._head_dim() * _HOST_BYTES

    def layer_parameters(self) -> int:
        """The decoder layers' parameters, from the config (a Llama decoder: attention
        projections and a gated MLP; the IR's constants may be int4 codes, so not counted)."""
        c = self.config
        hidden, inter = int(c["hidden_size"]), int(c["intermediate_size"])
        heads, hd, kv = int(c["num_attention_heads"]), self._head_dim(), self._kv_heads()
        attn = 2 * hidden * heads * hd + 2 * hidden * kv * hd
        return self._layers() * (attn + 3 * hidden * inter)

    def _layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def _kv_heads(self) -> int:
        c = self.config
        return int(c.get("num_key_value_heads") or c["num_attention_heads"])

    def _head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))

    def swap_out(self, seq_id: Hashable) -> _Swapped:
        s = self.seqs[seq_id]
        if not s.prefilled:
            raise ValueError(f"sequence {seq_id!r} is still being prefilled; remove it instead")
        slot: _Slot = s.cache
        state = {st.name: np.array(st.state.data, copy=True) for st in slot.request.query_state()}
        blocks = len(self.pool.table(seq_id))
        self._give_back(slot)
        s.cache = None
        self.pool.release(seq_id)
        del self.seqs[seq_id]
        nbytes = sum(a.nbytes for a in state.values())
        return _Swapped(s, state, slot.pos, blocks, nbytes)

    def swap_in(self, seq_id: Hashable, swapped: _Swapped) -> None:
        import openvino as ov

        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if len(self.seqs) >= self.max_batch:
            raise ValueError(f"batch full ({self.max_batch} sequences)")
        self.pool.allocate(seq_id, swapped.num_blocks, "swap-in needs")
        request = None
        try:
            request = self._take_request()
            for st in request.query_state():
                st.state = ov.Tensor(swapped.state[st.name])
        except BaseException:  # all or nothing, as add: the blocks and the request go back
            self.pool.release(seq_id)
            self._give_back(_Slot(request) if request is not None else None)
            raise
        swapped.seq.cache = _Slot(request, swapped.pos)
        self.seqs[seq_id] = swapped.seq
