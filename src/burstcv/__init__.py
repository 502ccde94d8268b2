"""burstcv: train vision models on ephemeral GPUs, serve them on right-sized CPUs."""

from __future__ import annotations

__version__ = "0.1.0"
