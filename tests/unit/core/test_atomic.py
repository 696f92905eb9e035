"""Atomic writes: a file or folder is complete or absent, and stale temp folders are cleared."""

from __future__ import annotations

import json

import pytest

from llmopt.core.atomic import atomic_dir, write_json


def test_atomic_dir_failure_leaves_nothing(tmp_path):
    final = tmp_path / "artifact"
    with pytest.raises(RuntimeError), atomic_dir(final) as d:
        (d / "half.bin").write_bytes(b"x" * 100)
        raise RuntimeError("killed mid-way")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == [], "no temporary leftovers"


def test_atomic_dir_replaces_and_clears_stale_tmp(tmp_path):
    final = tmp_path / "artifact"
    stale = tmp_path / ".tmp-artifact.dead"
    stale.mkdir()
    (stale / "junk").write_text("from a killed run")
    with atomic_dir(final) as d:
        (d / "a").write_text("1")
    with atomic_dir(final) as d:
        (d / "b").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert not stale.exists()


def test_write_json_is_complete_or_absent(tmp_path):
    p = write_json(tmp_path / "x.json", {"a": [1, 2]})
    assert json.loads(p.read_text()) == {"a": [1, 2]}
    with pytest.raises(TypeError):
        write_json(tmp_path / "y.json", {"bad": object()})
    assert not (tmp_path / "y.json").exists()
    assert [q.name for q in tmp_path.iterdir()] == ["x.json"]
