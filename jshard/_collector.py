"""`collector_paused`: Python's cyclic garbage collector paused while jshard makes objects by the
hundred thousand that all live on (a traced program, a search's tables, a plan's records)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused inside the block, left as the caller had it after.
    Each of the collector's passes over the oldest generation walks every live object again: with
    an unrolled 96-layer GPT traced and planned, a third of its planning time, and nearly half of
    reading its plan's records (`Plan.ops`). Nothing made in such a block needs the collector
    before it ends: it runs as usual after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
