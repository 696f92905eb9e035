"""Multiple-choice tasks from a user's JSONL file, scored by log-likelihood as lm-eval does.

Each line: {"context": "...", "choices": ["...", "..."], "answer": 0} ("question" and "label" are
accepted as aliases). The model's pick is the choice whose tokens, appended to the context, have
the highest summed log-probability (lm-eval's `acc`); the same items go through the reference and
the candidate, and the accuracy delta carries a paired-bootstrap interval over items.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmopt.core.schema import Metric
from llmopt.verify.gates import Gates
from llmopt.verify.stats import DEFAULT_SEED, is_noise, paired_bootstrap

__all__ = ["Item", "load_tasks", "choice_logprob", "accuracy", "score_tasks"]


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    answer: int


def load_tasks(path: str | Path) -> list[Item]:
    """Read a multiple-choice JSONL file; a malformed line raises ValueError naming it.

    >>> load_tasks("tasks/capitals.jsonl")[0].choices  # doctest: +SKIP
    ('Paris', 'Lyon')
    """
    items = []
    for no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d: dict[str, Any] = json.loads(line)
            ctx = d.get("context", d.get("question"))
            choices = tuple(str(c) for c in d["choices"])
            answer = int(d.get("answer", d.get("label")))
            assert isinstance(ctx, str) and len(choices) >= 2 and 0 <= answer < len(choices)
        except (ValueError, KeyError, TypeError, AssertionError) as e:
            raise ValueError(
                f"{path}:{no}: expected {{'context': str, 'choices': [str, ...], 'answer': int}} "
                f"with answer an index into choices ({type(e).__name__})"
            ) from None
        items.append(Item(ctx, choices, answer))
    if not items:
        raise ValueError(f"{path} holds no task items; write one JSON object per line")
    return items


def _continuation_logprobs(runner, ids: list[int], n_cont: int) -> float:
    # Endpoints echo prompt log-probabilities; in-process runners give full logits.
    if hasattr(runner, "token_logprobs"):
        return float(np.sum(runner.token_logprobs(ids)[0][-n_cont:]))
    import torch
    import torch.nn.functional as F

    x = torch.tensor([ids], dtype=torch.long)
    logp = F.log_softmax(runner.logits(x)[0, :-1].float(), -1)  # (T-1, V)
    target = x[0, 1:].unsqueeze(-1)
    return float(logp.gather(-1, target)[-n_cont:].sum())


def choice_logprob(runner, tokenizer, context: str, choice: str) -> float:
    """Summed log-probability of `choice`'s tokens after `context` (a space joins them).

    >>> choice_logprob(runner, runner.tokenizer, "The capital of France is", "Paris")  # doctest: +SKIP
    -1.9
    """
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    full = tokenizer(context + " " + choice, add_special_tokens=False)["input_ids"]
    # Tokens past the shared prefix belong to the choice (BPE may merge across the boundary).
    shared = next((i for i, (a, b) in enumerate(zip(ctx, full, strict=False)) if a != b), len(ctx))
    shared = max(1, min(shared, len(full) - 1))
    return _continuation_logprobs(runner, full, len(full) - shared)


def accuracy(items: list[Item], runner, tokenizer) -> np.ndarray:
    """Per-item correctness (1.0 / 0.0) of the highest-log-likelihood choice."""
    correct = []
    for it in items:
        scores = [choice_logprob(runner, tokenizer, it.context, c) for c in it.choices]
        correct.append(float(int(np.argmax(scores)) == it.answer))
    return np.array(correct)


def score_tasks(
    items: list[Item], reference, candidate, gates: Gates | None = None, seed: int = DEFAULT_SEED
) -> Metric:
    """The `task_accuracy` Metric of `candidate` next to `reference`, gated on the drop.

    >>> score_tasks(load_tasks("mc.jsonl"), ref_runner, cand_runner).passed  # doctest: +SKIP
    True
    """
    gates = gates or Gates()
    tok = reference.tokenizer
    ref = accuracy(items, reference, tok)
    cand = accuracy(items, candidate, tok)
    ci = paired_bootstrap(ref, cand, seed=seed)
    threshold = passed = None
    if gates.max_task_accuracy_drop is not None:
        threshold = float(ref.mean()) - gates.max_task_accuracy_drop
        passed = bool(cand.mean() >= threshold)
    return Metric(
        "task_accuracy",
        float(ref.mean()),
        float(cand.mean()),
        True,
        threshold,
        passed,
        len(items),
        "",
        "multiple-choice, log-likelihood of each choice (lm-eval acc)",
        ci[0],
        ci[1],
        is_noise(ci),
    )
