"""Reports render from fake-but-schema-valid run directories: complete, failed, partial."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from llmopt.core.atomic import write_json
from llmopt.core.schema import BenchResult, Candidate, Metric, Selection, VerifyResult, summarize
from llmopt.report import load_run, render_html, render_markdown, write_report
from llmopt.report.plots import nice_ticks
from llmopt.report.view import fmt_bytes, fmt_num, fmt_pct, fmt_x, order_names

XSS = "<script>alert(1)</script>"
GiB = 1024**3


def _run_json(root: Path, model: str, task: str) -> None:
    write_json(
        root / "run.json",
        {
            "schema_version": 1,
            "llmopt_version": "0.1.0",
            "created": "2026-05-09T12:34:56+00:00",
            "command": f"llmopt optimize {model} --target cpu --max-quality-drop 0.01",
            "model": model,
            "model_path": f"/models/{model}",
            "target": "cpu",
            "max_quality_drop": 0.01,
            "objective": "throughput",
        },
    )
    write_json(
        root / "model.json",
        {
            "name": model,
            "path": f"/models/{model}",
            "builtin": True,
            "task": task,
            "architecture": "LlamaForCausalLM",
            "model_type": "llama",
            "num_parameters": 134_515_008,
            "num_layers": 30,
            "hidden_size": 576,
            "num_heads": 9,
            "num_kv_heads": 3,
            "head_dim": 64,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "max_context": 8192,
            "dtype": "bfloat16",
            "weights_dtype": "bfloat16",
            "bytes_on_disk": 269_060_552,
            "weight_files": ["model.safetensors"],
            "weight_format": "safetensors",
            "tied_embeddings": True,
            "kv_bytes_per_token": {"float32": 46080, "bfloat16": 23040},
            "pooling": None,
            "normalize": None,
            "fingerprint": "sha256:abc",
        },
    )


def _plan(root: Path, cands: list[Candidate]) -> None:
    write_json(
        root / "plan.json",
        {
            "schema_version": 1,
            "target": {
                "device": "cpu",
                "threads": 2,
                "cpu": "Test CPU",
                "memory_bytes": 8 * GiB,
                "features": ["avx2"],
            },
            "workload": {"prompt_tokens": 128, "new_tokens": 64},
            "memory": {
                "weights_bytes": {
                    "float32": 538_060_032,
                    "bfloat16": 269_030_016,
                    "int8": 150_000_000,
                },
                "kv_bytes_per_token": {"float32": 46080},
                "notes": ["weights fit 15x over"],
            },
            "candidates": [c.to_dict() for c in cands],
            "skipped": [
                {
                    "id": "gguf-q4",
                    "engine": "llamacpp",
                    "recipe": "gguf-q4_k_m",
                    "reason": "llama-cpp-python not installed: pip install llmopt[llamacpp]",
                }
            ],
            "notes": ["plan note"],
        },
    )


def _cand(root: Path, c: Candidate, verify=None, bench=None, error=None) -> None:
    d = root / "candidates" / c.id
    write_json(d / "candidate.json", c.to_dict())
    write_json(d / "build.json", {"seconds": 1.5, "artifact_bytes": 100_000_000})
    if verify is not None:
        write_json(d / "verify.json", verify.to_dict())
    if bench is not None:
        write_json(d / "bench.json", bench.to_dict())
    if error is not None:
        write_json(d / "error.json", error)


def _lm_verify(cid: str, ppl: float, top1: float, passed: bool) -> VerifyResult:
    ref = 12.3456
    return VerifyResult(
        cid,
        "causal-lm",
        [
            Metric(
                "perplexity",
                ref,
                ppl,
                False,
                threshold=ref * 1.01,
                passed=ppl <= ref * 1.01,
                n=4096,
                note="wikitext sample",
            ),
            Metric("top1_agreement", 1.0, top1, True, threshold=0.9, passed=top1 >= 0.9, n=4096),
            Metric("kl_divergence_mean", 0.0, 0.0123, False, n=4096, unit="nats"),
            Metric("custom_metric_xyz", None, 7.5, True),
        ],
        passed=passed,
        quality_drop=(ppl - ref) / ref,
        seconds=3.2,
    )


def _lm_bench(cid: str, decode: list[float], rss: int, artifact: int) -> BenchResult:
    return BenchResult(
        cid,
        "causal-lm",
        {
            "decode_tokens_per_s": summarize(decode, "tok/s"),
            "prefill_tokens_per_s": summarize([x * 10 for x in decode], "tok/s"),
        },
        "decode_tokens_per_s",
        rss,
        rss - 200_000_000,
        artifact,
        1.1,
        0.4,
        settings={"threads": 2},
        env={"torch": "2.5.1", "cpu": "Test CPU", "threads": 2},
        notes=["bench note"],
    )


@pytest.fixture
def lm_run(tmp_path: Path) -> Path:
    root = tmp_path / "lm"
    ref = Candidate("hf-fp32", "torch", "fp32", {"dtype": "float32"}, True, "the reference")
    bf16 = Candidate("hf-bf16", "torch", "bf16", {"dtype": "bfloat16"}, False, XSS)
    w8 = Candidate("hf-w8a16", "torch", "w8a16", {"weight_bits": 8}, False, "int8 weights")
    _run_json(root, "smollm2-135m", "causal-lm")
    _plan(root, [ref, bf16, w8])
    _cand(
        root,
        ref,
        _lm_verify(ref.id, 12.3456, 1.0, True),
        _lm_bench(ref.id, [40.0, 41.0, 42.5], 900_000_000, 538_000_000),
    )
    _cand(
        root,
        bf16,
        _lm_verify(bf16.id, 12.3789, 0.987, True),
        _lm_bench(bf16.id, [70.0, 74.25, 75.0], 600_000_000, 269_000_000),
    )
    _cand(
        root,
        w8,
        _lm_verify(w8.id, 13.9012, 0.91, False),
        _lm_bench(w8.id, [90.0, 95.5, 99.0], 450_000_000, 150_000_000),
    )
    write_json(
        root / "selection.json",
        Selection(
            "throughput",
            bf16.id,
            0.01,
            {
                ref.id: "reference; slower than hf-bf16",
                bf16.id: "fastest within budget",
                w8.id: "perplexity 13.9 above threshold 12.47 (quality drop 12.60% > 1.00%)",
            },
            [bf16.id, ref.id],
            [ref.id, bf16.id, w8.id],
        ).to_dict(),
    )
    write_json(
        root / "doctor.json",
        {
            "findings": [
                {"check": "python", "status": "ok", "evidence": "3.11", "fix": ""},
                {"check": "numa", "status": "warn", "evidence": "1 node", "fix": "none needed"},
            ]
        },
    )
    return root


@pytest.fixture
def emb_run(tmp_path: Path) -> Path:
    root = tmp_path / "emb"
    ref = Candidate("hf-fp32", "torch", "fp32", reference=True)
    ort = Candidate("ort-int8", "onnxruntime", "ort-int8")
    _run_json(root, "minilm-l6", "embedding")
    _plan(root, [ref, ort])
    for c, cos, rate in ((ref, 1.0, 100.0), (ort, 0.9912, 260.0)):
        v = VerifyResult(
            c.id,
            "embedding",
            [
                Metric("cosine_mean", 1.0, cos, True, 0.99, cos >= 0.99, 1000),
                Metric("cosine_p1", 1.0, cos - 0.01, True, n=1000),
                Metric("cosine_min", 1.0, cos - 0.02, True, n=1000),
                Metric("wordsim353_spearman", 0.8, 0.795, True, n=353),
            ],
            passed=True,
            quality_drop=1 - cos,
        )
        b = BenchResult(
            c.id,
            "embedding",
            {
                "sentences_per_s_b1": summarize([rate / 4, rate / 4.2], "sent/s"),
                "sentences_per_s_b32": summarize([rate, rate * 1.02], "sent/s"),
            },
            "sentences_per_s_b32",
            300_000_000,
            90_000_000,
            23_000_000,
            0.3,
            0.1,
        )
        _cand(root, c, v, b)
    write_json(
        root / "selection.json",
        Selection(
            "throughput",
            ort.id,
            0.01,
            {ref.id: "reference", ort.id: "fastest within budget"},
            [ort.id, ref.id],
        ).to_dict(),
    )
    return root


@pytest.fixture
def failed_run(tmp_path: Path) -> Path:
    root = tmp_path / "failed"
    ref = Candidate("hf-fp32", "torch", "fp32", reference=True)
    bad = Candidate("ort-int8", "onnxruntime", "ort-int8")
    todo = Candidate("hf-bf16", "torch", "bf16")
    _run_json(root, "smollm2-135m", "causal-lm")
    _plan(root, [bad, ref, todo])  # reference not first in the plan: the view puts it first
    _cand(
        root,
        ref,
        _lm_verify(ref.id, 12.3456, 1.0, True),
        _lm_bench(ref.id, [40.0, 41.0, 42.5], 900_000_000, 538_000_000),
    )
    _cand(
        root,
        bad,
        error={
            "stage": "build",
            "error": "onnx export failed: <op> Unsupported",
            "traceback": "Traceback (most recent call last):\n  boom ```",
        },
    )
    return root


@pytest.fixture
def bare_run(tmp_path: Path) -> Path:
    root = tmp_path / "bare"
    _run_json(root, "smollm2-135m", "causal-lm")
    return root


class _Balance(HTMLParser):
    VOID = {
        "meta",
        "br",
        "hr",
        "img",
        "input",
        "link",
        "line",
        "rect",
        "circle",
        "path",
        "polyline",
    }

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        pass

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()


def _check_html(html: str) -> None:
    p = _Balance()
    p.feed(html)
    p.close()
    assert not p.errors and not p.stack, (p.errors, p.stack)
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", html, re.I)
    assert "http://" not in html and "https://" not in html
    assert "<script" not in html.lower().replace("&lt;script", "")


def test_lm_run(lm_run: Path) -> None:
    before = {p: p.read_bytes() for p in lm_run.rglob("*") if p.is_file()}
    md_path, html_path = write_report(lm_run)
    assert md_path == lm_run / "report.md" and html_path == lm_run / "report.html"
    after = {p: p.read_bytes() for p in lm_run.rglob("*") if p.is_file()}
    assert {p for p in after if p not in before} == {md_path, html_path}
    assert all(after[p] == b for p, b in before.items()), "the run directory was modified"
    md, html = md_path.read_text(), html_path.read_text()
    _check_html(html)
    assert "<svg" in html and "<details" in html
    view = load_run(lm_run)
    assert [c.id for c in view.candidates] == ["hf-fp32", "hf-bf16", "hf-w8a16"]
    bf16 = view.get("hf-bf16")
    assert view.speedup(bf16) == pytest.approx(74.25 / 41.0)
    assert view.memory_ratio(bf16) == pytest.approx(600 / 900)
    assert view.status(bf16).text == "chosen: fastest within budget"
    assert view.status(view.get("hf-w8a16")).kind == "dropped"
    for text in (md, html):
        for cid in ("hf-fp32", "hf-bf16", "hf-w8a16", "gguf-q4"):
            assert cid in text
        for num in (
            "12.35",
            "12.38",
            "13.9",
            "+0.0333",
            "74.25",
            "75",
            "95.5",
            "1.81x",
            "2.33x",
            "572.2 MiB",
            fmt_pct(view.get("hf-w8a16").verify.quality_drop),
            "custom_metric_xyz",
            "kl_divergence_mean",
            "2.5.1",
        ):
            assert num in text, num
        assert "Chosen: hf-bf16" in text
        assert "perplexity 13.9 above threshold 12.47" in text
        assert "llama-cpp-python not installed" in text
        assert "llmopt optimize smollm2-135m --target cpu" in text
        assert "2026-05-09T12:34:56+00:00" in text
        assert XSS not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;script>alert(1)&lt;/script>" in md  # no raw HTML can form in Markdown either
    for text in (md, html):
        assert "Quantization applied and verified" in text and "gate failed" in text
    # Known metrics first, unknown after, in both reports.
    assert md.index("| perplexity") < md.index("| kl_divergence_mean") < md.index("| custom_")


def test_embedding_run(emb_run: Path) -> None:
    md_path, html_path = write_report(emb_run)
    md, html = md_path.read_text(), html_path.read_text()
    _check_html(html)
    for text in (md, html):
        assert "ort-int8" in text and "onnxruntime" in text
        for name in (
            "cosine_mean",
            "cosine_p1",
            "cosine_min",
            "wordsim353_spearman",
            "sentences_per_s_b32",
            "sentences_per_s_b1",
            "0.9912",
            "2.60x",
        ):
            assert name in text, name
    assert "Chosen: ort-int8" in md


def test_failed_candidate(failed_run: Path) -> None:
    md_path, html_path = write_report(failed_run)
    md, html = md_path.read_text(), html_path.read_text()
    _check_html(html)
    view = load_run(failed_run)
    assert [c.id for c in view.candidates] == ["hf-fp32", "ort-int8", "hf-bf16"]
    assert view.status(view.get("ort-int8")).label == "failed at build"
    assert view.status(view.get("hf-bf16")).kind == "incomplete"
    assert "selection.json" in view.missing
    assert "failed at build: onnx export failed: &lt;op> Unsupported" in md
    assert "failed at build: onnx export failed: &lt;op&gt; Unsupported" in html
    assert "Traceback (most recent call last)" in md and "````text" in md  # fence outgrows ```
    assert "No selection yet" in md and "no verify.json, bench.json" in md


def test_bare_run(bare_run: Path) -> None:
    md_path, html_path = write_report(bare_run)
    md, html = md_path.read_text(), html_path.read_text()
    _check_html(html)
    for text in (md, html):
        assert "smollm2-135m" in text and "plan.json missing" in text
        assert "No candidates yet" in text and "selection.json" in text


def test_unreadable_file_is_reported(lm_run: Path) -> None:
    (lm_run / "candidates" / "hf-w8a16" / "bench.json").write_text("{not json")
    md, _ = (p.read_text() for p in write_report(lm_run))
    assert "Unreadable: candidates/hf-w8a16/bench.json" in md


def test_any_file_missing_or_corrupt(lm_run: Path) -> None:
    files = sorted(p for p in lm_run.rglob("*.json"))
    for i, victim in enumerate(files):
        saved = victim.read_bytes()
        # Alternate between a missing file and one holding the wrong JSON shape.
        victim.unlink() if i % 2 else victim.write_text("[1, 2]")
        view = load_run(lm_run)
        _check_html(render_html(view))
        assert "smollm2-135m" in render_markdown(view)
        victim.write_bytes(saved)


@pytest.mark.parametrize("fixture", ["lm_run", "emb_run", "failed_run", "bare_run"])
def test_deterministic(fixture: str, request: pytest.FixtureRequest) -> None:
    root = request.getfixturevalue(fixture)
    a = render_markdown(load_run(root)), render_html(load_run(root))
    write_report(root)  # the reports themselves must not change the next rendering
    b = render_markdown(load_run(root)), render_html(load_run(root))
    assert a == b


def test_nonfinite_metric_fails_integrity(lm_run: Path) -> None:
    p = lm_run / "candidates" / "hf-w8a16" / "verify.json"
    d = json.loads(p.read_text())
    d["metrics"][0]["candidate"] = float("nan")
    p.write_text(json.dumps(d))
    md = render_markdown(load_run(lm_run))
    assert "❌ **Integrity checks passed**" in md and "perplexity candidate = nan" in md


def test_formatters() -> None:
    assert fmt_num(12.34567) == "12.35" and fmt_num(123456.7) == "123,457"
    assert fmt_num(None) == "n/a" and fmt_num(0.0333, sign=True) == "+0.0333"
    assert fmt_pct(0.0042) == "0.42%" and fmt_x(1.849) == "1.85x"
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(12) == "12 B"
    assert nice_ticks(0, 97) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(0, 0) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert order_names(["z", "cosine_min", "perplexity"], ("perplexity", "cosine_min")) == [
        "perplexity",
        "cosine_min",
        "z",
    ]


def test_import_without_torch() -> None:
    code = "import sys, llmopt.report; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": _src()})


def _src() -> str:
    import llmopt

    return str(Path(llmopt.__file__).parents[1])


def test_roofline_rows_render(tmp_path):
    from llmopt.report.facts import roofline_rows
    from llmopt.report.view import CandidateView

    phase = {
        "phase": "decode b1",
        "achieved_bytes_per_s": 6.0e9,
        "bandwidth_share": 0.5,
        "achieved_flops_per_s": 2.5e9,
        "flops_share": 0.02,
        "verdict": "memory-bound",
        "implication": "fewer bytes per token help",
    }
    bench = BenchResult(
        "c",
        "causal-lm",
        {"decode_tokens_per_s": summarize([10.0])},
        "decode_tokens_per_s",
        1,
        1,
        1,
        0.0,
        0.0,
        roofline={"ceilings": {}, "phases": [phase]},
    )
    cv = CandidateView.__new__(CandidateView)
    cv.bench = bench
    rows = roofline_rows(cv)
    want = [
        "decode b1",
        "6",
        "50.00%",
        "2.5",
        "2.00%",
        "memory-bound",
        "fewer bytes per token help",
    ]
    assert rows == [want]
    cv.bench = BenchResult("c", "embedding", {}, "x", 1, 1, 1, 0.0, 0.0)
    assert roofline_rows(cv) == []


def test_engines_table_names_each_engines_best_and_verdict(tmp_path: Path) -> None:
    from llmopt.report.facts import engine_rows

    root = tmp_path / "engines"
    ref = Candidate("hf-fp32", "hf", "fp32", {}, True, "the reference")
    q8 = Candidate("llamacpp-gguf-q8_0", "llamacpp", "gguf-q8_0", {}, False, "llama.cpp Q8_0")
    q4 = Candidate("llamacpp-gguf-q4_0", "llamacpp", "gguf-q4_0", {}, False, "llama.cpp Q4_0")
    w4 = Candidate("torch-w4a16", "torch", "w4a16", {}, False, "int4")
    _run_json(root, "smollm2-135m", "causal-lm")
    _plan(root, [ref, q8, q4, w4])
    _cand(root, ref, _lm_verify(ref.id, 12.0, 1.0, True), _lm_bench(ref.id, [10, 10, 10], 9, 9))
    _cand(root, q8, _lm_verify(q8.id, 12.05, 0.97, True), _lm_bench(q8.id, [50, 51, 52], 5, 2))
    # Faster but over the budget: the engine's row shows its best candidate that passed.
    _cand(root, q4, _lm_verify(q4.id, 14.0, 0.8, False), _lm_bench(q4.id, [90, 91, 92], 4, 1))
    _cand(root, w4, _lm_verify(w4.id, 15.0, 0.7, False), _lm_bench(w4.id, [30, 30, 30], 4, 1))
    reasons = {ref.id: "kept: 0.20x the chosen", q8.id: "fastest within budget"}
    reasons |= {q4.id: "perplexity over budget", w4.id: "perplexity over budget"}
    write_json(
        root / "selection.json",
        Selection("throughput", q8.id, 0.01, reasons, [q8.id, ref.id], [ref.id, q8.id]).to_dict(),
    )
    rows = {r[0]: r for r in engine_rows(load_run(root))}
    assert rows["llamacpp"][1] == q8.id and rows["llamacpp"][-1].startswith("chosen")
    assert rows["hf"][1] == ref.id and "0.20x the chosen" in rows["hf"][-1]
    assert rows["torch"][1] == w4.id and "no candidate of this engine passed" in rows["torch"][-1]
    md, _ = write_report(root)
    assert "## Engines" in md.read_text()


def test_recalibrated_threshold_in_the_checklist(emb_run: Path) -> None:
    thr = {"threshold": 0.8123, "reference_threshold": 0.85, "agreement": 0.991}
    write_json(emb_run / "best" / "launch.json", {"similarity_threshold": thr | {"x": 1}})
    md = write_report(emb_run)[0].read_text()
    assert "similarity threshold for the application: 0.8123 in place of 0.85" in md
    assert "(decision agreement with the reference 99.10%; best/launch.json)" in md


def test_summary_quotes_the_side_by_side_ratio_the_selection_used(lm_run: Path) -> None:
    from llmopt.report.facts import summary_line

    sel = json.loads((lm_run / "selection.json").read_text())
    assert "1.81x the reference's decode_tokens_per_s" in summary_line(load_run(lm_run))
    sel["side_by_side"] = {
        "hf-bf16": {"ratio": 1.5, "lo": 1.45, "hi": 1.55, "ratios": [1.45, 1.55], "trusted": True}
    }
    write_json(lm_run / "selection.json", sel)
    line = summary_line(load_run(lm_run))
    assert "1.50x the reference's throughput measured side by side (2 rounds, 1.45-1.55x)" in line
    assert "1.81x" not in line


def _with_selection(root: Path, **changes) -> None:
    sel = json.loads((root / "selection.json").read_text())
    sel["objective_values"] = {"hf-fp32": 41.0, "hf-bf16": 74.25, "hf-w8a16": 95.5}
    sel.update(changes)
    write_json(root / "selection.json", sel)


def _row(view, cid: str) -> dict[str, str]:
    from llmopt.report.facts import candidate_cells, candidate_headers

    return dict(zip(candidate_headers(view), candidate_cells(view, view.get(cid)), strict=True))


def test_chosen_row_and_headline_quote_the_same_side_by_side_ratio(lm_run: Path) -> None:
    from llmopt.report.facts import summary_line

    pr = {"ratio": 1.5, "lo": 1.45, "hi": 1.55, "ratios": [1.45, 1.55], "trusted": True}
    _with_selection(lm_run, side_by_side={"hf-bf16": pr})
    view = load_run(lm_run)
    line = summary_line(view)
    chosen = _row(view, "hf-bf16")["throughput vs reference"]
    # The headline's number is the chosen row's, labelled with how it was measured, and not the
    # batch-1 decode ratio of the two separate full benchmarks (74.25 / 41 = 1.81x).
    assert chosen == "1.50x side by side (1.45-1.55x)"
    assert "1.50x the reference's throughput measured side by side" in line
    assert "1.81x" not in line and "1.81x" not in chosen
    assert _row(view, "hf-fp32")["throughput vs reference"] == "1.00x (reference)"
    # No side-by-side rounds for this one: its ratio is from the objective values, said so.
    assert _row(view, "hf-w8a16")["throughput vs reference"] == "2.33x separate runs"
    md, html = (p.read_text() for p in write_report(lm_run))
    for text in (md, html):
        assert "1.50x side by side (1.45-1.55x)" in text and "throughput vs reference" in text
    assert "throughput vs reference side by side" in html  # the summary card's label


def test_a_choice_inside_the_noise_says_so(lm_run: Path) -> None:
    from llmopt.report.facts import summary_line

    pr = {"ratio": 1.02, "lo": 0.97, "hi": 1.08, "ratios": [0.97, 1.08], "trusted": True}
    _with_selection(lm_run, side_by_side={"hf-bf16": pr})
    view = load_run(lm_run)
    line = summary_line(view)
    assert "no measurable throughput difference from the reference" in line
    assert "1.02x side by side, 2 rounds spanning 0.97-1.08x" in line
    assert "chosen for its smaller peak memory (0.67x the reference's)" in line
    assert "the reference's throughput measured" not in line and "faster" not in line
    assert _row(view, "hf-bf16")["throughput vs reference"] == "1.02x side by side (0.97-1.08x)"
    assert "throughput vs reference within noise" in write_report(lm_run)[1].read_text()
    # Same memory as the reference: only the higher median is left, and the line says that.
    b = json.loads((lm_run / "candidates/hf-bf16/bench.json").read_text())
    ref = json.loads((lm_run / "candidates/hf-fp32/bench.json").read_text())
    b["peak_rss_bytes"], b["artifact_bytes"] = ref["peak_rss_bytes"], ref["artifact_bytes"]
    write_json(lm_run / "candidates/hf-bf16/bench.json", b)
    assert "its higher median, a difference within noise" in summary_line(load_run(lm_run))


def test_unconfirmed_and_screen_ratios_are_labelled(lm_run: Path) -> None:
    from llmopt.report.facts import summary_line

    # Rounds measured but none comparable: the separate runs' ratio, not claimed as a speed-up.
    pr = {"ratio": None, "lo": None, "hi": None, "ratios": [], "rounds": 2, "trusted": False}
    _with_selection(lm_run, side_by_side={"hf-bf16": pr})
    view = load_run(lm_run)
    line = summary_line(view)
    assert "no confirmed throughput difference" in line
    assert "1.81x in separate runs, not confirmed side by side" in line
    assert "chosen on the separate runs' numbers, and it has its smaller peak memory" in line
    cell = _row(view, "hf-bf16")["throughput vs reference"]
    assert cell == "1.81x separate runs, not confirmed side by side"
    # A candidate the search cut at the screen: its screen score, labelled as such.
    cut = Candidate("hf-w4a16", "torch", "w4a16")
    _cand(lm_run, cut)
    write_json(lm_run / "search.json", {"objective": "throughput", "screen_scores": {cut.id: 0.9}})
    assert _row(load_run(lm_run), cut.id)["throughput vs reference"] == "0.90x screen"


def test_cli_final_table_agrees_with_the_report(lm_run: Path, monkeypatch) -> None:
    from rich.console import Console

    import llmopt.cli.render as render
    from llmopt.core.schema import Selection
    from llmopt.optimize.job import OptimizeResult
    from llmopt.report.facts import summary_line

    pr = {"ratio": 1.5, "lo": 1.45, "hi": 1.55, "ratios": [1.45, 1.55], "trusted": True}
    _with_selection(lm_run, side_by_side={"hf-bf16": pr})
    sel = Selection.from_dict(json.loads((lm_run / "selection.json").read_text()))
    console = Console(width=200, record=True)
    monkeypatch.setattr(render, "console", console)
    render.render_selection(OptimizeResult(lm_run, sel, False))
    text = console.export_text()
    assert "1.50x side by side (1.45-1.55x)" in text and "2.33x separate runs" in text
    assert summary_line(load_run(lm_run)) in text.replace("\n", " ")


def test_the_compile_payback_and_the_budget_cut_are_in_the_report(lm_run: Path) -> None:
    pay = "compiling pays back after ~6,000 generated tokens (60 s more warm-up, ...)"
    why = "compile not tried: needs ~300 s, 12 s left (2 rounds with a compile of ~120 s each)"
    _with_selection(lm_run, tuned={"note": f"settings: the defaults kept; {pay}", "payback": pay})
    write_json(lm_run / "search.json", {"objective": "throughput", "events": [f"settings: {why}"]})
    md, html = (p.read_text() for p in write_report(lm_run))
    for text in (md, html):
        assert "compiled decode" in text and pay.split(" (")[0] in text and why in text
