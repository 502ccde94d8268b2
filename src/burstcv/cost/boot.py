"""Say how long a training box takes from its launch to training: as this deployment measured
the type, else an assumed floor for its family (docs/budget.md says where the floors come from).
"""

from __future__ import annotations

from dataclasses import dataclass

from burstcv_spec import storage
from burstcv_spec.contracts import BootTimes, read_artifact, write_artifact

# Seconds from RunInstances to a passed preflight on an AWS Deep Learning AMI: EC2's pending,
# the first boot reading the root volume lazily from its snapshot, the driver's start, the
# wheel's install and torch's first CUDA import. Assumed, not measured by burstcv: a measured
# boot of the type replaces its family's floor.
BOOT_FLOOR_S: dict[str, int] = {
    "g4dn": 420,
    "g5": 480,
    "g5g": 480,
    "g6": 480,
    "g6e": 480,
    "gr6": 480,
    "p3": 540,
    "p3dn": 600,
    "p4d": 600,
    "p4de": 600,
    "p5": 720,
    "p5e": 720,
    "p5en": 720,
}
UNKNOWN_FAMILY_BOOT_S = 600  # a family the table lacks: the slower end of the table
MEASURED_KEPT = 10  # boots kept per type; the slowest of them is the estimate


@dataclass(frozen=True)
class BootEstimate:
    """How long one instance type takes to boot, and where that figure comes from."""

    instance_type: str
    seconds: float
    source: str  # "measured: …" or "assumed: …"


def boot_uri(artifact_root: str, instance_type: str) -> str:
    """Return where the type's measured boots are kept in the artifact store."""
    return storage.join(artifact_root, "boots", f"{instance_type}.json")


def record_boots(artifact_root: str, instance_type: str, seconds: list[float]) -> BootTimes:
    """Add measured boots of ``instance_type`` to its record (the latest MEASURED_KEPT)."""
    uri = boot_uri(artifact_root, instance_type)
    earlier = read_artifact(uri, BootTimes).measured_s if storage.exists(uri) else []
    kept = [*earlier, *(round(s, 1) for s in seconds)][-MEASURED_KEPT:]
    record = BootTimes(instance_type=instance_type, measured_s=kept)
    write_artifact(uri, record)
    return record


def boot_estimate(artifact_root: str, instance_type: str) -> BootEstimate:
    """Return the type's boot: the slowest of its measured boots, else its family's floor."""
    uri = boot_uri(artifact_root, instance_type)
    measured = read_artifact(uri, BootTimes).measured_s if storage.exists(uri) else []
    if measured:
        return BootEstimate(
            instance_type, max(measured), f"measured: the slowest of its last {len(measured)}"
        )
    family = instance_type.split(".")[0]
    if (floor := BOOT_FLOOR_S.get(family)) is None:
        return BootEstimate(
            instance_type, UNKNOWN_FAMILY_BOOT_S, f"assumed: no floor for the {family} family"
        )
    return BootEstimate(instance_type, floor, f"assumed: the {family} family's floor")
