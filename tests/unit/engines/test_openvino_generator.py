"""The openvino engine's batch generator on the tiny random Llama's fp32 IR: transformers' greedy
tokens; the hf engine's generator's seeded samples and log-probabilities token for token (the
same sampler over the same model, so any cache or position slip shows), whether sequences run
alone, together, chunked or swapped out and back; prompt log-probabilities of a full forward;
finish reasons; and a refused add (or a scheduler's preemption) that leaves every block free."""

from __future__ import annotations

import pytest
import torch

from llmopt.core.errors import LlmoptError
from llmopt.core.recipes import get_recipe
from llmopt.engines import get_engine, served_by_llmopt
from llmopt.engines.generation import BatchGenerator, GeneratorSpec, OutOfBlocks, SamplingParams
from llmopt.model.info import inspect_model

from ..serve.engine.test_faults import _drive

pytest.importorskip("openvino")
pytest.importorskip("nncf")

PROMPTS = {
    "a": [100, 3, 250, 17, 64, 64, 9, 140, 31, 77, 201, 12, 45, 88, 160, 2, 230, 111, 59, 70],
    "b": [5, 80, 120, 33, 7, 200, 18],
    "c": [65, 66, 67],
}
# Sampled at temperature 1 with a seed: the tokens vary (the random model's greedy choice
# repeats the last token), and both generators draw from the same seeded torch generator.
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def ir(tmp_path_factory, _tiny_llama_master):
    out = tmp_path_factory.mktemp("openvino-gen") / "fp32"
    out.mkdir()
    info = inspect_model(_tiny_llama_master)
    get_engine("openvino").build(_tiny_llama_master, info, get_recipe("fp32"), out)
    return _tiny_llama_master, out


def _gen(folder, engine="openvino", **kw):
    spec = GeneratorSpec(model=str(folder), engine=engine, settings={"threads": 1}, **kw)
    return get_engine(engine).load_generator(spec)


def _run(gen, prompts: dict, params: SamplingParams, budget: int | None = None) -> dict:
    for k, p in prompts.items():
        gen.add(k, p, params)
    out: dict = {k: [] for k in prompts}
    while any(not gen.finished(k) for k in prompts):
        for ev in gen.step(prefill_budget=budget):
            out[ev.seq_id].append(ev)
    for k in prompts:
        gen.remove(k)
    return out


def _tokens(events: dict) -> dict:
    return {k: [e.token_id for e in v] for k, v in events.items()}


def test_the_engine_serves_causal_lms():
    assert get_engine("openvino").batching and served_by_llmopt("openvino")


def test_greedy_tokens_match_transformers(ir):
    from transformers import AutoModelForCausalLM

    src, art = ir
    gen = _gen(art)
    assert isinstance(gen, BatchGenerator)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    want = {}
    for k, p in PROMPTS.items():
        x = torch.tensor([p])
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False
        )
        want[k] = out[0, len(p) :].tolist()
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    assert _tokens(_run(gen, {"a": PROMPTS["a"]}, greedy)) == {"a": want["a"]}
    assert _tokens(_run(gen, PROMPTS, greedy)) == want
    assert gen.free_blocks == gen.num_blocks - 1


def test_sampled_tokens_and_logprobs_are_the_hf_generators(ir):
    src, art = ir
    ref = _run(_gen(src, "hf"), PROMPTS, SAMPLED)
    assert len(set(_tokens(ref)["a"])) > 3  # the seeded draws vary: a slip would show
    gen = _gen(art, max_batch=3)
    for budget in (None, 5):  # whole prompts in one step; prompts in chunks of <= 5 tokens
        alone = {k: _run(gen, {k: p}, SAMPLED, budget)[k] for k, p in PROMPTS.items()}
        together = _run(gen, PROMPTS, SAMPLED, budget)
        for got in (alone, together):
            assert _tokens(got) == _tokens(ref)
            for k in PROMPTS:
                for e, r in zip(got[k], ref[k], strict=True):
                    assert e.logprob == pytest.approx(r.logprob, abs=1e-4)
                    assert [t for t, _ in e.top_logprobs] == [t for t, _ in r.top_logprobs]
    assert gen.free_blocks == gen.num_blocks - 1 and not gen.running
    assert len(gen._idle) == 3  # a request per sequence, reset and kept for the next one


def test_swap_out_and_in_continues_exactly(ir):
    src, art = ir
    want = _tokens(_run(_gen(src, "hf"), {"a": PROMPTS["a"]}, SAMPLED))["a"]
    gen = _gen(art, max_batch=2)
    gen.add("a", PROMPTS["a"], SAMPLED)
    got = [ev.token_id for ev in gen.step()] + [ev.token_id for ev in gen.step()]
    held = len(gen.blocks_of("a"))
    swapped = gen.swap_out("a")
    assert swapped.num_blocks == held and gen.free_blocks == gen.num_blocks - 1
    # The cache really left the plugin: the prompt and the first sampled token (the second is
    # not in the cache until the next step), keys and values in float32 on the host.
    assert swapped.nbytes == (len(PROMPTS["a"]) + 1) * gen.kv_bytes_per_token()
    gen.add("c", PROMPTS["c"], SAMPLED)  # another sequence uses the freed request meanwhile
    gen.step()
    gen.swap_in("a", swapped)
    while not gen.finished("a"):
        got += [ev.token_id for ev in gen.step() if ev.seq_id == "a"]
    assert got == want


def test_a_failed_swap_in_holds_nothing(ir):
    """swap_in is all or nothing, as add: when setting the state fails (here a state the host
    copy lacks), the blocks and the infer request go back, and the sequence comes back later."""
    src, art = ir
    want = _tokens(_run(_gen(src, "hf"), {"a": PROMPTS["a"]}, SAMPLED))["a"]
    gen = _gen(art, max_batch=2)
    gen.add("a", PROMPTS["a"], SAMPLED)
    got = [ev.token_id for ev in gen.step()] + [ev.token_id for ev in gen.step()]
    swapped = gen.swap_out("a")
    free, idle = gen.free_blocks, len(gen._idle)
    name, kept = next(iter(swapped.state.items()))
    del swapped.state[name]
    with pytest.raises(KeyError):
        gen.swap_in("a", swapped)
    assert gen.free_blocks == free and not gen.pool.tables and len(gen._idle) == idle
    swapped.state[name] = kept
    gen.swap_in("a", swapped)
    while not gen.finished("a"):
        got += [ev.token_id for ev in gen.step()]
    assert got == want


def test_prompt_logprobs_match_a_full_forward(ir):
    from transformers import AutoModelForCausalLM

    src, art = ir
    gen = _gen(art)
    prompt = PROMPTS["a"]
    gen.add("p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    events = []
    while not events:  # prefilled in chunks of 7 tokens: the log-probabilities gather across them
        events = gen.step(prefill_budget=7)
    (ev,) = events
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    assert ev.prompt_logprobs[0] is None and len(ev.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        lp, top = ev.prompt_logprobs[p]
        assert lp == pytest.approx(float(logp[p - 1, prompt[p]]), abs=1e-4)
        assert [t for t, _ in top] == logp[p - 1].topk(2).indices.tolist()


def test_finish_reasons(ir):
    _, art = ir
    gen = _gen(art)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    first = _tokens(_run(gen, {"b": PROMPTS["b"]}, greedy))["b"][0]
    stop = _run(gen, {"b": PROMPTS["b"]}, SamplingParams(max_tokens=10, stop_token_ids=(first,)))
    assert [(e.token_id, e.finish_reason) for e in stop["b"]] == [(first, "stop")]
    gen.eos_ids = {first}  # the model's EOS ends it too, unless ignore_eos
    assert _run(gen, {"b": PROMPTS["b"]}, SamplingParams(max_tokens=10))["b"][-1].finish_reason == (
        "stop"
    )
    length = _run(gen, {"b": PROMPTS["b"]}, SamplingParams(max_tokens=4, ignore_eos=True))["b"]
    assert [e.finish_reason for e in length] == [None, None, None, "length"]


def test_a_refused_add_holds_nothing(ir):
    _, art = ir
    gen = _gen(art, block_size=4, num_blocks=8, max_batch=2)  # 7 usable blocks
    free = gen.free_blocks
    refused = [
        ([1, 2, 10**6], SamplingParams(max_tokens=2), "vocabulary"),
        ([1, -1], SamplingParams(max_tokens=2), "vocabulary"),
        ([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.5, seed=2**64), "seed"),
        ([1, 2, 3], SamplingParams(max_tokens=2, logprobs=10**6), "logprobs"),
        (list(range(1, 120)), SamplingParams(max_tokens=20), "exceeds the context"),
    ]
    for prompt, params, why in refused:
        with pytest.raises(ValueError, match=why):
            gen.add("x", prompt, params)
        assert gen.free_blocks == free and not gen.running and not gen.pool.tables
    with pytest.raises(OutOfBlocks):
        gen.add("x", list(range(1, 40)), SamplingParams(max_tokens=2))  # 10 blocks: 7 free
    assert gen.free_blocks == free and not gen.running and not gen._idle


def test_the_scheduler_preempts_and_swaps_it_leaking_nothing(ir):
    from llmopt.serve.engine.scheduler import Scheduler, Sequence

    src, art = ir
    want = _tokens(_run(_gen(src, "hf"), PROMPTS, SAMPLED))
    # Room for about two of the three sequences: the scheduler must preempt, by swap first.
    gen = _gen(art, block_size=4, num_blocks=12, max_batch=3)
    sched = Scheduler(gen, 3, 256, swap_space_bytes=2**20, swap_pays=True)
    for i, k in enumerate(PROMPTS):
        sched.submit(Sequence(i, PROMPTS[k], SAMPLED))
    got: dict = {}
    for _ in range(500):
        if not sched.has_work():
            break
        for seq, ev in sched.step():
            got.setdefault(seq.seq_id, []).append(ev.token_id)
    assert sched.preemptions_total > 0 and sched.swaps_total > 0
    assert {k: got[i] for i, k in enumerate(PROMPTS)} == want
    assert sched.check_invariants() == [] and gen.free_blocks == gen.num_blocks - 1


def test_what_it_refuses_to_load(ir, tmp_path):
    src, art = ir
    with pytest.raises(LlmoptError, match="not an openvino causal-LM artifact"):
        _gen(src)  # an HF folder: nothing the engine built
    with pytest.raises(LlmoptError, match="on the CPU"):
        _gen(art, device="cuda")


def test_a_nan_sequence_fails_alone(tiny_llama_nan_dir, tmp_path):
    """A real NaN forward in the plugin (the tiny Llama with token 5's embedding NaN, built as
    an IR) in a batch of three: that sequence alone ends with a SequenceFault, the others get
    the tokens they get without it, and the infer request it leaves (reset, then reused by the
    next sequences) poisons no one."""
    from llmopt.serve.engine.scheduler import Scheduler, Sequence, SequenceFault

    art = tmp_path / "nan-ir"
    art.mkdir()
    info = inspect_model(tiny_llama_nan_dir)
    get_engine("openvino").build(tiny_llama_nan_dir, info, get_recipe("fp32"), art)
    gen = _gen(art, block_size=4, max_batch=3)
    sched = Scheduler(gen, 3, 256)
    a, b = [3, 4, 6, 7, 8], [9, 10]
    for i, prompt in ((1, a), (2, b)):
        sched.submit(Sequence(i, prompt, SAMPLED))
    clean = _drive(sched)
    for i, prompt in ((11, a), (12, [9, 10, 5, 11, 12]), (13, b)):
        sched.submit(Sequence(i, prompt, SAMPLED))
    mixed = _drive(sched)
    assert len(mixed[12]) == 1 and isinstance(mixed[12][0], SequenceFault)
    assert mixed[11] == clean[1] and mixed[13] == clean[2]
    for i, prompt in ((21, a), (22, b), (23, [9, 10])):  # three: the faulty one's request too
        sched.submit(Sequence(i, prompt, SAMPLED))
    after = _drive(sched)
    assert after[21] == clean[1] and after[22] == clean[2] and after[23] == clean[2]
    assert sched.check_invariants() == [] and gen.free_blocks == sched.capacity_blocks
