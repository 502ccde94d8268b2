"""Run training boxes on EC2: spot first, tagged for teardown by run id, unable to outlive a run.

Each option is dry-run first (a missing permission fails before anything is rented); a real
launch carries a ClientToken (a retried call cannot start a second box); any failure once
``RunInstances`` was sent terminates what it may have started; and a one-time EventBridge
Scheduler schedule per instance makes AWS itself terminate the box at its expiry.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, WaiterError

from burstcv.compute.base import (
    STOPPED,
    TAG_EXPIRES_AT,
    TAG_MANAGED,
    TAG_RUN_ID,
    WORKING,
    InstanceInfo,
)
from burstcv.compute.ec2_terms import (
    _LIVE_EC2_STATES,
    _PERMISSION_ERRORS,
    _SETTING_OF_ERROR,
    BACKSTOP_GROUP,
    BACKSTOP_RETRY,
    BACKSTOP_TARGET_ARN,
    PLACEMENT_REFUSAL,
    ZONE_ERRORS,
    BackstopError,
    CapacityUnavailableError,
    Cluster,
    LaunchAttempt,
    LaunchCheckError,
    NotManagedError,
    Subnet,
    _error_code,
    _error_message,
    _info,
    _next_option,
    _run_filters,
    _said,
    _tags,
    backstop_name,
    client_token,
    format_expiry,
    in_cluster,
    instance_tags,
    launch_plan,
    parse_expiry,
    prefer_zones,
    quoted_market,
    rate_of,
)
from burstcv.compute.userdata import RENDEZVOUS_PORT, UserDataSpec, expiry_of, render_user_data
from burstcv.cost.pricing import PriceListEndpoints
from burstcv.cost.quotes import PriceSources, quote
from burstcv.settings import Ec2Settings
from burstcv_spec.contracts import BoxRate, Launch, PriceQuote

log = logging.getLogger(__name__)


class Ec2Backend:
    """Launch, find by tag, and terminate burstcv training instances on EC2."""

    name = "ec2"

    def __init__(self, settings: Ec2Settings | None = None) -> None:
        self.settings = settings or Ec2Settings()
        self.poll_s = self.settings.waiter_delay_s

    # --- clients (built on first use, so constructing the backend touches no network) ---

    @cached_property
    def client(self) -> Any:
        """Return the boto3 EC2 client over ``aws_conn_id``."""
        return self._aws_client("ec2")

    def _aws_client(self, client_type: str, region: str | None = None) -> Any:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

        hook = AwsBaseHook(
            aws_conn_id=self.settings.aws_conn_id,
            client_type=client_type,
            region_name=region or self.settings.region,
        )
        return hook.conn

    @cached_property
    def pricing(self) -> PriceListEndpoints:
        """Return the Price List API (us-east-1, else ap-south-1: each has every region's)."""
        return PriceListEndpoints(lambda region: self._aws_client("pricing", region))

    def price_sources(self, artifact_root: str | None = None) -> PriceSources:
        """Return where this backend's prices come from: AWS, cached in the artifact store."""
        from burstcv.settings import get_settings

        return PriceSources(
            artifact_root=artifact_root or get_settings().artifact_root,
            pricing=lambda: self.pricing,
            ec2=lambda: self.client,
        )

    def price_quote(
        self, info: InstanceInfo, sources: PriceSources | None = None
    ) -> PriceQuote | None:
        """Return the quoted hourly price of one of this backend's boxes (spot: in its AZ)."""
        market, zone = quoted_market(info)
        sources = sources or self.price_sources()
        return quote(info.instance_type, self.settings.region, market, sources, zone=zone)

    def box_rate(self, info: InstanceInfo, *, bound: BoxRate | None) -> BoxRate:
        """Return one of this backend's boxes' rate, every part priced (``ec2_terms.rate_of``)."""
        return rate_of(info, self.price_quote(info), bound, self.settings)

    @cached_property
    def scheduler(self) -> Any:
        """Return the EventBridge Scheduler client (the backstop) over ``aws_conn_id``."""
        return self._aws_client("scheduler")

    @cached_property
    def sts(self) -> Any:
        """Return the STS client (account id, decoding a refusal) over ``aws_conn_id``."""
        return self._aws_client("sts")

    def enabled_regions(self) -> list[str]:
        """Return every region enabled for the account (the reaper looks in each)."""
        return sorted(r["RegionName"] for r in self.client.describe_regions()["Regions"])

    def resolve_ami(self, ami: str | None = None) -> str:
        """Return the AMI id: the setting (or ``ami``) itself, or the SSM parameter it names."""
        ami = self.settings.ami if ami is None else ami
        if ami.startswith("ami-"):
            return ami
        from airflow.providers.amazon.aws.hooks.ssm import SsmHook

        hook = SsmHook(aws_conn_id=self.settings.aws_conn_id, region_name=self.settings.region)
        image_id = str(hook.get_parameter_value(ami))
        log.info("AMI %s resolved through SSM %s", image_id, ami)
        return image_id

    def launch(self, launch: Launch, attempt: int = 1) -> list[str]:
        """Start attempt ``attempt`` of the run's instance(s), spot first; return their ids.
        A retry gets this attempt's working boxes, never an earlier one's (it may be dying)."""
        run_key = launch.run.run_key
        described = self.describe(run_key)
        existing = [
            i.instance_id for i in described if i.of_attempt(attempt) and i.state in WORKING
        ]
        if existing:
            log.info(
                "run %s already has live instances %s of attempt %d", run_key, existing, attempt
            )
            return existing

        s = self.settings
        s.required_instance_profile()
        if not launch.wheel_uri:
            raise ValueError("an EC2 launch needs the staged training wheel (wheel_uri)")
        user_data = render_user_data(
            UserDataSpec(
                run_id=run_key,
                job_uri=launch.job_uri,
                attempt=attempt,
                num_nodes=launch.count,
                wheel_uri=launch.wheel_uri,
                wheel_sha256=launch.wheel_sha256,
                deadline_at=launch.deadline_at,
                region=s.region,
                margin_min=s.watchdog_margin_min,
                python=s.python,
                log_every_s=s.log_every_s,
            )
        )
        expires_at = expiry_of(launch.deadline_at, s.watchdog_margin_min)
        return self._start(launch, attempt, user_data, self.resolve_ami(), expires_at, described)

    def launch_sizing_box(self, launch: Launch, user_data: str, image_id: str) -> list[str]:
        """Start one sizing box (``user_data`` from ``render_sizing_user_data``) as a training
        box is started; return its id. ``launch.run`` carries the box's own run key."""
        self.settings.required_instance_profile()
        described = self.describe(launch.run.run_key)
        existing = [i.instance_id for i in described if i.state in WORKING]
        if existing:
            return existing
        expires_at = expiry_of(launch.deadline_at, self.settings.sizing_margin_min)
        return self._start(
            launch, 1, user_data, image_id, expires_at, described, self.settings.sizing_volume_gb
        )

    def architecture(self, instance_type: str) -> str:
        """Return the AMI architecture an instance type runs (x86_64 or arm64)."""
        found = self.client.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"]
        if not found:
            raise ValueError(f"{instance_type} is not an instance type in {self.settings.region}")
        supported = found[0]["ProcessorInfo"]["SupportedArchitectures"]
        return "arm64" if "arm64" in supported else "x86_64"

    def resolve_sizing_ami(self, architecture: str) -> str:
        """Return the sizing boxes' AMI id for ``architecture`` (``{arch}`` in the setting)."""
        return self.resolve_ami(self.settings.sizing_ami.replace("{arch}", architecture))

    def _start(
        self,
        launch: Launch,
        attempt: int,
        user_data: str,
        image_id: str,
        expires_at: datetime,
        described: list[InstanceInfo],
        volume_gb: int | None = None,
    ) -> list[str]:
        base_params = self._run_params(launch, image_id, user_data, expires_at, attempt, volume_gb)
        subnets = self.launch_subnets()
        if launch.count > 1:
            subnets = prefer_zones(subnets, [i.zone for i in described if i.attempt < attempt])
            # Made before the boxes and removed by the teardown (terminate_run), with them.
            cluster = self.ensure_cluster(launch, expires_at, subnets[0])
            base_params = in_cluster(base_params, cluster)
        run_key = launch.run.run_key
        refusals: list[str] = []
        for option in self.plan(launch):
            launched = self._launch_option(run_key, attempt, base_params, option, subnets, refusals)
            if launched is None:
                continue
            subnet, ids = launched
            log.info(
                "run %s: launched %s as %s %s in %s (expires %s)",
                run_key,
                ids,
                option.instance_type,
                option.market,
                subnet,
                format_expiry(expires_at),
            )
            try:
                self._arm_backstop(ids, run_key, expires_at)
                self._confirm_findable(ids, run_key)
                self._wait_running(ids)
            except BaseException:  # a task timeout too: destroy what started, then re-raise
                log.error("run %s: setup failed after launch; terminating %s", run_key, ids)
                self._terminate_after_failed_setup(ids)
                raise
            return ids
        raise CapacityUnavailableError(
            f"no capacity for run {run_key} in {len(subnets)} subnet(s): tried "
            + "; ".join(refusals)
            + " (a quota of 0 vCPUs looks the same: docs/aws.md, one-time account setup)"
        )

    def _launch_option(
        self,
        run_key: str,
        attempt: int,
        base_params: dict[str, Any],
        option: LaunchAttempt,
        subnets: list[Subnet],
        refusals: list[str],
    ) -> tuple[Subnet, list[str]] | None:
        """Launch one option in the first subnet that has room; None (refusals noted) if none.
        A refusal of the zone moves to the next subnet; one of the account ends the option."""
        for subnet in subnets:
            params = self._option_params(base_params, option, subnet)
            # Zero cost: a missing permission or a wrong setting fails here, before renting.
            refused = self._dry_run(params, option)
            if refused is None:
                params["ClientToken"] = client_token(run_key, attempt, option, subnet.subnet_id)
                refused, ids = self._run(params, run_key)
                if refused is None:
                    return subnet, ids
            refusals.append(f"{option.instance_type} {option.market} in {subnet}: {refused}")
            zone_only = refused in ZONE_ERRORS or refused.startswith(PLACEMENT_REFUSAL)
            log.warning(
                "no %s %s for run %s in %s (%s); trying the next %s",
                option.instance_type,
                option.market,
                run_key,
                subnet,
                refused,
                "subnet" if zone_only else "option",
            )
            if not zone_only:
                return None
        return None

    def launch_subnets(self) -> list[Subnet]:
        """Return the subnets a launch tries, in order: BURSTCV_EC2_SUBNET_IDS, else the default
        subnet of every AZ (a shortage in one is not the end), else EC2's own choice."""
        s = self.settings
        try:
            if s.subnet_ids:
                found = self.client.describe_subnets(SubnetIds=list(s.subnet_ids))["Subnets"]
                known = {sub["SubnetId"]: sub for sub in found}
                chosen = [known.get(sid, {"SubnetId": sid}) for sid in s.subnet_ids]
            else:
                found = self.client.describe_subnets(
                    Filters=[{"Name": "default-for-az", "Values": ["true"]}]
                )["Subnets"]
                chosen = sorted(found, key=lambda sub: str(sub["AvailabilityZone"]))
        except ClientError as exc:
            raise LaunchCheckError(
                f"the subnets {list(s.subnet_ids)} cannot be read in {s.region} "
                f"({_said(exc)}); check BURSTCV_EC2_SUBNET_IDS"
            ) from exc
        subnets = [
            Subnet(sub["SubnetId"], sub.get("AvailabilityZone", ""), sub.get("VpcId", ""))
            for sub in chosen
        ]
        return subnets or [Subnet(None)]

    def plan(self, launch: Launch) -> list[LaunchAttempt]:
        """Return a launch's options in order: the run's choices, else this deployment's."""
        s = self.settings
        use_spot = s.use_spot if launch.use_spot is None else launch.use_spot
        return launch_plan(launch.instance_types or s.instance_types, use_spot)

    def check_launch(self, launch: Launch) -> list[tuple[LaunchAttempt, str]]:
        """Dry-run every option of a launch; return (option, "" if allowed, else why not).
        The user data is a stand-in: EC2 checks permissions and parameters, not the script."""
        expires_at = datetime.now(UTC) + timedelta(seconds=launch.time_budget_s)
        image_id = self.resolve_ami()
        # Tagged as a first attempt: the dry run sends every tag key a real launch sends.
        base_params = self._run_params(launch, image_id, "#!/bin/bash\n", expires_at, 1)
        first_subnet = self.launch_subnets()[0]
        return [(o, self.dry_run_refusal(base_params, o, first_subnet)) for o in self.plan(launch)]

    def dry_run_refusal(
        self, base_params: dict[str, Any], option: LaunchAttempt, subnet: Subnet
    ) -> str:
        """Dry-run one option in ``subnet``; return "" if EC2 would allow it, else why not."""
        try:
            return self._dry_run(self._option_params(base_params, option, subnet), option) or ""
        except LaunchCheckError as exc:
            return str(exc)

    def check_backstop(self) -> str:
        """Create and delete a disabled backstop schedule; return "" or why it cannot be armed."""
        if not self.settings.backstop:
            return ""
        name = backstop_name("check")
        try:
            self.scheduler.create_schedule(
                Name=name,
                GroupName=BACKSTOP_GROUP,
                ScheduleExpression="at(2099-01-01T00:00:00)",
                FlexibleTimeWindow={"Mode": "OFF"},
                State="DISABLED",  # never fires: this only proves the permissions and role
                Target={
                    "Arn": BACKSTOP_TARGET_ARN,
                    "RoleArn": self._backstop_role_arn(),
                    "Input": json.dumps({"InstanceIds": []}),
                },
            )
            self.scheduler.delete_schedule(Name=name, GroupName=BACKSTOP_GROUP)
        except ClientError as exc:
            return (
                f"{_said(exc)}; create the {self.settings.backstop_role} role and allow "
                "scheduler:CreateSchedule (docs/aws.md), or set BURSTCV_EC2_BACKSTOP=false"
            )
        return ""

    def _option_params(
        self, base_params: dict[str, Any], option: LaunchAttempt, subnet: Subnet
    ) -> dict[str, Any]:
        params = dict(base_params, InstanceType=option.instance_type)
        if subnet.subnet_id:
            params["SubnetId"] = subnet.subnet_id
        if option.market == "spot":
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                # One-time, terminate: an interrupted box is gone, never stopped or relaunched.
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        return params

    def _dry_run(self, params: dict[str, Any], option: LaunchAttempt) -> str | None:
        """Ask EC2 whether this launch would be allowed; return a next-option code or None.
        Raise LaunchCheckError, naming the missing permission or wrong setting, for others."""
        try:
            response = self.client.run_instances(**params, DryRun=True)
        except ClientError as exc:
            if _error_code(exc) == "DryRunOperation":
                return None
            if refused := _next_option(exc, params):
                return refused
            raise LaunchCheckError(self.explain_refusal(exc, option)) from exc
        # A dry run never launches; an endpoint that ignored the flag did: undo it at once.
        ids = [inst["InstanceId"] for inst in response.get("Instances", [])]
        self._terminate_after_failed_setup(ids)
        raise LaunchCheckError(f"EC2 ignored DryRun and started {ids}; terminated them")

    def _run(self, params: dict[str, Any], run_id: str) -> tuple[str | None, list[str]]:
        """Send RunInstances; return (next-option code, []) or (None, the new instance ids)."""
        try:
            response = self.client.run_instances(**params)
        except ClientError as exc:
            if refused := _next_option(exc, params):
                return refused, []
            raise
        except BaseException:
            # Interrupted inside RunInstances (a task timeout, SIGTERM, a dropped connection):
            # EC2 may have started the box without us learning its id. Find it by tag.
            log.error("run %s: interrupted inside RunInstances; terminating by tag", run_id)
            self._terminate_tagged(run_id)
            raise
        return None, [inst["InstanceId"] for inst in response["Instances"]]

    def explain_refusal(self, exc: ClientError, option: LaunchAttempt) -> str:
        """Return one line saying which permission or setting made EC2 refuse a launch."""
        code, message = _error_code(exc), _error_message(exc)
        what = f"a {option.market} {option.instance_type} launch in {self.settings.region}"
        if code.startswith(_PERMISSION_ERRORS):
            denied = self._decoded_denial(message) or (
                "ec2:RunInstances with the burstcv tags, ec2:CreateTags at launch, or "
                "iam:PassRole on the instance profile's role"
            )
            return (
                f"{what} is not allowed ({code}): the identity behind connection "
                f"{self.settings.aws_conn_id!r} lacks {denied}; attach deploy/iam-policy.json "
                "(docs/aws.md)"
            )
        said = (code + message).lower().replace(" ", "")
        for fragment, setting in _SETTING_OF_ERROR:
            if fragment in said:
                return f"{what} was refused ({code}: {message}); check {setting}"
        return f"{what} was refused by a dry run ({code}: {message})"

    def _decoded_denial(self, message: str) -> str:
        """Return 'action on resource' from an encoded authorization message, if decodable."""
        match = re.search(r"[Ee]ncoded authorization failure message: (\S+)", message)
        if match is None:
            return ""
        try:
            decoded = self.sts.decode_authorization_message(EncodedMessage=match.group(1))
            context = json.loads(decoded["DecodedMessage"]).get("context", {})
        except (ClientError, BotoCoreError, ValueError):
            log.warning("could not decode the authorization message; see it with the AWS CLI")
            return ""
        return f"{context.get('action', '?')} on {context.get('resource', '?')}"

    # --- the AWS-side backstop ---

    def _backstop_role_arn(self) -> str:
        role = self.settings.backstop_role
        if role.startswith("arn:"):
            return role
        account = self.sts.get_caller_identity()["Account"]
        return f"arn:aws:iam::{account}:role/{role}"

    def _arm_backstop(self, instance_ids: list[str], run_id: str, expires_at: datetime) -> None:
        """Make AWS itself terminate each instance at its expiry (one schedule per instance)."""
        if not self.settings.backstop:
            return
        role_arn = self._backstop_role_arn()
        for iid in instance_ids:
            try:
                self.scheduler.create_schedule(
                    Name=backstop_name(iid),
                    GroupName=BACKSTOP_GROUP,
                    ScheduleExpression=f"at({expires_at.astimezone(UTC):%Y-%m-%dT%H:%M:%S})",
                    ScheduleExpressionTimezone="UTC",
                    FlexibleTimeWindow={"Mode": "OFF"},
                    # It fires once and removes itself; teardown removes it sooner.
                    ActionAfterCompletion="DELETE",
                    Description=f"burstcv: terminate {iid} of run {run_id} at its expiry"[:512],
                    Target={
                        "Arn": BACKSTOP_TARGET_ARN,
                        "RoleArn": role_arn,
                        "Input": json.dumps({"InstanceIds": [iid]}),
                        "RetryPolicy": BACKSTOP_RETRY,
                    },
                )
            except ClientError as exc:
                if _error_code(exc) == "ConflictException":
                    continue  # armed already (a retried call)
                raise BackstopError(
                    f"could not schedule the AWS-side termination of {iid} ({_said(exc)}); "
                    f"create the {self.settings.backstop_role} role (docs/aws.md) or set "
                    "BURSTCV_EC2_BACKSTOP=false"
                ) from exc
        log.info(
            "run %s: AWS terminates %s at %s at the latest",
            run_id,
            instance_ids,
            format_expiry(expires_at),
        )

    def backstops(self, instance_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Return the armed backstop schedule of each instance that has one."""
        found = {}
        for iid in instance_ids:
            try:
                found[iid] = self.scheduler.get_schedule(
                    Name=backstop_name(iid), GroupName=BACKSTOP_GROUP
                )
            except ClientError as exc:
                if _error_code(exc) != "ResourceNotFoundException":
                    raise
        return found

    def _remove_backstops(self, instance_ids: list[str]) -> None:
        """Delete the instances' schedules; one already gone (fired, or removed) is fine."""
        if not self.settings.backstop:
            return
        for iid in instance_ids:
            try:
                self.scheduler.delete_schedule(Name=backstop_name(iid), GroupName=BACKSTOP_GROUP)
            except ClientError as exc:
                if _error_code(exc) != "ResourceNotFoundException":
                    # Harmless if left: it fires on a terminated instance and deletes itself.
                    log.warning("could not remove the backstop of %s: %s", iid, exc)

    def console_output(self, instance_id: str) -> str:
        """Return an instance's console output as EC2 last captured it ("" before any): the
        newest capture on Nitro types, the buffered one else."""
        try:
            answer = self.client.get_console_output(InstanceId=instance_id, Latest=True)
        except ClientError as exc:
            if _error_code(exc) != "UnsupportedOperation":
                raise
            answer = self.client.get_console_output(InstanceId=instance_id)
        return str(answer.get("Output") or "")  # boto3 decodes EC2's base64

    def describe(self, run_id: str) -> list[InstanceInfo]:
        """Return every burstcv instance tagged with the run id, in any state."""
        return [_info(inst) for inst in self._instances(_run_filters(run_id))]

    def terminate_run(self, run_id: str) -> list[str]:
        """Terminate every instance tagged with the run id, wait until gone; return their ids
        (those already gone too: their backstops are removed with the others')."""
        described = self.describe(run_id)
        live = [i.instance_id for i in described if i.state != STOPPED]
        if live:
            log.info("run %s: terminating %s", run_id, live)
            self.client.terminate_instances(InstanceIds=live)
            self._wait("instance_terminated", live)
        ids = [i.instance_id for i in described]
        self._remove_backstops(ids)
        self.remove_cluster(run_id)
        log.info("run %s: %d instance(s) gone", run_id, len(ids))
        return ids

    # --- several boxes: one placement group, one security group of their own ---

    def ensure_cluster(self, launch: Launch, expires_at: datetime, subnet: Subnet) -> Cluster:
        """Create (or find again, for a relaunch) the run's placement and security groups: the
        latter admits TCP from its own members only; both carry the run's tags (the IAM policy
        lets this identity touch only its own)."""
        run_id = launch.run.run_key
        name = f"burstcv-{run_id}"[:255]
        tags = instance_tags(launch, expires_at)
        try:
            self.client.create_placement_group(
                GroupName=name,
                Strategy="cluster",
                TagSpecifications=[{"ResourceType": "placement-group", "Tags": tags}],
            )
        except ClientError as exc:
            if _error_code(exc) != "InvalidPlacementGroup.Duplicate":
                raise
        group_id = self._run_security_group(run_id)
        if group_id is None:
            create: dict[str, Any] = {
                "GroupName": name,
                "Description": f"burstcv run {run_id}: its training boxes reach each other",
                "TagSpecifications": [{"ResourceType": "security-group", "Tags": tags}],
            }
            if subnet.vpc_id:
                create["VpcId"] = subnet.vpc_id
            group_id = str(self.client.create_security_group(**create)["GroupId"])
        own = [{"GroupId": group_id}]
        rule = {"IpProtocol": "tcp", "FromPort": 0, "ToPort": 65535, "UserIdGroupPairs": own}
        try:  # again on a relaunch: a rule a failed launch never added is added now
            self.client.authorize_security_group_ingress(GroupId=group_id, IpPermissions=[rule])
        except ClientError as exc:
            if _error_code(exc) != "InvalidPermission.Duplicate":
                raise
        log.info(
            "run %s: placement group %s, security group %s (rendezvous port %d)",
            run_id,
            name,
            group_id,
            RENDEZVOUS_PORT,
        )
        return Cluster(placement_group=name, security_group_id=group_id)

    def _run_security_group(self, run_id: str) -> str | None:
        filters = _run_filters(run_id)
        groups = self.client.describe_security_groups(Filters=filters)["SecurityGroups"]
        return str(groups[0]["GroupId"]) if groups else None

    def remove_cluster(self, run_id: str) -> str:
        """Delete the run's security and placement groups, if any (its boxes gone); return ""
        or why not. Neither costs anything: a failure is logged, never raised over teardown."""
        try:
            group_id = self._run_security_group(run_id)
            if group_id is not None:
                self.client.delete_security_group(GroupId=group_id)
            filters = _run_filters(run_id)
            found = self.client.describe_placement_groups(Filters=filters)["PlacementGroups"]
            for group in found:
                self.client.delete_placement_group(GroupName=group["GroupName"])
        except ClientError as exc:
            why = f"ec2:{exc.operation_name}: {_said(exc)}"
            log.warning(
                "run %s: could not remove its security or placement group (%s); they cost "
                "nothing, delete them by their burstcv:run-id tag",
                run_id,
                why,
            )
            return why
        if group_id is not None or found:
            log.info("run %s: removed its security group and placement group", run_id)
        return ""

    def remove_expired_clusters(
        self, now: datetime, live_runs: set[str], *, dry_run: bool = False
    ) -> list[str]:
        """Remove the groups of every run past its expiry that has no box left; return the runs.
        ``live_runs`` still have a box (one being terminated holds its security group)."""
        groups = self.client.describe_security_groups(Filters=_run_filters())["SecurityGroups"]
        groups += self.client.describe_placement_groups(Filters=_run_filters())["PlacementGroups"]
        expired: set[str] = set()
        for group in groups:
            tags = _tags(group)
            run_id, expiry = tags.get(TAG_RUN_ID), parse_expiry(tags.get(TAG_EXPIRES_AT, ""))
            if run_id and run_id not in live_runs and expiry is not None and expiry <= now:
                expired.add(run_id)
        for run_id in sorted(expired):
            log.info(
                "reaper: run %s is past its expiry with no box left: %s its groups",
                run_id,
                "would remove" if dry_run else "removing",
            )
            if not dry_run:
                self.remove_cluster(run_id)
        return sorted(expired)

    def list_managed(self) -> list[InstanceInfo]:
        """Return every burstcv-managed instance that still exists (stopped ones included)."""
        filters = [*_run_filters(), {"Name": "instance-state-name", "Values": _LIVE_EC2_STATES}]
        return [_info(inst) for inst in self._instances(filters)]

    def terminate(self, instance_ids: list[str]) -> None:
        """Terminate the given instances; refuse all of them if any lacks the managed tag."""
        if not instance_ids:
            return
        found = {inst["InstanceId"]: inst for inst in self._instances([], instance_ids)}
        managed = {iid for iid, inst in found.items() if _tags(inst).get(TAG_MANAGED) == "true"}
        unmanaged = sorted(iid for iid in instance_ids if iid not in managed)
        if unmanaged:
            raise NotManagedError(f"refusing to terminate {unmanaged}: no {TAG_MANAGED}=true tag")
        log.info("terminating %s", instance_ids)
        self.client.terminate_instances(InstanceIds=list(instance_ids))

    def _run_params(
        self,
        launch: Launch,
        image_id: str,
        user_data: str,
        expires_at: datetime,
        attempt: int | None = None,
        volume_gb: int | None = None,
    ) -> dict[str, Any]:
        s = self.settings
        tags = instance_tags(launch, expires_at, attempt)
        params: dict[str, Any] = {
            "ImageId": image_id,
            # All or nothing: a multi-instance run never starts with part of its boxes.
            "MinCount": launch.count,
            "MaxCount": launch.count,
            "UserData": user_data,
            # `shutdown -h` on the box (watchdog or job end) destroys it instead of stopping it.
            "InstanceInitiatedShutdownBehavior": "terminate",
            # IMDSv2 only; hop limit 1 keeps containers on the box away from the role credentials.
            "MetadataOptions": {
                "HttpTokens": "required",
                "HttpPutResponseHopLimit": 1,
                "HttpEndpoint": "enabled",
            },
            "BlockDeviceMappings": [
                {
                    "DeviceName": self._root_device(image_id),
                    # Encrypted at rest, gp3 (cheaper than gp2 at the same speed), and deleted
                    # with the instance so no orphan volume keeps billing.
                    "Ebs": {
                        "VolumeSize": s.volume_gb if volume_gb is None else volume_gb,
                        "VolumeType": "gp3",
                        "Encrypted": True,
                        "DeleteOnTermination": True,
                    },
                }
            ],
            # Tags on the instance and its volume at creation: teardown, reaper and the IAM
            # policy (aws:RequestTag) all key on them; there is no untagged moment.
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                {"ResourceType": "volume", "Tags": tags},
            ],
        }
        if s.instance_profile:
            key = "Arn" if s.instance_profile.startswith("arn:") else "Name"
            params["IamInstanceProfile"] = {key: s.instance_profile}
        if s.security_group_ids:
            params["SecurityGroupIds"] = list(s.security_group_ids)
        return params

    def _root_device(self, image_id: str) -> str:
        images = self.client.describe_images(ImageIds=[image_id])["Images"]
        if not images:
            raise ValueError(f"AMI {image_id} not found in {self.settings.region}")
        return str(images[0].get("RootDeviceName") or "/dev/sda1")

    def _instances(
        self, filters: list[dict[str, Any]], instance_ids: list[str] | None = None
    ) -> Iterator[dict[str, Any]]:
        kwargs: dict[str, Any] = {"Filters": filters}
        if instance_ids:
            kwargs["InstanceIds"] = instance_ids
        for page in self.client.get_paginator("describe_instances").paginate(**kwargs):
            for reservation in page["Reservations"]:
                yield from reservation["Instances"]

    def _wait(self, waiter: str, instance_ids: list[str]) -> None:
        s = self.settings
        self.client.get_waiter(waiter).wait(
            InstanceIds=instance_ids,
            WaiterConfig={"Delay": s.waiter_delay_s, "MaxAttempts": s.waiter_max_attempts},
        )

    def _confirm_findable(self, instance_ids: list[str], run_id: str) -> None:
        """Wait until EC2 knows the instances and check they carry the run's tags."""
        self._wait("instance_exists", instance_ids)
        for inst in self._instances([], instance_ids):
            tags = _tags(inst)
            if tags.get(TAG_MANAGED) != "true" or tags.get(TAG_RUN_ID) != run_id:
                raise RuntimeError(
                    f"instance {inst['InstanceId']} lacks the burstcv tags; teardown by tag "
                    "could not find it"
                )

    def _wait_running(self, instance_ids: list[str]) -> None:
        """Wait (briefly) for the boxes to run: EC2 bills an instance from ``running``, and a
        box not seen running is billed from its launch (an upper bound)."""
        # At most about 3 minutes (a box is seldom pending one), polled every 2 s at most.
        delay = min(self.settings.waiter_delay_s, 2.0)
        try:
            self.client.get_waiter("instance_running").wait(
                InstanceIds=instance_ids,
                WaiterConfig={"Delay": delay, "MaxAttempts": max(1, int(180 / delay))},
            )
        except WaiterError as exc:
            log.warning("boxes %s not all running yet (%s); billed from launch", instance_ids, exc)

    def _terminate_after_failed_setup(self, instance_ids: list[str]) -> None:
        """Terminate what a failed launch started; log (never raise over) a failure to do so:
        the caller re-raises the original one, and the clean-up layers find what is left."""
        try:
            self.client.terminate_instances(InstanceIds=instance_ids)
        except (ClientError, BotoCoreError):
            log.exception(
                "could not terminate %s after a failed setup; the reaper will", instance_ids
            )
            return
        self._remove_backstops(instance_ids)

    def _terminate_tagged(self, run_id: str) -> None:
        """Terminate every live instance tagged with the run (after an interrupted launch)."""
        try:
            live = [i.instance_id for i in self.describe(run_id) if i.state != STOPPED]
        except (ClientError, BotoCoreError):
            log.exception("could not look for instances of run %s; the reaper will", run_id)
            return
        if live:
            self._terminate_after_failed_setup(live)
