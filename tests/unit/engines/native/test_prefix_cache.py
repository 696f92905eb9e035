"""Prefix caching in the native engine: the block pool's reference counts, registered blocks and
eviction (`BlockPool`), and the generator reusing the KV blocks of shared prompt prefixes over
the tiny random Llama: the same greedy tokens and log-probabilities as without the cache, fewer
prompt tokens computed, and the pool's books right after any mix of add, step, remove, swap."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from llmopt.engines.generation import OutOfBlocks, SamplingParams  # noqa: E402
from llmopt.engines.native import load_generator  # noqa: E402
from llmopt.engines.native.blocks import BlockPool, block_hashes  # noqa: E402


def _gen(folder, **kw):
    kw = {"max_batch": 4, "block_size": 4, "num_blocks": 64, "max_seq_len": 96} | kw
    return load_generator(str(folder), recipe="fp32", device="cpu", **kw)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


SHARED = [(7 * i + 3) % 250 + 1 for i in range(42)]  # a 42-token prefix: 10 full blocks of 4
OTHER = [(5 * i + 1) % 250 + 1 for i in range(42)]
TAILS = [[11, 12, 13], [21, 22, 23, 24, 25], [31], [41, 42, 43, 44, 45, 46, 47]]


# -- the pool alone ---------------------------------------------------------------------------
def test_pool_shares_registered_blocks_and_evicts_lru():
    pool = BlockPool(num_blocks=7, block_size=2, caching=True)  # 6 usable
    a = pool.allocate("a", 3)
    hashes = block_hashes([1, 2, 3, 4, 5, 6], 2)
    for b, h in zip(a, hashes, strict=True):
        assert pool.register(b, h)
    assert pool.match(hashes) == a and pool.match(block_hashes([1, 2, 9, 9], 2)) == a[:1]
    b = pool.allocate("b", 3, cached=a[:2])  # shares two, one of its own
    assert b[:2] == a[:2] and b[2] not in a and pool.free == 2
    assert [pool.refs(x) for x in a] == [2, 2, 1]
    assert not pool.register(b[2], hashes[2])  # a's block holds those tokens already
    pool.release("a")
    assert pool.free == 3 and pool.cached_blocks == 3  # a's own third block: evictable
    assert pool.check() == []
    pool.release("b")
    assert pool.free == 6 and pool.check() == []
    # Free blocks never used go first, then the registered ones, the chain's tail first.
    got = pool.take(4)
    assert got[:3] == [b[2], 5, 6] and got[3] == a[2] and pool.cached_blocks == 2
    assert pool.match(hashes) == a[:2]  # the tail's hash is gone, the head still matches
    pool.give_back(got)
    c = pool.allocate("c", 2, cached=pool.match(hashes))  # revives evictable blocks
    assert c == a[:2] and pool.free == 4 and pool.check() == []
    with pytest.raises(OutOfBlocks):
        pool.allocate("d", 7)
    assert "d" not in pool.tables and pool.check() == []


def test_pool_without_caching_registers_nothing():
    pool = BlockPool(num_blocks=5, block_size=2)
    a = pool.allocate("a", 2)
    assert not pool.register(a[0], block_hashes([1, 2], 2)[0])
    assert pool.match(block_hashes([1, 2], 2)) == []
    pool.release("a")
    assert pool.allocate("b", 2) == a  # the same blocks again, as before prefix caching


def test_uncache_frees_evictable_and_forgets_held():
    pool = BlockPool(num_blocks=5, block_size=2, caching=True)
    a = pool.allocate("a", 2)
    for b, h in zip(a, block_hashes([1, 2, 3, 4], 2), strict=True):
        pool.register(b, h)
    pool.allocate("b", 1, cached=a[:1])
    pool.release("a")  # a[0] still held by b, a[1] evictable
    pool.uncache(a)
    assert pool.cached_blocks == 0 and pool.free == 3 and pool.check() == []
    pool.release("b")
    assert pool.free == 4 and pool.check() == []


# -- the generator ----------------------------------------------------------------------------
def _run_alone(gen, key, prompt, params) -> tuple[list[int], list[float]]:
    gen.add(key, prompt, params)
    toks, lps = [], []
    while not gen.finished(key):
        for ev in gen.step():
            if ev.seq_id == key:
                toks.append(ev.token_id)
                lps.append(ev.logprob)
    gen.remove(key)
    return toks, lps


def test_shared_prefix_same_output_fewer_prefill_tokens(tiny_llama_dir):
    off, on = _gen(tiny_llama_dir), _gen(tiny_llama_dir, prefix_caching=True)
    assert not off.prefix_caching and on.prefix_caching and on.pool.caching
    prompts = [SHARED + t for t in TAILS[:2]]
    want = [_run_alone(off, i, p, _greedy(8, logprobs=2)) for i, p in enumerate(prompts)]
    before = on.time.prefill_tokens
    got = [_run_alone(on, i, p, _greedy(8, logprobs=2)) for i, p in enumerate(prompts)]
    # The first computes its whole prompt (45 tokens); the second finds the 10 full blocks of
    # the shared 42 tokens (and not a block of the first one's tail) and computes 7 of 47.
    assert on.time.prefill_tokens - before == len(prompts[0]) + len(prompts[1]) - 40
    assert on.prefix_cache.queries == 45 + 47 and on.prefix_cache.hits == 40
    for (t_on, lp_on), (t_off, lp_off) in zip(got, want, strict=True):
        assert t_on == t_off
        assert lp_on == pytest.approx(lp_off, abs=1e-4)
    assert on.pool.check() == [] and on.free_blocks == on.num_blocks - 1


def test_concurrent_sharing_and_the_last_prompt_block(tiny_llama_dir):
    """Sequences sharing blocks decode side by side; a prompt that is exactly a cached chain
    still computes its last block (its last token's logits), in a block of its own."""
    off, on = _gen(tiny_llama_dir), _gen(tiny_llama_dir, prefix_caching=True)
    base = SHARED[:40]  # exactly 10 blocks
    prompts = {0: base, 1: base + TAILS[0], 2: base, 3: base + TAILS[3]}
    want = {k: _run_alone(off, k, p, _greedy(10))[0] for k, p in prompts.items()}
    on.add(0, prompts[0], _greedy(10))
    out: dict[int, list[int]] = {k: [] for k in prompts}
    for ev in on.step():
        out[ev.seq_id].append(ev.token_id)
    for k in (1, 2, 3):  # while 0 decodes
        on.add(k, prompts[k], _greedy(10))
        shared = on.seqs[k].done // on.block_size
        assert on.blocks_of(k)[:shared] == on.blocks_of(0)[:shared]
        assert shared == (9 if k == 2 else 10)  # never the block of the last prompt token
        assert all(on.pool.refs(b) == 1 for b in on.blocks_of(k)[shared:])  # its own
    while not all(on.finished(k) for k in prompts):
        for ev in on.step():
            out[ev.seq_id].append(ev.token_id)
        assert on.pool.check() == []
    assert out == want
    for k in prompts:
        on.remove(k)
    assert on.free_blocks == on.num_blocks - 1 and on.pool.check() == []


def test_chunked_prefill_after_a_hit(tiny_llama_dir):
    off, on = _gen(tiny_llama_dir), _gen(tiny_llama_dir, prefix_caching=True)
    _run_alone(on, "warm", SHARED + TAILS[2], _greedy(2))
    prompt = SHARED + TAILS[3] + list(range(60, 80))  # 69 tokens, 40 cached: 29 to compute
    want = _run_alone(off, 0, prompt, _greedy(6))[0]
    on.add(0, prompt, _greedy(6))
    assert on.prefill_pending(0) == 29
    got, computed = [], on.time.prefill_tokens
    while not on.finished(0):
        got += [ev.token_id for ev in on.step(prefill_budget=8)]
    assert got == want and on.time.prefill_tokens - computed == 29


def test_prompt_logprobs_skip_the_cache(tiny_llama_dir):
    off, on = _gen(tiny_llama_dir), _gen(tiny_llama_dir, prefix_caching=True)
    _run_alone(on, "warm", SHARED + TAILS[0], _greedy(2))
    queries = on.prefix_cache.queries
    p = SamplingParams(max_tokens=1, prompt_logprobs=1)
    for gen in (off, on):
        gen.add(0, SHARED + TAILS[1], p)
    assert on.prefill_pending(0) == len(SHARED + TAILS[1])  # everything computed
    a, b = off.step()[0].prompt_logprobs, on.step()[0].prompt_logprobs
    assert on.prefix_cache.queries == queries  # not a lookup
    assert len(a) == len(b) == 47 and a[0] is None is b[0]
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x[0] == pytest.approx(y[0], abs=1e-5)


def test_recompute_after_remove_hits_decode_blocks(tiny_llama_dir):
    """Blocks filled while decoding are cached too: a sequence removed and added again with
    prompt + generated tokens (a preemption by recompute) computes only its last block."""
    gen = _gen(tiny_llama_dir, prefix_caching=True)
    gen.add(0, SHARED[:10], _greedy(20))
    while not gen.finished(0):
        gen.step()
    ids = gen.remove(0)
    assert len(ids) == 30
    gen.add(1, ids, _greedy(2))
    assert gen.prefill_pending(1) == 30 - 28  # 7 cached blocks of 4; the last one computed


def test_eviction_under_pressure_keeps_output(tiny_llama_dir):
    """A pool too small for two prompts' blocks evicts the least recently released cached
    blocks, the chain's tail first; what survives is still reused, with the same output."""
    off = _gen(tiny_llama_dir)
    on = _gen(tiny_llama_dir, num_blocks=14, prefix_caching=True)  # 13 usable blocks
    a, b = SHARED[:40] + TAILS[0], OTHER[:32] + TAILS[1]  # 13 and 11 blocks with 6 tokens out
    want = {k: _run_alone(off, k, p, _greedy(6))[0] for k, p in (("a", a), ("b", b))}
    assert _run_alone(on, "a", a, _greedy(6))[0] == want["a"]
    # 43 + 6 tokens, 48 of them written: 12 full blocks cached (3 of them filled by decoding);
    # the 13th, partial, went back to the free list.
    assert on.pool.cached_blocks == 12 and on.free_blocks == 13
    assert _run_alone(on, "b", b, _greedy(6))[0] == want["b"]  # 1 free + 10 of a's, tail first
    hits = on.prefix_cache.hits
    assert len(on.pool.match(block_hashes(a, 4))) == 2  # a's head survived
    assert _run_alone(on, "a2", a, _greedy(6))[0] == want["a"]
    assert on.prefix_cache.hits - hits == 8
    assert on.pool.check() == [] and on.free_blocks == 13


def test_faulty_sequence_leaves_the_cache(tiny_llama_nan_dir):
    """A sequence whose logits went NaN takes its blocks out of the cache; the blocks it shared
    with a healthy sequence are not scrubbed under that one."""
    gen = _gen(tiny_llama_nan_dir, prefix_caching=True)
    clean = SHARED[:40]
    assert 5 not in clean
    gen.add(0, clean, _greedy(30))
    gen.step()
    gen.add(1, clean + [5, 6, 7], _greedy(4))  # token 5 poisons its own last block only
    shared = gen.blocks_of(1)[:10]
    assert shared == gen.blocks_of(0)[:10]
    kv = gen.pool.views[0][shared].clone()
    (ev,) = [e for e in gen.step() if e.seq_id == 1]
    assert ev.finish_reason == "error"
    own = gen.blocks_of(1)[10:]
    gen.remove(1)
    assert torch.equal(gen.pool.views[0][shared], kv)  # 0 still reads them
    assert all(gen.pool.refs(b) == 0 for b in own) and gen.pool.check() == []
    # None of its blocks is offered again, the shared ones included (the fault may come from
    # them); 0 keeps reading those, and frees them, uncached, when it ends.
    assert gen.pool.match(block_hashes(clean, 4)) == [] and gen.pool.cached_blocks == 0
    gen.remove(0)
    assert gen.pool.free == gen.num_blocks - 1 and gen.pool.check() == []


def test_swap_out_and_in_keeps_refcounts(tiny_llama_dir):
    off, on = _gen(tiny_llama_dir), _gen(tiny_llama_dir, prefix_caching=True)
    prompts = [SHARED + TAILS[0], SHARED + TAILS[1]]
    want = [_run_alone(off, i, p, _greedy(12))[0] for i, p in enumerate(prompts)]
    out: dict[int, list[int]] = {0: [], 1: []}
    on.add(0, prompts[0], _greedy(12))
    for ev in on.step():
        out[ev.seq_id].append(ev.token_id)
    on.add(1, prompts[1], _greedy(12))
    for ev in on.step():
        out[ev.seq_id].append(ev.token_id)
    shared = on.blocks_of(1)[:10]
    assert all(on.pool.refs(b) == 2 for b in shared)
    swapped = on.swap_out(0)
    assert all(on.pool.refs(b) == 1 for b in shared) and on.pool.check() == []
    for ev in on.step():
        out[ev.seq_id].append(ev.token_id)
    on.swap_in(0, swapped)
    assert on.pool.check() == []
    while not all(on.finished(k) for k in (0, 1)):
        for ev in on.step():
            out[ev.seq_id].append(ev.token_id)
    assert [out[0], out[1]] == want


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "step", "step", "remove", "remove", "swap"]),
            st.integers(0, 7),
        ),
        min_size=5,
        max_size=40,
    )
)
def test_books_hold_under_any_mix(tiny_llama_dir, ops):
    """Random add / step / remove / swap-out-and-in over a pool too small for everyone: the
    reference counts match the tables, nothing is lost, and no sequence's write position ever
    lies in a block another sequence holds."""
    gen = _gen(tiny_llama_dir, num_blocks=16, max_seq_len=64, prefix_caching=True)
    bs = gen.block_size
    swapped: dict[int, object] = {}
    next_id = 0

    def step(budget):
        try:
            for ev in gen.step(prefill_budget=budget):
                if ev.finish_reason:
                    gen.remove(ev.seq_id)
        except OutOfBlocks as e:
            gen.remove(e.seq_ids[-1])

    for op, arg in ops:
        running = sorted(gen.running)
        if op == "add":
            family = SHARED if arg % 2 else OTHER  # two prefixes competing for the cache
            prompt = family[: 4 + 5 * arg] + TAILS[arg % 4]
            try:
                gen.add(next_id, prompt, _greedy(1 + arg))
                step([None, 16][arg % 2])  # prefilled (in part) now: its blocks are cached
            except OutOfBlocks:
                assert next_id not in gen.pool.tables
            except ValueError:
                pass  # batch full
            next_id += 1
        elif op == "step" and running:
            step([None, 16][arg % 2])
        elif op == "remove" and running:
            gen.remove(running[arg % len(running)])
        elif op == "swap":
            decoding = [k for k in running if gen.prefill_pending(k) == 0]
            if swapped and arg % 2:
                k, s = swapped.popitem()
                try:
                    gen.swap_in(k, s)
                except (OutOfBlocks, ValueError):
                    swapped[k] = s
            elif decoding:
                k = decoding[arg % len(decoding)]
                swapped[k] = gen.swap_out(k)
        assert gen.pool.check() == []
        for k, s in gen.seqs.items():
            table = gen.blocks_of(k)
            nxt = len(s.ids) - 1 if s.prefilled else s.done  # its next write position
            assert all(gen.pool.refs(b) == 1 for b in table[nxt // bs :])
    for k in list(gen.running):
        gen.remove(k)
    assert gen.pool.check() == [] and gen.free_blocks == gen.num_blocks - 1
