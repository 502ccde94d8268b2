"""Pretrained weights: named torchvision weights, state_dict URIs, the store, and clear refusals."""

from __future__ import annotations

import hashlib
import json
import pathlib
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torchvision import models as tvm
from torchvision.models import ResNet18_Weights, ResNet50_Weights

from burstcv.training.job import JobSpec
from burstcv.training.models import build_model, head_prefix
from burstcv.training.names import pretrained_kind
from burstcv.training.weights import (
    PretrainedError,
    blob_uri,
    check_pretrained,
    load_pretrained,
    normalization,
    resolve_weights,
    weights_store_uri,
)
from burstcv_spec import storage
from burstcv_spec.preprocess import IMAGENET_MEAN, IMAGENET_STD, PreprocessSpec

DATASET_MEAN = (0.1, 0.2, 0.3)
DATASET_STD = (0.4, 0.5, 0.6)


def _one_line_error(arch: str, pretrained: str) -> str:
    with pytest.raises(PretrainedError) as info:
        check_pretrained(arch, pretrained)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def _backbone(state: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith(head_prefix(arch))}


# ---------------------------------------------------------------------------------------------
# What a pretrained value names


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("none", "none"),
        ("None", "none"),
        ("DEFAULT", "torchvision"),
        ("IMAGENET1K_V2", "torchvision"),
        ("ResNet50_Weights.IMAGENET1K_V2", "torchvision"),
        ("/data/weights/resnet50.pth", "uri"),
        ("weights.pt", "uri"),
        ("file:///data/w.pt", "uri"),
        ("s3://bucket/weights/w", "uri"),
    ],
)
def test_a_pretrained_value_is_none_a_weights_name_or_a_uri(value: str, kind: str) -> None:
    assert pretrained_kind(value) == kind


def test_weights_names_resolve_against_the_architectures_torchvision_enum() -> None:
    assert resolve_weights("resnet50", "DEFAULT") is ResNet50_Weights.IMAGENET1K_V2
    assert resolve_weights("resnet50", "IMAGENET1K_V1") is ResNet50_Weights.IMAGENET1K_V1
    assert resolve_weights("resnet50", "ResNet50_Weights.IMAGENET1K_V1") is (
        ResNet50_Weights.IMAGENET1K_V1
    )
    for arch in ("resnet18", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny"):
        check_pretrained(arch, "DEFAULT")  # nothing is downloaded to check a name


def test_an_unknown_weights_name_lists_the_valid_ones() -> None:
    message = _one_line_error("resnet50", "IMAGENET1K_V9")
    assert message == (
        "unknown weights 'IMAGENET1K_V9' for resnet50; choose IMAGENET1K_V1, IMAGENET1K_V2, DEFAULT"
    )
    # Another architecture's enum spelling is not this one's weights.
    assert "unknown weights" in _one_line_error("resnet50", "ResNet18_Weights.IMAGENET1K_V1")


def test_an_architecture_without_torchvision_weights_says_what_to_do() -> None:
    message = _one_line_error("resnet10", "DEFAULT")
    assert message.startswith("resnet10 has no torchvision weights")
    assert "state_dict URI" in message and "resnet18" in message and "convnext_tiny" in message


def test_a_value_that_is_neither_is_refused_in_job_json() -> None:
    from burstcv_testkit import make_job

    packed_demo = {
        "classes": ["a", "b"],
        "train_shards": ["train.npz"],
        "val_shards": ["val.npz"],
        "spec": PreprocessSpec(),
    }
    with pytest.raises(ValidationError, match="neither 'none', a torchvision weights name"):
        make_job(packed_demo, Path("/tmp/never"), pretrained="imagenet weights")
    with pytest.raises(ValidationError, match="freeze_backbone_epochs needs pretrained weights"):
        make_job(packed_demo, Path("/tmp/never"), freeze_backbone_epochs=1)
    job = make_job(packed_demo, Path("/tmp/never"), pretrained=" DEFAULT ")
    assert (job.pretrained, job.freeze_backbone_epochs, job.backbone_lr_scale) == (
        "DEFAULT",
        0,
        0.1,
    )
    assert JobSpec.model_validate(json.loads(job.model_dump_json())) == job


def test_normalisation_follows_the_weights() -> None:
    assert normalization("resnet18", "none", DATASET_MEAN, DATASET_STD) == (
        DATASET_MEAN,
        DATASET_STD,
    )
    transforms = ResNet50_Weights.IMAGENET1K_V2.transforms()
    mean, std = normalization("resnet50", "DEFAULT", DATASET_MEAN, DATASET_STD)
    assert list(mean) == transforms.mean and list(std) == transforms.std
    assert (mean, std) == (IMAGENET_MEAN, IMAGENET_STD)
    assert normalization("resnet10", "w.pt", DATASET_MEAN, DATASET_STD) == (
        IMAGENET_MEAN,
        IMAGENET_STD,
    )


# ---------------------------------------------------------------------------------------------
# State_dict files: what is refused, with one line each


def test_a_missing_weights_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt"
    assert _one_line_error("resnet18", str(missing)) == f"pretrained weights {missing} not found"
    assert _one_line_error("resnet18", f"file://{missing}") == (
        f"pretrained weights file://{missing} not found"
    )


class Payload:
    """A picklable object that is not a state dict."""

    def __init__(self) -> None:
        self.weights = torch.zeros(3)


class Trap:
    """Unpickling this would run code: create a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (pathlib.Path.touch, (self.marker,))


def test_a_pickle_with_code_is_refused_and_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    torch.save({"fc.weight": Trap(marker)}, tmp_path / "trap.pt")
    message = _one_line_error("resnet18", str(tmp_path / "trap.pt"))
    assert "pickles code or objects" in message and "weights_only=True" in message
    assert "Unsupported global" in message and "torch.save(model.state_dict()" in message
    assert not marker.exists()
    torch.save(Payload(), tmp_path / "object.pt")
    assert "pickles code or objects" in _one_line_error("resnet18", str(tmp_path / "object.pt"))


def test_files_that_are_not_state_dicts_are_refused(tmp_path: Path) -> None:
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    assert _one_line_error("resnet18", str(tmp_path / "list.pt")) == (
        f"{tmp_path / 'list.pt'} is not a state dict of name -> tensor (it holds a list)"
    )
    torch.save({"fc.weight": torch.zeros(1), "epochs": 3}, tmp_path / "mixed.pt")
    assert "'epochs'" in _one_line_error("resnet18", str(tmp_path / "mixed.pt"))
    (tmp_path / "text.pt").write_text('{"fc.weight": [0.0]}')
    assert "is not a torch weights file" in _one_line_error("resnet18", str(tmp_path / "text.pt"))


def test_weights_of_another_architecture_are_refused(tmp_path: Path) -> None:
    torch.save(tvm.resnet18().state_dict(), tmp_path / "r18.pt")
    message = _one_line_error("resnet50", str(tmp_path / "r18.pt"))
    assert message.startswith(f"{tmp_path / 'r18.pt'} does not fit resnet50: ")
    assert "differ in shape" in message and "layer1.0.conv1.weight is [64, 64, 3, 3]" in message
    # A scratch model's small-input stem (3x3) cannot seed the pretrained layout (7x7).
    torch.save(build_model("resnet18", 10, 32).state_dict(), tmp_path / "small.pt")
    message = _one_line_error("resnet18", str(tmp_path / "small.pt"))
    assert "conv1.weight is [64, 3, 3, 3] in the file and [64, 3, 7, 7] in resnet18" in message
    # Too few tensors: a file of one layer.
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, tmp_path / "part.pt")
    assert "backbone tensors are missing" in _one_line_error("resnet18", str(tmp_path / "part.pt"))


# ---------------------------------------------------------------------------------------------
# Loading


def test_loading_keeps_the_backbone_and_makes_a_head_for_the_dataset(tmp_path: Path) -> None:
    torch.manual_seed(1)
    source = tvm.mobilenet_v3_large()  # 1000 ImageNet classes, torchvision's layout
    torch.save(source.state_dict(), tmp_path / "w.pt")
    check_pretrained("mobilenet_v3_large", str(tmp_path / "w.pt"))
    model = build_model("mobilenet_v3_large", 5, 96, pretrained=True)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    report = load_pretrained(model, "mobilenet_v3_large", f"file://{tmp_path / 'w.pt'}")
    loaded = model.state_dict()
    expected = _backbone(source.state_dict(), "mobilenet_v3_large")
    assert report.loaded == len(expected) and report.head == 2 and report.unused == 2
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    assert loaded["classifier.3.weight"].shape == (5, 1280)
    assert torch.equal(loaded["classifier.3.weight"], fresh["classifier.3.weight"])


def test_a_training_checkpoint_or_a_ddp_state_dict_loads_too(tmp_path: Path) -> None:
    source = tvm.resnet18().state_dict()
    torch.save({"model": source, "epoch": torch.tensor(3)}, tmp_path / "ckpt.pt")
    torch.save({f"module.{k}": v for k, v in source.items()}, tmp_path / "ddp.pt")
    for name in ("ckpt.pt", "ddp.pt"):
        model = build_model("resnet18", 3, 224, pretrained=True)
        load_pretrained(model, "resnet18", str(tmp_path / name))
        assert torch.equal(
            model.state_dict()["layer4.1.bn2.running_var"], source["layer4.1.bn2.running_var"]
        )


# ---------------------------------------------------------------------------------------------
# Named weights: downloaded once by torchvision, then read from the artifact store


@pytest.fixture
def torch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point torch's hub cache (where torchvision keeps downloads) at an empty folder."""
    home = tmp_path / "torch-home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home


def _seed_hub_cache(torch_home: Path, url: str, state: dict[str, torch.Tensor]) -> Path:
    # No network here: the file torchvision would download is put where torchvision's own
    # loader looks first (its hub cache); everything after that is the real code path.
    path = torch_home / "hub" / "checkpoints" / url.rsplit("/", 1)[-1]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def _forbid_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(url: str, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"tried to download {url}")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)


def test_named_weights_are_kept_by_sha256_and_read_from_the_store_next_time(
    torch_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(2)
    published = tvm.resnet18().state_dict()
    hub_file = _seed_hub_cache(torch_home, ResNet18_Weights.IMAGENET1K_V1.url, published)
    digest = hashlib.sha256(hub_file.read_bytes()).hexdigest()
    store = weights_store_uri(str(tmp_path / "artifacts"))
    assert store == str(tmp_path / "artifacts" / "weights")

    first = build_model("resnet18", 4, 128, pretrained=True)
    report = load_pretrained(first, "resnet18", "DEFAULT", weights_store=store)
    assert report.source == blob_uri(store, digest) == str(Path(store) / "sha256" / f"{digest}.pth")
    assert hashlib.sha256(Path(report.source).read_bytes()).hexdigest() == digest
    index = json.loads(
        (Path(store) / "torchvision" / "ResNet18_Weights.IMAGENET1K_V1.json").read_text()
    )
    assert index["sha256"] == digest and index["url"] == ResNet18_Weights.IMAGENET1K_V1.url

    # Next run: no hub cache, no download; the store answers, for either spelling.
    hub_file.unlink()
    _forbid_downloads(monkeypatch)
    second = build_model("resnet18", 4, 128, pretrained=True)
    again = load_pretrained(second, "resnet18", "IMAGENET1K_V1", weights_store=store)
    assert again.source == report.source and again.loaded == report.loaded == 120
    for name, tensor in _backbone(published, "resnet18").items():
        assert torch.equal(second.state_dict()[name], tensor), name
    assert not hub_file.exists()


def test_a_corrupt_stored_file_is_downloaded_again(torch_home: Path, tmp_path: Path) -> None:
    published = tvm.resnet18().state_dict()
    hub_file = _seed_hub_cache(torch_home, ResNet18_Weights.IMAGENET1K_V1.url, published)
    store = weights_store_uri(str(tmp_path / "artifacts"))
    report = load_pretrained(
        build_model("resnet18", 4, 128, pretrained=True), "resnet18", "DEFAULT", weights_store=store
    )
    Path(report.source).write_bytes(b"corrupt")
    again = load_pretrained(
        build_model("resnet18", 4, 128, pretrained=True), "resnet18", "DEFAULT", weights_store=store
    )
    assert again.source == report.source
    assert Path(report.source).read_bytes() == hub_file.read_bytes()


# ---------------------------------------------------------------------------------------------
# s3: a state_dict URI and the store under an s3:// artifact root (moto in server mode)


def test_weights_on_s3_are_checked_and_loaded(s3: Any, tmp_path: Path) -> None:
    source = tvm.efficientnet_b0().state_dict()
    torch.save(source, tmp_path / "w.pt")
    storage.upload_file(tmp_path / "w.pt", "s3://artifacts/weights/mine/effnet.pt")
    check_pretrained("efficientnet_b0", "s3://artifacts/weights/mine/effnet.pt")
    assert _one_line_error("efficientnet_b0", "s3://artifacts/weights/mine/gone.pt") == (
        "pretrained weights s3://artifacts/weights/mine/gone.pt not found"
    )
    model = build_model("efficientnet_b0", 3, 64, pretrained=True)
    report = load_pretrained(model, "efficientnet_b0", "s3://artifacts/weights/mine/effnet.pt")
    assert report.loaded == len(_backbone(source, "efficientnet_b0"))
    assert torch.equal(model.state_dict()["features.0.0.weight"], source["features.0.0.weight"])


def test_the_store_works_under_an_s3_artifact_root(
    s3: Any, torch_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = tvm.resnet18().state_dict()
    hub_file = _seed_hub_cache(torch_home, ResNet18_Weights.IMAGENET1K_V1.url, published)
    store = weights_store_uri("s3://artifacts/burstcv")
    model = build_model("resnet18", 4, 128, pretrained=True)
    report = load_pretrained(model, "resnet18", "DEFAULT", weights_store=store)
    digest = hashlib.sha256(hub_file.read_bytes()).hexdigest()
    assert report.source == f"s3://artifacts/burstcv/weights/sha256/{digest}.pth"
    hub_file.unlink()
    _forbid_downloads(monkeypatch)
    again = load_pretrained(
        build_model("resnet18", 4, 128, pretrained=True), "resnet18", "DEFAULT", weights_store=store
    )
    assert again.source == report.source
