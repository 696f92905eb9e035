"""Teacher-forced logits of one token window through the engine's own paths, for quality checks.

A window runs as the engine would run it: a prefill chunk, a second chunk through the paged path
(which reads the KV cache, so a float8 cache is part of what is scored), then its last `decode`
tokens one at a time, each a one-row step through the decode kernels (on CUDA: the GEMV linears,
the flash-decoding attention, the fused RoPE when on). A check over whole windows alone would
never exercise those kernels: a chunk of more than one token takes the matmul paths.
"""

from __future__ import annotations

import math

import torch


def window_logits(
    model, ids: torch.Tensor, prefill: int, decode: int, kv_dtype: torch.dtype, device
) -> torch.Tensor:
    """fp32 logits (T, V) of `ids` (T,): positions [0, prefill) as a prefill, [prefill, T -
    decode) as one paged chunk, the last `decode` one token per forward."""
    t = ids.numel()
    if not 0 < prefill <= t - decode or decode < 0:
        raise ValueError(f"a window of {t} tokens cannot hold prefill={prefill}, decode={decode}")
    bs = 16
    nb = math.ceil(t / bs)
    model.setup_cache(nb + 1, bs, kv_dtype, device)
    table = torch.arange(1, nb + 1, device=device).unsqueeze(0)
    x = ids.view(1, -1).to(device)
    pos = torch.arange(t, device=device).unsqueeze(0)
    cuts = [0, prefill, *range(t - decode, t + 1)]
    out = []
    with torch.inference_mode():
        for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            if b > a:
                out.append(model(x[:, a:b], pos[:, a:b], table, prefill=i == 0, last_only=False))
    return torch.cat(out, dim=1)[0].float()
