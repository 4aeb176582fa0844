"""`jshard.data` in one process of 8 devices: the dataset strategies, agreement with `parallelize`, errors.

Per-process reads over two processes are counted in tests/test_distributed.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard.data import ShardedLoader, batch_shardings, local_slices, shard_batch


def images():
    return np.arange(8 * 4 * 8 * 3, dtype=np.float32).reshape(8, 4, 8, 3)


@pytest.mark.parametrize(
    "strategy, spec, per_device",
    [
        ("data_parallel", P(("d0", "d1", "d2")), (1, 4, 8, 3)),
        ("full_batch", P(), (8, 4, 8, 3)),
        (((1, 2, 4, 1),), P(None, "d0", ("d1", "d2")), (8, 2, 2, 3)),  # MindSpore's cut of H and W
        (((2, 1, 1, 1),), P("d0"), (4, 4, 8, 3)),  # 2-way, the rest repeated (the last, fastest axis)
    ],
    ids=["data_parallel", "full_batch", "hw", "repeated"],
)
def test_dataset_strategies_lay_the_batch_out_as_mindspore_does(strategy, spec, per_device):
    x = images()
    (g,) = shard_batch((x,), strategy)
    assert g.shape == x.shape and g.sharding.spec == spec
    assert {s.data.shape for s in g.addressable_shards} == {per_device}
    np.testing.assert_array_equal(np.asarray(g), x)


def test_hw_cut_puts_each_block_on_the_mindspore_rank():
    (g,) = shard_batch((images(),), ((1, 2, 4, 1),))
    by_device = {s.device: s.index for s in g.addressable_shards}
    devices = jax.devices()
    # device matrix [2, 4]: rank r holds H block r // 4 and W block r % 4
    for rank in range(8):
        h, w = by_device[devices[rank]][1:3]
        assert (h.start // 2, w.start // 2) == (rank // 4, rank % 4)


def test_shard_batch_gives_what_parallelize_expects_so_nothing_moves():
    x, w = np.ones((16, 8), np.float32), np.ones((8, 4), np.float32)
    step = js.parallelize(lambda w, x: jnp.sum(x @ w), devices=8)
    plan_sharding = step.lower(w, x).compile().input_shardings[0][1]
    batch = shard_batch(x)
    assert batch.sharding.is_equivalent_to(plan_sharding, 2)
    assert float(step(w, batch)) == float(np.sum(x @ w))  # sums of ones: whole numbers below 2**24, exact in any order


def test_layout_calls_are_dataset_strategies_too():
    lay = js.Layout((2, 4), ("dp", "mp"))
    tokens, mask = shard_batch((np.zeros((8, 16), np.int32), np.ones((8, 16))), (lay("dp", "None"), lay("dp", "mp")))
    assert tokens.sharding.spec == P("d0") and mask.sharding.spec == P("d0", ("d1", "d2"))


def test_loader_reads_only_the_rows_this_process_holds():
    data = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    reads = []

    def read(start, stop):
        reads.append((start, stop))
        return {"x": data[start:stop]}

    loader = ShardedLoader(read, 8, [(8, 3)])
    batch = loader.batch(2)
    assert reads == [(16, 24)] and loader.rows == (0, 8)  # one process holds every row
    np.testing.assert_array_equal(np.asarray(batch["x"]), data[16:24])
    assert batch["x"].sharding.spec == P(("d0", "d1", "d2"))


def test_local_slices_of_one_process_cover_the_array():
    (s,) = batch_shardings([4], ((1, 2, 4, 1),))
    assert local_slices((8, 4, 8, 3), s) == (slice(0, 8), slice(0, 4), slice(0, 8), slice(0, 3))


@pytest.mark.parametrize(
    "batch, strategy, message",
    [
        ((np.zeros((8, 2)),), ((2, 1), (2, 1)), "dataset_strategy has 2 entries ((2, 1), (2, 1)), but the batch has 1 arrays"),
        ((np.zeros((8, 2)),), ((2, 1, 1),), "dataset_strategy[0]=(2, 1, 1) has 3 entries, but batch array 0 has 2 dims"),
        ((np.zeros((8, 2)),), "model_parallel", "dataset_strategy='model_parallel' is not one of ('data_parallel', 'full_batch'), nor"),
        ((np.zeros((6, 2)),), "data_parallel", "its devices hold 8 slices of dim 0, but 8 does not divide 6"),
        ((np.zeros((8, 2)),), ((3, 1),), "does not divide the device count 8"),
    ],
    ids=["count", "rank", "unknown", "not-divisible", "device-count"],
)
def test_bad_dataset_strategies_name_the_problem(batch, strategy, message):
    with pytest.raises(js.ShardingError, match=re.escape(message)):
        shard_batch(batch, strategy)


def test_loader_rejects_arrays_of_another_batch_size():
    with pytest.raises(js.ShardingError, match=re.escape("every array of a batch has batch_size=8 rows in dim 0")):
        ShardedLoader(lambda a, b: None, 8, [(8, 2), (4,)])


# --- parallelize(dataset_strategy=<tuple>): the same policy at the function boundary -----------


def conv_loss(w, batch):
    """An NHWC image batch (the strategy cuts H and W) and its labels through a 1x1 conv."""
    images, labels = batch
    return ((jnp.einsum("nhwc,cd->nhwd", images, w).mean(axis=(1, 2)) - labels) ** 2).mean()


HW = ((1, 2, 4, 1), (1, 1))
HW_LAYOUT = (js.Layout((2, 4), ("h", "w"))("None", "h", "w", "None"), js.Layout((2, 4), ("h", "w"))("None", "None"))


@pytest.mark.parametrize("mode", ["data", "semi_auto", "auto"])
@pytest.mark.parametrize("strategy", [HW, HW_LAYOUT, ((2, 1, 1, 1), (2, 1))], ids=["hw", "layout", "repeated"])
def test_parallelize_takes_a_tuple_dataset_strategy_as_shard_batch_does(strategy, mode):
    w = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
    batch = (images() / images().size, np.ones((8, 2), np.float32))
    step = js.parallelize(conv_loss, devices=8, mode=mode, dataset_strategy=strategy)
    got = float(step(w, batch))
    want = float(jax.jit(conv_loss)(*jax.device_put((w, batch), jax.devices()[0])))
    np.testing.assert_allclose(got, want, rtol=64 * np.finfo(np.float32).eps)
    planned = step.lower(w, batch).compile().input_shardings[0][1]
    for have, expected, ndim in zip(planned, batch_shardings([4, 2], strategy), (4, 2)):
        assert have.is_equivalent_to(expected, ndim)  # shard_batch's batch moves nowhere


def test_a_tuple_dataset_strategy_puts_each_block_on_the_mindspore_rank():
    step = js.parallelize(conv_loss, devices=8, dataset_strategy=HW)
    batch = (images(), np.ones((8, 2), np.float32))
    sharding = step.lower(np.ones((3, 2), np.float32), batch).compile().input_shardings[0][1][0]
    blocks = sharding.devices_indices_map(images().shape)
    devices = jax.devices()
    for rank in range(8):  # device matrix [2, 4]: rank r holds H block r // 4 and W block r % 4
        h, w = blocks[devices[rank]][1:3]
        assert (h.start // 2, w.start // 2) == (rank // 4, rank % 4)


def test_parallelize_checks_a_tuple_dataset_strategy_against_the_batch():
    with pytest.raises(js.ShardingError, match=re.escape(
        "jshard.parallelize(conv_loss): dataset_strategy has 1 entries ((1, 2, 4, 1),), but the batch has 2 "
        "arrays; give one strategy per array.")):
        js.parallelize(conv_loss, devices=8, dataset_strategy=((1, 2, 4, 1),)).plan(
            np.ones((3, 2), np.float32), (images(), np.ones((8, 2), np.float32)))
    with pytest.raises(js.ShardingError, match=re.escape(
        "jshard.parallelize(conv_loss): mode='manual' lays out arguments by in_strategy's PartitionSpecs only; a "
        "dataset_strategy of strategy tuples needs mode='data', 'semi_auto' or 'auto'.")):
        js.parallelize(conv_loss, mode="manual", mesh=jax.make_mesh((8,), ("x",)), dataset_strategy=HW)
