"""Tables 19 and 19b: communication fusion (MindSpore's `comm_fusion`, `parallelize(...,
communication=js.Communication(fusion=...))`) and multi-copy, on the reference GPT and the zoo's
plain-JAX GPT (`tests/clients/loop_gpt.py`): the gradient all-reduces' count and bytes per setting,
read from the compiled programs (`jshard.audit`), against the buckets the plan records and the
loss of one device: deterministic figures; and (19b) the predicted step time per copy count on an abstract
H100 mesh, with what the search chose."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jshard as js
from benchmarks._table import Table, size
from jshard import models
from jshard.cost import CostModel
from tests.clients import loop_gpt

SETTINGS = (
    ("no communication= (XLA's combiner)", None),
    ("openstate False", {"openstate": False}),
    ("allreduce size 0", {"allreduce": {"mode": "size", "config": 0}}),
    ("allreduce size 0.25 MiB", {"allreduce": {"mode": "size", "config": 0.25}}),
    ("allreduce size 1 MiB", {"allreduce": {"mode": "size", "config": 1}}),
    ("allreduce auto (64 MiB buckets)", {"allreduce": {"mode": "auto"}}),
    ("allreduce index [4, 12]", {"allreduce": {"mode": "index", "config": [4, 12]}}),
)
"""Each fusion setting measured: its label, and MindSpore's `comm_fusion` dict (None: no `communication=`)."""


def _gpt():
    cfg = models.GPTConfig(n_layers=2)
    params = models.init_gpt(cfg, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(1), cfg, 64)
    return "reference GPT (2 layers)", lambda p, b: models.gpt_loss(p, b, cfg), params, batch


def _zoo():
    params, tokens = loop_gpt.create(rows=64)
    return "zoo: loop_gpt (plain JAX)", loop_gpt.loss_fn, params, tokens


def _row(name: str, label: str, loss, params, batch, fusion, copies: int = 1, **options) -> tuple[str, ...]:
    """One setting's compiled all-reduces (count, bytes), the plan's buckets, the compiled temporary
    bytes and what the plan says the copies hold, and the loss's distance from one device's."""
    grads = jax.value_and_grad(loss)
    marked = (lambda p, b: js.accumulate(grads)(p, b)) if fusion is not None or copies > 1 else grads
    comm = None if fusion is None and copies == 1 else js.Communication(copies, fusion)
    step = js.parallelize(marked, devices=8, communication=comm, **options)
    compiled = step.lower(params, batch).compile()
    report = js.audit(compiled)
    count, moved = report.by_kind().get("all-reduce", (0.0, 0.0))
    plan = step.plan(params, batch).communication
    sizes = [] if plan is None else [b for _, _, b in plan.buckets if b is not None]
    if plan is None or not plan.buckets:
        made = "-"
    else:
        made = f"{len(plan.buckets)}: " + (f"{size(min(sizes))} to {size(max(sizes))}" if sizes else "one per gradient")
    reference = float(jax.jit(loss)(params, batch))
    got = float(step(params, batch)[0])
    held = "-" if plan is None or copies == 1 else size(plan.copy_bytes)
    return (name, label, f"{count:.0f}", size(moved), made, size(compiled.memory_analysis().temp_size_in_bytes), held,
            f"{abs(got - reference):.2g}")


def fusion_table() -> Table:
    """The gradient all-reduces per fusion setting (data parallel, 8 devices), and multi-copy on
    the zoo GPT under its Megatron anchors."""
    rows = []
    for name, loss, params, batch in (_gpt(), _zoo()):
        for label, fusion in SETTINGS:
            rows.append(_row(name, label, loss, params, batch, fusion, mode="data"))
    name, loss, params, batch = _zoo()
    for copies in (1, 2):
        rows.append(_row(f"{name}, Megatron anchors (dp 2 x mp 4)", f"copies={copies}, allreduce size 0", loss, params,
                         batch, {"allreduce": {"mode": "size", "config": 0}}, copies, mode="semi_auto",
                         in_strategy=(None, (loop_gpt.DP, 1))))
    return Table(
        "19. Communication fusion and multi-copy: the gradient all-reduces per setting, 8 devices",
        "threshold 0 keeps every gradient's all-reduce apart, a large threshold fuses them into one per dtype, "
        "index splits them where asked; the count and bytes the audit reads equal the plan's buckets; the loss "
        "equals one device's",
        ("model", "setting", "all-reduces", "all-reduce bytes", "jshard's buckets: count, smallest to largest",
         "temp (compiled)", "copies hold (plan)", "loss against one device (abs. difference)"),
        tuple(rows),
        (
            "Data parallel on 8 simulated CPU devices (`mode=\"data\"`), one step of `jax.value_and_grad(loss)`; "
            "with `communication=` the gradient function is wrapped in `js.accumulate`, so jshard reduces the "
            "gradients itself, in buckets. Counts and bytes per device from the compiled HLO (`jshard.audit`).",
            "No communication=: XLA reduces the gradients and its CPU all-reduce combiner merges them (it takes no "
            "threshold; XLA:CPU merges no all-gathers or reduce-scatters). With communication=, the combiner is off "
            "(`xla_disable_hlo_passes=cpu-all-reduce-combiner`) and each bucket is one all-reduce; on a GPU the "
            "thresholds go to `xla_gpu_*_combine_threshold_bytes`. index numbers the parameters in "
            "`jax.tree.leaves` order (the loss joins the first bucket).",
            "Without communication= on loop_gpt XLA moves 128 KiB more: it all-reduces the tied embedding's two "
            "gradients (the lookup's and the output head's) apart before adding them; jshard sums on each device "
            "first and reduces once.",
            "The last rows: the zoo GPT under its own Megatron `shard` anchors (tensor parallel over mp, the "
            "tokens over dp): the gradients, cut over mp, get one all-reduce each over dp (jshard flattens no "
            "gradient another axis cuts); with copies=2 each copy's tensor-parallel all-reduces are its own "
            "(twice as many, half the bytes each), none merged across copies. temp: XLA's temporary bytes per "
            "device (`memory_analysis()`); copies hold: `plan.communication.copy_bytes`, the other copy's loss and "
            "gradients until they are summed, as the dp-manual region holds them (before mp cuts them). XLA's temp "
            "with copies=2 against copies=1 says whether its schedule held both copies' activations at once.",
        ),
    )


def _abstract_gpt(rows: int):
    """The reference GPT at a GPU's scale (width 1024, sequences of 512), as shapes."""
    cfg = models.GPTConfig(vocab=1024, seq_len=512, d_model=1024, n_heads=16, n_layers=2, d_ff=4096)
    params = jax.eval_shape(lambda: models.init_gpt(cfg, jax.random.key(0)))
    batch = jax.eval_shape(lambda: models.copy_task_batch(np.random.default_rng(1), cfg, rows))
    return "reference GPT (2 layers, width 1024, 8 x 512 tokens)", lambda p, b: models.gpt_loss(p, b, cfg), params, batch


def _abstract_hf_gpt2(rows: int):
    """The zoo's Hugging Face GPT-2 (`tests/clients/hf_gpt2.py`'s loss) at the same scale, as shapes."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    from tests.clients import hf_gpt2

    model = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=512, n_embd=1024, n_layer=2, n_head=16),
                                seed=0, _do_init=False)
    params = jax.eval_shape(lambda: model.init_weights(jax.random.key(0), (1, 512)))
    ids = jax.ShapeDtypeStruct((rows, 512), np.int32)
    return ("zoo: hf_gpt2 (2 layers, width 1024, 8 x 512 tokens)", lambda p, b: hf_gpt2.loss_fn(model.__call__, p, b),
            params, {"input_ids": ids, "labels": ids})


def _abstract_mlp(rows: int):
    """Two MLP blocks of width 4096 (`tests/test_comm_weighed.py`'s), as shapes: the search cuts them
    Megatron's way, their activations all-reduced between the matmuls."""
    def loss(p, b):
        h = b["x"]
        for w1, w2 in p:
            h = jnp.tanh(h @ w1) @ w2
        return jnp.mean((h - b["y"]) ** 2)

    f32 = jnp.float32
    params = [(jax.ShapeDtypeStruct((4096, 16384), f32), jax.ShapeDtypeStruct((16384, 4096), f32))] * 2
    return "MLP blocks (width 4096, 4096 rows)", loss, params, {k: jax.ShapeDtypeStruct((rows, 4096), f32) for k in "xy"}


def _copy_rows(name: str, loss, params, batch) -> list[tuple[str, ...]]:
    """One model's rows: each copy count as given (`communication=n`), then the search's own choice."""
    h100 = CostModel.for_device("H100")
    step = lambda p, b: js.accumulate(jax.value_and_grad(loss), 1)(p, b)  # noqa: E731
    rows = []
    for copies in (1, 2, 4, None):
        plan = js.parallelize(step, devices=8, mode="auto", cost_model=h100, communication=copies).plan(params, batch)
        work, search = plan.work, plan.search
        label = f"copies={copies} (given)" if copies else "no communication= (the search weighs)"
        chosen = "-" if copies else plan.communication.why.removeprefix("chosen by the search: ").split(":")[0]
        rows.append((name, label, f"{search.seconds * 1e3:.3f} ms", f"{work.seconds * 1e3:.3f} ms",
                     f"{work.comm_seconds * 1e3:.3f} ms", f"{work.hidden_seconds * 1e3:.3f} ms", size(search.peak_bytes),
                     chosen))
    return rows


def multi_copy_table() -> Table:
    """Table 19b: the predicted step time with and without multi-copy on an abstract H100 mesh."""
    rows = []
    for name, loss, params, batch in (_abstract_gpt(8), _abstract_hf_gpt2(8), _abstract_mlp(4096)):
        rows += _copy_rows(name, loss, params, batch)
    return Table(
        "19b. Multi-copy on an abstract H100 mesh: the predicted step time per copy count, and the search's choice",
        "the search keeps the copy count (and all-reduce fusion) its cost model predicts fastest; where it chooses "
        "copies > 1 one copy's collectives hide behind another copy's compute",
        ("model", "communication", "predicted step (search)", "predicted step (plan.work)", "collectives",
         "of which hidden", "estimated peak", "the search chose"),
        tuple(rows),
        (
            "8 devices of an abstract H100 mesh (`cost_model=CostModel.for_device(\"H100\")`: the roofline, collectives "
            "overlapping the compute that does not depend on them), `mode=\"auto\"`, the step "
            "`js.accumulate(jax.value_and_grad(loss), 1)`; planned only (`.plan` on shapes), nothing compiled. "
            "predicted step (search): what the search compares (`plan.search.seconds`, the makespan of its schedule); "
            "plan.work: the built plan's makespan, its collectives' seconds and what of them runs beside compute.",
            "Under mode=\"auto\" the copies run in the global view: the search lays out each copy, and each copy's "
            "weight gradients are all-reduced apart (the search prices a partial sum where its operator makes it), so "
            "copies pay the gradients' all-reduce n times: on both GPTs the data-parallel gradients dominate and one "
            "copy wins. On the MLP blocks, cut Megatron's way (no gradient all-reduce; activations all-reduced between "
            "the matmuls), two copies hide one copy's all-reduces behind the other's matmuls and the search takes them.",
            "allreduce size 0 (XLA's combiner off, each all-reduce starting once its operand is made) is weighed too "
            "(`Plan.communication.weighed`); it predicts more here (each all-reduce pays its latency).",
        ),
    )
