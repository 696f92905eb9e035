"""The files that travel with a model into an artifact folder: the weight-free ones (tokenizer,
chat template, sentence-transformers module descriptions), copied so every artifact loads on its
own, and the weights and whole artifacts, hard-linked where they are kept as they are.

Why link: weights are large (an 8B model in bf16 is 16 GB), and a candidate that keeps the
source's files, a tuned variation of a candidate and the run's `best/` would otherwise each hold
another copy on disk. A hard link shares the file's inode with its source, so writing into a
linked file would modify the source, which may be the user's model folder that llmopt must never
modify. The rule every caller keeps: link only into a new folder (a build's temporary folder,
`core.atomic.atomic_dir`) and never open a linked file for writing afterwards; a file is changed
only by writing a new one and renaming it over the old (`core.atomic`), which replaces the link
and leaves the source as it was. `link_or_copy` itself replaces a file already at its target
instead of writing into it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "TOKENIZER_PREFIXES",
    "ST_FILES",
    "ST_DIRS",
    "copy_tokenizer_files",
    "link_or_copy",
    "link_tree",
    "link_weights",
]

TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "vocab", "merges", "added_tokens")
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
ST_DIRS = ("1_Pooling", "2_Normalize")


def copy_tokenizer_files(source: Path, out: Path) -> None:
    """Copy the tokenizer, chat template and sentence-transformers files of `source` into `out`
    (files already in `out` are kept)."""
    for f in Path(source).iterdir():
        wanted = f.name.startswith(TOKENIZER_PREFIXES) or f.name in ST_FILES
        if (
            f.is_file()
            and (wanted or f.name == "chat_template.jinja")
            and not (out / f.name).exists()
        ):
            shutil.copy2(f, out / f.name)
    for d in ST_DIRS:
        if (source / d).is_dir() and not (out / d).exists():
            shutil.copytree(source / d, out / d)


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """Hard-link `src` at `dst`, or copy it (with its metadata) where linking fails: another
    filesystem, or one that does not allow links. Returns True when it linked.

    A file already at `dst` is removed first, never written into: it may itself be a link to a
    file that must not change (see the module docstring).
    """
    if os.path.lexists(dst):
        os.unlink(dst)
    try:
        os.link(src, dst)
        return True
    except OSError:
        shutil.copy2(src, dst)
        return False


def link_tree(src: Path, dst: Path, *, dirs_exist_ok: bool = False) -> None:
    """`shutil.copytree` of `src` to `dst` with every file hard-linked where it can be
    (`link_or_copy`)."""
    shutil.copytree(src, dst, copy_function=link_or_copy, dirs_exist_ok=dirs_exist_ok)


def link_weights(source: Path, out: Path, files: Iterable[Path]) -> str:
    """Give `out` the safetensors `files` of `source` and their index (hard links, else copies)
    and copies of `config.json` and `generation_config.json`. Returns "hard-linked", or
    "copied" when any file had to be copied."""
    out.mkdir(parents=True, exist_ok=True)
    linked = [
        link_or_copy(f, out / f.name) for f in [*files, *source.glob("*.safetensors.index.json")]
    ]
    for name in ("config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    return "hard-linked" if all(linked) else "copied"
