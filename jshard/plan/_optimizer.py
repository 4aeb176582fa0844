"""`OptimizerReport`: what optimizer parallel (ZeRO, MindSpore's `enable_parallel_optimizer`) cut."""

from __future__ import annotations

import dataclasses

from jshard._format import human_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class OptimizerReport:
    """The leaves `parallelize(..., optimizer=level)` cut over the data-parallel devices.

    Attributes:
      level: 1 (optimizer state cut), 2 (and gradients reduce-scattered), 3 (and parameters cut).
      threshold: bytes; smaller leaves stay whole.
      state_cut / state_total: optimizer-state leaves cut, and how many there are.
      params_cut / params_total: the same for the parameters (cut at level 3 only).
      saved_bytes: bytes per device the cuts save in the arguments.
      whole: paths of the leaves at or above the threshold that no free mesh axis divides (kept
        whole).
      regathered: parameter leaves the backward pass all-gathers again (`OptimizerParallel(comm_recompute=True)`).
      reduce_scattered: gradients jshard reduce-scatters to their cut itself (level 2 and 3: a
        `shard_map` ending in `lax.psum_scatter`, on every backend).
      leaves: per cut leaf, `(path, role, layout before, layout after)`: its argument path, `"state"`
        or `"parameter"`, and its `PartitionSpec`s as text (`table()` lists them).
      why: where the search chose the level (`optimizer_parallel` not given, a memory budget no plan
        met without it), why; `""` where the user asked for it.
    """

    level: int
    threshold: float
    state_cut: int
    state_total: int
    params_cut: int
    params_total: int
    saved_bytes: float
    whole: tuple[str, ...] = ()
    regathered: int = 0
    reduce_scattered: int = 0
    leaves: tuple[tuple[str, str, str, str], ...] = ()
    why: str = ""

    def line(self) -> str:
        """One line for `Plan.summary`."""
        kept = f"; kept whole (no free axis divides them): {', '.join(self.whole)}" if self.whole else ""
        kept += (f"; {self.regathered} parameter leaves all-gathered again in the backward pass (communication "
                 f"recompute)") if self.regathered else ""
        kept += (f"; {self.reduce_scattered} gradients reduce-scattered to their cut") if self.reduce_scattered else ""
        return (f"optimizer parallel level {self.level} (threshold {human_bytes(self.threshold)}): "
                f"{self.state_cut}/{self.state_total} optimizer-state and {self.params_cut}/{self.params_total} "
                f"parameter leaves cut, {human_bytes(self.saved_bytes)} per device saved{kept}"
                + (f"; {self.why}" if self.why else ""))

    def table(self) -> str:
        """One line per cut leaf: its path, role, and layout before and after the cut."""
        rows = [("argument", "role", "laid out", "cut")] + list(self.leaves)
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
