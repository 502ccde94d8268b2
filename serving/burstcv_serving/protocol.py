"""Shed prediction requests in uvicorn's HTTP protocol, as soon as their headers are parsed.

Under overload every refused client sends again at once, so the event loop spends most of
its time refusing; each refusal it can skip (a task, the ASGI middleware stack, two writes)
is time the admitted requests get back. ``AdmissionHttpProtocol`` asks admission control
(``burstcv_serving.admission``) before uvicorn starts the request's ASGI task and, when the
answer is no, writes the whole 503 in one write and lets uvicorn's parser throw the body
away as it arrives. Admitted requests, and every other request, go to the app unchanged.

It extends uvicorn's httptools protocol at one private method, ``_start_asgi_task``; the
service pins uvicorn in its requirements, and tests/serving run it as a real process.
"""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from burstcv_serving.admission import PREDICTION_PATHS, RETRY_AFTER_S, Refusal, refusal
from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.middleware import must_close

_STATUS_LINE = b"HTTP/1.1 503 " + HTTPStatus.SERVICE_UNAVAILABLE.phrase.encode() + b"\r\n"


class AdmissionHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing shed prediction requests before their task."""

    app_of_service: FastAPI  # set on the subclass that ``protocol_for`` builds
    close_after_body = False  # a refused request's body is still arriving; close after it

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        scope = cycle.scope
        scope["state"]["received_at"] = time.perf_counter()
        if scope["method"] == "POST" and scope["path"] in PREDICTION_PATHS and app is self.app:
            refused = refusal(self.app_of_service.state.service)
            if refused is not None:
                self._refuse(cycle, refused)
                return
        super()._start_asgi_task(cycle, app)

    def _refuse(self, cycle: RequestResponseCycle, refused: Refusal) -> None:
        """Write the 503 at once and finish the request as uvicorn's own send() would."""
        state = self.app_of_service.state
        metrics: ServiceMetrics = state.metrics
        metrics.requests.labels(path=cycle.scope["path"], method="POST", status=503).inc()
        metrics.shed.labels(reason=refused.reason).inc()
        max_discard = state.settings.max_discard_bytes
        close = not cycle.keep_alive or must_close(cycle.scope, max_discard)
        body = refused.body()
        head = [_STATUS_LINE]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\nretry-after: ",
            str(RETRY_AFTER_S).encode(),
            b"\r\n",
            b"connection: close\r\n" if close else b"",
            b"\r\n",
            body,
        ]
        cycle.response_started = True
        cycle.response_complete = True  # uvicorn's parser now drops this request's body
        cycle.keep_alive = not close
        self.transport.write(b"".join(head))
        if close and cycle.more_body and not must_close(cycle.scope, max_discard):
            # The client asked to close (urllib does): read the body to its end first, as
            # closing on unread data would reset the connection before the 503 is read.
            self.close_after_body = True
        elif close:
            self.transport.close()
        cycle.on_response()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.close_after_body:
            self.close_after_body = False
            self.transport.close()


def protocol_for(app: FastAPI) -> type[AdmissionHttpProtocol]:
    """Return the protocol class that sheds for ``app`` (pass it to uvicorn as ``http``)."""
    return type("AdmissionHttpProtocolForApp", (AdmissionHttpProtocol,), {"app_of_service": app})
