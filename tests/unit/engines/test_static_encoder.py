"""Static-shape encoder runs: bucketed, compiled, and computing what the eager encoder computes."""

from __future__ import annotations

import numpy as np
import pytest

from llmopt.core.recipes import get_recipe
from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine, load_runner
from llmopt.engines.static_encoder import StaticShapeEncoder
from llmopt.model.info import inspect_model

TEXTS = [
    "a",
    "the cat sat on the mat",
    "static shapes let a compiler specialize every kernel " * 3,
    "short one",
    "x " * 40,
]


def _runners(folder, backend="inductor"):
    info = inspect_model(folder)
    eager = load_runner("hf", folder, info, get_recipe("fp32"), EngineSettings(threads=1))
    compiled = load_runner(
        "hf", folder, info, get_recipe("fp32"), EngineSettings(threads=1, compile=True)
    )
    assert isinstance(compiled, StaticShapeEncoder)
    return eager, compiled


@pytest.mark.parametrize("fixture", ["tiny_bert_dir"])
def test_padding_to_buckets_changes_no_embedding(request, fixture):
    folder = request.getfixturevalue(fixture)
    eager, compiled = _runners(folder)
    for batch in (1, 4):  # 4: the last batch of 5 texts is filled with one row
        a = eager.embed(TEXTS, batch_size=batch)
        b = compiled.embed(TEXTS, batch_size=batch)
        np.testing.assert_allclose(b, a, atol=2e-5)
    # Only bucket shapes ran: rows = the batch size asked for, lengths from the buckets.
    assert {r for r, _ in compiled.shapes} == {1, 4}
    assert {t for _, t in compiled.shapes} <= set(compiled.buckets)


def test_hf_offers_the_compiled_embedder_on_cuda_and_opt_in_on_cpu(tiny_bert_dir, tiny_llama_dir):
    hf = get_engine("hf")
    enc = inspect_model(tiny_bert_dir)
    assert hf.settings_space(enc, get_recipe("bf16"), "cuda") == [{}, {"compile": True}]
    cpu = hf.settings_space(enc, get_recipe("fp32"), "cpu")
    assert cpu[1]["compile"] is True and "opt_in" in cpu[1]
    assert hf.settings_space(inspect_model(tiny_llama_dir), get_recipe("fp32"), "cuda") == [{}]
