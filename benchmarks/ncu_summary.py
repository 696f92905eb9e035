"""Summarise `ncu --page raw --csv` output of `ncu_gemv.py`: one line per kernel launch with its
duration, DRAM throughput, occupancy, registers and the warp-stall reasons that dominate.

    python benchmarks/ncu_summary.py gemv-raw.csv [ncu.log]

With the profiled program's log (`ncu_gemv.py` prints a "profiled SHAPE KERNEL" line per
profiled call, one kernel launch each), each line is labelled with its shape and kernel.
"""

from __future__ import annotations

import csv
import sys

COLUMNS = {  # raw metric -> short label
    "gpu__time_duration.sum": "us",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
    "dram__bytes_read.sum": "read MB",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
    "sm__maximum_warps_per_active_cycle_pct": "theo occ%",
    "launch__registers_per_thread": "regs",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue%",
}
STALLS = ("smsp__average_warp_latency_issue_stalled_", "smsp__average_warps_issue_stalled_")


def _num(v: str) -> float | None:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def main(path: str, log: str | None = None) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(head)}
    labels = []
    if log:
        with open(log) as f:
            labels = [" ".join(ln.split()[1:3]) for ln in f if ln.startswith("profiled ")]
    if len(labels) != len(data):  # (a call that launched more than one kernel)
        labels = [r[col["Kernel Name"]][:40] for r in data]
    for r, name in zip(data, labels, strict=True):
        parts = []
        for metric, label in COLUMNS.items():
            if metric in col:
                v = _num(r[col[metric]])
                unit = units[col[metric]]
                if v is not None and metric == "gpu__time_duration.sum":
                    v = v / 1000 if unit == "nsecond" else v * (1e6 if unit == "second" else 1)
                if v is not None and metric == "dram__bytes_read.sum":
                    scale = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1, "Gbyte": 1e3}.get(unit, 1)
                    v = v * scale
                parts.append(f"{label} {v:.1f}" if v is not None else f"{label} ?")
        stalls = []
        for metric, i in col.items():
            prefix = next((p for p in STALLS if metric.startswith(p)), None)
            if prefix and metric.endswith(".ratio"):
                v = _num(r[i])
                if v:
                    reason = metric[len(prefix) :].split("_per_")[0]
                    stalls.append((v, reason))
        stalls.sort(reverse=True)
        top = ", ".join(f"{s} {v:.2f}" for v, s in stalls[:5])
        print(f"{name:34s} " + "  ".join(parts) + (f"  stalls: {top}" if top else ""))


if __name__ == "__main__":
    main(*sys.argv[1:3])
