"""Int8 weight-only linear layers (W8A16) for the hf and torch engines, and the quantizer that makes them.

Weights are stored as int8 with one fp32 scale per output channel (symmetric, zero point 0), the
layout compressed-tensors calls "int-quantized" with strategy "channel": `weight` (out, in) int8
and `weight_scale` (out, 1). Activations stay in 16/32-bit floats.

Why hand-written: torchao is not installed on our CPU or GPU hosts, and the kernel we need on CPU,
`torch._weight_int8pack_mm`, ships with PyTorch itself. Measured on a 2-core Xeon (AVX-512, AMX):
at one token per step it beats an fp32 matmul by ~2.5x when fed bf16 activations, but it is far
slower than fp32 for prompt-sized inputs, so larger inputs dequantize the weight and use the
regular fp32 matmul instead (dispatch on the number of rows, `SMALL_M`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "Int8WeightOnlyLinear",
    "quantize_weight_int8",
    "quantize_linears_",
    "install_int8_linears_",
]

# Rows (tokens in the step) up to which the int8 kernel is used; above it, dequantize + fp32 GEMM.
SMALL_M = 8


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization.

    Args:
        weight: (out, in) float tensor.

    Returns:
        (int8 weight (out, in), fp32 scale (out, 1)) with weight ~= q * scale.

    >>> q, s = quantize_weight_int8(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
    >>> q.tolist(), [round(x, 4) for x in s.flatten().tolist()]
    ([[64, -127], [127, 64]], [0.0157, 0.0039])
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0  # (out, 1)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8WeightOnlyLinear(nn.Module):
    """A Linear whose weight is int8 with per-channel scales; computes y = x @ (q * s)^T + b."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        assert q.dtype == torch.int8 and q.dim() == 2, "q must be a 2-D int8 tensor"
        assert scale.shape == (q.shape[0], 1), f"scale must be (out, 1), got {tuple(scale.shape)}"
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        # clone(): a tensor read from safetensors can sit at an unaligned offset of the mapped file,
        # and the CPU int8pack kernel (AVX-512/AMX) segfaults on those.
        self.register_buffer("weight", q.contiguous().clone())
        self.register_buffer("weight_scale", scale.float().contiguous())
        # The CPU kernel wants the scale as a flat vector in the activation dtype.
        self.register_buffer("_scale_bf16", scale.flatten().to(torch.bfloat16), persistent=False)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if x2.device.type == "cpu" and x2.shape[0] <= SMALL_M:
            # A16: the int8 kernel reads 1 byte per weight; activations go in as bf16.
            y = torch._weight_int8pack_mm(
                x2.to(torch.bfloat16).contiguous(), self.weight, self._scale_bf16
            )
            y = y.to(x.dtype)
        else:
            w = self.weight.to(x.dtype) * self.weight_scale.to(x.dtype)  # (out, in)
            y = nn.functional.linear(x2, w)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def _ignored(name: str, ignore: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) for s in ignore)


def quantize_linears_(model: nn.Module, ignore: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Replace every nn.Linear (except names ending in `ignore`) by an Int8WeightOnlyLinear, in place.

    Returns the names of the replaced modules.
    """
    done = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or _ignored(name, ignore):
            continue
        q, s = quantize_weight_int8(module.weight)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8WeightOnlyLinear(q, s, module.bias))
        done.append(name)
    return done


def install_int8_linears_(
    model: nn.Module, state: dict[str, torch.Tensor], names: list[str]
) -> None:
    """Swap the Linear modules `names` for Int8WeightOnlyLinear built from saved tensors, in place."""
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear), f"{name} is {type(linear).__name__}, expected Linear"
        bias = state.get(f"{name}.bias")
        q, s = state[f"{name}.weight"], state[f"{name}.weight_scale"]
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8WeightOnlyLinear(q, s, bias))
