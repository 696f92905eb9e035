"""Continuous batching over the paged KV cache: add a sequence, step all, remove one.

`Generator` owns the block pool (a free list of block ids; block 0 is scratch) and the running
sequences. A scheduler (`llmopt.serve`) decides *who* runs; the generator only says what fits
(`free_blocks`, `blocks_needed`) and raises `OutOfBlocks` instead of evicting anyone itself.

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
GPU), one graph per (batch, length) bucket. Each new bucket costs a compile (about a minute for an
8B model on an H200), so a compiled generator never cuts the tables below `min_bucket_tokens` (the
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

`SamplingParams(prompt_logprobs=N)` asks for the log-probability of every prompt token given the
ones before it (and the top N): the prefill keeps the final hidden states of that sequence's
positions and runs the LM head and an fp32 log-softmax over them in chunks; the result comes
once, with the sequence's first `TokenEvent` (with chunked prefill, gathered chunk by chunk).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from llmopt.engines.native.model import Transformer

log = logging.getLogger(__name__)

__all__ = ["Generator", "SamplingParams", "TokenEvent", "OutOfBlocks", "Swapped", "EngineTime"]


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks. `seq_ids`: the running sequences that needed one."""

    def __init__(self, message: str, seq_ids: list[Hashable] | None = None):
        super().__init__(message)
        self.seq_ids = seq_ids or []


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # number of top alternatives to return per token (the chosen one always)
    # Log-probabilities of the prompt's own tokens, computed in prefill and sent once with the
    # first TokenEvent: None = off; 0 = each prompt token's only; N = also its top-N.
    prompt_logprobs: int | None = None


# One prompt token's (logprob given the tokens before it, top-N [(token id, logprob)]).
PromptLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class TokenEvent:
    seq_id: Hashable
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | None
    # First event only, when SamplingParams.prompt_logprobs is set: one entry per prompt token,
    # None for the first (nothing precedes it), else (logprob, top-N [(token id, logprob)]).
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass
class _Seq:
    ids: list[int]
    prompt_len: int
    params: SamplingParams
    blocks: list[int]
    rng: torch.Generator | None
    prefilled: bool = False
    finish: str | None = None
    done: int = 0  # prompt tokens whose KV is in the cache (chunked prefill progress)
    plp: list | None = None  # prompt log-probabilities gathered so far, chunk by chunk


@dataclass
class EngineTime:
    """Where a generator's `step()` calls spent their time, cumulative since it was made.

    The forward timings include the wait for the device, so on a GPU they are device time plus
    launch overhead; `step_s` also counts building the inputs and sampling. A server exports these
    as counters (`llmopt_engine_*_total`), which is how its wall time is attributed: prefill,
    decode, the rest of the step, and the time between steps (scheduling, streaming).
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

    @property
    def num_blocks(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def bucket(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _powers_of_two(cap: int) -> list[int]:
    return [1 << i for i in range(cap.bit_length()) if 1 << i <= cap]


class Generator:
    """Runs many sequences of different lengths through one native model."""

    # Prompt log-probabilities: fp32 logits computed per chunk of positions, at most this many
    # elements (64 MiB) at a time, so a long prompt never holds (T, vocab) logits at once.
    prompt_logprob_chunk = 1 << 24

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
    ):
        self.model, self.tokenizer = model, tokenizer
        p = next(model.parameters())
        self.device, self.dtype = p.device, (kv_dtype or model.model.norm.weight.dtype)
        cfg = model.cfg
        self.max_seq_len = int(max_seq_len or min(cfg.max_position, 4096))
        if cfg.sliding_window and self.max_seq_len > cfg.sliding_window:
            self.max_seq_len = int(cfg.sliding_window)  # beyond it, the window would matter
        self.block_size, self.max_batch = block_size, max_batch
        self.max_blocks_per_seq = math.ceil(self.max_seq_len / block_size)
        # Decode batches are padded up to one of these sizes (each a compiled graph when compiled).
        sizes = sorted({int(b) for b in (batch_sizes or _powers_of_two(max_batch))})
        if sizes[0] < 1 or sizes[-1] > max_batch:
            raise ValueError(f"batch sizes {sizes} must lie in 1..max_batch ({max_batch})")
        if sizes[-1] != max_batch:
            sizes.append(max_batch)  # a full batch must fit somewhere
        self.batch_sizes = sizes
        if min_bucket_tokens is None:
            min_bucket_tokens = 512 if compile else 0
        self.min_bucket_blocks = min(
            self.max_blocks_per_seq, max(1, math.ceil(min_bucket_tokens / block_size))
        )
        self.num_blocks = int(num_blocks or max_batch * self.max_blocks_per_seq + 1)
        model.setup_cache(self.num_blocks, block_size, self.dtype, self.device)
        self._free = list(range(self.num_blocks - 1, 0, -1))  # pop() gives low ids first
        self.seqs: dict[Hashable, _Seq] = {}
        self.bucket_blocks = bucket_blocks
        # Prompts admitted together are prefilled in one forward while padded tokens stay under this.
        self.max_prefill_tokens = max_prefill_tokens
        eos = set(cfg.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_ids = eos
        self._decode = self._decode_eager
        self.compile_seconds = 0.0
        self.time = EngineTime()
        if compile:
            self._decode = torch.compile(
                self._decode_eager, mode="reduce-overhead", fullgraph=True, dynamic=False
            )
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # First-chunk prefills through torch.compile (Inductor fuses the norms, RoPE and SiLU*mul
        # that run eager as separate memory-bound kernels over every prompt token). dynamic=True:
        # one graph for every batch and prompt length (batch 1 is its own, as Dynamo
        # specializes 1); no CUDA graphs, as a prefill's shapes vary and its kernels are long.
        self._prefill_forward = self.model
        self.prefill_compile_error: str | None = None
        if compile_prefill:
            self.enable_compiled_prefill()

    # --- capacity -------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def running(self) -> list[Hashable]:
        return list(self.seqs)

    def blocks_needed(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def finished(self, seq_id: Hashable) -> bool:
        return self.seqs[seq_id].finish is not None

    def prefill_pending(self, seq_id: Hashable) -> int:
        """Prompt tokens of `seq_id` still to prefill (0 once its first token is sampled)."""
        s = self.seqs[seq_id]
        return 0 if s.prefilled else len(s.ids) - s.done

    # --- lifecycle ------------------------------------------------------------------------
    def add(self, seq_id: Hashable, prompt_ids: list[int], params: SamplingParams) -> None:
        """Admit a sequence: allocate blocks for its prompt; it is prefilled in the next step()."""
        n = len(prompt_ids)
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if n == 0:
            raise ValueError("empty prompt")
        if n + params.max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of this generator ({self.max_seq_len} tokens)"
            )
        if len(self.seqs) >= self.max_batch:
            raise ValueError(f"batch full ({self.max_batch} sequences)")
        need = self.blocks_needed(n)
        if need > len(self._free):
            raise OutOfBlocks(f"prompt needs {need} KV blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(need)]
        rng = None
        if params.temperature > 0:
            rng = torch.Generator(device=self.device)
            rng.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.seqs[seq_id] = _Seq(list(prompt_ids), n, params, blocks, rng)

    def remove(self, seq_id: Hashable) -> list[int]:
        """Forget a sequence and free its blocks; returns its prompt + generated token ids."""
        s = self.seqs.pop(seq_id)
        self._free.extend(reversed(s.blocks))
        return s.ids

    # --- swapping (preemption that keeps the KV cache) ---------------------------------------
    def _block_views(self) -> list[torch.Tensor]:
        """Every layer's key and value cache as (num_blocks, block_size, n_kv, head_dim) views."""
        return [cache.view(-1, self.block_size, *cache.shape[1:])
                for layer in self.model.model.layers
                for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache)]  # fmt: skip

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token holds across all layers."""
        return sum(v[0, 0].numel() * v.element_size() for v in self._block_views())

    def swap_out(self, seq_id: Hashable) -> Swapped:
        """Copy a decoding sequence's KV blocks to host memory, free them, forget the sequence.

        The copies are queued on the current stream before anything can reuse the blocks, and
        `swap_in` copies back on the same stream, so nothing waits for them here. Its sampling
        state (random generator included) travels with it: after `swap_in` it continues exactly
        as if it had never left.
        """
        s = self.seqs[seq_id]
        if not s.prefilled:
            raise ValueError(f"sequence {seq_id!r} is still being prefilled; remove it instead")
        idx = torch.tensor(s.blocks, device=self.device)
        pin = self.device.type == "cuda"
        host = []
        for view in self._block_views():
            src = view.index_select(0, idx)
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            host.append(buf.copy_(src, non_blocking=pin))
        del self.seqs[seq_id]
        self._free.extend(reversed(s.blocks))
        s.blocks = []
        return Swapped(s, host[0::2], host[1::2])

    def swap_in(self, seq_id: Hashable, swapped: Swapped) -> None:
        """Bring a swapped-out sequence back into free blocks (any ids); it decodes next step."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if len(self.seqs) >= self.max_batch:
            raise ValueError(f"batch full ({self.max_batch} sequences)")
        need = swapped.num_blocks
        if need > len(self._free):
            raise OutOfBlocks(f"swap-in needs {need} KV blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(need)]
        idx = torch.tensor(blocks, device=self.device)
        host = [t for kv in zip(swapped.keys, swapped.values, strict=True) for t in kv]
        for view, buf in zip(self._block_views(), host, strict=True):
            view.index_copy_(0, idx, buf.to(self.device, non_blocking=True))
        swapped.seq.blocks = blocks
        self.seqs[seq_id] = swapped.seq

    # --- stepping -------------------------------------------------------------------------
    def step(self, prefill_budget: int | None = None) -> list[TokenEvent]:
        """Prefill new sequences, then decode one token for each sequence already running.

        `prefill_budget`: prompt tokens to compute in this step at most (chunked prefill; see
        the module docstring). None: prefill every new sequence whole.
        """
        decoding = [k for k, s in self.seqs.items() if s.prefilled and s.finish is None]
        # Make room for the token each decoding sequence writes now, before any work is done.
        short = [k for k in decoding if self._needs_block(self.seqs[k])]
        if len(short) > len(self._free):
            raise OutOfBlocks(
                f"{len(short)} sequences need a new KV block, {len(self._free)} free", short
            )
        for k in short:
            self.seqs[k].blocks.append(self._free.pop())
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
        # Later chunks (paged path) and first chunks (SDPA path) run in separate forwards. Chunks
        # of one kind share a forward, right-padded, while the padding fits in the budget's slack
        # and the forward stays within max_prefill_tokens.
        events = []
        kinds = [self.seqs[k].done == 0 for k, _ in chunks]  # before any chunk runs
        for fresh in (False, True):  # the older sequences' later chunks first
            group: list[tuple[Hashable, int]] = []
            for (k, n), first in zip(chunks, kinds, strict=True):
                if first != fresh:
                    continue
                if group:
                    longest, real = max(c for _, c in group), sum(c for _, c in group)
                    wider = max(longest, n) * (len(group) + 1)
                    extra = (wider - real - n) - (longest * len(group) - real)  # more padding
                    if wider > self.max_prefill_tokens or extra > left:
                        events.extend(self._prefill(group))
                        group = []
                    else:
                        left -= extra
                group.append((k, n))
            if group:
                events.extend(self._prefill(group))
        return events

    def _needs_block(self, s: _Seq) -> bool:
        return (len(s.ids) - 1) // self.block_size >= len(s.blocks)

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
        t = max(n for _, n in chunks)
        nb = self.blocks_needed(max(starts) + t)  # every key position a query can see
        tokens = torch.tensor(
            [s.ids[a : a + n] + [0] * (t - n) for s, a, (_, n) in zip(seqs, starts, chunks,
                                                                     strict=True)],
            device=self.device,
        )  # fmt: skip
        # Padding positions past a sequence's own blocks land in scratch block 0; those within
        # them are its own later positions, overwritten before any query can see them.
        tables = torch.tensor(
            [s.blocks[:nb] + [0] * (nb - min(nb, len(s.blocks))) for s in seqs], device=self.device
        )
        pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(
            t, device=self.device
        )
        last = torch.tensor([n - 1 for _, n in chunks], device=self.device)
        want = [s.params.prompt_logprobs is not None for s in seqs]
        hidden: list[torch.Tensor] = []
        hook = None
        if any(want):  # keep the final-norm output of every position (B, T, D), not logits
            hook = self.model.model.norm.register_forward_hook(lambda _m, _i, o: hidden.append(o))
        # The compiled forward takes first chunks of 2+ tokens (the shapes warmup() compiled);
        # later chunks (the paged path), 1-token prompts and prompt logprobs (a hook) run eager.
        fwd = self._prefill_forward if fresh and hook is None and t > 1 else self.model
        t0 = time.perf_counter()
        try:
            logits = fwd(tokens, pos, tables, prefill=fresh, last_index=last)
        finally:
            if hook is not None:
                hook.remove()
        self._wait()
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
        if not complete:
            return []
        rows = logits[torch.tensor(complete, device=logits.device)]
        events = self._emit_rows([keys[i] for i in complete], rows)
        for ev in events:
            s = self.seqs[ev.seq_id]
            ev.prompt_logprobs, s.plp = s.plp, None
        return events

    def _prompt_logprobs(
        self, hidden: torch.Tensor, s: _Seq, start: int = 0
    ) -> list[PromptLogprob | None]:
        """Log-probability of each prompt token given those before it (and the top-N), from
        one sequence's final hidden states (T, D) at positions start..start+T-1: position p
        scores prompt token p+1 (and position 0 adds None for the first token). The LM head and
        an fp32 log-softmax run over a few hundred positions at a time, so memory stays bounded
        for long prompts."""
        ids = s.ids[: s.prompt_len]
        k = int(s.params.prompt_logprobs or 0)
        vocab = int(self.model.cfg.vocab_size)
        chunk = max(1, self.prompt_logprob_chunk // vocab)
        targets = ids[start + 1 : start + hidden.shape[0] + 1]
        target = torch.tensor(targets, device=hidden.device, dtype=torch.long)
        out: list[PromptLogprob | None] = [None] if start == 0 else []
        for a in range(0, len(targets), chunk):
            b = min(a + chunk, len(targets))
            logp = torch.log_softmax(self.model.lm_head(hidden[a:b]).float(), -1)
            chosen = logp.gather(1, target[a:b, None])[:, 0].tolist()
            if k:
                vals, top = torch.topk(logp, min(k, vocab), -1)
                tops = [list(zip(r, v, strict=True)) for r, v in zip(top.tolist(), vals.tolist(),
                                                                     strict=True)]  # fmt: skip
            else:
                tops = [[] for _ in chosen]
            out.extend(zip(chosen, tops, strict=True))
        return out

    def padded_batch(self, b: int) -> int:
        """The decode batch size `b` sequences run at (the smallest of `batch_sizes` >= b)."""
        return next(s for s in self.batch_sizes if s >= b)

    def table_width(self, blocks: int) -> int:
        """The block-table width (a length bucket) a decode step over `blocks` blocks runs at."""
        if not self.bucket_blocks:
            return self.max_blocks_per_seq
        return max(self.min_bucket_blocks, bucket(blocks, self.max_blocks_per_seq))

    def warmup_widths(self, max_tokens: int | None = None) -> list[int]:
        """The length buckets (table widths) of contexts up to `max_tokens` (default: all)."""
        top = self.table_width(self.blocks_needed(max_tokens or self.max_seq_len))
        return sorted({self.table_width(w) for w in range(1, top + 1)})

    @torch.inference_mode()
    def warmup(self, max_tokens: int | None = None) -> float:
        """Run (and so compile) the decode step for every batch size and length bucket up to
        `max_tokens` of context (default: the whole context), and the compiled prefill if any.
        Returns the seconds it took.

        Only scratch block 0 is touched: the running sequences' KV cache is left alone.
        """
        t0 = time.perf_counter()
        for bp in self.batch_sizes:
            for nb in self.warmup_widths(max_tokens):
                packed = torch.zeros(bp, 2 + nb, dtype=torch.long, device=self.device)
                for _ in range(3):  # compile, then the CUDA-graph warm-up and recording runs
                    self._decode(packed)
        self.warmup_prefill()
        self._wait()
        return time.perf_counter() - t0

    def enable_compiled_prefill(self) -> None:
        """Run first-chunk prefills through `torch.compile` from now on (`compile_prefill`)."""
        if self._prefill_forward is self.model:
            self._prefill_forward = torch.compile(self.model, dynamic=True)

    @torch.inference_mode()
    def warmup_prefill(self) -> float:
        """Compile the compiled prefill's graphs (none without `compile_prefill`), writing only
        scratch block 0. Returns the seconds it took (0 when nothing is compiled).

        A compile that fails (a quantized layer Dynamo cannot trace, a missing C++ compiler on
        the CPU) is logged and the prefill stays eager (`prefill_compile_error` says why): the
        compiled prefill is a speed-up, not a reason for a server not to start.
        """
        if self._prefill_forward is self.model:
            return 0.0
        t0 = time.perf_counter()
        # Batch, length and table width must differ here: Dynamo gives equal sizes one symbol.
        t = 48
        tables = torch.zeros(2, self.blocks_needed(t) + 1, dtype=torch.long, device=self.device)
        try:
            for b in (2, 1):  # the dynamic-shape graph, then batch 1's (Dynamo specializes 1)
                z = torch.zeros(b, t, dtype=torch.long, device=self.device)
                # contiguous, as _prefill builds it: an expanded (stride-0) tensor here would
                # make Dynamo guard on strides, and the first real prefill would compile again
                pos = torch.arange(t, device=self.device).repeat(b, 1)
                self._prefill_forward(z, pos, tables[:b], prefill=True, last_index=z[:, 0] + t - 1)
        except Exception as e:  # noqa: BLE001 - any compile failure: fall back, say why
            self._prefill_forward = self.model
            self.prefill_compile_error = f"{type(e).__name__}: {e}"
            log.warning(
                "compiled prefill failed, prefill stays eager: %s", self.prefill_compile_error
            )
            return 0.0
        self._wait()
        return time.perf_counter() - t0

    @torch.inference_mode()
    def _decode_batch(self, keys: list[Hashable]) -> list[TokenEvent]:
        b = len(keys)
        bp = self.padded_batch(b)
        nb = self.table_width(max(len(self.seqs[k].blocks) for k in keys))
        # One host->device copy per step: rows of [token, position, block table...]; padding
        # rows (and table tails) point at scratch block 0.
        rows = [[0] * (2 + nb) for _ in range(bp)]
        for i, k in enumerate(keys):
            s = self.seqs[k]
            rows[i][0], rows[i][1] = s.ids[-1], len(s.ids) - 1
            rows[i][2 : 2 + len(s.blocks)] = s.blocks
        packed = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        t0 = time.perf_counter()
        logits, best, best_lp = self._decode(packed)
        self._wait()
        self.time.decode_s += time.perf_counter() - t0
        self.time.decode_steps += 1
        plain = [
            not self.seqs[k].params.logprobs and self.seqs[k].params.temperature <= 0 for k in keys
        ]
        if not all(plain):
            return self._emit_rows(keys, logits[:b].clone())
        # All greedy without alternatives: argmax and its logprob came out of the same graph.
        toks, lps = best[:b].tolist(), best_lp[:b].tolist()
        return [
            self._append(k, self.seqs[k], t, lp, [])
            for k, t, lp in zip(keys, toks, lps, strict=True)
        ]

    def _wait(self) -> None:
        """Wait for the GPU with the GIL released (CUDA event), before reading results.

        Reading a CUDA tensor (`.tolist()`, `int(...)`) also waits, but need not release the GIL;
        a server's event loop (detokenizing, streaming) then stalls for the whole step instead of
        running while the GPU computes.
        """
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()

    def _decode_eager(self, packed: torch.Tensor):
        logits = self.model(packed[:, :1], packed[:, 1:2], packed[:, 2:])
        best = torch.argmax(logits, -1, keepdim=True)
        best_lp = logits.gather(1, best) - torch.logsumexp(logits, -1, keepdim=True)
        return logits, best.flatten(), best_lp.flatten()

    def _emit_rows(self, keys: list[Hashable], logits: torch.Tensor) -> list[TokenEvent]:
        """Sample one token per sequence from its row of logits (B, V), all rows at once."""
        seqs = [self.seqs[k] for k in keys]
        picks = sample_rows(logits, [s.params for s in seqs], [s.rng for s in seqs])
        return [self._append(k, s, *pick) for k, s, pick in zip(keys, seqs, picks, strict=True)]

    def _append(self, key, s: _Seq, token: int, logprob: float, top) -> TokenEvent:
        s.ids.append(token)
        p = s.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            s.finish = "stop"
        elif len(s.ids) - s.prompt_len >= p.max_tokens or len(s.ids) >= self.max_seq_len:
            s.finish = "length"
        return TokenEvent(key, token, logprob, top, s.finish)

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


# Top-p looks for each row's nucleus among its top NUCLEUS_K logits first (see `nucleus`).
NUCLEUS_K = 256


def nucleus(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set every logit of x (S, V) outside its row's top-p nucleus (the smallest set of the most
    likely tokens whose probability reaches top_p (S, 1); rows at 1.0 untouched) to -inf.

    A row whose top NUCLEUS_K tokens already hold top_p of its probability (nearly every row of a
    trained model at usual temperatures) finds its nucleus there, from a top-k: sorting the whole
    vocabulary of every row was most of a sampled decode step on a CPU (64 rows x 49,152 logits).
    The other rows are sorted whole. Either way a row's result depends on that row alone.
    """
    inf = float("-inf")
    k = min(x.shape[-1], NUCLEUS_K)
    vals, order = torch.topk(x, k)  # descending
    probs = torch.exp(vals - torch.logsumexp(x, -1, keepdim=True))
    drop = (probs.cumsum(-1) - probs > top_p) & (top_p < 1.0)
    found = drop.any(-1) | (top_p[:, 0] >= 1.0)  # the nucleus ends within the top k (or no top-p)
    out = torch.full_like(x, inf).scatter(1, order, vals.masked_fill(drop, inf))
    out = torch.where((top_p >= 1.0), x, out)
    if not bool(found.all()):
        rest = (~found).nonzero()[:, 0]
        xs = x[rest]
        sorted_x, full_order = torch.sort(xs, dim=-1, descending=True)
        p = torch.softmax(sorted_x, -1)
        d = p.cumsum(-1) - p > top_p[rest]
        out[rest] = xs.scatter(1, full_order, sorted_x.masked_fill(d, inf))
    return out


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], rngs: list[torch.Generator | None]
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Pick the next token of every row of fp32 logits (B, V), each with its own parameters.

    Batched: the temperature, top-k and top-p filters, the softmax and the log-probabilities run
    once over all rows and the results come to the host in one transfer, instead of a few small
    kernels and a host sync per sequence (64 sampled streams would otherwise spend more on
    sampling than on the decode step). Every operation is row-wise, so a row's result does not
    depend on the others: a seeded sequence draws from its own generator and gets the same tokens
    in any batch; unseeded rows draw together from torch's global generator.
    Returns (token, logprob of it under the unmodified logits, top-N [(token, logprob)]) per row.
    """
    B, V = logits.shape
    dev, inf = logits.device, float("-inf")
    tokens = torch.argmax(logits, -1)  # greedy rows keep these
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows:
        idx = torch.tensor(rows, device=dev)
        temps = torch.tensor([params[i].temperature for i in rows], device=dev)
        x = logits[idx] / temps[:, None].to(logits.dtype)
        ks = [params[i].top_k if 0 < params[i].top_k < V else 0 for i in rows]
        if any(ks):
            kth = torch.topk(x, max(ks)).values.gather(
                1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None]
            )
            kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=dev)[:, None], inf)
            x = x.masked_fill(x < kth, inf)
        top_p = [params[i].top_p for i in rows]
        if any(q < 1.0 for q in top_p):
            x = nucleus(x, torch.tensor(top_p, device=dev, dtype=x.dtype)[:, None])
        probs = torch.softmax(x, -1)
        draws = torch.empty(len(rows), dtype=torch.long, device=dev)
        free = [j for j, i in enumerate(rows) if rngs[i] is None]
        if free:
            f = torch.tensor(free, device=dev)
            draws[f] = torch.multinomial(probs[f], 1)[:, 0]
        for j, i in enumerate(rows):
            if rngs[i] is not None:
                draws[j] = torch.multinomial(probs[j], 1, generator=rngs[i])[0]
        tokens = tokens.index_copy(0, idx, draws)
    chosen = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)
    n = max(p.logprobs for p in params)
    top: list = [[]] * B
    if n:  # rows asking for alternatives: the log-softmax and its top N
        want = [i for i, p in enumerate(params) if p.logprobs]
        w = torch.tensor(want, device=dev)
        logp = torch.log_softmax(logits[w], -1)
        vals, ids = torch.topk(logp, n)
        chosen = chosen.index_copy(0, w, logp.gather(1, tokens[w][:, None])[:, 0])
        for j, (r_ids, r_vals) in enumerate(zip(ids.tolist(), vals.tolist(), strict=True)):
            k = params[want[j]].logprobs
            top[want[j]] = list(zip(r_ids[:k], r_vals[:k], strict=True))
    return [(t, lp, top[i]) for i, (t, lp) in enumerate(zip(tokens.tolist(), chosen.tolist(),
                                                            strict=True))]  # fmt: skip
