"""The weight-free files that travel with a model: tokenizer, chat template, sentence-transformers
module descriptions. Every artifact folder gets them, so it loads on its own."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["TOKENIZER_PREFIXES", "ST_FILES", "ST_DIRS", "copy_tokenizer_files"]

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
