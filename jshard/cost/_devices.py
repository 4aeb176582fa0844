"""What the cost model knows of a device: its peak compute, its link bandwidth and its memory.

`DEVICE_KINDS` holds the accelerators jshard plans for by name (`CostModel.for_device("H100")`,
`jshard plan --device H100`); `device_memory` reads a present device's memory (its allocator's
limit on GPU and TPU). CPU devices report none: they are stand-ins for planning (simulated ones share
the host), so planning on them sets no budget unless a device kind is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

GiB = 2**30


class DeviceKind(NamedTuple):
    """One accelerator: dense bf16 FLOP/s, bytes/s per device on its fast links, memory in bytes."""

    flops: float
    bandwidth: float
    memory: float


DEVICE_KINDS: dict[str, DeviceKind] = {
    # vendor data sheets: dense bf16 tensor-core peak, NVLink bandwidth one way, HBM
    "H100": DeviceKind(989e12, 450e9, 80.0 * GiB),
    "H200": DeviceKind(989e12, 450e9, 141e9),
    "A100": DeviceKind(312e12, 300e9, 80.0 * GiB),
}
"""Device kinds by name (case-insensitive in `kind_of`)."""


def kind_of(name: str) -> tuple[str, DeviceKind] | None:
    """The known kind `name` stands for (`"h100"`, `"NVIDIA H100 80GB HBM3"`), or None."""
    upper = name.upper()
    for known, kind in DEVICE_KINDS.items():
        if known in upper:
            return known, kind
    return None


def device_memory(devices: Sequence) -> float | None:
    """Bytes one of `devices` can hold: the allocator's limit where the backend reports one (GPU,
    TPU), else None (CPU)."""
    if not devices:
        return None
    stats = devices[0].memory_stats()  # None where the backend keeps none (CPU)
    return float(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None
