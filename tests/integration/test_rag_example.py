"""examples/rag.py end to end: it starts `llmopt serve minilm-l6`, embeds through the official
client, searches a FAISS index and checks the answers against the in-process reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import llmopt

pytest.importorskip("openai")
pytest.importorskip("faiss", reason="faiss-cpu not installed (pip install faiss-cpu)")
pytest.importorskip("fastapi")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLE = Path(__file__).parents[2] / "examples" / "rag.py"


def test_rag_example_agrees_with_the_reference(tmp_path):
    from llmopt.assets import prepare_builtin

    prepare_builtin("minilm-l6")
    args = ["--corpus-size", "200", "--queries", "40", "--k", "5", "--threshold", "0.6", "--json"]
    # The llmopt under test (a checkout's src/ too), whatever folder the example runs in.
    src = str(Path(llmopt.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout)
    assert s["corpus"] == 200 and s["queries"] == 40 and s["served_model"] == "minilm-l6"
    # The server runs the reference's own weights (fp32): the same neighbours up to float noise.
    assert s["recall@5_vs_reference"] >= 0.95 and s["same_top1"] >= 0.95
    assert s["same_decision"] >= 0.95
    # The query is half of its source sentence: the reference finds it most of the time.
    assert s["hit@5"]["reference"] >= 0.8
    assert (tmp_path / "rag-server.log").is_file()
