"""Logits to tokens under `SamplingParams`: greedy, temperature, top-k, top-p, seeded draws, and
the log-probabilities a request asks for (of each chosen token, its top-N alternatives, and of
the prompt's own tokens).

Every operation is row-wise: a sequence's tokens do not depend on what else is in its batch, and
a seeded sequence (its own `torch.Generator`, `make_rng`) gets the same tokens in any batch.
"""

from __future__ import annotations

import torch

from llmopt.engines.generation import TEMPERATURE_FLOOR, PromptLogprob, SamplingParams

__all__ = [
    "NUCLEUS_K",
    "make_rng",
    "sampled",
    "greedy",
    "greedy_split",
    "GREEDY_SPLIT_MIN",
    "GREEDY_CHUNKS",
    "nucleus",
    "sample_rows",
    "prompt_logprobs",
    "PROMPT_LOGPROB_CHUNK",
]

# `greedy` reduces a vocabulary of at least GREEDY_SPLIT_MIN logits on CUDA in GREEDY_CHUNKS pieces
GREEDY_SPLIT_MIN = 8192
GREEDY_CHUNKS = 128

# Top-p looks for each row's nucleus among its top NUCLEUS_K logits first (see `nucleus`).
NUCLEUS_K = 256

# Prompt log-probabilities: fp32 logits computed per chunk of positions, at most this many
# elements (64 MiB) at a time, so a long prompt never holds (T, vocab) logits at once.
PROMPT_LOGPROB_CHUNK = 1 << 24


def sampled(params: SamplingParams) -> bool:
    """Whether a sequence draws at random: a temperature below `TEMPERATURE_FLOOR` is greedy."""
    return params.temperature >= TEMPERATURE_FLOOR


def make_rng(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The random generator a sampled sequence draws from (None for greedy): seeded with
    `params.seed`, else from torch's global generator."""
    if not sampled(params):
        return None
    rng = torch.Generator(device=device)
    rng.manual_seed(params.seed if params.seed is not None else torch.seed())
    return rng


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax token (B,), its log-probability (B,)) of logits (B, V); traceable (the compiled
    decode step runs it in its graph). On CUDA a large vocabulary goes through `greedy_split`."""
    if logits.is_cuda and logits.shape[-1] >= GREEDY_SPLIT_MIN:
        return greedy_split(logits)
    best = torch.argmax(logits, -1, keepdim=True)
    best_lp = logits.gather(1, best) - torch.logsumexp(logits, -1, keepdim=True)
    return best.flatten(), best_lp.flatten()


def greedy_split(
    logits: torch.Tensor, chunks: int = GREEDY_CHUNKS
) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy` in two levels: the vocabulary cut into `chunks` pieces, each reduced on its own
    (argmax, max, sum of exp relative to its max), then the pieces' results combined. Compiled,
    an argmax over one row of a 128k vocabulary is one serial program (Inductor does not split
    argmax reductions); a few hundred chunks reduce in parallel. The same token: the first
    chunk holding the maximum, and its first index there, is the first maximal index."""
    b, v = logits.shape
    size = -(-v // chunks)
    n = -(-v // size)
    x = logits
    if n * size != v:  # pad the last chunk (fewer than `size` values: no chunk is all padding)
        x = torch.nn.functional.pad(x, (0, n * size - v), value=float("-inf"))
    x = x.view(b, n, size)
    idx = x.argmax(-1, keepdim=True)  # (B, n, 1): first maximum of each chunk
    cmax = x.gather(-1, idx).squeeze(-1).float()  # (B, n)
    top = cmax.argmax(-1, keepdim=True)  # (B, 1): first chunk holding the maximum
    best = top * size + idx.squeeze(-1).gather(1, top)
    m = cmax.gather(1, top)
    # log-sum-exp, each chunk's sum taken relative to its own maximum then rescaled; a chunk of
    # -inf logits only (masked tokens) adds nothing (its own sum would be 0 * inf = NaN)
    s = torch.exp(x.float() - cmax.unsqueeze(-1)).sum(-1)
    s = torch.where(torch.isneginf(cmax), 0.0, s * torch.exp(cmax - m))
    lp = -torch.log(s.sum(-1, keepdim=True))  # the best logit's log-probability: m - lse
    return best.flatten(), lp.to(logits.dtype).flatten()


def nucleus(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set every logit of x (S, V) outside its row's top-p nucleus (the smallest set of the most
    likely tokens whose probability reaches top_p (S, 1); rows at 1.0 untouched) to -inf.

    A row whose top NUCLEUS_K tokens already hold top_p of its probability (nearly every row of a
    trained model at usual temperatures) finds its nucleus there, from a top-k: sorting the whole
    vocabulary of every row was most of a sampled decode step on a CPU (64 rows x 49,152 logits).
    The other rows are sorted whole. Either way a row's result depends on that row alone.
    """
    inf = float("-inf")
    k = min(x.shape[-1], NUCLEUS_K)
    vals, order = torch.topk(x, k)  # descending
    probs = torch.exp(vals - torch.logsumexp(x, -1, keepdim=True))
    drop = (probs.cumsum(-1) - probs > top_p) & (top_p < 1.0)
    found = drop.any(-1) | (top_p[:, 0] >= 1.0)  # the nucleus ends within the top k (or no top-p)
    out = torch.full_like(x, inf).scatter(1, order, vals.masked_fill(drop, inf))
    out = torch.where((top_p >= 1.0), x, out)
    if not bool(found.all()):
        rest = (~found).nonzero()[:, 0]
        xs = x[rest]
        sorted_x, full_order = torch.sort(xs, dim=-1, descending=True)
        p = torch.softmax(sorted_x, -1)
        d = p.cumsum(-1) - p > top_p[rest]
        out[rest] = xs.scatter(1, full_order, sorted_x.masked_fill(d, inf))
    return out


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], rngs: list[torch.Generator | None]
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Pick the next token of every row of fp32 logits (B, V), each with its own parameters.

    Batched: the temperature, top-k and top-p filters, the softmax and the log-probabilities run
    once over all rows and the results come to the host in one transfer, instead of a few small
    kernels and a host sync per sequence (64 sampled streams would otherwise spend more on
    sampling than on the decode step). Every operation is row-wise, so a row's result does not
    depend on the others: a seeded sequence draws from its own generator and gets the same tokens
    in any batch; unseeded rows draw together from torch's global generator.
    Returns (token, logprob of it under the unmodified logits, top-N [(token, logprob)]) per row.
    A row whose logits hold NaN or +inf (or whose filtered probabilities do not sum to a positive
    number) gets token -1 and logprob NaN: that sequence failed; the other rows are unaffected
    (the bad row is neutralized before the batched softmax and draw, which would otherwise raise
    for the whole batch).
    """
    B, V = logits.shape
    dev, inf = logits.device, float("-inf")
    bad = (
        torch.isnan(logits).any(-1)
        | torch.isposinf(logits).any(-1)
        | torch.isneginf(logits).all(-1)
    )
    logits = torch.where(bad[:, None], torch.zeros((), dtype=logits.dtype, device=dev), logits)
    tokens = torch.argmax(logits, -1)  # greedy rows keep these
    rows = [i for i, p in enumerate(params) if sampled(p)]
    if rows:
        idx = torch.tensor(rows, device=dev)
        temps = torch.tensor([params[i].temperature for i in rows], device=dev)
        x = logits[idx] / temps[:, None].to(logits.dtype)
        ks = [params[i].top_k if 0 < params[i].top_k < V else 0 for i in rows]
        if any(ks):
            kth = torch.topk(x, max(ks)).values.gather(
                1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None]
            )
            kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=dev)[:, None], inf)
            x = x.masked_fill(x < kth, inf)
        top_p = [params[i].top_p for i in rows]
        if any(q < 1.0 for q in top_p):
            x = nucleus(x, torch.tensor(top_p, device=dev, dtype=x.dtype)[:, None])
        probs = torch.softmax(x, -1)
        lost = ~torch.isfinite(probs).all(-1) | ~(probs.sum(-1) > 0)
        probs = torch.where(lost[:, None], torch.full_like(probs, 1.0 / V), probs)
        bad = bad.index_copy(0, idx, bad[idx] | lost)
        draws = torch.empty(len(rows), dtype=torch.long, device=dev)
        free = [j for j, i in enumerate(rows) if rngs[i] is None]
        if free:
            f = torch.tensor(free, device=dev)
            draws[f] = torch.multinomial(probs[f], 1)[:, 0]
        for j, i in enumerate(rows):
            if rngs[i] is not None:
                draws[j] = torch.multinomial(probs[j], 1, generator=rngs[i])[0]
        tokens = tokens.index_copy(0, idx, draws)
    chosen = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)
    n = max(p.logprobs for p in params)
    top: list = [[]] * B
    if n:  # rows asking for alternatives: the log-softmax and its top N
        want = [i for i, p in enumerate(params) if p.logprobs]
        w = torch.tensor(want, device=dev)
        logp = torch.log_softmax(logits[w], -1)
        vals, ids = torch.topk(logp, n)
        chosen = chosen.index_copy(0, w, logp.gather(1, tokens[w][:, None])[:, 0])
        for j, (r_ids, r_vals) in enumerate(zip(ids.tolist(), vals.tolist(), strict=True)):
            k = params[want[j]].logprobs
            top[want[j]] = list(zip(r_ids[:k], r_vals[:k], strict=True))
    picks = zip(tokens.tolist(), chosen.tolist(), bad.tolist(), strict=True)
    return [(-1, float("nan"), []) if b else (t, lp, top[i]) for i, (t, lp, b) in enumerate(picks)]


def prompt_logprobs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    prompt: list[int],
    k: int,
    vocab: int,
    start: int = 0,
    chunk_elems: int = PROMPT_LOGPROB_CHUNK,
) -> list[PromptLogprob | None]:
    """Log-probability of each prompt token given those before it (and the top-`k`), from one
    sequence's final hidden states (T, D) at positions start..start+T-1: position p scores prompt
    token p+1 (and position 0 adds None for the first token). The LM head and an fp32
    log-softmax run over a few hundred positions at a time (`chunk_elems` logits), so memory
    stays bounded for long prompts."""
    chunk = max(1, chunk_elems // vocab)
    targets = prompt[start + 1 : start + hidden.shape[0] + 1]
    target = torch.tensor(targets, device=hidden.device, dtype=torch.long)
    out: list[PromptLogprob | None] = [None] if start == 0 else []
    for a in range(0, len(targets), chunk):
        b = min(a + chunk, len(targets))
        logp = torch.log_softmax(lm_head(hidden[a:b]).float(), -1)
        chosen = logp.gather(1, target[a:b, None])[:, 0].tolist()
        if k:
            vals, top = torch.topk(logp, min(k, vocab), -1)
            rows = zip(top.tolist(), vals.tolist(), strict=True)
            tops = [list(zip(r, v, strict=True)) for r, v in rows]
        else:
            tops = [[] for _ in chosen]
        out.extend(zip(chosen, tops, strict=True))
    return out
