"""Build real ONNX classifiers (no torch), registries as docs/contracts.md says, and images."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from localserver import LocalServer as Server
from localserver import prediction_service
from onnx import TensorProto, helper
from PIL import Image

from burstcv_serving.settings import Settings

MODEL_NAME = "digits"
NUM_CLASSES = 10
IMAGE_SIZE = 32


def make_classifier_onnx(
    version: int,
    *,
    num_classes: int = NUM_CLASSES,
    slow: bool = False,
    image_size: int = IMAGE_SIZE,
) -> bytes:
    """Return a real classifier: GlobalAveragePool → Flatten → Gemm, [N,3,H,W] → logits.

    The bias makes class ``version % num_classes`` win by a wide margin on any plain image,
    so a response's top class tells which version computed it. ``slow`` upsamples the input
    to 1024x1024 first, so a batch takes milliseconds (to fill the queue on purpose).
    """
    rng = np.random.default_rng(version)
    weight = (rng.standard_normal((num_classes, 3)) * 0.1).astype(np.float32)
    bias = np.zeros(num_classes, dtype=np.float32)
    bias[version % num_classes] = 8.0
    nodes = []
    pool_input = "input"
    initializers = [
        helper.make_tensor("W", TensorProto.FLOAT, weight.shape, weight.ravel().tolist()),
        helper.make_tensor("B", TensorProto.FLOAT, bias.shape, bias.tolist()),
    ]
    if slow:
        initializers.append(helper.make_tensor("sizes", TensorProto.INT64, [4], [1, 3, 1024, 1024]))
        initializers.append(helper.make_tensor("roi", TensorProto.FLOAT, [0], []))
        initializers.append(helper.make_tensor("scales", TensorProto.FLOAT, [0], []))
        # Batch size is dynamic: take N from the input's shape.
        nodes += [
            helper.make_node("Shape", ["input"], ["in_shape"], end=1),
            helper.make_node("Slice", ["sizes", "one", "four"], ["hw"]),
            helper.make_node("Concat", ["in_shape", "hw"], ["out_sizes"], axis=0),
            helper.make_node("Resize", ["input", "roi", "", "out_sizes"], ["big"], mode="linear"),
        ]
        initializers.append(helper.make_tensor("one", TensorProto.INT64, [1], [1]))
        initializers.append(helper.make_tensor("four", TensorProto.INT64, [1], [4]))
        pool_input = "big"
    nodes += [
        helper.make_node("GlobalAveragePool", [pool_input], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["features"], axis=1),
        helper.make_node("Gemm", ["features", "W", "B"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        f"tiny_classifier_v{version}",
        [
            helper.make_tensor_value_info(
                "input", TensorProto.FLOAT, ["N", 3, image_size, image_size]
            )
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", num_classes])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()


def model_json(
    version: int | None,
    sha256: str,
    *,
    num_classes: int = NUM_CLASSES,
    image_size: int = IMAGE_SIZE,
) -> dict:
    """Return a model.json as the export stage writes it (docs/contracts.md)."""
    meta = {
        "format_version": 1,
        "name": MODEL_NAME,
        "arch": "tiny-gap-gemm",
        "classes": [str(i) for i in range(num_classes)],
        "onnx_file": "model.onnx",
        "sha256": sha256,
        "opset": 18,
        "input": {"name": "input", "shape": [None, 3, image_size, image_size], "dtype": "float32"},
        "output": {"name": "logits", "kind": "logits"},
        "preprocess": {
            "height": image_size,
            "width": image_size,
            "mean": [0.5, 0.5, 0.5],
            "std": [0.25, 0.25, 0.25],
            "interpolation": "bilinear",
            "color_mode": "RGB",
            "layout": "NCHW",
            "scale": 1 / 255,
            "formats": ["PNG", "JPEG", "WEBP"],
        },
        "metrics": {"val_accuracy": 0.9 + (version or 0) / 1000},
        "dataset_fingerprint": "0" * 64,
        "source_commit": "unknown",
        "run_id": f"test-run-{version}",
        "created_at": "2025-01-01T00:00:00Z",
    }
    if version is not None:
        meta["version"] = version
    return meta


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that readers see the old or the new content, never a half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass
class Registry:
    """Publish versions and move aliases in a local registry folder."""

    root: Path
    name: str = MODEL_NAME

    def version_dir(self, version: int) -> Path:
        return self.root / self.name / "versions" / str(version)

    def publish(
        self,
        version: int,
        onnx_bytes: bytes | None = None,
        *,
        claimed_sha256: str | None = None,
        slow: bool = False,
        image_size: int = IMAGE_SIZE,
        latency_slo_ms: float | None = None,
    ) -> str:
        """Write versions/<n>/{model.onnx, model.json, entry.json}; return the file's sha256.

        ``latency_slo_ms``: the gate's verdict in the entry, its latency_p95 check held to it
        (None: no gate recorded, as for a version registered by hand).
        """
        if onnx_bytes is None:
            onnx_bytes = make_classifier_onnx(version, slow=slow, image_size=image_size)
        sha = hashlib.sha256(onnx_bytes).hexdigest()
        directory = self.version_dir(version)
        write_atomic(directory / "model.onnx", onnx_bytes)
        meta = model_json(version, claimed_sha256 or sha, image_size=image_size)
        write_atomic(directory / "model.json", json.dumps(meta).encode())
        entry = {  # a RegistryEntry, as Registry.register writes it
            "schema_version": 1,
            "status": "accepted",
            "version": version,
            "model": self.name,
            "sha256": meta["sha256"],
            "registered_at": "2025-01-01T00:00:00Z",
            "lineage": {
                "run_id": meta["run_id"],
                "dataset_fingerprint": meta["dataset_fingerprint"],
                "source_commit": meta["source_commit"],
            },
        }
        if latency_slo_ms is not None:
            entry["gate"] = {
                "promote": True,
                "reasons": [],
                "checks": [
                    {"name": "error_rate", "passed": True, "observed": 0.0, "limit": 0.0},
                    {
                        "name": "latency_p95",
                        "passed": True,
                        "observed": latency_slo_ms / 2,
                        "limit": latency_slo_ms,
                    },
                ],
                "suggestions": [],
                "summary": "promote",
                "failed_figures": [],
            }
        write_atomic(directory / "entry.json", json.dumps(entry).encode())
        return claimed_sha256 or sha

    def move_alias(self, version: int, sha256: str, alias: str = "production") -> None:
        """Point the alias at a version atomically."""
        body = {"version": version, "sha256": sha256, "updated_at": "2025-01-01T00:00:00Z"}
        write_atomic(self.root / self.name / "aliases" / f"{alias}.json", json.dumps(body).encode())

    def publish_and_promote(self, version: int, **kwargs: object) -> str:
        sha = self.publish(version, **kwargs)  # type: ignore[arg-type]
        self.move_alias(version, sha)
        return sha


def make_settings(registry: Registry, **overrides: object) -> Settings:
    """Return service settings for a registry (no polling unless asked)."""
    values: dict[str, object] = {
        "registry_uri": str(registry.root),
        "model_name": registry.name,
        "poll_interval_s": 0,
        "intra_op_threads": 1,
        "max_batch_size": 8,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def image_bytes(fmt: str, size: tuple[int, int] = (40, 30), color: int = 128) -> bytes:
    """Return an encoded plain image in a Pillow format (PNG, JPEG, WEBP, GIF, BMP)."""
    buf = io.BytesIO()
    Image.new("RGB", size, (color, color, color)).save(buf, fmt)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """Return a PNG that declares width x height but carries no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


# The service's HTTP protocols (burstcv_serving.protocol.protocol_for): its own, admitting
# requests as their headers are parsed, and uvicorn's public one, admitting in ASGI middleware.
PROTOCOLS = ("fast", "public")
# What the service logs when it serves with uvicorn's public protocol.
PUBLIC_PROTOCOL_LOG = "fast HTTP protocol off"


@contextlib.contextmanager
def running_server(
    registry: Registry, log_dir: Path, *, protocol: str = "fast", **env: str
) -> Iterator[Server]:
    """Run ``python -m burstcv_serving`` on a free port until the block ends.

    ``env`` adds BURSTCV_SERVING_* settings (name without the prefix, e.g. MAX_QUEUE="4").
    ``protocol`` (one of PROTOCOLS) says which HTTP protocol it serves with; its log says
    which one ran, and that is checked before the block starts.
    """
    settings = {
        "REGISTRY_URI": registry.root,
        "POLL_INTERVAL_S": 0,
        "INTRA_OP_THREADS": 1,
        "FAST_PROTOCOL": str(protocol == "fast").lower(),
        "LOG_LEVEL": "info",  # the line naming the public protocol
    }
    with prediction_service(
        {**settings, **env}, log_path=log_dir / "server.log", timeout_s=30
    ) as server:
        public = PUBLIC_PROTOCOL_LOG in server.log_path.read_text(errors="replace")
        assert public == (protocol == "public"), (
            f"not the {protocol} protocol:\n{server.log_tail()}"
        )
        yield server
