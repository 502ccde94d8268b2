"""Find which model version should serve and read its files, from a registry or one directory.

Layout (docs/contracts.md)::

    <registry>/<name>/aliases/<alias>.json     {"version": n, "sha256": "<hex>", ...}
    <registry>/<name>/versions/<n>/model.json  (+ the onnx file it names)

A registry is a local folder or ``s3://bucket/prefix`` (S3 needs boto3, which the service
imports only when it meets an s3:// URI).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse


class SourceError(RuntimeError):
    """Raise when the registry cannot say which version should serve (alias unreadable)."""


@dataclass(frozen=True)
class ModelRef:
    """Name one model version to load: where its files are and the hash it must have."""

    version: int | str
    expected_sha256: str | None  # from the alias; model.json's own sha256 is checked too
    location: str  # the version's directory URI (holds model.json)


class ModelSource(Protocol):
    """Say which model version should serve now."""

    description: str

    def resolve(self) -> ModelRef:
        """Return the version that should serve, or raise SourceError."""
        ...

    def ref_for(self, version: int, sha256: str | None) -> ModelRef:
        """Return where a given version's files are (to stage it), or raise SourceError."""
        ...


def is_s3(uri: str) -> bool:
    """Return True for an ``s3://`` URI."""
    return uri.startswith("s3://")


def join(root: str, *parts: str) -> str:
    """Join path parts onto a local folder or an s3:// prefix."""
    clean = [p.strip("/") for p in parts if p]
    if is_s3(root):
        return "/".join([root.rstrip("/"), *clean])
    return str(Path(root).joinpath(*clean))


def read_bytes(uri: str) -> bytes:
    """Return the bytes at a local path or s3:// URI; raise FileNotFoundError when absent."""
    if not is_s3(uri):
        return Path(uri).read_bytes()
    import boto3  # optional: only an s3:// registry needs it

    parsed = urlparse(uri)
    client = boto3.client("s3")
    try:
        response = client.get_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
    except client.exceptions.NoSuchKey as exc:
        raise FileNotFoundError(uri) from exc
    body: bytes = response["Body"].read()
    return body


def read_json(uri: str) -> dict[str, Any]:
    """Return the JSON object at a URI; raise ValueError when it is not a JSON object."""
    data = json.loads(read_bytes(uri))
    if not isinstance(data, dict):
        raise ValueError(f"{uri} holds {type(data).__name__}, expected a JSON object")
    return data


class RegistrySource:
    """Resolve ``<registry>/<name>/aliases/<alias>.json`` to a version directory."""

    def __init__(self, registry_uri: str, name: str, alias: str) -> None:
        self.registry_uri = registry_uri
        self.name = name
        self.alias = alias
        self.alias_uri = join(registry_uri, name, "aliases", f"{alias}.json")
        self.description = f"alias {alias!r} of model {name!r} in {registry_uri}"

    def resolve(self) -> ModelRef:
        """Read the alias file and return the version it points at."""
        try:
            alias = read_json(self.alias_uri)
        except FileNotFoundError as exc:
            raise SourceError(f"alias file {self.alias_uri} does not exist") from exc
        except (OSError, ValueError) as exc:
            raise SourceError(f"cannot read alias file {self.alias_uri}: {exc}") from exc
        version = alias.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
            raise SourceError(f"alias file {self.alias_uri} has no positive integer 'version'")
        sha = alias.get("sha256")
        return self.ref_for(version, str(sha) if sha else None)

    def ref_for(self, version: int, sha256: str | None) -> ModelRef:
        """Return the registry folder of ``version``, to be checked against ``sha256``."""
        return ModelRef(
            version=version,
            expected_sha256=sha256,
            location=join(self.registry_uri, self.name, "versions", str(version)),
        )


class DirectorySource:
    """Serve the one model directory given (a staging copy of a candidate)."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.description = f"model directory {model_dir}"

    def resolve(self) -> ModelRef:
        """Read model.json's version (or 'candidate') and sha256 from the directory."""
        uri = join(self.model_dir, "model.json")
        try:
            meta = read_json(uri)
        except FileNotFoundError as exc:
            raise SourceError(f"{uri} does not exist") from exc
        except (OSError, ValueError) as exc:
            raise SourceError(f"cannot read {uri}: {exc}") from exc
        version = meta.get("version")
        if not isinstance(version, int | str) or isinstance(version, bool) or version == "":
            version = "candidate"
        sha = meta.get("sha256")
        return ModelRef(
            version=version,
            expected_sha256=str(sha) if sha else None,
            location=self.model_dir,
        )

    def ref_for(self, version: int, sha256: str | None) -> ModelRef:
        """Refuse: this service serves one fixed directory and has no versions to stage."""
        raise SourceError(
            f"this service serves the {self.description}, not a registry alias; "
            f"it cannot stage version {version}"
        )
