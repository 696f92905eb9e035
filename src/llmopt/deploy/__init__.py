"""Deployment bundles: container, compose, nginx, Kubernetes, start script, validated here.

>>> from llmopt.deploy import resolve_source, write_bundle            # doctest: +SKIP
>>> from llmopt.hardware.target import Target                          # doctest: +SKIP
>>> res = write_bundle(resolve_source("runs/smollm2-135m"), "deploy/smollm2",
...                    Target.gpu_model("H200"))                      # doctest: +SKIP
>>> [c.name for c in res.checks if c.status == "passed"]              # doctest: +SKIP
['nginx', 'compose', 'kubernetes', 'dockerfile', 'shell', 'yaml', 'no-weights']
"""

from __future__ import annotations

from llmopt.deploy.bundle import DeployResult, DeploySource, resolve_source, write_bundle
from llmopt.deploy.validate import CheckResult, validate_bundle

__all__ = [
    "DeployResult",
    "DeploySource",
    "resolve_source",
    "write_bundle",
    "CheckResult",
    "validate_bundle",
]
