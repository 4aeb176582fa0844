"""The zoo (issue 15, items 2 and 7; issue 32, item 5): models jshard was not shaped on, written as
their authors write them (`tests/clients/`) or imported unmodified from transformers (its Flax
Llama and ViT, anchored by one shared `Layout` or by tuples given apart), each run by
`benchmarks/_zoo.py` as its expert plan, jshard and Shardy from the model's own anchors, with the
batch's layout given or left default. Every program equals one device; jshard moves at most
Shardy's bytes and at most 1.05x the expert's, and peaks at most 1.05x the expert's peak. Where a
target does not hold today the test is a strict xfail naming the measured ratio (`python -m
benchmarks --only zoo` writes the same figures into BENCHMARKS.md).

One compile per model, layout and plan, shared by every test through `_zoo.measure`'s cache."""

import collections

import jax
import pytest
from _tolerance import assert_close, step_terms
from clients import eqx_style_vit
from jax.sharding import PartitionSpec as P

import jshard as js
from benchmarks import _zoo
from benchmarks._compiled import EXPERT_SLACK

pytestmark = pytest.mark.filterwarnings("ignore::jshard.LayoutCollisionWarning")
"""hf_*_tuples give their partition rules as tuples apart, as a user may; where two of them collide
jshard warns (proposing the shared `Layout`, which is hf_* itself): the zoo measures what the plan
it runs costs."""

TESTED = tuple(name for name in ("loop_gpt", "linen_lm", "nnx_gqa", "eqx_vit", "hf_llama", "hf_llama_tuples",
                                 "hf_vit", "hf_vit_tuples") if name in _zoo.LAYOUTS)
"""The zoo's models held to the targets here (the transformers ones where the `test` extra is
installed); linen_resnet (data parallel, its bytes held to its expert's in test_clients.py) is
measured by the benchmark alone, to keep the suite short."""
LAYOUTS = {**_zoo.LAYOUTS, **{name: ("given",) for name in _zoo.VARIANTS if name in _zoo.LAYOUTS}}
"""The batch layouts tested per model: the benchmark's, but the tuples-apart variants with the batch
given only (their rows with it left default are in table 15), to keep the suite short."""
CONFIGS = [(name, layout) for name in TESTED for layout in LAYOUTS[name]]
"""Each model with each batch layout it is tested with (nnx_gqa: given only)."""

MISSES: dict[tuple[str, str], str] = {}
"""The expert's bytes target measured missed today, each with its ratio (jshard's bytes over the
expert's) as the reason of a strict xfail (loop_gpt was 1.41x / 1.74x and linen_lm with the batch
left default 1.21x before global propagation; hf_llama 1.140x given and 1.302x default, hf_vit
1.536x default, before partial sums were summed as the walk back cuts their users and the default
batch was weighed cut over the axes the anchors leave free; hf_llama_tuples 1.862x and hf_vit_tuples
1.891x given, before a batch given as a lone tuple was weighed moved once onto the axes the
parameters' tuples leave free)."""
SHARDY_MISSES: dict[tuple[str, str], str] = {}
"""The same for Shardy's bytes from the same anchors."""
PEAK_MISSES: dict[tuple[str, str], str] = {}
"""The same for the expert's peak memory per device (issue 32: "peak <= 1.05x the expert where the
expert fits"; every expert fits the simulated devices)."""


def _strict(configs, missed):
    return [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=missed[c])) if c in missed else c
            for c in configs]


def _row(name: str, layout: str, plan: str) -> _zoo.Row:
    row = _zoo.measure(name, layout, plan)
    assert row.audit is not None, f"{name} {layout} {plan}: {row.error}"
    return row


def _ids(config):
    return "-".join(config)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_zoo_model_equals_one_device_under_every_plan(config):
    name, layout = config
    case = _zoo.case(name)
    terms = step_terms(case.params, case.batch)
    plans = ("expert", "jshard", "shardy") if layout == "given" else ("jshard", "shardy")
    for plan in plans:
        assert_close(_row(name, layout, plan).outputs, case.reference, terms=terms, err_msg=f"{name} {layout} {plan}")


@pytest.mark.parametrize("config", _strict(CONFIGS, SHARDY_MISSES), ids=_ids)
def test_zoo_jshard_moves_at_most_shardys_bytes_from_the_same_anchors(config):
    ours, shardy = (_row(*config, plan).audit.bytes() for plan in ("jshard", "shardy"))
    assert ours <= shardy, f"{ours / shardy:.3f}x Shardy"


@pytest.mark.parametrize("config", _strict(CONFIGS, MISSES), ids=_ids)
def test_zoo_jshard_moves_at_most_the_experts_bytes(config):
    name, layout = config
    ours, expert = _row(name, layout, "jshard").audit.bytes(), _row(name, "given", "expert").audit.bytes()
    assert ours <= (1 + EXPERT_SLACK) * expert, f"{ours / expert:.3f}x the expert"


@pytest.mark.parametrize("config", _strict(CONFIGS, PEAK_MISSES), ids=_ids)
def test_zoo_jshard_peaks_at_most_the_experts_peak(config):
    name, layout = config
    ours = _row(name, layout, "jshard").audit.memory.peak_bytes
    expert = _row(name, "given", "expert").audit.memory.peak_bytes
    assert ours <= (1 + EXPERT_SLACK) * expert, f"{ours / expert:.3f}x the expert's peak"


@pytest.mark.parametrize("layout", _zoo.LAYOUTS["linen_lm"])
def test_zoo_linen_lm_holds_no_more_temporaries_than_shardy_and_the_expert(layout):
    # its dropout masks' random bits drawn cut as the masks are applied, not whole on every device
    # (the expert places the batch as given: its temporaries are held to that layout's)
    plans = ("shardy", "expert") if layout == "given" else ("shardy",)
    ours = _row("linen_lm", layout, "jshard").audit.memory.temp_bytes
    for plan in plans:
        assert ours <= _row("linen_lm", layout, plan).audit.memory.temp_bytes, plan


def test_zoo_table_marks_every_missed_target():
    table = _zoo.zoo_table(TESTED, search=False, layouts=LAYOUTS)
    jshard_rows = [row for row in table.rows if row[3] == "jshard"]
    assert len(jshard_rows) == len(CONFIGS) and len(table.rows) == len(TESTED) + 2 * len(CONFIGS)
    for row, (name, layout) in zip(jshard_rows, CONFIGS):
        assert row[0] == name and row[2] == layout
        missed = {what: (name, layout) in m for what, m in
                  (("bytes > Shardy", SHARDY_MISSES), ("bytes > 1.05x expert", MISSES), ("peak > 1.05x expert", PEAK_MISSES))}
        assert row[-1].startswith(_zoo.WORSE) == any(missed.values()), row
        assert all((what in row[-1]) == miss for what, miss in missed.items()), row
        assert row[9].endswith(" equal"), row
    assert "WORSE" not in "".join(cell for row in table.rows if row[3] != "jshard" for cell in row)


def test_eqx_style_constraints_are_the_plans_anchors():
    case = _zoo.case("eqx_vit")
    with case.context():
        plan = js.parallelize(case.step, mode="semi_auto", **case.options["given"]).plan(*case.args["given"])
    # the constraint after the update: one per leaf of the model and its momentum, each the author's spec
    anchored = [op for op in plan.ops if op.origin == "model"]
    leaves = jax.tree.leaves(case.args["given"][:2])
    rule = jax.tree.leaves(eqx_style_vit.specs(case.args["given"][:2]), is_leaf=lambda x: isinstance(x, P))
    assert len(anchored) == len(leaves)
    assert collections.Counter(_cut(op.out_specs[0]) for op in anchored) == collections.Counter(map(_cut, rule))
    assert "set by the model" in plan.explain(anchored[0])


def _cut(spec: P) -> tuple:
    """`spec` without its trailing whole dims: `P("model", None)` and `P("model")` alike."""
    axes = list(spec)
    while axes and axes[-1] is None:
        axes.pop()
    return tuple(axes)
