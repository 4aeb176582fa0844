"""Table: the zoo. Models jshard was not shaped on, written the way their authors write them
(`tests/clients/`: Flax Linen with logical axis rules, Flax NNX sharding itself on an explicit
mesh, plain JAX with a Python loop over layers, an equinox-style pytree module, a Linen ResNet), and
models imported unmodified from a package users install (Hugging Face transformers' Flax Llama and
ViT, pinned in the `test` extra, each anchored two ways: one shared `Layout`, or tuples given
apart), each with its author's own anchors and its author's expert plan under a plain `jax.jit`.

Per model and batch layout (given as the expert lays it, or left to jshard's default), the expert's
compiled program, jshard's (`mode="semi_auto"`, `propagation="jshard"`) and Shardy's from the same
anchors (`propagation="xla"`): compiled collective bytes per step (`jshard.audit`), their ratio to
the expert's and to Shardy's, peak memory per device and its ratio to the expert's, and the loss
against one device's. A jshard row that moves more than Shardy's or more than `1 + EXPERT_SLACK`
times the expert's, or peaks above `1 + EXPERT_SLACK` times the expert's peak, is marked (issue 15:
"if it is not, the benchmark table says so in red"; issue 32: "peak <= 1.05x the expert").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable

import flax.linen as nn
import jax

import jshard as js
from benchmarks._compiled import EXPERT_SLACK, LOSS_RTOL, error_line, loss_check
from benchmarks._table import Table, size
from tests.clients import eqx_style_vit, linen_lm, linen_resnet, loop_gpt, nnx_gqa, one_device

IMPORTED = {"hf_llama": "hf_llama", "hf_llama_tuples": "hf_llama", "hf_vit": "hf_vit", "hf_vit_tuples": "hf_vit"}
"""The zoo's models imported unmodified from transformers, each the client module it comes from
(`tests/clients/`, whose `MODEL` is the class it imports): `hf_llama` anchored by one shared `Layout`,
`hf_llama_tuples` by strategy tuples given apart (the same rules, the same expert). Measured where
transformers (the `test` extra) is installed."""
VARIANTS = {"hf_llama_tuples": "hf_llama", "hf_vit_tuples": "hf_vit"}
"""A zoo model that is another's step with other anchors: its expert and reference are that model's."""
LAYOUTS = {"loop_gpt": ("given", "default"), "linen_lm": ("given", "default"), "nnx_gqa": ("given",),
           "eqx_vit": ("given", "default"), "linen_resnet": ("given",),
           **({name: ("given", "default") for name in IMPORTED} if importlib.util.find_spec("transformers") else {})}
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
      step: the train step as its author wrote it (its loss the last output, or that output's `"loss"`).
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
    if name in IMPORTED:
        return _imported(name)
    return {"loop_gpt": _loop_gpt, "linen_lm": _linen_lm, "nnx_gqa": _nnx_gqa, "eqx_vit": _eqx_vit,
            "linen_resnet": _linen_resnet}[name]()


@functools.cache
def measure(name: str, layout: str, plan: str) -> Row:
    """`plan` (one of `PLANS`) of the zoo model `name` with its batch `layout`, compiled once,
    audited and run one step."""
    if plan == "expert" and name in VARIANTS:  # the same program as its model's: compiled once
        return dataclasses.replace(measure(VARIANTS[name], layout, plan), model=name)
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


def zoo_table(models: tuple[str, ...] = MODELS, search: bool = True, layouts: dict | None = None) -> Table:
    """The zoo table: per model, the expert row, then jshard's and Shardy's per batch layout
    (`layouts[name]`, default `LAYOUTS[name]`), then (with `search`) the search's with the batch given."""
    cells = []
    for name in models:
        c = case(name)
        expert = measure(name, "given", "expert")
        cells.append(_cells(c, expert, expert, None, c.style))
        for layout in (layouts or LAYOUTS)[name]:
            shardy = measure(name, layout, "shardy")
            cells.append(_cells(c, measure(name, layout, "jshard"), expert, shardy))
            cells.append(_cells(c, shardy, expert, None))
        if search:
            cells.append(_cells(c, measure(name, "given", "search"), expert, measure(name, "given", "shardy")))
    slack = f"{1 + EXPERT_SLACK:g}x"
    return Table(
        "15. The zoo: models jshard was not shaped on, against their authors' expert plans and Shardy",
        f"jshard's compiled collective bytes <= Shardy's from the same anchors and <= {slack} the expert's, its peak "
        f"memory <= {slack} the expert's, with the batch's layout given or left default; the loss equal to one device's.",
        ("model", "style", "batch", "plan", "bytes/step", "x expert", "x Shardy", "peak", "peak x expert",
         "loss vs 1 device", "target"),
        tuple(cells),
        ("Bytes per device per step read by `jshard.audit` from the compiled HLO; peak from XLA's "
         "`memory_analysis()` (arguments + outputs + temp - aliased); peak x expert: its ratio to the expert's peak "
         "(every expert fits the simulated devices).",
         "expert: the author's own sharding under a plain `jax.jit` (tests/clients/: loop_gpt's Megatron layout with "
         "the tied embedding cut by vocabulary; linen_lm's `nn.logical_to_mesh_sharding`; nnx_gqa's own `jax.jit` of "
         "its explicitly sharded state; eqx_vit's `device_put` of its pytree by its path rule; linen_resnet's data "
         "parallel; hf_llama's and hf_vit's Megatron partition rules by path regex over the whole `TrainState`, "
         "EasyLM's `match_partition_rules`, on a dp 2 x mp 4 mesh). jshard / Shardy: `parallelize(step, "
         "mode='semi_auto', propagation='jshard' / 'xla')` with the model's own anchors (`shard` tuples, logical "
         "constraints, `out_sharding`s, `with_sharding_constraint`s; for hf_*: the same rules on the parameters as "
         "`in_strategy`, calls of one shared `Layout((2, 4), ('dp', 'mp'))`, or in hf_*_tuples strategy tuples given "
         "apart, the optimizer state left to the planner).",
         "hf_llama, hf_vit: `FlaxLlamaForCausalLM` (2 layers, width 64, 4 query and 2 key/value heads, vocabulary "
         "256, 8 x 16 tokens) and `FlaxViTForImageClassification` (2 layers, width 64, 4 heads, 8 images of 3 x 16 x "
         "16 in 4 x 4 patches), imported unmodified from transformers 4.57.6 (the `test` extra), random weights, "
         "trained as the library's Flax examples train them (`TrainState`, AdamW, `value_and_grad`).",
         "jshard search: `mode='auto'` (the recursive search, no memory budget), the model's anchors kept; its "
         "ratio to Shardy is to Shardy's propagation with the batch given. Not held to the targets: with no budget "
         "it may trade memory for bytes (see peak).",
         "batch given: the arguments placed as the expert places them (loop_gpt: `in_strategy=(None, (2, 1))`; "
         "hf_*: rows over dp in the parameters' form); default: the batch left to jshard's dataset strategy. "
         "nnx_gqa creates its batch sharded on Explicit axes and linen_resnet's expert is data parallel, so they "
         "have no default row.",
         "hf_*_tuples: each tuple is its own device matrix, the repeat appended minor (MindSpore's repeated "
         "calculation), so the kernels' `(1, 4)` take the mesh's two major axes and the batch's `(2, 1)` the major "
         "one: they collide (jshard warns, `LayoutCollisionWarning`, proposing the shared `Layout` of hf_*). Both "
         "cuts are kept as given: the arguments, the parameters' updates and AdamW's moments (laid out as their "
         "parameters) stay in them. With the batch given, jshard moves the batch once at the start onto the minor "
         "axis the kernels leave (a collective-permute of half of it) and runs Megatron on the kernels' own "
         "layout, so it meets the expert's bytes and peak; Shardy, propagating the collision, redistributes "
         "kernels at every matrix product. With the batch default, the default cut (rank order over the 8 "
         "devices) reaches that minor axis through a collective-permute of one device's rows before the "
         "all-gather hf_* also makes (3 KiB on hf_vit, 1.052x its expert where hf_vit is 1.041x): rank r "
         "holds rows block r, and the blocks a minor-axis half needs lie on the other half's devices.",
         f"target: {WORSE} where jshard moves more than Shardy or more than {slack} the expert, or its peak is more "
         f"than {slack} the expert's (what it misses named).",
         f"loss vs 1 device: relative difference of the step's loss from the same step on one device (equal: at "
         f"most {LOSS_RTOL:g}; tests/test_zoo.py compares every output with tests/_tolerance.py)."),
    )


def _cells(c: Case, row: Row, expert: Row, shardy: Row | None, style: str = "") -> tuple[str, ...]:
    """One row's cells (the model's style on its first row only)."""
    label = {"expert": "expert jax.jit", "jshard": "jshard", "shardy": "Shardy", "search": "jshard search"}[row.plan]
    head = (c.name, style, row.layout, label)
    if row.audit is None:
        return (*head, f"failed: {row.error}", "-", "-", "-", "-", "-", WORSE if row.plan == "jshard" else "")
    got, peak = row.audit.bytes(), row.audit.memory.peak_bytes
    loss = loss_check(_loss(row.outputs), _loss(c.reference))
    return (*head, size(got), _ratio(got, expert), _ratio(got, shardy) if shardy is not None else "-", size(peak),
            _ratio(peak, expert, peak=True), loss, _target(row, expert, shardy) if row.plan == "jshard" else "")


def _loss(outputs) -> float:
    """The step's loss: its last output, or that output's `"loss"` (transformers' examples return a dict
    of metrics)."""
    last = outputs[-1]
    return float(last["loss"] if isinstance(last, dict) else last)


def _ratio(got: float, other: Row, peak: bool = False) -> str:
    if other.audit is None:
        return "-"
    theirs = other.audit.memory.peak_bytes if peak else other.audit.bytes()
    return f"{got / theirs:.3f}" if theirs else ("1.000" if got == 0 else "inf")


def _misses(row: Row, expert: Row, shardy: Row) -> list[str]:
    """The targets jshard's `row` misses against the `expert`'s and `shardy`'s rows, each as its cell
    names it (none: meets every one)."""
    slack = 1 + EXPERT_SLACK
    got, out = row.audit.bytes(), []
    if shardy.audit is not None and got > shardy.audit.bytes():
        out.append("bytes > Shardy")
    if expert.audit is not None and got > slack * expert.audit.bytes():
        out.append(f"bytes > {slack:g}x expert")
    if expert.audit is not None and row.audit.memory.peak_bytes > slack * expert.audit.memory.peak_bytes:
        out.append(f"peak > {slack:g}x expert")
    return out


def _target(row: Row, expert: Row, shardy: Row) -> str:
    missed = _misses(row, expert, shardy)
    return f"{WORSE}: {', '.join(missed)}" if missed else "meets"


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


def _imported(name: str) -> Case:
    """A model imported from transformers (`IMPORTED`), anchored by one shared `Layout` or, in a
    `*_tuples` variant, by strategy tuples given apart."""
    module, (state, batch, reference, expert) = importlib.import_module(f"tests.clients.{IMPORTED[name]}"), _hf(name)
    shared = name not in VARIANTS
    strategies = module.strategies(state, shared)
    anchors = "one shared `Layout`" if shared else "strategy tuples given apart"
    return Case(name, f"transformers' `{module.MODEL.__name__}` imported unmodified, Megatron rules by path regex as "
                f"{anchors}", _allow_rank_promotion, module.train_step,
                {"given": (state, batch), "default": (state, batch)},
                {"given": {"devices": 8, "in_strategy": (strategies, module.batch_strategy(shared))},
                 "default": {"devices": 8, "in_strategy": (strategies, None)}},
                expert, reference, state.params, batch)


@functools.cache
def _hf(name: str) -> tuple:
    """`(state, batch, reference, expert)` of the client module behind `name`, shared by its variants."""
    if name in VARIANTS:
        return _hf(VARIANTS[name])
    module = importlib.import_module(f"tests.clients.{IMPORTED[name]}")
    with _allow_rank_promotion():
        state, batch = module.create()
        reference = jax.device_get(one_device(module.train_step, state, batch))
    state_sh, batch_sh = module.expert_shardings(module.make_mesh(), state)
    expert = jax.jit(module.train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None))
    return state, batch, reference, lambda: expert.lower(state, batch).compile()


def _allow_rank_promotion() -> contextlib.AbstractContextManager:
    """transformers' Flax models add rank-1 parameters to rank-3 values, as NumPy allows (the test suite
    raises on rank promotion)."""
    return jax.numpy_rank_promotion("allow")
