"""The run directory's identity rule: the same run resumes, another is refused."""

from __future__ import annotations

import pytest

from llmopt.core.errors import RunDirError
from llmopt.rundir.paths import RunDir


def test_rundir_resumes_same_run_and_refuses_another(tmp_path):
    meta = {"model_fingerprint": "abc", "target": "cpu", "settings": {"window": 512}}
    run = RunDir(tmp_path / "run")
    assert run.open(meta) is False
    assert run.open(dict(meta)) is True
    with pytest.raises(RunDirError, match="model_fingerprint"):
        run.open({**meta, "model_fingerprint": "other"})
    with pytest.raises(RunDirError, match="settings"):
        run.open({**meta, "settings": {"window": 256}})
    assert run.open({**meta, "target": "cuda"}, force=True) is False
    other = tmp_path / "not-a-run"
    other.mkdir()
    (other / "precious.txt").write_text("user data")
    with pytest.raises(RunDirError, match="not empty"):
        RunDir(other).open(meta)
    assert (other / "precious.txt").read_text() == "user data"
