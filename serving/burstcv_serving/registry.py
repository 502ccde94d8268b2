"""Find which model version should serve and read its files, from a registry or one directory.

Layout (docs/contracts.md)::

    <registry>/<name>/aliases/<alias>.json     {"version": n, "sha256": "<hex>", ...}
    <registry>/<name>/versions/<n>/model.json  (+ the onnx file it names)

A registry is a local folder or ``s3://bucket/prefix``, read through ``burstcv_spec.storage``
(S3 needs boto3, which is imported only when an s3:// URI is met).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from burstcv_spec.storage import join, read_json_object


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
            alias = read_json_object(self.alias_uri)
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
            meta = read_json_object(uri)
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
