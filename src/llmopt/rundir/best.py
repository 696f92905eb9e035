"""`best/`: the chosen candidate of a run, as one typed object with one reader and one writer.

    RUN/best/artifact/       the chosen candidate's artifact (hard links into candidates/<id>/)
    RUN/best/candidate.json  which engine, recipe and settings built it
    RUN/best/model.json      the source model's ModelInfo
    RUN/best/launch.json     how to run it: in Python and served (`llmopt serve`)
    RUN/best/deploy.json     what writing the deploy bundle did (best/deploy/, causal LMs)

`optimize` writes it (`write_best`); `serve`, `deploy` and the engines' `load_best` read it
(`Best.read` / `find_best`). Nothing else opens these files.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.core.atomic import atomic_dir, read_json, write_json
from llmopt.core.errors import LlmoptError
from llmopt.core.schema import Candidate
from llmopt.model.files import link_tree
from llmopt.model.info import ModelInfo

__all__ = ["Best", "NoBestError", "find_best", "write_best"]

log = logging.getLogger(__name__)


class NoBestError(LlmoptError):
    """A run directory whose search chose nothing (no candidate passed its quality gate)."""


@dataclass(frozen=True)
class Best:
    """A run's chosen candidate, read from its `best/` folder."""

    dir: Path
    candidate: Candidate
    model: ModelInfo
    launch: dict[str, Any] = field(default_factory=dict)

    @property
    def artifact(self) -> Path:
        return self.dir / "artifact"

    @property
    def recipe(self) -> str:
        return self.candidate.recipe

    @property
    def engine(self) -> str:
        return self.candidate.engine

    @property
    def run_root(self) -> Path | None:
        """The run directory around this `best/`, when there is one (it holds plan and bench)."""
        return self.dir.parent if (self.dir.parent / "run.json").is_file() else None

    @property
    def deploy_plan(self) -> Path:
        """The serving plan the deploy bundle was written for (may not exist)."""
        return self.dir / "deploy" / "plan.json"

    @classmethod
    def is_best_dir(cls, path: str | Path) -> bool:
        p = Path(path)
        return (p / "candidate.json").is_file() and (p / "model.json").is_file()

    @classmethod
    def read(cls, best_dir: str | Path) -> Best:
        """Read a `best/` folder (raises FileNotFoundError when it is not one)."""
        d = Path(best_dir)
        if not cls.is_best_dir(d):
            raise FileNotFoundError(f"{d} is not a best/ folder (no candidate.json + model.json)")
        launch: dict[str, Any] = {}
        if (d / "launch.json").is_file():
            try:
                launch = read_json(d / "launch.json")
            except (OSError, ValueError) as e:  # launch.json only advises; the artifact still loads
                log.warning("%s/launch.json unreadable (%s): not used", d, e)
        return cls(
            dir=d,
            candidate=Candidate.from_dict(read_json(d / "candidate.json")),
            model=ModelInfo.from_dict(read_json(d / "model.json")),
            launch=launch,
        )


def find_best(path: str | Path) -> Best | None:
    """`runs/NAME` or `runs/NAME/best` -> its `Best`; None for anything else (a model folder).

    Raises NoBestError for a run directory whose search chose nothing.
    """
    p = Path(path)
    if Best.is_best_dir(p):
        return Best.read(p)
    if (p / "run.json").is_file():
        if not Best.is_best_dir(p / "best"):
            raise NoBestError(
                f"{p} has no best/: no candidate passed its quality gate",
                hint="see its report.html for why, or serve a model folder instead",
            )
        return Best.read(p / "best")
    return None


def write_best(
    best_dir: Path,
    candidate: Candidate,
    artifact: Path,
    model_json: Path,
    launch: dict[str, Any],
) -> Best:
    """Write `best/` atomically: the artifact (hard links where possible: no second copy on
    disk), candidate.json, model.json and launch.json. Replaces a previous `best/`."""
    with atomic_dir(best_dir) as tmp:
        link_tree(artifact, tmp / "artifact")
        write_json(tmp / "candidate.json", candidate.to_dict())
        shutil.copy2(model_json, tmp / "model.json")
        write_json(tmp / "launch.json", launch)
    return Best.read(best_dir)
