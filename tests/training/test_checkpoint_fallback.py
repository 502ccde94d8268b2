"""Checkpoints survive their own write: the two newest kept, each verified, a resume falls back."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from burstcv_testkit import make_job, write_shard

from burstcv.training.checkpoint import (
    RESUME_KEYS,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    staged_path,
)
from burstcv.training.job import JobSpec, write_job
from burstcv.training.train import load_shards, run_job
from burstcv_spec import storage

TRAIN_LOG = "burstcv.training"  # the training loop's and its checkpoints' lines


def _state(epoch: int, step: int = 0) -> dict[str, Any]:
    """Return a small checkpoint with every key a resume reads."""
    return {
        "model": {"w": torch.full((64,), float(epoch))},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": epoch},
        "rng_cpu": torch.get_rng_state(),
        "epoch": epoch,
        "step": step,
        "history": "[]",
    }


def _truncate(path: Path) -> None:
    """Cut a file in half, as a write that stopped midway leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _position(uri: str) -> tuple[int, int]:
    ckpt = load_checkpoint(uri, RESUME_KEYS)
    assert ckpt is not None, uri
    return int(ckpt["epoch"]), int(ckpt["step"])


# ---------------------------------------------------------------------------------------------
# Saving and choosing, on small checkpoints


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_save_keeps_the_checkpoint_before_it(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root = "s3://artifacts/runs/r/job" if where == "s3" else str(tmp_path / "job")
    if where == "s3":
        request.getfixturevalue("s3")  # the emulator, emptied, with an "artifacts" bucket
    last = storage.join(root, "checkpoints", "last.pt")
    prev = storage.join(root, "checkpoints", "prev.pt")
    save_checkpoint(last, _state(1), keep_as=prev)
    assert not storage.exists(prev)  # nothing before the first
    save_checkpoint(last, _state(2), keep_as=prev)
    save_checkpoint(last, _state(3), keep_as=prev)
    assert (_position(last), _position(prev)) == ((3, 0), (2, 0))
    save_checkpoint(last, _state(4))  # no keep_as: the one before is not kept
    assert (_position(last), _position(prev)) == ((4, 0), (2, 0))


def test_a_resume_takes_last_pt_when_it_loads(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    save_checkpoint(str(ckpts / "prev.pt"), _state(2, 5))
    save_checkpoint(str(ckpts / "last.pt"), _state(3))
    found = resume_checkpoint(str(tmp_path))
    assert found is not None and found[0] == str(ckpts / "last.pt") and found[1]["epoch"] == 3


def test_a_truncated_last_pt_falls_back_to_the_further_along_of_prev_and_best(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpts = tmp_path / "checkpoints"
    save_checkpoint(str(ckpts / "last.pt"), _state(3, 2))
    save_checkpoint(str(ckpts / "prev.pt"), _state(2, 5))
    save_checkpoint(str(ckpts / "best.pt"), {**_state(2), "best": "{}"})
    _truncate(ckpts / "last.pt")
    with caplog.at_level(logging.WARNING, logger=TRAIN_LOG):
        found = resume_checkpoint(str(tmp_path))
    assert found is not None and found[0] == str(ckpts / "prev.pt")
    assert f"checkpoint skipped: {ckpts / 'last.pt'}" in caplog.text
    assert "does not load: RuntimeError: PytorchStreamReader failed" in caplog.text
    # best.pt is written at an epoch's end: it may be newer than prev.pt, and then it is taken.
    save_checkpoint(str(ckpts / "best.pt"), {**_state(3), "best": "{}"})
    found = resume_checkpoint(str(tmp_path))
    assert found is not None and found[0] == str(ckpts / "best.pt")


def test_a_checkpoint_without_what_a_resume_reads_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpts = tmp_path / "checkpoints"
    save_checkpoint(str(ckpts / "last.pt"), {"model": {"w": torch.zeros(2)}, "epoch": 3})
    save_checkpoint(str(ckpts / "prev.pt"), _state(2))
    with caplog.at_level(logging.WARNING, logger=TRAIN_LOG):
        found = resume_checkpoint(str(tmp_path))
    assert found is not None and found[0] == str(ckpts / "prev.pt")
    assert f"{ckpts / 'last.pt'} lacks optimizer, scheduler, rng_cpu, step, history" in caplog.text


def test_when_no_checkpoint_loads_the_run_starts_over_keeping_them_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpts = tmp_path / "checkpoints"
    save_checkpoint(str(ckpts / "last.pt"), _state(3))
    _truncate(ckpts / "last.pt")
    (ckpts / "prev.pt").write_bytes(b"\0" * 4096)
    # best.pt of weights only (as before best.pt held the whole state): nothing to resume from.
    save_checkpoint(str(ckpts / "best.pt"), {"model": {"w": torch.zeros(2)}, "best": "{}"})
    torn = {name: (ckpts / name).read_bytes() for name in ("last.pt", "prev.pt", "best.pt")}
    with caplog.at_level(logging.WARNING, logger=TRAIN_LOG):
        assert resume_checkpoint(str(tmp_path)) is None
    for name in ("last.pt", "prev.pt"):
        assert f"checkpoint skipped: {ckpts / name} (" in caplog.text
    assert f"{ckpts / 'best.pt'} lacks optimizer" in caplog.text
    kept = ckpts / "unreadable"
    assert f"training starts over (kept in {kept})" in caplog.text
    # What a person would look at is kept as it was, out of the way of the new saves.
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == torn


def test_no_checkpoint_or_only_a_weights_only_best_pt_starts_afresh(tmp_path: Path) -> None:
    assert resume_checkpoint(str(tmp_path)) is None
    save_checkpoint(
        str(tmp_path / "checkpoints" / "best.pt"), {"model": {"w": torch.zeros(2)}, "best": "{}"}
    )
    assert resume_checkpoint(str(tmp_path)) is None


def test_a_truncated_last_pt_on_s3_falls_back_to_prev(s3: Any) -> None:
    root = "s3://artifacts/runs/r/job"
    last, prev = f"{root}/checkpoints/last.pt", f"{root}/checkpoints/prev.pt"
    save_checkpoint(last, _state(1), keep_as=prev)
    save_checkpoint(last, _state(2), keep_as=prev)
    storage.write_bytes(last, storage.read_bytes(last)[:100])
    found = resume_checkpoint(root)
    assert found is not None and found[0] == prev and found[1]["epoch"] == 1


def test_partial_writes_are_told_from_files(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    save_checkpoint(str(ckpts / "last.pt"), _state(1))
    left = [ckpts / ".last.pt.k2x_9qzt.tmp", ckpts / ".best.pt.0a1b2c3d.tmp"]
    kept = [ckpts / "last.pt", ckpts / "notes.tmp", ckpts / ".last.pt.tmp"]
    for path in left + kept[1:]:
        path.write_bytes(b"partial")
    assert storage.remove_partial_writes(str(ckpts)) == sorted(str(p) for p in left)
    assert sorted(ckpts.iterdir()) == sorted(kept)
    assert storage.remove_partial_writes(str(tmp_path / "none")) == []
    assert storage.remove_partial_writes("s3://artifacts/runs/r/job/checkpoints") == []


# ---------------------------------------------------------------------------------------------
# A real run: 3 short epochs trained once, its job folder copied by each test


def _job(packed: dict[str, Any], shards: dict[str, list[str]], out: Path) -> JobSpec:
    # No periodic checkpoint in so short a run: last.pt is epoch 3's end, prev.pt epoch 2's.
    return make_job(packed, out, batch_size=32, checkpoint_every_s=3600.0, **shards)


@pytest.fixture(scope="module")
def trained(packed_demo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Train 3 epochs of 4 steps once; return (shards, job folder, metrics)."""
    root = tmp_path_factory.mktemp("fallback")
    images, labels = load_shards(packed_demo["train_shards"], packed_demo["classes"])
    val_images, val_labels = load_shards(packed_demo["val_shards"], packed_demo["classes"])
    classes = packed_demo["classes"]
    shards = {
        "train_shards": [write_shard(root / "train.npz", images[:128], labels[:128], classes)],
        "val_shards": [write_shard(root / "val.npz", val_images[:64], val_labels[:64], classes)],
    }
    out = root / "out"
    assert run_job(write_job(_job(packed_demo, shards, out), str(root / "job.json"))) == 0
    return shards, out, json.loads((out / "metrics.json").read_text())


def _copy(packed: dict[str, Any], trained: Any, tmp_path: Path) -> tuple[Path, str]:
    """Copy the trained job folder into tmp_path; return it and the job's URI."""
    shards, source, _ = trained
    out = tmp_path / "out"
    shutil.copytree(source, out)
    return out, write_job(_job(packed, shards, out), str(tmp_path / "job.json"))


def test_a_run_keeps_the_checkpoint_before_last_and_best_pt_is_whole(trained: Any) -> None:
    _, out, metrics = trained
    ckpts = out / "checkpoints"
    assert _position(str(ckpts / "last.pt")) == (3, 0)
    assert _position(str(ckpts / "prev.pt")) == (2, 0)
    best = load_checkpoint(str(ckpts / "best.pt"), RESUME_KEYS)
    assert best is not None
    assert int(best["epoch"]) == json.loads(best["best"])["epoch"] == metrics["best_epoch"]
    assert [p.name for p in ckpts.iterdir() if p.name.endswith(".tmp")] == []


def test_a_truncated_last_pt_resumes_from_prev_and_keeps_it(
    packed_demo: dict[str, Any], trained: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's run: the newest checkpoint is garbled, the one before it is fine."""
    out, job_uri = _copy(packed_demo, trained, tmp_path)
    ckpts = out / "checkpoints"
    _truncate(ckpts / "last.pt")
    # best.pt would be taken if it were further along than prev.pt: here prev.pt is the only one.
    (ckpts / "best.pt").unlink()
    with caplog.at_level(logging.INFO, logger=TRAIN_LOG):
        assert run_job(job_uri, attempt=2) == 0
    assert f"checkpoint skipped: {ckpts / 'last.pt'} (" in caplog.text
    assert f"attempt 2 resumed from {ckpts / 'prev.pt'} after epoch 2" in caplog.text
    # Epoch 3 trained again from epoch 2's end, to the same numbers as the unbroken run.
    epochs = json.loads((out / "metrics.json").read_text())["epochs"]
    unbroken = trained[2]["epochs"]
    assert [e["attempt"] for e in epochs] == [1, 1, 2]
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert epochs[2][key] == pytest.approx(unbroken[2][key], rel=1e-5), key
    # The garbled last.pt was not kept as prev.pt: the new last.pt replaced it.
    assert (_position(str(ckpts / "last.pt")), _position(str(ckpts / "prev.pt"))) == (
        (3, 0),
        (2, 0),
    )


def test_with_last_and_prev_unreadable_the_run_resumes_from_best_pt(
    packed_demo: dict[str, Any], trained: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out, job_uri = _copy(packed_demo, trained, tmp_path)
    ckpts = out / "checkpoints"
    unbroken = trained[2]
    # Make best.pt epoch 2's end (its checkpoint, prev.pt, with the best record), as a run whose
    # epoch 3 did not improve writes it, so that an epoch trains after the resume. This run's
    # best is epoch 2 or 3 (its accuracy ties, a tie is the later): the result stays the same.
    assert unbroken["best_epoch"] >= 2
    epoch_2 = unbroken["epochs"][1]
    record = {"epoch": 2, "val_accuracy": epoch_2["val_accuracy"], "val_loss": epoch_2["val_loss"]}
    second = load_checkpoint(str(ckpts / "prev.pt"), RESUME_KEYS)
    assert second is not None
    save_checkpoint(
        str(ckpts / "best.pt"), {**second, "best": json.dumps({**record, "improved_at": 2})}
    )
    _truncate(ckpts / "last.pt")
    _truncate(ckpts / "prev.pt")
    with caplog.at_level(logging.INFO, logger=TRAIN_LOG):
        assert run_job(job_uri, attempt=2) == 0
    for name in ("last.pt", "prev.pt"):
        assert f"checkpoint skipped: {ckpts / name} (" in caplog.text
    assert f"attempt 2 resumed from {ckpts / 'best.pt'} after epoch 2" in caplog.text
    # best.pt holds the whole state of its epoch's end: epoch 3 trains again from it (the
    # optimiser's and the schedule's state too), to the same result as the unbroken run.
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["attempt"] for e in metrics["epochs"]] == [1, 1, 2]
    assert metrics["best_epoch"] == unbroken["best_epoch"]
    assert metrics["val_accuracy"] == pytest.approx(unbroken["val_accuracy"], abs=1e-6)
    assert metrics["val_loss"] == pytest.approx(unbroken["val_loss"], rel=1e-5)
    assert metrics["confusion"] == unbroken["confusion"]


def test_a_partial_checkpoint_write_is_removed_when_the_next_attempt_starts(
    packed_demo: dict[str, Any], trained: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out, job_uri = _copy(packed_demo, trained, tmp_path)
    partial = out / "checkpoints" / ".last.pt.x1y2z3w4.tmp"
    partial.write_bytes((out / "checkpoints" / "last.pt").read_bytes()[:1000])
    with caplog.at_level(logging.INFO, logger=TRAIN_LOG):
        assert run_job(job_uri, attempt=2) == 0
    assert not partial.exists()
    assert f"removed {partial}, left by a checkpoint write that was cut short" in caplog.text
    assert f"attempt 2 resumed from {out / 'checkpoints' / 'last.pt'} after epoch 3" in caplog.text


def test_a_run_whose_only_checkpoint_is_torn_trains_its_epoch_over(
    packed_demo: dict[str, Any], trained: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Epoch 1's checkpoint, the only one, is torn: the run starts over instead of failing."""
    out, job_uri = _copy(packed_demo, trained, tmp_path)
    ckpts = out / "checkpoints"
    for name in ("prev.pt", "best.pt"):
        (ckpts / name).unlink()
    _truncate(ckpts / "last.pt")
    with caplog.at_level(logging.INFO, logger=TRAIN_LOG):
        assert run_job(job_uri, attempt=2) == 0
    assert "no checkpoint of the run loads: training starts over" in caplog.text
    metrics = json.loads((out / "metrics.json").read_text())
    # Every epoch trained by attempt 2, to the numbers of the unbroken run (same seed).
    assert [e["attempt"] for e in metrics["epochs"]] == [2, 2, 2]
    for got, want in zip(metrics["epochs"], trained[2]["epochs"], strict=True):
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    assert (out / "attempts" / "2" / "DONE").exists()
    assert (ckpts / "unreadable" / "last.pt").exists()


# ---------------------------------------------------------------------------------------------
# A real SIGKILL of a real process in the middle of its saves

SAVER = """
import sys, torch
from burstcv.training.checkpoint import save_checkpoint
last, prev = sys.argv[1], sys.argv[2]
state = {"model": {"w": torch.randn(12_000_000)}, "epoch": 0}  # 48 MB: a save takes a while
print("saving", flush=True)
while True:  # a trainer checkpointing as fast as it can
    state["epoch"] += 1
    save_checkpoint(last, state, keep_as=prev)
"""


def _kill_mid_save(uri: str, tmp: Path) -> bool:
    """Run a saver, SIGKILL it while its staged copy is being written; True if it was."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    prev = uri.replace("last.pt", "prev.pt")
    child = subprocess.Popen(
        [sys.executable, "-c", SAVER, uri, prev], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "saving\n"
        staged = staged_path(uri)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (staged.exists() and storage.exists(prev)):
            time.sleep(0.005)
        while time.monotonic() < deadline and not staged.exists():
            time.sleep(0.002)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    return staged.exists()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_save_killed_midway_leaves_nothing_in_the_temp_folder_and_is_cleared(
    where: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if where == "s3":
        request.getfixturevalue("s3")
        root = "s3://artifacts/runs/r/job"
    else:
        root = str(tmp_path / "job")
    last = storage.join(root, "checkpoints", "last.pt")
    tmp = tmp_path / "tmp"  # the temp folder, the saver's and this test's
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    for _ in range(5):  # a kill that fell between two saves is tried again
        if _kill_mid_save(last, tmp):
            break
    else:
        pytest.fail("no kill fell inside a save")
    staged = staged_path(last)
    if where == "local":
        # Staged beside its target, under a name that says what it is; the temp folder is empty.
        assert staged.parent == tmp_path / "job" / "checkpoints"
        assert staged.name == ".last.pt.staged" and list(tmp.iterdir()) == []
    # The checkpoints themselves are whole: the kill tore only the staged copy.
    for name in ("last.pt", "prev.pt"):
        ckpt = load_checkpoint(storage.join(root, "checkpoints", name))
        assert ckpt is not None and ckpt["model"]["w"].numel() == 12_000_000
    # The next save replaces it, and an attempt's start removes it.
    save_checkpoint(last, _state(9))
    assert not staged.exists() and _position(last) == (9, 0)
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.write_bytes(b"cut short")
    from burstcv.training.checkpoint import remove_leftovers

    with caplog.at_level(logging.WARNING, logger=TRAIN_LOG):
        remove_leftovers(root)
    assert not staged.exists() and list(tmp.iterdir()) == []
    assert f"removed {staged}, left by a checkpoint write that was cut short" in caplog.text


def test_progress_lists_only_the_epochs_a_checkpoint_holds(
    packed_demo: dict[str, Any], trained: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The box goes as epoch 2's checkpoint is written: the progress the orchestrator shows
    stops at epoch 1, the epoch the next attempt resumes after, not at one it trains again."""
    from burstcv.training import train

    shards, _, _ = trained
    out = tmp_path / "out"
    job_uri = write_job(_job(packed_demo, shards, out), str(tmp_path / "job.json"))
    real = train.save_checkpoint

    def dies_at_epoch_2(uri: str, state: dict[str, Any], **kwargs: Any) -> None:
        if uri.endswith("last.pt") and state["epoch"] == 2:
            raise OSError("No space left on device")
        real(uri, state, **kwargs)

    monkeypatch.setattr(train, "save_checkpoint", dies_at_epoch_2)
    with pytest.raises(OSError, match="No space left on device"):  # FAILED written, re-raised
        run_job(job_uri)
    progress = json.loads((out / "progress.json").read_text())
    assert [e["epoch"] for e in progress["epochs"]] == [1]
    assert _position(str(out / "checkpoints" / "last.pt")) == (1, 0)
