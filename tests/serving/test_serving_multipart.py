"""The in-memory multipart parser agrees with Starlette's on any well-formed body, and refuses
malformed ones with a reason (a 422 through the app, never a 500)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from fastapi.testclient import TestClient
from servingkit import image_bytes
from starlette.datastructures import UploadFile
from starlette.requests import Request

from burstcv_serving import multipart


def _encode(
    files: list[tuple[str, tuple[str, bytes, str]]], data: dict[str, str]
) -> tuple[bytes, str]:
    """Return (body, content type) as httpx would send them."""
    request = httpx.Request("POST", "http://x/", files=files, data=data)
    return request.read(), request.headers["content-type"]


def _starlette_parts(body: bytes, ctype: str) -> list[tuple[str, str | None, str, bytes]]:
    """Parse with Starlette + python-multipart, the reference implementation."""

    async def parse() -> list[tuple[str, str | None, str, bytes]]:
        sent = False

        async def receive() -> dict[str, object]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {
            "type": "http",
            "method": "POST",
            "headers": [(b"content-type", ctype.encode("latin-1"))],
        }
        form = await Request(scope, receive).form(max_part_size=10**8)
        parts = []
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                ctype_part = (value.content_type or "").split(";")[0].strip().lower()
                parts.append((name, value.filename, ctype_part, await value.read()))
            else:
                parts.append((name, None, "", value.encode()))
        return parts

    return asyncio.run(parse())


def _ours(body: bytes, ctype: str) -> list[tuple[str, str | None, str, bytes]]:
    boundary = multipart.boundary_of(ctype)
    assert boundary is not None
    return [(p.name, p.filename, p.content_type, p.data) for p in multipart.parse(body, boundary)]


NASTY_NAMES = ["x.png", 'quo"te.png', "semi;colon.png", "späce ü.png", "a\\b.png", ""]


def test_random_bodies_parse_like_starlette() -> None:
    rng = random.Random(7)
    for _ in range(60):
        files = []
        for i in range(rng.randint(1, 4)):
            # Payloads full of CR, LF and dashes: only the exact delimiter may end a part.
            size = rng.choice([0, 1, 17, 300, 5000])
            alphabet = [b"\r", b"\n", b"-", b"--", b"\r\n--", bytes([rng.randrange(256)])]
            data = b"".join(rng.choice(alphabet) for _ in range(size))
            name = rng.choice(NASTY_NAMES) or f"f{i}.bin"
            ctype = rng.choice(["image/png", "application/octet-stream", "text/plain"])
            files.append((rng.choice(["file", "files", "other"]), (name, data, ctype)))
        fields = {"note": "hello; world"} if rng.random() < 0.3 else {}
        body, ctype = _encode(files, fields)

        assert _ours(body, ctype) == _starlette_parts(body, ctype)


def test_preamble_epilogue_and_quoted_boundary() -> None:
    body = (
        b"this preamble is ignored\r\n"
        b'--b:1\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n'
        b"Content-Type: image/png\r\n\r\nPIXELS\r\n--b:1--\r\nepilogue"
    )
    assert _ours(body, 'multipart/form-data; boundary="b:1"') == [
        ("file", "a.png", "image/png", b"PIXELS")
    ]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"no boundary anywhere", "boundary not found"),
        (
            b'--B\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\ncut off',
            "not closed by the boundary",
        ),
        (b'--B\r\nContent-Disposition: form-data; name="file"', "headers never end"),
        (b"--B\r\nno colon here\r\n\r\ndata\r\n--B--", "malformed multipart part header"),
        (b"--B\r\nContent-Type: image/png\r\n\r\ndata\r\n--B--", "no 'Content-Disposition"),
        (b"--Bjunk\r\n\r\ndata\r\n--B--", "trailing data"),
    ],
    ids=["no boundary", "truncated", "endless headers", "bad header", "no disposition", "junk"],
)
def test_malformed_bodies_are_refused_with_a_reason(body: bytes, reason: str) -> None:
    with pytest.raises(multipart.MultipartError, match=reason):
        multipart.parse(body, b"B")


def test_content_type_without_boundary_is_refused() -> None:
    with pytest.raises(multipart.MultipartError, match="without a boundary"):
        multipart.boundary_of("multipart/form-data")
    assert multipart.boundary_of("image/png") is None


def test_the_app_answers_422_for_a_malformed_body(client: TestClient) -> None:
    body, ctype = _encode([("file", ("x.png", image_bytes("PNG"), "image/png"))], {})
    for broken in (body[: len(body) - 10], body.replace(b"Content-Disposition", b"X-Other")):
        response = client.post("/v1/predict", content=broken, headers={"Content-Type": ctype})
        assert response.status_code == 422, response.text
        assert "multipart" in response.json()["detail"]


def test_the_app_reads_a_file_among_other_fields(client: TestClient) -> None:
    files = [
        ("other", ("o.bin", b"\r\n--not-it\r\n", "application/octet-stream")),
        ("file", ('semi;"quoted".png', image_bytes("PNG"), "image/png")),
    ]
    response = client.post("/v1/predict", files=files, data={"note": "x"})
    assert response.status_code == 200, response.text
    assert response.json()["predictions"][0]["index"] == 1
