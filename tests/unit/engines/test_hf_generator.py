"""The hf engine's batch generator: transformers' own greedy tokens, for an architecture the
native engine refuses (GPT-2) and one it runs (Llama), whether sequences run alone, together,
chunked or swapped out and back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from llmopt.engines import get_engine
from llmopt.engines.generation import BatchGenerator, GeneratorSpec, OutOfBlocks, SamplingParams
from llmopt.engines.hf_generator import HFGenerator
from llmopt.engines.native.config import native_refusal
from llmopt.engines.torch_hf import load_hf_generator

from ..serve.engine.test_faults import _drive


@pytest.fixture
def tiny_gpt2_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A tiny random GPT-2 (learned positions, Conv1D projections, LayerNorm, GELU): an
    architecture the native engine does not implement, with the tiny Llama's tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    out = tmp_path / "tiny-gpt2"
    config = GPT2Config(
        vocab_size=264, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=257
    )
    config.eos_token_id = 258
    torch.manual_seed(0)
    GPT2LMHeadModel(config).eval().save_pretrained(out)
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy2(f, out / f.name)
    return out


def _reference(folder: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, min_new_tokens=n
    )
    return out[0, len(prompt) :].tolist()


def _run(gen: HFGenerator, prompts: dict, n: int, budget: int | None = None) -> dict:
    for k, p in prompts.items():
        gen.add(k, p, SamplingParams(max_tokens=n, ignore_eos=True))
    out: dict = {k: [] for k in prompts}
    while any(not gen.finished(k) for k in prompts):
        for ev in gen.step(prefill_budget=budget):
            out[ev.seq_id].append(ev.token_id)
    for k in prompts:
        gen.remove(k)
    return out


PROMPTS = {"a": list(range(40, 60)), "b": list(range(100, 107)), "c": [65, 66, 67]}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_tokens_match_transformers(family, tiny_gpt2_dir, tiny_llama_dir):
    folder = tiny_gpt2_dir if family == "gpt2" else tiny_llama_dir
    assert (native_refusal(folder) is not None) == (family == "gpt2")
    gen = get_engine("hf").load_generator(GeneratorSpec(model=str(folder), engine="hf"))
    assert isinstance(gen, BatchGenerator)
    want = {k: _reference(folder, p, 12) for k, p in PROMPTS.items()}
    assert _run(gen, {"a": PROMPTS["a"]}, 12) == {"a": want["a"]}  # alone
    assert _run(gen, PROMPTS, 12) == want  # together, joining in one step
    assert _run(gen, PROMPTS, 12, budget=5) == want  # prompts prefilled in chunks of <= 5
    assert gen.free_blocks == gen.num_blocks - 1  # every block back


def test_swap_out_and_in_continues_exactly(tiny_gpt2_dir):
    gen = load_hf_generator(tiny_gpt2_dir, max_batch=2)
    want = _reference(tiny_gpt2_dir, PROMPTS["a"], 10)
    gen.add("a", PROMPTS["a"], SamplingParams(max_tokens=10, ignore_eos=True))
    got = [ev.token_id for ev in gen.step()] + [ev.token_id for ev in gen.step()]
    held = len(gen.blocks_of("a"))
    swapped = gen.swap_out("a")
    assert swapped.num_blocks == held and swapped.nbytes > 0
    assert gen.free_blocks == gen.num_blocks - 1
    gen.swap_in("a", swapped)
    while not gen.finished("a"):
        got += [ev.token_id for ev in gen.step()]
    assert got == want


class _Unmovable:
    """A cache whose tensors cannot be moved (as when the device is out of memory)."""

    @property
    def layers(self):
        raise RuntimeError("out of memory (injected)")


def test_a_failed_swap_in_holds_nothing(tiny_gpt2_dir):
    """swap_in is all or nothing, as add: when moving the cache back fails, the blocks it took
    are free again, and the same swapped sequence comes back later and continues exactly."""
    gen = load_hf_generator(tiny_gpt2_dir, max_batch=2)
    want = _reference(tiny_gpt2_dir, PROMPTS["a"], 10)
    gen.add("a", PROMPTS["a"], SamplingParams(max_tokens=10, ignore_eos=True))
    got = [ev.token_id for ev in gen.step()] + [ev.token_id for ev in gen.step()]
    swapped = gen.swap_out("a")
    free, cache = gen.free_blocks, swapped.seq.cache
    swapped.seq.cache = _Unmovable()
    with pytest.raises(RuntimeError, match="injected"):
        gen.swap_in("a", swapped)
    assert gen.free_blocks == free and not gen.pool.tables and not gen.running
    swapped.seq.cache = cache
    gen.swap_in("a", swapped)
    while not gen.finished("a"):
        got += [ev.token_id for ev in gen.step()]
    assert got == want


def test_block_account_limits_admission_and_growth(tiny_gpt2_dir):
    gen = load_hf_generator(tiny_gpt2_dir, max_batch=4, block_size=4, num_blocks=6)  # 5 usable
    gen.add("a", list(range(40, 56)), SamplingParams(max_tokens=8, ignore_eos=True))  # 4 blocks
    with pytest.raises(OutOfBlocks):
        gen.add("b", list(range(40, 50)), SamplingParams(max_tokens=2))  # 3 more: 1 free
    gen.step()  # prefill: token 17 is sampled; the next decode writes position 16 -> block 5
    gen.step()
    assert gen.free_blocks == 0
    gen.step()
    gen.step()
    gen.step()  # positions 17..19 still fit block 5; position 20 needs a sixth
    with pytest.raises(OutOfBlocks) as e:
        gen.step()
    assert e.value.seq_ids == ["a"]


def test_prompt_logprobs_match_a_full_forward(tiny_gpt2_dir):
    from transformers import AutoModelForCausalLM

    gen = load_hf_generator(tiny_gpt2_dir)
    prompt = PROMPTS["a"]
    gen.add("p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    events = []
    while not events:  # prefilled in chunks of 7 tokens: the log-probabilities gather across them
        events = gen.step(prefill_budget=7)
    (ev,) = events
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    assert ev.prompt_logprobs[0] is None and len(ev.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        lp, top = ev.prompt_logprobs[p]
        assert lp == pytest.approx(float(logp[p - 1, prompt[p]]), abs=1e-4)
        assert [t for t, _ in top] == logp[p - 1].topk(2).indices.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_tokens_match_and_swap_goes_through_host_memory(tiny_gpt2_dir):
    from transformers import AutoModelForCausalLM

    gen = load_hf_generator(tiny_gpt2_dir, "fp32", "cuda", max_batch=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, dtype=torch.float32).cuda()
    x = torch.tensor([PROMPTS["a"]], device="cuda")
    want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)
    want = want[0, x.shape[1] :].tolist()
    assert _run(gen, PROMPTS, 10)["a"] == want
    gen.add("a", PROMPTS["a"], SamplingParams(max_tokens=10, ignore_eos=True))
    got = [ev.token_id for ev in gen.step()] + [ev.token_id for ev in gen.step()]
    swapped = gen.swap_out("a")
    layer = swapped.seq.cache.layers[0]
    assert layer.keys.device.type == "cpu"  # really moved off the GPU
    gen.swap_in("a", swapped)
    assert layer.keys.device.type == "cuda"
    while not gen.finished("a"):
        got += [ev.token_id for ev in gen.step()]
    assert got == want
    bf16 = load_hf_generator(tiny_gpt2_dir, "bf16", "cuda")
    assert len(_run(bf16, {"a": PROMPTS["a"]}, 10)["a"]) == 10


# -- admission is a transaction; a fault in one sequence fails it alone (issue 21) --------------
def test_a_refused_add_holds_nothing(tiny_gpt2_dir):
    """What would fail later is refused by `add` before it takes a block: an id past the
    model's embedding (its forward raised IndexError in the step, failing every sequence in
    it), a seed a random generator cannot take, sampling parameters out of range."""
    gen = load_hf_generator(tiny_gpt2_dir, max_batch=2, block_size=4, num_blocks=8)
    free = gen.free_blocks
    assert gen.vocab_size == 264
    refused = [
        ([1, 2, 264], SamplingParams(max_tokens=2), "vocabulary"),
        ([1, -1], SamplingParams(max_tokens=2), "vocabulary"),
        ([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.5, seed=2**64), "seed"),
        ([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.5, seed=-(2**63) - 1), "seed"),
        ([1, 2, 3], SamplingParams(max_tokens=2, logprobs=10**6), "logprobs"),
        ([1, 2, 3], SamplingParams(max_tokens=2, temperature=float("nan")), "temperature"),
        ([1, 2, 3], SamplingParams(max_tokens=2, top_p=0.0), "top_p"),
        (list(range(1, 120)), SamplingParams(max_tokens=20), "exceeds the context"),
    ]
    for prompt, params, why in refused:
        with pytest.raises(ValueError, match=why):
            gen.add("x", prompt, params)
        assert gen.free_blocks == free and not gen.running and not gen.pool.tables


def test_a_bad_request_fails_alone_under_the_scheduler(tiny_gpt2_dir):
    """A request with an id past the embedding, beside two good ones: it is refused (a 400 at
    the API), the others get transformers' tokens (one of them at temperature 1e-40, which
    overflowed the logits to inf: below the floor it is greedy), and every block comes back."""
    from llmopt.serve.engine.scheduler import Scheduler, Sequence

    gen = load_hf_generator(tiny_gpt2_dir, max_batch=4)
    want = {k: _reference(tiny_gpt2_dir, PROMPTS[k], 6) for k in ("a", "c")}
    sched = Scheduler(gen, 4, 256)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    sched.submit(Sequence(1, PROMPTS["a"], greedy))
    sched.submit(Sequence(2, [40, 41, 300], greedy))
    tiny = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1e-40, seed=1)
    sched.submit(Sequence(3, PROMPTS["c"], tiny))
    out = _drive(sched)
    assert isinstance(out[2][0], ValueError) and len(out[2]) == 1
    assert out[1] == want["a"] and out[3] == want["c"]
    assert sched.check_invariants() == [] and gen.free_blocks == sched.capacity_blocks


def test_a_nan_sequence_fails_alone(tiny_llama_nan_dir):
    """A real NaN forward (token 5's embedding is NaN) in a batch of three: that sequence ends
    with a SequenceFault after its prefill, the others get the tokens they get without it, and
    the next sequences are clean (each sequence has a cache of its own: nothing to scrub)."""
    from llmopt.serve.engine.scheduler import Scheduler, Sequence, SequenceFault

    gen = load_hf_generator(tiny_llama_nan_dir, max_batch=4, block_size=4)
    sched = Scheduler(gen, 4, 256)
    p = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    a, b = [3, 4, 6, 7, 8], [9, 10]
    for i, prompt in ((1, a), (2, b)):
        sched.submit(Sequence(i, prompt, p))
    clean = _drive(sched)
    for i, prompt in ((11, a), (12, [9, 10, 5, 11, 12]), (13, b)):
        sched.submit(Sequence(i, prompt, p))
    mixed = _drive(sched)
    assert len(mixed[12]) == 1 and isinstance(mixed[12][0], SequenceFault)
    assert "numerical fault" in str(mixed[12][0])
    assert mixed[11] == clean[1] and mixed[13] == clean[2]
    for i, prompt in ((21, a), (22, b)):
        sched.submit(Sequence(i, prompt, p))
    after = _drive(sched)
    assert after[21] == clean[1] and after[22] == clean[2]
    assert sched.check_invariants() == [] and gen.free_blocks == sched.capacity_blocks
