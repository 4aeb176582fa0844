"""Partition rules as the Flax LLM ecosystem writes them (EasyLM's `jax_utils`, MaxText's logical
rules): a table of `(regex, PartitionSpec)`, the first regex found in a leaf's `/`-joined path
giving its spec, on a `("dp", "mp")` mesh; and the port a jshard user writes of the same table to
`in_strategy` (`strategies`). Shared by the clients whose models are imported from transformers
(`hf_llama`, `hf_vit`): the rules are the user's, the models are not."""

import re

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js

DP, MP = 2, 4
MESH_SHAPE, MESH_AXES = (DP, MP), ("dp", "mp")


def match_partition_rules(rules, tree):
    """EasyLM's: each leaf's rule value, by the first regex found in its path (scalars: whole)."""

    def rule_of(path, leaf):
        if np.ndim(leaf) == 0:
            return P()
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        return next(value for pattern, value in rules if re.search(pattern, name))

    return jax.tree_util.tree_map_with_path(rule_of, tree)


def make_mesh(devices=None):
    devices = jax.devices()[: DP * MP] if devices is None else devices
    return jax.make_mesh(MESH_SHAPE, MESH_AXES, devices=devices)


def shardings(mesh, rules, tree):
    """`tree`'s leaves placed on `mesh` by `rules` (the expert's `in_shardings`)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), match_partition_rules(rules, tree))


def strategy(spec: P, ndim: int, shared: bool):
    """`spec` as jshard takes it: a call of one `Layout` over the mesh's axes (`shared`), or a strategy
    tuple given apart (slices per dim)."""
    axes = tuple(spec) + (None,) * (ndim - len(spec))
    if shared:
        return js.Layout(MESH_SHAPE, MESH_AXES)(*(axis or "None" for axis in axes))
    sizes = dict(zip(MESH_AXES, MESH_SHAPE))
    return tuple(sizes[axis] if axis else 1 for axis in axes)


def strategies(rules, state, shared: bool):
    """`rules` as jshard's `in_strategy` for a `TrainState`: on the parameters only (the optimizer
    state and step left to the planner), each leaf's `strategy`."""
    specs = match_partition_rules(rules, state.params)
    params = jax.tree.map(
        lambda spec, leaf: strategy(spec, np.ndim(leaf), shared),
        specs,
        state.params,
        is_leaf=lambda x: isinstance(x, P),
    )
    return state.replace(params=params, opt_state=None, step=None)
