"""What a bundle deploys: the model facts, the folder to mount, the verified recipe if any.

Its own module because both the bundle writer (`llmopt.deploy.bundle`) and the README renderer
(`llmopt.deploy.readme`) need it, and the writer imports the renderer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmopt.hardware.target import Target
    from llmopt.model.info import ModelInfo

__all__ = ["DeploySource", "run_target"]


@dataclass
class DeploySource:
    """What is deployed: the model facts, the folder to mount, and the verified recipe if any."""

    info: ModelInfo
    model_dir: Path
    kind: str  # "run" | "model" | "config"
    recipe: str | None = None
    candidate: str | None = None
    launch: dict[str, Any] = field(default_factory=dict)  # a run's best/launch.json


def run_target(model_dir: Path) -> Target | None:
    """The target a run was optimized for, from the run that holds `model_dir` (its
    `best/artifact`): plan.json's recorded target, else run.json's device on this machine; None
    when `model_dir` is not in a run or the run recorded none.

    What was measured there is what is deployed: a run chosen on the CPU deploys for the CPU.
    """
    from llmopt.core.atomic import read_json  # lazy: only deploy of a run reads these
    from llmopt.hardware.target import Target

    run = Path(model_dir).resolve().parent.parent  # RUN/best/artifact -> RUN
    try:
        recorded = read_json(run / "plan.json").get("target")
    except (OSError, ValueError):
        recorded = None
    if isinstance(recorded, dict) and recorded.get("device") in ("cpu", "cuda"):
        return Target.from_dict(recorded)
    try:
        meta = read_json(run / "run.json")
    except (OSError, ValueError):
        return None
    device = meta.get("target")
    if device == "cpu":
        return Target.cpu_host((meta.get("settings") or {}).get("threads"))
    return None
