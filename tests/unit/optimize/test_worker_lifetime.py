"""A stage's worker process ends when the run that started it ends, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# The middle process plays `llmopt optimize`: it starts a stage-like child that sets itself up
# as a worker does, prints the child's pid, then waits.
PARENT = textwrap.dedent(
    """
    import os, subprocess, sys
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import time; from llmopt.optimize.worker import _die_with_parent; "
         "_die_with_parent(); print('ready', flush=True); time.sleep(120)"],
        env={**os.environ, "LLMOPT_STAGE_PARENT": str(os.getpid())},
        stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    print(child.pid, flush=True)
    child.wait()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(") ")[1][0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_the_worker_dies_with_the_run(how):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(how)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the stage kept running after its run was killed"
    finally:
        parent.kill()
