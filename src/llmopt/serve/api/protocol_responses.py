"""The OpenAI wire format, responses: every body the server sends, as a pydantic model.

Modelled on vLLM's OpenAI protocol (CompletionResponse, ChatCompletionStreamResponse,
EmbeddingResponse, UsageInfo, ErrorResponse, ModelCard...), so a field's name, type and place
are written down once and a handler cannot send a misspelt or mistyped field. Field order is the
order on the wire.

Omitted vs `null` matters to OpenAI clients (a chat delta without `content` is not a delta with
`content: null`; a stream chunk carries `usage: null` only when the client asked for usage), so
fields listed in a `SparseWireModel`'s `omit_unset` are left out of the body unless they were given when the
model was built; every other field is always sent, `null` included.

Bodies are rendered from `model_dump()` by the same JSON encoders as before (Starlette's for
responses, `json.dumps` for stream events), so the bytes on the wire do not depend on pydantic's
JSON encoder (non-finite floats, float spelling).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer
from starlette.responses import JSONResponse

__all__ = [
    "WireModel",
    "SparseWireModel",
    "ErrorInfo",
    "ErrorResponse",
    "error_body",
    "UsageInfo",
    "CompletionLogprobs",
    "CompletionChoice",
    "CompletionResponse",
    "CompletionStreamResponse",
    "ChatLogprob",
    "ChatLogprobToken",
    "ChatLogprobs",
    "ChatMessageOut",
    "ChatChoice",
    "ChatCompletionResponse",
    "DeltaMessage",
    "ChatStreamChoice",
    "ChatCompletionStreamResponse",
    "EmbeddingData",
    "EmbeddingUsage",
    "EmbeddingResponse",
    "ModelCard",
    "ModelList",
    "HealthResponse",
    "json_response",
    "sse_event",
]


class WireModel(BaseModel):
    """A response body (or part of one): every field is sent, `null` included."""

    model_config = ConfigDict(extra="forbid")


class SparseWireModel(WireModel):
    """A body whose fields named in `omit_unset` are sent only when set (when the model was
    built with them). Kept apart from `WireModel` so that only these few models pay for the
    Python serializer, not every part of every stream chunk."""

    omit_unset: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _wire(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for name in self.omit_unset - self.model_fields_set:
            out.pop(name, None)
        return out


def json_response(
    body: WireModel, status: int = 200, headers: dict[str, str] | None = None
) -> JSONResponse:
    """`body` as a JSON response (Starlette's encoder, as every other response)."""
    return JSONResponse(body.model_dump(), status, headers=headers)


def sse_event(body: WireModel) -> str:
    """`body` as one Server-Sent Event (`data: {...}` and a blank line)."""
    return f"data: {json.dumps(body.model_dump(), ensure_ascii=False)}\n\n"


# -- errors --------------------------------------------------------------------------------------
class ErrorInfo(WireModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(WireModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`, nulls included."""

    error: ErrorInfo


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))


class UsageInfo(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# -- /v1/completions -----------------------------------------------------------------------------
class CompletionLogprobs(WireModel):
    """OpenAI's legacy logprobs: parallel lists, one entry per token. An echoed prompt's first
    token has `null` log-probability and alternatives (nothing precedes it)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []

    def __add__(self, other: CompletionLogprobs) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=self.tokens + other.tokens,
            token_logprobs=self.token_logprobs + other.token_logprobs,
            top_logprobs=self.top_logprobs + other.top_logprobs,
            text_offset=self.text_offset + other.text_offset,
        )


class CompletionChoice(WireModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(WireModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(SparseWireModel):
    """One stream chunk. `usage` is sent (as `null` until the last chunk) only when the client
    asked for it with `stream_options.include_usage`."""

    omit_unset: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions ------------------------------------------------------------------------
class ChatLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobToken(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(WireModel):
    content: list[ChatLogprobToken]


class ChatMessageOut(WireModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(WireModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(WireModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(SparseWireModel):
    """What a chat stream chunk adds: `role` in the opening chunk only; no `content` in a
    final chunk that only carries the finish reason."""

    omit_unset: ClassVar[frozenset[str]] = frozenset({"role", "content"})
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(WireModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(SparseWireModel):
    """One chat stream chunk; `usage` as in `CompletionStreamResponse`."""

    omit_unset: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# -- /v1/embeddings ------------------------------------------------------------------------------
class EmbeddingData(WireModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(WireModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(WireModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# -- /v1/models and /health ----------------------------------------------------------------------
class ModelCard(WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmopt"
    max_model_len: int


class ModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(SparseWireModel):
    """`/health`: `settings` holds each scheduler/KV-cache setting as `{"value", "source"}`;
    `engine` (where the engine runs, whether it is alive, its last error, `leaked_blocks`) is
    sent only with a native engine. "degraded": KV blocks leaked (the block invariant broke)."""

    omit_unset: ClassVar[frozenset[str]] = frozenset({"engine"})
    status: Literal["ok", "draining", "engine_dead", "degraded"]
    model: str
    task: str
    in_flight: int
    settings: dict[str, dict[str, Any]]
    engine: dict[str, Any] | None = None
