"""Sentence-embedding pooling shared by every engine, so that torch and ONNX agree by construction."""

from __future__ import annotations

import numpy as np

__all__ = ["pool"]


def pool(hidden: np.ndarray, mask: np.ndarray, mode: str = "mean", normalize: bool = True) -> np.ndarray:
    """Pool token states into one vector per sequence.

    Args:
        hidden: (B, T, D) last hidden states.
        mask: (B, T) attention mask, 1 for real tokens.
        mode: "mean" (mask-weighted average, sentence-transformers' default), "cls" (first
            token) or "last" (last real token, for decoder embedders such as Qwen3-Embedding;
            assumes right padding).
        normalize: L2-normalize the result (as sentence-transformers' Normalize module does).

    Returns:
        (B, D) float32.

    >>> pool(np.ones((1, 2, 3)), np.array([[1, 0]]), normalize=False).tolist()
    [[1.0, 1.0, 1.0]]
    """
    hidden = hidden.astype(np.float32, copy=False)
    m = mask.astype(np.float32)
    if mode == "mean":
        out = (hidden * m[:, :, None]).sum(1) / np.clip(m.sum(1, keepdims=True), 1e-9, None)
    elif mode == "cls":
        out = hidden[:, 0]
    elif mode == "last":
        last = m.sum(1).astype(np.int64) - 1  # (B,)
        out = hidden[np.arange(hidden.shape[0]), last]
    else:
        raise ValueError(f"unknown pooling mode {mode!r}; use mean, cls or last")
    if normalize:
        out = out / np.clip(np.linalg.norm(out, axis=1, keepdims=True), 1e-12, None)
    return out.astype(np.float32, copy=False)
