"""Run the training job as a local process: the embedded default and the model of a GPU box.

Each launch is a process group running ``burstcv train --job <uri>`` under a shell wrapper
that, like the EC2 user-data, records when it stopped. A JSON record per process under
``BURSTCV_COMPUTE_STATE_DIR/<run_id>/`` plays the role of EC2 tags: teardown and the reaper
find processes by run id from these records, never from ids kept elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from burstcv import lineage
from burstcv.compute.base import (
    RUNNING,
    STOPPED,
    InstanceInfo,
)
from burstcv.settings import get_settings
from burstcv_spec.contracts import Launch, LocalProcessRecord, read_artifact, write_artifact

log = logging.getLogger(__name__)

TERMINATE_GRACE_S = 20.0  # SIGTERM lets training checkpoint before SIGKILL


def _reap(pid: int) -> None:
    """Collect the exit status of our own child, so an exited box is not a zombie forever."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _group_alive(pgid: int) -> bool:
    """Return True while any process of the box's process group still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _alive(rec: LocalProcessRecord) -> bool:
    _reap(rec.pid)
    # The group outlives its leader (the wrapper) while the training process finishes.
    return _proc_start_ticks(rec.pid) == rec.start_ticks or _group_alive(rec.pid)


def _proc_start_ticks(pid: int) -> int | None:
    """Return a process's start time in clock ticks (guards against pid reuse), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped: it no longer runs
        return None
    return int(fields[19])


WATCHDOG_POLL_S = 1  # how soon the watchdog notices its trainer is gone, and so the box ends
KILL_GRACE_S = 30  # between the watchdog's SIGTERM (checkpoint) and its SIGKILL


def wrapper_script(train_cmd: list[str], budget_s: int, stopped_file: Path) -> str:
    """Return the bash that runs one box: the trainer, its watchdog, and the stop record.

    It mirrors the EC2 user-data: a watchdog bounds the run (from the run's deadline, like the
    box's), and the stop time is recorded when the job ends. Everything stays in this one
    process group (no `timeout`, which makes its own group and would survive a killpg), so
    terminating the group ends the whole box. The watchdog lives exactly as long as the
    trainer: it polls the trainer's process every WATCHDOG_POLL_S, so the box's process
    group, which is what liveness reads, ends within a poll of the trainer's end, whoever
    killed which process (the out-of-memory killer's kill -9 of the trainer, or of this
    wrapper: the trainer then runs on and writes its own markers). A single long `sleep`
    here outlived a killed trainer and made the box look alive until the deadline.
    """
    return (
        # A zombie (exited, not yet reaped: the wrapper is gone) no longer trains.
        'alive() { local s; s=$(cat /proc/"$1"/stat 2>/dev/null) || return 1; s=${s##*) }; '
        '[ "${s%% *}" != Z ]; }\n'
        f"{shlex.join(train_cmd)} & child=$!\n"
        f"deadline=$(( $(date +%s) + {budget_s} ))\n"
        "( while alive $child; do\n"
        "    if [ $(date +%s) -ge $deadline ]; then\n"
        f"      kill -TERM $child; grace=$(( $(date +%s) + {KILL_GRACE_S} ))\n"
        "      while alive $child && [ $(date +%s) -lt $grace ]; do\n"
        f"        sleep {WATCHDOG_POLL_S}\n"
        "      done\n"
        "      kill -KILL $child; break\n"
        "    fi\n"
        f"    sleep {WATCHDOG_POLL_S}\n"
        "  done ) >/dev/null 2>&1 & watchdog=$!\n"
        "wait $child; rc=$?\n"
        "kill $watchdog 2>/dev/null\n"
        f"date +%s.%N > {shlex.quote(str(stopped_file))}\n"
        "exit $rc\n"
    )


class LocalBackend:
    """Start training jobs as local processes and find them again by run id."""

    name = "local"

    def __init__(self, state_dir: str | None = None) -> None:
        self.state_dir = Path(state_dir or get_settings().compute_state_dir)

    # -- records ---------------------------------------------------------------------------
    def _run_dir(self, run_id: str) -> Path:
        return self.state_dir / run_id

    def _records(self, run_id: str | None = None) -> list[tuple[Path, LocalProcessRecord]]:
        dirs = (
            [self._run_dir(run_id)]
            if run_id
            else sorted(p for p in self.state_dir.glob("*") if p.is_dir())
        )
        out = []
        for folder in dirs:
            for path in sorted(folder.glob("local-*.json")):
                out.append((path, read_artifact(str(path), LocalProcessRecord)))
        return out

    def _info(self, path: Path, rec: LocalProcessRecord) -> InstanceInfo:
        alive = _alive(rec)
        stopped_file = path.with_suffix(".stopped")
        stopped_at = None
        if stopped_file.exists():
            stopped_at = datetime.fromtimestamp(float(stopped_file.read_text().split()[0]), UTC)
        elif rec.stopped_at:
            stopped_at = datetime.fromisoformat(rec.stopped_at)
        return InstanceInfo(
            instance_id=rec.instance_id,
            run_id=rec.run_key,
            dag_id=rec.dag_id,
            state=RUNNING if alive else STOPPED,
            expires_at=datetime.fromisoformat(rec.expires_at),
            instance_type="local",
            lifecycle="local",
            launched_at=datetime.fromisoformat(rec.launched_at),
            stopped_at=stopped_at,
            airflow_run_id=rec.airflow_run_id,
        )

    # -- protocol --------------------------------------------------------------------------
    def launch(self, launch: Launch, attempt: int = 1) -> list[str]:
        """Start ``burstcv train --job`` in its own process group; return its id."""
        folder = self._run_dir(launch.run.run_key)
        folder.mkdir(parents=True, exist_ok=True)
        ids = []
        for _ in range(launch.count):
            instance_id = f"local-{uuid.uuid4().hex[:12]}"
            record_path = folder / f"{instance_id}.json"
            stopped_file = record_path.with_suffix(".stopped")
            log_path = record_path.with_suffix(".log")
            train_cmd = [
                sys.executable,
                "-m",
                "burstcv.cli",
                "train",
                "--job",
                launch.job_uri,
                "--attempt",
                str(attempt),
            ]
            launched = lineage.utc_now()
            deadline = launch.deadline_at
            budget = max(1, int((deadline - launched).total_seconds())) + 60
            script = wrapper_script(train_cmd, budget, stopped_file)
            with open(log_path, "ab") as log_fh:
                proc = subprocess.Popen(
                    ["bash", "-c", script],
                    stdout=log_fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            record = LocalProcessRecord(
                instance_id=instance_id,
                pid=proc.pid,
                start_ticks=_proc_start_ticks(proc.pid),
                run_key=launch.run.run_key,
                dag_id=launch.dag_id,
                job_uri=launch.job_uri,
                airflow_run_id=launch.run.airflow_run_id,
                launched_at=launched.isoformat(),
                attempt=attempt,
                expires_at=(deadline + timedelta(seconds=120)).isoformat(),
                log=str(log_path),
            )
            write_artifact(str(record_path), record)
            ids.append(instance_id)
            log.info(
                "launched %s (pid %d) for run %s, log %s",
                instance_id,
                proc.pid,
                launch.run.run_key,
                log_path,
            )
        return ids

    def describe(self, run_id: str) -> list[InstanceInfo]:
        """Return every process recorded for the run."""
        return [self._info(p, r) for p, r in self._records(run_id)]

    def list_managed(self) -> list[InstanceInfo]:
        """Return every recorded process that still runs."""
        return [i for i in (self._info(p, r) for p, r in self._records()) if i.state != STOPPED]

    def terminate(self, instance_ids: list[str]) -> None:
        """Stop the given processes: SIGTERM to the group, SIGKILL after the grace period."""
        wanted = set(instance_ids)
        for path, rec in self._records():
            if rec.instance_id in wanted:
                self._stop(path, rec)

    def terminate_run(self, run_id: str) -> list[str]:
        """Stop every process of the run; return their ids."""
        ids = []
        for path, rec in self._records(run_id):
            self._stop(path, rec)
            ids.append(rec.instance_id)
        return ids

    def _stop(self, path: Path, rec: LocalProcessRecord) -> None:
        pid = rec.pid  # the wrapper leads the box's process group: pgid == pid
        if not _alive(rec):
            return
        log.info("terminating %s (process group %d)", rec.instance_id, pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # training checkpoints on SIGTERM, then exits
        deadline = time.monotonic() + TERMINATE_GRACE_S
        while time.monotonic() < deadline and _alive(rec):
            time.sleep(0.1)
        if _alive(rec):
            log.warning(
                "%s ignored SIGTERM for %.0fs: killing it", rec.instance_id, TERMINATE_GRACE_S
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            while _alive(rec) and time.monotonic() < deadline + 10:
                time.sleep(0.1)
        if rec.stopped_at is None:
            write_artifact(
                str(path), rec.model_copy(update={"stopped_at": lineage.utc_now().isoformat()})
            )
