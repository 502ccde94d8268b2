"""Check the test-support IAM evaluator (tests/awsaudit.py) on the rules the audit relies on."""

from __future__ import annotations

import http.client
import socket
from typing import Any

import pytest
from awsaudit import Check, RecordingProxy, condition_holds, evaluate

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


def test_the_proxy_serves_on_a_socket_handed_in_and_records_each_call(
    moto_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # as a sandbox would, inside its own network namespace
    with RecordingProxy(moto_url, sock) as proxy:
        assert proxy.url == f"http://127.0.0.1:{sock.getsockname()[1]}"
        s3 = boto3.client("s3", endpoint_url=proxy.url)
        s3.create_bucket(Bucket="audit-bucket")
        s3.put_object(Bucket="audit-bucket", Key="runs/r/job/DONE", Body=b"{}")
        assert s3.get_object(Bucket="audit-bucket", Key="runs/r/job/DONE")["Body"].read() == b"{}"
        s3.list_objects_v2(Bucket="audit-bucket", Prefix="runs/")
        s3.delete_object(Bucket="audit-bucket", Key="runs/r/job/DONE")
        # A body sent with chunked transfer encoding (what streaming clients do) arrives whole.
        conn = http.client.HTTPConnection("127.0.0.1", sock.getsockname()[1], timeout=10)
        conn.putrequest("PUT", "/audit-bucket/runs/r/log")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.putheader(
            "Authorization",
            "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, "
            "SignedHeaders=host, Signature=0",
        )
        conn.endheaders()
        for part in (b"first ", b"second"):
            conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        conn.send(b"0\r\n\r\n")
        assert conn.getresponse().status == 200
        conn.close()
        assert s3.get_object(Bucket="audit-bucket", Key="runs/r/log")["Body"].read() == (
            b"first second"
        )
        ec2 = boto3.client("ec2", endpoint_url=proxy.url)
        image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        (instance,) = ec2.run_instances(
            ImageId=image,
            MinCount=1,
            MaxCount=1,
            TagSpecifications=[
                {"ResourceType": "instance", "Tags": [{"Key": "burstcv:managed", "Value": "true"}]}
            ],
        )["Instances"]
        ec2.terminate_instances(InstanceIds=[instance["InstanceId"]])
        calls = proxy.snapshot()
    assert [c.action for c in calls] == [
        "s3:CreateBucket",
        "s3:PutObject",
        "s3:GetObject",
        "s3:ListBucket",
        "s3:DeleteObject",
        "s3:PutObject",
        "s3:GetObject",
        "ec2:DescribeImages",
        "ec2:RunInstances",
        "ec2:TerminateInstances",
    ]
    assert calls[3].checks[0].context == {"s3:prefix": "runs/"}
    run = calls[8]
    assert run.checks[0].resource == "arn:aws:ec2:us-east-1:123456789012:instance/*"
    assert run.checks[0].context == {
        "aws:RequestTag/burstcv:managed": "true",
        "aws:TagKeys": ["burstcv:managed"],
    }
    assert any(c.action == "ec2:CreateTags" for c in run.checks)
    (terminate,) = calls[9].checks
    assert terminate.resource.endswith(f":instance/{instance['InstanceId']}")
    assert terminate.context == {"aws:ResourceTag/burstcv:managed": "true"}
