"""Serve POST /v1/predict and POST /v1/predict/batch: images in, top-k classes out.

The hot path takes the raw request: the body is split by ``burstcv_serving.multipart`` (no
form machinery, no dependency resolution) and the answer serialised straight to JSON bytes;
the models in ``schemas`` still describe both in /openapi.json.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException, Request, Response
from PIL import Image
from starlette.concurrency import run_in_threadpool

from burstcv_serving import multipart
from burstcv_serving.admission import ADMISSION_WAIT, BODY_READ_AT, RETRY_AFTER_S
from burstcv_serving.batcher import DeadlineExceededError, NoModelError, QueueFullError
from burstcv_serving.schemas import BatchPredictionOut, ErrorOut, PredictionOut
from burstcv_serving.settings import Settings
from burstcv_serving.state import get_service, require_model
from burstcv_spec.preprocess import (
    ImageDecodeError,
    ImageTooLargeError,
    PreprocessSpec,
    UnsupportedFormatError,
    decode_to_uint8,
    load_for,
    probe_image,
    to_uint8,
)

router = APIRouter(prefix="/v1", tags=["predict"])

# A request whose images declare at most this many pixels in all is decoded on the event loop:
# a 128x128 PNG decodes in about 0.1 ms, less than the thread-pool round trip would cost.
# Larger ones go to the thread pool so that one big upload cannot stall every other request.
INLINE_DECODE_MAX_PIXELS = 128 * 128

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorOut, "description": "Body, image or file count over the limit."},
    415: {"model": ErrorOut, "description": "Not an image, or an image format not accepted."},
    422: {"model": ErrorOut, "description": "Missing field, or truncated/corrupt image data."},
    503: {
        "model": ErrorOut,
        "description": "No model loaded, or overloaded: the request could not start within the "
        "queueing-delay target (see Retry-After).",
    },
}


def _form_body(field: str, about: str, *, many: bool) -> dict[str, Any]:
    """Return the OpenAPI requestBody of a multipart form with one (or repeated) file field."""
    binary: dict[str, Any] = {"type": "string", "format": "binary"}
    schema = {**({"type": "array", "items": binary} if many else binary), "description": about}
    form = {"type": "object", "required": [field], "properties": {field: schema}}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": form}}}}


def _check_part_type(part: multipart.Part, what: str) -> None:
    """Refuse a part whose declared content type is not an image (octet-stream is allowed)."""
    ctype = part.content_type
    if ctype and not (ctype.startswith("image/") or ctype == "application/octet-stream"):
        raise HTTPException(
            415, detail=f"{what} has content type {ctype}; send a PNG, JPEG or WEBP image"
        )


async def _file_parts(request: Request, field: str) -> list[multipart.Part]:
    """Read the body and return the parts of ``field``; 422 with the reason when unusable."""
    ctype = request.headers.get("content-type", "")
    try:
        boundary = multipart.boundary_of(ctype)
        if boundary is None:
            raise HTTPException(
                422,
                detail=f"missing multipart field '{field}' (send multipart/form-data; the "
                f"request's content type is {ctype or 'none'})",
            )
        body = await request.body()
        request.scope.setdefault("state", {})[BODY_READ_AT] = time.perf_counter()
        parts = multipart.parse(body, boundary)
    except multipart.MultipartError as exc:
        raise HTTPException(422, detail=str(exc)) from exc
    files = [part for part in parts if part.name == field]
    if not files:
        raise HTTPException(422, detail=f"missing multipart field '{field}'")
    if any(part.filename is None for part in files):
        raise HTTPException(
            422,
            detail=f"multipart field '{field}' is a form value, not a file: send the "
            "image as a file part (with a filename)",
        )
    return files


def _decode_probed(probed: list[Image.Image], spec: PreprocessSpec) -> np.ndarray:
    """Decode images whose headers probe_image already checked, at the model's input size."""
    if len(probed) == 1:
        return to_uint8(load_for(probed[0], spec), spec)[None]
    return np.stack([to_uint8(load_for(img, spec), spec) for img in probed])


async def _decode(
    parts: list[multipart.Part], labels: list[str], spec: PreprocessSpec, max_pixels: int
) -> np.ndarray:
    """Decode every part at the model's input size; a 4xx naming the file that fails."""
    for part, label in zip(parts, labels, strict=True):
        _check_part_type(part, label)
    try:
        # Headers only (cheap at any size): they say how much decoding is ahead.
        probed = [probe_image(p.data, max_pixels=max_pixels, formats=spec.formats) for p in parts]
        if sum(img.width * img.height for img in probed) <= INLINE_DECODE_MAX_PIXELS:
            return _decode_probed(probed, spec)
        return await run_in_threadpool(_decode_probed, probed, spec)
    except ImageDecodeError:
        # Name the offending file: decode again one by one (only on the error path).
        for part, label in zip(parts, labels, strict=True):
            try:
                await run_in_threadpool(decode_to_uint8, part.data, spec, max_pixels=max_pixels)
            except UnsupportedFormatError as exc:
                raise HTTPException(415, detail=f"{label}: {exc}") from exc
            except ImageTooLargeError as exc:
                raise HTTPException(413, detail=f"{label}: {exc}") from exc
            except ImageDecodeError as exc:
                raise HTTPException(422, detail=f"{label}: {exc}") from exc
        raise


async def _classify(request: Request, field: str) -> Response:
    """Answer a prediction request whose images come in multipart ``field``, as JSON bytes."""
    started = time.perf_counter()
    service = await get_service(request)
    model = await require_model(service)
    settings: Settings = request.app.state.settings
    many = field == "files"
    with service.batcher.tracking():
        files = await _file_parts(request, field)
        if not many:
            files = files[:1]
            labels = [f"file {files[0].filename!r}" if files[0].filename else "file"]
        elif len(files) > settings.max_batch_files:
            raise HTTPException(
                413,
                detail=f"{len(files)} files sent; the limit is {settings.max_batch_files} "
                "per request",
            )
        else:
            labels = [
                f"file {i} ({f.filename!r})" if f.filename else f"file {i}"
                for i, f in enumerate(files)
            ]
        images = await _decode(files, labels, model.spec, settings.max_pixels)
        waited = request.scope.get("state", {}).get(ADMISSION_WAIT, 0.0)
        try:
            answered_by, probabilities = await service.batcher.submit(
                [part.data for part in files], images, model.spec, waited
            )
        except (QueueFullError, DeadlineExceededError, NoModelError) as exc:
            raise HTTPException(
                503, detail=str(exc), headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from exc
        except ImageDecodeError as exc:  # re-decoding for a new model's input size failed
            raise HTTPException(422, detail=str(exc)) from exc
    rows = [answered_by.top_k(row, settings.top_k) for row in probabilities]
    content: dict[str, Any] = {"version": answered_by.version, "model": answered_by.name}
    if many:
        content["results"] = [
            {"filename": f.filename, "predictions": row} for f, row in zip(files, rows, strict=True)
        ]
    else:
        content["predictions"] = rows[0]
    received_at: float = request.scope.get("state", {}).get("received_at", started)
    content["server_time_ms"] = round((time.perf_counter() - received_at) * 1000.0, 3)
    body = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Response(body.encode(), media_type="application/json")


@router.post(
    "/predict",
    response_model=PredictionOut,
    responses=ERROR_RESPONSES,
    summary="Classify one image",
    openapi_extra=_form_body("file", "the image: PNG, JPEG or WEBP", many=False),
)
async def predict(request: Request) -> Response:
    """Classify one image sent as multipart field ``file``."""
    return await _classify(request, "file")


@router.post(
    "/predict/batch",
    response_model=BatchPredictionOut,
    responses=ERROR_RESPONSES,
    summary="Classify several images with one model version",
    openapi_extra=_form_body("files", "images, one part each, same field", many=True),
)
async def predict_batch(request: Request) -> Response:
    """Classify every image sent as multipart field ``files``, in order."""
    return await _classify(request, "files")
