"""Atomic writes: a file or folder is either absent or complete, never half-written.

Every artifact goes to a temporary sibling first and is renamed into place (rename is atomic on
one filesystem). A killed process therefore leaves at most a `.tmp-*` sibling, which readers
ignore and the next writer removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_file", "write_text", "write_json", "read_json", "atomic_dir", "TMP_PREFIX"]

TMP_PREFIX = ".tmp-"


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """An open file that becomes `path` when the block ends without error (fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (temp file in the same folder, fsync, rename)."""
    with atomic_file(path, "w") as f:
        f.write(text)
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON atomically. Dataclasses must be converted by the caller."""
    return write_text(
        path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n"
    )


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it to `final` only on success.

    If `final` already exists it is replaced (the old one is moved aside first, then deleted).
    On any exception the temporary folder is removed and `final` is untouched.

    Example:
        >>> with atomic_dir("/tmp/llmopt-doc-example") as d:   # doctest: +SKIP
        ...     (d / "config.json").write_text("{}")
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f"{TMP_PREFIX}{final.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f"{TMP_PREFIX}{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
