"""jshard: MindSpore-style automatic parallelism for JAX.

Annotate a few operators with MindSpore strategy tuples (`((2, 1), (1, 4))`) or `Layout`s; jshard
compiles them into one `jax.sharding.Mesh` and `PartitionSpec`s, plans the rest, explains it and
hands the program to XLA.

`jshard.checkpoint` (Orbax checkpoints), `jshard.data` (dataset sharding) and `jshard.models`
(reference models) are imported on first use (`__getattr__` below), so `import jshard` stays cheap
and `import jshard; jshard.checkpoint.save(...)` works.
"""

import importlib as _importlib
import os as _os

from jshard._accumulate import accumulate as accumulate
from jshard._compat import source_info_util as _source_info_util
from jshard._devices import simulate_devices as simulate_devices
from jshard._distributed import ProcessInfo as ProcessInfo
from jshard._distributed import init as init
from jshard._errors import CheckpointError as CheckpointError
from jshard._errors import DeviceCountError as DeviceCountError
from jshard._errors import LayoutCollisionWarning as LayoutCollisionWarning
from jshard._errors import LayoutConflictError as LayoutConflictError
from jshard._errors import MemoryBudgetError as MemoryBudgetError
from jshard._errors import PlanEditedWarning as PlanEditedWarning
from jshard._errors import ShardingError as ShardingError
from jshard._errors import ShardNotAppliedWarning as ShardNotAppliedWarning
from jshard._parallelize import Parallelized as Parallelized
from jshard._parallelize import parallelize as parallelize
from jshard._recompute import recompute as recompute
from jshard._shard import shard as shard
from jshard._visualize import Visualization as Visualization
from jshard._visualize import visualize as visualize
from jshard.audit import Audit as Audit
from jshard.audit import audit as audit
from jshard.compile import Accumulation as Accumulation
from jshard.compile import Communication as Communication
from jshard.compile import Fusion as Fusion
from jshard.compile import OptimizerParallel as OptimizerParallel
from jshard.compile import Pipelining as Pipelining
from jshard.compile import Search as Search
from jshard.context import attention as attention
from jshard.context import context_choice as context_choice
from jshard.context import unzigzag as unzigzag
from jshard.context import zigzag as zigzag
from jshard.cost import CostModel as CostModel
from jshard.hetero import offload_names as offload_names
from jshard.hetero import on_host as on_host
from jshard.layouts import Layout as Layout
from jshard.layouts import TensorLayout as TensorLayout
from jshard.pipeline import Pipeline as Pipeline
from jshard.pipeline import pipeline_stage as pipeline_stage
from jshard.plan import OpRecord as OpRecord
from jshard.plan import Plan as Plan

# Operators' source lines should name the user's code, not jshard's wrappers.
for _wrapper in ("_accumulate.py", "hetero", "_shard.py", "context", "_params.py", "_parallelize.py", "_recompute.py", _os.path.join("propagate", "_emit.py"),
                 _os.path.join("plan", "_plan.py"), "compile"):
    _source_info_util.register_exclusion(_os.path.join(_os.path.dirname(__file__), _wrapper))

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

_LAZY = ("checkpoint", "data", "models")


def __getattr__(name: str):
    if name in _LAZY:
        return _importlib.import_module(f"jshard.{name}")  # sets the attribute: called once per name
    raise AttributeError(f"module 'jshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Accumulation",
    "Audit",
    "CheckpointError",
    "Communication",
    "CostModel",
    "DeviceCountError",
    "Fusion",
    "Layout",
    "LayoutCollisionWarning",
    "LayoutConflictError",
    "MemoryBudgetError",
    "OpRecord",
    "OptimizerParallel",
    "Parallelized",
    "Pipeline",
    "Pipelining",
    "Plan",
    "PlanEditedWarning",
    "ProcessInfo",
    "Search",
    "ShardNotAppliedWarning",
    "ShardingError",
    "TensorLayout",
    "Visualization",
    "accumulate",
    "attention",
    "audit",
    "context_choice",
    "init",
    "offload_names",
    "on_host",
    "parallelize",
    "pipeline_stage",
    "recompute",
    "shard",
    "simulate_devices",
    "unzigzag",
    "visualize",
    "zigzag",
]
