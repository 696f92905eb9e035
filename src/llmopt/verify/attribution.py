"""Layer-level attribution: where does the candidate's computation leave the reference's?

Forward hooks record every transformer block's output hidden state in the reference and in the
candidate on the same input; the SQNR per block (signal = reference, noise = the difference, in dB)
falls as error accumulates. A healthy quantized model loses SQNR gradually; a broken layer makes it
*jump*, and the first such block is the one to inspect (or leave unquantized).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LayerSQNR", "Attribution", "find_layers", "layer_sqnr"]

# SQNR of identical tensors is infinite; cap it so drops stay finite numbers.
MAX_DB = 200.0


@dataclass
class LayerSQNR:
    index: int
    name: str
    sqnr_db: float


@dataclass
class Attribution:
    """SQNR per block and the first block where the error jumps (None when none does)."""

    layers: list[LayerSQNR]
    first_jump: int | None
    jump_db: float
    floor_db: float
    notes: list[str] = field(default_factory=list)

    @property
    def first_jump_name(self) -> str | None:
        return None if self.first_jump is None else self.layers[self.first_jump].name

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["first_jump_name"] = self.first_jump_name
        return d


def find_layers(model) -> tuple[str, list]:
    """The transformer blocks of a HF model: the longest nn.ModuleList (decoder or encoder layers).

    >>> find_layers(runner.model)[0]  # doctest: +SKIP
    'model.layers'
    """
    from torch import nn

    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    assert lists, f"{type(model).__name__} has no nn.ModuleList of layers"
    name, layers = max(lists, key=lambda nm: len(nm[1]))
    return name, list(layers)


def _capture(model, inputs: dict[str, Any]) -> tuple[list[str], list]:
    import torch

    prefix, layers = find_layers(model)
    outs: list = [None] * len(layers)
    hooks = []
    for i, layer in enumerate(layers):

        def hook(_m, _inp, out, i=i):
            h = out[0] if isinstance(out, tuple) else out  # (B, T, D)
            outs[i] = h.detach().float().cpu()

        hooks.append(layer.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return [f"{prefix}.{i}" for i in range(len(layers))], outs


def layer_sqnr(
    reference_model,
    candidate_model,
    inputs: dict[str, Any],
    jump_db: float = 15.0,
    floor_db: float = 20.0,
) -> Attribution:
    """Per-block SQNR of the candidate's hidden states against the reference's.

    Args:
        reference_model: the reference torch module (e.g. `runner.model`).
        candidate_model: the candidate torch module, same architecture.
        inputs: model keyword inputs, e.g. {"input_ids": (1, T) tensor}.
        jump_db: a drop of at least this many dB from the previous block is a jump.
        floor_db: a block below this SQNR counts as a jump too (catches a fault in block 0).

    Returns:
        Attribution with one LayerSQNR per block and `first_jump`.

    >>> a = layer_sqnr(ref.model, cand.model, {"input_ids": windows[:1, :128]})  # doctest: +SKIP
    >>> a.first_jump_name  # doctest: +SKIP
    'model.layers.7'
    """
    names, ref = _capture(reference_model, inputs)
    _, cand = _capture(candidate_model, inputs)
    assert len(ref) == len(cand), f"{len(ref)} reference blocks vs {len(cand)} candidate blocks"
    layers = []
    for i, (r, c) in enumerate(zip(ref, cand, strict=False)):
        noise = float(((r - c) ** 2).sum())
        signal = float((r**2).sum())
        if not math.isfinite(noise):
            db = -MAX_DB
        elif noise == 0.0:
            db = MAX_DB
        else:
            db = min(MAX_DB, 10.0 * math.log10(max(signal, 1e-30) / noise))
        layers.append(LayerSQNR(i, names[i], db))
    first = None
    for i, layer in enumerate(layers):
        prev = layers[i - 1].sqnr_db if i else None
        if layer.sqnr_db < floor_db or (prev is not None and prev - layer.sqnr_db >= jump_db):
            first = i
            break
    return Attribution(layers, first, jump_db, floor_db)
