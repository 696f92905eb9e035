"""Local (sliding-window) layers holding only their window: a ring of blocks per sequence in a
pool of their own, checked against transformers on a tiny Gemma-3-style model (5 local layers
of window 8, 1 global) over sequences several windows long."""

from __future__ import annotations

import torch

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
