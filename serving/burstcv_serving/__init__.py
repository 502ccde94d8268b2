"""Serve burstcv's ONNX image classifiers on CPU with FastAPI and onnxruntime (no torch)."""

from __future__ import annotations

__version__ = "0.1.0"
