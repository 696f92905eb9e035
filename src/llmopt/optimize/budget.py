"""The wall-clock budget of a search (`--time-budget 15m`) and time estimates for its tasks.

The budget counts this invocation's wall time (a resumed run gets its budget afresh and reuses
everything already measured). A task is started only when its estimate fits in what is left after
`reserve_s` (selection, best/ and the report), with one exception: a search always screens its
`SCREEN_FLOOR` cheapest candidates while any time is left (`Budget.floor_allows`), because a
search that compares nothing has answered nothing, and an estimate can be wrong (a reference
timed on a busy machine); the stage deadline still stops a screen that would overrun.

Estimates are medians of what was observed (`typical`), so one contended measurement does not
set them, and a cut says which budget would have allowed the rest (`Budget.exhausted`).
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field

__all__ = [
    "Budget",
    "parse_duration",
    "default_budget",
    "DEFAULT_BUDGETS",
    "format_duration",
    "typical",
    "SCREEN_FLOOR",
]

# Candidates screened whatever the estimates say, in screening order, while time is left.
SCREEN_FLOOR = 2

_UNITS = {"s": 1, "m": 60, "h": 3600}

# The budget a run gets when none is given: (parameters below, seconds). A small model's quick
# start must answer in minutes (the built-in SmolLM2 on a 2-core CPU: docs/benchmarks.md); a
# larger one needs longer for its reference alone, whose evaluation is never cut.
DEFAULT_BUDGETS = ((1_000_000_000, 300.0), (None, 1800.0))


def default_budget(num_parameters: int | None) -> tuple[float, str]:
    """The default time budget for a model of `num_parameters`, and a sentence saying so.

    >>> default_budget(134_515_008)[0], default_budget(8_000_000_000)[0]
    (300.0, 1800.0)
    """
    n = num_parameters or 0
    for below, seconds in DEFAULT_BUDGETS:
        if below is None or n < below:
            size = f"under {below / 1e9:.0f}B parameters" if below else "of 1B parameters or more"
            return seconds, (
                f"{seconds / 60:.0f} min, the default for a model {size} "
                "(--time-budget 15m for a longer search, --time-budget none for no limit)"
            )
    raise AssertionError("DEFAULT_BUDGETS ends with an open bound")


def parse_duration(text: str | float | int | None) -> float | None:
    """Seconds in "90s", "15m", "1h30m", "2.5h" or a bare number of seconds; None and "none"
    (no limit) give None.

    >>> parse_duration("15m"), parse_duration("1h30m"), parse_duration("45"), parse_duration("none")
    (900.0, 5400.0, 45.0, None)
    """
    if text is None or isinstance(text, int | float):
        return None if text is None else float(text)
    s = text.strip().lower()
    if s in ("none", "off", "unlimited"):
        return None
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smh])", s)
    if not parts or "".join(f"{n}{u}" for n, u in parts) != s.replace(" ", ""):
        raise ValueError(f"cannot read time budget {text!r}; write it like 90s, 15m, 1h or 1h30m")
    total = sum(float(n) * _UNITS[u] for n, u in parts)
    if total <= 0:
        raise ValueError(f"time budget must be positive, got {text!r}")
    return total


def format_duration(seconds: float) -> str:
    """A budget as `--time-budget` takes it, rounded up to whole minutes.

    >>> format_duration(1150), format_duration(3600), format_duration(5430)
    ('20m', '1h', '1h31m')
    """
    m = max(1, math.ceil(seconds / 60))
    h, m = divmod(m, 60)
    return f"{h}h{m}m" if h and m else f"{h}h" if h else f"{m}m"


def typical(samples: list[float], default: float) -> float:
    """The estimate of the next task of a kind: the median of the observed ones (`default` when
    none), so one measurement taken under contention does not set it.

    >>> typical([40.0, 42.0, 560.0], 100.0), typical([], 100.0)
    (42.0, 100.0)
    """
    return float(statistics.median(samples)) if samples else float(default)


@dataclass
class Budget:
    """Seconds allowed for this invocation (None = unlimited), and what is left of them."""

    seconds: float | None
    reserve_s: float = 20.0
    started: float = field(default_factory=time.monotonic)
    wall_start: float = field(default_factory=time.time)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def left(self) -> float | None:
        return None if self.seconds is None else self.seconds - self.elapsed

    def fits(self, estimate_s: float, parallel: int = 1, reserve_s: float | None = None) -> bool:
        """Whether a task of `estimate_s` (spread over `parallel` workers) fits before the end,
        keeping `reserve_s` (default: the budget's) for what comes after it."""
        if self.seconds is None:
            return True
        keep = self.reserve_s if reserve_s is None else reserve_s
        return self.elapsed + estimate_s / max(1, parallel) <= self.seconds - keep

    def floor_allows(self, started: int, floor: int = SCREEN_FLOOR) -> bool:
        """Whether a screen must start anyway: fewer than `floor` started and time is left
        before the reserve (the stage deadline stops it if it overruns)."""
        if started >= floor:
            return False
        return self.seconds is None or self.elapsed < self.seconds - self.reserve_s

    def exhausted(self, what: str, estimate_s: float, rest_s: float, parallel: int = 1) -> str:
        """Why a task was not started, and the `--time-budget` that would have allowed it and
        everything after it (`rest_s`: their estimated seconds, this one's included).

        >>> b = Budget(900.0, started=time.monotonic() - 562)
        >>> b.exhausted("the build and screen", 1150, 2300).split("; ")[1]
        '--time-budget 49m would allow the rest (~2300 s of tasks)'
        """
        left = max(0.0, self.left or 0.0)
        need = self.elapsed + rest_s / max(1, parallel) + self.reserve_s
        return (
            f"time budget exhausted: {what} needs ~{estimate_s:.0f} s, {left:.0f} s left of "
            f"{self.seconds or 0:.0f} s; --time-budget {format_duration(need)} would allow the "
            f"rest (~{rest_s:.0f} s of tasks)"
        )

    @property
    def deadline(self) -> float | None:
        """Epoch seconds by which candidate stages must end (half the reserve left after it for
        selection and the report); a stage still running then is killed and recorded as cut."""
        if self.seconds is None:
            return None
        return self.wall_start + self.seconds - self.reserve_s / 2

    @classmethod
    def since(cls, seconds: float | None, started_at: float | None = None) -> Budget:
        """A budget whose clock started at epoch `started_at` (e.g. the CLI process's start, so
        its imports count too); None: now."""
        if started_at is None:
            return cls(seconds)
        ago = max(0.0, time.time() - started_at)
        return cls(seconds, started=time.monotonic() - ago, wall_start=started_at)

    @staticmethod
    def process_start() -> float:
        """When this llmopt process started its work (epoch seconds): the first import of
        `llmopt`, so interpreter start-up and imports count, a parent shell's earlier work not."""
        import llmopt

        return llmopt.IMPORTED_AT

    def to_dict(self) -> dict[str, float | None]:
        return {"seconds": self.seconds, "elapsed_s": round(self.elapsed, 1)}
