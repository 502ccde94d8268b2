"""A photo dataset through the whole DAG: fine-tuned from a state_dict, exported, gated, served.

The photos are the shipped-photo set (200-800 px JPEGs, some EXIF-rotated, CMYK or 16-bit);
the run trains at 64 px from "pretrained" weights made here (resnet10 in torchvision's
layout, taught grating orientations), in its own registry, served by its own service. The
served answer for a photo must be torch's, through the photo eval transform.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from airflow.dag_processing.dagbag import DagBag
from burstcv_testkit import pretrain_on_gratings
from localserver import prediction_service
from torch.nn import functional as F

from burstcv.data.photos import write_photo_dataset
from burstcv.registry.registry import PRODUCTION, Registry
from burstcv.settings import get_settings
from burstcv.training.models import build_model
from burstcv.training.train import load_checkpoint
from burstcv_spec import storage
from burstcv_spec.contracts import ModelCard, read_artifact
from burstcv_spec.layout import RunLayout
from burstcv_spec.preprocess import PreprocessSpec, decode_to_uint8
from burstcv_spec.preprocess import normalize as np_normalize

pytestmark = pytest.mark.e2e

ARCH = "resnet10"
IMAGE_SIZE = 64


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photo-run") / "photos"
    write_photo_dataset(root, per_class=(24, 8))
    return root


@pytest.fixture(scope="module")
def pretrained_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Teach resnet10 (torchvision's layout) 4 grating orientations; save its state_dict."""
    path = tmp_path_factory.mktemp("weights") / "gratings.pt"
    return pretrain_on_gratings(path, ARCH, [0.0, 45.0, 90.0, 135.0], size_px=IMAGE_SIZE)


@pytest.fixture(scope="module")
def photo_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Point the pipeline at a registry of its own and start a service on it; yield both."""
    registry = str(tmp_path_factory.mktemp("photo-registry"))
    saved = {k: os.environ.get(k) for k in ("BURSTCV_REGISTRY_URI", "BURSTCV_MODEL_NAME")}
    os.environ["BURSTCV_REGISTRY_URI"] = registry
    os.environ["BURSTCV_MODEL_NAME"] = "photos"
    settings = {"REGISTRY_URI": registry, "MODEL_NAME": "photos", "POLL_INTERVAL_S": 0.5}
    try:
        with prediction_service(settings, ready_path="/healthz") as server:
            os.environ["BURSTCV_SERVING_URL"] = server.url
            get_settings.cache_clear()
            yield registry, server.url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.environ["BURSTCV_SERVING_URL"] = ""
        get_settings.cache_clear()


def test_a_photo_dataset_fine_tunes_exports_gates_and_serves_torchs_answer(
    photos: Path, pretrained_file: Path, photo_registry: tuple[str, str]
) -> None:
    registry_uri, url = photo_registry
    dag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags")).dags[
        "burstcv_pipeline"
    ]
    conf = {
        "dataset_uri": str(photos),
        "model": ARCH,
        "pretrained": str(pretrained_file),
        "image_size": IMAGE_SIZE,
        "epochs": 8,
        "batch_size": 16,
        "learning_rate": 0.1,
        "backbone_lr_scale": 0.5,
        "int8": False,
        "accuracy_floor": 0.5,  # plumbing, not accuracy: test_finetune measures that
        "latency_slo_ms": 500.0,  # nor latency: a busy CI machine must not fail it
    }
    dag_run = dag.test(run_conf=conf)
    states = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
    assert str(dag_run.state) == "success", states

    registry = Registry(registry_uri, "photos")
    version = registry.get_alias(PRODUCTION).version
    card = registry.model_card(version)
    # The photo eval transform, the size asked for and the weights' (ImageNet) normalisation.
    assert (card.preprocess.height, card.preprocess.resize_short) == (IMAGE_SIZE, 73)
    assert card.preprocess.mean == pytest.approx([0.485, 0.456, 0.406])

    # What torch says for an EXIF-rotated photo, through the same eval transform...
    layout = RunLayout.of(get_settings().artifact_root, dag_run.run_id)
    checkpoint = load_checkpoint(storage.join(layout.job, "model.pt"))
    assert checkpoint is not None
    model = build_model(ARCH, len(card.classes), IMAGE_SIZE, pretrained=True)
    model.load_state_dict(checkpoint.get("model", checkpoint))
    model.eval()
    spec = PreprocessSpec.from_dict(card.preprocess.model_dump(mode="json"))
    photo = sorted((photos / "val" / "flower").glob("0000.jpg"))[0]
    x = np_normalize(decode_to_uint8(photo.read_bytes(), spec)[None], spec)
    with torch.inference_mode():
        torch_probs = F.softmax(model(torch.from_numpy(x)), dim=1)[0].numpy()

    # ...is what the service answers with the deployed version.
    response = httpx.post(
        f"{url}/v1/predict",
        files={"file": (photo.name, photo.read_bytes(), "image/jpeg")},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["version"] == version
    served = {p["label"]: p["score"] for p in answer["predictions"]}
    best = card.classes[int(np.argmax(torch_probs))]
    assert answer["predictions"][0]["label"] == best
    for label, score in served.items():
        assert score == pytest.approx(float(torch_probs[card.classes.index(label)]), abs=1e-3)
    read_artifact(storage.join(layout.model, "model.json"), ModelCard)
