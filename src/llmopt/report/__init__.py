"""Reports rendered from a run directory (a pure function of it): `report.md` and `report.html`.

Importable without torch: only the standard library, `llmopt.core.schema` and `llmopt.core.atomic`.

>>> from llmopt.report import write_report
>>> md_path, html_path = write_report("runs/smollm2")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path

from llmopt.core.atomic import write_text
from llmopt.report.html import render_html
from llmopt.report.markdown import render_markdown
from llmopt.report.view import CandidateView, RunView, Status, load_run

__all__ = [
    "CandidateView",
    "RunView",
    "Status",
    "load_run",
    "render_html",
    "render_markdown",
    "write_report",
]


def write_report(run_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Render the run directory and write `report.md` and `report.html` into it, atomically.

    Nothing else in the run directory is touched; missing stage files are reported, not fatal.

    Args:
        run_dir: the folder `llmopt optimize` wrote.

    Returns:
        (path of report.md, path of report.html).

    Example:
        >>> write_report("runs/smollm2")  # doctest: +SKIP
        (PosixPath('runs/smollm2/report.md'), PosixPath('runs/smollm2/report.html'))
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"run directory {run_dir} does not exist; pass the folder "
            "`llmopt optimize` wrote (it holds run.json)"
        )
    view = load_run(run_dir)
    md = write_text(run_dir / "report.md", render_markdown(view))
    html = write_text(run_dir / "report.html", render_html(view))
    return md, html
