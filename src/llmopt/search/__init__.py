"""The closed-loop search behind `llmopt optimize`.

    space.py      every compatible recipe x engine x engine settings, or the reason it is not
    objective.py  what "best" means: latency, throughput, memory or cost, from a BenchResult
    budget.py     the wall-clock budget (`--time-budget 15m`) and per-task time estimates
    halving.py    successive halving: who survives the cheap screen, and why the others do not
    executor.py   where candidate tasks run: in this machine's worker processes, or as Ray tasks

The stages themselves (build, verify, bench) are `llmopt.worker`; this package only decides which
of them run, at which fidelity, in which order, and where.
"""

from __future__ import annotations

from llmopt.search.budget import Budget, parse_duration
from llmopt.search.objective import OBJECTIVES, Objective, get_objective
from llmopt.search.space import candidate_space

__all__ = [
    "Budget",
    "parse_duration",
    "OBJECTIVES",
    "Objective",
    "get_objective",
    "candidate_space",
]
