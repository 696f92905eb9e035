"""Helpers of the serve API tests: an app in process over a model folder, and the check that
the engine went idle with every KV block back (the block invariant)."""

from __future__ import annotations

import time

import pytest

from llmopt.serve.settings import ServeSettings


def serve_client(folder, **kw):
    """A TestClient over `folder` served with small limits (`kw` overrides them); `.ctx` is the
    server context. Use it as a context manager (that starts the engine thread)."""
    from starlette.testclient import TestClient

    from llmopt.serve.api.app import create_app
    from llmopt.serve.server import load_context

    base = dict(max_num_seqs=2, num_blocks=64, block_size=4, max_seq_len=120, max_queue=2)
    ctx = load_context(str(folder), ServeSettings(**(base | kw)))
    c = TestClient(create_app(ctx))
    c.ctx = ctx
    return c


def settle(ctx, timeout: float = 10.0) -> None:
    """Wait for the engine thread to go idle, then check the block invariant (an embedding
    server: that no request is left outstanding)."""
    deadline = time.monotonic() + timeout
    if ctx.engine is None:
        while ctx.outstanding and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ctx.outstanding == 0 and not ctx.started
        return
    sched = ctx.engine.sched
    while (sched.has_work() or ctx.outstanding) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.05)  # the step that freed the last blocks has published
    assert not sched.has_work() and ctx.outstanding == 0
    assert sched.gen.free_blocks == sched.capacity_blocks, "KV blocks leaked"
    assert sched.check_invariants() == []


@pytest.fixture(scope="session")
def make_client():
    """`serve_client`, for tests and fixtures of any scope."""
    return serve_client


@pytest.fixture(scope="session", name="settle")
def settle_fixture():
    """`settle`: wait for the engine to go idle, then check the block invariant."""
    return settle
