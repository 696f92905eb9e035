"""The generator's forwards as they run: eager or `torch.compile`d, and the few shapes they see.

A decode step takes one packed (rows, 2 + width) int64 tensor: each row a sequence's last token,
its position and its block table (then its ring's block ids, for a model whose local layers hold
only their window: `ring_blocks`), and `carry`, the greedy tokens of the step before: a token
written as -(j + 1) is row j's entry of `carry` (`inputs.carried`), so the next step can be
launched before this one's tokens reach the host. Rows are padded to one of `batch_sizes` (1, 2,
4, 8... by default) and tables to a length bucket (`table_width`), so a compiled decode (CUDA
graphs on a GPU: `mode="reduce-overhead"`) has one graph per (batch, width) pair. Each new pair
costs a compile (a minute or more for a large model): a compiled step never cuts tables below
`min_bucket_tokens`, and `warmup` compiles the pairs up front so no request waits for one.

A compiled prefill (`compile_prefill`) runs first-chunk prefills through `torch.compile` with
dynamic shapes and no CUDA graphs; `warmup_prefill` compiles it, or falls back to eager and says
why.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from llmopt.engines.native.model import Transformer
from llmopt.engines.native.sampling import greedy

log = logging.getLogger(__name__)

__all__ = ["CompiledSteps", "bucket", "powers_of_two", "wait"]


def bucket(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def powers_of_two(cap: int) -> list[int]:
    return [1 << i for i in range(cap.bit_length()) if 1 << i <= cap]


def wait(device: torch.device) -> None:
    """Wait for the GPU with the GIL released (CUDA event), before reading results.

    Reading a CUDA tensor (`.tolist()`, `int(...)`) also waits, but need not release the GIL;
    a server's event loop (detokenizing, streaming) then stalls for the whole step instead of
    running while the GPU computes.
    """
    if device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()


class CompiledSteps:
    """The decode step and the first-chunk prefill forward of one model, and their shapes.

    `decode(packed, carry)` returns (logits (rows, V), greedy tokens (rows,), their logprobs
    (rows,)): the argmax runs inside the (compiled) graph, so an all-greedy step reads back rows
    of ints. `carry` (max_batch,) is a persistent device tensor the generator copies a step's
    greedy tokens into; a packed token -(j + 1) reads row j of it (resolved inside the graph, so
    it costs no launch of its own).
    """

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        *,
        max_batch: int,
        block_size: int,
        max_blocks_per_seq: int,
        compile: bool = False,
        bucket_blocks: bool = True,
        batch_sizes: list[int] | tuple[int, ...] | None = None,
        min_bucket_tokens: int | None = None,
        compile_prefill: bool = False,
        ring_blocks: int = 0,
    ):
        self.model, self.device = model, device
        self.carry = torch.zeros(max_batch, dtype=torch.long, device=device)
        # With rings (local layers over a pool of their own), a packed decode row ends with the
        # sequence's `ring_blocks` ring block ids, after its block table: one more fixed-width
        # field, so the compiled shapes stay one per (batch, table width).
        self.ring_blocks = int(ring_blocks)
        self.block_size, self.max_blocks_per_seq = block_size, max_blocks_per_seq
        # Decode batches are padded up to one of these sizes (each a compiled graph when compiled).
        sizes = sorted({int(b) for b in (batch_sizes or powers_of_two(max_batch))})
        if sizes[0] < 1 or sizes[-1] > max_batch:
            raise ValueError(f"batch sizes {sizes} must lie in 1..max_batch ({max_batch})")
        if sizes[-1] != max_batch:
            sizes.append(max_batch)  # a full batch must fit somewhere
        self.batch_sizes = sizes
        if min_bucket_tokens is None:
            min_bucket_tokens = 512 if compile else 0
        self.min_bucket_blocks = min(
            max_blocks_per_seq, max(1, math.ceil(min_bucket_tokens / block_size))
        )
        self.bucket_blocks = bucket_blocks
        self.decode: Callable = self.decode_eager
        if compile:
            self.decode = torch.compile(
                self.decode_eager, mode="reduce-overhead", fullgraph=True, dynamic=False
            )
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # First-chunk prefills through torch.compile (Inductor fuses the norms, RoPE and SiLU*mul
        # that run eager as separate memory-bound kernels over every prompt token). dynamic=True:
        # one graph for every batch and prompt length (batch 1 is its own, as Dynamo
        # specializes 1); no CUDA graphs, as a prefill's shapes vary and its kernels are long.
        self.prefill_forward: Callable = self.model
        self.prefill_compile_error: str | None = None
        if compile_prefill:
            self.enable_compiled_prefill()

    def decode_eager(self, packed: torch.Tensor, carry: torch.Tensor):
        tok = packed[:, :1]
        tok = torch.where(tok < 0, carry[(-1 - tok).clamp(min=0)], tok)
        r = self.ring_blocks
        if r:
            tables, rings = packed[:, 2:-r], packed[:, -r:]
            logits = self.model(tok, packed[:, 1:2], tables, local_tables=rings)
        else:
            logits = self.model(tok, packed[:, 1:2], packed[:, 2:])
        best, best_lp = greedy(logits)
        return logits, best, best_lp

    # -- shapes --------------------------------------------------------------------------------
    def padded_batch(self, b: int) -> int:
        """The decode batch size `b` sequences run at (the smallest of `batch_sizes` >= b)."""
        return next(s for s in self.batch_sizes if s >= b)

    def table_width(self, blocks: int) -> int:
        """The block-table width (a length bucket) a decode step over `blocks` blocks runs at."""
        if not self.bucket_blocks:
            return self.max_blocks_per_seq
        return max(self.min_bucket_blocks, bucket(blocks, self.max_blocks_per_seq))

    def widths(self, top_blocks: int) -> list[int]:
        """The length buckets of tables up to `top_blocks` blocks."""
        top = self.table_width(top_blocks)
        return sorted({self.table_width(w) for w in range(1, top + 1)})

    # -- warm-up -------------------------------------------------------------------------------
    @torch.inference_mode()
    def warmup(self, widths: list[int]) -> None:
        """Run (and so compile) the decode step for every batch size and these widths, writing
        only scratch block 0."""
        for bp in self.batch_sizes:
            for nb in widths:
                width = 2 + nb + self.ring_blocks
                packed = torch.zeros(bp, width, dtype=torch.long, device=self.device)
                for _ in range(3):  # compile, then the CUDA-graph warm-up and recording runs
                    self.decode(packed, self.carry)

    def enable_compiled_prefill(self) -> None:
        """Run first-chunk prefills through `torch.compile` from now on (`compile_prefill`)."""
        if self.prefill_forward is self.model:
            self.prefill_forward = torch.compile(self.model, dynamic=True)

    @torch.inference_mode()
    def warmup_prefill(self) -> float:
        """Compile the compiled prefill's graphs (none without `compile_prefill`), writing only
        scratch block 0. Returns the seconds it took (0 when nothing is compiled).

        A compile that fails (a quantized layer Dynamo cannot trace, a missing C++ compiler on
        the CPU) is logged and the prefill stays eager (`prefill_compile_error` says why): the
        compiled prefill is a speed-up, not a reason for a server not to start.
        """
        if self.prefill_forward is self.model:
            return 0.0
        t0 = time.perf_counter()
        # Batch, length and table width must differ here: Dynamo gives equal sizes one symbol.
        t = 48
        width = math.ceil(t / self.block_size) + 1
        tables = torch.zeros(2, width, dtype=torch.long, device=self.device)
        r = self.ring_blocks  # rings as the real prefills pass them (None: none), all scratch
        rings = torch.zeros(2, r, dtype=torch.long, device=self.device) if r else None
        try:
            for b in (2, 1):  # the dynamic-shape graph, then batch 1's (Dynamo specializes 1)
                z = torch.zeros(b, t, dtype=torch.long, device=self.device)
                # contiguous, as _prefill builds it: an expanded (stride-0) tensor here would
                # make Dynamo guard on strides, and the first real prefill would compile again
                pos = torch.arange(t, device=self.device).repeat(b, 1)
                self.prefill_forward(
                    z,
                    pos,
                    tables[:b],
                    prefill=True,
                    last_index=z[:, 0] + t - 1,
                    local_tables=None if rings is None else rings[:b],
                )
        except Exception as e:  # noqa: BLE001 - any compile failure: fall back, say why
            self.prefill_forward = self.model
            self.prefill_compile_error = f"{type(e).__name__}: {e}"
            log.warning(
                "compiled prefill failed, prefill stays eager: %s", self.prefill_compile_error
            )
            return 0.0
        wait(self.device)
        return time.perf_counter() - t0
