"""What every request handler needs: the loaded model, the engine loop, limits and counters.

The server serves one model, either a causal LM (through a batching engine's generator and the
scheduler, behind an `EngineClient`) or an embedding model (through an `EmbeddingRunner` behind
the dynamic batcher).
Everything here runs on the event loop thread, so the counters need no lock.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from llmopt.engines.generation import TEMPERATURE_FLOOR, SamplingParams
from llmopt.serve.api.protocol import APIError
from llmopt.serve.engine.client import EngineClient
from llmopt.serve.metrics import ServeMetrics
from llmopt.serve.settings import ServeSettings

__all__ = ["ServerContext", "until_done_or_gone"]


@dataclass
class ServerContext:
    settings: ServeSettings
    served_name: str
    task: str  # "causal-lm" | "embedding"
    tokenizer: Any
    metrics: ServeMetrics
    max_seq_len: int
    engine: EngineClient | None = None  # EngineLoop or EngineProcess (causal-lm)
    embedder: Any = None  # EmbedBatcher (embedding)
    num_blocks: int = 0  # usable KV blocks (the engine keeps one as scratch)
    block_size: int = 16
    # The scheduler/cache settings in effect: {name: {"value", "source"}} (shown by /health).
    effective: dict[str, dict[str, Any]] = field(default_factory=dict)
    outstanding: int = 0  # sequences / embedding requests accepted and not finished
    draining: bool = False
    inflight_http: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    _latency_ema: float = 0.0
    _token_text: dict[int, str] = field(default_factory=dict)
    _token_bytes: dict[int, list[int]] = field(default_factory=dict)
    _byte_level: bool | None = None
    # When each accepted request (generation or embedding) started, oldest first (insertion
    # order): Retry-After's latency estimate before any request has finished.
    started: dict[int, float] = field(default_factory=dict)
    # The open Generations (`serve.api.generation`): cut when the drain window ends.
    generations: set[Any] = field(default_factory=set)

    # -- checks that become 400/404/429 -------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.served_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"`{self.served_name}` (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def require(self, task: str, endpoint: str) -> None:
        if self.task != task:
            what = "an embedding model" if self.task == "embedding" else "a generative model"
            raise APIError(
                400,
                f"{endpoint} is not available: this server serves {what} (`{self.served_name}`)",
                code="unsupported_endpoint",
            )

    def check_length(
        self,
        prompt_len: int,
        max_tokens: int,
        prompt_param: str = "prompt",
        tokens_param: str = "max_tokens",
    ) -> None:
        """400 unless the prompt and `max_tokens` fit the context and the KV cache. `param` names
        what to change: the prompt (`prompt_param`) when it alone does not fit, else the
        completion's length (`tokens_param`)."""
        total = prompt_len + max_tokens
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        blocks = math.ceil(total / self.block_size)
        if total > self.max_seq_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_seq_len} "
                f"tokens. However, you requested {total} tokens ({prompt_len} in the "
                f"prompt, {max_tokens} for the completion). Please reduce the prompt "
                "or max_tokens.",
                param=prompt_param if prompt_len >= self.max_seq_len else tokens_param,
                code="context_length_exceeded",
            )
        if self.num_blocks and blocks > self.num_blocks:
            alone = math.ceil((prompt_len + 1) / self.block_size) > self.num_blocks
            raise APIError(
                400,
                f"{total} tokens need {blocks} KV-cache blocks; the server has "
                f"{self.num_blocks} in all (start it with more --num-blocks)",
                param=prompt_param if alone else tokens_param,
                code="context_length_exceeded",
            )

    def admit(self, n: int, endpoint: str, param: str | None = None) -> None:
        """Take `n` places in the bounded queue, or answer 429 with Retry-After (400 when `n`
        alone is more than the server ever takes: waiting would never help)."""
        cap = self.settings.capacity
        if n > cap:
            self.metrics.rejected.labels("too_many_sequences").inc()
            raise APIError(
                400,
                f"this request needs {n} sequences (prompts x n); the server takes at most "
                f"{cap} at a time (max-num-seqs {self.settings.max_num_seqs} + max-queue "
                f"{self.settings.max_queue}): send fewer prompts or a smaller n per request",
                param=param,
                code="too_many_sequences",
            )
        if self.outstanding + n > cap:
            self.metrics.rejected.labels("capacity").inc()
            retry = self.retry_after()
            raise APIError(
                429,
                f"server at capacity: {self.outstanding} requests in flight "
                f"(max-num-seqs {self.settings.max_num_seqs} + max-queue "
                f"{self.settings.max_queue}); retry after {retry} s",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry)},
            )

    def retry_after(self) -> int:
        """Seconds until the queue ahead has drained (1..60): one request latency per full batch
        in flight. The latency is the running average of finished requests, and never less than
        the age of the oldest request in flight (before any has finished, that is all we know)."""
        waves = max(1.0, self.outstanding / self.settings.max_num_seqs)
        oldest = next(iter(self.started.values()), None)
        age = time.monotonic() - oldest if oldest is not None else 0.0
        latency = max(self._latency_ema, age)
        return int(min(60, max(1, math.ceil(latency * waves))))

    def note_latency(self, seconds: float) -> None:
        a = 0.2
        self._latency_ema = (
            seconds if not self._latency_ema else (1 - a) * self._latency_ema + a * seconds
        )

    # -- token helpers ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def token_text(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return s

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (OpenAI's logprob `bytes`): for a byte-level BPE token or a
        byte-fallback piece (`<0xE2>`) the raw bytes, even when they are part of a character
        (its decoded text is then U+FFFD, whose bytes would be wrong); else its text in UTF-8."""
        b = self._token_bytes.get(token_id)
        if b is None:
            if self._byte_level is None:
                self._byte_level = _is_byte_level(self.tokenizer)
            raw = _raw_token_bytes(self.tokenizer, token_id, self._byte_level)
            if raw is None:
                raw = self.token_text(token_id).encode("utf-8")
            b = self._token_bytes[token_id] = list(raw)
        return b

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab = len(self.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise APIError(
                400, f"token ids out of the vocabulary (0..{vocab - 1}): {bad[:5]}", param=param
            )
        return ids

    def sampling_params(
        self,
        req: Any,
        max_tokens: int,
        logprobs: int,
        seed: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        # The engine stops at the model's EOS ids itself unless ignore_eos. A temperature below
        # the floor is greedy (as vLLM does): dividing logits by it overflows to inf.
        temperature = float(req.temperature)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < TEMPERATURE_FLOOR else temperature,
            top_p=float(req.top_p),
            top_k=int(req.top_k),
            seed=seed,
            ignore_eos=bool(req.ignore_eos),
            logprobs=int(logprobs),
            prompt_logprobs=prompt_logprobs,
        )


async def until_done_or_gone(request: Request, coro: Any) -> Any:
    """Await `coro` for a request that is not streamed; if the client disconnects first,
    cancel it (its sequences are aborted, its embedding job dropped) and return a 499 response
    (nobody is listening; the status is for the access log)."""
    task = asyncio.ensure_future(coro)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character BPE vocabularies spell
    it with (printable Latin-1 bytes as themselves, the others shifted past U+0100)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer spells tokens in GPT-2's byte alphabet (a ByteLevel decoder)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _raw_token_bytes(tokenizer: Any, token_id: int, byte_level: bool) -> bytes | None:
    """A token's bytes from its vocabulary spelling, or None when the spelling does not say."""
    try:
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
    except Exception:
        return None
    if not isinstance(piece, str):
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if byte_level and piece and all(c in _BYTE_DECODER for c in piece):
        return bytes(_BYTE_DECODER[c] for c in piece)
    return None
