"""`llmopt optimize`: the main job and the closed-loop search inside it.

    job.py        optimize(): inspect -> plan -> search -> select -> best/ -> report, top to bottom
    plan.py       the target machine and the candidate list (and what is skipped, why)
    space.py      every compatible recipe x engine x engine settings, or the reason it is not
    objective.py  what "best" means: latency, throughput, memory or cost, from a BenchResult
    budget.py     the wall-clock budget (`--time-budget 15m`) and per-task time estimates
    halving.py    successive halving: who survives the cheap screen, and why the others do not
    loop.py       which candidate tasks run, at which fidelity, in which order, within budget
    executor.py   where candidate tasks run: in this machine's worker processes, or as Ray tasks
    worker.py     one stage (build, verify, bench) of one candidate, in its own process
    select.py     the fastest candidate within the quality budget, and why each other one is not
    reverify.py   `--reverify RUN`: does a finished run's choice still hold?
"""

from __future__ import annotations

from llmopt.optimize.job import OptimizeResult, optimize, reverify

__all__ = ["optimize", "reverify", "OptimizeResult"]
