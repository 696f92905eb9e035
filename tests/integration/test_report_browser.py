"""report.html in a real headless Chromium: it renders (a non-blank screenshot) with no console
messages at all (the report has no JavaScript, so any console line is an error), and the checker
itself catches a page that throws."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from llmopt.core.atomic import write_json
from llmopt.core.schema import BenchResult, Candidate, Metric, Selection, VerifyResult, summarize
from llmopt.report import write_report

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
    "--hide-scrollbars",
]


def _chromium(page: Path, tmp: Path, *extra: str) -> tuple[str, subprocess.CompletedProcess]:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed")
    shot = tmp / f"{page.stem}.png"
    proc = subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={tmp / 'profile'}",
            "--window-size=1280,2400",
            f"--screenshot={shot}",
            *extra,
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return str(shot), proc


def _console(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]


def _png_pixels(path: str) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB(A) PNG (what Chromium writes) into rows of raw pixel bytes."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, w = 8, b"", 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), (depth, color)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, rows, prev = zlib.decompress(idat), [], bytearray(w * bpp)
    stride = w * bpp + 1
    for y in range(h):
        f, line = raw[y * stride], bytearray(raw[y * stride + 1 : (y + 1) * stride])
        for i in range(len(line)):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, rows


def _stats(v: float) -> dict:
    return {"m": summarize([v * 0.97, v, v * 1.03], "tokens/s")}


def _run(root: Path) -> Path:
    cands = [
        Candidate("hf-fp32", "hf", "fp32", {"threads": 2}, True, "reference"),
        Candidate("hf-w8a16", "hf", "w8a16", {"threads": 2}),
        Candidate("hf-bf16", "hf", "bf16", {"threads": 2}),
        Candidate("hf-w8a8-dynamic", "hf", "w8a8-dynamic", {"threads": 2}),
    ]
    write_json(
        root / "run.json",
        {
            "model": "smollm2-135m",
            "target": "cpu",
            "created": "2026-11-29",
            "max_quality_drop": 0.01,
            "command": "llmopt optimize smollm2-135m",
            "settings": {"prompt_tokens": 100, "new_tokens": 64, "bench_batch_sizes": [1, 4]},
            "llmopt_version": "0.1.0",
        },
    )
    write_json(
        root / "model.json",
        {
            "name": "smollm2-135m",
            "task": "causal-lm",
            "num_parameters": 134_515_008,
            "kv_bytes_per_token": {"float32": 46080},
        },
    )
    write_json(
        root / "plan.json",
        {
            "target": {"device": "cpu", "memory_bytes": 8 * 2**30},
            "memory": {"weights_bytes": {"float32": 538_060_032}},
            "candidates": [c.to_dict() for c in cands],
            "skipped": [
                {
                    "id": "onnxruntime-fp32",
                    "engine": "onnxruntime",
                    "recipe": "fp32",
                    "reason": "engine does not run causal-lm models",
                }
            ],
        },
    )
    write_json(
        root / "doctor.json",
        {
            "findings": [
                {"id": "host.cpu", "title": "CPU", "status": "ok", "evidence": "2 cores, avx512"}
            ]
        },
    )
    speeds = {"hf-fp32": 14.0, "hf-w8a16": 19.0, "hf-bf16": 11.0}
    for c in cands:
        d = root / "candidates" / c.id
        write_json(d / "candidate.json", c.to_dict())
        write_json(d / "build.json", {"seconds": 2.0, "artifact_bytes": 200_000_000})
        drop = {"hf-fp32": 0.0, "hf-w8a16": 0.004, "hf-bf16": 0.006, "hf-w8a8-dynamic": 0.07}[c.id]
        ppl = Metric("perplexity", 20.0, 20.0 * (1 + drop), False, 20.2, drop <= 0.01, 8192)
        v = VerifyResult(c.id, "causal-lm", [ppl], drop <= 0.01, drop)
        write_json(d / "verify.screen.json", v.to_dict())
        write_json(d / "task.screen.json", {"host": "vm", "pid": 11 + len(c.id), "seconds": 9.0})
        if c.id not in speeds:
            continue
        s = speeds[c.id]
        metrics = {
            "decode_tokens_per_s": _stats(s)["m"],
            "decode_tokens_per_s_b4": _stats(2.5 * s)["m"],
            "prefill_tokens_per_s": _stats(40 * s)["m"],
            "decode_ms_per_token": summarize([1000 / s * f for f in (0.95, 1, 1.1)], "ms"),
        }
        b = BenchResult(
            c.id,
            "causal-lm",
            metrics,
            "decode_tokens_per_s",
            700 * 2**20,
            500 * 2**20,
            200_000_000,
            1.0,
            2.0,
            {"prompt_tokens": 100, "new_tokens": 64},
            {"torch_threads": 2},
            roofline={
                "phases": [
                    {
                        "phase": "decode b1",
                        "verdict": "memory-bound",
                        "bandwidth_share": 0.6,
                        "flops_share": 0.02,
                        "achieved_bytes_per_s": 7e9,
                        "achieved_flops_per_s": 4e9,
                        "implication": "fewer bytes per weight",
                    }
                ]
            },
        )
        write_json(d / "verify.json", v.to_dict())
        write_json(d / "bench.json", b.to_dict())
    sel = Selection(
        "throughput",
        "hf-w8a16",
        0.01,
        {
            "hf-w8a16": "chosen: best throughput",
            "hf-fp32": "kept: 0.74x",
            "hf-bf16": "kept: 0.58x",
            "hf-w8a8-dynamic": "cut: screened out",
        },
        ["hf-w8a16", "hf-fp32", "hf-bf16"],
        ["hf-fp32", "hf-w8a16"],
        cut={"hf-w8a8-dynamic": "screened out at fidelity 1 (screen): ppl +7.0% > budget 1.0%"},
    )
    write_json(root / "selection.json", sel.to_dict())
    write_json(
        root / "search.json",
        {
            "objective": "throughput",
            "search": "halving",
            "budget": {"seconds": 900, "elapsed_s": 300},
            "executor": {"executor": "local"},
            "screen_scores": {"hf-w8a16": 1.3, "hf-bf16": 0.8, "hf-w8a8-dynamic": 1.6},
            "events": ["screen: 3 screened, 2 go on to full fidelity"],
        },
    )
    return write_report(root)[1]


def test_report_renders_in_chromium_without_console_errors(tmp_path):
    html = _run(tmp_path / "run")
    text = html.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text
    shot, proc = _chromium(html, tmp_path)
    assert _console(proc.stderr) == [], _console(proc.stderr)
    w, h, rows = _png_pixels(shot)
    assert (w, h) == (1280, 2400)
    colors = {row[i : i + 3] for row in rows[::8] for i in range(0, len(row), 24)}
    assert len(colors) > 20, f"screenshot looks blank ({len(colors)} colours)"
    # Ink on the page: a real share of sampled pixels is not background.
    bg = {b"\xff\xff\xff", b"\xf6\xf8\xfa"}
    ink = sum(row[i : i + 3] not in bg for row in rows[::8] for i in range(0, len(row), 24))
    assert ink > 0.05 * (len(rows) // 8) * (len(rows[0]) // 24)
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile2'}", "--dump-dom", html.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    for needle in (
        "Latency CDF",
        "Throughput vs concurrency",
        "Pareto",
        "Roofline verdict",
        "Caches enabled",
        "screened out at fidelity 1",
    ):
        assert needle in dom, needle


def test_checker_catches_a_page_that_throws(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text("<html><body><h1>x</h1><script>throw new Error('boom')</script></body></html>")
    _, proc = _chromium(page, tmp_path)
    assert any("boom" in line for line in _console(proc.stderr))
