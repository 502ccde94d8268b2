"""The typed contracts between stages: round trips, one-line errors, schema versions, the doc."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from burstcv_testkit import g6_box_rate, gate_decision, model_card
from pydantic import ValidationError

from burstcv.params import ResolvedRun, RunParams
from burstcv_spec import contracts_doc
from burstcv_spec.contracts import (
    ARTIFACTS,
    SCHEMA_VERSION,
    STAGE_RESULTS,
    AliasRecord,
    ArtifactError,
    AttemptBill,
    AttemptRecord,
    BenchFigures,
    Benchmarked,
    Billing,
    BootTimes,
    BoxBill,
    BoxSizing,
    CalibrationRecord,
    Contract,
    DataChunk,
    DatasetCounts,
    DatasetProfile,
    Deployed,
    DoneMarker,
    DriftBlock,
    EpochRecord,
    ExpectationResult,
    Exported,
    FailedMarker,
    FleetOption,
    GateVerdict,
    HistoryEvent,
    HostInfo,
    HostLoad,
    ImageSizeChoice,
    InstanceRecord,
    LatencyRecord,
    Launch,
    LocalProcessRecord,
    ModelCard,
    OptimizerBlock,
    Packed,
    PackedPart,
    PackPlan,
    PreprocessBlock,
    PretrainedLoad,
    PriceQuote,
    Provisioned,
    RangeTest,
    ReapDecision,
    ReaperReport,
    ReapError,
    Recovery,
    RegistryEntry,
    RunCosts,
    RunRecord,
    RunRef,
    ScanPlan,
    SchemaVersionError,
    SizePoint,
    SizingReport,
    SkipRecord,
    SupervisorState,
    Trained,
    TrainingBeat,
    TrainingMetrics,
    TrainingOutcome,
    TrainingProgress,
    TriggerHeartbeat,
    Validated,
    ValidationRecord,
    VerdictRecord,
    WallSeconds,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import RegistryLayout, RunLayout
from burstcv_spec.preprocess import PreprocessSpec

REPO = Path(__file__).resolve().parents[1]
RUN = RunRef.of("manual__2026-12-01T00:00:00+00:00")
HOST = HostInfo(machine="x86_64", processor="x86_64", cpu_count=2, python="3.12", platform="Linux")
DECISION = gate_decision(0.97, 12.5)
FIGURES = BenchFigures.model_validate(
    {**DECISION["benchmark"]["candidate"], "latencies_ms": [1.0, 2.5], "bare_onnxruntime_p50_ms": 1}
)
GATE = GateVerdict.model_validate(DECISION["gate"])
LAUNCH = Launch(
    run=RUN,
    dag_id="burstcv_pipeline",
    job_uri="/a/runs/x/job/job.json",
    time_budget_s=600,
    instance_types=["g6.xlarge"],
    use_spot=None,
    deadline_at=datetime(2026, 12, 1, 1, 0, tzinfo=UTC),
    wheel_uri="",
    wheel_sha256="",
)
CARD = ModelCard.model_validate(model_card(b"onnx"))
RATE = g6_box_rate(price_source="bundled table")
RESOLVED = ResolvedRun(
    run_id=RUN.airflow_run_id,
    trigger="asset_triggered",
    started_at="now",
    params=RunParams.resolve({"dataset_uri": "s3://b/cats/v7", "num_nodes": 2}),
    costs=RunCosts(
        region="eu-west-1",
        boxes=2,
        max_cost_usd=5.0,
        box_rate=RATE,
        time_budget_s=10_000,
        margin_s=360,
        budget_reason="what $5 buys",
        serving=[],
        serving_unpriced="no on-demand price for c7i.large in eu-west-1",
    ),
    image_size=ImageSizeChoice(px=224, reason="the median short side", resize_short=256),
)
BUSY = HostLoad(
    cpus=[0, 1],
    wall_s=2.0,
    others_share=0.9,
    own_cpu_s=1.1,
    psi_some_share=0.4,
    calibration_ms=70.0,
    calibration_quiet_ms=31.2,
    busy=True,
    reason="other processes took 90% of CPUs 0,1 (at most 25%)",
)


EPOCH = EpochRecord(
    epoch=1,
    train_loss=1.2,
    images_per_s=900.0,
    val_loss=0.9,
    val_accuracy=0.7,
    lr=0.1,
    elapsed_s=12.5,
    backbone_frozen=True,
)
PROGRESS = TrainingProgress(attempt=1, epochs_total=3, epochs=[EPOCH])
METRICS = TrainingMetrics(
    val_accuracy=0.7,
    val_loss=0.9,
    confusion=[[3, 1], [0, 4]],
    classes=["a", "b"],
    arch="resnet10",
    epochs=[EPOCH],
    best_epoch=1,
    epochs_asked=3,
    epochs_run=1,
    seconds_saved=25.0,
    stop_reason="early stop",
    recoveries=[Recovery(epoch=1, step=40, reason="loss not finite", lr_scale=0.3)],
    lr_range_test=RangeTest(
        chosen_lr=0.05,
        min_loss_lr=0.5,
        steepest_lr=0.08,
        fallback_lr=0.1,
        steps=3,
        seconds=1.5,
        lrs=[0.01, 0.1, 1.0],
        losses=[2.3, 1.9, 2.0],
    ),
    optimizer=OptimizerBlock(
        name="sgd",
        learning_rate=0.05,
        lr_scale=0.3,
        weight_decay=5e-5,
        batch_size=128,
        warmup_steps=10,
        steps_per_epoch=40,
        total_steps=120,
        schedule="linear warm-up, cosine decay",
    ),
    wall_s=WallSeconds(setup=1.0, data=0.5, compute=10.0, eval=1.0),
    device="cpu",
    device_name="cpu",
    world_size=1,
    pretrained="DEFAULT",
    pretrained_loaded=PretrainedLoad(source="s3://w/r.pt", loaded=60, head=2, unused=2),
    amp_dtype="float32",
    precision="fp32",
    versions={"torch": "2.14.1"},
    host=HOST,
    train_images=320,
    val_images=80,
    source_commit="c",
    dataset_fingerprint="f",
    finished_at="now",
    attempt=1,
)


SIZE = SizePoint(vcpus=1, measured=True, sustainable_rps=120.0, p95_ms=9.5, rss_mb=110.0)
FLEET = FleetOption(
    instance_type="c7i.large",
    vcpus=2,
    memory_gib=4.0,
    replicas=2,
    rps_per_replica=200.0,
    extrapolated=False,
    usd_per_hour=0.1785,
    usd_per_month=130.31,
    usd_per_million=0.2479,
)
SIZING = SizingReport(
    latency_slo_ms=50.0,
    target_rps=200.0,
    headroom=0.3,
    region="us-east-1",
    host_cores=2,
    sizes=[SIZE, SizePoint(vcpus=4, measured=False, sustainable_rps=400.0)],
    options=[FLEET],
    chosen=FLEET,
    reason="2 x c7i.large",
    price_source={"source": "table", "as_of": "2024-06-01"},
)
BOX = BoxSizing(
    instance_type="c7g.large",
    instance_id="i-0123456789abcdef0",
    region="us-east-1",
    zone="us-east-1a",
    host=HostInfo(
        machine="aarch64", processor="aarch64", cpu_count=2, python="3.11.9", platform="Linux"
    ),
    sizes=[SIZE],
    measured_at="2026-12-05T12:00:00+00:00",
    seconds=41.5,
    speed_key="k" * 32,
    measured_in="manual__2026-12-05",
)
SIZED_ON_BOXES = SIZING.model_copy(
    update={
        "boxes": [BOX, BoxSizing(instance_type="m7g.large", region="us-east-1", skipped="quota")],
        "options": [FLEET.model_copy(update={"measured_on": "c7i.large"})],
    }
)


def examples() -> list[Contract]:
    """Return one filled-in instance of every stage result and artifact."""
    return [
        RUN,
        ScanPlan(
            dataset_uri="s3://b/cats",
            listing_uri="/a/runs/x/dataset/scan/listing.parquet",
            refused_uri="/a/runs/x/dataset/scan/refused.parquet",
            ignored=[{"path": ".DS_Store", "note": "hidden or system file"}],
            files=3,
            bytes=300,
            chunks=[
                DataChunk(index=0, start=0, stop=2, files=2, bytes=200, part_uri="p0"),
                DataChunk(index=1, start=2, stop=3, files=1, bytes=100, part_uri="p1"),
            ],
        ),
        Validated(
            fingerprint="f" * 64,
            manifest_uri="m",
            validation_uri="v",
            data_docs_uri="d",
        ),
        PackPlan(
            shards=2,
            images_per_shard=780,
            classes=["0", "1"],
            chunks=[DataChunk(index=0, start=0, stop=2, files=3, bytes=300, part_uri="p0")],
        ),
        Packed(
            classes=["0", "1"],
            train_shards=["t"],
            val_shards=["v"],
            counts={"train": 2, "val": 1},
            preprocess=PreprocessBlock.of(PreprocessSpec()),
            fingerprint="f",
        ),
        LAUNCH,
        Provisioned(
            run=RUN,
            job_uri=LAUNCH.job_uri,
            output_uri="/a/runs/x/job",
            instance_ids=["i-1"],
            backend="ec2",
            launch=LAUNCH,
        ),
        Trained(
            model_uri="m.pt",
            metrics_uri="m.json",
            val_accuracy=0.9,
            epochs=3,
            train_wall_s=4.5,
            device="cpu",
        ),
        Exported(model_dir="/m", sha256=CARD.sha256, parity_max_abs_diff=1e-6, onnx_file="m.onnx"),
        Benchmarked(latency_uri="/l", host=HOST, candidate=FIGURES.summary()),
        Deployed(version=3, previous_version=None, services={"u": {"version": 3}}, staged={}),
        ReaperReport(
            backend="ec2",
            region="eu-west-1",
            checked_at=datetime(2026, 12, 1, 16, 0, tzinfo=UTC),
            dry_run=False,
            decisions=[
                ReapDecision(
                    instance_id="i-1",
                    run_key="manual__x",
                    dag_id="burstcv_pipeline",
                    reason="run-not-active",
                    detail="DAG run burstcv_pipeline/manual__x is not running",
                )
            ],
            kept=["i-2"],
            errors=[ReapError(instance_id="i-3", step="terminate", error="ClientError: x")],
        ),
        RESOLVED,
        SkipRecord(reason="nothing new", production_version=1, fingerprint="f", decided_at="now"),
        PackedPart(
            index=0,
            train_shards=["t"],
            val_shards=["v"],
            counts={"train": 2, "val": 1},
            train_histogram=[[0] * 255 + [2]] * 3,
        ),
        AttemptRecord(attempt=2, instance_ids=["i-2"], launched_at="now"),
        LocalProcessRecord(
            instance_id="local-0123456789ab",
            pid=4242,
            start_ticks=123456,
            run_key="manual__x",
            dag_id="burstcv_pipeline",
            job_uri="/a/runs/manual__x/job/job.json",
            launched_at="2026-12-01T16:00:00+00:00",
            attempt=1,
            expires_at="2026-12-01T17:02:00+00:00",
            log="/c/manual__x/local-0123456789ab.log",
        ),
        TriggerHeartbeat(attempt=2, polled_at="2026-12-01T16:00:00+00:00", every_s=60.0),
        BootTimes(instance_type="g6.xlarge", measured_s=[95.2, 131.0]),
        SupervisorState(
            supervisor=4100,
            components={"api-server": 4101, "scheduler": "restarting", "triggerer": "starting"},
        ),
        TrainingBeat(
            attempt=2,
            beats=41,
            epoch=3,
            step=1200,
            phase="train",
            step_s=0.12,
            written_at="2026-12-01T16:00:05+00:00",
        ),
        AttemptBill(
            attempt=2,
            run_key="manual__x",
            dag_id="burstcv_pipeline",
            backend="ec2",
            region="eu-west-1",
            boxes=[
                BoxBill(
                    instance_id="i-1",
                    instance_type="g6e.xlarge",
                    market="spot",
                    zone="eu-west-1b",
                    image_id="ami-1",
                    usd_per_hour=0.7421,
                    price_source="EC2 DescribeSpotPriceHistory (Linux/UNIX), 2026-12-01",
                    volume_gb=100,
                    ebs_usd_per_gb_month=0.088,
                    public_ipv4_usd_per_hour=0.005,
                    launched_at="2026-12-01T16:00:00+00:00",
                    running_at="2026-12-01T16:00:20+00:00",
                    ended_at="2026-12-01T16:30:00+00:00",
                )
            ],
        ),
        PriceQuote(
            instance_type="g6e.xlarge",
            region="eu-west-1",
            market="spot",
            zone="eu-west-1b",
            usd_per_hour=0.7421,
            source="EC2 DescribeSpotPriceHistory",
            as_of="2026-12-01T15:00:00+00:00",
            fetched_at="2026-12-01T16:00:00+00:00",
        ),
        Billing(
            instance_ids=["i-1"],
            billed_seconds={"i-1": 60.0},
            cost_usd=0.01,
            backend="ec2",
            instances=[
                InstanceRecord(instance_id="i-1", run_id=RUN.run_key, dag_id="d", state="x")
            ],
            terminated_at="now",
        ),
        ValidationRecord(
            success=False,
            dataset_uri="/d",
            fingerprint="f",
            counts=DatasetCounts(
                files=3, usable=2, errors=1, ignored=0, per_split={"train": {"a": 2}}
            ),
            expectations=[
                ExpectationResult(
                    name="decodable",
                    description="every image decodes",
                    expectation_type="expect_column_values_to_be_in_set",
                    success=False,
                    observed={"unexpected_count": 1},
                    offending_files=["train/a/bad.png"],
                    reasons={"train/a/bad.png": "truncated"},
                )
            ],
            ignored=[],
            drift=DriftBlock(status="no_baseline", message="no earlier validated dataset"),
            warnings=[],
            config={"min_images_per_class": 5},
            manifest_uri="/m.parquet",
            data_docs_uri="/docs/index.html",
            validated_at="now",
            versions={"great_expectations": "1.0", "pillow": "11.0"},
        ),
        DatasetProfile(
            dataset_uri="/d",
            fingerprint="f",
            validated_at="now",
            images=2,
            class_proportions={"a": 1.0},
            median_width=32.0,
            median_height=None,
        ),
        PROGRESS,
        METRICS,
        DoneMarker(val_accuracy=0.97, finished_at="now", attempt=1),
        FailedMarker(stage="preflight", reason="no GPU", resumable=False, attempt=1, at="now"),
        TrainingOutcome(status="failed", attempt=2, stage="interrupted", reason="spot notice"),
        LatencyRecord(measured_at="now", host=HOST, requests=2, concurrency=1, candidate=FIGURES),
        LatencyRecord(
            measured_at="now",
            host=HOST,
            requests=2,
            concurrency=1,
            candidate=FIGURES.model_copy(update={"shed": 1, "host_load": BUSY}),
            inconclusive="the host was busy",
            bench_s=3.5,
            sizing_s=9.0,
        ),
        CalibrationRecord(quiet_ms={"node|x86_64|numpy 2.3": 31.2}),
        VerdictRecord(version=3, **GATE.model_dump()),
        SIZING,
        SIZED_ON_BOXES,
        BOX,
        CARD,
        RegistryEntry.model_validate(
            {
                **DECISION,
                "version": 1,
                "model": "digits",
                "sha256": CARD.sha256,
                "registered_at": "now",
                "lineage": {"run_id": "r", "dataset_fingerprint": "f", "source_commit": "c"},
            }
        ),
        AliasRecord(version=1, sha256=CARD.sha256),
        HistoryEvent(
            at="now",
            actor="api",
            action="promote",
            alias="production",
            from_version=None,
            to_version=1,
            result="moved",
        ),
    ]


def test_every_stage_result_and_artifact_has_an_example() -> None:
    # run.json's contract is generic over its params: RunRecord[RunParams] (ResolvedRun).
    kinds = {RunRecord if isinstance(e, RunRecord) else type(e) for e in examples()}
    assert kinds == set(STAGE_RESULTS) | set(ARTIFACTS)


@pytest.mark.parametrize("value", examples(), ids=lambda v: type(v).__name__)
def test_every_model_survives_a_round_trip_through_json(value: Contract) -> None:
    """What a task pushes to XCom (or a stage writes) is what the next one rebuilds."""
    text = json.dumps(value.model_dump(mode="json", by_alias=True))
    assert type(value).model_validate(json.loads(text)) == value


def test_stage_results_refuse_unknown_keys_and_cannot_change() -> None:
    with pytest.raises(ValidationError, match="run_id"):
        Trained.model_validate({**examples()[5].model_dump(), "run_id": "x"})
    with pytest.raises(ValidationError, match="frozen"):
        RUN.run_key = "other"  # type: ignore[misc]


def test_files_carry_the_schema_version_and_keep_their_keys(tmp_path: Path) -> None:
    uri = write_artifact(str(tmp_path / "model.json"), CARD)
    written = json.loads(Path(uri).read_text())
    assert written["schema_version"] == SCHEMA_VERSION
    assert "version" not in written  # a run's model.json has no registry version, as before
    assert set(written) == set(model_card(b"onnx")) | {"schema_version"}
    event = examples()[-1].model_dump(mode="json", by_alias=True)
    assert event["from"] is None and event["to"] == 1  # the history's keys, kept


def test_an_old_file_without_a_schema_version_is_read_as_version_1(tmp_path: Path) -> None:
    old = model_card(b"onnx")
    del old["schema_version"]
    (tmp_path / "model.json").write_text(json.dumps(old))
    card = read_artifact(str(tmp_path / "model.json"), ModelCard)
    assert card.schema_version == 1 and card == CARD


def test_a_newer_schema_version_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "verdict.json"
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "anything": "new"}))
    with pytest.raises(SchemaVersionError) as caught:
        read_artifact(str(path), VerdictRecord)
    assert str(caught.value) == (
        f"{path}: schema_version {SCHEMA_VERSION + 1} is newer than this code reads "
        f"({SCHEMA_VERSION}); upgrade burstcv to read it"
    )


def test_a_malformed_model_json_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "x" / "model" / "model.json"
    path.parent.mkdir(parents=True)
    bad = model_card(b"onnx")
    bad["preprocess"]["height"] = "tall"
    path.write_text(json.dumps(bad))
    with pytest.raises(ArtifactError) as caught:
        read_artifact(str(path), ModelCard)
    message = str(caught.value)
    assert message.startswith(f"{path}: field 'preprocess.height': ")
    assert "integer" in message and "\n" not in message


@pytest.mark.parametrize(
    ("change", "field", "why"),
    [
        ({"sha256": "abc"}, "sha256", "64 hex digits"),
        ({"onnx_file": "../model.onnx"}, "onnx_file", "beside model.json"),
        ({"classes": []}, "classes", "at least 1 item"),
        ({"preprocess": {"interpolation": "lanczos"}}, "preprocess", "unknown interpolation"),
        ({"colour": "red"}, "colour", "Extra inputs are not permitted"),
    ],
)
def test_each_bad_model_json_value_is_named(
    tmp_path: Path, change: dict[str, Any], field: str, why: str
) -> None:
    bad = model_card(b"onnx")
    for key, value in change.items():
        bad[key] = {**bad[key], **value} if isinstance(value, dict) else value
    (tmp_path / "model.json").write_text(json.dumps(bad))
    with pytest.raises(ArtifactError, match=f"model.json: field '{field}': .*{why}"):
        read_artifact(str(tmp_path / "model.json"), ModelCard)


def test_a_file_that_is_not_a_json_object_says_so(tmp_path: Path) -> None:
    (tmp_path / "production.json").write_text("[1]")
    with pytest.raises(ArtifactError, match=r"production\.json: holds list, expected a JSON obj"):
        read_artifact(str(tmp_path / "production.json"), AliasRecord)
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(ArtifactError, match=r"run\.json: not JSON"):
        read_artifact(str(tmp_path / "run.json"), ResolvedRun)


def test_the_layouts_name_the_documented_paths() -> None:
    run = RunLayout.of("/store", RUN.airflow_run_id)
    assert run.root == f"/store/runs/{RUN.run_key}"
    assert run.model_card == f"/store/runs/{RUN.run_key}/model/model.json"
    assert run.billing == f"/store/runs/{RUN.run_key}/job/billing.json"
    assert run.verdict == f"/store/runs/{RUN.run_key}/bench/verdict.json"
    registry = RegistryLayout("s3://bucket/registry", "digits")
    assert registry.entry(3) == "s3://bucket/registry/digits/versions/3/entry.json"
    assert registry.alias("production") == "s3://bucket/registry/digits/aliases/production.json"


def test_the_contracts_doc_is_the_generated_one() -> None:
    doc = REPO / "docs" / "contracts.md"
    assert contracts_doc.updated(doc.read_text()) == doc.read_text(), (
        "docs/contracts.md is stale: run python -m burstcv_spec.contracts_doc docs/contracts.md"
    )


def test_every_field_is_described() -> None:
    for model in (*STAGE_RESULTS, *ARTIFACTS, *contracts_doc.BLOCKS):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_a_sizing_file_written_before_the_slo_was_renamed_still_reads(tmp_path: Path) -> None:
    older = {**SIZING.model_dump(mode="json"), "slo_p95_ms": 80.0}
    del older["latency_slo_ms"]
    (tmp_path / "sizing.json").write_text(json.dumps(older))
    assert read_artifact(str(tmp_path / "sizing.json"), SizingReport).latency_slo_ms == 80.0


def test_the_resolved_run_reads_back_as_the_run_params_it_holds(tmp_path: Path) -> None:
    write_artifact(str(tmp_path / "run.json"), RESOLVED)
    back = read_artifact(str(tmp_path / "run.json"), ResolvedRun)
    assert isinstance(back.params, RunParams)
    assert back == RESOLVED
    assert back.params.num_nodes == 2 and back.costs.box_rate.volume_gb == 100


def test_a_run_provisioned_before_the_budget_moved_to_run_json_still_tears_down() -> None:
    provisioned = next(e for e in examples() if isinstance(e, Provisioned))
    older = {**provisioned.model_dump(mode="json"), "max_cost_usd": 5.0}
    assert Provisioned.model_validate(older) == provisioned
