"""What the cost model knows of a device: its peak compute, its link bandwidths (to its peers, and to
its host's memory) and its memory.

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
    """One accelerator: dense bf16 FLOP/s, bytes/s per device on its fast links, memory in bytes, and
    bytes/s one way between its memory and its host's (`host_bandwidth`: PCIe, or NVLink-C2C)."""

    flops: float
    bandwidth: float
    memory: float
    host_bandwidth: float


DEVICE_KINDS: dict[str, DeviceKind] = {
    # vendor data sheets: dense bf16 tensor-core peak, NVLink bandwidth one way, HBM, host link one
    # way (PCIe Gen5 x16: 128 GB/s both ways; Gen4: 64 GB/s; GH200's NVLink-C2C: 900 GB/s both ways)
    "H100": DeviceKind(989e12, 450e9, 80.0 * GiB, 64e9),
    "H200": DeviceKind(989e12, 450e9, 141e9, 64e9),
    "A100": DeviceKind(312e12, 300e9, 80.0 * GiB, 32e9),
    "GH200": DeviceKind(989e12, 450e9, 96e9, 450e9),
}
"""Device kinds by name (case-insensitive in `kind_of`)."""

HOST_BANDWIDTH = 32e9
"""Bytes/s one way between a device's memory and its host's where no device kind is named: PCIe
Gen4 x16. (A CPU device's "host" memory is its own RAM; jshard's CPU devices are stand-ins for
planning, priced as the accelerator they stand for.)"""


def kind_of(name: str) -> tuple[str, DeviceKind] | None:
    """The known kind `name` stands for (`"h100"`, `"NVIDIA H100 80GB HBM3"`, `"NVIDIA GH200 480GB"`:
    the longest known name it holds), or None."""
    upper = name.upper()
    found = [known for known in DEVICE_KINDS if known in upper]
    if not found:
        return None
    known = max(found, key=len)
    return known, DEVICE_KINDS[known]


def device_memory(devices: Sequence) -> float | None:
    """Bytes one of `devices` can hold: the allocator's limit where the backend reports one (GPU,
    TPU), else None (CPU)."""
    if not devices:
        return None
    stats = devices[0].memory_stats()  # None where the backend keeps none (CPU)
    return float(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None
