"""Validate and pack in chunks: the joined result is the one-pass result, file for file.

The DAG maps one ``scan`` and one ``pack_shards`` task per chunk; these tests run the same
pipeline functions in one process, chunk by chunk, and compare with a one-chunk run and with
the one-pass scan (``validate_dataset``) on the same data.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from burstcv.data import pack
from burstcv.data.chunks import MB, chunk_ranges
from burstcv.data.validate import validate_dataset
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv.stages import data as data_stage
from burstcv.stages import resolve
from burstcv_spec.contracts import PackPlan, RunRef, ScanPlan, ValidationRecord, read_artifact

# Fields that name where or when a record was written, not what it found.
WHERE_AND_WHEN = {"manifest_uri", "data_docs_uri", "validated_at"}


def test_chunk_ranges_keep_within_both_limits() -> None:
    sizes = [(1, 10)] * 10
    assert chunk_ranges(sizes, 4, 1000) == [(0, 4, 4, 40), (4, 8, 4, 40), (8, 10, 2, 20)]
    assert chunk_ranges(sizes, 100, 25) == [(i, i + 2, 2, 20) for i in range(0, 10, 2)]
    # An item over a limit alone is a chunk of its own; nothing is one empty chunk.
    assert chunk_ranges([(1, 5), (1, 500), (1, 5)], 10, 100) == [
        (0, 1, 1, 5),
        (1, 2, 1, 500),
        (2, 3, 1, 5),
    ]
    assert chunk_ranges([], 10, 10) == [(0, 0, 0, 0)]
    # A run fills up to a limit exactly; an item over a limit first is a run of its own.
    assert chunk_ranges([(1, 10)] * 4, 100, 20) == [(0, 2, 2, 20), (2, 4, 2, 20)]
    assert chunk_ranges([(1, 500), (1, 5)], 10, 100) == [(0, 1, 1, 500), (1, 2, 1, 5)]
    assert chunk_ranges([(1, 1)] * 2, 1, 1) == [(0, 1, 1, 1), (1, 2, 1, 1)]  # 1 is a limit
    with pytest.raises(ValueError, match=">= 1"):
        chunk_ranges(sizes, 0, 10)


def _faulty(kit: Any, root: Path) -> Path:
    """Return a 3-class dataset with a cross-split copy, a corrupt file, a stray and a dotfile."""
    kit.write_dataset(root)
    shutil.copy(root / "train" / "cat" / "000.png", root / "val" / "dog" / "zz-copy.png")
    (root / "train" / "fox" / "broken.png").write_bytes(b"not an image at all")
    (root / "train" / "stray.png").write_bytes((root / "train" / "dog" / "001.png").read_bytes())
    (root / "train" / "cat" / ".DS_Store").write_bytes(b"\0")
    return root


def _run(
    home: Path, dataset: Path, shard_format: str = "auto", **given: Any
) -> tuple[Settings, RunParams]:
    settings = Settings(
        home=str(home), artifact_root=str(home / "artifacts"), shard_format=shard_format
    )
    params = RunParams.resolve(
        {"dataset_uri": str(dataset), "pretrained": "none", **given}, settings
    )
    return settings, params


def _record(uri: str) -> dict[str, Any]:
    return read_artifact(uri, ValidationRecord).model_dump(mode="json", exclude=WHERE_AND_WHEN)


def test_a_chunked_validation_fails_as_the_one_pass_scan_does(tmp_path: Path, kit: Any) -> None:
    dataset = _faulty(kit, tmp_path / "pets")
    run = RunRef.of("manual__chunks")
    settings, params = _run(tmp_path / "chunked", dataset, chunk_files=7)
    with pytest.raises(resolve.ValidationFailed) as chunked:
        data_stage.validate(run, settings, params=params)
    paths = resolve.run_layout(run, settings)
    plan = read_artifact(paths.scan_plan, ScanPlan)
    # 62 files to inspect (the stray is refused unread, the dotfile ignored), 7 a chunk.
    assert plan.files == 62 and len(plan.chunks) == 9
    assert [c.index for c in plan.chunks] == list(range(9))
    assert all(Path(c.part_uri).is_file() for c in plan.chunks)
    # The bad files are named, whichever chunks they were in.
    for name in ("train/fox/broken.png", "val/dog/zz-copy.png", "train/stray.png"):
        assert name in str(chunked.value)

    # The same data scanned in one pass: the same manifest row for row, the same findings.
    one_pass = validate_dataset(
        str(dataset), str(tmp_path / "one-pass"), params.validation_config()
    )
    pd.testing.assert_frame_equal(
        pd.read_parquet(paths.manifest), pd.read_parquet(one_pass.manifest_uri)
    )
    assert _record(paths.validation) == _record(str(tmp_path / "one-pass" / "validation.json"))


@pytest.mark.parametrize("shard_format", ["raw", "jpeg"])
def test_chunked_scan_and_pack_equal_one_chunk_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_format: str, kit: Any
) -> None:
    monkeypatch.setattr(pack, "SHARD_IMAGES", 8)  # 36 training images: 5 shards
    dataset = kit.write_dataset(tmp_path / "pets", per_class=12)
    results = {}
    for name, limits in {"one": {}, "files": {"chunk_files": 20}}.items():
        settings, params = _run(tmp_path / name, dataset, shard_format, **limits)
        run = RunRef.of(f"manual__{name}")
        validated = data_stage.validate(run, settings, params=params)
        packed = data_stage.pack(run, validated, settings=settings)
        paths = resolve.run_layout(run, settings)
        results[name] = (paths, validated, packed)

    one_paths, one_validated, one_packed = results["one"]
    assert len(read_artifact(one_paths.scan_plan, ScanPlan).chunks) == 1
    assert len(read_artifact(one_paths.pack_plan, PackPlan).chunks) == 1
    plan = read_artifact(results["files"][0].pack_plan, PackPlan)
    assert len(read_artifact(results["files"][0].scan_plan, ScanPlan).chunks) == 4  # 72 / 20
    # Shards of 8, 8, 8, 8, 4 images per split, at most 20 images a chunk.
    assert [(c.start, c.stop) for c in plan.chunks] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    for name in ("files",):
        paths, validated, packed = results[name]
        assert validated.fingerprint == one_validated.fingerprint
        pd.testing.assert_frame_equal(
            pd.read_parquet(paths.manifest), pd.read_parquet(one_paths.manifest)
        )
        assert _record(paths.validation) == _record(one_paths.validation)
        # The same shards, in the same order, byte for byte, and the same statistics.
        assert packed.counts == one_packed.counts and packed.classes == one_packed.classes
        assert packed.shard_format == one_packed.shard_format == shard_format
        assert packed.preprocess == one_packed.preprocess
        for mine, theirs in zip(
            packed.train_shards + packed.val_shards,
            one_packed.train_shards + one_packed.val_shards,
            strict=True,
        ):
            assert Path(mine).name == Path(theirs).name
            assert Path(mine).read_bytes() == Path(theirs).read_bytes()
    assert plan.shards == len(one_packed.train_shards) + len(one_packed.val_shards)


def test_a_chunk_that_did_not_run_is_named_and_a_rerun_chunk_joins(
    tmp_path: Path, kit: Any
) -> None:
    dataset = kit.write_dataset(tmp_path / "pets")
    settings, params = _run(tmp_path / "home", dataset, chunk_files=25)
    run = RunRef.of("manual__retry")
    plan = data_stage.plan_scan(run, params, settings)
    assert [c.files for c in plan.chunks] == [25, 25, 10]
    assert plan.bytes == sum(p.stat().st_size for p in dataset.rglob("*.png"))
    assert plan.chunks[0].bytes + plan.chunks[1].bytes + plan.chunks[2].bytes == plan.bytes
    for chunk in (plan.chunks[0], plan.chunks[2]):
        data_stage.scan_chunk(run, chunk, settings)
    with pytest.raises(FileNotFoundError, match="scan chunk 1: no manifest part"):
        data_stage.validate(run, settings)
    # A retried chunk rewrites its own part only: twice is the same as once.
    for _ in range(2):
        assert data_stage.scan_chunk(run, plan.chunks[1], settings) == 25
    validated = data_stage.validate(run, settings)
    assert read_artifact(validated.validation_uri, ValidationRecord).counts.usable == 60


def test_the_mb_limit_cuts_large_files_into_more_chunks(tmp_path: Path, kit: Any) -> None:
    dataset = kit.write_dataset(tmp_path / "pets", per_class=6)
    big = dataset / "train" / "cat" / "zz-big.png"
    big.write_bytes((dataset / "train" / "cat" / "000.png").read_bytes() + b"\0" * (2 * MB))
    settings, params = _run(tmp_path / "home", dataset, chunk_mb=1)
    plan = data_stage.plan_scan(RunRef.of("manual__mb"), params, settings)
    # The files listed before the big one, the big one alone, the rest.
    assert [c.files for c in plan.chunks] == [6, 1, 30]
    assert plan.chunks[1].bytes > 2 * MB and plan.chunks[0].bytes + plan.chunks[2].bytes < MB


def test_a_plan_never_maps_more_chunks_than_airflow_allows() -> None:
    from burstcv.data.chunks import chunk_cap, ranges_within

    sizes = [(1, 10)] * 100
    runs, files, size = ranges_within(sizes, 1, 1000, None)  # no cap: one file a chunk
    assert len(runs) == 100 and (files, size) == (1, 1000)
    runs, files, size = ranges_within(sizes, 1, 1000, 9)
    assert len(runs) <= 9 and files > 1  # grown until it fits, both limits alike
    assert sum(r[2] for r in runs) == 100 and runs[0][0] == 0 and runs[-1][1] == 100
    assert all(r[2] <= files and r[3] <= size for r in runs)
    assert ranges_within(sizes, 1, 1000, 1)[0] == [(0, 100, 100, 1000)]
    with pytest.raises(ValueError, match="at least one chunk"):
        ranges_within(sizes, 1, 1000, 0)
    # Airflow's default map limit (1,024) with its 10% margin.
    assert chunk_cap(1024) == 921 and chunk_cap(1) == 1


def test_chunks_past_the_map_limit_are_grown_and_each_reads_its_own_listing(
    tmp_path: Path, kit: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dataset = kit.write_dataset(tmp_path / "pets")  # 60 files
    settings, params = _run(tmp_path / "home", dataset, chunk_files=2)  # 30 chunks asked
    monkeypatch.setenv("AIRFLOW__CORE__MAX_MAP_LENGTH", "5")  # a deployment's lower limit
    assert data_stage.map_limit() == 5
    run = RunRef.of("manual__maplimit")
    with caplog.at_level("WARNING", logger="burstcv.data.chunks"):
        plan = data_stage.plan_scan(run, params, settings)
    assert len(plan.chunks) <= 4  # 90% of 5
    assert sum(c.files for c in plan.chunks) == 60
    assert "more chunks than the 4 mapped tasks allowed" in caplog.text
    # Each chunk reads its own rows: the whole listing is not needed to scan.
    for chunk in plan.chunks:
        assert chunk.listing_uri and Path(chunk.listing_uri).is_file()
    Path(plan.listing_uri).unlink()
    for chunk in plan.chunks:
        assert data_stage.scan_chunk(run, chunk, settings) == chunk.files
    validated = data_stage.validate(run, settings)
    assert read_artifact(validated.validation_uri, ValidationRecord).counts.usable == 60


def test_a_plan_from_before_chunk_slices_still_scans_and_packs(tmp_path: Path, kit: Any) -> None:
    dataset = kit.write_dataset(tmp_path / "pets")
    settings, params = _run(tmp_path / "home", dataset, chunk_files=25)
    run = RunRef.of("manual__oldplan")
    plan = data_stage.plan_scan(run, params, settings)
    old = plan.chunks[1].model_copy(update={"listing_uri": None})
    assert "listing_uri" not in old.model_dump(mode="json")
    assert data_stage.scan_chunk(run, old, settings) == 25
    for chunk in (plan.chunks[0], plan.chunks[2]):
        data_stage.scan_chunk(run, chunk, settings)
    validated = data_stage.validate(run, settings)
    # A pack chunk without its rows (a plan from before them) orders the whole manifest.
    pack_plan = data_stage.plan_pack(run, validated, settings)
    sliced = data_stage.pack_chunk(run, validated, pack_plan.chunks[0], settings)
    whole = data_stage.pack_chunk(
        run, validated, pack_plan.chunks[0].model_copy(update={"listing_uri": None}), settings
    )
    assert sliced == whole


def test_each_pack_chunk_reads_its_own_shards_rows_not_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kit: Any
) -> None:
    monkeypatch.setattr(pack, "SHARD_IMAGES", 8)
    dataset = kit.write_dataset(tmp_path / "pets", per_class=12)  # 36 training, 36 validation
    settings, params = _run(tmp_path / "home", dataset, "raw", chunk_files=20)
    run = RunRef.of("manual__rows")
    validated = data_stage.validate(run, settings, params=params)
    plan = data_stage.plan_pack(run, validated, settings)
    assert len(plan.chunks) == 4
    rows = [pack.read_shard_rows(Path(c.listing_uri).read_bytes()) for c in plan.chunks]
    # Every shard once, in order, each image once: 5 training shards, then 5 validation.
    assert [s.number for chunk in rows for s in chunk] == list(range(10))
    assert [(s.split, s.local) for s in rows[1]] == [("train", 2), ("train", 3), ("train", 4)]
    assert sum(len(s.uris) for chunk in rows for s in chunk) == 72
    assert all(len(s.uris) == len(s.labels) for chunk in rows for s in chunk)

    def no_manifest(*_: Any, **__: Any) -> Any:
        raise AssertionError("a pack chunk read the whole manifest")

    monkeypatch.setattr(data_stage, "read_manifest", no_manifest)
    for chunk in plan.chunks:
        part = data_stage.pack_chunk(run, validated, chunk, settings)
        assert part.index == chunk.index
    packed = data_stage.pack(run, validated, settings=settings, packed_chunks=True)
    assert packed.counts == {"train": 36, "val": 36}
    assert len(packed.train_shards) == len(packed.val_shards) == 5


def test_an_empty_split_s_shard_travels_in_a_chunk_s_rows() -> None:
    shards = [
        pack.Shard(0, "train", 0, ["a.png", "b.png"], np.array([1, 0])),
        pack.Shard(1, "val", 0, [], np.zeros(0, np.int64)),
    ]
    back = pack.read_shard_rows(pack.shard_rows(shards))
    assert [(s.number, s.split, s.local, s.uris) for s in back] == [
        (0, "train", 0, ["a.png", "b.png"]),
        (1, "val", 0, []),
    ]
    assert back[0].labels.tolist() == [1, 0] and back[1].labels.dtype == np.int64


def test_a_scan_chunks_pool_takes_its_task_slots_share_of_the_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from burstcv.data.scanner.dispatch import POOL_MIN_FILES, worker_count

    monkeypatch.setattr("burstcv.data.scanner.dispatch.usable_cpus", lambda: 16)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    monkeypatch.setenv("AIRFLOW__CELERY__WORKER_CONCURRENCY", "4")
    assert data_stage.worker_task_slots() == 4
    assert data_stage.task_processes(Settings()) == 4  # 16 CPUs over 4 slots
    assert data_stage.task_processes(Settings(task_processes=3)) == 3  # the setting wins
    monkeypatch.setenv("AIRFLOW__CELERY__WORKER_CONCURRENCY", "64")
    assert data_stage.task_processes(Settings()) == 1  # never fewer than one
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    assert data_stage.worker_task_slots() == 1
    assert data_stage.task_processes(Settings()) == 16
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    monkeypatch.setenv("AIRFLOW__CELERY__WORKER_CONCURRENCY", "0")
    assert data_stage.worker_task_slots() == 1  # a worker has at least its own slot
    # No readable Airflow configuration: one slot, and Airflow's default map limit.
    import airflow.configuration

    def unreadable(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no airflow.cfg here")

    monkeypatch.setattr(airflow.configuration.conf, "get", unreadable)
    monkeypatch.setattr(airflow.configuration.conf, "getint", unreadable)
    assert data_stage.worker_task_slots() == 1 and data_stage.map_limit() == 1024
    # The pool: one process below the size a pool pays for, then the CPUs up to the cap.
    assert worker_count(None, POOL_MIN_FILES, cap=1) == 1
    assert worker_count(1, 10) == 1
    assert worker_count(None, POOL_MIN_FILES - 1, cap=4) == 1
    assert worker_count(None, POOL_MIN_FILES, cap=4) == 4
    assert worker_count(None, POOL_MIN_FILES, cap=None) == 16
    assert worker_count(None, POOL_MIN_FILES, cap=64) == 16
    assert worker_count(2, 10, cap=1) == 2  # an explicit request (scan --workers) stands
