"""When a sequence is done: both batching engines (the native `torch` generator and the `hf`
one) end a sequence through the one shared rule (`generation.finish_reason`, applied by
`PooledGenerator.append_token`), so the same request finishes the same way on either."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmopt.engines import get_engine
from llmopt.engines.generation import GeneratorSpec, SamplingParams, finish_reason

ENGINES = ["torch", "hf"]
PROMPT = [5, 6, 7]


def _load(engine: str, folder: Path):
    return get_engine(engine).load_generator(
        GeneratorSpec(model=str(folder), engine=engine, max_batch=2)
    )


def _events(gen, prompt: list[int], params: SamplingParams) -> list:
    gen.add("s", prompt, params)
    out = []
    while not gen.finished("s"):
        out.extend(gen.step())
    gen.remove("s")
    assert gen.free_blocks == gen.num_blocks - 1  # every block back
    return out


def test_finish_reason_order_and_limits():
    p = SamplingParams(max_tokens=4, stop_token_ids=(9,))
    kw = {"max_seq_len": 10, "eos_ids": {2}}
    # A stop at the last allowed token is a stop, not a length cut.
    assert finish_reason(9, p, generated=4, total=8, **kw) == "stop"
    assert finish_reason(3, p, generated=3, total=7, **kw) is None
    assert finish_reason(3, p, generated=4, total=8, **kw) == "length"
    assert finish_reason(3, p, generated=2, total=10, **kw) == "length"  # the context is full
    ignore = SamplingParams(max_tokens=4, stop_token_ids=(9,), ignore_eos=True)
    assert finish_reason(2, ignore, generated=1, total=5, **kw) is None
    assert finish_reason(9, ignore, generated=1, total=5, **kw) == "stop"  # stop ids still stop


@pytest.mark.parametrize("engine", ENGINES)
def test_length_stop_tokens_and_eos(engine, tiny_llama_dir):
    gen = _load(engine, tiny_llama_dir)
    assert gen.tokenizer.eos_token_id in gen.eos_ids
    full = _events(gen, PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
    greedy = [e.token_id for e in full]
    assert [e.finish_reason for e in full] == [None] * 5 + ["length"]
    stop = greedy[2]
    cut = greedy[: greedy.index(stop) + 1]
    got = _events(gen, PROMPT, SamplingParams(max_tokens=6, stop_token_ids=(stop,)))
    assert [e.token_id for e in got] == cut and got[-1].finish_reason == "stop"
    gen.eos_ids = {stop}  # the model's EOS, as if it had declared this id
    got = _events(gen, PROMPT, SamplingParams(max_tokens=6))
    assert [e.token_id for e in got] == cut and got[-1].finish_reason == "stop"
    got = _events(gen, PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [e.token_id for e in got] == greedy and got[-1].finish_reason == "length"


@pytest.mark.parametrize("engine", ENGINES)
def test_numerical_fault_ends_that_sequence_with_an_error(engine, tiny_llama_nan_dir):
    gen = _load(engine, tiny_llama_nan_dir)
    (ev,) = _events(gen, [9, 5, 7], SamplingParams(max_tokens=6, ignore_eos=True))  # 5: NaN
    assert (ev.token_id, ev.finish_reason) == (-1, "error") and "numerical fault" in ev.error
    ok = _events(gen, [9, 8, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [e.finish_reason for e in ok] == [None, None, "length"]
