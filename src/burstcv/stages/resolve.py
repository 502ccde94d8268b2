"""Resolve a run once (run.json) and decide what it trains: the params, prices and budget
first, then what validate derives from the data, and whether production already is this model.
Every stage reads the run through ``resolved_run``; a failed stage reports an error from here."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from burstcv import lineage
from burstcv.cost.budget import UnpricedRunError, resolve_costs
from burstcv.cost.model import BudgetTooSmallError
from burstcv.params import EXPORT_PARAMS, TRAINING_PARAMS, ResolvedRun, RunParams
from burstcv.settings import Settings, get_settings
from burstcv_spec import storage
from burstcv_spec.contracts import (
    ImageSizeChoice,
    PreprocessBlock,
    RunRef,
    SkipRecord,
    TrainingChoice,
    Validated,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import RunLayout

log = logging.getLogger(__name__)


class StageError(RuntimeError):
    """Raise when a stage cannot continue; the message is the one-line reason users see."""


class ValidationFailed(StageError):
    """Raise when the dataset fails its checks: nothing that costs money may run after it."""


class TrainingFailed(StageError):
    """Raise when the training box reported FAILED or vanished without a result."""


def run_layout(run: RunRef | str, settings: Settings | None = None) -> RunLayout:
    """Return the folders and files of a run under the configured artifact root."""
    s = settings or get_settings()
    return RunLayout.of(s.artifact_root, run.run_key if isinstance(run, RunRef) else run)


def resolve_run(
    run: RunRef, params: RunParams, settings: Settings | None = None, *, trigger: str = "cli"
) -> ResolvedRun:
    """Resolve the run once and write it to run.json (params, prices, budget); one that cannot
    be had or priced fails here (ValidationFailed), before anything is rented."""
    s = settings or get_settings()
    try:
        params.check_compute()
        params.check_weights()  # the form cannot check weights; fail before renting anything
        costs = resolve_costs(params, s)
    except (ValueError, UnpricedRunError, BudgetTooSmallError) as exc:
        raise ValidationFailed(str(exc)) from exc
    log.info("budget: %s", costs.budget_reason)
    resolved = ResolvedRun(
        run_id=run.airflow_run_id,
        trigger=trigger,
        started_at=lineage.utc_now_iso(),
        params=params,
        costs=costs,
    )
    write_artifact(run_layout(run, s).record, resolved)
    return resolved


def resolved_run(run: RunRef | str, settings: Settings | None = None) -> ResolvedRun:
    """Return the run as its first task resolved it (run.json), with what validate added."""
    uri = run_layout(run, settings).record
    if not storage.exists(uri):
        raise StageError(f"{uri} does not exist: the run's first task (plan_scan) resolves it")
    return read_artifact(uri, ResolvedRun)


def run_backend(run: RunRef, given: dict[str, Any], settings: Settings | None = None) -> str:
    """Return the run's compute backend: as resolved, or (no run.json: the run was refused
    before anything was rented) as the trigger gave it, whatever its other values."""
    if storage.exists(run_layout(run, settings).record):
        return resolved_run(run, settings).params.compute_backend
    return RunParams.backend_of(given, settings)


def choose_training(
    params: RunParams, *, train_images: int, photos: bool, settings: Settings | None = None
) -> TrainingChoice:
    """Return how the run will train: its explicit values, the rest derived from the data.
    ``pretrained=auto`` fetches the model's ImageNet weights for photos, or trains from
    scratch with a warning. Raises ValueError when the weights cannot seed the model."""
    from burstcv.training.names import MODEL_AUTO, pretrained_kind
    from burstcv.training.recipe import RecipeRequest, choose_recipe

    s = settings or get_settings()
    recipe = choose_recipe(
        train_images,
        photos=photos,
        request=RecipeRequest(
            model=None if params.model == MODEL_AUTO else params.model,
            batch_size=params.batch_size,
            learning_rate=params.learning_rate,
            epochs=params.epochs,
            optimizer=None if params.optimizer == "auto" else params.optimizer,
            warmup_steps=params.warmup_steps,
            early_stop_patience=params.early_stop_patience,
            batch_scaling=params.batch_scaling,
            nodes=params.num_nodes,
        ),
    )
    derived, reason, warning = list(recipe.derived), recipe.reason, None
    pretrained = params.pretrained
    if pretrained_kind(pretrained) == "auto":
        from burstcv.training.weights import auto_pretrained, weights_store_uri

        auto = auto_pretrained(
            recipe.model, photos=photos, store=weights_store_uri(s.artifact_root)
        )
        pretrained, warning = auto.pretrained, auto.warning
        derived.append("pretrained")
        reason = f"weights {auto.reason}; {reason}"
    if params.model == MODEL_AUTO or params.pretrained != pretrained:
        params.check_weights(recipe.model, pretrained)  # what the form could not check
    chosen = {k: v for k, v in asdict(recipe).items() if k in TrainingChoice.model_fields}
    chosen.update(pretrained=pretrained, derived=derived, reason=reason, warning=warning)
    return TrainingChoice.model_validate(chosen)


def derived(resolved: ResolvedRun) -> tuple[ImageSizeChoice, TrainingChoice]:
    """Return what validate derived from the data (run.json), or raise StageError."""
    if resolved.image_size is None or resolved.training is None:
        raise StageError(
            f"run {resolved.run_id} has no image size or training recipe in its run.json: "
            "validate chooses them (run validate first)"
        )
    return resolved.image_size, resolved.training


def _as_chosen(name: str, value: Any, chosen: dict[str, Any]) -> Any:
    """Return ``value`` as the run trains it: auto (empty, or "auto") is what validate chose.
    The same data and other params make the same choice, so a run on auto and a recorded run
    that named the value auto chose are one choice, either way round."""
    if name in chosen and (value is None or value == "auto"):
        return chosen[name]
    return value


def nothing_new_to_train(
    run: RunRef, validated: Validated, *, settings: Settings | None = None
) -> str | None:
    """Return why this run need not train (it would remake production), or None to train.

    It would when production was made from the same validated data and params that matter
    (``TRAINING_PARAMS``, ``EXPORT_PARAMS``, the eval transform). ``force_train`` always trains."""
    from burstcv.registry.registry import PRODUCTION, Registry

    s = settings or get_settings()
    resolved = resolved_run(run, s)
    params, size = resolved.params, resolved.image_size
    if size is None:
        raise StageError(f"run {resolved.run_id} has no image size in its run.json: validate first")
    registry = Registry(s.registry_uri, s.model_name)
    alias = registry.get_alias(PRODUCTION)
    if alias is None:
        return None
    entry = registry.entry(alias.version)
    if entry.lineage.dataset_fingerprint != validated.fingerprint:
        return None
    if params.force_train:
        log.info(
            "the dataset is production v%d's (fingerprint %s); training anyway: force_train",
            alias.version,
            validated.fingerprint[:12],
        )
        return None
    if entry.params is None:
        return None  # registered outside the pipeline: what made it is unknown
    card = registry.model_card(alias.version)
    if differing := _differing(resolved, size, entry.params, card.preprocess, s):
        log.info(
            "the dataset is production v%d's, but %s differ: training",
            alias.version,
            ", ".join(differing),
        )
        return None
    mine = params.model_dump(mode="json")
    same = ", ".join(
        f"{k} {mine[k]}"
        for k in TRAINING_PARAMS + EXPORT_PARAMS
        if mine.get(k) not in (None, []) and not (k == "pretrained" and mine[k] == "none")
    )
    reason = (
        f"nothing new to train on: the validated dataset (fingerprint "
        f"{validated.fingerprint[:12]}) and the params that matter ({same}, image size "
        f"{size.px} px) are those of production version {alias.version} (run "
        f"{entry.lineage.run_id or '?'}); no compute was rented. Trigger "
        "with force_train to train anyway."
    )
    write_artifact(
        run_layout(run, s).skip,
        SkipRecord(
            reason=reason,
            production_version=alias.version,
            fingerprint=validated.fingerprint,
            decided_at=lineage.utc_now_iso(),
        ),
    )
    log.info("%s", reason)
    return reason


def _differing(
    resolved: ResolvedRun,
    size: ImageSizeChoice,
    recorded: dict[str, Any],
    preprocess: PreprocessBlock,
    s: Settings,
) -> list[str]:
    """Return the params that matter (and the image size) that differ from production's."""
    mine = resolved.params.model_dump(mode="json")
    # A param production's record lacks (added since) had its default then.
    defaults = RunParams.defaults(s)
    chosen: dict[str, Any] = {}  # what validate chose for each param left on auto
    if (training := resolved.training) is not None:
        chosen = training.model_dump(include=set(training.derived) & set(RunParams.model_fields))
    differing = [
        k
        for k in TRAINING_PARAMS + EXPORT_PARAMS
        if _as_chosen(k, recorded.get(k, defaults.get(k)), chosen)
        != _as_chosen(k, mine.get(k), chosen)
    ]
    stored = (preprocess.height, preprocess.width, preprocess.resize_short)
    if stored != (size.px, size.px, size.resize_short):
        differing.append("image size")
    return differing
