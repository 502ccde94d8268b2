"""Check the reaper against the emulator: it ends leaked burstcv instances and nothing else."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from burstcv.compute.base import TAG_RUN_ID, LaunchRequest
from burstcv.compute.ec2 import Ec2Backend
from burstcv.compute.reaper import (
    REASON_EXPIRED,
    REASON_RUN_NOT_ACTIVE,
    reap,
)

DAG_ID = "burstcv_train"


def launch_held(backend: Ec2Backend, player: Any, run_id: str) -> str:
    """Launch one instance for ``run_id`` that the harness leaves running (a leak)."""
    player.modes[run_id] = player.HOLD
    (iid,) = backend.launch(
        LaunchRequest(
            run_id=run_id,
            dag_id=DAG_ID,
            job_uri=f"s3://never-read/runs/{run_id}/job/job.json",  # held: never read
            time_budget_s=600,
            wheel_uri=f"s3://never-read/runtime/{'0' * 64}/t.whl",
            wheel_sha256="0" * 64,
        )
    )
    return iid


def state(ec2_client: Any, iid: str) -> str:
    """Return the emulator's state name for one instance."""
    reservations = ec2_client.describe_instances(InstanceIds=[iid])["Reservations"]
    return str(reservations[0]["Instances"][0]["State"]["Name"])


def strangers(ec2_client: Any) -> list[str]:
    """Start two instances burstcv must never touch: untagged, and run-tagged but unmanaged."""
    image = ec2_client.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    untagged = ec2_client.run_instances(ImageId=image, MinCount=1, MaxCount=1)
    lookalike = ec2_client.run_instances(
        ImageId=image,
        MinCount=1,
        MaxCount=1,
        TagSpecifications=[
            {"ResourceType": "instance", "Tags": [{"Key": TAG_RUN_ID, "Value": "gone-run"}]}
        ],
    )
    return [untagged["Instances"][0]["InstanceId"], lookalike["Instances"][0]["InstanceId"]]


def test_expired_instance_of_a_dead_orchestrator_is_terminated(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    iid = launch_held(backend, player, "orphan")
    (info,) = backend.describe("orphan")
    assert info.expires_at is not None
    # The orchestrator died and its metadata still says "running": expiry alone decides.
    report = reap(backend, is_run_active=lambda dag, run: True, now=info.expires_at)
    assert report.instance_ids == [iid]
    assert report.decisions[0].reason == REASON_EXPIRED
    assert report.to_dict()["terminated"][0]["instance_id"] == iid
    assert state(ec2_client, iid) in ("shutting-down", "terminated")
    assert kit.live_managed() == []


def test_instance_of_a_finished_run_is_terminated_before_expiry(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    asked: list[tuple[str, str]] = []
    keep = launch_held(backend, player, "still-running")
    leak = launch_held(backend, player, "finished")

    def is_run_active(dag_id: str, run_id: str) -> bool:
        asked.append((dag_id, run_id))
        return run_id == "still-running"

    report = reap(backend, is_run_active=is_run_active)
    assert report.instance_ids == [leak]
    assert report.decisions[0].reason == REASON_RUN_NOT_ACTIVE
    assert report.kept == [keep]
    assert sorted(asked) == [(DAG_ID, "finished"), (DAG_ID, "still-running")]
    assert kit.live_managed() == [keep]
    backend.terminate_run("still-running")
    assert kit.live_managed() == []


def test_reaper_leaves_instances_without_the_burstcv_tags_alone(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    others = strangers(ec2_client)
    leak = launch_held(backend, player, "leaked")
    (info,) = backend.describe("leaked")
    assert info.expires_at is not None
    report = reap(
        backend, is_run_active=lambda dag, run: False, now=info.expires_at + timedelta(days=1)
    )
    assert report.instance_ids == [leak]
    assert [state(ec2_client, iid) for iid in others] == ["running", "running"]
    assert kit.live_managed() == []
    ec2_client.terminate_instances(InstanceIds=others)


def test_dry_run_terminates_nothing_and_says_what_it_would(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    leak = launch_held(backend, player, "dry")
    report = reap(backend, is_run_active=lambda dag, run: False, dry_run=True)
    assert report.dry_run and report.instance_ids == [leak]
    assert report.to_dict()["would_terminate"][0]["reason"] == REASON_RUN_NOT_ACTIVE
    assert "would terminate" in report.summary()
    assert state(ec2_client, leak) == "running"
    reap(backend, is_run_active=lambda dag, run: False)
    assert kit.live_managed() == []


def test_reaper_does_not_guess_when_airflow_cannot_answer(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    iid = launch_held(backend, player, "unknown")

    def is_run_active(dag_id: str, run_id: str) -> bool:
        raise ConnectionError("metadata database unreachable")

    with pytest.raises(ConnectionError):
        reap(backend, is_run_active=is_run_active)
    assert state(ec2_client, iid) == "running"
    backend.terminate_run("unknown")
    assert kit.live_managed() == []


def test_nothing_to_reap_reports_so(backend: Ec2Backend, ec2_client: Any) -> None:
    report = reap(backend, is_run_active=lambda dag, run: True)
    assert report.instance_ids == [] and "nothing to terminate" in report.summary()
