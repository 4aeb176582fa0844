"""jaxpr → OpGraph: the traced program as a flat list of operator `Node`s (calls inlined, loop and
branch bodies nested in place), the form every planner reads."""

from jshard.graph._graph import AUTO_LABEL as AUTO_LABEL
from jshard.graph._graph import COMM_KEPT_LABEL as COMM_KEPT_LABEL
from jshard.graph._graph import CONSTRAINT as CONSTRAINT
from jshard.graph._graph import INLINE as INLINE
from jshard.graph._graph import JSHARD_SCOPE as JSHARD_SCOPE
from jshard.graph._graph import MANUAL as MANUAL
from jshard.graph._graph import NESTED as NESTED
from jshard.graph._graph import PARAMETER_SCOPE as PARAMETER_SCOPE
from jshard.graph._graph import RECOMPUTE_SCOPE as RECOMPUTE_SCOPE
from jshard.graph._graph import REMAT as REMAT
from jshard.graph._graph import KeepComm as KeepComm
from jshard.graph._graph import Node as Node
from jshard.graph._graph import dead_nodes as dead_nodes
from jshard.graph._graph import distinct_calls as distinct_calls
from jshard.graph._graph import flatten as flatten
from jshard.graph._graph import inline_equations as inline_equations
from jshard.graph._graph import nested_jaxprs as nested_jaxprs
from jshard.graph._graph import operand_vars as operand_vars
from jshard.graph._graph import remat_policy_name as remat_policy_name
from jshard.graph._graph import resolve as resolve
