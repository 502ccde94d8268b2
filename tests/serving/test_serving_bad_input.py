"""Send every kind of bad input and check the 4xx status and a reason a client can act on."""

from __future__ import annotations

import io
import random
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from servingkit import Registry, image_bytes, make_settings, png_header_only

from burstcv_serving.main import create_app

MAX_BODY_BYTES = 200_000
MAX_PIXELS = 1000 * 1000


@pytest.fixture
def strict_client(registry: Registry) -> Iterator[TestClient]:
    """Return a client on a service with small body and pixel limits."""
    settings = make_settings(registry, max_body_bytes=MAX_BODY_BYTES, max_pixels=MAX_PIXELS)
    with TestClient(create_app(settings)) as client:
        yield client


def _truncated_png() -> bytes:
    noisy = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noisy).save(buf, "PNG")
    return buf.getvalue()[: len(buf.getvalue()) // 2]


BAD_FILES = [
    # (case, filename, bytes, content type, status, words the reason must contain)
    ("empty", "e.png", b"", "image/png", 422, "empty file"),
    ("garbage", "g.png", b"\x13\x37" * 500, "image/png", 422, "not an image"),
    ("truncated png", "t.png", _truncated_png(), "image/png", 422, "truncated PNG"),
    ("gif", "a.gif", image_bytes("GIF"), "image/gif", 415, "unsupported image format GIF"),
    ("bmp sent as png", "b.png", image_bytes("BMP"), "image/png", 415, "format BMP"),
    ("text/plain part", "t.txt", b"hello", "text/plain", 415, "content type text/plain"),
    ("bomb 20000x20000", "bomb.png", png_header_only(20000, 20000), "image/png", 413, "bomb"),
    ("over max pixels", "big.png", png_header_only(2000, 2000), "image/png", 413, "limit is"),
]


@pytest.mark.parametrize(
    ("name", "data", "ctype", "status", "reason"),
    [case[1:] for case in BAD_FILES],
    ids=[case[0] for case in BAD_FILES],
)
def test_bad_file_gets_its_status_and_reason(
    strict_client: TestClient, name: str, data: bytes, ctype: str, status: int, reason: str
) -> None:
    response = strict_client.post("/v1/predict", files={"file": (name, data, ctype)})

    assert response.status_code == status, response.text
    assert reason in response.json()["detail"]


def test_body_over_the_limit_is_refused_from_content_length(strict_client: TestClient) -> None:
    big = b"\0" * (MAX_BODY_BYTES + 1)
    response = strict_client.post("/v1/predict", files={"file": ("x.png", big, "image/png")})
    assert response.status_code == 413
    assert f"limit of {MAX_BODY_BYTES} bytes" in response.json()["detail"]


def test_chunked_body_over_the_limit_is_refused_while_reading(strict_client: TestClient) -> None:
    boundary = "burstcvboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.png"\r\n'
        "Content-Type: image/png\r\n\r\n"
    ).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent with chunked encoding
        yield head
        for _ in range(MAX_BODY_BYTES // 10_000 + 5):
            yield b"\1" * 10_000
        yield f"\r\n--{boundary}--\r\n".encode()

    response = strict_client.post(
        "/v1/predict",
        content=chunks(),
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert response.status_code == 413
    assert "larger than the limit" in response.json()["detail"]


def test_missing_file_field_is_422_naming_the_field(strict_client: TestClient) -> None:
    response = strict_client.post(
        "/v1/predict", files={"image": ("x.png", image_bytes("PNG"), "image/png")}
    )
    assert response.status_code == 422
    assert response.json()["detail"] == "missing multipart field 'file'"


def test_raw_body_is_told_to_use_multipart(strict_client: TestClient) -> None:
    response = strict_client.post(
        "/v1/predict", content=image_bytes("PNG"), headers={"Content-Type": "image/png"}
    )
    assert response.status_code == 422
    assert "send multipart/form-data" in response.json()["detail"]


def test_form_field_instead_of_file_is_422(strict_client: TestClient) -> None:
    response = strict_client.post("/v1/predict", data={"file": "not a file"})
    assert response.status_code == 422
    assert "file" in response.json()["detail"]


def test_mutated_images_never_get_a_server_error(strict_client: TestClient) -> None:
    """Flip, cut and splice bytes of valid images: every answer is a 200 or a 4xx."""
    rng = random.Random(1)
    seeds = [image_bytes(fmt, size=(48, 40)) for fmt in ("PNG", "JPEG", "WEBP")]
    seen: set[int] = set()
    for _ in range(150):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 6)):
            position = rng.randrange(len(data))
            if rng.random() < 0.7:
                data[position] = rng.randrange(256)
            else:
                data = data[:position] or data
        response = strict_client.post(
            "/v1/predict", files={"file": ("m", bytes(data), "image/png")}
        )
        assert response.status_code in (200, 413, 415, 422), response.text
        if response.status_code != 200:
            assert response.json()["detail"]
        seen.add(response.status_code)
    assert 422 in seen  # the mutations did produce broken images
