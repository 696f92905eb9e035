"""The engine boundary: the generation protocol, the KV block pool, seeded sampling, the one way
runners load (with its legacy rule), and the engine clients the API layer sees."""

from __future__ import annotations

import inspect
import logging
import pickle
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine, load_runner  # noqa: E402
from llmopt.engines.generation import (  # noqa: E402
    BatchGenerator,
    GeneratorSpec,
    OutOfBlocks,
    SamplingParams,
)
from llmopt.engines.native.blocks import BlockPool  # noqa: E402
from llmopt.engines.native.sampling import make_rng, sample_rows  # noqa: E402


# -- the block pool ---------------------------------------------------------------------------
def test_block_pool_allocates_low_ids_first_and_frees_them_back():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.free == 5 and pool.blocks_needed(9) == 3  # block 0 is scratch
    assert pool.allocate("a", 3) == [1, 2, 3]
    assert pool.allocate("b", 1) == [4] and pool.free == 1
    pool.grow(["b"])
    assert pool.table("b") == [4, 5] and pool.free == 0
    assert pool.release("a") == [1, 2, 3] and pool.free == 3
    assert pool.allocate("c", 2) == [1, 2]  # the freed blocks come back lowest first
    got = pool.take(1)
    pool.give_back(got)
    assert pool.free == 1 and 0 not in {b for t in pool.tables.values() for b in t}


def test_block_pool_out_of_blocks_takes_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate("a", 2)
    with pytest.raises(OutOfBlocks, match="prompt needs 2 KV blocks, 1 free"):
        pool.allocate("b", 2, "prompt needs")
    assert pool.free == 1 and "b" not in pool.tables
    pool.allocate("c", 1)
    with pytest.raises(OutOfBlocks) as err:
        pool.grow(["a", "c"])  # all or none, and it names who needed a block
    assert err.value.seq_ids == ["a", "c"] and pool.table("a") == [1, 2]


# -- sampling ---------------------------------------------------------------------------------
def test_seeded_sampling_repeats_and_ignores_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11, logprobs=2),
        SamplingParams(temperature=1.3, seed=5),
        SamplingParams(),
    ]

    def draw(rows):
        out = []
        rngs = [make_rng(params[i], logits.device) for i in rows]
        for _ in range(5):
            out.append(sample_rows(logits[rows], [params[i] for i in rows], rngs))
        return out

    first, again = draw([0, 1, 2]), draw([0, 1, 2])
    assert first == again  # same seeds, same tokens (and logprobs)
    alone = draw([0])
    assert [step[0] for step in first] == [step[0] for step in alone]
    assert make_rng(params[2], logits.device) is None  # greedy needs no generator
    assert all(step[2][0] == int(torch.argmax(logits[2])) for step in first)


def test_generator_seeded_generation_is_reproducible(tiny_llama_dir):
    from llmopt.engines.native import load_generator

    gen = load_generator(tiny_llama_dir, max_batch=2, max_seq_len=64, block_size=4)
    p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=123, ignore_eos=True)
    a, _ = gen.generate([5, 6, 7], p)
    b, _ = gen.generate([5, 6, 7], p)
    assert a == b and gen.free_blocks == gen.num_blocks - 1


# -- the generation protocol and the engines' batching capability ------------------------------
def test_generator_spec_pickles_and_the_native_engine_batches(tiny_llama_dir):
    spec = GeneratorSpec(
        model=tiny_llama_dir, max_batch=2, block_size=4, max_seq_len=64, batch_sizes=[1, 2]
    )
    assert pickle.loads(pickle.dumps(spec)) == spec and spec.batch_sizes == (1, 2)
    engine = get_engine(spec.engine)
    assert engine.batching
    gen = engine.load_generator(spec)
    assert isinstance(gen, BatchGenerator)
    assert gen.block_size == 4 and gen.max_seq_len == 64 and gen.batch_sizes == [1, 2]
    gen.add("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2))
    assert gen.blocks_of("a") == [1, 2] and gen.layer_parameters() > 0


def test_an_engine_without_batching_says_so():
    ort = get_engine("onnxruntime")  # runs embedders: no generator to serve causal LMs with
    assert not ort.batching
    with pytest.raises(NotImplementedError, match="no batching generator"):
        ort.load_generator(GeneratorSpec(model="x"))


# -- load_runner ------------------------------------------------------------------------------
def test_load_runner_loads_old_embedding_runs_with_hf(monkeypatch, tmp_path):
    calls = []

    def fake_load(name):
        return lambda artifact, info, recipe, settings: (
            calls.append((name, recipe.name, settings)) or name
        )

    for name in ("hf", "torch"):
        monkeypatch.setattr(get_engine(name), "load", fake_load(name))
    # The warning is read from a handler on the module's own logger: earlier tests in the same
    # process (servers, Ray) may have reconfigured the root logger or disabled existing ones.
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # type: ignore[method-assign]
    log = logging.getLogger("llmopt.engines")
    monkeypatch.setattr(log, "disabled", False)
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        embedder = SimpleNamespace(task="embedding")
        assert load_runner("torch", tmp_path, embedder, "fp32", {"threads": 2}) == "hf"
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert calls == [("hf", "fp32", EngineSettings(threads=2))]  # a dict is typed on the way
    assert any("does not embed" in r.getMessage() for r in warnings)
    # A causal LM stays on the engine named, and a Recipe object works as well as its name.
    from llmopt.core.recipes import get_recipe

    lm = SimpleNamespace(task="causal-lm")
    assert load_runner("torch", tmp_path, lm, get_recipe("bf16")) == "torch"
    assert calls[-1] == ("torch", "bf16", EngineSettings())


# -- the API layer's engine clients -----------------------------------------------------------
def test_engine_loop_and_process_are_engine_clients(tiny_llama_dir):
    from llmopt.engines.native import load_generator
    from llmopt.serve.engine.client import EngineClient
    from llmopt.serve.engine.loop import EngineLoop
    from llmopt.serve.engine.process import EngineProcess
    from llmopt.serve.metrics import ServeMetrics

    pytest.importorskip("prometheus_client")
    gen = load_generator(tiny_llama_dir, max_batch=2, max_seq_len=64, block_size=4)
    loop = EngineLoop(gen, 2, 64, ServeMetrics())
    assert isinstance(loop, EngineClient)
    # EngineProcess starts a child in __init__: check its shape structurally instead.
    members = [n for n in dir(EngineClient) if not n.startswith("_")] + ["error"]
    init = inspect.getsource(EngineProcess.__init__)
    for name in members:
        assert hasattr(EngineProcess, name) or re.search(rf"self\.{name}\b[^=\n]*=", init), name
    for name in ("submit", "abort", "start", "stop", "describe"):
        want = inspect.signature(getattr(EngineClient, name)).parameters
        assert list(inspect.signature(getattr(EngineProcess, name)).parameters) == list(want)
        assert list(inspect.signature(getattr(EngineLoop, name)).parameters) == list(want)
