"""`verify_models`: verify a candidate (folder, built-in name or endpoint) against a reference.

This is what `llmopt verify REFERENCE CANDIDATE` calls. It reads top to bottom: load both, run the
integrity checks (fail fast), score the task's metrics with their gates, then attribute the error
to a layer when both sides are in-process torch models.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt import engines
from llmopt.assets.text import (
    evaluation_sentences,
    evaluation_text,
    simlex999,
    token_windows,
    wordsim353,
)
from llmopt.core.recipes import get_recipe
from llmopt.core.schema import VerifyResult
from llmopt.hardware.runtime import flush_denormals
from llmopt.model.info import inspect_model
from llmopt.verify import endpoint as ep
from llmopt.verify.attribution import layer_sqnr
from llmopt.verify.embedding import RetrievalSpec, reference_side, verify_embedding
from llmopt.verify.gates import Gates
from llmopt.verify.integrity import IntegrityError, check_tokenizers, check_weights
from llmopt.verify.lm import verify_causal_lm
from llmopt.verify.tasks import load_tasks, score_tasks

__all__ = ["VerifyReport", "load_runner", "verify_models"]

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    """What `llmopt verify` prints: the gated result, integrity problems and layer attribution."""

    reference: str
    candidate: str
    result: VerifyResult
    integrity: list[str] = field(default_factory=list)
    attribution: dict[str, Any] | None = None
    tasks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.result.passed and not self.integrity

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "candidate": self.candidate,
            "passed": self.passed,
            "result": self.result.to_dict(),
            "integrity": self.integrity,
            "attribution": self.attribution,
        }


def _recipe_of(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    q = cfg.get("quantization_config") or {}
    if (q.get("llmopt") or {}).get("recipe"):
        return q["llmopt"]["recipe"]
    return {"bfloat16": "bf16", "float16": "fp16"}.get(str(cfg.get("torch_dtype")), "fp32")


def load_runner(model: str | Path, recipe: str | None = None, threads: int | None = None):
    """A torch-engine runner for a HF folder, a candidate artifact or a built-in name.

    Args:
        model: built-in name (smollm2-135m, minilm-l6) or folder.
        recipe: the folder's recipe (fp32, bf16, w8a16); read from its config.json when None.
        threads: CPU threads.

    Returns:
        (runner, ModelInfo, folder).

    >>> runner, info, folder = load_runner("smollm2-135m")  # doctest: +SKIP
    """

    info = inspect_model(str(model))
    folder = Path(info.path)
    rec = get_recipe(recipe or _recipe_of(folder))
    settings = {"threads": threads} if threads else {}
    return engines.load_runner("hf", folder, info, rec, settings), info, folder


@flush_denormals()  # the whole verification runs with denormals flushed (see flush_denormals)
def verify_models(
    reference: str | Path,
    candidate: str | Path | None = None,
    *,
    endpoint: str | None = None,
    endpoint_model: str | None = None,
    recipe: str | None = None,
    gates: Gates | None = None,
    windows: int = 8,
    window: int = 256,
    sentences: int = 1000,
    tasks: str | Path | None = None,
    attribution: bool = True,
    threads: int | None = None,
    progress=None,
    retrieval: RetrievalSpec | None = None,
) -> VerifyReport:
    """Verify `candidate` (a folder or built-in) or `endpoint` (an OpenAI-compatible URL).

    Args:
        reference: the reference model (built-in name or folder), run in process with torch fp32.
        candidate: the candidate folder or built-in name; None when `endpoint` is given.
        endpoint: base URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1).
        endpoint_model: the model name to send to the endpoint (its first listed model if None).
        recipe: the candidate folder's recipe (read from its config.json when None).
        gates: thresholds; `Gates()` by default.
        windows, window: causal LMs: held-out windows and tokens per window.
        sentences: embeddings: held-out sentences.
        tasks: causal LMs: a multiple-choice JSONL file (see `llmopt.verify.tasks`).
        attribution: compute per-layer SQNR (both in process, causal or embedding).
        threads: CPU threads.
        progress: optional callable(done, total).
        retrieval: embeddings: the user's threshold, pairs, queries and corpus; the model's
            instruction prompts are filled in from its folder.

    >>> verify_models("smollm2-135m", "runs/smollm2-135m/candidates/hf-w8a16/artifact").passed
    ... # doctest: +SKIP
    True
    """

    gates = gates or Gates()

    ref_runner, info, _ = load_runner(reference, "fp32", threads)
    integrity: list[str] = []
    if endpoint:
        cand_name = endpoint
        client = ep.OpenAIEndpoint(endpoint, endpoint_model, tokenizer=ref_runner.tokenizer)
        cand_runner = client.embedding_runner() if info.task == "embedding" else client
    else:
        assert candidate is not None, "give a candidate folder or an endpoint"

        cinfo = inspect_model(str(candidate))
        cand_name = cinfo.path
        # Before loading: a missing scale would otherwise crash the loader with a bare KeyError.
        integrity += check_weights(cinfo.path)
        if cinfo.task != info.task:
            integrity.append(f"task mismatch: reference {info.task}, candidate {cinfo.task}")
        if not integrity:
            cand_runner = load_runner(candidate, recipe, threads)[0]
    if integrity:
        # Fail fast: quality numbers of a corrupt artifact would only confuse.
        raise IntegrityError(
            f"{cand_name} failed integrity checks:\n  " + "\n  ".join(integrity),
            hint="rebuild the candidate or fix the export that wrote it",
        )
    if info.task == "embedding":
        sents = evaluation_sentences(sentences)
        ref_res = verify_embedding(
            "reference",
            ref_runner,
            sents,
            None,
            wordsim353(),
            None,
            gates=gates,
            simlex_pairs=simlex999(),
            retrieval=(retrieval or RetrievalSpec()).with_prompts(info),
        )
        scores = {m.name: m.candidate for m in ref_res.metrics}
        ref_emb = ref_runner.embed(sents)
        spec = (retrieval or RetrievalSpec()).with_prompts(info)
        result = verify_embedding(
            "candidate",
            cand_runner,
            sents,
            ref_emb,
            wordsim353(),
            scores["wordsim353_spearman"],
            1.0 - gates.max_quality_drop,
            gates=gates,
            simlex_pairs=simlex999(),
            reference_scores=scores,
            retrieval=spec,
            reference_retrieval=reference_side(ref_runner, spec),
        )
        report = VerifyReport(str(reference), cand_name, result)
    else:
        cand_tok = getattr(cand_runner, "tokenizer", None)
        if cand_tok is not None and (bad := check_tokenizers(ref_runner.tokenizer, cand_tok)):
            raise IntegrityError(bad, hint="use the reference's tokenizer files in the candidate")
        ids = token_windows(ref_runner.tokenizer, evaluation_text(), window, windows)
        if endpoint:
            result = ep.verify_causal_lm_endpoint("candidate", client, ids, ref_runner, gates)
        else:
            result = verify_causal_lm(
                "candidate",
                cand_runner,
                ids,
                ref_runner,
                gates.max_quality_drop,
                progress,
                gates=gates,
            )
        report = VerifyReport(str(reference), cand_name, result)
        if tasks:
            metric = score_tasks(load_tasks(tasks), ref_runner, cand_runner, gates)
            result.metrics.append(metric)
            result.passed = result.passed and metric.passed is not False
    if attribution and not endpoint and hasattr(cand_runner, "model"):
        report.attribution = _attribute(ref_runner, cand_runner, info.task).to_dict()
    return report


def _attribute(ref_runner, cand_runner, task: str):
    import torch

    tok = ref_runner.tokenizer
    ids = tok(evaluation_text()[:2000], add_special_tokens=False, return_tensors="pt")
    inputs = {"input_ids": ids["input_ids"][:, :128]}
    if task == "embedding":
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return layer_sqnr(ref_runner.model, cand_runner.model, inputs)
