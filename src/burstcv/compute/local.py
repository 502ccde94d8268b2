"""Run the training job as a local process: the embedded default and the model of a GPU box.

Each launch is a process group running ``burstcv train --job <uri>`` under a shell wrapper;
a JSON record per process under ``BURSTCV_COMPUTE_STATE_DIR/<run_id>/`` plays the role of EC2
tags. Hosts that share the state dir may not share a pid namespace (a docker-compose stack's
containers): each record names the host whose pid it is; elsewhere a box is judged from the
wrapper's files beside its record (heartbeat, stop record) and stopped by a stop-request file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from burstcv import lineage
from burstcv.compute.base import RUNNING, STOPPED, InstanceInfo
from burstcv.settings import get_settings
from burstcv_spec.contracts import Launch, LocalProcessRecord, read_artifact, write_artifact

log = logging.getLogger(__name__)

TERMINATE_GRACE_S = 20.0  # SIGTERM lets training checkpoint before SIGKILL
HEARTBEAT_STALE_S = 60.0  # another host's box is lost once its heartbeat is this old
STOP_SETTLE_S = 10.0  # beyond both graces, how long a stop request may take to be seen


def this_host() -> str:
    """Return who runs this code, ``<hostname>/<pid namespace inode>``: containers may share
    a hostname (or set none), never a pid namespace."""
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        host += f"/{os.stat('/proc/self/ns/pid').st_ino}"
    return host


def _beside(record_path: Path, kind: str) -> Path:
    """Return one of the wrapper's files beside a box's record: ``stopped`` (written with its
    stop time when the box ends), ``heartbeat`` (touched while the trainer lives) or ``stop``
    (a stop request: its existence asks the wrapper's watchdog to stop the trainer)."""
    return record_path.with_suffix(f".{kind}")


def _stop_time(stopped_file: Path) -> datetime | None:
    """Return when the box stopped, from its stop record (its mtime if it holds no time)."""
    try:
        text = stopped_file.read_text().split()
        return datetime.fromtimestamp(float(text[0]) if text else stopped_file.stat().st_mtime, UTC)
    except (OSError, ValueError):
        return None


def _group_alive(pgid: int) -> bool:
    """Return True while any process of the box's process group still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _on_this_host(rec: LocalProcessRecord) -> bool:
    """Return True if the record's pid means its box here (records without a host: yes)."""
    return not rec.host or rec.host == this_host()


def _alive(path: Path, rec: LocalProcessRecord) -> bool:
    if not _on_this_host(rec):
        return _alive_by_files(path, rec)
    # Collect our own child's exit status, so an exited box is not a zombie forever.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(rec.pid, os.WNOHANG)
    # The group outlives its leader (the wrapper) while the training process finishes.
    return _proc_start_ticks(rec.pid) == rec.start_ticks or _group_alive(rec.pid)


def _alive_by_files(path: Path, rec: LocalProcessRecord) -> bool:
    """Judge a box of another host: not stopped, and its heartbeat (before the first: its
    launch) fresh; a box killed whole writes no stop record, but its heartbeat goes stale."""
    if _beside(path, "stopped").exists():
        return False
    try:
        beat = _beside(path, "heartbeat").stat().st_mtime
    except OSError:
        beat = datetime.fromisoformat(rec.launched_at).timestamp()
    return time.time() - beat < HEARTBEAT_STALE_S


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
HEARTBEAT_EVERY_S = 5  # how often the watchdog touches the heartbeat file


def train_command(job_uri: str, attempt: int) -> list[str]:
    """Return the command a box runs: ``burstcv train --job <uri> --attempt <n>``."""
    cli = [sys.executable, "-m", "burstcv.cli"]
    return [*cli, "train", "--job", job_uri, "--attempt", str(attempt)]


def wrapper_script(train_cmd: list[str], budget_s: int, record_path: Path) -> str:
    """Return the bash that runs one box: the trainer, its watchdog, and the stop record.
    All in one process group (no `timeout`, which makes its own group and would survive a
    killpg). The watchdog polls the trainer, so the group ends within a poll of the trainer's
    end, whoever killed it; it touches the heartbeat file while the trainer lives, and honours
    the stop-request file as it does the deadline."""
    heartbeat = shlex.quote(str(_beside(record_path, "heartbeat")))
    stop_request = shlex.quote(str(_beside(record_path, "stop")))
    stopped = shlex.quote(str(_beside(record_path, "stopped")))
    return (
        # A zombie (exited, not yet reaped: the wrapper is gone) no longer trains.
        'alive() { local s; s=$(cat /proc/"$1"/stat 2>/dev/null) || return 1; s=${s##*) }; '
        '[ "${s%% *}" != Z ]; }\n'
        # Called by the watchdog while the trainer lives; next_beat is the watchdog's own.
        'beat() { local now; now=$(date +%s); [ "$now" -lt "$next_beat" ] && return; '
        f"touch {heartbeat}; next_beat=$(( now + {HEARTBEAT_EVERY_S} )); }}\n"
        f"{shlex.join(train_cmd)} & child=$!\n"
        f"deadline=$(( $(date +%s) + {budget_s} ))\n"
        "( next_beat=0\n"
        "  while alive $child; do\n"
        "    beat\n"
        f"    if [ $(date +%s) -ge $deadline ] || [ -e {stop_request} ]; then\n"
        f"      kill -TERM $child; kill -CONT $child; grace=$(( $(date +%s) + {KILL_GRACE_S} ))\n"
        "      while alive $child && [ $(date +%s) -lt $grace ]; do\n"
        "        beat\n"
        f"        sleep {WATCHDOG_POLL_S}\n"
        "      done\n"
        "      kill -KILL $child; break\n"
        "    fi\n"
        f"    sleep {WATCHDOG_POLL_S}\n"
        "  done ) >/dev/null 2>&1 & watchdog=$!\n"
        "wait $child; rc=$?\n"
        "kill $watchdog 2>/dev/null\n"
        # Written aside, then renamed: a reader never finds the stop record empty.
        f"date +%s.%N > {stopped}.tmp && mv {stopped}.tmp {stopped}\n"
        "exit $rc\n"
    )


class LocalBackend:
    """Start training jobs as local processes and find them again by run id."""

    name = "local"
    poll_s = 0.2  # a local box's state is its process: cheap to look at

    def __init__(self, state_dir: str | None = None) -> None:
        self.state_dir = Path(state_dir or get_settings().compute_state_dir)

    def _records(self, run_id: str | None = None) -> list[tuple[Path, LocalProcessRecord]]:
        root = self.state_dir
        dirs = [root / run_id] if run_id else sorted(p for p in root.glob("*") if p.is_dir())
        return [
            (path, read_artifact(str(path), LocalProcessRecord))
            for folder in dirs
            for path in sorted(folder.glob("local-*.json"))
        ]

    def _info(self, path: Path, rec: LocalProcessRecord) -> InstanceInfo:
        alive = _alive(path, rec)
        if (stopped_file := _beside(path, "stopped")).exists():
            stopped_at = _stop_time(stopped_file)
        else:
            stopped_at = datetime.fromisoformat(rec.stopped_at) if rec.stopped_at else None
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
            attempt=rec.attempt,
        )

    def launch(self, launch: Launch, attempt: int = 1) -> list[str]:
        """Start ``burstcv train --job`` in its own process group; return its id."""
        folder = self.state_dir / launch.run.run_key
        folder.mkdir(parents=True, exist_ok=True)
        ids = []
        for _ in range(launch.count):
            instance_id = f"local-{uuid.uuid4().hex[:12]}"
            record_path = folder / f"{instance_id}.json"
            log_path = record_path.with_suffix(".log")
            launched = lineage.utc_now()
            budget = max(1, int((launch.deadline_at - launched).total_seconds())) + 60
            script = wrapper_script(train_command(launch.job_uri, attempt), budget, record_path)
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
                host=this_host(),
                start_ticks=_proc_start_ticks(proc.pid),
                run_key=launch.run.run_key,
                dag_id=launch.dag_id,
                job_uri=launch.job_uri,
                airflow_run_id=launch.run.airflow_run_id,
                launched_at=launched.isoformat(),
                attempt=attempt,
                expires_at=(launch.deadline_at + timedelta(seconds=120)).isoformat(),
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
        """Stop the given processes (one of another host: through its wrapper)."""
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
        if not _alive(path, rec):
            return
        if _on_this_host(rec):
            self._kill_group(path, rec)
        else:
            self._request_stop(path, rec)
        if rec.stopped_at is None:
            write_artifact(
                str(path), rec.model_copy(update={"stopped_at": lineage.utc_now().isoformat()})
            )

    def _kill_group(self, path: Path, rec: LocalProcessRecord) -> None:
        """Stop a box of this host: SIGTERM to its process group, SIGKILL after the grace."""
        pid = rec.pid  # the wrapper leads the box's process group: pgid == pid
        log.info("terminating %s (process group %d)", rec.instance_id, pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # training checkpoints on SIGTERM, then exits
            # A stopped trainer (SIGSTOP, a stall) handles its SIGTERM only once continued.
            os.killpg(pid, signal.SIGCONT)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        if not _gone(path, rec, deadline, 0.1):
            log.warning(
                "%s ignored SIGTERM for %.0fs: killing it", rec.instance_id, TERMINATE_GRACE_S
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            _gone(path, rec, deadline + 10, 0.1)

    def _request_stop(self, path: Path, rec: LocalProcessRecord) -> None:
        """Stop a box of another host through its wrapper's stop-request file, never its pid."""
        log.info("asking %s (launched on %s) to stop", rec.instance_id, rec.host)
        _beside(path, "stop").touch()
        grace = TERMINATE_GRACE_S + KILL_GRACE_S + STOP_SETTLE_S
        if not _gone(path, rec, time.monotonic() + grace, 0.2):
            log.warning(
                "%s on %s has not stopped %.0fs after the stop request",
                rec.instance_id,
                rec.host,
                grace,
            )


def _gone(path: Path, rec: LocalProcessRecord, until: float, poll_s: float) -> bool:
    """Wait until the box has ended, or the monotonic clock reads ``until``; return if it ended."""
    while time.monotonic() < until and _alive(path, rec):
        time.sleep(poll_s)
    return not _alive(path, rec)
