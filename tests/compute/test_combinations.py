"""Features in combination: trigger, backend, boxes and region, from a run's first task to its bill.

Each capability has its own tests; this module runs them together, as a user combines them.
The four dimensions are trigger (manual with a conf, scheduled, asset event, the command
line), backend (local, ec2 on the emulator), boxes (``num_nodes`` 1 or 2) and region
(us-east-1, priced by the bundled table; eu-west-1, which only AWS prices: the Price List API
answers for the training type and for no serving type). They are crossed pairwise: every pair
of values of any two dimensions is in some cell, 8 cells instead of 32, so a fault that needs
two features together shows in one of them.

Each cell runs the real stages: the trigger's own way into the run's first task (the task
body Airflow runs, with the trigger form's params merged with the run's conf as Airflow merges
them, its run type and asset events; or ``burstcv validate`` on the command line), scan,
validate, pack, provision (a real local training process, or EC2 boxes on the emulator that
run a stand-in for ``burstcv train``: no GPU box exists here), the wait for the attempt's
marker, teardown and the bill, then the gate and the registry on fixed benchmark figures and
the report. It asserts what the run recorded against what the trigger said, the deadline the
boxes got against the budget computed here from AWS's billing rules, the bill against the
attempt records priced here, and that the gate's verdict is the same in the other region.
A local run of two boxes is refused before anything is rented, in whichever cell it falls.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.definitions.param import process_params
from awsaudit import RecordingProxy, price_list
from burstcv_testkit import bench_figures, write_dataset, write_model_dir
from typer.testing import CliRunner

from burstcv.airflow import data_stages
from burstcv.cli import app
from burstcv.compute.attempts import training_outcome
from burstcv.compute.ec2 import Ec2Settings
from burstcv.gate.sizing import recommend
from burstcv.params import ResolvedRun
from burstcv.registry.registry import Registry
from burstcv.settings import Settings, get_settings
from burstcv.stages import boxes as boxes_stage
from burstcv.stages import data as data_stage
from burstcv.stages import gate as gate_stage
from burstcv.stages import report as report_stage
from burstcv.stages import resolve
from burstcv.training.job import load_job
from burstcv_spec import storage
from burstcv_spec.contracts import (
    AttemptBill,
    Benchmarked,
    Billing,
    BoxBill,
    Exported,
    HostInfo,
    RunRef,
    ScanPlan,
    SizePoint,
    read_artifact,
)
from burstcv_spec.layout import END_RECORD, LAUNCH_RECORD

DAGS = Path(__file__).resolve().parents[2] / "dags"
IN_TABLE, FAR = "us-east-1", "eu-west-1"
GPU_TYPE = "g6.xlarge"
FAR_GPU_USD = 0.975  # the Price List API's answer for g6.xlarge in eu-west-1 (no table row)
# AWS's published rates, written here rather than read back from the code under test.
TABLE_GPU_USD = 0.8048  # g6.xlarge on demand in us-east-1 (the bundled table)
SIZING_BOX_USD = 0.357  # c7i.2xlarge on demand in us-east-1 (the bundled table)
GP3_USD_PER_GB_MONTH = {IN_TABLE: 0.08, FAR: 0.088}
IPV4_USD_PER_HOUR = 0.005
HOURS_PER_MONTH = 730
MIN_BILLED_S = 60


@dataclass(frozen=True)
class Cell:
    """One combination: how the run is started, where it trains, on how many boxes, where."""

    trigger: str  # manual, scheduled, asset_triggered, cli
    backend: str
    boxes: int
    region: str

    def __str__(self) -> str:
        return f"{self.trigger}-{self.backend}-{self.boxes}box-{self.region}"


# Every pair of values of any two dimensions appears in some row (all-pairs).
CELLS = [
    Cell("manual", "local", 1, IN_TABLE),
    Cell("manual", "ec2", 2, FAR),
    Cell("scheduled", "local", 2, FAR),
    Cell("scheduled", "ec2", 1, IN_TABLE),
    Cell("asset_triggered", "local", 1, FAR),
    Cell("asset_triggered", "ec2", 2, IN_TABLE),
    Cell("cli", "local", 2, IN_TABLE),
    Cell("cli", "ec2", 1, FAR),
]


def test_the_cells_cover_every_pair_of_values() -> None:
    dims = [
        ("trigger", {"manual", "scheduled", "asset_triggered", "cli"}),
        ("backend", {"local", "ec2"}),
        ("boxes", {1, 2}),
        ("region", {IN_TABLE, FAR}),
    ]
    for i, (a, a_values) in enumerate(dims):
        for b, b_values in dims[i + 1 :]:
            seen = {(getattr(c, a), getattr(c, b)) for c in CELLS}
            assert seen == {(x, y) for x in a_values for y in b_values}, (a, b)


@dataclass
class World:
    """A deployment for one cell: its settings, datasets and the emulator's recording proxy."""

    cell: Cell
    default_dataset: Path
    event_dataset: Path
    proxy: RecordingProxy
    tmp: Path

    @property
    def settings(self) -> Settings:
        return get_settings()


@pytest.fixture(params=CELLS, ids=str)
def world(
    request: pytest.FixtureRequest,
    aws: str,
    ec2_settings: Ec2Settings,
    kit: Any,
    player: Any,
    audited_calls: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Any:
    """Configure a deployment as the cell says: store, backend, region; two small datasets."""
    cell: Cell = request.param
    default_dataset = write_dataset(tmp_path / "data" / "pets", per_class=8)
    event_dataset = write_dataset(tmp_path / "data" / "pets-v2", per_class=8, seed=7)
    env = {
        "BURSTCV_DATASET_URI": str(default_dataset),
        "BURSTCV_COMPUTE_BACKEND": cell.backend,
        "BURSTCV_SERVING_URL": "",
        "BURSTCV_SCHEDULE": "",
    }
    if cell.backend == "ec2":
        env |= {
            "BURSTCV_ARTIFACT_ROOT": kit.artifact_root,
            "BURSTCV_REGISTRY_URI": f"s3://{kit.bucket}/registry",
        }
        for name, value in ec2_settings.model_dump().items():
            if value is not None:
                text = ",".join(value) if isinstance(value, tuple) else str(value)
                env[f"BURSTCV_EC2_{name.upper()}"] = text
    else:
        env |= {
            "BURSTCV_ARTIFACT_ROOT": str(tmp_path / "artifacts"),
            "BURSTCV_REGISTRY_URI": str(tmp_path / "registry"),
        }
    env["BURSTCV_EC2_REGION"] = cell.region
    # A run with no conf (scheduled, asset-triggered, a command-line verb) trains on the
    # deployment's number of boxes; a manual run says its own.
    env["BURSTCV_NUM_NODES"] = str(cell.boxes if cell.trigger != "manual" else 1)
    env["BURSTCV_EC2_INSTANCE_TYPES"] = GPU_TYPE
    # On demand, at a price written here (a spot box's price is the emulator's history:
    # tests/compute/test_prices.py prices those).
    env["BURSTCV_EC2_USE_SPOT"] = "false"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # The Price List API prices the GPU type in the far region and nothing else: in us-east-1
    # the bundled table answers, and no serving type has a price in the far region.
    audited_calls.answers["pricing:GetProducts"] = price_list({GPU_TYPE: str(FAR_GPU_USD)}, FAR)
    get_settings.cache_clear()
    yield World(cell, default_dataset, event_dataset, audited_calls, tmp_path)
    get_settings.cache_clear()


def airflow_params(conf: dict[str, Any]) -> dict[str, Any]:
    """Return the params the run's first task sees: Airflow's own merge of the pipeline DAG's
    trigger form (parsed now, with this deployment's defaults) and the run's conf."""
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(DAGS)).dags["burstcv_pipeline"]
    return process_params(dag, dag.get_task("plan_scan"), conf, suppress_exception=False)


def start(world: World, conf: dict[str, Any]) -> RunRef:
    """Start the run the cell's way, through the run's first task; return it."""
    cell = world.cell
    run = RunRef.of(f"{cell.trigger}__{cell}")
    if cell.trigger == "cli":
        options = [f"--{name.replace('_', '-')}={value}" for name, value in conf.items()]
        assert not options, "burstcv validate takes the data checks only"
        result = CliRunner().invoke(
            app, ["validate", str(world.default_dataset), "--run-id", run.airflow_run_id]
        )
        assert result.exit_code == 0, result.output
        return run
    events = None
    if cell.trigger == "asset_triggered":
        event = SimpleNamespace(
            extra={"dataset_uri": str(world.event_dataset)}, timestamp=datetime.now(UTC)
        )
        events = {"burstcv_dataset": [event]}
    data_stages.plan_scan.function(
        params=airflow_params(conf),
        run_id=run.airflow_run_id,
        triggering_asset_events=events,
        dag_run=SimpleNamespace(run_type=cell.trigger),
    )
    return run


def conf_of(cell: Cell) -> dict[str, Any]:
    """Return what the trigger says: a manual run's conf; the others take the defaults."""
    if cell.trigger == "manual":
        return {"num_nodes": cell.boxes, "max_cost_usd": 0.6, "epochs": 2}
    return {}


def expected_deadline_s(resolved: ResolvedRun, cell: Cell, settings: Settings) -> int:
    """Return the seconds to the deadline, from AWS's rules and the cell, computed here."""
    cap = resolved.params.time_budget_s
    if cell.backend == "local":
        return cap
    usd = FAR_GPU_USD if cell.region == FAR else TABLE_GPU_USD
    volume = settings.ec2.volume_gb * GP3_USD_PER_GB_MONTH[cell.region] / HOURS_PER_MONTH
    per_hour = cell.boxes * (usd + volume + IPV4_USD_PER_HOUR)
    margin_s = (settings.ec2.watchdog_margin_min + 1) * 60
    return min(cap, math.floor(training_usd(resolved, cell) / per_hour * 3600) - margin_s)


def training_usd(resolved: ResolvedRun, cell: Cell) -> float:
    """Return the training boxes' budget: an ec2 run in a region that prices its serving types
    sizes its fleet on EC2 (size_on auto), and sets aside three sizing boxes of its priciest
    serving type (c7i.2xlarge), a 16 GB volume and an IPv4 each, for 900 s and 3 min."""
    if cell.backend != "ec2" or cell.region == FAR:
        return resolved.params.max_cost_usd
    box = SIZING_BOX_USD + 16 * GP3_USD_PER_GB_MONTH[cell.region] / HOURS_PER_MONTH
    reserve = 3 * (box + IPV4_USD_PER_HOUR) * (900 + 180) / 3600
    if reserve > resolved.params.max_cost_usd / 4:  # auto leaves a small budget to training
        return resolved.params.max_cost_usd
    return resolved.params.max_cost_usd - reserve


def priced_by_hand(box: BoxBill, now: datetime) -> float:
    """Return what one box cost under EC2's rules, computed here from its record."""
    if box.market == "local":
        return 0.0
    launched = datetime.fromisoformat(box.launched_at)
    ended = datetime.fromisoformat(box.ended_at) if box.ended_at else now
    running = datetime.fromisoformat(box.running_at) if box.running_at else launched
    instance_s = max(MIN_BILLED_S, math.ceil((ended - running).total_seconds()))
    attached_s = max(MIN_BILLED_S, math.ceil((ended - launched).total_seconds()))
    attached = box.volume_gb * box.ebs_usd_per_gb_month / HOURS_PER_MONTH
    return (
        box.usd_per_hour * instance_s + (attached + box.public_ipv4_usd_per_hour) * attached_s
    ) / 3600


def wait_done(run: RunRef, backend: str, output_uri: str, timeout_s: float = 240.0) -> None:
    """Wait, as the train task's trigger does, until the attempt's marker says how it ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome = training_outcome(run.run_key, backend, output_uri, 1)
        if outcome.status != "running":
            assert outcome.status == "done", outcome.line()
            return
        time.sleep(0.5)
    raise AssertionError(f"run {run.run_key} did not finish within {timeout_s} s")


def judge(run: RunRef, settings: Settings, tmp: Path) -> Any:
    """Run the gate on fixed figures and the fleet sized at the run's resolved prices."""
    resolved = resolve.resolved_run(run, settings)
    params = resolved.params
    sizes = [
        SizePoint(vcpus=1, measured=True, sustainable_rps=180.0, p95_ms=9.0, rss_mb=120.0),
        SizePoint(vcpus=2, measured=True, sustainable_rps=330.0, p95_ms=9.5, rss_mb=125.0),
    ]
    sizing = recommend(
        sizes,
        latency_slo_ms=params.latency_slo_ms,
        target_rps=params.target_rps,
        prices=resolved.costs.serving,
        region=resolved.costs.region,
        unpriced=resolved.costs.serving_unpriced,
        families=params.serving_families,
    )
    host = HostInfo(machine="x86_64", processor="x", cpu_count=2, python="3.11", platform="l")
    model_dir = write_model_dir(tmp / f"model-{run.run_key}", b"onnx", run_id=run.airflow_run_id)
    exported = Exported(
        model_dir=str(model_dir), sha256="0" * 64, parity_max_abs_diff=0.0, onnx_file="model.onnx"
    )
    bench = Benchmarked(
        latency_uri="unused", host=host, candidate=bench_figures(p95_ms=12.0), sizing=sizing
    )
    return gate_stage.gate(run, exported, bench, settings), sizing


def verdict_of(record: Any) -> tuple[Any, ...]:
    return (record.promote, [(c.name, c.passed, c.observed, c.limit) for c in record.checks])


def test_a_run_holds_together_from_its_trigger_to_its_bill(
    world: World, player: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cell, s = world.cell, world.settings
    conf = conf_of(cell)
    if cell.backend == "local" and cell.boxes > 1:
        # Refused at the run's first task, before anything is written or rented, however the
        # run asked for its boxes (a conf, or the deployment's default).
        with pytest.raises(Exception, match="num_nodes 2 needs the ec2 compute backend"):
            start(world, conf)
        assert not storage.exists(resolve.run_layout(RunRef.of(f"{cell.trigger}__{cell}")).record)
        return
    run = start(world, conf)

    # The run as resolved: the trigger's dataset and kind, the boxes and the region.
    resolved = resolve.resolved_run(run, s)
    expected_dataset = (
        world.event_dataset if cell.trigger == "asset_triggered" else world.default_dataset
    )
    assert resolved.trigger == cell.trigger
    assert resolved.params.dataset_uri == str(expected_dataset)
    assert (resolved.costs.boxes, resolved.costs.region) == (cell.boxes, cell.region)
    assert resolved.costs.time_budget_s == expected_deadline_s(resolved, cell, s)
    sized_on_ec2 = training_usd(resolved, cell) < resolved.params.max_cost_usd
    assert (resolved.costs.sizing is not None) == sized_on_ec2
    assert resolved.costs.training_usd == pytest.approx(training_usd(resolved, cell))
    serving_types = {q.instance_type for q in resolved.costs.serving}
    if cell.region == FAR:  # nobody prices a serving type there: known now, not at the gate
        assert not serving_types & {"c7i.large", "m7i.large"}
        assert (
            resolved.costs.serving_unpriced
            and "BURSTCV_PRICE_TABLE" in resolved.costs.serving_unpriced
        )
    else:
        assert {
            "c7i.large",
            "m7i.large",
        } <= serving_types and resolved.costs.serving_unpriced is None

    # validate (scanned by the run's own chunks), pack, provision: the real stages.
    if cell.trigger != "cli":
        for chunk in read_artifact(resolve.run_layout(run, s).scan_plan, ScanPlan).chunks:
            data_stage.scan_chunk(run, chunk, s)
        validated = data_stage.validate(run, s)
    else:
        validated = data_stage.validate(run, s)  # burstcv validate ran it; again, as the DAG would
    packed = data_stage.pack(run, validated, settings=s)
    if cell.backend == "ec2":
        player.modes[run.run_key] = player.DIE  # each box runs its job, then is gone
    before = datetime.now(UTC)
    provisioned = boxes_stage.provision(run, "burstcv_pipeline", packed, s)
    after = datetime.now(UTC)
    assert len(provisioned.instance_ids) == cell.boxes

    # The deadline every box's watchdog is armed from: the resolved seconds from provision.
    job = load_job(provisioned.job_uri)
    assert job.deadline_at is not None and job.dataset_fingerprint == validated.fingerprint
    budget_s = resolved.costs.time_budget_s
    assert (
        before + timedelta(seconds=budget_s)
        <= job.deadline_at
        <= after + timedelta(seconds=budget_s)
    )
    assert (
        provisioned.launch.deadline_at == job.deadline_at and provisioned.launch.count == cell.boxes
    )
    if cell.backend == "ec2":
        for play in [p for p in player.plays.values() if p.run_id == run.run_key]:
            assert f"{int(job.deadline_at.timestamp())} - $(date +%s)" in play.user_data

    wait_done(run, cell.backend, provisioned.output_uri)
    billing: Billing = boxes_stage.terminate(run, cell.backend, s)

    # The bill, against the attempt's records priced here by EC2's rules.
    (end,) = [
        read_artifact(storage.join(provisioned.output_uri, "attempts", "1", name), AttemptBill)
        for name in (END_RECORD,)
    ]
    launch = read_artifact(
        storage.join(provisioned.output_uri, "attempts", "1", LAUNCH_RECORD), AttemptBill
    )
    assert [b.instance_id for b in end.boxes] == [b.instance_id for b in launch.boxes]
    assert len(end.boxes) == cell.boxes and all(b.ended_at for b in end.boxes)
    by_hand = sum(priced_by_hand(box, datetime.now(UTC)) for box in end.boxes)
    assert billing.cost_usd == pytest.approx(by_hand, rel=1e-9, abs=1e-12)
    assert sorted(billing.instance_ids) == sorted(provisioned.instance_ids)
    if cell.backend == "ec2":
        usd = FAR_GPU_USD if cell.region == FAR else TABLE_GPU_USD
        for box in end.boxes:
            assert (box.usd_per_hour, box.volume_gb) == (usd, s.ec2.volume_gb)
            assert box.ebs_usd_per_gb_month == GP3_USD_PER_GB_MONTH[cell.region]
        assert 0 < billing.cost_usd <= resolved.params.max_cost_usd
    else:
        assert billing.cost_usd == 0.0

    # The gate, on fixed figures: the same verdict as in the other region.
    verdict, sizing = judge(run, s, world.tmp)
    other = FAR if cell.region == IN_TABLE else IN_TABLE
    monkeypatch.setenv("BURSTCV_EC2_REGION", other)
    get_settings.cache_clear()
    sibling = RunRef.of(f"{run.airflow_run_id}-elsewhere")
    resolve.resolve_run(sibling, resolved.params, get_settings(), trigger=cell.trigger)
    elsewhere, _ = judge(sibling, get_settings(), world.tmp)
    monkeypatch.setenv("BURSTCV_EC2_REGION", cell.region)
    get_settings.cache_clear()
    assert verdict.promote and verdict_of(verdict) == verdict_of(elsewhere)
    assert sizing.chosen is not None  # a fleet exists in both regions; priced only in one
    assert (sizing.chosen.usd_per_month is None) == (cell.region == FAR)

    # The registry records the run as it ran: its params and the data it trained on.
    entry = Registry(s.registry_uri, s.model_name).entry(verdict.version)
    assert entry.lineage.dataset_uri == str(expected_dataset)
    assert entry.params is not None and entry.params["dataset_uri"] == str(expected_dataset)
    assert entry.params["num_nodes"] == cell.boxes

    # The report says what started the run, on which data, and for how many boxes.
    page = storage.read_bytes(report_stage.report(run, s)).decode()
    assert f"Started by <b>{cell.trigger}</b> on <code>{expected_dataset}</code>" in page
    assert f"<b>{cell.boxes}</b> box{'es' if cell.boxes > 1 else ''} a launch" in page
