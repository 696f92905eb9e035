"""Calibration data: token windows the quantizers look at.

Default: the calibration part of the built-in Wikipedia split (`llmopt.assets.text`), which never
overlaps the held-out part that perplexity is measured on. Or the user's text: a plain text file,
or JSONL with one object per line holding a "text" field. Windows are cut from the tokenized text
and `num_samples` of them are drawn with `seed`, so the same settings give the same tokens. Only
the first 16 x num_samples x seq_len characters are tokenized (about four times what is needed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmopt.assets.text import calibration_text
from llmopt.core.errors import LlmoptError

if TYPE_CHECKING:
    import torch

__all__ = ["CalibrationConfig", "CalibrationDataError", "calibration_windows", "read_text"]


class CalibrationDataError(LlmoptError):
    """The calibration file is missing, empty, malformed or too short."""


@dataclass(frozen=True)
class CalibrationConfig:
    """Which text the quantizers calibrate on.

    Args:
        path: None (built-in Wikipedia calibration split), a .txt file or a .jsonl file
            (one {"text": ...} object per line).
        num_samples: windows drawn.
        seq_len: tokens per window.
        seed: drawing seed.

    >>> CalibrationConfig(num_samples=8, seq_len=256).seq_len
    256
    """

    path: Path | None = None
    num_samples: int = 64
    seq_len: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.seq_len < 8:
            raise ValueError(f"seq_len must be >= 8, got {self.seq_len}")
        if self.path is not None and not isinstance(self.path, Path):
            object.__setattr__(self, "path", Path(self.path))

    def to_dict(self) -> dict:
        return {
            "path": None if self.path is None else str(self.path),
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }


def read_text(path: Path) -> str:
    """Text of a .txt file, or the "text" fields of a .jsonl file joined by blank lines."""
    if not path.is_file():
        raise CalibrationDataError(
            f"calibration file {path} does not exist", hint="pass an existing .txt or .jsonl file"
        )
    raw = path.read_text(encoding="utf-8")
    if path.suffix.lower() not in (".jsonl", ".json"):
        text = raw
    else:
        parts = []
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationDataError(
                    f"{path}:{i} is not valid JSON ({e.msg})",
                    hint='write one JSON object per line, e.g. {"text": "..."}',
                ) from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise CalibrationDataError(
                    f'{path}:{i} has no string "text" field', hint='use {"text": "..."} per line'
                )
            parts.append(obj["text"])
        text = "\n\n".join(parts)
    if not text.strip():
        raise CalibrationDataError(f"calibration file {path} holds no text", hint="add text")
    return text


def calibration_windows(tokenizer, config: CalibrationConfig) -> torch.Tensor:
    """(num_samples, seq_len) int64 token ids, drawn without replacement with `config.seed`.

    Raises:
        CalibrationDataError: the text is shorter than one window.
    """
    import torch

    text = calibration_text() if config.path is None else read_text(config.path)
    # Tokenizing megabytes costs seconds (minutes for byte-level vocabularies): read about four
    # times the characters the windows need (~4 characters per token), which still leaves a choice.
    text = text[: 16 * config.num_samples * config.seq_len]
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    n_windows = len(ids) // config.seq_len
    if n_windows == 0:
        raise CalibrationDataError(
            f"the calibration text has {len(ids)} tokens, fewer than one window of "
            f"{config.seq_len}",
            hint="give more text or a smaller --seq-len",
        )
    windows = torch.tensor(ids[: n_windows * config.seq_len], dtype=torch.long)
    windows = windows.view(n_windows, config.seq_len)
    g = torch.Generator().manual_seed(config.seed)
    pick = torch.randperm(n_windows, generator=g)[: config.num_samples]
    # Fewer windows than asked: use them all (the facts record how many were used).
    return windows[pick.sort().values]
