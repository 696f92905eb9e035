"""The paged KV cache's block pool: which blocks are free and which sequence holds which.

Block 0 is scratch (padding rows and table tails point at it) and is never handed out. Blocks
come off a free list, lowest ids first, and go back in reverse, so a sequence freed and admitted
again gets the same blocks. Running short raises `OutOfBlocks`; the pool never evicts anyone.

    pool = BlockPool(num_blocks=9, block_size=16)
    pool.allocate("a", pool.blocks_needed(40))   # [1, 2, 3]
    pool.grow(["a"])                             # one more block for the next token
    pool.release("a")

The cache tensors themselves live in the model's attention layers; a pool given them
(`layers`) also moves a sequence's blocks to host memory and back (`swap_out`, `swap_in`:
preemption that keeps the KV cache).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from llmopt.engines.generation import OutOfBlocks, TokenEvent, finish_reason

__all__ = ["BlockPool", "PooledGenerator", "block_views"]


class BlockPool:
    """A free list of KV block ids and the block table of every sequence holding some."""

    def __init__(self, num_blocks: int, block_size: int, layers=None):
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self._free = list(range(self.num_blocks - 1, 0, -1))  # pop() gives low ids first
        self.tables: dict[Hashable, list[int]] = {}
        # The caches the blocks index: the model's attention layers (after `setup_cache`).
        self.views = block_views(layers, self.block_size) if layers is not None else []

    @property
    def free(self) -> int:
        return len(self._free)

    def blocks_needed(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def take(self, n: int, what: str = "") -> list[int]:
        """`n` free blocks, owned by the caller (no table); OutOfBlocks if fewer are free."""
        if n > len(self._free):
            raise OutOfBlocks(f"{what or 'need'} {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, blocks: Sequence[int]) -> None:
        """Return blocks from `take` (or a table) to the free list."""
        self._free.extend(reversed(blocks))

    def allocate(self, seq_id: Hashable, n: int, what: str = "") -> list[int]:
        """A new table of `n` blocks for `seq_id` (which must hold none)."""
        assert seq_id not in self.tables, f"sequence {seq_id!r} already holds blocks"
        table = self.tables[seq_id] = self.take(n, what)
        return table

    def grow(self, seq_ids: list[Hashable]) -> None:
        """One more block for each of `seq_ids`, all or none (OutOfBlocks names them)."""
        if len(seq_ids) > len(self._free):
            raise OutOfBlocks(
                f"{len(seq_ids)} sequences need a new KV block, {len(self._free)} free", seq_ids
            )
        for k in seq_ids:
            self.tables[k].append(self._free.pop())

    def release(self, seq_id: Hashable) -> list[int]:
        """Free `seq_id`'s blocks; returns the table it held."""
        table = self.tables.pop(seq_id)
        self.give_back(table)
        return table

    def table(self, seq_id: Hashable) -> list[int]:
        return self.tables[seq_id]

    def scrub(self, blocks: Sequence[int]) -> None:
        """Zero `blocks` in every layer's keys and values. After a numerical fault a block may
        hold NaN; attention masks the positions a sequence must not see by giving them zero
        weight, and 0 x NaN is NaN, so a block reused with stale NaN (or scratch block 0) would
        poison whoever reads it next."""
        if not self.views or not blocks:
            return
        idx = torch.tensor(list(blocks), device=self.views[0].device)
        for view in self.views:
            view.index_fill_(0, idx, 0)

    # -- the blocks' contents: preemption by swap ------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token holds across all layers."""
        return sum(v[0, 0].numel() * v.element_size() for v in self.views)

    def swap_out(self, seq_id: Hashable) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copy `seq_id`'s blocks of every layer to host memory (pinned on CUDA) and free them.
        Returns (keys, values), one tensor per layer each, in block order.

        The copies are queued on the current stream before anything can reuse the blocks, and
        `swap_in` copies back on the same stream, so nothing waits for them here."""
        device = self.views[0].device
        idx = torch.tensor(self.tables[seq_id], device=device)
        pin = device.type == "cuda"
        host = []
        for view in self.views:
            src = view.index_select(0, idx)
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            host.append(buf.copy_(src, non_blocking=pin))
        self.release(seq_id)
        return host[0::2], host[1::2]

    def swap_in(self, seq_id: Hashable, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """Allocate blocks for `seq_id` (any ids) and copy a `swap_out`'s keys and values in."""
        blocks = self.allocate(seq_id, int(keys[0].shape[0]) if keys else 0, "swap-in needs")
        try:
            device = self.views[0].device
            idx = torch.tensor(blocks, device=device)
            host = [t for kv in zip(keys, values, strict=True) for t in kv]
            for view, buf in zip(self.views, host, strict=True):
                view.index_copy_(0, idx, buf.to(device, non_blocking=True))
        except BaseException:
            self.release(seq_id)  # all or nothing: a failed copy keeps no blocks
            raise


def block_views(layers, block_size: int) -> list[torch.Tensor]:
    """Every layer's key and value cache as (num_blocks, block_size, n_kv, head_dim) views,
    keys and values alternating."""
    return [
        cache.view(-1, block_size, *cache.shape[1:])
        for layer in layers
        for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache)
    ]


class PooledGenerator:
    """What every generator over a `BlockPool` answers the scheduler with, and the admission
    checks they share (the native engine's `Generator` and the hf engine's `HFGenerator`).

    A subclass sets `pool` (a `BlockPool`), `seqs` (sequence id -> its state, with `ids`,
    `prompt_len`, `params`, `prefilled`, `done`, `finish` and `faulty`), `max_seq_len`,
    `max_batch` and `eos_ids`, and hands each sampled token to `append_token`, the one place
    that decides whether a sequence is done.
    """

    pool: BlockPool
    seqs: dict
    max_seq_len: int
    max_batch: int
    eos_ids: set[int]

    @property
    def free_blocks(self) -> int:
        return self.pool.free

    @property
    def running(self) -> list[Hashable]:
        return list(self.seqs)

    def blocks_needed(self, n_tokens: int) -> int:
        return self.pool.blocks_needed(n_tokens)

    def blocks_of(self, seq_id: Hashable) -> list[int]:
        return list(self.pool.table(seq_id))

    def finished(self, seq_id: Hashable) -> bool:
        return self.seqs[seq_id].finish is not None

    def prefill_pending(self, seq_id: Hashable) -> int:
        """Prompt tokens of `seq_id` still to prefill (0 once its first token is sampled)."""
        s = self.seqs[seq_id]
        return 0 if s.prefilled else len(s.ids) - s.done

    def check_admission(self, seq_id: Hashable, prompt_ids: list[int], max_tokens: int) -> int:
        """Refuse (ValueError) a sequence that cannot be admitted, before anything is taken;
        returns its prompt length."""
        n = len(prompt_ids)
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if n == 0:
            raise ValueError("empty prompt")
        if n + max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"of this generator ({self.max_seq_len} tokens)"
            )
        if len(self.seqs) >= self.max_batch:
            raise ValueError(f"batch full ({self.max_batch} sequences)")
        return n

    def append_token(self, key: Hashable, token: int, logprob: float, top) -> TokenEvent:
        """Record the token just sampled for `key` and say whether the sequence is done
        (`finish_reason`). A token of -1 or a NaN logprob (`sampling.sample_rows` marks a row
        whose logits held NaN or inf so) fails this sequence alone: it ends with "error" and
        `faulty`, and the token is not appended."""
        s = self.seqs[key]
        if token < 0 or math.isnan(logprob):
            s.finish, s.faulty = "error", True
            why = "numerical fault: NaN or inf in the logits of this sequence"
            return TokenEvent(key, -1, float("nan"), [], "error", error=why)
        s.ids.append(token)
        s.finish = finish_reason(
            token,
            s.params,
            generated=len(s.ids) - s.prompt_len,
            total=len(s.ids),
            max_seq_len=self.max_seq_len,
            eos_ids=self.eos_ids,
        )
        return TokenEvent(key, token, logprob, top, s.finish)
