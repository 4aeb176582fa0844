"""What the cost model knows of a device: its peak compute, its link bandwidth and its memory.

`DEVICE_KINDS` holds the accelerators jshard plans for by name (`CostModel.for_device("H100")`,
`jshard plan --device H100`); `device_memory` reads a present device's memory (its allocator's
limit on GPU and TPU; on CPU, where simulated devices share the host, the host's memory divided
among them).
"""

from __future__ import annotations

import os
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
    """Bytes one of `devices` can hold: the allocator's limit where the backend reports one, else
    (CPU) the host's memory divided among the local devices of that platform, else None."""
    if not devices:
        return None
    device = devices[0]
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics raise here  # noqa: BLE001
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    if device.platform == "cpu":
        host = _host_memory()
        return None if host is None else host / max(len(_local_devices(device.platform)), 1)
    return None


def _host_memory() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _local_devices(platform: str) -> list:
    import jax  # noqa: PLC0415  (only where a present device is asked about)

    return jax.local_devices(backend=platform)
