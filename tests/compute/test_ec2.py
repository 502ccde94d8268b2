"""Exercise the EC2 backend against moto in server mode, with a harness playing each instance."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError, WaiterError
from burstcv_testkit import HELD_WHEEL, launch_of, resolve_validated

from burstcv.compute.base import (
    ENDING,
    RUNNING,
    STOPPED,
    TAG_ATTEMPT,
    TAG_DAG_ID,
    TAG_EXPIRES_AT,
    TAG_MANAGED,
    TAG_RUN_ID,
    job_outcome,
)
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.compute.ec2_terms import (
    CapacityUnavailableError,
    LaunchCheckError,
    NotManagedError,
    launch_plan,
    parse_expiry,
    placement_refusal,
)
from burstcv.cost.pricing import hourly_price
from burstcv.cost.quotes import SOURCE_SPOT_HISTORY, quote_uri
from burstcv.params import RunParams
from burstcv.settings import get_settings
from burstcv.stages import boxes as boxes_stage
from burstcv.stages import resolve
from burstcv_spec.contracts import (
    Launch,
    Packed,
    PreprocessBlock,
    PriceQuote,
    RunRef,
    read_artifact,
)
from burstcv_spec.preprocess import PreprocessSpec

DAG_ID = "burstcv_train"


def request(run_id: str, job_uri: str | None = None, **overrides: Any) -> Launch:
    """Return the launch of a run."""
    # Held instances never read their job or wheel: any S3 URIs will do (the boot path
    # itself runs for real in test_box_boot.py).
    return launch_of(run_id, job_uri, dag_id=DAG_ID, **{**HELD_WHEEL, **overrides})


def wait_outcome(backend: Ec2Backend, run_id: str, timeout_s: float = 30.0) -> str:
    """Poll job_outcome until it is no longer running."""
    job_dir = f"s3://burstcv-test/artifacts/runs/{run_id}/job"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome = job_outcome(backend, run_id, job_dir)
        if outcome != "running":
            return outcome
        time.sleep(0.1)
    raise TimeoutError(f"run {run_id} still running after {timeout_s} s")


def inject_run_errors(
    backend: Ec2Backend,
    refuse: Callable[[str, str, str], str | None],
) -> list[tuple[str, str, str]]:
    """Make RunInstances fail with the code ``refuse(type, market, zone)`` returns; log each.

    A botocore event hook on the backend's real client: the request never reaches the
    emulator when refused, exactly as EC2 answers a capacity shortage (which a dry run,
    checking only permissions and parameters, does not see). The zone is that of the call's
    subnet: capacity is per Availability Zone.
    """
    attempts: list[tuple[str, str, str]] = []
    zone_of = {s.subnet_id: s.zone for s in backend.launch_subnets()}

    def before_run_instances(params: dict[str, Any], **_: Any) -> None:
        if params.get("DryRun"):
            return
        market = "spot" if "InstanceMarketOptions" in params else "on-demand"
        zone = zone_of.get(params.get("SubnetId"), "")
        attempts.append((params["InstanceType"], market, zone))
        code = refuse(params["InstanceType"], market, zone)
        if code:
            raise ClientError(
                {"Error": {"Code": code, "Message": f"injected {code}"}}, "RunInstances"
            )

    backend.client.meta.events.register(
        "before-parameter-build.ec2.RunInstances", before_run_instances
    )
    return attempts


def the_instance(ec2_client: Any, instance_id: str) -> dict[str, Any]:
    """Return the emulator's description of one instance."""
    return ec2_client.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][
        0
    ]


# --- settings and plan ---------------------------------------------------------------------


def test_settings_read_comma_lists_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURSTCV_EC2_INSTANCE_TYPES", "g5.xlarge, g4dn.xlarge")
    monkeypatch.setenv("BURSTCV_EC2_SECURITY_GROUP_IDS", "sg-1,sg-2")
    monkeypatch.setenv("BURSTCV_EC2_USE_SPOT", "false")
    settings = Ec2Settings()
    assert settings.instance_types == ("g5.xlarge", "g4dn.xlarge")
    assert settings.security_group_ids == ("sg-1", "sg-2")
    assert settings.use_spot is False


def test_settings_default_to_the_pytorch_deep_learning_ami() -> None:
    settings = Ec2Settings()
    assert "deeplearning" in settings.ami and "pytorch" in settings.ami
    assert settings.ami.endswith("/latest/ami-id")  # resolved through SSM at each launch
    assert settings.python == "/opt/pytorch/bin/python"
    assert settings.require_gpu is True


def test_plan_tries_spot_on_every_type_before_on_demand() -> None:
    plan = [(a.instance_type, a.market) for a in launch_plan(["a", "b"], use_spot=True)]
    assert plan == [("a", "spot"), ("b", "spot"), ("a", "on-demand"), ("b", "on-demand")]
    assert [a.market for a in launch_plan(["a"], use_spot=False)] == ["on-demand"]


# --- launch --------------------------------------------------------------------------------


def test_launch_spells_out_every_safe_default(
    backend: Ec2Backend, ec2_client: Any, player: Any, audited_calls: Any, kit: Any
) -> None:
    run_id = "safe-defaults"
    player.modes[run_id] = kit.HOLD
    before = time.time()
    ids = backend.launch(request(run_id))

    # The provider's hook really talks to the emulator (through the recording proxy of the
    # call audit): the test's own client sees the box.
    assert backend.client.meta.endpoint_url == audited_calls.url
    assert len(ids) == 1
    inst = the_instance(ec2_client, ids[0])
    ssm = boto3.client("ssm", region_name="us-east-1")
    assert inst["ImageId"] == ssm.get_parameter(Name=kit.ami_parameter)["Parameter"]["Value"]
    assert inst["InstanceType"] == "g6.xlarge"
    assert inst.get("InstanceLifecycle") == "spot"
    assert inst["MetadataOptions"]["HttpTokens"] == "required"
    assert inst["MetadataOptions"]["HttpPutResponseHopLimit"] == 1
    assert inst["IamInstanceProfile"]["Arn"].endswith("/burstcv-training")
    shutdown = ec2_client.describe_instance_attribute(
        InstanceId=ids[0], Attribute="instanceInitiatedShutdownBehavior"
    )["InstanceInitiatedShutdownBehavior"]["Value"]
    assert shutdown == "terminate"

    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags[TAG_MANAGED] == "true"
    assert tags[TAG_RUN_ID] == run_id
    assert tags[TAG_DAG_ID] == DAG_ID
    expires = parse_expiry(tags[TAG_EXPIRES_AT])
    assert expires is not None and tags[TAG_EXPIRES_AT].endswith("Z")
    # Expiry = the run's deadline (600 s from now) + the 5 min watchdog margin + 1 min.
    assert abs(expires.timestamp() - (before + 600 + 6 * 60)) < 30

    (mapping,) = inst["BlockDeviceMappings"]
    assert mapping["Ebs"]["DeleteOnTermination"] is True
    (volume,) = ec2_client.describe_volumes(VolumeIds=[mapping["Ebs"]["VolumeId"]])["Volumes"]
    assert volume["Encrypted"] is True
    assert volume["VolumeType"] == "gp3"
    assert volume["Size"] == 50
    volume_tags = {t["Key"]: t["Value"] for t in volume["Tags"]}
    assert volume_tags[TAG_RUN_ID] == run_id and volume_tags[TAG_MANAGED] == "true"

    user_data = base64.b64decode(
        ec2_client.describe_instance_attribute(InstanceId=ids[0], Attribute="userData")["UserData"][
            "Value"
        ]
    ).decode()
    assert 'shutdown -h "+$WATCHDOG_MIN"' in user_data
    assert f"s3://never-read/runs/{run_id}/job/job.json" in user_data

    (info,) = backend.describe(run_id)
    # Priced at the spot price AWS quotes for the box's own AZ, cached with its source.
    quoted = backend.price_quote(info)
    spot = read_artifact(
        quote_uri(get_settings().artifact_root, "g6.xlarge", "us-east-1", "spot", info.zone),
        PriceQuote,
    )
    assert spot.source == SOURCE_SPOT_HISTORY and info.zone == "us-east-1a"
    assert quoted is not None and quoted.usd_per_hour == spot.usd_per_hour
    assert backend.terminate_run(run_id) == ids
    assert kit.live_managed() == []
    assert ec2_client.describe_volumes(VolumeIds=[])["Volumes"] == []  # deleted with the box


def test_launch_is_idempotent_for_a_live_run(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "retried-task"
    player.modes[run_id] = kit.HOLD
    first = backend.launch(request(run_id))
    assert backend.launch(request(run_id)) == first
    backend.terminate_run(run_id)
    assert kit.live_managed() == []


def test_launch_without_an_instance_profile_starts_nothing(
    ec2_settings: Ec2Settings, ec2_client: Any, kit: Any
) -> None:
    settings = ec2_settings.model_copy(update={"instance_profile": None})
    with pytest.raises(ValueError, match="BURSTCV_EC2_INSTANCE_PROFILE") as refused:
        Ec2Backend(settings).launch(request("no-profile"))
    assert "\n" not in str(refused.value)
    assert kit.live_managed() == []


def test_spot_capacity_error_on_first_type_falls_back_to_next_type(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "spot-fallback"
    player.modes[run_id] = kit.HOLD

    def refuse(instance_type: str, market: str, zone: str) -> str | None:
        return "InsufficientInstanceCapacity" if instance_type == "g6.xlarge" else None

    attempts = inject_run_errors(backend, refuse)
    (iid,) = backend.launch(request(run_id))
    zones = [s.zone for s in backend.launch_subnets()]
    # Every AZ's default subnet for the first type, then the next type in the first AZ.
    assert attempts == [("g6.xlarge", "spot", z) for z in zones] + [("g5.xlarge", "spot", zones[0])]
    inst = the_instance(ec2_client, iid)
    assert inst["InstanceType"] == "g5.xlarge"
    assert inst.get("InstanceLifecycle") == "spot"
    backend.terminate_run(run_id)
    assert kit.live_managed() == []


def test_a_capacity_shortage_in_one_az_launches_in_the_next(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "az-failover"
    player.modes[run_id] = kit.HOLD
    subnets = backend.launch_subnets()
    assert [s.zone for s in subnets] == sorted(s.zone for s in subnets)
    assert len(subnets) > 1 and all(s.subnet_id for s in subnets)  # every AZ's default subnet

    def refuse(instance_type: str, market: str, zone: str) -> str | None:
        return "InsufficientInstanceCapacity" if zone == subnets[0].zone else None

    attempts = inject_run_errors(backend, refuse)
    (iid,) = backend.launch(request(run_id))
    assert attempts == [
        ("g6.xlarge", "spot", subnets[0].zone),
        ("g6.xlarge", "spot", subnets[1].zone),
    ]
    inst = the_instance(ec2_client, iid)
    assert inst["InstanceType"] == "g6.xlarge" and inst.get("InstanceLifecycle") == "spot"
    assert inst["SubnetId"] == subnets[1].subnet_id
    assert inst["Placement"]["AvailabilityZone"] == subnets[1].zone
    backend.terminate_run(run_id)
    assert kit.live_managed() == []


def test_the_subnet_setting_is_tried_in_its_order(
    ec2_settings: Ec2Settings, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "listed-subnets"
    player.modes[run_id] = kit.HOLD
    defaults = Ec2Backend(ec2_settings).launch_subnets()
    chosen = (defaults[2].subnet_id or "", defaults[0].subnet_id or "")
    backend = Ec2Backend(ec2_settings.model_copy(update={"subnet_ids": chosen}))
    assert [s.subnet_id for s in backend.launch_subnets()] == list(chosen)
    attempts = inject_run_errors(
        backend, lambda t, m, z: "InsufficientInstanceCapacity" if z == defaults[2].zone else None
    )
    (iid,) = backend.launch(request(run_id))
    assert [z for _, _, z in attempts] == [defaults[2].zone, defaults[0].zone]
    assert the_instance(ec2_client, iid)["SubnetId"] == chosen[1]
    backend.terminate_run(run_id)


def test_a_subnet_that_does_not_exist_is_named_before_anything_is_rented(
    ec2_settings: Ec2Settings, kit: Any
) -> None:
    backend = Ec2Backend(ec2_settings.model_copy(update={"subnet_ids": ("subnet-0nothere",)}))
    with pytest.raises(LaunchCheckError, match="BURSTCV_EC2_SUBNET_IDS") as refused:
        backend.launch(request("bad-subnet"))
    assert "\n" not in str(refused.value)
    assert kit.live_managed() == []


def test_the_single_subnet_setting_is_refused_with_its_new_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BURSTCV_EC2_SUBNET_ID", "subnet-1")
    with pytest.raises(ValueError, match="BURSTCV_EC2_SUBNET_IDS"):
        Ec2Settings()
    monkeypatch.delenv("BURSTCV_EC2_SUBNET_ID")
    monkeypatch.setenv("BURSTCV_EC2_SUBNET_IDS", "subnet-1, subnet-2")
    assert Ec2Settings().subnet_ids == ("subnet-1", "subnet-2")


def test_no_spot_anywhere_falls_back_to_on_demand(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "on-demand-fallback"
    player.modes[run_id] = kit.HOLD

    def refuse(instance_type: str, market: str, zone: str) -> str | None:
        # The account's spot limit: no other AZ would answer differently, so no other is tried.
        return "MaxSpotInstanceCountExceeded" if market == "spot" else None

    attempts = inject_run_errors(backend, refuse)
    (iid,) = backend.launch(request(run_id))
    assert [m for _, m, _ in attempts] == ["spot", "spot", "spot", "on-demand"]
    inst = the_instance(ec2_client, iid)
    assert inst["InstanceType"] == "g6.xlarge"
    assert "InstanceLifecycle" not in inst
    (info,) = backend.describe(run_id)
    rate = backend.box_rate(info, bound=None)  # what its launch record bills it at
    assert (info.lifecycle, rate.market) == ("on-demand", "on-demand")
    assert rate.usd_per_hour == pytest.approx(hourly_price("g6.xlarge", "us-east-1", "on-demand"))
    # With its 50 GB gp3 root volume (us-east-1: $0.08 per GB-month) and the public IPv4
    # the default subnet gives it ($0.005/h).
    assert (rate.volume_gb, rate.ebs_usd_per_gb_month) == (50, 0.08)
    assert info.public_ipv4 and rate.public_ipv4_usd_per_hour == 0.005
    assert backend.terminate_run(run_id) == [iid]
    assert kit.live_managed() == []


def test_no_capacity_anywhere_raises_and_leaves_nothing(
    backend: Ec2Backend, ec2_client: Any, kit: Any
) -> None:
    attempts = inject_run_errors(backend, lambda t, m, z: "Unsupported")
    with pytest.raises(
        CapacityUnavailableError,
        match=r"g4dn\.xlarge on-demand in subnet-\w+ \(us-east-1f\): Unsupported",
    ):
        backend.launch(request("no-capacity"))
    assert len(attempts) == 6 * len(backend.launch_subnets())  # 3 types x 2 markets x every AZ
    assert kit.live_managed() == []


def test_other_errors_are_raised_at_once(backend: Ec2Backend, ec2_client: Any, kit: Any) -> None:
    attempts = inject_run_errors(backend, lambda t, m, z: "UnauthorizedOperation")
    with pytest.raises(ClientError, match="UnauthorizedOperation"):
        backend.launch(request("not-allowed"))
    assert len(attempts) == 1
    assert kit.live_managed() == []


def test_setup_failure_after_launch_terminates_what_started(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "setup-fails"
    player.modes[run_id] = kit.HOLD
    launched: list[str] = []

    def after_run_instances(parsed: dict[str, Any], **_: Any) -> None:
        launched.extend(i["InstanceId"] for i in parsed.get("Instances", []))

    def before_describe(**_: Any) -> None:
        if launched:
            raise ClientError(
                {"Error": {"Code": "RequestLimitExceeded", "Message": "injected"}},
                "DescribeInstances",
            )

    events = backend.client.meta.events
    events.register("after-call.ec2.RunInstances", after_run_instances)
    events.register("before-parameter-build.ec2.DescribeInstances", before_describe)
    # The waiter for "instance exists" wraps the injected error; launch re-raises it.
    with pytest.raises(WaiterError, match="RequestLimitExceeded"):
        backend.launch(request(run_id))
    assert len(launched) == 1
    assert the_instance(ec2_client, launched[0])["State"]["Name"] == "terminated"
    assert kit.live_managed() == []


# --- the run's choices, defaulted by the settings, reach the launch ----------------------------


def packed_for(kit: Any, run_key: str) -> Packed:
    """Return a packed dataset of the run (held boxes never read its shards)."""
    return Packed(
        classes=["0", "1"],
        train_shards=[f"{kit.artifact_root}/runs/{run_key}/dataset/shards/train-000.npz"],
        val_shards=[f"{kit.artifact_root}/runs/{run_key}/dataset/shards/val-000.npz"],
        counts={"train": 2, "val": 2},
        preprocess=PreprocessBlock.of(PreprocessSpec(height=32, width=32)),
        fingerprint=run_key,
    )


def provision_run(settings: Any, kit: Any, run_key: str, given: dict[str, Any]) -> str:
    """Provision a run through the pipeline stage, as the DAG does; return its one instance."""
    params = RunParams.resolve({"compute_backend": "ec2", "time_budget_s": 600, **given}, settings)
    packed = packed_for(kit, run_key)
    run = RunRef.of(run_key)
    resolve_validated(run, params, settings, packed)  # the run's first task and validate
    provisioned = boxes_stage.provision(run, "burstcv_pipeline", packed, settings)
    (instance_id,) = provisioned.instance_ids
    return str(instance_id)


def test_the_ec2_settings_are_a_runs_defaults_and_the_run_decides(
    s3_deployment: Any, ec2_client: Any, player: Any, kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BURSTCV_EC2_INSTANCE_TYPES", "g5.xlarge,g4dn.xlarge")
    monkeypatch.setenv("BURSTCV_EC2_USE_SPOT", "false")
    for key in ("settings-decide", "run-decides"):
        player.modes[key] = kit.HOLD

    # A run that chooses nothing launches what the settings say: on-demand, g5.xlarge first.
    inst = the_instance(ec2_client, provision_run(s3_deployment, kit, "settings-decide", {}))
    assert inst["InstanceType"] == "g5.xlarge"
    assert "InstanceLifecycle" not in inst  # on-demand
    boxes_stage.terminate(RunRef.of("settings-decide"), "ec2", s3_deployment)

    # A run's own choice wins: spot on its type, though the deployment's default is on-demand
    # (one spot setting, not the run's and the deployment's ANDed).
    given = {"use_spot": True, "instance_types": ["g4dn.xlarge"]}
    inst = the_instance(ec2_client, provision_run(s3_deployment, kit, "run-decides", given))
    assert inst["InstanceType"] == "g4dn.xlarge"
    assert inst.get("InstanceLifecycle") == "spot"
    boxes_stage.terminate(RunRef.of("run-decides"), "ec2", s3_deployment)
    assert kit.live_managed() == []


# --- whole runs, played by the harness -----------------------------------------------------


def test_box_gone_without_marker_is_reported_lost_quickly(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "box-died"
    player.modes[run_id] = kit.DIE
    job_uri = kit.write_job(run_id, outcome="crash")
    backend.launch(request(run_id, job_uri))
    play = player.wait_played(run_id)
    assert play.powered_off_at is not None
    assert wait_outcome(backend, run_id, timeout_s=5) == "lost"
    assert time.time() - play.powered_off_at < 5
    assert kit.live_managed() == []
    assert len(backend.terminate_run(run_id)) == 1


def test_describe_and_list_managed_follow_the_tags(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    player.modes.update({"run-a": kit.HOLD, "run-b": kit.HOLD})
    (a,) = backend.launch(request("run-a"))
    (b,) = backend.launch(request("run-b"))
    (info,) = backend.describe("run-a")
    assert (info.instance_id, info.run_id, info.dag_id) == (a, "run-a", DAG_ID)
    assert info.state == RUNNING and info.lifecycle == "spot"
    assert info.instance_type == "g6.xlarge" and info.launched_at is not None
    assert {i.instance_id for i in backend.list_managed()} == {a, b}

    backend.terminate_run("run-a")
    (gone,) = backend.describe("run-a")
    assert gone.state == STOPPED and gone.stopped_at is not None
    assert [i.instance_id for i in backend.list_managed()] == [b]
    # A second teardown is harmless and still names the box.
    assert backend.terminate_run("run-a") == [a]
    backend.terminate_run("run-b")
    assert kit.live_managed() == []


def test_terminate_refuses_instances_without_the_managed_tag(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    image = ec2_client.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    (stranger,) = [
        i["InstanceId"]
        for i in ec2_client.run_instances(ImageId=image, MinCount=1, MaxCount=1)["Instances"]
    ]
    player.modes["mine"] = kit.HOLD
    (mine,) = backend.launch(request("mine"))
    with pytest.raises(NotManagedError, match=stranger):
        backend.terminate([mine, stranger])
    # Refused as a whole: neither was touched.
    assert the_instance(ec2_client, stranger)["State"]["Name"] == "running"
    assert the_instance(ec2_client, mine)["State"]["Name"] == "running"
    backend.terminate([mine])
    backend.terminate_run("mine")
    assert kit.live_managed() == []
    ec2_client.terminate_instances(InstanceIds=[stranger])


# --- several boxes ---------------------------------------------------------------------------


def test_several_boxes_share_a_placement_group_only_they_can_reach_and_go_together(
    s3_deployment: Any, backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    from burstcv.compute.userdata import RENDEZVOUS_PORT, parse_config
    from burstcv_spec.contracts import AttemptRecord

    run_id = "two-boxes"
    player.modes[run_id] = kit.HOLD
    params = RunParams.resolve({"compute_backend": "ec2", "num_nodes": 2}, s3_deployment)
    resolve_validated(RunRef.of(run_id), params, s3_deployment, packed_for(kit, run_id))
    provisioned = boxes_stage.provision(
        RunRef.of(run_id), DAG_ID, packed_for(kit, run_id), s3_deployment
    )
    ids = provisioned.instance_ids
    assert len(ids) == 2 and provisioned.launch.count == 2

    boxes = [the_instance(ec2_client, iid) for iid in ids]
    # One launch: every box tagged with the run, in the run's cluster placement group; the
    # launch index is each box's node rank.
    assert sorted(b["AmiLaunchIndex"] for b in boxes) == [0, 1]
    assert {b["Placement"]["GroupName"] for b in boxes} == {f"burstcv-{run_id}"}
    assert all({t["Key"]: t["Value"] for t in b["Tags"]}[TAG_RUN_ID] == run_id for b in boxes)
    (group,) = ec2_client.describe_placement_groups(GroupNames=[f"burstcv-{run_id}"])[
        "PlacementGroups"
    ]
    assert group["Strategy"] == "cluster"
    assert {t["Key"]: t["Value"] for t in group["Tags"]}[TAG_RUN_ID] == run_id
    # The run's own security group: TCP (the rendezvous port among them) from its members only.
    groups = {g["GroupId"] for b in boxes for g in b["SecurityGroups"]}
    (run_group,) = [
        g
        for g in ec2_client.describe_security_groups(GroupIds=sorted(groups))["SecurityGroups"]
        if {t["Key"]: t["Value"] for t in g.get("Tags", [])}.get(TAG_RUN_ID) == run_id
    ]
    (rule,) = run_group["IpPermissions"]
    assert rule["IpProtocol"] == "tcp" and rule["FromPort"] <= RENDEZVOUS_PORT <= rule["ToPort"]
    assert [p["GroupId"] for p in rule["UserIdGroupPairs"]] == [run_group["GroupId"]]
    assert rule.get("IpRanges", []) == [] and rule.get("Ipv6Ranges", []) == []
    # Every box knows the job is two boxes; each has its own AWS-side backstop.
    raw = ec2_client.describe_instance_attribute(InstanceId=ids[0], Attribute="userData")
    config = parse_config(base64.b64decode(raw["UserData"]["Value"]).decode())
    assert config["NUM_NODES"] == "2" and config["RENDEZVOUS_PORT"] == str(RENDEZVOUS_PORT)
    assert set(backend.backstops(ids)) == set(ids)

    # One box gone without a marker loses the attempt for both.
    job_dir = provisioned.output_uri
    assert job_outcome(backend, run_id, job_dir) == "running"
    ec2_client.terminate_instances(InstanceIds=[ids[1]])
    assert job_outcome(backend, run_id, job_dir) == "lost"
    # The relaunch ends the survivor and starts both boxes again, in the same groups.
    assert boxes_stage.relaunch(provisioned, s3_deployment) == 2
    relaunched = [i for i in backend.describe(run_id) if i.state == RUNNING]
    assert len(relaunched) == 2 and not {i.instance_id for i in relaunched} & set(ids)
    record = read_artifact(f"{job_dir}/attempt.json", AttemptRecord)
    assert (record.attempt, sorted(record.instance_ids)) == (
        2,
        sorted(i.instance_id for i in relaunched),
    )
    assert the_instance(ec2_client, ids[0])["State"]["Name"] in ("shutting-down", "terminated")

    # The teardown takes every box of every attempt, then the groups; billing counts each box.
    billing = boxes_stage.terminate(RunRef.of(run_id), "ec2", s3_deployment)
    assert sorted(billing.instance_ids) == sorted(ids + [i.instance_id for i in relaunched])
    assert set(billing.billed_seconds) == set(billing.instance_ids)
    assert kit.live_managed() == []
    assert backend.backstops(billing.instance_ids) == {}
    assert (
        ec2_client.describe_placement_groups(
            Filters=[{"Name": f"tag:{TAG_RUN_ID}", "Values": [run_id]}]
        )["PlacementGroups"]
        == []
    )
    assert (
        ec2_client.describe_security_groups(
            Filters=[{"Name": f"tag:{TAG_RUN_ID}", "Values": [run_id]}]
        )["SecurityGroups"]
        == []
    )


def test_a_relaunch_never_takes_a_dying_box_of_the_attempt_before_for_its_own(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "dying-box"
    player.modes[run_id] = kit.HOLD
    job_dir = f"s3://burstcv-test/artifacts/runs/{run_id}/job"
    (first,) = backend.launch(request(run_id), 1)
    # Attempt 1's box was just terminated, but DescribeInstances still lists it running.
    (second,) = backend.launch(request(run_id), 2)
    assert second != first
    assert backend.launch(request(run_id), 2) == [second]  # a retried call: the same box
    tags = {t["Key"]: t["Value"] for t in the_instance(ec2_client, second)["Tags"]}
    assert tags[TAG_ATTEMPT] == "2"
    assert {i.instance_id: i.attempt for i in backend.describe(run_id)} == {first: 1, second: 2}

    # Each attempt is judged by its own boxes: the old box running keeps attempt 2 alive no
    # more than attempt 2's box keeps attempt 1 alive.
    assert job_outcome(backend, run_id, job_dir, 2) == "running"
    ec2_client.terminate_instances(InstanceIds=[second])
    assert the_instance(ec2_client, first)["State"]["Name"] == "running"
    assert job_outcome(backend, run_id, job_dir, 2) == "lost"
    assert job_outcome(backend, run_id, job_dir, 1) == "running"
    backend.terminate_run(run_id)
    assert kit.live_managed() == []


def test_a_relaunch_of_several_boxes_tries_its_zone_first_and_passes_a_placement_refusal(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "two-box-zones"
    player.modes[run_id] = kit.HOLD
    subnets = backend.launch_subnets()
    zones = [s.zone for s in subnets]
    assert len(zones) >= 3
    refuse: dict[str, str] = {zones[0]: "InsufficientInstanceCapacity"}
    tries = inject_run_errors(backend, lambda t, m, z: refuse.get(z))
    two = {"count": 2, "instance_types": ["g6.xlarge"], "use_spot": False}

    first = backend.launch(request(run_id, **two), 1)
    assert [z for _, _, z in tries] == zones[:2]
    assert {the_instance(ec2_client, i)["Placement"]["AvailabilityZone"] for i in first} == {
        zones[1]
    }
    ec2_client.terminate_instances(InstanceIds=first)

    # The relaunch tries attempt 1's zone first; refused for the placement there, it goes on
    # to the next zone instead of failing the task.
    tries.clear()
    refuse.clear()
    refuse[zones[1]] = "InvalidPlacementGroup.InUse"
    second = backend.launch(request(run_id, **two), 2)
    assert [z for _, _, z in tries] == [zones[1], zones[0]]
    assert {the_instance(ec2_client, i)["Placement"]["AvailabilityZone"] for i in second} == {
        zones[0]
    }
    assert {i.attempt for i in backend.describe(run_id) if i.instance_id in second} == {2}
    backend.terminate_run(run_id)
    assert kit.live_managed() == []


def test_a_relaunch_of_several_boxes_waits_for_the_old_ones_to_terminate_within_its_bound(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any, caplog: Any
) -> None:
    from burstcv_testkit import reclaim_in_emulator

    from burstcv.compute.attempts import wait_ended

    run_id = "two-box-wait"
    player.modes[run_id] = kit.HOLD
    deadline = datetime.now(UTC) + timedelta(seconds=600)
    a, b = backend.launch(request(run_id, count=2), 1)
    reclaim_in_emulator(a, ends_after_s=1.0)  # EC2 ends a reclaimed box after a while
    ec2_client.terminate_instances(InstanceIds=[b])
    started = time.monotonic()
    boxes = wait_ended(backend, run_id, 1, 60.0, deadline, terminated=True)
    assert time.monotonic() - started >= 0.9
    assert {i.instance_id: i.state for i in boxes} == {a: STOPPED, b: STOPPED}

    # A box still shutting down past the bound is logged and left to the teardown.
    c, d = backend.launch(request(run_id, count=2), 2)
    reclaim_in_emulator(c)
    ec2_client.terminate_instances(InstanceIds=[d])
    boxes = wait_ended(backend, run_id, 2, 0.3, deadline, terminated=True)
    assert {i.instance_id: i.state for i in boxes}[c] == ENDING
    assert f"['{c}'] of attempt 2 not terminated after 0.3 s" in caplog.text
    # A run of one box waits only until its box no longer runs: shutting down is ended.
    assert wait_ended(backend, run_id, 2, 60.0, deadline, terminated=False) == boxes
    backend.terminate_run(run_id)
    assert kit.live_managed() == []


def test_a_box_without_an_attempt_tag_is_of_the_first_attempt() -> None:
    from burstcv.compute.ec2 import _info

    def box(tags: dict[str, str]) -> dict[str, Any]:
        return {
            "InstanceId": "i-0old",
            "State": {"Name": "running"},
            "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
        }

    # Launched by a burstcv before the tag existed: the run's first attempt.
    old = _info(box({TAG_RUN_ID: "r"}))
    assert old.attempt == 1 and old.of_attempt(1) and not old.of_attempt(2)
    assert _info(box({TAG_RUN_ID: "r", TAG_ATTEMPT: "3"})).attempt == 3
    assert _info(box({TAG_RUN_ID: "r", TAG_ATTEMPT: "x"})).attempt == 1


def test_a_placement_refusal_is_a_zones_refusal_only_for_a_launch_into_a_group() -> None:
    def refusal(code: str, message: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": message}}, "RunInstances")

    placed = {"Placement": {"GroupName": "burstcv-run"}}
    in_other_zone = refusal(
        "InvalidParameterValue",
        "The placement group 'burstcv-run' is in use in another Availability Zone",
    )
    assert placement_refusal(in_other_zone, placed) == "placement group: InvalidParameterValue"
    assert placement_refusal(refusal("InvalidPlacementGroup.InUse", "x"), placed) != ""
    # Not about the group, or no group at all: a setting to fix, raised as before.
    assert placement_refusal(refusal("InvalidParameterValue", "bad volume size"), placed) == ""
    assert placement_refusal(in_other_zone, {}) == ""


def test_several_boxes_need_the_ec2_backend_and_nothing_starts_without_it(
    s3_deployment: Any, kit: Any
) -> None:
    params = RunParams.resolve({"compute_backend": "local", "num_nodes": 2}, s3_deployment)
    run = RunRef.of("local-two")
    # The run's first task refuses it: nothing is resolved, so nothing can be provisioned.
    with pytest.raises(resolve.ValidationFailed, match="num_nodes 2 needs the ec2 compute backend"):
        resolve.resolve_run(run, params, s3_deployment)
    with pytest.raises(resolve.StageError, match=r"run\.json does not exist"):
        boxes_stage.provision(run, DAG_ID, packed_for(kit, "local-two"), s3_deployment)
    assert kit.live_managed() == []


def test_a_retry_of_provision_launches_against_the_first_tries_deadline(
    s3_deployment: Any, backend: Ec2Backend, player: Any, kit: Any
) -> None:
    from burstcv.training.job import load_job, write_job

    run_id = "retried"
    player.modes[run_id] = kit.HOLD
    run = RunRef.of(run_id)
    params = RunParams.resolve({"compute_backend": "ec2"}, s3_deployment)
    resolve_validated(run, params, s3_deployment, packed_for(kit, run_id))
    first = boxes_stage.provision(run, DAG_ID, packed_for(kit, run_id), s3_deployment)
    armed = load_job(first.job_uri).deadline_at
    assert armed is not None and first.launch.deadline_at == armed
    # The first try's worker died after its launch: nothing ended its box; the retry does.
    time.sleep(1.1)  # a retry comes later: a fresh budget would end later

    second = boxes_stage.provision(run, DAG_ID, packed_for(kit, run_id), s3_deployment, attempt=2)

    assert second.launch.deadline_at == armed == load_job(second.job_uri).deadline_at
    (box,) = second.instance_ids
    assert box not in first.instance_ids
    assert {i.instance_id for i in backend.describe(run_id) if i.state == RUNNING} == {box}
    ended = {i.state for i in backend.describe(run_id) if i.instance_id in first.instance_ids}
    assert ended <= {ENDING, STOPPED}
    # A try with too little of the budget left launches nothing, and says why.
    boxes_stage.clean_up_provision(run, "ec2", s3_deployment)
    job = load_job(second.job_uri)
    soon = datetime.now(UTC) + timedelta(seconds=boxes_stage.MIN_TRAINING_LEFT_S / 2)
    write_job(job.model_copy(update={"deadline_at": soon}), second.job_uri)
    with pytest.raises(resolve.StageError, match="the run's time budget is spent"):
        boxes_stage.provision(run, DAG_ID, packed_for(kit, run_id), s3_deployment, attempt=3)
    assert [i for i in backend.describe(run_id) if i.state == RUNNING] == []
    assert kit.live_managed() == []
