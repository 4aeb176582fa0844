"""Multi-copy and communication fusion (`parallelize(..., communication=js.Communication(copies,
fusion))`): each configuration equals one device, and the compiled program holds the collectives
it promises (counts and bytes read by the audit, XLA:CPU's combiner on or off), the copies' chains
independent of each other."""

import collections
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import audit
from jshard._buckets import buckets

ROWS, WIDTH, LAYERS = 32, 16, 4


def _loss(p, b):
    h = b["x"]
    for w in p:
        h = jnp.tanh(h @ w)
    return jnp.mean((h - b["y"]) ** 2)


def _step(p, b):
    return js.accumulate(jax.value_and_grad(_loss))(p, b)


@functools.cache
def _problem():
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / math.sqrt(WIDTH), jnp.float32) for _ in range(LAYERS)]
    batch = {"x": jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32)}
    return params, batch


def _assert_one_device(got, params, batch, loss=_loss):
    assert_close(got, jax.jit(jax.value_and_grad(loss))(params, batch), terms=step_terms(params, batch))


def _leaf_bytes(params) -> list[int]:
    """What jshard reduces, in order: the loss (a float32 scalar), then each gradient."""
    return [4, *(x.size * x.dtype.itemsize for x in params)]


@functools.cache
def _data_parallel(fusion: str):
    """The data-parallel step under one fusion configuration (a dict's repr, to cache on)."""
    params, batch = _problem()
    step = js.parallelize(_step, devices=8, mode="data", communication=js.Communication(fusion=eval(fusion)))
    return step, audit(step.lower(params, batch).compile())


@pytest.mark.parametrize("fusion", [
    "{'allreduce': {'mode': 'size', 'config': 0}}",
    "{'openstate': False}",
    "{'allreduce': {'mode': 'size', 'config': 1}}",
    "{'allreduce': {'mode': 'auto'}}",
    "{'allreduce': {'mode': 'index', 'config': [2]}}",
    "{'allreduce': {'mode': 'size', 'config': 2048 / 2**20}}",
], ids=["size0", "openstate-off", "size1MiB", "auto", "index2", "size2KiB"])
def test_gradient_buckets_follow_the_configuration(fusion):
    params, batch = _problem()
    step, report = _data_parallel(fusion)
    config = js.Communication(fusion=eval(fusion)).of("allreduce")
    gradients = list(range(1, LAYERS + 1))  # after the loss
    expected = [sum(_leaf_bytes(params)[i] for i in b) for b in buckets(_leaf_bytes(params), config, gradients)]
    _assert_one_device(step(params, batch), params, batch)
    assert report.count("all-reduce") == len(expected)
    assert report.bytes("all-reduce") == sum(expected)
    plan = step.plan(params, batch).communication
    assert [size for _, _, size in plan.buckets] == expected
    assert plan.compiler_options == (("xla_disable_hlo_passes", "cpu-all-reduce-combiner"),)


def test_size_zero_keeps_every_gradient_apart_and_a_large_size_fuses_them():
    params, _ = _problem()
    assert _data_parallel("{'allreduce': {'mode': 'size', 'config': 0}}")[1].count("all-reduce") == LAYERS + 1
    assert _data_parallel("{'allreduce': {'mode': 'size', 'config': 1}}")[1].count("all-reduce") == 1
    assert _data_parallel("{'allreduce': {'mode': 'size', 'config': 1}}")[1].bytes("all-reduce") == sum(_leaf_bytes(params))


def test_index_splits_before_the_parameter_it_numbers_the_loss_in_the_first_bucket():
    params, batch = _problem()
    step, report = _data_parallel("{'allreduce': {'mode': 'index', 'config': [2]}}")
    loss, *grads = _leaf_bytes(params)
    assert [size for _, _, size in step.plan(params, batch).communication.buckets] == [loss + grads[0] + grads[1],
                                                                                       grads[2] + grads[3]]
    assert report.count("all-reduce") == 2


def _plain(params, batch):
    return jax.value_and_grad(_loss)(params, batch)


@pytest.mark.parametrize("fusion, apart", [(None, False), ({"openstate": False}, True)], ids=["xla", "off"])
def test_without_jshard_accumulate_the_combiner_is_switched_by_a_compile_option(fusion, apart):
    """Where XLA reduces the gradients (no `jshard.accumulate`), threshold 0 is XLA:CPU's combiner
    off: one all-reduce per gradient, against one combined all-reduce of them all."""
    params, batch = _problem()
    comm = None if fusion is None else js.Communication(fusion=fusion)
    step = js.parallelize(_plain, devices=8, mode="data", communication=comm)
    report = audit(step.lower(params, batch).compile())
    _assert_one_device(step(params, batch), params, batch)
    assert report.count("all-reduce") == (LAYERS + 1 if apart else 1)
    assert report.bytes("all-reduce") == sum(_leaf_bytes(params))


def test_xla_cpu_reads_no_combiner_threshold():
    """The fact `jshard/compile/_fusion.py` rests on, pinned for the installed jaxlib: XLA:CPU's
    all-reduce combiner ignores the GPU's threshold options (0 would keep every all-reduce apart)
    and is switched off only by disabling its pass."""
    params, batch = _problem()
    lowered = js.parallelize(_plain, devices=8, mode="data").lower(params, batch)
    for options, count in (({"xla_gpu_all_reduce_combine_threshold_bytes": 0}, 1),
                           ({"xla_gpu_collective_combine_threshold_count": 1}, 1),
                           ({"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}, LAYERS + 1)):
        assert audit(lowered.compile(options)).count("all-reduce") == count, options


def test_a_threshold_xla_cpu_cannot_take_is_refused_where_jshard_does_not_reduce():
    params, batch = _problem()
    step = js.parallelize(_plain, devices=8, mode="data",
                          communication=js.Communication(fusion={"allreduce": {"mode": "size", "config": 32}}))
    with pytest.raises(js.ShardingError, match=r"\{'allreduce': \{'mode': 'size', 'config': 32\}\}\) on cpu: XLA:CPU's "
                                               r"all-reduce combiner takes no threshold.*jshard\.accumulate"):
        step.plan(params, batch)


@pytest.mark.parametrize("comm, message", [
    (js.Communication(0), r"Communication\(copies=0\) is not a number of copies"),
    (js.Communication(fusion={"allreduce": {"mode": "fast"}}), r"mode='fast' is not one of \('auto', 'size', 'index'\)"),
    (js.Communication(fusion={"allgather": {"mode": "index", "config": [2]}}), r"for 'allreduce' only"),
    (js.Communication(fusion={"allreduce": {"mode": "size", "config": -1}}), r"a threshold in MiB \(0 or more\)"),
    (js.Communication(fusion={"allreduce": {"mode": "index", "config": [3, 2]}}), r"ascending leaf indices"),
    (js.Communication(fusion={"broadcast": {"mode": "auto"}}), r"'broadcast' is not a collective comm_fusion configures"),
    (js.Communication(fusion={"allreduce": {"mode": "auto", "config": 8}}), r"mode='auto' takes no config"),
], ids=["copies0", "mode", "index-allgather", "negative", "unsorted", "kind", "auto-config"])
def test_a_wrong_configuration_is_named(comm, message):
    with pytest.raises(js.ShardingError, match=message):
        js.parallelize(_step, devices=8, mode="data", communication=comm)


def test_multi_copy_needs_jshard_accumulate():
    params, batch = _problem()
    with pytest.raises(js.ShardingError, match=r"Communication\(copies=2\), but the function calls no jshard\.accumulate"):
        js.parallelize(_plain, devices=8, mode="data", communication=2).plan(params, batch)


def test_multi_copy_refuses_rows_it_cannot_deal_to_every_copy():
    params, batch = _problem()
    with pytest.raises(js.ShardingError, match=r"accumulation=1 with Communication\(copies=3\) does not divide the 32 rows"):
        js.parallelize(_step, devices=8, mode="data", communication=3).plan(params, batch)


def test_copies_inside_accumulated_micro_batches_equal_one_device():
    """k = 2 micro-batches of n = 2 copies each: the gradients still reduced once, one all-reduce
    per bucket (threshold 0: per leaf)."""
    params, batch = _problem()
    step = js.parallelize(_step, devices=8, mode="data", accumulation=2,
                          communication=js.Communication(2, {"allreduce": {"mode": "size", "config": 0}}))
    _assert_one_device(step(params, batch), params, batch)
    report = audit(step.lower(params, batch).compile())
    assert (report.count("all-reduce"), report.bytes("all-reduce")) == (LAYERS + 1, sum(_leaf_bytes(params)))


def test_multi_copy_is_refused_where_no_mesh_axes_cut_the_batch_before_planning():
    params, batch = _problem()
    with pytest.raises(js.ShardingError, match=r"Communication\(copies=2, fusion=None\) runs the copies.*the batch's "
                                               r"rows are not cut over the same mesh axes before planning.*mode='auto'"):
        js.parallelize(_step, devices=8, mode="semi_auto", dataset_strategy="full_batch",
                       communication=2).plan(params, batch)


def test_multi_copy_under_the_search_runs_the_copies_in_the_global_view():
    """Under mode="auto" the copies are independent chains the search lays out, the user's count kept."""
    params, batch = _problem()
    step = js.parallelize(_step, devices=8, mode="auto", communication=2)
    _assert_one_device(step(params, batch), params, batch)
    plan = step.plan(params, batch)
    assert plan.communication.copies == 2 and not plan.communication.weighed and not plan.communication.why


# Multi-copy under tensor parallel: the second matmul's contracted dim is cut over mp, so each copy's
# forward pass ends in an all-reduce over mp that another copy's compute could hide.
LAYOUT = js.Layout((4, 2), ("dp", "mp"))


def _tp_loss(p, b):
    h = jnp.tanh(js.shard(jnp.matmul, in_strategy=(LAYOUT("dp", "None"), LAYOUT("None", "mp")))(b["x"], p["w1"]))
    h = js.shard(jnp.matmul, in_strategy=(LAYOUT("dp", "mp"), LAYOUT("mp", "None")))(h, p["w2"])
    return jnp.mean((h - b["y"]) ** 2)


@functools.cache
def _tp(copies: int):
    rng = np.random.default_rng(1)
    params = {"w1": jnp.asarray(rng.normal(size=(WIDTH, 2 * WIDTH)) / math.sqrt(WIDTH), jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(2 * WIDTH, WIDTH)) / math.sqrt(2 * WIDTH), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32)}
    step = js.parallelize(lambda p, b: js.accumulate(jax.value_and_grad(_tp_loss))(p, b), devices=8,
                          in_strategy=({"w1": LAYOUT("None", "mp"), "w2": LAYOUT("mp", "None")},
                                       {"x": LAYOUT("dp", "None"), "y": LAYOUT("dp", "None")}),
                          communication=js.Communication(copies))
    return step, params, batch, step.lower(params, batch)


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_COPY = re.compile(r'op_name="[^"]*jshard_copy(\d+)')
_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def _entry(text: str) -> dict[str, str]:
    """The entry computation's instructions, name -> its text."""
    body = text[text.index("\nENTRY"):]
    body = body[body.index("\n", 1):body.index("\n}")]
    return {m[1]: m[2] for line in body.splitlines() if (m := _DEF.match(line))}


def _chains(text: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Each copy's collectives (name -> copy) in the compiled entry computation, and the pairs
    (collective, instruction of another copy) one data dependency joins, either way."""
    nodes = _entry(text)
    operands = {n: [o for o in re.findall(r"%([\w.\-]+)", body.split("metadata=")[0]) if o in nodes and o != n]
                for n, body in nodes.items()}
    users = collections.defaultdict(list)
    for n, ops in operands.items():
        for o in ops:
            users[o].append(n)
    copy = {n: int(m[1]) for n, body in nodes.items() if (m := _COPY.search(body))}

    def reached(start, edges):
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    collectives = {n: copy[n] for n in nodes if n in copy and _COLLECTIVE.search(nodes[n])}
    joined = [(c, o) for c in collectives for o in reached(c, users) | reached(c, operands)
              if o in copy and copy[o] != copy[c]]
    return collectives, joined


def test_buckets_of_gradients_another_axis_cuts_are_refused():
    _, params, batch, _ = _tp(2)
    step = js.parallelize(lambda p, b: js.accumulate(jax.value_and_grad(_tp_loss))(p, b), devices=8,
                          in_strategy=({"w1": LAYOUT("None", "mp"), "w2": LAYOUT("mp", "None")},
                                       {"x": LAYOUT("dp", "None"), "y": LAYOUT("dp", "None")}),
                          communication=js.Communication(fusion={"allreduce": {"mode": "size", "config": 1}}))
    with pytest.raises(js.ShardingError, match=r"puts several gradients in one all-reduce.*here mesh axes besides the "
                                               r"batch's may cut them.*'size' 0 \(one all-reduce per gradient\)"):
        step.plan(params, batch)


def test_multi_copy_equals_one_device_with_independent_chains():
    step, params, batch, lowered = _tp(2)
    _assert_one_device(step(params, batch), params, batch, _tp_loss)
    text = lowered.compile().as_text()
    collectives, joined = _chains(text)
    assert sorted(collections.Counter(collectives.values()).items()) == [(0, 1), (1, 1)]  # one all-reduce per copy
    assert joined == []
    # gradients summed once: the reduction over dp is one all-reduce per leaf (loss, w1, w2), none per copy
    report = audit(lowered.compile())
    dp = [c for c in report.collectives if c.kind == "all-reduce" and c.group_size == 4]
    assert sum(c.count for c in dp) == 1 + len(params)


def test_xla_cpu_combiner_would_join_the_copies():
    """The check above is not vacuous: compiled with XLA:CPU's all-reduce combiner on, the copies'
    all-reduces merge into one that both copies' chains pass through."""
    _, _, _, lowered = _tp(2)
    collectives, joined = _chains(lowered.compile({"xla_disable_hlo_passes": ""}).as_text())
    assert len(collectives) == 1 and joined


def test_multi_copy_memory_is_in_the_plan():
    step, params, batch, _ = _tp(2)
    plan = step.plan(params, batch)
    assert plan.communication.copies == 2
    # the other copy's results (loss and gradients), held until summed, per device of the dp-manual region
    assert plan.communication.copy_bytes == 4 + sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert "communication: 2 copies" in plan.summary()


@pytest.mark.parametrize("comm, platform, bucketed, expected", [
    (js.Communication(fusion={"allreduce": {"mode": "size", "config": 32}, "allgather": {"mode": "size", "config": 0}}),
     "gpu", False, {"xla_gpu_all_reduce_combine_threshold_bytes": 32 * 2**20,
                    "xla_gpu_all_gather_combine_threshold_bytes": 0}),
    (js.Communication(fusion={"openstate": False}), "gpu", False,
     {"xla_gpu_all_reduce_combine_threshold_bytes": 0, "xla_gpu_all_gather_combine_threshold_bytes": 0,
      "xla_gpu_reduce_scatter_combine_threshold_bytes": 0}),
    (js.Communication(2, {"reducescatter": {"mode": "size", "config": 8}}), "gpu", True,
     {"xla_gpu_all_reduce_combine_threshold_bytes": 0, "xla_gpu_reduce_scatter_combine_threshold_bytes": 8 * 2**20}),
    (js.Communication(fusion={"allreduce": {"mode": "auto"}}), "gpu", False, {}),
    (js.Communication(fusion={"allreduce": {"mode": "auto"}}), "cpu", False, {}),
    (js.Communication(fusion={"allreduce": {"mode": "size", "config": 0}}), "cpu", False,
     {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}),
], ids=["gpu-size", "gpu-off", "gpu-copies", "gpu-auto", "cpu-auto", "cpu-size0"])
def test_compiler_options_per_backend(comm, platform, bucketed, expected):
    """What each backend is told (a GPU's thresholds cannot be compiled here; the CPU's are above)."""
    from jshard.compile._fusion import compiler_options

    assert compiler_options(comm, platform, bucketed) == expected


def test_a_setting_no_backend_option_expresses_is_refused_on_the_gpu_too():
    from jshard.compile._fusion import check_fusion

    index = js.Communication(fusion={"allreduce": {"mode": "index", "config": [3]}})
    with pytest.raises(js.ShardingError, match=r"on gpu: XLA's combiners take a threshold, not split indices"):
        check_fusion(index, "gpu", False, "jshard.parallelize(step)")
    check_fusion(index, "gpu", True, "jshard.parallelize(step)")  # jshard's own buckets follow it
    for unknown in (index, js.Communication(2), js.Communication(fusion={"openstate": False})):
        with pytest.raises(js.ShardingError, match=r"on tpu: jshard knows no option of XLA's tpu backend"):
            check_fusion(unknown, "tpu", False, "jshard.parallelize(step)")
    check_fusion(js.Communication(fusion={"allreduce": {"mode": "auto"}}), "tpu", False, "jshard.parallelize(step)")


def test_index_mode_is_refused_where_jshard_does_not_reduce():
    params, batch = _problem()
    step = js.parallelize(_plain, devices=8, mode="data",
                          communication=js.Communication(fusion={"allreduce": {"mode": "index", "config": [2]}}))
    with pytest.raises(js.ShardingError, match=r"on cpu: XLA's combiners take a threshold, not split indices"):
        step.plan(params, batch)


def _sgd(params, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    return [w - 0.1 * g for w, g in zip(params, grads)], loss


def test_all_gathers_and_reduce_scatters_stay_apart_on_cpu_and_fusing_them_is_refused():
    """Optimizer parallel level 3 gathers each cut parameter and reduce-scatters each gradient:
    XLA:CPU merges neither, so `openstate=False` holds one of each per parameter, and a size that
    asks to merge them is refused."""
    params, batch = _problem()
    step = js.parallelize(_sgd, devices=8, mode="data", optimizer=js.OptimizerParallel(3, threshold=0),
                          communication=js.Communication(fusion={"openstate": False}))
    report = audit(step.lower(params, batch).compile())
    per_device = sum(_leaf_bytes(params)[1:])  # each gathered parameter, each scattered gradient
    assert report.by_kind()["all-gather"] == (LAYERS, per_device)
    assert report.by_kind()["reduce-scatter"] == (LAYERS, per_device)
    fused = js.parallelize(_sgd, devices=8, mode="data", optimizer=js.OptimizerParallel(3, threshold=0),
                           communication=js.Communication(fusion={"allgather": {"mode": "size", "config": 1}}))
    with pytest.raises(js.ShardingError, match=r"on cpu: XLA:CPU merges no allgather at all"):
        fused.plan(params, batch)


def test_communication_takes_its_group_or_the_copies():
    assert js.parallelize(_step, devices=8, mode="data", communication=2).options.communication == js.Communication(2)
    with pytest.raises(TypeError, match=r"communication= takes a js\.Communication\(\.\.\.\), or int \(copies\), got "
                                        r"str '2'"):
        js.parallelize(_step, communication="2")
    with pytest.raises(TypeError, match=r"Communication\(fusion=\) takes MindSpore's comm_fusion dict"):
        js.parallelize(_step, communication=js.Communication(fusion=[("allreduce", "size")]))
    with pytest.raises(TypeError, match=r"Communication\(fusion=\) takes MindSpore's comm_fusion dict"):
        js.parallelize(_step, communication=js.Communication(fusion=("allreduce", "size", 32)))
