"""MindSpore's Gather / EmbeddingLookup strategies on a `shard`ed lookup (`jnp.take(table, indices,
axis=0)`, `table[indices]`): the device matrix, which rank holds which slice of the table, the
indices and the result, the masked lookup and its all-reduce in the compiled program, the values
against one device, and the strategies MindSpore refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close
from test_layouts import holders

import jshard as js

TABLE = jnp.asarray(np.random.default_rng(0).standard_normal((32, 8), dtype=np.float32))
TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, 32, size=(16, 4)), jnp.int32)


def lookup_step(strategy, lookup=lambda t, i: jnp.take(t, i, axis=0)):
    def step(table, tokens):
        return js.shard(lookup, strategy)(table, tokens)

    return step


def blocks(sharding, shape, dim, n):
    """The ranks holding each of the `n` blocks of `dim` (whole along the other dims they are cut on
    the strategy: every holder of a block, whatever else it holds)."""
    found = [set() for _ in range(n)]
    step = shape[dim] // n
    for block, ranks in holders(sharding, shape).items():
        start, stop = block[dim]
        for k in range(start // step, stop // step):
            found[k] |= ranks
    return found


@pytest.mark.parametrize(
    "strategy, matrix, table_rows, table_cols, token_rows",
    [
        # Rows and batch cut ("shard batch and axis"): matrix [c, a] = [4, 2], rank = 2*c + a.
        (((2, 1), (4, 1)), (4, 2), [{0, 2, 4, 6}, {1, 3, 5, 7}], None, [{0, 1}, {2, 3}, {4, 5}, {6, 7}]),
        # Rows whole: matrix table + indices = [1, 2, 4, 1], rank = 4*b + c.
        (((1, 2), (4, 1)), (1, 2, 4, 1), None, [{0, 1, 2, 3}, {4, 5, 6, 7}], [{0, 4}, {1, 5}, {2, 6}, {3, 7}]),
        # Rows cut on 4 of 8 devices, indices whole: the repeat goes first, [2, 4, 1], rank = 4*r + a.
        (((4, 1), (1, 1)), (2, 4, 1), [{0, 4}, {1, 5}, {2, 6}, {3, 7}], None, None),
        (((8, 1), (1, 1)), (8, 1), [{r} for r in range(8)], None, None),
    ],
    ids=["((2,1),(4,1))", "((1,2),(4,1))", "((4,1),(1,1))-repeated", "((8,1),(1,1))"],
)
def test_gather_ranks_on_8(strategy, matrix, table_rows, table_cols, token_rows):
    step = js.parallelize(lookup_step(strategy), devices=8)
    (table_sh, tokens_sh), _ = step.lower(TABLE, TOKENS).compile().input_shardings
    annotation = step.plan(TABLE, TOKENS).annotations[0]
    assert annotation.in_layouts[0].device_matrix == annotation.in_layouts[1].device_matrix == matrix
    if table_rows:
        assert blocks(table_sh, TABLE.shape, 0, len(table_rows)) == table_rows
    if table_cols:
        assert blocks(table_sh, TABLE.shape, 1, len(table_cols)) == table_cols
    if token_rows:
        assert blocks(tokens_sh, TOKENS.shape, 0, len(token_rows)) == token_rows
    out = step(TABLE, TOKENS)
    # A masked lookup sums one row and zeros: as many terms as the rows are cut into.
    assert_close(out, jnp.take(TABLE, TOKENS, axis=0), terms=strategy[0][0])
    if token_rows:  # the result's rows are cut as the tokens' rows
        assert blocks(out.sharding, out.shape, 0, len(token_rows)) == token_rows


def test_rows_and_batch_cut_is_a_masked_lookup_and_one_all_reduce():
    """No device gathers the table: each looks its tokens up in its own rows, and one all-reduce
    over the row axis (2 devices) sums the result's local block."""
    table = jnp.zeros((4096, 64), jnp.float32)
    step = js.parallelize(lookup_step(((2, 1), (4, 1)), lambda t, i: t[i]), devices=8)
    report = js.audit(step.lower(table, TOKENS).compile())
    assert [(c.kind, c.count, c.group_size) for c in report.collectives] == [("all-reduce", 1.0, 2)]
    assert report.bytes() == 4 * 4 * 64 * 4  # f32[16/4, 4, 64] per device
    assert step.plan(table, TOKENS).predicted_bytes("all-reduce") == report.bytes()  # the cost model agrees


def test_embedding_gradient_equals_one_device():
    def loss(table, tokens):
        return jnp.sum(jnp.tanh(lookup_step(((2, 1), (4, 1)))(table, tokens)))

    grad = js.parallelize(jax.value_and_grad(loss), devices=8, batch_argnums=1)(TABLE, TOKENS)
    want = jax.jit(jax.value_and_grad(loss))(TABLE, TOKENS)
    assert_close(grad, want, terms=TOKENS.size + 4)


@pytest.mark.parametrize(
    "strategy, axis, message",
    [
        (((2, 1), (2, 2)), 0, "in_strategy[0]=(2, 1) cuts the table's rows (the looked-up dim) and in_strategy[1]=(2, 2) "
                              "cuts the indices; MindSpore's Gather cuts both only as ((a, 1), (c, 1)) with a * c = 8 devices"),
        (((2, 2), (1, 1)), 0, "in_strategy[0]=(2, 2) cuts the rows and the columns of the table on 4 of 8 devices; "
                              "MindSpore's Gather repeats a row-cut table only when its columns are whole. Use "
                              "in_strategy[0]=(4, 2) (every device) or (2, 1)"),
    ],
    ids=["indices-cut-otherwise", "repeated-2d-cut"],
)
def test_gather_strategies_mindspore_refuses(strategy, axis, message):
    step = js.parallelize(lookup_step(strategy, lambda t, i: jnp.take(t, i, axis=axis)), devices=8)
    with pytest.raises(js.ShardingError, match="jshard.shard") as e:
        step(TABLE, TOKENS[:, :2] % 8)
    assert message in str(e.value)


def test_gather_on_axis_1_with_the_looked_up_dim_cut():
    """MindSpore's test_gather_v2.py::test_gatherv2_semi_auto3: Gather(axis=1) with ((1, 8), (1, 1)),
    the looked-up dim cut 8-way: a masked lookup along it and an all-reduce, equal to one device."""
    step = js.parallelize(lookup_step(((1, 8), (1, 1)), lambda t, i: jnp.take(t, i, axis=1)), devices=8)
    tokens = TOKENS % 8
    assert_close(step(TABLE, tokens), jnp.take(TABLE, tokens, axis=1), terms=8)
    (gather,) = [op for op in step.plan(TABLE, tokens).ops if op.primitive == "gather"]
    assert gather.in_strategy[0] == (1, 8)
