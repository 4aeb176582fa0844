"""The offload stage (MindSpore's heterogeneous storage): which argument leaves
`parallelize(..., offload=...)` keeps in host memory between steps, and which results update them.

The roles are optimizer parallel's (`roles`): argument 0 is the parameters, every other argument
but the batch the optimizer state; a result updates an argument where it has the argument's tree,
shapes and dtypes (`updating`). PRNG key leaves stay on the device. `build_program` lays the chosen
leaves out in host memory (`jshard.hetero`).
"""

from __future__ import annotations

import jax

from jshard._errors import ShardingError
from jshard.compile._optimizer import roles, updating
from jshard.compile._options import Options
from jshard.compile._signature import dtype_of
from jshard.compile._trace import Traced
from jshard.hetero import Offload


def offloaded(traced: Traced, args: tuple, options: Options, call: str) -> Offload:
    """The leaves `options.offload` keeps in host memory, and the results that update them.

    Raises:
      ShardingError: a role asked for has no argument (no optimizer state, say).
    """
    params, state = roles(args, options)
    chosen = {"parameters": params, "optimizer": state}
    ids: set[int] = set()
    for name in options.offload:
        leaves = {i for i in chosen[name] if not jax.dtypes.issubdtype(dtype_of(traced.leaves[i]), jax.dtypes.extended)}
        if not leaves:
            raise ShardingError(_no_state_error(call, name, len(args), options))
        ids |= leaves
    return Offload(options.offload, frozenset(ids), updating(traced, args, {i: i for i in ids}))


def _no_state_error(call: str, name: str, n: int, options: Options) -> str:
    batch = (n - 1,) if options.batch_argnums is None else options.batch_argnums
    role = "parameter (argument 0)" if name == "parameters" else "optimizer-state (every argument but 0 and the batch)"
    return (f"{call}: offload=({name!r},) keeps the {role} leaves in host memory, but this call has none "
            f"({n} positional argument(s), the batch: {batch}). Pass that state as an argument, name the batch "
            f"with batch_argnums=, or drop {name!r} from offload.")
