"""Process facts: the peak RSS a benchmark reports is its own process's."""

from __future__ import annotations


def test_peak_rss_is_the_process_own_not_inherited():
    import subprocess
    import sys

    from llmopt.hardware.runtime import peak_rss_bytes

    ballast = bytearray(400 * 2**20)  # the parent touches 400 MiB
    ballast[::4096] = b"x" * len(ballast[::4096])
    assert peak_rss_bytes() > 400 * 2**20
    code = "from llmopt.hardware.runtime import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    assert child < 200 * 2**20, (
        f"child reports {child / 2**20:.0f} MiB: inherited the parent's peak"
    )
    del ballast
