"""Multiple-choice JSONL scoring and the `llmopt verify` command (table, --json, exit codes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.verify.api import load_runner
from llmopt.verify.lm_eval import lm_eval_available, run_lm_eval
from llmopt.verify.tasks import accuracy, choice_logprob, load_tasks, score_tasks


def _jsonl(path: Path, rows) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


ROWS = [
    {"context": "The cat sat on the", "choices": ["mat", "quantum"], "answer": 0},
    {"question": "Water is", "choices": ["wet", "dry", "loud"], "label": 1},
    {"context": "One, two,", "choices": ["three", "banana"], "answer": 0},
]


def test_load_tasks_and_errors(tmp_path):
    items = load_tasks(_jsonl(tmp_path / "t.jsonl", ROWS))
    assert [i.answer for i in items] == [0, 1, 0] and items[1].choices == ("wet", "dry", "loud")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        load_tasks(_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"context": "x", "choices": ["a"]}]))


def test_scoring_is_log_likelihood(tiny_llama_dir, tmp_path):
    import torch

    runner = load_runner(tiny_llama_dir, threads=1)[0]
    tok = runner.tokenizer
    # By hand: log p(" mat" | "The cat sat on the") from one forward pass.
    full = tok("The cat sat on the mat", add_special_tokens=False)["input_ids"]
    n = len(full) - len(tok("The cat sat on the", add_special_tokens=False)["input_ids"])
    logp = torch.log_softmax(runner.logits(torch.tensor([full]))[0, :-1], -1)
    by_hand = logp.gather(-1, torch.tensor(full[1:])[:, None])[-n:].sum().item()
    assert choice_logprob(runner, tok, "The cat sat on the", "mat") == pytest.approx(by_hand)
    items = load_tasks(_jsonl(tmp_path / "t.jsonl", ROWS))
    acc = accuracy(items, runner, tok)
    m = score_tasks(items, runner, runner)
    assert m.reference == m.candidate == acc.mean() and m.passed and m.noise is True
    assert m.n == 3


def test_lm_eval_bridge_skips_cleanly():
    if lm_eval_available():
        pytest.skip("lm-eval installed: the bridge is exercised by its own run")
    from llmopt.core.errors import EngineUnavailableError

    with pytest.raises(EngineUnavailableError, match="pip install lm-eval"):
        run_lm_eval("a", "b", ["arc_easy"])


def _scaled_copy(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file, save_file

    out = Path(shutil.copytree(src, dst))
    state = load_file(out / "model.safetensors")
    for k in state:
        if k.startswith("model.layers.1.") and k.endswith("proj.weight"):
            state[k] = state[k] * 1.5
    save_file(state, out / "model.safetensors", {"format": "pt"})
    return out


def test_cli_json_pass_and_fail(tiny_llama_dir, tmp_path, monkeypatch):
    import llmopt.assets.text as text

    story = (
        "The river rises in the northern hills and flows south through farmland and two market "
        "towns before it reaches the sea. In the nineteenth century a canal joined it to the "
        "capital, and mills were built along its banks. "
    ) * 12
    monkeypatch.setattr(text, "evaluation_text", lambda: story)
    args = ["--windows", "4", "--window", "64", "--json"]
    ok = CliRunner().invoke(app, ["verify", str(tiny_llama_dir), str(tiny_llama_dir), *args])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert data["passed"] and data["gates"]["max_quality_drop"] == 0.01
    assert data["attribution"]["first_jump"] is None
    names = [m["name"] for m in data["result"]["metrics"]]
    assert names[:3] == ["perplexity", "top1_agreement", "kl_divergence_mean"]
    bad = _scaled_copy(tiny_llama_dir, tmp_path / "scaled")
    out = tmp_path / "report.json"
    res = CliRunner().invoke(
        app, ["verify", str(tiny_llama_dir), str(bad), *args[:-1], "--out", str(out)]
    )
    assert res.exit_code == 1
    assert "FAIL" in res.output and "first jump at model.layers.1" in res.output
    assert json.loads(out.read_text())["attribution"]["first_jump_name"] == "model.layers.1"


def test_cli_needs_a_candidate():
    res = CliRunner().invoke(app, ["verify", "smollm2-135m"])
    assert res.exit_code != 0 and "CANDIDATE" in str(res.exception)


def test_gate_table_shows_every_number_in_full_at_80_columns(monkeypatch):
    from rich.console import Console

    import llmopt.cli.verify_cmd as verify_cmd
    from llmopt.core.schema import Metric, VerifyResult
    from llmopt.verify.api import VerifyReport

    metrics = [
        Metric(
            "perplexity",
            12.345678,
            12.401234,
            False,
            12.469135,
            True,
            4096,
            ci_low=-0.0123456,
            ci_high=0.0987654,
            noise=True,
        ),
        Metric(
            "top1_agreement",
            1.0,
            0.987654,
            True,
            0.9,
            True,
            4096,
            ci_low=-0.0182345,
            ci_high=-0.0071234,
            noise=False,
        ),
        # The widest numbers `_fmt` writes, in every column at once, and a report-only gate.
        Metric(
            "kl_divergence_p99_over_all_tokens",
            0.000123456,
            -0.000923456,
            False,
            None,
            None,
            123456,
            ci_low=-0.000812345,
            ci_high=-0.000712345,
            noise=False,
        ),
        Metric("greedy_match_first_divergence", None, 123456.0, True, -0.000123456, False, 32),
    ]
    result = VerifyResult("c", "causal-lm", metrics, False, 0.0045, seconds=12.3)
    report = VerifyReport(
        "/models/a/long/reference/folder", "/runs/x/candidates/y/artifact", result
    )
    console = Console(width=80, record=True, force_terminal=False)
    monkeypatch.setattr(verify_cmd, "console", console)
    verify_cmd.render_report(report)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    fmt = verify_cmd._fmt
    for m in metrics:
        for x in (m.reference, m.candidate, m.delta, m.threshold, m.ci_low, m.ci_high):
            if x is not None:
                assert fmt(x) in text, fmt(x)
        assert str(m.n) in text
    assert fmt(-0.000923456) == "-9.23e-04" and "-0.001047" in text  # the delta, whole
