"""Property-based fuzzing of the OpenAI surface (hypothesis) and overload, through the real app
in process over tiny random models: whatever a client sends, the answer is never a 5xx, every
4xx carries OpenAI's error body (`param` a field name or null), a 200 stream ends with `[DONE]`,
and after every case the KV-cache block invariant holds (nothing leaked). The case counts are
bounded and the examples derandomized, so the suite is reproducible and takes about a minute
on two CPU cores. Figures: docs/serving.md ("Robustness")."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CASES = 200  # per endpoint
FUZZ = settings(
    max_examples=CASES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SEEN: dict[str, int] = {}

# Text as JSON can spell it: any code point, lone surrogates included.
TEXT = st.text(st.characters(exclude_categories=()), min_size=0, max_size=12)
BIG = st.integers(min_value=-(2**70), max_value=2**70)
FLOAT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-40, 5e-324, 1e-5, 0.5, 1.0, 2.0, 2.0000001, -0.0]),
)
WILD = st.one_of(st.none(), st.booleans(), BIG, FLOAT, TEXT, st.lists(BIG, max_size=3))
IDS = st.lists(st.integers(min_value=-3, max_value=300), min_size=0, max_size=6)


def _sampling() -> dict:
    return {
        "max_tokens": st.one_of(st.integers(min_value=-1, max_value=6), WILD),
        "temperature": st.one_of(FLOAT, WILD),
        "top_p": st.one_of(FLOAT, WILD),
        "top_k": st.one_of(st.integers(min_value=-1, max_value=300), WILD),
        "seed": st.one_of(BIG, st.sampled_from([2**64 - 1, 2**64, -(2**63), -(2**63) - 1])),
        "n": st.one_of(st.integers(min_value=0, max_value=20), WILD),
        "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5), WILD),
        "stream": st.booleans(),
        "stream_options": st.one_of(st.just({"include_usage": True}), WILD),
        "ignore_eos": st.booleans(),
        "priority": st.one_of(st.integers(min_value=-5, max_value=5), WILD),
        "presence_penalty": st.one_of(st.just(0), FLOAT),
        "user": st.one_of(TEXT, WILD),
    }


COMPLETION = st.fixed_dictionaries(
    {
        "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=4), IDS, st.lists(IDS, max_size=3), WILD),
    },
    optional=_sampling()
    | {
        "logprobs": st.one_of(st.integers(min_value=-1, max_value=25), WILD),
        "echo": st.booleans(),
        "best_of": st.one_of(st.integers(min_value=0, max_value=3), WILD),
        "suffix": st.one_of(TEXT, WILD),
    },
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), TEXT)},
    optional={
        "content": st.one_of(
            TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})), WILD
        ),
        "name": st.one_of(TEXT, WILD),
    },
)
CHAT = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(MESSAGE, min_size=0, max_size=3), WILD)},
    optional=_sampling()
    | {
        "logprobs": st.one_of(st.booleans(), WILD),
        "top_logprobs": st.one_of(st.integers(min_value=-1, max_value=25), WILD),
        "max_completion_tokens": st.one_of(st.integers(min_value=-1, max_value=6), WILD),
        "response_format": st.one_of(st.just({"type": "json_object"}), WILD),
    },
)
EMBEDDING = st.fixed_dictionaries(
    {
        "input": st.one_of(
            TEXT,
            st.lists(TEXT, max_size=5),
            st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=4),
            st.lists(st.lists(BIG, max_size=3), max_size=3),
            WILD,
        )
    },
    optional={
        "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), WILD),
        "dimensions": st.one_of(st.integers(min_value=-1, max_value=500), WILD),
        "user": st.one_of(TEXT, WILD),
    },
)


def _with_model(body: dict, name: str, draw_model) -> dict:
    # Most cases carry the served name, so they reach the handlers rather than a 404.
    return {"model": name if draw_model is None else draw_model} | body


def _names_a_field(param: object, body: dict) -> bool:
    """Whether `param` is a dotted path into `body` (its last part may be a field the body
    lacks: a required or defaulted one), with no part that names a union's member as pydantic
    spells it (`str`, `list[int]`)."""
    if not isinstance(param, str) or not param:
        return False
    node: object = body
    parts = param.split(".")
    for i, part in enumerate(parts):
        if "[" in part or part in ("str", "int", "float", "bool", "none"):
            return False
        if isinstance(node, dict):
            if part not in node:
                return i == len(parts) - 1
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def check(client, settle, path: str, body: dict) -> None:
    raw = json.dumps(body)  # ensure_ascii: lone surrogates travel as \udXXX escapes
    r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    SEEN[path] = SEEN.get(path, 0) + 1
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code >= 400:
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["message"], e
        assert e["param"] is None or _names_a_field(e["param"], body), (e, body)
    elif body.get("stream") is True:
        lines = [x for x in r.text.split("\n") if x.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", r.text
        for x in lines[:-1]:
            chunk = json.loads(x[6:])
            assert "server_error" not in json.dumps(chunk.get("error", "")), chunk
    else:
        assert r.json()["object"] in ("text_completion", "chat.completion", "list"), r.text
    settle(client.ctx)


@pytest.fixture(scope="module")
def lm(tmp_path_factory, _tiny_llama_master, make_client):
    import shutil

    folder = tmp_path_factory.mktemp("fuzz") / "tiny-llama"
    shutil.copytree(_tiny_llama_master, folder)
    with make_client(folder, max_num_seqs=2, max_queue=4, max_seq_len=96, num_blocks=64) as c:
        yield c


@pytest.fixture(scope="module")
def emb(tmp_path_factory, _tiny_bert_master, make_client):
    import shutil

    folder = tmp_path_factory.mktemp("fuzz") / "tiny-bert"
    shutil.copytree(_tiny_bert_master, folder)
    with make_client(folder, embed_max_inputs=64) as c:
        yield c


MODEL = st.one_of(st.none(), st.none(), st.none(), TEXT, WILD)


@FUZZ
@given(body=COMPLETION, model=MODEL)
def test_fuzz_completions(lm, settle, body, model):
    check(lm, settle, "/v1/completions", _with_model(body, lm.ctx.served_name, model))


@FUZZ
@given(body=CHAT, model=MODEL)
def test_fuzz_chat(lm, settle, body, model):
    check(lm, settle, "/v1/chat/completions", _with_model(body, lm.ctx.served_name, model))


@FUZZ
@given(body=EMBEDDING, model=MODEL)
def test_fuzz_embeddings(emb, settle, body, model):
    check(emb, settle, "/v1/embeddings", _with_model(body, emb.ctx.served_name, model))


def test_overload_at_ten_times_capacity_loses_nothing(lm, settle):
    """40 streams at once on a server that takes 4 (2 running + 2 queued... here 2 + 4): every
    request is either served to its end (finish_reason and [DONE]) or refused with a 429 and a
    Retry-After; none accepted is lost or cut."""
    cap = lm.ctx.settings.capacity
    total = 10 * cap
    name = lm.ctx.served_name
    outcomes: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"model": name, "prompt": f"load {i}", "max_tokens": 12, "stream": True}
        with lm.stream("POST", "/v1/completions", json=body | {"ignore_eos": True}) as r:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                out = "429"
            else:
                lines = [x for x in r.iter_lines() if x.startswith("data: ")]
                ok = r.status_code == 200 and lines[-1] == "data: [DONE]"
                last = json.loads(lines[-2][6:]) if len(lines) > 1 else {}
                ok = ok and last.get("choices", [{}])[0].get("finish_reason") == "length"
                out = "done" if ok else f"lost {r.status_code} {lines[-2:]}"
        with lock:
            outcomes.append(out)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(total)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lost = [o for o in outcomes if o.startswith("lost")]
    print(
        f"overload: {total} streams on capacity {cap}: {outcomes.count('done')} completed, "
        f"{outcomes.count('429')} x 429, {len(lost)} lost"
    )
    assert len(outcomes) == total and not lost, lost
    assert outcomes.count("done") >= cap
    settle(lm.ctx)


def test_fuzz_counted():
    """Runs last in this module: the fuzz cases above actually ran (printed for the docs)."""
    print(f"fuzz cases: {SEEN}")
    if SEEN:
        assert all(v >= min(CASES, 50) for v in SEEN.values()), SEEN
