"""Check an AWS account is ready for burstcv without renting anything: ``burstcv aws check``.

Every check is free: launches are dry runs, the backstop schedule is created disabled and
deleted at once, and the S3 checks write, read, list and delete one small probe object under
the prefixes the pipeline writes (the run folders and the registry's aliases). The rest only
reads: the vCPU quotas of the candidate types' families, the training role's S3 access (IAM's
policy simulator), each launch subnet's route to S3, the bucket's region, the default EBS
encryption key, the Spot service-linked role and a price for every type and market. Each
check yields one line or a few: ``ok``, or ``MISSING`` with the command or setting that fixes it.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from burstcv import lineage
from burstcv.compute.ec2 import (
    Ec2Backend,
    LaunchAttempt,
    LaunchCheckError,
    Subnet,
    format_expiry,
    in_cluster,
    launch_plan,
)
from burstcv.cost.pricing import PRICING_API_REGIONS
from burstcv.cost.quotes import quote
from burstcv.settings import Ec2Settings, Settings
from burstcv_spec import storage
from burstcv_spec.contracts import Launch, RunRef

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


# --- vCPU quotas ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VcpuQuota:
    """Name the two EC2 quotas (Service Quotas codes) that count one family's vCPUs in a region.

    ``spot_family``: the spot quota's own name where it differs (P5's spot quota is its own;
    its on-demand one is every P family's).
    """

    family: str
    on_demand: str
    spot: str
    spot_family: str | None = None

    def code(self, market: str) -> str:
        """Return the quota code of ``market`` (spot or on-demand)."""
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
    """Return the vCPUs an EC2 quota allows in the region: the applied value, else the default.

    Service Quotas answers NoSuchResourceException for a quota the account never had applied
    (never raised): the default then holds, which is not always 0. Neither: 0, nothing runs.
    """
    for read in (quotas.get_service_quota, quotas.get_aws_default_service_quota):
        try:
            return float(read(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except ClientError as exc:
            if _code(exc) != "NoSuchResourceException":
                raise
    return 0.0


def check_vcpu_quotas(
    backend: Ec2Backend, settings: Settings, *, num_nodes: int = 1
) -> list[Finding]:
    """Compare each market's vCPU quota of each family with the largest candidate's vCPUs.

    A new account has 0 vCPUs of G and VT and of P instances, on demand and spot: every
    launch is refused (``VcpuLimitExceeded``) until an increase is granted. Only the markets
    the settings use are checked; the increase asked for fits BURSTCV_GPU_POOL_SLOTS boxes.
    """
    s = backend.settings
    plan = launch_plan(s.instance_types, s.use_spot)
    described = backend.client.describe_instance_types(InstanceTypes=list(s.instance_types))
    vcpus = {
        t["InstanceType"]: int(t["VCpuInfo"]["DefaultVCpus"]) for t in described["InstanceTypes"]
    }
    quotas = backend._aws_client("service-quotas")  # the backend's connection and region
    findings: list[Finding] = []
    # One entry per quota code (P5 and P4 on demand share one): its family, the largest type.
    needs: dict[str, tuple[str, str, int]] = {}
    for option in plan:
        family = vcpu_quota_of(option.instance_type)
        if family is None:
            findings.append(
                Finding(
                    f"vCPU quota of {option.instance_type} {option.market}",
                    "not a G, VT, P or standard family: find its quota in Service Quotas "
                    f"(Amazon EC2) for {s.region} and check it yourself",
                )
            )
            continue
        if option.instance_type not in vcpus:
            findings.append(
                Finding(
                    f"vCPU quota of {option.instance_type} {option.market}",
                    f"EC2 does not describe {option.instance_type} in {s.region}; check "
                    "BURSTCV_EC2_INSTANCE_TYPES",
                )
            )
            continue
        code = family.code(option.market)
        largest = needs.get(code)
        if largest is None or vcpus[option.instance_type] > largest[2]:
            label = f"{family.name(option.market)} {option.market}"
            needs[code] = (label, option.instance_type, vcpus[option.instance_type])
    for code, (label, instance_type, need) in needs.items():
        name = f"vCPU quota {label} ({code}) in {s.region}"
        try:
            value = _quota_value(quotas, code)
        except ClientError as exc:
            findings.append(
                Finding(
                    name,
                    f"{_reason(exc)}; allow servicequotas:GetServiceQuota and "
                    "servicequotas:GetAWSDefaultServiceQuota",
                )
            )
            continue
        run_need = need * num_nodes  # a launch starts every box of the run at once
        boxes = f"{num_nodes} x {instance_type}" if num_nodes > 1 else f"a {instance_type}"
        if value >= run_need:
            findings.append(Finding(f"{name}: {value:g} vCPUs, {boxes} needs {run_need}"))
            continue
        # The GPU pool bounds the boxes that exist at once (a run takes a slot per box).
        slots = max(settings.gpu_pool_slots, num_nodes, 1)
        desired = need * slots
        findings.append(
            Finding(
                name,
                f"{value:g} vCPUs, {boxes} needs {run_need}; ask for {desired} "
                f"({slots} boxes at once, BURSTCV_GPU_POOL_SLOTS): aws "
                f"service-quotas request-service-quota-increase --service-code ec2 "
                f"--quota-code {code} --desired-value {desired} --region {s.region}",
            )
        )
    return findings


# --- the training role's own S3 access ----------------------------------------------------------

CHECK_RUN = "burstcv-check"  # the run name in the objects the simulation asks about
S3_READ, S3_WRITE, S3_LIST = "s3:GetObject", "s3:PutObject", "s3:ListBucket"


def _s3_arn(uri: str) -> str:
    return "arn:aws:s3:::" + uri.removeprefix("s3://")


KMS_USE = ("kms:Decrypt", "kms:GenerateDataKey")  # read and write SSE-KMS objects


def instance_role_requests(
    artifact_root: str, kms_key_arn: str | None = None
) -> list[tuple[str, str]]:
    """Return the (action, resource ARN) pairs a training box needs under ``artifact_root``.

    It reads its job, its shards and the training wheel (and pretrained weights kept in the
    store), writes its checkpoints, metrics, markers and logs into its run's job folder, and
    lists the bucket so that a marker not yet written answers 404, not 403. A bucket that
    encrypts with a customer managed KMS key by default needs that key's use too.
    """
    run = storage.join(artifact_root, "runs", CHECK_RUN)
    bucket = artifact_root.removeprefix("s3://").split("/", 1)[0]
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
    return [
        *((S3_READ, _s3_arn(uri)) for uri in reads),
        *((S3_WRITE, _s3_arn(uri)) for uri in writes),
        (S3_LIST, f"arn:aws:s3:::{bucket}"),
        *((action, kms_key_arn) for action in KMS_USE if kms_key_arn),
    ]


def bucket_kms_key(backend: Ec2Backend, artifact_root: str) -> str | None:
    """Return the customer managed KMS key the bucket encrypts new objects with by default.

    None for SSE-S3, no default, or an AWS managed key (aws/s3, which S3 uses for anyone the
    bucket lets write). A customer managed key is used only by principals its policies allow:
    a box without kms:Decrypt and kms:GenerateDataKey on it can neither read its job nor
    write its FAILED marker.
    """
    bucket = artifact_root.removeprefix("s3://").split("/", 1)[0]
    try:
        config = backend._aws_client("s3").get_bucket_encryption(Bucket=bucket)
    except ClientError as exc:
        if _code(exc) == "ServerSideEncryptionConfigurationNotFoundError":
            return None
        raise
    for rule in config["ServerSideEncryptionConfiguration"].get("Rules", []):
        default = rule.get("ApplyServerSideEncryptionByDefault", {})
        key = default.get("KMSMasterKeyID")
        if not str(default.get("SSEAlgorithm", "")).startswith("aws:kms") or not key:
            continue
        meta = backend._aws_client("kms").describe_key(KeyId=key)["KeyMetadata"]
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


def check_instance_role_s3(backend: Ec2Backend, artifact_root: str) -> list[Finding]:
    """Ask IAM's policy simulator whether the training role may read and write its run's files.

    The role is the one behind BURSTCV_EC2_INSTANCE_PROFILE. A box without these rights boots,
    is billed, and fails at its first S3 call; the dry-run launch cannot see it.
    """
    profile = backend.settings.instance_profile
    if not profile or not storage.is_s3(artifact_root):
        return []  # the instance profile and artifact store lines already say what to set
    iam = backend._aws_client("iam")
    profile_name = profile.rsplit("/", 1)[-1]
    name = f"training role's S3 access under {artifact_root}"
    try:
        roles = iam.get_instance_profile(InstanceProfileName=profile_name)["InstanceProfile"][
            "Roles"
        ]
    except ClientError as exc:
        if _code(exc) == "NoSuchEntity":
            return [
                Finding(name, f"no instance profile {profile_name}: create it (docs/aws.md, IAM)")
            ]
        return [Finding(name, f"{_reason(exc)}; allow iam:GetInstanceProfile on {profile_name}")]
    if not roles:
        return [
            Finding(
                name,
                f"instance profile {profile_name} holds no role: aws iam "
                f"add-role-to-instance-profile --instance-profile-name {profile_name} "
                "--role-name burstcv-training",
            )
        ]
    role_arn = str(roles[0]["Arn"])
    name = f"training role {role_arn.rsplit('/', 1)[-1]}: S3 access under {artifact_root}"
    try:
        key = bucket_kms_key(backend, artifact_root)
    except ClientError as exc:
        return [
            Finding(
                name,
                f"{_reason(exc)}; allow s3:GetEncryptionConfiguration on the bucket and "
                "kms:DescribeKey (deploy/iam-policy.json)",
            )
        ]
    if key:
        name += f" (the bucket's default key {key})"
    wanted = instance_role_requests(artifact_root, key)
    try:
        pages = iam.get_paginator("simulate_principal_policy").paginate(
            PolicySourceArn=role_arn,
            ActionNames=sorted({action for action, _ in wanted}),
            ResourceArns=sorted({resource for _, resource in wanted}),
        )
        decisions = _simulated_decisions(r for page in pages for r in page["EvaluationResults"])
    except ClientError as exc:
        return [Finding(name, f"{_reason(exc)}; allow iam:SimulatePrincipalPolicy on {role_arn}")]
    under_root = _s3_arn(artifact_root) + "/"
    refused = [
        f"{action} on {resource.removeprefix(under_root).removeprefix('arn:aws:s3:::')}"
        f" ({decisions.get((action, resource), 'not simulated')})"
        for action, resource in wanted
        if decisions.get((action, resource)) != "allowed"
    ]
    if not refused:
        return [Finding(name)]
    fix = "give it deploy/instance-role-policy.json (docs/aws.md, the training instance's role)"
    if key and any(line.startswith(KMS_USE) for line in refused):
        fix += (
            f", and {' and '.join(KMS_USE)} on {key} (the bucket encrypts with it by default: "
            "without them a box can neither read its job nor write its FAILED marker)"
        )
    return [Finding(name, f"the role may not {'; '.join(refused)}: {fix}")]


# --- network: a route from each launch subnet to S3 ---------------------------------------------


def _s3_route(
    table: dict[str, Any], s3_endpoints: dict[str, set[str]], public_ip: bool, region: str
) -> tuple[str, str]:
    """Return (how the table reaches S3, "") or ("", why it does not)."""
    table_id = str(table["RouteTableId"])
    for endpoint_id, tables in s3_endpoints.items():
        if table_id in tables:
            return f"S3 gateway endpoint {endpoint_id}", ""
    routes = [r for r in table.get("Routes", []) if r.get("State") != "blackhole"]
    for route in routes:
        if str(route.get("GatewayId", "")) in s3_endpoints:
            return f"S3 gateway endpoint {route['GatewayId']}", ""
    default = [r for r in routes if r.get("DestinationCidrBlock") == "0.0.0.0/0"]
    for route in default:
        if route.get("NatGatewayId"):
            # Works, at a price: a NAT gateway bills each GB it carries, and every box's S3
            # traffic (shards, wheel, checkpoints) goes through it; a gateway endpoint is free.
            return (
                f"NAT gateway {route['NatGatewayId']}, billed per GB: every box's shard "
                "download, wheel and checkpoints pass through it; an S3 gateway endpoint "
                f"carries them free (aws ec2 create-vpc-endpoint --vpc-id {table['VpcId']} "
                f"--service-name com.amazonaws.{region}.s3 --route-table-ids {table_id})",
                "",
            )
    for route in default:
        gateway = str(route.get("GatewayId", ""))
        if gateway.startswith("igw-"):
            if public_ip:
                return f"internet gateway {gateway} (public IPs on launch)", ""
            return "", (
                f"its route table {table_id} goes to internet gateway {gateway}, but the subnet "
                "gives instances no public IP: turn on its auto-assign public IPv4 address "
                "(aws ec2 modify-subnet-attribute --map-public-ip-on-launch --subnet-id …), "
                "or add an S3 gateway endpoint"
            )
    for route in default:
        for target in ("TransitGatewayId", "NetworkInterfaceId", "InstanceId"):
            if route.get(target):
                return f"default route via {route[target]} (not followed further)", ""
    return "", f"its route table {table_id} has no S3 gateway endpoint, NAT or internet gateway"


def _s3_routing(
    backend: Ec2Backend, vpcs: list[str]
) -> tuple[list[dict[str, Any]], dict[str, set[str]]]:
    """Return the VPCs' route tables and their S3 gateway endpoints (id: its route tables)."""
    ec2, region = backend.client, backend.settings.region
    tables = [
        t
        for page in ec2.get_paginator("describe_route_tables").paginate(
            Filters=[{"Name": "vpc-id", "Values": vpcs}]
        )
        for t in page["RouteTables"]
    ]
    endpoints = ec2.describe_vpc_endpoints(
        Filters=[
            {"Name": "vpc-id", "Values": vpcs},
            {"Name": "service-name", "Values": [f"com.amazonaws.{region}.s3"]},
            {"Name": "vpc-endpoint-type", "Values": ["Gateway"]},
        ]
    )["VpcEndpoints"]
    s3_endpoints = {
        str(e["VpcEndpointId"]): set(e.get("RouteTableIds", []))
        for e in endpoints
        if e.get("State", "available").lower() == "available"
    }
    return tables, s3_endpoints


def check_subnet_routes(backend: Ec2Backend) -> list[Finding]:
    """Check every subnet a launch may use can reach S3 (the box's job, wheel and results).

    The table is the subnet's explicit association, else its VPC's main table; S3 is reached
    through an S3 gateway endpoint, a NAT gateway, or an internet gateway with a public IP.
    """
    region = backend.settings.region
    subnets: list[Subnet] = backend.launch_subnets()
    ids = [sub.subnet_id for sub in subnets if sub.subnet_id]
    findings = [
        Finding(
            "route to S3",
            f"{region} has no default VPC: set BURSTCV_EC2_SUBNET_IDS to subnets with a route "
            "to S3 (docs/aws.md, network)",
        )
        for sub in subnets
        if not sub.subnet_id
    ]
    if not ids:
        return findings
    ec2 = backend.client
    described = {s["SubnetId"]: s for s in ec2.describe_subnets(SubnetIds=ids)["Subnets"]}
    vpcs = sorted({str(s["VpcId"]) for s in described.values()})
    tables, s3_endpoints = _s3_routing(backend, vpcs)
    for sub in subnets:
        if not sub.subnet_id:
            continue
        info = described[sub.subnet_id]
        name = f"route to S3 from subnet {sub}"
        table = _route_table_of(tables, sub.subnet_id, str(info["VpcId"]))
        if table is None:
            findings.append(Finding(name, f"VPC {info['VpcId']} has no main route table"))
            continue
        public_ip = bool(info.get("MapPublicIpOnLaunch"))
        via, missing = _s3_route(table, s3_endpoints, public_ip, region)
        if via:
            findings.append(Finding(f"{name} via {via}"))
            continue
        findings.append(
            Finding(
                name,
                f"{missing}: aws ec2 create-vpc-endpoint --vpc-id {info['VpcId']} --service-name "
                f"com.amazonaws.{region}.s3 --route-table-ids {table['RouteTableId']} "
                f"--region {region} (free), or a NAT gateway",
            )
        )
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
    found = backend.client.describe_prefix_lists(
        Filters=[{"Name": "prefix-list-name", "Values": [name]}]
    )["PrefixLists"]
    return {str(p["PrefixListId"]) for p in found}


def check_security_group_egress(backend: Ec2Backend) -> list[Finding]:
    """Check the security groups a training box gets let it reach S3 over HTTPS.

    A box gets BURSTCV_EC2_SECURITY_GROUP_IDS, else its VPC's default group. Accounts that
    follow CIS 4.3 (AWS Config ``vpc-default-security-group-closed``) strip the default group
    of every rule: a box there reaches nothing, cannot even write its FAILED marker, and would
    be paid for until its boot bound. Egress is the union of the groups' rules.
    """
    s = backend.settings
    ec2 = backend.client
    s3_lists = _s3_prefix_lists(backend)
    if s.security_group_ids:
        groups = ec2.describe_security_groups(GroupIds=list(s.security_group_ids))
        sets = {"BURSTCV_EC2_SECURITY_GROUP_IDS": groups["SecurityGroups"]}
    else:
        vpcs = sorted({sub.vpc_id for sub in backend.launch_subnets() if sub.vpc_id})
        sets = {}
        for vpc in vpcs:
            found = ec2.describe_security_groups(
                Filters=[
                    {"Name": "vpc-id", "Values": [vpc]},
                    {"Name": "group-name", "Values": ["default"]},
                ]
            )["SecurityGroups"]
            sets[f"the default security group of {vpc}"] = found
    findings = []
    for label, groups in sets.items():
        ids = [str(g["GroupId"]) for g in groups]
        name = f"HTTPS egress to S3 from {label} ({', '.join(ids)})"
        reaches = [
            f"{where} ({g['GroupId']})"
            for g in groups
            for rule in g.get("IpPermissionsEgress", [])
            if (where := _https_egress(rule, s3_lists))
        ]
        if reaches:
            findings.append(Finding(f"{name}: to {reaches[0]}"))
            continue
        s3_list = sorted(s3_lists)[0] if s3_lists else "<the S3 prefix list>"
        rule = f"IpProtocol=tcp,FromPort=443,ToPort=443,PrefixListIds=[{{PrefixListId={s3_list}}}]"
        findings.append(
            Finding(
                name,
                "no egress rule lets a box reach S3 over HTTPS (a box could not read its job "
                "nor write its FAILED marker): aws ec2 authorize-security-group-egress "
                f"--group-id {ids[0] if ids else '<group>'} --ip-permissions '{rule}' "
                f"--region {s.region}, or set BURSTCV_EC2_SECURITY_GROUP_IDS to a group with "
                "such a rule",
            )
        )
    return findings


def _route_table_of(
    tables: list[dict[str, Any]], subnet_id: str, vpc_id: str
) -> dict[str, Any] | None:
    """Return the subnet's route table: its explicit association, else the VPC's main table."""
    for table in tables:
        if any(a.get("SubnetId") == subnet_id for a in table.get("Associations", [])):
            return table
    for table in tables:
        if table.get("VpcId") == vpc_id and any(
            a.get("Main") for a in table.get("Associations", [])
        ):
            return table
    return None


# --- the bucket's region --------------------------------------------------------------------------


def check_bucket_region(artifact_root: str, region: str) -> list[Finding]:
    """Check the artifact bucket is in the run's region.

    Asked with HeadBucket, which needs only s3:ListBucket (the orchestrator has it) and
    answers with the bucket's region (``x-amz-bucket-region``) even when it refuses. A bucket
    elsewhere is reached across regions: billed per GB each way, slower, and never through
    an S3 gateway endpoint (it serves its own region's buckets only).
    """
    if not storage.is_s3(artifact_root):
        return []
    bucket = artifact_root.removeprefix("s3://").split("/", 1)[0]
    name = f"bucket {bucket} in the run's region {region}"
    try:
        response = storage.s3_client().head_bucket(Bucket=bucket)
    except ClientError as exc:
        response = exc.response
        if not _bucket_region(response):
            return [Finding(name, f"{_reason(exc)}; its region cannot be read")]
    where = _bucket_region(response) or "us-east-1"
    if where == region:
        return [Finding(name)]
    return [
        Finding(
            name,
            f"it is in {where}: every shard, checkpoint and log would cross regions (billed per "
            f"GB, and no S3 gateway endpoint reaches it); use a bucket in {region} for "
            f"BURSTCV_ARTIFACT_ROOT, or set BURSTCV_EC2_REGION={where}",
        )
    ]


def _bucket_region(response: Any) -> str:
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    return str(response.get("BucketRegion") or headers.get("x-amz-bucket-region") or "")


# --- the default EBS encryption key -------------------------------------------------------------

# What a launch needs on a customer managed key that encrypts its volumes (AWS's EBS docs),
# besides kms:CreateGrant with kms:GrantIsForAWSResource=true.
EBS_KMS_ACTIONS = (
    "kms:Decrypt",
    "kms:DescribeKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncrypt*",
)


# The same, as IAM's policy simulator names them (it takes no wildcard), and the context a
# launch's grant carries.
EBS_KMS_SIMULATED = (
    "kms:CreateGrant",
    "kms:Decrypt",
    "kms:DescribeKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
)
GRANT_FOR_AWS_RESOURCE = {
    "ContextKeyName": "kms:GrantIsForAWSResource",
    "ContextKeyValues": ["true"],
    "ContextKeyType": "boolean",
}


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


def _refused_key_uses(backend: Ec2Backend, principal: str, key_arn: str) -> list[str]:
    """Return the launch's uses of ``key_arn`` IAM's simulator refuses ``principal``."""
    results = backend._aws_client("iam").simulate_principal_policy(
        PolicySourceArn=principal,
        ActionNames=list(EBS_KMS_SIMULATED),
        ResourceArns=[key_arn],
        ContextEntries=[GRANT_FOR_AWS_RESOURCE],
    )["EvaluationResults"]
    decisions = _simulated_decisions(results)
    return [
        f"{action} ({decisions.get((action, key_arn), 'not simulated')})"
        for action in EBS_KMS_SIMULATED
        if decisions.get((action, key_arn)) != "allowed"
    ]


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

    burstcv asks for an encrypted root volume without naming a key, so EC2 uses the account's
    default EBS key: the AWS managed ``aws/ebs`` needs nothing; a customer managed key needs
    the launching identity (and, for spot, the Spot service-linked role) allowed to use it, or
    the instance is terminated during launch (``Client.InvalidKMSKey.InvalidState``). Whether
    this identity may is asked of IAM's policy simulator (its own identity policies); whether
    the Spot role may, of the key's policy.
    """
    ec2 = backend.client
    by_default = bool(ec2.get_ebs_encryption_by_default()["EbsEncryptionByDefault"])
    key_id = str(ec2.get_ebs_default_kms_key_id()["KmsKeyId"])
    kms = backend._aws_client("kms")
    name = f"default EBS encryption key {key_id}"
    try:
        meta = kms.describe_key(KeyId=key_id)["KeyMetadata"]
    except ClientError as exc:
        return [Finding(name, f"{_reason(exc)}; allow kms:DescribeKey on the account's keys")]
    arn = str(meta.get("Arn", key_id))
    if meta.get("KeyManager") == "AWS":
        account_default = "on" if by_default else "off"
        return [
            Finding(
                f"default EBS encryption key: AWS managed key (encryption by default "
                f"{account_default}; burstcv encrypts its volumes either way)"
            )
        ]
    name = f"default EBS encryption key {arn} (customer managed)"
    grants = (
        f"add to the orchestrator's policy (deploy/iam-policy.json) "
        f"{', '.join(EBS_KMS_ACTIONS)} and kms:CreateGrant (with the condition "
        f"kms:GrantIsForAWSResource=true) on {arn}"
    )
    problems = []
    principal = own_principal(backend)
    if principal is None:
        problems.append(
            f"not checked: burstcv calls AWS as neither a user nor a role; {grants}, or name "
            "this identity in the key's policy"
        )
    else:
        try:
            refused = _refused_key_uses(backend, principal, arn)
        except ClientError as exc:
            problems.append(
                f"not checked ({_reason(exc)}: allow iam:SimulatePrincipalPolicy on "
                f"{principal}, deploy/iam-policy.json SimulateItself); {grants}"
            )
        else:
            if refused:
                problems.append(
                    f"{principal} may not {', '.join(refused)} by its IAM policies: {grants} "
                    "(or name it in the key's policy)"
                )
    if use_spot:
        spot = _spot_role_on_key(kms, arn)
        if spot:
            problems.append(spot)
    if problems:
        return [Finding(name, "; ".join(problems))]
    spot_ok = f", and its key policy names {SPOT_ROLE}" if use_spot else ""
    return [Finding(f"{name}: {principal} may use it for the boxes' volumes{spot_ok}")]


# --- the Spot service-linked role ---------------------------------------------------------------

SPOT_ROLE = "AWSServiceRoleForEC2Spot"


def check_spot_role(backend: Ec2Backend) -> list[Finding]:
    """Check the EC2 Spot service-linked role exists (a first spot launch needs it)."""
    name = f"Spot service-linked role {SPOT_ROLE}"
    try:
        backend._aws_client("iam").get_role(RoleName=SPOT_ROLE)
    except ClientError as exc:
        if _code(exc) == "NoSuchEntity":
            return [
                Finding(
                    name,
                    "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com",
                )
            ]
        return [Finding(name, f"{_reason(exc)}; allow iam:GetRole on {SPOT_ROLE}")]
    return [Finding(name)]


# --- prices --------------------------------------------------------------------------------------


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
        findings.append(
            Finding(
                name,
                f"neither AWS ({api}) nor the bundled table prices it: allow {where} to the "
                "orchestrator (deploy/iam-policy.json), or set BURSTCV_PRICE_TABLE to a table "
                f"that prices {option.instance_type} {option.market} in {region}",
            )
        )
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
    """Make what a run of several boxes makes before its launch, as the run makes it; dry-run
    the launch of its boxes into it; delete it again.

    The placement group and the run's security group cost nothing. The policy lets this
    identity open, launch into and delete only groups that carry the run's tags, which no dry
    run of a group that does not exist can show; so they are made for real (with the ingress
    rule between the boxes), tagged with the check's expiry: should the delete fail, the
    reaper removes them.
    """
    label = f"a run of {launch.count} boxes"
    subnet = backend.launch_subnets()[0]
    try:
        findings = _made_cluster(backend, launch, subnet, label)
    finally:
        left = backend.remove_cluster(launch.run.run_key)
    findings.append(
        Finding(
            f"{label}: its groups deleted",
            f"{left}: allow ec2:DeleteSecurityGroup and ec2:DeletePlacementGroup on the groups "
            "a run tags (deploy/iam-policy.json); the reaper removes these after "
            f"{format_expiry(launch.deadline_at)}"
            if left
            else "",
        )
    )
    return findings


def _made_cluster(backend: Ec2Backend, launch: Launch, subnet: Subnet, label: str) -> list[Finding]:
    try:
        cluster = backend.ensure_cluster(launch, launch.deadline_at, subnet)
    except ClientError as exc:
        return [
            Finding(
                f"{label}: ec2:{exc.operation_name}",
                f"{_reason(exc)}: allow it on the groups a run tags "
                "(deploy/iam-policy.json), or train on one box",
            )
        ]
    made = Finding(
        f"{label}: placement group {cluster.placement_group} and security group "
        f"{cluster.security_group_id} made, its members' ingress opened"
    )
    base = backend._run_params(
        launch, backend.resolve_ami(), "#!/bin/bash\n", launch.deadline_at, 1
    )
    option = backend.plan(launch)[0]
    params = backend._option_params(in_cluster(base, cluster), option, subnet)
    try:
        refused = backend._dry_run(params, option) or ""
    except LaunchCheckError as exc:
        refused = str(exc)
    return [
        made,
        Finding(
            f"dry-run launch {launch.count} x {option.instance_type} {option.market} "
            f"into placement group {cluster.placement_group}",
            refused,
        ),
    ]


# --- why a box found no way to S3 ---------------------------------------------------------------


def no_s3_cause(backend: Ec2Backend, instance_id: str, artifact_root: str) -> str:
    """Return the likeliest reason a box could not reach S3, read from the account's side.

    In order: its security groups let no HTTPS out, its subnet has no route to S3, its role
    may not use the run's files (or the bucket's default KMS key). EC2 forgets a terminated
    box's network, so what the box had is read while it is described, else what a launch
    gives (the same checks as ``burstcv aws check``). What the account cannot show (a
    firewall on the way, a bucket policy) is left to the box's console output.
    """
    found = list(backend._instances([], [instance_id]))
    inst = found[0] if found else {}
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
    else:
        blocked = [f for f in check_security_group_egress(backend) if not f.ok]
        if blocked:
            return f"{blocked[0].name}: {blocked[0].missing}"
    zone = str(inst.get("Placement", {}).get("AvailabilityZone", ""))
    routes = [
        f for f in check_subnet_routes(backend) if not f.ok and (not zone or f"({zone})" in f.name)
    ]
    if routes:
        return f"{routes[0].name}: {routes[0].missing}"
    role = [f for f in check_instance_role_s3(backend, artifact_root) if not f.ok]
    if role:
        return f"{role[0].name}: {role[0].missing}"
    return (
        "its security groups, route and role look right from here: read its console output "
        f"(aws ec2 get-console-output --instance-id {instance_id} --latest)"
    )


# --- the whole check ----------------------------------------------------------------------------


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _guarded(label: str, check: Callable[[], list[Finding]]) -> list[Finding]:
    """Run one check; a refusal or an unreachable service becomes its MISSING line."""
    try:
        return check()
    except (ClientError, BotoCoreError, LaunchCheckError) as exc:
        return [Finding(label, f"{_reason(exc)}; see docs/aws.md")]


def check_account(
    settings: Settings,
    ec2: Ec2Settings | None = None,
    *,
    num_nodes: int = 1,
    serving_families: list[str] | None = None,
) -> list[Finding]:
    """Return every finding: identity, launches, backstop, S3, role, quotas, network, prices.

    ``num_nodes`` and ``serving_families`` are the run params the check sizes for: a run of
    several boxes needs each family's quota for all of them, and its serving fleet a price.
    """
    backend = Ec2Backend(ec2 or Ec2Settings())
    s = backend.settings
    findings: list[Finding] = []
    try:
        account = backend.sts.get_caller_identity()["Account"]
        findings.append(Finding(f"credentials (account {account}, region {s.region})"))
    except (ClientError, BotoCoreError) as exc:
        return [Finding("credentials", f"{_reason(exc)}; see docs/aws.md, the connection")]
    try:
        for option, refused in backend.check_launch(check_launch_of()):
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
    # What the dry run cannot see: each would fail the first real run after it was billed,
    # or (quotas) refuse every launch with a message that looks like a capacity shortage.
    root = settings.artifact_root
    plan = launch_plan(s.instance_types, s.use_spot)
    findings += _guarded(
        "vCPU quotas", lambda: check_vcpu_quotas(backend, settings, num_nodes=num_nodes)
    )
    findings += _guarded("training role's S3 access", lambda: check_instance_role_s3(backend, root))
    findings += _guarded("route to S3", lambda: check_subnet_routes(backend))
    findings += _guarded("HTTPS egress to S3", lambda: check_security_group_egress(backend))
    if num_nodes > 1:
        findings += _guarded(
            "a run of several boxes",
            lambda: check_cluster_calls(
                backend, check_launch_of().model_copy(update={"count": num_nodes})
            ),
        )
    findings += _guarded("bucket region", lambda: check_bucket_region(root, s.region))
    findings += _guarded("default EBS encryption key", lambda: check_ebs_key(backend, s.use_spot))
    if s.use_spot:
        findings += _guarded(
            f"Spot service-linked role {SPOT_ROLE}", lambda: check_spot_role(backend)
        )
    findings += _guarded("prices", lambda: check_prices(backend, plan, root))
    if serving_families:
        families = serving_families
        findings += _guarded(
            "serving prices", lambda: check_serving_prices(backend, families, root)
        )
    return findings
