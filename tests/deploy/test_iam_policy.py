"""Check the orchestrator's IAM policy is least-privilege for launching, tagging, terminating."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from moto.iam.policy_validation import IAMPolicyDocumentValidator

from burstcv.compute.base import (
    MANAGED_TAG_KEYS,
    TAG_DAG_ID,
    TAG_EXPIRES_AT,
    TAG_MANAGED,
    TAG_RUN_ID,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
POLICY_PATH = DEPLOY / "iam-policy.json"
# Actions without resource-level permissions: "*" is the only resource AWS accepts.
UNSCOPABLE = {
    "DescribeAnything": ["ec2:Describe*"],
    "DecodeLaunchRefusals": ["sts:DecodeAuthorizationMessage"],
    # The Price List API has no resource-level permissions: it answers for any region and type.
    "ReadOnDemandPrices": ["pricing:GetProducts"],
    # `burstcv aws check` reads the vCPU quotas and the account's EBS encryption defaults:
    # none of these actions has resource-level permissions.
    "ReadVcpuQuotas": [
        "servicequotas:GetServiceQuota",
        "servicequotas:GetAWSDefaultServiceQuota",
    ],
    "ReadEbsEncryptionDefaults": ["ec2:GetEbsEncryptionByDefault", "ec2:GetEbsDefaultKmsKeyId"],
}


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    """Return the parsed policy document."""
    return json.loads(POLICY_PATH.read_text())  # type: ignore[no-any-return]


def as_list(value: str | list[str]) -> list[str]:
    """Return a policy field that may be a string or a list as a list."""
    return [value] if isinstance(value, str) else list(value)


def statements(policy: dict[str, Any], effect: str, action: str) -> list[dict[str, Any]]:
    """Return the statements with ``effect`` that name ``action`` exactly."""
    return [
        s for s in policy["Statement"] if s["Effect"] == effect and action in as_list(s["Action"])
    ]


def test_is_a_valid_iam_policy_document(policy: dict[str, Any]) -> None:
    assert policy["Version"] == "2012-10-17"
    IAMPolicyDocumentValidator(POLICY_PATH.read_text()).validate()  # AWS's grammar, via moto


def test_no_wildcard_actions(policy: dict[str, Any]) -> None:
    for statement in policy["Statement"]:
        for action in as_list(statement["Action"]):
            _, _, name = action.partition(":")
            assert action != "*" and name != "*", f"{statement['Sid']}: {action}"
    wildcard_resources = [
        s["Sid"] for s in policy["Statement"] if s["Effect"] == "Allow" and s["Resource"] == "*"
    ]
    assert sorted(wildcard_resources) == sorted(UNSCOPABLE)
    for sid, actions in UNSCOPABLE.items():
        (statement,) = [s for s in policy["Statement"] if s["Sid"] == sid]
        assert as_list(statement["Action"]) == actions


def test_terminate_and_stop_only_with_the_managed_tag(policy: dict[str, Any]) -> None:
    for action in ("ec2:TerminateInstances", "ec2:StopInstances"):
        allows = statements(policy, "Allow", action)
        assert allows, action
        for statement in allows:
            condition = statement["Condition"]["StringEquals"]
            assert condition == {f"aws:ResourceTag/{TAG_MANAGED}": "true"}
        (deny,) = statements(policy, "Deny", action)
        assert deny["Condition"]["StringNotEquals"] == {f"aws:ResourceTag/{TAG_MANAGED}": "true"}


def test_launch_requires_the_managed_request_tag(policy: dict[str, Any]) -> None:
    allows = statements(policy, "Allow", "ec2:RunInstances")
    tagged = [
        s
        for s in allows
        if any(":instance/" in r or ":volume/" in r for r in as_list(s["Resource"]))
    ]
    assert len(tagged) == 1
    (statement,) = tagged
    assert statement["Condition"]["StringEquals"] == {f"aws:RequestTag/{TAG_MANAGED}": "true"}
    allowed_keys = statement["Condition"]["ForAllValues:StringEquals"]["aws:TagKeys"]
    assert {TAG_MANAGED, TAG_RUN_ID, TAG_DAG_ID, TAG_EXPIRES_AT} <= set(allowed_keys)
    # One definition: the keys a launch may send are exactly the ones the policy allows.
    assert sorted(allowed_keys) == sorted(MANAGED_TAG_KEYS)
    untagged = [s for s in allows if s is not statement]
    for s in untagged:  # the other RunInstances resources never include instances or volumes
        assert not any(":instance/" in r or ":volume/" in r for r in as_list(s["Resource"]))
    (deny,) = statements(policy, "Deny", "ec2:RunInstances")
    assert deny["Condition"]["StringNotEquals"] == {f"aws:RequestTag/{TAG_MANAGED}": "true"}


CREATE_ACTIONS = ["RunInstances", "CreatePlacementGroup", "CreateSecurityGroup"]


def test_tags_are_written_only_at_creation(policy: dict[str, Any]) -> None:
    (allow,) = statements(policy, "Allow", "ec2:CreateTags")
    assert allow["Condition"]["StringEquals"] == {"ec2:CreateAction": CREATE_ACTIONS}
    assert statements(policy, "Allow", "ec2:DeleteTags") == []
    (deny,) = statements(policy, "Deny", "ec2:CreateTags")
    assert "ec2:DeleteTags" in as_list(deny["Action"])
    assert deny["Condition"]["StringNotEquals"] == {"ec2:CreateAction": CREATE_ACTIONS}


def test_run_groups_are_created_tagged_and_changed_only_when_managed(
    policy: dict[str, Any],
) -> None:
    creates = [
        s
        for s in statements(policy, "Allow", "ec2:CreatePlacementGroup")
        + statements(policy, "Allow", "ec2:CreateSecurityGroup")
        if any(":vpc/" not in r for r in as_list(s["Resource"]))
    ]
    (create,) = {id(s): s for s in creates}.values()
    assert create["Condition"]["StringEquals"] == {f"aws:RequestTag/{TAG_MANAGED}": "true"}
    keys = create["Condition"]["ForAllValues:StringEquals"]["aws:TagKeys"]
    assert sorted(keys) == sorted(MANAGED_TAG_KEYS)
    (vpc,) = [s for s in statements(policy, "Allow", "ec2:CreateSecurityGroup") if s is not create]
    assert as_list(vpc["Resource"]) == ["arn:aws:ec2:*:ACCOUNT_ID:vpc/*"]
    for action in (
        "ec2:AuthorizeSecurityGroupIngress",
        "ec2:DeleteSecurityGroup",
        "ec2:DeletePlacementGroup",
    ):
        (allow,) = statements(policy, "Allow", action)
        assert allow["Condition"] == {"StringEquals": {f"aws:ResourceTag/{TAG_MANAGED}": "true"}}, (
            action
        )
        (deny,) = statements(policy, "Deny", action)
        assert deny["Condition"] == {
            "StringNotEquals": {f"aws:ResourceTag/{TAG_MANAGED}": "true"}
        }, action
    launches = [
        s
        for s in statements(policy, "Allow", "ec2:RunInstances")
        if any(":placement-group/" in r for r in as_list(s["Resource"]))
    ]
    (launch,) = launches
    assert launch["Condition"] == {"StringEquals": {f"aws:ResourceTag/{TAG_MANAGED}": "true"}}


def test_pass_role_names_each_role_for_its_one_service(policy: dict[str, Any]) -> None:
    passes = {
        tuple(as_list(s["Resource"])): s["Condition"]["StringEquals"]["iam:PassedToService"]
        for s in statements(policy, "Allow", "iam:PassRole")
    }
    assert passes == {
        ("arn:aws:iam::ACCOUNT_ID:role/burstcv-training",): "ec2.amazonaws.com",
        ("arn:aws:iam::ACCOUNT_ID:role/burstcv-backstop",): "scheduler.amazonaws.com",
    }


def test_only_the_spot_service_linked_role_may_be_created(policy: dict[str, Any]) -> None:
    (statement,) = statements(policy, "Allow", "iam:CreateServiceLinkedRole")
    assert as_list(statement["Resource"]) == [
        "arn:aws:iam::ACCOUNT_ID:role/aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot"
    ]
    assert statement["Condition"] == {"StringEquals": {"iam:AWSServiceName": "spot.amazonaws.com"}}


def test_deletes_reach_only_registry_aliases_and_run_files(policy: dict[str, Any]) -> None:
    (statement,) = statements(policy, "Allow", "s3:DeleteObject")
    assert sorted(as_list(statement["Resource"])) == [
        "arn:aws:s3:::BURSTCV_BUCKET/*/aliases/*",
        "arn:aws:s3:::BURSTCV_BUCKET/*/runs/*",
        "arn:aws:s3:::BURSTCV_BUCKET/runs/*",
    ]


def test_backstop_schedules_are_burstcv_ones_only(policy: dict[str, Any]) -> None:
    scheduler = [
        s
        for s in policy["Statement"]
        if any(a.startswith("scheduler:") for a in as_list(s["Action"]))
    ]
    (statement,) = scheduler
    assert as_list(statement["Resource"]) == [
        "arn:aws:scheduler:*:ACCOUNT_ID:schedule/default/burstcv-backstop-*"
    ]


@pytest.mark.parametrize("name", ["backstop-role-policy.json", "backstop-role-trust.json"])
def test_backstop_role_documents_are_valid(name: str) -> None:
    text = (DEPLOY / name).read_text()
    doc = json.loads(text)
    assert doc["Version"] == "2012-10-17"
    if name == "backstop-role-policy.json":
        IAMPolicyDocumentValidator(text).validate()
        (statement,) = doc["Statement"]
        assert statement["Action"] == "ec2:TerminateInstances"
        assert statement["Condition"] == {
            "StringEquals": {f"aws:ResourceTag/{TAG_MANAGED}": "true"}
        }
    else:
        (statement,) = doc["Statement"]
        assert statement["Principal"] == {"Service": "scheduler.amazonaws.com"}


def test_s3_and_ssm_are_scoped(policy: dict[str, Any]) -> None:
    s3_resources = [
        r
        for s in policy["Statement"]
        if any(a.startswith("s3:") for a in as_list(s["Action"]))
        for r in as_list(s["Resource"])
    ]
    assert s3_resources and all(r.startswith("arn:aws:s3:::BURSTCV_BUCKET") for r in s3_resources)
    (ssm,) = statements(policy, "Allow", "ssm:GetParameter")
    # The Deep Learning AMIs (training) and Amazon Linux 2023 (sizing boxes), nothing else.
    assert as_list(ssm["Resource"]) == [
        "arn:aws:ssm:*::parameter/aws/service/deeplearning/*",
        "arn:aws:ssm:*::parameter/aws/service/ami-amazon-linux-latest/*",
    ]
