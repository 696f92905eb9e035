"""`llmopt serve --http2`: the same app under hypercorn, which speaks HTTP/2.

hypercorn (a maintained ASGI server built on the `h2` protocol library) serves, on one port:
- without a certificate: HTTP/1.1 and cleartext HTTP/2 (h2c), by prior knowledge (the client
  opens with the HTTP/2 preface) or by `Upgrade: h2c` on a first HTTP/1.1 request;
- with `--ssl-certfile/--ssl-keyfile`: TLS, h2 or http/1.1 as the client picks by ALPN.
uvicorn speaks HTTP/1.1 only, which is why `--http2` changes the server rather than a setting.

The draining shutdown is `serve.drain.Drain`, as under uvicorn: this module only adapts it
(hypercorn's `shutdown_trigger` ends the serving once the drain is over; a second signal cuts
the open streams at once, as the end of the drain window would, and stops within a second).

`RequestBodyFirst` works around a hypercorn HTTP/2 bug (hypercorn issue 329, open in 0.18): when a
response ends before the client has sent all of its request body, hypercorn forgets the stream,
and the client's next DATA frame for it raises a KeyError that drops the whole connection, every
other stream multiplexed on it included. The app answers early on purpose (503 while draining,
401, 413), so under HTTP/2 the end of such a response waits for the rest of the request body.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from llmopt.core.errors import LlmoptError
from llmopt.serve.api.context import ServerContext
from llmopt.serve.drain import Drain, cut_generations

__all__ = [
    "INSTALL",
    "HTTP2UnavailableError",
    "RequestBodyFirst",
    "require_hypercorn",
    "serve_hypercorn",
]

log = logging.getLogger(__name__)

INSTALL = "pip install 'llmopt[serve]'  (or: pip install hypercorn h2)"

# How long, once the drain is over, connections get to close by themselves (as uvicorn's
# timeout_graceful_shutdown in `server.run_server`).
GRACEFUL_TIMEOUT_S = 5.0
# After a second signal: how long the streams cut at once get to write their last event.
FORCE_GRACE_S = 1.0


class HTTP2UnavailableError(LlmoptError):
    """`--http2` was asked for but hypercorn (or h2) is not installed."""


def require_hypercorn() -> None:
    """Raise `HTTP2UnavailableError` with the install command unless hypercorn and h2 import."""
    try:
        import h2  # noqa: F401
        import hypercorn.asyncio  # noqa: F401
    except ImportError as e:
        raise HTTP2UnavailableError(
            f"--http2 needs the hypercorn server and the h2 library ({e})", INSTALL
        ) from None


def bind_address(host: str, port: int) -> str:
    """hypercorn's bind string: IPv6 literals in brackets.

    >>> bind_address("::1", 8000), bind_address("127.0.0.1", 8000)
    ('[::1]:8000', '127.0.0.1:8000')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# How long an early response waits for the rest of its request body before ending anyway.
BODY_WAIT_S = 10.0


class RequestBodyFirst:
    """ASGI middleware: on HTTP/2, a response does not end before its request body has (see the
    module doc). The rest of an unread body is received and dropped; nothing is buffered."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("http_version") != "2":
            return await self.app(scope, receive, send)
        done = False

        async def tracked_receive() -> dict[str, Any]:
            nonlocal done
            msg = await receive()
            if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
                done = True
            return msg

        async def guarded_send(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.body" and not msg.get("more_body", False) and not done:
                try:
                    async with asyncio.timeout(BODY_WAIT_S):
                        while not done:
                            await tracked_receive()
                except TimeoutError:
                    log.warning("request body still arriving %g s after the response", BODY_WAIT_S)
            await send(msg)

        await self.app(scope, tracked_receive, guarded_send)


def make_config(ctx: ServerContext, log_level: str) -> Any:
    """The hypercorn `Config` for `ctx.settings`."""
    from hypercorn.config import Config

    s = ctx.settings
    cfg = Config()
    cfg.bind = [bind_address(s.host, s.port)]
    cfg.alpn_protocols = ["h2", "http/1.1"]
    if s.ssl_certfile:
        cfg.certfile, cfg.keyfile = s.ssl_certfile, s.ssl_keyfile
    cfg.accesslog = None
    # hypercorn's errors through llmopt's logging setup (its own handler would print each twice)
    errors = logging.getLogger("hypercorn.error")
    errors.setLevel(log_level.upper())
    cfg.errorlog = errors
    cfg.keep_alive_timeout = 5.0
    cfg.graceful_timeout = GRACEFUL_TIMEOUT_S
    # One HTTP/2 connection may carry every request the server admits (running + queued, one
    # more gets 429), so a single multiplexing client is never held back below the server's
    # own limits by hypercorn's default of 100 streams.
    cfg.h2_max_concurrent_streams = max(100, s.capacity + 1)
    return cfg


async def _serve(app: Any, ctx: ServerContext, cfg: Any) -> None:
    from hypercorn.asyncio import serve

    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()

    def force() -> None:
        # Streams still open get their `shutting_down` event and [DONE] now, and the server
        # waits no longer than FORCE_GRACE_S for them to be written (hypercorn reads
        # graceful_timeout after the trigger; then it cancels what is left).
        cut_generations(ctx)
        cfg.graceful_timeout = FORCE_GRACE_S
        loop.call_soon_threadsafe(stopped.set)

    drain = Drain(ctx, stop=stopped.set, force=force)
    drain.bind(loop)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, drain.on_signal, sig)
    try:
        await serve(app, cfg, shutdown_trigger=stopped.wait)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def serve_hypercorn(app: Any, ctx: ServerContext, log_level: str = "info") -> None:
    """Serve `app` under hypercorn until SIGTERM/SIGINT, then drain (`serve.drain`)."""
    require_hypercorn()
    asyncio.run(_serve(RequestBodyFirst(app), ctx, make_config(ctx, log_level)))
