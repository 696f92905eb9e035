"""benchmarks/ncu_summary.py: Nsight Compute's raw CSV (a header row, a units row, one row per
profiled launch) turned into one line per kernel, labelled from the profiled program's log."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))

import ncu_summary  # noqa: E402

HEAD = [
    "ID",
    "Kernel Name",
    "gpu__time_duration.sum",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__registers_per_thread",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
]
UNITS = ["", "", "nsecond", "%", "register/thread", "inst", "inst", "inst"]


def _write(path: Path, rows: list[list[str]]) -> None:
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([HEAD, UNITS, *rows])


def test_each_launch_gets_its_duration_dram_share_and_top_stalls(tmp_path, capsys):
    raw = tmp_path / "raw.csv"
    _write(
        raw,
        [
            ["0", "wo8_gemv", "36,900", "67.7", "48", "6.70", "0.50", "0.93"],
            ["1", "int4_gemv", "24800", "53.2", "96", "2.25", "0.89", "0"],
        ],
    )
    log = tmp_path / "ncu.log"
    log.write_text(
        "==PROF== Connected\nprofiled gate_up int8-gemv (28672 x 4096, m=1)\n"
        "profiled gate_up int4-g128-gemv (28672 x 4096, m=1)\n"
    )
    ncu_summary.main(str(raw), str(log))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("gate_up int8-gemv")
    assert "us 36.9" in lines[0] and "dram% 67.7" in lines[0] and "regs 48.0" in lines[0]
    # stalls by size, the zero one left out
    assert lines[0].endswith("stalls: long_scoreboard 6.70, math_pipe_throttle 0.93, barrier 0.50")
    assert lines[1].startswith("gate_up int4-g128-gemv") and "us 24.8" in lines[1]
    assert "math_pipe_throttle" not in lines[1]


def test_a_log_that_does_not_match_the_launches_falls_back_to_kernel_names(tmp_path, capsys):
    raw = tmp_path / "raw.csv"
    _write(raw, [["0", "wo8_gemv", "1000", "50", "40", "1", "1", "1"]] * 2)
    log = tmp_path / "ncu.log"
    log.write_text("profiled o int8-gemv (4096 x 4096, m=1)\n")  # one label, two launches
    ncu_summary.main(str(raw), str(log))
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == ["wo8_gemv", "wo8_gemv"]
    assert "us 1.0" in lines[0]
