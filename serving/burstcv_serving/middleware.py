"""Limit bodies, admit prediction requests before their body is read, count every request.

A refusal sent before the body is read keeps the connection open when the body is at most
``max_discard_bytes`` (uvicorn discards the rest), so a client that sends its whole body before
reading (urllib) still reads the answer instead of a reset.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from burstcv_serving.admission import ADMISSION_WAIT, BODY_READ_AT, RETRY_AFTER_S, Refusal
from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.state import ServiceState

# Key in a request's scope state: the HTTP protocol admitted it already (and releases its slot).
ADMITTED = "burstcv_admitted"


def _too_large(limit: int) -> str:
    return f"request body is larger than the limit of {limit} bytes; send a smaller image"


def must_close(scope: Mapping[str, Any], max_discard_bytes: int) -> bool:
    """Tell whether a refusal sent before reading the body must close the connection: a body
    over ``max_discard_bytes``, chunked (unbounded), or waiting for ``100 Continue``."""
    for name, value in scope["headers"]:
        if name == b"content-length" and (not value.isdigit() or int(value) > max_discard_bytes):
            return True
        if name == b"transfer-encoding":
            return True
        if name == b"expect" and value.lower() == b"100-continue":
            return True
    return False


async def refuse_unread(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    detail: str,
    max_discard_bytes: int,
    extra_headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Refuse before reading the body. When the server closes after the answer anyway (HTTP/1.0,
    or ``Connection: close`` as urllib sends) and need not cut the body off, read the body to
    its end first: closing on the unread rest would reset the connection."""
    close = must_close(scope, max_discard_bytes)
    closes = scope.get("http_version") == "1.0" or any(
        name == b"connection" and b"close" in value.lower() for name, value in scope["headers"]
    )
    while not close and closes:  # read and drop the body, to its end
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    await send_error(send, status, detail, close=close, extra_headers=extra_headers)


async def send_error(
    send: Send,
    status: int,
    detail: str,
    *,
    close: bool,
    extra_headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Send a ``{"detail": ...}`` JSON answer, closing the connection after it if ``close``."""
    body = json.dumps({"detail": detail}).encode()
    length = str(len(body)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", length), *extra_headers]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Answer 413 when Content-Length exceeds the limit, and stop reading once it is passed."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_discard_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_discard_bytes = max_discard_bytes

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
                    await send_error(send, 400, "Content-Length is not a number", close=True)
                    return
                if declared > limit:
                    detail = _too_large(limit)
                    await refuse_unread(scope, receive, send, 413, detail, self.max_discard_bytes)
                    return
        received = 0
        discard = self.max_discard_bytes

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # chunked bodies have no Content-Length to check first
                    # Read and discard the rest (up to a bound) so the client reads the 413.
                    while message.get("more_body", False) and received <= discard:
                        message = await receive()
                        received += len(message.get("body", b""))
                    more = message["type"] != "http.request" or message.get("more_body", False)
                    headers = {"Connection": "close"} if more else None
                    raise HTTPException(413, detail=_too_large(limit), headers=headers)
            return message

        await self.app(scope, limited_receive, send)


# An ASGI scope's client: (address, port), which names a connection while it is open.
Client = tuple[object, ...]


@dataclass(slots=True, eq=False)
class _WaitingRequest:
    """A request waiting in the admission gate, resolved through a future."""

    arrived: float
    future: asyncio.Future[Refusal | None]
    admitted_at: float | None = None

    def alive(self) -> bool:
        return not self.future.done()

    def admit(self, admitted_at: float) -> None:
        self.admitted_at = admitted_at
        self.future.set_result(None)

    def refuse(self, refused: Refusal) -> None:
        self.future.set_result(refused)


class AdmissionMiddleware:
    """Admit prediction requests through the admission gate before their body is read.

    Where ``burstcv_serving.protocol`` does not run: uvicorn's public protocol, any other server,
    the test client. Early retries are known by the client's (address, port).
    """

    def __init__(
        self,
        app: ASGIApp,
        paths: Collection[str],
        metrics: ServiceMetrics,
        max_discard_bytes: int,
    ) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.metrics = metrics
        self.max_discard_bytes = max_discard_bytes
        self.retry_after = ((b"retry-after", str(RETRY_AFTER_S).encode()),)
        # time.perf_counter() of the last 503 per client (address, port), for Retry-After; and
        # the same in time order, to forget each once its Retry-After has passed.
        self._refused_at: dict[Client, float] = {}
        self._refusals: deque[tuple[float, Client]] = deque()

    def _early_retry(self, client: Client | None, now: float) -> bool:
        """Tell whether a request from ``client`` comes before its last 503's Retry-After."""
        refused_at = None if client is None else self._refused_at.get(client)
        return refused_at is not None and now - refused_at < RETRY_AFTER_S

    def _refused(self, client: Client | None) -> None:
        """Remember that ``client`` was answered 503 now; forget those past Retry-After."""
        now = time.perf_counter()
        refusals, refused_at = self._refusals, self._refused_at
        while refusals and now - refusals[0][0] >= RETRY_AFTER_S:
            then, old = refusals.popleft()
            if refused_at.get(old) == then:
                del refused_at[old]
        if client is not None:
            refused_at[client] = now
            refusals.append((now, client))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        service: ServiceState | None = scope["app"].state.service
        if service is None or service.manager.current is None:
            # The route answers 503 saying why (starting, or which load failed).
            self.metrics.shed.labels(reason="no_model").inc()
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        if state.get(ADMITTED):
            await self.app(scope, receive, send)
            return
        arrived = state.setdefault("received_at", time.perf_counter())
        waiter = _WaitingRequest(arrived, asyncio.get_running_loop().create_future())
        client = tuple(scope["client"]) if scope.get("client") else None
        service.gate.offer(waiter, early_retry=self._early_retry(client, arrived))
        try:
            refused = await waiter.future
            if refused is None:
                state[ADMISSION_WAIT] = (waiter.admitted_at or arrived) - arrived
                await self.app(scope, receive, send)
                return
        finally:
            if waiter.admitted_at is not None:
                service.gate.release(waiter.admitted_at, state.get(BODY_READ_AT))
        await refuse_unread(
            scope, receive, send, 503, refused.detail, self.max_discard_bytes, self.retry_after
        )
        self._refused(client)


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
        # The HTTP protocol stamps the arrival earlier (when the headers were parsed); keep it.
        received_at = scope.setdefault("state", {}).setdefault("received_at", started)
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
            self.metrics.latency.labels(path=path).observe(time.perf_counter() - received_at)


Handler = Callable[[Request], Awaitable[Response]]


class FastLaneMiddleware:
    """Hand POST requests for the given paths to their handlers, past FastAPI's router.

    The prediction routes take the raw request and build their own response, so the router
    would add only time (a tenth of a millisecond per request on a small CPU). The FastAPI
    routes stay registered: they document the endpoints and answer any other method.
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
