"""Static-shape encoder runs: the checklist's "TensorRT for fixed shapes" step, built from torch.

An embedding model sees inputs of every length, while a compiled graph, and above all a captured
CUDA graph, wants one shape. So each batch is padded up to one of a few shapes: its length to the
next length bucket (powers of two from 16 up to the model's limit) and its row count to the batch
size asked for. Each shape gets its own compiled forward: on a GPU `torch.compile` with
`mode="reduce-overhead"` captures it as a CUDA graph (one launch per batch instead of one per
kernel, which is where a small encoder's time goes on a fast GPU); on a CPU inductor compiles it.

Padding never changes a result: padded positions are masked out of attention and pooling, and
the rows added to fill a batch are dropped. What the bucket costs is compute on padding; sorting
inputs by length (`embed_in_batches`) keeps that small.

Selected by `EngineSettings.compile` on the `hf` engine's embedding candidates (`hf-bf16-compile`
on CUDA; opt-in on the CPU, where compiling each bucket takes tens of seconds).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from llmopt.engines.pooling import embed_in_batches, pool

if TYPE_CHECKING:
    from llmopt.core.settings import EngineSettings
    from llmopt.model.info import ModelInfo

__all__ = ["StaticShapeEncoder", "length_buckets", "bucket_for"]

log = logging.getLogger(__name__)

MIN_BUCKET = 16
# Dynamo keeps this many compiled shapes per function before it falls back to eager; every
# (rows, length bucket) pair is one, and a benchmark asks for two row counts (batch 1 and 32).
CACHE_SIZE = 64


def length_buckets(limit: int) -> list[int]:
    """Powers of two from 16 below `limit`, then `limit` itself.

    >>> length_buckets(512), length_buckets(100), length_buckets(8)
    ([16, 32, 64, 128, 256, 512], [16, 32, 64, 100], [8])
    """
    out = []
    b = MIN_BUCKET
    while b < limit:
        out.append(b)
        b *= 2
    return [*out, limit]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `n`.

    >>> bucket_for(17, [16, 32, 64]), bucket_for(16, [16, 32])
    (32, 16)
    """
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} tokens exceed the largest bucket {buckets[-1]}")


class StaticShapeEncoder:
    """An `EmbeddingRunner` whose forwards only ever see bucketed shapes, each compiled once."""

    def __init__(
        self,
        model,
        tokenizer,
        info: ModelInfo,
        device: str,
        settings: EngineSettings,
        backend: str = "inductor",
    ):
        import torch
        import torch._dynamo.config as dynamo_config  # lazy: only compiled runners need it

        self.model, self.tokenizer, self.info, self.device = model, tokenizer, info, device
        limit = getattr(info, "max_seq_length", None) or info.max_context or 512
        self.max_length = min(int(settings.max_length or limit), int(limit))
        self.sort_by_length = settings.sort_by_length is not False
        self.buckets = length_buckets(self.max_length)
        self.shapes: set[tuple[int, int]] = set()  # the (rows, length) shapes compiled so far
        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, CACHE_SIZE)
        mode = "reduce-overhead" if device.startswith("cuda") else None

        def forward(**feeds: torch.Tensor) -> torch.Tensor:
            return model(**feeds).last_hidden_state

        self._forward = torch.compile(forward, backend=backend, mode=mode, dynamic=False)

    def embed(self, texts, batch_size: int = 32) -> np.ndarray:
        dim = int(self.info.hidden_size)
        embed = lambda b: self._embed_batch(b, batch_size)  # noqa: E731
        return embed_in_batches(texts, batch_size, embed, dim, self.sort_by_length)

    def _embed_batch(self, batch: list[str], rows: int) -> np.ndarray:
        import torch

        enc = self.tokenizer(
            batch, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        n, t = enc["input_ids"].shape
        length = bucket_for(t, self.buckets)
        rows = max(rows, n)
        feeds = {k: _pad(v, rows, length, self._fill(k)) for k, v in enc.items()}
        # A filler row attends to its first position only: a row with nothing to attend to
        # would be a softmax over nothing (NaN) in some attention kernels.
        feeds["attention_mask"][n:, 0] = 1
        self.shapes.add((rows, length))
        with torch.inference_mode():
            feeds = {k: v.to(self.device) for k, v in feeds.items()}
            hidden = self._forward(**feeds)[:n].float().cpu().numpy()
        mask = feeds["attention_mask"][:n].cpu().numpy()
        return pool(hidden, mask, self.info.pooling, self.info.normalize)

    def _fill(self, name: str) -> int:
        if name == "input_ids":
            return int(self.tokenizer.pad_token_id or 0)
        return 0  # attention_mask, token_type_ids


def _pad(x, rows: int, length: int, value: int):
    """`x` (n, t) padded with `value` to (rows, length)."""
    import torch

    out = torch.full((rows, length), value, dtype=x.dtype)
    out[: x.shape[0], : x.shape[1]] = x
    return out
