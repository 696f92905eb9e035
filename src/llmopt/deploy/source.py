"""What a bundle deploys: the model facts, the folder to mount, the verified recipe if any.

Its own module because both the bundle writer (`llmopt.deploy.bundle`) and the README renderer
(`llmopt.deploy.readme`) need it, and the writer imports the renderer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmopt.model.info import ModelInfo

__all__ = ["DeploySource"]


@dataclass
class DeploySource:
    """What is deployed: the model facts, the folder to mount, and the verified recipe if any."""

    info: ModelInfo
    model_dir: Path
    kind: str  # "run" | "model" | "config"
    recipe: str | None = None
    candidate: str | None = None
    launch: dict[str, Any] = field(default_factory=dict)  # a run's best/launch.json
