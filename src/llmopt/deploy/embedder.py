"""Bundles for embedding models: the same files and validators as LM bundles, another server.

What serves the embedder:

- a run's chosen candidate (an ONNX Runtime, OpenVINO or transformers artifact) is served by
  llmopt's own server (`llmopt serve BEST --host 0.0.0.0`), because only llmopt loads those
  artifacts; the run's `best/` folder is mounted read-only where LM bundles mount the model;
- a model folder on a GPU target is served by vLLM's pooling runner (`vllm serve MODEL
  --runner pooling`), which loads the Hugging Face folder as it is; on a CPU target by llmopt.

The recalibrated similarity threshold of the run (best/launch.json, written by `llmopt optimize
--threshold`) goes into plan.json and into the container's environment as
`LLMOPT_SIMILARITY_THRESHOLD`, next to the threshold it replaces, so the application reads the
threshold that was verified instead of the one hard-coded for the reference model.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmopt.deploy import templates as T

if TYPE_CHECKING:
    from llmopt.deploy.source import DeploySource
    from llmopt.hardware.target import Target

__all__ = ["EmbedderPlan", "plan_embedder", "embedder_files"]

# llmopt is installed into the image from this requirement; point it at a wheel or a git URL
# with `docker build --build-arg LLMOPT_SPEC=...` where llmopt is not on your package index.
LLMOPT_SPEC = "llmopt[serve,onnx,openvino]"


@dataclass(frozen=True)
class EmbedderPlan:
    """What the embedder bundle runs: the server, its command, the device it needs.

    Duck-types the few `ServingPlan` fields the shared templates read (model name, target kind,
    tensor/pipeline split, replicas), so compose, nginx and Kubernetes files are the LM ones.
    """

    model: dict[str, Any]
    target: Any
    served_by: str  # "llmopt" | "vllm"
    argv: list[str]
    threads: int | None
    threshold: dict[str, Any] | None
    engine: str | None
    recipe: str | None
    replicas: int = 1

    @property
    def memory(self) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(tp=1, pp=1)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "embedding",
            "model": self.model,
            "target": {"kind": self.target.kind, "name": self.target.name},
            "served_by": self.served_by,
            "engine": self.engine,
            "recipe": self.recipe,
            "threads": self.threads,
            "similarity_threshold": self.threshold,
            "launch": {},
        }
        if self.served_by == "vllm":
            out["launch"]["vllm"] = {"argv": self.argv}
        else:
            out["launch"]["llmopt"] = {"argv": self.argv}
        return out


def plan_embedder(source: DeploySource, target: Target, launch: dict[str, Any]) -> EmbedderPlan:
    """Choose the server of an embedder bundle (see the module docstring).

    Args:
        source: from `resolve_source` (a run's best/ or a model folder).
        target: the hardware it is for.
        launch: the run's best/launch.json (empty for a model folder).
    """
    info = source.info
    vllm = source.kind != "run" and target.kind == "gpu"
    if vllm:
        argv = ["vllm", "serve", T.MODEL_MOUNT, "--runner", "pooling"]
        argv += ["--host", "0.0.0.0", "--port", str(T.PORT)]
    else:
        argv = ["llmopt", "serve", T.MODEL_MOUNT, "--host", "0.0.0.0", "--port", str(T.PORT)]
    settings = launch.get("settings") or {}
    if not vllm and target.kind == "gpu":
        # llmopt's embedder engines run on the CPU here: the bundle asks for no GPU.
        from types import SimpleNamespace

        target = SimpleNamespace(kind="cpu", name=f"CPU (not {target.name})", threads=None)
    return EmbedderPlan(
        model={
            "name": info.name,
            "task": info.task,
            "pooling": info.pooling,
            "normalize": info.normalize,
            "query_prompt": getattr(info, "query_prompt", None),
            "document_prompt": getattr(info, "document_prompt", None),
            "max_seq_length": info.max_seq_length,
        },
        target=target,
        served_by="vllm" if vllm else "llmopt",
        argv=argv,
        threads=settings.get("threads") or getattr(target, "threads", None),
        threshold=launch.get("similarity_threshold"),
        engine=launch.get("engine"),
        recipe=source.recipe,
    )


def embedder_files(plan: EmbedderPlan, image: str, mount_dir: str) -> dict[str, str]:
    """Every file of an embedder bundle (no weights), by relative path."""
    return {
        "Dockerfile": _dockerfile(plan),
        ".dockerignore": T.dockerignore(),
        "start.sh": _start_script(plan),
        "plan.json": json.dumps(plan.to_dict(), indent=2, default=str) + "\n",
        "docker-compose.yml": T.compose(plan),  # type: ignore[arg-type]
        ".env": f"# Host folder mounted read-only at {T.MODEL_MOUNT}: "
        f"{'the run best/ folder' if plan.served_by == 'llmopt' else 'the model folder'}.\n"
        f"MODEL_DIR={mount_dir}\nIMAGE={image}\n",
        "nginx/llm.conf": T.nginx_conf(),
        "nginx/llm-tls.conf": T.nginx_tls_conf(),
        "k8s.yaml": T.kubernetes(plan, image),  # type: ignore[arg-type]
        "README.md": _readme(plan, image, mount_dir),
    }


def _dockerfile(plan: EmbedderPlan) -> str:
    head = [
        "# syntax=docker/dockerfile:1",
        "# Generated by `llmopt deploy` for an embedding model. The image holds the server, never",
        f"# the weights: mount them at {T.MODEL_MOUNT} (docker-compose.yml and k8s.yaml do).",
    ]
    if plan.served_by == "vllm":
        body = [f"FROM {T.GPU_IMAGE}"]
    else:
        body = [
            f"FROM {T.CPU_BASE}",
            "# A CPU torch first (the default index would pull CUDA), then llmopt and its engines.",
            f'ARG LLMOPT_SPEC="{LLMOPT_SPEC}"',
            "RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch "
            '\\\n && pip install --no-cache-dir "$LLMOPT_SPEC"',
        ]
    body += [
        "WORKDIR /app",
        "COPY start.sh plan.json /app/",
        "RUN chmod +x /app/start.sh",
        f"ENV MODEL_DIR={T.MODEL_MOUNT} PORT={T.PORT}",
        f"EXPOSE {T.PORT}",
        "HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 "
        f'CMD python3 -c "{T._HEALTH}"',
        'ENTRYPOINT ["/app/start.sh"]',
    ]
    return "\n".join(head + body) + "\n"


def _start_script(plan: EmbedderPlan) -> str:
    """start.sh: check the device against the plan, export the threshold, exec the server."""
    argv = " ".join(shlex.quote(a) for a in plan.argv)
    argv = argv.replace(shlex.quote(T.MODEL_MOUNT), '"$MODEL_DIR"').replace(
        f"--port {T.PORT}", '--port "$PORT"'
    )
    t = plan.threshold or {}
    thr = "" if t.get("threshold") is None else f"{t['threshold']:.6g}"
    ref = "" if t.get("reference_threshold") is None else f"{t['reference_threshold']:.6g}"
    need_file = "config.json" if plan.served_by == "vllm" else "launch.json"
    gpu = plan.served_by == "vllm"
    threads = int(plan.threads or 0)
    return f"""#!/usr/bin/env bash
# Generated by `llmopt deploy`: check the device against the plan, then start the embedder.
# Served by {plan.served_by}; planned for {plan.target.name} ({plan.target.kind}).
set -euo pipefail
MODEL_DIR="${{MODEL_DIR:-{T.MODEL_MOUNT}}}"
PORT="${{PORT:-{T.PORT}}}"
NEED_GPU={int(gpu)}
PLAN_THREADS={threads}
# The threshold verified for this candidate (llmopt verify/optimize --threshold); the
# application compares cosine similarity against it instead of the reference's.
export LLMOPT_SIMILARITY_THRESHOLD="${{LLMOPT_SIMILARITY_THRESHOLD:-{thr}}}"
export LLMOPT_REFERENCE_THRESHOLD="{ref}"

if [ ! -f "$MODEL_DIR/{need_file}" ]; then
  echo "llmopt: no {"model" if gpu else "run best/ folder"} at $MODEL_DIR ({need_file} missing): mount it there (it is not in the image)" >&2
  exit 2
fi

if [ "$NEED_GPU" = 1 ]; then
  GPUS=0
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    GPUS=$(nvidia-smi -L | grep -c '^GPU ' || true)
  fi
  if [ "$GPUS" -lt 1 ]; then
    echo "llmopt: this bundle serves with vLLM on a GPU and found none; deploy with --cpu to serve with llmopt on the CPU" >&2
    exit 3
  fi
  echo "llmopt: found $GPUS GPU(s)"
else
  CORES=$(nproc)
  echo "llmopt: $CORES CPU core(s) available"
  if [ "$PLAN_THREADS" -gt 0 ] && [ "$CORES" -lt "$PLAN_THREADS" ]; then
    echo "llmopt: the candidate was measured with $PLAN_THREADS threads and this container has $CORES cores: expect lower throughput (give it more CPUs, or re-run llmopt optimize here)" >&2
  fi
  if ! grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
    echo "llmopt: this CPU has no AVX2: int8 and fp32 kernels run far slower than where the candidate was measured" >&2
  fi
fi
if [ -n "$LLMOPT_SIMILARITY_THRESHOLD" ]; then
  echo "llmopt: similarity threshold $LLMOPT_SIMILARITY_THRESHOLD (the reference's was ${{LLMOPT_REFERENCE_THRESHOLD:-unset}})"
fi

set -- {argv} "$@"
echo "llmopt: exec $*"
exec "$@"
"""


def _readme(plan: EmbedderPlan, image: str, mount_dir: str) -> str:
    t = plan.threshold
    if t:
        thr = (
            f"Use similarity threshold **{t['threshold']:.4g}** in the application instead of "
            f"{t['reference_threshold']:.4g}: it keeps the reference's decisions on "
            f"{(t.get('agreement') or 0):.2%} of the verified pairs (out of sample), against "
            f"{(t.get('agreement_as_is') or 0):.2%} at the old threshold. The container exports "
            "it as `LLMOPT_SIMILARITY_THRESHOLD`."
        )
    else:
        thr = (
            "No threshold was verified for this bundle: run `llmopt optimize MODEL --threshold T "
            "[--pairs FILE]` to get one recalibrated for the chosen candidate."
        )
    server = (
        "vLLM's pooling runner (`vllm serve --runner pooling`), on the GPU"
        if plan.served_by == "vllm"
        else f"llmopt's own server (engine `{plan.engine or 'hf'}`, recipe `{plan.recipe or 'fp32'}`)"
    )
    m = plan.model
    prompt = (
        f"\nQueries take the model's instruction prompt: `{m['query_prompt']!r}` (prepend it "
        "to each query before embedding).\n"
        if m.get("query_prompt")
        else ""
    )
    return f"""# {m["name"]}: embedding service bundle

Generated by `llmopt deploy`. Served by {server}; OpenAI-compatible `POST /v1/embeddings`.
Pooling: {m["pooling"]}, normalized: {m["normalize"]}.
{prompt}
## Threshold

{thr}

## Run

```bash
# .env holds MODEL_DIR={mount_dir} (mounted read-only at {T.MODEL_MOUNT})
docker compose up -d --build
curl -s 127.0.0.1:8080/v1/embeddings -H 'content-type: application/json' \\
  -d '{{"model": "{m["name"]}", "input": ["a sentence"]}}'
```

The proxy listens on 127.0.0.1:8080 (set BIND_ADDR in .env to publish it elsewhere).
`start.sh` checks the device first ({"a GPU" if plan.served_by == "vllm" else "CPU cores and AVX2"})
and prints the threshold it exports. Kubernetes: `k8s.yaml` (push {image}, and a PVC holding
the folder). `plan.json` records what was chosen and why.

{T.tls_readme()}"""
