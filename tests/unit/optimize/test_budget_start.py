"""The time budget counts from llmopt's start, not from the creation of the process that runs it:
`bash -c "setup && llmopt optimize"` execs llmopt in a process forked before the setup ran."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from llmopt.optimize.budget import Budget


def test_budget_clock_starts_at_import_not_at_fork(tmp_path):
    # The child sleeps 2 s in the shell, then execs Python (same process, created 2 s earlier).
    code = "from llmopt.optimize.budget import Budget; import time; print(time.time() - Budget.process_start())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        ["bash", "-c", f"sleep 2 && exec {sys.executable} -c '{code}'"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    ).stdout
    assert 0.0 <= float(out) < 1.5, out


def test_process_start_is_before_now():
    assert Budget.process_start() <= time.time()
