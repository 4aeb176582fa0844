"""The exceptions jshard raises.

Every error a user can act on is a `ShardingError` (a `ValueError`), whose message names the public
call, the operator, the tensor's shape, the strategy, the device count and a fix. A wrong *kind* of
value (a string where a tuple of ints belongs) is a `TypeError`.
"""

from __future__ import annotations


class ShardingError(ValueError):
    """A strategy, layout, mesh or device count that jshard cannot honour as written."""


class LayoutConflictError(ShardingError):
    """Two strategies in one program that cannot share one device order (one mesh)."""


class DeviceCountError(ShardingError):
    """A device count that does not fit: too few devices, or a backend already started."""
