"""jaxpr → OpGraph, plans and their records (the propagation engine grows here)."""

from jshard.propagate._graph import Node as Node
from jshard.propagate._graph import flatten as flatten
from jshard.propagate._plan import ORIGINS as ORIGINS
from jshard.propagate._plan import OpRecord as OpRecord
from jshard.propagate._plan import Plan as Plan
from jshard.propagate._plan import build_ops as build_ops
from jshard.propagate._audit import Audit as Audit
from jshard.propagate._audit import Collective as Collective
from jshard.propagate._audit import MemoryFigures as MemoryFigures
from jshard.propagate._audit import audit as audit
