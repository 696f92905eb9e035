"""The paged KV cache's block pool: which blocks are free, which sequence holds which, and (with
prefix caching) which full blocks hold which tokens.

Block 0 is scratch (padding rows and table tails point at it) and is never handed out. Blocks
come off a free list, lowest ids first, and go back in reverse, so a sequence freed and admitted
again gets the same blocks. Running short raises `OutOfBlocks`; the pool never evicts a sequence.

    pool = BlockPool(num_blocks=9, block_size=16)
    pool.allocate("a", pool.blocks_needed(40))   # [1, 2, 3]
    pool.grow(["a"])                             # one more block for the next token
    pool.release("a")

Every block has a reference count: the tables holding it (and `take` callers). Without prefix
caching each block has one holder at most. With it (`caching=True`, vLLM's automatic prefix
caching), a block that is full and written can be `register`ed under the chained hash of its
tokens (`block_hashes`: the hash of the previous block's hash and this block's token ids, so
equal hashes mean equal tokens at equal positions from the start of the sequence). A new
sequence whose prompt starts with the same tokens `match`es those blocks and `allocate`s them
into its table (one more reference each) instead of computing them again. A block whose last
holder lets go stays registered but evictable (counted in `free`): allocation takes never-used
free blocks first, then evicts the least recently released registered ones, which forget their
hash. A shared block is only ever read: a sequence writes past the blocks it matched, in its own.

The cache tensors themselves live in the model's attention layers; a pool given them
(`layers`) also moves a sequence's blocks to host memory and back (`swap_out`, `swap_in`:
preemption that keeps the KV cache).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

import torch

from llmopt.engines.generation import OutOfBlocks, TokenEvent, finish_reason

__all__ = ["BlockPool", "PooledGenerator", "block_views", "block_hashes"]

# The hash the first block of every sequence chains from.
_ROOT = b"llmopt-kv-prefix"


def block_hashes(
    ids: Sequence[int], block_size: int, parent: bytes | None = None, start: int = 0
) -> list[bytes]:
    """The chained hashes of the full blocks of `ids` from block `start` on (`parent`: the hash
    of block `start - 1`; None for the first block): SHA-256 of the parent hash and the block's
    token ids, so a hash names a block's tokens and every token before them. A cryptographic hash,
    as vLLM's `sha256` option: a collision would hand one request another's keys and values.

    >>> h = block_hashes([1, 2, 3, 4, 5], 2)
    >>> len(h), h == block_hashes([1, 2, 3, 4], 2), h[1] == block_hashes([9, 9, 3, 4], 2)[1]
    (2, True, False)
    >>> block_hashes([1, 2, 3, 4], 2, parent=h[0], start=1) == h[1:]
    True
    """
    out = []
    prev = _ROOT if parent is None else parent
    for b in range(start, len(ids) // block_size):
        toks = ids[b * block_size : (b + 1) * block_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{block_size}q", *toks)).digest()
        out.append(prev)
    return out


class BlockPool:
    """A free list of KV block ids, the block table of every sequence holding some, a reference
    count per block, and (with `caching`) the registered full blocks by hash."""

    def __init__(self, num_blocks: int, block_size: int, layers=None, caching: bool = False):
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self._free = list(range(self.num_blocks - 1, 0, -1))  # pop() gives low ids first
        self.tables: dict[Hashable, list[int]] = {}
        self._refs = [0] * self.num_blocks  # holders of each block (tables and `take` callers)
        self.caching = bool(caching)
        self._cached: dict[bytes, int] = {}  # hash -> registered block
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        # Registered blocks nobody holds, least recently released first: evicted in this order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # The caches the blocks index: the model's attention layers (after `setup_cache`).
        self.views = block_views(layers, self.block_size) if layers is not None else []

    @property
    def free(self) -> int:
        """Blocks allocation can take: never used or released, and registered but held by none."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Registered blocks (held or evictable)."""
        return len(self._cached)

    def refs(self, block: int) -> int:
        """How many tables (and `take` callers) hold `block`."""
        return self._refs[block]

    def blocks_needed(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def take(self, n: int, what: str = "") -> list[int]:
        """`n` free blocks, owned by the caller (no table); OutOfBlocks if fewer are free.
        Never-used blocks first, then the least recently released registered ones (evicted:
        their hash is forgotten)."""
        if n > self.free:
            raise OutOfBlocks(f"{what or 'need'} {n} KV blocks, {self.free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._forget(b)
            self._refs[b] = 1
            out.append(b)
        return out

    def give_back(self, blocks: Sequence[int]) -> None:
        """Let go of blocks from `take` (or a table): a block nobody holds any more goes back
        to the free list, or, registered, to the evictable end of the cache (a table's last
        block first, so a chain is evicted from its tail)."""
        for b in reversed(blocks):
            assert self._refs[b] > 0, f"block {b} given back more often than taken"
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._hash_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def allocate(
        self, seq_id: Hashable, n: int, what: str = "", cached: Sequence[int] = ()
    ) -> list[int]:
        """A new table of `n` blocks for `seq_id` (which must hold none): the registered blocks
        `cached` (from `match`; one more holder each) followed by new ones. All or nothing."""
        assert seq_id not in self.tables, f"sequence {seq_id!r} already holds blocks"
        cached = list(cached)
        assert len(cached) <= n, "more cached blocks than the table holds"
        revived = sum(self._refs[b] == 0 for b in cached)  # evictable now, held after this
        if n - len(cached) > self.free - revived:
            raise OutOfBlocks(
                f"{what or 'need'} {n - len(cached)} KV blocks, {self.free - revived} free"
            )
        for b in cached:
            assert b in self._hash_of, f"block {b} is not registered"
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        table = self.tables[seq_id] = cached + self.take(n - len(cached), what)
        return table

    def grow(self, seq_ids: list[Hashable]) -> None:
        """One more block for each of `seq_ids`, all or none (OutOfBlocks names them)."""
        if len(seq_ids) > self.free:
            raise OutOfBlocks(
                f"{len(seq_ids)} sequences need a new KV block, {self.free} free", seq_ids
            )
        for k, b in zip(seq_ids, self.take(len(seq_ids)), strict=True):
            self.tables[k].append(b)

    def release(self, seq_id: Hashable) -> list[int]:
        """Free `seq_id`'s blocks (those others still hold stay theirs); returns its table."""
        table = self.tables.pop(seq_id)
        self.give_back(table)
        return table

    def table(self, seq_id: Hashable) -> list[int]:
        return self.tables[seq_id]

    # -- the prefix cache ------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of `hashes` (empty without caching)."""
        out = []
        for h in hashes if self.caching else ():
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def register(self, block: int, h: bytes) -> bool:
        """Record that `block` (full, written, held by its writer) holds the tokens hashed `h`.
        False (nothing recorded) without caching, or when another block already holds them:
        this one then stays private and is freed, not cached, when released."""
        if not self.caching or h in self._cached or block in self._hash_of:
            return False
        assert self._refs[block] > 0, f"block {block} registered while nobody holds it"
        self._cached[h], self._hash_of[block] = block, h
        return True

    def uncache(self, blocks: Sequence[int]) -> None:
        """Forget the hashes of `blocks` (their contents are not to be reused: a sequence that
        held them failed numerically); an evictable one goes back to the free list."""
        for b in blocks:
            if b in self._hash_of:
                self._forget(b)
                if b in self._evictable:
                    del self._evictable[b]
                    self._free.append(b)

    def _forget(self, block: int) -> None:
        del self._cached[self._hash_of.pop(block)]

    def check(self) -> list[str]:
        """What is wrong with the pool's books (empty: nothing), for pools whose blocks are all
        held through tables: reference counts against the tables, free and evictable blocks
        held by nobody, every block accounted for once, registered blocks both ways."""
        problems = []
        held = Counter(b for t in self.tables.values() for b in t)
        if 0 in held:
            problems.append("scratch block 0 is in a table")
        bad = [b for b in range(1, self.num_blocks) if self._refs[b] != held[b]]
        if bad:
            problems.append(f"reference counts differ from the tables for blocks {bad[:5]}")
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        if free & evictable or (free | evictable) & set(held):
            problems.append("a block is free (or evictable) and held")
        if len(free) + len(evictable) + len(held) != self.num_blocks - 1:
            problems.append(
                f"{len(free)} free + {len(evictable)} evictable + {len(held)} held != "
                f"{self.num_blocks - 1} blocks"
            )
        if any(b not in self._hash_of for b in evictable) or free & set(self._hash_of):
            problems.append("an evictable block is unregistered, or a free one registered")
        if {b: h for h, b in self._cached.items()} != self._hash_of:
            problems.append("the hash -> block and block -> hash maps disagree")
        return problems

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
