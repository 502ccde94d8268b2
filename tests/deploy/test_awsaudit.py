"""Check the test-support IAM evaluator (tests/awsaudit.py) on the rules the audit relies on."""

from __future__ import annotations

from typing import Any

import pytest
from awsaudit import Check, condition_holds, evaluate

INSTANCE = "arn:aws:ec2:us-east-1:111:instance/*"


def policy(*statements: dict[str, Any]) -> dict[str, Any]:
    """Return a policy document of the given statements."""
    return {"Version": "2012-10-17", "Statement": list(statements)}


ALLOW_RUN = {
    "Sid": "Run",
    "Effect": "Allow",
    "Action": "ec2:RunInstances",
    "Resource": "arn:aws:ec2:*:ACCOUNT_ID:instance/*",
    "Condition": {"ForAllValues:StringEquals": {"aws:TagKeys": ["a", "b"]}},
}


def test_allow_needs_action_resource_and_every_condition() -> None:
    doc = policy(ALLOW_RUN)
    ok = Check("ec2:RunInstances", INSTANCE, {"aws:TagKeys": ["a"]})
    assert evaluate(doc, ok, {"ACCOUNT_ID": "111"})[0]
    assert not evaluate(doc, ok, {"ACCOUNT_ID": "222"})[0]  # another account's ARN
    extra = Check("ec2:RunInstances", INSTANCE, {"aws:TagKeys": ["a", "c"]})
    allowed, reason = evaluate(doc, extra, {"ACCOUNT_ID": "111"})
    assert not allowed and "no statement allows" in reason and "'c'" in reason
    other = Check("ec2:StopInstances", INSTANCE)
    assert not evaluate(doc, other, {"ACCOUNT_ID": "111"})[0]


def test_explicit_deny_wins_and_is_named() -> None:
    deny = {
        "Sid": "NoUntagged",
        "Effect": "Deny",
        "Action": "ec2:*",
        "Resource": "*",
        "Condition": {"StringNotEquals": {"aws:RequestTag/managed": "true"}},
    }
    doc = policy(ALLOW_RUN, deny)
    check = Check("ec2:RunInstances", INSTANCE, {"aws:TagKeys": []})
    assert evaluate(doc, check, {"ACCOUNT_ID": "111"}) == (
        False,
        f"ec2:RunInstances on {INSTANCE}: explicitly denied by NoUntagged",
    )
    tagged = Check(
        "ec2:RunInstances", INSTANCE, {"aws:TagKeys": ["a"], "aws:RequestTag/managed": "true"}
    )
    assert evaluate(doc, tagged, {"ACCOUNT_ID": "111"})[0]


def test_not_action_and_wildcards() -> None:
    doc = policy({"Effect": "Allow", "NotAction": "iam:*", "Resource": "arn:aws:s3:::b/run?/*"})
    assert evaluate(doc, Check("s3:GetObject", "arn:aws:s3:::b/runs/x/y"))[0]
    assert not evaluate(doc, Check("s3:GetObject", "arn:aws:s3:::b/run/x"))[0]
    assert not evaluate(doc, Check("iam:PassRole", "arn:aws:s3:::b/runs/x"))[0]
    assert evaluate(doc, Check("S3:getobject", "arn:aws:s3:::b/runs/x"))[0]  # actions: any case


@pytest.mark.parametrize(
    ("operator", "expected", "context", "holds"),
    [
        ("StringEquals", "x", {}, False),  # a missing key fails a positive operator
        ("StringNotEquals", "x", {}, True),  # and passes a negated one
        ("StringEqualsIfExists", "x", {}, True),
        ("StringLike", "ml-*", {"k": "ml-team"}, True),
        ("StringNotLike", "ml-*", {"k": "ml-team"}, False),
        ("ForAllValues:StringEquals", ["a"], {}, True),  # vacuous
        ("ForAnyValue:StringEquals", ["a"], {"k": ["b", "a"]}, True),
        ("Null", "true", {}, True),
        ("Null", "false", {}, False),
        ("Bool", "true", {"k": "True"}, True),
    ],
)
def test_condition_operators(
    operator: str, expected: Any, context: dict[str, Any], holds: bool
) -> None:
    assert condition_holds(operator, "k", expected, context) is holds


def test_an_unknown_operator_is_an_error_not_a_pass() -> None:
    with pytest.raises(ValueError, match="NumericLessThan"):
        condition_holds("NumericLessThan", "k", "3", {"k": "1"})
