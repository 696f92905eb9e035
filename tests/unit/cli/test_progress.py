"""`optimize`'s progress: timestamped lines where the output is not a terminal, a live table
that updates in place where it is (checked on a real pseudo-terminal)."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import time

from llmopt.cli.progress import OptimizeProgress


def test_plain_lines_with_timestamps_when_not_a_terminal():
    buf = io.StringIO()
    now = [100.0]
    p = OptimizeProgress(stream=buf, clock=lambda: now[0], started_at=100.0)
    assert not p.live  # a StringIO is not a terminal
    with p:
        p("budget", "", "", "300")
        now[0] = 101.0
        p("start", "hf-w8a16", "build", "full")
        now[0] = 112.5
        p("done", "hf-w8a16", "build", "")
        p("cut", "hf-w4a16-awq-g128", "search", "predicted to miss the quality budget")
        p("skip", "hf-fp32", "bench", "already finished")
    lines = buf.getvalue().splitlines()
    assert "inspecting and planning" in lines[0]
    assert lines[1].endswith("+0:01  start  build   hf-w8a16 (full)")
    assert "+0:12  done   build   hf-w8a16 11.5 s" in lines[2]
    assert "cut    search  hf-w4a16-awq-g128  predicted to miss" in lines[3]
    assert len(lines) == 4  # reused stages are not one line each
    assert p.budget_s == 300.0


def test_nothing_printed_when_disabled():
    buf = io.StringIO()
    with OptimizeProgress(enabled=False, stream=buf) as p:
        p("start", "a", "build", "full")
    assert buf.getvalue() == ""


SCRIPT = """
import sys, time
from llmopt.cli.progress import OptimizeProgress
with OptimizeProgress(budget_s=300) as p:
    p("start", "hf-fp32", "build", "full"); time.sleep(1.2)
    p("done", "hf-fp32", "build", ""); p("start", "hf-fp32", "bench", "full"); time.sleep(1.2)
    p("done", "hf-fp32", "bench", "decode_tokens_per_s 45.1"); time.sleep(0.6)
print("LIVE" if p.live else "LINES")
"""


def test_live_table_updates_in_a_terminal():
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    out = b""
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=30)
    os.close(master)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "LIVE" in text
    # One row per candidate, redrawn in place (cursor movements) as its state changed.
    assert "\x1b[" in text and "candidate" in text and "budget 5:00" in text
    assert "running" in text and "benchmarking" in text
    assert "decode_tokens_per_s 45.1" in text


def test_a_long_stage_reports_what_its_log_last_said(tmp_path):
    """Off a terminal, a stage running longer than the heartbeat is reported again with the last
    line of its log (a calibration's layer count, say), so a log shows it is alive."""
    log = tmp_path / "candidates" / "hf-w4a16-awq-g64" / "log.txt"
    log.parent.mkdir(parents=True)
    log.write_text("2026-12-02 05:01:02,123 llmopt.optimize.worker INFO calibrate 12/30\n")
    buf = io.StringIO()
    with OptimizeProgress(stream=buf, heartbeat_s=0.5) as p:
        p("rundir", "", "", str(tmp_path))
        p("start", "hf-w4a16-awq-g64", "build", "full")
        time.sleep(2.5)
        p("done", "hf-w4a16-awq-g64", "build", "")
    still = [line for line in buf.getvalue().splitlines() if " still " in line]
    assert still and all("build   hf-w4a16-awq-g64" in line for line in still)
    assert still[0].endswith("calibrate 12/30")
