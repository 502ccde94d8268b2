"""Define what every compute backend offers: launch a training box, watch it, destroy it by tag.

Instances are found again by their run-id tag, never only by ids remembered elsewhere, so a
teardown or the reaper can clean up after a process that died.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol

from burstcv.training.job import attempt_dir
from burstcv_spec import storage
from burstcv_spec.contracts import Launch
from burstcv_spec.layout import DONE_MARKER, FAILED_MARKER

# Instance states every backend maps its own onto.
PENDING = "pending"
RUNNING = "running"
# Shutting down, stopping or stopped: it will never train again (a reclaimed spot box stays
# shutting-down for minutes), but it still exists and may still bill, so teardown and the
# reaper still terminate it.
ENDING = "ending"
STOPPED = "stopped"  # gone: terminated, shut down, or exited
WORKING = (PENDING, RUNNING)  # the states of a box that may still write a marker

JobOutcome = Literal["done", "failed", "lost", "running"]

# Tag keys: what the teardown, the reaper and the IAM policy key on.
TAG_MANAGED = "burstcv:managed"
TAG_RUN_ID = "burstcv:run-id"
TAG_DAG_ID = "burstcv:dag-id"
TAG_EXPIRES_AT = "burstcv:expires-at"
TAG_AIRFLOW_RUN_ID = "burstcv:airflow-run-id"  # the raw Airflow run id (run-id is path-safe)
# The training attempt a box belongs to (1 for provision, +1 per relaunch): a relaunch tells
# its own boxes from a dying box of the attempt before by this tag, never by their state.
TAG_ATTEMPT = "burstcv:attempt"
TAG_NAME = "Name"  # the console's name column
# Every tag key a launch may send: the one list the IAM policy's aws:TagKeys must equal
# (tests/deploy/test_iam_policy.py), so a key added here and not there fails the tests.
MANAGED_TAG_KEYS = (
    TAG_MANAGED,
    TAG_RUN_ID,
    TAG_DAG_ID,
    TAG_EXPIRES_AT,
    TAG_AIRFLOW_RUN_ID,
    TAG_ATTEMPT,
    TAG_NAME,
)


@dataclass
class InstanceInfo:
    """Describe one managed instance (or local process) as its tags and state say."""

    instance_id: str
    run_id: str
    dag_id: str
    state: str
    expires_at: datetime | None = None
    instance_type: str = ""
    lifecycle: str = ""  # "spot" | "on-demand" | "local"
    launched_at: datetime | None = None
    stopped_at: datetime | None = None
    airflow_run_id: str = ""
    image_id: str = ""  # the AMI the box booted (ec2), recorded in billing.json
    zone: str = ""  # its Availability Zone (ec2): where its spot price is quoted
    public_ipv4: bool = False  # it has a public IPv4 address (ec2), which bills by the hour
    # The attempt that launched it (its tag); a box launched before the tag existed: 1.
    attempt: int = 1
    # Why it left running, as EC2 says (StateReason code): Client.InstanceInitiatedShutdown
    # when it powered itself off, Server.SpotInstanceTermination when reclaimed; "" else.
    ended_by: str = ""

    def of_attempt(self, attempt: int) -> bool:
        """Return whether attempt ``attempt`` launched this box."""
        return self.attempt == attempt


class ComputeBackend(Protocol):
    """Launch, watch and destroy training boxes; every call is safe to repeat."""

    name: str
    poll_s: float  # between two looks at its boxes while waiting for them to change state

    def launch(self, launch: Launch, attempt: int = 1) -> list[str]:
        """Start attempt ``attempt`` of the run's boxes; return their ids (clean up on failure)."""

    def describe(self, run_id: str) -> list[InstanceInfo]:
        """Return every instance tagged with the run id, in any state."""

    def terminate_run(self, run_id: str) -> list[str]:
        """Terminate every instance tagged with the run id, wait until gone; return their ids."""

    def list_managed(self) -> list[InstanceInfo]:
        """Return every burstcv-managed instance that is not yet stopped (for the reaper)."""

    def terminate(self, instance_ids: list[str]) -> None:
        """Terminate the given managed instances (the reaper's tool)."""


def job_outcome(
    backend: ComputeBackend, run_id: str, job_dir_uri: str, attempt: int = 1
) -> JobOutcome:
    """Return done, failed, lost (every box ending or gone without a marker) or running.
    The boxes are read before the markers, so a marker written just before its box went away
    is still seen; DONE wins (training writes it last). Of several boxes, one gone without a
    marker loses the attempt for all (the others would wait for a collective's timeout)."""
    instances = [i for i in backend.describe(run_id) if i.of_attempt(attempt)]
    if storage.exists(attempt_dir(job_dir_uri, attempt, DONE_MARKER)):
        return "done"
    if storage.exists(attempt_dir(job_dir_uri, attempt, FAILED_MARKER)):
        return "failed"
    if not any(info.state in WORKING for info in instances):
        return "lost"
    if len(instances) > 1 and any(info.state not in WORKING for info in instances):
        return "lost"
    return "running"
