"""Stages cut from any function: the regions `pipeline_stage(fn, k)` tags, found in its jaxpr.

`cut(step, params, micro_batch, stages)` traces `step` (a loss `step(params, batch) -> scalar`, or
a train step returning `jax.value_and_grad(loss)(params, batch)`, whose forward loss it keeps: the
equations the loss depends on) on one micro-batch, and assigns each equation a stage:

- an equation inside `pipeline_stage(fn, k)` (its name stack holds `STAGE_SCOPE + k`; calls such as
  `jax.jit` are inlined, their equations taking the call's tag) runs on stage `k`;
- an untagged equation joins the stage of its nearest tagged producer, the latest stage among its
  operands' producers (MindSpore's rule); one fed by parameters, the batch and constants only runs
  on the first stage that uses it.

Each stage `k` is then one function `run(k, params_k, micro_batch, inputs) -> outputs`: `params_k`
are the parameter leaves its equations read (a leaf read by two stages, a tied embedding, is in
both), `inputs` the boundary values entering it from earlier stages, `outputs` the values a later
stage reads (values made earlier and needed later go along, stage by stage); the last stage
returns the loss.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jshard._compat import source_info_util
from jshard._errors import ShardingError
from jshard._format import shape_str
from jshard._source import user_source
from jshard.cost import CostModel
from jshard.graph import INLINE, REMAT, distinct_calls, nested_jaxprs, resolve
from jshard.pipeline._balance import StageBalance, balance, report

STAGE_SCOPE = "jshard_pipeline_stage_"
"""The name scope `pipeline_stage(fn, k)` runs `fn` in, followed by `k`."""
_TAG = re.compile(STAGE_SCOPE + r"(\d+)")
_CALL_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_INLINED = INLINE - {"custom_jvp_call", "custom_vjp_call"}


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """One equation of the flattened forward loss: its operands (outer variables or literals) and
    results, and the stage it runs on."""

    eqn: Any
    inputs: tuple
    outputs: tuple
    tag: int | None
    stage: int = -1
    scope: str = ""


@dataclasses.dataclass(frozen=True, eq=False)
class Cut:
    """A forward loss cut into `stages` per-stage functions (see the module docstring).

    Attributes:
      stages: S.
      ops: per stage, its equations in program order.
      params: per stage, the indices of the parameter leaves it reads (flat, `jax.tree.leaves` order).
      boundary: per boundary `k -> k+1` (`k < S - 1`), the values crossing it, as avals.
      balance: where the stages end and each one's predicted cost (`StageBalance`), where the cut
        was priced by a cost model.
    """

    stages: int
    ops: tuple[tuple[Op, ...], ...]
    params: tuple[tuple[int, ...], ...]
    boundary: tuple[tuple[jax.core.ShapedArray, ...], ...]
    _param_vars: tuple
    _batch_vars: tuple
    _consts: dict
    _crossing: tuple[tuple[Any, ...], ...]
    _loss: Any
    balance: StageBalance | None = None

    @property
    def loss_aval(self) -> jax.core.ShapedArray:
        """The loss's shape and dtype (a scalar)."""
        return self._loss.aval

    @property
    def consts(self) -> tuple:
        """The constants the traced loss closes over (a tracer among them: a value of a trace around it)."""
        return tuple(self._consts.values())

    @property
    def batch_avals(self) -> tuple[jax.core.ShapedArray, ...]:
        """The micro-batch's leaves' shapes and dtypes (one micro-batch, as traced)."""
        return tuple(v.aval for v in self._batch_vars)

    def param_specs(self) -> tuple[PartitionSpec | None, ...]:
        """Per parameter leaf, the layout over one stage's axes a `jshard.shard` constraint on the
        leaf itself gives it (its first, in program order), or None where none constrains it."""
        index = {v: j for j, v in enumerate(self._param_vars)}
        specs: list[PartitionSpec | None] = [None] * len(self._param_vars)
        for op, sharding in self._constraints():
            j = index.get(op.inputs[0])
            if j is not None and specs[j] is None:
                specs[j] = sharding.spec
        return tuple(specs)

    def row_axes(self, rows: int) -> tuple[str, ...]:
        """The axes `jshard.shard` constraints cut the leading dim of a value of `rows` rows over
        (the micro-batch's rows: data parallel written as strategies), parameters left out."""
        params = set(self._param_vars)
        found: dict[str, None] = {}
        for op, sharding in self._constraints():
            aval = op.inputs[0].aval
            if op.inputs[0] not in params and aval.shape and aval.shape[0] == rows and sharding.spec:
                found.update(dict.fromkeys(spec_axes(sharding.spec[:1])))
        return tuple(found)

    def _constraints(self):
        """`(op, sharding)` of every `sharding_constraint` on a variable, over every stage."""
        for ops in self.ops:
            for op in ops:
                sharding = op.eqn.params.get("sharding") if op.eqn.primitive.name == "sharding_constraint" else None
                if isinstance(sharding, NamedSharding) and isinstance(op.inputs[0], jcore.Var):
                    yield op, sharding

    def run(self, k: int, params_k: list, batch: list, inputs: list) -> list:
        """Stage `k` on its parameter leaves, the micro-batch's leaves and its boundary inputs: the
        values crossing to stage `k + 1`, or `[loss]` on the last stage."""
        env = dict(self._consts)
        env.update(zip((self._param_vars[i] for i in self.params[k]), params_k))
        env.update(zip(self._batch_vars, batch))
        if k:
            env.update(zip(self._crossing[k - 1], inputs))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        for op in self.ops[k]:
            out = _bind(op.eqn, map(read, op.inputs))
            env.update(zip(op.outputs, out if op.eqn.primitive.multiple_results else [out]))
        return [read(v) for v in (self._crossing[k] if k < self.stages - 1 else (self._loss,))]


def _bind(eqn, args):
    """`eqn` applied to `args`, under its source line and context. A `jshard.shard` constraint, traced over one stage's devices, is
    bound over the mesh in context (inside the pipeline's `shard_map`, the stage's own automatic
    axes), so that its strategy holds on whichever stage runs it."""
    params = eqn.primitive.get_bind_params(eqn.params)
    sharding = params.get("sharding") if eqn.primitive.name == "sharding_constraint" else None
    if isinstance(sharding, NamedSharding):
        mesh = jax.sharding.get_abstract_mesh()
        made = sharding.mesh if isinstance(sharding.mesh, AbstractMesh) else sharding.mesh.abstract_mesh
        if mesh.manual_axes and made != mesh:  # a manual axis (the stage's data axes) holds each device's own rows: no cut left
            spec = without_axes(sharding.spec, set(mesh.manual_axes))
            params = {**params, "sharding": NamedSharding(mesh, spec), "context_mesh": mesh}
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        return eqn.primitive.bind(*args, **params)


def spec_axes(spec) -> list[str]:
    """The mesh axes a `PartitionSpec` (or a slice of its entries) names, in order."""
    return [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]


def without_axes(spec: PartitionSpec, drop: set) -> PartitionSpec:
    """`spec` with the axes in `drop` left out (a dim cut over none of its axes left whole)."""
    def keep(entry):
        axes = tuple(a for a in spec_axes([entry]) if a not in drop)
        return None if not axes else axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*map(keep, spec))


def cut(step, params: Any, batch: Any, stages: int, call: str = "jshard.pipeline.cut",
        cost: CostModel | None = None) -> Cut:
    """`step`'s forward loss on `(params, batch)` (shapes of one micro-batch) cut into `stages`;
    `call` names the public call in errors. With a `cost` model, an untagged loss is cut where
    the stages' predicted times are most even (`_balance.py`), and every cut carries its
    `StageBalance`.

    Raises:
      ShardingError: no tagged operator (and no cost model, or no narrow places to cut), a stage id >= `stages`, stages out of order along the data
        flow, a stage with nothing to run, or a result that is neither a loss nor `(loss, grads)`.

    Examples:
      >>> import jax.numpy as jnp, jshard as js
      >>> def loss(p, x):
      ...     h = js.pipeline_stage(lambda w, x: jnp.tanh(x @ w), 0)(p["a"], x)
      ...     return js.pipeline_stage(lambda w, h: h @ w, 1)(p["b"], h).mean()  # the mean joins stage 1
      >>> c = cut(loss, {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 2))}, jnp.ones((2, 3)), 2)
      >>> c.params, [[a.str_short() for a in b] for b in c.boundary]
      (((0,), (1,)), [['float32[2,4]']])
    """
    closed = distinct_calls(jax.make_jaxpr(step)(params, batch))
    jaxpr, n_params = closed.jaxpr, len(jax.tree.leaves(params))
    out = jax.eval_shape(step, params, batch)
    _check_loss_form(call, out, params)
    every, env = _flatten(call, jaxpr)
    if len(jax.tree.leaves(out)) > 1:
        _check_value_and_grad(call, every, [resolve(env, v) for v in jaxpr.outvars], out)
    loss = resolve(env, jaxpr.outvars[0])
    ops = _needed(every, loss)
    param_vars = tuple(jaxpr.invars[:n_params])
    tagged = any(op.tag is not None for op in ops)
    if not tagged:
        stage_of = None if cost is None else balance(ops, stages, param_vars, loss, cost)
        if stage_of is None:
            raise ShardingError(_no_tags_error(call, stages, cost is not None, len(ops)))
        ops = [dataclasses.replace(op, tag=k) for op, k in zip(ops, stage_of)]
    ops = _assign(call, ops, stages, loss)
    per_stage = tuple(tuple(op for op in ops if op.stage == k) for k in range(stages))
    _check_every_stage_runs(call, per_stage, stages)
    balanced = None if cost is None else report(ops, [op.stage for op in ops], stages, param_vars, loss, cost,
                                                tagged, _where)
    index = {v: i for i, v in enumerate(param_vars)}
    used = tuple(tuple(sorted({index[v] for op in st for v in _vars(op.inputs) if v in index})) for st in per_stage)
    crossing = _crossing(ops, stages, loss)
    return Cut(stages, per_stage, used, tuple(tuple(v.aval for v in b) for b in crossing), param_vars,
               tuple(jaxpr.invars[n_params:]), dict(zip(jaxpr.constvars, closed.consts)), crossing, loss, balanced)


def _check_loss_form(call: str, out, params) -> None:
    """The step returns a scalar loss, or a pair `(loss, tree like params)` (`_check_value_and_grad`
    then checks that the tree is the loss's gradients)."""
    leaves = jax.tree.leaves(out)
    scalar = lambda a: a.shape == () and jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
    if len(leaves) == 1 and scalar(leaves[0]):
        return
    if (isinstance(out, tuple) and len(out) == 2 and jax.tree.structure(out[1]) == jax.tree.structure(params)
            and scalar(out[0])):
        return
    raise ShardingError(
        f"{call}: a function cut into pipeline stages returns a scalar loss, or (loss, grads) as "
        f"jax.value_and_grad(loss)(params, batch) does; it returned {jax.tree.map(lambda a: shape_str(a.dtype, a.shape), out)}. "
        f"{_FULL_STEP}"
    )


_FULL_STEP = ("For a full train step (the gradients, then an optimizer update, metrics), mark its gradient "
              "function: loss, grads = jshard.accumulate(jax.value_and_grad(loss_fn))(params, batch); the "
              "pipeline runs that call, and the rest of the step runs on its gradients.")


def _check_value_and_grad(call: str, ops: list[Op], outvars: list, out) -> None:
    """A step returning `(loss, tree)` returns what `jax.value_and_grad` makes: the loss made in its
    forward (`jvp`) pass, every leaf of the tree made in its backward (`transpose`) pass, or the
    zeros of a parameter the loss does not read. The pipeline returns its own gradients of that loss,
    so anything else (the updated parameters of a train step, clipped gradients) would come back
    replaced by them: refused."""
    made = {v: op for op in ops for v in op.outputs}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out[1])[0]]
    loss_op = made.get(outvars[0])
    if loss_op is None or "jvp(" not in loss_op.scope:
        raise ShardingError(_not_value_and_grad_error(call, "the loss (result [0])", loss_op))
    for path, v in zip(paths, outvars[1:]):
        op = made.get(v)
        if not _is_gradient(op):
            raise ShardingError(_not_value_and_grad_error(call, f"result [1]{path}", op))


def _is_gradient(op: Op | None) -> bool:
    if op is None:
        return False
    zeros = (op.eqn.primitive.name == "broadcast_in_dim" and isinstance(op.inputs[0], jcore.Literal)
             and not op.inputs[0].val)
    return "transpose(" in op.scope or zeros


def _not_value_and_grad_error(call: str, what: str, op: Op | None) -> str:
    made = f"made by {_where(op)}" if op is not None else "an argument or a constant passed through"
    return (f"{call}: the step returns (loss, tree like params), but {what} is {made}, outside the "
            f"{'forward' if 'loss' in what else 'backward'} pass of jax.value_and_grad: the pair is not "
            f"jax.value_and_grad(loss)(params, batch). A pipeline returns the loss's own gradients, so it "
            f"cannot return this step's values. {_FULL_STEP}")


def _flatten(call: str, jaxpr) -> tuple[list[Op], dict]:
    """The top-level equations with call-like bodies inlined, each with its innermost stage tag,
    and the map from a call's variables to the ones inlined (`resolve`)."""
    out: list[Op] = []
    env: dict = {}
    _walk(call, jaxpr, env, "", out)
    return out, env


def _check_no_tags_inside(call: str, eqn) -> None:
    """A loop, branch or custom derivative runs on one stage: a tag inside its body cannot cut it."""
    bodies = [*nested_jaxprs(eqn), *filter(None, (_open(eqn.params.get(k)) for k in _CALL_KEYS))]
    tags = sorted({int(t) for body in bodies for t in _tags_in(body)})
    if tags:
        raise ShardingError(
            f"{call}: {_where_eqn(eqn)} holds operators tagged jshard.pipeline_stage(fn, k) for k in {tags} inside "
            f"its body; a {eqn.primitive.name} runs on one stage and cannot be cut. Tag the {eqn.primitive.name} "
            f"as a whole (call it inside one pipeline_stage), or unroll it (a Python loop over the layers)."
        )


def _open(sub):
    return sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub


def _tags_in(jaxpr) -> list[str]:
    found = []
    for eqn in jaxpr.eqns:
        found += _TAG.findall(str(eqn.source_info.name_stack))
        for body in [*nested_jaxprs(eqn), *filter(None, (_open(eqn.params.get(k)) for k in _CALL_KEYS))]:
            found += _tags_in(body)
    return found


def _walk(call: str, jaxpr, env: dict, prefix: str, out: list[Op]) -> None:
    for eqn in jaxpr.eqns:
        scope = f"{prefix}/{eqn.source_info.name_stack}"
        sub = _call_body(eqn)
        if sub is None:
            _check_no_tags_inside(call, eqn)
            tags = _TAG.findall(scope)
            out.append(Op(eqn, tuple(resolve(env, v) for v in eqn.invars), tuple(eqn.outvars),
                          int(tags[-1]) if tags else None, scope=scope))
            continue
        for v_in, v_out in zip(sub.invars, eqn.invars):
            env[v_in] = resolve(env, v_out)
        _walk(call, sub, env, scope, out)
        for v_out, v_in in zip(eqn.outvars, sub.outvars):
            env[v_out] = resolve(env, v_in)


def _call_body(eqn):
    """The body of a call-like equation (`jax.jit`, a remat) to inline, or None. A custom
    derivative (`jax.custom_jvp` / `custom_vjp`) stays one equation, so that its rule is the one
    differentiated; so does a body with constants of its own, and a recompute region
    (`jax.checkpoint`, `jshard.recompute`) with no stage tag inside, so that its stage's backward
    recomputes it rather than storing what it made."""
    if eqn.primitive.name not in _INLINED:
        return None
    for key in _CALL_KEYS:
        sub = eqn.params.get(key)
        if sub is None:
            continue
        body = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
        if (isinstance(sub, jcore.ClosedJaxpr) and sub.consts) or (eqn.primitive.name in REMAT and not _tags_in(body)):
            return None
        return body
    return None


def _needed(ops: list[Op], loss) -> list[Op]:
    """The equations the loss depends on (a train step's gradient and residual work dropped)."""
    live, kept = {loss}, []
    for op in reversed(ops):
        if any(v in live for v in op.outputs):
            kept.append(op)
            live.update(v for v in op.inputs if isinstance(v, jcore.Var))
    return kept[::-1]


def _assign(call: str, ops: list[Op], stages: int, loss) -> list[Op]:
    """Every equation's stage (see the module docstring), checked: ids below `stages`, and no value
    flowing from a later stage to an earlier one."""
    made: dict = {}
    stage: list[int | None] = []
    for op in ops:
        producers = [made[v] for v in op.inputs if isinstance(v, jcore.Var) and made.get(v) is not None]
        if op.tag is not None:
            if op.tag >= stages:
                raise ShardingError(_range_error(call, op, stages))
            late = [p for p in producers if p > op.tag]
            if late:
                raise ShardingError(_order_error(call, op, max(late)))
            s = op.tag
        else:
            s = max(producers, default=None)
        stage.append(s)
        made.update(dict.fromkeys(op.outputs, s))
    first_use: dict = {loss: stages - 1}
    for i in reversed(range(len(ops))):
        op = ops[i]
        if stage[i] is None:
            stage[i] = min((first_use[v] for v in op.outputs if v in first_use), default=0)
        for v in op.inputs:
            if isinstance(v, jcore.Var):
                first_use[v] = min(first_use.get(v, stages), stage[i])
    return [dataclasses.replace(op, stage=s) for op, s in zip(ops, stage)]


def _crossing(ops: list[Op], stages: int, loss) -> tuple[tuple[Any, ...], ...]:
    """Per boundary `k -> k+1`, the values made on a stage <= k and read on one > k, in program order."""
    made = {v: op.stage for op in ops for v in op.outputs}
    last_use: dict = {loss: stages - 1}
    for op in ops:
        for v in _vars(op.inputs):
            if v in made:
                last_use[v] = max(last_use.get(v, 0), op.stage)
    order = [v for op in ops for v in op.outputs if v in last_use]
    return tuple(tuple(v for v in order if made[v] <= k < last_use[v]) for k in range(stages - 1))


def _vars(values) -> list:
    """The variables among an equation's operands (literals left out)."""
    return [v for v in values if isinstance(v, jcore.Var)]


def _check_every_stage_runs(call: str, per_stage, stages: int) -> None:
    empty = [k for k, ops in enumerate(per_stage) if not ops]
    if empty:
        raise ShardingError(
            f"{call}: stages={stages}, but stage(s) {empty} run no operator of the loss: every "
            f"stage 0..{stages - 1} needs a jshard.pipeline_stage(fn, k) region the loss depends on. Tag "
            f"the layers of those stages, or use stages={stages - len(empty)}."
        )


def _where(op: Op) -> str:
    return _where_eqn(op.eqn)


def _where_eqn(eqn) -> str:
    return f"{eqn.primitive.name} at {user_source(eqn.source_info)}"


def _range_error(call: str, op: Op, stages: int) -> str:
    return (f"{call}: {_where(op)} is tagged jshard.pipeline_stage(fn, {op.tag}), but stages={stages} "
            f"has stages 0..{stages - 1}. Tag it with a stage below {stages}, or pass stages="
            f"{op.tag + 1}.")


def _order_error(call: str, op: Op, late: int) -> str:
    return (f"{call}: {_where(op)} is tagged jshard.pipeline_stage(fn, {op.tag}), but it reads a value made on "
            f"stage {late}: stages must not decrease along the data flow (a stage only sends to later ones). "
            f"Tag it {late} or later, or move the producer to stage {op.tag} or earlier.")


def _no_tags_error(call: str, stages: int, priced: bool = False, ops: int = 0) -> str:
    why = (f" Cut by the cost model, its {ops} operator(s) hold fewer narrow places to end a stage at (where no "
           f"more crosses than between two of its layers) than the {stages - 1} cut(s) {stages} stages need."
           if priced else "")
    return (f"{call}: stages={stages}, but no operator of the loss is tagged with a stage.{why} Wrap the "
            f"parts of the model in jshard.pipeline_stage(fn, k) (the embedding and first layers k=0, ..., the "
            f"head k={stages - 1}), or pass a jshard.Pipeline(first=..., layer=..., last=...).")
