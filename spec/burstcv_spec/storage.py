"""Read and write artifacts under a URI root that is either a local folder or ``s3://bucket/prefix``.

Writes are atomic (locally write-then-rename, on S3 a single PUT). boto3 is imported only
for an s3:// URI, so a service image without boto3 serves local registries.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

_UMASK = os.umask(0)
os.umask(_UMASK)


def safe_run_id(run_id: str) -> str:
    """Turn an Airflow run id (with ':' and '+') into a path-safe folder name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)


class ArtifactNotFoundError(FileNotFoundError):
    """Raise when a URI names nothing."""


def is_s3(uri: str) -> bool:
    """Return True for an ``s3://`` URI."""
    return uri.startswith("s3://")


def join(root: str, *parts: str) -> str:
    """Join path parts onto a URI root with '/' (local roots use the OS separator)."""
    clean = [p.strip("/") for p in parts if p]
    if is_s3(root):
        return "/".join([root.rstrip("/"), *clean])
    return str(Path(root).joinpath(*clean))


def _split_s3(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


_CLIENT_LOCK = threading.Lock()


def s3_client() -> Any:
    """Return a boto3 S3 client honouring ``AWS_ENDPOINT_URL[_S3]`` (an emulator in tests)."""
    import boto3

    # boto3's default session may not build two clients at once (validation writes the
    # manifest from a thread while the main thread may upload Data Docs).
    with _CLIENT_LOCK:
        # No endpoint_url here: botocore reads AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL.
        return boto3.client("s3")


def read_bytes(uri: str) -> bytes:
    """Return the bytes at a URI, or raise ArtifactNotFoundError."""
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        client = s3_client()
        try:
            return client.get_object(Bucket=bucket, Key=key)["Body"].read()  # type: ignore[no-any-return]
        except client.exceptions.NoSuchKey as exc:
            raise ArtifactNotFoundError(uri) from exc
    path = Path(uri)
    if not path.is_file():
        raise ArtifactNotFoundError(uri)
    return path.read_bytes()


def write_bytes(uri: str, data: bytes) -> str:
    """Write bytes to a URI atomically and return the URI."""
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        s3_client().put_object(Bucket=bucket, Key=key, Body=data)
        return uri
    _write_local(Path(uri), lambda fh: fh.write(data))
    return uri


# A local write goes to ".<name>.<8 random characters>.tmp" beside its file (mkstemp's names),
# renamed into place once complete: a killed writer leaves only such a file behind.
_PARTIAL_SUFFIX = ".tmp"
_PARTIAL_NAME = re.compile(r"\..+\.[a-z0-9_]{8}" + re.escape(_PARTIAL_SUFFIX))


def _write_local(path: Path, fill: Callable[[IO[bytes]], object]) -> None:
    """Write a local file atomically: ``fill`` writes a temporary file beside it, renamed after."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_PARTIAL_SUFFIX)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are shared like any file
    try:
        with os.fdopen(fd, "wb") as fh:
            fill(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_partial_writes(folder_uri: str) -> list[str]:
    """Remove the temporary files that killed local writes left in a folder; return their paths.

    Only for a folder nothing is writing to now: a write in progress has such a file too.
    """
    if is_s3(folder_uri):
        return []
    folder = Path(folder_uri)
    if not folder.is_dir():
        return []
    removed: list[str] = []
    for path in sorted(folder.glob(f".*{_PARTIAL_SUFFIX}")):
        if _PARTIAL_NAME.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def read_json(uri: str) -> Any:
    """Return the parsed JSON document at a URI."""
    return json.loads(read_bytes(uri))


def read_json_object(uri: str) -> dict[str, Any]:
    """Return the JSON object at a URI; raise ValueError naming the URI when it is not one."""
    data = read_json(uri)
    if not isinstance(data, dict):
        raise ValueError(f"{uri} holds {type(data).__name__}, expected a JSON object")
    return data


def write_json(uri: str, doc: Any) -> str:
    """Write a JSON document (indented, keys sorted) atomically."""
    return write_bytes(uri, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())


_S3_NOT_FOUND = ("404", "NoSuchKey", "NotFound")  # the error codes of a key that is not there


def exists(uri: str) -> bool:
    """Return True if a file exists at the URI."""
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        client = s3_client()
        try:
            client.head_object(Bucket=bucket, Key=key)
        except client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _S3_NOT_FOUND:
                return False
            raise
        return True
    return Path(uri).is_file()


def list_files(prefix: str) -> Iterator[str]:
    """Yield the URIs of every file under a prefix (recursively), sorted."""
    if is_s3(prefix):
        bucket, key = _split_s3(prefix)
        key = key.rstrip("/") + "/" if key else ""
        pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
        keys = sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))
        yield from (f"s3://{bucket}/{k}" for k in keys)
    elif Path(prefix).is_dir():
        yield from map(str, sorted(p for p in Path(prefix).rglob("*") if p.is_file()))


def upload_file(local_path: str | Path, uri: str) -> str:
    """Copy a local file to a URI (streaming on S3, atomic rename locally)."""
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        s3_client().upload_file(str(local_path), bucket, key)
        return uri
    return write_bytes(uri, Path(local_path).read_bytes())


def copy(src_uri: str, dst_uri: str) -> str:
    """Copy a file to another URI of the same store atomically (on S3 a server-side copy)."""
    if is_s3(src_uri) != is_s3(dst_uri):
        raise ValueError(f"copy {src_uri} to {dst_uri}: both local or both on S3")
    if is_s3(src_uri):
        bucket, key = _split_s3(src_uri)
        dst_bucket, dst_key = _split_s3(dst_uri)
        client = s3_client()
        try:  # the managed copy: server-side, in parts past the multipart threshold
            client.copy({"Bucket": bucket, "Key": key}, dst_bucket, dst_key)
        except client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _S3_NOT_FOUND:
                raise ArtifactNotFoundError(src_uri) from exc
            raise
        return dst_uri
    src = Path(src_uri)
    if not src.is_file():
        raise ArtifactNotFoundError(src_uri)
    with src.open("rb") as source:
        _write_local(Path(dst_uri), lambda fh: shutil.copyfileobj(source, fh, 1 << 20))
    return dst_uri


def download_file(uri: str, local_path: str | Path) -> Path:
    """Copy a URI to a local file and return its path."""
    dest = Path(local_path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        s3_client().download_file(bucket, key, str(dest))
    else:
        write_bytes(str(dest), read_bytes(uri))
    return dest


def local_path(uri: str) -> Path:
    """Return the Path for a local URI; refuse s3:// (callers must download instead)."""
    if is_s3(uri):
        raise ValueError(f"{uri} is not a local path")
    return Path(uri)


def sha256_file(path: str | Path) -> str:
    """Return the hex sha256 of a local file, streamed (model files may be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
