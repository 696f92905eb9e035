"""Integrity checks that fail fast, before (and besides) the quality metrics, with a clear message.

What they catch is the silent corruption users report most: NaN/Inf in weights or outputs,
quantization scales that are all zero or missing (the int8 weights then decode to zeros or to
garbage), parameters that did not load (randomly initialized instead), a tokenizer that does not
match the reference's (every id means a different token), and degenerate output (one token repeated,
or nothing at all).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmopt.core.errors import LlmoptError

__all__ = [
    "IntegrityError",
    "check_weights",
    "check_loaded",
    "check_tokenizers",
    "degenerate",
    "raise_on_problems",
]

log = logging.getLogger(__name__)

# Probe text for tokenizer comparison: words, digits, punctuation, non-ASCII and whitespace runs.
PROBE = "The quick brown fox jumps over 13 lazy dogs; naïve café owners pay €4.50.\n\n  Done!"


class IntegrityError(LlmoptError):
    """An artifact or a running candidate is broken (NaN, missing scales, wrong tokenizer...)."""


def check_weights(folder: str | Path) -> list[str]:
    """Problems in a model folder's safetensors: non-finite tensors, zero or missing scales.

    Args:
        folder: a Hugging Face folder (or a candidate artifact) with *.safetensors files.

    Returns:
        Human-readable problems; empty when the weights look sound.

    >>> check_weights("runs/smollm2-135m/candidates/hf-w8a16/artifact")  # doctest: +SKIP
    []
    """
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    problems: list[str] = []
    names: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                names.add(key)
                t = st.get_tensor(key)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad = int((~torch.isfinite(t)).sum())
                    problems.append(f"{f.name}: {key} has {bad} NaN/Inf values")
                if key.endswith(("weight_scale", "scale", "scales")) and t.numel():
                    zero = int((t == 0).sum())
                    if zero == t.numel():
                        problems.append(f"{f.name}: quantization scale {key} is all zero")
                    elif zero:
                        problems.append(f"{f.name}: quantization scale {key} has {zero} zeros")
    for module in _quantized_modules(folder):
        if f"{module}.weight_scale" not in names:
            problems.append(f"quantization scale {module}.weight_scale is missing")
    return problems


def _quantized_modules(folder: Path) -> list[str]:
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        return []
    qcfg = json.loads(cfg_file.read_text()).get("quantization_config") or {}
    return list((qcfg.get("llmopt") or {}).get("quantized_modules", []))


def check_loaded(model: Any, folder: str | Path) -> list[str]:
    """Parameters of `model` that are not in the folder's safetensors (so they did not load).

    Tied weights (an output head that shares the embedding) are not counted.

    >>> check_loaded(runner.model, artifact)  # doctest: +SKIP
    []
    """
    from safetensors import safe_open

    stored: set[str] = set()
    for f in Path(folder).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            stored.update(st.keys())
    ptrs: dict[int, str] = {}
    missing = []
    for name, p in model.named_parameters(remove_duplicate=False):
        first = ptrs.setdefault(p.data_ptr(), name)
        if first != name:
            continue  # tied to a parameter already seen
        # HF prefixes differ between a base model and its task head ("model." / "bert.").
        if not any(s == name or s.endswith("." + name) or name.endswith("." + s) for s in stored):
            missing.append(name)
    return [f"parameter {n} is not in the checkpoint (randomly initialized)" for n in missing]


def check_tokenizers(reference: Any, candidate: Any, text: str = PROBE) -> str | None:
    """None when both tokenizers encode `text` identically, else what differs.

    >>> check_tokenizers(ref.tokenizer, cand.tokenizer)  # doctest: +SKIP
    """
    a = reference(text, add_special_tokens=False)["input_ids"]
    b = candidate(text, add_special_tokens=False)["input_ids"]
    if a == b:
        return None
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return (
        f"tokenizer mismatch: the probe text encodes to {len(b)} ids in the candidate and "
        f"{len(a)} in the reference, first differing at position {at} "
        f"(reference {a[at : at + 4]}, candidate {b[at : at + 4]}); "
        "copy the reference's tokenizer files into the candidate folder"
    )


def degenerate(tokens: Sequence[int], eos_token_id: int | None = None) -> str | None:
    """None for healthy output, else why it is degenerate (empty, or one token repeated).

    >>> degenerate([5, 5, 5, 5, 5, 5, 5, 5])
    'degenerate output: token 5 repeated 8 times'
    >>> degenerate([3, 9, 4]) is None
    True
    """
    toks = list(tokens)
    if eos_token_id is not None and eos_token_id in toks:
        toks = toks[: toks.index(eos_token_id)]
    if not toks:
        return "degenerate output: empty (end of text at once)"
    if len(toks) >= 4 and len(set(toks)) == 1:
        return f"degenerate output: token {toks[0]} repeated {len(toks)} times"
    return None


def raise_on_problems(problems: Sequence[str], what: str) -> None:
    """Raise IntegrityError listing `problems` (no-op when empty)."""
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise IntegrityError(
            f"{what} failed integrity checks:\n  {shown}{more}",
            hint="rebuild the candidate (llmopt optimize --force) or fix the export that wrote it",
        )
