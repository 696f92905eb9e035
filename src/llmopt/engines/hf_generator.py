"""The `hf` engine's batch generator: any architecture transformers runs, behind `llmopt serve`.

`HFGenerator` is a `llmopt.engines.generation.BatchGenerator` over a transformers
`AutoModelForCausalLM` and its own KV cache (a `DynamicCache` per sequence, or whatever cache the
architecture builds for itself: sliding-window, hybrid, recurrent state). It is the fallback for
the decoders the native engine refuses, so it favours being right for every architecture over
speed:

- **One forward per sequence.** Each `step()` prefills the sequences admitted since the last step
  (whole, or at most `prefill_budget` prompt tokens, in order: chunked prefill appends to the
  sequence's cache) and then runs one decode forward per running sequence. Sequences join and
  leave between steps, as with the native engine, so every stream progresses in every step;
  but their forwards are not batched into one, because batching sequences of different
  lengths through an arbitrary architecture's cache needs padding and masks that not every
  architecture implements the same way. Throughput therefore grows little with concurrency;
  a model the native engine runs should be served there.
- **Blocks are an account, not a layout.** The scheduler admits by KV blocks; this generator
  keeps the same account (`BlockPool` without tensors: `block_size` tokens a block) so the
  scheduler's admission and preemption work unchanged, while the tensors live in the
  transformers cache, which grows token by token.
- **Swap** moves a sequence's cache tensors to host memory and back.

>>> from llmopt.engines.torch_hf import load_hf_generator  # doctest: +SKIP
>>> gen = load_hf_generator("path/to/gpt2-folder", max_batch=4)  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from llmopt.engines.generation import (
    PromptLogprob,
    SamplingParams,
    TokenEvent,
    eos_token_ids,
)
from llmopt.engines.native import sampling
from llmopt.engines.native.blocks import BlockPool, PooledGenerator
from llmopt.engines.native.generator import EngineTime, check_sampling_params

__all__ = ["HFGenerator"]

# Context of a generator when neither the spec nor the model's config says (a config without
# `max_position_embeddings`: many recurrent or ALiBi models).
DEFAULT_MAX_SEQ_LEN = 2048


@dataclass
class _Seq:
    ids: list[int]
    prompt_len: int
    params: SamplingParams
    rng: torch.Generator | None
    cache: Any = None
    done: int = 0  # prompt tokens already in the cache
    prefilled: bool = False
    finish: str | None = None
    plp: list | None = None
    faulty: bool = False  # its logits went NaN/inf (`PooledGenerator.append_token`)


@dataclass
class _Swapped:
    """A decoding sequence moved to host memory (`HFGenerator.swap_out`)."""

    seq: _Seq
    num_blocks: int
    nbytes: int


def _cache_tensors(cache: Any) -> list[tuple[Any, str]]:
    """(holder, attribute) of every tensor of a transformers cache (layered caches of
    transformers >= 4.56 keep `layers[i].keys/values`; older ones `key_cache/value_cache`)."""
    found = []
    for layer in getattr(cache, "layers", None) or []:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            if isinstance(getattr(layer, name, None), torch.Tensor):
                found.append((layer, name))
    return found


def _move_cache(cache: Any, device: torch.device | str) -> int:
    """Move a cache's tensors to `device` in place; returns their bytes."""
    total = 0
    holders = _cache_tensors(cache)
    if holders:
        for holder, name in holders:
            t = getattr(holder, name).to(device)
            setattr(holder, name, t)
            total += t.numel() * t.element_size()
        return total
    for name in ("key_cache", "value_cache"):
        tensors = getattr(cache, name, None) or []
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor):
                tensors[i] = t.to(device)
                total += t.numel() * t.element_size()
    return total


class HFGenerator(PooledGenerator):
    """Continuous batching at step granularity over a transformers causal LM (see the module
    docstring for what is and is not batched)."""

    batch_sizes = [1]  # each forward runs one sequence

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 8,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_seq_len: int | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        cfg = model.config
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        self.max_seq_len = int(max_seq_len or min(limit or DEFAULT_MAX_SEQ_LEN, 4096))
        if limit:
            self.max_seq_len = min(self.max_seq_len, int(limit))
        self.max_batch, self.block_size = int(max_batch), int(block_size)
        per_seq = math.ceil(self.max_seq_len / self.block_size)
        # +1: block 0 is the pool's scratch block, never handed out (as in the native engine).
        self.num_blocks = int(num_blocks or self.max_batch * per_seq + 1)
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.seqs: dict[Hashable, _Seq] = {}
        # transformers 5.2x renamed `past_key_values` to `cache` (input and output).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else getattr(cfg, "eos_token_id", None)
        self.eos_ids = eos_token_ids(eos, tokenizer)
        self.time = EngineTime()
        # The ids the model embeds: its embedding's rows (a tokenizer may count fewer or more).
        rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
        text_cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        self.vocab_size = int(rows or text_cfg.vocab_size)

    # (capacity: `PooledGenerator`)
    # --- lifecycle ------------------------------------------------------------------------
    def add(self, seq_id: Hashable, prompt_ids: list[int], params: SamplingParams) -> None:
        n = self.check_admission(seq_id, prompt_ids, params.max_tokens)
        # What can fail runs before the blocks are taken (add is all or nothing), and what
        # would fail a step is refused here: every sequence's forward runs in the same step, so
        # an id past the embedding (IndexError in the forward) would fail the whole batch.
        vocab = self.vocab_size
        if bad := [t for t in prompt_ids if not 0 <= int(t) < vocab]:
            raise ValueError(f"token ids out of the vocabulary (0..{vocab - 1}): {bad[:5]}")
        check_sampling_params(params, vocab)  # the native engine's rules: the engines refuse alike
        rng = sampling.make_rng(params, self.device)
        self.pool.allocate(seq_id, self.blocks_needed(n), "prompt needs")
        self.seqs[seq_id] = _Seq(list(prompt_ids), n, params, rng)

    def remove(self, seq_id: Hashable) -> list[int]:
        s = self.seqs.pop(seq_id)
        self.pool.release(seq_id)
        return s.ids

    # --- swapping ---------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token across all layers, from the config (full attention)."""
        cfg = self.model.config
        cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        layers = int(getattr(cfg, "num_hidden_layers", 0) or getattr(cfg, "n_layer", 0) or 1)
        heads = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0) or 1)
        kv = int(getattr(cfg, "num_key_value_heads", 0) or heads)
        hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0) or heads)
        head_dim = int(getattr(cfg, "head_dim", 0) or hidden // heads)
        size = next(self.model.parameters()).element_size()
        return 2 * layers * kv * head_dim * size

    def layer_parameters(self) -> int:
        embed = self.model.get_input_embeddings()
        head = self.model.get_output_embeddings()
        skip = {id(p) for m in (embed, head) if m is not None for p in m.parameters()}
        return sum(p.numel() for p in self.model.parameters() if id(p) not in skip)

    def swap_out(self, seq_id: Hashable) -> _Swapped:
        s = self.seqs[seq_id]
        if not s.prefilled:
            raise ValueError(f"sequence {seq_id!r} is still being prefilled; remove it instead")
        blocks = len(self.pool.table(seq_id))
        nbytes = _move_cache(s.cache, "cpu")
        self.pool.release(seq_id)
        del self.seqs[seq_id]
        return _Swapped(s, blocks, nbytes)

    def swap_in(self, seq_id: Hashable, swapped: _Swapped) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if len(self.seqs) >= self.max_batch:
            raise ValueError(f"batch full ({self.max_batch} sequences)")
        self.pool.allocate(seq_id, swapped.num_blocks, "swap-in needs")
        try:
            _move_cache(swapped.seq.cache, self.device)  # may fail: out of device memory
        except BaseException:
            self.pool.release(seq_id)  # all or nothing, as add: the blocks are not kept
            raise
        self.seqs[seq_id] = swapped.seq

    # --- stepping ---------------------------------------------------------------------------
    def step(self, prefill_budget: int | None = None) -> list[TokenEvent]:
        """Prefill what was admitted (at most `prefill_budget` prompt tokens), then decode one
        token for every sequence that was already decoding."""
        decoding = [k for k, s in self.seqs.items() if s.prefilled and s.finish is None]
        self.pool.grow([k for k in decoding if self._needs_block(k)])
        t0 = time.perf_counter()
        events: list[TokenEvent] = []
        left = math.inf if prefill_budget is None else int(prefill_budget)
        for k in [k for k, s in self.seqs.items() if not s.prefilled]:
            if left <= 0:
                break
            s = self.seqs[k]
            n = int(min(len(s.ids) - s.done, left))
            left -= n
            if ev := self._prefill(k, n):
                events.append(ev)
        for k in decoding:
            events.append(self._decode(k))
        self.time.step_s += time.perf_counter() - t0
        return events

    def _needs_block(self, seq_id: Hashable) -> bool:
        return (len(self.seqs[seq_id].ids) - 1) // self.block_size >= len(self.pool.table(seq_id))

    @torch.inference_mode()
    def _forward(self, s: _Seq, ids: list[int], all_logits: bool) -> torch.Tensor:
        x = torch.tensor([ids], device=self.device)
        kw: dict[str, Any] = {"use_cache": True}
        if s.cache is not None:
            kw[self._cache_kw] = s.cache
        if not all_logits and self._keep_kw:
            kw["logits_to_keep"] = 1
        out = self.model(input_ids=x, **kw)
        s.cache = getattr(out, self._cache_kw, None)
        if s.cache is None:
            s.cache = out.past_key_values
        return out.logits[0].float()  # (T or 1, V)

    def _prefill(self, key: Hashable, n: int) -> TokenEvent | None:
        s = self.seqs[key]
        start = s.done
        want = s.params.prompt_logprobs is not None
        t0 = time.perf_counter()
        logits = self._forward(s, s.ids[start : start + n], all_logits=want)
        self._wait()
        self.time.prefill_s += time.perf_counter() - t0
        self.time.prefill_tokens += n
        self.time.prefill_forwards += 1
        if want:
            s.plp = (s.plp or []) + self._prompt_logprobs(logits, s, start)
        s.done += n
        if s.done < len(s.ids):
            return None
        s.prefilled = True
        ev = self._emit(key, logits[-1:])
        ev.prompt_logprobs, s.plp = s.plp, None
        return ev

    def _prompt_logprobs(
        self, logits: torch.Tensor, s: _Seq, start: int
    ) -> list[PromptLogprob | None]:
        # The logits are the "hidden states" of an identity head: the shared routine then
        # scores position p against prompt token p+1 exactly as the native engine does.
        k, vocab = int(s.params.prompt_logprobs or 0), int(logits.shape[-1])
        ids = s.ids[: s.prompt_len]
        head = torch.nn.Identity()
        return sampling.prompt_logprobs(head, logits, ids, k, vocab, start)

    def _decode(self, key: Hashable) -> TokenEvent:
        s = self.seqs[key]
        t0 = time.perf_counter()
        logits = self._forward(s, [s.ids[-1]], all_logits=False)
        self._wait()
        self.time.decode_s += time.perf_counter() - t0
        self.time.decode_steps += 1
        return self._emit(key, logits[-1:])

    def _emit(self, key: Hashable, logits: torch.Tensor) -> TokenEvent:
        s = self.seqs[key]
        ((token, logprob, top),) = sampling.sample_rows(logits, [s.params], [s.rng])
        return self.append_token(key, token, logprob, top)

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- warm-up (nothing is compiled) --------------------------------------------------------
    def warmup_widths(self, max_tokens: int | None = None) -> list[int]:
        return []

    def warmup(self, max_tokens: int | None = None) -> float:
        return 0.0

    def warmup_prefill(self) -> float:
        return 0.0

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], dict]:
        """Run one sequence to the end; returns (generated ids, timings)."""
        key = object()
        self.add(key, prompt_ids, params)
        t0 = time.perf_counter()
        out = self.step()
        t1 = time.perf_counter()
        while out[-1].finish_reason is None:
            out.extend(self.step())
        t2 = time.perf_counter()
        self.remove(key)
        ids = [e.token_id for e in out]
        return ids, {"ttft_s": t1 - t0, "decode_s": t2 - t1, "decode_tokens": len(ids) - 1}
