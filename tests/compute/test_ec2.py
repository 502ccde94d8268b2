"""Exercise the EC2 backend against moto in server mode, with a harness playing each instance."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError, WaiterError

from burstcv import storage
from burstcv.compute.base import (
    RUNNING,
    STOPPED,
    TAG_DAG_ID,
    TAG_EXPIRES_AT,
    TAG_MANAGED,
    TAG_RUN_ID,
    LaunchRequest,
    job_outcome,
)
from burstcv.compute.ec2 import (
    CapacityUnavailableError,
    Ec2Backend,
    Ec2Settings,
    NotManagedError,
    launch_plan,
    parse_expiry,
)
from burstcv.cost.pricing import hourly_price

DAG_ID = "burstcv_train"


def request(run_id: str, job_uri: str | None = None, **overrides: Any) -> LaunchRequest:
    """Return a launch request for a run."""
    return LaunchRequest(
        run_id=run_id,
        dag_id=DAG_ID,
        # Held instances never read their job: any S3 URI will do.
        job_uri=job_uri or f"s3://never-read/runs/{run_id}/job/job.json",
        time_budget_s=overrides.pop("time_budget_s", 600),
        **overrides,
    )


def wait_outcome(backend: Ec2Backend, run_id: str, timeout_s: float = 30.0) -> str:
    """Poll job_outcome until it is no longer running."""
    job_dir = f"{backend.settings.artifact_root}/runs/{run_id}/job"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome = job_outcome(backend, run_id, job_dir)
        if outcome != "running":
            return outcome
        time.sleep(0.1)
    raise TimeoutError(f"run {run_id} still running after {timeout_s} s")


def inject_run_errors(
    backend: Ec2Backend, refuse: Callable[[str, str], str | None]
) -> list[tuple[str, str]]:
    """Make real RunInstances calls fail with the code ``refuse(type, market)`` returns; log each.

    A botocore event hook on the backend's real client: the request never reaches the
    emulator when refused, exactly as EC2 answers a capacity shortage (which a dry run,
    checking only permissions and parameters, does not see).
    """
    attempts: list[tuple[str, str]] = []

    def before_run_instances(params: dict[str, Any], **_: Any) -> None:
        if params.get("DryRun"):
            return
        market = "spot" if "InstanceMarketOptions" in params else "on-demand"
        attempts.append((params["InstanceType"], market))
        code = refuse(params["InstanceType"], market)
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


def test_settings_refuse_a_local_artifact_root() -> None:
    with pytest.raises(ValueError, match="s3://"):
        Ec2Settings(artifact_root="/tmp/artifacts")


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
    # Expiry = the watchdog: ceil(600 s / 60) + 5 min margin = 15 min after launch.
    assert abs(expires.timestamp() - (before + 15 * 60)) < 30

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
    assert "shutdown -h +15" in user_data
    assert f"s3://never-read/runs/{run_id}/job/job.json" in user_data

    report = backend.terminate_run(run_id)
    assert report.instance_ids == ids
    assert kit.live_managed() == []
    assert ec2_client.describe_volumes(VolumeIds=[])["Volumes"] == []  # deleted with the box
    assert report.billed_seconds[ids[0]] == 60.0  # the one-minute minimum
    expected = hourly_price("g6.xlarge", "us-east-1", "spot") * 60 / 3600
    assert report.cost_usd == pytest.approx(expected)


def test_launch_is_idempotent_for_a_live_run(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "retried-task"
    player.modes[run_id] = kit.HOLD
    first = backend.launch(request(run_id))
    assert backend.launch(request(run_id)) == first
    backend.terminate_run(run_id)
    assert kit.live_managed() == []


def test_launch_without_a_bundle_starts_nothing(
    ec2_settings: Ec2Settings, ec2_client: Any, kit: Any
) -> None:
    settings = ec2_settings.model_copy(update={"bundle_uri": "", "artifact_root": ""})
    with pytest.raises(ValueError, match="BUNDLE_URI"):
        Ec2Backend(settings).launch(request("no-bundle"))
    assert kit.live_managed() == []


def test_spot_capacity_error_on_first_type_falls_back_to_next_type(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "spot-fallback"
    player.modes[run_id] = kit.HOLD

    def refuse(instance_type: str, market: str) -> str | None:
        return "InsufficientInstanceCapacity" if instance_type == "g6.xlarge" else None

    attempts = inject_run_errors(backend, refuse)
    (iid,) = backend.launch(request(run_id))
    assert attempts == [("g6.xlarge", "spot"), ("g5.xlarge", "spot")]
    inst = the_instance(ec2_client, iid)
    assert inst["InstanceType"] == "g5.xlarge"
    assert inst.get("InstanceLifecycle") == "spot"
    backend.terminate_run(run_id)
    assert kit.live_managed() == []


def test_no_spot_anywhere_falls_back_to_on_demand(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "on-demand-fallback"
    player.modes[run_id] = kit.HOLD
    codes = iter(["SpotMaxPriceTooLow", "MaxSpotInstanceCountExceeded", "InsufficientCapacity"])

    def refuse(instance_type: str, market: str) -> str | None:
        return next(codes) if market == "spot" else None

    attempts = inject_run_errors(backend, refuse)
    (iid,) = backend.launch(request(run_id))
    assert [m for _, m in attempts] == ["spot", "spot", "spot", "on-demand"]
    inst = the_instance(ec2_client, iid)
    assert inst["InstanceType"] == "g6.xlarge"
    assert "InstanceLifecycle" not in inst
    report = backend.terminate_run(run_id)
    on_demand = hourly_price("g6.xlarge", "us-east-1", "on-demand") * 60 / 3600
    assert report.cost_usd == pytest.approx(on_demand)
    assert kit.live_managed() == []


def test_no_capacity_anywhere_raises_and_leaves_nothing(
    backend: Ec2Backend, ec2_client: Any, kit: Any
) -> None:
    attempts = inject_run_errors(backend, lambda t, m: "Unsupported")
    with pytest.raises(CapacityUnavailableError, match=r"g4dn\.xlarge on-demand: Unsupported"):
        backend.launch(request("no-capacity"))
    assert len(attempts) == 6
    assert kit.live_managed() == []


def test_other_errors_are_raised_at_once(backend: Ec2Backend, ec2_client: Any, kit: Any) -> None:
    attempts = inject_run_errors(backend, lambda t, m: "UnauthorizedOperation")
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


# --- whole runs, played by the harness -----------------------------------------------------


def test_successful_run_shuts_itself_down_with_no_idle_tail(
    backend: Ec2Backend, ec2_client: Any, s3_client: Any, player: Any, kit: Any
) -> None:
    run_id = "happy-path"
    job_uri = kit.write_job(run_id, outcome="done", seconds=1.0)
    (iid,) = backend.launch(request(run_id, job_uri))

    assert wait_outcome(backend, run_id) == "done"
    play = player.wait_played(run_id)
    assert play.error == ""
    assert play.exit_code is not None  # the script ran to its `shutdown -h now`
    # The box destroyed itself: nothing left for the teardown but to record the bill.
    assert kit.live_managed() == []
    assert the_instance(ec2_client, iid)["State"]["Name"] == "terminated"
    # Watchdog armed first, `shutdown -h now` last.
    assert play.shutdown_calls[0][:2] == ["-h", "+15"]
    assert play.shutdown_calls[-1] == ["-h", "now"]

    done_at = kit.last_modified(f"{kit.job_dir(run_id)}/DONE")
    assert play.powered_off_at is not None
    idle_tail_s = play.powered_off_at - done_at.timestamp()
    # The target is < 10 s (a few s measured on a quiet machine, see the printed figure); the
    # bound here is looser because the emulated box's tools are Python processes that a
    # loaded 2-core CI machine can start slowly. Timing targets live in benchmarks.
    assert idle_tail_s < 30.0
    log_uri = f"{kit.job_dir(run_id)}/logs/{iid}.log"
    assert "training exited with 0" in storage.read_bytes(log_uri).decode()
    assert not storage.exists(f"{kit.job_dir(run_id)}/FAILED")

    report = backend.terminate_run(run_id)
    box_s = play.powered_off_at - play.started
    print(
        f"\n[ec2 emulated run] idle tail (DONE -> terminated): {idle_tail_s:.2f} s; "
        f"box lifetime {box_s:.2f} s (training ~1.0 s); billed {report.billed_seconds[iid]:.0f} s; "
        f"cost ${report.cost_usd:.5f}"
    )
    assert box_s < 60
    assert report.billed_seconds[iid] == 60.0  # a box that lived seconds bills the minimum


def test_training_failure_leaves_failed_marker_and_no_instance(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "loss-nan"
    job_uri = kit.write_job(run_id, outcome="fail")
    backend.launch(request(run_id, job_uri))
    assert wait_outcome(backend, run_id) == "failed"
    failed = storage.read_json(f"{kit.job_dir(run_id)}/FAILED")
    assert failed["reason"] == "loss is NaN"  # training's own reason, not overwritten
    player.wait_played(run_id)
    assert kit.live_managed() == []
    backend.terminate_run(run_id)


def test_crash_without_marker_gets_failed_from_the_exit_trap(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "segfault"
    job_uri = kit.write_job(run_id, outcome="crash", exit_code=139)
    backend.launch(request(run_id, job_uri))
    assert wait_outcome(backend, run_id) == "failed"
    failed = storage.read_json(f"{kit.job_dir(run_id)}/FAILED")
    assert failed["exit_code"] == 139
    assert "without a DONE or FAILED marker" in failed["reason"]
    player.wait_played(run_id)
    assert kit.live_managed() == []
    backend.terminate_run(run_id)


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
    report = backend.terminate_run(run_id)
    assert len(report.instance_ids) == 1


def test_spot_interruption_makes_training_checkpoint_then_shuts_down(
    backend: Ec2Backend, ec2_client: Any, s3_client: Any, player: Any, kit: Any
) -> None:
    run_id = "spot-reclaimed"
    job_uri = kit.write_job(run_id, outcome="done", seconds=30)
    backend.launch(request(run_id, job_uri))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        plays = [p for p in player.plays.values() if p.run_id == run_id and p.dir]
        if plays and (plays[0].dir / "opt" / "train.pid").exists():  # type: ignore[operator]
            break
        time.sleep(0.05)
    else:
        pytest.fail("training never started on the emulated box")
    # AWS posts the two-minute notice; the script's poller reads it through IMDSv2.
    (plays[0].dir / "spot-notice").write_text(  # type: ignore[operator]
        json.dumps({"action": "terminate", "time": "2030-01-01T00:00:00Z"})
    )
    assert wait_outcome(backend, run_id, timeout_s=20) == "failed"
    failed = storage.read_json(f"{kit.job_dir(run_id)}/FAILED")
    assert failed["reason"].startswith("spot interruption")
    checkpoint = s3_client.get_object(
        Bucket=kit.bucket, Key=f"artifacts/runs/{run_id}/job/checkpoints/last.pt"
    )["Body"].read()
    assert checkpoint == b"checkpoint at SIGTERM"
    player.wait_played(run_id)
    assert kit.live_managed() == []
    backend.terminate_run(run_id)


# --- describe, list, terminate -------------------------------------------------------------


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
    # A second teardown is harmless and still reports the bill.
    again = backend.terminate_run("run-a")
    assert again.instance_ids == [a] and again.billed_seconds[a] >= 60
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


def write_real_job(kit: Any, run_id: str) -> str:
    """Write a tiny real job (two classes of 32x32 shards, as pack writes them); return its URI."""
    import io

    import numpy as np

    rng = np.random.default_rng(0)
    classes = ["dark", "light"]
    job_dir = f"{kit.job_dir(run_id)}"
    shards = {}
    for split, n in (("train", 64), ("val", 32)):
        labels = np.arange(n, dtype=np.int64) % 2
        images = np.where(labels[:, None, None, None] == 1, 200, 40).astype(np.uint8)
        images = np.broadcast_to(images, (n, 32, 32, 3)).copy()
        images += rng.integers(0, 20, size=images.shape, dtype=np.uint8)
        buffer = io.BytesIO()
        np.savez(buffer, images=images, labels=labels, classes=np.array(classes))
        key = f"artifacts/runs/{run_id}/dataset/shards/{split}-000.npz"
        kit.s3.put_object(Bucket=kit.bucket, Key=key, Body=buffer.getvalue())
        shards[split] = [f"s3://{kit.bucket}/{key}"]
    job = {
        "run_id": run_id,
        "arch": "resnet10",
        "classes": classes,
        "train_shards": shards["train"],
        "val_shards": shards["val"],
        "preprocess": {
            "height": 32,
            "width": 32,
            "mean": [0.5, 0.5, 0.5],
            "std": [0.25, 0.25, 0.25],
            "scale": 1 / 255,
        },
        "output_uri": job_dir,
        "epochs": 1,
        "batch_size": 32,
        "time_budget_s": 120,
        "compile": "off",
    }
    storage.write_json(f"{job_dir}/job.json", job)
    return f"{job_dir}/job.json"


@pytest.mark.parametrize("player_command", ["real"], indirect=True)
def test_real_burstcv_train_runs_on_the_emulated_box(
    backend: Ec2Backend, ec2_client: Any, s3_client: Any, player: Any, kit: Any
) -> None:
    pytest.importorskip("torch")
    run_id = "real-train"
    job_uri = write_real_job(kit, run_id)
    (iid,) = backend.launch(request(run_id, job_uri, time_budget_s=120))
    play = player.wait_played(run_id, timeout_s=120)
    assert play.error == ""
    outcome = wait_outcome(backend, run_id, timeout_s=10)
    job_dir = f"{kit.job_dir(run_id)}"
    log = storage.read_bytes(f"{job_dir}/logs/{iid}.log").decode()
    assert outcome == "done", log[-2000:]
    assert storage.exists(f"{job_dir}/metrics.json") and storage.exists(f"{job_dir}/model.pt")
    assert kit.live_managed() == []
    assert play.powered_off_at is not None
    done_at = kit.last_modified(f"{job_dir}/DONE")
    idle_tail_s = play.powered_off_at - done_at.timestamp()
    # The target is < 10 s (a few s measured on a quiet machine, see the printed figure); the
    # bound here is looser because the emulated box's tools are Python processes that a
    # loaded 2-core CI machine can start slowly. Timing targets live in benchmarks.
    assert idle_tail_s < 30.0
    report = backend.terminate_run(run_id)
    print(
        f"\n[ec2 emulated run, real burstcv train] idle tail {idle_tail_s:.2f} s; box lifetime "
        f"{play.powered_off_at - play.started:.2f} s; billed {report.billed_seconds[iid]:.0f} s"
    )
