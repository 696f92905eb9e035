"""A CPU-heavy neighbour starts while `optimize` compares its finalists: the run either decides on
rounds the neighbour did not disturb, measuring again where it did, or says it could not compare
them; it never reports a ratio built from a disturbed round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUSY = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass"


def test_a_neighbour_during_the_side_by_side_rounds(tiny_llama_dir, tmp_path, quick_optimize_args):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "llmopt.cli.main"]
    cmd += quick_optimize_args(tiny_llama_dir, out, time_budget="none")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = out / "candidates" / "hf-fp32" / "bench.pair1.json"
    busy: list[subprocess.Popen] = []
    deadline = time.time() + 900
    while proc.poll() is None and time.time() < deadline:
        if not busy and first.exists():  # the first round has begun: the neighbour arrives
            n = 2 * (os.cpu_count() or 2)
            busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(s=8)]) for _ in range(n)]
        time.sleep(0.05)
    for p in busy:
        p.wait(timeout=60)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, 1), stdout
    sel = json.loads((out / "selection.json").read_text())
    side = sel["side_by_side"]
    if not side:  # no candidate passed its gates: nothing was compared side by side
        assert sel["chosen"] in (None, "hf-fp32")
        return
    assert busy, "the rounds ran, so the neighbour was started during them"
    for cid, pr in side.items():
        assert pr["rounds"] == len(pr["ratios"]) + len(pr["dropped"]), pr
        for r in range(1, pr["rounds"] + 1):
            ref = json.loads((out / "candidates" / "hf-fp32" / f"bench.pair{r}.json").read_text())
            mine = json.loads((out / "candidates" / cid / f"bench.pair{r}.json").read_text())
            probes = [
                b["env"]["probe"][k]["probe_ms"] for b in (ref, mine) for k in ("before", "after")
            ]
            disturbed = max(probes) / min(probes) > 1.25
            # A disturbed round never contributes a ratio; an undisturbed one always does.
            assert (r in pr["dropped"]) == disturbed, (cid, r, probes, pr)
        if pr["dropped"]:
            assert "left out" in pr["note"] or "not comparable" in pr["note"]
    if sel["chosen"] in side and not side[sel["chosen"]]["trusted"]:
        assert "not comparable" in sel["reasons"][sel["chosen"]]
