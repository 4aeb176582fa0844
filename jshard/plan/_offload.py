"""`OffloadReport`: the state `parallelize(..., offload=...)` keeps in host memory between steps
(MindSpore's heterogeneous storage)."""

from __future__ import annotations

import dataclasses

from jshard._format import human_bytes

HOST_MEMORY = "pinned_host"
"""The memory kind state kept in host memory has (page-locked host memory, which the device reads
by DMA)."""


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadReport:
    """What lives in host memory, and what crosses between host and device each step.

    Attributes:
      what: the offloaded roles, as asked (`("optimizer",)`, `("parameters",)` or both).
      memory_kind: the host memory kind of their shardings (`"pinned_host"`).
      host: paths of the argument leaves kept in host memory (`args[1][0].mu['w']`).
      host_bytes: bytes per device those leaves hold in host memory.
      read_bytes: bytes per device streamed host -> device per step (every offloaded argument but
        the host tables, which only the host reads).
      written_bytes: bytes per device streamed device -> host per step (the results that update them,
        but the host tables, updated on the host).
      args / results: the argument and result leaves (flat indices) in host memory.
      seconds: the streaming's price per step on the cost model's host link
        (`CostModel.host_seconds`).
      why: where the strategy search chose the offload (`mode="auto"` under a memory budget, no
        `offload=` given), why: the budget, and what staying on the device would have cost; else "".
    """

    what: tuple[str, ...]
    memory_kind: str
    host: tuple[str, ...]
    host_bytes: float
    read_bytes: float
    written_bytes: float
    args: tuple[int, ...] = ()
    results: tuple[int, ...] = ()
    seconds: float = 0.0
    why: str = ""

    @property
    def moved_bytes(self) -> float:
        """Bytes per device crossing between host and device per step, both ways."""
        return self.read_bytes + self.written_bytes

    def line(self) -> str:
        """One line for `Plan.summary`."""
        shown = ", ".join(self.host[:4]) + (f", ... ({len(self.host)} leaves)" if len(self.host) > 4 else "")
        what = "+".join(self.what) or "host tables"
        priced = f" ({self.seconds * 1e3:.4g} ms on the host link)" if self.seconds else ""
        return (f"offload {what}: {len(self.host)} leaves in host memory ({self.memory_kind}), "
                f"{human_bytes(self.host_bytes)} per device, not held on the device between steps; streamed "
                f"per step {human_bytes(self.read_bytes)} host->device + {human_bytes(self.written_bytes)} "
                f"device->host per device{priced}: {shown}" + (f"; {self.why}" if self.why else ""))
