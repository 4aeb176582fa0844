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
    before it ends: it runs as usual after, the objects made in the block handed to its oldest
    generation (`_to_oldest`) rather than left young for its next pass to walk."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            _to_oldest()
            gc.enable()


def _to_oldest() -> None:
    """Moves every object the collector tracks into its oldest generation, in constant time: the
    young ones (all made while it was paused: an unrolled 96-layer GPT's half a million) are not
    walked again by the first pass after (0.3 s at that depth, finding no garbage: they live on in
    the plan). The oldest generation is walked only by a full pass, which still frees any cycle
    among them; none is kept for ever. `gc.freeze` moves them to the permanent generation and
    `gc.unfreeze` back into the oldest, so where the caller froze objects of its own (a server
    before it forks) they are left as they are."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
