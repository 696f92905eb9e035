"""The run directory: where every stage of `optimize` reads and writes (the layout below).

    RUN/run.json  model.json  plan.json  selection.json  report.md  report.html
    RUN/candidates/<id>/{candidate.json, artifact/, build.json, verify.json, bench.json, log.txt}
    RUN/candidates/<id>/{verify.screen.json, bench.screen.json}  the cheap screen (fidelity 1)
    RUN/candidates/<id>/task.<rung>.json   where and how long each search task ran
    RUN/search.json   the search of the last invocation: objective, budget, rungs, cuts, executor
    RUN/reference/   outputs of the reference candidate other candidates compare against
    RUN/best/        the chosen candidate's artifact and launch configuration

A stage is finished when its JSON exists: each is written atomically after the stage's work, and
artifacts are built under a temporary name and renamed (llmopt.core.atomic). Resuming therefore means
"skip what exists"; a killed stage leaves only `.tmp-*` entries, which are ignored and cleared.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.core.atomic import read_json, write_json
from llmopt.core.errors import RunDirError

__all__ = ["RunDir", "CandidateDir", "STAGES", "FIDELITIES"]

STAGES = ("build", "verify", "bench")
# "full" writes <stage>.json; any other fidelity <stage>.<fidelity>.json ("screen": the cheap
# first rung of the search; "pair1", "pair2", ...: the rounds of the side-by-side benchmark of
# the finalists; "tune1", ...: the chosen one's settings variations; "reverify": `optimize
# --reverify`). Build has one fidelity.
_ROUNDS = tuple(f"{k}{r}" for k in ("pair", "tune") for r in range(1, 5))
FIDELITIES = ("screen", "full", "reverify", *_ROUNDS)
# run.json keys that must match for a run directory to be resumed rather than refused.
IDENTITY_KEYS = ("model_fingerprint", "target", "settings")


@dataclass(frozen=True)
class CandidateDir:
    root: Path

    @property
    def id(self) -> str:
        return self.root.name

    @property
    def artifact(self) -> Path:
        return self.root / "artifact"

    @property
    def log(self) -> Path:
        return self.root / "log.txt"

    def stage_file(self, stage: str, fidelity: str = "full") -> Path:
        assert stage in STAGES or stage in ("candidate", "error"), f"unknown stage {stage!r}"
        assert fidelity in FIDELITIES, f"unknown fidelity {fidelity!r}"
        if fidelity == "full" or stage in ("build", "candidate", "error"):
            return self.root / f"{stage}.json"
        return self.root / f"{stage}.{fidelity}.json"

    def task_file(self, rung: str) -> Path:
        return self.root / f"task.{rung}.json"

    def done(self, stage: str, fidelity: str = "full") -> bool:
        return self.stage_file(stage, fidelity).exists()

    def read(self, stage: str, fidelity: str = "full") -> dict[str, Any] | None:
        f = self.stage_file(stage, fidelity)
        return read_json(f) if f.exists() else None


class RunDir:
    """Paths and resume rules of one run directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    # The run's top-level files, spelled out so that a type checker and a reader see them.
    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def model_json(self) -> Path:
        return self.root / "model.json"

    @property
    def plan_json(self) -> Path:
        return self.root / "plan.json"

    @property
    def selection_json(self) -> Path:
        return self.root / "selection.json"

    @property
    def search_json(self) -> Path:
        return self.root / "search.json"

    @property
    def doctor_json(self) -> Path:
        return self.root / "doctor.json"

    @property
    def reverify_json(self) -> Path:
        return self.root / "reverify.json"

    @property
    def report_md(self) -> Path:
        return self.root / "report.md"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def reference(self) -> Path:
        return self.root / "reference"

    @property
    def best(self) -> Path:
        return self.root / "best"

    def candidate(self, cid: str) -> CandidateDir:
        return CandidateDir(self.root / "candidates" / cid)

    def candidates(self) -> list[CandidateDir]:
        base = self.root / "candidates"
        return (
            sorted(
                (
                    CandidateDir(p)
                    for p in base.iterdir()
                    if p.is_dir() and not p.name.startswith(".")
                ),
                key=lambda c: c.id,
            )
            if base.exists()
            else []
        )

    def open(self, meta: dict[str, Any], force: bool = False) -> bool:
        """Start a new run or resume a matching one. Returns True when resuming.

        Raises RunDirError when the folder holds a run of a different model or settings
        (unless `force`, which starts over in place).
        """
        if self.run_json.exists():
            old = read_json(self.run_json)
            diff = [k for k in IDENTITY_KEYS if old.get(k) != meta.get(k)]
            if not diff:
                return True
            if not force:
                raise RunDirError(
                    f"{self.root} holds a run with different {', '.join(diff)} "
                    f"(model {old.get('model')!r}, target {old.get('target')!r})",
                    hint="choose another --out folder, or pass --force to discard that run",
                )
            shutil.rmtree(self.root)
        elif self.root.exists() and any(self.root.iterdir()):
            raise RunDirError(
                f"{self.root} exists, is not empty and is not an llmopt run directory",
                hint="choose a new or empty --out folder",
            )
        write_json(self.run_json, meta)
        return False
