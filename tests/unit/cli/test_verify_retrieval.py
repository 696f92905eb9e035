"""`llmopt verify --pairs --threshold --corpus` end to end on tiny CLS and last-token embedders:
the reference in fp32 against a real bf16 copy, through the CLI, with the FAISS index check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmopt.cli.main import app

WORDS = [
    "river",
    "stone",
    "city",
    "music",
    "paper",
    "garden",
    "window",
    "light",
    "history",
    "number",
]


def _texts(n: int, offset: int = 0) -> list[str]:
    return [
        " ".join(WORDS[(i * 7 + j * 3 + offset) % len(WORDS)] for j in range(4 + i % 5))
        for i in range(n)
    ]


def _bf16_copy(folder: Path, out: Path) -> Path:
    """The same model stored in bfloat16: a real candidate whose scores shift a little."""
    import torch
    import transformers

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    # The folder's own class, so the copy keeps its architecture (a CausalLM embedder stays one).
    model = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    for f in folder.iterdir():
        if not f.name.startswith(("model", "config.json")):
            (shutil.copytree if f.is_dir() else shutil.copyfile)(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
    return out


def _files(tmp_path: Path) -> tuple[Path, Path]:
    a, b = _texts(60), _texts(60, offset=1)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"text1": x, "text2": y, "label": int(i % 2)}) + "\n"
            for i, (x, y) in enumerate(zip(a, b, strict=True))
        )
    )
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(_texts(80, offset=2)) + "\n")
    return pairs, corpus


@pytest.mark.parametrize("fixture", ["tiny_bert_cls_dir", "tiny_last_token_dir"])
def test_verify_with_pairs_threshold_and_corpus(fixture, request, tmp_path):
    pytest.importorskip("faiss", reason="faiss-cpu not installed (pip install faiss-cpu)")
    ref = request.getfixturevalue(fixture)
    cand = _bf16_copy(ref, tmp_path / "bf16")
    pairs, corpus = _files(tmp_path)
    args = ["verify", str(ref), str(cand), "--json", "--no-attribution", "--sentences", "40"]
    args += ["--pairs", str(pairs), "--threshold", "0.8", "--corpus", str(corpus)]
    args += ["--threads", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code in (0, 1) and res.stdout.strip(), (res.output, repr(res.exception))
    data = json.loads(res.stdout)
    m = {x["name"]: x for x in data["result"]["metrics"]}
    # The threshold study ran on the user's 60 labelled pairs, and its gate is on.
    assert m["decision_agreement"]["n"] == 60 and m["recalibrated_threshold"]["reference"] == 0.8
    gate = m["recalibrated_agreement"]
    assert gate["threshold"] == 0.95 and gate["passed"] == (gate["candidate"] >= 0.95)
    assert gate["candidate"] >= m["decision_agreement"]["candidate"]
    assert "label_accuracy" in m and m["label_accuracy"]["n"] == 60
    # The FAISS check indexed the user's corpus (80 texts, each querying the others).
    idx = m["index_recall@10"]
    assert idx["n"] == 80 and 0.0 <= idx["candidate"] <= 1.0 and "user's corpus" in idx["note"]
    assert 0.0 < m["hnsw_recall@10"]["candidate"] <= 1.0
    # bf16 against fp32 is close but not identical: the cosine is measured, not assumed.
    cos = m["cosine_mean"]["candidate"]
    assert 0.9 < cos < 1.0
    assert res.exit_code == (0 if data["passed"] else 1)


def test_bad_pairs_file_is_a_clear_error(tiny_bert_cls_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "x"}\n' * 12)
    res = CliRunner().invoke(
        app, ["verify", str(tiny_bert_cls_dir), str(tiny_bert_cls_dir), "--pairs", str(bad)]
    )
    assert res.exit_code != 0
    assert "expected two texts" in str(res.exception) or "expected two texts" in res.output
    res = CliRunner().invoke(
        app, ["verify", str(tiny_bert_cls_dir), str(tiny_bert_cls_dir), "--threshold", "3"]
    )
    assert res.exit_code != 0 and "[-1, 1]" in res.output
