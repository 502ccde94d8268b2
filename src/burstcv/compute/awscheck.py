"""Check an AWS account is ready for burstcv without renting anything: ``burstcv aws check``.

Every check is free: launches are dry runs, the backstop schedule is created disabled and
deleted at once, and the S3 checks write, read, list and delete one small probe object under
the prefixes the pipeline writes (the run folders and the registry's aliases).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError

from burstcv.compute.base import LaunchRequest
from burstcv.compute.ec2 import Ec2Backend
from burstcv.settings import Ec2Settings, Settings
from burstcv_spec import storage

log = logging.getLogger(__name__)

PROBE_BODY = b"burstcv aws check probe: safe to delete\n"


@dataclass(frozen=True)
class Finding:
    """Say whether one thing burstcv needs is in place, and what to do if not."""

    name: str
    missing: str = ""  # empty: in place

    @property
    def ok(self) -> bool:
        """Return whether nothing is missing."""
        return not self.missing

    def line(self) -> str:
        """Return the one line the CLI prints."""
        return f"ok       {self.name}" if self.ok else f"MISSING  {self.name}: {self.missing}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        message = str(error.get("Message", "")).splitlines()[:1]
        return f"{error.get('Code', '?')}: {message[0] if message else ''}"
    return f"{type(exc).__name__}: {exc}"


def check_s3_prefix(label: str, prefix: str) -> list[Finding]:
    """Write, read, list and delete one probe object under ``prefix``."""
    if not storage.is_s3(prefix):
        return [Finding(f"{label} on S3", f"{prefix!r} is not an s3:// URI")]
    probe = storage.join(prefix, f".burstcv-check-{uuid.uuid4().hex[:12]}")
    bucket, key = probe.removeprefix("s3://").split("/", 1)
    client = storage.s3_client()
    findings = []
    steps: tuple[tuple[str, Callable[[], object]], ...] = (
        ("s3:PutObject", lambda: client.put_object(Bucket=bucket, Key=key, Body=PROBE_BODY)),
        ("s3:GetObject", lambda: client.get_object(Bucket=bucket, Key=key)["Body"].read()),
        ("s3:ListBucket", lambda: client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)),
        ("s3:DeleteObject", lambda: client.delete_object(Bucket=bucket, Key=key)),
    )
    for action, step in steps:
        try:
            step()
        except (ClientError, BotoCoreError) as exc:
            findings.append(Finding(f"{action} under {prefix}", _reason(exc)))
            continue
        findings.append(Finding(f"{action} under {prefix}"))
    return findings


def check_account(settings: Settings, ec2: Ec2Settings | None = None) -> list[Finding]:
    """Return every finding: identity, AMI, each launch option, backstop, S3 prefixes."""
    backend = Ec2Backend(ec2 or Ec2Settings())
    s = backend.settings
    findings: list[Finding] = []
    try:
        account = backend.sts.get_caller_identity()["Account"]
        findings.append(Finding(f"credentials (account {account}, region {s.region})"))
    except (ClientError, BotoCoreError) as exc:
        return [Finding("credentials", f"{_reason(exc)}; see docs/aws.md, the connection")]
    try:
        request = LaunchRequest("burstcv-check", "burstcv-check", "s3://check/job.json", 3600)
        for option, refused in backend.check_launch(request):
            name = f"dry-run launch {option.instance_type} {option.market}"
            findings.append(Finding(name, refused))
    except (ClientError, BotoCoreError, ValueError) as exc:
        findings.append(Finding(f"AMI {s.ami}", f"{_reason(exc)}; check BURSTCV_EC2_AMI"))
    findings.append(
        Finding(f"backstop schedule (role {s.backstop_role})", backend.check_backstop())
    )
    findings += check_s3_prefix("artifact store", storage.join(settings.artifact_root, "runs"))
    registry_aliases = storage.join(settings.registry_uri, settings.model_name, "aliases")
    findings += check_s3_prefix("registry", registry_aliases)
    # What a training box needs beyond the launch: its instance profile (the role it reads
    # its job and writes its results with) and an S3 artifact store (it cannot read a local
    # folder). The training wheel is built and staged by each run itself.
    try:
        profile = s.required_instance_profile()
        findings.append(Finding(f"instance profile {profile}"))
    except ValueError as exc:
        findings.append(Finding("instance profile", str(exc)))
    store_ok = storage.is_s3(settings.artifact_root)
    findings.append(
        Finding(
            f"artifact store {settings.artifact_root}",
            "" if store_ok else "set BURSTCV_ARTIFACT_ROOT=s3://bucket/prefix for the ec2 backend",
        )
    )
    return findings
