"""Small uploads decode on the event loop, large ones in a thread: both answer the same."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from servingkit import image_bytes

from burstcv_serving.routes.predict import INLINE_DECODE_MAX_PIXELS

SIDE_INLINE = math.isqrt(INLINE_DECODE_MAX_PIXELS)  # exactly at the limit: decoded inline
SIDE_THREAD = SIDE_INLINE + 1  # one pixel row over: decoded in the thread pool


def _truncated_png(side: int) -> bytes:
    noisy = np.random.default_rng(side).integers(0, 255, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noisy).save(buf, "PNG")
    return buf.getvalue()[: len(buf.getvalue()) // 2]


@pytest.mark.parametrize("side", [SIDE_INLINE, SIDE_THREAD], ids=["inline", "thread"])
def test_an_image_on_either_side_of_the_inline_limit_is_classified(
    client: TestClient, side: int
) -> None:
    data = image_bytes("PNG", size=(side, side))

    response = client.post("/v1/predict", files={"file": ("x.png", data, "image/png")})

    assert response.status_code == 200, response.text
    assert response.json()["predictions"][0]["index"] == 1  # version 1's bias wins


@pytest.mark.parametrize("side", [SIDE_INLINE, SIDE_THREAD], ids=["inline", "thread"])
def test_a_truncated_image_on_either_side_of_the_limit_is_422(
    client: TestClient, side: int
) -> None:
    response = client.post(
        "/v1/predict", files={"file": ("t.png", _truncated_png(side), "image/png")}
    )

    assert response.status_code == 422, response.text
    assert "truncated PNG" in response.json()["detail"]


def test_a_batch_over_the_limit_in_total_is_answered_in_order(client: TestClient) -> None:
    side = math.isqrt(INLINE_DECODE_MAX_PIXELS // 2) + 1  # two of these exceed the limit
    files = [
        ("files", (f"{i}.png", image_bytes("PNG", size=(side, side), color=60 * i), "image/png"))
        for i in range(3)
    ]

    response = client.post("/v1/predict/batch", files=files)

    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["filename"] for r in results] == ["0.png", "1.png", "2.png"]
    assert all(r["predictions"][0]["index"] == 1 for r in results)
