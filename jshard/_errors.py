"""The exceptions jshard raises.

Every error a user can act on is a `ShardingError` (a `ValueError`), whose message names the public
call, the operator, the tensor's shape, the strategy, the device count and a fix. A wrong *kind* of
value (a string where a tuple of ints belongs) is a `TypeError`.

As JAX hides its own frames, jshard's are left out of the traceback of an error raised through a
public call (each decorated with `api_boundary`): the traceback shows the user's lines, then the
message. `JAX_TRACEBACK_FILTERING=off` shows every frame.
"""

from __future__ import annotations

import os

from jshard._compat import traceback_util

traceback_util.register_exclusion(os.path.dirname(__file__))

api_boundary = traceback_util.api_boundary
"""Decorates a public jshard call: an exception raised below it loses jshard's and JAX's frames."""


class ShardingError(ValueError):
    """A strategy, layout, mesh or device count that jshard cannot honour as written."""


class LayoutConflictError(ShardingError):
    """Two strategies in one program that cannot share one device order (one mesh)."""


class DeviceCountError(ShardingError):
    """A device count that does not fit: too few devices, or a backend already started."""


class MemoryBudgetError(ShardingError):
    """No plan the search finds fits the memory budget per device.

    Attributes:
      least_bytes: the least per-device peak the search estimated (every tensor cut as finely as
        its dims allow), or None where unknown.
      bound: whether `least_bytes` bounds every plan from below (the search's estimate with every
        tensor cut as finely as it can be), rather than the peak of one plan.
    """

    def __init__(self, message: str, least_bytes: float | None = None, bound: bool = False):
        super().__init__(message)
        self.least_bytes = least_bytes
        self.bound = bound


class CheckpointError(ShardingError):
    """A checkpoint that cannot be written or read as asked: the target cannot be written (a full
    disk, a read-only directory), a step is damaged, cannot be verified (no record of its files) or
    was not written by `jshard.checkpoint.save`, or a saved plan does not fit this job's devices. The
    message names the directory or file and the step to use instead."""


class PlanEditedWarning(UserWarning):
    """A plan file whose content no longer matches the digest `Plan.save` wrote into it: it was
    edited (or written by hand) since. `Plan.load(path, strict=True)` refuses such a file."""


class LayoutCollisionWarning(UserWarning):
    """Strategy tuples given apart (`in_strategy`) whose cuts land on one mesh axis where an operator
    takes them together, so that XLA redistributes one first; the warning names the cost and the
    shared `Layout` that keeps the cuts apart."""


class ShardNotAppliedWarning(UserWarning):
    """A `jshard.shard` call ran outside `jshard.parallelize` (eagerly, or under a plain `jax.jit`)
    with several devices present: its strategy was not applied and the plain function ran, as
    Flax's `nn.with_logical_constraint` does outside its rules. Warned once per `shard` call; a
    one-device reference run of the same model may silence it with
    `warnings.simplefilter("ignore", jshard.ShardNotAppliedWarning)`."""


for _error in (ShardingError, LayoutConflictError, DeviceCountError, MemoryBudgetError, CheckpointError,
               PlanEditedWarning, LayoutCollisionWarning, ShardNotAppliedWarning):
    _error.__module__ = "jshard"  # as tracebacks print it: jshard.ShardingError, the name users import
