"""ASGI middleware: refuse oversized bodies early, count every request for Prometheus, and
send prediction requests straight to their handlers."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Collection, Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from burstcv_serving.metrics import ServiceMetrics


def _too_large(limit: int) -> str:
    return f"request body is larger than the limit of {limit} bytes; send a smaller image"


async def _send_error(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Answer 413 when Content-Length exceeds the limit, and stop reading once it is passed."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_error(send, 400, "Content-Length is not a number")
                    return
                if declared > limit:
                    await _send_error(send, 413, _too_large(limit))
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # chunked bodies have no Content-Length to check first
                    raise HTTPException(413, detail=_too_large(limit))
            return message

        await self.app(scope, limited_receive, send)


class MetricsMiddleware:
    """Count responses by route and status, and time them; stamp the arrival time."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, paths: Collection[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        scope.setdefault("state", {})["received_at"] = started
        status = 500  # if the app fails before answering, ServerErrorMiddleware sends a 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            path = scope["path"] if scope["path"] in self.paths else "other"
            self.metrics.requests.labels(path=path, method=scope["method"], status=status).inc()
            self.metrics.latency.labels(path=path).observe(time.perf_counter() - started)


Handler = Callable[[Request], Awaitable[Response]]


class FastLaneMiddleware:
    """Hand POST requests for the given paths to their handlers, past FastAPI's router.

    The prediction routes take only the raw request and build their own response, so the
    router's matching, dependency solving and exception middleware add nothing but time
    (about a tenth of a millisecond per request on a small CPU). HTTPExceptions become the
    same ``{"detail": ...}`` answers FastAPI gives; anything else propagates to the server
    error middleware (a 500). The FastAPI routes stay registered: they document the
    endpoints in /openapi.json and answer any other method.
    """

    def __init__(self, app: ASGIApp, handlers: Mapping[str, Handler]) -> None:
        self.app = app
        self.handlers = dict(handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = (
            self.handlers.get(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST"
            else None
        )
        if handler is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await handler(Request(scope, receive))
        except HTTPException as exc:
            response = JSONResponse(
                {"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers
            )
        await response(scope, receive, send)
