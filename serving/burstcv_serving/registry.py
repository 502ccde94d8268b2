"""Find which model version should serve and read its files, from a registry or one directory.

The registry (``burstcv_spec.layout.RegistryLayout``, docs/contracts.md) is a local folder or
``s3://bucket/prefix``, read through ``burstcv_spec.storage``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from burstcv_spec.contracts import (
    AliasRecord,
    Artifact,
    ArtifactError,
    ModelCard,
    RegistryEntry,
    read_artifact,
)
from burstcv_spec.layout import MODEL_CARD, RegistryLayout
from burstcv_spec.storage import join

ArtifactT = TypeVar("ArtifactT", bound=Artifact)


class SourceError(RuntimeError):
    """Raise when the registry cannot say which version should serve (alias unreadable)."""


def read_or_raise(
    uri: str, schema: type[ArtifactT], error: type[Exception], what: str = ""
) -> ArtifactT:
    """Read a JSON artifact; raise ``error`` naming ``what`` file (and field) is unreadable."""
    try:
        return read_artifact(uri, schema)
    except FileNotFoundError as exc:
        raise error(f"{what}{uri} does not exist") from exc
    except ArtifactError as exc:  # names the file and the field
        raise error(f"cannot read {what}{exc}") from exc
    except OSError as exc:
        raise error(f"cannot read {what}{uri}: {exc}") from exc


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

    def ref_for(self, version: int, sha256: str | None) -> ModelRef:
        """Return where a given version's files are (to stage it), or raise SourceError."""

    def recorded_slo_ms(self, ref: ModelRef) -> float | None:
        """Return the latency SLO the gate held this version to, ms, or None if unrecorded."""


class RegistrySource:
    """Resolve ``<registry>/<name>/aliases/<alias>.json`` to a version directory."""

    def __init__(self, registry_uri: str, name: str, alias: str) -> None:
        self.layout = RegistryLayout(registry_uri, name)
        self.alias_uri = self.layout.alias(alias)
        self.description = f"alias {alias!r} of model {name!r} in {registry_uri}"

    def resolve(self) -> ModelRef:
        """Read the alias file and return the version it points at."""
        alias = read_or_raise(self.alias_uri, AliasRecord, SourceError, "alias file ")
        return self.ref_for(alias.version, alias.sha256 or None)

    def ref_for(self, version: int, sha256: str | None) -> ModelRef:
        """Return the registry folder of ``version``, to be checked against ``sha256``."""
        return ModelRef(version, sha256, self.layout.version(version))

    def recorded_slo_ms(self, ref: ModelRef) -> float | None:
        """Read the limit of the gate's latency_p95 check from entry.json; None if there is none
        or it is unreadable (the configured target stays: the model serves the same)."""
        if not isinstance(ref.version, int):
            return None
        try:
            entry = read_artifact(self.layout.entry(ref.version), RegistryEntry)
        except (ArtifactError, OSError):
            return None
        checks = entry.gate.checks if entry.gate is not None else []
        limits = [c.limit for c in checks if c.name == "latency_p95" and c.limit > 0]
        return limits[0] if limits else None


class DirectorySource:
    """Serve the one model directory given (a staging copy of a candidate)."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.description = f"model directory {model_dir}"

    def resolve(self) -> ModelRef:
        """Read model.json's version (or 'candidate') and sha256 from the directory."""
        card = read_or_raise(join(self.model_dir, MODEL_CARD), ModelCard, SourceError)
        return ModelRef(
            version="candidate" if card.version is None else card.version,
            expected_sha256=card.sha256,
            location=self.model_dir,
        )

    def recorded_slo_ms(self, ref: ModelRef) -> float | None:
        """Return None: a model directory has no registry entry (its service is configured)."""
        return None

    def ref_for(self, version: int, sha256: str | None) -> ModelRef:
        """Refuse: this service serves one fixed directory and has no versions to stage."""
        raise SourceError(
            f"this service serves the {self.description}, not a registry alias; "
            f"it cannot stage version {version}"
        )
