"""The user's own retrieval data for embedder verification: sentence pairs, queries, a corpus.

Pairs (`--pairs FILE.jsonl`) are what a deployment compares against its similarity threshold: one
JSON object a line with two texts and an optional label (1 = should match, 0 = should not).
Accepted key pairs: `text1`/`text2`, `sentence1`/`sentence2`, `query`/`passage`, `a`/`b`; the
label is `label` or `score` (a number; >= 0.5 counts as a match). Queries and corpus files
(`--queries`, `--corpus`) are JSONL with a `text` field, or plain text with one text a line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmopt.core.errors import LlmoptError

__all__ = ["PairSet", "load_pairs", "load_texts", "PairsFileError"]

_KEYS = (("text1", "text2"), ("sentence1", "sentence2"), ("query", "passage"), ("a", "b"))


class PairsFileError(LlmoptError):
    """A pairs, queries or corpus file that cannot be read as documented."""


@dataclass(frozen=True)
class PairSet:
    """Text pairs with optional labels (1.0 match, 0.0 no match).

    >>> PairSet(["a"], ["b"], None, "x.jsonl").texts()
    ['a', 'b']
    """

    first: list[str]
    second: list[str]
    labels: np.ndarray | None  # (P,) of 0/1, or None when the file has no labels
    source: str

    def __len__(self) -> int:
        return len(self.first)

    def texts(self) -> list[str]:
        """Every distinct text, in first-seen order (each is embedded once)."""
        return list(dict.fromkeys([*self.first, *self.second]))


def load_pairs(path: str | Path) -> PairSet:
    """Read a pairs JSONL file.

    Raises:
        PairsFileError: a missing file, a line that is not a JSON object with two texts, labels
            on some lines only, or fewer than 10 pairs (no threshold can be judged on fewer).
    """
    path = Path(path)
    rows = _jsonl(path)
    first, second, labels = [], [], []
    for n, row in enumerate(rows, 1):
        keys = next((k for k in _KEYS if k[0] in row and k[1] in row), None)
        if keys is None or not all(isinstance(row[k], str) for k in keys):
            raise PairsFileError(
                f"{path}:{n}: expected two texts as text1/text2 (or sentence1/sentence2, "
                f"query/passage, a/b); got keys {sorted(row)}",
                hint='write one pair a line, e.g. {"text1": "...", "text2": "...", "label": 1}',
            )
        first.append(row[keys[0]])
        second.append(row[keys[1]])
        label = row.get("label", row.get("score"))
        if label is not None and not isinstance(label, int | float):
            raise PairsFileError(
                f"{path}:{n}: label {label!r} is not a number",
                hint="use 1 for a pair that should match and 0 for one that should not",
            )
        labels.append(label)
    if len(first) < 10:
        raise PairsFileError(
            f"{path} has {len(first)} pairs; a threshold needs at least 10 to be judged",
            hint="give more pairs (hundreds make the confidence intervals useful)",
        )
    given = [x is not None for x in labels]
    if any(given) and not all(given):
        raise PairsFileError(
            f"{path}: {sum(given)} of {len(labels)} pairs have a label",
            hint="label every pair or none",
        )
    arr = np.array([float(x) >= 0.5 for x in labels], dtype=np.float64) if all(given) else None
    return PairSet(first, second, arr, str(path))


def load_texts(path: str | Path) -> list[str]:
    """Read a queries or corpus file: JSONL with a `text` field, else one text a line.

    Raises:
        PairsFileError: a missing or empty file, or a JSONL line without a string `text`.
    """
    path = Path(path)
    if not path.is_file():
        raise PairsFileError(f"{path} does not exist", hint="pass the path of an existing file")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise PairsFileError(f"{path} is empty", hint="write one text a line")
    if not lines[0].lstrip().startswith("{"):
        return [ln.strip() for ln in lines]
    out = []
    for n, row in enumerate(_jsonl(path), 1):
        if not isinstance(row.get("text"), str):
            raise PairsFileError(
                f"{path}:{n}: expected a JSON object with a string 'text'",
                hint='write {"text": "..."} a line, or plain text with one text a line',
            )
        out.append(row["text"])
    return out


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise PairsFileError(f"{path} does not exist", hint="pass the path of an existing file")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise PairsFileError(
                f"{path}:{n}: not JSON ({e})", hint="write one JSON object a line (JSONL)"
            ) from e
        if not isinstance(row, dict):
            raise PairsFileError(f"{path}:{n}: not a JSON object", hint="one object a line")
        rows.append(row)
    return rows
