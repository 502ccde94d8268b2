"""A rank's error is its own: each rank writes its FAILED marker, the orchestrator reads them all.

In a run of several boxes, one rank's deterministic error (a corrupt shard only its box reads)
stops its peers too, and they say "a peer box was lost", which is resumable. Read alone, the
first rank's marker would relaunch every box for an error that cannot go away. The run here
is real: two torchrun agents on this host, each a "box" of one gloo process, rendezvousing
over c10d as the boxes of an EC2 run do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from burstcv_testkit import corrupt_image_member, make_job
from localserver import free_port

from burstcv.compute.attempts import rank_error, training_outcome
from burstcv.data import pack
from burstcv.data.demo import pack_demo
from burstcv.settings import get_settings
from burstcv.training.job import (
    STAGE_BUDGET,
    STAGE_INTERRUPTED,
    STAGE_TRAIN,
    attempt_failure,
    rank_failures,
    write_failed,
    write_job,
    write_rank_failed,
)
from burstcv.training.stream import node_shards, read_shard_info
from burstcv_spec.contracts import FailedMarker, read_artifact


@pytest.fixture
def local_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh local backend with no boxes: the attempt's markers alone say how it ended."""
    monkeypatch.setenv("BURSTCV_COMPUTE_STATE_DIR", str(tmp_path / "state"))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def rank_marker(rank: int, stage: str, reason: str, *, resumable: bool) -> FailedMarker:
    return FailedMarker(
        stage=stage,
        reason=reason,
        resumable=resumable,
        attempt=1,
        rank=rank,
        node=rank,
        traceback=["Traceback (most recent call last):", f"  rank {rank}", reason],
    )


PEER_LOST = "a peer box was lost: Connection closed by peer"


def test_a_ranks_own_error_outweighs_the_peer_lost_markers_it_caused(
    tmp_path: Path, local_state: None
) -> None:
    out = str(tmp_path / "job")
    write_failed(out, 1, STAGE_INTERRUPTED, PEER_LOST, resumable=True)
    write_rank_failed(out, rank_marker(0, STAGE_INTERRUPTED, PEER_LOST, resumable=True))
    write_rank_failed(out, rank_marker(2, STAGE_INTERRUPTED, PEER_LOST, resumable=True))
    write_rank_failed(out, rank_marker(10, STAGE_TRAIN, "ValueError: later", resumable=False))
    write_rank_failed(
        out, rank_marker(1, STAGE_TRAIN, "JobSpecError: shard 3 is corrupt", resumable=False)
    )
    assert [m.rank for m in rank_failures(out, 1)] == [0, 1, 2, 10]  # by rank, not by name

    outcome = training_outcome("r-ranks", "local", out)

    assert (outcome.status, outcome.stage, outcome.resumable) == ("failed", STAGE_TRAIN, False)
    assert outcome.reason == "rank 1 (node 1): JobSpecError: shard 3 is corrupt"


def test_a_ranks_error_ends_an_attempt_whose_boxes_are_gone_without_the_first_ranks_marker(
    tmp_path: Path, local_state: None
) -> None:
    out = str(tmp_path / "job")
    write_rank_failed(out, rank_marker(3, STAGE_TRAIN, "ValueError: bad", resumable=False))
    outcome = training_outcome("r-gone", "local", out)  # no box, no attempt marker: lost
    assert (outcome.status, outcome.resumable) == ("failed", False)
    assert outcome.reason == "rank 3 (node 3): ValueError: bad"


def test_a_running_boxs_rank_markers_are_read_on_every_poll_only_when_it_has_peers(
    tmp_path: Path, local_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from burstcv.compute import attempts

    out = str(tmp_path / "job")
    write_rank_failed(out, rank_marker(1, STAGE_TRAIN, "ValueError: bad", resumable=False))
    # The boxes are up (the backend says so: the one thing here that is not a real box).
    monkeypatch.setattr(attempts, "job_outcome", lambda *_: "running")
    listed: list[int] = []
    real = attempts.owning_rank_failure
    monkeypatch.setattr(
        attempts, "owning_rank_failure", lambda uri, n: listed.append(n) or real(uri, n)
    )
    # Several boxes: the others wait out their timeouts, so the marker decides at once.
    outcome = training_outcome("r-poll", "local", out, 1, boxes=2)
    assert (outcome.status, outcome.reason) == ("failed", "rank 1 (node 1): ValueError: bad")
    assert listed == [1]
    # One box: torchrun ends its other processes as a rank fails, so the markers wait until
    # the attempt has ended, and a poll of a box still up lists nothing.
    assert training_outcome("r-poll", "local", out, 1, boxes=1).status == "running"
    assert listed == [1]
    monkeypatch.setattr(attempts, "job_outcome", lambda *_: "lost")
    assert training_outcome("r-poll", "local", out, 1, boxes=1).reason == (
        "rank 1 (node 1): ValueError: bad"
    )


def test_the_attempts_own_final_marker_stands_and_peer_lost_alone_is_resumable(
    tmp_path: Path, local_state: None
) -> None:
    out = str(tmp_path / "job")
    write_rank_failed(out, rank_marker(0, STAGE_INTERRUPTED, PEER_LOST, resumable=True))
    assert rank_error("r", out, 1) is None
    write_failed(out, 1, STAGE_INTERRUPTED, PEER_LOST, resumable=True)
    outcome = training_outcome("r-peer", "local", out)
    assert (outcome.status, outcome.resumable, outcome.reason) == ("failed", True, PEER_LOST)
    # Every rank out of budget: the attempt's marker already says so, as the first rank's.
    spent = "the run's time budget is spent"
    write_rank_failed(out, rank_marker(1, STAGE_BUDGET, spent, resumable=False))
    write_failed(out, 1, STAGE_BUDGET, spent, resumable=False)
    outcome = training_outcome("r-peer", "local", out)
    assert (outcome.stage, outcome.reason, outcome.resumable) == (STAGE_BUDGET, spent, False)


def test_an_unreadable_rank_marker_is_skipped(tmp_path: Path, local_state: None) -> None:
    out = str(tmp_path / "job")
    write_rank_failed(out, rank_marker(1, STAGE_TRAIN, "ValueError: bad", resumable=False))
    torn = tmp_path / "job" / "attempts" / "1" / "ranks" / "0" / "FAILED"
    torn.parent.mkdir(parents=True)
    torn.write_text('{"stage": "tra')  # a write cut short
    stray = tmp_path / "job" / "attempts" / "1" / "ranks" / "notes" / "FAILED"
    stray.parent.mkdir(parents=True)
    stray.write_text(rank_marker(0, STAGE_TRAIN, "x", resumable=False).model_dump_json())
    (torn.parent.parent / "1" / "FAILED.tmp").write_text("{}")  # not a marker's name
    assert [m.rank for m in rank_failures(out, 1)] == [1]
    with pytest.raises(ValueError, match="names its rank"):
        write_rank_failed(
            out, rank_marker(0, STAGE_TRAIN, "x", resumable=False).model_copy(update={"rank": None})
        )


def two_boxes(job_uri: str) -> list[subprocess.CompletedProcess[str]]:
    """Run the job as two boxes would: two torchrun agents, one gloo process each, c10d."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "rank-markers",
                "--rdzv-conf",
                f"is_host={'true' if host else 'false'}",
                "--local-addr",
                "127.0.0.1",
                "--max-restarts",
                "0",
                "-m",
                "burstcv.training.entry",
                "train",
                "--job",
                job_uri,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for host in (True, False)
    ]
    done = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""))
    return done


def test_a_corrupt_shard_on_the_second_box_fails_the_attempt_with_that_ranks_reason(
    demo_dataset: Path, tmp_path: Path, local_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pack, "SHARD_IMAGES", 400)  # 4 training shards, 2 a box
    result, spec = pack_demo(demo_dataset, str(tmp_path / "shards"))
    packed = {
        "classes": result.classes,
        "train_shards": result.train_shards,
        "val_shards": result.val_shards,
        "spec": spec,
    }
    train = packed["train_shards"]
    counts = [read_shard_info(uri, packed["classes"]).count for uri in train]
    second_box = node_shards(counts, 2)[1]
    bad = Path(train[second_box[-1]])
    bad.write_bytes(corrupt_image_member(bad.read_bytes()))
    out = tmp_path / "job"
    job = make_job(packed, out, epochs=1)
    job_uri = write_job(job, str(tmp_path / "job.json"))

    boxes = two_boxes(job_uri)

    assert all(box.returncode != 0 for box in boxes), [b.stdout[-2000:] for b in boxes]
    markers = {m.rank: m for m in rank_failures(str(out), 1)}
    failing = markers[1]
    assert (failing.node, failing.stage, failing.resumable) == (1, STAGE_TRAIN, False)
    assert bad.name in failing.reason, failing
    # Its traceback's last lines, from the box where they were printed: where it broke.
    assert failing.traceback and failing.traceback[-1].startswith("burstcv"), failing.traceback
    assert "JobSpecError" in failing.traceback[-1]
    assert any("in load_shard" in line for line in failing.traceback), failing.traceback
    # The first rank saw its peer go; alone, that would have been relaunched.
    if 0 in markers:
        assert markers[0].resumable, markers[0]
    outcome = training_outcome("r-corrupt", "local", str(out))
    assert (outcome.status, outcome.resumable) == ("failed", False), outcome
    assert outcome.reason.startswith("rank 1 (node 1): ") and bad.name in outcome.reason
    assert json.loads((out / "attempts" / "1" / "ranks" / "1" / "FAILED").read_text())["rank"] == 1


def test_an_attempts_failure_is_its_owning_ranks_else_its_own_marker(tmp_path: Path) -> None:
    out = str(tmp_path / "job")
    assert attempt_failure(out, 1) is None  # nothing written: nothing to say
    write_failed(out, 1, STAGE_TRAIN, PEER_LOST, resumable=True)
    assert attempt_failure(out, 1) == read_artifact(f"{out}/attempts/1/FAILED", FailedMarker)
    write_rank_failed(out, rank_marker(0, STAGE_TRAIN, PEER_LOST, resumable=True))
    assert attempt_failure(out, 1).rank is None  # a peer's "lost" is not an error of its own
    write_rank_failed(out, rank_marker(2, STAGE_TRAIN, "OSError: disk full", resumable=False))
    write_rank_failed(out, rank_marker(1, STAGE_TRAIN, "ValueError: bad", resumable=False))
    owner = attempt_failure(out, 1)
    assert (owner.rank, owner.reason) == (1, "ValueError: bad")  # the lowest owning rank
    # Another attempt's markers are its own; one cut short is no failure to show.
    failed_2 = tmp_path / "job" / "attempts" / "2" / "FAILED"
    failed_2.parent.mkdir(parents=True)
    failed_2.write_text('{"stage": "tra')
    assert attempt_failure(out, 2) is None
