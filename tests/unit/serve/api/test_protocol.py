"""The serve API's response models: each kind of body round-trips through its pydantic model,
fixed examples render to exactly the JSON the server sent before the models existed (field
order, `null` vs omitted), and live responses of every kind validate against their model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from llmopt.serve.api.protocol import APIError  # noqa: E402
from llmopt.serve.api.protocol_responses import (  # noqa: E402
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
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    WireModel,
    error_body,
    json_response,
    sse_event,
)
from llmopt.serve.settings import ServeSettings  # noqa: E402

HEAD = {"id": "cmpl-1", "created": 7, "model": "m"}
USAGE = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
LP = CompletionLogprobs(
    tokens=["a", "b"],
    token_logprobs=[None, -0.5],
    top_logprobs=[None, {"b": -0.5, "c": -1.25}],
    text_offset=[0, 1],
)
CHAT_LP = ChatLogprobs(
    content=[
        ChatLogprobToken(
            token="é",
            logprob=-0.1,
            bytes=[195, 169],
            top_logprobs=[ChatLogprob(token="é", logprob=-0.1, bytes=[195, 169])],
        )
    ]
)

# (model, the JSON the hand-written dicts produced for the same example)
EXAMPLES: list[tuple[WireModel, str]] = [
    (
        error_body("bad", param="stop"),
        '{"error":{"message":"bad","type":"invalid_request_error","param":"stop","code":null}}',
    ),
    (
        CompletionResponse(
            **HEAD,
            choices=[CompletionChoice(index=0, text="ab", logprobs=LP, finish_reason="length")],
            usage=USAGE,
        ),
        '{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,'
        '"text":"ab","logprobs":{"tokens":["a","b"],"token_logprobs":[null,-0.5],"top_logprobs":'
        '[null,{"b":-0.5,"c":-1.25}],"text_offset":[0,1]},"finish_reason":"length"}],"usage":'
        '{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}',
    ),
    (
        CompletionStreamResponse(**HEAD, choices=[CompletionChoice(index=1, text="x")]),
        '{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":1,'
        '"text":"x","logprobs":null,"finish_reason":null}]}',
    ),
    (
        CompletionStreamResponse(**HEAD, choices=[CompletionChoice(index=0, text="x")], usage=None),
        '{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,'
        '"text":"x","logprobs":null,"finish_reason":null}],"usage":null}',
    ),
    (
        CompletionStreamResponse(**HEAD, choices=[], usage=USAGE),
        '{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[],"usage":'
        '{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}',
    ),
    (
        ChatCompletionResponse(
            **HEAD,
            choices=[
                ChatChoice(
                    index=0,
                    message=ChatMessageOut(content="hi"),
                    logprobs=CHAT_LP,
                    finish_reason="stop",
                )
            ],
            usage=USAGE,
        ),
        '{"id":"cmpl-1","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,'
        '"message":{"role":"assistant","content":"hi"},"logprobs":{"content":[{"token":"é",'
        '"logprob":-0.1,"bytes":[195,169],"top_logprobs":[{"token":"é","logprob":-0.1,"bytes":'
        '[195,169]}]}]},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,'
        '"total_tokens":5}}',
    ),
    (
        ChatCompletionStreamResponse(
            **HEAD,
            choices=[ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
        ),
        '{"id":"cmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index"'
        ':0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}',
    ),
    (
        ChatCompletionStreamResponse(
            **HEAD, choices=[ChatStreamChoice(index=0, delta=DeltaMessage(content="x"))], usage=None
        ),
        '{"id":"cmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index"'
        ':0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null}],"usage":null}',
    ),
    (
        ChatCompletionStreamResponse(
            **HEAD, choices=[ChatStreamChoice(index=0, delta=DeltaMessage(), finish_reason="stop")]
        ),
        '{"id":"cmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index"'
        ':0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}',
    ),
    (
        EmbeddingResponse(
            data=[
                EmbeddingData(index=0, embedding=[0.5, -1.0]),
                EmbeddingData(index=1, embedding="AAAAPw=="),
            ],
            model="e",
            usage=EmbeddingUsage(prompt_tokens=4, total_tokens=4),
        ),
        '{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5,-1.0]},{"object":'
        '"embedding","index":1,"embedding":"AAAAPw=="}],"model":"e","usage":{"prompt_tokens":4,'
        '"total_tokens":4}}',
    ),
    (
        ModelList(data=[ModelCard(id="m", created=1, max_model_len=96)]),
        '{"object":"list","data":[{"id":"m","object":"model","created":1,"owned_by":"llmopt",'
        '"max_model_len":96}]}',
    ),
    (
        HealthResponse(
            status="ok",
            model="m",
            task="causal-lm",
            in_flight=0,
            settings={"block_size": {"value": 16, "source": "default"}},
        ),
        '{"status":"ok","model":"m","task":"causal-lm","in_flight":0,"settings":{"block_size":'
        '{"value":16,"source":"default"}}}',
    ),
    (
        HealthResponse(
            status="engine_dead",
            model="m",
            task="causal-lm",
            in_flight=2,
            settings={},
            engine={"mode": "process", "alive": False},
        ),
        '{"status":"engine_dead","model":"m","task":"causal-lm","in_flight":2,"settings":{},'
        '"engine":{"mode":"process","alive":false}}',
    ),
]


@pytest.mark.parametrize(
    "model, want", EXAMPLES, ids=lambda x: type(x).__name__ if isinstance(x, WireModel) else ""
)
def test_fixed_examples_render_the_previous_json_and_round_trip(model, want):
    assert json_response(model).body.decode() == want  # the bytes of a JSON response
    assert json.loads(sse_event(model)[len("data: ") :]) == json.loads(want)  # and of an event
    again = type(model).model_validate_json(want)  # parsing the wire form gives the same body
    assert again.model_dump() == model.model_dump()


def test_stream_events_keep_json_dumps_spacing_and_non_finite_floats():
    chunk = CompletionStreamResponse(
        **HEAD,
        choices=[
            CompletionChoice(
                index=0,
                text="ü",
                logprobs=CompletionLogprobs(
                    tokens=["ü"], token_logprobs=[float("-inf")], top_logprobs=[{}], text_offset=[0]
                ),
            )
        ],
    )
    ev = sse_event(chunk)
    assert ev.startswith('data: {"id": "cmpl-1", "object": "text_completion"') and ev.endswith(
        "\n\n"
    )
    assert '"text": "ü"' in ev and "-Infinity" in ev  # as json.dumps(ensure_ascii=False) wrote it


def test_models_refuse_unknown_fields_and_wrong_literals():
    with pytest.raises(ValueError):
        UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2, extra=1)
    with pytest.raises(ValueError):
        CompletionResponse.model_validate(json.loads(EXAMPLES[1][1]) | {"object": "chat"})
    assert APIError(404, "no", param="model").body() == error_body("no", param="model")


def test_live_responses_validate_against_their_models(tiny_llama_dir, tiny_bert_dir):
    from starlette.testclient import TestClient

    from llmopt.serve.api.app import create_app
    from llmopt.serve.server import load_context

    s = ServeSettings(max_num_seqs=2, num_blocks=32, block_size=4, max_seq_len=96)
    ctx = load_context(str(tiny_llama_dir), s)
    name = ctx.served_name

    def check(cls: type[WireModel], body: dict) -> None:
        assert cls.model_validate(body).model_dump() == body, cls.__name__

    def events(r) -> list[dict]:
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(x) for x in lines[:-1]]

    stream = {"stream": True, "stream_options": {"include_usage": True}}
    comp = {"model": name, "prompt": "ab", "max_tokens": 3, "logprobs": 1, "echo": True, "n": 2}
    chat = {
        "model": name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    with TestClient(create_app(ctx)) as c:
        check(CompletionResponse, c.post("/v1/completions", json=comp).json())
        for e in events(c.post("/v1/completions", json=comp | stream)):
            check(CompletionStreamResponse, e)
        check(ChatCompletionResponse, c.post("/v1/chat/completions", json=chat).json())
        for e in events(c.post("/v1/chat/completions", json=chat | stream)):
            check(ChatCompletionStreamResponse, e)
        check(ModelList, c.get("/v1/models").json())
        check(ModelCard, c.get(f"/v1/models/{name}").json())
        check(HealthResponse, c.get("/health").json())
        check(ErrorResponse, c.post("/v1/embeddings", json={"model": name, "input": "x"}).json())
    ectx = load_context(str(tiny_bert_dir), s)
    with TestClient(create_app(ectx)) as c:
        for fmt in ("float", "base64"):
            body = {"model": ectx.served_name, "input": ["a b", "c"], "encoding_format": fmt}
            check(EmbeddingResponse, c.post("/v1/embeddings", json=body).json())
