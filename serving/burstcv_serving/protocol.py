"""Admit prediction requests in uvicorn's HTTP protocol, as soon as their headers are parsed.

Under overload every refused client sends again at once, so a refusal, and a wait for a
service slot (``burstcv_serving.admission``), must cost the event loop as little as possible.
``AdmissionHttpProtocol`` offers each prediction request to the admission gate before uvicorn
starts its ASGI task: an admitted one starts at once; a waiting one costs a small object, its
body left to uvicorn's parser; a refused one gets the whole 503 in one write, and the parser
throws its body away. While requests wait, one that arrives whole in one read, between
requests, in the plainest form (``simple_request``) waits as raw bytes: most are refused, and
parsing each would cost more than the refusal. Each connection remembers its last 503, for
early retries.

It overrides uvicorn's private ``_start_asgi_task`` and reads private state, so it is written
for one uvicorn version (``WRITTEN_FOR_UVICORN``); ``protocol_for`` is the one door, falling
back to uvicorn's own protocol and ``middleware.AdmissionMiddleware`` (the same gate).
tests/serving run the shedding tests both ways, as real processes.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import re
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from burstcv_serving.admission import (
    ADMISSION_WAIT,
    BODY_READ_AT,
    PREDICTION_PATHS,
    RETRY_AFTER_S,
    Refusal,
)
from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.middleware import ADMITTED, must_close
from burstcv_serving.state import ServiceState

# The uvicorn release this module was written against (serving/requirements.txt pins it; a
# test keeps the two equal). Any other release runs uvicorn's public protocol instead.
WRITTEN_FOR_UVICORN = "0.54.0"
# The parameters of the private method it overrides, in that release.
_START_ASGI_TASK_PARAMETERS = ("self", "cycle", "app")

log = logging.getLogger(__name__)

_STATUS_LINE = b"HTTP/1.1 503 " + HTTPStatus.SERVICE_UNAVAILABLE.phrase.encode() + b"\r\n"


@dataclass(slots=True, eq=False)
class _WaitingCycle:
    """A request whose headers are parsed, waiting in the admission gate for a slot."""

    protocol: AdmissionHttpProtocol
    cycle: RequestResponseCycle
    app: Any
    service: ServiceState
    arrived: float

    def alive(self) -> bool:
        return not self.cycle.disconnected and not self.protocol.transport.is_closing()

    def admit(self, admitted_at: float) -> None:
        """Start the request's task; its slot is freed when it ends."""
        state = self.cycle.scope["state"]
        state[ADMITTED] = True
        state[ADMISSION_WAIT] = admitted_at - self.arrived
        task = self.protocol.start_task(self.cycle, self.app)
        gate = self.service.gate
        task.add_done_callback(lambda _: gate.release(admitted_at, state.get(BODY_READ_AT)))

    def refuse(self, refused: Refusal) -> None:
        self.protocol.refuse(self.cycle, refused)


_SIMPLE_REQUEST_LINES = {
    b"POST " + path.encode() + b" HTTP/1.1\r\n": path for path in sorted(PREDICTION_PATHS)
}
# The headers that frame a request or change how it is answered (in a lower-cased head).
_FRAMING = re.compile(rb"\r\n(content-length|connection|transfer-encoding|expect|upgrade):([^\r]*)")


def simple_request(data: bytes) -> str | None:
    """Return the path of the one whole prediction request ``data`` holds, or None.

    Only the plainest form, whose framing and answer need nothing from a parser: HTTP/1.1, one
    Content-Length, no Transfer-Encoding, Expect, Upgrade, or Connection but ``keep-alive``.
    """
    line_end = data.find(b"\r\n")
    path = _SIMPLE_REQUEST_LINES.get(data[: line_end + 2]) if line_end > 0 else None
    if path is None:
        return None
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    length = -1
    for name, value in _FRAMING.findall(data[line_end : head_end + 2].lower()):
        value = value.strip(b" \t")
        if name == b"content-length" and length < 0 and value.isdigit():
            length = int(value)
        elif name != b"connection" or value != b"keep-alive":
            return None  # a second length, or a header that changes the framing or answer
    if length < 0 or head_end + 4 + length != len(data):
        return None
    return path


@dataclass(slots=True, eq=False)
class _WaitingBytes:
    """A simple request (``simple_request``) waiting in the admission gate, not parsed yet."""

    protocol: AdmissionHttpProtocol
    path: str
    length: int
    arrived: float

    def alive(self) -> bool:
        return not self.protocol.transport.is_closing()

    def admit(self, admitted_at: float) -> None:
        self.protocol.parse_admitted(self.arrived, admitted_at)

    def refuse(self, refused: Refusal) -> None:
        self.protocol.refuse_unparsed(self.path, self.length, refused)


class _Refusals:
    """The 503 answers of one app: each written once per reason and connection handling."""

    def __init__(self, app: FastAPI) -> None:
        metrics: ServiceMetrics = app.state.metrics
        self.max_discard: int = app.state.settings.max_discard_bytes
        self.counted = {
            path: metrics.requests.labels(path=path, method="POST", status=503)
            for path in PREDICTION_PATHS
        }
        self._default_headers: object = None
        self._written: dict[tuple[Refusal, bool], bytes] = {}

    def response(
        self, refused: Refusal, close: bool, default_headers: list[tuple[bytes, bytes]]
    ) -> bytes:
        """Return the whole 503 (uvicorn renews its default headers, the date, every second)."""
        if default_headers is not self._default_headers:
            self._default_headers = default_headers
            self._written.clear()
        key = (refused, close)
        written = self._written.get(key)
        if written is None:
            body = refused.body()
            head = b"".join(b"%s: %s\r\n" % header for header in default_headers)
            head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
            head += b"retry-after: %d\r\n" % RETRY_AFTER_S
            head += b"connection: close\r\n" if close else b""
            written = self._written[key] = _STATUS_LINE + head + b"\r\n" + body
        return written


class AdmissionHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, admitting prediction requests before their task starts."""

    app_of_service: FastAPI  # set on the subclass that ``protocol_for`` builds
    refusals: _Refusals  # likewise
    close_after_body = False  # a refused request's body is still arriving; close after it
    in_message = False  # the parser is inside a request (between its first and last byte)
    # A simple request waiting unparsed (and whatever arrived after it), or None.
    unparsed: bytes | None = None
    # (arrived, admitted_at) of an unparsed request that got a slot and is being parsed.
    admitted: tuple[float, float] | None = None
    refused_at = float("-inf")  # time.perf_counter() of the last 503 written by refuse*()

    def early_retry(self, now: float) -> bool:
        """Tell whether a request arriving now comes before the last 503's Retry-After."""
        return now - self.refused_at < RETRY_AFTER_S

    def data_received(self, data: bytes) -> None:
        if self.unparsed is not None:  # keep what follows the waiting request, in order
            self.unparsed += data
            return
        if not self.in_message and (self.cycle is None or self.cycle.response_complete):
            service: ServiceState | None = self.app_of_service.state.service
            if service is not None and service.gate.waiting and not self.pipeline:
                path = simple_request(data)
                if path is not None and service.manager.current is not None:
                    self._unset_keepalive_if_required()
                    self.unparsed = data
                    now = time.perf_counter()
                    waiting = _WaitingBytes(self, path, len(data), now)
                    service.gate.offer(waiting, early_retry=self.early_retry(now))
                    return
        super().data_received(data)

    def on_message_begin(self) -> None:
        self.in_message = True
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self.in_message = False
        super().on_message_complete()
        if self.close_after_body:
            self.close_after_body = False
            self.transport.close()

    def parse_admitted(self, arrived: float, admitted_at: float) -> None:
        """Parse an unparsed request that got a slot; its task starts without asking again."""
        data, self.unparsed = self.unparsed, None
        self.admitted = (arrived, admitted_at)
        try:
            super().data_received(data or b"")
        finally:
            if self.admitted is not None:  # not a request after all: give the slot back
                self.admitted = None
                service: ServiceState | None = self.app_of_service.state.service
                if service is not None:
                    service.gate.release(admitted_at)

    def refuse_unparsed(self, path: str, length: int, refused: Refusal) -> None:
        """Answer a waiting unparsed request 503 (keep-alive), then read what followed it."""
        data, self.unparsed = self.unparsed or b"", None
        refusals = self.refusals
        refusals.counted[path].inc()
        self.transport.write(refusals.response(refused, False, self.server_state.default_headers))
        self.refused_at = time.perf_counter()
        self.server_state.total_requests += 1  # as uvicorn's on_response_complete counts
        if len(data) > length:
            self.data_received(data[length:])
        else:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        scope = cycle.scope
        if self.admitted is not None:  # an unparsed request that got its slot while waiting
            arrived, admitted_at = self.admitted
            self.admitted = None
            scope["state"]["received_at"] = arrived
            waiting = _WaitingCycle(self, cycle, app, self.app_of_service.state.service, arrived)
            waiting.admit(admitted_at)
            return
        now = time.perf_counter()
        scope["state"]["received_at"] = now
        if scope["method"] == "POST" and scope["path"] in PREDICTION_PATHS and app is self.app:
            service: ServiceState | None = self.app_of_service.state.service
            # Without a model the route answers 503 itself, saying why.
            if service is not None and service.manager.current is not None:
                waiting_cycle = _WaitingCycle(self, cycle, app, service, now)
                service.gate.offer(waiting_cycle, early_retry=self.early_retry(now))
                return
        self.start_task(cycle, app)

    def start_task(self, cycle: RequestResponseCycle, app: Any) -> asyncio.Task[None]:
        """Start the request's ASGI task, as uvicorn's ``_start_asgi_task`` does."""
        if self.config.reset_contextvars:
            task = self.loop.create_task(cycle.run_asgi(app), context=contextvars.Context())
        else:
            task = self.loop.create_task(cycle.run_asgi(app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        return task

    def refuse(self, cycle: RequestResponseCycle, refused: Refusal) -> None:
        """Write the 503 at once and finish the request as uvicorn's own send() would."""
        refusals = self.refusals
        refusals.counted[cycle.scope["path"]].inc()
        unbounded = must_close(cycle.scope, refusals.max_discard)
        close = unbounded or not cycle.keep_alive
        cycle.response_started = True
        cycle.response_complete = True  # uvicorn's parser now drops this request's body
        cycle.keep_alive = not close
        self.transport.write(refusals.response(refused, close, self.server_state.default_headers))
        self.refused_at = time.perf_counter()
        if close and cycle.more_body and not unbounded:
            # The client asked to close (urllib does): read the body to its end first, as
            # closing on unread data would reset the connection before the 503 is read.
            self.close_after_body = True
        elif close:
            self.transport.close()
        cycle.on_response()


def fast_path_mismatch() -> str | None:
    """Say why the installed uvicorn cannot run ``AdmissionHttpProtocol``, or None if it can."""
    installed = uvicorn.__version__
    if installed != WRITTEN_FOR_UVICORN:
        return f"uvicorn is {installed}, the protocol was written for {WRITTEN_FOR_UVICORN}"
    method = getattr(HttpToolsProtocol, "_start_asgi_task", None)
    if method is None:
        return "uvicorn's HttpToolsProtocol has no _start_asgi_task"
    try:
        parameters = tuple(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        parameters = ()
    if parameters != _START_ASGI_TASK_PARAMETERS:
        return (
            f"uvicorn's HttpToolsProtocol._start_asgi_task takes {parameters}, "
            f"not {_START_ASGI_TASK_PARAMETERS}"
        )
    return None


def protocol_for(app: FastAPI) -> type[AdmissionHttpProtocol] | Literal["httptools"]:
    """Return the HTTP protocol to serve ``app`` with (pass it to uvicorn as ``http``): the one
    that sheds, if ``fast_protocol`` is on and uvicorn is the written-for one; else uvicorn's."""
    if not app.state.settings.fast_protocol:
        log.info("fast HTTP protocol off (setting): uvicorn's httptools protocol admits in ASGI")
        return "httptools"
    mismatch = fast_path_mismatch()
    if mismatch is not None:
        log.warning(
            "fast HTTP protocol off: %s; serving with uvicorn's httptools protocol, admitting "
            "requests in ASGI middleware",
            mismatch,
        )
        return "httptools"
    return type(
        "AdmissionHttpProtocolForApp",
        (AdmissionHttpProtocol,),
        {"app_of_service": app, "refusals": _Refusals(app)},
    )
