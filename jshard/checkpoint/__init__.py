"""Distributed checkpoints (Orbax): sharded state plus the plan, restored onto any layout."""

from jshard._errors import CheckpointError as CheckpointError
from jshard.checkpoint._orbax import SaveHandle as SaveHandle
from jshard.checkpoint._orbax import latest_step as latest_step
from jshard.checkpoint._orbax import load_plan as load_plan
from jshard.checkpoint._orbax import restore as restore
from jshard.checkpoint._orbax import save as save
