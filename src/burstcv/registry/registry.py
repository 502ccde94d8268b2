"""Keep numbered, immutable model versions and the aliases that point at them.

Layout (docs/contracts.md): ``<root>/<model>/versions/<n>/{model.onnx, model.json, entry.json}``
and ``<root>/<model>/aliases/<alias>.json``. A version number is claimed by creating its folder
exclusively (``mkdir`` locally, a conditional PUT on S3), so two concurrent registrations never
share one; aliases move under a lock (locally ``flock``, on S3 a lease object taken with
conditional PUTs), written whole (rename locally, one PUT on S3), so a reader never sees a
half-written alias.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from burstcv import lineage, storage

log = logging.getLogger(__name__)

PRODUCTION = "production"
PREVIOUS = "previous"
S3_LEASE_S = 60.0  # an S3 alias lock older than this belongs to a dead writer
S3_LOCK_WAIT_S = 120.0
_CONDITION_FAILED = ("PreconditionFailed", "ConditionalRequestConflict")


class RegistryError(RuntimeError):
    """Raise when the registry cannot do what was asked (unknown version, no previous, ...)."""


@dataclass(frozen=True)
class Alias:
    """Point an alias at a version (with the sha256 of its ONNX file)."""

    version: int
    sha256: str
    updated_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form stored in aliases/<name>.json."""
        return {"version": self.version, "sha256": self.sha256, "updated_at": self.updated_at}


class Registry:
    """Register versions of one model and move its aliases safely."""

    def __init__(self, root_uri: str, model_name: str) -> None:
        if not model_name or "/" in model_name:
            raise RegistryError(f"invalid model name {model_name!r}")
        self.root = storage.join(root_uri, model_name)
        self.model_name = model_name

    # -- paths -----------------------------------------------------------------------------
    def version_uri(self, version: int, *parts: str) -> str:
        """Return the URI of a version folder or a file inside it."""
        return storage.join(self.root, "versions", str(version), *parts)

    def alias_uri(self, alias: str) -> str:
        """Return the URI of an alias file."""
        return storage.join(self.root, "aliases", f"{alias}.json")

    # -- versions --------------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Return every registered version number, ascending."""
        found: set[int] = set()
        prefix = storage.join(self.root, "versions")
        for uri in storage.list_files(prefix):
            rel = uri[len(prefix) :].lstrip("/").split("/")
            if rel and rel[0].isdigit() and rel[-1] == "entry.json":
                found.add(int(rel[0]))
        return sorted(found)

    def entry(self, version: int) -> dict[str, Any]:
        """Return a version's entry.json (gate verdict, figures, lineage, status)."""
        try:
            return storage.read_json(self.version_uri(version, "entry.json"))  # type: ignore[no-any-return]
        except storage.ArtifactNotFoundError as exc:
            raise RegistryError(f"{self.model_name} has no version {version}") from exc

    def model_json(self, version: int) -> dict[str, Any]:
        """Return a version's model.json."""
        return storage.read_json(self.version_uri(version, "model.json"))  # type: ignore[no-any-return]

    def register(self, model_dir_uri: str, entry: dict[str, Any]) -> int:
        """Copy model.onnx + model.json from a run into a new version; return its number."""
        model_json = storage.read_json(storage.join(model_dir_uri, "model.json"))
        onnx_file = model_json.get("onnx_file", "model.onnx")
        onnx_bytes = storage.read_bytes(storage.join(model_dir_uri, onnx_file))
        version = self._claim_version()
        model_json["version"] = version
        storage.write_bytes(self.version_uri(version, onnx_file), onnx_bytes)
        storage.write_json(self.version_uri(version, "model.json"), model_json)
        full_entry = {
            **entry,
            "version": version,
            "model": self.model_name,
            "sha256": model_json["sha256"],
            "registered_at": lineage.utc_now_iso(),
            "lineage": {
                "run_id": model_json.get("run_id", ""),
                "dataset_fingerprint": model_json.get("dataset_fingerprint", ""),
                "source_commit": model_json.get("source_commit", ""),
            },
        }
        # entry.json is written last: a version without it is incomplete and never listed.
        storage.write_json(self.version_uri(version, "entry.json"), full_entry)
        log.info("registered %s version %d (%s)", self.model_name, version, entry.get("status"))
        return version

    def _claim_version(self) -> int:
        for _ in range(1000):
            existing = self._claimed_numbers()
            version = (max(existing) if existing else 0) + 1
            if self._try_claim(version):
                return version
        raise RegistryError("could not claim a version number after 1000 tries")

    def _claimed_numbers(self) -> list[int]:
        prefix = storage.join(self.root, "versions")
        if storage.is_s3(prefix):
            nums = set()
            for uri in storage.list_files(prefix):
                head = uri[len(prefix) :].lstrip("/").split("/")[0]
                if head.isdigit():
                    nums.add(int(head))
            return sorted(nums)
        path = Path(prefix)
        return (
            sorted(int(p.name) for p in path.iterdir() if p.name.isdigit()) if path.is_dir() else []
        )

    def _try_claim(self, version: int) -> bool:
        uri = self.version_uri(version, ".claim")
        if storage.is_s3(uri):
            bucket, _, key = uri[5:].partition("/")
            client = storage.s3_client()
            try:
                client.put_object(Bucket=bucket, Key=key, Body=b"", IfNoneMatch="*")
            except client.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in _CONDITION_FAILED:
                    return False
                raise
            return True
        folder = Path(self.version_uri(version))
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir()
        except FileExistsError:
            return False
        return True

    # -- aliases ---------------------------------------------------------------------------
    def get_alias(self, alias: str) -> Alias | None:
        """Return where an alias points, or None if it was never set."""
        try:
            data = storage.read_json(self.alias_uri(alias))
        except storage.ArtifactNotFoundError:
            return None
        return Alias(int(data["version"]), str(data["sha256"]), str(data.get("updated_at", "")))

    @contextlib.contextmanager
    def _alias_lock(self) -> Iterator[None]:
        if storage.is_s3(self.root):
            with self._s3_lease():
                yield
            return
        lock_path = Path(self.root) / "aliases" / ".lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _s3_lease(self) -> Iterator[None]:
        """Hold aliases/.lock on S3: created with a conditional PUT (If-None-Match: *).

        A lease older than S3_LEASE_S (its holder died) is taken over with a PUT conditional
        on the stale lease's ETag, so two waiters can never both take it.
        """
        bucket, _, key = storage.join(self.root, "aliases", ".lock")[5:].partition("/")
        client = storage.s3_client()
        body = json.dumps({"owner": uuid.uuid4().hex, "at": time.time()}).encode()
        deadline = time.monotonic() + S3_LOCK_WAIT_S
        while True:
            try:
                client.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
                break
            except client.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in _CONDITION_FAILED:
                    raise
            try:
                held = client.get_object(Bucket=bucket, Key=key)
            except client.exceptions.NoSuchKey:
                continue  # released between our two calls: try again at once
            lease = json.loads(held["Body"].read() or b"{}")
            if time.time() - float(lease.get("at", 0)) > S3_LEASE_S:
                try:
                    client.put_object(Bucket=bucket, Key=key, Body=body, IfMatch=held["ETag"])
                    log.warning("took over a stale registry lease of %s", lease.get("owner"))
                    break
                except client.exceptions.ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") not in _CONDITION_FAILED:
                        raise
            if time.monotonic() > deadline:
                raise RegistryError(f"s3://{bucket}/{key} stayed locked for {S3_LOCK_WAIT_S}s")
            time.sleep(0.05)
        try:
            yield
        finally:
            client.delete_object(Bucket=bucket, Key=key)

    def _write_alias(self, alias: str, version: int) -> Alias:
        sha = self.model_json(version)["sha256"]
        value = Alias(version, sha, lineage.utc_now_iso())
        storage.write_json(self.alias_uri(alias), value.to_dict())
        return value

    def promote(self, version: int, *, force: bool = False) -> Alias | None:
        """Point production at a version and previous at what production was; return the old one.

        A version the gate rejected is refused unless ``force`` (an operator's explicit call).
        """
        entry = self.entry(version)
        if entry.get("status") == "rejected" and not force:
            raise RegistryError(
                f"version {version} was rejected by the gate: {entry.get('reason')}"
            )
        with self._alias_lock():
            old = self.get_alias(PRODUCTION)
            if old is not None and old.version == version:
                return old
            if old is not None:
                self._write_alias(PREVIOUS, old.version)
            self._write_alias(PRODUCTION, version)
        log.info("%s production: %s -> %d", self.model_name, old.version if old else None, version)
        return old

    def set_production(self, version: int) -> None:
        """Point production at a version without touching previous (used to undo a deploy)."""
        with self._alias_lock():
            self._write_alias(PRODUCTION, version)

    def restore_aliases(self, production: Alias | None, previous: Alias | None) -> None:
        """Put both aliases back exactly as they were (after a failed deploy)."""
        with self._alias_lock():
            for name, value in ((PRODUCTION, production), (PREVIOUS, previous)):
                if value is None:
                    if storage.is_s3(self.alias_uri(name)):
                        bucket, _, key = self.alias_uri(name)[5:].partition("/")
                        storage.s3_client().delete_object(Bucket=bucket, Key=key)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self.alias_uri(name))
                else:
                    storage.write_json(self.alias_uri(name), value.to_dict())

    def rollback(self) -> tuple[int, int]:
        """Swap production and previous; return (from_version, to_version)."""
        with self._alias_lock():
            current, previous = self.get_alias(PRODUCTION), self.get_alias(PREVIOUS)
            if previous is None or current is None:
                raise RegistryError(f"{self.model_name} has no previous version to roll back to")
            self._write_alias(PRODUCTION, previous.version)
            self._write_alias(PREVIOUS, current.version)
        return current.version, previous.version
