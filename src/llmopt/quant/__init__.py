"""Quantization with calibration: recipes (`llmopt.core.recipes`) applied layer by layer, exported as
compressed-tensors Hugging Face folders (and GGUF for llama.cpp).

Entry point: `quantize(source, recipe, out, calibration=..., device=..., auto_exclude=...,
max_quality_drop=...) -> facts`. See docs/quantization.md.

Why not llm-compressor: version 0.14 pins transformers<=5.17 (we run 5.24) and
compressed-tensors==0.19, and pulls in `datasets` and `auto-round`. We use compressed-tensors
itself (config objects and the compressors that pack the weights) and write the algorithms
(RTN, AWQ, GPTQ, SmoothQuant, FP8) in `algorithms.py`.
"""

from __future__ import annotations

from llmopt.quant.api import build_checkpoint, fake_quantized_model, quantize
from llmopt.quant.calibration import CalibrationConfig, CalibrationDataError
from llmopt.quant.checks import QuantConfigError, QuantMemoryError

__all__ = [
    "quantize",
    "build_checkpoint",
    "fake_quantized_model",
    "CalibrationConfig",
    "CalibrationDataError",
    "QuantConfigError",
    "QuantMemoryError",
]
