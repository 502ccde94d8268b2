"""Record every AWS call a process makes (an HTTP proxy in front of moto) and judge it by IAM.

``RecordingProxy`` sits between any AWS client (boto3, the AWS CLI, another process, a network
namespace) and the moto server. It forwards each request unchanged and records it as the AWS
call it is: the service (from the SigV4 credential scope), the IAM action, and the
authorizations AWS would check for it (``Check``: action, resource ARN, condition context),
including the implied ones (``iam:PassRole`` for an instance profile's role or a schedule's
role, ``ec2:CreateTags`` for tags set at launch or at a group's creation, the Spot
service-linked role, the placement group a launch goes into).

``evaluate(policy, call, variables)`` is a small IAM evaluator over those checks: Effect,
Action/NotAction, Resource/NotResource with ``*``/``?`` wildcards, and the condition operators
the shipped policies use; an explicit Deny wins, and no matching Allow is an implicit deny.
Recording at the HTTP level rather than patching boto3 is what lets one tool audit separate
processes.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from xml.sax.saxutils import escape

MOTO_ACCOUNT_ID = "123456789012"

ContextValue = str | list[str]

# Hop-by-hop headers never forwarded (RFC 9110 §7.6.1); framing is redone by the proxy.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}
_CREDENTIAL = re.compile(r"Credential=[^/,\s]+/\d{8}/([^/]+)/([^/]+)/aws4_request")
# EC2 actions whose authorization is per instance and keyed on the instance's own tags.
_PER_INSTANCE = {
    "TerminateInstances",
    "StopInstances",
    "StartInstances",
    "RebootInstances",
    "ModifyInstanceAttribute",
    "GetConsoleOutput",
}
SPOT_SERVICE_LINKED_ROLE = "role/aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot"


@dataclass(frozen=True)
class Check:
    """Name one authorization AWS makes for a call: an action on a resource, in a context."""

    action: str
    resource: str
    context: Mapping[str, ContextValue] = field(default_factory=dict)


@dataclass
class AwsCall:
    """Describe one recorded AWS request and the authorizations it needs."""

    service: str  # SigV4 signing name: ec2, s3, ssm, iam, sts, scheduler
    action: str  # IAM action, e.g. "ec2:RunInstances"
    region: str
    method: str
    path: str
    params: dict[str, Any]  # query-protocol parameters, the JSON body, or S3 query/headers
    checks: list[Check]
    status: int = 0  # the upstream's HTTP status

    @property
    def resources(self) -> list[str]:
        """Return every resource ARN the call touches."""
        return [c.resource for c in self.checks]

    def __str__(self) -> str:
        return f"{self.action} {self.method} {self.path} -> {self.status}"


# A recorded response: (HTTP status, body), or a function of the call that returns one.
Answer = tuple[int, bytes] | Callable[[AwsCall], tuple[int, bytes]]


def console_answer(instance_id: str, console: str) -> tuple[int, bytes]:
    """Answer GetConsoleOutput as EC2 does once it has captured a box's console (base64)."""
    import base64
    from datetime import UTC, datetime

    encoded = base64.b64encode(console.encode()).decode()
    return 200, (
        '<GetConsoleOutputResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
        f"<requestId>console-1</requestId><instanceId>{instance_id}</instanceId>"
        f"<timestamp>{datetime.now(UTC).isoformat()}</timestamp><output>{encoded}</output>"
        "</GetConsoleOutputResponse>"
    ).encode()


def price_list_answer(instance_type: str, region: str, usd: str) -> bytes:
    """Return a GetProducts response as the Price List API sends it (PriceList: JSON strings):
    one Linux, shared-tenancy product of ``instance_type`` in ``region`` at ``usd`` an hour."""
    product = {
        "product": {
            "productFamily": "Compute Instance",
            "attributes": {
                "instanceType": instance_type,
                "regionCode": region,
                "operatingSystem": "Linux",
                "tenancy": "Shared",
                "preInstalledSw": "NA",
                "capacitystatus": "Used",
            },
            "sku": "8VCNEHQMSCQS4P39",
        },
        "serviceCode": "AmazonEC2",
        "terms": {
            "OnDemand": {
                "8VCNEHQMSCQS4P39.JRTCKXETXF": {
                    "priceDimensions": {
                        "8VCNEHQMSCQS4P39.JRTCKXETXF.6YS6EN2CT7": {
                            "unit": "Hrs",
                            "pricePerUnit": {"USD": usd},
                            "description": f"${usd} per On Demand Linux {instance_type} Hour",
                        }
                    },
                    "effectiveDate": "2026-11-01T00:00:00Z",
                }
            }
        },
        "version": "20261101000000",
        "publicationDate": "2026-11-01T00:00:00Z",
    }
    return json.dumps({"FormatVersion": "aws_v1", "PriceList": [json.dumps(product)]}).encode()


EMPTY_PRICE_LIST = json.dumps({"FormatVersion": "aws_v1", "PriceList": []}).encode()


def price_list(prices: Mapping[str, str], region: str) -> Callable[[AwsCall], tuple[int, bytes]]:
    """Return an answer to GetProducts as the Price List API gives it: the product its filters
    name when it is a type of ``prices`` in ``region``, else an empty list."""

    def answer(call: AwsCall) -> tuple[int, bytes]:
        asked = {f["Field"]: f["Value"] for f in call.params["Filters"]}
        usd = prices.get(asked["instanceType"]) if asked["regionCode"] == region else None
        if usd is None:
            return 200, EMPTY_PRICE_LIST
        return 200, price_list_answer(asked["instanceType"], region, usd)

    return answer


# --- the proxy ----------------------------------------------------------------------------------


class RecordingProxy:
    """Forward HTTP requests to ``upstream_url`` and record each as an ``AwsCall``.

    Serves on 127.0.0.1 (a free port) or on ``sock``, a bound socket handed in (one made inside
    a network namespace, say). ``calls`` is appended to under a lock; read ``snapshot()`` for a
    consistent copy. An instance profile's role is taken to share its name unless
    ``instance_profile_roles`` maps it.
    """

    def __init__(
        self,
        upstream_url: str,
        sock: socket.socket | None = None,
        *,
        account_id: str = MOTO_ACCOUNT_ID,
        instance_profile_roles: Mapping[str, str] | None = None,
    ) -> None:
        self.upstream = urllib.parse.urlsplit(upstream_url)
        self.account_id = account_id
        self.instance_profile_roles = dict(instance_profile_roles or {})
        self.calls: list[AwsCall] = []
        # Recorded responses for calls the emulator does not model (the Price List API):
        # action -> (status, JSON body), or a function of the call returning one (an answer
        # that depends on what was asked). The call is still recorded and audited.
        self.answers: dict[str, Answer] = {}
        self._lock = threading.Lock()
        handler = _handler_for(self)
        if sock is None:
            self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        else:
            self._server = ThreadingHTTPServer(
                sock.getsockname()[:2], handler, bind_and_activate=False
            )
            self._server.socket.close()
            self._server.socket = sock
            self._server.server_address = sock.getsockname()[:2]
            sock.listen(64)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        host_text = host.decode() if isinstance(host, bytes) else str(host)
        self.url = f"http://{host_text}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="aws-recording-proxy", daemon=True
        )
        self._thread.start()

    def snapshot(self) -> list[AwsCall]:
        """Return a copy of the calls recorded so far."""
        with self._lock:
            return list(self.calls)

    def clear(self) -> None:
        """Forget the calls recorded so far."""
        with self._lock:
            self.calls.clear()

    def record(self, call: AwsCall) -> None:
        """Append one call (thread-safe)."""
        with self._lock:
            self.calls.append(call)

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> RecordingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- forwarding ---

    def forward(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """Send one request upstream and return its status, headers and body."""
        conn = HTTPConnection(self.upstream.hostname or "127.0.0.1", self.upstream.port, timeout=60)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in _HOP_BY_HOP:
                    conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            data = response.read()
            return response.status, response.getheaders(), data
        finally:
            conn.close()

    def _upstream_ec2(self, region: str) -> Any:
        import boto3

        return boto3.client(
            "ec2",
            region_name=region,
            endpoint_url=self.upstream.geturl(),
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def group_tags(self, region: str, kind: str, key: str) -> dict[str, str]:
        """Ask the upstream for the tags of a security group (by id) or placement group (name)."""
        ec2 = self._upstream_ec2(region)
        try:
            if kind == "security-group":
                found = ec2.describe_security_groups(GroupIds=[key])["SecurityGroups"]
            else:
                found = ec2.describe_placement_groups(GroupNames=[key])["PlacementGroups"]
        except ec2.exceptions.ClientError:
            return {}  # unknown group: no tags, as AWS would evaluate it
        return {t["Key"]: t["Value"] for g in found for t in g.get("Tags", [])}

    def instance_tags(self, region: str, instance_ids: list[str]) -> dict[str, dict[str, str]]:
        """Ask the upstream for the tags of instances (the aws:ResourceTag context)."""
        import boto3

        ec2 = boto3.client(
            "ec2",
            region_name=region,
            endpoint_url=self.upstream.geturl(),
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        tags: dict[str, dict[str, str]] = {iid: {} for iid in instance_ids}
        for iid in instance_ids:
            try:
                reservations = ec2.describe_instances(InstanceIds=[iid])["Reservations"]
            except ec2.exceptions.ClientError:
                continue  # unknown instance: no tags, as AWS would evaluate it
            for inst in (i for r in reservations for i in r["Instances"]):
                tags[iid] = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        return tags


def _handler_for(proxy: RecordingProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return  # the calls list is the record

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailer fields
                        break
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                return b"".join(parts)
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _serve(self) -> None:
            body = self._body()
            headers = list(self.headers.items())
            call = describe_request(proxy, self.command, self.path, dict(self.headers), body)
            if call.action in proxy.answers:
                answer = proxy.answers[call.action]
                status, data = answer(call) if callable(answer) else answer
                out_headers = [("Content-Type", "application/x-amz-json-1.1")]
            else:
                status, out_headers, data = proxy.forward(self.command, self.path, headers, body)
            call.status = status
            proxy.record(call)
            self.send_response(status)
            for name, value in out_headers:
                if name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            if self.command == "HEAD":
                length = dict((k.lower(), v) for k, v in out_headers).get("content-length", "0")
                self.send_header("Content-Length", length)
                self.end_headers()
                return
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _serve

    return Handler


# --- request -> AWS call ------------------------------------------------------------------------


def describe_request(
    proxy: RecordingProxy, method: str, target: str, headers: Mapping[str, str], body: bytes
) -> AwsCall:
    """Return the AWS call an HTTP request makes, with the authorizations it needs."""
    lowered = {k.lower(): v for k, v in headers.items()}
    split = urllib.parse.urlsplit(target)
    query = dict(urllib.parse.parse_qsl(split.query, keep_blank_values=True))
    match = _CREDENTIAL.search(lowered.get("authorization", "")) or _CREDENTIAL.search(
        "Credential=" + query.get("X-Amz-Credential", "")
    )
    region, service = (match.group(1), match.group(2)) if match else ("", "unknown")
    path = urllib.parse.unquote(split.path)
    account = proxy.account_id

    amz_target = lowered.get("x-amz-target", "")
    if amz_target:  # JSON protocol (ssm, …): X-Amz-Target: AmazonSSM.GetParameter
        name = amz_target.rsplit(".", 1)[-1]
        params = json.loads(body or b"{}")
        action = f"{service}:{name}"
        return AwsCall(
            service, action, region, method, path, params, _json_checks(action, params, region)
        )

    form = dict(query)
    if "x-www-form-urlencoded" in lowered.get("content-type", ""):
        form.update(urllib.parse.parse_qsl(body.decode(), keep_blank_values=True))
    if "Action" in form:  # query protocol (ec2, iam, sts)
        action = f"{service}:{form['Action']}"
        checks = _query_checks(proxy, service, form, region)
        return AwsCall(service, action, region, method, path, form, checks)

    if service == "s3":
        action, checks = _s3_checks(method, path, query, lowered, body)
        return AwsCall(service, action, region, method, path, query, checks)
    if service == "scheduler":
        params = json.loads(body or b"{}") if body else {}
        action, checks = _scheduler_checks(method, path, query, params, region, account)
        return AwsCall(service, action, region, method, path, params, checks)
    action = f"{service}:{method} {path}"
    return AwsCall(service, action, region, method, path, query, [Check(action, "*")])


def _indexed(form: Mapping[str, str], prefix: str) -> list[str]:
    """Return the values of ``Prefix.1``, ``Prefix.2``, … in order."""
    found = []
    for key, value in form.items():
        m = re.fullmatch(re.escape(prefix) + r"\.(\d+)", key)
        if m:
            found.append((int(m.group(1)), value))
    return [v for _, v in sorted(found)]


def _tag_specifications(form: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Return {resource type: {tag key: value}} from RunInstances' TagSpecification.N."""
    specs: dict[str, dict[str, str]] = {}
    for key, kind in form.items():
        m = re.fullmatch(r"TagSpecification\.(\d+)\.ResourceType", key)
        if not m:
            continue
        n = m.group(1)
        keys = _indexed_fields(form, f"TagSpecification.{n}.Tag", "Key")
        values = _indexed_fields(form, f"TagSpecification.{n}.Tag", "Value")
        specs.setdefault(kind, {}).update(
            {k: values.get(i, "") for i, k in keys.items()}  # same index pairs key and value
        )
    return specs


def _indexed_fields(form: Mapping[str, str], prefix: str, name: str) -> dict[int, str]:
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\." + re.escape(name))
    return {int(m.group(1)): v for k, v in form.items() if (m := pattern.fullmatch(k))}


def _tag_context(tags: Mapping[str, str], kind: str = "RequestTag") -> dict[str, ContextValue]:
    context: dict[str, ContextValue] = {f"aws:{kind}/{k}": v for k, v in tags.items()}
    if kind == "RequestTag":
        context["aws:TagKeys"] = list(tags)
    return context


def _query_checks(
    proxy: RecordingProxy, service: str, form: Mapping[str, str], region: str
) -> list[Check]:
    action = f"{service}:{form['Action']}"
    account = proxy.account_id
    if service == "sts" and form["Action"] == "GetCallerIdentity":
        return []  # needs no permission
    if service != "ec2":
        return [Check(action, "*")]
    name = form["Action"]
    ec2 = f"arn:aws:ec2:{region}:{account}"
    if name == "RunInstances":
        return _run_instances_checks(proxy, form, region)
    if name in _PER_INSTANCE:
        ids = _indexed(form, "InstanceId") or [form.get("InstanceId", "")]
        found = proxy.instance_tags(region, ids)
        return [
            Check(action, f"{ec2}:instance/{iid}", _tag_context(found[iid], "ResourceTag"))
            for iid in ids
        ]
    if name in ("CreatePlacementGroup", "CreateSecurityGroup"):
        kind = "placement-group" if name == "CreatePlacementGroup" else "security-group"
        tags = _tag_specifications(form).get(kind, {})
        named = form.get("GroupName", "*") if kind == "placement-group" else "*"
        resource = f"{ec2}:{kind}/{named}"
        checks = [
            Check(action, resource, _tag_context(tags)),
            Check("ec2:CreateTags", resource, {"ec2:CreateAction": name, **_tag_context(tags)}),
        ]
        if kind == "security-group":
            checks.append(Check(action, f"{ec2}:vpc/{form.get('VpcId', '*')}"))
        return checks
    if name in ("AuthorizeSecurityGroupIngress", "DeleteSecurityGroup"):
        group = form.get("GroupId", "")
        tags = proxy.group_tags(region, "security-group", group)
        return [Check(action, f"{ec2}:security-group/{group}", _tag_context(tags, "ResourceTag"))]
    if name == "DeletePlacementGroup":
        group = form.get("GroupName", "")
        tags = proxy.group_tags(region, "placement-group", group)
        return [Check(action, f"{ec2}:placement-group/{group}", _tag_context(tags, "ResourceTag"))]
    if name in ("CreateTags", "DeleteTags"):
        ids = _indexed(form, "ResourceId")
        keys = _indexed_fields(form, "Tag", "Key")
        values = _indexed_fields(form, "Tag", "Value")
        tags = {k: values.get(i, "") for i, k in keys.items()}
        return [Check(action, f"{ec2}:instance/{iid}", _tag_context(tags)) for iid in ids]
    return [Check(action, "*")]  # Describe*: no resource-level permissions


def _run_instances_checks(
    proxy: RecordingProxy, form: Mapping[str, str], region: str
) -> list[Check]:
    account = proxy.account_id
    ec2 = f"arn:aws:ec2:{region}:{account}"
    run = "ec2:RunInstances"
    specs = _tag_specifications(form)
    checks = [
        Check(run, f"{ec2}:instance/*", _tag_context(specs.get("instance", {}))),
        Check(run, f"{ec2}:volume/*", _tag_context(specs.get("volume", {}))),
        Check(run, f"arn:aws:ec2:{region}::image/{form.get('ImageId', '*')}"),
        Check(run, f"{ec2}:network-interface/*"),
        Check(run, f"{ec2}:subnet/{form.get('SubnetId', '*')}"),
    ]
    groups = _indexed(form, "SecurityGroupId") or ["*"]
    checks += [Check(run, f"{ec2}:security-group/{g}") for g in groups]
    placement = form.get("Placement.GroupName", "")
    if placement:  # several boxes: launched into the run's placement group
        tags = proxy.group_tags(region, "placement-group", placement)
        checks.append(
            Check(run, f"{ec2}:placement-group/{placement}", _tag_context(tags, "ResourceTag"))
        )
    for kind, tags in specs.items():  # tagging at creation is its own authorization
        resource = f"{ec2}:{kind}/*"
        checks.append(
            Check(
                "ec2:CreateTags",
                resource,
                {"ec2:CreateAction": "RunInstances", **_tag_context(tags)},
            )
        )
    if form.get("InstanceMarketOptions.MarketType") == "spot":
        checks.append(Check(run, f"{ec2}:spot-instances-request/*"))
        # A first spot launch in an account makes EC2 create its service-linked role.
        checks.append(
            Check(
                "iam:CreateServiceLinkedRole",
                f"arn:aws:iam::{account}:{SPOT_SERVICE_LINKED_ROLE}",
                {"iam:AWSServiceName": "spot.amazonaws.com"},
            )
        )
    profile = form.get("IamInstanceProfile.Name") or form.get("IamInstanceProfile.Arn", "")
    if profile:
        name = profile.rsplit("/", 1)[-1]
        role = proxy.instance_profile_roles.get(name, name)
        checks.append(
            Check(
                "iam:PassRole",
                f"arn:aws:iam::{account}:role/{role}",
                {"iam:PassedToService": "ec2.amazonaws.com"},
            )
        )
    return checks


def _json_checks(action: str, params: Mapping[str, Any], region: str) -> list[Check]:
    if action in ("ssm:GetParameter", "ssm:GetParameters"):
        names = params.get("Names") or [params.get("Name", "")]
        return [Check(action, _ssm_parameter_arn(n, region)) for n in names]
    return [Check(action, "*")]


def _ssm_parameter_arn(name: str, region: str) -> str:
    if name.startswith("arn:"):
        return name
    # AWS's public parameters (/aws/service/…) belong to no account.
    account = "" if name.startswith("/aws/") else MOTO_ACCOUNT_ID
    return f"arn:aws:ssm:{region}:{account}:parameter/{name.lstrip('/')}"


def _s3_checks(
    method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str], body: bytes
) -> tuple[str, list[Check]]:
    bucket, _, key = path.lstrip("/").partition("/")
    bucket_arn = f"arn:aws:s3:::{bucket}"
    object_arn = f"{bucket_arn}/{key}"
    if not key:
        if method == "POST" and "delete" in query:  # DeleteObjects: one check per key
            keys = [
                el.text or ""
                for el in ET.fromstring(body).iter()
                if el.tag.rsplit("}", 1)[-1] == "Key"
            ]
            return "s3:DeleteObject", [Check("s3:DeleteObject", f"{bucket_arn}/{k}") for k in keys]
        if method in ("GET", "HEAD") and not (
            set(query)
            - {
                "list-type",
                "prefix",
                "delimiter",
                "continuation-token",
                "max-keys",
                "start-after",
                "encoding-type",
                "marker",
                "fetch-owner",
            }
        ):
            prefix = {"s3:prefix": query["prefix"]} if "prefix" in query else {}
            return "s3:ListBucket", [Check("s3:ListBucket", bucket_arn, prefix)]
        if method == "GET" and set(query) == {"encryption"}:  # GetBucketEncryption
            return "s3:GetEncryptionConfiguration", [
                Check("s3:GetEncryptionConfiguration", bucket_arn)
            ]
        names = {"PUT": "s3:CreateBucket", "DELETE": "s3:DeleteBucket"}
        action = names.get(method) or f"s3:{method.title()}Bucket?{'&'.join(sorted(query))}"
        return action, [Check(action, bucket_arn)]
    if method in ("GET", "HEAD"):
        action = "s3:ListMultipartUploadParts" if "uploadId" in query else "s3:GetObject"
        return action, [Check(action, object_arn)]
    if method in ("PUT", "POST"):
        checks = [Check("s3:PutObject", object_arn)]
        source = headers.get("x-amz-copy-source")
        if source:
            src = urllib.parse.unquote(source).lstrip("/").split("?", 1)[0]
            checks.append(Check("s3:GetObject", f"arn:aws:s3:::{src}"))
        return "s3:PutObject", checks
    if method == "DELETE":
        action = "s3:AbortMultipartUpload" if "uploadId" in query else "s3:DeleteObject"
        return action, [Check(action, object_arn)]
    action = f"s3:{method}"
    return action, [Check(action, object_arn)]


def _scheduler_checks(
    method: str,
    path: str,
    query: Mapping[str, str],
    params: Mapping[str, Any],
    region: str,
    account: str,
) -> tuple[str, list[Check]]:
    parts = path.strip("/").split("/")
    if parts[0] == "schedules" and len(parts) == 2:
        group = params.get("GroupName") or query.get("groupName") or "default"
        arn = f"arn:aws:scheduler:{region}:{account}:schedule/{group}/{parts[1]}"
        name = {
            "POST": "CreateSchedule",
            "PUT": "UpdateSchedule",
            "GET": "GetSchedule",
            "DELETE": "DeleteSchedule",
        }[method]
        action = f"scheduler:{name}"
        checks = [Check(action, arn)]
        role = (params.get("Target") or {}).get("RoleArn")
        if role:
            checks.append(
                Check("iam:PassRole", role, {"iam:PassedToService": "scheduler.amazonaws.com"})
            )
        return action, checks
    if parts[0] == "schedules":
        return "scheduler:ListSchedules", [
            Check("scheduler:ListSchedules", f"arn:aws:scheduler:{region}:{account}:schedule/*")
        ]
    action = f"scheduler:{method} {path}"
    return action, [Check(action, "*")]


# --- the evaluator ------------------------------------------------------------------------------


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _substitute(doc: Any, variables: Mapping[str, str]) -> Any:
    if isinstance(doc, str):
        for name, value in variables.items():
            doc = doc.replace(name, value)
        return doc
    if isinstance(doc, list):
        return [_substitute(v, variables) for v in doc]
    if isinstance(doc, dict):
        return {k: _substitute(v, variables) for k, v in doc.items()}
    return doc


def _glob(pattern: str, value: str, *, ignore_case: bool = False) -> bool:
    if ignore_case:
        pattern, value = pattern.lower(), value.lower()
    # IAM wildcards: * any run (slashes included), ? one character; nothing else is special.
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, re.DOTALL) is not None


_STRING_OPERATORS = {
    "StringEquals": (lambda p, v: p == v, False),
    "StringNotEquals": (lambda p, v: p == v, True),
    "StringEqualsIgnoreCase": (lambda p, v: p.lower() == v.lower(), False),
    "StringNotEqualsIgnoreCase": (lambda p, v: p.lower() == v.lower(), True),
    "StringLike": (lambda p, v: _glob(p, v), False),
    "StringNotLike": (lambda p, v: _glob(p, v), True),
    "ArnEquals": (lambda p, v: p == v, False),
    "ArnNotEquals": (lambda p, v: p == v, True),
    "ArnLike": (lambda p, v: _glob(p, v), False),
    "ArnNotLike": (lambda p, v: _glob(p, v), True),
    "Bool": (lambda p, v: p.lower() == v.lower(), False),
}


def condition_holds(operator: str, key: str, expected: Any, context: Mapping[str, Any]) -> bool:
    """Return whether one condition (operator, key, policy values) holds in ``context``."""
    present = key in context
    if operator == "Null":
        (flag,) = _as_list(expected)
        return (not present) == (str(flag).lower() == "true")
    qualifier, _, op = operator.rpartition(":")
    if_exists = op.endswith("IfExists")
    op = op.removesuffix("IfExists")
    if op not in _STRING_OPERATORS:
        raise ValueError(f"condition operator {operator!r} is not supported by this evaluator")
    compare, negated = _STRING_OPERATORS[op]
    wanted = [str(p) for p in _as_list(expected)]
    values = [str(v) for v in _as_list(context[key])] if present else []

    def matches(value: str) -> bool:
        return any(compare(p, value) for p in wanted)

    if qualifier == "ForAllValues":
        # Every value in the request must match (vacuously true when there are none).
        return all((not matches(v)) if negated else matches(v) for v in values)
    if qualifier == "ForAnyValue":
        return any((not matches(v)) if negated else matches(v) for v in values)
    if qualifier:
        raise ValueError(f"condition qualifier {qualifier!r} is not supported")
    if not present:
        # AWS: a missing key makes positive operators false and negated ones true.
        return if_exists or negated
    hit = any(matches(v) for v in values)
    return not hit if negated else hit


def _statement_applies(statement: Mapping[str, Any], check: Check) -> bool:
    if "Action" in statement:
        if not any(_glob(a, check.action, ignore_case=True) for a in _as_list(statement["Action"])):
            return False
    elif any(_glob(a, check.action, ignore_case=True) for a in _as_list(statement["NotAction"])):
        return False
    if "Resource" in statement:
        if not any(_glob(r, check.resource) for r in _as_list(statement["Resource"])):
            return False
    elif any(_glob(r, check.resource) for r in _as_list(statement.get("NotResource", []))):
        return False
    for operator, pairs in (statement.get("Condition") or {}).items():
        for key, expected in pairs.items():
            if not condition_holds(operator, key, expected, check.context):
                return False
    return True


def evaluate_check(policy: Mapping[str, Any], check: Check) -> tuple[bool, str]:
    """Return (allowed, reason) for one authorization against one (substituted) policy."""
    statements = _as_list(policy["Statement"])
    denies = [s for s in statements if s["Effect"] == "Deny" and _statement_applies(s, check)]
    if denies:
        sid = denies[0].get("Sid", "a Deny statement")
        return False, f"{check.action} on {check.resource}: explicitly denied by {sid}"
    allows = [s for s in statements if s["Effect"] == "Allow" and _statement_applies(s, check)]
    if allows:
        return True, f"{check.action} on {check.resource}: allowed by {allows[0].get('Sid', '?')}"
    context = ", ".join(f"{k}={v}" for k, v in sorted(check.context.items()))
    return False, (
        f"{check.action} on {check.resource}: no statement allows it"
        + (f" (context: {context})" if context else "")
    )


def evaluate(
    policy: Mapping[str, Any], call: AwsCall | Check, variables: Mapping[str, str] | None = None
) -> tuple[bool, str]:
    """Return (allowed, reason) for a call: every authorization it needs must be allowed.

    ``variables`` replaces placeholders in the policy text first (``ACCOUNT_ID``,
    ``BURSTCV_BUCKET``). The reason names the first authorization that is refused.
    """
    doc = _substitute(policy, variables or {})
    checks = [call] if isinstance(call, Check) else call.checks
    if not checks:
        return True, f"{call.action if isinstance(call, AwsCall) else ''} needs no permission"
    reasons = []
    for check in checks:
        allowed, reason = evaluate_check(doc, check)
        if not allowed:
            return False, reason
        reasons.append(reason)
    return True, "; ".join(reasons)


def denied(
    policy: Mapping[str, Any], calls: Iterable[AwsCall], variables: Mapping[str, str] | None = None
) -> list[str]:
    """Return one line per recorded call the policy refuses (empty when all are allowed)."""
    lines = []
    for call in calls:
        allowed, reason = evaluate(policy, call, variables)
        if not allowed:
            lines.append(f"{call}: {reason}")
    return lines


def simulated(
    policy: dict[str, Any],
    variables: dict[str, str],
    wanted: list[tuple[str, str]],
    context: dict[str, Any] | None = None,
) -> bytes:
    """Return IAM's SimulatePrincipalPolicy response for ``wanted`` (action, resource) pairs
    under ``policy`` alone, in ``context``, as the audit's IAM evaluator decides each."""
    members = []
    for action in sorted({a for a, _ in wanted}):
        for resource in sorted({r for _, r in wanted}):
            allowed, reason = evaluate(policy, Check(action, resource, context or {}), variables)
            decision = (
                "allowed"
                if allowed
                else "explicitDeny"
                if "denied by" in reason
                else "implicitDeny"
            )
            members.append(
                "<member>"
                f"<EvalActionName>{action}</EvalActionName>"
                f"<EvalResourceName>{escape(resource)}</EvalResourceName>"
                f"<EvalDecision>{decision}</EvalDecision>"
                "<MatchedStatements/><MissingContextValues/>"
                "</member>"
            )
    return (
        '<SimulatePrincipalPolicyResponse xmlns="https://iam.amazonaws.com/doc/2010-05-08/">'
        "<SimulatePrincipalPolicyResult><IsTruncated>false</IsTruncated>"
        f"<EvaluationResults>{''.join(members)}</EvaluationResults>"
        "</SimulatePrincipalPolicyResult>"
        "<ResponseMetadata><RequestId>7a62c49f-347e-4fc4-9331-6e8eEXAMPLE</RequestId>"
        "</ResponseMetadata></SimulatePrincipalPolicyResponse>"
    ).encode()
