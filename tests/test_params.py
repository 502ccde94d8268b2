"""Run parameters: one definition behind the trigger form, the CLI and the docs; one default."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from burstcv.data.config import ValidationConfig
from burstcv.params import DATA_CHECKS, RunParams, describe_default, params_table, run_fields
from burstcv.settings import Settings, get_settings
from burstcv.stages import data as data_stage
from burstcv.stages import resolve
from burstcv.training.job import JobSpec
from burstcv_spec.contracts import RunRef

REPO = Path(__file__).resolve().parents[1]
TABLE_BEGIN = "<!-- run-params:begin (generated from burstcv.params; see tests/test_params.py) -->"
TABLE_END = "<!-- run-params:end -->"


def test_an_unknown_name_is_refused_not_ignored() -> None:
    with pytest.raises(ValidationError, match="epoch"):
        RunParams.resolve({"epoch": 3})  # a typo of epochs


def test_defaults_have_one_home_each(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURSTCV_DATASET_URI", "s3://bucket/datasets/v7")
    monkeypatch.setenv("BURSTCV_COMPUTE_BACKEND", "ec2")
    monkeypatch.setenv("BURSTCV_TRAIN_TIMEOUT_S", "1800")
    monkeypatch.setenv("BURSTCV_EC2_INSTANCE_TYPES", "g5.xlarge, g4dn.xlarge")
    monkeypatch.setenv("BURSTCV_EC2_USE_SPOT", "false")
    params = RunParams.resolve({})
    # Deployment facts: the settings.
    assert params.dataset_uri == "s3://bucket/datasets/v7"
    assert params.compute_backend == "ec2"
    assert params.time_budget_s == 1800
    assert params.instance_types == ["g5.xlarge", "g4dn.xlarge"]
    assert params.use_spot is False
    # Training choices: auto (validate derives them from the data), or the job's contract.
    job = JobSpec.model_fields
    assert (params.model, params.pretrained, params.optimizer) == ("auto", "auto", "auto")
    for name in ("epochs", "batch_size", "learning_rate", "warmup_steps", "early_stop_patience"):
        assert getattr(params, name) is None, name
        assert run_fields()[name].auto and describe_default(run_fields()[name]) == "auto"
    for name in ("seed", "freeze_backbone_epochs", "backbone_lr_scale"):
        assert getattr(params, name) == job[name].default, name
    # Data checks: the dataset gate's own defaults.
    checks = ValidationConfig()
    for name in DATA_CHECKS:
        assert getattr(params, name) == getattr(checks, name), name


def test_a_given_none_empties_a_field_that_may_be_empty() -> None:
    params = RunParams.resolve({"near_duplicate_max_distance": None, "drift_max": 0.2})
    config = params.validation_config()
    assert config.near_duplicate_max_distance is None  # off, not the default 0
    assert config.drift_max == 0.2
    assert RunParams.resolve({"epochs": None}).epochs is None  # empty: auto
    with pytest.raises(ValidationError, match="seed"):
        RunParams.resolve({"seed": None})  # not a field that may be empty


def test_data_checks_that_cannot_be_met_are_refused() -> None:
    with pytest.raises(ValidationError, match="0 < min <= max"):
        RunParams.resolve({"min_width": 64, "max_width": 32})


def test_a_time_budget_over_the_train_timeout_is_refused(tmp_path: Path) -> None:
    settings = Settings(home=str(tmp_path), train_timeout_s=1800)
    with pytest.raises(ValueError, match="BURSTCV_TRAIN_TIMEOUT_S 1800"):
        RunParams.resolve({"time_budget_s": 3600}, settings)
    assert RunParams.resolve({"time_budget_s": 1800}, settings).time_budget_s == 1800


def test_the_data_checks_take_effect_in_the_validate_stage(
    demo_dataset: Path, tmp_path: Path
) -> None:
    settings = Settings(home=str(tmp_path))
    given = {"dataset_uri": str(demo_dataset)}
    passed = data_stage.validate(
        RunRef.of("manual__defaults"), settings, params=RunParams.resolve(given, settings)
    )
    assert Path(passed.validation_uri).is_file()
    strict = RunParams.resolve({**given, "min_images_per_class": 100}, settings)
    with pytest.raises(resolve.ValidationFailed, match="min_images_per_class"):
        data_stage.validate(RunRef.of("manual__strict"), settings, params=strict)


def test_the_docs_table_is_the_generated_one() -> None:
    docs = (REPO / "docs" / "airflow.md").read_text()
    assert TABLE_BEGIN in docs and TABLE_END in docs, "docs/airflow.md lost the table markers"
    written = docs.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip()
    assert written == params_table().strip(), (
        "docs/airflow.md's run-parameter table is stale; replace the text between its markers "
        "with: python -c 'from burstcv.params import params_table; print(params_table())'"
    )


def test_every_field_is_described_for_a_user() -> None:
    for name, spec in run_fields().items():
        assert spec.title and spec.description, name
        assert not re.search(r"[A-Z_]{2,}_[A-Z]", spec.title), f"{name}: a title, not a name"


def _bounds(name: str) -> dict[str, Any]:
    """Return a field's bounds as pydantic holds them (not through the JSON schema)."""
    words = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}
    found: dict[str, Any] = {}
    for constraint in RunParams.model_fields[name].metadata:
        for attribute, keyword in words.items():
            if getattr(constraint, attribute, None) is not None:
                found[keyword] = getattr(constraint, attribute)
    return found


def probes(name: str) -> list[Any]:
    """Return values around each bound of a field (the deployment's too), and an empty one."""
    spec = run_fields()[name]
    step = 1 if spec.value_type == "integer" else 1e-6
    bounds = list(_bounds(name).values())
    if spec.maximum_from:
        bounds.append(RunParams.defaults()[name])  # the setting is its default and its ceiling
    values: list[Any] = [None]
    for bound in bounds:
        values += [bound - step, bound, bound + step]
    if spec.value_type in ("string", "array") and not spec.nullable:
        values.append("" if spec.value_type == "string" else [])
    return values


# What a probe of one field sets beside it, so only that field's own bounds decide (the
# cross-field checks, min <= max, are RunParams's alone: the form checks each field).
PARTNERS = {"max_width": {"min_width": 1}, "max_height": {"min_height": 1}}


def run_params_accept(name: str, value: Any) -> bool:
    """Return whether RunParams takes the value for the field."""
    try:
        RunParams.resolve({**PARTNERS.get(name, {}), name: value})
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def form() -> Any:
    """Return the trigger form as the REST API checks it: the serialized DAG's params."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["burstcv_pipeline"]
    return DagSerialization.from_dict(DagSerialization.to_dict(dag)).params


def form_accepts(form: Any, name: str, value: Any) -> bool:
    """Return whether Airflow's own validation takes the value for the field (trigger or 400)."""
    from airflow.exceptions import ParamValidationError

    try:
        form.deep_merge({name: value}).validate()
    except ParamValidationError as exc:
        assert name in str(exc)  # the refusal names the field
        return False
    return True


@pytest.fixture(scope="module")
def cli_run() -> Any:
    """Return `burstcv run` as click sees it, with a context to convert option values in."""
    import typer

    from burstcv.cli import app

    command = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    return command, command.make_context("run", [])


def cli_accepts(cli_run: Any, name: str, value: Any) -> bool:
    """Return whether `burstcv run` takes the value for the field's option."""
    import typer

    command, ctx = cli_run
    (option,) = [p for p in command.params if p.name == name]
    empty = "auto" if run_fields()[name].auto else "none"  # a field whose empty means auto
    text = empty if value is None else ",".join(value) if isinstance(value, list) else str(value)
    try:
        option.process_value(ctx, text)
    except typer.BadParameter:
        return False
    return True


def test_the_form_run_params_and_the_cli_agree_field_by_field(form: Any, cli_run: Any) -> None:
    command, ctx = cli_run
    options = {p.name: p for p in command.params if p.name in RunParams.model_fields}
    assert list(form) == list(RunParams.model_fields) == list(options), "names"
    defaults = RunParams.defaults()
    for name, spec in run_fields().items():
        param, option = form.get_param(name), options[name]
        assert option.opts[0] == "--" + name.replace("_", "-")
        # Defaults: the form shows this deployment's; the CLI leaves a setting's to RunParams.
        assert param.value == defaults[name], name
        assert param.schema["title"] == spec.title and param.description == spec.description
        if spec.default_from:
            assert option.default is None and option.show_default == spec.default_from
        elif spec.value_type == "array":
            assert option.process_value(ctx, option.default) == defaults[name], name
        else:
            assert option.default == defaults[name], name
        # Bounds and emptiness: each side refuses exactly what RunParams refuses.
        for value in probes(name):
            expected = run_params_accept(name, value)
            assert form_accepts(form, name, value) is expected, (name, value)
            # On the command line, an option not given is the default: "none" is text.
            if spec.value_type != "boolean" and (value is not None or spec.nullable):
                assert cli_accepts(cli_run, name, value) is expected, (name, value)
    for name, value in (("model", "vgg99"), ("compute_backend", "gpu"), ("instance_types", [])):
        assert not run_params_accept(name, value)
        assert not form_accepts(form, name, value)


def test_the_form_refuses_out_of_bounds_values_instead_of_clamping_them(form: Any) -> None:
    for name in form:
        schema = form.get_param(name).schema
        # The UI's number input clamps to top-level bounds without a word; under allOf,
        # Airflow's validation refuses the trigger and the form shows why.
        assert not {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(schema)
    assert not form_accepts(form, "epochs", 0)
    assert form_accepts(form, "drift_max", None)  # a field that may be empty
    assert not form_accepts(form, "near_duplicate_max_distance", 17)


def test_the_clean_up_finds_the_backend_of_a_run_refused_for_another_field(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = {"epoch": 3, "compute_backend": "ec2"}
    with pytest.raises(ValidationError):
        RunParams.resolve(refused)
    assert RunParams.backend_of(refused) == "ec2"
    monkeypatch.setenv("BURSTCV_COMPUTE_BACKEND", "ec2")
    get_settings.cache_clear()
    assert RunParams.backend_of({"epochs": 0}) == "ec2"  # the deployment's default
    with pytest.raises(ValidationError):
        RunParams.backend_of({"compute_backend": "gpu"})


def test_every_model_param_reaches_the_training_job() -> None:
    """A model param declared in RunParams and forgotten on its way to job.json fails here."""
    from burstcv.params import JOB_SHAPED, Affects, job_values, params_that
    from burstcv_spec.contracts import TrainingChoice

    for name in params_that(Affects.MODEL):
        assert name in JOB_SHAPED or name in JobSpec.model_fields, (
            f"model param {name} is neither a JobSpec field nor shaped for the job (JOB_SHAPED)"
        )
    # Every direct model param, set away from its default, arrives in the job's values as set;
    # the recipe's resolved values win over the params' auto ones.
    given = {
        "dataset_uri": "/d",
        "lr_range_test": True,
        "freeze_backbone_epochs": 2,
        "backbone_lr_scale": 0.25,
        "seed": 7,
        "pretrained": "DEFAULT",
        "model": "resnet18",
    }
    params = RunParams.resolve(given)
    training = TrainingChoice(
        model="resnet18",
        pretrained="IMAGENET1K_V1",
        batch_size=48,
        learning_rate=0.03,
        epochs=9,
        optimizer="adamw",
        warmup_steps=11,
        early_stop_patience=4,
        derived=["batch_size"],
        reason="test",
    )
    values = job_values(params, training)
    job = JobSpec.model_validate(
        {**values, "run_id": "r", "classes": ["a", "b"], "train_shards": ["t"]}
        | {"val_shards": ["v"], "preprocess": {}, "output_uri": "/o"}
    )
    expected = {
        "arch": "resnet18",
        "pretrained": "IMAGENET1K_V1",
        "batch_size": 48,
        "learning_rate": 0.03,
        "epochs": 9,
        "optimizer": "adamw",
        "warmup_steps": 11,
        "early_stop_patience": 4,
        "lr_range_test": True,
        "freeze_backbone_epochs": 2,
        "backbone_lr_scale": 0.25,
        "seed": 7,
    }
    assert {k: getattr(job, k) for k in expected} == expected
    direct = {n for n in params_that(Affects.MODEL) if n not in JOB_SHAPED}
    assert direct <= set(values), "a model param did not reach job_values"
