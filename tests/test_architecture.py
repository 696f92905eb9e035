"""The package layers hold: no upward import, no cycle, code formatted, docstring examples run.

The layers and the acyclic rule are declared once, in pyproject.toml's [tool.importlinter];
this test runs import-linter on them, so a cycle or an upward import fails the build.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llmopt

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "llmopt"


def test_import_contracts_hold():
    # lint_imports reads pyproject.toml from the working directory and returns 0 when every
    # contract is kept; its report (printed) names each offending import with its line.
    import os

    from importlinter.cli import lint_imports

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert lint_imports() == 0, "import contracts broken: see the report above"
    finally:
        os.chdir(cwd)


def _function_local_llmopt_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `from llmopt...` import inside a function body."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmopt"):
                out.append((node.lineno, node.module))
    return out


def test_function_local_imports_say_why():
    """An llmopt import inside a function is allowed only where it is heavy (it pulls torch,
    transformers, onnxruntime...) or optional, and the function says so in a `# heavy` or
    `# lazy` comment on the import line or the line above."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for lineno, module in _function_local_llmopt_imports(path):
            context = " ".join(lines[max(0, lineno - 3) : lineno + 1]).lower()
            if "# heavy" not in context and "# lazy" not in context:
                offenders.append(f"{path.relative_to(ROOT)}:{lineno} {module}")
    assert not offenders, "function-local imports without a reason:\n" + "\n".join(offenders)


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff not installed (pip install -e '.[dev]')",
)
def test_code_is_ruff_formatted_and_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    fmt = subprocess.run(
        [ruff, "format", "--check", "src", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    lint = subprocess.run(
        [ruff, "check", "src", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    skips = sum(p.read_text(encoding="utf-8").count("fmt: skip") for p in SRC.rglob("*.py"))
    assert skips <= 10, f"{skips} `fmt: skip` markers; keep them for tables that read better only"


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(llmopt.__path__, "llmopt."))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name):
    """Every module imports, and its docstring examples run (those that need a model or a
    server are marked `# doctest: +SKIP` in the docstring itself)."""
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
