"""The local backend: the training box is a process group, found again and destroyed by run id."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from burstcv_testkit import first_trigger_event, launch_of, make_job

from burstcv.compute import local
from burstcv.compute.base import RUNNING, STOPPED
from burstcv.compute.local import LocalBackend
from burstcv.compute.reaper import RunActivity, reap
from burstcv.settings import get_settings
from burstcv.training.job import write_job


def wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def processes_running(needle: str) -> list[int]:
    """Return the pids whose command line mentions ``needle`` (a job's path): none may leak."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state not in ("Z", "X"):
            found.append(int(proc.name))
    return found


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Point the settings (read by the operator and pipeline) at a fresh backend state folder."""
    state = tmp_path / "state"
    monkeypatch.setenv("BURSTCV_COMPUTE_STATE_DIR", str(state))
    get_settings.cache_clear()
    yield state
    get_settings.cache_clear()
    # Whatever a test asserted, no box it started outlives it.
    for run_dir in state.glob("*"):
        if run_dir.is_dir():
            LocalBackend(str(state)).terminate_run(run_dir.name)


def provisioned_for(
    run_key: str,
    out: Path,
    *,
    job_uri: str = "",
    deadline_at: datetime | None = None,
) -> dict[str, Any]:
    """Return provision's XCom (a Provisioned as JSON) for a local run with these facts.

    The run is resolved first (its run.json, as the run's first task writes it): a relaunch
    reads the run's budget there.
    """
    from burstcv.params import RunParams
    from burstcv.stages import resolve
    from burstcv_spec.contracts import Launch, Provisioned, RunRef

    run = RunRef(airflow_run_id=f"manual__{run_key}", run_key=run_key)
    settings = get_settings()
    resolve.resolve_run(run, RunParams.resolve({"compute_backend": "local"}, settings), settings)
    launch = Launch(
        run=run,
        dag_id="d",
        job_uri=job_uri,
        time_budget_s=600,
        instance_types=[],
        use_spot=True,
        deadline_at=deadline_at or datetime.now(UTC) + timedelta(seconds=600),
        wheel_uri="",
        wheel_sha256="",
    )
    return Provisioned(
        run=run,
        job_uri=job_uri,
        output_uri=str(out),
        instance_ids=[],
        backend="local",
        launch=launch,
    ).model_dump(mode="json")


@pytest.fixture
def long_job(packed_demo: dict[str, Any], tmp_path: Path) -> tuple[str, Path]:
    out = tmp_path / "job"
    job_uri = write_job(make_job(packed_demo, out, epochs=200), str(tmp_path / "job.json"))
    return job_uri, out


def test_on_kill_of_the_train_task_terminates_the_box(
    long_job: tuple[str, Path], state_dir: Path
) -> None:
    from burstcv.airflow.operators import WaitForTrainingOperator

    job_uri, out = long_job
    backend = LocalBackend()
    ids = backend.launch(launch_of("r-kill", job_uri))
    assert [i.state for i in backend.describe("r-kill")] == [RUNNING]
    op = WaitForTrainingOperator(
        task_id="train",
        provisioned=provisioned_for("r-kill", out, job_uri=job_uri),
    )
    op.on_kill()
    infos = backend.describe("r-kill")
    assert [i.instance_id for i in infos] == ids and [i.state for i in infos] == [STOPPED]
    assert processes_running(job_uri) == []  # the whole box: wrapper, watchdog and trainer
    assert backend.terminate_run("r-kill") == ids  # a second teardown is harmless


def test_a_box_that_dies_without_a_marker_is_reported_lost(
    long_job: tuple[str, Path], state_dir: Path
) -> None:
    from burstcv.compute.attempts import training_outcome

    job_uri, out = long_job
    backend = LocalBackend()
    # No chance to write FAILED: a vanished machine.
    os.killpg(launch_box(state_dir, "r-lost", job_uri), signal.SIGKILL)
    wait_for(lambda: backend.describe("r-lost")[0].state == STOPPED)
    outcome = training_outcome("r-lost", "local", str(out))
    assert outcome.status == "lost"
    assert "without writing DONE or FAILED" in outcome.reason


def launch_box(state_dir: Path, run_id: str, job_uri: str, time_budget_s: int = 600) -> int:
    """Launch one local box for ``run_id``; return its wrapper's pid (its process group)."""
    LocalBackend().launch(launch_of(run_id, job_uri, time_budget_s=time_budget_s))
    return int(json.loads(next((state_dir / run_id).glob("local-*.json")).read_text())["pid"])


def box_processes(pgid: int) -> dict[int, str]:
    """Return the live processes of one box's process group: pid -> command line."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found[int(proc.name)] = cmdline
    return found


def trainer_pid(pgid: int) -> int:
    """Wait for the box's trainer (``burstcv train --job``) to start; return its pid."""
    found: list[int] = []

    def started() -> bool:
        found[:] = [
            pid
            for pid, cmd in box_processes(pgid).items()
            if cmd.startswith(sys.executable) and " burstcv.cli train --job " in cmd
        ]
        return bool(found)

    wait_for(started)
    return found[0]


def test_a_trainer_killed_by_the_oom_killer_is_seen_lost_within_a_poll(
    long_job: tuple[str, Path], state_dir: Path
) -> None:
    from burstcv.compute.attempts import training_outcome
    from burstcv.compute.local import WATCHDOG_POLL_S

    job_uri, out = long_job
    backend = LocalBackend()
    wrapper = launch_box(state_dir, "r-oom", job_uri, time_budget_s=3600)
    os.kill(trainer_pid(wrapper), signal.SIGKILL)  # the trainer alone: wrapper and watchdog live
    killed = time.monotonic()
    # An hour-long watchdog sleep kept the box "alive" until the deadline: now the box ends
    # within the watchdog's poll (bounded generously: this machine is shared).
    wait_for(lambda: backend.describe("r-oom")[0].state == STOPPED, timeout_s=30)
    assert time.monotonic() - killed < 10 * WATCHDOG_POLL_S + 5
    assert box_processes(wrapper) == {}
    outcome = training_outcome("r-oom", "local", str(out))
    assert outcome.status == "lost", outcome
    assert backend.describe("r-oom")[0].stopped_at is not None  # the wrapper recorded the stop
    assert processes_running(job_uri) == []


def test_a_killed_wrapper_leaves_the_trainer_to_finish_and_the_box_ends_with_it(
    packed_demo: dict[str, Any], tmp_path: Path, state_dir: Path
) -> None:
    from burstcv.compute.attempts import training_outcome

    out = tmp_path / "job"
    job_uri = write_job(make_job(packed_demo, out, epochs=1), str(tmp_path / "job.json"))
    backend = LocalBackend()
    wrapper = launch_box(state_dir, "r-wrap", job_uri)
    trainer = trainer_pid(wrapper)
    os.kill(wrapper, signal.SIGKILL)
    assert backend.describe("r-wrap")[0].state == RUNNING  # the trainer still trains
    wait_for(lambda: backend.describe("r-wrap")[0].state == STOPPED, timeout_s=300)
    assert not Path(f"/proc/{trainer}").exists() or box_processes(wrapper) == {}
    assert training_outcome("r-wrap", "local", str(out)).status == "done"
    assert box_processes(wrapper) == {}  # the watchdog went with its trainer
    assert processes_running(job_uri) == []


def test_reaper_terminates_expired_and_orphaned_boxes_only(
    long_job: tuple[str, Path], state_dir: Path
) -> None:
    job_uri, _ = long_job
    backend = LocalBackend()
    for run in ("r-live", "r-orphan", "r-expired"):
        backend.launch(
            launch_of(run, job_uri, dag_id="burstcv_pipeline", airflow_run_id=f"manual__{run}")
        )
    record = next((state_dir / "r-expired").glob("local-*.json"))
    data = json.loads(record.read_text())
    data["expires_at"] = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    record.write_text(json.dumps(data))

    def is_active(dag_id: str, run_id: str) -> RunActivity:
        return RunActivity.OVER if run_id == "r-orphan" else RunActivity.ACTIVE

    dry = reap(backend, run_activity=is_active, dry_run=True)
    assert sorted(d.run_key for d in dry.decisions) == ["r-expired", "r-orphan"]
    assert all(i.state == RUNNING for i in backend.list_managed())
    report = reap(backend, run_activity=is_active)
    assert sorted(d.reason for d in report.decisions) == ["expired", "run-not-active"]
    assert [i.run_id for i in backend.list_managed()] == ["r-live"]
    backend.terminate_run("r-live")
    assert backend.list_managed() == []
    assert processes_running(job_uri) == []


def test_a_retry_after_a_lost_box_relaunches_and_resumes_from_the_checkpoint(
    packed_demo: dict[str, Any], trained_demo: dict[str, Any], tmp_path: Path, state_dir: Path
) -> None:
    """Spot reclaim without warning: the train task's retry starts a new box that resumes."""
    from types import SimpleNamespace

    from airflow.sdk.exceptions import TaskDeferred

    from burstcv.airflow.operators import WaitForTrainingOperator
    from burstcv.compute.attempts import current_attempt, training_outcome

    out = tmp_path / "job"
    job_uri = write_job(make_job(packed_demo, out), str(tmp_path / "job.json"))
    provisioned = provisioned_for("r-spot", out, job_uri=job_uri)
    launch = provisioned["launch"]
    backend = LocalBackend()
    first = backend.launch(
        launch_of(
            "r-spot",
            job_uri,
            use_spot=True,
            airflow_run_id="manual__r-spot",
            deadline_at=datetime.fromisoformat(launch["deadline_at"]),
        )
    )
    wait_for(lambda: (out / "checkpoints" / "last.pt").exists(), timeout_s=240)
    record = json.loads(next((state_dir / "r-spot").glob("local-*.json")).read_text())
    os.killpg(record["pid"], signal.SIGKILL)
    wait_for(lambda: all(i.state == STOPPED for i in backend.describe("r-spot")))
    assert training_outcome("r-spot", "local", str(out)).status == "lost"

    op = WaitForTrainingOperator(task_id="train", provisioned=provisioned)
    with pytest.raises(TaskDeferred):
        op.execute({"ti": SimpleNamespace(try_number=2), "run_id": "manual__r-spot"})
    second = [i.instance_id for i in backend.describe("r-spot") if i.instance_id not in first]
    assert len(second) == 1, "the retry started exactly one new box"
    assert current_attempt(str(out)) == 2
    wait_for(
        lambda: training_outcome("r-spot", "local", str(out), 2).status != "running",
        timeout_s=300,
    )
    outcome = training_outcome("r-spot", "local", str(out), 2)
    assert outcome.status == "done", outcome
    resumed = json.loads((out / "metrics.json").read_text())
    unbroken = trained_demo["metrics"]
    assert resumed["val_accuracy"] == pytest.approx(unbroken["val_accuracy"], abs=1e-6)
    assert resumed["confusion"] == unbroken["confusion"]
    backend.terminate_run("r-spot")
    assert processes_running(job_uri) == []


def test_a_retry_after_a_job_failure_fails_without_relaunching(
    packed_demo: dict[str, Any], tmp_path: Path, state_dir: Path
) -> None:
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException

    from burstcv.airflow.operators import WaitForTrainingOperator
    from burstcv.training.job import STAGE_TRAIN, write_failed

    out = tmp_path / "job"
    out.mkdir()
    write_failed(str(out), 1, STAGE_TRAIN, "ValueError: bad shard", resumable=False)
    op = WaitForTrainingOperator(
        task_id="train",
        provisioned=provisioned_for("r-bad", out),
    )
    with pytest.raises(AirflowFailException, match="bad shard"):
        op.execute({"ti": SimpleNamespace(try_number=2), "run_id": "manual__r-bad"})
    assert LocalBackend().describe("r-bad") == []


def test_no_relaunch_after_the_runs_deadline(tmp_path: Path, state_dir: Path) -> None:
    from burstcv.stages.boxes import relaunch
    from burstcv.stages.resolve import TrainingFailed

    out = tmp_path / "job"
    out.mkdir()
    from burstcv_spec.contracts import Provisioned

    provisioned = provisioned_for(
        "r-late", out, deadline_at=datetime.now(UTC) - timedelta(seconds=1)
    )
    with pytest.raises(TrainingFailed, match=r"deadline .* has passed; no relaunch"):
        relaunch(Provisioned.model_validate(provisioned))
    assert LocalBackend().describe("r-late") == []


# --- boxes seen from another host (container) that shares the state dir, not the pids -------

# Stands in for ``burstcv train`` where only the box's process handling matters: it trains
# until signalled. "ignores-sigterm" notes the SIGTERM in its log and trains on.
FAKE_TRAINER = """
import signal, sys, time
def ignore(signum, frame):
    print(f"SIGTERM ignored at {time.time()}", flush=True)
if sys.argv[1] == "ignores-sigterm":
    signal.signal(signal.SIGTERM, ignore)
print("training", flush=True)
time.sleep(600)
"""

OTHER_HOST = "another-container/4026531000"

FakeBox = Callable[..., tuple[Path, int]]


@pytest.fixture
def fake_box(state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Launch boxes running FAKE_TRAINER; return (record path, process group) per launch."""
    needle = str(tmp_path / "fake-job.json")  # never read: it names this test's processes
    launched: list[int] = []

    def launch(run_id: str, mode: str = "honours-sigterm") -> tuple[Path, int]:
        monkeypatch.setattr(
            local,
            "train_command",
            lambda job_uri, attempt: [sys.executable, "-c", FAKE_TRAINER, mode, "--job", job_uri],
        )
        LocalBackend().launch(launch_of(run_id, needle))
        record = next((state_dir / run_id).glob("local-*.json"))
        pgid = int(json.loads(record.read_text())["pid"])
        launched.append(pgid)
        wait_for(lambda: "training" in record.with_suffix(".log").read_text(), timeout_s=20)
        return record, pgid

    yield launch
    for pid in processes_running(needle):  # wrapper, watchdog and trainer all name the job
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pgid in launched:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, 0)
    assert processes_running(needle) == []


def as_launched_elsewhere(record: Path, host: str = OTHER_HOST) -> None:
    """Rewrite a record as if another host (another pid namespace) had launched its box."""
    data = json.loads(record.read_text())
    data["host"] = host
    record.write_text(json.dumps(data))


def unshare_pid_namespace() -> list[str]:
    """Return the command prefix that runs a command in a new pid namespace, or skip."""
    prefix = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("util-linux unshare is not installed")
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.strip()}")
    return prefix


# Runs in another pid namespace: the box's pids mean nothing there, only the files do.
OTHER_NAMESPACE = """
import json, os, sys
from burstcv.compute.local import LocalBackend, this_host
backend = LocalBackend(sys.argv[1])
run_id, pid = sys.argv[2], int(sys.argv[3])
seen = {"host": this_host(), "pid_visible": os.path.exists(f"/proc/{pid}")}
seen["described"] = [i.state for i in backend.describe(run_id)]
seen["managed"] = [i.run_id for i in backend.list_managed()]
seen["terminated"] = backend.terminate_run(run_id)
seen["after"] = [i.state for i in backend.describe(run_id)]
print(json.dumps(seen))
"""


def test_another_pid_namespace_sees_the_box_running_and_stops_it(
    fake_box: FakeBox, state_dir: Path
) -> None:
    """The triggerer and another worker share the state dir, not the pid namespace."""
    prefix = unshare_pid_namespace()
    record, pgid = fake_box("r-ns")
    assert json.loads(record.read_text())["host"] == local.this_host()
    child = subprocess.run(
        [*prefix, sys.executable, "-c", OTHER_NAMESPACE, str(state_dir), "r-ns", str(pgid)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout.splitlines()[-1])
    assert seen["host"] != local.this_host()
    assert not seen["pid_visible"]
    assert seen["described"] == [RUNNING]
    assert seen["managed"] == ["r-ns"]
    assert seen["terminated"] == [record.stem]
    assert seen["after"] == [STOPPED]
    # Stopped for real, by the wrapper, as seen from the namespace that launched it.
    assert record.with_suffix(".stopped").exists()
    assert record.with_suffix(".stop").exists()
    # The watchdog's last `sleep` outlives it by up to a poll: the group ends after that.
    backend = LocalBackend()
    wait_for(lambda: backend.describe("r-ns")[0].state == STOPPED, timeout_s=10)
    assert box_processes(pgid) == {}
    assert backend.describe("r-ns")[0].stopped_at is not None
    assert json.loads(record.read_text())["stopped_at"]


def test_a_box_of_another_host_killed_whole_is_stopped_once_its_heartbeat_is_stale(
    fake_box: FakeBox, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record, pgid = fake_box("r-stale")
    as_launched_elsewhere(record)
    backend = LocalBackend()
    wait_for(lambda: record.with_suffix(".heartbeat").exists(), timeout_s=10)
    assert [i.state for i in backend.describe("r-stale")] == [RUNNING]
    os.killpg(pgid, signal.SIGKILL)  # wrapper, watchdog and trainer at once: no stop record
    wait_for(lambda: box_processes(pgid) == {}, timeout_s=10)
    # Nothing says it stopped yet: the heartbeat is fresh (and its pid is not read).
    assert [i.state for i in backend.describe("r-stale")] == [RUNNING]
    monkeypatch.setattr(local, "HEARTBEAT_STALE_S", 1.0)
    wait_for(lambda: backend.describe("r-stale")[0].state == STOPPED, timeout_s=10)
    assert backend.list_managed() == []
    assert not record.with_suffix(".stopped").exists()
    assert backend.terminate_run("r-stale") == [record.stem]
    assert not record.with_suffix(".stop").exists()  # a stopped box is not asked to stop


def test_an_old_record_without_a_host_is_judged_by_its_pid(
    fake_box: FakeBox, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from burstcv_spec.contracts import LocalProcessRecord, read_artifact

    record, pgid = fake_box("r-old")
    data = json.loads(record.read_text())
    del data["host"]
    record.write_text(json.dumps(data))
    assert read_artifact(str(record), LocalProcessRecord).host == ""
    backend = LocalBackend()
    monkeypatch.setattr(local, "HEARTBEAT_STALE_S", 0.0)  # by the files it would be stopped
    assert [i.state for i in backend.describe("r-old")] == [RUNNING]
    os.killpg(pgid, signal.SIGKILL)
    monkeypatch.setattr(local, "HEARTBEAT_STALE_S", 3600.0)  # by the files it would run on
    wait_for(lambda: backend.describe("r-old")[0].state == STOPPED, timeout_s=10)
    assert not record.with_suffix(".stopped").exists()


@pytest.mark.parametrize(
    ("mode", "ended_by"),
    [("honours-sigterm", signal.SIGTERM), ("ignores-sigterm", signal.SIGKILL)],
)
def test_a_stop_request_file_ends_the_trainer_through_the_wrapper(
    mode: str,
    ended_by: signal.Signals,
    fake_box: FakeBox,
    state_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(local, "KILL_GRACE_S", 2)  # read when the wrapper script is written
    record, pgid = fake_box("r-stop", mode)
    record.with_suffix(".stop").touch()
    status: list[int] = []

    def wrapper_exited() -> bool:
        pid, wait_status = os.waitpid(pgid, os.WNOHANG)  # the wrapper is this test's child
        if pid:
            status.append(wait_status)
        return bool(pid)

    wait_for(wrapper_exited, timeout_s=20)
    ended = time.time()
    # The wrapper exits with its trainer's status: 128 + the signal that ended it.
    assert os.waitstatus_to_exitcode(status[0]) == 128 + ended_by
    log_text = record.with_suffix(".log").read_text()
    if ended_by == signal.SIGKILL:
        term_at = float(log_text.split("SIGTERM ignored at ")[1].split()[0])
        assert ended - term_at >= local.KILL_GRACE_S - 1  # whole seconds, as `date +%s` counts
    else:
        assert "SIGTERM ignored" not in log_text
    assert record.with_suffix(".stopped").exists()
    backend = LocalBackend()
    wait_for(lambda: backend.describe("r-stop")[0].state == STOPPED, timeout_s=10)
    assert box_processes(pgid) == {}


def test_stopping_a_box_of_another_host_asks_its_wrapper_and_never_signals_the_pid(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from burstcv_spec.contracts import LocalProcessRecord, write_artifact

    def no_signals(pgid: int, signum: int) -> None:
        raise AssertionError(f"signalled process group {pgid} of another host")

    monkeypatch.setattr(local.os, "killpg", no_signals)
    folder = state_dir / "r-far"
    folder.mkdir(parents=True)
    record = folder / "local-0123456789ab.json"
    now = datetime.now(UTC)
    write_artifact(
        str(record),
        LocalProcessRecord(
            instance_id=record.stem,
            pid=os.getpid(),  # here that pid is this test, alive: only the files may count
            host=OTHER_HOST,
            run_key="r-far",
            dag_id="d",
            job_uri="/never/read/job.json",
            launched_at=now.isoformat(),
            attempt=1,
            expires_at=(now + timedelta(hours=1)).isoformat(),
            log=str(record.with_suffix(".log")),
        ),
    )
    backend = LocalBackend()
    # No heartbeat yet, launched just now: the box is starting.
    assert [i.state for i in backend.describe("r-far")] == [RUNNING]

    def far_wrapper() -> None:
        """Do what the other host's wrapper does: see the stop request, record the stop."""
        deadline = time.monotonic() + 30
        while not record.with_suffix(".stop").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        record.with_suffix(".stopped").write_text(f"{time.time()}\n")

    wrapper = threading.Thread(target=far_wrapper, daemon=True)
    wrapper.start()
    assert backend.terminate_run("r-far") == [record.stem]
    wrapper.join(timeout=30)
    infos = backend.describe("r-far")
    assert [i.state for i in infos] == [STOPPED] and infos[0].stopped_at is not None
    assert json.loads(record.read_text())["stopped_at"]

    # A box that never beat, launched longer ago than the window, is lost.
    record.with_suffix(".stopped").unlink()
    data = json.loads(record.read_text())
    data["launched_at"] = (now - timedelta(seconds=local.HEARTBEAT_STALE_S + 1)).isoformat()
    record.write_text(json.dumps(data))
    assert [i.state for i in backend.describe("r-far")] == [STOPPED]


def test_a_stopped_trainer_is_ended_for_want_of_progress_not_at_the_deadline(
    long_job: tuple[str, Path], state_dir: Path
) -> None:
    """kill -STOP: the process lives (the watchdog keeps the box up), but its beat stops; the
    train task's trigger marks the attempt FAILED, resumable, within the stall bound."""
    from burstcv.airflow.triggers import TrainingCompletionTrigger
    from burstcv.compute.attempts import resumable
    from burstcv.compute.liveness import BEAT_EVERY_S, MIN_BEATS, read_beat
    from burstcv_spec.contracts import TrainingOutcome

    job_uri, out = long_job
    backend = LocalBackend()
    wrapper = launch_box(state_dir, "r-stall", job_uri, time_budget_s=3600)
    trainer = trainer_pid(wrapper)
    wait_for(lambda: read_beat(str(out), 1) is not None, timeout_s=240)
    os.kill(trainer, signal.SIGSTOP)
    stopped = time.monotonic()
    trigger = TrainingCompletionTrigger(
        run_id="r-stall",
        backend="local",
        output_uri=str(out),
        attempt=1,
        poll_interval_s=0.5,
        stall_min_s=1.0,  # the bound is then a few beat intervals
    )
    try:
        outcome = TrainingOutcome.model_validate(first_trigger_event(trigger, 180))
        assert outcome.status == "failed" and outcome.stage == "stalled", outcome
        assert resumable(outcome)
        assert outcome.reason.startswith("no progress for "), outcome.reason
        assert " at epoch 1 step " in outcome.reason and "stalled" in outcome.reason
        assert time.monotonic() - stopped < MIN_BEATS * BEAT_EVERY_S + 2 * BEAT_EVERY_S + 30
        # All that while the box was up: its process lived, only its progress stopped.
        assert backend.describe("r-stall")[0].state == RUNNING
    finally:
        backend.terminate_run("r-stall")  # SIGTERM, then SIGCONT: a stopped trainer ends too
    wait_for(lambda: backend.describe("r-stall")[0].state == STOPPED, timeout_s=60)
    assert processes_running(job_uri) == []
