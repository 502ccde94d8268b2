"""Check the reaper against the emulator: it ends leaked burstcv instances and nothing else."""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from burstcv_testkit import HELD_WHEEL, launch_of

from burstcv.compute import reaper
from burstcv.compute.base import ENDING, RUNNING, STOPPED, TAG_RUN_ID, InstanceInfo
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings, Subnet
from burstcv.compute.reaper import (
    REASON_EXPIRED,
    REASON_RUN_NOT_ACTIVE,
    REASON_UNTRACEABLE,
    RunActivity,
    decide,
    reap,
)
from burstcv.settings import Settings
from burstcv_spec.contracts import ReapDecision, ReaperReport, ReapError, RunRef

DAG_ID = "burstcv_train"
# Runs as Airflow names them: their raw ids hold ':' and '+', which the boxes' run-key tag
# (the path-safe form) does not; Airflow knows a run by its raw id only.
LIVE = RunRef.of("manual__2026-05-01T11:58:03.123456+00:00")
FINISHED = RunRef.of("scheduled__2026-05-01T00:00:00+00:00")


class Airflow:
    """Answer the reaper's one question as Airflow would; record who was asked, and when.

    It knows runs by (DAG id, run id) exactly, and a run it does not know reads as OVER, as
    a deleted run does in Airflow: a reaper that asks with the wrong id (the path-safe key
    instead of the raw Airflow id, or another DAG's id) would terminate a live run's box, and
    the test that keeps that box fails. An exception in the table is raised, any other
    answer returned as is.
    """

    def __init__(
        self,
        runs: dict[str, object],
        *,
        dag_id: str = DAG_ID,
        events: list[str] | None = None,
    ) -> None:
        self.runs = {(dag_id, run_id): answer for run_id, answer in runs.items()}
        self.asked: list[tuple[str, str]] = []
        self.events = events if events is not None else []

    def __call__(self, dag_id: str, run_id: str) -> RunActivity:
        self.asked.append((dag_id, run_id))
        self.events.append(f"ask {run_id}")
        answer = self.runs.get((dag_id, run_id), RunActivity.OVER)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]


def launch_held(
    backend: Ec2Backend,
    player: Any,
    run_id: str,
    time_budget_s: int = 600,
    *,
    airflow_run_id: str = "",
) -> str:
    """Launch one instance for run key ``run_id`` that the harness leaves running (a leak)."""
    player.modes[run_id] = player.HOLD
    (iid,) = backend.launch(
        launch_of(
            run_id,
            dag_id=DAG_ID,
            time_budget_s=time_budget_s,
            airflow_run_id=airflow_run_id,
            **HELD_WHEEL,
        )
    )
    return iid


def sweep_settings(kit: Any, monkeypatch: Any, regions: str = "us-east-1") -> Settings:
    """Return settings for a reaper pass over EC2 on the emulator (``regions`` "": all)."""
    for key, value in {
        "BURSTCV_EC2_AMI": kit.ami_parameter,
        "BURSTCV_EC2_INSTANCE_PROFILE": "burstcv-training",
    }.items():
        monkeypatch.setenv(key, value)
    return Settings(reaper_backends="", reaper_regions=regions, compute_backend="ec2")


def runs_with_groups(ec2_client: Any) -> tuple[set[str], set[str]]:
    """Return the run keys that have a placement group, and those that have a security group."""

    def run_of(group: dict[str, Any]) -> str:
        return {t["Key"]: t["Value"] for t in group.get("Tags", [])}.get(TAG_RUN_ID, "")

    placement = ec2_client.describe_placement_groups()["PlacementGroups"]
    security = ec2_client.describe_security_groups()["SecurityGroups"]
    return {run_of(g) for g in placement} - {""}, {run_of(g) for g in security} - {""}


def make_groups(backend: Ec2Backend, run_key: str, expires_at: datetime) -> None:
    """Make the placement and security groups of a run of several boxes, as its launch does."""
    backend.ensure_cluster(launch_of(run_key, dag_id=DAG_ID), expires_at, Subnet(None))


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
    airflow = Airflow({"orphan": RunActivity.ACTIVE})
    report = reap(backend, run_activity=airflow, now=info.expires_at)
    assert airflow.asked == []
    assert report.instance_ids == [iid]
    assert report.decisions[0].reason == REASON_EXPIRED
    assert report.model_dump(mode="json")["decisions"][0]["instance_id"] == iid
    assert state(ec2_client, iid) in ("shutting-down", "terminated")
    assert kit.live_managed() == []


def test_instance_of_a_finished_run_is_terminated_before_expiry(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    keep = launch_held(backend, player, "still-running")
    leak = launch_held(backend, player, "finished")
    airflow = Airflow({"still-running": RunActivity.ACTIVE, "finished": RunActivity.OVER})
    report = reap(backend, run_activity=airflow)
    assert report.instance_ids == [leak]
    assert report.decisions[0].reason == REASON_RUN_NOT_ACTIVE
    assert report.kept == [keep]
    assert sorted(airflow.asked) == [(DAG_ID, "finished"), (DAG_ID, "still-running")]
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
    airflow = Airflow({"leaked": RunActivity.ACTIVE})
    report = reap(backend, run_activity=airflow, now=info.expires_at + timedelta(days=1))
    assert report.instance_ids == [leak]
    assert airflow.asked == []  # past its expiry: no question asked
    assert [state(ec2_client, iid) for iid in others] == ["running", "running"]
    assert kit.live_managed() == []
    ec2_client.terminate_instances(InstanceIds=others)


def test_dry_run_terminates_nothing_and_says_what_it_would(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    leak = launch_held(backend, player, "dry")
    airflow = Airflow({"dry": RunActivity.OVER})
    report = reap(backend, run_activity=airflow, dry_run=True)
    assert report.dry_run and report.instance_ids == [leak]
    assert report.model_dump(mode="json")["decisions"][0]["reason"] == REASON_RUN_NOT_ACTIVE
    assert "would terminate" in report.summary()
    assert state(ec2_client, leak) == "running"
    assert reap(backend, run_activity=airflow).instance_ids == [leak]
    assert kit.live_managed() == []


def test_an_airflow_error_about_one_box_stops_none_of_the_others(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    unknown = launch_held(backend, player, "unknown")
    finished = launch_held(backend, player, "finished")
    expired = launch_held(backend, player, "expired", time_budget_s=60)  # 6 min, not 15
    (info,) = backend.describe("expired")
    assert info.expires_at is not None
    airflow = Airflow(
        {
            "unknown": ConnectionError("metadata database unreachable"),
            "finished": RunActivity.OVER,
            "expired": RunActivity.ACTIVE,
        }
    )

    # "now" is past the expiry of "expired" only.
    later = info.expires_at + timedelta(seconds=1)
    for run_id in ("unknown", "finished"):
        (other,) = backend.describe(run_id)
        assert other.expires_at is not None and other.expires_at > later
    report = reap(backend, run_activity=airflow, now=later)

    # Expired first, without asking; the finished run's box despite the error before it.
    assert report.decisions[0].instance_id == expired
    assert report.decisions[0].reason == REASON_EXPIRED
    assert sorted(airflow.asked) == [(DAG_ID, "finished"), (DAG_ID, "unknown")]
    assert set(report.instance_ids) == {expired, finished}
    assert state(ec2_client, expired) == "terminated"
    assert state(ec2_client, finished) == "terminated"
    # The box whose run could not be checked is kept (no guessing) and the error counted.
    assert report.kept == [unknown]
    (error,) = report.errors
    assert (error.instance_id, error.step) == (unknown, "check-run")
    assert "metadata database unreachable" in error.error
    assert report.errors[0].instance_id == unknown
    assert "1 error(s)" in report.summary()
    assert state(ec2_client, unknown) == "running"
    backend.terminate_run("unknown")
    assert kit.live_managed() == []


def test_a_refused_terminate_stops_none_of_the_others(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    first = launch_held(backend, player, "refused")
    second = launch_held(backend, player, "fine")
    refused_ids: list[str] = []

    def refuse_first(params: dict[str, Any], **_: Any) -> None:
        if params.get("InstanceIds") == [first]:
            refused_ids.append(first)
            raise ClientError(
                {"Error": {"Code": "RequestLimitExceeded", "Message": "injected"}},
                "TerminateInstances",
            )

    backend.client.meta.events.register(
        "before-parameter-build.ec2.TerminateInstances", refuse_first
    )
    airflow = Airflow({"refused": RunActivity.OVER, "fine": RunActivity.OVER})
    report = reap(backend, run_activity=airflow)
    assert refused_ids == [first]
    assert report.instance_ids == [second]
    assert [(e.instance_id, e.step) for e in report.errors] == [(first, "terminate")]
    assert state(ec2_client, second) == "terminated"
    assert state(ec2_client, first) == "running"
    ec2_client.terminate_instances(InstanceIds=[first])
    assert kit.live_managed() == []


def test_the_pipeline_reaper_sweeps_every_enabled_region(
    ec2_settings: Ec2Settings, ec2_client: Any, player: Any, kit: Any, monkeypatch: Any
) -> None:
    far = Ec2Backend(ec2_settings.model_copy(update={"region": "eu-west-1"}))
    iid = launch_held(far, player, FINISHED.run_key, airflow_run_id=FINISHED.airflow_run_id)
    monkeypatch.setenv("BURSTCV_EC2_REGION", "us-east-1")  # the settings name another region
    settings = sweep_settings(kit, monkeypatch, regions="")
    assert settings.reaper_backend_names() == ["local", "ec2"]
    airflow = Airflow({FINISHED.airflow_run_id: RunActivity.OVER})
    reports = reaper.reap_everywhere(["ec2"], airflow, settings=settings)
    by_region = {r.region: r for r in reports}
    assert {"us-east-1", "eu-west-1"} <= set(by_region)
    assert by_region["eu-west-1"].instance_ids == [iid]
    assert [r.region for r in reports if r.instance_ids] == ["eu-west-1"]
    assert airflow.asked == [(DAG_ID, FINISHED.airflow_run_id)]
    assert reaper.reap_errors(reports) == 0
    far_ec2 = boto3.client(
        "ec2", region_name="eu-west-1", endpoint_url=ec2_client.meta.endpoint_url
    )
    assert state(far_ec2, iid) == "terminated"


def test_ec2_is_swept_whenever_aws_is_configured(monkeypatch: Any) -> None:
    for key in list(os.environ):
        if key.startswith(("AWS_", "BURSTCV_EC2_")) or key == "AIRFLOW_CONN_AWS_DEFAULT":
            monkeypatch.delenv(key)
    assert Settings(reaper_backends="").reaper_backend_names() == ["local"]
    monkeypatch.setenv("AWS_PROFILE", "burstcv")
    assert Settings(reaper_backends="").reaper_backend_names() == ["local", "ec2"]
    assert Settings(reaper_backends="local").reaper_backend_names() == ["local"]


def test_aws_settings_passed_through_empty_configure_nothing(monkeypatch: Any) -> None:
    """A compose file passes `${BURSTCV_EC2_REGION:-}`: set to nothing, it names no AWS."""
    for key in list(os.environ):
        if key.startswith(("AWS_", "BURSTCV_EC2_")) or key == "AIRFLOW_CONN_AWS_DEFAULT":
            monkeypatch.delenv(key)
    for key in ("BURSTCV_EC2_REGION", "BURSTCV_EC2_INSTANCE_PROFILE", "AIRFLOW_CONN_AWS_DEFAULT"):
        monkeypatch.setenv(key, "")
    assert Settings(reaper_backends="").reaper_backend_names() == ["local"]
    monkeypatch.setenv("BURSTCV_EC2_REGION", "eu-west-1")
    assert Settings(reaper_backends="").reaper_backend_names() == ["local", "ec2"]


@pytest.mark.parametrize("regions", ["", "eu-west-1"])
def test_ec2_without_credentials_is_a_warning_not_a_failed_pass(
    monkeypatch: Any, tmp_path: Any, regions: str
) -> None:
    """EC2 configured but no credentials anywhere: nothing can have been launched from here."""
    for key in list(os.environ):
        if key.startswith(("AWS_", "BURSTCV_EC2_")) or key == "AIRFLOW_CONN_AWS_DEFAULT":
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("BURSTCV_EC2_REGION", "eu-west-1")
    settings = Settings(
        home=str(tmp_path), reaper_backends="", reaper_regions=regions, compute_backend="ec2"
    )
    airflow = Airflow({})
    reports = reaper.reap_everywhere(None, airflow, settings=settings)
    assert [r.backend for r in reports] == ["local", "ec2"]
    assert airflow.asked == []
    assert reaper.reap_errors(reports) == 0
    (ec2,) = [r for r in reports if r.backend == "ec2"]
    assert ec2.errors == []
    (warning,) = ec2.warnings
    assert warning.startswith("ec2 not swept: no AWS credentials (")


def test_nothing_to_reap_reports_so(backend: Ec2Backend, ec2_client: Any) -> None:
    airflow = Airflow({})
    report = reap(backend, run_activity=airflow)
    assert report.instance_ids == [] and "nothing to terminate" in report.summary()
    assert airflow.asked == []


def test_burstcv_reap_exits_non_zero_when_the_pass_counted_errors(
    monkeypatch: Any, tmp_path: Any
) -> None:
    from typer.testing import CliRunner

    from burstcv import cli

    expired = ReapDecision(
        instance_id="i-expired", run_key="r", dag_id="d", reason="expired", detail="expired"
    )
    throttled = ReapError(instance_id="i-other", step="terminate", error="ClientError: throttled")
    pass_with_an_error = [
        ReaperReport(
            backend="ec2",
            region="us-east-1",
            checked_at=NOW,
            dry_run=False,
            decisions=[expired],
            errors=[throttled],
        )
    ]
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.setattr(reaper, "reap_everywhere", lambda *args, **kwargs: pass_with_an_error)
    result = CliRunner().invoke(cli.app, ["reap"])
    assert result.exit_code == 1
    assert "ec2 us-east-1: terminated 1 ['i-expired']" in result.output
    assert "throttled" in result.output and "1 error(s) in this pass" in result.output
    pass_with_an_error[0] = pass_with_an_error[0].model_copy(update={"errors": []})
    assert CliRunner().invoke(cli.app, ["reap"]).exit_code == 0


# --- The decision, without the emulator: an in-memory backend and a scripted Airflow. ---

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def box(
    iid: str,
    run_id: str = "",
    *,
    expires_at: datetime | None = None,
    state: str = RUNNING,
    dag_id: str = DAG_ID,
) -> InstanceInfo:
    """Return a managed box of ``run_id`` (by default its id doubles as its run id)."""
    return InstanceInfo(iid, run_id or f"run-{iid}", dag_id, state, expires_at=expires_at)


class FakeBackend:
    """Hold managed boxes in memory; record every terminate and refuse the ids it is told to."""

    name = "fake"

    def __init__(self, *boxes: InstanceInfo, refuse: tuple[str, ...] = ()) -> None:
        self.boxes = list(boxes)
        self.refuse = set(refuse)
        self.terminated: list[str] = []
        self.events: list[str] = []
        self.listings = 0

    def list_managed(self) -> list[InstanceInfo]:
        self.listings += 1
        return list(self.boxes)

    def terminate(self, instance_ids: list[str]) -> None:
        for iid in instance_ids:
            self.events.append(f"terminate {iid}")
            if iid in self.refuse:
                raise RuntimeError(f"refused to terminate {iid}")
            self.terminated.append(iid)


def test_a_live_runs_box_is_kept_and_a_finished_runs_box_goes() -> None:
    live, done = box("i-live", "live"), box("i-done", "done")
    backend = FakeBackend(live, done)
    airflow = Airflow({"live": RunActivity.ACTIVE, "done": RunActivity.OVER})
    report = reap(backend, run_activity=airflow, now=NOW)
    assert backend.terminated == ["i-done"]
    assert report.instance_ids == ["i-done"]
    assert report.decisions[0].reason == REASON_RUN_NOT_ACTIVE
    assert (report.decisions[0].run_key, report.decisions[0].dag_id) == ("done", DAG_ID)
    assert report.kept == ["i-live"]
    assert report.errors == [] and report.warnings == []
    assert sorted(airflow.asked) == [(DAG_ID, "done"), (DAG_ID, "live")]
    assert backend.listings == 1


def test_airflow_is_asked_about_the_run_of_the_boxs_own_dag() -> None:
    """Airflow's run ids are unique within a DAG only: two DAGs may each have a run of an id."""
    run = FINISHED.run_key
    train, pipeline = box("i-train", run), box("i-pipeline", run, dag_id="burstcv_pipeline")
    backend = FakeBackend(train, pipeline)
    airflow = Airflow({run: RunActivity.ACTIVE})  # burstcv_train's; burstcv_pipeline's is gone
    report = reap(backend, run_activity=airflow, now=NOW)
    assert backend.terminated == ["i-pipeline"] and report.kept == ["i-train"]
    (decision,) = report.decisions
    assert (decision.run_key, decision.dag_id) == (run, "burstcv_pipeline")
    assert decision.detail == f"DAG run burstcv_pipeline/{run} is not running"
    assert airflow.asked == [(DAG_ID, run), ("burstcv_pipeline", run)]


def test_a_box_without_an_expiry_tag_lives_as_long_as_its_run() -> None:
    backend = FakeBackend(box("i-1", "live"))
    report = reap(backend, run_activity=Airflow({"live": RunActivity.ACTIVE}), now=NOW)
    assert backend.terminated == [] and report.kept == ["i-1"]
    assert report.errors == []


def test_an_expired_box_goes_even_while_airflow_says_its_run_is_active() -> None:
    backend = FakeBackend(box("i-old", "live", expires_at=NOW - timedelta(minutes=1)))
    airflow = Airflow({"live": RunActivity.ACTIVE})
    report = reap(backend, run_activity=airflow, now=NOW)
    assert backend.terminated == ["i-old"]
    assert [d.reason for d in report.decisions] == [REASON_EXPIRED]
    assert airflow.asked == []  # expiry alone decides: Airflow is not even asked
    assert report.kept == []


def test_a_box_goes_exactly_at_its_expiry_instant_and_not_a_moment_before() -> None:
    airflow = Airflow({"live": RunActivity.ACTIVE})
    at = FakeBackend(box("i-1", "live", expires_at=NOW))
    assert reap(at, run_activity=airflow, now=NOW).instance_ids == ["i-1"]
    before = FakeBackend(box("i-1", "live", expires_at=NOW + timedelta(microseconds=1)))
    report = reap(before, run_activity=airflow, now=NOW)
    assert before.terminated == [] and report.kept == ["i-1"]


def test_expired_boxes_go_before_airflow_is_asked_about_any_other() -> None:
    # Listed after a finished run's box, the box that expires right now still goes first:
    # a slow or hanging Airflow can never keep an expired box alive.
    backend = FakeBackend(box("i-finished", "finished"), box("i-expired", "live", expires_at=NOW))
    airflow = Airflow({"finished": RunActivity.OVER}, events=backend.events)
    report = reap(backend, run_activity=airflow, now=NOW)
    assert backend.events == ["terminate i-expired", "ask finished", "terminate i-finished"]
    assert report.instance_ids == ["i-expired", "i-finished"]
    assert [d.reason for d in report.decisions] == [REASON_EXPIRED, REASON_RUN_NOT_ACTIVE]


def test_expired_boxes_go_while_airflow_is_down() -> None:
    backend = FakeBackend(
        box("i-expired", "a", expires_at=NOW - timedelta(hours=1)),
        box("i-young", "b", expires_at=NOW + timedelta(hours=1)),
    )
    down = ConnectionError("metadata database unreachable")
    report = reap(backend, run_activity=Airflow({"a": down, "b": down}), now=NOW)
    assert backend.terminated == ["i-expired"]
    assert report.kept == ["i-young"]
    assert [(e.instance_id, e.step) for e in report.errors] == [("i-young", "check-run")]
    assert "ConnectionError: metadata database unreachable" in report.errors[0].error


def test_a_box_missing_its_run_or_dag_tag_goes_without_asking_airflow() -> None:
    no_run = InstanceInfo("i-no-run", "", DAG_ID, RUNNING)
    no_dag = InstanceInfo("i-no-dag", "some-run", "", RUNNING)
    backend = FakeBackend(no_run, no_dag)
    # Asked, this Airflow would keep both: so only the tags can have sent them.
    airflow = Airflow({"": RunActivity.ACTIVE})
    airflow.runs[("", "some-run")] = RunActivity.ACTIVE
    report = reap(backend, run_activity=airflow, now=NOW)
    assert backend.terminated == ["i-no-run", "i-no-dag"]
    assert [d.reason for d in report.decisions] == [REASON_UNTRACEABLE, REASON_UNTRACEABLE]
    assert airflow.asked == [] and report.kept == []


def test_an_unclassified_run_keeps_its_box_with_a_warning() -> None:
    backend = FakeBackend(box("i-1", "odd"), box("i-2", "live"))
    airflow = Airflow({"odd": RunActivity.UNKNOWN, "live": RunActivity.ACTIVE})
    report = reap(backend, run_activity=airflow, now=NOW)
    assert backend.terminated == [] and report.kept == ["i-1", "i-2"]
    (warning,) = report.warnings  # one, about the unclassified run only
    assert f"{DAG_ID}/odd" in warning
    assert report.errors == []
    assert "1 warning(s)" in report.summary()
    assert report.warnings == [warning]


def test_an_answer_that_is_not_a_run_activity_keeps_the_box_and_counts_an_error() -> None:
    backend = FakeBackend(box("i-1", "odd"), box("i-2", "done"))
    report = reap(backend, run_activity=Airflow({"odd": "over", "done": RunActivity.OVER}), now=NOW)
    assert backend.terminated == ["i-2"]
    assert report.kept == ["i-1"]
    assert [(e.instance_id, e.run_key, e.step) for e in report.errors] == [
        ("i-1", "odd", "check-run")
    ]
    assert report.errors[0].error.startswith("TypeError")


def test_a_refused_terminate_is_counted_and_the_others_still_go() -> None:
    backend = FakeBackend(
        box("i-expired-refused", expires_at=NOW),
        box("i-expired", expires_at=NOW),
        box("i-done-refused", "done-1"),
        box("i-done", "done-2"),
        refuse=("i-expired-refused", "i-done-refused"),
    )
    airflow = Airflow({"done-1": RunActivity.OVER, "done-2": RunActivity.OVER})
    report = reap(backend, run_activity=airflow, now=NOW)
    assert backend.terminated == ["i-expired", "i-done"]
    assert report.instance_ids == ["i-expired", "i-done"]  # only what really went
    assert [(e.instance_id, e.step) for e in report.errors] == [
        ("i-expired-refused", "terminate"),
        ("i-done-refused", "terminate"),
    ]
    assert "refused to terminate i-done-refused" in report.errors[1].error
    assert report.summary() == (
        "reaper: terminated i-expired (expired), i-done (run-not-active); kept 0; 2 error(s)"
    )


def test_a_stopped_box_is_neither_terminated_nor_asked_about_nor_kept() -> None:
    backend = FakeBackend(
        box("i-gone", "done", state=STOPPED, expires_at=NOW - timedelta(hours=1)),
        box("i-ending", "done", state=ENDING),
    )
    airflow = Airflow({"done": RunActivity.OVER})
    report = reap(backend, run_activity=airflow, now=NOW)
    # A shutting-down box still bills: it goes; a stopped one is already gone.
    assert backend.terminated == ["i-ending"]
    assert airflow.asked == [(DAG_ID, "done")]
    assert report.kept == [] and report.errors == []


def test_the_boxes_the_caller_already_listed_are_the_ones_reaped() -> None:
    listed = box("i-listed", "done")
    backend = FakeBackend(box("i-other", "done"))
    report = reap(
        backend,
        run_activity=Airflow({"done": RunActivity.OVER}),
        now=NOW,
        managed=[listed],
    )
    assert backend.listings == 0
    assert backend.terminated == ["i-listed"]
    assert report.instance_ids == ["i-listed"]


def test_without_a_now_the_pass_uses_the_current_time() -> None:
    backend = FakeBackend(
        box("i-past", expires_at=datetime.now(UTC) - timedelta(minutes=1)),
        box("i-future", expires_at=datetime.now(UTC) + timedelta(hours=1)),
    )
    before = datetime.now(UTC)
    report = reap(backend, run_activity=Airflow({"run-i-future": RunActivity.ACTIVE}))
    assert before <= report.checked_at <= datetime.now(UTC)
    assert backend.terminated == ["i-past"] and report.kept == ["i-future"]


def test_the_given_now_decides_not_the_clock() -> None:
    # A pass replayed for a moment long past: boxes young then are kept, whatever today is.
    then = datetime(2020, 1, 1, tzinfo=UTC)
    backend = FakeBackend(box("i-1", expires_at=then + timedelta(hours=1)))
    report = reap(backend, run_activity=Airflow({"run-i-1": RunActivity.ACTIVE}), now=then)
    assert report.checked_at == then
    assert backend.terminated == [] and report.kept == ["i-1"]


def test_a_dry_run_terminates_nothing_and_reports_what_it_would() -> None:
    backend = FakeBackend(box("i-expired", expires_at=NOW), box("i-done", "done"), box("i-live"))
    airflow = Airflow({"done": RunActivity.OVER, "run-i-live": RunActivity.ACTIVE})
    report = reap(backend, run_activity=airflow, now=NOW, dry_run=True)
    assert backend.terminated == [] and backend.events == []
    assert report.dry_run and report.instance_ids == ["i-expired", "i-done"]
    data = ReaperReport.model_validate_json(report.model_dump_json())
    assert data == report and data.dry_run
    assert [d.instance_id for d in data.decisions] == ["i-expired", "i-done"]
    assert data.kept == ["i-live"] and data.checked_at == NOW
    assert report.summary() == (
        "reaper: would terminate i-expired (expired), i-done (run-not-active); kept 1"
    )


def test_a_real_pass_terminates_by_default_and_reports_it() -> None:
    backend = FakeBackend(box("i-done", "done"))
    report = reap(backend, run_activity=Airflow({"done": RunActivity.OVER}), now=NOW)
    assert backend.terminated == ["i-done"]
    assert not report.dry_run
    assert [d.reason for d in report.decisions] == [REASON_RUN_NOT_ACTIVE]
    assert report.summary() == "reaper: terminated i-done (run-not-active); kept 0"


def test_a_pass_with_nothing_to_terminate_says_how_many_it_kept() -> None:
    backend = FakeBackend(box("i-1"), box("i-2", "odd"), box("i-3", "broken"))
    airflow = Airflow(
        {
            "run-i-1": RunActivity.ACTIVE,
            "odd": RunActivity.UNKNOWN,
            "broken": ConnectionError("down"),
        }
    )
    report = reap(backend, run_activity=airflow, now=NOW)
    assert report.instance_ids == []
    assert report.summary() == (
        "reaper: nothing to terminate (3 managed instance(s) kept); 1 error(s); 1 warning(s)"
    )
    assert reap(FakeBackend(), run_activity=airflow, now=NOW).summary() == (
        "reaper: nothing to terminate (0 managed instance(s) kept)"
    )


def test_decide_says_why_a_box_goes_or_none_to_keep_it() -> None:
    airflow = Airflow({"live": RunActivity.ACTIVE, "done": RunActivity.OVER})
    expired = decide(box("i-1", "live", expires_at=NOW), run_activity=airflow, now=NOW)
    assert expired is not None
    assert (expired.instance_id, expired.reason) == ("i-1", REASON_EXPIRED)
    assert expired.detail == f"expired at {NOW.isoformat()}"
    assert airflow.asked == []  # an expired box needs no question
    young = box("i-2", "live", expires_at=NOW + timedelta(seconds=1))
    assert decide(young, run_activity=airflow, now=NOW) is None
    assert decide(box("i-3", "live"), run_activity=airflow, now=NOW) is None
    over = decide(box("i-4", "done"), run_activity=airflow, now=NOW)
    assert over is not None and over.reason == REASON_RUN_NOT_ACTIVE
    assert f"{DAG_ID}/done" in over.detail
    assert airflow.asked == [(DAG_ID, "live"), (DAG_ID, "live"), (DAG_ID, "done")]


def test_decide_keeps_nothing_that_no_run_can_own() -> None:
    airflow = Airflow({})
    for info in (
        InstanceInfo("i-1", "", DAG_ID, RUNNING),
        InstanceInfo("i-2", "run", "", RUNNING),
        InstanceInfo("i-3", "", "", RUNNING),
    ):
        decision = decide(info, run_activity=airflow, now=NOW)
        assert decision is not None and decision.reason == REASON_UNTRACEABLE, info
    assert airflow.asked == []


def test_decide_refuses_an_answer_that_is_not_a_run_activity() -> None:
    with pytest.raises(TypeError, match="not a RunActivity"):
        decide(box("i-1"), run_activity=lambda dag, run: True, now=NOW)  # type: ignore[arg-type,return-value]


def test_the_groups_of_an_expired_run_with_no_box_left_are_removed(
    backend: Ec2Backend, ec2_client: Any, kit: Any, monkeypatch: Any
) -> None:
    """A run of several boxes whose orchestrator died leaves its placement and security
    groups behind (its teardown never ran): a reaper pass removes them once the run's expiry
    passed and its last box is gone, never a live run's, never before its expiry."""
    now = datetime.now(UTC)
    for run_id, expiry in (
        ("leaked", now - timedelta(minutes=5)),
        ("terminating", now - timedelta(minutes=5)),  # a box still holds its group
        ("later", now + timedelta(hours=1)),
    ):
        make_groups(backend, run_id, expiry)

    everything = {"leaked", "terminating", "later"}
    assert backend.remove_expired_clusters(now, {"terminating"}, dry_run=True) == ["leaked"]
    assert runs_with_groups(ec2_client) == (everything, everything)  # a dry run removes nothing
    assert backend.remove_expired_clusters(now, {"terminating"}) == ["leaked"]
    assert runs_with_groups(ec2_client) == ({"terminating", "later"}, {"terminating", "later"})

    # The reaper's pass does the same, after its boxes: "terminating" has none left now.
    airflow = Airflow({})
    reports = reaper.reap_everywhere(["ec2"], airflow, settings=sweep_settings(kit, monkeypatch))
    assert reaper.reap_errors(reports) == 0
    assert airflow.asked == []
    assert runs_with_groups(ec2_client) == ({"later"}, {"later"})


# --- A pass everywhere: Airflow is asked by the raw run id the boxes carry ---


def test_a_pass_everywhere_asks_airflow_by_the_raw_run_id_and_keeps_a_live_runs_box(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any, monkeypatch: Any
) -> None:
    """Boxes are tagged with the path-safe run key; Airflow knows only the raw run id (its own
    tag), and answers "not found" (OVER) for anything else: asked by the key, a reaper would
    terminate every live run's box."""
    assert LIVE.run_key != LIVE.airflow_run_id
    assert FINISHED.run_key != FINISHED.airflow_run_id
    keep = launch_held(backend, player, LIVE.run_key, airflow_run_id=LIVE.airflow_run_id)
    leak = launch_held(backend, player, FINISHED.run_key, airflow_run_id=FINISHED.airflow_run_id)
    # Launched before the raw id had a tag of its own: its key is all there is to ask with.
    legacy = launch_held(backend, player, "legacy-run")
    airflow = Airflow(
        {
            LIVE.airflow_run_id: RunActivity.ACTIVE,
            FINISHED.airflow_run_id: RunActivity.OVER,
            "legacy-run": RunActivity.ACTIVE,
        }
    )
    settings = sweep_settings(kit, monkeypatch)
    (report,) = reaper.reap_everywhere(["ec2"], airflow, settings=settings)

    # The live run's box is still up; only the finished run's went.
    assert (state(ec2_client, keep), state(ec2_client, leak)) == ("running", "terminated")
    assert (report.backend, report.region, report.dry_run) == ("ec2", "us-east-1", False)
    assert report.instance_ids == [leak]
    (decision,) = report.decisions
    assert (decision.run_key, decision.dag_id, decision.reason) == (
        FINISHED.run_key,
        DAG_ID,
        REASON_RUN_NOT_ACTIVE,
    )
    assert sorted(report.kept) == sorted([keep, legacy])
    assert report.errors == [] and report.warnings == []
    assert sorted(airflow.asked) == sorted(
        [
            (DAG_ID, LIVE.airflow_run_id),
            (DAG_ID, FINISHED.airflow_run_id),
            (DAG_ID, "legacy-run"),
        ]
    )
    assert sorted(kit.live_managed()) == sorted([keep, legacy])
    backend.terminate([keep, legacy])
    assert kit.live_managed() == []


def test_a_dry_pass_everywhere_terminates_no_box_and_removes_no_group(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any, monkeypatch: Any
) -> None:
    """A run's groups outlive its last box by one pass (a box being terminated still holds its
    security group), and a dry pass removes neither boxes nor groups."""
    leak = launch_held(backend, player, FINISHED.run_key, airflow_run_id=FINISHED.airflow_run_id)
    expired = datetime.now(UTC) - timedelta(minutes=5)
    make_groups(backend, FINISHED.run_key, expired)  # its orchestrator died after making them
    make_groups(backend, "abandoned", expired)  # no box left at all
    airflow = Airflow({FINISHED.airflow_run_id: RunActivity.OVER})
    settings = sweep_settings(kit, monkeypatch)
    both = {FINISHED.run_key, "abandoned"}

    (dry,) = reaper.reap_everywhere(["ec2"], airflow, dry_run=True, settings=settings)
    assert dry.dry_run and dry.instance_ids == [leak]
    assert (
        dry.summary() == f"reaper (ec2 us-east-1): would terminate {leak} (run-not-active); kept 0"
    )
    assert state(ec2_client, leak) == "running"
    assert runs_with_groups(ec2_client) == (both, both)

    (first,) = reaper.reap_everywhere(["ec2"], airflow, settings=settings)
    assert not first.dry_run and first.instance_ids == [leak]
    assert state(ec2_client, leak) == "terminated"
    # Listed when the pass began, the box kept its run's groups through it.
    assert runs_with_groups(ec2_client) == ({FINISHED.run_key}, {FINISHED.run_key})

    (second,) = reaper.reap_everywhere(["ec2"], airflow, settings=settings)
    assert second.instance_ids == [] and second.kept == []
    assert runs_with_groups(ec2_client) == (set(), set())
    assert reaper.reap_errors([dry, first, second]) == 0
    assert airflow.asked == [(DAG_ID, FINISHED.airflow_run_id)] * 2


def test_a_backend_or_a_group_sweep_that_fails_is_counted_and_stops_nothing_else(
    backend: Ec2Backend,
    ec2_client: Any,
    player: Any,
    kit: Any,
    monkeypatch: Any,
    audited_calls: Any,
) -> None:
    leak = launch_held(backend, player, FINISHED.run_key, airflow_run_id=FINISHED.airflow_run_id)
    # AWS refuses to list the security groups: the groups sweep fails, after the boxes.
    refused = (
        b"<Response><Errors><Error><Code>UnauthorizedOperation</Code>"
        b"<Message>injected refusal</Message></Error></Errors>"
        b"<RequestID>r-1</RequestID></Response>"
    )
    monkeypatch.setitem(audited_calls.answers, "ec2:DescribeSecurityGroups", (403, refused))
    airflow = Airflow({FINISHED.airflow_run_id: RunActivity.OVER})
    settings = sweep_settings(kit, monkeypatch)
    reports = reaper.reap_everywhere(["nowhere", "ec2"], airflow, settings=settings)

    assert [(r.backend, r.region) for r in reports] == [("nowhere", ""), ("ec2", "us-east-1")]
    nowhere, ec2 = reports
    (listing,) = nowhere.errors
    assert (listing.instance_id, listing.step) == ("", "list")
    assert "unknown compute backend 'nowhere'" in listing.error
    assert nowhere.decisions == [] and nowhere.warnings == []
    assert ec2.instance_ids == [leak]
    assert state(ec2_client, leak) == "terminated"
    (groups,) = ec2.errors
    assert (groups.instance_id, groups.step) == ("", "groups")
    assert groups.error.startswith("ClientError") and "injected refusal" in groups.error
    assert reaper.reap_errors(reports) == 2


@pytest.mark.parametrize("botocore", ["importable", "missing"])
def test_a_backend_that_cannot_be_swept_is_an_error_not_a_warning(
    tmp_path: Any, monkeypatch: Any, botocore: str
) -> None:
    """Only AWS's own "no credentials" is a warning; without botocore, nothing is."""
    if botocore == "missing":
        monkeypatch.setitem(sys.modules, "botocore.exceptions", None)  # import fails
    settings = Settings(home=str(tmp_path), reaper_backends="")
    airflow = Airflow({})
    reports = reaper.reap_everywhere(["nowhere", "local"], airflow, settings=settings)
    assert [r.backend for r in reports] == ["nowhere", "local"]
    nowhere, local = reports
    assert [(e.instance_id, e.step) for e in nowhere.errors] == [("", "list")]
    assert nowhere.errors[0].error.startswith("UnknownBackendError: unknown compute backend")
    assert nowhere.warnings == [] and local.warnings == [] and local.errors == []
    assert reaper.reap_errors(reports) == 1
    assert airflow.asked == []
