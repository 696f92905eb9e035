"""What identifies and reproduces a run: run.json (model fingerprint, target, settings, library
versions, seeds, hardware) and doctor.json (the environment section of the report).

Both the main job and `--reverify` read these facts: the re-check compares today's library versions
and hardware fingerprint with the ones the run recorded.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any

from llmopt import __version__
from llmopt.core.atomic import write_json
from llmopt.doctor import run_doctor
from llmopt.rundir.paths import RunDir
from llmopt.verify.stats import DEFAULT_SEED

__all__ = ["run_meta", "versions", "hardware_fingerprint", "write_doctor"]

log = logging.getLogger(__name__)


def run_meta(model, path: Path, info, tgt, settings: dict[str, Any]) -> dict[str, Any]:
    """run.json: identity (model fingerprint, target, settings) plus what reproduces the run."""
    argv = " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "llmopt" else None

    return {
        "llmopt_version": __version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": f"llmopt {argv}" if argv else f"optimize({str(model)!r}, target={tgt.device!r})",
        "model": str(model),
        "model_path": str(path),
        "model_fingerprint": info.fingerprint,
        "target": tgt.device,
        "max_quality_drop": settings["max_quality_drop"],
        "settings": settings,
        "versions": versions(),
        "seeds": {
            "bootstrap": DEFAULT_SEED,
            "data": "fixed article split (llmopt.assets.text)",
            "decoding": "greedy",
        },
        "hardware": hardware_fingerprint(tgt),
    }


def versions() -> dict[str, str | None]:
    """Versions of llmopt, Python and every library a candidate's numbers depend on."""
    from importlib import metadata

    out: dict[str, str | None] = {"llmopt": __version__, "python": platform.python_version()}
    for dist in (
        "torch",
        "transformers",
        "numpy",
        "onnxruntime",
        "onnx",
        "safetensors",
        "llama-cpp-python",
        "vllm",
        "ray",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def hardware_fingerprint(tgt) -> dict[str, Any]:
    """The facts that make two machines comparable, and a short hash of them."""
    facts = {
        "device": tgt.device,
        "cpu": tgt.cpu,
        "threads": tgt.threads,
        "cores": os.cpu_count(),
        "memory_gib": round(tgt.memory_bytes / 2**30),
        "features": sorted(tgt.features),
        "gpu": (tgt.gpu or {}).get("name"),
        "machine": platform.machine(),
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return {**facts, "fingerprint": digest}


def write_doctor(run: RunDir, target: str) -> None:
    """doctor.json once per run: the environment section of the report."""
    if run.doctor_json.exists():
        return
    try:
        write_json(
            run.doctor_json, run_doctor(target if target in ("cpu", "cuda") else "auto").to_dict()
        )
    except Exception as e:  # the report says the environment is unknown; the run goes on
        log.warning("doctor failed: %s", e)
        write_json(run.doctor_json, {"error": f"{type(e).__name__}: {e}", "findings": []})
