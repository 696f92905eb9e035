"""Files into artifact folders: hard links where the filesystem allows, copies elsewhere, and a
linked file is only ever replaced, never written into (the source may be the user's folder)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from llmopt.model.files import link_or_copy, link_tree, link_weights

CONFIGS = ["config.json", "generation_config.json"]


def _model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"w1")
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"w2")
    (folder / "model.safetensors.index.json").write_text("{}")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "generation_config.json").write_text("{}")
    (folder / "README.md").write_text("not part of the weights")
    return folder


def test_link_or_copy_links_and_replaces_without_touching_the_source(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"user weights")
    dst = tmp_path / "dst.bin"
    assert link_or_copy(src, dst) is True
    assert os.path.samefile(src, dst)
    # A second link over a file already there replaces it; writing through it never happens.
    other = tmp_path / "other.bin"
    other.write_bytes(b"other")
    assert link_or_copy(other, dst) is True
    assert src.read_bytes() == b"user weights" and dst.read_bytes() == b"other"


def test_link_or_copy_copies_across_filesystems(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem to link across")
    src = tmp_path / "src.bin"
    src.write_bytes(b"user weights")
    with tempfile.TemporaryDirectory(dir=shm) as other:
        dst = Path(other) / "dst.bin"
        (Path(other) / "dst.bin").write_bytes(b"stale")
        assert link_or_copy(src, dst) is False
        assert dst.read_bytes() == b"user weights" and not os.path.samefile(src, dst)
        assert dst.stat().st_mtime == src.stat().st_mtime  # copied with its metadata


def test_link_weights_links_safetensors_and_copies_configs(tmp_path):
    source = _model(tmp_path / "model")
    out = tmp_path / "artifact"
    files = sorted(source.glob("*.safetensors"))
    assert link_weights(source, out, files) == "hard-linked"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([*(f.name for f in files), "model.safetensors.index.json"] + CONFIGS)
    for f in files:
        assert os.path.samefile(f, out / f.name)
    for name in CONFIGS:  # small: copied, not linked
        assert not os.path.samefile(source / name, out / name)
        assert (out / name).read_text() == (source / name).read_text()


def test_link_tree_links_every_file(tmp_path):
    source = _model(tmp_path / "model")
    (source / "sub").mkdir()
    (source / "sub" / "x.bin").write_bytes(b"x")
    link_tree(source, tmp_path / "copy")
    for f in source.rglob("*"):
        if f.is_file():
            assert os.path.samefile(f, tmp_path / "copy" / f.relative_to(source))
    with pytest.raises(FileExistsError):
        link_tree(source, tmp_path / "copy")
    link_tree(source, tmp_path / "copy", dirs_exist_ok=True)
    assert (source / "config.json").read_text() == '{"model_type": "llama"}'
