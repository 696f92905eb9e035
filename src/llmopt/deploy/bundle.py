"""`llmopt deploy`: a ready-to-run bundle for a run's chosen candidate or a model folder.

    resolve_source   run directory (best/ artifact + chosen recipe) or model folder -> ModelInfo
    plan_serving     the same plan `llmopt plan` prints, for the model mounted at /models/model
    render           Dockerfile, compose, nginx, Kubernetes, start.sh, launch/, README, plan.json
    validate         every validator available here (deploy.validate), results in bundle.json

The bundle is built under a temporary name and renamed when complete (atomic_dir). It never
holds weights: the model folder stays where it is and is mounted read-only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmopt.assets.models import BUILTIN_MODELS
from llmopt.core.atomic import atomic_dir, write_json, write_text
from llmopt.core.errors import LlmoptError
from llmopt.core.recipes import RECIPES
from llmopt.deploy import templates as T
from llmopt.deploy.embedder import embedder_files, plan_embedder
from llmopt.deploy.readme import bundle_readme
from llmopt.deploy.source import DeploySource
from llmopt.deploy.validate import CheckResult, validate_bundle
from llmopt.model.info import CONFIG_ONLY, inspect_model
from llmopt.planning.serving import plan_serving
from llmopt.rundir.best import NoBestError, find_best

if TYPE_CHECKING:
    from llmopt.hardware.target import Target
    from llmopt.planning.serving import ServingPlan
    from llmopt.planning.workload import Workload

__all__ = ["DeploySource", "DeployResult", "resolve_source", "write_bundle"]

# Recipe (from a run's chosen candidate) -> (serving weight precision, dtype of the rest).
_RECIPE_PRECISION = {
    "fp32": ("float32", "float32"),
    "bf16": ("bfloat16", "bfloat16"),
    "fp16": ("float16", "float16"),
    "w8a16": ("int8", None),  # compressed-tensors int8 weights; vLLM reads the scheme from config
    "w8a8-dynamic": ("int8", None),
}


def _recipe_precision(name: str | None) -> tuple[str, str | None] | None:
    """(weight precision for the memory math, dtype flag) of a recipe; None: plan's default."""
    if not name:
        return None
    if name in _RECIPE_PRECISION:
        return _RECIPE_PRECISION[name]

    rec = RECIPES.get(name)
    if rec is None or rec.weight_bits is None or getattr(rec, "weight_type", "int") != "int":
        # FP8 checkpoints carry their scheme in config.json; vLLM must not get --quantization fp8
        # on top of it, so they keep the default (bf16) memory math: an overestimate, never short.
        return None
    return ("int4" if rec.weight_bits == 4 else "int8"), None


class DeployError(LlmoptError):
    """The source cannot be deployed (wrong kind of folder, unsupported task)."""


@dataclass
class DeployResult:
    out: Path
    plan: ServingPlan
    source: DeploySource
    files: list[str]
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "failed" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "ok": self.ok,
            "source": {
                "kind": self.source.kind,
                "model_dir": str(self.source.model_dir),
                "recipe": self.source.recipe,
                "candidate": self.source.candidate,
            },
            "files": self.files,
            "checks": [c.to_dict() for c in self.checks],
            "plan": self.plan.to_dict(),
        }


def resolve_source(path: str | Path, *, params: float | None = None) -> DeploySource:
    """A run directory (its best/ artifact) or a model folder, as something to deploy.

    Args:
        path: `runs/NAME` written by `llmopt optimize`, its `best/` folder, an HF folder, or a
            built-in model's name.
        params: parameter count override for config-only folders.

    Raises:
        DeployError: a run without a chosen candidate, or a model llmopt cannot serve yet.
    """

    if isinstance(path, str) and path in BUILTIN_MODELS and not Path(path).exists():
        # A built-in name, as every other command takes it (prepared on first use).
        path = Path(inspect_model(path).path)
    p = Path(path).resolve()
    try:
        best = find_best(p)
    except NoBestError as e:
        raise DeployError(
            e.message,
            hint="look at report.html, relax --max-quality-drop, or deploy the model folder",
        ) from e
    if best is not None:
        src = DeploySource(
            best.model, best.artifact, "run", best.recipe, best.candidate.id, best.launch
        )
    else:
        info = inspect_model(str(p), params=params, config_only="auto")
        src = DeploySource(info, p, "config" if info.weight_format == CONFIG_ONLY else "model")
    if src.info.task not in ("causal-lm", "embedding"):
        raise DeployError(
            f"{src.info.name} is a {src.info.task} model; bundles serve causal LMs and embedders",
            hint="serve it in Python with llmopt.engines.load_best(RUN/best)",
        )
    return src


def _files(plan: ServingPlan, image: str, model_dir: Path) -> dict[str, str]:
    files = {
        "Dockerfile": T.dockerfile(plan),
        ".dockerignore": T.dockerignore(),
        "start.sh": T.start_script(plan),
        "plan.json": json.dumps(plan.to_dict(), indent=2, default=str) + "\n",
        "docker-compose.yml": T.compose(plan),
        ".env": f"# Host folder with the model (mounted read-only at {T.MODEL_MOUNT}).\n"
        f"MODEL_DIR={model_dir}\nIMAGE={image}\n",
        "nginx/llm.conf": T.nginx_conf(),
        "nginx/llm-tls.conf": T.nginx_tls_conf(),
        "k8s.yaml": T.kubernetes(plan, image),
    }
    for name, cfg in plan.launch.items():  # the alternatives, ready to run by hand
        files[f"launch/{name}.sh"] = (
            f'#!/usr/bin/env bash\n# {name}: {"; ".join(cfg.notes) or "see README.md"}\nexec {cfg.command} "$@"\n'
        )
        for fname, content in cfg.files.items():
            files[f"launch/{fname}"] = content
    return files


def write_bundle(
    source: DeploySource,
    out: str | Path,
    target: Target,
    workload: Workload | None = None,
    *,
    image: str | None = None,
    validate: bool = True,
    **plan_kw: Any,
) -> DeployResult:
    """Plan serving for `source` on `target` and write the bundle folder `out` atomically.

    Args:
        source: from `resolve_source`.
        out: bundle folder (replaced if it exists).
        target: hardware, e.g. `Target.gpu_model("H200")`.
        workload: request shape and SLOs.
        image: container image name used by compose and Kubernetes.
        validate: run the validators available here (results in bundle.json).
        plan_kw: passed to `plan_serving` (precision, kv_dtype, tp, ...).

    >>> src = resolve_source("runs/smollm2-135m")                        # doctest: +SKIP
    >>> res = write_bundle(src, "deploy/smollm2", Target.gpu_model("L4"))  # doctest: +SKIP
    >>> res.ok                                                             # doctest: +SKIP
    True
    """

    if source.info.task == "embedding":
        return _write_embedder_bundle(source, Path(out), target, image, validate)
    if _recipe_precision(source.recipe):  # serve what was verified, unless told otherwise
        precision, dtype = _recipe_precision(source.recipe)
        plan_kw.setdefault("precision", precision)
        if dtype:
            plan_kw.setdefault("dtype", dtype)
    # Inside the container the server must listen on all interfaces so the published port and
    # the nginx sidecar reach it; the host side publishes it on 127.0.0.1 unless told otherwise.
    plan = plan_serving(
        source.info, target, workload, model_path=T.MODEL_MOUNT, host="0.0.0.0", **plan_kw
    )
    image = image or f"llmopt/{T.slug(source.info.name)}:latest"
    files = _files(plan, image, source.model_dir)
    files["README.md"] = bundle_readme(plan, source, image)
    out = Path(out)
    # A bundle for a plan that does not fit is written (to inspect) but reported as failed.
    fits = CheckResult("plan", "passed" if plan.fits else "failed", "llmopt plan", plan.notes[0])
    checks = _write_files(out, files, source, source.model_dir, validate, first=[fits])
    return DeployResult(out, plan, source, sorted(files) + ["bundle.json"], checks)


def _write_embedder_bundle(
    source: DeploySource, out: Path, target: Target, image: str | None, validate: bool
) -> DeployResult:
    """The embedder bundle (`llmopt.deploy.embedder`): same layout, validators and manifest."""
    plan = plan_embedder(source, target, source.launch)
    image = image or f"llmopt/{T.slug(source.info.name)}:latest"
    # A run mounts its best/ folder (llmopt serves it); a model folder is mounted as it is.
    mount = source.model_dir.parent if source.kind == "run" else source.model_dir
    files = embedder_files(plan, image, str(mount))
    checks = _write_files(out, files, source, mount, validate)
    return DeployResult(out, plan, source, sorted(files) + ["bundle.json"], checks)  # type: ignore[arg-type]


def _write_files(
    out: Path,
    files: dict[str, str],
    source: DeploySource,
    model_dir: Path,
    validate: bool,
    first: list[CheckResult] | None = None,
) -> list[CheckResult]:
    """Write a bundle's `files` to `out` atomically, run the validators available here, and
    write `bundle.json` (the source, each file's sha256, the checks: `first`, then the
    validators'). Returns the checks."""
    with atomic_dir(out) as tmp:
        tmp.chmod(0o755)  # a bundle is shared and built by others: not the temp dir's 0700
        for rel, text in files.items():
            write_text(tmp / rel, text)
            (tmp / rel).chmod(0o755 if rel.endswith(".sh") else 0o644)
            (tmp / rel).parent.chmod(0o755)
        checks = [*(first or []), *(validate_bundle(tmp) if validate else [])]
        manifest = {
            "generator": "llmopt deploy",
            "source": {
                "kind": source.kind,
                "model_dir": str(model_dir),
                "recipe": source.recipe,
                "candidate": source.candidate,
                "fingerprint": source.info.fingerprint,
            },
            "files": {
                rel: hashlib.sha256(text.encode()).hexdigest()
                for rel, text in sorted(files.items())
            },
            "checks": [c.to_dict() for c in checks],
        }
        write_json(tmp / "bundle.json", manifest).chmod(0o644)
    return checks
