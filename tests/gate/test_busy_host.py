"""The gate on a busy host: the benchmark stage, for real, beside CPU burners.

A run's folder holds what the stages before the benchmark write (run.json, job.json, the
validated manifest, the exported demo model); ``benchmark_stage.benchmark`` then measures it through
real staging services, with the fleet sizing. On a quiet host the model passes the gate; on
a host kept busy on purpose (burners on the same CPUs, bounded in time) the benchmark is
inconclusive with the reason: nothing is registered, nothing rejected, and the report and
latency.json say why; with the burners kept off the staging services' CPUs (isolation
working), the same model passes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from burstcv_testkit import cpu_burners, demo_val_images, export_trained

from burstcv.data.manifest import write_manifest
from burstcv.gate.interference import Placement
from burstcv.gate.latency import drive, staging_service
from burstcv.gate.sizing import host_cpus
from burstcv.params import RunParams
from burstcv.registry.registry import Registry
from burstcv.settings import Settings
from burstcv.stages import benchmark as benchmark_stage
from burstcv.stages import gate as gate_stage
from burstcv.stages import report as report_stage
from burstcv.stages import resolve
from burstcv.training.job import write_job
from burstcv_spec import storage
from burstcv_spec.contracts import (
    Exported,
    LatencyRecord,
    ModelCard,
    RunRef,
    SizingReport,
    read_artifact,
)
from burstcv_spec.layout import MODEL_CARD


@pytest.fixture(scope="module")
def exported_demo(
    trained_demo: dict[str, Any], demo_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Export the session's trained demo model once; each run copies it into its folder."""
    out = tmp_path_factory.mktemp("busy-host") / "model"
    export_trained(trained_demo, out, parity_images=demo_val_images(demo_dataset, 32))
    return out


def settings(tmp_path: Path, **fields: Any) -> Settings:
    """This module's deployment: its own home and registry, short loads, two quick attempts."""
    values: dict[str, Any] = {
        "home": str(tmp_path / "home"),  # its own calibration and sizes measured before
        "registry_uri": str(tmp_path / "registry"),
        "bench_requests": 80,
        "bench_warmup_requests": 10,
        "bench_attempts": 2,
        "bench_busy_backoff_s": 0.5,
        "sizing_step_s": 0.5,
        "sizing_max_vcpus": 1,
    }
    return Settings(**{**values, **fields})


def prepared_run(
    name: str,
    s: Settings,
    trained_demo: dict[str, Any],
    exported_demo: Path,
    demo_dataset: Path,
    **conf: Any,
) -> tuple[RunRef, Exported]:
    """Write a run's folder as the stages before the benchmark do; return it and its export."""
    run = RunRef.of(f"manual__{name}")
    params = RunParams.resolve({"dataset_uri": str(demo_dataset), "accuracy_floor": 0.5, **conf}, s)
    resolve.resolve_run(run, params, s, trigger="manual")
    paths = resolve.run_layout(run, s)
    write_job(trained_demo["job"], paths.job_spec)
    rows = [
        {
            "path": path,
            "uri": str(demo_dataset / path),
            "label": path.split("/")[1],
            "split": "val",
            "decode_ok": True,
        }
        for path, _ in demo_val_images(demo_dataset, 32)
    ]
    write_manifest(pd.DataFrame(rows), paths.manifest)
    shutil.copytree(exported_demo, paths.model)
    card = read_artifact(storage.join(paths.model, MODEL_CARD), ModelCard)
    assert card.parity is not None
    exported = Exported(
        model_dir=paths.model,
        sha256=card.sha256,
        parity_max_abs_diff=card.parity.max_abs_diff,
        onnx_file=card.onnx_file,
    )
    return run, exported


def test_a_quiet_host_measures_the_model_and_it_passes(
    tmp_path: Path,
    trained_demo: dict[str, Any],
    exported_demo: Path,
    demo_dataset: Path,
) -> None:
    s = settings(tmp_path)
    run, exported = prepared_run("quiet-host", s, trained_demo, exported_demo, demo_dataset)
    bench = benchmark_stage.benchmark(run, s)
    record = read_artifact(resolve.run_layout(run, s).latency, LatencyRecord)
    assert record.inconclusive is None
    load = record.candidate.host_load
    assert load is not None and not load.busy
    assert load.others_share <= s.bench_busy_share and load.calibration_ms is not None
    assert bench.sizing is not None and bench.sizing.host_load is not None
    assert not bench.sizing.host_load.busy
    # The time the gate added is recorded.
    assert record.bench_s is not None and record.bench_s > 0
    assert record.sizing_s is not None and record.sizing_s > 0
    assert record.candidate.errors == 0 and record.candidate.shed == 0
    verdict = gate_stage.gate(run, exported, bench, s)
    assert verdict.promote, verdict.summary


def test_a_busy_host_makes_the_gate_inconclusive_never_a_rejection(
    tmp_path: Path,
    trained_demo: dict[str, Any],
    exported_demo: Path,
    demo_dataset: Path,
) -> None:
    s = settings(tmp_path)
    # An SLO the model meets on a quiet host (p95 under 10 ms) and misses beside the burners:
    # a pass measured beside them would have been kept.
    run, _ = prepared_run(
        "busy-host", s, trained_demo, exported_demo, demo_dataset, latency_slo_ms=20.0
    )
    # Three other processes per CPU, as a neighbour's training and tests would be; they stop
    # by themselves within two minutes whatever happens here.
    with (
        cpu_burners(per_cpu=3, seconds=120),
        pytest.raises(benchmark_stage.GateInconclusive) as caught,
    ):
        benchmark_stage.benchmark(run, s)
    message = str(caught.value)
    # The sizing comes first (the latency benchmark's load follows from it): it found the
    # host busy, and nothing after it was measured.
    assert message.startswith("gate inconclusive: fleet sizing: inconclusive")
    assert "busy through 2 attempt(s)" in message
    assert "other processes took" in message and "The model was not judged" in message
    paths = resolve.run_layout(run, s)
    record = read_artifact(paths.latency, LatencyRecord)
    assert record.inconclusive is not None and "other processes took" in record.inconclusive
    assert record.candidate is None and record.sizing_s is not None
    # The sizing's figures are kept, marked: they measured the neighbours.
    sizes = read_artifact(paths.sizing, SizingReport)
    assert sizes.host_load is not None and sizes.host_load.busy
    # Nothing was judged: no verdict, no version registered (rejected or otherwise).
    assert not storage.exists(paths.verdict)
    assert Registry(s.registry_uri, s.model_name).versions() == []
    page = storage.read_bytes(report_stage.report(run, s)).decode()
    assert "Inconclusive, nothing judged" in page and "BUSY" in page


@pytest.mark.skipif(len(host_cpus()) < 2, reason="isolation needs two CPUs")
def test_a_busy_host_with_the_services_isolated_from_it_measures_the_model_and_it_passes(
    tmp_path: Path,
    trained_demo: dict[str, Any],
    exported_demo: Path,
    demo_dataset: Path,
) -> None:
    s = settings(tmp_path)
    run, exported = prepared_run("isolated", s, trained_demo, exported_demo, demo_dataset)
    place = Placement.split(host_cpus())
    # The neighbours are kept off the staging services' CPUs (as a dedicated worker's cpuset
    # would): they share the load generator's.
    with cpu_burners(per_cpu=2, seconds=180, cpus=place.generator):
        bench = benchmark_stage.benchmark(run, s)
    record = read_artifact(resolve.run_layout(run, s).latency, LatencyRecord)
    assert record.inconclusive is None
    load = record.candidate.host_load
    assert load is not None and load.cpus == place.service and not load.busy, load
    assert bench.sizing is not None and bench.sizing.host_load is not None
    assert bench.sizing.host_load.cpus == place.service and not bench.sizing.host_load.busy
    verdict = gate_stage.gate(run, exported, bench, s)
    assert verdict.promote, verdict.summary


def test_a_new_version_of_the_same_model_reuses_its_sizes_until_something_changes(
    tmp_path: Path,
    trained_demo: dict[str, Any],
    exported_demo: Path,
    demo_dataset: Path,
) -> None:
    s = settings(tmp_path)
    first, _ = prepared_run("sizes-first", s, trained_demo, exported_demo, demo_dataset)
    measured = benchmark_stage.benchmark(first, s).sizing
    assert measured is not None and measured.measured_in == first.airflow_run_id
    assert measured.speed_key and measured.host_load is not None
    # The same architecture, input and preprocessing on the same host, at the same SLO: the
    # sizes are the first run's, the fleet chosen again at this run's load and prices: a
    # load no single replica of any type carries, however fast this host measured.
    load = round(3 * max(o.rps_per_replica for o in measured.options))
    again, again_exported = prepared_run(
        "sizes-again", s, trained_demo, exported_demo, demo_dataset, target_rps=float(load)
    )
    again_bench = benchmark_stage.benchmark(again, s)
    reused = again_bench.sizing
    assert reused is not None and reused.measured_in == first.airflow_run_id
    assert reused.sizes == measured.sizes and reused.speed_key == measured.speed_key
    assert reused.host_load == measured.host_load and reused.target_rps == load
    assert reused.chosen is not None and measured.chosen is not None
    assert reused.chosen.replicas > measured.chosen.replicas  # its load, not the default
    timing = read_artifact(resolve.run_layout(again, s).latency, LatencyRecord).sizing_s
    assert timing is not None and timing < 1.0
    page = storage.read_bytes(report_stage.report(again, s)).decode()
    assert f"Sizes reused from run {first.airflow_run_id}" in page
    # The registry says whose figures the version's fleet rests on.
    version = gate_stage.gate(again, again_exported, again_bench, s).version
    entry = Registry(s.registry_uri, s.model_name).entry(version)
    assert entry.fleet is not None and entry.fleet_measured_in == first.airflow_run_id
    # Another SLO holds each rate to another limit: measured again.
    other_slo, _ = prepared_run(
        "sizes-slo", s, trained_demo, exported_demo, demo_dataset, latency_slo_ms=80.0
    )
    remeasured = benchmark_stage.benchmark(other_slo, s).sizing
    assert remeasured is not None and remeasured.measured_in == other_slo.airflow_run_id
    assert remeasured.speed_key != measured.speed_key
    # The setting forces a measurement where one would be reused.
    forced_settings = settings(tmp_path, sizing_remeasure=True)
    forced, _ = prepared_run(
        "sizes-forced", forced_settings, trained_demo, exported_demo, demo_dataset
    )
    again_measured = benchmark_stage.benchmark(forced, forced_settings).sizing
    assert again_measured is not None and again_measured.measured_in == forced.airflow_run_id
    assert again_measured.speed_key == measured.speed_key


def test_the_staging_copy_sheds_past_its_target_and_shedding_is_not_an_error(
    exported_demo: Path, demo_dataset: Path
) -> None:
    images = [body for _, body in demo_val_images(demo_dataset, 16)]

    def measure(target_ms: float) -> Any:
        with staging_service(str(exported_demo), queue_delay_target_ms=target_ms) as url:
            return drive(url, images, requests=400, concurrency=32, warmup=5, label="candidate")

    tight = measure(0.5)  # a request that queues half a millisecond is shed
    assert tight.shed > 0 and tight.errors == 0 and tight.error_rate == 0.0
    assert tight.status_counts.get("503") == tight.shed
    assert tight.status_counts.get("200", 0) + tight.shed == tight.requests
    generous = measure(5000.0)  # the SLO of a photo model: nothing waits that long here
    assert generous.shed == 0 and generous.errors == 0
