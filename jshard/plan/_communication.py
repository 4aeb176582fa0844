"""`CommunicationReport`: what `parallelize(..., communication=...)` (multi-copy, MindSpore's
`comm_fusion`) did to one program."""

from __future__ import annotations

import dataclasses
from typing import Any

from jshard._format import human_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class CommunicationReport:
    """What `parallelize(..., communication=...)` did to one program (`Plan.communication`).

    Attributes:
      copies: n, the copies each micro-batch's rows were cut into (multi-copy).
      buckets: each all-reduce jshard emitted for the gradients, `(leaves, dtype, bytes per
        device)`, in order (the bytes None where other mesh axes may cut the gradient: one leaf
        each, its bytes per device XLA's layout); empty where XLA reduces them.
      compiler_options: the XLA options the program was compiled with, as `(name, value)` pairs.
      copy_bytes: per device, the bytes multi-copy holds beyond one copy: the other n - 1 copies'
        gradients, live until they are summed (each copy's activations are 1/n of the batch's,
        as many in all as one copy of the whole batch holds).
      bucket_bytes: per device, the largest flat buffer a bucket of several leaves is copied into.
      weighed: under `mode="auto"` with no `communication=` given, each arrangement the search
        weighed (`copies=n`, the all-reduces apart) with its predicted seconds per step and peak,
        the chosen one marked; empty where the user gave it.
      why: one line: why the search chose this arrangement, or "" where the user gave it.
    """

    copies: int
    buckets: tuple[tuple[int, str, int | None], ...]
    compiler_options: tuple[tuple[str, Any], ...]
    copy_bytes: int = 0
    bucket_bytes: int = 0
    weighed: tuple[Any, ...] = ()
    why: str = ""

    def line(self) -> str:
        """One line for `Plan.summary()`."""
        sizes = [size for _, _, size in self.buckets if size is not None]
        made = ("XLA's" if not self.buckets else f"{len(self.buckets)} bucket(s)"
                + (f" of {human_bytes(max(sizes))} at most" if sizes else ", one per gradient"))
        options = ", ".join(f"{k}={v}" for k, v in self.compiler_options) or "none"
        line = (f"communication: {self.copies} cop{'y' if self.copies == 1 else 'ies'} (+{human_bytes(self.copy_bytes)} "
                f"per device); gradient all-reduces: {made}; XLA options: {options}")
        if not self.why:
            return line
        tried = "; ".join(w.text() for w in self.weighed)
        return f"{line}; {self.why}" + (f" (weighed: {tried})" if len(self.weighed) > 1 else "")
