"""Table 20: plans at scale (issue 34 item 3). A Mixtral-8x7B-class MoE and a 128k-token Llama-class step
planned by `jshard.parallelize(mode="auto")` for 256 and 1024 H100s under an 80 GiB budget on abstract
meshes (nothing compiled), beside the configurations MaxText, torchtitan and Megatron-LM publish for the
same models, each with its source; where jshard can express a published configuration, that
configuration planned through jshard too, so both are priced by the same cost model.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax

import jshard as js
from benchmarks import _llama
from benchmarks._compiled import error_line
from benchmarks._table import Table, size
from jshard import models
from jshard.cost import CostModel

BUDGET, DEVICE = 80 * 2**30, "H100"
COUNTS = (256, 1024)

MIXTRAL = _llama.Decoder(
    "Mixtral 8x7B",
    vocab=32000,
    seq_len=4096,
    d_model=4096,
    n_heads=32,
    n_kv_heads=8,
    d_ff=14336,
    n_layers=32,
    n_experts=8,
    top_k=2,
    rope_theta=1e6,
    attention_block=4096,
)
LLAMA_8B = _llama.Decoder(
    "Llama 3 8B, 128k", vocab=128256, seq_len=131072, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, n_layers=32
)
LLAMA_70B = _llama.Decoder(
    "Llama 3 70B, 128k", vocab=128256, seq_len=131072, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, n_layers=80
)


class Case(NamedTuple):
    """One model at one device count: `batch(devices)` sequences per step."""

    cfg: _llama.Decoder
    batch: Callable[[int], int]
    batch_rule: str


CASES = (
    Case(MIXTRAL, lambda n: 4 * n, "4 sequences per device (Megatron-LM's 256 on 64 GPUs)"),
    Case(LLAMA_8B, lambda n: n // 4, "a sequence per 4 devices (torchtitan's 2 on 8 GPUs)"),
    Case(LLAMA_70B, lambda n: n // 8, "a sequence per 8 devices (MaxText's per_device_batch_size 0.125)"),
)


class Published(NamedTuple):
    """A peer's published configuration of `model` (a `Decoder.name`).

    Attributes:
      peer: who published it.
      where: the hardware and count it ran on.
      degrees: its parallel degrees in its own terms.
      measured: what it reports measuring, or `""`.
      seconds: its step time at this table's tokens per device, derived from `measured`, or None.
      derived: how `seconds` was derived, in words.
      source: repository, path and commit (or URL) it is read from.
      plan: `plan(cfg, devices, batch) -> parallelize keywords` giving its degrees in jshard, or None
        where jshard cannot express it (with `why`).
    """

    model: str
    peer: str
    where: str
    degrees: str
    measured: str
    seconds: float | None
    derived: str
    source: str
    plan: Callable[[_llama.Decoder, int, int], dict] | None = None
    why: str = ""


def _fsdp(cfg: _llama.Decoder, devices: int, batch: int, context: int = 1) -> dict:
    """MaxText's `ici_fsdp_parallelism=-1`, `remat_policy=full` (with `context` > 1, torchtitan's and
    MaxText's FSDP x CP: the sequence cut `context` ways, the batch over the rest): each parameter and
    its Adam moments stored cut over every device (their first dim past the layer axis that the count
    divides), the batch over every device (or the devices beside the sequence's cut), the search
    laying out the rest (gathering the weights before use, as FSDP does, or not) under the budget, as
    jshard's own row's."""
    lay = js.Layout((devices // context, context), ("fsdp", "cp"))
    every = ("fsdp", "cp")

    def stored(path, leaf) -> js.Layout:
        dims = ["None"] * len(leaf.shape)
        first = 1 if jax.tree_util.keystr(path).startswith("['layers']") else 0
        cut = next(i for i in range(first, len(dims)) if leaf.shape[i] % devices == 0)
        dims[cut] = every
        return lay(*dims)

    abstract = _llama.abstract_args(cfg, batch)
    params = jax.tree_util.tree_map_with_path(stored, abstract[0])
    tokens = lay(every, "None") if context == 1 else lay("fsdp", "cp")
    state = models.state_strategies(params, abstract[0], abstract[1])
    return {
        "mode": "auto",
        "search": js.Search(memory_budget=BUDGET),
        "recompute": "full",
        "context": None if context == 1 else lay("fsdp", "cp", "None", "None"),
        "in_strategy": (params, state, (tokens, tokens)),
    }


def _fsdp_cp(context: int) -> Callable[[_llama.Decoder, int, int], dict]:
    """`_fsdp` with the sequence cut `context` ways (context parallel, the attention's form the cost
    model's: `jshard.attention(form='auto')`)."""
    return lambda cfg, devices, batch: _fsdp(cfg, devices, batch, context)


def _expert_data(cfg: _llama.Decoder, devices: int, batch: int) -> dict:
    """Megatron-LM's TP 1 x EP 8 with data parallel over the rest and the distributed optimizer
    (optimizer parallel level 1), without its pipeline stages (PP 4 -> 1)."""
    lay = js.Layout((devices // cfg.n_experts, cfg.n_experts), ("dp", "ep"))
    whole = lambda leaf: lay(*["None"] * len(leaf.shape))
    params = jax.tree.map(whole, _llama.abstract_params(cfg))
    for w in ("w_gate", "w_up", "w_down"):
        params["layers"][w] = lay("None", "ep", "None", "None")
    tokens = lay(("dp", "ep"), "None")
    return {
        "mode": "semi_auto",
        "optimizer": 1,
        "recompute": None,
        "context": None,
        "in_strategy": (params, None, (tokens, tokens)),
    }


MEGATRON_MOE = (
    "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md @ 022bcb5a "
    "('Reference Best Parallel Mapping', MCore v0.8; 468 TFLOPS with MCore v0.9)"
)
MAXTEXT_TRILLIUM = "AI-Hypercomputer/maxtext benchmarks/maxtext_trillium_model_configs.py @ 9898f767"
TORCHTITAN_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ 820504e2 (table 2)"

PUBLISHED = (
    Published(
        MIXTRAL.name,
        "Megatron-LM",
        "64 H100 80GB",
        "TP 1 · EP 8 · PP 4 (VP 8) · DP 16, distributed optimizer; "
        "dropless, all-to-all; micro-batch 1, global batch 256 x 4096",
        "468 TFLOP/s per GPU (bf16)",
        _llama.flops(MIXTRAL, 256) / (64 * 468e12),
        "this table's model FLOPs at 4 sequences per GPU / 468 TFLOP/s",
        MEGATRON_MOE,
        _expert_data,
    ),
    Published(
        MIXTRAL.name,
        "MaxText",
        "TPU v6e (Trillium)",
        "FSDP over every chip (ici_fsdp_parallelism -1); "
        "capacity factor 1.25 (dropped), remat custom with offload; 12 sequences x 4096 per chip",
        "",
        None,
        "",
        f"{MAXTEXT_TRILLIUM} (mixtral_8x7b_dropped)",
        _fsdp,
    ),
    Published(
        LLAMA_8B.name,
        "torchtitan",
        "8 H100 96GB",
        "FSDP 2 · CP 4; local batch 1 x 131072, full activation checkpointing, Float8, torch.compile",
        "1,071 tokens/s per GPU, 84.0 GiB",
        131072 / 4 / 1071,
        "131072 / 4 tokens per GPU / 1,071 tokens/s",
        TORCHTITAN_H100,
        _fsdp_cp(4),
    ),
    Published(
        LLAMA_70B.name,
        "MaxText",
        "TPU v6e-256",
        "FSDP over every chip x CP 16; 0.125 sequences x 131072 per chip, remat custom with offload",
        "",
        None,
        "",
        f"{MAXTEXT_TRILLIUM} (llama3_1_70b_131072; v6e-256 in benchmarks/maxtext_xpk_runner.py)",
        _fsdp_cp(16),
    ),
)


class Planned(NamedTuple):
    """One plan's figures: `degrees` as `Degrees.cell`; `seconds`/`peak` None where no plan fits
    (then `least`, the search's least peak of any policy), `took` its planning wall time; `stored`,
    each argument leaf's key path and cuts per dim as the plan stores it (`stored`)."""

    degrees: str
    seconds: float | None
    peak: float | None
    least: float | None
    took: float
    status: str
    stored: tuple[tuple[str, tuple[int, ...]], ...] = ()


def _step(cfg: _llama.Decoder, recompute: str | None):
    return _llama.train_step(cfg, recompute)


def plan_auto(case: Case, devices: int) -> Planned:
    """jshard's own plan: `mode="auto"` under the H100 budget, the recompute policy the search's,
    the attention given no strategy (the planning weighs its context-parallel cut)."""
    step = js.parallelize(
        _step(case.cfg, "auto"),
        devices=devices,
        mode="auto",
        search=js.Search(memory_budget=BUDGET),
        cost_model=CostModel.for_device(DEVICE),
        donate_argnums=(0, 1),
    )
    return _planned(step, case, devices)


def plan_published(pub: Published, case: Case, devices: int) -> Planned:
    """The published configuration's degrees planned through jshard, on this table's model and batch."""
    kw = dict(pub.plan(case.cfg, devices, case.batch(devices)))
    recompute = kw.pop("recompute")
    case = case._replace(cfg=dataclasses.replace(case.cfg, context=kw.pop("context")))
    step = js.parallelize(
        _step(case.cfg, recompute),
        devices=devices,
        donate_argnums=(0, 1),
        cost_model=CostModel.for_device(DEVICE),
        **kw,
    )
    return _planned(step, case, devices)


def _planned(step, case: Case, devices: int) -> Planned:
    args = _llama.abstract_args(case.cfg, case.batch(devices))
    start = time.perf_counter()
    try:
        plan = step.plan(*args)
    except js.MemoryBudgetError as e:
        took = time.perf_counter() - start
        policy = re.search(r"with recompute '(\w+)'", str(e))
        least = f" (least with recompute {policy.group(1)})" if policy else ""
        return Planned(
            "-", None, None, e.least_bytes, took, f"no plan fits 80 GiB with any recompute policy or offload{least}"
        )
    except Exception as e:  # a plan that fails is a row, not the end of the run
        return Planned("-", None, None, None, time.perf_counter() - start, f"failed: {error_line(e)}")
    took = time.perf_counter() - start
    report = plan.search
    if report is None:  # a propagated plan: its peak is the same memory model's, read by `Plan.work`
        fits = plan.work.peak_bytes <= BUDGET
        return Planned(
            degrees(plan, case.cfg),
            plan.work.seconds,
            plan.work.peak_bytes,
            None,
            took,
            f"propagated; {'fits' if fits else 'over budget'}",
            stored(plan),
        )
    fits = report.peak_bytes <= BUDGET
    chosen = next((w.policy for w in report.recompute if w.chosen), "as marked")
    return Planned(
        degrees(plan, case.cfg),
        report.seconds if fits else None,
        report.peak_bytes,
        None if fits else report.peak_bytes,
        took,
        f"recompute {chosen}; {'fits' if fits else 'over budget'}"
        + (
            ""
            if not report.context
            else f"; sequence {report.context_cut} chosen by the search of "
            + ", ".join(w.policy.split()[1] for w in report.context)
            + " weighed"
        ),
        stored(plan),
    )


def stored(plan: js.Plan) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each argument leaf's key path and cuts per dim as `plan` stores it (its `in_shardings`): the
    devices each dim is cut over, whatever the mesh axes are named (jshard's fine mesh, a `Layout`'s)."""
    leaves = jax.tree_util.tree_flatten_with_path(plan.in_shardings)[0]
    return tuple((jax.tree_util.keystr(path), _spec_cuts(s.spec, plan.mesh.shape)) for path, s in leaves)


def _spec_cuts(spec, sizes) -> tuple[int, ...]:
    """How many ways each dim of a `PartitionSpec` over a mesh of `sizes` cuts (dims it leaves out: 1)."""
    cuts = []
    for axes in spec:
        cut = 1
        for axis in axes if isinstance(axes, tuple) else (axes,):
            cut *= 1 if axis is None else sizes[axis]
        cuts.append(cut)
    return tuple(cuts)


def _cuts(strategies: Sequence[Sequence[int] | None] | None, k: int = 0) -> tuple[int, ...]:
    """The `k`th operand's (or result's) strategy of an operator, `()` where jshard fixed none."""
    return tuple(strategies[k] or ()) if strategies else ()


def degrees(plan: js.Plan, cfg: _llama.Decoder) -> str:
    """The plan's degrees, read from its forward operators: data (the attention scores' batch cut),
    tensor (their heads' cut), sequence (their queries' cut), expert (the experts' matmul's expert
    cut), and FSDP (how many ways the stored feed-forward weight is cut beyond its cut in use)."""
    forward = [op for op in plan.ops if op.primitive == "dot_general" and not op.backward and not op.recomputed]
    batch, heads, q = _attention_cuts(plan)
    shape = f"[{cfg.n_experts},{cfg.d_model},{cfg.d_ff}]" if cfg.n_experts else f"[{cfg.d_model},{cfg.d_ff}]"
    ffn = next(
        op
        for op in forward
        if len(op.in_shapes) == 2 and op.in_shapes[1].endswith(shape) and op.in_strategy is not None
    )
    weight = _cuts(ffn.in_strategy, 1)
    used = 1
    for c in weight:
        used *= c
    stored = plan.device_count // _replicas(plan, "w_up")
    parts = [f"data {batch}", f"FSDP {max(stored // used, 1)}", f"tensor {heads}"]
    if cfg.n_experts:
        parts.append(f"expert {weight[0]}")
    parts += [f"sequence {q}", "pipeline 1"]
    return " · ".join(parts)


def _attention_cuts(plan: js.Plan) -> tuple[int, int, int | str]:
    """`(batch, heads, sequence)` cuts of the attention: its region's queries' where it runs context
    parallel (a `shard_map`; the sequence with the form `jshard.attention` took), else its scores'
    `[b, kv, g, t, tile]` (the first forward product)."""
    for op in plan.ops:
        if op.primitive == "shard_map" and not op.backward and "_attention" in op.source:
            if len(_cuts(op.in_strategy)) == 4:
                b, t, h, _ = _cuts(op.in_strategy)
                form = re.search(r"\): (\w+)", op.annotation or "")
                return b, h, f"{t} ({form.group(1)})" if form else t
    scores = next(
        op
        for op in plan.ops
        if op.primitive == "dot_general"
        and not op.backward
        and len(_cuts(op.out_strategy)) == 5
        and ("_attention" in op.source or "_forms" in op.source)
    )
    b, kv, g, t, _ = _cuts(scores.out_strategy)
    return b, kv * g, t


def _replicas(plan: js.Plan, name: str) -> int:
    """How many devices hold each slice of the parameter `layers/<name>` as stored."""
    leaves = jax.tree_util.tree_flatten_with_path(plan.in_shardings[0])[0]
    sharding = next(s for path, s in leaves if jax.tree_util.keystr(path).endswith(f"['{name}']"))
    cut = 1
    for axes in sharding.spec:
        for axis in axes if isinstance(axes, tuple) else (axes,):
            if axis is not None:
                cut *= plan.mesh.shape[axis]
    return plan.device_count // cut


def _cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def _rate(case: Case, devices: int, seconds: float | None) -> str:
    """Model FLOP/s per device at `seconds` per step (`_llama.flops`: no recompute, no dispatch einsums)."""
    return "-" if seconds is None else f"{_llama.flops(case.cfg, case.batch(devices)) / devices / seconds / 1e12:.0f}"


def _peak(p: Planned) -> str:
    if p.least is not None:
        return f"no plan fits: {size(p.least)} at least"
    return "not estimated" if p.peak is None else size(p.peak)


def _target(p: Planned, published: Sequence[Planned]) -> str:
    """Meets where jshard's plan fits the budget and predicts no more than each published
    configuration planned through jshard that fits."""
    if p.seconds is None or p.peak is None or p.peak > BUDGET:
        return "🔴 misses (no plan fits 80 GiB)"
    rivals = [q for q in published if q.seconds is not None and q.peak is not None and q.peak <= BUDGET]
    best = min(rivals, key=lambda q: q.seconds, default=None)
    if best is not None and p.seconds > best.seconds:
        return (
            f"🔴 misses ({p.seconds / best.seconds:.4f}x the published plan's step: "
            f"{(p.seconds - best.seconds) * 1e6:+.1f} us{_otherwise(p, best)})"
        )
    return "meets"


def _otherwise(p: Planned, q: Planned, shown: int = 3) -> str:
    """`; stored otherwise: ...`, the argument leaves `p` stores cut otherwise than `q` (cuts per dim,
    `p`'s against `q`'s), the first `shown` named; `""` where none differs or either is not known."""
    mine, theirs = dict(p.stored), dict(q.stored)
    differ = [k for k, cuts in mine.items() if k in theirs and theirs[k] != cuts]
    if not differ:
        return ""
    named = ", ".join(f"{k} {'x'.join(map(str, mine[k]))} vs {'x'.join(map(str, theirs[k]))}" for k in differ[:shown])
    more = f" and {len(differ) - shown} more" if len(differ) > shown else ""
    return f"; stored otherwise: {named}{more}"


def scale_rows(cases: Sequence[Case], counts: Sequence[int], published: Sequence[Published]) -> list[tuple[str, ...]]:
    rows = []
    for case in cases:
        peers = [pub for pub in published if pub.model == case.cfg.name]
        for devices in counts:
            mine = plan_auto(case, devices)
            theirs = [plan_published(pub, case, devices) if pub.plan else None for pub in peers]
            where = f"{devices} H100 (batch {case.batch(devices):,} x {case.cfg.seq_len:,})"
            rows.append(
                (
                    case.cfg.name,
                    where,
                    "jshard auto",
                    mine.degrees,
                    _cell(mine.seconds),
                    _rate(case, devices, mine.seconds),
                    _peak(mine),
                    f"{mine.took:.1f} s",
                    "-",
                    mine.status,
                    _target(mine, [q for q in theirs if q is not None]),
                )
            )
            for pub, q in zip(peers, theirs):
                rows.append(
                    (
                        case.cfg.name,
                        where,
                        f"{pub.peer} as published, planned by jshard",
                        q.degrees if q else f"{pub.degrees} (not planned: {pub.why})",
                        _cell(q.seconds) if q else "-",
                        _rate(case, devices, q.seconds if q else None),
                        _peak(q) if q else "-",
                        f"{q.took:.1f} s" if q else "-",
                        f"{pub.where}: {pub.measured or 'no figure published'}"
                        + (f"; {pub.seconds:.2f} s per step derived ({pub.derived})" if pub.seconds else ""),
                        f"{pub.degrees}. {pub.source}" if q else pub.source,
                        "-",
                    )
                )
    return rows


def scale_table(
    cases: Sequence[Case] = CASES, counts: Sequence[int] = COUNTS, published: Sequence[Published] = PUBLISHED
) -> Table:
    rows = scale_rows(cases, counts, published)
    models = "; ".join(f"{c.cfg.name}: {c.cfg.describe()}, {c.batch_rule}" for c in cases)
    return Table(
        "20. Plans at scale: Mixtral 8x7B and a 128k-token Llama on 256 and 1024 H100s, beside the published "
        "configurations",
        "jshard's plan fits 80 GiB per device and predicts no more time per step than the published configuration "
        "planned through jshard (same cost model)",
        (
            "model",
            "devices",
            "plan",
            "degrees",
            "predicted step",
            "model TFLOP/s / device",
            "predicted peak / device",
            "plan time",
            "published (measured)",
            "status / source",
            "target",
        ),
        tuple(rows),
        (
            f"Models ({_llama.__name__}): {models}. " + _llama.__doc__.split("\n\n")[1].replace("\n", " "),
            "jshard auto: `jshard.parallelize(step, devices=n, mode='auto', search=js.Search(memory_budget='80GiB'), "
            "cost_model=CostModel.for_device('H100'))` of the Adam train step, on shapes only (an abstract mesh; "
            "nothing compiled), each layer `jshard.recompute(policy='auto')`: the search weighs none, selective and "
            "full recompute and keeps the fastest plan that fits. `jshard.attention` is given no strategy and the "
            "planning weighs its context-parallel cut (`compile/_weigh.weigh_context`): the least cut that leaves "
            "no device idle (sequence 4 for the 8B and 8 for the 70B, whose batch of a sequence per 4 or 8 devices "
            "does not cover the devices; 2 for Mixtral, whose batch does) first, then no cut (the search cutting the tiled attention "
            "in its global view), then two and four times the least, as the 60 s planning time limit allows, each "
            "traced and searched, the fastest predicted that fits kept; the status names the cuts weighed and the "
            "one chosen. The search lays out everything else (FSDP, heads, the logits, recompute) and "
            "`form='auto'` takes the cost model's form. predicted step / peak: the search's (alpha-beta "
            "collectives at the H100's NVLink rate on every mesh axis, compute at the measured matmul rate, the "
            "memory model's peak: the values live at each top-level program point and, at a loop's point (the "
            "scanned layers, forward and backward; the attention's tiles; a context-parallel region), what its "
            "body holds at once, once whatever the trip count); a plan over the budget shows the least peak any "
            "recompute policy reaches. plan time: trace + search + records, wall clock, on a 2-core machine shared "
            "with other work; the layers are scanned (one traced layer whatever the depth), so no layer count was "
            "cut to plan in time.",
            "model TFLOP/s / device: the model's FLOPs per step (3x the forward's matmuls, attention's causal half, "
            "the experts' top-2 share; no recompute, no dispatch einsums: the convention the peers report in) over "
            "devices x predicted step, the figure to hold beside Megatron-LM's measured 468.",
            "degrees, read from the plan's forward operators: data = the attention scores' batch cut, tensor = "
            "their heads' cut, sequence = their queries' cut, expert = the experts' matmul's expert cut, FSDP = the "
            "stored feed-forward weight's cut over its cut in use (gathered before use); jshard's auto mode builds "
            "no pipeline stages (`jshard.Pipelining` does, given stages).",
            "Published as planned by jshard, on this table's model and batch: torchtitan's FSDP 2 x CP 4 (on 8 "
            "GPUs) and MaxText's FSDP x CP 16 are `mode='auto'` with a `Layout((n/cp, cp), ('fsdp', 'cp'))`: "
            "every parameter and its Adam moments stored cut over all n devices (both peers shard over the "
            "context axis too), the tokens' batch over fsdp and their sequence over cp, `jshard.attention`'s "
            "strategy the same cut (`form='auto'`), full recompute (torchtitan's full activation checkpointing; "
            "MaxText's custom remat with offload taken as full), the search laying out the rest under the same "
            "budget. MaxText's FSDP (Mixtral) is `mode='auto'` with "
            "its layouts as anchors (every parameter and its Adam moments stored cut over all devices on their "
            "first dim the count divides; the batch over all devices), full recompute, the activations laid "
            "out by the same search under the same budget as jshard's own row; Megatron-LM's TP 1 x EP 8 x DP with "
            "the distributed optimizer is `mode='semi_auto'` with a `Layout((n/8, 8), ('dp', 'ep'))` cutting the "
            "experts over ep and the batch over both, `optimizer=1`, no recompute, without its PP 4 (jshard's "
            "pipeline needs the step cut into stages): its step and peak are the propagated plan's (`Plan.work`, "
            "the peak by the same memory model as the search's, `Plan.work.peak_bytes`). Their "
            "measured figures ran on their own "
            "hardware and kernels (flash attention, grouped GEMMs, Float8 for torchtitan); a derived step time is "
            "at this table's tokens per device.",
            "Megatron-LM's row predicted 6.01 s on 256 devices and 11.93 s on 1,024 in this table before: the plain "
            "attention's causal mask and its fill, made of constants alone, were hoisted by JAX out of the "
            "recomputed layer scan as loop-invariant residuals, broadcast to the whole batch's scores "
            "`[b, kv, g, t, t]`; the propagated plan left them uncut, and their memory traffic grew with the global "
            "batch. `jshard.attention` now adds the mask as a bias made from positions tied to the queries, which "
            "JAX recomputes inside the layer: the row stays level. The Mixtral rows moved with the "
            "attention's rewrite (jshard auto on 256 devices 5.25 s and 16.29 GiB before): `jshard.attention` "
            "multiplies the weights by the values in float32 where the old model's code did in bfloat16, and the "
            "mask is no longer a residual; the parts were not separated.",
            "Attention's memory: plain attention's scores `[b, kv, g, t, t]` (2 TiB per 128k sequence in float32 for "
            "32 heads) fit no plan (648-661 GiB per device at least before this table moved to tiled attention). "
            "Tiled, a device holds one tile's scores `[b, kv, g, its queries, 1024]`: 4 GiB in float32 for the 8B "
            "at sequence 4 (32 heads, 32,768 queries), and the backward's few arrays of that shape beside it. The "
            "memory model counts them: a loop's body (the scanned layer, the tiles' loop inside it, the "
            "context-parallel region) adds at its point what it holds at once, its buffers as XLA fuses them "
            "(`rules.FUSION`). A manual region (the context-parallel attention) is "
            "priced by its body's collectives and matrix products per device (before this table's change, its "
            "matrix products were priced at zero).",
            "Loop bodies in the peak: before the memory model counted them (this table at 348ccfc), every peak here "
            "was the values live at top-level program points. The 128k Llama rows' peaks do not move: each is at "
            "the loss head (the logits `[tokens, 128256]` in float32 and what the loss makes of them, at the top "
            "level), and the layer scan's points stay below it with their bodies counted (8B at sequence 4 on 256 "
            "devices: 20.0 GiB at the forward scan, 10.1 GiB of it its body's, and 27.0 GiB at the backward "
            "scan, 18.0 GiB its body's, beside 72.23 GiB at the head; MaxText's 70B at sequence 16: 54.2 and 63.0 "
            "GiB, 10.0 and 17.9 of it the bodies', beside 79.40). Mixtral's rows rose with them (MaxText's on 256 devices "
            "from 14.48 to 32.05 GiB without a sequence cut: each layer's experts' and attention's temporaries). "
            "Mixtral's attention (`block=4096`) is weighed with its sequence cut too since `form='auto'` skips a "
            "ring its block cannot tile (every cut failed before: jshard auto kept no cut, expert 8 or 4 at "
            "5.88-5.90 s, 32-39 GiB, varying with the machine's load): sequence 2 by the gather form is chosen, "
            "jshard auto and MaxText's anchors alike. Megatron-LM's propagated plan now has a peak: about 937 GiB per device, far over 80 GiB "
            "(no recompute, and without its 4 pipeline stages every layer's activations of 4 sequences are kept "
            "at once), so its 4.43 s is no plan that fits, and the target column does not weigh it.",
        ),
    )
