"""`burstcv aws check` against the emulator: what is in place, what is missing, nothing rented.

The emulator (moto) models most of what the check reads: instance types and their vCPUs,
subnets, route tables and S3 gateway endpoints, the bucket's region (HeadBucket), EBS
encryption by default, KMS keys (customer managed ones), IAM roles and instance profiles, the
spot price history, and the absence of any EC2 vCPU quota (its Service Quotas knows only VPC
quotas, so GetServiceQuota for ec2 answers NoSuchResourceException, as for a quota never set).
What it does not model is answered by the recording proxy with recorded responses in each
API's documented shape (the calls are still recorded and audited against
deploy/iam-policy.json): the applied vCPU quotas of a prepared account (one answer for every
quota code), ec2:GetEbsDefaultKmsKeyId (not implemented), kms:DescribeKey of the AWS managed
``aws/ebs`` key (moto calls every key CUSTOMER managed), iam:SimulatePrincipalPolicy (not
implemented; the decisions are those of deploy/instance-role-policy.json as the audit's own
IAM evaluator judges it) and pricing:GetProducts (an empty price list: the bundled table prices
on demand; or, per call, the product the call's filters name, as the Price List API answers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import boto3
import pytest
from awsaudit import (
    EMPTY_PRICE_LIST,
    MOTO_ACCOUNT_ID,
    Answer,
    RecordingProxy,
    price_list,
    simulated,
)
from burstcv_testkit import s3_gateway_endpoint
from typer.testing import CliRunner

from burstcv.cli import app
from burstcv.compute.awscheck import (
    check_serving_prices,
    check_sizing_quota,
    check_vcpu_quotas,
    instance_role_requests,
    sizing_role_requests,
    vcpu_quota_of,
)
from burstcv.compute.ec2 import Ec2Backend
from burstcv.settings import get_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ACCOUNT = MOTO_ACCOUNT_ID
EBS_ALIAS_ARN = f"arn:aws:kms:us-east-1:{ACCOUNT}:alias/aws/ebs"
SPOT_ROLE_PATH = "/aws-service-role/spot.amazonaws.com/"
# The serving_families default (c7i, m7i): the types a sizing box may measure.
SERVING_TYPES = ("c7i.2xlarge", "c7i.large", "c7i.xlarge", "m7i.large", "m7i.xlarge")


def run_check() -> Any:
    """Run `burstcv aws check` in-process and return the result."""
    return CliRunner().invoke(app, ["aws", "check"])


# --- recorded responses, for what the emulator does not model -----------------------------------


def quota_answer(value: float) -> bytes:
    """Return a GetServiceQuota (or GetAWSDefaultServiceQuota) response of ``value`` vCPUs."""
    quota = {
        "ServiceCode": "ec2",
        "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
        "QuotaArn": f"arn:aws:servicequotas:us-east-1:{ACCOUNT}:ec2/L-DB2E81BA",
        "QuotaCode": "L-DB2E81BA",
        "QuotaName": "Running On-Demand G and VT instances",
        "Value": value,
        "Unit": "None",
        "Adjustable": True,
        "GlobalQuota": False,
    }
    return json.dumps({"Quota": quota}).encode()


def ebs_default_key_answer(key_id: str) -> bytes:
    """Return an EC2 GetEbsDefaultKmsKeyId response naming ``key_id``."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<GetEbsDefaultKmsKeyIdResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
        "<requestId>5c1b1c4c-0000-4000-8000-000000000000</requestId>"
        f"<kmsKeyId>{escape(key_id)}</kmsKeyId>"
        "</GetEbsDefaultKmsKeyIdResponse>"
    ).encode()


def aws_managed_ebs_key_answer() -> bytes:
    """Return a KMS DescribeKey response for the account's AWS managed ``aws/ebs`` key."""
    key_id = "7adeb491-68c9-4a5b-86ec-a86ce5364094"
    metadata = {
        "AWSAccountId": ACCOUNT,
        "KeyId": key_id,
        "Arn": f"arn:aws:kms:us-east-1:{ACCOUNT}:key/{key_id}",
        "CreationDate": 1700000000.0,
        "Enabled": True,
        "Description": "Default key that protects my EBS volumes when no other key is defined",
        "KeyUsage": "ENCRYPT_DECRYPT",
        "KeyState": "Enabled",
        "Origin": "AWS_KMS",
        "KeyManager": "AWS",
        "CustomerMasterKeySpec": "SYMMETRIC_DEFAULT",
        "KeySpec": "SYMMETRIC_DEFAULT",
        "EncryptionAlgorithms": ["SYMMETRIC_DEFAULT"],
        "MultiRegion": False,
    }
    return json.dumps({"KeyMetadata": metadata}).encode()


def simulation_answer(
    policy: dict[str, Any], variables: dict[str, str], kms_key_arn: str | None = None
) -> bytes:
    """Return IAM's SimulatePrincipalPolicy response for a role whose only policy is ``policy``.

    Every action is evaluated on every resource the check asks about (IAM's cross product);
    each decision is the audit's IAM evaluator's.
    """
    root = get_settings().artifact_root
    wanted = instance_role_requests(root, kms_key_arn) + sizing_role_requests(root, kms_key_arn)
    return simulated(policy, variables, wanted)


ORCHESTRATOR_SESSION = f"arn:aws:sts::{MOTO_ACCOUNT_ID}:assumed-role/burstcv-orchestrator/airflow"


def caller_identity_answer(arn: str) -> bytes:
    """Return STS's GetCallerIdentity response for a caller ``arn`` of the emulator's account."""
    return (
        '<GetCallerIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
        f"<GetCallerIdentityResult><Arn>{arn}</Arn><UserId>AROAEXAMPLE:airflow</UserId>"
        f"<Account>{MOTO_ACCOUNT_ID}</Account></GetCallerIdentityResult>"
        "<ResponseMetadata><RequestId>01234567-89ab-cdef-0123-456789abcdef</RequestId>"
        "</ResponseMetadata></GetCallerIdentityResponse>"
    ).encode()


def instance_role_policy_variables(kit: Any) -> dict[str, str]:
    """Return the values docs/aws.md substitutes into deploy/instance-role-policy.json."""
    return {
        "BURSTCV_BUCKET": kit.bucket,
        "ARTIFACT_ROOT": kit.artifact_root.removeprefix("s3://"),
    }


class Answers:
    """Set the proxy's recorded responses for one test; the next test starts without them."""

    def __init__(self, proxy: RecordingProxy, monkeypatch: pytest.MonkeyPatch) -> None:
        self.proxy = proxy
        self.monkeypatch = monkeypatch
        # Only what a test sets: the emulator answers everything else, pricing aside.
        for action in (
            "servicequotas:GetServiceQuota",
            "ec2:GetEbsDefaultKmsKeyId",
            "kms:DescribeKey",
            "iam:SimulatePrincipalPolicy",
        ):
            monkeypatch.delitem(proxy.answers, action, raising=False)
        self.set("pricing:GetProducts", EMPTY_PRICE_LIST)
        # The orchestrator runs as the role docs/aws.md names (the emulator's caller is a
        # user "moto"): IAM's simulator is asked about it, as the policy lets it be.
        self.set("sts:GetCallerIdentity", caller_identity_answer(ORCHESTRATOR_SESSION))
        # Not modelled: a new account's default for the GPU families is 0 vCPUs.
        self.set("servicequotas:GetAWSDefaultServiceQuota", quota_answer(0.0))

    def set(self, action: str, body: bytes, status: int = 200) -> None:
        """Answer ``action`` with ``body`` for the rest of the test."""
        self.set_answer(action, (status, body))

    def set_answer(self, action: str, answer: Answer) -> None:
        """Answer ``action`` with ``answer`` (a response, or a function of the call that
        returns one) for the rest of the test."""
        self.monkeypatch.setitem(self.proxy.answers, action, answer)


@pytest.fixture
def answers(audited_calls: RecordingProxy, monkeypatch: pytest.MonkeyPatch) -> Answers:
    """Return the recorded responses of this test (pricing: an empty price list)."""
    return Answers(audited_calls, monkeypatch)


@pytest.fixture(autouse=True)
def _iam_resources(iam_resources_audited: None) -> None:
    """Every test here: the IAM and KMS reads audited on their real resources (conftest)."""


@pytest.fixture
def prepared_account(s3_deployment: Any, kit: Any, aws: str, answers: Answers) -> None:
    """Set up the account as docs/aws.md asks: quotas, route to S3, roles, keys, prices."""
    ec2 = boto3.client("ec2", region_name=kit.region, endpoint_url=aws)
    s3_gateway_endpoint(ec2, kit.region)
    iam = boto3.client("iam", region_name=kit.region, endpoint_url=aws)
    # moto's CreateServiceLinkedRole names the spot role AWSServiceRoleForspot: create it as
    # AWS names it.
    iam.create_role(
        RoleName="AWSServiceRoleForEC2Spot",
        Path=SPOT_ROLE_PATH,
        AssumeRolePolicyDocument=json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [
                    {
                        "Effect": "Allow",
                        "Principal": {"Service": "spot.amazonaws.com"},
                        "Action": "sts:AssumeRole",
                    }
                ],
            }
        ),
    )
    role_policy = json.loads((DEPLOY / "instance-role-policy.json").read_text())
    variables = instance_role_policy_variables(kit)
    text = json.dumps(role_policy)
    for name, value in variables.items():
        text = text.replace(name, value)
    iam.put_role_policy(
        RoleName="burstcv-training", PolicyName="burstcv-training", PolicyDocument=text
    )
    answers.set("servicequotas:GetServiceQuota", quota_answer(64.0))
    answers.set("ec2:GetEbsDefaultKmsKeyId", ebs_default_key_answer(EBS_ALIAS_ARN))
    answers.set("kms:DescribeKey", aws_managed_ebs_key_answer())
    answers.set("iam:SimulatePrincipalPolicy", simulation_answer(role_policy, variables))


def test_a_ready_account_passes_every_check_and_rents_nothing(
    prepared_account: None, kit: Any, audited_calls: RecordingProxy
) -> None:
    result = run_check()
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "ok       dry-run launch g6.xlarge spot" in lines
    assert "ok       dry-run launch g4dn.xlarge on-demand" in lines
    assert any(line.startswith("ok       backstop schedule") for line in lines)
    assert any(
        "s3:DeleteObject under s3://burstcv-test/registry/digits/aliases" in x for x in lines
    )
    for market, code in (("on-demand", "L-DB2E81BA"), ("spot", "L-3819A6DF")):
        assert (
            f"ok       vCPU quota G and VT {market} ({code}) in us-east-1: 64 vCPUs, "
            "a g6.xlarge needs 4" in lines
        )
    assert (
        "ok       training role burstcv-training: S3 access under s3://burstcv-test/artifacts"
        in lines
    )
    routes = [x for x in lines if "route to S3 from subnet" in x]
    assert len(routes) == 6  # the default subnet of each of us-east-1's six AZs
    assert all(x.startswith("ok") and "via S3 gateway endpoint vpce-" in x for x in routes)
    (egress,) = [x for x in lines if "HTTPS egress to S3" in x]
    assert egress.startswith("ok       HTTPS egress to S3 from the default security group of vpc-")
    assert "ok       bucket burstcv-test in the run's region us-east-1" in lines
    assert any(x.startswith("ok       default EBS encryption key: AWS managed key") for x in lines)
    assert "ok       Spot service-linked role AWSServiceRoleForEC2Spot" in lines
    prices = [x for x in lines if x.startswith("ok       price ")]
    assert len(prices) == 6, lines  # three types, two markets
    # The serving fleet's CPU types (the serving_families default, c7i and m7i), priced as a
    # run prices them: the Price List API answers nothing here, so the bundled table.
    assert [x for x in lines if x.startswith("ok       serving price ")] == [
        "ok       serving price c7i.2xlarge on-demand in us-east-1: $0.3570/h",
        "ok       serving price c7i.large on-demand in us-east-1: $0.0892/h",
        "ok       serving price c7i.xlarge on-demand in us-east-1: $0.1785/h",
        "ok       serving price m7i.large on-demand in us-east-1: $0.1008/h",
        "ok       serving price m7i.xlarge on-demand in us-east-1: $0.2016/h",
    ]
    # Not the last line: a handler an earlier in-process CLI run left on a closed stream may
    # print its logging error after it.
    # The sizing boxes: one on-demand box per serving type, two at once (the default
    # BURSTCV_SIZING_PARALLEL), the largest two counted; each type dry-run on the AL2023 image
    # of its architecture, as the sizing resolves it; the role's sizing paths simulated.
    assert (
        "ok       vCPU quota Standard (A, C, D, H, I, M, R, T, Z) on-demand (L-1216C47A) in "
        "us-east-1: 64 vCPUs, sizing boxes c7i.2xlarge, c7i.xlarge (2 at once, "
        "BURSTCV_SIZING_PARALLEL) needs 12" in lines
    )
    (image,) = [x for x in lines if "sizing boxes' AMI" in x]
    assert image.startswith("ok       sizing boxes' AMI for x86_64: ami-")
    sized = [x for x in lines if x.startswith("ok       dry-run launch sizing box ")]
    assert [x.split()[5] for x in sized] == sorted(SERVING_TYPES), sized
    assert all(image.rsplit(" ", 1)[-1] in x for x in sized)
    assert (
        "ok       sizing boxes' role burstcv-training: S3 access under s3://burstcv-test/artifacts"
        in lines
    )
    # The emulator's default VPC routes nothing but its S3 gateway endpoint: before a run has
    # staged the wheelhouse, the line says what the boxes then depend on.
    assert (
        "ok       sizing boxes' wheels (cp311-x86_64): no wheelhouse staged yet: a run stages "
        "one beside the wheel (pip download on the orchestrator); the boxes reach S3 only, so "
        "the orchestrator must reach the package index or hold the wheelhouse "
        "(BURSTCV_WHEELHOUSE_CACHE)" in lines
    )
    assert "all 51 checks passed: nothing was rented" in lines
    assert not [x for x in lines if x.startswith("MISSING")]
    assert kit.live_managed() == []
    calls = audited_calls.snapshot()
    launches = [c for c in calls if c.action == "ec2:RunInstances"]
    assert len(launches) == 6 + 5 and all(c.params.get("DryRun") == "true" for c in launches)
    sizing = [c for c in launches if c.params["InstanceType"] in SERVING_TYPES]
    assert {c.params.get("InstanceMarketOptions.MarketType") for c in sizing} == {None}
    assert {c.params["BlockDeviceMapping.1.Ebs.VolumeSize"] for c in sizing} == {"16"}
    asked = sorted(c.params["QuotaCode"] for c in calls if c.action.startswith("servicequotas"))
    assert asked == ["L-1216C47A", "L-3819A6DF", "L-DB2E81BA"]
    # The probes are gone again.
    listed = kit.s3.list_objects_v2(Bucket=kit.bucket).get("Contents", [])
    assert not [o["Key"] for o in listed if ".burstcv-check" in o["Key"]]


def test_a_fresh_account_is_told_each_thing_to_set_up(
    s3_deployment: Any,
    kit: Any,
    aws: str,
    answers: Answers,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # g6e.xlarge: no price in the bundled table (and the Price List API answers nothing).
    monkeypatch.setenv("BURSTCV_EC2_INSTANCE_TYPES", "g6.xlarge,g6e.xlarge,p4d.24xlarge")
    get_settings.cache_clear()
    # The bucket lives in another region than the runs.
    kit.s3.delete_bucket(Bucket=kit.bucket)
    boto3.client("s3", region_name="eu-west-1", endpoint_url=aws).create_bucket(
        Bucket=kit.bucket, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"}
    )
    # EBS volumes default to a customer managed key.
    key_arn = boto3.client("kms", region_name=kit.region, endpoint_url=aws).create_key()[
        "KeyMetadata"
    ]["Arn"]
    answers.set("ec2:GetEbsDefaultKmsKeyId", ebs_default_key_answer(key_arn))
    # The training role exists but has no policy.
    answers.set(
        "iam:SimulatePrincipalPolicy",
        simulation_answer({"Version": "2012-10-17", "Statement": []}, {}),
    )

    result = run_check()

    assert result.exit_code == 1
    missing = [x for x in result.output.splitlines() if x.startswith("MISSING")]
    request = "aws service-quotas request-service-quota-increase --service-code ec2"
    expected_quotas = {
        ("G and VT on-demand", "L-DB2E81BA", 16),  # 4 vCPUs x 4 boxes (BURSTCV_GPU_POOL_SLOTS)
        ("G and VT spot", "L-3819A6DF", 16),
        ("P on-demand", "L-417A185B", 384),  # a p4d.24xlarge has 96 vCPUs
        ("P4, P3 and P2 spot", "L-7212CCBC", 384),
    }
    for family, code, desired in expected_quotas:
        (line,) = [x for x in missing if f"vCPU quota {family} ({code})" in x]
        assert line.endswith(
            f"{request} --quota-code {code} --desired-value {desired} --region us-east-1"
        ), line
    routes = [x for x in missing if "route to S3 from subnet" in x]
    assert len(routes) == 6 and all(
        "aws ec2 create-vpc-endpoint" in x and "com.amazonaws.us-east-1.s3" in x for x in routes
    )
    (region,) = [x for x in missing if "bucket burstcv-test" in x]
    assert "it is in eu-west-1" in region and "BURSTCV_EC2_REGION=eu-west-1" in region
    (ebs,) = [x for x in missing if "default EBS encryption key" in x]
    assert key_arn in ebs and "kms:CreateGrant" in ebs and "kms:ReEncrypt*" in ebs
    assert "AWSServiceRoleForEC2Spot" in ebs  # spot boxes need the key too
    (spot,) = [x for x in missing if "Spot service-linked role" in x]
    assert spot.endswith("aws iam create-service-linked-role --aws-service-name spot.amazonaws.com")
    (role,) = [x for x in missing if "training role burstcv-training" in x]
    assert "s3:GetObject on runs/burstcv-check/job/job.json (implicitDeny)" in role
    assert "s3:GetObject on runtime/burstcv-check/" in role  # the training wheel
    assert "s3:PutObject on runs/burstcv-check/job/attempts/1/DONE (implicitDeny)" in role
    assert "s3:ListBucket on burstcv-test (implicitDeny)" in role
    assert "deploy/instance-role-policy.json" in role
    # The same role, for what a sizing box reads and writes.
    (sizing,) = [x for x in missing if "sizing boxes' role burstcv-training" in x]
    assert "s3:GetObject on runs/burstcv-check/model/model.onnx (implicitDeny)" in sizing
    assert "s3:GetObject on runtime/burstcv-check/burstcv_size-" in sizing  # the sizing wheel
    assert "s3:PutObject on runs/burstcv-check/bench/sizing/boxes/c7i.large.json" in sizing
    # A new account's standard quota (here its default, 0) for two sizing boxes at once.
    (standard,) = [x for x in missing if "(L-1216C47A)" in x]
    assert "0 vCPUs, sizing boxes c7i.2xlarge, c7i.xlarge (2 at once" in standard
    assert standard.endswith(
        f"{request} --quota-code L-1216C47A --desired-value 12 --region us-east-1"
    )
    (price,) = [x for x in missing if "price " in x]
    assert price.startswith("MISSING  price g6e.xlarge on-demand in us-east-1")
    assert "BURSTCV_PRICE_TABLE" in price and "pricing:GetProducts" in price
    # Nothing else: the launches, the backstop, the probes and the profile are in place.
    assert len(missing) == 4 + 6 + 1 + 1 + 1 + 1 + 1 + 2, "\n".join(missing)
    assert kit.live_managed() == []


def test_what_is_missing_is_printed_one_line_each(
    prepared_account: None,
    kit: Any,
    audited_calls: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BURSTCV_EC2_INSTANCE_PROFILE", "no-such-profile")
    monkeypatch.setenv("BURSTCV_REGISTRY_URI", "s3://no-such-bucket/registry")
    get_settings.cache_clear()
    result = run_check()
    assert result.exit_code == 1
    missing = [x for x in result.output.splitlines() if x.startswith("MISSING")]
    launch = [x for x in missing if "dry-run launch" in x]
    assert len(launch) == 6 + 5 and all("BURSTCV_EC2_INSTANCE_PROFILE" in x for x in launch)
    registry = [x for x in missing if "s3://no-such-bucket" in x]
    assert len(registry) == 4 and all("NoSuchBucket" in x for x in registry)
    (role,) = [x for x in missing if "training role" in x]
    assert "no instance profile no-such-profile" in role
    # The artifact store is fine; only the role's line names it.
    assert not [x for x in missing if "burstcv-test" in x and x != role]
    assert "16 of" in result.output
    assert kit.live_managed() == []
    audited_calls.clear()  # the refused PassRole of a wrong profile is this test's point


def test_a_run_of_two_boxes_needs_each_familys_quota_for_both(
    s3_deployment: Any, answers: Answers
) -> None:
    # 6 vCPUs of G and VT, on demand and spot: one g6.xlarge (4 vCPUs) fits, two do not.
    answers.set("servicequotas:GetServiceQuota", quota_answer(6.0))
    backend = Ec2Backend(s3_deployment.ec2)

    one = [f.line() for f in check_vcpu_quotas(backend, s3_deployment)]
    two = [f.line() for f in check_vcpu_quotas(backend, s3_deployment, num_nodes=2)]

    request = "aws service-quotas request-service-quota-increase --service-code ec2"
    codes = {"on-demand": "L-DB2E81BA", "spot": "L-3819A6DF"}
    assert sorted(one) == sorted(
        f"ok       vCPU quota G and VT {market} ({code}) in us-east-1: 6 vCPUs, a g6.xlarge needs 4"
        for market, code in codes.items()
    )
    # A launch starts both boxes at once: 2 x 4 vCPUs; the increase asked for still fits the
    # GPU pool's 4 boxes at once (BURSTCV_GPU_POOL_SLOTS).
    assert sorted(two) == sorted(
        f"MISSING  vCPU quota G and VT {market} ({code}) in us-east-1: 6 vCPUs, "
        f"2 x g6.xlarge needs 8; ask for 16 (4 boxes at once, BURSTCV_GPU_POOL_SLOTS): "
        f"{request} --quota-code {code} --desired-value 16 --region us-east-1"
        for market, code in codes.items()
    )


def test_a_subnet_reaching_s3_through_a_nat_gateway_is_told_what_it_pays_and_the_free_way(
    s3_deployment: Any, aws: str
) -> None:
    from burstcv.compute.awscheck import check_subnet_routes

    backend = Ec2Backend(s3_deployment.ec2)
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=aws)  # the account's admin
    first = backend.launch_subnets()[0]
    # A private subnet: its own route table sends everything to a NAT gateway.
    allocation = ec2.allocate_address(Domain="vpc")["AllocationId"]
    nat = ec2.create_nat_gateway(SubnetId=first.subnet_id, AllocationId=allocation)["NatGateway"]
    table = ec2.create_route_table(VpcId=first.vpc_id)["RouteTable"]["RouteTableId"]
    ec2.create_route(
        RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat["NatGatewayId"]
    )
    association = ec2.associate_route_table(RouteTableId=table, SubnetId=first.subnet_id)
    try:
        lines = [f.line() for f in check_subnet_routes(backend)]
    finally:
        ec2.disassociate_route_table(AssociationId=association["AssociationId"])
        ec2.delete_route_table(RouteTableId=table)
        ec2.delete_nat_gateway(NatGatewayId=nat["NatGatewayId"])
        ec2.release_address(AllocationId=allocation)
    (line,) = [x for x in lines if first.subnet_id in x]
    assert line.startswith(f"ok       route to S3 from subnet {first} via NAT gateway")
    assert "billed per GB" in line and "shard download" in line
    assert (
        f"aws ec2 create-vpc-endpoint --vpc-id {first.vpc_id} --service-name "
        f"com.amazonaws.us-east-1.s3 --route-table-ids {table}" in line
    )


def test_a_default_security_group_stripped_of_its_rules_is_named_with_the_rule_to_add(
    s3_deployment: Any, aws: str
) -> None:
    from burstcv.compute.awscheck import check_security_group_egress

    backend = Ec2Backend(s3_deployment.ec2)
    admin = boto3.client("ec2", region_name="us-east-1", endpoint_url=aws)
    vpc = backend.launch_subnets()[0].vpc_id
    (default,) = admin.describe_security_groups(
        Filters=[
            {"Name": "vpc-id", "Values": [vpc]},
            {"Name": "group-name", "Values": ["default"]},
        ]
    )["SecurityGroups"]
    gid = default["GroupId"]
    (s3_list,) = admin.describe_prefix_lists(
        Filters=[{"Name": "prefix-list-name", "Values": ["com.amazonaws.us-east-1.s3"]}]
    )["PrefixLists"]
    pl = s3_list["PrefixListId"]
    label = f"HTTPS egress to S3 from the default security group of {vpc} ({gid})"
    assert [f.line() for f in check_security_group_egress(backend)] == [
        f"ok       {label}: to anywhere ({gid})"
    ]

    # CIS 4.3: the default group has no rules at all.
    admin.revoke_security_group_egress(GroupId=gid, IpPermissions=default["IpPermissionsEgress"])
    own = admin.create_security_group(GroupName="egress-s3", Description="s3", VpcId=vpc)
    try:
        (line,) = [f.line() for f in check_security_group_egress(backend)]
        assert line.startswith(f"MISSING  {label}: no egress rule lets a box reach S3 over HTTPS")
        assert f"authorize-security-group-egress --group-id {gid}" in line
        assert f"PrefixListIds=[{{PrefixListId={pl}}}]" in line and "\n" not in line
        # The user's own group, letting HTTPS out to S3's prefix list only, in the setting.
        own_id = own["GroupId"]
        (everything,) = admin.describe_security_groups(GroupIds=[own_id])["SecurityGroups"]
        admin.revoke_security_group_egress(
            GroupId=own_id, IpPermissions=everything["IpPermissionsEgress"]
        )
        admin.authorize_security_group_egress(
            GroupId=own_id,
            IpPermissions=[
                {
                    "IpProtocol": "tcp",
                    "FromPort": 443,
                    "ToPort": 443,
                    "PrefixListIds": [{"PrefixListId": pl}],
                }
            ],
        )
        configured = s3_deployment.ec2.model_copy(update={"security_group_ids": (own_id,)})
        assert [f.line() for f in check_security_group_egress(Ec2Backend(configured))] == [
            "ok       HTTPS egress to S3 from BURSTCV_EC2_SECURITY_GROUP_IDS "
            f"({own_id}): to the S3 prefix list ({own_id})"
        ]
    finally:
        admin.authorize_security_group_egress(
            GroupId=gid, IpPermissions=[{"IpProtocol": "-1", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]
        )
        admin.delete_security_group(GroupId=own["GroupId"])


def test_a_bucket_encrypting_with_a_customer_key_needs_the_training_roles_use_of_it(
    s3_deployment: Any, kit: Any, aws: str, answers: Answers
) -> None:
    from burstcv.compute.awscheck import check_instance_role_s3

    kms = boto3.client("kms", region_name=kit.region, endpoint_url=aws)
    key = kms.create_key(Description="the bucket's default key")["KeyMetadata"]
    kit.s3.put_bucket_encryption(
        Bucket=kit.bucket,
        ServerSideEncryptionConfiguration={
            "Rules": [
                {
                    "ApplyServerSideEncryptionByDefault": {
                        "SSEAlgorithm": "aws:kms",
                        "KMSMasterKeyID": key["KeyId"],
                    }
                }
            ]
        },
    )
    role_policy = json.loads((DEPLOY / "instance-role-policy.json").read_text())
    variables = instance_role_policy_variables(kit)
    backend = Ec2Backend(s3_deployment.ec2)
    try:
        # The role as docs/aws.md gives it: S3 only, so the key refuses it.
        answers.set(
            "iam:SimulatePrincipalPolicy", simulation_answer(role_policy, variables, key["Arn"])
        )
        (finding,) = check_instance_role_s3(backend, kit.artifact_root)
        line = finding.line()
        assert line.startswith("MISSING  training role burstcv-training: S3 access under ")
        assert f"(the bucket's default key {key['Arn']})" in line
        assert f"kms:Decrypt on {key['Arn']} (implicitDeny)" in line
        assert f"kms:GenerateDataKey on {key['Arn']} (implicitDeny)" in line
        assert f"and kms:Decrypt and kms:GenerateDataKey on {key['Arn']}" in line
        assert "s3:GetObject" not in line  # its S3 access is whole
        # The same role with the key's use: in place.
        granted = {
            **role_policy,
            "Statement": [
                *role_policy["Statement"],
                {
                    "Effect": "Allow",
                    "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
                    "Resource": key["Arn"],
                },
            ],
        }
        answers.set(
            "iam:SimulatePrincipalPolicy", simulation_answer(granted, variables, key["Arn"])
        )
        (finding,) = check_instance_role_s3(backend, kit.artifact_root)
        assert finding.ok, finding.line()
    finally:
        kit.s3.delete_bucket_encryption(Bucket=kit.bucket)
    # No default key: S3 alone, as before.
    answers.set("iam:SimulatePrincipalPolicy", simulation_answer(role_policy, variables))
    (finding,) = check_instance_role_s3(backend, kit.artifact_root)
    assert finding.ok and "default key" not in finding.line(), finding.line()


def test_a_customer_managed_ebs_key_is_judged_by_the_orchestrators_own_grants(
    s3_deployment: Any, kit: Any, aws: str, answers: Answers
) -> None:
    from burstcv.compute.awscheck import EBS_KMS_SIMULATED, check_ebs_key, own_principal

    backend = Ec2Backend(s3_deployment.ec2)
    principal = own_principal(backend)
    assert principal == f"arn:aws:iam::{MOTO_ACCOUNT_ID}:role/burstcv-orchestrator"
    key_policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "Enable IAM policies",
                "Effect": "Allow",
                "Principal": {"AWS": f"arn:aws:iam::{MOTO_ACCOUNT_ID}:root"},
                "Action": "kms:*",
                "Resource": "*",
            }
        ],
    }
    kms = boto3.client("kms", region_name=kit.region, endpoint_url=aws)
    key = kms.create_key(Policy=json.dumps(key_policy))["KeyMetadata"]["Arn"]
    answers.set("ec2:GetEbsDefaultKmsKeyId", ebs_default_key_answer(key))
    orchestrator = json.loads((DEPLOY / "iam-policy.json").read_text())
    variables = {"ACCOUNT_ID": MOTO_ACCOUNT_ID, "BURSTCV_BUCKET": kit.bucket}
    wanted = [(action, key) for action in EBS_KMS_SIMULATED]
    grant_context = {"kms:GrantIsForAWSResource": "true"}

    # The policy as shipped: DescribeKey only, the key's use is refused.
    answers.set(
        "iam:SimulatePrincipalPolicy", simulated(orchestrator, variables, wanted, grant_context)
    )
    (finding,) = check_ebs_key(backend, use_spot=False)
    line = finding.line()
    assert line.startswith(f"MISSING  default EBS encryption key {key} (customer managed)")
    assert f"{principal} may not kms:CreateGrant (implicitDeny), kms:Decrypt" in line
    assert "kms:DescribeKey (" not in line  # the shipped policy allows that one
    assert "kms:GrantIsForAWSResource=true" in line and "deploy/iam-policy.json" in line
    # With the statement docs/aws.md gives: in place, nothing flagged.
    granted = {
        **orchestrator,
        "Statement": [
            *orchestrator["Statement"],
            {
                "Effect": "Allow",
                "Action": [
                    "kms:Decrypt",
                    "kms:DescribeKey",
                    "kms:GenerateDataKeyWithoutPlaintext",
                    "kms:ReEncrypt*",
                ],
                "Resource": key,
            },
            {
                "Effect": "Allow",
                "Action": "kms:CreateGrant",
                "Resource": key,
                "Condition": {"Bool": {"kms:GrantIsForAWSResource": "true"}},
            },
        ],
    }
    answers.set("iam:SimulatePrincipalPolicy", simulated(granted, variables, wanted, grant_context))
    (finding,) = check_ebs_key(backend, use_spot=False)
    assert finding.ok, finding.line()
    assert finding.line() == (
        f"ok       default EBS encryption key {key} (customer managed): {principal} may use "
        "it for the boxes' volumes"
    )
    # Spot boxes: the key's policy must name the Spot service-linked role too.
    (finding,) = check_ebs_key(backend, use_spot=True)
    assert not finding.ok
    assert "its key policy does not name AWSServiceRoleForEC2Spot" in finding.line()
    key_policy["Statement"].append(
        {
            "Sid": "Spot boxes",
            "Effect": "Allow",
            "Principal": {
                "AWS": f"arn:aws:iam::{MOTO_ACCOUNT_ID}:role/aws-service-role/"
                "spot.amazonaws.com/AWSServiceRoleForEC2Spot"
            },
            "Action": ["kms:CreateGrant", "kms:Decrypt", "kms:GenerateDataKey*"],
            "Resource": "*",
        }
    )
    kms.put_key_policy(KeyId=key, PolicyName="default", Policy=json.dumps(key_policy))
    (finding,) = check_ebs_key(backend, use_spot=True)
    assert finding.ok and finding.line().endswith(
        "and its key policy names AWSServiceRoleForEC2Spot"
    ), finding.line()
    # A simulator that refuses the check: the advice stands, and says what to allow.
    answers.set(
        "iam:SimulatePrincipalPolicy",
        b"<ErrorResponse><Error><Type>Sender</Type><Code>AccessDenied</Code>"
        b"<Message>not authorized to perform: iam:SimulatePrincipalPolicy</Message></Error>"
        b"<RequestId>r-2</RequestId></ErrorResponse>",
        status=403,
    )
    (finding,) = check_ebs_key(backend, use_spot=False)
    assert not finding.ok
    assert f"allow iam:SimulatePrincipalPolicy on {principal}" in finding.line()
    assert "kms:CreateGrant (with the condition kms:GrantIsForAWSResource=true)" in finding.line()


@pytest.mark.parametrize(
    ("caller", "principal"),
    [
        (
            "arn:aws:sts::111122223333:assumed-role/burstcv-orchestrator/airflow-worker",
            "arn:aws:iam::111122223333:role/burstcv-orchestrator",
        ),
        (
            "arn:aws-cn:sts::111122223333:assumed-role/orchestrator/i-0abc",
            "arn:aws-cn:iam::111122223333:role/orchestrator",
        ),
        (
            "arn:aws:iam::111122223333:user/ops/burstcv-orchestrator",
            "arn:aws:iam::111122223333:user/ops/burstcv-orchestrator",
        ),
        ("arn:aws:iam::111122223333:root", None),
        ("arn:aws:sts::111122223333:federated-user/alice", None),
        ("not-an-arn", None),
    ],
)
def test_the_simulated_principal_is_the_user_or_the_role_behind_the_session(
    caller: str, principal: str | None
) -> None:
    from burstcv.compute.awscheck import simulator_principal

    assert simulator_principal(caller) == principal


def test_p5_counts_against_every_p_familys_on_demand_quota_and_its_own_spot_quota(
    s3_deployment: Any, answers: Answers, audited_calls: RecordingProxy
) -> None:
    answers.set("servicequotas:GetServiceQuota", quota_answer(200.0))
    ec2 = s3_deployment.ec2.model_copy(
        update={"instance_types": ("p4d.24xlarge", "p5.48xlarge"), "use_spot": True}
    )
    lines = [f.line() for f in check_vcpu_quotas(Ec2Backend(ec2), s3_deployment)]
    # "Running On-Demand P instances" counts both: one line, for the larger; spot has two.
    assert sorted(lines) == sorted(
        [
            "ok       vCPU quota P on-demand (L-417A185B) in us-east-1: 200 vCPUs, "
            "a p5.48xlarge needs 192",
            "ok       vCPU quota P4, P3 and P2 spot (L-7212CCBC) in us-east-1: 200 vCPUs, "
            "a p4d.24xlarge needs 96",
            "ok       vCPU quota P5 spot (L-C4BD4855) in us-east-1: 200 vCPUs, "
            "a p5.48xlarge needs 192",
        ]
    )
    asked = sorted(
        c.params["QuotaCode"]
        for c in audited_calls.snapshot()
        if c.action == "servicequotas:GetServiceQuota"
    )
    assert asked == ["L-417A185B", "L-7212CCBC", "L-C4BD4855"]  # the shared one read once
    for instance_type, spot in (
        ("p3.2xlarge", "L-7212CCBC"),
        ("p4de.24xlarge", "L-7212CCBC"),
        ("p5e.48xlarge", "L-C4BD4855"),
        ("p5en.48xlarge", "L-C4BD4855"),
    ):
        quota = vcpu_quota_of(instance_type)
        assert quota is not None and (quota.code("on-demand"), quota.code("spot")) == (
            "L-417A185B",
            spot,
        )


def test_a_quota_never_raised_is_read_as_its_default_not_as_zero(
    s3_deployment: Any, answers: Answers, audited_calls: RecordingProxy
) -> None:
    # No applied value (the emulator answers NoSuchResourceException, as Service Quotas does
    # for a quota never raised): the account's default holds, here 8 vCPUs.
    answers.set("servicequotas:GetAWSDefaultServiceQuota", quota_answer(8.0))
    lines = [f.line() for f in check_vcpu_quotas(Ec2Backend(s3_deployment.ec2), s3_deployment)]
    assert sorted(lines) == sorted(
        f"ok       vCPU quota G and VT {market} ({code}) in us-east-1: 8 vCPUs, a g6.xlarge needs 4"
        for market, code in (("on-demand", "L-DB2E81BA"), ("spot", "L-3819A6DF"))
    )
    read = [c.action for c in audited_calls.snapshot() if c.service == "servicequotas"]
    assert read.count("servicequotas:GetServiceQuota") == 2
    assert read.count("servicequotas:GetAWSDefaultServiceQuota") == 2


def test_the_check_sizes_the_quotas_for_the_num_nodes_it_is_given(
    prepared_account: None, kit: Any
) -> None:
    result = CliRunner().invoke(app, ["aws", "check", "--num-nodes", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # What a run of several boxes makes before its launch, made as the run makes it (and
    # audited: allowed), the launch into it dry-run, then deleted.
    (made,) = [x for x in lines if x.startswith("ok       a run of 2 boxes: placement group")]
    assert "burstcv-burstcv-check" in made and "ingress opened" in made, made
    assert (
        "ok       dry-run launch 2 x g6.xlarge spot into placement group burstcv-burstcv-check"
        in lines
    ), lines
    assert "ok       a run of 2 boxes: its groups deleted" in lines
    assert kit.ec2.describe_placement_groups()["PlacementGroups"] == []
    left = kit.ec2.describe_security_groups(
        Filters=[{"Name": "tag:burstcv:managed", "Values": ["true"]}]
    )["SecurityGroups"]
    assert left == []
    for market, code in (("on-demand", "L-DB2E81BA"), ("spot", "L-3819A6DF")):
        assert (
            f"ok       vCPU quota G and VT {market} ({code}) in us-east-1: 64 vCPUs, "
            "2 x g6.xlarge needs 8" in lines
        )
    assert kit.live_managed() == []


def test_a_refused_ingress_rule_is_named_and_the_groups_made_for_the_check_are_deleted(
    prepared_account: None, kit: Any, answers: Answers
) -> None:
    # A policy without ec2:AuthorizeSecurityGroupIngress on the run's groups: the boxes of a
    # multi-box run could not reach each other. The groups exist by then; none is left.
    answers.set(
        "ec2:AuthorizeSecurityGroupIngress",
        b"<Response><Errors><Error><Code>UnauthorizedOperation</Code>"
        b"<Message>You are not authorized to perform this operation.</Message></Error>"
        b"</Errors><RequestID>r-1</RequestID></Response>",
        status=403,
    )
    result = CliRunner().invoke(app, ["aws", "check", "--num-nodes", "3"])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    (refused,) = [x for x in lines if "a run of 3 boxes: ec2:" in x]
    assert refused.startswith("MISSING  a run of 3 boxes: ec2:AuthorizeSecurityGroupIngress")
    assert "UnauthorizedOperation" in refused and "deploy/iam-policy.json" in refused
    assert not any("dry-run launch 3 x" in x for x in lines)
    assert "ok       a run of 3 boxes: its groups deleted" in lines
    assert kit.ec2.describe_placement_groups()["PlacementGroups"] == []
    assert (
        kit.ec2.describe_security_groups(
            Filters=[{"Name": "tag:burstcv:managed", "Values": ["true"]}]
        )["SecurityGroups"]
        == []
    )
    assert kit.live_managed() == []


def test_serving_types_nobody_prices_in_the_region_are_named_with_what_to_set(
    s3_deployment: Any, answers: Answers, audited_calls: RecordingProxy
) -> None:
    # eu-west-1 is in no row of the bundled table; the Price List API prices c7i.large only.
    answers.set_answer("pricing:GetProducts", price_list({"c7i.large": "0.0941"}, "eu-west-1"))
    backend = Ec2Backend(s3_deployment.ec2.model_copy(update={"region": "eu-west-1"}))

    findings = check_serving_prices(backend, ["c7i", "m7i"], s3_deployment.artifact_root)

    lines = [f.line() for f in findings]
    assert lines[0] == "ok       serving price c7i.large on-demand in eu-west-1: $0.0941/h"
    (missing,) = lines[1:]
    assert missing.startswith(
        "MISSING  serving prices (c7i, m7i) in eu-west-1: no on-demand price for c7i.2xlarge, "
        "c7i.xlarge, m7i.large, m7i.xlarge in eu-west-1"
    )
    # What to set: the permission to ask AWS, or a table that prices them there.
    assert "allow pricing:GetProducts" in missing and "deploy/iam-policy.json" in missing
    assert "BURSTCV_PRICE_TABLE" in missing and "\n" not in missing
    asked = sorted(
        next(f["Value"] for f in c.params["Filters"] if f["Field"] == "instanceType")
        for c in audited_calls.snapshot()
        if c.action == "pricing:GetProducts"
    )
    assert asked == ["c7i.2xlarge", "c7i.large", "c7i.xlarge", "m7i.large", "m7i.xlarge"]


# --- the sizing boxes ---------------------------------------------------------------------------


def test_the_sizing_boxes_quota_is_sized_for_the_largest_candidates_run_at_once(
    s3_deployment: Any, answers: Answers, audited_calls: RecordingProxy
) -> None:
    # 10 standard vCPUs: the two largest candidates at once (8 + 4) do not fit; one at a time
    # (BURSTCV_SIZING_PARALLEL=1) the largest alone (8) does.
    answers.set("servicequotas:GetServiceQuota", quota_answer(10.0))
    backend = Ec2Backend(s3_deployment.ec2)
    types = ["c7g.xlarge", "c7i.2xlarge", "c7i.large", "m7i.xlarge", "x2iedn.xlarge"]
    standard = "vCPU quota Standard (A, C, D, H, I, M, R, T, Z) on-demand (L-1216C47A)"

    lines = [f.line() for f in check_sizing_quota(backend, s3_deployment, types)]

    request = "aws service-quotas request-service-quota-increase --service-code ec2"
    assert lines == [
        "MISSING  vCPU quota of x2iedn.xlarge on-demand: not a G, VT, P or standard family: "
        "find its quota in Service Quotas (Amazon EC2) for us-east-1 and check it yourself",
        f"MISSING  {standard} in us-east-1: 10 vCPUs, sizing boxes c7i.2xlarge, c7g.xlarge "
        "(2 at once, BURSTCV_SIZING_PARALLEL) needs 12; ask for 12 (2 at once; more if other "
        f"instances of the family run in us-east-1): {request} --quota-code L-1216C47A "
        "--desired-value 12 --region us-east-1",
    ]
    one = s3_deployment.model_copy(update={"sizing_parallel": 1})
    assert [f.line() for f in check_sizing_quota(backend, one, types[:4])] == [
        f"ok       {standard} in us-east-1: 10 vCPUs, sizing boxes c7i.2xlarge "
        "(1 at once, BURSTCV_SIZING_PARALLEL) needs 8"
    ]
    # Exactly what two boxes at once need: enough.
    answers.set("servicequotas:GetServiceQuota", quota_answer(12.0))
    (exact,) = [f.line() for f in check_sizing_quota(backend, s3_deployment, types[:4])]
    assert exact.startswith(f"ok       {standard} in us-east-1: 12 vCPUs, sizing boxes")
    asked = {
        c.params["QuotaCode"] for c in audited_calls.snapshot() if c.service == "servicequotas"
    }
    assert asked == {"L-1216C47A"}  # sizing boxes are on demand: no spot quota is read


@pytest.mark.parametrize(
    ("parallel", "expected"),
    [
        (1, {"L-1216C47A": (["m7i.xlarge"], 4), "L-DB2E81BA": (["g6.xlarge"], 4)}),
        (2, {"L-1216C47A": (["m7i.xlarge", "c7g.large"], 6), "L-DB2E81BA": (["g6.xlarge"], 4)}),
        (
            3,
            {
                "L-1216C47A": (["m7i.xlarge", "c7g.large", "c7i.large"], 8),
                "L-DB2E81BA": (["g6.xlarge"], 4),
            },
        ),
    ],
)
def test_sizing_quota_needs_count_the_largest_boxes_each_quota_holds_at_once(
    parallel: int, expected: dict[str, tuple[list[str], int]]
) -> None:
    from burstcv.compute.awscheck import sizing_quota_needs

    vcpus = {"c7i.large": 2, "m7i.xlarge": 4, "c7g.large": 2, "g6.xlarge": 4, "x2iedn.xlarge": 4}
    needs = sizing_quota_needs(vcpus, parallel)
    assert {code: (types, need) for code, (_, types, need) in needs.items()} == expected
    assert needs["L-1216C47A"][0].family.startswith("Standard")


def test_a_sizing_type_refused_at_its_dry_run_is_named_with_awss_reason(
    s3_deployment: Any, answers: Answers, audited_calls: RecordingProxy
) -> None:
    from burstcv.compute.awscheck import check_sizing_launches

    # An organisation policy that denies Graviton: EC2 refuses the arm64 type, encoding why.
    def run_instances(call: Any) -> tuple[int, bytes]:
        if call.params["InstanceType"].startswith("c7g"):
            return 403, (
                b"<Response><Errors><Error><Code>UnauthorizedOperation</Code><Message>You are "
                b"not authorized to perform this operation. Encoded authorization failure "
                b"message: gRaViToN-dEnIeD</Message></Error></Errors><RequestID>r-3</RequestID>"
                b"</Response>"
            )
        return 412, (
            b"<Response><Errors><Error><Code>DryRunOperation</Code><Message>Request would have "
            b"succeeded, but DryRun flag is set.</Message></Error></Errors><RequestID>r-4"
            b"</RequestID></Response>"
        )

    instances = f"arn:aws:ec2:us-east-1:{ACCOUNT}:instance/*"
    decoded = json.dumps(
        {
            "allowed": False,
            "explicitDeny": True,
            "context": {"action": "ec2:RunInstances", "resource": instances},
        }
    )
    answers.set_answer("ec2:RunInstances", run_instances)
    answers.set(
        "sts:DecodeAuthorizationMessage",
        (
            '<DecodeAuthorizationMessageResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            f"<DecodeAuthorizationMessageResult><DecodedMessage>{escape(decoded)}</DecodedMessage>"
            "</DecodeAuthorizationMessageResult><ResponseMetadata><RequestId>r-5</RequestId>"
            "</ResponseMetadata></DecodeAuthorizationMessageResponse>"
        ).encode(),
    )
    backend = Ec2Backend(s3_deployment.ec2)

    lines = [f.line() for f in check_sizing_launches(backend, ["c7g.large", "c7i.large"])]

    images = {
        arch: backend.resolve_sizing_ami(arch) for arch in ("arm64", "x86_64")
    }  # AL2023, per architecture, as the sizing boxes resolve them
    assert images["arm64"] != images["x86_64"]
    assert lines[:2] == [
        f"ok       sizing boxes' AMI for arm64: {images['arm64']}",
        f"ok       sizing boxes' AMI for x86_64: {images['x86_64']}",
    ]
    refused, allowed = lines[2:]
    assert refused.startswith(
        f"MISSING  dry-run launch sizing box c7g.large on-demand ({images['arm64']}): "
        "a on-demand c7g.large launch in us-east-1 is not allowed (UnauthorizedOperation)"
    )
    assert f"ec2:RunInstances on {instances}" in refused
    assert refused.endswith("every sizing skips c7g.large; allow it, or serve on other families")
    assert allowed == (
        f"ok       dry-run launch sizing box c7i.large on-demand ({images['x86_64']})"
    )
    launches = [c for c in audited_calls.snapshot() if c.action == "ec2:RunInstances"]
    assert {(c.params["InstanceType"], c.params["ImageId"]) for c in launches} == {
        ("c7g.large", images["arm64"]),
        ("c7i.large", images["x86_64"]),
    }
    assert all(c.params["DryRun"] == "true" for c in launches)


def test_a_role_policy_missing_the_sizing_paths_is_named_for_the_sizing_boxes(
    s3_deployment: Any, kit: Any, answers: Answers
) -> None:
    from burstcv.compute.awscheck import check_instance_role_s3

    shipped = json.loads((DEPLOY / "instance-role-policy.json").read_text())
    sizing_sid = "WriteTheSizingBoxesFiguresAndLogs"
    without = {
        **shipped,
        "Statement": [s for s in shipped["Statement"] if s["Sid"] != sizing_sid],
    }
    answers.set(
        "iam:SimulatePrincipalPolicy",
        simulation_answer(without, instance_role_policy_variables(kit)),
    )
    backend = Ec2Backend(s3_deployment.ec2)

    training, sizing = [
        f.line() for f in check_instance_role_s3(backend, kit.artifact_root, sizing=True)
    ]

    under = f"burstcv-training: S3 access under {kit.artifact_root}"
    assert training == f"ok       training role {under}"
    assert sizing == (
        f"MISSING  sizing boxes' role {under}: the role may not s3:PutObject on "
        "runs/burstcv-check/bench/sizing/boxes/c7i.large.json (implicitDeny); s3:PutObject on "
        "runs/burstcv-check/bench/sizing/logs/c7i.large.log (implicitDeny): give it "
        "deploy/instance-role-policy.json (docs/aws.md, the training instance's role)"
    )
    # A training box's own check asks nothing of the sizing paths.
    assert [f.line() for f in check_instance_role_s3(backend, kit.artifact_root)] == [training]


def test_sizing_boxes_get_their_wheels_from_s3_where_staged_else_from_the_index(
    s3_deployment: Any, kit: Any, aws: str
) -> None:
    from burstcv.compute.awscheck import check_sizing_wheels
    from burstcv.compute.runtime import build_sizing_wheel, wheelhouse_uri

    backend = Ec2Backend(s3_deployment.ec2)
    admin = boto3.client("ec2", region_name=kit.region, endpoint_url=aws)
    types = ["c7g.large", "c7i.large"]
    x86, arm = "sizing boxes' wheels (cp311-x86_64)", "sizing boxes' wheels (cp311-aarch64)"
    later = (
        "no wheelhouse staged yet: a run stages one beside the wheel "
        "(pip download on the orchestrator)"
    )
    s3_only = (
        f"{later}; the boxes reach S3 only, so the orchestrator must reach the package index or "
        "hold the wheelhouse (BURSTCV_WHEELHOUSE_CACHE)"
    )
    assert [f.line() for f in check_sizing_wheels(backend, kit.artifact_root, types)] == [
        f"ok       {arm}: {s3_only}",
        f"ok       {x86}: {s3_only}",
    ]

    # The x86_64 wheelhouse of this checkout's sizing wheel is staged beside it.
    wheel = build_sizing_wheel()
    staged = wheelhouse_uri(
        f"{kit.artifact_root}/runtime/{wheel.sha256}/{wheel.filename}", "cp311-x86_64"
    )
    bucket, key = staged.removeprefix("s3://").split("/", 1)
    kit.s3.put_object(Bucket=bucket, Key=key, Body=b"a wheelhouse tar")
    # And the boxes' subnets have an internet gateway (public IPs on launch).
    vpc = backend.launch_subnets()[0].vpc_id
    (main,) = admin.describe_route_tables(
        Filters=[
            {"Name": "vpc-id", "Values": [vpc]},
            {"Name": "association.main", "Values": ["true"]},
        ]
    )["RouteTables"]
    igw = admin.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
    admin.attach_internet_gateway(InternetGatewayId=igw, VpcId=vpc)
    admin.create_route(
        RouteTableId=main["RouteTableId"], DestinationCidrBlock="0.0.0.0/0", GatewayId=igw
    )
    (default,) = admin.describe_security_groups(
        Filters=[{"Name": "vpc-id", "Values": [vpc]}, {"Name": "group-name", "Values": ["default"]}]
    )["SecurityGroups"]
    try:
        assert [f.line() for f in check_sizing_wheels(backend, kit.artifact_root, types)] == [
            f"ok       {arm}: {later}, else the boxes install from the package index via "
            f"internet gateway {igw}",
            f"ok       {x86}: from the wheelhouse {staged}; S3 suffices, no package index",
        ]
        # Groups that let HTTPS out to S3's prefix list only: the index is out of reach.
        admin.revoke_security_group_egress(
            GroupId=default["GroupId"], IpPermissions=default["IpPermissionsEgress"]
        )
        (arm_line, _) = [f.line() for f in check_sizing_wheels(backend, kit.artifact_root, types)]
        assert arm_line == f"ok       {arm}: {s3_only}"
    finally:
        admin.authorize_security_group_egress(
            GroupId=default["GroupId"],
            IpPermissions=[{"IpProtocol": "-1", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}],
        )
        admin.delete_route(RouteTableId=main["RouteTableId"], DestinationCidrBlock="0.0.0.0/0")
        admin.detach_internet_gateway(InternetGatewayId=igw, VpcId=vpc)
        admin.delete_internet_gateway(InternetGatewayId=igw)


@pytest.mark.parametrize(
    ("default_route", "public_ip", "way"),
    [
        ({"NatGatewayId": "nat-1"}, False, "NAT gateway nat-1"),
        ({"GatewayId": "igw-1"}, True, "internet gateway igw-1"),
        ({"GatewayId": "igw-1"}, False, ""),  # no public IP: the gateway does not carry it
        ({"GatewayId": "igw-1", "State": "blackhole"}, True, ""),
        ({"TransitGatewayId": "tgw-1"}, False, "default route via tgw-1 (not followed further)"),
        ({"GatewayId": "vpce-1"}, True, ""),
        (None, True, ""),
    ],
)
def test_a_subnets_way_to_the_internet_is_its_default_route(
    default_route: dict[str, str] | None, public_ip: bool, way: str
) -> None:
    from burstcv.compute.awscheck import _internet_way

    routes: list[dict[str, str]] = [{"DestinationCidrBlock": "172.31.0.0/16", "GatewayId": "local"}]
    if default_route is not None:
        routes.append({"DestinationCidrBlock": "0.0.0.0/0", **default_route})
    assert _internet_way({"RouteTableId": "rtb-1", "Routes": routes}, public_ip) == way


def test_a_refused_quota_read_and_a_sizing_image_that_does_not_resolve_say_what_to_set(
    s3_deployment: Any, answers: Answers, audited_calls: RecordingProxy
) -> None:
    from burstcv.compute.awscheck import check_sizing_launches

    answers.set(
        "servicequotas:GetServiceQuota",
        json.dumps(
            {"__type": "AccessDeniedException", "Message": "not authorized: GetServiceQuota"}
        ).encode(),
        status=400,
    )
    backend = Ec2Backend(
        s3_deployment.ec2.model_copy(
            update={"sizing_ami": "/aws/service/ami-amazon-linux-latest/no-such-image-{arch}"}
        )
    )

    (quota,) = [f.line() for f in check_sizing_quota(backend, s3_deployment, ["c7i.large"])]
    lines = [f.line() for f in check_sizing_launches(backend, ["c7i.large"])]

    assert quota.startswith(
        "MISSING  vCPU quota Standard (A, C, D, H, I, M, R, T, Z) on-demand (L-1216C47A) in "
        "us-east-1: AccessDeniedException: not authorized: GetServiceQuota; allow "
        "servicequotas:GetServiceQuota and servicequotas:GetAWSDefaultServiceQuota"
    )
    (image,) = lines  # no launch is tried without its image
    assert image.startswith("MISSING  sizing boxes' AMI for x86_64: ParameterNotFound")
    assert image.endswith(
        "check BURSTCV_EC2_SIZING_AMI (/aws/service/ami-amazon-linux-latest/no-such-image-{arch})"
    )
    assert not [c for c in audited_calls.snapshot() if c.action == "ec2:RunInstances"]
