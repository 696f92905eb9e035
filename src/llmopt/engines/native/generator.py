"""Continuous batching over the paged KV cache: add a sequence, step all, remove one.

`Generator` (a `llmopt.engines.generation.BatchGenerator`) owns the running sequences and
orchestrates three pieces: the block pool (`blocks.py`: a free list of block ids, block 0 is
scratch, and each sequence's block table), the forwards (`compiled.py`: eager or compiled, and
their padded shapes) and sampling (`sampling.py`). A scheduler (`llmopt.serve`) decides *who*
runs; the generator only says what fits (`free_blocks`, `blocks_needed`) and raises
`OutOfBlocks` instead of evicting anyone itself.

    gen = load_generator("smollm2-135m", max_batch=8)
    gen.add("a", tok.encode("The capital of France is"), SamplingParams(max_tokens=8))
    while not all(gen.finished(s) for s in gen.running):
        for ev in gen.step():
            print(ev.seq_id, tok.decode([ev.token_id]))

Each `step()` first prefills the sequences added since the last step (batched, right-padded, up
to `max_prefill_tokens` per forward; SDPA causal attention), then runs one decode step for every
sequence that was already running, as a single batch padded to a bucket size (`batch_sizes`: 1,
2, 4, 8, ... by default), with the block tables cut to a bucket of the longest sequence. With
`compile=True` the decode step is `torch.compile`d (`mode="reduce-overhead"`: CUDA graphs on
GPU), one graph per (batch, length) bucket. Each new bucket costs a compile (a minute or more for
a large model), so a compiled generator never cuts the tables below `min_bucket_tokens` (the
gather of a few hundred tokens costs microseconds, a compile a minute), and `warmup()` compiles
the buckets up front: a server calls it before it accepts requests, so no request waits for a
compile. With `compile_prefill=True` the first-chunk prefill forward is compiled too (dynamic
shapes, no CUDA graphs; `warmup()` compiles it).

Chunked prefill: `step(prefill_budget=N)` computes at most N prompt tokens in this step (the
scheduler passes its token budget less one token per running decode). The sequences waiting for
prefill get chunks in the order they were added; a prompt longer than what is left is prefilled
over several steps, its KV cache written chunk by chunk, and its first token is sampled when its
last chunk is done. A first chunk (position 0) runs through the SDPA prefill path; later chunks
through the model's paged path (queries at positions start..start+n-1 attend to the keys the
earlier chunks wrote). Chunks are right-padded together only while the padding fits in what the
budget leaves, so the tokens a step computes (padding included) never exceed N. The decode step
and its compiled shapes are the same with or without chunking.

The decode step's inputs (`inputs.py`): one packed row per sequence, kept from step to step in
a persistent host buffer (pinned on CUDA) per shape and written where something changed (token,
position, a new block, a sequence joining); one non-blocking copy a step. Overlap (`overlap`,
default on CUDA): when every sequence of a step is greedy without logprobs, the step after it is
launched before its tokens are read back: that step's input tokens are this one's argmax,
still on the device (`CompiledSteps.carry`), and each sequence's next block is taken before the
launch (`_grow_ahead`). `step()` then reads back the step launched by the previous call (an
event, pinned memory) and hands its tokens over, so the host's work (events, stop conditions,
the scheduler, the next step's inputs) runs while the device computes. A sequence that
finished on a token the host had not yet read has its row in the step in flight computed and
dropped; `remove` and `swap_out` mark their rows dead the same way. Each call still returns one
token per decoding sequence, the same tokens and events as the synchronous path. A step with a
sampled sequence or logprobs, and a step whose batch gained a sequence the step in flight does
not hold (a swap-in), run synchronously, and the overlap resumes on the next all-greedy step.

`SamplingParams(prompt_logprobs=N)` asks for the log-probability of every prompt token given the
ones before it (and the top N): the prefill keeps the final hidden states of that sequence's
positions and runs the LM head and an fp32 log-softmax over them in chunks; the result comes
once, with the sequence's first `TokenEvent` (with chunked prefill, gathered chunk by chunk).

Local (sliding-window) layers of Gemma 2/3-style models hold only their window: each sequence
also owns a *ring* of `ring` blocks (`Transformer.ring_blocks`) in a second pool (`local_pool`,
`max_batch x ring + 1` blocks, block 0 scratch), which the local layers' caches index and which
is overwritten as the sequence moves past the window; the global layers index `pool` as every
layer of another model does. A sequence takes its ring on `add` (or `swap_in`) and gives it
back on `remove` (or `swap_out`); `free_blocks`, `blocks_needed` and `kv_bytes_per_token` count
the global pool only, the part that grows with a sequence (a ring is a fixed cost per sequence,
and the local pool holds one for each of `max_batch` sequences). With a context no longer than
the ring (or `local_kv=False`) every layer indexes the one pool, as before.

Prefix caching (`prefix_caching=True`; what `llmopt serve` turns on), vLLM's automatic prefix
caching: once a prefill chunk (or a decode step) has filled a block, the block is registered in
the pool under the chained hash of its tokens (`blocks.block_hashes`). `add` looks the new
prompt's full blocks up, longest cached chain first, puts the blocks found into the sequence's
table (shared: one more reference each) and starts its prefill after them, through the paged
path as a later chunk would. The block holding the last prompt token is never reused (at least
one token is computed, for the first token's logits), so a sequence's first write is always in
a block of its own and no shared block is ever written. A sequence that asks for prompt
log-probabilities skips the lookup (they need every prompt position's hidden state). Released
blocks stay cached until their space is needed (`BlockPool`); a sequence that failed numerically
takes its blocks out of the cache, and only the blocks it alone held are scrubbed. Swapping out
copies the shared blocks too; swapped back in, the sequence holds private copies. `prefix_cache`
counts lookups and hits in tokens. With rings (local layers) prefix caching stays off: a ring is
overwritten as its sequence moves on, so its blocks name no fixed prefix.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from llmopt.engines.generation import (
    OutOfBlocks,
    PrefixCacheStats,
    PromptLogprob,
    SamplingParams,
    TokenEvent,
    check_seed,
    eos_token_ids,
)
from llmopt.engines.native import sampling
from llmopt.engines.native.blocks import BlockPool, PooledGenerator, block_hashes
from llmopt.engines.native.compiled import CompiledSteps, wait
from llmopt.engines.native.inputs import Flight, PackedInputs, arrange, carried
from llmopt.engines.native.model import Transformer

__all__ = ["Generator", "SamplingParams", "TokenEvent", "OutOfBlocks", "Swapped", "EngineTime"]


@dataclass
class _Seq:
    ids: list[int]
    prompt_len: int
    params: SamplingParams
    rng: torch.Generator | None
    prefilled: bool = False
    finish: str | None = None
    done: int = 0  # prompt tokens whose KV is in the cache (chunked prefill progress)
    plp: list | None = None  # prompt log-probabilities gathered so far, chunk by chunk
    faulty: bool = False  # its logits went NaN/inf: its blocks may hold NaN
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks so far
    registered: int = 0  # blocks of its table offered to the prefix cache (or found there)


@dataclass
class EngineTime:
    """Where a generator's `step()` calls spent their time, cumulative since it was made.

    The forward timings include the wait for the device, so on a GPU they are device time plus
    launch overhead; `step_s` also counts building the inputs and sampling. With `overlap`,
    `decode_s` is the launches plus the waits for their tokens (the device time that overlapped
    the host's work between steps is not in it), and `decode_steps` counts the steps read back
    (one launched ahead and dropped, as after the last sequence finishes, is not counted). A
    server exports these as counters (`llmopt_engine_*_total`), which is how its wall time is
    attributed: prefill, decode, the rest of the step, and the time between steps (scheduling,
    streaming).
    """

    prefill_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens computed (padding not counted)
    prefill_forwards: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    step_s: float = 0.0


@dataclass
class Swapped:
    """A decoding sequence moved out of the KV pool (`Generator.swap_out`): its state, and its
    blocks' keys and values per layer in host memory (pinned on CUDA), in block order."""

    seq: _Seq
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # The ring's blocks of the local layers, in ring order (empty without a local pool).
    local_keys: list[torch.Tensor] = field(default_factory=list)
    local_values: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        """Blocks of the global pool it needs back (its ring comes from the local pool)."""
        return int(self.keys[0].shape[0]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        held = (*self.keys, *self.values, *self.local_keys, *self.local_values)
        return sum(t.numel() * t.element_size() for t in held)


def prefill_inputs(
    seqs: list[_Seq],
    tables: list[list[int]],
    starts: list[int],
    chunks: list[tuple[Hashable, int]],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens (B, T), block tables (B, nb), positions (B, T), last real index (B,)) of one
    prefill forward over the next `n` tokens of each sequence from `starts`, right-padded to the
    longest chunk T."""
    t = max(n for _, n in chunks)
    nb = math.ceil((max(starts) + t) / block_size)  # every key position a query can see
    rows = zip(seqs, starts, chunks, strict=True)
    ids = [s.ids[a : a + n] + [0] * (t - n) for s, a, (_, n) in rows]
    # Padding positions past a sequence's own blocks land in scratch block 0; those within
    # them are its own later positions, overwritten before any query can see them.
    padded = [b[:nb] + [0] * (nb - min(nb, len(b))) for b in tables]
    pos = torch.tensor(starts, device=device)[:, None] + torch.arange(t, device=device)
    last = torch.tensor([n - 1 for _, n in chunks], device=device)
    return torch.tensor(ids, device=device), torch.tensor(padded, device=device), pos, last


def plan_prefill(
    chunks: list[tuple[Hashable, int]], fresh: list[bool], left: float, max_tokens: int
) -> list[list[tuple[Hashable, int]]]:
    """Group the (key, tokens) chunks of one step into forwards: later chunks (paged path) and
    first chunks (`fresh`, SDPA path) run separately, later ones first; chunks of one kind share
    a forward, right-padded, while the extra padding fits in `left` (the budget's slack) and the
    forward stays within `max_tokens`."""
    forwards = []
    for kind in (False, True):  # the older sequences' later chunks first
        group: list[tuple[Hashable, int]] = []
        for (k, n), first in zip(chunks, fresh, strict=True):
            if first != kind:
                continue
            if group:
                longest, real = max(c for _, c in group), sum(c for _, c in group)
                wider = max(longest, n) * (len(group) + 1)
                extra = (wider - real - n) - (longest * len(group) - real)  # more padding
                if wider > max_tokens or extra > left:
                    forwards.append(group)
                    group = []
                else:
                    left -= extra
            group.append((k, n))
        if group:
            forwards.append(group)
    return forwards


def check_sampling_params(p: SamplingParams, vocab: int) -> None:
    """ValueError for sampling parameters that would fail (or poison) a step of the batch."""
    if p.max_tokens < 1:
        raise ValueError(f"max_tokens {p.max_tokens} must be >= 1")
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise ValueError(f"temperature {p.temperature} must be a finite number >= 0")
    if not 0 < p.top_p <= 1:  # False for NaN too
        raise ValueError(f"top_p {p.top_p} must lie in (0, 1]")
    if p.top_k < 0:
        raise ValueError(f"top_k {p.top_k} must be >= 0 (0: off)")
    if not 0 <= p.logprobs <= vocab:
        raise ValueError(f"logprobs {p.logprobs} must lie in 0..{vocab} (the vocabulary)")
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= vocab:
        raise ValueError(f"prompt_logprobs {p.prompt_logprobs} must lie in 0..{vocab}")
    check_seed(p.seed)


class Generator(PooledGenerator):
    """Runs many sequences of different lengths through one native model (a `BatchGenerator`).

    The pieces: `pool` (the KV blocks and each sequence's table, `blocks.py`), `steps` (the
    eager or compiled decode and prefill forwards and their shapes, `compiled.py`), and
    `sampling.py` (logits to tokens). This class orchestrates them: add / step / remove.
    """

    # Prompt log-probabilities: fp32 logits computed per chunk of positions, at most this many
    # elements (64 MiB) at a time, so a long prompt never holds (T, vocab) logits at once.
    prompt_logprob_chunk = sampling.PROMPT_LOGPROB_CHUNK

    def __init__(
        self,
        model: Transformer,
        tokenizer: Any = None,
        *,
        max_batch: int = 8,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_seq_len: int | None = None,
        kv_dtype: torch.dtype | None = None,
        compile: bool = False,
        bucket_blocks: bool = True,
        max_prefill_tokens: int = 4096,
        batch_sizes: list[int] | tuple[int, ...] | None = None,
        min_bucket_tokens: int | None = None,
        compile_prefill: bool = False,
        local_kv: bool = True,
        local_blocks: int | None = None,
        overlap: bool | None = None,
        prefix_caching: bool = False,
    ):
        """`local_kv`: give local (sliding-window) layers rings of their window in a pool of
        their own (see the module doc); `local_blocks`: that pool's size (default `max_batch x
        ring + 1`, every sequence's ring and the scratch block). `overlap`: launch the next
        all-greedy decode step before reading this one's tokens back (see the module doc;
        default: on CUDA); off, every step is read back before the next is launched. Both give
        the same tokens. `prefix_caching`: reuse the KV blocks of prompt prefixes computed
        before (see the module doc; stays off with rings)."""
        self.model, self.tokenizer = model, tokenizer
        p = next(model.parameters())
        self.device, self.dtype = p.device, (kv_dtype or model.model.norm.weight.dtype)
        cfg = model.cfg
        self.max_seq_len = int(max_seq_len or min(cfg.max_position, 4096))
        if cfg.sliding_window and self.max_seq_len > cfg.sliding_window:
            self.max_seq_len = int(cfg.sliding_window)  # beyond it, the window would matter
        self.block_size, self.max_batch = block_size, max_batch
        self.max_blocks_per_seq = math.ceil(self.max_seq_len / block_size)
        layers = list(model.model.layers)
        # Rings only where they hold less than a whole context, and some layer stays global.
        ring = model.ring_blocks(block_size) if local_kv else 0
        if not (0 < ring < self.max_blocks_per_seq and not all(ly.local for ly in layers)):
            ring = 0
        self.ring = ring
        self.steps = CompiledSteps(
            model,
            self.device,
            max_batch=max_batch,
            block_size=block_size,
            max_blocks_per_seq=self.max_blocks_per_seq,
            compile=compile,
            bucket_blocks=bucket_blocks,
            batch_sizes=batch_sizes,
            min_bucket_tokens=min_bucket_tokens,
            compile_prefill=compile_prefill,
            ring_blocks=ring,
        )
        self.batch_sizes = self.steps.batch_sizes
        self.num_blocks = int(num_blocks or max_batch * self.max_blocks_per_seq + 1)
        self.local_blocks = int(local_blocks or max_batch * ring + 1) if ring else 0
        if ring and self.local_blocks < ring + 1:
            raise ValueError(
                f"local_blocks {self.local_blocks} holds no ring of {ring} blocks (plus scratch "
                f"block 0): pass at least {ring + 1}, or leave it unset ({max_batch * ring + 1})"
            )
        model.setup_cache(
            self.num_blocks,
            block_size,
            self.dtype,
            self.device,
            local_blocks=self.local_blocks or None,
        )
        # The global pool's views are the layers it indexes: all of them without rings.
        glob = [ly for ly in layers if not (ring and ly.local)]
        self.prefix_caching = bool(prefix_caching) and not ring
        self.prefix_cache = PrefixCacheStats() if self.prefix_caching else None
        self.pool = BlockPool(self.num_blocks, block_size, glob, caching=self.prefix_caching)
        self.local_pool: BlockPool | None = None
        if ring:
            local = [ly for ly in layers if ly.local]
            self.local_pool = BlockPool(self.local_blocks, block_size, local)
        self.seqs: dict[Hashable, _Seq] = {}
        # Prompts admitted together are prefilled in one forward while padded tokens stay under this.
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_ids = eos_token_ids(cfg.eos_token_ids, tokenizer)
        self.compile_seconds = 0.0
        self.time = EngineTime()
        self.overlap = self.device.type == "cuda" if overlap is None else bool(overlap)
        self.inputs = PackedInputs(self.device, ring)
        self._rows: list[Hashable] = []  # the decode batch's row order (`inputs.arrange`)
        self._flight: Flight | None = None  # a decode step launched, not yet read back
        self._launches = 0
        # Host tensors the overlapped steps' tokens are read back into, used in turn (pinned on
        # CUDA: a copy from the device into them does not block).
        pin = self.device.type == "cuda"
        self._landing = [
            (
                torch.zeros(max_batch, dtype=torch.long, pin_memory=pin),
                torch.zeros(max_batch, dtype=torch.float32, pin_memory=pin),
            )
            for _ in range(2)
        ]

    # (capacity: `PooledGenerator`)
    # --- lifecycle ------------------------------------------------------------------------
    def add(self, seq_id: Hashable, prompt_ids: list[int], params: SamplingParams) -> None:
        """Admit a sequence: allocate blocks for its prompt; it is prefilled in the next step()."""
        n = self.check_admission(seq_id, prompt_ids, params.max_tokens)
        vocab = int(self.model.cfg.vocab_size)
        if not all(0 <= int(t) < vocab for t in prompt_ids):
            bad = [t for t in prompt_ids if not 0 <= int(t) < vocab][:5]
            raise ValueError(f"token ids out of the vocabulary (0..{vocab - 1}): {bad}")
        # Everything that can fail runs before the blocks are taken (add is all or nothing).
        check_sampling_params(params, vocab)
        rng = sampling.make_rng(params, self.device)
        self._check_ring_free()
        bs, hashes, cached = self.block_size, [], []
        lookup = self.prefix_caching and params.prompt_logprobs is None
        if lookup:  # the full blocks before the last prompt token's (see the module doc)
            hashes = block_hashes(prompt_ids[: (n - 1) // bs * bs], bs)
            cached = self.pool.match(hashes)
        self.pool.allocate(seq_id, self.blocks_needed(n), "prompt needs", cached=cached)
        if self.local_pool is not None:  # cannot fail now (checked above)
            self.local_pool.allocate(seq_id, self.ring, "ring needs")
        s = _Seq(list(prompt_ids), n, params, rng, done=len(cached) * bs, hashes=hashes)
        s.registered = len(cached)
        self.seqs[seq_id] = s
        if lookup and self.prefix_cache is not None:
            self.prefix_cache.queries += n
            self.prefix_cache.hits += s.done

    def remove(self, seq_id: Hashable) -> list[int]:
        """Forget a sequence and free its blocks; returns its prompt + generated token ids.
        Blocks held under `seq_id` are freed even when no sequence was recorded for it (what a
        failed admission may leave); KeyError when it holds nothing at all."""
        s = self.seqs.pop(seq_id, None)
        if self._flight is not None:  # its row in a step in flight is computed and dropped
            self._flight.dead.add(seq_id)
        pools = [p for p in (self.pool, self.local_pool) if p is not None]
        if s is not None and s.faulty:  # its KV (and scratch block 0) may hold NaN
            for p in pools:
                table = p.tables.get(seq_id, [])
                p.uncache(table)  # nobody is to reuse them
                p.scrub([0, *(b for b in table if p.refs(b) == 1)])  # not what others still read
        held = [p for p in pools if seq_id in p.tables]
        if not held and s is None:
            raise KeyError(seq_id)
        for p in held:
            p.release(seq_id)
        return s.ids if s is not None else []

    @property
    def free_rings(self) -> int:
        """Rings the local pool can still hand out (0 without one)."""
        return self.local_pool.free // self.ring if self.local_pool is not None else 0

    def ring_of(self, seq_id: Hashable) -> list[int]:
        """The local pool's blocks `seq_id` holds (its ring; empty without a local pool)."""
        return list(self.local_pool.table(seq_id)) if self.local_pool is not None else []

    def _check_ring_free(self) -> None:
        """OutOfBlocks before anything is taken when no ring is free (add is all or nothing)."""
        if self.local_pool is not None and self.local_pool.free < self.ring:
            raise OutOfBlocks(
                f"a sequence needs a ring of {self.ring} local-layer KV blocks, "
                f"{self.local_pool.free} free (local_blocks {self.local_blocks})"
            )

    # --- swapping (preemption that keeps the KV cache) ---------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token holds in the global pool: across all layers, or,
        with rings, across the global layers only (the local ones hold a fixed `ring_bytes`)."""
        return self.pool.kv_bytes_per_token()

    def ring_bytes(self) -> int:
        """Bytes of keys and values one sequence's ring holds across the local layers (0
        without rings): a fixed cost per sequence, whatever its length."""
        if self.local_pool is None:
            return 0
        return self.local_pool.kv_bytes_per_token() * self.ring * self.block_size

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache takes on the device: both pools, scratch blocks included."""
        total = self.pool.kv_bytes_per_token() * self.num_blocks * self.block_size
        if self.local_pool is not None:
            total += self.local_pool.kv_bytes_per_token() * self.local_blocks * self.block_size
        return total

    def layer_parameters(self) -> int:
        """Parameters of the decoder layers (a recomputed token costs about twice as many FLOPs)."""
        return sum(p.numel() for p in self.model.model.layers.parameters())

    def swap_out(self, seq_id: Hashable) -> Swapped:
        """Copy a decoding sequence's KV blocks to host memory, free them, forget the sequence.
        Its sampling state (random generator included) travels with it: after `swap_in` it
        continues exactly as if it had never left."""
        s = self.seqs[seq_id]
        if not s.prefilled:
            raise ValueError(f"sequence {seq_id!r} is still being prefilled; remove it instead")
        if self._flight is not None:
            self._flight.dead.add(seq_id)
        # The copies are queued behind any step in flight, whose write of this sequence's
        # next position (the KV of its last token) they take along.
        keys, values = self.pool.swap_out(seq_id)
        swapped = Swapped(s, keys, values)
        if self.local_pool is not None:
            swapped.local_keys, swapped.local_values = self.local_pool.swap_out(seq_id)
        del self.seqs[seq_id]
        return swapped

    def swap_in(self, seq_id: Hashable, swapped: Swapped) -> None:
        """Bring a swapped-out sequence back into free blocks (any ids); it decodes next step."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if len(self.seqs) >= self.max_batch:
            raise ValueError(f"batch full ({self.max_batch} sequences)")
        self._check_ring_free()
        self.pool.swap_in(seq_id, swapped.keys, swapped.values)
        if self.local_pool is not None:  # cannot run short now (checked above)
            try:
                self.local_pool.swap_in(seq_id, swapped.local_keys, swapped.local_values)
            except BaseException:
                self.pool.release(seq_id)  # all or nothing, as add
                raise
        self.seqs[seq_id] = swapped.seq
        swapped.seq.registered = 0  # new blocks: offer them to the cache again
        self._cache_blocks([seq_id])

    # --- stepping -------------------------------------------------------------------------
    def step(self, prefill_budget: int | None = None) -> list[TokenEvent]:
        """Prefill new sequences, then decode one token for each sequence already running.

        `prefill_budget`: prompt tokens to compute in this step at most (chunked prefill; see
        the module docstring). None: prefill every new sequence whole.
        """
        decoding = [k for k, s in self.seqs.items() if s.prefilled and s.finish is None]
        fl = self._flight
        if fl is not None and not fl.covers(decoding, self.seqs):
            # A sequence joined (swap-in) since it was launched: drop it. The synchronous step
            # below computes its rows again and writes the same keys and values.
            self._flight = fl = None
        if fl is None:
            # Make room for the token each decoding sequence writes now, before any work is
            # done (a step in flight has its blocks already: `_grow_ahead`).
            self.pool.grow([k for k in decoding if self._needs_block(k)])
        t0 = time.perf_counter()
        events = []
        pending = [k for k, s in self.seqs.items() if not s.prefilled]
        if pending:
            events.extend(self._prefill_chunks(pending, prefill_budget))
        if decoding:
            events.extend(self._decode_batch(decoding))
        self.time.step_s += time.perf_counter() - t0
        return events

    def _prefill_chunks(self, pending: list[Hashable], budget: int | None) -> list[TokenEvent]:
        """Prefill at most `budget` tokens (padding included) of the pending sequences, in order
        (None: all of every pending prompt, forwards of at most max_prefill_tokens padded)."""
        chunks: list[tuple[Hashable, int]] = []
        left = math.inf if budget is None else int(budget)
        for k in pending:
            if left <= 0:
                break
            s = self.seqs[k]
            n = int(min(len(s.ids) - s.done, left))
            chunks.append((k, n))
            left -= n
        fresh = [self.seqs[k].done == 0 for k, _ in chunks]  # before any chunk runs
        events = []
        for group in plan_prefill(chunks, fresh, left, self.max_prefill_tokens):
            events.extend(self._prefill(group))
        return events

    def _cache_blocks(self, keys: list[Hashable]) -> None:
        """Register the blocks of `keys` filled (and written) since they were last offered, with
        the chained hashes of their tokens (prefix caching; see the module doc)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for k in keys:
            s = self.seqs[k]
            # Tokens whose KV is written: the prefilled part of the prompt, or all but the
            # token sampled last.
            full = (len(s.ids) - 1 if s.prefilled else s.done) // bs
            if s.faulty or full <= s.registered:
                continue
            if len(s.hashes) < full:
                parent = s.hashes[-1] if s.hashes else None
                s.hashes += block_hashes(s.ids[: full * bs], bs, parent, len(s.hashes))
            table = self.pool.table(k)
            for i in range(s.registered, full):
                self.pool.register(table[i], s.hashes[i])
            s.registered = full

    def _needs_block(self, seq_id: Hashable) -> bool:
        return (len(self.seqs[seq_id].ids) - 1) // self.block_size >= len(self.pool.table(seq_id))

    @torch.inference_mode()
    def _prefill(self, chunks: list[tuple[Hashable, int]]) -> list[TokenEvent]:
        """One forward over the next `n` prompt tokens of each (key, n), right-padded to the
        longest. All chunks start at position 0 (SDPA prefill) or all after earlier chunks
        (paged attention). A sequence whose prompt is complete samples its first token."""
        keys = [k for k, _ in chunks]
        seqs = [self.seqs[k] for k in keys]
        starts = [s.done for s in seqs]
        fresh = not any(starts)
        assert fresh or all(starts), "first and later chunks run in separate forwards"
        held = [self.pool.table(k) for k in keys]
        tokens, tables, pos, last = prefill_inputs(
            seqs, held, starts, chunks, self.block_size, self.device
        )
        rings = None
        if self.local_pool is not None:
            rings = torch.tensor([self.local_pool.table(k) for k in keys], device=self.device)
        t = tokens.shape[1]
        want = [s.params.prompt_logprobs is not None for s in seqs]
        hidden: list[torch.Tensor] = []
        hook = None
        if any(want):  # keep the final-norm output of every position (B, T, D), not logits
            hook = self.model.model.norm.register_forward_hook(lambda _m, _i, o: hidden.append(o))
        # The compiled forward takes first chunks of 2+ tokens (the shapes warmup() compiled);
        # later chunks (the paged path), 1-token prompts and prompt logprobs (a hook) run eager.
        fwd = self.steps.prefill_forward if fresh and hook is None and t > 1 else self.model
        t0 = time.perf_counter()
        try:
            logits = fwd(tokens, pos, tables, prefill=fresh, last_index=last, local_tables=rings)
        finally:
            if hook is not None:
                hook.remove()
        wait(self.device)
        self.time.prefill_s += time.perf_counter() - t0
        self.time.prefill_tokens += sum(n for _, n in chunks)
        self.time.prefill_forwards += 1
        complete = []  # rows whose prompt is now whole: they sample their first token
        # The n choices of one request (`n > 1`) share a prompt: its log-probabilities are
        # computed once per forward and copied to the others.
        scored: dict[tuple, list[PromptLogprob | None]] = {}
        for i, s in enumerate(seqs):
            n = chunks[i][1]
            if want[i]:
                if s.plp is None:
                    s.plp = []
                key = (starts[i], n, s.params.prompt_logprobs, tuple(s.ids[: s.prompt_len]))
                if key not in scored:
                    scored[key] = self._prompt_logprobs(hidden[0][i, :n], s, starts[i])
                s.plp.extend(scored[key])
            s.done += n
            if s.done < len(s.ids):
                continue  # more chunks to come
            s.prefilled = True
            complete.append(i)
        events = []
        if complete:
            rows = logits[torch.tensor(complete, device=logits.device)]
            events = self._emit_rows([keys[i] for i in complete], rows)
            for ev in events:
                s = self.seqs[ev.seq_id]
                ev.prompt_logprobs, s.plp = s.plp, None
        self._cache_blocks(keys)
        return events

    def _prompt_logprobs(
        self, hidden: torch.Tensor, s: _Seq, start: int = 0
    ) -> list[PromptLogprob | None]:
        """`sampling.prompt_logprobs` of one sequence's chunk (hidden states (T, D) from
        position `start`)."""
        k, vocab = int(s.params.prompt_logprobs or 0), int(self.model.cfg.vocab_size)
        ids = s.ids[: s.prompt_len]
        lm_head, chunk = self.model.lm_head, self.prompt_logprob_chunk
        return sampling.prompt_logprobs(lm_head, hidden, ids, k, vocab, start, chunk)

    # --- shapes and warm-up (the forwards themselves are `self.steps`) -----------------------
    def padded_batch(self, b: int) -> int:
        return self.steps.padded_batch(b)

    def table_width(self, blocks: int) -> int:
        return self.steps.table_width(blocks)

    def warmup_widths(self, max_tokens: int | None = None) -> list[int]:
        """The length buckets (table widths) of contexts up to `max_tokens` (default: all)."""
        return self.steps.widths(self.blocks_needed(max_tokens or self.max_seq_len))

    def warmup(self, max_tokens: int | None = None) -> float:
        """Run (and so compile) the decode step for every batch size and length bucket up to
        `max_tokens` of context (default: the whole context), and the compiled prefill if any.
        Returns the seconds it took. Only scratch block 0 is touched."""
        t0 = time.perf_counter()
        self.steps.warmup(self.warmup_widths(max_tokens))
        self.steps.warmup_prefill()
        wait(self.device)
        return time.perf_counter() - t0

    def warmup_prefill(self) -> float:
        return self.steps.warmup_prefill()

    def enable_compiled_prefill(self) -> None:
        self.steps.enable_compiled_prefill()

    @property
    def prefill_compile_error(self) -> str | None:
        return self.steps.prefill_compile_error

    def decode_packed(self, packed: torch.Tensor):
        """One decode forward over packed rows of [token, position, block table..., ring...]
        (padded to the shapes `padded_batch` / `table_width` give; the ring's `ring` block ids
        only with a local pool): (logits, greedy tokens, their logprobs). A token -(j + 1)
        stands for row j's greedy token of the step before (`CompiledSteps.carry`)."""
        return self.steps.decode(packed, self.steps.carry)

    @torch.inference_mode()
    def _decode_batch(self, keys: list[Hashable]) -> list[TokenEvent]:
        """One decode step for `keys`: their next tokens, as events in their order.

        Synchronous unless `overlap` and every sequence is greedy without logprobs: then the
        step after this one is launched (its tokens taken from this one's on the device) before
        this one's tokens are read back, and it is what the next call reads."""
        fl = self._flight
        if fl is None:
            if not self._overlaps(keys):
                return self._decode_now(keys)
            fl = self._launch(keys, None)
        # Step N+1 for every sequence that decodes next time: these (those that finish on
        # this step's token included: their rows are computed and dropped) and the ones whose
        # prompt just completed in this step's prefill.
        self._flight = None
        nxt = [k for k, s in self.seqs.items() if s.prefilled and s.finish is None]
        if self._overlaps(nxt) and self._grow_ahead(nxt, fl):
            self._flight = self._launch(nxt, fl)
        return self._land(fl)

    def _overlaps(self, keys: list[Hashable]) -> bool:
        """Whether a step over `keys` may run overlapped: greedy tokens only, no logprobs."""
        if not self.overlap or not keys:
            return False
        return not any((p := self.seqs[k].params).logprobs or sampling.sampled(p) for k in keys)

    def _grow_ahead(self, keys: list[Hashable], fl: Flight) -> bool:
        """Give each of `keys` the block its next step writes into, before its tokens are
        known; False (nothing taken) when the pool is short: the next step then runs
        synchronously and asks for them (or raises `OutOfBlocks`) as it always does."""
        need = []
        for k in keys:
            pos = len(self.seqs[k].ids) - (fl.row(k, self.seqs) is None)  # in flight: one more
            if pos // self.block_size >= len(self.pool.table(k)):
                need.append(k)
        try:
            self.pool.grow(need)
        except OutOfBlocks:
            return False
        return True

    def _packed(self, rows: list[Hashable], tokens: list[int], positions: list[int]):
        """The packed device tensor of a step over `rows` (`inputs.PackedInputs`)."""
        tables = [self.pool.table(k) for k in rows]
        rings = [self.local_pool.table(k) for k in rows] if self.local_pool is not None else None
        bp = self.padded_batch(len(rows))
        nb = self.table_width(max(len(t) for t in tables))
        seqs = [self.seqs[k] for k in rows]
        return self.inputs.fill(bp, nb, seqs, tables, rings, tokens, positions)

    def _decode_now(self, keys: list[Hashable]) -> list[TokenEvent]:
        """A synchronous decode step: launch, wait, read back, sample if asked."""
        rows = self._rows = arrange(self._rows, keys)
        seqs = [self.seqs[k] for k in rows]
        packed = self._packed(rows, [s.ids[-1] for s in seqs], [len(s.ids) - 1 for s in seqs])
        t0 = time.perf_counter()
        logits, best, best_lp = self.decode_packed(packed)
        wait(self.device)
        self.time.decode_s += time.perf_counter() - t0
        self.time.decode_steps += 1
        row_of = {k: i for i, k in enumerate(rows)}
        order = [row_of[k] for k in keys]
        params = [self.seqs[k].params for k in keys]
        if any(p.logprobs or sampling.sampled(p) for p in params):
            idx = torch.tensor(order, device=logits.device)
            events = self._emit_rows(keys, logits.index_select(0, idx))
        else:  # all greedy without alternatives: argmax and its logprob came out of the graph
            toks, lps = best[: len(rows)].tolist(), best_lp[: len(rows)].tolist()
            picked = zip(keys, order, strict=True)
            events = [self.append_token(k, toks[i], lps[i], []) for k, i in picked]
        self._cache_blocks(keys)
        return events

    def _launch(self, keys: list[Hashable], prev: Flight | None) -> Flight:
        """Queue a decode step over `keys` and the copies of its greedy tokens: to `carry` (the
        next step's input) and to host memory (read by `_land`). A sequence in `prev` (launched,
        not read back) takes its token from there (`inputs.carried`), one position further."""
        t0 = time.perf_counter()
        rows = self._rows = arrange(self._rows, keys)
        seqs = [self.seqs[k] for k in rows]
        tokens, positions = [], []
        for k, s in zip(rows, seqs, strict=True):
            j = prev.row(k, self.seqs) if prev is not None else None
            if j is None:
                tokens.append(s.ids[-1])
                positions.append(len(s.ids) - 1)
            else:
                tokens.append(carried(j))
                positions.append(len(s.ids))
        packed = self._packed(rows, tokens, positions)
        _, best, best_lp = self.decode_packed(packed)
        tok_host, lp_host = self._landing[self._launches % 2]
        self._launches += 1
        n = best.shape[0]
        self.steps.carry[:n].copy_(best)
        tok_host[:n].copy_(best, non_blocking=True)
        lp_host[:n].copy_(best_lp, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.time.decode_s += time.perf_counter() - t0
        return Flight(list(keys), rows, seqs, tok_host, lp_host, done)

    def _land(self, fl: Flight) -> list[TokenEvent]:
        """Wait for a launched step's tokens and hand them to their sequences, skipping rows
        whose sequence has finished, left or been replaced since the launch."""
        t0 = time.perf_counter()
        if fl.done is not None:
            fl.done.synchronize()  # releases the GIL while the device works
        self.time.decode_s += time.perf_counter() - t0
        self.time.decode_steps += 1
        b = len(fl.rows)
        toks, lps = fl.tokens[:b].tolist(), fl.logprobs[:b].tolist()
        events, landed = [], []
        for k in fl.keys:
            i = fl.row(k, self.seqs)
            if i is None or fl.seqs[i].finish is not None:
                continue  # finished on the step before (a wasted row), removed or replaced
            events.append(self.append_token(k, toks[i], lps[i], []))
            landed.append(k)
        self._cache_blocks(landed)
        return events

    def _emit_rows(self, keys: list[Hashable], logits: torch.Tensor) -> list[TokenEvent]:
        """Sample one token per sequence from its row of logits (B, V), all rows at once."""
        seqs = [self.seqs[k] for k in keys]
        picks = sampling.sample_rows(logits, [s.params for s in seqs], [s.rng for s in seqs])
        return [self.append_token(k, *pick) for k, pick in zip(keys, picks, strict=True)]

    # --- convenience ----------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], dict]:
        """Run one sequence to the end; returns (generated ids, timings)."""
        key = object()
        self.add(key, prompt_ids, params)
        t0 = time.perf_counter()
        out = [self.step()[0]]
        t1 = time.perf_counter()
        while out[-1].finish_reason is None:
            out.extend(self.step())
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        self.remove(key)
        ids = [e.token_id for e in out]
        return ids, {"ttft_s": t1 - t0, "decode_s": t2 - t1, "decode_tokens": len(ids) - 1}
