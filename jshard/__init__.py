"""jshard: MindSpore-style automatic parallelism for JAX.

Annotate a few operators with MindSpore strategy tuples (`((2, 1), (1, 4))`) or `Layout`s; jshard
compiles them into one `jax.sharding.Mesh` and `PartitionSpec`s, plans the rest, explains it and
hands the program to XLA.
"""

import os as _os

from jax._src import source_info_util as _source_info_util

# Operators' source lines should name the user's code, not jshard's wrappers.
for _wrapper in ("_shard.py", "_params.py", "_parallelize.py", _os.path.join("propagate", "_emit.py"),
                 _os.path.join("propagate", "_plan.py")):
    _source_info_util.register_exclusion(_os.path.join(_os.path.dirname(__file__), _wrapper))

from jshard._devices import simulate_devices as simulate_devices
from jshard._distributed import ProcessInfo as ProcessInfo
from jshard._distributed import init as init
from jshard._errors import DeviceCountError as DeviceCountError
from jshard._errors import LayoutConflictError as LayoutConflictError
from jshard._errors import ShardingError as ShardingError
from jshard._parallelize import Parallelized as Parallelized
from jshard._parallelize import parallelize as parallelize
from jshard._shard import shard as shard
from jshard.layouts import Layout as Layout
from jshard.layouts import TensorLayout as TensorLayout
from jshard.pipeline import Pipeline as Pipeline
from jshard.pipeline import pipeline_stage as pipeline_stage
from jshard.propagate import Audit as Audit
from jshard.propagate import OpRecord as OpRecord
from jshard.propagate import Plan as Plan
from jshard.propagate import audit as audit

__all__ = [
    "Audit",
    "DeviceCountError",
    "Layout",
    "LayoutConflictError",
    "OpRecord",
    "Parallelized",
    "Pipeline",
    "Plan",
    "ProcessInfo",
    "ShardingError",
    "TensorLayout",
    "audit",
    "init",
    "parallelize",
    "pipeline_stage",
    "shard",
    "simulate_devices",
]
