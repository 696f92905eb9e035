"""`bench compare`: noise labelling against the measured spread, tables, plots, CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmopt.bench.compare import CompareInputError, compare_runs, to_html, to_markdown
from llmopt.core.schema import summarize


def _doc(label: str, tput: list[list[float]], ttft: list[list[float]]) -> dict:
    """A serve bench.json: one point per concurrency, repeats given per point."""
    points = []
    for i, (tp, tt) in enumerate(zip(tput, ttft, strict=True)):
        c = 2**i
        runs = [
            {
                "requests": [
                    {"success": True, "ttft": t / 1000, "latency": t / 500} for t in (tt[0], tt[-1])
                ]
            }
        ]
        points.append(
            {
                "spec": {"mode": "concurrency", "value": c, "label": f"concurrency {c}"},
                "summary": {
                    "output_throughput": summarize(tp, "tokens/s").to_dict(),
                    "ttft_ms.median": summarize(tt, "ms").to_dict(),
                },
                "runs": runs,
            }
        )
    return {"kind": "serve", "label": label, "points": points}


@pytest.fixture
def runs(tmp_path):
    a = _doc("a", [[100, 104, 98], [180, 190, 185]], [[50, 52, 49], [80, 82, 81]])
    # +2% throughput at c=1 (inside a's 6% spread), +30% at c=2; TTFT 2x worse at c=2.
    b = _doc("b", [[102, 103, 101], [240, 242, 238]], [[50, 51, 50], [160, 162, 161]])
    paths = []
    for d in (a, b):
        (tmp_path / d["label"]).mkdir()
        p = tmp_path / d["label"] / "bench.json"
        p.write_text(json.dumps(d))
        paths.append(p.parent)
    return paths


def test_small_changes_are_noise_big_ones_are_not(runs):
    cmp = compare_runs(runs)
    v = {(r["row"], r["metric"]): r["verdicts"][1] for r in cmp["rows"]}
    assert v[("concurrency 1", "output_throughput")] == "noise"
    assert v[("concurrency 2", "output_throughput")] == "better"
    assert v[("concurrency 2", "ttft_ms.median")] == "worse"  # lower is better for latency


def test_single_repeat_is_not_claimed(tmp_path):
    docs = [_doc(x, [[100 + 10 * i]], [[50]]) for i, x in enumerate("ab")]
    paths = []
    for d in docs:
        p = tmp_path / f"{d['label']}.json"
        p.write_text(json.dumps(d))
        paths.append(p)
    rows = compare_runs(paths)["rows"]
    assert rows[0]["verdicts"] == ["baseline", "1 repeat"]


def test_markdown_and_html_carry_plots(runs):
    cmp = compare_runs(runs)
    md = to_markdown(cmp)
    assert "| concurrency 2 |" in md and "better" in md
    assert set(cmp["charts"]) == {"throughput_vs_load", "ttft_vs_load", "ttft_cdf", "e2el_cdf"}
    html = to_html(cmp)
    assert html.count("<svg") == 4 and "<script" not in html


def test_bad_inputs_are_typed(tmp_path, runs):
    with pytest.raises(CompareInputError, match="at least two"):
        compare_runs(runs[:1])
    with pytest.raises(CompareInputError, match="no bench.json"):
        compare_runs([runs[0], tmp_path / "nothing"])


def test_optimize_run_dirs_compare_by_candidate(tmp_path):
    for run, med in (("r1", [20, 21, 22]), ("r2", [30, 31, 29])):
        c = tmp_path / run / "candidates" / "hf-fp32"
        c.mkdir(parents=True)
        c.joinpath("bench.json").write_text(
            json.dumps(
                {
                    "candidate_id": "hf-fp32",
                    "metrics": {"decode_tokens_per_s": summarize(med, "tokens/s").to_dict()},
                }
            )
        )
    rows = compare_runs([tmp_path / "r1", tmp_path / "r2"])["rows"]
    assert rows[0]["row"] == "hf-fp32" and rows[0]["verdicts"][1] == "better"


def test_cli_compare_json_and_html(runs, tmp_path):
    from llmopt.cli.main import app

    html = tmp_path / "cmp.html"
    res = CliRunner().invoke(
        app, ["bench", "compare", *map(str, runs), "--html", str(html), "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["labels"] == ["a", "b"] and html.read_text().count("<svg") == 4
