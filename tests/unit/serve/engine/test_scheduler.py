"""The serve scheduler over the real native generator (tiny random Llama): admission by free KV
blocks, FIFO with priority, token budget, preemption by recompute, aborts freeing blocks."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from llmopt.engines.generation import OutOfBlocks, SamplingParams  # noqa: E402
from llmopt.engines.native import load_generator  # noqa: E402
from llmopt.serve.engine.scheduler import Scheduler, Sequence  # noqa: E402


def _gen(folder, **kw):
    kw = {"max_batch": 4, "block_size": 4, "num_blocks": 64, "max_seq_len": 64} | kw
    return load_generator(str(folder), recipe="fp32", device="cpu", **kw)


def _run(sched: Scheduler, limit: int = 500) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for _ in range(limit):
        if not sched.has_work():
            return out
        for seq, ev in sched.step():
            assert not isinstance(ev, BaseException), ev
            out.setdefault(seq.seq_id, []).append(ev.token_id)
    raise AssertionError("scheduler did not finish")


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


PROMPTS = [
    [1, 5, 9, 13, 17, 21, 25],
    [2, 4, 6, 8, 10],
    [3, 7, 11, 15, 19, 23, 27, 31, 35],
    [9, 8, 7],
]


def test_all_finish_blocks_return(tiny_llama_dir):
    gen = _gen(tiny_llama_dir)
    sched = Scheduler(gen, max_num_seqs=2, max_num_batched_tokens=256)
    free0 = gen.free_blocks
    for i, p in enumerate(PROMPTS):
        sched.submit(Sequence(i, p, _greedy(6)))
    first = sched.step()
    assert len(sched.running) == 2 and sched.stats().waiting == 2  # max_num_seqs holds
    assert {s.seq_id for s, _ in first} == {0, 1}  # FIFO
    out = _run(sched)
    for seq, ev in first:
        out[seq.seq_id].insert(0, ev.token_id)
    assert sorted(out) == [0, 1, 2, 3] and all(len(v) == 6 for v in out.values())
    assert gen.free_blocks == free0 and not gen.running


def test_priority_then_fifo(tiny_llama_dir):
    gen = _gen(tiny_llama_dir)
    sched = Scheduler(gen, max_num_seqs=1, max_num_batched_tokens=256)
    order = []
    for sid, prio in [(0, 5), (1, 0), (2, 5), (3, 0)]:
        sched.submit(Sequence(sid, PROMPTS[sid], _greedy(2), priority=prio))
    while sched.has_work():
        for seq, ev in sched.step():
            if ev.finish_reason:
                order.append(seq.seq_id)
    assert order == [1, 3, 0, 2]


def test_admission_waits_for_free_blocks(tiny_llama_dir):
    # 9 usable blocks of 4 tokens; each sequence needs ceil((7+8)/4) = 4 blocks at its end.
    gen = _gen(tiny_llama_dir, num_blocks=10)
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=256, watermark=0)
    for i in range(4):
        sched.submit(Sequence(i, PROMPTS[0], _greedy(8)))
    first = sched.step()
    # Prompts of 7 tokens take 2 blocks each; admission keeps one block per running sequence
    # free: 2 + (2+1) + (2+2) = 9 blocks, so the fourth waits.
    assert len(sched.running) == 3 and sched.stats().waiting == 1
    out = _run(sched)
    for seq, ev in first:
        out[seq.seq_id].insert(
            0, ev.token_id
        )  # growing past the free blocks forces preemptions, nothing is lost
    assert sorted(out) == [0, 1, 2, 3] and all(len(v) == 8 for v in out.values())
    assert sched.preemptions_total > 0
    assert gen.free_blocks == sched.capacity_blocks


def test_preemption_by_recompute_keeps_greedy_output(tiny_llama_dir):
    alone = {}
    for i, p in enumerate(PROMPTS):
        gen = _gen(tiny_llama_dir)
        alone[i], _ = gen.generate(p, _greedy(12))
    gen = _gen(tiny_llama_dir, num_blocks=12)  # 11 usable: four sequences cannot all grow
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=256, watermark=0)
    for i, p in enumerate(PROMPTS):
        sched.submit(Sequence(i, p, _greedy(12)))
    out = _run(sched)
    assert sched.preemptions_total > 0
    assert out == alone  # recompute: same tokens, none lost, none doubled


def test_prompt_logprobs_sent_once_across_preemptions(tiny_llama_dir):
    def params() -> SamplingParams:
        return SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=1)

    alone = {}
    for i, p in enumerate(PROMPTS):
        gen = _gen(tiny_llama_dir)
        gen.add(i, p, params())
        alone[i] = gen.step()[0].prompt_logprobs
    gen = _gen(tiny_llama_dir, num_blocks=12)  # preemptions re-add prompt + generated tokens
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=256, watermark=0)
    for i, p in enumerate(PROMPTS):
        sched.submit(Sequence(i, p, params()))
    got: dict[int, list] = {}
    for _ in range(500):
        if not sched.has_work():
            break
        for seq, ev in sched.step():
            if ev.prompt_logprobs is not None:
                got.setdefault(seq.seq_id, []).append(ev.prompt_logprobs)
    assert sched.preemptions_total > 0 and not sched.has_work()
    assert sorted(got) == [0, 1, 2, 3] and all(len(v) == 1 for v in got.values())  # once each
    for i, p in enumerate(PROMPTS):
        (plp,) = got[i]
        assert len(plp) == len(p) and plp[0] is None  # the original prompt, not prompt + output
        for a, b in zip(plp[1:], alone[i][1:], strict=True):
            assert a[0] == pytest.approx(b[0], abs=1e-5) and [t for t, _ in a[1]] == [
                t for t, _ in b[1]
            ]
    # A re-admitted sequence asks the engine for none.
    seq = Sequence(9, [1, 2, 3], params())
    seq.generated = 2
    assert seq.engine_params().prompt_logprobs is None and seq.engine_params().max_tokens == 10


def test_token_budget_limits_prefills_per_step(tiny_llama_dir):
    gen = _gen(tiny_llama_dir)
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=10, chunked_prefill=False)
    for i in range(3):
        sched.submit(Sequence(i, PROMPTS[0], _greedy(3)))  # 7 tokens each
    assert len(sched.step()) == 1  # 7 fit, 7 more would exceed 10
    assert len(sched.running) == 1
    sched.step()
    assert len(sched.running) == 2
    _run(sched)


def _count_tokens(gen) -> list[int]:
    """Record the tokens (padding included) of every model forward: prefills and decodes."""
    counted: list[int] = []
    decode = gen.steps.decode

    def wrapped(packed, *rest):
        counted.append(-1)  # a decode step: the scheduler's count of running decodes applies
        return decode(packed, *rest)

    gen.steps.decode = wrapped
    gen.model.register_forward_pre_hook(
        lambda _m, args, _kw: None if counted[-1:] == [-1] else counted.append(args[0].numel()),
        with_kwargs=True,
    )
    return counted


def test_chunked_prefill_splits_the_budget(tiny_llama_dir):
    alone = {}
    for i in range(3):
        alone[i], _ = _gen(tiny_llama_dir).generate(PROMPTS[2], _greedy(3 + i))
    gen = _gen(tiny_llama_dir)
    sched = Scheduler(gen, max_num_seqs=4, max_num_batched_tokens=10)
    assert sched.chunked_prefill  # the default
    counted = _count_tokens(gen)
    for i in range(3):
        sched.submit(Sequence(i, PROMPTS[2], _greedy(3 + i)))  # 9 tokens each
    out: dict[int, list[int]] = {}
    steps = []
    while sched.has_work():
        decodes = sum(gen.prefill_pending(s) == 0 for s in sched.running)  # before admission
        counted.clear()
        for seq, ev in sched.step():
            out.setdefault(seq.seq_id, []).append(ev.token_id)
        prefill = [c for c in counted if c != -1]
        assert sum(prefill) + decodes <= 10  # one token per decode, the rest for chunks
        assert counted.count(-1) == (decodes > 0)  # decodes ran every step they could
        steps.append((decodes, prefill))
        assert len(steps) < 50
    # 9 + 1 of the second prompt; 1 decode + 8 + 1 of the third; 2 decodes + 8; ...
    assert steps[:3] == [(0, [9, 1]), (1, [8, 1]), (2, [8])]
    assert out == alone


def test_chunked_sequence_preempted_mid_prefill(tiny_llama_dir):
    prompts = {0: list(range(40, 44)), 1: list(range(50, 85))}  # 1 block; 9 blocks
    lengths = {0: 12, 1: 4}
    alone = {
        i: _gen(tiny_llama_dir).generate(p, _greedy(lengths[i]))[0] for i, p in prompts.items()
    }
    # 11 usable blocks of 4 tokens. Sequence 1 is prefilled 4 tokens a step (a budget of 5 less
    # sequence 0's decode); sequence 0 grows into the last free block, then needs one more while
    # 1 is half prefilled: 1, the latest to arrive, is evicted and recomputed later.
    gen = _gen(tiny_llama_dir, num_blocks=12)
    sched = Scheduler(gen, max_num_seqs=2, max_num_batched_tokens=5, watermark=0)
    removed = []
    remove = gen.remove

    def spy(sid):
        removed.append((sid, gen.prefill_pending(sid), len(gen.seqs[sid].ids)))
        return remove(sid)

    gen.remove = spy
    for i, p in prompts.items():
        sched.submit(Sequence(i, p, _greedy(lengths[i])))
    out = _run(sched)
    assert sched.preemptions_total == 1
    sid, pending, n = removed[0]
    assert sid == 1 and 0 < pending < n == 35  # evicted with part of its prompt prefilled
    assert out == alone  # recomputed: same tokens, none lost, none doubled
    assert gen.free_blocks == sched.capacity_blocks


def test_abort_frees_blocks_everywhere(tiny_llama_dir):
    gen = _gen(tiny_llama_dir)
    sched = Scheduler(gen, max_num_seqs=1, max_num_batched_tokens=256)
    free0 = gen.free_blocks
    sched.submit(Sequence(0, PROMPTS[2], _greedy(30)))
    sched.submit(Sequence(1, PROMPTS[1], _greedy(30)))
    sched.step()
    assert gen.free_blocks < free0
    assert sched.abort(1).status == "aborted"  # queued
    assert sched.abort(0).status == "aborted"  # running
    assert sched.abort(0) is None  # already gone
    assert gen.free_blocks == free0 and not sched.has_work()
    assert sched.step() == []


def test_engine_refusal_fails_only_that_sequence(tiny_llama_dir):
    gen = _gen(tiny_llama_dir, max_seq_len=16)
    sched = Scheduler(gen, max_num_seqs=2, max_num_batched_tokens=256)
    sched.submit(Sequence(0, PROMPTS[0], _greedy(40)))  # 7 + 40 > 16: the engine refuses
    sched.submit(Sequence(1, PROMPTS[3], _greedy(2)))
    first = sched.step()
    assert isinstance(first[0][1], ValueError) and first[0][0].seq_id == 0
    rest = _run(sched)
    assert len(first[1:]) + len(rest[1]) == 2  # the other one runs to the end


def test_out_of_blocks_is_the_engines_class():
    assert issubclass(OutOfBlocks, Exception)


def _swap_sched(gen, space: int) -> Scheduler:
    return Scheduler(
        gen,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        watermark=0,
        swap_space_bytes=space,
        swap_pays=True,
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_preemption_by_swap_continues_exactly(tiny_llama_dir, temperature):
    """Swapped-out sequences come back with their KV cache and sampling state: the same tokens
    as running alone, greedy or sampled with a seed (recompute cannot promise the latter)."""

    def params() -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True)

    alone = {}
    for i, p in enumerate(PROMPTS):
        alone[i], _ = _gen(tiny_llama_dir).generate(p, params())
    gen = _gen(tiny_llama_dir, num_blocks=12)  # 11 usable: four sequences cannot all grow
    sched = _swap_sched(gen, 1 << 30)
    for i, p in enumerate(PROMPTS):
        sched.submit(Sequence(i, p, params()))
    out = _run(sched)
    assert sched.swaps_total > 0 and sched.preemptions_total == sched.swaps_total
    assert out == alone
    assert sched.swap_used_bytes == 0 and gen.free_blocks == sched.capacity_blocks


def test_swap_space_full_falls_back_to_recompute(tiny_llama_dir):
    gen = _gen(tiny_llama_dir, num_blocks=12)
    one_block = gen.kv_bytes_per_token() * gen.block_size
    sched = _swap_sched(gen, one_block)  # too small for any victim (each holds >= 2 blocks)
    for i, p in enumerate(PROMPTS):
        sched.submit(Sequence(i, p, _greedy(12)))
    _run(sched)
    assert sched.preemptions_total > 0 and sched.swaps_total == 0


def test_abort_while_swapped_releases_host_memory(tiny_llama_dir):
    gen = _gen(tiny_llama_dir, num_blocks=12)
    sched = _swap_sched(gen, 1 << 30)
    for i, p in enumerate(PROMPTS):
        sched.submit(Sequence(i, p, _greedy(12)))
    for _ in range(200):
        sched.step()
        swapped = [s for s in sched._queued.values() if s.swapped is not None]
        if swapped:
            break
    else:
        pytest.fail("nothing was swapped out")
    assert sched.stats().swapped == 1 and sched.swap_used_bytes == swapped[0].swapped.nbytes
    sched.abort(swapped[0].seq_id)
    assert sched.swap_used_bytes == 0 and sched.stats().swapped == 0
    _run(sched)
    assert gen.free_blocks == sched.capacity_blocks


def test_swap_verdict_by_model_and_device(tiny_llama_dir):
    from llmopt.serve.engine import swap

    gen = _gen(tiny_llama_dir)
    pays, why = swap.swap_pays(gen)
    assert "FLOP per KV byte" in why and "CPU" in why
    # The tiny model's recompute intensity (layer parameters per KV byte) is low; a CPU's
    # balance is lower still, a GPU's far higher.
    params = sum(p.numel() for p in gen.model.model.layers.parameters())
    intensity = params / gen.kv_bytes_per_token()
    assert pays == (intensity > swap.device_balance("cpu")[0])
    assert intensity < 989e12 / swap.PCIE5_BPS  # an H200 would recompute it
