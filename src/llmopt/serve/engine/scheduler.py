"""Continuous batching over a batching engine's paged KV cache (a `BatchGenerator`).

The scheduler owns three queues: `waiting` (new requests, by priority then arrival: FIFO when
every priority is equal), `running` (sequences in the engine's batch) and `preempted` (evicted
to make room; re-admitted before any waiting request of the same or a lower priority). Each
`step()`:

1. admits sequences while the batch has a free slot, the step's token budget
   (`max_num_batched_tokens`: prompt tokens to prefill plus one per running decode) allows, and
   the engine has the KV blocks for the whole prompt while keeping one block per running
   sequence plus a small watermark free (so admitting does not force a preemption next step).
   When the sequence at the head of the queues finds the batch full or too few blocks free, and
   sequences of a lower priority (a higher number) run, the lowest-priority, latest-arrived of
   them are preempted (as in 3) until it fits: vLLM's priority scheduling. Only a strictly
   lower priority is preempted, and only when preempting all of those would make room;
2. runs one engine step (prefills, or prefill chunks, of the admitted; one decode for every
   running sequence);
3. when the engine reports that running sequences need a new block and none is free
   (`OutOfBlocks`), preempts the latest-arrived, lowest-priority running sequences (their blocks
   freed): by swap, when `swap_space_bytes` has room for the victim's KV cache and swapping beats
   recomputing for this model and device (`serve/swap.py`): its cache waits in host memory and
   comes back into any free blocks, sampling state included; otherwise by recompute: queued again
   with prompt + generated tokens as its new prompt. Either way no generated token is lost and
   none is produced twice.

With chunked prefill (`chunked_prefill=True`, the default) the budget is split as vLLM splits
it: one token per running decode first; what is left goes to prefill chunks, first to the
sequences already being prefilled (oldest first), then to new ones. A new sequence is admitted
while any budget is left (its first chunk runs in the same step); a prompt longer than what is
left is prefilled over several steps (`BatchGenerator.step(prefill_budget=...)`), so no step
computes more than `max_num_batched_tokens` tokens (unless the running decodes alone do) and
running decodes never wait for a long prefill. A sequence being prefilled holds its batch slot and its
whole prompt's KV blocks, and is preempted like any other (its prompt is prefilled again from
the start). Without chunking, a step prefills the admitted prompts whole (a lone prompt longer
than the budget too).

It is single-threaded by design: only the engine thread (`serve/engine/loop.py`) calls it.

>>> sched = Scheduler(gen, max_num_seqs=8, max_num_batched_tokens=2048)   # doctest: +SKIP
>>> sched.submit(Sequence(1, [1, 2, 3], SamplingParams(max_tokens=4)))    # doctest: +SKIP
>>> sched.step()                                                           # doctest: +SKIP
[(Sequence(seq_id=1, ...), TokenEvent(seq_id=1, token_id=..., finish_reason=None))]
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from llmopt.engines.generation import BatchGenerator, OutOfBlocks, SamplingParams
from llmopt.serve import collector
from llmopt.serve.engine.swap import swap_pays as swap_verdict

__all__ = ["Sequence", "Scheduler", "SchedulerStats", "SequenceFault"]

log = logging.getLogger(__name__)


class SequenceFault(RuntimeError):
    """This sequence alone failed in an engine step (NaN or inf in its logits); the engine has
    dropped it and the rest of the batch goes on."""


@dataclass(eq=False)
class Sequence:
    """One generation request as the scheduler sees it.

    `tokens` is what the engine prefills on admission: the prompt, or after a preemption the
    prompt plus everything generated so far. `generated` counts tokens across preemptions.
    """

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first (vLLM's convention)
    sink: Any = None  # where the engine loop delivers this sequence's events
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    preemptions: int = 0
    status: str = "new"  # waiting | running | preempted | finished | aborted | failed
    order: int = 0  # arrival order, the FIFO tie-break
    swapped: Any = None  # the engine's Swapped (KV cache in host memory) while preempted by swap

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def key(self) -> tuple[int, int]:
        return (self.priority, self.order)

    def engine_params(self) -> Any:
        """The sampling params for (re)admission: what is left of max_tokens.

        After a preemption the prompt is prompt + generated tokens; its prompt log-probabilities
        were already delivered with the first token, so they are not asked for again.
        """
        if self.generated == 0:
            return self.params
        extra = {"prompt_logprobs": None} if hasattr(self.params, "prompt_logprobs") else {}
        return replace(self.params, max_tokens=self.params.max_tokens - self.generated, **extra)


@dataclass
class SchedulerStats:
    waiting: int
    running: int
    preempted: int
    free_blocks: int
    num_blocks: int
    preemptions_total: int
    swapped: int = 0  # preempted sequences whose KV cache waits in host memory
    swap_used_bytes: int = 0
    engine_time: Any = None  # the generator's cumulative EngineTime, where it keeps one
    # KV blocks allocated but held by no running sequence (the block invariant: 0 always).
    leaked_blocks: int = 0
    # The engine's prefix cache (`PrefixCacheStats`, cumulative prompt tokens looked up and
    # found cached); all 0 and `prefix_caching` False for an engine without one.
    prefix_caching: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    priority_preemptions: int = 0  # preemptions to admit a higher-priority sequence
    # The garbage collections of the process stepping the engine (`collector.GCPauses`)
    gc: collector.GCPauses | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    def prefix_cache(self) -> dict[str, Any]:
        """The prefix cache as `/health` shows it (cumulative, in prompt tokens)."""
        return {
            "enabled": self.prefix_caching,
            "queries": self.prefix_cache_queries,
            "hits": self.prefix_cache_hits,
            "hit_rate": round(self.prefix_cache_hit_rate, 4),
        }

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.num_blocks if self.num_blocks else 0.0


def _out_of_blocks_ids(exc: BaseException) -> list[int]:
    ids = getattr(exc, "seq_ids", None)
    if ids is None and exc.args and isinstance(exc.args[0], list | tuple | set):
        ids = exc.args[0]
    return list(ids or [])


class Scheduler:
    """Waiting / running / preempted queues over a `BatchGenerator`.

    Args:
        gen: the engine's generator (`get_engine(name).load_generator(spec)`).
        max_num_seqs: sequences in the batch at most (capped by the engine's `max_batch`).
        max_num_batched_tokens: tokens per step (prefill tokens + one per running decode).
        out_of_blocks: the exception the engine raises when out of KV blocks (default:
            `llmopt.engines.generation.OutOfBlocks`).
        watermark: blocks kept free at admission while other sequences run (default: 1% of the
            cache, at least 1).
        chunked_prefill: split prompts into chunks that fit the step's budget (see above); an
            attribute, so a server may switch it before the first step.
        swap_space_bytes: host memory for swapped-out KV caches (0: preempt by recompute only).
            A decoding victim is swapped when its cache fits in what is left and the engine
            says moving it beats recomputing it (`swap_pays`); otherwise it is recomputed.
        swap_pays: the engine's verdict (default: `llmopt.serve.engine.swap.swap_pays(gen)`).
    """

    def __init__(
        self,
        gen: BatchGenerator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        out_of_blocks: type[BaseException] | None = None,
        watermark: int | None = None,
        chunked_prefill: bool = True,
        swap_space_bytes: int = 0,
        swap_pays: bool | None = None,
    ):
        self.gen = gen
        self.max_num_seqs = min(max_num_seqs, int(gen.max_batch))
        self.max_num_batched_tokens = max_num_batched_tokens
        self.OutOfBlocks = out_of_blocks or OutOfBlocks
        self.watermark = watermark if watermark is not None else max(1, gen.num_blocks // 100)
        self.running: dict[int, Sequence] = {}
        self._queued: dict[int, Sequence] = {}  # waiting + preempted, by id
        self._waiting: list[tuple[int, int, Sequence]] = []  # heap by (priority, order)
        self._preempted: list[tuple[int, int, Sequence]] = []  # heap by (priority, order)
        self._order = itertools.count()
        self.preemptions_total = 0
        self.priority_preemptions = 0
        self.chunked_prefill = chunked_prefill
        self.capacity_blocks = int(gen.free_blocks)  # usable blocks (the engine may keep scratch)
        self.swap_space_bytes = int(swap_space_bytes)
        self.swap_used_bytes = 0
        self.swaps_total = 0
        if self.swap_space_bytes and swap_pays is None:
            swap_pays, why = swap_verdict(gen)
            log.info("swap preemption %s: %s", "on" if swap_pays else "off", why)
        self.swap = bool(self.swap_space_bytes and swap_pays)
        self._kv_token = int(gen.kv_bytes_per_token()) if self.swap else 0

    # -- requests in and out ------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        assert seq.seq_id not in self._queued and seq.seq_id not in self.running, "duplicate id"
        seq.order, seq.status = next(self._order), "waiting"
        self._queued[seq.seq_id] = seq
        heapq.heappush(self._waiting, (seq.priority, seq.order, seq))

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a sequence wherever it is; its KV blocks are freed. None if unknown/finished."""
        seq = self.running.pop(seq_id, None)
        if seq is not None:
            self.gen.remove(seq_id)
        else:
            seq = self._queued.pop(seq_id, None)  # its heap entry is skipped when reached
        if seq is not None:
            seq.status = "aborted"
            self._drop_swap(seq)
        return seq

    def _drop_swap(self, seq: Sequence) -> None:
        if seq.swapped is not None:
            self.swap_used_bytes -= seq.swapped.nbytes
            seq.swapped = None

    def has_work(self) -> bool:
        return bool(self.running or self._queued)

    def stats(self) -> SchedulerStats:
        pre = sum(s.status == "preempted" for s in self._queued.values())
        swapped = sum(s.swapped is not None for s in self._queued.values())
        pc = getattr(self.gen, "prefix_cache", None)
        return SchedulerStats(
            len(self._queued) - pre,
            len(self.running),
            pre,
            int(self.gen.free_blocks),
            self.capacity_blocks,
            self.preemptions_total,
            swapped,
            self.swap_used_bytes,
            getattr(self.gen, "time", None),
            self.leaked_blocks(),
            pc is not None,
            int(pc.queries) if pc is not None else 0,
            int(pc.hits) if pc is not None else 0,
            self.priority_preemptions,
            collector.pauses(),
        )

    def leaked_blocks(self) -> int:
        """KV blocks allocated but not held by any running sequence: the block invariant (free
        + held by the running = capacity; nothing held with nothing running) says 0. A block
        that running sequences share (prefix caching) counts once; a cached block nobody holds
        counts as free (the engine evicts it when it needs the room)."""
        held = set()
        for sid in self.running:
            held.update(self.gen.blocks_of(sid))
        return self.capacity_blocks - int(self.gen.free_blocks) - len(held)

    def check_invariants(self) -> list[str]:
        """What is wrong with the scheduler's books (empty: nothing): leaked KV blocks, swap
        space counted but not held, a sequence both queued and running."""
        problems = []
        leaked = self.leaked_blocks()
        if leaked:
            problems.append(
                f"{leaked} KV blocks allocated to no running sequence "
                f"({self.gen.free_blocks} free of {self.capacity_blocks}, "
                f"{len(self.running)} running)"
            )
        swap = sum(s.swapped.nbytes for s in self._queued.values() if s.swapped is not None)
        if swap != self.swap_used_bytes:
            problems.append(f"swap space counted {self.swap_used_bytes} B, held {swap} B")
        both = set(self.running) & set(self._queued)
        if both:
            problems.append(f"sequences both running and queued: {sorted(both)[:5]}")
        return problems

    # -- one iteration ------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, Any]]:
        """Admit, run one engine step, handle finishes and preemption.

        Returns (sequence, TokenEvent) pairs, (sequence, ValueError) for sequences the engine
        refused at admission (another exception where admitting it failed otherwise), and
        (sequence, SequenceFault) for a sequence that alone failed in the step. A finished or
        failed sequence is already removed from the engine, and holds nothing.
        """
        out: list[tuple[Sequence, Any]] = self._admit()
        if not self.running:
            return out
        try:
            if self.chunked_prefill:
                events = self.gen.step(prefill_budget=self._prefill_budget())
            else:
                events = self.gen.step()
        except self.OutOfBlocks as e:
            self._preempt(_out_of_blocks_ids(e))
            return out
        for ev in events:
            seq = self.running.get(ev.seq_id)
            if seq is None:  # not ours any more (cannot happen single-threaded; be safe)
                log.warning("event for unknown sequence %s dropped", ev.seq_id)
                continue
            if getattr(ev, "error", None):  # this sequence alone failed: drop it, keep the rest
                self.gen.remove(ev.seq_id)
                del self.running[ev.seq_id]
                seq.status = "failed"
                log.warning("sequence %s failed: %s", ev.seq_id, ev.error)
                out.append((seq, SequenceFault(ev.error)))
                continue
            seq.generated += 1
            if ev.finish_reason is not None:
                self.gen.remove(ev.seq_id)
                del self.running[ev.seq_id]
                seq.status = "finished"
            out.append((seq, ev))
        return out

    def fail_all(self) -> list[Sequence]:
        """After an engine error: drop every sequence (running and queued) and return them."""
        seqs = list(self.running.values()) + list(self._queued.values())
        for sid in list(self.running):
            try:
                self.gen.remove(sid)
            except Exception:  # the engine is already in trouble; the blocks are its problem
                log.exception("remove(%s) failed after an engine error", sid)
        for q in self._queued.values():
            self._drop_swap(q)
        self.running.clear()
        self._queued.clear()
        self._waiting.clear()
        self._preempted.clear()
        for s in seqs:
            s.status = "failed"
        return seqs

    # -- internals ----------------------------------------------------------------------------
    def _peek(self) -> tuple[list, Sequence] | None:
        """The next sequence to admit and its heap: the higher priority of the two heads, the
        preempted one on a tie."""
        heads = []
        for heap in (self._preempted, self._waiting):
            while heap and heap[0][2].seq_id not in self._queued:
                heapq.heappop(heap)  # aborted while queued
            if heap:
                heads.append((heap[0][2].priority, heap))
        if not heads:
            return None
        _, heap = min(heads, key=lambda h: h[0])  # min is stable: preempted first on a tie
        return heap, heap[0][2]

    def _prefill_budget(self) -> int:
        """This step's tokens for prefill chunks: the budget less one per running decode."""
        decodes = sum(self.gen.prefill_pending(sid) == 0 for sid in self.running)
        return max(0, self.max_num_batched_tokens - decodes)

    def _admit(self) -> list[tuple[Sequence, Any]]:
        failed: list[tuple[Sequence, Any]] = []
        if self.chunked_prefill:  # chunks of the prompts already being prefilled come first
            budget = self._prefill_budget()
            budget -= sum(self.gen.prefill_pending(sid) for sid in self.running)
        else:
            budget = self.max_num_batched_tokens - len(self.running)  # decode tokens this step
        prefilled = False
        while True:
            head = self._peek()
            if head is None:
                break
            heap, seq = head
            if seq.swapped is None:
                n = len(seq.tokens)
                if self.chunked_prefill and budget <= 0:
                    break  # no room for a first chunk this step
                if not self.chunked_prefill and prefilled and n > budget:
                    break  # the next step has room; a lone long prompt is still admitted
                # Its prompt and the position of the token its prefill samples, which the next
                # step writes: admitted with one block short, that step runs out of blocks, the
                # newest sequence (this one) is preempted, and admission repeats forever.
                need = self.gen.blocks_needed(n + 1)
            else:  # back from host memory: no prefill, one decode token (maybe a new block)
                need = seq.swapped.num_blocks + 1
            if not self._fits(need):
                freed = self._preempt_for(seq, need)
                if freed is None:
                    break  # strict order: a later, smaller request does not overtake
                budget += freed
            if seq.swapped is not None:
                if not self._swap_in(seq, heap):
                    break
                budget -= 1
                continue
            try:
                self.gen.add(seq.seq_id, seq.tokens, seq.engine_params())
            except self.OutOfBlocks:
                self._forget(seq.seq_id)
                break
            except Exception as e:  # refused (ValueError) or failed: this request alone
                self._forget(seq.seq_id)
                heapq.heappop(heap)
                del self._queued[seq.seq_id]
                seq.status = "failed"
                if not isinstance(e, ValueError):
                    log.warning("the engine failed to admit sequence %s: %r", seq.seq_id, e)
                failed.append((seq, e))
                continue
            heapq.heappop(heap)
            del self._queued[seq.seq_id]
            self.running[seq.seq_id] = seq
            seq.status = "running"
            # What it computes: less than its prompt where the engine found a cached prefix.
            budget -= self.gen.prefill_pending(seq.seq_id)
            prefilled = True
        return failed

    def _fits(self, need: int, running: int | None = None, free: int | None = None) -> bool:
        """Whether a sequence needing `need` KV blocks can be admitted: a batch slot, and the
        blocks while one block per running sequence plus the watermark stay free (admitting
        into that room would only force a preemption next step, and re-admitting a
        just-preempted sequence into it would repeat forever)."""
        running = len(self.running) if running is None else running
        free = int(self.gen.free_blocks) if free is None else free
        reserve = running + self.watermark if running else 0
        return running < self.max_num_seqs and need <= free - reserve

    def _preempt_for(self, seq: Sequence, need: int) -> int | None:
        """Preempt running sequences of a lower priority than `seq`, lowest priority and latest
        arrival first, until `seq` fits (vLLM's priority scheduling). None, preempting nobody,
        when there are none or preempting all of them would not make room; else the step's
        tokens their preemption gave back (their pending prefill, or a decode token each)."""
        victims = sorted(
            (r for r in self.running.values() if r.priority > seq.priority),
            key=lambda r: r.key,
            reverse=True,
        )
        running, free, take = len(self.running), int(self.gen.free_blocks), 0
        for v in victims:  # the fewest victims that make room (shared blocks free fewer)
            running, free, take = running - 1, free + len(self.gen.blocks_of(v.seq_id)), take + 1
            if self._fits(need, running, free):
                break
        else:
            return None
        tokens = 0
        for v in victims[:take]:
            if self._fits(need):
                break
            if self.chunked_prefill:
                tokens += self.gen.prefill_pending(v.seq_id) or 1
            else:
                tokens += 1
            self._evict(v, f"to admit sequence {seq.seq_id} (priority {seq.priority})")
            self.priority_preemptions += 1
        return tokens if self._fits(need) else None

    def _forget(self, seq_id: int) -> None:
        """After a failed `add`: make sure the engine holds nothing for `seq_id` (the protocol
        says add is all or nothing; an engine that breaks it must not leak blocks for good)."""
        try:
            self.gen.blocks_of(seq_id)
        except Exception:
            return  # holds nothing: the usual case
        log.warning("the engine kept blocks of refused sequence %s; freeing them", seq_id)
        try:
            self.gen.remove(seq_id)
        except Exception:
            log.exception("remove(%s) failed after a refused add", seq_id)

    def _swap_in(self, seq: Sequence, heap: list) -> bool:
        if not self._fits(seq.swapped.num_blocks + 1):
            return False  # strict order, as for prompts (+1: its next decode's block)
        try:
            self.gen.swap_in(seq.seq_id, seq.swapped)
        except (self.OutOfBlocks, ValueError):
            return False
        heapq.heappop(heap)
        del self._queued[seq.seq_id]
        self._drop_swap(seq)
        self.running[seq.seq_id] = seq
        seq.status = "running"
        return True

    def _preempt(self, needing: list[int]) -> None:
        # Victims: lowest priority, then latest arrival first (vLLM's recompute policy).
        victims = sorted(self.running.values(), key=lambda s: s.key, reverse=True)
        need = {sid for sid in needing if sid in self.running} or set(self.running)
        while victims and self.gen.free_blocks < len(need & set(self.running)):
            self._evict(victims.pop(0), "out of KV blocks")

    def _evict(self, v: Sequence, why: str) -> None:
        """Preempt running sequence `v`: swap its KV cache out where that pays and fits, else
        remove it to recompute; either way it is queued again with the preempted."""
        how = "recompute"
        nbytes = len(self.gen.blocks_of(v.seq_id)) * self.gen.block_size * self._kv_token
        if (
            self.swap
            and self.gen.prefill_pending(v.seq_id) == 0
            and self.swap_used_bytes + nbytes <= self.swap_space_bytes
        ):
            v.swapped = self.gen.swap_out(v.seq_id)
            self.swap_used_bytes += v.swapped.nbytes
            self.swaps_total += 1
            how = "swapped to host"
        else:
            v.tokens = list(self.gen.remove(v.seq_id))
        del self.running[v.seq_id]
        v.status, v.preemptions = "preempted", v.preemptions + 1
        self._queued[v.seq_id] = v
        heapq.heappush(self._preempted, (v.priority, v.order, v))
        self.preemptions_total += 1
        log.info("preempted sequence %s (%s, %d tokens): %s", v.seq_id, how, len(v.tokens), why)
