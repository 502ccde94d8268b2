"""Every answer is the one the OpenAPI document promises, for malformed requests too.

A small schema-driven fuzzer: for each operation the document lists, requests whose bodies
break the declared schema in the usual ways (wrong types, missing and extra fields, values out
of range, not JSON at all), with the admin token. Each answer's status must be documented for
that operation and its body must validate against the documented schema.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from jsonschema import Draft202012Validator

ADMIN = {"Authorization": "Bearer dev-token"}

# Bodies that break a JSON object schema in the ways a client gets wrong (sent raw).
MALFORMED_JSON = [
    b"",
    b"not json",
    b"{",
    b"null",
    b"[]",
    b"[1, 2]",
    b'"version"',
    b"{}",
    b'{"version": "one"}',
    b'{"version": 1.5}',
    b'{"version": -3}',
    b'{"version": 0}',
    b'{"version": true}',
    b'{"version": null}',
    b'{"version": [1]}',
    b'{"version": {"n": 1}}',
    b'{"version": 1, "sha256": "not-hex"}',
    b'{"version": 1, "sha256": 7}',
    b'{"version": 99999999999999999999999999}',
    b'{"versoin": 1}',
    json.dumps({"version": {"a": {"b": {"c": [1] * 50}}}}).encode(),
    b'{"version": "\xff"}',  # not UTF-8
    b"[" * 100_000,  # past the JSON parser's depth
]


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method.upper(), path, operation)
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
        if method in {"get", "post", "put", "patch", "delete"}
    ]


def _check(document: dict[str, Any], operation: dict[str, Any], answer: Any, what: str) -> None:
    status = str(answer.status_code)
    responses = operation["responses"]
    assert status in responses, f"{what}: status {status} is not documented ({sorted(responses)})"
    content = responses[status].get("content", {}).get("application/json")
    if content is None or "schema" not in content:
        return
    schema = {**content["schema"], "components": document["components"]}
    errors = sorted(Draft202012Validator(schema).iter_errors(answer.json()), key=str)
    assert not errors, f"{what}: {status} body {answer.text[:200]} breaks its schema: {errors[0]}"


def test_the_document_describes_a_422_as_one_detail_string(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(document)
    documented = [
        op["responses"]["422"] for _, _, op in _operations(document) if "422" in op["responses"]
    ]
    assert documented, "no operation documents its 422"
    for response in documented:
        assert response["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorOut"
        }


@pytest.mark.parametrize(
    "body", MALFORMED_JSON, ids=lambda b: b.decode(errors="replace")[:30] or "empty"
)
def test_json_operations_answer_malformed_bodies_within_their_schema(
    client: TestClient, body: bytes
) -> None:
    document = client.get("/openapi.json").json()
    json_operations = [
        (method, path, op)
        for method, path, op in _operations(document)
        if "application/json" in op.get("requestBody", {}).get("content", {})
    ]
    assert json_operations, "no operation takes a JSON body"
    for method, path, operation in json_operations:
        answer = client.request(
            method, path, content=body, headers={**ADMIN, "Content-Type": "application/json"}
        )
        what = f"{method} {path} {body[:40]!r}"
        _check(document, operation, answer, what)
        assert answer.status_code < 500, what
        if answer.status_code == 422:
            detail = answer.json()["detail"]
            assert isinstance(detail, str) and detail, what
            assert "multipart" not in detail, f"{what}: a JSON endpoint told to send multipart"


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/json", b'{"image": "x"}'),
        ("text/plain", b"hello"),
        ("multipart/form-data; boundary=x", b"--x\r\nbroken"),
        (None, b""),
    ],
)
def test_every_post_answers_a_wrong_body_within_its_schema(
    client: TestClient, content_type: str | None, body: bytes
) -> None:
    document = client.get("/openapi.json").json()
    headers = dict(ADMIN)
    if content_type is not None:
        headers["Content-Type"] = content_type
    for method, path, operation in _operations(document):
        if method != "POST" or "{" in path:
            continue
        answer = client.request(method, path, content=body, headers=headers)
        what = f"{method} {path} ({content_type}) {body[:30]!r}"
        assert answer.status_code < 500, what
        _check(document, operation, answer, what)


@pytest.mark.parametrize(
    ("body", "why"),
    [(b'{"version": "\xff"}', "not UTF-8 text"), (b"[" * 100_000, "nested too deeply")],
)
def test_a_body_the_parser_cannot_read_is_a_422_that_says_why(
    client: TestClient, body: bytes, why: str
) -> None:
    answer = client.post(
        "/v1/admin/stage", content=body, headers={**ADMIN, "Content-Type": "application/json"}
    )
    assert answer.status_code == 422
    assert answer.json()["detail"].startswith(f"the body is not valid JSON (it is {why})")
