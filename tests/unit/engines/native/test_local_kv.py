"""Local (sliding-window) layers holding only their window: a ring of blocks per sequence in a
pool of their own, checked against transformers on a tiny Gemma-3-style model (5 local layers
of window 8, 1 global) over sequences several windows long."""

from __future__ import annotations

import pytest
import torch

from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine
from llmopt.engines.generation import OutOfBlocks, SamplingParams
from llmopt.engines.native.generator import Generator
from llmopt.engines.native.weights import load_model

from .test_engine import _hf_model

BS = 4  # block size: the window of 8 spans at most 3 blocks, so a ring holds 3


def _setup(tmp_path, batch: int):
    hf = _hf_model("gemma3", tmp_path)
    native = load_model(tmp_path, "cpu", torch.float32)
    ring = native.ring_blocks(BS)
    assert ring == 3
    per_seq = 16  # global blocks: 64 tokens
    native.setup_cache(1 + batch * per_seq, BS, torch.float32, "cpu", local_blocks=1 + batch * ring)
    tables = torch.arange(1, 1 + batch * per_seq).view(batch, per_seq)
    rings = torch.arange(1, 1 + batch * ring).view(batch, ring)
    return hf, native, tables, rings


def test_prefill_and_chunks_over_the_ring_match_transformers(tmp_path):
    hf, native, tables, rings = _setup(tmp_path, 2)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids).logits
        pos = torch.arange(40).expand(2, 40)
        whole = native(ids, pos, tables, prefill=True, last_only=False, local_tables=rings)
        torch.testing.assert_close(whole, ref, atol=2e-4, rtol=1e-4)
        # A prompt in chunks: 10 tokens, then 17 (longer than the ring), then 13 one by one.
        first = native(
            ids[:, :10], pos[:, :10], tables, prefill=True, last_only=False, local_tables=rings
        )
        second = native(ids[:, 10:27], pos[:, 10:27], tables, last_only=False, local_tables=rings)
        rest = [
            native(ids[:, t : t + 1], pos[:, t : t + 1], tables, local_tables=rings)
            for t in range(27, 40)
        ]
    torch.testing.assert_close(first, ref[:, :10], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(second, ref[:, 10:27], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(rest, 1), ref[:, 27:], atol=2e-4, rtol=1e-4)


def test_right_padded_prefill_does_not_overwrite_a_short_rows_ring(tmp_path):
    hf, native, tables, rings = _setup(tmp_path, 2)
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    short = 5  # row 1 is 5 real tokens, right-padded to 30: its padding must not wrap onto them
    with torch.inference_mode():
        pos = torch.arange(30).expand(2, 30)
        last = torch.tensor([29, short - 1])
        native(ids, pos, tables, prefill=True, last_index=last, local_tables=rings)
        # Row 1 continues from its real length; its logits equal transformers' on its real ids.
        nxt = torch.tensor([[0], [7]])
        step = native(nxt, torch.tensor([[30], [short]]), tables, local_tables=rings)
        ref = hf(torch.cat([ids[1:, :short], nxt[1:]], 1)).logits[0, -1]
    torch.testing.assert_close(step[1], ref, atol=2e-4, rtol=1e-4)


def test_greedy_decode_far_past_the_window_matches_transformers(tmp_path):
    hf, native, tables, rings = _setup(tmp_path, 1)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    want = hf.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False)[0, 6:]
    got = []
    with torch.inference_mode():
        logits = native(
            prompt, torch.arange(6).view(1, 6), tables, prefill=True, local_tables=rings
        )
        for n in range(6, 46):
            tok = logits.argmax(-1)
            got.append(int(tok))
            if n < 45:
                logits = native(tok.view(1, 1), torch.tensor([[n]]), tables, local_tables=rings)
    assert got == want.tolist()
    # 46 tokens held in full by the global layer, the window's ring (12 rows + scratch) by the
    # local ones: the local layers' caches do not grow with the sequence.
    layers = native.model.layers
    assert [ly.local for ly in layers] == [True] * 5 + [False]
    assert layers[0].self_attn.k_cache.shape[0] == (1 + 3) * BS < 46
    assert layers[5].self_attn.k_cache.shape[0] == (1 + 16) * BS


# --- through the Generator: rings taken on add, given back on remove, swapped with the rest ----

GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)


def _generator(tmp_path, device="cpu", **kw):
    hf = _hf_model("gemma3", tmp_path)
    native = load_model(tmp_path, device, torch.float32)
    kw = {"max_batch": 2, "max_seq_len": 64, "block_size": BS, **kw}
    return hf, Generator(native, **kw)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (13, 5)]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, EOS included (generate's `min_new_tokens` would
    suppress it, and the generator under test does not)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def _run(gen, prompts, budget=None, check=None) -> dict:
    """Every prompt to the end, all admitted together; {index: generated ids}."""
    for i, p in enumerate(prompts):
        gen.add(i, p, GREEDY)
    while not all(gen.finished(i) for i in gen.running):
        gen.step(budget)
        if check is not None:
            check(gen)
    out = {i: gen.remove(i)[len(prompts[i]) :] for i in range(len(prompts))}
    return out


def test_generator_greedy_past_the_window_matches_transformers(tmp_path):
    hf, gen = _generator(tmp_path)
    assert gen.ring == 3 and gen.local_blocks == 2 * 3 + 1
    layers = gen.model.model.layers
    # The local layers' caches hold the rings (7 blocks), the global layer 2 x 16 + 1 blocks.
    assert layers[0].self_attn.k_cache.shape[0] == 7 * BS
    assert layers[5].self_attn.k_cache.shape[0] == (2 * 16 + 1) * BS
    for prompt in _prompts():
        got, _ = gen.generate(prompt, GREEDY)
        assert got == _hf_greedy(hf, prompt, 30)  # 30 tokens: several windows past 8
    assert gen.local_pool.free == gen.local_blocks - 1 and gen.free_blocks == gen.num_blocks - 1


def test_interleaved_sequences_equal_each_alone_and_hold_one_ring(tmp_path):
    _, gen = _generator(tmp_path)
    prompts = _prompts()
    alone = [gen.generate(p, GREEDY)[0] for p in prompts]
    seen = []

    def check(g):  # every running sequence holds exactly its ring, however long it grows
        for k in g.running:
            assert len(g.ring_of(k)) == g.ring
        assert g.local_pool.free == g.local_blocks - 1 - g.ring * len(g.running)
        seen.append(max(len(g.seqs[k].ids) for k in g.running))

    together = _run(gen, prompts, check=check)
    assert max(seen) > 3 * 8  # several windows long, still 3 local blocks each
    assert together == dict(enumerate(alone))
    # Chunked prefill (4 prompt tokens a step: the 13-token prompt in chunks past its ring).
    assert _run(gen, prompts, budget=4) == dict(enumerate(alone))
    assert gen.local_pool.free == gen.local_blocks - 1 and not gen.local_pool.tables
    assert gen.free_blocks == gen.num_blocks - 1


def test_swap_out_and_in_keeps_the_tokens(tmp_path):
    _, gen = _generator(tmp_path, max_batch=3)
    prompts = _prompts()
    alone = [gen.generate(p, GREEDY)[0] for p in prompts]
    gen.add(0, prompts[0], GREEDY)
    for _ in range(12):  # past the window: the ring has wrapped
        gen.step()
    ring = gen.ring_of(0)
    swapped = gen.swap_out(0)
    assert not gen.running and gen.local_pool.free == gen.local_blocks - 1
    assert len(swapped.local_keys) == 5 and swapped.num_blocks == len(swapped.keys[0])
    # Another sequence takes the freed ring meanwhile: sequence 0 comes back into other blocks.
    gen.add(1, prompts[1], GREEDY)
    gen.step()
    assert gen.ring_of(1) == ring
    gen.swap_in(0, swapped)
    assert gen.ring_of(0) != ring
    while not all(gen.finished(k) for k in gen.running):
        gen.step()
    assert gen.remove(0)[len(prompts[0]) :] == alone[0]
    assert gen.remove(1)[len(prompts[1]) :] == alone[1]
    assert gen.local_pool.free == gen.local_blocks - 1


def test_admission_refuses_cleanly_when_no_ring_is_free(tmp_path):
    _, gen = _generator(tmp_path, max_batch=3, local_blocks=1 + 2 * 3)  # rings for two
    prompts = _prompts()
    gen.add(0, prompts[0], GREEDY)
    gen.add(1, prompts[1], GREEDY)
    free, local = gen.free_blocks, gen.local_pool.free
    with pytest.raises(OutOfBlocks, match="ring of 3 local-layer KV blocks, 0 free"):
        gen.add(2, prompts[1], GREEDY)
    assert gen.free_blocks == free and gen.local_pool.free == local  # it holds nothing
    assert 2 not in gen.pool.tables and 2 not in gen.local_pool.tables and 2 not in gen.seqs
    with pytest.raises(KeyError):
        gen.remove(2)
    # Swapping in is refused the same way, and the swapped sequence stays whole.
    gen.step()
    swapped = gen.swap_out(0)
    gen.add(2, prompts[1], GREEDY)
    with pytest.raises(OutOfBlocks):
        gen.swap_in(0, swapped)
    assert 0 not in gen.pool.tables and 0 not in gen.local_pool.tables
    gen.remove(2)
    gen.swap_in(0, swapped)
    assert gen.ring_of(0)
    with pytest.raises(ValueError, match="local_blocks 3 holds no ring of 3 blocks"):
        _generator(tmp_path, local_blocks=3)


def test_kv_bytes_count_the_global_layers_and_the_rings_apart(tmp_path):
    _, gen = _generator(tmp_path)
    per_layer = 2 * 2 * 16 * 4  # keys and values, 2 KV heads of 16, fp32
    assert gen.kv_bytes_per_token() == 1 * per_layer  # the one global layer grows per token
    assert gen.ring_bytes() == 5 * per_layer * 3 * BS  # 5 local layers x a 3-block ring
    assert gen.kv_cache_bytes() == per_layer * BS * (1 * gen.num_blocks + 5 * gen.local_blocks)
    full = Generator(gen.model, max_batch=2, max_seq_len=64, block_size=BS, local_kv=False)
    assert full.local_pool is None and full.ring == 0
    assert full.kv_bytes_per_token() == 6 * per_layer
    assert gen.kv_cache_bytes() < full.kv_cache_bytes() / 2.5
    # A context within the ring holds no rings: the one pool, as before.
    short = Generator(gen.model, max_batch=2, max_seq_len=12, block_size=BS)
    assert short.ring == 0 and short.local_pool is None


def test_the_engine_runner_uses_rings(tmp_path):
    hf = _hf_model("gemma3", tmp_path)
    runner = get_engine("torch").load(
        tmp_path,
        None,
        get_recipe("fp32"),
        EngineSettings(device="cpu", max_batch=2, max_seq_len=64),
    )
    assert runner.gen.ring > 0
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ref = hf(ids).logits
    torch.testing.assert_close(runner.logits(ids), ref, atol=2e-4, rtol=1e-4)
    out, state = runner.prefill(ids[:, :20])
    for t in range(20, 40):
        torch.testing.assert_close(out, ref[:, t - 1], atol=2e-4, rtol=1e-4)
        out, state = runner.decode(ids[:, t : t + 1], state)
    runner._release()
    assert runner.gen.local_pool.free == runner.gen.local_blocks - 1


# The compiled paths: slow on the CPU (inductor), CUDA graphs where a GPU is present.
CPU_SLOW_OR_CUDA = [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.mark.parametrize("device", CPU_SLOW_OR_CUDA)
def test_compiled_decode_and_prefill_carry_the_rings(tmp_path, device):
    """The compiled decode step (rings packed after the block table: one more fixed-width
    field; CUDA graphs on a GPU) and the compiled prefill give the eager generator's tokens,
    and `warmup` compiles every shape a run then uses (no compile while generating)."""
    _, eager = _generator(tmp_path / "eager", device)
    prompts = _prompts()
    want = _run(eager, prompts)
    _, gen = _generator(
        tmp_path, device, compile=True, compile_prefill=True, batch_sizes=[2], min_bucket_tokens=64
    )
    gen.warmup()
    assert gen.prefill_compile_error is None
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert _run(gen, prompts) == want
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles


def test_a_faulty_sequence_s_ring_is_scrubbed_on_remove(tmp_path):
    """A sequence that ended in a numerical fault may leave NaN in its ring (and the local
    scratch block): remove zeroes them, so the next sequence on those blocks reads no NaN."""
    _, gen = _generator(tmp_path)
    prompt = _prompts()[0]
    alone, _ = gen.generate(prompt, GREEDY)
    gen.add("bad", prompt, GREEDY)
    gen.step()
    ring = gen.ring_of("bad")
    for view in gen.local_pool.views:  # what a NaN forward would have written
        view[[0, *ring]] = float("nan")
    gen.seqs["bad"].faulty = True
    gen.remove("bad")
    for view in gen.local_pool.views:
        assert not view[[0, *ring]].isnan().any()
    got, _ = gen.generate(prompt, GREEDY)  # on the same ring
    assert got == alone


def test_a_failed_swap_in_keeps_neither_blocks_nor_ring(tmp_path):
    """swap_in is all or nothing, as add: when copying the ring back fails (here a host copy of
    the wrong shape), the global blocks already taken are free again and no ring is held; the
    sequence comes back later and ends with its own tokens."""
    _, gen = _generator(tmp_path, max_batch=3)
    prompt = _prompts()[0]
    alone = gen.generate(prompt, GREEDY)[0]
    gen.add(0, prompt, GREEDY)
    for _ in range(12):
        gen.step()
    swapped = gen.swap_out(0)
    free, local, ring_keys = gen.free_blocks, gen.local_pool.free, swapped.local_keys[0]
    swapped.local_keys[0] = ring_keys[:, :1]
    with pytest.raises(RuntimeError):
        gen.swap_in(0, swapped)
    assert gen.free_blocks == free and gen.local_pool.free == local
    assert not gen.pool.tables and not gen.local_pool.tables and not gen.running
    swapped.local_keys[0] = ring_keys
    gen.swap_in(0, swapped)
    while not gen.finished(0):
        gen.step()
    assert gen.remove(0)[len(prompt) :] == alone
