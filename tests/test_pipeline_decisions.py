"""The pipeline's own decisions: when a run has nothing new to train on, why deploy skips,
how long a run may last on its budget."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from burstcv_testkit import bench_figures, write_model_dir

from burstcv.cost import budget
from burstcv.cost.quotes import PriceSources
from burstcv.params import EXPORT_PARAMS, TRAINING_PARAMS, Affects, RunParams
from burstcv.registry.registry import Registry
from burstcv.settings import Settings
from burstcv.stages import deploy as deploy_stage
from burstcv.stages import gate as gate_stage
from burstcv.stages import resolve as resolve_stage
from burstcv_spec import storage
from burstcv_spec.contracts import (
    Benchmarked,
    Exported,
    GateCheck,
    HostInfo,
    ImageSizeChoice,
    PriceQuote,
    RegistryDecision,
    RunRef,
    SizePoint,
    SizingReport,
    SkipRecord,
    TrainingChoice,
    Validated,
    VerdictRecord,
    read_artifact,
    write_artifact,
)

FINGERPRINT = "f1" * 32
RUN = RunRef.of("scheduled__2026-12-01T00:00:00+00:00")


def validated(fingerprint: str) -> Validated:
    """Return validate's result for a dataset with this fingerprint."""
    return Validated(
        fingerprint=fingerprint,
        manifest_uri="/a/manifest.parquet",
        validation_uri="/a/validation.json",
        data_docs_uri="/a/data_docs/index.html",
    )


def resolve(
    settings: Settings,
    run_params: RunParams,
    *,
    image_size: int = 32,
    resize_short: int | None = None,
) -> None:
    """Resolve RUN with these params (run.json), and the image size validate chose."""
    resolved = resolve_stage.resolve_run(RUN, run_params, settings)
    size = ImageSizeChoice(px=image_size, reason="the data's", resize_short=resize_short)
    write_artifact(
        resolve_stage.run_layout(RUN, settings).record,
        resolved.model_copy(update={"image_size": size}),
    )


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Return settings whose registry has production v1, made from FINGERPRINT at 32 px."""
    s = Settings(artifact_root=str(tmp_path / "artifacts"), registry_uri=str(tmp_path / "reg"))
    model_dir = write_model_dir(
        tmp_path / "model",
        b"an onnx file: the registry only stores it",
        run_id="manual__first",
        dataset_fingerprint=FINGERPRINT,
    )
    registry = Registry(s.registry_uri, s.model_name)
    params = RunParams(dataset_uri="/data/digits", epochs=3)
    version = registry.register(
        str(model_dir),
        RegistryDecision.model_validate(
            {"status": "accepted", "params": params.model_dump(mode="json")}
        ),
    )
    registry.promote(version)
    return s


def promote_production(settings: Settings, tmp_path: Path, recorded: dict[str, object]) -> None:
    """Register and promote a new production version made from FINGERPRINT with these params."""
    model_dir = write_model_dir(
        tmp_path / "model-v2",
        b"another onnx file",
        run_id="manual__second",
        dataset_fingerprint=FINGERPRINT,
    )
    registry = Registry(settings.registry_uri, settings.model_name)
    registry.promote(
        registry.register(
            str(model_dir),
            RegistryDecision.model_validate({"status": "accepted", "params": recorded}),
        )
    )


def decide(settings: Settings, fingerprint: str = FINGERPRINT, **params: object) -> str | None:
    resolve(settings, RunParams(dataset_uri="/data/digits-copy", **{"epochs": 3, **params}))
    return resolve_stage.nothing_new_to_train(RUN, validated(fingerprint), settings=settings)


def test_production_data_and_params_need_no_training(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="burstcv"):
        reason = decide(settings)
    assert reason is not None and reason.startswith("nothing new to train on:")
    assert "production version 1 (run manual__first)" in reason
    assert "model auto, pretrained auto, epochs 3" in reason and "force_train" in reason
    assert f"(fingerprint {FINGERPRINT[:12]})" in reason
    # Params left unset are not listed as if they had a value.
    assert "None" not in reason and "batch_size" not in reason and "expected_classes" not in reason
    assert reason in caplog.messages
    skip = read_artifact(resolve_stage.run_layout(RUN, settings).skip, SkipRecord)
    assert skip.reason == reason and skip.production_version == 1


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"fingerprint": "ab" * 32}, "new data"),
        ({"epochs": 4}, "a training param"),
        ({"model": "mobilenet_v3_small"}, "the architecture"),
        ({"pretrained": "DEFAULT"}, "pretrained weights"),
        ({"backbone_lr_scale": 0.5}, "a fine-tuning param"),
        ({"int8": False}, "an export param"),
        ({"force_train": True}, "forced"),
    ],
)
def test_new_data_other_params_or_force_train(
    settings: Settings, change: dict[str, object], why: str
) -> None:
    assert decide(settings, **change) is None, why
    assert not storage.exists(resolve_stage.run_layout(RUN, settings).skip)


def test_every_run_param_says_what_it_changes() -> None:
    """A new field must say whether it changes the model: else a run could skip over it."""
    for name, field in RunParams.model_fields.items():
        declared = [m for m in field.metadata if isinstance(m, Affects)]
        assert len(declared) == 1, f"RunParams.{name} declares {declared}, not one Affects"


# A value other than the fixture's production params for every param that changes the model
# or its export. A new such param fails the test below until it has one here.
CHANGED = {
    "model": "mobilenet_v3_small",
    "pretrained": "none",
    "epochs": 4,
    "batch_size": 64,
    "batch_scaling": "global",
    "learning_rate": 0.01,
    "optimizer": "sgd",
    "warmup_steps": 10,
    "early_stop_patience": 3,
    "lr_range_test": True,
    "freeze_backbone_epochs": 1,
    "backbone_lr_scale": 0.5,
    "seed": 7,
    "expected_classes": [str(d) for d in range(10)],
    "int8": False,
    "int8_max_accuracy_drop": 0.05,
}


def test_a_change_to_any_param_that_changes_the_model_trains(settings: Settings) -> None:
    assert set(CHANGED) == set(TRAINING_PARAMS + EXPORT_PARAMS), "give the new param a value"
    for name, value in CHANGED.items():
        change = {name: value}
        if name == "freeze_backbone_epochs":  # freezing needs weights to freeze
            change["pretrained"] = "DEFAULT"
        assert decide(settings, **change) is None, f"{name}={value!r} was skipped over"


@pytest.mark.parametrize(
    "change",
    [
        {"max_cost_usd": 9.0},
        {"latency_slo_ms": 20.0},
        {"accuracy_floor": 0.5},
        {"promote": False},
        {"use_spot": False},
        {"min_images_per_class": 1},
        {"max_accuracy_drop": 0.1},
    ],
)
def test_a_change_to_how_the_run_goes_is_still_nothing_new(
    settings: Settings, change: dict[str, object]
) -> None:
    assert decide(settings, **change) is not None


def test_no_pretrained_weights_is_not_listed_as_a_param(settings: Settings, tmp_path: Path) -> None:
    from_scratch = RunParams(dataset_uri="/data/digits", epochs=3, pretrained="none")
    promote_production(settings, tmp_path, from_scratch.model_dump(mode="json"))
    reason = decide(settings, pretrained="none")
    assert reason is not None and "production version 2 (run manual__second)" in reason
    assert "model auto, epochs 3" in reason and "pretrained" not in reason


def test_a_param_production_did_not_record_had_its_default(
    settings: Settings, tmp_path: Path
) -> None:
    """A production version made before a param existed was made with that param's default."""
    recorded = RunParams(dataset_uri="/data/digits", epochs=3).model_dump(mode="json")
    del recorded["backbone_lr_scale"], recorded["int8_max_accuracy_drop"]
    promote_production(settings, tmp_path, recorded)
    reason = decide(settings)
    assert reason is not None and "production version 2" in reason
    assert decide(settings, backbone_lr_scale=0.5) is None
    assert decide(settings, int8_max_accuracy_drop=0.05) is None


def choice(**values: object) -> TrainingChoice:
    """Return validate's training choice, ``derived`` naming the values it chose (auto)."""
    base: dict[str, object] = {
        "model": "resnet10",
        "pretrained": "none",
        "batch_size": 32,
        "learning_rate": 0.001,
        "epochs": 3,
        "optimizer": "adamw",
        "warmup_steps": 0,
        "early_stop_patience": 2,
        "reason": "the data's",
    }
    return TrainingChoice.model_validate({**base, **values})


def decide_resolved(settings: Settings, training: TrainingChoice, **params: object) -> str | None:
    """Decide RUN with these params and the training values validate chose for it."""
    resolve(settings, RunParams(dataset_uri="/data/digits-copy", **params))
    layout = resolve_stage.run_layout(RUN, settings)
    record = resolve_stage.resolved_run(RUN, settings)
    write_artifact(layout.record, record.model_copy(update={"training": training}))
    return resolve_stage.nothing_new_to_train(RUN, validated(FINGERPRINT), settings=settings)


@pytest.mark.parametrize(
    ("recorded", "mine", "derived", "same"),
    [
        # A run on auto whose choice is production's named value: the same model.
        ({"epochs": 6, "optimizer": "sgd"}, {}, {"epochs": 6, "optimizer": "sgd"}, True),
        ({"epochs": 6}, {}, {"epochs": 5}, False),
        # Production on auto, this run on auto: the same choice from the same data.
        ({"epochs": None, "optimizer": "auto"}, {}, {"epochs": 7, "optimizer": "adamw"}, True),
        # Production on auto, this run naming a value: what production chose is not known.
        ({"epochs": None}, {"epochs": 3}, {}, False),
    ],
)
def test_auto_is_compared_as_the_value_it_chose(
    settings: Settings,
    tmp_path: Path,
    recorded: dict[str, object],
    mine: dict[str, object],
    derived: dict[str, object],
    same: bool,
) -> None:
    production = RunParams(dataset_uri="/data/digits", **recorded).model_dump(mode="json")
    promote_production(settings, tmp_path, production)
    training = choice(**derived, derived=sorted(derived))
    reason = decide_resolved(settings, training, **{"epochs": None, "optimizer": "auto", **mine})
    assert (reason is not None) is same, (recorded, mine, derived)


def test_another_image_size_trains(settings: Settings) -> None:
    resolve(settings, RunParams(dataset_uri="/data/digits", epochs=3), image_size=64)
    assert (
        resolve_stage.nothing_new_to_train(RUN, validated(FINGERPRINT), settings=settings) is None
    )


def test_the_same_image_size_with_another_resize_trains(settings: Settings) -> None:
    run_params = RunParams(dataset_uri="/data/digits", epochs=3)
    resolve(settings, run_params, resize_short=48)
    assert (
        resolve_stage.nothing_new_to_train(RUN, validated(FINGERPRINT), settings=settings) is None
    )
    resolve(settings, run_params)
    same = resolve_stage.nothing_new_to_train(RUN, validated(FINGERPRINT), settings=settings)
    assert same is not None and "image size 32 px" in same


def test_an_empty_registry_trains(tmp_path: Path) -> None:
    empty = Settings(artifact_root=str(tmp_path / "a"), registry_uri=str(tmp_path / "r"))
    assert decide(empty) is None


def test_a_skipped_deploy_says_which_check_failed_with_its_figures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    verdict = VerdictRecord(
        version=7,
        promote=False,
        reasons=["accuracy 0.6890 is below the floor 0.9000"],
        checks=[GateCheck(name="accuracy_floor", passed=False, observed=0.689, limit=0.9)],
        suggestions=[],
        summary="not promoted: accuracy 0.6890 is below the floor 0.9000",
        failed_figures=["accuracy 0.6890 < floor 0.9"],
    )
    with caplog.at_level(logging.INFO, logger="burstcv"):
        reason = deploy_stage.deploy_skip_reason(verdict, promote=True)
    assert reason == "version 7 not promoted: accuracy 0.6890 < floor 0.9"
    assert caplog.messages[0] == reason
    accepted = verdict.model_copy(update={"promote": True, "failed_figures": []})
    assert deploy_stage.deploy_skip_reason(accepted, promote=True) is None
    held = deploy_stage.deploy_skip_reason(accepted, promote=False)
    assert held == "version 7 passed the gate but is not deployed: the run has promote=false"


def test_export_and_gate_read_a_bounded_sample_of_a_split_a_shard_at_a_time(
    tmp_path: Path,
) -> None:
    """A split larger than the limit gives evenly spaced images over all its shards; a smaller
    one is returned whole, in order, with its labels."""
    import numpy as np

    from burstcv.training.stream import sample_split

    classes = ["a", "b", "c"]
    uris, start = [], 0
    for no, count in enumerate([40, 40, 11]):
        ids = np.arange(start, start + count)
        images = np.zeros((count, 4, 4, 3), np.uint8)
        images[:, 0, 0, 0] = ids
        path = tmp_path / f"val-{no:05d}.npz"
        np.savez(path, images=images, labels=ids % 3, classes=np.array(classes))
        uris.append(str(path))
        start += count

    images, labels = sample_split(uris, classes, 10)
    ids = images[:, 0, 0, 0].astype(int)
    assert ids.tolist() == np.linspace(0, 90, 10).round().astype(int).tolist()
    assert (labels == ids % 3).all()
    assert {int(i) // 40 for i in ids} == {0, 1, 2}  # every shard contributes

    whole, whole_labels = sample_split(uris, classes, 1000)
    assert whole[:, 0, 0, 0].tolist() == list(range(91))
    assert whole_labels.tolist() == [i % 3 for i in range(91)]


class Prices:
    """Stand in for AWS's on-demand quotes ($/hour; None: nobody can price the type)."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, usd_per_hour: dict[str, float | None]
    ) -> None:
        self.usd_per_hour = usd_per_hour
        self.asked: list[list[str]] = []
        monkeypatch.setattr(budget, "candidate_quotes", self.quote)
        monkeypatch.setenv("BURSTCV_EC2_REGION", "us-west-2")
        monkeypatch.setenv("BURSTCV_EC2_VOLUME_GB", "100")
        monkeypatch.setenv("BURSTCV_EC2_WATCHDOG_MARGIN_MIN", "5")

    def quote(
        self, instance_types: list[str], region: str, sources: object
    ) -> dict[str, PriceQuote | None]:
        self.asked.append(instance_types)
        return {
            t: None
            if (usd := self.usd_per_hour[t]) is None
            else PriceQuote(
                instance_type=t,
                region=region,
                market="on-demand",
                usd_per_hour=usd,
                source="test",
                as_of="2026-12-01",
                fetched_at="2026-12-01",
            )
            for t in instance_types
        }


# What a box costs an hour beyond its instance, computed here from AWS's published rates,
# not read back from the code: 100 GB of gp3 at $0.08/GB-month (730 h) and one public IPv4
# at $0.005/h. A box may outlive the deadline by the watchdog's 5 min margin plus the minute
# its shutdown rounds to: 360 s.
EXTRAS_PER_HOUR = 100 * 0.08 / 730 + 0.005
MARGIN_S = 360


def deadline_s(max_cost_usd: float, instance_usd_per_hour: float, boxes: int = 1) -> int:
    """Return the seconds to the deadline that keep ``boxes`` boxes within the budget."""
    per_hour = boxes * (instance_usd_per_hour + EXTRAS_PER_HOUR)
    return math.floor(max_cost_usd / per_hour * 3600) - MARGIN_S


def ec2_run(instance_types: list[str], max_cost_usd: float, num_nodes: int = 1) -> RunParams:
    """Return an EC2 run of two hours at most on these types, within this budget."""
    return RunParams(
        dataset_uri="/d",
        compute_backend="ec2",
        instance_types=instance_types,
        max_cost_usd=max_cost_usd,
        time_budget_s=7200,
        num_nodes=num_nodes,
    )


def test_the_budget_bounds_the_priciest_allowed_box_exactly_at_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Prices(monkeypatch, {"g6.xlarge": 1.8, "g6.12xlarge": 3.6, "g4dn.xlarge": 0.9})
    run = ec2_run(["g6.xlarge", "g6.12xlarge", "g4dn.xlarge"], max_cost_usd=1.8)
    costs = budget.resolve_costs(run, Settings())
    assert costs.time_budget_s == deadline_s(1.8, 3.6) == 1432
    rate = costs.box_rate
    assert (rate.instance_type, rate.market, rate.usd_per_hour) == ("g6.12xlarge", "on-demand", 3.6)
    # The priciest box living to the deadline and its margin spends the budget, no more.
    spent = (3.6 + EXTRAS_PER_HOUR) * (costs.time_budget_s + MARGIN_S) / 3600
    assert spent <= 1.8 < (3.6 + EXTRAS_PER_HOUR) * (costs.time_budget_s + MARGIN_S + 2) / 3600
    # A generous budget leaves the run's own time budget alone.
    assert budget.resolve_costs(ec2_run(["g4dn.xlarge"], 100.0), Settings()).time_budget_s == 7200


def test_a_run_of_several_boxes_divides_its_budget_among_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4 x g5.12xlarge on $20: the deadline buys 4 boxes, not one (which would bill ~$80)."""
    Prices(monkeypatch, {"g5.12xlarge": 5.672})
    one = budget.resolve_costs(ec2_run(["g5.12xlarge"], 20.0), Settings())
    four = budget.resolve_costs(ec2_run(["g5.12xlarge"], 20.0, num_nodes=4), Settings())
    assert one.time_budget_s == 7200 and one.boxes == 1  # one box: the 2 h cap binds
    assert four.time_budget_s == deadline_s(20.0, 5.672, boxes=4) == 2804
    assert four.boxes == 4 and "4 x g5.12xlarge" in four.budget_reason
    worst = 4 * (5.672 + EXTRAS_PER_HOUR) * (four.time_budget_s + MARGIN_S) / 3600
    assert worst <= 20.0


def test_a_budget_that_cannot_buy_every_box_its_minute_is_refused_before_renting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Prices(monkeypatch, {"g5.12xlarge": 5.672})
    with pytest.raises(resolve_stage.ValidationFailed, match=r"4 x g5\.12xlarge") as refused:
        resolve_stage.resolve_run(RUN, ec2_run(["g5.12xlarge"], 2.0, num_nodes=4), Settings())
    assert "raise max_cost_usd" in str(refused.value)


# --- a deadline before the boxes' boot: refused at resolve, before anything is rented --------

P4D_USD_PER_HOUR = 32.7726  # p4d.24xlarge on demand (AWS's published price)


def refused_at_resolve(
    run: RunParams, settings: Settings, trigger: str = "form"
) -> resolve_stage.ValidationFailed:
    """Resolve RUN as ``trigger`` does; return its refusal, asserting nothing was written."""
    with pytest.raises(resolve_stage.ValidationFailed) as refused:
        resolve_stage.resolve_run(RUN, run, settings, trigger=trigger)
    assert not storage.exists(resolve_stage.run_layout(RUN, settings).record)
    assert "\n" not in str(refused.value)
    return refused.value


@pytest.mark.parametrize("trigger", ["form", "schedule", "asset", "cli"])
@pytest.mark.parametrize("use_spot", [True, False])
def test_a_budget_whose_deadline_comes_before_the_boot_is_refused_saying_what_it_buys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trigger: str, use_spot: bool
) -> None:
    """p4d.24xlarge at $5: 188 s to the deadline, shorter than its family's assumed boot."""
    Prices(monkeypatch, {"p4d.24xlarge": P4D_USD_PER_HOUR})
    settings = Settings(artifact_root=str(tmp_path / "artifacts"))
    run = ec2_run(["p4d.24xlarge"], 5.0).model_copy(update={"use_spot": use_spot})
    message = str(refused_at_resolve(run, settings, trigger))
    assert deadline_s(5.0, P4D_USD_PER_HOUR) == 188
    assert message.startswith(
        "1 x p4d.24xlarge at $5.00 buys 188 s to the deadline; a p4d.24xlarge box's boot takes "
        "about 600 s (assumed: the p4d family's floor): its boxes would be paid and never train"
    )
    # Enough for the boot, a minute of training and the watchdog's margin, at the box's rate.
    needed = (P4D_USD_PER_HOUR + EXTRAS_PER_HOUR) * (600 + 60 + MARGIN_S) / 3600
    assert f"raise max_cost_usd to ${needed:.2f} or more" in message
    assert budget.resolve_costs(ec2_run(["p4d.24xlarge"], round(needed + 0.01, 2)), settings)


def test_several_boxes_are_refused_when_their_shared_deadline_comes_before_the_boot(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    Prices(monkeypatch, {"g5.12xlarge": 5.672})
    settings = Settings(artifact_root=str(tmp_path / "artifacts"))
    message = str(refused_at_resolve(ec2_run(["g5.12xlarge"], 5.0, num_nodes=4), settings))
    assert deadline_s(5.0, 5.672, boxes=4) == 431
    assert message.startswith("4 x g5.12xlarge at $5.00 buys 431 s to the deadline; a ")
    assert "about 480 s (assumed: the g5 family's floor)" in message
    # One box of the same type on the same budget reaches past its boot.
    one = budget.resolve_costs(ec2_run(["g5.12xlarge"], 5.0), settings)
    assert one.time_budget_s == deadline_s(5.0, 5.672) == 2804


def test_the_slowest_boot_among_the_types_decides_and_a_short_time_budget_is_refused_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    Prices(monkeypatch, {"g4dn.xlarge": 0.526, "g6.xlarge": 0.8048})
    settings = Settings(artifact_root=str(tmp_path / "artifacts"))
    short = ec2_run(["g4dn.xlarge", "g6.xlarge"], 100.0).model_copy(update={"time_budget_s": 450})
    message = str(refused_at_resolve(short, settings))
    assert message.startswith(
        "time_budget_s leaves 450 s to the deadline; a g6.xlarge box's boot takes about 480 s"
    )
    assert "raise time_budget_s" in message
    only_g4dn = short.model_copy(update={"instance_types": ["g4dn.xlarge"]})
    assert budget.resolve_costs(only_g4dn, settings).time_budget_s == 450  # its floor: 420 s


def test_measured_boots_of_a_type_replace_its_familys_floor(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from burstcv.cost.boot import MEASURED_KEPT, boot_estimate, record_boots

    Prices(monkeypatch, {"p4d.24xlarge": P4D_USD_PER_HOUR, "g6.xlarge": 0.8048})
    root = str(tmp_path / "artifacts")
    settings = Settings(artifact_root=root)
    # This deployment's p4d boxes booted in under 3 minutes: 188 s is past their boot.
    record_boots(root, "p4d.24xlarge", [150.0, 171.4])
    costs = budget.resolve_costs(ec2_run(["p4d.24xlarge"], 5.0), settings)
    assert costs.time_budget_s == 188
    # Its g6 boxes boot slower than the family's floor: the measured boot refuses.
    record_boots(root, "g6.xlarge", [900.0])
    run = ec2_run(["g6.xlarge"], 100.0).model_copy(update={"time_budget_s": 600})
    message = str(refused_at_resolve(run, settings))
    assert (
        "a g6.xlarge box's boot takes about 900 s (measured: the slowest of its last 1)" in message
    )
    # Only the latest boots count: an old slow one ages out.
    record_boots(root, "g6.xlarge", [200.0] * MEASURED_KEPT)
    assert boot_estimate(root, "g6.xlarge").seconds == 200.0
    assert budget.resolve_costs(run, settings).time_budget_s == 600


def test_a_type_nobody_can_price_counts_at_the_highest_known_price(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Prices(monkeypatch, {"g6.xlarge": 1.8, "g5.48xlarge": None, "g4dn.xlarge": 0.9})
    run = ec2_run(["g5.48xlarge", "g4dn.xlarge", "g6.xlarge"], max_cost_usd=0.9)
    with caplog.at_level(logging.WARNING, logger="burstcv.cost"):
        assert budget.resolve_costs(run, Settings()).time_budget_s == deadline_s(0.9, 1.8)
    (warning,) = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "burstcv.cost.budget"
    ]
    assert warning.startswith("no price for g5.48xlarge in us-west-2;")
    assert "g6.xlarge's $1.8000/h" in warning


def test_priced_types_need_no_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Prices(monkeypatch, {"g6.xlarge": 1.8, "g4dn.xlarge": 0.9})
    with caplog.at_level(logging.WARNING, logger="burstcv.cost"):
        budget.resolve_costs(ec2_run(["g6.xlarge", "g4dn.xlarge"], 0.9), Settings())
    assert not [r for r in caplog.records if r.name == "burstcv.cost.budget"]


def test_a_run_no_type_of_which_has_a_price_is_refused_with_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Prices(monkeypatch, {"x9.huge": None, "x9.bigger": None})
    with pytest.raises(budget.UnpricedRunError) as refused:
        budget.resolve_costs(ec2_run(["x9.huge", "x9.bigger"], 5.0), Settings())
    message = str(refused.value)
    assert (
        "no price for any of the run's instance types (x9.huge, x9.bigger) in us-west-2" in message
    )
    assert "pricing:GetProducts" in message and "BURSTCV_PRICE_TABLE" in message


def test_a_local_run_keeps_its_time_budget_and_asks_no_prices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prices = Prices(monkeypatch, {"g6.xlarge": 1.8})
    run = RunParams(dataset_uri="/d", compute_backend="local", max_cost_usd=0.01, time_budget_s=900)
    costs = budget.resolve_costs(run, Settings())
    assert (costs.time_budget_s, costs.margin_s, costs.box_rate.usd_per_hour) == (900, 0, 0.0)
    assert prices.asked == []


def test_a_mapped_task_is_one_line_of_the_run_summary_worst_state_first() -> None:
    from burstcv.airflow.local_run import _states_line

    assert _states_line(["success"]) == "success"
    assert _states_line(["success", "failed", "success"]) == "1 failed, 2 success (mapped)"
    assert _states_line(["skipped"] * 3) == "3 skipped (mapped)"


def test_a_serving_family_burstcv_does_not_know_is_named_with_the_ones_it_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Prices(monkeypatch, {"g6.xlarge": 1.8})
    run = ec2_run(["g6.xlarge"], 5.0).model_copy(update={"serving_families": ["c9x"]})
    costs = budget.resolve_costs(run, Settings())
    assert [q.instance_type for q in costs.serving if q.instance_type.startswith("c")] == []
    assert costs.serving_unpriced == (
        "no CPU type of the families c9x is known to burstcv "
        "(serving_families: choose among c7g, c7i, c8g, m7g, m7i)"
    )


def test_a_retried_gate_keeps_the_version_its_earlier_try_registered(
    settings: Settings, tmp_path: Path
) -> None:
    """The gate is retried (its worker lost, say): the model is registered once, and the
    verdict stands, even when the earlier try died before writing verdict.json."""
    resolve(settings, RunParams(dataset_uri="/data/digits", epochs=3))
    model_dir = write_model_dir(
        tmp_path / "run-model", b"this run's onnx", run_id=RUN.airflow_run_id
    )
    exported = Exported(
        model_dir=str(model_dir), sha256="0" * 64, parity_max_abs_diff=0.0, onnx_file="model.onnx"
    )
    host = HostInfo(machine="x86_64", processor="x", cpu_count=2, python="3.11", platform="l")
    bench = Benchmarked(latency_uri="unused", host=host, candidate=bench_figures(p95_ms=12.0))
    registry = Registry(settings.registry_uri, settings.model_name)
    before = registry.versions()
    first = gate_stage.gate(RUN, exported, bench, settings)
    assert registry.versions() == [*before, first.version]
    Path(resolve_stage.run_layout(RUN, settings).verdict).unlink()  # died before writing it
    slower = bench.model_copy(update={"candidate": bench_figures(p95_ms=400.0)})
    again = gate_stage.gate(RUN, exported, slower, settings)
    assert again == first and registry.versions() == [*before, first.version]
    assert read_artifact(resolve_stage.run_layout(RUN, settings).verdict, VerdictRecord) == first
    # Another model of the same run (retrained after a clear) is judged and registered anew.
    other = write_model_dir(tmp_path / "retrained", b"another onnx", run_id=RUN.airflow_run_id)
    third = gate_stage.gate(
        RUN, exported.model_copy(update={"model_dir": str(other)}), slower, settings
    )
    assert third.version == first.version + 1 and not third.promote


def test_the_advice_prices_a_replica_at_the_rate_the_sizing_found_it_sustains() -> None:
    from burstcv.gate.sizing import recommend

    def sizing(*rates: float) -> SizingReport:
        points = [
            SizePoint(vcpus=i + 1, measured=True, sustainable_rps=r) for i, r in enumerate(rates)
        ]
        return recommend(
            points, latency_slo_ms=50.0, target_rps=10.0, prices=[], region="us-east-1"
        )

    assert gate_stage.capacity_rps(sizing(40.0, 70.0), 2) == 70.0
    assert gate_stage.capacity_rps(sizing(40.0, 70.0), 1) == 40.0
    assert gate_stage.capacity_rps(sizing(40.0), 2) == 80.0  # extrapolated, linear at best
    assert gate_stage.capacity_rps(sizing(0.5), 1) == 0.5  # a trickle is still a rate
    # Nothing held the SLO, nothing measured, no sizing, no host figure: no capacity.
    assert gate_stage.capacity_rps(sizing(0.0, 0.0), 2) is None
    unmeasured = sizing(40.0).model_copy(
        update={"sizes": [SizePoint(vcpus=1, measured=False, sustainable_rps=40.0)]}
    )
    assert gate_stage.capacity_rps(unmeasured, 1) is None
    assert gate_stage.capacity_rps(None, 2) is None
    assert gate_stage.capacity_rps(sizing(40.0), None) is None
    assert gate_stage.capacity_rps(sizing(40.0), 0) is None


S3_STORE = "s3://burstcv-test/artifacts"


@pytest.fixture
def local_quotes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Quote the serving types from the bundled table, cached in a local folder (the run's
    S3 store is never reached: these tests resolve, and rent nothing)."""
    monkeypatch.setattr(
        budget, "price_sources", lambda params, settings: PriceSources(artifact_root=str(tmp_path))
    )


def sizing_reserve(boxes: int, max_s: int) -> float:
    """Return what ``boxes`` sizing boxes of the priciest c7i/m7i type (c7i.2xlarge, $0.357/h
    in the bundled table, a 16 GB volume and a public IPv4) cost over ``max_s`` + 3 min."""
    per_hour = 0.357 + 16 * 0.08 / 730 + 0.005
    return boxes * per_hour * (max_s + 180) / 3600


def test_a_run_sized_on_ec2_keeps_its_sizing_boxes_out_of_the_training_budget(
    monkeypatch: pytest.MonkeyPatch, local_quotes: None
) -> None:
    """$1.80 on g6.xlarge at $3.60/h: the sizing boxes' reserve comes off the training time."""
    Prices(monkeypatch, {"g6.xlarge": 3.6})
    store = Settings(artifact_root=S3_STORE)
    on_host = budget.resolve_costs(
        ec2_run(["g6.xlarge"], 1.8).model_copy(update={"size_on": "host"}), store
    )
    assert on_host.sizing is None and on_host.training_usd == 1.8
    # An ec2 run whose artifacts are in S3 sizes on ec2 unless told otherwise.
    costs = budget.resolve_costs(ec2_run(["g6.xlarge"], 1.8), store)
    sizing = costs.sizing
    assert sizing is not None and (sizing.boxes, sizing.max_s, sizing.margin_s) == (3, 900, 180)
    assert sizing.box_rate.instance_type == "c7i.2xlarge" and sizing.box_rate.volume_gb == 16
    assert sizing.reserve_usd == pytest.approx(sizing_reserve(3, 900), abs=1e-6)
    assert costs.training_usd == pytest.approx(1.8 - sizing.reserve_usd)
    assert costs.time_budget_s == deadline_s(costs.training_usd, 3.6) < on_host.time_budget_s
    # Training boxes and sizing boxes together stay within the run's budget.
    training = (3.6 + EXTRAS_PER_HOUR) * (costs.time_budget_s + MARGIN_S) / 3600
    assert training + sizing.reserve_usd <= 1.8
    # Fewer, shorter boxes reserve less; the store decides the default, not the backend alone.
    small = budget.resolve_costs(
        ec2_run(["g6.xlarge"], 1.8).model_copy(update={"sizing_boxes": 1, "sizing_max_s": 300}),
        store,
    )
    assert small.sizing is not None
    assert small.sizing.reserve_usd == pytest.approx(sizing_reserve(1, 300), abs=1e-6)
    assert budget.resolve_costs(ec2_run(["g6.xlarge"], 1.8), Settings()).sizing is None


@pytest.mark.parametrize(("max_cost_usd", "sized_on_ec2"), [(1.2, False), (1.4, True)])
def test_auto_sizes_on_ec2_only_where_the_boxes_take_at_most_a_quarter_of_the_budget(
    monkeypatch: pytest.MonkeyPatch, local_quotes: None, max_cost_usd: float, sized_on_ec2: bool
) -> None:
    """Three boxes set aside about $0.327: over a quarter of $1.20, under a quarter of $1.40."""
    Prices(monkeypatch, {"g6.xlarge": 3.6})
    run = ec2_run(["g6.xlarge"], max_cost_usd)
    costs = budget.resolve_costs(run, Settings(artifact_root=S3_STORE))
    assert (costs.sizing is not None) == sized_on_ec2
    # Asked for by name, the boxes are set aside whatever their share.
    asked = budget.resolve_costs(
        run.model_copy(update={"size_on": "ec2"}), Settings(artifact_root=S3_STORE)
    )
    assert asked.sizing is not None
    assert asked.sizing.reserve_usd == pytest.approx(sizing_reserve(3, 900), abs=1e-6)


def test_a_local_run_may_size_on_ec2_and_an_ec2_sizing_needs_an_s3_store(
    monkeypatch: pytest.MonkeyPatch, local_quotes: None
) -> None:
    Prices(monkeypatch, {"g6.xlarge": 3.6})
    local = RunParams(
        dataset_uri="/d",
        compute_backend="local",
        size_on="ec2",
        serving_families=["c7g", "c7i"],
        max_cost_usd=1.0,
        time_budget_s=900,
    )
    costs = budget.resolve_costs(local, Settings(artifact_root=S3_STORE))
    assert costs.sizing is not None and costs.time_budget_s == 900  # local training is free
    # The priciest type the families allow, Graviton included: c7i.2xlarge, then c7g.2xlarge.
    assert costs.sizing.box_rate.instance_type == "c7i.2xlarge"
    arm_only = local.model_copy(update={"serving_families": ["c7g"]})
    arm = budget.resolve_costs(arm_only, Settings(artifact_root=S3_STORE)).sizing
    assert arm is not None and arm.box_rate.instance_type == "c7g.2xlarge"
    with pytest.raises(resolve_stage.ValidationFailed, match="s3:// URI, or size_on host"):
        resolve_stage.resolve_run(RUN, local, Settings(artifact_root="/tmp/store"))
    # A budget the sizing boxes alone would spend is refused before anything is rented.
    tight = local.model_copy(update={"max_cost_usd": 0.2})
    with pytest.raises(resolve_stage.ValidationFailed, match="sizing boxes' reserve") as refused:
        resolve_stage.resolve_run(RUN, tight, Settings(artifact_root=S3_STORE))
    assert "raise max_cost_usd" in str(refused.value)
