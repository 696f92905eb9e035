"""The OpenAI wire format, requests: request models (pydantic) and the error they raise.

Requests are validated here, so every malformed request becomes a 400 with OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. Fields OpenAI defines that this server does not
implement are refused with a 400 naming the field when set to a non-default value, instead of
being silently ignored; unknown extra fields are ignored (as vLLM does). The response models
are in `protocol_responses`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmopt.engines.generation import SEED_MAX, SEED_MIN
from llmopt.serve.api.protocol_responses import ErrorResponse, error_body

__all__ = [
    "APIError",
    "CompletionRequest",
    "ChatRequest",
    "EmbeddingRequest",
    "StreamOptions",
    "new_id",
    "now",
]


class APIError(Exception):
    """An HTTP error with OpenAI's body. Raised anywhere in a handler; rendered by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> ErrorResponse:
        return error_body(self.message, self.type, self.param, self.code)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Req):
    include_usage: bool = False


class _Sampling(_Req):
    """Fields common to completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # vLLM extension; 0 = off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=16)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False  # vLLM extension (used by `llmopt bench serve --ignore-eos`)
    priority: int = 0  # vLLM extension: lower is served first; FIFO within a priority
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")
        return stops

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(
                    400,
                    f"{name} is not supported by this server; leave it at 0",
                    param=name,
                    code="unsupported_parameter",
                )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed with stream=true", param="stream_options"
            )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: score the prompt (echo) only
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of is not supported (use n)", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400,
                "max_tokens 0 generates nothing: it is for scoring the prompt "
                "with echo=true (and logprobs)",
                param="max_tokens",
            )

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(_Req):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(
                    400,
                    f"content part type {part.get('type')!r} is not supported (text only)",
                    param="messages",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise APIError(400, "tools (function calling) are not supported", param="tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise APIError(
                400, "response_format other than text is not supported", param="response_format"
            )
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class EmbeddingRequest(_Req):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def count(self) -> int:
        """How many inputs the request holds."""
        x = self.input
        if isinstance(x, str) or (x and all(isinstance(v, int) for v in x)):
            return 1
        return len(x)

    def texts(self, tokenizer: Any) -> list[str]:
        x = self.input
        if isinstance(x, str):
            items: list[Any] = [x]
        elif not x:
            raise APIError(400, "input is empty", param="input")
        elif all(isinstance(v, int) for v in x):
            items = [list(x)]
        else:
            items = list(x)
        texts = []
        vocab = len(tokenizer)
        for it in items:
            if isinstance(it, list):  # token ids: decode them (the runner tokenizes text)
                bad = [i for i in it if not 0 <= i < vocab]
                if bad:
                    raise APIError(
                        400,
                        f"token ids out of the vocabulary (0..{vocab - 1}): {bad[:5]}",
                        param="input",
                    )
                texts.append(tokenizer.decode(it, skip_special_tokens=True))
            else:
                texts.append(it)
        if any(not t for t in texts):
            raise APIError(400, "input holds an empty string", param="input")
        return texts
