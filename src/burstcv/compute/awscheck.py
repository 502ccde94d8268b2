"""Check an AWS account is ready for burstcv without renting anything: ``burstcv aws check``.

Every check is free: launches are dry runs, the backstop schedule is created disabled and
deleted at once, and the S3 checks write, read, list and delete one small probe object under
the prefixes the pipeline writes; the rest only reads.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ParamSpec

from botocore.exceptions import BotoCoreError, ClientError

from burstcv import lineage
from burstcv.compute.ec2 import Ec2Backend
from burstcv.compute.ec2_terms import (
    LaunchAttempt,
    LaunchCheckError,
    Subnet,
    _error_code,
    _error_message,
    format_expiry,
    in_cluster,
    launch_plan,
)
from burstcv.cost.pricing import PRICING_API_REGIONS, instance_shapes
from burstcv.cost.quotes import quote
from burstcv.settings import Ec2Settings, Settings
from burstcv_spec import storage
from burstcv_spec.contracts import Launch, RunRef
from burstcv_spec.layout import RunLayout

log = logging.getLogger(__name__)
P = ParamSpec("P")

PROBE_BODY = b"burstcv aws check probe: safe to delete\n"


@dataclass(frozen=True)
class Finding:
    """Say whether one thing burstcv needs is in place, and what to do if not."""

    name: str
    missing: str = ""  # empty: in place

    @property
    def ok(self) -> bool:
        return not self.missing

    def line(self) -> str:
        """Return the one line the CLI prints."""
        return f"ok       {self.name}" if self.ok else f"MISSING  {self.name}: {self.missing}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return f"{exc.response.get('Error', {}).get('Code', '?')}: {_error_message(exc)}"
    return f"{type(exc).__name__}: {exc}"


def _bucket(uri: str) -> str:
    return uri.removeprefix("s3://").split("/", 1)[0]


def _refusal(step: Callable[[], object]) -> str:
    """Run ``step``; return "" when AWS allowed it, else why not."""
    try:
        step()
    except (ClientError, BotoCoreError) as exc:
        return _reason(exc)
    return ""


def check_s3_prefix(label: str, prefix: str) -> list[Finding]:
    """Write, read, list and delete one probe object under ``prefix``."""
    if not storage.is_s3(prefix):
        return [Finding(f"{label} on S3", f"{prefix!r} is not an s3:// URI")]
    probe = storage.join(prefix, f".burstcv-check-{uuid.uuid4().hex[:12]}")
    bucket, key = probe.removeprefix("s3://").split("/", 1)
    client = storage.s3_client()
    steps: tuple[tuple[str, Callable[[], object]], ...] = (
        ("s3:PutObject", lambda: client.put_object(Bucket=bucket, Key=key, Body=PROBE_BODY)),
        ("s3:GetObject", lambda: client.get_object(Bucket=bucket, Key=key)["Body"].read()),
        ("s3:ListBucket", lambda: client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)),
        ("s3:DeleteObject", lambda: client.delete_object(Bucket=bucket, Key=key)),
    )
    return [Finding(f"{action} under {prefix}", _refusal(step)) for action, step in steps]


@dataclass(frozen=True)
class VcpuQuota:
    """Name the two EC2 quotas (Service Quotas codes) that count one family's vCPUs in a region."""

    family: str
    on_demand: str
    spot: str
    spot_family: str | None = None  # the spot quota's own name where it differs (P5's)

    def code(self, market: str) -> str:
        return self.spot if market == "spot" else self.on_demand

    def name(self, market: str) -> str:
        """Return the family as the quota of ``market`` names it."""
        return (self.spot_family or self.family) if market == "spot" else self.family


GPU_G_AND_VT = VcpuQuota("G and VT", on_demand="L-DB2E81BA", spot="L-3819A6DF")
# "Running On-Demand P instances" counts every P family; spot has two quotas: "All P4, P3 and
# P2 Spot Instance Requests" and "All P5 Spot Instance Requests" (P5, P5e, P5en and later).
GPU_P = VcpuQuota("P", on_demand="L-417A185B", spot="L-7212CCBC", spot_family="P4, P3 and P2")
GPU_P5 = VcpuQuota("P", on_demand="L-417A185B", spot="L-C4BD4855", spot_family="P5")
STANDARD = VcpuQuota("Standard (A, C, D, H, I, M, R, T, Z)", "L-1216C47A", "L-34B43A08")
_STANDARD_LETTERS = frozenset("acdhimrtz")


def vcpu_quota_of(instance_type: str) -> VcpuQuota | None:
    """Return the quota family an instance type counts against (None: one not known here)."""
    match = re.match(r"([a-z]+)(\d*)", instance_type)
    letters, generation = (match.group(1), match.group(2)) if match else ("", "")
    if letters.startswith("g") or letters == "vt":  # g4dn, g5, g6, g6e, gr6, vt1
        return GPU_G_AND_VT
    if letters == "p":  # p2, p3, p4d; p5, p5e, p5en (and later) spot apart
        return GPU_P5 if generation and int(generation) >= 5 else GPU_P
    if letters in _STANDARD_LETTERS:
        return STANDARD
    return None


def _quota_value(quotas: Any, code: str) -> float:
    """Return the vCPUs an EC2 quota allows in the region: the applied value, else the default."""
    for read in (quotas.get_service_quota, quotas.get_aws_default_service_quota):
        try:
            return float(read(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except ClientError as exc:
            # A quota never raised has no applied value; its default (not always 0) holds.
            if _error_code(exc) != "NoSuchResourceException":
                raise
    return 0.0


def _vcpus(backend: Ec2Backend, types: Iterable[str]) -> dict[str, int]:
    """Return the vCPUs of each type EC2 describes in the region (DescribeInstanceTypes)."""
    described = backend.client.describe_instance_types(InstanceTypes=list(types))
    return {
        t["InstanceType"]: int(t["VCpuInfo"]["DefaultVCpus"]) for t in described["InstanceTypes"]
    }


def _unknown_quota(
    instance_type: str, market: str, family: VcpuQuota | None, region: str, setting: str
) -> Finding:
    why = (
        "not a G, VT, P or standard family: find its quota in Service Quotas "
        f"(Amazon EC2) for {region} and check it yourself"
        if family is None
        else f"EC2 does not describe {instance_type} in {region}; check {setting}"
    )
    return Finding(f"vCPU quota of {instance_type} {market}", why)


def _quota_needs(backend: Ec2Backend) -> tuple[list[Finding], dict[str, tuple[str, str, int]]]:
    """Return the types no known quota counts, and per quota code (P5 and P4 on demand share
    one) its label, the largest candidate type and that type's vCPUs."""
    s = backend.settings
    vcpus = _vcpus(backend, s.instance_types)
    unknown: list[Finding] = []
    needs: dict[str, tuple[str, str, int]] = {}
    for option in launch_plan(s.instance_types, s.use_spot):
        instance_type, market = option.instance_type, option.market
        family = vcpu_quota_of(instance_type)
        if family is None or instance_type not in vcpus:
            setting = "BURSTCV_EC2_INSTANCE_TYPES"
            unknown.append(_unknown_quota(instance_type, market, family, s.region, setting))
            continue
        code = family.code(market)
        if code not in needs or vcpus[instance_type] > needs[code][2]:
            needs[code] = (f"{family.name(market)} {market}", instance_type, vcpus[instance_type])
    return unknown, needs


@dataclass(frozen=True)
class QuotaNeed:
    """Say what one quota must hold: ``need`` vCPUs for ``boxes``, ``ask`` for ``ask_for``."""

    code: str
    label: str
    boxes: str
    need: int
    ask: int
    ask_for: str


def _quota_finding(quotas: Any, region: str, want: QuotaNeed) -> Finding:
    """Compare one quota's vCPUs with what ``want`` needs; say what to ask for if too few."""
    name = f"vCPU quota {want.label} ({want.code}) in {region}"
    try:
        value = _quota_value(quotas, want.code)
    except ClientError as exc:
        why = "allow servicequotas:GetServiceQuota and servicequotas:GetAWSDefaultServiceQuota"
        return Finding(name, f"{_reason(exc)}; {why}")
    have = f"{value:g} vCPUs, {want.boxes} needs {want.need}"
    if value >= want.need:
        return Finding(f"{name}: {have}")
    return Finding(
        name,
        f"{have}; ask for {want.ask} ({want.ask_for}): aws service-quotas "
        f"request-service-quota-increase --service-code ec2 --quota-code {want.code} "
        f"--desired-value {want.ask} --region {region}",
    )


def check_vcpu_quotas(
    backend: Ec2Backend, settings: Settings, *, num_nodes: int = 1
) -> list[Finding]:
    """Compare each market's vCPU quota of each family with the largest candidate's vCPUs.
    A new account has 0 G, VT and P vCPUs: every launch is refused until an increase is granted."""
    findings, needs = _quota_needs(backend)
    quotas = backend._aws_client("service-quotas")  # the backend's connection and region
    # The GPU pool bounds the boxes that exist at once (a run takes a slot per box).
    slots = max(settings.gpu_pool_slots, num_nodes, 1)
    for code, (label, instance_type, need) in needs.items():
        boxes = f"{num_nodes} x {instance_type}" if num_nodes > 1 else f"a {instance_type}"
        # A launch starts every box of the run at once.
        ask_for = f"{slots} boxes at once, BURSTCV_GPU_POOL_SLOTS"
        want = QuotaNeed(code, label, boxes, need * num_nodes, need * slots, ask_for)
        findings.append(_quota_finding(quotas, backend.settings.region, want))
    return findings


def sizing_candidates(families: Iterable[str]) -> list[str]:
    """Return the CPU types a sizing box may measure: the serving families' known types."""
    wanted = set(families)
    return [t for t in sorted(instance_shapes()) if t.split(".")[0] in wanted]


def sizing_quota_needs(
    vcpus: dict[str, int], parallel: int
) -> dict[str, tuple[VcpuQuota, list[str], int]]:
    """Return per on-demand quota code its family, the ``parallel`` largest candidates it
    counts (the sizing boxes that could run at once) and their vCPUs together."""
    by_code: dict[str, tuple[VcpuQuota, list[str]]] = {}
    for instance_type in sorted(vcpus, key=lambda t: (-vcpus[t], t)):
        family = vcpu_quota_of(instance_type)
        if family is not None:
            by_code.setdefault(family.on_demand, (family, []))[1].append(instance_type)
    return {
        code: (family, types[:parallel], sum(vcpus[t] for t in types[:parallel]))
        for code, (family, types) in by_code.items()
    }


def check_sizing_quota(backend: Ec2Backend, settings: Settings, types: list[str]) -> list[Finding]:
    """Compare the on-demand quota of the sizing boxes' family (Standard for the serving
    types) with the largest candidates that could run at once (BURSTCV_SIZING_PARALLEL)."""
    region = backend.settings.region
    vcpus = _vcpus(backend, types)
    # A type EC2 does not offer in the region fails DescribeInstanceTypes: the line says so.
    findings = [
        _unknown_quota(t, "on-demand", None, region, "--serving-families")
        for t in types
        if vcpu_quota_of(t) is None
    ]
    quotas = backend._aws_client("service-quotas")
    needs = sizing_quota_needs(vcpus, settings.sizing_parallel)
    for code, (family, largest, need) in needs.items():
        at_once = f"{len(largest)} at once"
        boxes = f"sizing boxes {', '.join(largest)} ({at_once}, BURSTCV_SIZING_PARALLEL)"
        ask_for = f"{at_once}; more if other instances of the family run in {region}"
        label = f"{family.name('on-demand')} on-demand"
        findings.append(
            _quota_finding(quotas, region, QuotaNeed(code, label, boxes, need, need, ask_for))
        )
    return findings


def sizing_images(backend: Ec2Backend, types: list[str]) -> tuple[list[Finding], dict[str, str]]:
    """Resolve the sizing boxes' image of each candidate's architecture as a sizing box does;
    return a line per architecture and {type: its image id} for the types whose image resolved."""
    s = backend.settings
    arch = {t: backend.architecture(t) for t in types}
    findings, images = [], {}
    for architecture in sorted(set(arch.values())):
        name = f"sizing boxes' AMI for {architecture}"
        try:
            images[architecture] = backend.resolve_sizing_ami(architecture)
        except (ClientError, BotoCoreError, ValueError) as exc:
            why = f"{_reason(exc)}; check BURSTCV_EC2_SIZING_AMI ({s.sizing_ami})"
            findings.append(Finding(name, why))
            continue
        findings.append(Finding(f"{name}: {images[architecture]}"))
    return findings, {t: images[a] for t, a in arch.items() if a in images}


def check_sizing_launches(backend: Ec2Backend, types: list[str]) -> list[Finding]:
    """Dry-run one sizing box of each candidate type on its architecture's image, as the
    sizing launches it (on demand, its volume and tags, the first launch subnet). A type
    refused here is skipped by every sizing: its line names AWS's reason."""
    s = backend.settings
    findings, images = sizing_images(backend, types)
    subnet = backend.launch_subnets()[0]
    for instance_type, image_id in images.items():
        launch = check_launch_of().model_copy(
            update={"instance_types": [instance_type], "use_spot": False}
        )
        option = LaunchAttempt(instance_type, "on-demand")
        name = f"dry-run launch sizing box {instance_type} on-demand ({image_id})"
        base = backend._run_params(
            launch, image_id, "#!/bin/bash\n", launch.deadline_at, 1, s.sizing_volume_gb
        )
        refused = backend.dry_run_refusal(base, option, subnet)
        why = f"{refused}: every sizing skips {instance_type}; allow it, or serve on other families"
        findings.append(Finding(name, why if refused else ""))
    return findings


# --- the training role's own S3 access ----------------------------------------------------------

CHECK_RUN = "burstcv-check"  # the run name in the objects the simulation asks about
S3_READ, S3_WRITE, S3_LIST = "s3:GetObject", "s3:PutObject", "s3:ListBucket"
KMS_USE = ("kms:Decrypt", "kms:GenerateDataKey")  # read and write SSE-KMS objects


def _s3_arn(uri: str) -> str:
    return "arn:aws:s3:::" + uri.removeprefix("s3://")


def _role_requests(
    artifact_root: str, reads: Iterable[str], writes: Iterable[str], kms_key_arn: str | None
) -> list[tuple[str, str]]:
    return [
        *((S3_READ, _s3_arn(uri)) for uri in reads),
        *((S3_WRITE, _s3_arn(uri)) for uri in writes),
        (S3_LIST, f"arn:aws:s3:::{_bucket(artifact_root)}"),  # a missing marker: 404, not 403
        *((action, kms_key_arn) for action in KMS_USE if kms_key_arn),
    ]


def instance_role_requests(
    artifact_root: str, kms_key_arn: str | None = None
) -> list[tuple[str, str]]:
    """Return the (action, resource ARN) pairs a training box needs under ``artifact_root``."""
    run = storage.join(artifact_root, "runs", CHECK_RUN)
    reads = (
        storage.join(run, "job", "job.json"),
        storage.join(run, "dataset", "shards", "train-00000.tar"),
        storage.join(artifact_root, "runtime", CHECK_RUN, "burstcv_train-0-py3-none-any.whl"),
        storage.join(artifact_root, "weights", "sha256", f"{CHECK_RUN}.pth"),
    )
    writes = (
        storage.join(run, "job", "checkpoints", "last.pt"),
        storage.join(run, "job", "attempts", "1", "DONE"),
    )
    return _role_requests(artifact_root, reads, writes, kms_key_arn)


def sizing_role_requests(
    artifact_root: str, kms_key_arn: str | None = None
) -> list[tuple[str, str]]:
    """Return the (action, resource ARN) pairs a sizing box needs under ``artifact_root``: its
    wheel and the wheelhouse beside it, the model and requests it reads, its figures and log."""
    paths, sized = RunLayout.of(artifact_root, CHECK_RUN), "c7i.large"
    runtime = storage.join(artifact_root, "runtime", CHECK_RUN)
    reads = (
        storage.join(runtime, "burstcv_size-0-py3-none-any.whl"),
        storage.join(runtime, "wheelhouse", "numpy-0-cp311-cp311-manylinux_2_28_x86_64.whl"),
        storage.join(paths.model, "model.onnx"),
        storage.join(paths.sizing_requests, "0000.img"),
    )
    writes = (paths.box_sizing(sized), storage.join(paths.sizing_boxes, "logs", f"{sized}.log"))
    return _role_requests(artifact_root, reads, writes, kms_key_arn)


def bucket_kms_key(backend: Ec2Backend, artifact_root: str) -> str | None:
    """Return the customer managed KMS key the bucket encrypts new objects with by default."""
    try:
        config = backend._aws_client("s3").get_bucket_encryption(Bucket=_bucket(artifact_root))
    except ClientError as exc:
        if _error_code(exc) == "ServerSideEncryptionConfigurationNotFoundError":
            return None
        raise
    for rule in config["ServerSideEncryptionConfiguration"].get("Rules", []):
        default = rule.get("ApplyServerSideEncryptionByDefault", {})
        key = default.get("KMSMasterKeyID")
        if not str(default.get("SSEAlgorithm", "")).startswith("aws:kms") or not key:
            continue
        meta = backend._aws_client("kms").describe_key(KeyId=key)["KeyMetadata"]
        # aws/s3 (AWS managed) serves anyone the bucket lets write: nothing to check.
        return None if meta.get("KeyManager") == "AWS" else str(meta["Arn"])
    return None


def _simulated_decisions(results: Iterable[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """Return {(action, resource): decision} from IAM's EvaluationResults."""
    decisions: dict[tuple[str, str], str] = {}
    for result in results:
        action = str(result["EvalActionName"])
        specific = result.get("ResourceSpecificResults") or []
        for entry in specific:
            decisions[(action, str(entry["EvalResourceName"]))] = str(entry["EvalResourceDecision"])
        if not specific:
            resource = str(result.get("EvalResourceName", "*"))
            decisions[(action, resource)] = str(result["EvalDecision"])
    return decisions


def _refused(
    iam: Any, principal: str, wanted: list[tuple[str, str]], **context: Any
) -> list[tuple[str, str, str]]:
    """Return (action, resource, decision) of each request IAM's policy simulator refuses."""
    pages = iam.get_paginator("simulate_principal_policy").paginate(
        PolicySourceArn=principal,
        ActionNames=sorted({action for action, _ in wanted}),
        ResourceArns=sorted({resource for _, resource in wanted}),
        **context,
    )
    decisions = _simulated_decisions(r for page in pages for r in page["EvaluationResults"])
    return [
        (action, resource, decisions.get((action, resource), "not simulated"))
        for action, resource in wanted
        if decisions.get((action, resource)) != "allowed"
    ]


def check_instance_role_s3(
    backend: Ec2Backend, artifact_root: str, *, sizing: bool = False
) -> list[Finding]:
    """Ask IAM's policy simulator whether the training role may read and write its run's files
    (and, with ``sizing``, a sizing box's). The dry-run launch cannot see it: a box without
    these rights boots, is billed, and fails."""
    profile = backend.settings.instance_profile
    if not profile or not storage.is_s3(artifact_root):
        return []  # the instance profile and artifact store lines already say what to set
    iam = backend._aws_client("iam")
    profile_name = profile.rsplit("/", 1)[-1]
    name = f"training role's S3 access under {artifact_root}"
    try:
        found = iam.get_instance_profile(InstanceProfileName=profile_name)["InstanceProfile"]
    except ClientError as exc:
        why = (
            f"no instance profile {profile_name}: create it (docs/aws.md, IAM)"
            if _error_code(exc) == "NoSuchEntity"
            else f"{_reason(exc)}; allow iam:GetInstanceProfile on {profile_name}"
        )
        return [Finding(name, why)]
    if not found["Roles"]:
        why = (
            f"instance profile {profile_name} holds no role: aws iam "
            f"add-role-to-instance-profile --instance-profile-name {profile_name} "
            "--role-name burstcv-training"
        )
        return [Finding(name, why)]
    role_arn = str(found["Roles"][0]["Arn"])
    under = f"role {role_arn.rsplit('/', 1)[-1]}: S3 access under {artifact_root}"
    name = f"training {under}"
    try:
        key = bucket_kms_key(backend, artifact_root)
    except ClientError as exc:
        why = "allow s3:GetEncryptionConfiguration on the bucket and kms:DescribeKey"
        return [Finding(name, f"{_reason(exc)}; {why} (deploy/iam-policy.json)")]
    if key:
        under += f" (the bucket's default key {key})"
    # The sizing boxes have the training boxes' instance profile: one simulation asks for both.
    kinds = {"training": instance_role_requests(artifact_root, key)}
    if sizing:
        kinds["sizing boxes'"] = sizing_role_requests(artifact_root, key)
    wanted = list(dict.fromkeys(pair for pairs in kinds.values() for pair in pairs))
    try:
        refused = _refused(iam, role_arn, wanted)
    except ClientError as exc:
        why = f"{_reason(exc)}; allow iam:SimulatePrincipalPolicy on {role_arn}"
        return [Finding(f"{kind} {under}", why) for kind in kinds]
    root = _s3_arn(artifact_root) + "/"
    return [
        Finding(f"{kind} {under}", _role_fix([r for r in refused if r[:2] in pairs], root, key))
        for kind, pairs in kinds.items()
    ]


def _role_fix(refused: list[tuple[str, str, str]], under_root: str, key: str | None) -> str:
    """Return what the training role may not do and how to grant it ("" for nothing)."""
    if not refused:
        return ""
    lines = [
        f"{action} on {resource.removeprefix(under_root).removeprefix('arn:aws:s3:::')} "
        f"({decision})"
        for action, resource, decision in refused
    ]
    fix = "give it deploy/instance-role-policy.json (docs/aws.md, the training instance's role)"
    if key and any(line.startswith(KMS_USE) for line in lines):
        fix += (
            f", and {' and '.join(KMS_USE)} on {key} (the bucket encrypts with it by default: "
            "without them a box can neither read its job nor write its FAILED marker)"
        )
    return f"the role may not {'; '.join(lines)}: {fix}"


# --- network: a route from each launch subnet to S3 ---------------------------------------------


def _s3_route(
    table: dict[str, Any], s3_endpoints: dict[str, set[str]], public_ip: bool, region: str
) -> tuple[str, str]:
    """Return (how the table reaches S3, "") or ("", why it does not)."""
    table_id = str(table["RouteTableId"])
    endpoints = [e for e, tables in s3_endpoints.items() if table_id in tables]
    endpoints += [
        str(r.get("GatewayId")) for r in _routes(table) if r.get("GatewayId") in s3_endpoints
    ]
    if endpoints:
        return f"S3 gateway endpoint {endpoints[0]}", ""
    way = _internet_way(table, public_ip)
    if way.startswith("NAT"):
        return (
            f"{way}, billed per GB: every box's shard download, wheel and checkpoints pass "
            "through it; an S3 gateway endpoint carries them free (aws ec2 create-vpc-endpoint "
            f"--vpc-id {table['VpcId']} --service-name com.amazonaws.{region}.s3 "
            f"--route-table-ids {table_id})",
            "",
        )
    if way:
        return way + (" (public IPs on launch)" if way.startswith("internet") else ""), ""
    gateway = str(_default_route(table).get("GatewayId", ""))
    if gateway.startswith("igw-"):
        return "", (
            f"its route table {table_id} goes to internet gateway {gateway}, but the subnet "
            "gives instances no public IP: turn on its auto-assign public IPv4 address "
            "(aws ec2 modify-subnet-attribute --map-public-ip-on-launch --subnet-id …), "
            "or add an S3 gateway endpoint"
        )
    return "", f"its route table {table_id} has no S3 gateway endpoint, NAT or internet gateway"


def _routes(table: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in table.get("Routes", []) if r.get("State") != "blackhole"]


def _default_route(table: dict[str, Any]) -> dict[str, Any]:
    """Return the table's default route ({} if none; a table holds one per destination)."""
    return next((r for r in _routes(table) if r.get("DestinationCidrBlock") == "0.0.0.0/0"), {})


def _internet_way(table: dict[str, Any], public_ip: bool) -> str:
    """Return how a box of the table's subnet reaches the internet ("" if it cannot)."""
    default = _default_route(table)
    gateway = str(default.get("GatewayId", ""))
    if default.get("NatGatewayId"):
        return f"NAT gateway {default['NatGatewayId']}"
    if gateway.startswith("igw-") and public_ip:
        return f"internet gateway {gateway}"
    for target in ("TransitGatewayId", "NetworkInterfaceId", "InstanceId"):
        if default.get(target):
            return f"default route via {default[target]} (not followed further)"
    return ""


Routing = dict[str, tuple[dict[str, Any], dict[str, Any] | None]]


def _s3_routing(backend: Ec2Backend, ids: list[str]) -> tuple[Routing, dict[str, set[str]]]:
    """Return each subnet's description and route table (None: its VPC has no main table), and
    the subnets' VPCs' S3 gateway endpoints (id: its route tables)."""
    ec2, region = backend.client, backend.settings.region
    found = ec2.describe_subnets(SubnetIds=ids)["Subnets"]
    in_vpcs = {"Name": "vpc-id", "Values": sorted({str(info["VpcId"]) for info in found})}
    pages = ec2.get_paginator("describe_route_tables").paginate(Filters=[in_vpcs])
    tables = [t for page in pages for t in page["RouteTables"]]
    endpoints = ec2.describe_vpc_endpoints(
        Filters=[
            in_vpcs,
            {"Name": "service-name", "Values": [f"com.amazonaws.{region}.s3"]},
            {"Name": "vpc-endpoint-type", "Values": ["Gateway"]},
        ]
    )["VpcEndpoints"]
    s3_endpoints = {
        str(e["VpcEndpointId"]): set(e.get("RouteTableIds", []))
        for e in endpoints
        if e.get("State", "available").lower() == "available"
    }
    routing = {
        str(info["SubnetId"]): (
            info,
            _route_table_of(tables, str(info["SubnetId"]), str(info["VpcId"])),
        )
        for info in found
    }
    return routing, s3_endpoints


def check_subnet_routes(backend: Ec2Backend) -> list[Finding]:
    """Check every subnet a launch may use can reach S3 (the box's job, wheel and results)."""
    region = backend.settings.region
    subnets: list[Subnet] = backend.launch_subnets()
    ids = [sub.subnet_id for sub in subnets if sub.subnet_id]
    no_vpc = (
        f"{region} has no default VPC: set BURSTCV_EC2_SUBNET_IDS to subnets with a route "
        "to S3 (docs/aws.md, network)"
    )
    findings = [Finding("route to S3", no_vpc) for sub in subnets if not sub.subnet_id]
    if not ids:
        return findings
    routing, s3_endpoints = _s3_routing(backend, ids)
    for sub in subnets:
        if not sub.subnet_id:
            continue
        info, table = routing[sub.subnet_id]
        name = f"route to S3 from subnet {sub}"
        if table is None:
            findings.append(Finding(name, f"VPC {info['VpcId']} has no main route table"))
            continue
        via, missing = _s3_route(table, s3_endpoints, bool(info.get("MapPublicIpOnLaunch")), region)
        fix = (
            f"aws ec2 create-vpc-endpoint --vpc-id {info['VpcId']} --service-name "
            f"com.amazonaws.{region}.s3 --route-table-ids {table['RouteTableId']} "
            f"--region {region} (free), or a NAT gateway"
        )
        findings.append(Finding(f"{name} via {via}") if via else Finding(name, f"{missing}: {fix}"))
    return findings


# --- network: the boxes' security groups let them out to S3 ------------------------------------

HTTPS = 443


def _https_egress(rule: dict[str, Any], s3_lists: set[str]) -> str:
    """Return where one egress rule lets HTTPS out to ("" if it does not)."""
    protocol = str(rule.get("IpProtocol", ""))
    ports = protocol == "-1" or (
        protocol in ("tcp", "6") and rule.get("FromPort", 0) <= HTTPS <= rule.get("ToPort", -1)
    )
    if not ports:
        return ""
    if any(r.get("CidrIp") == "0.0.0.0/0" for r in rule.get("IpRanges", [])):
        return "anywhere"
    if any(p.get("PrefixListId") in s3_lists for p in rule.get("PrefixListIds", [])):
        return "the S3 prefix list"
    others = [str(r.get("CidrIp")) for r in rule.get("IpRanges", [])] + [
        str(p.get("PrefixListId")) for p in rule.get("PrefixListIds", [])
    ]
    return f"{', '.join(others)} only (not followed further)" if others else ""


def _s3_prefix_lists(backend: Ec2Backend) -> set[str]:
    """Return the ids of the region's S3 prefix list (what an egress rule to S3 names)."""
    name = f"com.amazonaws.{backend.settings.region}.s3"
    by_name = [{"Name": "prefix-list-name", "Values": [name]}]
    found = backend.client.describe_prefix_lists(Filters=by_name)["PrefixLists"]
    return {str(p["PrefixListId"]) for p in found}


def _box_groups(backend: Ec2Backend) -> dict[str, list[dict[str, Any]]]:
    """Return the security groups a box gets, by what names them: the setting, else the
    default group of each launch subnet's VPC."""
    s, ec2 = backend.settings, backend.client
    if s.security_group_ids:
        groups = ec2.describe_security_groups(GroupIds=list(s.security_group_ids))
        return {"BURSTCV_EC2_SECURITY_GROUP_IDS": groups["SecurityGroups"]}
    vpcs = sorted({sub.vpc_id for sub in backend.launch_subnets() if sub.vpc_id})
    default = {"Name": "group-name", "Values": ["default"]}
    return {
        f"the default security group of {vpc}": ec2.describe_security_groups(
            Filters=[{"Name": "vpc-id", "Values": [vpc]}, default]
        )["SecurityGroups"]
        for vpc in vpcs
    }


def check_security_group_egress(backend: Ec2Backend) -> list[Finding]:
    """Check the security groups a training box gets let it reach S3 over HTTPS.
    Accounts that follow CIS 4.3 strip a VPC's default group of every rule: a box there cannot
    even write its FAILED marker, and is paid for until its boot bound."""
    s3_lists = _s3_prefix_lists(backend)
    findings = []
    for label, groups in _box_groups(backend).items():
        ids = [str(g["GroupId"]) for g in groups]
        name = f"HTTPS egress to S3 from {label} ({', '.join(ids)})"
        reaches = [
            f"{where} ({g['GroupId']})"
            for g in groups
            for rule in g.get("IpPermissionsEgress", [])
            if (where := _https_egress(rule, s3_lists))
        ]
        s3_list = sorted(s3_lists)[0] if s3_lists else "<the S3 prefix list>"
        rule = f"IpProtocol=tcp,FromPort=443,ToPort=443,PrefixListIds=[{{PrefixListId={s3_list}}}]"
        why = (
            "no egress rule lets a box reach S3 over HTTPS (a box could not read its job "
            "nor write its FAILED marker): aws ec2 authorize-security-group-egress "
            f"--group-id {ids[0] if ids else '<group>'} --ip-permissions '{rule}' "
            f"--region {backend.settings.region}, or set BURSTCV_EC2_SECURITY_GROUP_IDS to a "
            "group with such a rule"
        )
        findings.append(Finding(f"{name}: to {reaches[0]}") if reaches else Finding(name, why))
    return findings


def _index_way(backend: Ec2Backend) -> str:
    """Return how boxes reach the package index (HTTPS to the internet) from every launch
    subnet, through the groups they get ("" where some cannot)."""
    ids = [sub.subnet_id for sub in backend.launch_subnets() if sub.subnet_id]
    if not ids:
        return ""
    ways = set()
    for info, table in _s3_routing(backend, ids)[0].values():
        way = _internet_way(table or {}, bool(info.get("MapPublicIpOnLaunch")))
        if not way:
            return ""
        ways.add(way)
    egress = all(
        any(
            _https_egress(rule, set()) == "anywhere"
            for g in groups
            for rule in g.get("IpPermissionsEgress", [])
        )
        for groups in _box_groups(backend).values()
    )
    return ", ".join(sorted(ways)) if egress else ""


def wheel_source(tag: str, staged: str, index_way: str) -> Finding:
    """Say where sizing boxes of ``tag`` get their wheels: the wheelhouse ``staged`` beside
    the sizing wheel (S3 suffices), else the package index, reached ``index_way`` if at all."""
    name = f"sizing boxes' wheels ({tag})"
    if staged:
        return Finding(f"{name}: from the wheelhouse {staged}; S3 suffices, no package index")
    later = (
        "no wheelhouse staged yet: a run stages one beside the wheel "
        "(pip download on the orchestrator)"
    )
    if index_way:
        return Finding(
            f"{name}: {later}, else the boxes install from the package index via {index_way}"
        )
    return Finding(
        f"{name}: {later}; the boxes reach S3 only, so the orchestrator must reach the "
        "package index or hold the wheelhouse (BURSTCV_WHEELHOUSE_CACHE)"
    )


def check_sizing_wheels(backend: Ec2Backend, artifact_root: str, types: list[str]) -> list[Finding]:
    """Say, per Python and machine of the sizing boxes, whether the wheelhouse of this
    checkout's sizing wheel is staged (boxes need S3 only) or a box needs the package index."""
    from burstcv.compute.runtime import build_sizing_wheel, sizing_tags, wheelhouse_uri

    wheel = build_sizing_wheel()
    wheel_uri = storage.join(artifact_root, "runtime", wheel.sha256, wheel.filename)
    tags = sizing_tags(backend.settings.sizing_python, types)
    staged = {t: u for t in tags if storage.exists(u := wheelhouse_uri(wheel_uri, t))}
    index_way = _index_way(backend)
    return [wheel_source(tag, staged.get(tag, ""), index_way) for tag in tags]


def _route_table_of(
    tables: list[dict[str, Any]], subnet_id: str, vpc_id: str
) -> dict[str, Any] | None:
    """Return the subnet's route table: its explicit association, else the VPC's main table."""
    for table in tables:
        if any(a.get("SubnetId") == subnet_id for a in table.get("Associations", [])):
            return table
    for table in tables:
        main = any(a.get("Main") for a in table.get("Associations", []))
        if main and table.get("VpcId") == vpc_id:
            return table
    return None


def check_bucket_region(artifact_root: str, region: str) -> list[Finding]:
    """Check the artifact bucket is in the run's region (else billed per GB each way, slower)."""
    if not storage.is_s3(artifact_root):
        return []
    bucket = _bucket(artifact_root)
    name = f"bucket {bucket} in the run's region {region}"
    try:  # HeadBucket needs only s3:ListBucket, and names the region even when it refuses
        response = storage.s3_client().head_bucket(Bucket=bucket)
    except ClientError as exc:
        response = exc.response
        if not _bucket_region(response):
            return [Finding(name, f"{_reason(exc)}; its region cannot be read")]
    where = _bucket_region(response) or "us-east-1"
    why = (
        f"it is in {where}: every shard, checkpoint and log would cross regions (billed per "
        f"GB, and no S3 gateway endpoint reaches it); use a bucket in {region} for "
        f"BURSTCV_ARTIFACT_ROOT, or set BURSTCV_EC2_REGION={where}"
    )
    return [Finding(name, "" if where == region else why)]


def _bucket_region(response: Any) -> str:
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    return str(response.get("BucketRegion") or headers.get("x-amz-bucket-region") or "")


# --- the default EBS encryption key -------------------------------------------------------------

# What a launch needs on a customer managed key that encrypts its volumes (AWS's EBS docs).
EBS_KMS_ACTIONS = (
    "kms:Decrypt",
    "kms:DescribeKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncrypt*",
)
# The same as IAM's simulator names them (no wildcard), with the context of a launch's grant.
EBS_KMS_SIMULATED = (
    "kms:CreateGrant",
    *EBS_KMS_ACTIONS[:-1],
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
)
GRANT_FOR_AWS_RESOURCE = {
    "ContextKeyName": "kms:GrantIsForAWSResource",
    "ContextKeyValues": ["true"],
    "ContextKeyType": "boolean",
}
SPOT_ROLE = "AWSServiceRoleForEC2Spot"


def own_principal(backend: Ec2Backend) -> str | None:
    """Return the IAM ARN burstcv calls AWS as, as IAM's policy simulator takes it."""
    return simulator_principal(str(backend.sts.get_caller_identity()["Arn"]))


def simulator_principal(arn: str) -> str | None:
    """Return the principal IAM's policy simulator takes for a caller ARN: the user, or the
    role behind an assumed-role session (its path, which the session ARN does not carry, is
    taken as /). None for the root user or a federated session."""
    parts = arn.split(":", 5)
    if len(parts) < 6:
        return None
    partition, service, account, resource = parts[1], parts[2], parts[4], parts[5]
    if service == "sts" and resource.startswith("assumed-role/"):
        return f"arn:{partition}:iam::{account}:role/{resource.split('/')[1]}"
    if resource.startswith("user/"):
        return f"arn:{partition}:iam::{account}:{resource}"
    return None


def _spot_role_on_key(kms: Any, key_arn: str) -> str:
    """Return "" when the key's policy names the Spot service-linked role, else what to do."""
    fix = (
        "for spot, add a key policy statement letting the role AWSServiceRoleForEC2Spot use "
        "the key (docs/aws.md)"
    )
    try:
        policy = str(kms.get_key_policy(KeyId=key_arn, PolicyName="default")["Policy"])
    except ClientError as exc:
        return f"{fix}; its policy could not be read ({_reason(exc)}: allow kms:GetKeyPolicy)"
    return "" if SPOT_ROLE in policy else f"its key policy does not name {SPOT_ROLE}: {fix}"


def check_ebs_key(backend: Ec2Backend, use_spot: bool) -> list[Finding]:
    """Check which KMS key encrypts the boxes' volumes, and what a customer managed one needs.
    A default EBS key the launcher (and, for spot, the Spot role) may not use gets the instance
    terminated during launch (``Client.InvalidKMSKey.InvalidState``)."""
    ec2 = backend.client
    by_default = bool(ec2.get_ebs_encryption_by_default()["EbsEncryptionByDefault"])
    key_id = str(ec2.get_ebs_default_kms_key_id()["KmsKeyId"])
    kms = backend._aws_client("kms")
    try:
        meta = kms.describe_key(KeyId=key_id)["KeyMetadata"]
    except ClientError as exc:
        why = f"{_reason(exc)}; allow kms:DescribeKey on the account's keys"
        return [Finding(f"default EBS encryption key {key_id}", why)]
    arn = str(meta.get("Arn", key_id))
    if meta.get("KeyManager") == "AWS":
        on = "on" if by_default else "off"
        name = (
            f"default EBS encryption key: AWS managed key (encryption by default {on}; "
            "burstcv encrypts its volumes either way)"
        )
        return [Finding(name)]
    name = f"default EBS encryption key {arn} (customer managed)"
    principal = own_principal(backend)
    problems = [_own_key_problem(backend, principal, arn)]
    if use_spot:
        problems.append(_spot_role_on_key(kms, arn))
    if missing := "; ".join(p for p in problems if p):
        return [Finding(name, missing)]
    spot_ok = f", and its key policy names {SPOT_ROLE}" if use_spot else ""
    return [Finding(f"{name}: {principal} may use it for the boxes' volumes{spot_ok}")]


def _own_key_problem(backend: Ec2Backend, principal: str | None, arn: str) -> str:
    """Return why ``principal`` may not use the key for a launch, by its IAM policies ("" if it
    may); a key policy naming it is not read."""
    grants = (
        f"add to the orchestrator's policy (deploy/iam-policy.json) "
        f"{', '.join(EBS_KMS_ACTIONS)} and kms:CreateGrant (with the condition "
        f"kms:GrantIsForAWSResource=true) on {arn}"
    )
    if principal is None:
        return (
            f"not checked: burstcv calls AWS as neither a user nor a role; {grants}, or name "
            "this identity in the key's policy"
        )
    wanted = [(action, arn) for action in EBS_KMS_SIMULATED]
    iam = backend._aws_client("iam")
    try:
        refused = _refused(iam, principal, wanted, ContextEntries=[GRANT_FOR_AWS_RESOURCE])
    except ClientError as exc:
        return (
            f"not checked ({_reason(exc)}: allow iam:SimulatePrincipalPolicy on "
            f"{principal}, deploy/iam-policy.json SimulateItself); {grants}"
        )
    if refused:
        uses = ", ".join(f"{action} ({decision})" for action, _, decision in refused)
        return (
            f"{principal} may not {uses} by its IAM policies: {grants} "
            "(or name it in the key's policy)"
        )
    return ""


def check_spot_role(backend: Ec2Backend) -> list[Finding]:
    """Check the EC2 Spot service-linked role exists (a first spot launch needs it)."""
    name = f"Spot service-linked role {SPOT_ROLE}"
    try:
        backend._aws_client("iam").get_role(RoleName=SPOT_ROLE)
    except ClientError as exc:
        why = (
            "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com"
            if _error_code(exc) == "NoSuchEntity"
            else f"{_reason(exc)}; allow iam:GetRole on {SPOT_ROLE}"
        )
        return [Finding(name, why)]
    return [Finding(name)]


def check_prices(
    backend: Ec2Backend, plan: list[LaunchAttempt], artifact_root: str
) -> list[Finding]:
    """Quote every candidate type and market as a run does (AWS, the store, the bundled table)."""
    region = backend.settings.region
    sources = backend.price_sources(artifact_root)
    findings = []
    for option in plan:
        found = quote(option.instance_type, region, option.market, sources)
        name = f"price {option.instance_type} {option.market} in {region}"
        if found is not None:
            findings.append(Finding(f"{name}: ${found.usd_per_hour:.4f}/h ({found.source})"))
            continue
        if option.market == "on-demand":
            api = "pricing:GetProducts"
            where = (
                f"{api} in {' or '.join(PRICING_API_REGIONS)}, the Price List API's endpoints; "
                "a policy that denies other regions must leave it one of them"
            )
        else:
            api = "ec2:DescribeSpotPriceHistory"
            where = f"{api} in {region}"
        why = (
            f"neither AWS ({api}) nor the bundled table prices it: allow {where} to the "
            "orchestrator (deploy/iam-policy.json), or set BURSTCV_PRICE_TABLE to a table "
            f"that prices {option.instance_type} {option.market} in {region}"
        )
        findings.append(Finding(name, why))
    return findings


def check_serving_prices(
    backend: Ec2Backend, families: list[str], artifact_root: str
) -> list[Finding]:
    """Quote the serving fleet's CPU types as a run does: a type nobody prices leaves every
    run's fleet unpriced (never a rejected model), so it is named with what to set."""
    from burstcv.cost.budget import serving_quotes

    region = backend.settings.region
    quotes, unpriced = serving_quotes(families, region, backend.price_sources(artifact_root))
    findings = [
        Finding(f"serving price {q.instance_type} on-demand in {region}: ${q.usd_per_hour:.4f}/h")
        for q in quotes
    ]
    if unpriced:
        findings.append(Finding(f"serving prices ({', '.join(families)}) in {region}", unpriced))
    return findings


def check_launch_of(budget_s: int = 3600) -> Launch:
    """Return the launch the check dry-runs: the deployment's types and spot choice."""
    return Launch(
        run=RunRef(airflow_run_id=CHECK_RUN, run_key=CHECK_RUN),
        dag_id=CHECK_RUN,
        job_uri="s3://check/job.json",
        time_budget_s=budget_s,
        instance_types=[],  # the backend's: BURSTCV_EC2_INSTANCE_TYPES
        use_spot=None,  # the backend's: BURSTCV_EC2_USE_SPOT
        deadline_at=lineage.utc_now() + timedelta(seconds=budget_s),
        wheel_uri="",
        wheel_sha256="",
    )


def check_cluster_calls(backend: Ec2Backend, launch: Launch) -> list[Finding]:
    """Make a run's placement and security groups, dry-run its launch into them, delete them.
    Made for real (free): no dry run shows the policy's tag conditions. Tagged with the check's
    expiry, so the reaper removes them should the delete fail."""
    label = f"a run of {launch.count} boxes"
    subnet = backend.launch_subnets()[0]
    try:
        findings = _made_cluster(backend, launch, subnet, label)
    finally:
        left = backend.remove_cluster(launch.run.run_key)
    why = (
        f"{left}: allow ec2:DeleteSecurityGroup and ec2:DeletePlacementGroup on the groups "
        "a run tags (deploy/iam-policy.json); the reaper removes these after "
        f"{format_expiry(launch.deadline_at)}"
    )
    return [*findings, Finding(f"{label}: its groups deleted", why if left else "")]


def _made_cluster(backend: Ec2Backend, launch: Launch, subnet: Subnet, label: str) -> list[Finding]:
    try:
        cluster = backend.ensure_cluster(launch, launch.deadline_at, subnet)
    except ClientError as exc:
        why = "allow it on the groups a run tags (deploy/iam-policy.json), or train on one box"
        return [Finding(f"{label}: ec2:{exc.operation_name}", f"{_reason(exc)}: {why}")]
    made = Finding(
        f"{label}: placement group {cluster.placement_group} and security group "
        f"{cluster.security_group_id} made, its members' ingress opened"
    )
    image_id = backend.resolve_ami()
    base = backend._run_params(launch, image_id, "#!/bin/bash\n", launch.deadline_at, 1)
    option = backend.plan(launch)[0]
    name = (
        f"dry-run launch {launch.count} x {option.instance_type} {option.market} "
        f"into placement group {cluster.placement_group}"
    )
    return [made, Finding(name, backend.dry_run_refusal(in_cluster(base, cluster), option, subnet))]


def no_s3_cause(backend: Ec2Backend, instance_id: str, artifact_root: str) -> str:
    """Return the likeliest reason a box could not reach S3, read from the account's side.
    EC2 forgets a terminated box's network: then what a launch gives is checked instead."""
    inst = next(iter(backend._instances([], [instance_id])), {})
    groups = [str(g["GroupId"]) for g in inst.get("SecurityGroups", [])]
    if groups:
        described = backend.client.describe_security_groups(GroupIds=groups)["SecurityGroups"]
        s3_lists = _s3_prefix_lists(backend)
        rules = [rule for g in described for rule in g.get("IpPermissionsEgress", [])]
        if not any(_https_egress(rule, s3_lists) for rule in rules):
            return (
                f"no egress rule of its security group(s) {', '.join(groups)} lets HTTPS out "
                "to S3 (burstcv aws check names the rule to add)"
            )
    elif blocked := _first_missing(check_security_group_egress(backend)):
        return blocked
    zone = str(inst.get("Placement", {}).get("AvailabilityZone", ""))
    routes = check_subnet_routes(backend)
    if route := _first_missing(f for f in routes if not zone or f"({zone})" in f.name):
        return route
    if role := _first_missing(check_instance_role_s3(backend, artifact_root)):
        return role
    return (
        "its security groups, route and role look right from here: read its console output "
        f"(aws ec2 get-console-output --instance-id {instance_id} --latest)"
    )


def _first_missing(findings: Iterable[Finding]) -> str:
    return next((f"{f.name}: {f.missing}" for f in findings if not f.ok), "")


def _guarded(
    label: str, check: Callable[P, list[Finding]], *args: P.args, **kwargs: P.kwargs
) -> list[Finding]:
    """Run one check; a refusal or an unreachable service becomes its MISSING line."""
    try:
        return check(*args, **kwargs)
    except (ClientError, BotoCoreError, LaunchCheckError) as exc:
        return [Finding(label, f"{_reason(exc)}; see docs/aws.md")]


def _launch_and_store(backend: Ec2Backend, settings: Settings) -> list[Finding]:
    """Dry-run every launch option and the backstop; probe the S3 prefixes a run writes."""
    s = backend.settings
    findings: list[Finding] = []
    try:
        for option, refused in backend.check_launch(check_launch_of()):
            name = f"dry-run launch {option.instance_type} {option.market}"
            findings.append(Finding(name, refused))
    except (ClientError, BotoCoreError, ValueError) as exc:
        findings.append(Finding(f"AMI {s.ami}", f"{_reason(exc)}; check BURSTCV_EC2_AMI"))
    backstop = f"backstop schedule (role {s.backstop_role})"
    findings.append(Finding(backstop, backend.check_backstop()))
    findings += check_s3_prefix("artifact store", storage.join(settings.artifact_root, "runs"))
    registry_aliases = storage.join(settings.registry_uri, settings.model_name, "aliases")
    findings += check_s3_prefix("registry", registry_aliases)
    # What a training box needs beyond the launch: its role, and a store it can reach.
    try:
        findings.append(Finding(f"instance profile {s.required_instance_profile()}"))
    except ValueError as exc:
        findings.append(Finding("instance profile", str(exc)))
    why = "set BURSTCV_ARTIFACT_ROOT=s3://bucket/prefix for the ec2 backend"
    store_ok = storage.is_s3(settings.artifact_root)
    return [*findings, Finding(f"artifact store {settings.artifact_root}", "" if store_ok else why)]


def check_account(
    settings: Settings,
    ec2: Ec2Settings | None = None,
    *,
    num_nodes: int = 1,
    serving_families: list[str] | None = None,
) -> list[Finding]:
    """Return every finding: identity, launches, backstop, S3, role, quotas, network, prices."""
    backend = Ec2Backend(ec2 or Ec2Settings())
    s = backend.settings
    try:
        account = backend.sts.get_caller_identity()["Account"]
    except (ClientError, BotoCoreError) as exc:
        return [Finding("credentials", f"{_reason(exc)}; see docs/aws.md, the connection")]
    findings = [Finding(f"credentials (account {account}, region {s.region})")]
    findings += _launch_and_store(backend, settings)
    # Unseen by a dry run: each fails a run once billed, or (quotas) looks like no capacity.
    root = settings.artifact_root
    plan = launch_plan(s.instance_types, s.use_spot)
    findings += _guarded("vCPU quotas", check_vcpu_quotas, backend, settings, num_nodes=num_nodes)
    # The sizing boxes (one on-demand CPU box per candidate serving type) share the role.
    sizing = sizing_candidates(serving_families or [])
    findings += _guarded(
        "training role's S3 access", check_instance_role_s3, backend, root, sizing=bool(sizing)
    )
    if sizing:
        quota = "sizing boxes' vCPU quota"
        findings += _guarded(quota, check_sizing_quota, backend, settings, sizing)
        findings += _guarded("sizing boxes' launches", check_sizing_launches, backend, sizing)
        findings += _guarded("sizing boxes' wheels", check_sizing_wheels, backend, root, sizing)
    findings += _guarded("route to S3", check_subnet_routes, backend)
    findings += _guarded("HTTPS egress to S3", check_security_group_egress, backend)
    if num_nodes > 1:
        launch = check_launch_of().model_copy(update={"count": num_nodes})
        findings += _guarded("a run of several boxes", check_cluster_calls, backend, launch)
    findings += _guarded("bucket region", check_bucket_region, root, s.region)
    findings += _guarded("default EBS encryption key", check_ebs_key, backend, s.use_spot)
    if s.use_spot:
        findings += _guarded(f"Spot service-linked role {SPOT_ROLE}", check_spot_role, backend)
    findings += _guarded("prices", check_prices, backend, plan, root)
    if serving_families:
        findings += _guarded(
            "serving prices", check_serving_prices, backend, serving_families, root
        )
    return findings
