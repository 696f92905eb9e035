"""Verify a candidate served behind an OpenAI-compatible endpoint (vLLM, llama.cpp, TGI...).

The same metrics as in process, from the two endpoints every such server has:

- `/v1/completions` with `echo=True, logprobs=k, max_tokens=1`: the log-probability of every prompt
  token (perplexity) and the server's top-k alternatives (top-1 agreement); with `temperature=0`,
  greedy generations (greedy match length);
- `/v1/embeddings`: an `EmbeddingRunner`, so `verify_embedding` runs unchanged.

An endpoint returns top-k log-probabilities, not the full distribution, so KL divergence cannot be
computed: the result says so in its notes instead of leaving the metric out silently. Servers that
do not echo prompt log-probabilities get the same treatment for perplexity.
Standard library HTTP only (urllib): no client dependency for a few JSON posts.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from llmopt.assets.text import window_convention
from llmopt.core.errors import LlmoptError
from llmopt.core.schema import Metric, VerifyResult
from llmopt.verify.gates import Gates
from llmopt.verify.lm import greedy_tokens, perplexity_metric
from llmopt.verify.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_ci, is_noise

if TYPE_CHECKING:
    import torch

__all__ = [
    "EndpointError",
    "OpenAIEndpoint",
    "EndpointEmbeddingRunner",
    "verify_causal_lm_endpoint",
]


class EndpointError(LlmoptError):
    """The endpoint could not be reached or answered something unusable."""


class OpenAIEndpoint:
    """A minimal client of an OpenAI-compatible server.

    Args:
        base_url: e.g. "http://127.0.0.1:8000/v1" (a trailing /v1 is added when missing).
        model: the model name to send; the server's first listed model when None.
        timeout: seconds per request.

    >>> ep = OpenAIEndpoint("http://127.0.0.1:8000")  # doctest: +SKIP
    >>> ep.token_logprobs([1, 2, 3])  # doctest: +SKIP
    [-3.1, -0.2]
    """

    def __init__(
        self, base_url: str, model: str | None = None, timeout: float = 120.0, tokenizer=None
    ):
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.timeout = timeout
        self.model = model or self._first_model()
        # Servers that refuse token-id prompts (llama-cpp-python) get text decoded with the
        # reference's tokenizer; the echoed token count then doubles as a tokenizer check.
        self.tokenizer = tokenizer
        self.text_prompts = False

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            raise EndpointError(
                f"{self.base_url}{path} answered HTTP {e.code}: {detail}",
                hint="check that the server is OpenAI-compatible and serves this model",
            ) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise EndpointError(
                f"cannot reach {self.base_url}{path}: {e}",
                hint="start the server first, or fix --endpoint (e.g. http://127.0.0.1:8000/v1)",
            ) from None

    def _first_model(self) -> str:
        models = self._request("/models").get("data") or []
        if not models:
            raise EndpointError(
                f"{self.base_url}/models lists no model", hint="pass the model name"
            )
        return models[0]["id"]

    def _complete(self, ids: Sequence[int], **kw: Any) -> dict[str, Any]:
        prompt = self.tokenizer.decode(list(ids)) if self.text_prompts else [int(i) for i in ids]
        body = {"model": self.model, "prompt": prompt, "temperature": 0.0, **kw}
        try:
            return self._request("/completions", body)
        except EndpointError as e:
            if self.text_prompts or self.tokenizer is None or "valid string" not in e.message:
                raise
            self.text_prompts = True
            return self._complete(ids, **kw)

    def token_logprobs(self, ids: Sequence[int], top: int = 1) -> tuple[list[float], list[dict]]:
        """Log-probability of each token of `ids` after the first, and the top-k alternatives.

        Raises EndpointError when the server does not return prompt log-probabilities, or
        (text prompts) tokenizes the window into a different number of tokens.
        """
        choice = self._complete(ids, max_tokens=1, echo=True, logprobs=top)["choices"][0]
        lp = choice.get("logprobs") or {}
        values = list(lp.get("token_logprobs") or [])
        tops = list(lp.get("top_logprobs") or [{}] * len(values))
        if self.text_prompts and values:
            # Echo = prompt tokens, plus a BOS some servers add (llama-cpp-python echoes only
            # the prompt; others append the generated token, dropped below by the slice).
            if len(values) == len(ids) + 2:
                values, tops = values[:-1], tops[:-1]
            if len(values) == len(ids) + 1:
                values, tops = values[1:], tops[1:]
            if len(values) != len(ids):
                raise EndpointError(
                    f"tokenizer mismatch: the server tokenized a {len(ids)}-token window into "
                    f"{len(values)} tokens",
                    hint="serve a model that shares the reference's tokenizer",
                )
        if len(values) < len(ids) or any(v is None for v in values[1 : len(ids)]):
            raise EndpointError(
                f"{self.base_url} returned {len(values)} log-probabilities for a {len(ids)}-token "
                "prompt: it does not echo prompt log-probabilities",
                hint="llama.cpp: start llama_cpp.server with --logits_all true; vLLM echoes them",
            )
        return [float(v) for v in values[1 : len(ids)]], list(tops[1 : len(ids)])

    def greedy_text(self, ids: Sequence[int], new_tokens: int) -> str:
        """Greedy continuation (temperature 0) of the prompt `ids`, as text."""
        return self._complete(ids, max_tokens=new_tokens)["choices"][0]["text"]

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Embeddings from `/v1/embeddings`, in input order: (len(texts), D) float32."""
        rows: list[list[float]] = []
        for s in range(0, len(texts), batch_size):
            batch = list(texts[s : s + batch_size])
            data = self._request("/embeddings", {"model": self.model, "input": batch})["data"]
            rows += [d["embedding"] for d in sorted(data, key=lambda d: d.get("index", 0))]
        return np.asarray(rows, dtype=np.float32).reshape(len(texts), -1)

    def embedding_runner(self) -> EndpointEmbeddingRunner:
        return EndpointEmbeddingRunner(self)


class EndpointEmbeddingRunner:
    """EmbeddingRunner over `/v1/embeddings`, so `verify_embedding` verifies servers unchanged."""

    def __init__(self, endpoint: OpenAIEndpoint):
        self.endpoint = endpoint

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        return self.endpoint.embed(texts, batch_size)


def verify_causal_lm_endpoint(
    candidate_id: str,
    endpoint: OpenAIEndpoint,
    windows: torch.Tensor,
    reference,
    gates: Gates | None = None,
    generation_prompts: int = 2,
    generation_tokens: int = 32,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> VerifyResult:
    """`verify_causal_lm` for a served candidate: perplexity, top-1 agreement, greedy match.

    Args:
        candidate_id: for the result.
        endpoint: the served candidate.
        windows: (N, T) token ids in the reference's tokenizer (the server must share it).
        reference: the in-process reference runner.
        gates: thresholds; `Gates()` by default.
        generation_prompts, generation_tokens: greedy generations compared with the reference.
        resamples, seed: bootstrap settings.

    >>> verify_causal_lm_endpoint("llama.cpp", ep, windows, ref_runner).passed  # doctest: +SKIP
    True
    """
    import torch.nn.functional as F

    gates = gates or Gates()
    t0 = time.perf_counter()
    n, T = windows.shape
    tok = reference.tokenizer
    nll_c, nll_r, agree, shifted = (np.zeros(n) for _ in range(4))
    notes = [
        "kl_divergence_mean not measured: an endpoint returns top-k log-probabilities, "
        "not the full next-token distribution"
    ]
    top1_ok = True
    try:
        for i, w in enumerate(windows):
            lp_c, tops = endpoint.token_logprobs(w.tolist(), top=1)
            nll_c[i] = -float(np.sum(lp_c))
            logp_r = F.log_softmax(reference.logits(w.view(1, -1))[0, :-1].float(), -1)  # (T-1, V)
            nll_r[i] = -logp_r.gather(-1, w[1:].unsqueeze(-1)).sum().item()
            if top1_ok and all(tops):
                ref_top = [tok.decode([int(t)]) for t in logp_r.argmax(-1)]
                cand_top = [max(d, key=d.get) for d in tops]
                agree[i] = float(np.mean([a == b for a, b in zip(ref_top, cand_top, strict=True)]))
                shifted[i] = float(
                    np.mean([a == b for a, b in zip(ref_top[1:], cand_top[:-1], strict=False)])
                )
            else:
                top1_ok = False
    except EndpointError as e:
        if "does not echo" not in e.message:
            raise
        # Say so in the result: the primary gate cannot be measured, so the candidate cannot pass.
        notes.append(f"perplexity and top1_agreement not measured: {e.message}")
        metrics = [
            Metric(
                "perplexity",
                None,
                float("nan"),
                False,
                None,
                False,
                0,
                "",
                "not measured: no prompt log-probabilities from the endpoint",
            )
        ]
        metrics += _greedy(endpoint, reference, windows, generation_prompts, generation_tokens)
        return VerifyResult(
            candidate_id,
            "causal-lm",
            metrics,
            False,
            float("nan"),
            time.perf_counter() - t0,
            notes,
            inputs=_sent(endpoint, tok),
        )
    if top1_ok and n and shifted.mean() > agree.mean() + 0.2:
        notes.append(
            f"the endpoint's prompt log-probabilities look shifted by one position (its top-1 "
            f"matches the reference's next-position pick {shifted.mean():.0%} of the time, the "
            f"same position {agree.mean():.0%}): a server bug (llama-cpp-python echo), so its "
            "perplexity and top-1 agreement are not the model's"
        )
    ppl, drop = perplexity_metric(
        nll_c,
        nll_r,
        T - 1,
        gates.max_quality_drop,
        resamples,
        seed,
        f"{n} windows x {T} tokens, prompt log-probabilities echoed",
    )
    metrics = [ppl]
    if top1_ok:
        lo, hi = bootstrap_ci(lambda ix: float(agree[ix].mean()), n, resamples, seed=seed)
        value = float(agree.mean())
        passed = None if gates.min_top1_agreement is None else value >= gates.min_top1_agreement
        metrics.append(
            Metric(
                "top1_agreement",
                1.0,
                value,
                True,
                gates.min_top1_agreement,
                passed,
                n * (T - 1),
                "",
                "compared as decoded token text",
                lo - 1,
                hi - 1,
                is_noise((lo - 1, hi - 1)),
            )
        )
    else:
        notes.append("top1_agreement not measured: the endpoint returned no top_logprobs")
    metrics += _greedy(endpoint, reference, windows, generation_prompts, generation_tokens)
    passed = all(m.passed for m in metrics if m.passed is not None)
    return VerifyResult(
        candidate_id,
        "causal-lm",
        metrics,
        passed,
        drop,
        time.perf_counter() - t0,
        notes,
        inputs=_sent(endpoint, tok),
    )


def _sent(endpoint: OpenAIEndpoint, tok) -> str:
    """The windows' input convention, and how they reached the server."""
    how = (
        "sent as text decoded with the reference tokenizer"
        if endpoint.text_prompts
        else ("sent as token ids")
    )
    return f"{window_convention(tok)}; {how}"


def _greedy(endpoint, reference, windows, prompts: int, new: int) -> list[Metric]:

    tok = reference.tokenizer
    lengths = []
    for w in windows[:prompts]:
        prompt = w[:32]
        ref_ids = greedy_tokens(reference, prompt, new)
        text = endpoint.greedy_text(prompt.tolist(), new)
        cand_ids = tok(text, add_special_tokens=False)["input_ids"][:new]
        same = next(
            (k for k, (a, b) in enumerate(zip(cand_ids, ref_ids, strict=False)) if a != b),
            min(len(cand_ids), len(ref_ids)),
        )
        lengths.append(same)
    if not lengths:
        return []
    return [
        Metric(
            "greedy_match_length",
            float(new),
            float(np.mean(lengths)),
            True,
            n=len(lengths),
            unit="tokens",
            note="server text re-tokenized with the reference tokenizer",
        )
    ]
