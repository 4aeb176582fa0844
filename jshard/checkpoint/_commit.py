"""A step's file record made part of Orbax's commit, and async saves finished at interpreter exit.

Orbax writes a step into a temporary directory and, once every process has written its shards,
process 0 finalizes it: `AtomicRenameTemporaryPath.finalize` renames it into place. `RecordedPath`
is that class with one thing more: before the rename it records the size and CRC-32 of every file
of the step's items (`_files.record`). So a step is never visible without its record, and a step
found without one (a record deleted, a step another program or an older jshard wrote) is refused as
unverified rather than read unchecked.

An async save (`save(..., blocking=False)`) that the program never waits on would be cut off by the
interpreter's exit (Orbax's background thread then fails on closed executors, the process exits 0
and the step is lost). `pending` holds the handles not yet waited on; `_finish_at_exit`, registered
with `threading._register_atexit` (the hook `concurrent.futures` itself uses, run before its
executors shut down), waits on each, and where one fails ends the process with status 1, naming
the step that was lost.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING

import orbax.checkpoint as ocp

from jshard.checkpoint._files import record

if TYPE_CHECKING:
    from jshard.checkpoint._orbax import SaveHandle

pending: dict[int, SaveHandle] = {}
"""`id(handle) -> handle` for every async save not yet waited on."""
_registered = False


class RecordedPath(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Orbax's atomic-rename commit, with the step's file record written just before the rename."""

    async def finalize(self, *args, **kwargs):
        record(os.fspath(self.get()))
        await super().finalize(*args, **kwargs)


def track(handle) -> None:
    """Has `handle` (an unfinished `SaveHandle`) waited on at interpreter exit unless waited on first."""
    global _registered
    if not _registered:
        threading._register_atexit(_finish_at_exit)
        _registered = True
    pending[id(handle)] = handle


def _finish_at_exit() -> None:
    for handle in list(pending.values()):
        try:
            handle.wait()
        except BaseException as e:  # the interpreter is exiting: say which step was lost, exit non-zero
            print(f"jshard.checkpoint: step {handle.step} of {handle.directory} was not saved: the program exited "
                  f"before its async save finished, and finishing it failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            os._exit(1)
