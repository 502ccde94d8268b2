"""Build the FastAPI app; the model is loaded in the lifespan, never at import."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from burstcv_serving import __version__
from burstcv_serving.admission import PREDICTION_PATHS, AdmissionGate
from burstcv_serving.batcher import MicroBatcher
from burstcv_serving.manager import ModelManager
from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.middleware import (
    AdmissionMiddleware,
    BodyLimitMiddleware,
    FastLaneMiddleware,
    MetricsMiddleware,
)
from burstcv_serving.model import LoadedModel
from burstcv_serving.registry import DirectorySource, ModelSource, RegistrySource
from burstcv_serving.routes import admin, health, metrics, model_info, predict
from burstcv_serving.schemas import ErrorOut
from burstcv_serving.settings import Settings, queue_target_ms
from burstcv_serving.state import ServiceState

logger = logging.getLogger(__name__)


def make_source(settings: Settings) -> ModelSource:
    """Return the model directory when one is set, else the registry alias."""
    if settings.model_dir:
        return DirectorySource(settings.model_dir)
    return RegistrySource(settings.registry_uri, settings.model_name, settings.alias)


def _admission(
    settings: Settings, manager: ModelManager, metrics: ServiceMetrics, executor: Executor
) -> tuple[MicroBatcher, AdmissionGate]:
    """Build the micro-batcher and the admission gate; their target follows the serving SLO."""
    target_s = queue_target_ms(settings, None)[0] / 1000.0
    batcher = MicroBatcher(
        manager,
        executor,
        metrics,
        max_batch_size=settings.max_batch_size,
        max_batch_wait_s=settings.max_batch_wait_ms / 1000.0,
        max_queue=settings.max_queue,
        max_pixels=settings.max_pixels,
        inline_max_s=settings.inline_max_ms / 1000.0,
        queue_delay_target_s=target_s,
    )
    gate = AdmissionGate(
        batcher,
        metrics,
        queue_delay_target_s=target_s,
        max_waiting=settings.max_waiting,
        # At least two full batches in service (one running while the next one gathers); at
        # most what the inference queue holds.
        min_slots=settings.service_slots or 2 * settings.max_batch_size,
        max_slots=settings.service_slots or max(settings.max_queue, settings.max_batch_size),
    )

    def follow(model: LoadedModel) -> None:
        target, why = queue_target_ms(settings, model.latency_slo_ms)
        if target / 1000.0 != gate.queue_delay_target_s:
            logger.info("queueing-delay target %g ms: %s", target, why)
        batcher.queue_delay_target_s = target / 1000.0
        gate.set_target(target / 1000.0)

    manager.on_swap = follow
    return batcher, gate


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Load and warm the model, start the batcher and the alias poller; stop them after."""
    settings: Settings = app.state.settings
    source = make_source(settings)
    manager = ModelManager(source, settings, app.state.metrics)
    # One inference thread: onnxruntime parallelises inside a batch with its own threads.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="burstcv-infer")
    batcher, gate = _admission(settings, manager, app.state.metrics, executor)
    logger.info("loading the model from %s", source.description)
    await manager.refresh()  # a failure leaves the service up but not ready; polling retries
    batcher.start()
    gate.start()
    poller: asyncio.Task[None] | None = None
    if settings.poll_interval_s > 0:
        poller = asyncio.create_task(
            manager.poll_forever(settings.poll_interval_s), name="burstcv-alias-poller"
        )
    app.state.service = ServiceState(manager=manager, batcher=batcher, gate=gate)
    # Everything built so far (the framework, the model, the app) lives as long as the
    # process: keep it out of the collector's full passes, which otherwise stop the event
    # loop for tens of milliseconds under load.
    gc.freeze()
    try:
        yield
    finally:
        app.state.service = None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        await batcher.stop()
        executor.shutdown(wait=True)


_SEND_JSON = "(send a JSON object, as the OpenAPI document at /openapi.json describes)"


def _describe_validation_errors(request: Request, exc: RequestValidationError) -> str:
    multipart = request.url.path.startswith("/v1/predict")  # the admin routes take JSON
    kind = "multipart field" if multipart else "field"
    reasons = []
    whole_body = False  # the body itself is wrong (absent, not JSON, not an object)
    for error in exc.errors():
        invalid_json = error.get("type") == "json_invalid"
        field = (
            "" if invalid_json else ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        )
        whole_body = whole_body or not field
        if invalid_json:
            reasons.append(f"the body is not valid JSON ({error.get('ctx', {}).get('error', '?')})")
        elif error.get("type") == "missing":
            reasons.append(f"missing {kind} '{field}'" if field else "the request has no body")
        else:
            where = f"{kind} '{field}'" if field else "the body"
            reasons.append(f"{where}: {error.get('msg', 'invalid')}")
    detail = "; ".join(reasons) or "invalid request"
    ctype = request.headers.get("content-type", "")
    if multipart and request.method == "POST" and not ctype.startswith("multipart/form-data"):
        detail += f" (send multipart/form-data; the request's content type is {ctype or 'none'})"
    elif not multipart and request.method == "POST" and whole_body:
        detail += f" {_SEND_JSON}"
    return detail


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": _describe_validation_errors(request, exc)}, status_code=422)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Answer FastAPI's own 400 for a body it could not parse (not UTF-8, JSON nested too
    deeply) as the documented 422 every other unreadable body gets, with the reason."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and exc.__cause__ is not None:
        cause = exc.__cause__
        why = type(cause).__name__
        if isinstance(cause, UnicodeDecodeError):
            why = "it is not UTF-8 text"
        elif isinstance(cause, RecursionError):
            why = "it is nested too deeply"
        if request.url.path.startswith("/v1/predict"):
            detail = f"the body could not be read as multipart/form-data ({why})"
        else:
            detail = f"the body is not valid JSON ({why}) {_SEND_JSON}"
        return JSONResponse({"detail": detail}, status_code=422)
    return await http_exception_handler(request, exc)


def _document_string_details(app: FastAPI) -> None:
    """Make the OpenAPI document say what a 422 is: an ``ErrorOut`` (one ``detail`` string),
    not FastAPI's list of errors."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        error_ref = {"$ref": "#/components/schemas/ErrorOut"}
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                if "422" in operation.get("responses", {}):
                    operation["responses"]["422"] = {
                        "description": "The request does not match this endpoint's schema; "
                        "detail says which field and why.",
                        "content": {"application/json": {"schema": error_ref}},
                    }
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.setdefault("ErrorOut", ErrorOut.model_json_schema())
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app from settings (read from the environment when not given); load nothing."""
    settings = settings or Settings()
    service_metrics = ServiceMetrics()
    app = FastAPI(
        title="burstcv prediction service",
        version=__version__,
        description="Classify images with the ONNX model behind a registry alias, on CPU.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = service_metrics
    app.state.service = None
    for module in (predict, model_info, health, metrics, admin):
        app.include_router(module.router)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    _document_string_details(app)
    # Added last = outermost: metrics see every answer, including early 413s and 503s. The
    # body limit comes before admission: a body that is too large would never be served.
    app.add_middleware(
        FastLaneMiddleware,
        handlers={"/v1/predict": predict.predict, "/v1/predict/batch": predict.predict_batch},
    )
    app.add_middleware(
        AdmissionMiddleware,
        paths=PREDICTION_PATHS,
        metrics=service_metrics,
        max_discard_bytes=settings.max_discard_bytes,
    )
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.max_body_bytes,
        max_discard_bytes=settings.max_discard_bytes,
    )
    known_paths = [getattr(route, "path", "") for route in app.routes]
    app.add_middleware(MetricsMiddleware, metrics=service_metrics, paths=known_paths)
    return app


app = create_app()
