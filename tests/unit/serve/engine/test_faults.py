"""Faults inside the engine over the real native generator (tiny random Llama): a request the
engine refuses after admission takes nothing with it, a tiny temperature samples greedily, and a
numerical fault in one row fails that sequence alone. After every scenario the block invariant
holds (`Scheduler.check_invariants`)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from llmopt.engines.generation import SamplingParams  # noqa: E402
from llmopt.engines.native import load_generator  # noqa: E402
from llmopt.engines.native.generator import Generator  # noqa: E402
from llmopt.serve.engine.scheduler import Scheduler, Sequence, SequenceFault  # noqa: E402


def _gen(folder, **kw):
    kw = {"max_batch": 4, "block_size": 4, "num_blocks": 64, "max_seq_len": 64} | kw
    return load_generator(str(folder), recipe="fp32", device="cpu", **kw)


def _drive(sched: Scheduler, limit: int = 500) -> dict[int, list]:
    """Step until idle; each sequence's tokens, or the exception that ended it."""
    out: dict[int, list] = {}
    for _ in range(limit):
        if not sched.has_work():
            return out
        for seq, ev in sched.step():
            out.setdefault(seq.seq_id, []).append(
                ev if isinstance(ev, BaseException) else ev.token_id
            )
    raise AssertionError("scheduler did not finish")


def _idle_and_whole(sched: Scheduler) -> None:
    assert not sched.has_work()
    assert sched.check_invariants() == []
    assert sched.gen.free_blocks == sched.capacity_blocks


@pytest.mark.parametrize(
    "params, why",
    [
        (SamplingParams(max_tokens=4, temperature=0.7, seed=2**64), "seed"),
        (SamplingParams(max_tokens=4, temperature=0.7, seed=-(2**63) - 1), "seed"),
        (SamplingParams(max_tokens=4, logprobs=10**6), "logprobs"),
        (SamplingParams(max_tokens=4, temperature=float("nan")), "temperature"),
        (SamplingParams(max_tokens=4, temperature=0.5, top_p=0.0), "top_p"),
        (SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
def test_generator_add_refuses_before_taking_blocks(tiny_llama_dir, params, why):
    gen = _gen(tiny_llama_dir)
    free = gen.free_blocks
    with pytest.raises(ValueError, match=why):
        gen.add("x", list(range(1, 40)), params)
    assert gen.free_blocks == free and not gen.running and not gen.pool.tables
    with pytest.raises(ValueError, match="vocabulary"):
        gen.add("y", [1, 2, 10**9], SamplingParams(max_tokens=2))
    assert gen.free_blocks == free and not gen.pool.tables


def test_refusal_after_admission_leaks_nothing(tiny_llama_dir):
    """The issue's first fault: the engine refuses a request it was given (a seed out of range,
    with a long prompt): the scheduler fails that request, its blocks stay free, and the next
    request runs."""
    gen = _gen(tiny_llama_dir)
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=256)
    long = list(range(1, 50))
    for i in range(4):
        sched.submit(Sequence(i, long, SamplingParams(max_tokens=4, temperature=1, seed=2**64)))
    out = _drive(sched)
    assert all(isinstance(v[0], ValueError) for v in out.values()) and len(out) == 4
    _idle_and_whole(sched)
    sched.submit(Sequence(9, long, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert len(_drive(sched)[9]) == 8
    _idle_and_whole(sched)


class _LeakyAdd(Generator):
    """An engine that breaks the protocol: it takes the blocks, then fails (as the native
    generator did before admission checked the seed first)."""

    def add(self, seq_id, prompt_ids, params):
        if params.seed == 13:
            self.pool.allocate(seq_id, self.blocks_needed(len(prompt_ids)), "prompt needs")
            raise RuntimeError("Overflow when unpacking long long")
        super().add(seq_id, prompt_ids, params)


def test_scheduler_frees_what_a_failed_add_kept(tiny_llama_dir):
    gen = _gen(tiny_llama_dir)
    gen.__class__ = _LeakyAdd  # the same loaded generator, with the faulty add
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=256)
    sched.submit(Sequence(1, list(range(1, 30)), SamplingParams(max_tokens=3, seed=13)))
    sched.submit(Sequence(2, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    out = _drive(sched)
    assert isinstance(out[1][0], RuntimeError) and len(out[2]) == 3
    _idle_and_whole(sched)


def test_a_failed_swap_in_holds_nothing(tiny_llama_dir):
    """swap_in is all or nothing, as add: when copying the keys and values back fails (here a
    host copy of the wrong shape), the blocks it took are free again; the sequence comes back
    later and continues exactly as if it had never left."""
    gen = _gen(tiny_llama_dir)
    p = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)
    want, _ = gen.generate([3, 4, 5, 6, 7], p)
    gen.add("a", [3, 4, 5, 6, 7], p)
    got = [ev.token_id for ev in gen.step()] + [ev.token_id for ev in gen.step()]
    swapped = gen.swap_out("a")
    free, keys = gen.free_blocks, swapped.keys[0]
    swapped.keys[0] = keys[:, :1]  # the wrong shape: the copy into the cache raises
    with pytest.raises(RuntimeError):
        gen.swap_in("a", swapped)
    assert gen.free_blocks == free and not gen.pool.tables and not gen.running
    swapped.keys[0] = keys
    gen.swap_in("a", swapped)
    while not gen.finished("a"):
        got += [ev.token_id for ev in gen.step()]
    gen.remove("a")
    assert got == want and gen.free_blocks == gen.num_blocks - 1


def test_tiny_temperature_is_greedy(tiny_llama_dir):
    """The issue's second fault: temperature 1e-40 (the API allows 0-2) overflowed the logits to
    inf and failed the whole batch. Below the floor it samples greedily."""
    gen = _gen(tiny_llama_dir)
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=256)
    prompts = {1: [3, 4, 5], 2: [9, 8, 7, 6], 3: [11, 12]}
    for t in (1e-40, 1e-38, 5e-324):
        for i, p in prompts.items():
            params = SamplingParams(max_tokens=6, temperature=t if i == 2 else 0.9, seed=i)
            sched.submit(Sequence(i, p, params))
        out = _drive(sched)
        assert all(len(v) == 6 and all(isinstance(x, int) for x in v) for v in out.values()), out
        ref, _ = gen.generate(prompts[2], SamplingParams(max_tokens=6))
        assert out[2] == ref  # greedy
        _idle_and_whole(sched)


def _poison_row(gen: Generator, victim_row: int) -> None:
    """Fault injection: NaN in one row of the next decode step's logits (the real forward runs;
    later steps are clean)."""
    real = gen.decode_packed
    calls = []

    def decode(packed):
        logits, best, best_lp = real(packed)
        calls.append(1)
        if len(calls) > 1:
            return logits, best, best_lp
        logits, best_lp = logits.clone(), best_lp.clone()
        logits[victim_row] = float("nan")
        best_lp[victim_row] = float("nan")
        return logits, best, best_lp

    gen.decode_packed = decode


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_in_one_row_fails_that_sequence_alone(tiny_llama_dir, temperature):
    """A numerical fault in one row of a batch (greedy fast path and sampled path): that
    sequence ends with a SequenceFault, the others finish with the tokens they would have had
    alone."""
    gen = _gen(tiny_llama_dir)
    prompts = {1: [3, 4, 5], 2: [9, 8, 7, 6], 3: [11, 12]}

    def params(i):
        return SamplingParams(max_tokens=5, temperature=temperature, seed=i, ignore_eos=True)

    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=256)
    for i, p in prompts.items():
        sched.submit(Sequence(i, p, params(i)))
    clean = _drive(sched)
    _poison_row(gen, victim_row=1)  # the second running sequence (id 2)
    for i, p in prompts.items():
        sched.submit(Sequence(i + 10, p, params(i)))
    out = _drive(sched)
    assert isinstance(out[12][-1], SequenceFault) and len(out[12]) == 2  # prefill token, fault
    assert out[11] == clean[1] and out[13] == clean[3]
    _idle_and_whole(sched)


def test_sample_rows_isolates_bad_rows():
    from llmopt.engines.native.sampling import sample_rows

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=5, logprobs=2)] * 4
    rngs = [torch.Generator().manual_seed(i) for i in range(4)]
    picks = sample_rows(logits, params, rngs)
    assert [p[0] for p in picks][1:3] == [-1, -1]
    assert all(0 <= p[0] < 50 for i, p in enumerate(picks) if i in (0, 3))
    alone = sample_rows(logits[[0]], params[:1], [torch.Generator().manual_seed(0)])
    assert alone[0][0] == picks[0][0]  # row 0 does not depend on the bad rows


def test_a_nan_sequence_poisons_no_one_after_it(tiny_llama_nan_dir):
    """A sequence whose forward goes NaN fails alone, and the blocks it leaves hold no NaN:
    attention gives masked positions zero weight, and 0 x NaN is NaN, so a block reused with
    stale NaN used to fail the next sequence that grew into it (and every one after)."""
    gen = _gen(tiny_llama_nan_dir)  # token 5 gives NaN
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=256)
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    a, b = [3, 4, 6, 7, 8], [9, 10]
    for i, prompt in ((1, a), (2, b)):
        sched.submit(Sequence(i, prompt, p))
    clean = _drive(sched)
    for i, prompt in ((11, a), (12, [9, 10, 5, 11, 12, 13, 14, 15, 16]), (13, b)):
        sched.submit(Sequence(i, prompt, p))
    mixed = _drive(sched)
    assert isinstance(mixed[12][0], SequenceFault)
    assert mixed[11] == clean[1] and mixed[13] == clean[2]  # 13 grows into 12's old blocks
    for i, prompt in ((21, a), (22, b)):
        sched.submit(Sequence(i, prompt, p))
    after = _drive(sched)
    assert after[21] == clean[1] and after[22] == clean[2]
    _idle_and_whole(sched)
    for view in gen.pool.views:
        assert not torch.isnan(view).any()


def test_engine_process_reports_a_sequence_fault_in_health(tiny_llama_nan_dir):
    """`--engine-process`: a sequence that fails in the engine process (a real NaN forward)
    gets its error, /health's `last_error` says why (it said null), the engine stays alive,
    and the next request is served with nothing leaked."""
    import asyncio

    from llmopt.engines.generation import GeneratorSpec
    from llmopt.serve.engine.process import EngineProcess
    from llmopt.serve.metrics import ServeMetrics

    spec = GeneratorSpec(
        model=str(tiny_llama_nan_dir), max_batch=2, block_size=4, num_blocks=64, max_seq_len=64
    )

    async def scenario():
        ep = EngineProcess(spec, {}, 2, 256, False, ServeMetrics(), start_timeout=300)
        try:
            ep.start(asyncio.get_running_loop())
            assert ep.describe()["last_error"] is None
            _, q = ep.submit([9, 10, 5, 11], SamplingParams(max_tokens=4, ignore_eos=True))
            item = await asyncio.wait_for(q.get(), 120)
            assert isinstance(item, RuntimeError) and "numerical fault" in str(item)
            d = ep.describe()
            assert d["alive"] and "numerical fault" in d["last_error"]
            _, q = ep.submit([9, 10], SamplingParams(max_tokens=4, ignore_eos=True))
            events = [await asyncio.wait_for(q.get(), 120) for _ in range(4)]
            assert events[-1].finish_reason == "length"
            await asyncio.sleep(0.2)  # the step that freed the blocks has reported
            assert ep.describe()["leaked_blocks"] == 0
        finally:
            ep.stop()

    asyncio.run(scenario())
