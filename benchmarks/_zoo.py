"""Table: the zoo. Models jshard was not shaped on, written the way their authors write them
(`tests/clients/`: Flax Linen with logical axis rules, Flax NNX sharding itself on an explicit
mesh, plain JAX with a Python loop over layers, an equinox-style pytree module, a Linen ResNet),
each with its author's own anchors and its author's expert plan under a plain `jax.jit`.

Per model and batch layout (given as the expert lays it, or left to jshard's default), the expert's
compiled program, jshard's (`mode="semi_auto"`, `propagation="jshard"`) and Shardy's from the same
anchors (`propagation="xla"`): compiled collective bytes per step (`jshard.audit`), their ratio to
the expert's and to Shardy's, peak memory per device, and the loss against one device's. A jshard
row that moves more than Shardy's or more than `1 + EXPERT_SLACK` times the expert's is marked
(issue 15: "if it is not, the benchmark table says so in red").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax

import jshard as js
from benchmarks._compiled import EXPERT_SLACK, LOSS_RTOL, error_line, loss_check
from benchmarks._table import Table, size
from tests.clients import eqx_style_vit, linen_lm, linen_resnet, loop_gpt, nnx_gqa, one_device

LAYOUTS = {"loop_gpt": ("given", "default"), "linen_lm": ("given", "default"), "nnx_gqa": ("given",),
           "eqx_vit": ("given", "default"), "linen_resnet": ("given",)}
"""The zoo's models, each with the batch layouts it is measured with (`given`: as the expert lays the
batch; `default`: left to jshard's dataset strategy)."""
MODELS = tuple(LAYOUTS)
PLANS = ("expert", "jshard", "shardy", "search")
"""The author's `jax.jit`; jshard's and Shardy's propagation from the model's anchors
(`mode="semi_auto"`); jshard's search (`mode="auto"`, the recursive search, the anchors kept)."""
WORSE = "🔴 **WORSE**"
"""The marker of a jshard row that misses a target (GitHub renders the circle red)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One zoo model, ready to run.

    Attributes:
      name / style: the model, and the style it is written in.
      context: enters what the author's step runs under (their mesh, their logical rules).
      step: the train step as its author wrote it (its loss the last output).
      args: the step's arguments per batch layout (`given`: as the expert lays them; `default`:
        the batch as a plain array, where the model leaves it to the caller).
      options: `jshard.parallelize` options per batch layout, besides mode and propagation.
      expert: compiles the expert's program for `args["given"]`.
      reference: the step's outputs on one device (fetched to the host).
      params / batch: the pytrees a tolerance's term count is taken from.
    """

    name: str
    style: str
    context: Callable[[], contextlib.AbstractContextManager]
    step: Callable
    args: dict[str, tuple]
    options: dict[str, dict]
    expert: Callable[[], jax.stages.Compiled]
    reference: object
    params: object
    batch: object


@dataclasses.dataclass(frozen=True)
class Row:
    """What one plan of one zoo model compiled to: `audit` None where it failed (`error`)."""

    model: str
    layout: str
    plan: str
    audit: js.Audit | None
    outputs: object = None
    error: str = ""


@functools.cache
def case(name: str) -> Case:
    """The zoo model `name` (one of `MODELS`), built once."""
    return {"loop_gpt": _loop_gpt, "linen_lm": _linen_lm, "nnx_gqa": _nnx_gqa, "eqx_vit": _eqx_vit,
            "linen_resnet": _linen_resnet}[name]()


@functools.cache
def measure(name: str, layout: str, plan: str) -> Row:
    """`plan` (one of `PLANS`) of the zoo model `name` with its batch `layout`, compiled once,
    audited and run one step."""
    c = case(name)
    try:
        with c.context():
            if plan == "expert":
                compiled = c.expert()
            else:
                mode = {"jshard": {"mode": "semi_auto"}, "shardy": {"mode": "semi_auto", "propagation": "xla"},
                        "search": {"mode": "auto"}}[plan]
                compiled = js.parallelize(c.step, **mode, **c.options[layout]).lower(*c.args[layout]).compile()
            outputs = jax.device_get(compiled(*jax.device_put(c.args[layout], compiled.input_shardings[0])))
    except Exception as e:  # a plan that fails is a row of the report, not the end of the run
        return Row(name, layout, plan, None, error=error_line(e))
    return Row(name, layout, plan, js.audit(compiled), outputs)


def zoo_table(models: tuple[str, ...] = MODELS, search: bool = True) -> Table:
    """The zoo table: per model, the expert row, then jshard's and Shardy's per batch layout, then
    (with `search`) the search's with the batch given."""
    cells = []
    for name in models:
        c = case(name)
        expert = measure(name, "given", "expert")
        cells.append(_cells(c, expert, expert, None, c.style))
        for layout in LAYOUTS[name]:
            shardy = measure(name, layout, "shardy")
            cells.append(_cells(c, measure(name, layout, "jshard"), expert, shardy))
            cells.append(_cells(c, shardy, expert, None))
        if search:
            cells.append(_cells(c, measure(name, "given", "search"), expert, measure(name, "given", "shardy")))
    return Table(
        "15. The zoo: models jshard was not shaped on, against their authors' expert plans and Shardy",
        f"jshard's compiled collective bytes <= Shardy's from the same anchors and <= {1 + EXPERT_SLACK:g}x the "
        f"expert's, its peak memory per device <= {1 + EXPERT_SLACK:g}x the expert's, with the batch's layout given "
        "or left default; the loss equal to one device's.",
        ("model", "style", "batch", "plan", "bytes/step", "x expert", "x Shardy", "peak", "loss vs 1 device", "target"),
        tuple(cells),
        ("Bytes per device per step read by `jshard.audit` from the compiled HLO; peak from XLA's "
         "`memory_analysis()` (arguments + outputs + temp - aliased), in brackets over the expert's.",
         "expert: the author's own sharding under a plain `jax.jit` (tests/clients/: loop_gpt's Megatron layout with "
         "the tied embedding cut by vocabulary; linen_lm's `nn.logical_to_mesh_sharding`; nnx_gqa's own `jax.jit` of "
         "its explicitly sharded state; eqx_vit's `device_put` of its pytree by its path rule; linen_resnet's data "
         "parallel). jshard / Shardy: `parallelize(step, mode='semi_auto', propagation='jshard' / 'xla')` with the "
         "model's own anchors (`shard` tuples, logical constraints, `out_sharding`s, `with_sharding_constraint`s).",
         "jshard search: `mode='auto'` (the recursive search, no memory budget), the model's anchors kept; its "
         "ratio to Shardy is to Shardy's propagation with the batch given. Not held to the targets: with no budget "
         "it may trade memory for bytes (see peak).",
         "batch given: the arguments placed as the expert places them (loop_gpt: `in_strategy=(None, (2, 1))`); "
         "default: the batch left to jshard's dataset strategy. nnx_gqa creates its batch sharded on Explicit axes "
         "and linen_resnet's expert is data parallel, so they have no default row.",
         f"target: {WORSE} where jshard moves more than Shardy or more than {1 + EXPERT_SLACK:g}x the expert, or "
         f"peaks above {1 + EXPERT_SLACK:g}x the expert's peak.",
         f"loss vs 1 device: relative difference of the step's loss from the same step on one device (equal: at "
         f"most {LOSS_RTOL:g}; tests/test_zoo.py compares every output with tests/_tolerance.py)."),
    )


def _cells(c: Case, row: Row, expert: Row, shardy: Row | None, style: str = "") -> tuple[str, ...]:
    """One row's cells (the model's style on its first row only)."""
    label = {"expert": "expert jax.jit", "jshard": "jshard", "shardy": "Shardy", "search": "jshard search"}[row.plan]
    head = (c.name, style, row.layout, label)
    if row.audit is None:
        return (*head, f"failed: {row.error}", "-", "-", "-", "-", WORSE if row.plan == "jshard" else "")
    got = row.audit.bytes()
    versus_expert = _ratio(got, expert)
    versus_shardy = _ratio(got, shardy) if shardy is not None else "-"
    loss = loss_check(float(row.outputs[-1]), float(c.reference[-1]))
    peak = size(row.audit.memory.peak_bytes)
    if expert.audit is not None and row.plan != "expert":
        peak += f" ({row.audit.memory.peak_bytes / expert.audit.memory.peak_bytes:.3f}x)"
    return (*head, size(got), versus_expert, versus_shardy, peak, loss,
            _target(row, expert, shardy) if row.plan == "jshard" else "")


def _ratio(got: float, other: Row) -> str:
    if other.audit is None:
        return "-"
    theirs = other.audit.bytes()
    return f"{got / theirs:.3f}" if theirs else ("1.000" if got == 0 else "inf")


def _target(row: Row, expert: Row, shardy: Row) -> str:
    assert row.audit is not None  # a failed row is marked before
    got, misses = row.audit.bytes(), []
    if shardy.audit is not None and got > shardy.audit.bytes():
        misses.append("than Shardy")
    if expert.audit is not None and got > (1 + EXPERT_SLACK) * expert.audit.bytes():
        misses.append(f"than {1 + EXPERT_SLACK:g}x the expert")
    if expert.audit is not None and row.audit.memory.peak_bytes > (1 + EXPERT_SLACK) * expert.audit.memory.peak_bytes:
        misses.append(f"peak than {1 + EXPERT_SLACK:g}x the expert's")
    return f"{WORSE} {' and '.join(misses)}" if misses else "meets"


def _loop_gpt() -> Case:
    params, tokens = loop_gpt.create()
    mesh = loop_gpt.make_mesh()
    psh, tsh = loop_gpt.expert_shardings(mesh, params)
    expert = jax.jit(loop_gpt.train_step, in_shardings=(psh, tsh), out_shardings=(psh, None))
    reference = jax.device_get(one_device(loop_gpt.train_step, params, tokens))
    return Case("loop_gpt", "plain JAX, Python loop over layers, Megatron `shard` tuples", contextlib.nullcontext,
                loop_gpt.train_step, {"given": (params, tokens), "default": (params, tokens)},
                {"given": {"devices": 8, "in_strategy": (None, (loop_gpt.DP, 1))}, "default": {"devices": 8}},
                lambda: expert.lower(params, tokens).compile(), reference, params, tokens)


def _linen_lm() -> Case:
    mesh, (state, batch), rng = linen_lm.make_mesh(), linen_lm.create_state(), jax.random.key(1)
    state_sh, batch_sh = linen_lm.expert_shardings(mesh)

    @contextlib.contextmanager
    def context():
        with jax.set_mesh(mesh), nn.logical_axis_rules(linen_lm.LOGICAL_RULES):
            yield

    with context():
        placed = jax.device_put((state, batch), (state_sh, batch_sh))
    expert = jax.jit(linen_lm.train_step, in_shardings=(state_sh, batch_sh, None))
    options = {"batch_argnums": 1}
    return Case("linen_lm", "Flax Linen, logical axis rules, dropout", context, linen_lm.train_step,
                {"given": (*placed, rng), "default": (placed[0], jax.device_get(batch), rng)},
                {"given": options, "default": options}, lambda: expert.lower(*placed, rng).compile(),
                jax.device_get(one_device(linen_lm.train_step, state, batch, rng)), state.params, batch)


def _nnx_gqa() -> Case:
    mesh, one = nnx_gqa.make_mesh(jax.devices()), nnx_gqa.make_mesh(jax.devices()[:1])
    with jax.set_mesh(mesh):
        graphdef, state, batch = nnx_gqa.create_state(mesh)
    step = functools.partial(nnx_gqa.train_step, graphdef)
    with jax.set_mesh(one):
        reference = jax.device_get(jax.jit(step)(*nnx_gqa.moved((state, batch), one)))
    return Case("nnx_gqa", "Flax NNX, Explicit mesh axes, `out_sharding` on every einsum",
                functools.partial(jax.set_mesh, mesh), step, {"given": (state, batch)}, {"given": {}},
                lambda: jax.jit(step).lower(state, batch).compile(), reference, state, batch)


def _eqx_vit() -> Case:
    model, opt_state, images, labels = eqx_style_vit.create()
    mesh = eqx_style_vit.make_mesh()
    with jax.set_mesh(mesh):
        placed = eqx_style_vit.place(mesh, model, opt_state, images, labels)
    one = eqx_style_vit.make_mesh(jax.devices()[:1], shape=(1, 1))
    with jax.set_mesh(one):
        reference = jax.device_get(jax.jit(eqx_style_vit.train_step)(model, opt_state, images, labels))
    options = {"batch_argnums": (2, 3)}
    return Case("eqx_vit", "equinox-style pytree modules, `vmap` inside, `with_sharding_constraint`",
                functools.partial(jax.set_mesh, mesh), eqx_style_vit.train_step,
                {"given": placed, "default": (*placed[:2], jax.device_get(images), jax.device_get(labels))},
                {"given": options, "default": options}, lambda: jax.jit(eqx_style_vit.train_step).lower(*placed).compile(),
                reference, model, (images, labels))


def _linen_resnet() -> Case:
    mesh, (state, batch) = linen_resnet.make_mesh(), linen_resnet.create_state()
    state_sh, batch_sh = linen_resnet.expert_shardings(mesh)
    with jax.set_mesh(mesh):
        placed = jax.device_put(batch, batch_sh)
    expert = jax.jit(linen_resnet.train_step, in_shardings=(state_sh, batch_sh))
    return Case("linen_resnet", "Flax Linen, BatchNorm, data parallel", functools.partial(jax.set_mesh, mesh),
                linen_resnet.train_step, {"given": (state, placed)}, {"given": {}},
                lambda: expert.lower(state, placed).compile(),
                jax.device_get(one_device(linen_resnet.train_step, state, batch)), state.params, batch)
