"""Sentence-embedding pooling shared by every engine, so that torch and ONNX agree by construction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["pool", "embed_in_batches", "encoder_feeds"]


def pool(
    hidden: np.ndarray, mask: np.ndarray, mode: str = "mean", normalize: bool = True
) -> np.ndarray:
    """Pool token states into one vector per sequence.

    Args:
        hidden: (B, T, D) last hidden states.
        mask: (B, T) attention mask, 1 for real tokens.
        mode: "mean" (mask-weighted average, sentence-transformers' default), "cls" (first
            token) or "last" (last real token, for decoder embedders such as Qwen3-Embedding;
            either padding side: Qwen3-Embedding's tokenizer pads on the left).
        normalize: L2-normalize the result (as sentence-transformers' Normalize module does).

    Returns:
        (B, D) float32.

    >>> pool(np.ones((1, 2, 3)), np.array([[1, 0]]), normalize=False).tolist()
    [[1.0, 1.0, 1.0]]
    >>> h = np.arange(6.0).reshape(2, 3, 1)  # right-padded row, then left-padded row
    >>> pool(h, np.array([[1, 1, 0], [0, 1, 1]]), "last", normalize=False).ravel().tolist()
    [1.0, 5.0]
    """
    hidden = hidden.astype(np.float32, copy=False)
    m = mask.astype(np.float32)
    if mode == "mean":
        out = (hidden * m[:, :, None]).sum(1) / np.clip(m.sum(1, keepdims=True), 1e-9, None)
    elif mode == "cls":
        out = hidden[:, 0]
    elif mode == "last":
        # The last position whose mask is 1, whichever side the padding is on.
        last = m.shape[1] - 1 - np.argmax(m[:, ::-1] > 0, axis=1)  # (B,)
        out = hidden[np.arange(hidden.shape[0]), last]
    else:
        raise ValueError(f"unknown pooling mode {mode!r}; use mean, cls or last")
    if normalize:
        out = out / np.clip(np.linalg.norm(out, axis=1, keepdims=True), 1e-12, None)
    return out.astype(np.float32, copy=False)


def embed_in_batches(
    texts: Sequence[str],
    batch_size: int,
    embed_batch: Callable[[list[str]], np.ndarray],
    dim: int,
    sort_by_length: bool = True,
) -> np.ndarray:
    """Embed `texts` in batches with `embed_batch`, returning (len(texts), dim) in input order.

    With `sort_by_length` (the default, as sentence-transformers does) texts of similar length
    share a batch, so each batch pads less; measured on MiniLM at batch 32 this is +60-90%
    sentences/s on Wikipedia sentences. Every engine uses this helper so they are compared fairly.

    >>> embed_in_batches(["bb", "a"], 1, lambda b: np.array([[len(b[0])]], np.float32), 1).tolist()
    [[2.0], [1.0]]
    """
    assert batch_size >= 1, "batch_size must be >= 1"
    texts = list(texts)
    if not texts:
        return np.zeros((0, dim), np.float32)
    order = (
        np.argsort([-len(t) for t in texts], kind="stable")
        if sort_by_length
        else np.arange(len(texts))
    )
    chunks = [
        embed_batch([texts[j] for j in order[i : i + batch_size]])
        for i in range(0, len(texts), batch_size)
    ]
    out = np.empty((len(texts), chunks[0].shape[1]), np.float32)
    out[order] = np.concatenate(chunks)  # undo the sort
    return out


def encoder_feeds(
    tokenizer: Any, batch: list[str], max_length: int, input_names: Sequence[str]
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Tokenize `batch` into the int64 feeds an exported encoder takes, and the attention mask.

    The ONNX Runtime and OpenVINO runners both feed a graph by input name; an input the
    tokenizer does not produce is `token_type_ids` (all zeros, one segment) or a mistake.

    Raises:
        KeyError: the graph takes an input the tokenizer does not produce.

    >>> tok = lambda b, **kw: {"input_ids": np.array([[5, 6]]), "attention_mask": np.ones((1, 2))}
    >>> feeds, mask = encoder_feeds(tok, ["x"], 8, ["input_ids", "token_type_ids"])
    >>> sorted(feeds), feeds["token_type_ids"].tolist()
    (['input_ids', 'token_type_ids'], [[0, 0]])
    """
    enc = tokenizer(
        batch, padding=True, truncation=True, max_length=max_length, return_tensors="np"
    )
    mask = np.asarray(enc["attention_mask"]).astype(np.int64)  # (B, T)
    feeds = {}
    for name in input_names:
        if name in enc:
            feeds[name] = np.asarray(enc[name]).astype(np.int64)
        elif name == "token_type_ids":  # a tokenizer without segment ids: all zeros
            feeds[name] = np.zeros_like(mask)
        else:
            raise KeyError(f"model input {name!r} is not produced by the tokenizer")
    return feeds, mask
