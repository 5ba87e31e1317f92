"""End every open request when vLLM's engine has stopped, so that SIGTERM is bounded (issue 38, item 3).

What vLLM 0.32 does on SIGTERM / SIGINT: the engine drains in-flight requests for ``--shutdown-timeout``
seconds (0, the default: none), is then stopped (force-killed if still busy), and only after that does the HTTP
server shut down, waiting, with no bound, for its connections to close. Requests still open at that point never
get a last chunk: their output queues are not failed when the engine client is shut down cleanly (an engine that
*crashes* does fail them). Clients stall with no error and no ``[DONE]``, and the server process stays up for as
long as any client keeps its connection.

:class:`EndStreamsOnShutdown` is an ASGI middleware, added with vLLM's own ``--middleware`` flag (every profile
sets it; README's commands should too). It runs each HTTP request as vLLM would and watches vLLM's engine client
(``app.state.engine_client.errored``: the engine is dead or its output loop has ended). Once the engine has been
stopped for :data:`GRACE_S` while the request is still open, it ends the request itself: a stream gets a final
``data:`` error event (code 503, vLLM's error shape) and ``data: [DONE]``; a request whose answer has not started
gets HTTP 503; a started non-stream body is closed. The HTTP server's connections then close and the process
exits within the drain timeout plus a few seconds. Requests that finish on their own are untouched.
"""

from __future__ import annotations

import asyncio
import json

#: how often an open request looks at the engine, and how long the engine must have been stopped before the
#: middleware ends the request (vLLM's own error path, for an engine that crashed, gets that long to answer)
POLL_S = 0.5
GRACE_S = 1.0

MESSAGE = (
    "the server is shutting down: the engine stopped before this request finished (it was still running "
    "when the --shutdown-timeout drain ended)"
)


def _error_json() -> bytes:
    return json.dumps(
        {"error": {"message": MESSAGE, "type": "ServiceUnavailableError", "param": None, "code": 503}}
    ).encode()


def engine_stopped(scope) -> bool:
    """Has the app's vLLM engine client stopped (dead engine or ended output loop)? False when unknown."""
    app = scope.get("app")
    client = getattr(getattr(app, "state", None), "engine_client", None)
    try:
        return bool(client is not None and client.errored)
    except Exception:  # noqa: BLE001 (a client mid-teardown: treat as stopped only via the property)
        return False


class EndStreamsOnShutdown:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> None:
        self.app = app
        self.poll_s = poll_s
        self.grace_s = grace_s

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "ended": False, "sse": False}

        async def relay(message) -> None:
            if state["ended"]:
                return  # the middleware already ended this response
            if message["type"] == "http.response.start":
                state["started"] = True
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                state["sse"] = b"text/event-stream" in ctype
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True

        inner = asyncio.ensure_future(self.app(scope, receive, relay))
        stopped_for = 0.0
        try:
            while True:
                done, _ = await asyncio.wait({inner}, timeout=self.poll_s)
                if done:
                    inner.result()  # re-raise what the app raised
                    return
                stopped_for = stopped_for + self.poll_s if engine_stopped(scope) else 0.0
                if stopped_for >= self.grace_s:
                    break
        except asyncio.CancelledError:  # the server cancelled this request: asyncio.wait leaves the app running
            inner.cancel()
            raise
        inner.cancel()
        try:
            await inner
        except BaseException:  # noqa: BLE001 (the cancelled app's CancelledError or its own error)
            pass
        if state["ended"]:
            return
        state["ended"] = True
        if not state["started"]:
            await send(
                {"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": _error_json(), "more_body": False})
        elif state["sse"]:
            body = b"data: " + _error_json() + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
