"""Streamed training data: a reproducible order, bounded memory, the same errors and accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from burstcv_testkit import make_job, run_ddp_job
from localserver import moto_server, use_moto
from PIL import Image

from burstcv.data import pack
from burstcv.data.demo import pack_demo
from burstcv.training.job import write_job
from burstcv.training.stream import (
    SHARD_CACHE_ENV,
    JobSpecError,
    ShardCache,
    ShardStream,
    epoch_windows,
    load_shard,
    node_shards,
    read_shard_info,
)
from burstcv.training.train import (
    Dist,
    Share,
    Split,
    _train_batches,
    load_shards,
    open_splits,
    run_job,
    share_shards,
    split_batches,
)
from burstcv_spec import storage
from burstcv_spec.preprocess import PreprocessSpec

CLASSES = ["a", "b", "c"]
CPU = torch.device("cpu")


def write_shard(path: Path, images: np.ndarray, labels: np.ndarray, classes: list[str]) -> str:
    """Write one shard in pack_dataset's format (uncompressed .npz of three arrays)."""
    np.savez(path, images=images, labels=labels, classes=np.array(classes))
    return str(path)


def numbered_shards(root: Path, counts: list[int], px: int = 4) -> list[str]:
    """Write shards whose every image holds its own global number (pixel 0: low, 1: high byte)."""
    uris, start = [], 0
    for no, count in enumerate(counts):
        ids = np.arange(start, start + count)
        images = np.zeros((count, px, px, 3), np.uint8)
        images[:, 0, 0, 0], images[:, 0, 1, 0] = ids % 256, ids // 256
        uris.append(write_shard(root / f"train-{no:05d}.npz", images, ids % 3, CLASSES))
        start += count
    return uris


def ids_of(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    x, y = batch  # NCHW on the device
    ids = (x[:, 0, 0, 0].long() + 256 * x[:, 0, 0, 1].long()).tolist()
    assert (torch.tensor(ids) % 3).tolist() == y.tolist(), "labels travel with their images"
    return ids


def open_stream(
    uris: list[str], classes: list[str], device: torch.device, **kw: Any
) -> ShardStream:
    """Return the stream over ``uris``, each shard's headers read and validated first."""
    return ShardStream([read_shard_info(uri, classes) for uri in uris], classes, device, **kw)


def epoch_ids(stream: ShardStream, seed: int, epoch: int, **kw: Any) -> list[list[int]]:
    return [ids_of(b) for b in stream.train_batches(seed=seed, epoch=epoch, batch_size=16, **kw)]


@pytest.fixture
def stream(tmp_path: Path) -> ShardStream:
    """Return a stream over 7 shards of uneven sizes (251 images), a 2-shard window."""
    uris = numbered_shards(tmp_path, [40, 40, 40, 40, 40, 40, 11])
    stream = open_stream(uris, CLASSES, CPU, budget_bytes=3 * 40 * (4 * 4 * 3 + 8))
    assert (stream.mix, stream.prefetch, len(stream)) == (2, 1, 251)
    return stream


def test_an_epoch_is_a_shuffle_fixed_by_seed_and_epoch(stream: ShardStream) -> None:
    first = epoch_ids(stream, seed=0, epoch=0)
    assert first == epoch_ids(stream, seed=0, epoch=0)  # reproducible
    assert len(first) == 251 // 16 and all(len(b) == 16 for b in first)  # full batches only
    flat = [i for b in first for i in b]
    assert len(set(flat)) == len(flat) and set(flat) <= set(range(251))  # each image at most once
    assert flat != sorted(flat)
    assert first != epoch_ids(stream, seed=0, epoch=1)
    assert first != epoch_ids(stream, seed=1, epoch=0)
    # Shards come in a new order each epoch, and a batch mixes the two shards of its window.
    orders = {
        tuple(w for window in epoch_windows(stream.counts, 0, e, 2) for w in window)
        for e in range(6)
    }
    assert len(orders) > 1
    assert len({i // 40 for i in first[0]}) == 2


def test_a_resumed_epoch_continues_the_same_stream(stream: ShardStream) -> None:
    full = epoch_ids(stream, seed=3, epoch=2)
    for start in (1, 5, 6, 14):  # inside a window, at a batch across windows, the last step
        assert epoch_ids(stream, seed=3, epoch=2, start_step=start) == full[start:]
    assert epoch_ids(stream, seed=3, epoch=2, start_step=len(full)) == []


def test_ranks_share_each_global_batch(stream: ShardStream) -> None:
    full = epoch_ids(stream, seed=0, epoch=0)
    ranks = [epoch_ids(stream, seed=0, epoch=0, rank=r, world_size=2) for r in (0, 1)]
    for step, batch in enumerate(full):
        assert ranks[0][step] == batch[0::2] and ranks[1][step] == batch[1::2]


def test_evaluation_reads_every_image_once_in_file_order(stream: ShardStream) -> None:
    ids = [i for b in stream.eval_batches(batch_size=32) for i in ids_of(b)]
    assert ids == list(range(251))


def test_a_split_smaller_than_a_batch_is_one_step(tmp_path: Path) -> None:
    small = open_stream(numbered_shards(tmp_path, [5, 4]), CLASSES, CPU, budget_bytes=1)
    assert (small.mix, small.prefetch) == (1, 0)  # no room: one shard at a time
    batches = [ids_of(b) for b in small.train_batches(seed=0, epoch=0, batch_size=16)]
    assert len(batches) == 1 and sorted(batches[0]) == list(range(9))


def test_memory_budget_picks_whole_or_streamed(packed_demo: dict[str, Any], tmp_path: Path) -> None:
    whole = open_splits(make_job(packed_demo, tmp_path), CPU)[:2]
    assert all(isinstance(s, Split) for s in whole)
    streamed = open_splits(make_job(packed_demo, tmp_path, data_memory_budget_mb=1), CPU)[:2]
    assert all(isinstance(s, ShardStream) for s in streamed)
    assert [len(s) for s in streamed] == [len(s) for s in whole]


# ---------------------------------------------------------------------------------------------
# Bad shards: the errors of the in-memory path, from the headers, before any training


def _bad(tmp_path: Path, **arrays: Any) -> str:
    good: dict[str, Any] = {
        "images": np.zeros((4, 4, 4, 3), np.uint8),
        "labels": np.zeros(4, np.int64),
        "classes": np.array(CLASSES),
    }
    good.update(arrays)
    path = tmp_path / "bad.npz"
    np.savez(path, **{k: v for k, v in good.items() if v is not None})
    return str(path)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"classes": np.array(["a", "b", "x"])}, r"was packed for classes \['a', 'b', 'x'\]"),
        (
            {"images": np.zeros((4, 4, 4, 3), np.float32)},
            r"holds float32 \(4, 4, 4, 3\), not uint8",
        ),
        ({"images": np.zeros((4, 4, 4), np.uint8)}, r"holds uint8 \(4, 4, 4\), not uint8"),
        ({"labels": np.array([0, 1, 2, 3])}, r"has labels outside 0\.\.2"),
        ({"labels": np.array([0, -1, 0, 0])}, r"has labels outside 0\.\.2"),
        ({"labels": np.zeros(3, np.int64)}, r"has labels outside 0\.\.2"),
        ({"labels": None}, r"has no 'labels' array"),
    ],
)
def test_bad_shards_fail_with_the_shard_named(
    tmp_path: Path, arrays: dict[str, Any], message: str
) -> None:
    uri = _bad(tmp_path, **arrays)
    for read in (read_shard_info, load_shard):
        with pytest.raises(JobSpecError, match=message) as err:
            read(uri, CLASSES)
        assert uri in str(err.value)


def test_missing_or_foreign_shards_fail_with_the_shard_named(tmp_path: Path) -> None:
    for read in (read_shard_info, load_shard):
        with pytest.raises(JobSpecError, match=r"missing shard .*nope\.npz"):
            read(str(tmp_path / "nope.npz"), CLASSES)
    (tmp_path / "text.npz").write_text("not a zip")
    for read in (read_shard_info, load_shard):
        with pytest.raises(JobSpecError, match=r"text.npz is not an .npz file"):
            read(str(tmp_path / "text.npz"), CLASSES)


def test_a_bad_shard_fails_a_streamed_job_before_training(
    packed_demo: dict[str, Any], tmp_path: Path
) -> None:
    bad = _bad(tmp_path, labels=np.array([0, 1, 2, 99]), classes=np.array(packed_demo["classes"]))
    job = make_job(
        packed_demo,
        tmp_path / "out",
        train_shards=[*packed_demo["train_shards"], bad],
        data_memory_budget_mb=1,
    )
    with pytest.raises(JobSpecError):
        run_job(write_job(job, str(tmp_path / "job.json")))
    failed = json.loads((tmp_path / "out" / "attempts" / "1" / "FAILED").read_text())
    assert f"shard {bad} has labels outside 0..9" in failed["reason"]
    assert not (tmp_path / "out" / "checkpoints" / "last.pt").exists()


def test_s3_shards_are_sized_from_their_headers_and_streamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = numbered_shards(tmp_path, [30, 25])
    with moto_server() as url:
        use_moto(url, monkeypatch)
        storage.s3_client().create_bucket(Bucket="shards")
        uris = [
            storage.write_bytes(f"s3://shards/d/{Path(p).name}", Path(p).read_bytes())
            for p in local
        ]
        infos = [read_shard_info(u, CLASSES) for u in uris]
        assert [(i.count, i.height, i.width) for i in infos] == [(30, 4, 4), (25, 4, 4)]
        remote = ShardStream(infos, CLASSES, CPU, budget_bytes=1 << 20)
        assert [i for b in remote.eval_batches(16) for i in ids_of(b)] == list(range(55))
        with pytest.raises(JobSpecError, match=r"missing shard s3://shards/d/none\.npz"):
            read_shard_info("s3://shards/d/none.npz", CLASSES)
        with pytest.raises(JobSpecError, match=r"missing shard s3://shards/d/none\.npz"):
            load_shard("s3://shards/d/none.npz", CLASSES)


def test_a_shard_cache_downloads_each_s3_shard_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epochs after the first read the box's own copy; a full disk falls back to per-epoch."""
    local = numbered_shards(tmp_path, [40, 40, 40, 11])
    downloads: list[str] = []
    real_download = storage.download_file

    def counted(uri: str, path: str | Path) -> Path:
        downloads.append(uri)
        return real_download(uri, path)

    with moto_server() as url:
        use_moto(url, monkeypatch)
        monkeypatch.setattr(storage, "download_file", counted)
        storage.s3_client().create_bucket(Bucket="shards")
        uris = [
            storage.write_bytes(f"s3://shards/d/{Path(p).name}", Path(p).read_bytes())
            for p in local
        ]
        infos = [read_shard_info(u, CLASSES) for u in uris]
        budget = 3 * 40 * (4 * 4 * 3 + 8)
        plain = ShardStream(infos, CLASSES, CPU, budget_bytes=budget)
        expected = [epoch_ids(plain, seed=3, epoch=e) for e in range(3)]
        assert len(downloads) == 3 * len(uris)  # no cache: every epoch downloads every shard

        downloads.clear()
        cache = ShardCache(tmp_path / "cache")
        cached = ShardStream(infos, CLASSES, CPU, budget_bytes=budget, cache=cache)
        assert [epoch_ids(cached, seed=3, epoch=e) for e in range(3)] == expected
        assert sorted(downloads) == sorted(uris)
        assert (cache.downloads, cache.hits) == (len(uris), 2 * len(uris))
        assert sorted(p.name for p in cache.root.iterdir()) == sorted(
            cache.path(u).name for u in uris
        )
        cache.clear()
        assert not cache.root.exists()

        # A disk without room beyond the reserve: nothing is kept, each epoch downloads again,
        # into a temporary file under the cache folder that goes at once.
        downloads.clear()
        full = ShardCache(tmp_path / "full", reserve_bytes=1 << 60)
        crowded = ShardStream(infos, CLASSES, CPU, budget_bytes=budget, cache=full)
        assert [epoch_ids(crowded, seed=3, epoch=e) for e in range(2)] == expected[:2]
        assert len(downloads) == 2 * len(uris) and full.full and full.downloads == 0
        assert list(full.root.iterdir()) == []

        with pytest.raises(JobSpecError, match=r"missing shard s3://shards/d/none\.npz"):
            load_shard("s3://shards/d/none.npz", CLASSES, ShardCache(tmp_path / "c2"))


def test_the_shard_cache_is_per_run_under_the_box_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SHARD_CACHE_ENV, raising=False)
    assert ShardCache.from_env("r1") is None  # off the box: no cache, local shards read in place
    monkeypatch.setenv(SHARD_CACHE_ENV, str(tmp_path / "box"))
    cache = ShardCache.from_env("r1")
    assert cache is not None and cache.root == tmp_path / "box" / "r1" and cache.root.is_dir()


# ---------------------------------------------------------------------------------------------
# Training on streamed shards


@pytest.fixture(scope="module")
def small_shards(demo_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Return the demo digits packed 200 images a shard (8 train, 2 val shards)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pack, "SHARD_IMAGES", 200)
        result, spec = pack_demo(demo_dataset, str(tmp_path_factory.mktemp("small-shards")))
    assert len(result.train_shards) == 8 and len(result.val_shards) == 2
    for uri in result.train_shards:  # pack deals the label-sorted rows out: every class a shard
        assert set(load_shard(uri, result.classes)[1].tolist()) == set(range(10))
    return {
        "classes": result.classes,
        "train_shards": result.train_shards,
        "val_shards": result.val_shards,
        "spec": spec,
    }


def test_streamed_training_reaches_the_accuracy_of_the_in_memory_path(
    small_shards: dict[str, Any], trained_demo: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    job = make_job(small_shards, out, data_memory_budget_mb=1)  # 4.4 MB of train images
    assert run_job(write_job(job, str(tmp_path / "job.json"))) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    unbroken = trained_demo["metrics"]
    assert metrics["val_accuracy"] >= 0.90
    assert abs(metrics["val_accuracy"] - unbroken["val_accuracy"]) <= 0.05
    assert (metrics["train_images"], metrics["val_images"]) == (
        unbroken["train_images"],
        unbroken["val_images"],
    )
    assert len(metrics["epochs"]) == 3 and (out / "attempts" / "1" / "DONE").exists()


def test_two_ddp_ranks_train_on_streamed_shards(
    small_shards: dict[str, Any], trained_demo: dict[str, Any], tmp_path: Path
) -> None:
    """torchrun with 2 gloo ranks, both streaming: each its share of every global batch."""
    out = tmp_path / "out"
    job_uri = write_job(make_job(small_shards, out, data_memory_budget_mb=1), str(tmp_path / "j"))
    result = run_ddp_job(job_uri)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "streaming train shards" in result.stdout + result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["train_images"] == trained_demo["metrics"]["train_images"]
    assert metrics["val_accuracy"] >= 0.90
    assert abs(metrics["val_accuracy"] - trained_demo["metrics"]["val_accuracy"]) <= 0.05
    assert (out / "attempts" / "1" / "DONE").exists()


# ---------------------------------------------------------------------------------------------
# Peak memory: a dataset several times the budget, trained in a child process

PEAK_RSS = textwrap.dedent(
    """
    import json, logging, resource, sys
    logging.basicConfig(level=logging.INFO)
    from burstcv.training.job import load_job
    from burstcv.training.train import main
    metrics = main(load_job(sys.argv[1]))
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": peak_kb / 1024, "train_images": metrics.train_images}))
    """
)

MEMORY_PX = 128  # 48 KiB an image: data bytes grow faster than CPU training time
MEMORY_BUDGET_MB = 24
MEMORY_SHARD_IMAGES = 64  # 3 MB shards: the stream holds 3 of them
MEMORY_TRAIN_IMAGES = 2000  # 94 MB, with 18 MB of validation images: > 4x the budget
MEMORY_VAL_IMAGES = 384


def _photo_like(rng: np.random.Generator, label: int) -> np.ndarray:
    # Smooth gradients and a class-coloured block: compresses and trains like a photo, not noise.
    y, x = np.mgrid[0:MEMORY_PX, 0:MEMORY_PX]
    base = (x * rng.uniform(0.5, 2) + y * rng.uniform(0.5, 2)) % 256
    img = np.stack([base, base[::-1], base[:, ::-1]], axis=-1)
    r, c = rng.integers(0, MEMORY_PX // 2, 2)
    img[r : r + 32, c : c + 32, label % 3] = 255
    return img.astype(np.uint8)


def pack_photos(root: Path, train: int, val: int) -> dict[str, Any]:
    """Pack ``train`` + ``val`` images of 4 classes (48 distinct PNGs, each used many times)."""
    rng = np.random.default_rng(0)
    (root / "photos").mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(48):
        path = root / "photos" / f"{i}.png"
        Image.fromarray(_photo_like(rng, i)).save(path)
        files.append((str(path), str(i % 4)))
    spec = PreprocessSpec(height=MEMORY_PX, width=MEMORY_PX, mean=(0.5,) * 3, std=(0.25,) * 3)
    manifest = pd.DataFrame(
        [
            {
                "path": f"{split}/{n}.png",
                "uri": files[n % 48][0],
                "split": split,
                "label": files[n % 48][1],
                "decode_ok": True,
            }
            for split, count in (("train", train), ("val", val))
            for n in range(count)
        ]
    )
    result = pack.pack_dataset(manifest, str(root / "shards"), spec, workers=2)
    return {
        "classes": result.classes,
        "train_shards": result.train_shards,
        "val_shards": result.val_shards,
        "spec": spec,
    }


def memory_job(packed: dict[str, Any], out: Path) -> Any:
    """Return a one-epoch job over photo shards, small batches, under MEMORY_BUDGET_MB."""
    return make_job(
        packed,
        out,
        arch="mobilenet_v3_small",
        epochs=1,
        batch_size=32,
        data_memory_budget_mb=MEMORY_BUDGET_MB,
        augment={"crop_padding_px": 0},
    )


def peak_rss_mb(job_uri: str) -> dict[str, Any]:
    """Run the job in a child process; return its peak RSS (MB), image count and log."""
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, job_uri],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["log"] = proc.stderr
    return result


def test_streaming_keeps_peak_memory_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """112 MB of images under a 24 MB budget: the child's peak RSS grows by less than 24 MB.

    The baseline is the same job over two batches and one shard of validation images: torch,
    the model, the optimiser and the activations of a training and an evaluation batch (as big
    as a streamed one), everything but the data. The growth is the 3 shards the stream
    holds (9 MB), its batch buffers and the allocator's slack; loading the data whole would
    take over 112 MB.
    """
    monkeypatch.setattr(pack, "SHARD_IMAGES", MEMORY_SHARD_IMAGES)
    baseline_job = memory_job(pack_photos(tmp_path / "two-batches", 64, 64), tmp_path / "base")
    big_job = memory_job(
        pack_photos(tmp_path / "big", MEMORY_TRAIN_IMAGES, MEMORY_VAL_IMAGES), tmp_path / "big"
    )
    shards = big_job.train_shards + big_job.val_shards
    data_mb = sum(Path(u).stat().st_size for u in shards) / 2**20
    assert data_mb > 4 * MEMORY_BUDGET_MB  # loading it whole could not fit

    baseline = peak_rss_mb(write_job(baseline_job, str(tmp_path / "base.json")))
    streamed = peak_rss_mb(write_job(big_job, str(tmp_path / "big.json")))
    assert streamed["train_images"] == MEMORY_TRAIN_IMAGES
    assert "streaming train shards" in streamed["log"] and "validation streamed" in streamed["log"]
    growth = streamed["peak_mb"] - baseline["peak_mb"]
    assert growth < MEMORY_BUDGET_MB, (
        f"peak RSS {streamed['peak_mb']:.0f} MB, baseline {baseline['peak_mb']:.0f} MB, "
        f"data {data_mb:.0f} MB"
    )


# --- several boxes: each reads its own shards --------------------------------------------------


def test_shards_are_dealt_to_boxes_evenly_and_the_same_way_every_time() -> None:
    counts = [40, 40, 40, 40, 40, 40, 11]
    deal = node_shards(counts, 2)
    assert deal == node_shards(counts, 2)  # no seed, no epoch: a relaunch reads the same
    assert sorted(i for part in deal for i in part) == list(range(7))  # disjoint, all dealt
    held = [sum(counts[i] for i in part) for part in deal]
    assert max(held) - min(held) <= max(counts)
    assert node_shards([96] * 4, 2) == [[0, 2], [1, 3]]
    assert [len(p) for p in node_shards([10] * 5, 5)] == [1] * 5
    with pytest.raises(ValueError, match="cannot deal 2 shard"):
        node_shards([10, 10], 3)


def box_ranks(uris: list[str], nodes: int, per_box: int) -> list[tuple[ShardStream, Share]]:
    """Return every rank's stream over its box's shards and its share, rank by rank."""
    counts = [read_shard_info(uri, CLASSES).count for uri in uris]
    world = nodes * per_box
    ranks = []
    for rank in range(world):
        d = Dist(rank, world, rank % per_box, node=rank // per_box, nodes=nodes)
        share, mine = share_shards(counts, 16, d)
        stream = open_stream([uris[i] for i in mine], CLASSES, CPU, budget_bytes=10**6)
        ranks.append((stream, share))
    return ranks


def rank_ids(stream: ShardStream, share: Share, epoch: int, start: int = 0) -> list[list[int]]:
    """Return a rank's batches of an epoch from ``start``, as the training loop asks for them."""
    return [ids_of(b) for b in _train_batches(stream, 5, epoch, start, share)]


def test_boxes_train_on_their_own_shards_in_the_same_number_of_steps(tmp_path: Path) -> None:
    uris = numbered_shards(tmp_path, [40, 40, 40, 40, 40, 40, 11])
    ranks = box_ranks(uris, nodes=2, per_box=2)
    shares = [share for _, share in ranks]
    # A batch of 16 is 4 a rank, 8 a box. One box holds 131 images, the other 120: the
    # smaller decides, 120 // 8 = 15 steps for all.
    assert {s.steps for s in shares} == {15} and {s.images for s in shares} == {251}
    assert [(s.rank, s.world_size, s.batch_size) for s in shares] == [(0, 2, 8), (1, 2, 8)] * 2
    for epoch in (0, 1):
        seen = [rank_ids(stream, share, epoch) for stream, share in ranks]
        assert all(len(steps) == 15 for steps in seen)  # no rank waits on a collective alone
        assert all(len(batch) == 4 for steps in seen for batch in steps)
        flat = [i for steps in seen for batch in steps for i in batch]
        assert len(set(flat)) == len(flat)  # no image twice in an epoch, across every rank
        for box in (0, 1):  # a box's ranks read only the shards dealt to it
            mine = {
                i
                for shard in node_shards([40] * 6 + [11], 2)[box]
                for i in range(40 * shard, 40 * shard + (40 if shard < 6 else 11))
            }
            assert {i for steps in seen[2 * box : 2 * box + 2] for b in steps for i in b} <= mine
    # A relaunch resumes every rank's stream where it stopped.
    for stream, share in ranks:
        full = rank_ids(stream, share, 1)
        assert rank_ids(stream, share, 1, start=4) == full[4:]


def test_the_whole_split_path_takes_the_same_share(tmp_path: Path) -> None:
    uris = numbered_shards(tmp_path, [40, 40, 40, 40])
    counts = [40] * 4
    for rank in range(2):
        share, mine = share_shards(counts, 16, Dist(rank, 2, 0, node=rank, nodes=2))
        images, labels = load_shards([uris[i] for i in mine], CLASSES)
        split = Split(torch.from_numpy(images).permute(0, 3, 1, 2), torch.from_numpy(labels))
        batches = [ids_of(b) for b in split_batches(split, 0, 0, 0, share)]
        assert len(batches) == share.steps == 80 // 8 and {len(b) for b in batches} == {8}
        assert {i // 40 for b in batches for i in b} == set(mine)


def test_fewer_shards_than_boxes_means_every_box_reads_every_shard(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="burstcv.training.train"):
        share, mine = share_shards([40], 16, Dist(1, 2, 0, node=1, nodes=2))
    assert mine == [0] and (share.rank, share.world_size, share.batch_size) == (1, 2, 16)
    assert share.steps == 40 // 16
    assert "1 training shard(s) for 2 boxes: every box reads every shard" in caplog.text
