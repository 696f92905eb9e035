"""The serve scheduler with prefix caching and priority preemption, over the real native generator
(tiny random Llama): a higher-priority arrival preempts a running lower-priority sequence when the
batch or the KV cache is full, the preempted one finishes later with the tokens it would have
produced alone, and the books (scheduler and block pool) stay right under any mix of arrivals,
priorities, aborts, preemptions and swaps with shared prompt prefixes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from llmopt.engines.generation import SamplingParams  # noqa: E402
from llmopt.engines.native import load_generator  # noqa: E402
from llmopt.serve.engine.scheduler import Scheduler, Sequence  # noqa: E402


def _gen(folder, **kw):
    kw = {"max_batch": 4, "block_size": 4, "num_blocks": 64, "max_seq_len": 80} | kw
    return load_generator(str(folder), recipe="fp32", device="cpu", **kw)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


PREFIX = [(7 * i + 3) % 250 + 1 for i in range(24)]  # 6 blocks of 4
PROMPTS = {
    "low": PREFIX + [11, 12, 13],
    "high": PREFIX + [21, 22],
    "high2": [5, 9, 14, 200, 3, 8, 1],
}

_ALONE: dict[tuple, list[int]] = {}


def _alone(folder, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of `prompt` run alone, without the prefix cache (the reference; the tiny
    Llama's weights are the same in every test's copy)."""
    key = (tuple(prompt), n)
    if key not in _ALONE:
        _ALONE[key] = _gen(folder).generate(prompt, _greedy(n))[0]
    return _ALONE[key]


def _tight(folder, swap: bool, chunked: bool):
    """A prefix-caching generator and scheduler over a KV cache too small for all (14 blocks)."""
    gen = _gen(folder, num_blocks=14, prefix_caching=True)
    sched = Scheduler(
        gen,
        max_num_seqs=3,
        max_num_batched_tokens=24,
        watermark=0,
        chunked_prefill=chunked,
        swap_space_bytes=(1 << 30) if swap else 0,
        swap_pays=swap,
    )
    return gen, sched


class Driver:
    """Steps a scheduler, keeping every sequence's tokens and the order they finished in, and
    checks the books after every step."""

    def __init__(self, sched: Scheduler):
        self.sched, self.out, self.finished = sched, {}, []

    def step(self) -> None:
        for seq, ev in self.sched.step():
            assert not isinstance(ev, BaseException), ev
            self.out.setdefault(seq.seq_id, []).append(ev.token_id)
            if ev.finish_reason:
                self.finished.append(seq.seq_id)
        assert self.sched.check_invariants() == []
        assert self.sched.gen.pool.check() == []

    def run(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("scheduler did not finish")


@pytest.mark.parametrize("caching", [False, True])
def test_higher_priority_arrival_preempts_when_the_batch_is_full(tiny_llama_dir, caching):
    gen = _gen(tiny_llama_dir, prefix_caching=caching)
    sched = Scheduler(gen, max_num_seqs=1, max_num_batched_tokens=256)
    d = Driver(sched)
    sched.submit(Sequence("low", PROMPTS["low"], _greedy(12), priority=5))
    for _ in range(4):
        d.step()
    assert list(sched.running) == ["low"] and len(d.out["low"]) == 4
    sched.submit(Sequence("high", PROMPTS["high"], _greedy(6), priority=0))
    d.step()
    assert list(sched.running) == ["high"] and sched._queued["low"].status == "preempted"
    assert sched.preemptions_total == sched.priority_preemptions == 1
    assert sched.stats().priority_preemptions == 1
    d.run()
    assert d.finished == ["high", "low"]
    for k, n in (("low", 12), ("high", 6)):
        assert d.out[k] == _alone(tiny_llama_dir, PROMPTS[k], n)  # none lost, none doubled
    assert gen.free_blocks == sched.capacity_blocks
    if caching:  # "high" shares "low"'s prefix; "low" recomputed from its cached blocks
        assert gen.prefix_cache.hits >= 24 + 24
        stats = sched.stats()
        assert stats.prefix_caching and stats.prefix_cache_hits == gen.prefix_cache.hits
        assert 0 < stats.prefix_cache_hit_rate < 1


def test_higher_priority_arrival_preempts_when_blocks_run_short(tiny_llama_dir):
    # 12 usable blocks: "low" holds 7 (27 tokens) and grows; "high2" (2 blocks) does not fit
    # beside it until "low" goes, though the batch has room.
    gen = _gen(tiny_llama_dir, num_blocks=13)
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=256, watermark=0)
    d = Driver(sched)
    sched.submit(Sequence("low", PROMPTS["low"], _greedy(20), priority=1))
    for _ in range(12):
        d.step()
    assert gen.free_blocks < 3  # 2 for "high2" + 1 kept for "low"'s next block
    sched.submit(Sequence("high2", PROMPTS["high2"], _greedy(4), priority=0))
    d.step()
    assert "high2" in sched.running and "low" not in sched.running
    assert sched.priority_preemptions == 1
    d.run()
    assert d.out["low"] == _alone(tiny_llama_dir, PROMPTS["low"], 20)
    assert d.out["high2"] == _alone(tiny_llama_dir, PROMPTS["high2"], 4)


def test_same_or_lower_priority_arrival_waits(tiny_llama_dir):
    gen = _gen(tiny_llama_dir)
    sched = Scheduler(gen, max_num_seqs=1, max_num_batched_tokens=256)
    d = Driver(sched)
    sched.submit(Sequence("a", PROMPTS["low"], _greedy(6), priority=1))
    d.step()
    sched.submit(Sequence("b", PROMPTS["high"], _greedy(3), priority=1))
    sched.submit(Sequence("c", PROMPTS["high2"], _greedy(3), priority=2))
    d.run()
    assert sched.preemptions_total == 0 and d.finished == ["a", "b", "c"]


def test_preempted_low_priority_does_not_block_a_waiting_higher_one(tiny_llama_dir):
    """Preempted sequences come back before waiting ones of the same priority, not before
    waiting ones of a higher priority."""
    gen = _gen(tiny_llama_dir)
    sched = Scheduler(gen, max_num_seqs=1, max_num_batched_tokens=256)
    d = Driver(sched)
    sched.submit(Sequence("low", PROMPTS["low"], _greedy(8), priority=5))
    d.step()
    sched.submit(Sequence("high", PROMPTS["high"], _greedy(3), priority=0))
    d.step()  # "low" preempted
    sched.submit(Sequence("high2", PROMPTS["high2"], _greedy(3), priority=0))
    d.run()
    assert d.finished == ["high", "high2", "low"]
    assert sched.preemptions_total == 1
    assert d.out["low"] == _alone(tiny_llama_dir, PROMPTS["low"], 8)


def test_priority_preemption_swaps_where_it_pays(tiny_llama_dir):
    gen = _gen(tiny_llama_dir, prefix_caching=True)
    sched = Scheduler(
        gen, max_num_seqs=1, max_num_batched_tokens=256, swap_space_bytes=1 << 30, swap_pays=True
    )
    d = Driver(sched)
    sched.submit(Sequence("low", PROMPTS["low"], _greedy(10), priority=3))
    for _ in range(3):
        d.step()
    sched.submit(Sequence("high", PROMPTS["high"], _greedy(4), priority=0))
    d.step()
    assert sched.swaps_total == 1 and sched._queued["low"].swapped is not None
    d.run()
    assert d.finished == ["high", "low"] and sched.swap_used_bytes == 0
    assert d.out["low"] == _alone(tiny_llama_dir, PROMPTS["low"], 10)
    assert gen.free_blocks == sched.capacity_blocks


def test_no_preemption_that_would_not_make_room(tiny_llama_dir):
    # "huge" needs 16 blocks of 15 usable: preempting "low" would not make room, so nobody goes.
    gen = _gen(tiny_llama_dir, num_blocks=16, max_seq_len=80)
    sched = Scheduler(gen, max_num_seqs=2, max_num_batched_tokens=256, watermark=0)
    d = Driver(sched)
    sched.submit(Sequence("low", PROMPTS["low"], _greedy(4), priority=5))
    d.step()
    sched.submit(Sequence("huge", list(range(1, 64)), _greedy(2), priority=0))
    d.step()
    assert sched.preemptions_total == 0 and "low" in sched.running


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["submit", "submit", "submit", "step", "step", "abort"]),
            st.integers(0, 5),  # prompt variant / which sequence
            st.integers(0, 3),  # priority
        ),
        min_size=5,
        max_size=40,
    ),
    swap=st.booleans(),
    chunked=st.booleans(),
)
def test_books_and_outputs_under_any_mix(tiny_llama_dir, ops, swap, chunked):
    """Random arrivals (shared prefixes, mixed priorities), aborts and steps over a KV cache too
    small for all: the scheduler's and the pool's books hold after every step (shared and
    cached blocks counted right), and every sequence that finishes has the tokens it would
    have had alone."""
    gen, sched = _tight(tiny_llama_dir, swap, chunked)
    d = Driver(sched)
    prompts: dict[int, tuple[list[int], int]] = {}
    for op, arg, prio in ops:
        if op == "submit":
            sid = len(prompts)
            prompt = PREFIX[: 4 * arg + 2] + [100 + sid, 101 + sid]
            prompts[sid] = (prompt, 4 + 2 * arg)
            sched.submit(Sequence(sid, prompt, _greedy(4 + 2 * arg), priority=prio))
        elif op == "abort" and prompts:
            sched.abort(arg % len(prompts))
            assert sched.check_invariants() == [] and gen.pool.check() == []
        elif op == "step" and sched.has_work():
            d.step()
    d.run()
    assert gen.free_blocks == sched.capacity_blocks
    assert sched.swap_used_bytes == 0 and not gen.pool.tables
    for sid in d.finished:
        prompt, n = prompts[sid]
        assert d.out[sid] == _alone(tiny_llama_dir, prompt, n), sid


@pytest.mark.parametrize("swap", [True, False])
def test_a_readmitted_sequence_gets_the_block_its_next_step_writes(tiny_llama_dir, swap):
    """Hypothesis found it: a sequence swapped back in (or recomputed) with exactly its blocks
    ran out of blocks on its first decode beside a running one, was preempted again as the
    newest, and re-admitted the next step, forever, while the running one made no progress."""
    gen, sched = _tight(tiny_llama_dir, swap, chunked=True)
    d = Driver(sched)
    prompts = {}
    for sid, arg in enumerate([4, 4, 0, 4, 0]):
        prompts[sid] = (PREFIX[: 4 * arg + 2] + [100 + sid, 101 + sid], 4 + 2 * arg)
        sched.submit(Sequence(sid, prompts[sid][0], _greedy(prompts[sid][1])))
    d.run(limit=200)
    assert sorted(d.finished) == list(range(5))
    for sid, (prompt, n) in prompts.items():
        assert d.out[sid] == _alone(tiny_llama_dir, prompt, n), sid
