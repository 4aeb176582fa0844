"""`PeerReport`: jshard's propagated plan against Shardy's from the same anchors, both compiled, and
which of the two the program runs (`parallelize(..., propagation="best")`)."""

from __future__ import annotations

import dataclasses

from jshard._format import human_bytes

KEPT = ("jshard", "xla")
"""Whose plan a weighing keeps: jshard's engine's, or Shardy's (`propagation="xla"`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PeerReport:
    """jshard's plan and Shardy's from the same anchors, compiled and measured alike.

    Attributes:
      jshard_bytes / shardy_bytes: the compiled programs' collective bytes per device per call
        (`jshard.audit`, loops weighted by their trip counts).
      jshard_peak / shardy_peak: their peak bytes per device (XLA's `memory_analysis()`).
      kept: `"jshard"` (its plan runs: fewer bytes, or as many) or `"xla"` (Shardy's runs).
      seconds: the seconds compiling and reading the plan the program does not run took.
    """

    jshard_bytes: float
    shardy_bytes: float
    jshard_peak: float
    shardy_peak: float
    kept: str
    seconds: float

    def __post_init__(self) -> None:
        if self.kept not in KEPT:
            raise ValueError(f"PeerReport.kept must be one of {KEPT}, got {self.kept!r}")

    @property
    def ratio(self) -> float:
        """jshard's bytes over Shardy's (1.0 where both move nothing; inf where only jshard's moves)."""
        if self.shardy_bytes:
            return self.jshard_bytes / self.shardy_bytes
        return 1.0 if not self.jshard_bytes else float("inf")

    def line(self) -> str:
        """The summary's line: whose plan runs, and by how much it won."""
        both = (f"{human_bytes(self.jshard_bytes)} against {human_bytes(self.shardy_bytes)} per device; "
                f"peak {human_bytes(self.jshard_peak)} against {human_bytes(self.shardy_peak)}; "
                f"the other compiled in {self.seconds:.2f} s")
        if self.kept == "jshard":
            return f"propagation: jshard's plan kept, {self.ratio:.3f}x Shardy's bytes ({both})"
        return (f"propagation: Shardy's plan kept: jshard's moved {self.ratio:.3f}x its bytes ({both}); "
                f"the operator records are not jshard's predictions")
