"""The overlapped decode path (`Generator(overlap=True)`: step N+1 launched with step N's greedy
tokens on the device, step N's read back after) against the synchronous path, and the packed
inputs kept between steps (`inputs.PackedInputs`). On the CPU every launch runs at once, so
these check the bookkeeping: the same events step for step, wasted rows dropped, nothing after a
finish, every block back."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmopt.engines.generation import SamplingParams
from llmopt.engines.native import load_generator
from llmopt.engines.native.inputs import PackedInputs, arrange
from llmopt.serve.engine.scheduler import Scheduler, Sequence

from .test_local_kv import CPU_SLOW_OR_CUDA, _generator, _prompts
from .test_local_kv import _run as _run_rings

ROOT = Path(__file__).resolve().parents[4]

P = {
    "a": [5, 6, 7],
    "b": list(range(20, 29)),
    "c": [9] * 6,
    "d": [100, 101],
    "d2": [40, 41, 42, 43, 44],
    "e": list(range(60, 73)),
}


def _gen(folder, overlap: bool, **kw):
    kw = {"max_batch": 4, "block_size": 4, "max_seq_len": 64, "device": "cpu"} | kw
    return load_generator(str(folder), recipe="fp32", overlap=overlap, **kw)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


class Log:
    """Every event of a run; fails on an event of a sequence after its finish."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.logprobs: list[float] = []
        self.closed: set = set()

    def record(self, step: int, events) -> None:
        for ev in events:
            assert ev.seq_id not in self.closed, f"{ev.seq_id!r}: an event after its finish"
            self.events.append((step, ev.seq_id, ev.token_id, ev.finish_reason))
            self.logprobs.append(ev.logprob)
            if ev.finish_reason:
                self.closed.add(ev.seq_id)


def _count_carried(gen) -> list[int]:
    """Count the decode steps launched with tokens still on the device (`inputs.carried`)."""
    real, steps = gen.decode_packed, [0, 0]

    def decode(packed):
        steps[0] += 1
        steps[1] += bool((packed[:, 0] < 0).any())
        return real(packed)

    gen.decode_packed = decode
    return steps


def _joins_and_finishes(gen, stop: int, budget: int | None) -> Log:
    """Sequences join at different steps, grow into new blocks and batch buckets, finish by
    max_tokens and by a stop token; one finished sequence stays in the batch two steps before
    it is removed, and one key is used again as soon as its first sequence is removed."""
    log = Log()
    plan = {
        0: [("a", P["a"], _greedy(14)), ("b", P["b"], _greedy(5))],
        2: [("c", P["c"], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))],
        3: [("d", P["d"], _greedy(3))],
        5: [("e", P["e"], _greedy(9))],
    }
    ended: dict = {}
    again = True
    for step in range(60):
        for k, prompt, params in plan.get(step, []):
            gen.add(k, prompt, params)
        log.record(step, gen.step(budget))
        for k in list(gen.seqs):
            if not gen.finished(k):
                continue
            ended.setdefault(k, step)
            if k == "b" and step < ended[k] + 2:
                continue  # finished, still in the batch
            gen.remove(k)
            del ended[k]
            log.closed.discard(k)
            if k == "d" and again:  # the same key, another sequence, at once
                gen.add("d", P["d2"], _greedy(4))
                again = False
        if not gen.seqs and step > 5:
            break
    return log


@pytest.mark.parametrize("budget", [None, 5])
def test_overlap_gives_the_synchronous_events_step_for_step(tiny_llama_dir, budget):
    sync, ov = _gen(tiny_llama_dir, False), _gen(tiny_llama_dir, True)
    stop = sync.generate(P["c"], _greedy(12))[0][3]
    carried = _count_carried(ov)
    before = sync.time.decode_steps
    want = _joins_and_finishes(sync, stop, budget)
    got = _joins_and_finishes(ov, stop, budget)
    assert got.events == want.events
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    reasons = [e[3] for e in want.events if e[3]]
    assert reasons.count("stop") == 1 and reasons.count("length") == 5
    assert len({e[0] for e in want.events}) >= 14
    # The overlapped generator launched nearly every decode step ahead, with its tokens taken
    # on the device (one more launch than steps read per restart: the last one is dropped).
    assert ov.time.decode_steps == sync.time.decode_steps - before
    assert carried[1] >= carried[0] - 6 and carried[0] > ov.time.decode_steps
    for g in (sync, ov):
        assert g.free_blocks == g.num_blocks - 1 and not g.pool.tables and not g.seqs


def _mixed(gen) -> Log:
    """While steps are in flight: a sequence swapped out and back, one aborted mid-generation,
    a sampled one and one asking for logprobs joining (synchronous steps while they run)."""
    log = Log()
    gen.add(0, P["a"], _greedy(24))
    gen.add(1, P["b"], _greedy(20))
    gen.add(2, P["c"], _greedy(20))
    held = None
    for step in range(80):
        if step == 3:
            held = gen.swap_out(1)
        if step == 6:
            gen.swap_in(1, held)
        if step == 8:
            gen.remove(2)
            log.closed.add(2)  # aborted: nothing more may come for it
        if step == 9:
            gen.add(3, P["d"], SamplingParams(max_tokens=6, temperature=0.8, seed=3))
        if step == 18:
            gen.add(4, P["d2"], _greedy(4, logprobs=2))
        log.record(step, gen.step())
        for k in [k for k in gen.seqs if gen.finished(k)]:
            gen.remove(k)
        if not gen.seqs:
            break
    return log


def test_overlap_survives_swaps_aborts_and_synchronous_steps(tiny_llama_dir):
    sync, ov = _gen(tiny_llama_dir, False), _gen(tiny_llama_dir, True)
    carried = _count_carried(ov)
    want, got = _mixed(sync), _mixed(ov)
    assert got.events == want.events
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert {e[1] for e in want.events} == {0, 1, 2, 3, 4}
    assert 0 < carried[1] < carried[0]  # overlapped, and synchronous while 3 and 4 ran
    for g in (sync, ov):
        assert g.free_blocks == g.num_blocks - 1 and not g.seqs


@pytest.mark.parametrize("swap", [False, True])
def test_scheduler_preempting_over_the_overlapped_generator(tiny_llama_dir, swap):
    """A pool too small for every sequence to grow: preemption (recompute or swap) with steps
    in flight; every sequence gets the tokens it gets alone, no block is leaked."""
    prompts = [[1, 5, 9, 13, 17, 21, 25], [2, 4, 6, 8, 10], [3, 7, 11, 15, 19, 23, 27], [9, 8]]
    alone = {
        i: _gen(tiny_llama_dir, False).generate(p, _greedy(12))[0] for i, p in enumerate(prompts)
    }
    gen = _gen(tiny_llama_dir, True, num_blocks=12)
    sched = Scheduler(
        gen,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        watermark=0,
        swap_space_bytes=(1 << 30) if swap else 0,
        swap_pays=True,
    )
    for i, p in enumerate(prompts):
        sched.submit(Sequence(i, p, _greedy(12)))
    out: dict[int, list[int]] = {}
    for _ in range(300):
        if not sched.has_work():
            break
        for seq, ev in sched.step():
            assert not isinstance(ev, BaseException), ev
            out.setdefault(seq.seq_id, []).append(ev.token_id)
        assert sched.check_invariants() == [] and sched.leaked_blocks() == 0
    assert sched.preemptions_total > 0 and (sched.swaps_total > 0) == swap
    assert out == alone
    assert gen.free_blocks == sched.capacity_blocks and not gen.seqs


def test_a_fault_in_flight_fails_that_sequence_alone(tiny_llama_dir):
    """NaN logits in one row of a decode step: that sequence ends with an error event and
    nothing after it (its next step, already launched, is dropped); the others go on."""
    params = _greedy(8)
    runs = []
    for overlap in (False, True):
        gen = _gen(tiny_llama_dir, overlap)
        real, calls = gen.decode_packed, []

        def decode(packed, gen=gen, real=real, calls=calls):
            logits, best, best_lp = real(packed)
            calls.append(1)
            if len(calls) == 3:  # the third decode step: sequence 1's row goes bad
                best_lp = best_lp.clone()
                best_lp[gen._rows.index(1)] = float("nan")
            return logits, best, best_lp

        gen.decode_packed = decode
        log = Log()
        for i, k in enumerate("ab"):
            gen.add(i, P[k], params)
        for step in range(20):
            log.record(step, gen.step())
            for k in [k for k in gen.seqs if gen.finished(k)]:
                gen.remove(k)
            if not gen.seqs:
                break
        assert gen.free_blocks == gen.num_blocks - 1
        runs.append(log.events)
    assert runs[0] == runs[1]
    bad = [e for e in runs[1] if e[1] == 1]
    assert bad[-1][2:] == (-1, "error") and len(bad) == 4  # prefill token, two decodes, fault
    assert [e for e in runs[1] if e[1] == 0] == [e for e in runs[0] if e[1] == 0]
    assert len([e for e in runs[1] if e[1] == 0]) == 8


def test_overlap_with_rings_equals_each_alone(tmp_path):
    """Gemma-3-style local layers (a ring per sequence, packed after the block table)."""
    _, sync = _generator(tmp_path / "s")
    _, ov = _generator(tmp_path / "o", overlap=True)
    prompts = _prompts()
    alone = {
        i: sync.generate(p, SamplingParams(max_tokens=30, ignore_eos=True))[0]
        for i, p in enumerate(prompts)
    }
    assert _run_rings(ov, prompts) == alone
    assert _run_rings(ov, prompts, budget=4) == alone
    assert ov.local_pool.free == ov.local_blocks - 1 and ov.free_blocks == ov.num_blocks - 1


def _rebuilt(rows: int, width: int, ring: int, tables, rings, tokens, positions):
    """The packed rows as the generator once built them, whole, every step."""
    out = [[0] * (2 + width + ring) for _ in range(rows)]
    for i, table in enumerate(tables):
        out[i][0], out[i][1] = tokens[i], positions[i]
        out[i][2 : 2 + len(table)] = table
        if ring:
            out[i][2 + width :] = rings[i]
    return torch.tensor(out)


@pytest.mark.parametrize("ring", [0, 2])
def test_packed_inputs_written_incrementally_equal_rows_built_whole(ring):
    """Random joins, leaves, re-admissions under a key used before, new blocks and bucket
    changes: every step's buffer equals the rows built whole; a step where nothing joined or
    left rewrites no row, and a leave rewrites one."""
    rnd = random.Random(0)
    inputs = PackedInputs(torch.device("cpu"), ring)
    state: dict = {}  # key -> [seq object, table, ring, length]
    rows_order: list = []
    next_block = iter(range(1, 100000))
    history: list[tuple] = []  # (shape, membership changed) per step
    filled = quiet = 0
    for step in range(400):
        changed = False
        if rnd.random() < 0.15 and len(state) < 8:
            k = rnd.randrange(12)
            if k not in state:  # a key seen before comes back as another sequence
                n = rnd.randrange(1, 20)
                table = [next(next_block) for _ in range(-(-n // 4))]
                state[k] = [object(), table, [next(next_block) for _ in range(ring)], n]
                changed = True
        if rnd.random() < 0.1 and state:
            del state[rnd.choice(list(state))]
            changed = True
        for s in state.values():  # one token each; a new block every 4
            s[3] += 1
            if (s[3] - 1) // 4 >= len(s[1]):
                s[1].append(next(next_block))
        if not state:
            history.clear()
            continue
        rows_order = arrange(rows_order, list(state))
        seqs, tables, rings = zip(*[state[k][:3] for k in rows_order], strict=True)
        tokens = [rnd.randrange(100) for _ in rows_order]
        positions = [state[k][3] - 1 for k in rows_order]
        bp = 8 if len(state) > 4 else 4
        width = max(4, 1 << (max(len(t) for t in tables) - 1).bit_length())
        before = inputs.rewrites
        got = inputs.fill(bp, width, seqs, tables, rings if ring else None, tokens, positions)
        want = _rebuilt(bp, width, ring, tables, rings, tokens, positions)
        assert torch.equal(got, want), step
        filled += len(seqs)
        history.append(((bp, width), changed))
        # Both buffers of this shape saw this batch already: nothing to rewrite, only tokens,
        # positions and new blocks.
        same = len(history) >= 3 and {h[0] for h in history[-3:]} == {(bp, width)}
        if same and not any(h[1] for h in history[-2:]):
            assert inputs.rewrites == before, step
            quiet += 1
    assert quiet > 100 and inputs.rewrites < filled / 5


def test_arrange_keeps_rows_and_fills_holes():
    assert arrange([], [3, 1, 2]) == [3, 1, 2]
    assert arrange([1, 2, 3], [1, 2, 3]) == [1, 2, 3]
    assert arrange([1, 2, 3, 4], [2, 3, 4]) == [4, 2, 3]  # the last row fills the hole
    assert arrange([1, 2, 3], [1, 3, 5, 6]) == [1, 5, 3, 6]  # a newcomer fills it
    assert arrange([1, 2, 3, 4, 5], [5]) == [5]


@pytest.mark.parametrize("device", CPU_SLOW_OR_CUDA)
def test_compiled_overlap_gives_the_synchronous_events(tiny_llama_dir, device):
    """The compiled decode step (CUDA graphs on a GPU, where the copies to and from the device
    really run behind the host): the carried tokens are resolved inside the graph, its outputs
    are copied out before the next replay overwrites them, and the events equal the
    synchronous compiled generator's, step for step."""
    kw = {"device": device, "compile": True, "min_bucket_tokens": 16}
    sync, ov = _gen(tiny_llama_dir, False, **kw), _gen(tiny_llama_dir, True, **kw)
    for g in (sync, ov):
        g.warmup()
    stop = sync.generate(P["c"], _greedy(12))[0][3]
    carried = _count_carried(ov)
    want = _joins_and_finishes(sync, stop, 5)
    got = _joins_and_finishes(ov, stop, 5)
    assert got.events == want.events
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert carried[1] >= carried[0] - 6 > 0
    for g in (sync, ov):
        assert g.free_blocks == g.num_blocks - 1 and not g.seqs


def test_decode_benchmark_runs_both_paths_and_reports_host_time(tmp_path):
    """`benchmarks/decode.py --overlap off on` on a tiny shape on the CPU: both paths per
    point, the same greedy tokens, and host ms per step (wall less device-only) reported."""
    out = tmp_path / "d.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--shape", "tiny"]
    cmd += ["--device", "cpu", "--prompt-len", "8", "--new-tokens", "8", "--batches", "1", "2"]
    cmd += ["--modes", "fp32", "--overlap", "off", "on", "--threads", "1", "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())["native"]
    assert [(r["batch"], r["overlap"]) for r in res] == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    assert res[1]["greedy_equal_to_first_path"] == 8
    for r in res:
        want = r["ms_per_step"] - r["ms_per_step_device_only"]
        assert r["host_ms_per_step"] == pytest.approx(want)


def test_overlap_with_prefix_caching_gives_the_synchronous_tokens(tiny_llama_dir):
    """Prefix caching and the overlapped decode together: prompts sharing a prefix, joining while
    others decode, give the events of the synchronous, uncached path, and every block comes back
    (decode-written blocks are registered on the landed path too)."""
    shared = list(range(30, 47))  # 4 full blocks of 4, then a tail
    prompts = {f"s{i}": shared + [80 + i, 90 + i] for i in range(4)}

    def run(overlap: bool, cache: bool) -> Log:
        gen = _gen(tiny_llama_dir, overlap, prefix_caching=cache)
        log, pending, live = Log(), list(prompts), set()
        for step in range(200):
            if pending and step in (0, 1, 3, 4):  # join while others decode
                k = pending.pop(0)
                gen.add(k, prompts[k], _greedy(7 + step))
                live.add(k)
            if not live:
                break
            evs = gen.step()
            log.record(step, evs)
            for ev in evs:
                if ev.finish_reason:
                    gen.remove(ev.seq_id)
                    live.discard(ev.seq_id)
        assert not live and not pending
        assert gen.free_blocks == gen.num_blocks - 1
        return log

    want = run(False, False)
    for overlap, cache in ((True, True), (False, True), (True, False)):
        got = run(overlap, cache)
        assert [e[1:] for e in got.events] == [e[1:] for e in want.events], (overlap, cache)
