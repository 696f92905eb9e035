"""The FastAPI application: routes, OpenAI error bodies, and the guard in front of them.

The guard (pure ASGI middleware, so it also covers streamed responses to their end):
- refuses new `/v1` requests with 503 while the server drains on shutdown;
- checks `Authorization: Bearer <key>` when the server has an API key (401);
- bounds the request body (413), also for bodies sent without Content-Length;
- refuses text that is not Unicode (a lone surrogate such as `"\\ud800"`, which JSON can
  spell but UTF-8 cannot, escaped or as raw bytes) with 400 naming the field, for every
  endpoint alike;
- counts requests in flight (what draining waits for);
- turns an unexpected error into a 500 with OpenAI's body (the connection stays usable);
- when a request ends for any reason, closes its generations, so a sequence never outlives
  the request that started it (its KV blocks are freed).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from llmopt.serve.api.completions import chat_completions, completions
from llmopt.serve.api.context import ServerContext
from llmopt.serve.api.embeddings import embeddings
from llmopt.serve.api.protocol import APIError, ChatRequest, CompletionRequest, EmbeddingRequest
from llmopt.serve.api.protocol_responses import (
    HealthResponse,
    ModelCard,
    ModelList,
    error_body,
    json_response,
)

__all__ = ["create_app"]

log = logging.getLogger(__name__)

_STATUS_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


async def _send_error(
    send: Any,
    status: int,
    message: str,
    type: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> None:
    resp = json_response(error_body(message, type, param, code), status, headers)
    await resp({"type": "http"}, _no_receive, send)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


class Guard:
    """Draining, API key, body size, in-flight count and generation cleanup (see module doc)."""

    def __init__(self, app: Any, ctx: ServerContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        ctx, s = self.ctx, self.ctx.settings
        if ctx.draining:
            ctx.metrics.rejected.labels("draining").inc()
            return await _send_error(
                send,
                503,
                "the server is shutting down; retry on another replica",
                "service_unavailable",
                "shutting_down",
            )
        headers = dict(scope.get("headers") or [])
        if s.api_key and not _authorized(headers.get(b"authorization", b""), s.api_key):
            ctx.metrics.rejected.labels("unauthorized").inc()
            return await _send_error(
                send,
                401,
                "missing or wrong API key: send `Authorization: Bearer <key>`",
                "authentication_error",
                "invalid_api_key",
                {"WWW-Authenticate": "Bearer"},
            )
        body = b""
        if scope["method"] in ("POST", "PUT", "PATCH"):
            declared = headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > s.max_body_bytes:
                return await self._too_large(send)
            chunks, size, more = [], 0, True
            while more:  # read it all here, bounded, then replay it to the app
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return None
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > s.max_body_bytes:
                    return await self._too_large(send)
                chunks.append(chunk)
                more = msg.get("more_body", False)
            body = b"".join(chunks)
        if _maybe_surrogate(body):
            where = _surrogate_field(body)
            if where is not None:
                ctx.metrics.rejected.labels("bad_text").inc()
                return await _send_error(
                    send,
                    400,
                    f"{where or 'the body'}: text holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                    "which is not a Unicode character; send valid UTF-8 text",
                    "invalid_request_error",
                    "invalid_text",
                    param=where or None,
                )
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        scope.setdefault("state", {})["llmopt_generations"] = gens = []
        started = False

        async def tracked(msg: dict[str, Any]) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        ctx.inflight_http += 1
        try:
            await self.app(scope, replay, tracked)
        except Exception as e:
            # Answered here, not re-raised: re-raising makes the server drop the connection
            # (a keep-alive client's next request would fail). After the headers, nothing can
            # be said; the stream is cut.
            log.exception("unhandled error")
            if started:
                raise
            await _send_error(
                send, 500, f"internal error: {type(e).__name__}", "server_error", "internal_error"
            )
        finally:
            ctx.inflight_http -= 1
            for g in gens:
                g.close()

    async def _too_large(self, send: Any) -> None:
        self.ctx.metrics.rejected.labels("too_large").inc()
        limit = self.ctx.settings.max_body_bytes
        await _send_error(
            send,
            413,
            f"request body larger than {limit} bytes (server --max-body-bytes)",
            "invalid_request_error",
            "request_too_large",
        )


# A JSON escape of a lone UTF-16 surrogate: a high one not followed by a low one, or a low one
# not preceded by a high one (a pair, as `ensure_ascii` clients spell every emoji, is fine). A
# match may still be a false alarm (an escaped backslash before "u..."): the body is then parsed
# to see.
_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


# The same surrogate written as raw bytes (ED A0..BF xx): not UTF-8, but the JSON parser reads
# bytes with `surrogatepass`, so it would reach the handlers as a lone surrogate all the same.
_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def _maybe_surrogate(body: bytes) -> bool:
    """Whether the body may hold a lone surrogate (then it is parsed to find it): an escape, raw
    surrogate bytes, or a UTF-16/32 body (the parser detects those by their zero bytes)."""
    return bool(_SURROGATE.search(body) or _RAW_SURROGATE.search(body) or 0 in body[:4])


def _surrogate_field(body: bytes) -> str | None:
    """The dotted path of the first string in the JSON `body` that is not valid Unicode ("" for
    the body itself), or None when every string is (or the body is not JSON, or nested too deep
    to parse: the app says so, with a 400)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return None
    stack: list[tuple[list[str], Any]] = [([], doc)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str | dict):
            keys = [x] if isinstance(x, str) else list(x)
            for k in keys:  # object keys count too
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return ".".join(path)
        if isinstance(x, dict):
            stack.extend(([*path, k], v) for k, v in reversed(x.items()))
        elif isinstance(x, list):
            stack.extend(([*path, str(i)], v) for i, v in reversed(list(enumerate(x))))
    return None


def _field_path(loc: list[Any], body: Any, missing: bool) -> str | None:
    """The dotted path of the field a validation error is about (`messages.0.content`), or
    None. pydantic's `loc` also names the member of a union it tried (`prompt.str`,
    `prompt.list[int].1`): those are not fields, so only the parts that index into the body
    are kept (and a missing field's name, at the end).

    >>> _field_path(["messages", 0, "content", "str"], {"messages": [{"content": [1]}]}, False)
    'messages.0.content'
    >>> _field_path(["prompt", "list[int]", 1], {"prompt": [1, "a"]}, False)
    'prompt.1'
    >>> _field_path(["model"], {"prompt": "x"}, True)
    'model'
    """
    parts, node = [], body
    for i, x in enumerate(loc):
        if isinstance(node, dict) and isinstance(x, str):
            if x in node or (missing and i == len(loc) - 1):
                parts.append(x)
                node = node.get(x)
        elif isinstance(node, list) and isinstance(x, int) and 0 <= x < len(node):
            parts.append(str(x))
            node = node[x]
        # else: the name of a union's member pydantic tried, not a field
    return ".".join(parts) or None


def _authorized(header: bytes, key: str) -> bool:
    scheme, _, token = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), key)


def create_app(ctx: ServerContext) -> Any:
    """The ASGI app serving `ctx`'s model (engine threads start and stop with its lifespan).

    Example:
        >>> app = create_app(load_context("smollm2-135m", ServeSettings()))  # doctest: +SKIP
    """

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        import asyncio

        if ctx.engine is not None:
            ctx.engine.start(asyncio.get_running_loop())
        if ctx.embedder is not None:
            ctx.embedder.start()
        yield
        if ctx.engine is not None:
            ctx.engine.stop()
        if ctx.embedder is not None:
            ctx.embedder.stop()

    app = FastAPI(title="llmopt serve", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_r: Request, e: APIError) -> JSONResponse:
        return json_response(e.body(), e.status, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        loc = list(first.get("loc", ()))[1:]  # after "body"
        if first.get("type") == "json_invalid":
            # Its loc holds a character position, not a field: param is null.
            pos = f" (at character {loc[0]})" if loc else ""
            msg, param = f"the request body is not valid JSON{pos}", None
        else:
            param = _field_path(loc, getattr(e, "body", None), first.get("type") == "missing")
            msg = f"{param + ': ' if param else ''}{first.get('msg', 'invalid value')}"
        return json_response(error_body(msg, "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        t = _STATUS_TYPES.get(e.status_code, "invalid_request_error")
        return json_response(error_body(str(e.detail), t), e.status_code, e.headers)

    @app.exception_handler(Exception)
    async def _crash(_r: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return json_response(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "draining" if ctx.draining else "ok"
        extra: dict[str, Any] = {}
        if ctx.engine is not None:
            extra["engine"] = ctx.engine.describe()
            if not extra["engine"]["alive"]:  # nothing can be served: route elsewhere
                status = "engine_dead"
            elif extra["engine"].get("leaked_blocks") and status == "ok":
                status = "degraded"  # KV capacity lost for good: restart when convenient
        body = HealthResponse(
            status=status,
            model=ctx.served_name,
            task=ctx.task,
            in_flight=ctx.outstanding,
            settings=ctx.effective,
            **extra,
        )
        return json_response(body, 200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> ModelCard:
        return ModelCard(id=ctx.served_name, created=ctx.created, max_model_len=ctx.max_seq_len)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return json_response(ModelList(data=[model_card()]))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        ctx.check_model(model_id)
        return json_response(model_card())

    @app.post("/v1/completions")
    async def _completions(req: CompletionRequest, request: Request) -> Response:
        return await completions(ctx, req, request)

    @app.post("/v1/chat/completions")
    async def _chat(req: ChatRequest, request: Request) -> Response:
        return await chat_completions(ctx, req, request)

    @app.post("/v1/embeddings")
    async def _embeddings(req: EmbeddingRequest, request: Request) -> Response:
        return await embeddings(ctx, req, request)

    app.add_middleware(Guard, ctx=ctx)
    return app
