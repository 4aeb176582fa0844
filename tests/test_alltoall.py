"""`enable_alltoall` (MindSpore's switch; jshard's default on): a mesh axis that moves from one tensor
dim to another is priced and emitted as an all-to-all only when enabled, else as an all-gather and a
local slice; read back from the compiled HLO, and the plan's priced collectives agree with it."""

import jax.numpy as jnp
import pytest
from _tolerance import assert_close

import jshard as js
from jshard.cost import Comm, redistribution


def test_a_move_is_an_all_to_all_only_when_enabled():
    axis_size = {"d0": 2, "d1": 4}
    src, dst = (("d0", "d1"), ()), ((), ("d0", "d1"))  # rows cut 8-way -> columns cut 8-way
    assert redistribution((64, 32), 4, src, dst, axis_size) == [Comm("all-to-all", 64 * 32 * 4 / 8, ("d0", "d1"))]
    assert redistribution((64, 32), 4, src, dst, axis_size, alltoall=False) == [
        Comm("all-gather", 64 * 32 * 4, ("d0", "d1"))]
    # an axis dst drops is gathered either way; one that stays on its dim moves nothing
    src, dst = (("d0",), ("d1",)), (("d0",), ())
    assert redistribution((64, 32), 4, src, dst, axis_size, alltoall=False) == redistribution(
        (64, 32), 4, src, dst, axis_size) == [Comm("all-gather", 64 * 32 * 4 / 2, ("d1",))]


def _transposed(x):
    return js.shard(jnp.sin, in_strategy=((8, 1),))(x.T) * 2  # x's rows cut, x.T's rows wanted cut


@pytest.mark.parametrize("enable", [False, True], ids=["off", "on"])
def test_transpose_redistribution_in_the_compiled_program(enable):
    x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 100
    f = js.parallelize(_transposed, devices=8, in_strategy=((8, 1),), cost_model=js.CostModel(alltoall=enable))
    kinds = js.audit(f.lower(x).compile()).by_kind()
    priced = {c.kind for op in f.plan(x).ops for c in op.comms}
    assert priced == set(kinds), (priced, kinds)
    if enable:
        assert "all-to-all" in kinds and "all-gather" not in kinds
    else:
        assert "all-to-all" not in kinds and "all-gather" in kinds
    assert_close(f(x), _transposed(x))


def test_enable_alltoall_is_checked():
    with pytest.raises(TypeError, match=r"jshard.parallelize\(<lambda>\): CostModel\(alltoall=\) takes True or False, got .yes."):
        js.parallelize(lambda x: x, devices=8, cost_model=js.CostModel(alltoall="yes"))


def test_on_by_default_and_in_the_cli(capsys):
    from jshard._cli import main

    x = jnp.ones((64, 32), jnp.float32)
    kinds = js.audit(js.parallelize(_transposed, devices=8, in_strategy=((8, 1),)).lower(x).compile()).by_kind()
    assert "all-to-all" in kinds
    assert main(["plan", "gpt", "--devices", "8", "--no-enable-alltoall"]) == 0
    assert "all-to-all" not in capsys.readouterr().out
