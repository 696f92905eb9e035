"""The draining shutdown, the same whichever HTTP server runs the app (uvicorn or hypercorn).

The first SIGTERM or SIGINT starts draining: `ctx.draining` is set, so the guard in front of the
app (`api/app.py`) answers new `/v1` requests with 503 and `/health` with "draining", while the
server keeps its listening socket open (a client is refused with a status it can act on, not a
reset connection). The server is told to stop once the requests in flight have finished or
`drain_timeout_s` has passed; at the end of that window every generation still running is cut
with an error the client can see (a stream: an in-band error event, code `shutting_down`, and
`data: [DONE]`; a non-streamed request: a 503), and the cut requests get `CUT_GRACE_S` to write
it. A second signal stops the server at once.

A server adapter gives `Drain` two callables, `stop` (close gracefully: the drain is over) and
`force` (close now), and calls `on_signal` from its signal handling; nothing here knows which
server it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from llmopt.serve.api.context import ServerContext
from llmopt.serve.api.protocol import APIError

__all__ = ["CUT_GRACE_S", "Drain", "cut_generations"]

log = logging.getLogger(__name__)

# After the drain window, how long the cut requests get to send their last event.
CUT_GRACE_S = 2.0


def cut_generations(ctx: ServerContext) -> int:
    """End every open generation with a 503 `shutting_down` error (in-band for streams, which
    then send `[DONE]`); returns how many were cut."""
    err = APIError(
        503,
        f"the server shut down: the drain window ({ctx.settings.drain_timeout_s:g} s, "
        "--drain-timeout) ended before this request finished; retry on another replica",
        type="service_unavailable",
        code="shutting_down",
    )
    gens = list(ctx.generations)
    for g in gens:
        g.cut(err)
    return len(gens)


class Drain:
    """One server's shutdown: drain on the first signal, force on the second.

    Args:
        ctx: the server context the app's guard reads (`draining`, `inflight_http`).
        stop: tells the server to close gracefully (called on the event loop).
        force: tells the server to close at once (called from the signal handler).

    Example:
        >>> drain = Drain(ctx, stop=server_should_exit, force=server_force_exit)  # doctest: +SKIP
        >>> drain.bind(asyncio.get_running_loop())  # once the server's loop runs  # doctest: +SKIP
    """

    def __init__(
        self, ctx: ServerContext, stop: Callable[[], None], force: Callable[[], None]
    ) -> None:
        self.ctx = ctx
        self._stop = stop
        self._force = force
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the server runs on (the drain waits there)."""
        self._loop = loop

    def on_signal(self, sig: int) -> None:
        """A shutdown signal. Safe to call from a signal handler, on or off the loop."""
        if self.ctx.draining:
            log.info("signal %s again: stopping now", sig)
            self._force()
            return
        if self._loop is None:  # the server is not serving yet: nothing to drain
            self._stop()
            return
        self.ctx.draining = True
        log.info("signal %s: draining %d requests in flight", sig, self.ctx.inflight_http)
        self._loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        """Wait for the requests in flight (at most the drain window), cut what is left, then
        tell the server to stop."""
        ctx = self.ctx
        deadline = time.monotonic() + ctx.settings.drain_timeout_s
        while ctx.inflight_http > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if ctx.inflight_http:
            log.warning("drain timeout: %d requests still in flight", ctx.inflight_http)
            cut_generations(ctx)
            # Let the cut streams write their error event and [DONE] before closing.
            grace = time.monotonic() + CUT_GRACE_S
            while ctx.inflight_http > 0 and time.monotonic() < grace:
                await asyncio.sleep(0.02)
        self._stop()
