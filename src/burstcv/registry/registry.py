"""Keep numbered, immutable model versions and the aliases that point at them.

A version number is claimed by creating its folder exclusively (``mkdir``, or a conditional
PUT on S3). Aliases move under a lock (``flock``, or an S3 lease object), written whole, by
compare-and-swap: a write names the version it replaces and fails (AliasConflictError) when
the alias holds anything else; on S3 the PUT is conditional on the ETag read, so even a writer
whose lease was taken over cannot lose another's move. Every move, refusal and conflict is
appended to ``history/``, one JSON file per event.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from burstcv import lineage
from burstcv_spec import layout, storage
from burstcv_spec.contracts import (
    AliasRecord,
    ArtifactError,
    HistoryEvent,
    Lineage,
    ModelCard,
    RegistryDecision,
    RegistryEntry,
    parse_artifact,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import MODEL_CARD, RegistryLayout

log = logging.getLogger(__name__)

PRODUCTION = layout.PRODUCTION
PREVIOUS = layout.PREVIOUS
S3_LEASE_S = 60.0  # an S3 alias lock older than this belongs to a dead writer
S3_LOCK_WAIT_S = 120.0
_CONDITION_FAILED = ("PreconditionFailed", "ConditionalRequestConflict")
DEFAULT_ACTOR = "api"


class RegistryError(RuntimeError):
    """Raise when the registry cannot do what was asked (unknown version, no previous, ...)."""


class RejectedVersionError(RegistryError):
    """Raise when a version the gate rejected is to be promoted without force."""


class AliasConflictError(RegistryError):
    """Raise when an alias no longer holds the version a write expected to replace."""

    def __init__(self, alias: str, expected: int | None, found: int | None) -> None:
        self.alias, self.expected, self.found = alias, expected, found
        super().__init__(
            f"{alias} holds {version_name(found)}, not {version_name(expected)}: it was moved "
            "meanwhile, so it was left alone"
        )


class Current:
    """Say "whatever the alias holds when the lock is taken" (the default expectation)."""


CURRENT = Current()


class Registry:
    """Register versions of one model and move its aliases safely."""

    def __init__(self, root_uri: str, model_name: str) -> None:
        if not model_name or "/" in model_name:
            raise RegistryError(f"invalid model name {model_name!r}")
        self.layout = RegistryLayout(root_uri, model_name)
        self.root = self.layout.root
        self.model_name = model_name

    def version_uri(self, version: int, *parts: str) -> str:
        """Return the URI of a version folder or a file inside it."""
        return self.layout.version(version, *parts)

    def alias_uri(self, alias: str) -> str:
        """Return the URI of an alias file."""
        return self.layout.alias(alias)

    def _listed(self) -> list[list[str]]:
        prefix = self.layout.versions
        return [uri[len(prefix) :].lstrip("/").split("/") for uri in storage.list_files(prefix)]

    def versions(self) -> list[int]:
        """Return every registered version number (one with its entry.json), ascending."""
        return sorted(
            {int(r[0]) for r in self._listed() if r[0].isdigit() and r[-1] == "entry.json"}
        )

    def entry(self, version: int) -> RegistryEntry:
        """Return a version's entry.json (gate verdict, figures, lineage, status)."""
        try:
            return read_artifact(self.layout.entry(version), RegistryEntry)
        except storage.ArtifactNotFoundError as exc:
            raise RegistryError(f"{self.model_name} has no version {version}") from exc

    def model_card(self, version: int) -> ModelCard:
        """Return a version's model.json."""
        return read_artifact(self.layout.model_card(version), ModelCard)

    def register(
        self, model_dir_uri: str, decision: RegistryDecision, *, dataset_uri: str = ""
    ) -> int:
        """Copy model.onnx + model.json from a run into a new version; return its number."""
        card = read_artifact(storage.join(model_dir_uri, MODEL_CARD), ModelCard)
        onnx_bytes = storage.read_bytes(storage.join(model_dir_uri, card.onnx_file))
        version = self._claim_version()
        storage.write_bytes(self.version_uri(version, card.onnx_file), onnx_bytes)
        registered = card.model_copy(update={"version": version})
        write_artifact(self.layout.model_card(version), registered)
        entry = RegistryEntry(
            **dict(decision),
            version=version,
            model=self.model_name,
            sha256=card.sha256,
            registered_at=lineage.utc_now_iso(),
            lineage=Lineage(
                run_id=card.run_id,
                dataset_fingerprint=card.dataset_fingerprint,
                source_commit=card.source_commit,
                dataset_uri=dataset_uri,
            ),
        )
        # entry.json is written last: a version without it is incomplete and never listed.
        write_artifact(self.layout.entry(version), entry)
        log.info("registered %s version %d (%s)", self.model_name, version, entry.status)
        return version

    def _claim_version(self) -> int:
        for _ in range(1000):
            existing = self._claimed_numbers()
            version = (max(existing) if existing else 0) + 1
            if self._try_claim(version):
                return version
        raise RegistryError("could not claim a version number after 1000 tries")

    def _claimed_numbers(self) -> list[int]:
        path = Path(self.layout.versions)  # locally a claimed folder may hold no file yet
        if storage.is_s3(self.layout.versions):
            names = [rel[0] for rel in self._listed()]
        else:
            names = [p.name for p in path.iterdir()] if path.is_dir() else []
        return sorted({int(name) for name in names if name.isdigit()})

    def _try_claim(self, version: int) -> bool:
        uri = self.version_uri(version, ".claim")
        if storage.is_s3(uri):
            return _s3_conditional(storage.s3_client(), uri, b"", IfNoneMatch="*")
        folder = Path(self.version_uri(version))
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir()
        except FileExistsError:
            return False
        return True

    def get_alias(self, alias: str) -> AliasRecord | None:
        """Return where an alias points, or None if it was never set."""
        return _read_alias(self.alias_uri(alias))[0]

    @contextlib.contextmanager
    def aliases_locked(self, actor: str = DEFAULT_ACTOR) -> Iterator[AliasWriter]:
        """Hold the alias lock; yield the one object that may move aliases meanwhile."""
        with self._alias_lock():
            yield AliasWriter(self, actor)

    @contextlib.contextmanager
    def _alias_lock(self) -> Iterator[None]:
        if storage.is_s3(self.root):
            with self._s3_lease():
                yield
            return
        lock_path = Path(self.layout.alias_lock)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _s3_lease(self) -> Iterator[None]:
        """Hold aliases/.lock on S3, created by a PUT with If-None-Match: *; a lease older than
        S3_LEASE_S is taken over by a PUT conditional on its ETag, so only one waiter wins."""
        uri = self.layout.alias_lock
        bucket, _, key = uri[5:].partition("/")
        client = storage.s3_client()
        body = json.dumps({"owner": uuid.uuid4().hex, "at": time.time()}).encode()
        deadline = time.monotonic() + S3_LOCK_WAIT_S
        while not _s3_conditional(client, uri, body, IfNoneMatch="*"):
            try:
                held = client.get_object(Bucket=bucket, Key=key)
            except client.exceptions.NoSuchKey:
                continue  # released between our two calls: try again at once
            lease = json.loads(held["Body"].read() or b"{}")
            stale = time.time() - float(lease.get("at", 0)) > S3_LEASE_S
            if stale and _s3_conditional(client, uri, body, IfMatch=held["ETag"]):
                log.warning("took over a stale registry lease of %s", lease.get("owner"))
                break
            if time.monotonic() > deadline:
                raise RegistryError(f"s3://{bucket}/{key} stayed locked for {S3_LOCK_WAIT_S}s")
            time.sleep(0.05)
        try:
            yield
        finally:
            client.delete_object(Bucket=bucket, Key=key)

    def check_promotable(self, version: int, *, force: bool = False) -> RegistryEntry:
        """Return a version's entry; raise RegistryError if the gate rejected it (unless forced)."""
        entry = self.entry(version)
        if entry.status == "rejected" and not force:
            raise RejectedVersionError(
                f"version {version} was rejected by the gate: {entry.reason}"
            )
        return entry

    def promote(
        self,
        version: int,
        *,
        force: bool = False,
        expect: int | Current | None = CURRENT,
        actor: str = DEFAULT_ACTOR,
    ) -> AliasRecord | None:
        """Point production at a version and previous at what production was; return the old one.

        ``expect``: the version production must still hold (None: unset).
        """
        self.check_promotable(version, force=force)
        with self.aliases_locked(actor) as aliases:
            return aliases.promote(version, expect=expect)

    def rollback(
        self, *, expect: int | Current | None = CURRENT, actor: str = DEFAULT_ACTOR
    ) -> tuple[int, int]:
        """Swap production and previous; return (from_version, to_version)."""
        with self.aliases_locked(actor) as aliases:
            current, previous = aliases.read(PRODUCTION), aliases.read(PREVIOUS)
            if previous is None or current is None:
                raise RegistryError(f"{self.model_name} has no previous version to roll back to")
            aliases.promote(previous.version, expect=expect, action="rollback")
        return current.version, previous.version

    def record(
        self,
        *,
        actor: str,
        action: str,
        alias: str,
        from_version: int | None,
        to_version: int | None,
        result: str,
        detail: str = "",
    ) -> HistoryEvent:
        """Append one event to the alias history and return it (its own file, named by its
        time: appending never rewrites, or races on, a shared log)."""
        event = HistoryEvent(
            at=lineage.utc_now_iso(),
            actor=actor,
            action=action,
            alias=alias,
            from_version=from_version,
            to_version=to_version,
            result=result,
            detail=" ".join(detail.split()),
        )
        name = f"{_monotonic_ns():020d}-{uuid.uuid4().hex[:8]}.json"
        write_artifact(storage.join(self.layout.history, name), event)
        return event

    def history(self, limit: int | None = None) -> list[HistoryEvent]:
        """Return the alias history, oldest first (only the newest ``limit`` events if given)."""
        uris = [u for u in storage.list_files(self.layout.history) if u.endswith(".json")]
        if limit is not None:
            uris = uris[-limit:] if limit > 0 else []
        events = []
        for uri in uris:
            try:
                events.append(read_artifact(uri, HistoryEvent))
            except (storage.ArtifactNotFoundError, ArtifactError) as exc:
                raise RegistryError(f"unreadable history event {uri}: {exc}") from exc
        return events


class AliasWriter:
    """Move aliases while the registry's alias lock is held: compare-and-swap, recorded."""

    def __init__(self, registry: Registry, actor: str) -> None:
        self.registry = registry
        self.actor = actor

    def read(self, alias: str) -> AliasRecord | None:
        """Return where an alias points now."""
        return self.registry.get_alias(alias)

    def swap(
        self, alias: str, *, expect: int | None, version: int | None, action: str
    ) -> AliasRecord | None:
        """Point ``alias`` at ``version`` (None: remove it) only if it still holds ``expect``,
        else record the conflict and raise AliasConflictError."""
        uri = self.registry.alias_uri(alias)
        current, etag = _read_alias(uri)
        found = current.version if current else None
        value = (
            None
            if version is None
            else AliasRecord(
                version=version,
                sha256=self.registry.model_card(version).sha256,
                updated_at=lineage.utc_now_iso(),
                updated_by=self.actor,
            )
        )
        conflict = found != expect or not _conditional_write(uri, value, etag)
        if conflict and found == expect:  # the conditional write lost: read what won
            now = self.registry.get_alias(alias)
            found = now.version if now else None
        held = f"{alias} holds {version_name(found)}, not {version_name(expect)}"
        self.registry.record(
            actor=self.actor,
            action=action,
            alias=alias,
            from_version=expect,
            to_version=version,
            result="conflict" if conflict else "moved",
            detail=held if conflict else "",
        )
        if conflict:
            raise AliasConflictError(alias, expect, found)
        return value

    def promote(
        self, version: int, *, expect: int | Current | None = CURRENT, action: str = "promote"
    ) -> AliasRecord | None:
        """Point production at ``version`` and previous at what production held; return that
        (nothing moves if production already holds ``version``)."""
        old = self.read(PRODUCTION)
        old_version = old.version if old else None
        if not isinstance(expect, Current) and old_version != expect:
            self.swap(PRODUCTION, expect=expect, version=version, action=action)  # records, raises
        if old_version == version:
            return old
        self.swap(PRODUCTION, expect=old_version, version=version, action=action)
        if old is not None:
            before = self.read(PREVIOUS)
            self.swap(
                PREVIOUS,
                expect=before.version if before else None,
                version=old.version,
                action=action,
            )
        log.info("%s production: %s -> %d", self.registry.model_name, old_version, version)
        return old

    def undo(
        self, wrote: int, *, production: AliasRecord | None, previous: AliasRecord | None
    ) -> bool:
        """Put production (and previous) back as they were, only if production still holds
        ``wrote``; return False, leaving the newer state alone, when something moved it since.
        """
        current = self.read(PRODUCTION)
        if current is None or current.version != wrote:
            self.registry.record(
                actor=self.actor,
                action="restore",
                alias=PRODUCTION,
                from_version=wrote,
                to_version=production.version if production else None,
                result="left",
                detail=(
                    f"production holds {version_name(current.version if current else None)}, not "
                    f"{wrote}: a newer move was left alone"
                ),
            )
            return False
        self.swap(
            PRODUCTION,
            expect=wrote,
            version=production.version if production else None,
            action="restore",
        )
        now_previous = self.read(PREVIOUS)
        if production is not None and now_previous and now_previous.version == production.version:
            self.swap(
                PREVIOUS,
                expect=production.version,
                version=previous.version if previous else None,
                action="restore",
            )
        return True


def version_name(version: int | None) -> str:
    """Return "version <n>", or "nothing" for None (an alias that was never set)."""
    return "nothing" if version is None else f"version {version}"


_last_ns = 0
_ns_lock = threading.Lock()


def _monotonic_ns() -> int:
    """Return wall-clock nanoseconds, strictly increasing within this process."""
    global _last_ns
    with _ns_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


def _read_alias(uri: str) -> tuple[AliasRecord | None, str | None]:
    """Return an alias file's value and, on S3, the ETag a conditional write must match."""
    if storage.is_s3(uri):
        bucket, _, key = uri[5:].partition("/")
        client = storage.s3_client()
        try:
            response = client.get_object(Bucket=bucket, Key=key)
        except client.exceptions.NoSuchKey:
            return None, None
        etag: str | None = str(response["ETag"])
        body = response["Body"].read()
    else:
        try:
            body, etag = storage.read_bytes(uri), None
        except storage.ArtifactNotFoundError:
            return None, None
    try:
        record = parse_artifact(json.loads(body), AliasRecord, uri)
    except ValueError as exc:  # ArtifactError, or not JSON at all
        raise RegistryError(f"alias file {uri} is malformed: {exc}") from exc
    return record, etag


def _conditional_write(uri: str, value: AliasRecord | None, etag: str | None) -> bool:
    """Write (or remove, for None) an alias file; on S3 only if it is still ``etag`` (None:
    absent). Return False when the condition failed; locally the flock excludes other writers.
    """
    if not storage.is_s3(uri):
        if value is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(uri)
        else:
            write_artifact(uri, value)
        return True
    if value is None and etag is None:
        return True  # nothing to remove
    body = None
    if value is not None:
        doc = value.model_dump(mode="json", by_alias=True)
        body = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
    return _s3_conditional(storage.s3_client(), uri, body, **condition)


def _s3_conditional(client: Any, uri: str, body: bytes | None, **condition: str) -> bool:
    """PUT ``body`` (None: DELETE) at an S3 URI only while ``condition`` holds; return if it did."""
    bucket, _, key = uri[5:].partition("/")
    try:
        if body is None:
            client.delete_object(Bucket=bucket, Key=key, **condition)
        else:
            client.put_object(Bucket=bucket, Key=key, Body=body, **condition)
    except client.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in _CONDITION_FAILED:
            return False
        raise
    return True
