"""What burstcv's EC2 calls mean: the order of launch options, the refusals that move a launch
on, the tags a box carries and how a DescribeInstances answer reads as an ``InstanceInfo``.

Pure functions of EC2's requests and answers (no client): ``compute.ec2`` makes the calls.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from botocore.exceptions import ClientError

from burstcv.compute.base import (
    ENDING,
    PENDING,
    RUNNING,
    STOPPED,
    TAG_AIRFLOW_RUN_ID,
    TAG_ATTEMPT,
    TAG_DAG_ID,
    TAG_EXPIRES_AT,
    TAG_MANAGED,
    TAG_NAME,
    TAG_RUN_ID,
    InstanceInfo,
)
from burstcv.cost.pricing import public_ipv4_usd_per_hour, volume_usd_per_gb_month
from burstcv.settings import Ec2Settings
from burstcv_spec.contracts import BoxRate, Launch, PriceQuote

log = logging.getLogger(__name__)

# Refusals of one Availability Zone: the same option is tried in the next subnet first. The
# others (quotas, the spot role) are the account's: no other AZ would answer differently.
ZONE_ERRORS = frozenset(
    {"InsufficientInstanceCapacity", "InsufficientCapacity", "Unsupported", "SpotMaxPriceTooLow"}
)
# Errors that mean "no room for this type/market right now": try the next option.
# VcpuLimitExceeded: the account's vCPU quota for this market is used up; the other has its own.
CAPACITY_ERRORS = ZONE_ERRORS | {"MaxSpotInstanceCountExceeded", "VcpuLimitExceeded"}
# A first spot launch needs the EC2 Spot service-linked role; without leave to create it,
# spot is unavailable to this account but on-demand still works.
SPOT_ROLE_ERRORS = frozenset({"AuthFailure.ServiceLinkedRoleCreationNotPermitted"})
NEXT_OPTION_ERRORS = CAPACITY_ERRORS | SPOT_ROLE_ERRORS
PLACEMENT_REFUSAL = "placement group"
# Dry-run refusals that mean "this identity may not", as opposed to a wrong parameter.
_PERMISSION_ERRORS = ("UnauthorizedOperation", "AccessDenied", "AuthFailure", "Blocked")
# Parameter errors (in the code and message, lower-cased, no spaces) and the setting at fault.
_SETTING_OF_ERROR = (
    ("invalidamiid", "BURSTCV_EC2_AMI"),
    ("subnet", "BURSTCV_EC2_SUBNET_IDS"),
    ("securitygroup", "BURSTCV_EC2_SECURITY_GROUP_IDS"),
    ("invalidgroup", "BURSTCV_EC2_SECURITY_GROUP_IDS"),
    ("instanceprofile", "BURSTCV_EC2_INSTANCE_PROFILE"),
    ("instancetype", "BURSTCV_EC2_INSTANCE_TYPES"),
    ("volumesize", "BURSTCV_EC2_VOLUME_GB"),
)
# EventBridge Scheduler's universal target: the schedule itself calls EC2 TerminateInstances.
BACKSTOP_TARGET_ARN = "arn:aws:scheduler:::aws-sdk:ec2:terminateInstances"
BACKSTOP_GROUP = "default"
# Keep retrying for a day: EC2 throttling must not save the box.
BACKSTOP_RETRY = {"MaximumRetryAttempts": 185, "MaximumEventAgeInSeconds": 86400}

_EC2_TO_STATE = {
    "pending": PENDING,
    "running": RUNNING,
    "shutting-down": ENDING,
    "stopping": ENDING,
    "stopped": ENDING,  # a stopped instance keeps its volume (and its bill): not gone
    "terminated": STOPPED,
}
_LIVE_EC2_STATES = [name for name, state in _EC2_TO_STATE.items() if state != STOPPED]

# "User initiated (2024-05-01 10:00:00 GMT)": when EC2 says the instance left running.
_TRANSITION_TIME = re.compile(r"\((\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}) (?:GMT|UTC)\)")


class CapacityUnavailableError(RuntimeError):
    """Raise when no instance type, spot or on-demand, has capacity."""


class NotManagedError(PermissionError):
    """Raise when asked to terminate an instance that burstcv did not launch."""


class LaunchCheckError(RuntimeError):
    """Raise when a dry run refuses a launch: a missing permission or a wrong setting."""


class BackstopError(RuntimeError):
    """Raise when the AWS-side backstop of a launched instance cannot be arranged."""


@dataclass(frozen=True)
class LaunchAttempt:
    """Name one (instance type, market) option tried by a launch."""

    instance_type: str
    market: Literal["spot", "on-demand"]


@dataclass(frozen=True)
class Subnet:
    """Name one subnet a launch may use, and its Availability Zone (None: EC2's choice)."""

    subnet_id: str | None
    zone: str = ""
    vpc_id: str = ""  # where a run's own security group is made (several boxes)

    def __str__(self) -> str:
        return f"{self.subnet_id} ({self.zone})" if self.subnet_id else "EC2's default subnet"


def launch_plan(instance_types: Iterable[str], use_spot: bool) -> list[LaunchAttempt]:
    """Return the options in order: spot on every type, then on-demand on every type."""
    types = list(instance_types)
    plan = [LaunchAttempt(t, "spot") for t in types] if use_spot else []
    return plan + [LaunchAttempt(t, "on-demand") for t in types]


def prefer_zones(subnets: list[Subnet], zones: Iterable[str]) -> list[Subnet]:
    """Return the subnets with those in ``zones`` first (in that order), the rest as they were."""
    order = list(dict.fromkeys(z for z in zones if z))
    rank = {zone: n for n, zone in enumerate(order)}
    return sorted(subnets, key=lambda sub: rank.get(sub.zone, len(order)))


def placement_refusal(exc: ClientError, params: dict[str, Any]) -> str:
    """Return ``PLACEMENT_REFUSAL: <code>`` when a launch into a placement group was refused
    for the group (tied to another zone, full, or busy), else "": like a shortage, the zone's."""
    if "Placement" not in params:
        return ""
    code, message = _error_code(exc), _error_message(exc).lower()
    about_group = code.startswith("InvalidPlacementGroup") or (
        code in ("InvalidParameterValue", "InvalidParameterCombination", "Unsupported")
        and "placement group" in message
    )
    return f"{PLACEMENT_REFUSAL}: {code}" if about_group else ""


def _next_option(exc: ClientError, params: dict[str, Any]) -> str:
    """Return the code of a refusal that moves a launch on to its next option, else ""."""
    code = _error_code(exc)
    return code if code in NEXT_OPTION_ERRORS else placement_refusal(exc, params)


def client_token(
    run_id: str, attempt: int, option: LaunchAttempt, subnet_id: str | None = None
) -> str:
    """Return the RunInstances ClientToken (at most 64 characters) of one option, in one subnet,
    of one attempt: a retried call gets the first call's boxes; a relaunch, new ones."""
    key = f"{run_id}|{attempt}|{option.instance_type}|{option.market}"
    if subnet_id:
        key += f"|{subnet_id}"
    return "burstcv-" + hashlib.sha256(key.encode()).hexdigest()[:48]


def in_cluster(params: dict[str, Any], cluster: Cluster) -> dict[str, Any]:
    """Return RunInstances parameters that put the boxes in the run's placement group."""
    return dict(
        params,
        Placement={"GroupName": cluster.placement_group},
        SecurityGroupIds=[*params.get("SecurityGroupIds", []), cluster.security_group_id],
    )


@dataclass(frozen=True)
class Cluster:
    """Name what the boxes of a multi-box run share: a placement group and a security group."""

    placement_group: str
    security_group_id: str


def backstop_name(instance_id: str) -> str:
    """Return the name of the schedule that terminates ``instance_id`` at its expiry."""
    return f"burstcv-backstop-{instance_id}"


def instance_tags(
    launch: Launch, expires_at: datetime, attempt: int | None = None
) -> list[dict[str, str]]:
    """Return the tags a launch puts on its instances and volumes (keys: MANAGED_TAG_KEYS);
    the groups a run's attempts share get no ``attempt``."""
    tags = [
        {"Key": TAG_MANAGED, "Value": "true"},
        {"Key": TAG_RUN_ID, "Value": launch.run.run_key},
        {"Key": TAG_DAG_ID, "Value": launch.dag_id},
        {"Key": TAG_EXPIRES_AT, "Value": format_expiry(expires_at)},
        {"Key": TAG_NAME, "Value": f"burstcv-{launch.run.run_key}"[:255]},
    ]
    if launch.run.airflow_run_id:
        tags.append({"Key": TAG_AIRFLOW_RUN_ID, "Value": launch.run.airflow_run_id[:255]})
    if attempt is not None:
        tags.append({"Key": TAG_ATTEMPT, "Value": str(attempt)})
    return tags


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _error_message(exc: ClientError) -> str:
    message = str(exc.response.get("Error", {}).get("Message", ""))
    return message.splitlines()[0] if message else ""


def _said(exc: ClientError) -> str:
    """Return ``<code>: <first line of the message>`` of an AWS error."""
    return f"{_error_code(exc)}: {_error_message(exc)}"


def _run_filters(run_id: str | None = None) -> list[dict[str, Any]]:
    """Return the describe filters of burstcv's resources (of one run, with ``run_id``)."""
    filters: list[dict[str, Any]] = [{"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]}]
    if run_id is not None:
        filters.append({"Name": f"tag:{TAG_RUN_ID}", "Values": [run_id]})
    return filters


def format_expiry(moment: datetime) -> str:
    """Return the ISO 8601 UTC text of an expiry tag (``2024-05-01T10:00:00Z``)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_expiry(text: str) -> datetime | None:
    """Return the datetime of an expiry tag, or None if it is missing or unreadable."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        log.warning("unreadable %s tag %r", TAG_EXPIRES_AT, text)
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _tags(instance: dict[str, Any]) -> dict[str, str]:
    return {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}


def _stopped_at(instance: dict[str, Any]) -> datetime | None:
    match = _TRANSITION_TIME.search(instance.get("StateTransitionReason") or "")
    if instance["State"]["Name"] != "terminated" or match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)


def _info(instance: dict[str, Any]) -> InstanceInfo:
    tags = _tags(instance)
    launched = instance.get("LaunchTime")
    if isinstance(launched, datetime) and launched.tzinfo is None:
        launched = launched.replace(tzinfo=UTC)
    return InstanceInfo(
        instance_id=instance["InstanceId"],
        run_id=tags.get(TAG_RUN_ID, ""),
        dag_id=tags.get(TAG_DAG_ID, ""),
        state=_EC2_TO_STATE.get(instance["State"]["Name"], RUNNING),
        expires_at=parse_expiry(tags.get(TAG_EXPIRES_AT, "")),
        instance_type=instance.get("InstanceType", ""),
        lifecycle="spot" if instance.get("InstanceLifecycle") == "spot" else "on-demand",
        launched_at=launched if isinstance(launched, datetime) else None,
        stopped_at=_stopped_at(instance),
        airflow_run_id=tags.get(TAG_AIRFLOW_RUN_ID, ""),
        image_id=instance.get("ImageId", ""),
        zone=instance.get("Placement", {}).get("AvailabilityZone", ""),
        public_ipv4=bool(instance.get("PublicIpAddress")),
        attempt=_attempt_tag(tags.get(TAG_ATTEMPT, "")),
        ended_by=str((instance.get("StateReason") or {}).get("Code", "")),
    )


def _attempt_tag(text: str) -> int:
    """Return the attempt a box's tag names; 1 when it has none (launched before the tag)."""
    return int(text) if text.isdecimal() else 1


def quoted_market(info: InstanceInfo) -> tuple[str, str]:
    """Return the market a box is quoted in and the zone of its quote (spot prices are an AZ's;
    an on-demand price is the region's)."""
    market = "spot" if info.lifecycle == "spot" else "on-demand"
    return market, info.zone if market == "spot" else ""


def rate_of(
    info: InstanceInfo, found: PriceQuote | None, bound: BoxRate | None, settings: Ec2Settings
) -> BoxRate:
    """Return a box's rate, every part priced; a box nobody can quote is billed at the run's
    ``bound`` rate, which the budget assumed anyway."""
    if found is not None:
        usd, source = found.usd_per_hour, f"{found.source}, {found.as_of}"
    else:
        usd = bound.usd_per_hour if bound is not None else 0.0
        source = "no quote: the run's bound rate (its priciest type, on-demand)"
        log.warning(
            "no price for %s %s; billed at the run's bound rate, $%.4f/h",
            info.lifecycle,
            info.instance_type,
            usd,
        )
    return BoxRate(
        instance_type=info.instance_type,
        market=info.lifecycle or "on-demand",
        usd_per_hour=usd,
        price_source=source,
        volume_gb=settings.volume_gb,
        ebs_usd_per_gb_month=volume_usd_per_gb_month(settings.region),
        public_ipv4_usd_per_hour=public_ipv4_usd_per_hour() if info.public_ipv4 else 0.0,
    )
