"""`WorkReport`: how much of the single-device work each device does under a plan and, where a
device does nearly all of it, what the data-parallel plan of the same program would cost."""

from __future__ import annotations

import dataclasses

from jshard.search import REPLICATED_SHARE


@dataclasses.dataclass(frozen=True, slots=True)
class WorkReport:
    """The work per device of a planned program, against one device doing it all.

    Attributes:
      devices: the device count.
      flops: the program's FLOPs per call on one device holding everything (loops weighted by
        their trip counts).
      device_flops: one device's FLOPs per call under the plan (each operator's divided by the
        devices its strategy cuts it over).
      comm_seconds / compute_seconds: the plan's predicted collective and compute time per call
        (the cost model's α–β, and each operator's roofline: `CostModel.compute_seconds`).
      data_comm_seconds / data_compute_seconds: the same for the data-parallel plan of the same
        traced program (its batch arguments' dim 0 cut over every device, the parameters
        replicated, the propagation engine laying out the rest), priced only where this plan's
        `share` is at least `REPLICATED_SHARE` and it is not itself `mode="data"`; else None.
      data_missing: why the data-parallel plan was not priced there (e.g. the batch does not
        divide), or `""`.
      mode: the plan's `parallelize` mode.
      hidden_seconds / data_hidden_seconds: of `comm_seconds` (`data_comm_seconds`), the time the
        collectives run beside compute that does not wait for them, where the cost model overlaps
        them (`CostModel.overlap`); 0 where it does not.
      hidden_ops: `(OpRecord.index, seconds)` per operator whose collectives run beside compute:
        the seconds of them the device computes through (`hidden`, what `Plan.explain` says).
      peak_bytes: the memory model's peak per device of the plan as built (`plan.planned_peak`: what
        `SearchReport.peak_bytes` is for a searched plan, here for every plan jshard lays out).
    """

    devices: int
    flops: float
    device_flops: float
    comm_seconds: float
    compute_seconds: float
    mode: str
    data_comm_seconds: float | None = None
    data_compute_seconds: float | None = None
    data_missing: str = ""
    hidden_seconds: float = 0.0
    data_hidden_seconds: float = 0.0
    hidden_ops: tuple[tuple[int, float], ...] = ()
    peak_bytes: float | None = None

    def hidden(self, op: int) -> float:
        """Seconds of operator `op`'s (its `OpRecord.index`) collectives that run beside compute."""
        return dict(self.hidden_ops).get(op, 0.0)

    @property
    def share(self) -> float:
        """The share of the single-device work one device does (1.0: nothing is cut)."""
        return self.device_flops / self.flops if self.flops else 1.0

    @property
    def seconds(self) -> float:
        """This plan's predicted time per call: compute, and the collectives it waits for."""
        return self.comm_seconds + self.compute_seconds - self.hidden_seconds

    @property
    def data_seconds(self) -> float | None:
        """The data-parallel plan's predicted time per call, or None where it was not priced."""
        if self.data_comm_seconds is None or self.data_compute_seconds is None:
            return None
        return self.data_comm_seconds + self.data_compute_seconds - self.data_hidden_seconds

    @property
    def replicated(self) -> bool:
        """Whether one device does at least `REPLICATED_SHARE` of the single-device work."""
        return self.share >= REPLICATED_SHARE

    def line(self) -> str | None:
        """The summary's line where (nearly) nothing is cut, else None."""
        if not self.replicated:
            return None
        whole = self.device_flops >= self.flops
        share = f"{self.share:.0%}" if whole else f"{min(self.share, 0.999):.1%}"  # never "100%" for a cut
        line = (f"{'nothing' if whole else 'little'} is cut: each of the {self.devices} devices does {share} of the "
                f"single-device work")
        if self.mode == "data":
            return line + "; mode='data' cuts only the batch arguments, and little of this program's work follows them"
        data = self.data_seconds
        if data is None:
            return line + f"; no data-parallel plan to compare: {self.data_missing}"
        line += (f"; the data-parallel plan would take {_us(data)} per call against {_us(self.seconds)} for this "
                 f"one: ")
        saved = self.compute_seconds - self.data_compute_seconds
        paid = (self.data_comm_seconds - self.data_hidden_seconds) - (self.comm_seconds - self.hidden_seconds)
        if data >= self.seconds:
            return line + (f"the cost model says the step is too small to cut (cutting the batch saves {_us(saved)} "
                           f"of compute per device and costs {_us(paid)} of collectives)")
        return line + (f"the data-parallel plan is predicted faster (it saves {_us(saved)} of compute per device for "
                       f"{_us(paid)} of collectives); parallelize(mode='data') plans it")


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"
