"""Progress of `llmopt optimize` as it runs: a live table in a terminal, plain lines elsewhere.

The job reports through one callback, `progress(event, candidate_id, stage, detail)` (events
"start", "done", "skip", "fail", "cut" from the executor and the search; "note", a message, and
"budget", its seconds, and "rundir", the run directory, from the job with no candidate). A long
stage (a calibration, a GGUF conversion, a compilation) shows its own progress: the last line of
the candidate's log, in the table's "now" column, or every `heartbeat_s` as a line of its own. Where the output is a terminal, a rich live view shows one row per candidate (its
stage, state, elapsed time, quality and speed so far) under a line with the budget left; where it
is not (a log file, CI, a notebook), each event is one timestamped line, flushed at once, so a
log shows where the run is while it runs.

>>> import io
>>> buf = io.StringIO()
>>> p = OptimizeProgress(live=False, stream=buf, clock=lambda: 100.0)
>>> with p:
...     p("start", "hf-fp32", "bench", "screen")
...     p("done", "hf-fp32", "bench", "decode 45.1 tok/s")
>>> for line in buf.getvalue().splitlines():  # the wall-clock time first, then the rest
...     print(line.split(" ", 1)[1])
+0:00  inspecting and planning (a built-in is prepared once)
+0:00  start  bench   hf-fp32 (screen)
+0:00  done   bench   hf-fp32  decode 45.1 tok/s
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["OptimizeProgress"]

_VERBS = {"build": "building", "verify": "verifying", "bench": "benchmarking", "search": "search"}
_STYLE = {"done": "green", "fail": "red", "cut": "yellow", "skip": "dim", "start": "cyan"}
_STATE_STYLE = {
    "running": "cyan",
    "done": "green",
    "failed": "red",
    "cut": "yellow",
    "reused": "dim",
}


@dataclass
class _Row:
    stage: str = ""
    state: str = "waiting"
    started: float | None = None
    seconds: float = 0.0  # time spent in finished stages
    last_s: float = 0.0  # the last finished stage's time
    quality: str = ""
    speed: str = ""
    detail: str = ""


def _clock_str(seconds: float) -> str:
    s = int(max(0.0, seconds))
    return f"{s // 60}:{s % 60:02d}"


class OptimizeProgress:
    """The `progress` callback of `optimize` (and `--reverify`), as a context manager.

    Args:
        enabled: False prints nothing (the `--json` paths).
        live: a live table (True) or one line per event (False); default: whether `stream`
            is a terminal.
        budget_s: the run's time budget in seconds (None: no limit), for the "left" column.
        started_at: epoch seconds the budget counts from (default: now).
        stream: where the lines go (default: standard output).
        clock: time source (tests).
        heartbeat_s: off a terminal, a running stage is reported again this often (0: never).
    """

    def __init__(
        self,
        enabled: bool = True,
        live: bool | None = None,
        budget_s: float | None = None,
        started_at: float | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.time,
        heartbeat_s: float = 30.0,
    ):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.clock = clock
        self.t0 = started_at if started_at is not None else clock()
        self.budget_s = budget_s
        self.rows: dict[str, _Row] = {}
        self.notes: list[str] = []
        self._live: Live | None = None
        self.run_dir: Path | None = None
        self.heartbeat_s = heartbeat_s
        self._beats: dict[str, float] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # -- context manager ------------------------------------------------------------------
    def __enter__(self) -> OptimizeProgress:
        if self.enabled and self.live:
            console = Console(file=self.stream, force_terminal=True)
            self._live = Live(self._render(), console=console, refresh_per_second=2)
            self._live.__enter__()
        elif self.enabled:
            self._line("note", "", "", "inspecting and planning (a built-in is prepared once)")
        if self.enabled and (self.live or self.heartbeat_s > 0):
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc)
            self._live = None

    def _tick(self) -> None:
        """Once a second: redraw the live view (elapsed times, log lines), or off a terminal
        report each stage that has run `heartbeat_s` since it was last reported."""
        while not self._stop.wait(1.0):
            with self._lock:
                if self._live is not None:
                    self._live.update(self._render())
                    continue
                now = self.clock()
                for cid, row in self.rows.items():
                    if row.state != "running" or row.started is None:
                        continue
                    if now - self._beats.get(cid, row.started) >= self.heartbeat_s:
                        self._beats[cid] = now
                        tail = self.last_log_line(cid)
                        took = _clock_str(now - row.started)
                        self._line(
                            "still", cid, row.stage, f"{took}" + (f"  {tail}" if tail else "")
                        )

    def last_log_line(self, cid: str) -> str:
        """The last line of the candidate's log.txt (what a long stage last said), or ""."""
        if self.run_dir is None:
            return ""
        f = self.run_dir / "candidates" / cid / "log.txt"
        try:
            with open(f, "rb") as fh:
                fh.seek(max(0, f.stat().st_size - 4096))
                lines = fh.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        last = lines[-1].strip() if lines else ""
        # "2026-12-02 05:01:02,123 llmopt... INFO calibrate 12/30" -> the message alone
        return last.split(" INFO ", 1)[-1][:100]

    # -- the callback -----------------------------------------------------------------------
    def __call__(self, event: str, cid: str, stage: str, detail: str) -> None:
        with self._lock:
            self._event(event, cid, stage, detail)

    def _event(self, event: str, cid: str, stage: str, detail: str) -> None:
        now = self.clock()
        if event == "rundir":
            self.run_dir = Path(detail)
            return
        if event == "budget":
            self.budget_s = float(detail)
            return
        if event == "note":
            self.notes.append(detail)
        elif cid:
            row = self.rows.setdefault(cid, _Row())
            if event == "start":
                row.stage, row.state, row.started, row.detail = stage, "running", now, detail
                self._beats.pop(cid, None)  # the next heartbeat counts from this stage's start
            else:
                if row.started is not None:
                    row.last_s = now - row.started
                    row.seconds += row.last_s
                    row.started = None
                row.stage = stage or row.stage
                row.state = {"done": "done", "skip": "reused"}.get(event, event)
                row.detail = detail
                if event == "done" and stage == "verify" and detail:
                    row.quality = detail
                elif event == "done" and stage == "bench" and detail:
                    row.speed = detail
                elif event == "fail":
                    row.state = "failed"
        if not self.enabled:
            return
        if self._live is not None:
            if event in ("fail", "cut", "note"):  # keep these above the table for good
                self._live.console.print(self._message(event, cid, stage, detail))
            self._live.update(self._render())
        elif event != "skip":  # reused stages are summarized at the end, not one line each
            self._line(event, cid, stage, detail)

    # -- plain lines -------------------------------------------------------------------------
    def _line(self, event: str, cid: str, stage: str, detail: str) -> None:
        now = self.clock()
        wall = time.strftime("%H:%M:%S", time.localtime(now))
        head = f"{wall} +{_clock_str(now - self.t0)}  {event:<6} {stage:<7} {cid}"
        if event == "start":
            text = f"{head} ({detail})" if detail else head
        else:
            row = self.rows.get(cid)
            took = f" {row.last_s:.1f} s" if row and event == "done" and row.last_s else ""
            text = f"{head}{took}  {detail}" if detail else f"{head}{took}"
        if event == "note":
            text = f"{wall} +{_clock_str(now - self.t0)}  {detail}"
        print(text.rstrip(), file=self.stream, flush=True)

    def _message(self, event: str, cid: str, stage: str, detail: str) -> Text:
        if event == "note":
            return Text(detail)
        return Text(f"{cid}: {stage} {event}: {detail}", style=_STYLE.get(event, ""))

    # -- the live view ------------------------------------------------------------------------
    def _render(self) -> Group:
        now = self.clock()
        elapsed = now - self.t0
        head = f"elapsed {_clock_str(elapsed)}"
        if self.budget_s:
            left = self.budget_s - elapsed
            head += f"  ·  budget {_clock_str(self.budget_s)}, {_clock_str(left)} left"
            head += f"  ·  ends by {time.strftime('%H:%M:%S', time.localtime(self.t0 + self.budget_s))} at the latest"
        t = Table(expand=False, box=None, pad_edge=False)
        for col in ("candidate", "stage", "state", "elapsed", "quality", "speed", "now"):
            t.add_column(col)
        for cid, row in self.rows.items():
            running = row.seconds + (now - row.started if row.started is not None else 0.0)
            state = Text(row.state, style=_STATE_STYLE.get(row.state, ""))
            stage = _VERBS.get(row.stage, row.stage) if row.state == "running" else row.stage
            now_says = self.last_log_line(cid) if row.state == "running" else ""
            t.add_row(cid, stage, state, f"{running:.0f} s", row.quality, row.speed, now_says)
        return Group(Text(head, style="bold"), t)
