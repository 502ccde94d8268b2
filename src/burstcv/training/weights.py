"""Resolve, fetch, check and load the pretrained weights a run starts from.

Named weights are downloaded by torchvision once, then kept in the artifact store by sha256.
``check_pretrained`` needs no GPU, so the orchestrator can refuse a run before renting one.
"""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
from torch import nn
from torchvision.models import get_model_weights
from torchvision.models._api import WeightsEnum

from burstcv import lineage
from burstcv.training.models import architecture, build_model, head_prefix
from burstcv.training.names import ARCHITECTURE_NAMES, check_architecture, pretrained_kind
from burstcv_spec import storage
from burstcv_spec.contracts import PretrainedLoad

log = logging.getLogger(__name__)

Triple = tuple[float, float, float]

STORE_INDEX_FORMAT = 1
# Where a training checkpoint, or a Lightning-style one, keeps its weights.
_NESTED_STATE_KEYS = ("model", "state_dict")


class PretrainedError(ValueError):
    """Raise when pretrained weights cannot be used; the one-line message says why."""


def weights_store_uri(artifact_root: str) -> str:
    """Return where named weights are kept by sha256: ``<artifact root>/weights``."""
    return storage.join(artifact_root, "weights")


def resolve_weights(arch: str, name: str) -> WeightsEnum:
    """Return the torchvision weights ``name`` of ``arch``, or raise listing the valid names."""
    tv_name = architecture(arch).torchvision_name
    if tv_name is None:
        with_weights = [a for a in ARCHITECTURE_NAMES if architecture(a).torchvision_name]
        raise PretrainedError(
            f"{arch} has no torchvision weights; use pretrained 'none' or a state_dict URI, "
            f"or a model that has weights: {', '.join(with_weights)}"
        )
    enum = get_model_weights(tv_name)
    member = name.removeprefix(f"{enum.__name__}.")
    if member not in enum.__members__:
        raise PretrainedError(
            f"unknown weights {name!r} for {arch}; choose {', '.join(enum.__members__)}"
        )
    return enum[member]


def weights_key(weights: WeightsEnum) -> str:
    """Return the full name of torchvision weights (``DEFAULT`` resolved): the store's key."""
    return f"{type(weights).__name__}.{weights.name}"


def normalization(
    arch: str, pretrained: str, dataset_mean: Triple, dataset_std: Triple
) -> tuple[Triple, Triple]:
    """Return the (mean, std) a model must be trained and served with: from scratch the
    dataset's, torchvision weights theirs, a state_dict URI ImageNet's."""
    kind = pretrained_kind(pretrained)
    if kind == "none":
        return dataset_mean, dataset_std
    if kind == "uri":
        # Imported here: the training wheel ships no burstcv_spec.preprocess (and no Pillow).
        from burstcv_spec.preprocess import IMAGENET_MEAN, IMAGENET_STD

        return IMAGENET_MEAN, IMAGENET_STD
    transform = resolve_weights(arch, pretrained).transforms()
    mean, std = (tuple(float(v) for v in transform.mean), tuple(float(v) for v in transform.std))
    if len(mean) != 3 or len(std) != 3:
        raise PretrainedError(f"weights {pretrained!r} of {arch} do not name an RGB mean/std")
    return mean, std


def _reason(exc: BaseException) -> str:
    """Return the part of a torch.load error that says what was wrong, on one line."""
    text = str(exc)
    # torch's refusal buries the culprit in advice (allowlist it) unfit for untrusted files.
    culprit = re.search(r"Unsupported (global: GLOBAL \S+|operand \d+)", text)
    if culprit:
        return culprit.group(0)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def read_state_dict(data: bytes, source: str) -> dict[str, torch.Tensor]:
    """Load weights with ``weights_only=True``; refuse anything but a state dict of tensors (a
    training checkpoint gives its ``model``; DistributedDataParallel's ``module.`` is dropped)."""
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # untrusted bytes: any failure to parse them is the file's fault
        if isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in str(exc):
            raise PretrainedError(
                f"{source} is not a plain state dict: it pickles code or objects, which "
                f"torch.load(weights_only=True) refuses ({_reason(exc)}); save weights "
                "with torch.save(model.state_dict(), path)"
            ) from exc
        raise PretrainedError(f"{source} is not a torch weights file ({_reason(exc)})") from exc
    if isinstance(obj, dict):
        obj = next((obj[k] for k in _NESTED_STATE_KEYS if isinstance(obj.get(k), dict)), obj)
    if not isinstance(obj, dict) or not obj:
        holds = "an empty dict" if isinstance(obj, dict) else f"a {type(obj).__name__}"
        raise PretrainedError(f"{source} is not a state dict of name -> tensor (it holds {holds})")
    bad = [k for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if bad:
        raise PretrainedError(
            f"{source} is not a state dict of name -> tensor ({len(bad)} entries are not "
            f"tensors, e.g. {bad[0]!r})"
        )
    if all(k.startswith("module.") for k in obj):
        obj = {k.removeprefix("module."): v for k, v in obj.items()}
    return obj


def read_weights_uri(uri: str) -> dict[str, torch.Tensor]:
    """Read the state_dict at a URI (path, file://, s3://), or raise a one-line PretrainedError."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "s3", "file") and len(parsed.scheme) > 1:  # 1 letter: C:\ drive
        raise PretrainedError(f"weights URI {uri!r}: only paths, file:// and s3:// are supported")
    try:
        data = storage.read_bytes(unquote(parsed.path) if parsed.scheme == "file" else uri)
    except storage.ArtifactNotFoundError as exc:
        raise PretrainedError(f"pretrained weights {uri} not found") from exc
    return read_state_dict(data, uri)


def _index_uri(store: str, weights: WeightsEnum) -> str:
    return storage.join(store, "torchvision", f"{weights_key(weights)}.json")


def blob_uri(store: str, digest: str) -> str:
    """Return the content-addressed URI of a weights file in the store."""
    return storage.join(store, "sha256", f"{digest}.pth")


def _from_store(store: str, weights: WeightsEnum) -> tuple[dict[str, torch.Tensor], str] | None:
    index = _index_uri(store, weights)
    if not storage.exists(index):
        return None
    expected = str(storage.read_json_object(index)["sha256"])
    uri = blob_uri(store, expected)
    try:
        data = storage.read_bytes(uri)
    except storage.ArtifactNotFoundError:
        log.warning("%s names %s, which is gone; downloading again", index, uri)
        return None
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        log.warning("%s has sha256 %s, not %s; downloading again", uri, digest, expected)
        return None
    return read_state_dict(data, uri), uri


def fetch_weights(weights: WeightsEnum, store: str | None) -> tuple[dict[str, torch.Tensor], str]:
    """Return torchvision weights' state dict and its source: the store, else a download (kept)."""
    if store:
        found = _from_store(store, weights)
        if found is not None:
            log.info("read %s from the artifact store: %s", weights_key(weights), found[1])
            return found
    log.info("downloading %s from %s", weights_key(weights), weights.url)
    weights.get_state_dict(progress=False, check_hash=True)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name
    data = cached.read_bytes()
    state = read_state_dict(data, weights.url)
    if not store:
        return state, weights.url
    digest = hashlib.sha256(data).hexdigest()
    uri = storage.write_bytes(blob_uri(store, digest), data)
    storage.write_json(
        _index_uri(store, weights),
        {
            "format_version": STORE_INDEX_FORMAT,
            "weights": weights_key(weights),
            "url": weights.url,
            "sha256": digest,
            "bytes": len(data),
            "uri": uri,
            "stored_at": lineage.utc_now_iso(),
        },
    )
    log.info("kept %s in the artifact store: %s", weights_key(weights), uri)
    return state, uri


def _fit(
    model: nn.Module, arch: str, state: dict[str, torch.Tensor], source: str
) -> tuple[dict[str, torch.Tensor], PretrainedLoad]:
    """Return the tensors of ``state`` to load into the backbone, or raise if they do not fit."""
    own = model.state_dict()
    prefix = head_prefix(arch)
    backbone = [k for k in own if not k.startswith(prefix)]
    mismatched = [k for k in backbone if k in state and state[k].shape != own[k].shape]
    if mismatched:
        k = mismatched[0]
        why = (
            "a resnet trained from scratch at 64 px or less has the small-input stem; a "
            "pretrained one keeps torchvision's"
            if mismatched == ["conv1.weight"]
            else "weights of another architecture?"
        )
        raise PretrainedError(
            f"{source} does not fit {arch}: {len(mismatched)} backbone tensor(s) differ in "
            f"shape, e.g. {k} is {list(state[k].shape)} in the file and {list(own[k].shape)} "
            f"in {arch} ({why})"
        )
    # Old torchvision files predate BatchNorm's num_batches_tracked: a counter, not a weight.
    missing = [k for k in backbone if k not in state and not k.endswith("num_batches_tracked")]
    if missing:
        raise PretrainedError(
            f"{source} does not fit {arch}: {len(missing)} of {len(backbone)} backbone tensors "
            f"are missing from it, e.g. {', '.join(missing[:3])} (weights of another "
            "architecture?)"
        )
    usable = {k: state[k] for k in backbone if k in state}
    report = PretrainedLoad(
        source=source,
        loaded=len(usable),
        head=len(own) - len(backbone),
        unused=len(set(state) - set(usable)),
    )
    return usable, report


def load_pretrained(
    model: nn.Module, arch: str, pretrained: str, *, weights_store: str | None = None
) -> PretrainedLoad:
    """Load the backbone of ``model`` (built with ``pretrained=True``); the head starts fresh."""
    kind = pretrained_kind(pretrained)
    if kind == "none":
        raise ValueError("load_pretrained needs weights; pretrained is 'none'")
    if kind == "torchvision":
        state, source = fetch_weights(resolve_weights(arch, pretrained), weights_store)
    else:
        state, source = read_weights_uri(pretrained), pretrained
    usable, report = _fit(model, arch, state, source)
    model.load_state_dict(usable, strict=False)
    log.info(
        "loaded %d tensors from %s; the classifier head (%d tensors) starts fresh; "
        "%d tensors of the weights unused",
        report.loaded,
        report.source,
        report.head,
        report.unused,
    )
    return report


def check_pretrained(arch: str, pretrained: str) -> None:
    """Raise a one-line error if ``pretrained`` cannot seed ``arch``; downloads nothing."""
    try:
        check_architecture(arch)
        kind = pretrained_kind(pretrained)
    except ValueError as exc:
        raise PretrainedError(str(exc)) from exc
    if kind == "torchvision":
        resolve_weights(arch, pretrained)
    elif kind == "uri":
        state = read_weights_uri(pretrained)
        # The backbone does not depend on the class count or (pretrained) the input size.
        _fit(build_model(arch, 2, 224, pretrained=True), arch, state, pretrained)


@dataclass(frozen=True)
class AutoWeights:
    """Say what ``pretrained=auto`` resolved to, why, and the warning when it fell back."""

    pretrained: str  # "none" or the full torchvision weights name
    reason: str
    warning: str | None = None


def auto_pretrained(arch: str, *, photos: bool, store: str | None) -> AutoWeights:
    """Resolve ``pretrained=auto``: for photos, the architecture's ImageNet weights, fetched
    here into ``store`` so the box never needs the internet (else from scratch, with a warning)."""
    if not photos:
        return AutoWeights("none", "from scratch (small images, not photos)")
    if architecture(arch).torchvision_name is None:
        return AutoWeights("none", f"from scratch ({arch} has no ImageNet weights)")
    weights = resolve_weights(arch, "DEFAULT")
    key = weights_key(weights)
    try:
        _, source = fetch_weights(weights, store)
    except (OSError, RuntimeError, ValueError) as exc:  # no network, a bad download
        return AutoWeights(
            "none",
            f"from scratch ({key} could not be fetched)",
            f"pretrained auto: the ImageNet weights of {arch} ({key}) could not be fetched "
            f"({_reason(exc)}); training from scratch, which needs more data and epochs to reach "
            "the same accuracy",
        )
    return AutoWeights(key, f"{key} (ImageNet), kept in the artifact store: {source}")
