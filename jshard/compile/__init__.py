"""The compile core every front end shares: validated `Options` (jit's argument options resolved
by `resolve` and bound per call by `bind`), the trace stage (`Traced`), the `Planner` contract and
its planners, the program stage (`Program`: emission, `jax.jit`, `Plan`), the per-signature cache,
and `build`, which runs them in order (see ARCHITECTURE.md)."""

from jshard.compile._arguments import Bound as Bound
from jshard.compile._arguments import bind as bind
from jshard.compile._arguments import resolve as resolve
from jshard.compile._core import build as build
from jshard.compile._groups import Accumulation as Accumulation
from jshard.compile._groups import Communication as Communication
from jshard.compile._groups import Fusion as Fusion
from jshard.compile._groups import OptimizerParallel as OptimizerParallel
from jshard.compile._groups import Pipelining as Pipelining
from jshard.compile._groups import Search as Search
from jshard.compile._groups import grouped as grouped
from jshard.compile._groups import parse_bytes as parse_bytes
from jshard.compile._options import Options as Options
from jshard.compile._planners import Planned as Planned
from jshard.compile._planners import Planner as Planner
from jshard.compile._planners import Problem as Problem
from jshard.compile._program import Program as Program
from jshard.compile._session import Planning as Planning
from jshard.compile._signature import SignatureCache as SignatureCache
from jshard.compile._signature import abstract as abstract
from jshard.compile._signature import dtype_of as dtype_of
from jshard.compile._signature import placed as placed
from jshard.compile._trace import Traced as Traced
