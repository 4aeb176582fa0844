"""Every JAX-private (`jax._src`) import jshard makes, in one place.

jshard needs a few things JAX has no public API for yet: the source-line machinery (so operators
name the user's code, not jshard's wrappers), traceback filtering (so errors show the user's
frames, not jshard's), re-tracing a rebuilt loop body, and the CPU backend and `jax.distributed`
client state (for simulated devices and gloo collectives), and the error JAX raises where `Explicit`
axes' types do not fit an operator (`ShardingTypeError`). They are fenced
here, checked against the JAX versions `pyproject.toml` allows (`jax>=0.10`, tested on 0.10.2): a
JAX release that moves one breaks this module at import, with a message, and nothing else.
"""

from __future__ import annotations

import jax

try:
    from jax._src import distributed as distributed
    from jax._src import linear_util as linear_util
    from jax._src import source_info_util as source_info_util
    from jax._src import traceback_util as traceback_util
    from jax._src import xla_bridge as xla_bridge
    from jax._src.core import ShardingTypeError as ShardingTypeError
    from jax._src.interpreters import partial_eval as partial_eval
    from jax._src.lib import _jax as xla_client
except ImportError as e:  # pragma: no cover - only on a JAX release that moved these
    raise ImportError(
        f"jshard uses JAX internals that JAX {jax.__version__} has moved ({e}); jshard is tested with "
        f"jax>=0.10,<0.11. Install a JAX version in that range, or a jshard release made for yours."
    ) from e

__all__ = ["ShardingTypeError", "distributed", "linear_util", "partial_eval", "source_info_util", "traceback_util",
           "xla_bridge", "xla_client"]
