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
    """One accelerator: dense bf16 FLOP/s (its data sheet's peak), bytes/s per device on its fast
    links, memory in bytes, bytes/s one way between its memory and its host's (`host_bandwidth`:
    PCIe, or NVLink-C2C), the bf16 matrix-multiply rate a large product reaches (`matmul_flops`),
    the bytes/s of a pass over its own memory (`memory_bandwidth`), and whether its collectives run
    beside its compute (`overlap`: XLA's GPU backend makes them asynchronous and its latency-hiding
    scheduler moves independent work between a collective's start and its end)."""

    flops: float
    bandwidth: float
    memory: float
    host_bandwidth: float
    matmul_flops: float
    memory_bandwidth: float
    overlap: bool = True


DEVICE_KINDS: dict[str, DeviceKind] = {
    # vendor data sheets: dense bf16 tensor-core peak, NVLink bandwidth one way, HBM, host link one
    # way (PCIe Gen5 x16: 128 GB/s both ways; Gen4: 64 GB/s; GH200's NVLink-C2C: 900 GB/s both ways),
    # then the matmul rate and memory bandwidth. The H100's are measured on one H100 SXM 80GB
    # (benchmarks/gpu_results.json: a bf16 8192^3 product under jax.jit, 711 TFLOP/s, 72% of the peak;
    # a jitted elementwise pass over 1 GiB, 2504 GB/s read + written, 75% of the 3.35 TB/s data
    # sheet); the H200's on one H200 (2026-11-28, `python -m benchmarks._gpu --quick`: 653 TFLOP/s, 66%;
    # 3079 GB/s, 64% of 4.8 TB/s); the others' are their data sheets' (peak and HBM bandwidth), not yet measured.
    "H100": DeviceKind(989e12, 450e9, 80.0 * GiB, 64e9, 711e12, 2504e9),
    "H200": DeviceKind(989e12, 450e9, 141e9, 64e9, 653e12, 3079e9),
    "A100": DeviceKind(312e12, 300e9, 80.0 * GiB, 32e9, 312e12, 2.039e12),
    "GH200": DeviceKind(989e12, 450e9, 96e9, 450e9, 989e12, 4.0e12),
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
