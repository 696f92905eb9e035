"""`llmopt optimize`: the main job and the closed-loop search inside it.

job.py        optimize(): inspect -> plan -> search -> select -> best/ -> report, top to bottom
runmeta.py    run.json (identity, versions, hardware fingerprint) and doctor.json
profiles.py   StageProfile: the sizes of each fidelity's verify and bench work (full, screen)
plan.py       the target machine and its memory math
space.py      the plan: every compatible recipe x engine x engine settings, or why it is not
objective.py  what "best" means: latency, throughput, memory or cost, from a BenchResult
budget.py     the wall-clock budget (`--time-budget 15m`) and per-task time estimates
halving.py    successive halving: who survives the cheap screen, and why the others do not
loop.py       which candidate tasks run, at which fidelity, in which order, within budget
executor.py   where candidate tasks run: in this machine's worker processes, or as Ray tasks
worker.py     one stage (build, verify, bench) of one candidate, in its own process
select.py     SelectionInput -> the fastest candidate within the quality budget, and why each
              other one is not
reverify.py   `--reverify RUN`: does a finished run's choice still hold?
"""

from __future__ import annotations

from llmopt.optimize.job import OptimizeResult, optimize
from llmopt.optimize.reverify import reverify

__all__ = ["optimize", "reverify", "OptimizeResult"]
