"""Online load generator for OpenAI-compatible servers (vLLM, llama.cpp, Ollama, llmopt's own).

It streams `/v1/completions` (or `/v1/chat/completions`) requests and times every chunk on the
client, the way vLLM's `bench serve` does, or sends `/v1/embeddings` requests (one response
each, a batch of texts drawn from a batch-size mix) and times the response, so the numbers (see `serve_metrics.py`) mean the same thing across tools.
Arrival patterns, as vLLM's `get_request`: fixed concurrency (all requests queued, at most N in
flight), constant rate, and Poisson/gamma arrivals whose `burstiness` is the gamma shape (1 =
Poisson, < 1 burstier, > 1 more even). Every loop is bounded: `num_requests` caps the count,
`max_seconds` the wall time (unsent requests are dropped and in-flight ones cancelled and recorded
as failed), and each request has its own timeout. Failures (refused connection, HTTP error, a
stream without chunks) become records with an error; nothing here raises for a server's fault.

Client: httpx (async, HTTP/1.1 keep-alive pool). It is the client `openai` itself is built on,
so it adds no dependency beside the official client the tests use, and its per-phase timeouts
(connect/read/pool) bound a stalled stream per chunk, not only per request. With `http2`, it
speaks HTTP/2 only (cleartext h2c by prior knowledge on http://, ALPN h2 on https://; a server
without it fails the run rather than falling back) over ONE connection that multiplexes every
request in flight, as a browser or an HTTP/2 proxy would; the protocol each response came back
in is recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from llmopt.bench.serve_metrics import PERCENTILES, SLO, RequestRecord, serve_metrics
from llmopt.core.errors import EngineUnavailableError, LlmoptError

__all__ = [
    "ENDPOINTS",
    "LoadSpec",
    "Workload",
    "LoadTargetError",
    "arrival_offsets",
    "make_batches",
    "make_prompts",
    "run_load",
]

log = logging.getLogger(__name__)

Mode = Literal["concurrency", "rate", "poisson"]
ENDPOINTS = ("completions", "chat", "embeddings")
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Common short English words: each is one token in BPE vocabularies with a leading space, so a
# prompt of N words is about N tokens (the server's usage report gives the exact count).
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "as",
    "with",
    "by",
    "he",
    "at",
    "from",
    "his",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "has",
    "had",
    "one",
    "not",
    "but",
    "first",
    "new",
    "two",
    "their",
    "after",
    "its",
    "who",
    "also",
    "they",
    "time",
    "she",
    "her",
    "year",
    "been",
    "other",
    "when",
    "there",
    "all",
    "during",
    "into",
    "school",
    "more",
    "most",
    "may",
    "over",
    "city",
    "some",
    "him",
    "only",
    "world",
    "can",
    "many",
    "later",
    "three",
    "state",
    "would",
    "under",
    "university",
    "about",
    "where",
    "then",
    "known",
    "used",
    "made",
    "such",
    "both",
    "area",
    "part",
]


class LoadTargetError(LlmoptError):
    """The endpoint to load is not allowed or not reachable as given."""


@dataclass(frozen=True)
class LoadSpec:
    """How requests arrive.

    Args:
        mode: "concurrency" (keep `value` requests in flight), "rate" (constant `value` req/s) or
            "poisson" (gamma-distributed gaps at mean `value` req/s, shape `burstiness`).
        value: the concurrency (an integer >= 1) or the rate in requests/s.
        burstiness: gamma shape for "poisson"; 1.0 is a Poisson process.
        num_requests: requests to send (the count bound).
        max_seconds: wall-time bound of the whole run.
        max_concurrency: optional cap on requests in flight for the rate modes.
        seed: for arrival gaps and synthetic lengths (reproducible runs).

    Example:
        >>> LoadSpec("poisson", 4.0, burstiness=0.5).label
        'poisson 4 req/s b=0.5'
    """

    mode: Mode
    value: float
    burstiness: float = 1.0
    num_requests: int = 32
    max_seconds: float = 300.0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("concurrency", "rate", "poisson"):
            raise ValueError(f"mode {self.mode!r}: use concurrency, rate or poisson")
        if self.value <= 0:
            raise ValueError(f"{self.mode} value must be > 0, got {self.value}")
        if self.mode == "concurrency" and int(self.value) != self.value:
            raise ValueError(f"concurrency must be a whole number, got {self.value}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0 (1 = Poisson), got {self.burstiness}")
        if not 1 <= self.num_requests <= 100_000:
            raise ValueError(f"num_requests must be in 1..100000, got {self.num_requests}")
        if not 0 < self.max_seconds <= 24 * 3600:
            raise ValueError(f"max_seconds must be in (0, 86400], got {self.max_seconds}")

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"concurrency {int(self.value)}"
        extra = f" b={self.burstiness:g}" if self.mode == "poisson" else ""
        return f"{self.mode} {self.value:g} req/s{extra}"


@dataclass(frozen=True)
class Workload:
    """What each request asks for: synthetic lengths or prompts from a JSONL file.

    Args:
        input_len: mean prompt length in tokens (synthetic prompts).
        output_len: mean `max_tokens` per request.
        range_ratio: lengths drawn uniformly in [len*(1-r), len*(1+r)] as vLLM's random dataset.
        prompts_file: JSONL with {"prompt": str, "max_tokens": int (optional)} per line.
        ignore_eos: ask the server to ignore end-of-sequence (vLLM honours it; others may not).
        endpoint: "completions" (streamed /v1/completions), "chat" (streamed
            /v1/chat/completions, the prompt as one user message) or "embeddings"
            (/v1/embeddings; `output_len` unused).
        batch_sizes: embeddings: texts per request, each request drawing one of these
            uniformly (the batch-size mix; (1,) sends one text a request).

    Example:
        >>> Workload(input_len=64, output_len=32).output_len
        32
        >>> Workload(endpoint="embeddings", batch_sizes=(1, 8)).batch_sizes
        (1, 8)
    """

    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    prompts_file: Path | None = None
    ignore_eos: bool = False
    endpoint: str = "completions"
    batch_sizes: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {self.endpoint!r}: use one of {', '.join(ENDPOINTS)}")
        if not self.batch_sizes or any(not 1 <= b <= 2048 for b in self.batch_sizes):
            raise ValueError(f"batch sizes {self.batch_sizes} must each be in 1..2048")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1 token")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise FileNotFoundError(
                f"prompts file {self.prompts_file} not found; pass a JSONL path"
            )


def make_prompts(w: Workload, n: int, seed: int = 0) -> list[tuple[str, int]]:
    """`n` (prompt, max_tokens) pairs, cycling through the JSONL file or drawn synthetically.

    Example:
        >>> len(make_prompts(Workload(input_len=8, output_len=4), 3)[0][0].split())
        8
    """
    rng = random.Random(seed)

    def draw(mean: int) -> int:
        lo, hi = int(mean * (1 - w.range_ratio)), int(mean * (1 + w.range_ratio))
        return max(1, rng.randint(lo, hi))

    if w.prompts_file is not None:
        rows = []
        for i, line in enumerate(Path(w.prompts_file).read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append((str(d["prompt"]), int(d.get("max_tokens", w.output_len))))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{w.prompts_file} line {i + 1}: {e}; each line must be "
                    '{"prompt": "...", "max_tokens": N}'
                ) from None
        if not rows:
            raise ValueError(f"{w.prompts_file} holds no prompts")
        return [rows[i % len(rows)] for i in range(n)]
    return [
        (" ".join(rng.choice(_WORDS) for _ in range(draw(w.input_len))), draw(w.output_len))
        for _ in range(n)
    ]


def arrival_offsets(spec: LoadSpec, n: int) -> list[float]:
    """Send time of each request in seconds after the start (vLLM's `get_request` schedule).

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)), constant for "rate", zero for
    "concurrency"; the cumulative times are rescaled so the last lands at n/rate, as vLLM does
    to keep throughput stable across seeds.

    Example:
        >>> arrival_offsets(LoadSpec("rate", 2.0), 4)
        [0.5, 1.0, 1.5, 2.0]
    """
    if spec.mode == "concurrency":
        return [0.0] * n
    rng = random.Random(spec.seed)
    rate = spec.value
    if spec.mode == "rate":
        gaps = [1.0 / rate] * n
    else:
        gaps = [rng.gammavariate(spec.burstiness, 1.0 / (rate * spec.burstiness)) for _ in range(n)]
    out, t = [], 0.0
    for g in gaps:
        t += g
        out.append(t)
    scale = (n / rate) / out[-1] if out[-1] > 0 else 1.0
    return [x * scale for x in out]


def check_url(base_url: str, allow_remote: bool = False) -> str:
    """Normalize `base_url` (no trailing /v1) and refuse non-loopback hosts unless allowed."""
    u = urlparse(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise LoadTargetError(
            f"{base_url!r} is not an http(s) URL", "use e.g. http://127.0.0.1:8000"
        )
    if u.hostname not in _LOOPBACK and not allow_remote:
        raise LoadTargetError(
            f"{u.hostname} is not a loopback address; load tests hit only this machine by default",
            "pass --allow-remote if you own that server and mean to load it",
        )
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _one(
    client,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    w: Workload,
    timeout_s: float,
    est_prompt_len: int = 0,
    texts: list[str] | None = None,
) -> RequestRecord:
    if w.endpoint == "embeddings":
        return await _one_embeddings(client, url, model, texts or [prompt], timeout_s)
    chat = w.endpoint == "chat"
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    if w.ignore_eos:
        body["ignore_eos"] = True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    rec = RequestRecord(success=False, start_time=time.perf_counter())
    st = rec.start_time
    last = st
    chunks = pieces = 0
    text: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url + path, json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                    rec.error = f"HTTP {resp.status_code}: {detail}"
                    return rec
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    d = json.loads(data)
                    now = time.perf_counter()
                    if d.get("choices"):
                        # As vLLM: any chunk with choices is a token event (text may be "").
                        if chunks == 0:
                            rec.ttft = now - st
                        else:
                            rec.itl.append(now - last)
                        last = now
                        chunks += 1
                        choice = d["choices"][0]
                        piece = (
                            (choice.get("delta") or {}).get("content")
                            if chat
                            else choice.get("text")
                        ) or ""
                        rec.finish_reason = (
                            d["choices"][0].get("finish_reason") or rec.finish_reason
                        )
                        text.append(piece)
                        pieces += bool(piece)
                    if d.get("usage"):
                        rec.output_tokens = int(d["usage"].get("completion_tokens") or 0)
                        rec.prompt_len = int(d["usage"].get("prompt_tokens") or 0)
    except TimeoutError:
        rec.error = f"timeout after {timeout_s:g} s"
        return rec
    except asyncio.CancelledError:
        rec.error = "cancelled: run deadline reached"
        return rec
    except Exception as e:  # a server's fault must become a record, never a crash
        rec.error = f"{type(e).__name__}: {e}"[:300]
        return rec
    if chunks == 0:
        rec.error = "never received a chunk with choices"
        return rec
    rec.success, rec.latency = True, last - st
    rec.generated_text = "".join(text)
    # Without a usage report, count text-carrying chunks: servers stream one token per chunk,
    # and some (llama.cpp) end with an empty chunk that carries only finish_reason.
    rec.tokens_source = "usage" if rec.output_tokens else "chunks"
    rec.output_tokens = rec.output_tokens or pieces or chunks
    rec.prompt_len = rec.prompt_len or est_prompt_len
    return rec


async def _one_embeddings(
    client, url: str, model: str, texts: list[str], timeout_s: float
) -> RequestRecord:
    body = {"model": model, "input": texts, "encoding_format": "float"}
    rec = RequestRecord(success=False, start_time=time.perf_counter(), inputs=len(texts))
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.post(url + "/v1/embeddings", json=body)
            raw = await resp.aread()
    except TimeoutError:
        rec.error = f"timeout after {timeout_s:g} s"
        return rec
    except asyncio.CancelledError:
        rec.error = "cancelled: run deadline reached"
        return rec
    except Exception as e:  # a server's fault must become a record, never a crash
        rec.error = f"{type(e).__name__}: {e}"[:300]
        return rec
    done = time.perf_counter()
    if resp.status_code != 200:
        rec.error = f"HTTP {resp.status_code}: {raw.decode('utf-8', 'replace')[:300]}"
        return rec
    try:
        d = json.loads(raw)
        got = len(d["data"])
    except (ValueError, KeyError, TypeError) as e:
        rec.error = f"not an embeddings response ({type(e).__name__}: {e})"[:300]
        return rec
    if got != len(texts):
        rec.error = f"{got} embeddings for {len(texts)} inputs"
        return rec
    rec.success, rec.latency = True, done - rec.start_time
    rec.prompt_len = int((d.get("usage") or {}).get("prompt_tokens") or 0)
    rec.tokens_source = "usage" if rec.prompt_len else "words"
    rec.prompt_len = rec.prompt_len or sum(len(t.split()) for t in texts)
    return rec


def make_batches(w: Workload, prompts: list[tuple[str, int]], seed: int = 0) -> list[list[str]]:
    """Embeddings: one list of texts per request, its size drawn from `w.batch_sizes`.

    Example:
        >>> make_batches(Workload(batch_sizes=(2,)), [("a", 1), ("b", 1)])
        [['a', 'b'], ['b', 'a']]
    """
    rng = random.Random(seed + 1)
    texts = [p for p, _ in prompts]
    out = []
    for i in range(len(prompts)):
        b = rng.choice(w.batch_sizes)
        out.append([texts[(i + j) % len(texts)] for j in range(b)])
    return out


async def first_model(client, url: str) -> str:
    """The first model id the server lists (as vLLM does when --model is not given)."""
    r = await client.get(url + "/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def make_client(
    limit: int | None, timeout_s: float, http2: bool = False, on_response: list | None = None
) -> Any:
    """The httpx client a run uses: a keep-alive pool of HTTP/1.1 connections, one per request in
    flight; or with `http2` one HTTP/2 connection for all of them (h2c by prior knowledge on
    http://, h2 by ALPN on https://; HTTP/1.1 is not offered, so no silent fallback)."""
    import httpx

    tmo = httpx.Timeout(timeout_s, connect=10.0)
    hooks = {"response": on_response or []}
    if http2:
        one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        return httpx.AsyncClient(
            timeout=tmo, limits=one, http1=False, http2=True, event_hooks=hooks
        )
    limits = httpx.Limits(max_connections=limit or 1000, max_keepalive_connections=limit or 100)
    return httpx.AsyncClient(timeout=tmo, limits=limits, event_hooks=hooks)


async def _run(
    url: str,
    spec: LoadSpec,
    w: Workload,
    model: str | None,
    timeout_s: float,
    warmups: int,
    http2: bool = False,
) -> dict[str, Any]:
    try:
        import httpx  # noqa: F401  (make_client imports it; fail here with the fix)
    except ImportError:
        raise EngineUnavailableError(
            "the load generator needs httpx", "pip install 'llmopt[bench]'"
        ) from None
    if http2:
        try:
            import h2  # noqa: F401
        except ImportError:
            raise EngineUnavailableError(
                "--http2 needs httpx's HTTP/2 support (the h2 library)",
                "pip install 'llmopt[bench]'  (or: pip install 'httpx[http2]')",
            ) from None

    prompts = make_prompts(w, spec.num_requests + warmups, spec.seed)
    batches = make_batches(w, prompts, spec.seed) if w.endpoint == "embeddings" else None
    offsets = arrival_offsets(spec, spec.num_requests)
    limit = int(spec.value) if spec.mode == "concurrency" else spec.max_concurrency
    versions: set[str] = set()

    async def seen(resp: Any) -> None:  # the protocol every response came back in
        versions.add(resp.http_version)

    async with make_client(limit, timeout_s, http2, [seen]) as client:
        try:
            model = model or await first_model(client, url)
        except Exception as e:
            raise LoadTargetError(
                f"no OpenAI-compatible server answers at {url}/v1/models ({type(e).__name__}: {e})",
                "start the server first, or check --url and --model",
            ) from None
        for i, (p, m) in enumerate(prompts[:warmups]):  # untimed: allocation, caches
            texts = batches[i] if batches else None
            await _one(client, url, model, p, m, w, timeout_s, len(p.split()), texts)
        sem = asyncio.Semaphore(limit) if limit else None

        async def send(i: int) -> RequestRecord:
            p, m = prompts[warmups + i]
            texts = batches[warmups + i] if batches else None
            if sem is None:
                return await _one(client, url, model, p, m, w, timeout_s, len(p.split()), texts)
            async with sem:
                return await _one(client, url, model, p, m, w, timeout_s, len(p.split()), texts)

        t0 = time.perf_counter()
        deadline = t0 + spec.max_seconds
        tasks: list[asyncio.Task] = []
        for i, off in enumerate(offsets):
            wait = t0 + off - time.perf_counter()
            if t0 + off > deadline:
                break  # the time bound: the rest are never sent
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(send(i)))
        pending: set[asyncio.Task] = set()
        if tasks:  # asyncio.wait refuses an empty set (first arrival past the deadline)
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    records = []
    for t in tasks:
        r = t.result() if t.done() and not t.cancelled() else None
        records.append(r or RequestRecord(False, error="cancelled: run deadline reached"))
    unsent = spec.num_requests - len(tasks)
    return {
        "model": model,
        "records": records,
        "duration_s": duration,
        "unsent": unsent,
        "http_version": ", ".join(sorted(versions)) or None,
    }


def run_load(
    base_url: str,
    spec: LoadSpec,
    workload: Workload | None = None,
    model: str | None = None,
    slo: SLO | None = None,
    timeout_s: float = 120.0,
    warmups: int = 1,
    allow_remote: bool = False,
    percentiles: tuple[float, ...] = PERCENTILES,
    http2: bool = False,
) -> dict[str, Any]:
    """Load one endpoint with one arrival pattern and return vLLM-defined metrics.

    Args:
        base_url: server root, e.g. "http://127.0.0.1:8000" (a trailing /v1 is accepted).
        spec: arrival pattern and bounds.
        workload: prompt and output lengths (default: 128 in, 64 out, synthetic).
        model: model id to request (default: the first one /v1/models lists).
        slo: goodput objectives (e.g. SLO(ttft_ms=500, tpot_ms=50)).
        timeout_s: per-request bound.
        warmups: untimed requests sent one by one before the measured ones.
        allow_remote: permit a non-loopback host.
        percentiles: latency percentiles to report (p50, p90, p95, p99 by default).
        http2: speak HTTP/2 over one multiplexed connection (`make_client`).

    Returns:
        {"spec", "workload", "model", "http_version" (the protocol the server answered in),
        "metrics" (see serve_metrics), "unsent", "errors" (first 10 distinct), "requests"
        (per-request records)}.

    Example:
        >>> run_load("http://127.0.0.1:8000", LoadSpec("concurrency", 4, num_requests=16))  # doctest: +SKIP
    """
    w = workload or Workload()
    url = check_url(base_url, allow_remote)
    out = asyncio.run(_run(url, spec, w, model, timeout_s, warmups, http2))
    recs: list[RequestRecord] = out["records"]
    errors = sorted({r.error for r in recs if not r.success})[:10]
    if errors:
        log.warning(
            "%d of %d requests failed: %s", sum(not r.success for r in recs), len(recs), errors[0]
        )
    metrics = serve_metrics(recs, max(out["duration_s"], 1e-9), slo, percentiles)
    return {
        "kind": "serve",
        "spec": asdict(spec) | {"label": spec.label},
        "workload": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(w).items()},
        "url": url,
        "model": out["model"],
        "http_version": out["http_version"],
        "connections": "one, multiplexed"
        if http2
        else "a keep-alive pool, one per request in flight",
        "metrics": metrics,
        "unsent": out["unsent"],
        # Without usage in the stream, prompt lengths are word counts (about 1 token per word of
        # the synthetic prompts) and output lengths are text-chunk counts.
        "finish_reasons": dict(Counter(r.finish_reason or "none" for r in recs if r.success)),
        "lengths_from_usage": all(r.tokens_source == "usage" for r in recs if r.success),
        "errors": errors,
        "requests": [r.to_dict() for r in recs],
    }
