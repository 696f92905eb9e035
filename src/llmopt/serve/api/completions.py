"""`/v1/completions` and `/v1/chat/completions`: request -> Generations -> OpenAI responses.

Both endpoints share one path: validate, tokenize (chat: the tokenizer's chat template), check
lengths, take places in the bounded queue, start one `Generation` per (prompt, n) choice, then
either stream OpenAI chunks over SSE (ending with `data: [DONE]`, a usage chunk first when
`stream_options.include_usage`) or collect them into one response. Non-streamed requests watch
for the client going away and cancel their sequences when it does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmopt.engines.generation import SEED_MAX
from llmopt.serve.api.context import ServerContext, until_done_or_gone
from llmopt.serve.api.generation import Delta, Generation, merge
from llmopt.serve.api.protocol import APIError, ChatRequest, CompletionRequest, new_id, now
from llmopt.serve.api.protocol_responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    SparseWireModel,
    UsageInfo,
    json_response,
    sse_event,
)

__all__ = ["completions", "chat_completions"]


def _registry(request: Request) -> list[Generation]:
    # The guard middleware closes every Generation listed here when the HTTP request ends.
    return request.scope.setdefault("state", {}).setdefault("llmopt_generations", [])


def _start(
    ctx: ServerContext,
    request: Request,
    req: Any,
    prompts: list[list[int]],
    max_tokens: int,
    logprobs: int,
    prompt_logprobs: int | None = None,
) -> list[Generation]:
    ctx.admit(len(prompts) * req.n, request.url.path, "n" if req.n > 1 else "prompt")
    stops = req.stop_list()
    deadline = time.monotonic() + ctx.settings.request_timeout_s
    gens = []
    for ids in prompts:
        for j in range(req.n):
            # Choice j draws from seed + j; past the top of the range a random generator
            # takes, it wraps around (2**64 - 1 with n=2: choices 2**64 - 1 and 0).
            seed = None if req.seed is None else req.seed + j
            if seed is not None and seed > SEED_MAX:
                seed -= 2**64
            params = ctx.sampling_params(req, max_tokens, logprobs, seed, prompt_logprobs)
            gens.append(
                Generation(ctx, ids, params, stops, req.priority, deadline, _registry(request))
            )
    return gens


def _usage(prompts: list[list[int]], gens: list[Generation], generated: bool = True) -> UsageInfo:
    p = sum(len(x) for x in prompts)
    c = sum(g.n_tokens for g in gens) if generated else 0
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


async def _stream(
    ctx: ServerContext,
    gens: list[Generation],
    prompts: list[list[int]],
    include_usage: bool,
    first: list[SparseWireModel],
    chunk: Callable[..., SparseWireModel],
    choice: Callable[[int, Delta], Any],
    endpoint: str,
    generated: bool = True,
) -> AsyncIterator[str]:
    """The SSE body: `first`, then one `chunk(choices=[choice(i, delta)])` per delta (with
    `usage: null` when the client asked for usage), then the usage chunk, then `[DONE]`."""
    outcome = "ok"

    def event(i: int, d: Delta) -> str:
        c = [choice(i, d)]
        return sse_event(chunk(choices=c, usage=None) if include_usage else chunk(choices=c))

    try:
        for c in first:
            yield sse_event(c)
        # Events that are already waiting go out in one write: when the event loop falls
        # behind the engine (many streams), a socket send per token is what it spends most on.
        pending: list[str] = []
        async for i, d in merge(gens):
            pending.append(event(i, d))
            if not any(g.ready() for g in gens):
                yield "".join(pending)
                pending = []
        if pending:
            yield "".join(pending)
        if include_usage:
            yield sse_event(chunk(choices=[], usage=_usage(prompts, gens, generated)))
    except APIError as e:  # headers are sent: report in-band, as vLLM does
        outcome = "error"
        yield sse_event(e.body())
    except asyncio.CancelledError:
        outcome = "disconnected"
        raise
    finally:
        for g in gens:
            g.close()
        ctx.metrics.requests.labels(endpoint, outcome).inc()
    yield "data: [DONE]\n\n"


def _streaming(body: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


async def _collect(gens: list[Generation]) -> list[list[Delta]]:
    async def one(g: Generation) -> list[Delta]:
        return [d async for d in g.deltas()]

    return list(await asyncio.gather(*(one(g) for g in gens)))


# -- logprobs in both formats -----------------------------------------------------------------
def _completion_logprobs(
    ctx: ServerContext, deltas: list[Delta], offset: int
) -> CompletionLogprobs:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for d in deltas:
        for tid, lp, tops in d.logprobs:
            s = ctx.token_text(tid)
            tokens.append(s)
            token_logprobs.append(lp)
            top = {ctx.token_text(t): v for t, v in tops}
            top.setdefault(s, lp)
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(s)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=text_offset,
    )


def _echo_logprobs(ctx: ServerContext, ids: list[int], plp: list[Any] | None) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs (OpenAI's legacy format): the first
    token has none (`null`), every later one its log-probability given the tokens before it and
    the top-N alternatives (`plp`: the engine's prompt log-probabilities, computed in prefill)."""
    toks = [ctx.token_text(t) for t in ids]
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    offset = 0
    for i, s in enumerate(toks):
        entry = plp[i] if plp is not None and i < len(plp) else None
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            lp, alts = entry
            top = {ctx.token_text(t): v for t, v in alts}
            top.setdefault(s, lp)
            token_logprobs.append(lp)
            top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(s)
    return CompletionLogprobs(
        tokens=toks,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=text_offset,
    )


def _chat_logprobs(ctx: ServerContext, deltas: list[Delta], k: int) -> ChatLogprobs:
    def entry(t: int, v: float) -> dict[str, Any]:
        return {"token": ctx.token_text(t), "logprob": v, "bytes": ctx.token_bytes(t)}

    content = []
    for d in deltas:
        for tid, lp, tops in d.logprobs:
            tops_k = [ChatLogprob(**entry(t, v)) for t, v in tops[:k]]
            content.append(ChatLogprobToken(**entry(tid, lp), top_logprobs=tops_k))
    return ChatLogprobs(content=content)


# -- /v1/completions ---------------------------------------------------------------------------
async def completions(ctx: ServerContext, req: CompletionRequest, request: Request) -> Response:
    ctx.check_model(req.model)
    ctx.require("causal-lm", "/v1/completions")
    req.check_unsupported()
    prompts = [ctx.check_ids(p) if isinstance(p, list) else ctx.encode(p) for p in req.prompts()]
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default: 16
    # max_tokens 0 (with echo): score the prompt only. The engine's prefill always yields one
    # token; it is generated and dropped, as vLLM does.
    score_only = max_tokens == 0
    max_tokens = max(1, max_tokens)
    for i, ids in enumerate(prompts):
        where = f"prompt.{i}" if len(prompts) > 1 else "prompt"
        ctx.check_length(len(ids), max_tokens, where)
    # echo + logprobs: the engine also scores the prompt (OpenAI's legacy prompt logprobs).
    scored = req.logprobs if req.echo and req.logprobs is not None else None
    gens = _start(ctx, request, req, prompts, max_tokens, req.logprobs or 0, scored)
    cid, created, n = new_id("cmpl"), now(), req.n
    echo = [ctx.tokenizer.decode(p) for p in prompts] if req.echo else None
    echoed: set[int] = set()  # streamed choices whose prompt has been sent

    def shown(d: Delta) -> Delta:
        if not score_only:
            return d
        return replace(d, text="", token_ids=[], logprobs=[], finish_reason="length")

    def stream_choice(i: int, d: Delta) -> CompletionChoice:
        d = shown(d)
        text, prefix = d.text, ""
        if echo and i not in echoed:  # the prompt goes out with the choice's first token
            echoed.add(i)
            prefix = echo[i // n]
        lp = None
        if req.logprobs is not None:
            lp = _completion_logprobs(ctx, [d], len(prefix))
            if prefix:
                lp = _echo_logprobs(ctx, prompts[i // n], d.prompt_logprobs) + lp
        return CompletionChoice(
            index=i, text=prefix + text, logprobs=lp, finish_reason=d.finish_reason
        )

    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        chunk = partial(CompletionStreamResponse, id=cid, created=created, model=ctx.served_name)
        body = _stream(
            ctx, gens, prompts, include, [], chunk, stream_choice, "completions", not score_only
        )
        return _streaming(body)

    result = await until_done_or_gone(request, _collect(gens))
    if isinstance(result, Response):
        ctx.metrics.requests.labels("completions", "disconnected").inc()
        return result
    choices = []
    for i, deltas in enumerate(result):
        deltas = [shown(d) for d in deltas]
        prefix = echo[i // n] if echo else ""
        text = prefix + "".join(d.text for d in deltas)
        lp = _completion_logprobs(ctx, deltas, len(prefix)) if req.logprobs is not None else None
        if lp is not None and echo:
            plp = deltas[0].prompt_logprobs if deltas else None
            lp = _echo_logprobs(ctx, prompts[i // n], plp) + lp
        choices.append(
            CompletionChoice(
                index=i,
                text=text,
                logprobs=lp,
                finish_reason=deltas[-1].finish_reason if deltas else "stop",
            )
        )
    ctx.metrics.requests.labels("completions", "ok").inc()
    return json_response(
        CompletionResponse(
            id=cid,
            created=created,
            model=ctx.served_name,
            choices=choices,
            usage=_usage(prompts, gens, not score_only),
        )
    )


# -- /v1/chat/completions ----------------------------------------------------------------------
def _chat_prompt(ctx: ServerContext, req: ChatRequest) -> list[int]:
    tok = ctx.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(
            400,
            f"`{ctx.served_name}` has no chat template; use /v1/completions",
            code="no_chat_template",
        )
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template that rejects the conversation (roles out of order...)
        raise APIError(
            400, f"the chat template rejected the messages: {e}", param="messages"
        ) from None
    return list(tok(text, add_special_tokens=False)["input_ids"])


async def chat_completions(ctx: ServerContext, req: ChatRequest, request: Request) -> Response:
    ctx.check_model(req.model)
    ctx.require("causal-lm", "/v1/chat/completions")
    req.check_unsupported()
    ids = _chat_prompt(ctx, req)
    max_tokens = req.limit or max(1, ctx.max_seq_len - len(ids))  # OpenAI: up to the context
    which = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    ctx.check_length(len(ids), max_tokens, "messages", which)
    k = req.top_logprobs or 0
    gens = _start(ctx, request, req, [ids], max_tokens, k if req.logprobs else 0)
    cid, created = new_id("chatcmpl"), now()

    def stream_choice(i: int, d: Delta) -> ChatStreamChoice:
        # A final delta with no text carries only the finish reason: no `content` at all.
        delta = (
            DeltaMessage(content=d.text) if d.text or d.finish_reason is None else DeltaMessage()
        )
        lp = _chat_logprobs(ctx, [d], k) if req.logprobs else None
        return ChatStreamChoice(index=i, delta=delta, logprobs=lp, finish_reason=d.finish_reason)

    if req.stream:
        chunk = partial(
            ChatCompletionStreamResponse, id=cid, created=created, model=ctx.served_name
        )
        first = [
            chunk(
                choices=[
                    ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                ]
            )
            for i in range(len(gens))
        ]
        include = bool(req.stream_options and req.stream_options.include_usage)
        return _streaming(_stream(ctx, gens, [ids], include, first, chunk, stream_choice, "chat"))

    result = await until_done_or_gone(request, _collect(gens))
    if isinstance(result, Response):
        ctx.metrics.requests.labels("chat", "disconnected").inc()
        return result
    choices = []
    for i, deltas in enumerate(result):
        msg = ChatMessageOut(content="".join(d.text for d in deltas))
        choices.append(
            ChatChoice(
                index=i,
                message=msg,
                logprobs=_chat_logprobs(ctx, deltas, k) if req.logprobs else None,
                finish_reason=deltas[-1].finish_reason if deltas else "stop",
            )
        )
    ctx.metrics.requests.labels("chat", "ok").inc()
    return json_response(
        ChatCompletionResponse(
            id=cid,
            created=created,
            model=ctx.served_name,
            choices=choices,
            usage=_usage([ids], gens),
        )
    )
