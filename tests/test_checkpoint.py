"""`jshard.checkpoint`: sharded saves restored onto other layouts, bit for bit; atomic and async saves;
mismatches listed. One process of 8 devices here; tests/test_distributed.py restores a checkpoint
written by two processes."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js
import jshard.checkpoint as ckpt

REPO = pathlib.Path(__file__).resolve().parents[1]


def state():
    rng = np.random.default_rng(0)
    return {"w1": rng.standard_normal((16, 32), np.float32), "w2": rng.standard_normal((32, 8), np.float32),
            "count": np.int32(7)}


def placed(tree, mesh, spec_of):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec_of(x))), tree)


def shardings(mesh, spec_of, like):
    return jax.tree.map(lambda x: NamedSharding(mesh, spec_of(x)), like)


DATA8 = Mesh(np.array(jax.devices()), ("dp",))
TENSOR4 = Mesh(np.array(jax.devices()[:4]), ("mp",))
rows = lambda x: P("dp") if np.ndim(x) else P()
last = lambda x: P(*([None] * (np.ndim(x) - 1)), "mp") if np.ndim(x) else P()


def test_eight_way_data_parallel_to_four_way_tensor_parallel_and_back_is_exact(tmp_path):
    s = state()
    ckpt.save(tmp_path, placed(s, DATA8, rows), step=1)
    on_tensor = ckpt.restore(tmp_path, shardings(TENSOR4, last, s))
    assert on_tensor["w1"].sharding.spec == P(None, "mp") and len(on_tensor["w1"].sharding.device_set) == 4
    assert on_tensor["w1"].addressable_shards[0].data.shape == (16, 8)
    ckpt.save(tmp_path, on_tensor, step=2)
    back = ckpt.restore(tmp_path, shardings(DATA8, rows, s), step=2)
    for name, value in s.items():
        np.testing.assert_array_equal(np.asarray(on_tensor[name]), value)
        np.testing.assert_array_equal(np.asarray(back[name]), value)
    assert back["w2"].sharding.spec == P("dp") and back["count"].dtype == np.int32
    assert ckpt.latest_step(tmp_path) == 2


def _step_and_state():
    def step(params, opt, x):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"]))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), opt

    s = state()
    params, opt = {"w1": s["w1"], "w2": s["w2"]}, {"count": s["count"]}
    x = np.ones((8, 16), np.float32)
    parallel = js.parallelize(step, devices=8, in_strategy=({"w1": (1, 8), "w2": (8, 1)}, None, (8, 1)))
    return parallel, (params, opt), x


def test_restore_onto_a_plan_lays_the_state_out_as_the_plan_does(tmp_path):
    parallel, (params, opt), x = _step_and_state()
    plan = parallel.plan(params, opt, x)
    ckpt.save(tmp_path, (params, opt), plan, step=3)  # saved from host arrays (one device)
    restored_params, restored_opt = ckpt.restore(tmp_path, plan)
    assert restored_params["w1"].sharding.spec == plan.in_shardings[0]["w1"].spec
    assert restored_params["w1"].sharding.spec == P(None, ("d0", "d1", "d2"))
    np.testing.assert_array_equal(np.asarray(restored_params["w2"]), params["w2"])
    loaded = ckpt.load_plan(tmp_path)
    assert isinstance(loaded, js.Plan) and loaded.fine.sizes == plan.fine.sizes
    again, _ = ckpt.restore(tmp_path, loaded, like=(params, opt))
    assert again["w2"].sharding.spec == restored_params["w2"].sharding.spec
    new, _ = parallel(restored_params, restored_opt, x)  # runs without moving anything
    expected, _ = jax.jit(parallel.fn)(params, opt, x)
    # x @ w1 (16 terms), tanh (a few), the backward's ones @ w2.T (8) and x.T @ (...) over the batch (8)
    assert_close(new["w1"], expected["w1"], terms=16 + 4 + 8 + 8)


def test_a_loaded_plan_needs_the_state_tree(tmp_path):
    parallel, (params, opt), x = _step_and_state()
    ckpt.save(tmp_path, (params, opt), parallel.plan(params, opt, x), step=0)
    with pytest.raises(js.ShardingError, match=re.escape("pass like=<the state, or jax.eval_shape of it>")):
        ckpt.restore(tmp_path, ckpt.load_plan(tmp_path))


def test_restoring_into_another_model_lists_every_mismatched_leaf(tmp_path):
    ckpt.save(tmp_path, {"w": np.ones((8, 4), np.float32), "b": np.zeros(4, np.float32)}, step=5)
    target = {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(DATA8, P("dp"))),
              "c": jax.ShapeDtypeStruct((4,), np.float32, sharding=NamedSharding(DATA8, P()))}
    with pytest.raises(js.ShardingError) as info:
        ckpt.restore(tmp_path, target)
    text = str(info.value)
    assert f"jshard.checkpoint.restore('{tmp_path}'): step 5 does not fit the target; 3 leaf/leaves differ:" in text
    assert "b: in the checkpoint, not in the target" in text
    assert "c: in the target, not in the checkpoint" in text
    assert "w: saved f32[8,4], target f32[8,8]" in text


def test_a_target_sharding_that_does_not_divide_is_listed(tmp_path):
    ckpt.save(tmp_path, {"w": np.ones((6, 4), np.float32)}, step=0)
    with pytest.raises(js.ShardingError, match=re.escape("w: the target sharding P('dp',) does not divide (6, 4)")):
        ckpt.restore(tmp_path, {"w": NamedSharding(DATA8, P("dp"))})


def test_missing_checkpoints_and_steps_are_errors(tmp_path):
    with pytest.raises(js.ShardingError, match="no step: it holds no complete checkpoint"):
        ckpt.restore(tmp_path / "none", {"w": NamedSharding(DATA8, P())})
    ckpt.save(tmp_path, {"w": np.ones(8, np.float32)}, step=1)
    with pytest.raises(js.ShardingError, match=re.escape("step 4 is not there: its complete steps are [1]")):
        ckpt.restore(tmp_path, {"w": NamedSharding(DATA8, P())}, step=4)
    with pytest.raises(js.ShardingError, match="step 1 is already saved there"):
        ckpt.save(tmp_path, {"w": np.ones(8, np.float32)}, step=1)
    assert ckpt.latest_step(tmp_path / "none") is None and ckpt.load_plan(tmp_path) is None


def test_async_save_returns_a_handle_to_wait_on(tmp_path):
    s = placed(state(), DATA8, rows)
    handle = ckpt.save(tmp_path, s, step=7, blocking=False)
    assert handle.wait() == 7 and handle.done
    assert ckpt.latest_step(tmp_path) == 7
    np.testing.assert_array_equal(np.asarray(ckpt.restore(tmp_path, shardings(DATA8, rows, s))["w1"]), state()["w1"])


CRASH = """
import os, signal, sys
import jshard
jshard.simulate_devices(8)
import numpy as np
import jshard.checkpoint as ckpt
from orbax.checkpoint._src.path import atomicity

async def crash(self):  # the step's files are written; die before the rename that publishes them
    print("crashing in finalize", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

atomicity.AtomicRenameTemporaryPath.finalize = crash
ckpt.save(sys.argv[1], {"w": np.full((8, 4), 2.0, np.float32)}, step=2)
"""


def test_a_crash_mid_save_leaves_the_previous_step_as_the_latest(tmp_path):
    ckpt.save(tmp_path, {"w": np.full((8, 4), 1.0, np.float32)}, step=1)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    crashed = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path)], env=env, capture_output=True, text=True,
                             timeout=120)
    assert crashed.returncode == -9 and "crashing in finalize" in crashed.stdout, crashed.stderr
    assert any("tmp" in p.name for p in tmp_path.iterdir() if p.name != "1")  # the half-written step
    assert ckpt.latest_step(tmp_path) == 1
    restored = ckpt.restore(tmp_path, {"w": NamedSharding(DATA8, P("dp"))})
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((8, 4), 1.0))
    ckpt.save(tmp_path, {"w": np.full((8, 4), 3.0, np.float32)}, step=2)  # the next save goes through
    assert ckpt.latest_step(tmp_path) == 2


# Bad files: named, never read as wrong values; the earlier steps stay restorable.


def _two_steps(directory, plan=None):
    ckpt.save(directory, {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}, step=1)
    ckpt.save(directory, {"w": np.arange(4096, dtype=np.float32).reshape(64, 64) * 2}, plan, step=2)
    shard = max((directory / "2" / "state").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    return shard, shard.relative_to(directory / "2")


def _cut(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


DAMAGE = {"cut short": (_cut, r"\d+ bytes, \d+ were saved \(cut short\)"),
          "one byte changed": (_flip, r"its contents changed since it was saved \(CRC-32 \w{8}, saved \w{8}\)"),
          "missing": (os.remove, r"missing \(\d+ bytes were saved\)")}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_shard_is_named_and_the_previous_step_still_restores(tmp_path, damage):
    shard, relative = _two_steps(tmp_path)
    spoil, what = DAMAGE[damage]
    spoil(shard)
    target = {"w": NamedSharding(DATA8, P("dp"))}
    with pytest.raises(js.ShardingError, match=re.escape(f"step 2 is damaged; 1 file(s) in {tmp_path / '2'} differ from "
                                                         f"what was saved:\n  {relative}: ") + what
                       + re.escape("\nThe other steps are untouched: restore the previous complete one with step=1 "
                                   "(complete steps [1, 2]).")):
        ckpt.restore(tmp_path, target)
    np.testing.assert_array_equal(np.asarray(ckpt.restore(tmp_path, target, step=1)["w"]),
                                  np.arange(4096, dtype=np.float32).reshape(64, 64))


def test_a_step_saved_without_a_record_is_still_never_read_wrong(tmp_path):
    _two_steps(tmp_path)
    (tmp_path / "2" / "jshard_files.json").unlink()  # as a step saved by an earlier jshard
    _cut(tmp_path / "2" / "state" / "manifest.ocdbt")
    with pytest.raises(js.ShardingError, match=re.escape(f"step 2 ({tmp_path / '2'}) cannot be read: ValueError: ")
                       + r".*manifest\.ocdbt.*\nIts files were cut short, changed or removed after it was saved\. "
                       + re.escape("The other steps are untouched: restore the previous complete one with step=1")):
        ckpt.restore(tmp_path, {"w": NamedSharding(DATA8, P("dp"))})


def test_a_damaged_plan_file_is_named_and_the_state_still_restores(tmp_path):
    parallel, (params, opt), x = _step_and_state()
    ckpt.save(tmp_path, (params, opt), parallel.plan(params, opt, x), step=0)
    plan_file = tmp_path / "0" / "plan" / "metadata"
    _cut(plan_file)
    with pytest.raises(js.ShardingError, match=re.escape("step 0 is damaged; 1 file(s)") + ".*\n  plan/metadata: .*cut short"):
        ckpt.load_plan(tmp_path)
    (tmp_path / "0" / "jshard_files.json").unlink()
    with pytest.raises(js.ShardingError, match=re.escape(f"jshard.checkpoint.load_plan({str(tmp_path)!r}): {plan_file} is "
                                                         "not valid JSON: ")):
        ckpt.load_plan(tmp_path)
    like = jax.eval_shape(lambda: (params, opt))
    restored, _ = ckpt.restore(tmp_path, jax.tree.map(lambda _: NamedSharding(DATA8, P()), like))
    np.testing.assert_array_equal(np.asarray(restored["w1"]), params["w1"])


def test_a_directory_another_program_wrote_is_named(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(3, args=ocp.args.StandardSave({"w": np.ones(8, np.float32)}))
        manager.wait_until_finished()
    with pytest.raises(js.ShardingError, match=re.escape(f"step 3 ({tmp_path / '3'}) holds the items ['default'], not the "
                                                         "'state' jshard.checkpoint.save writes")):
        ckpt.restore(tmp_path, {"w": NamedSharding(DATA8, P())})


def test_another_functions_plan_is_named(tmp_path):
    parallel, (params, opt), x = _step_and_state()
    ckpt.save(tmp_path, (params, opt), parallel.plan(params, opt, x), step=0)
    other = js.parallelize(lambda w: w * 2, devices=8).plan(np.ones((8, 4), np.float32))
    with pytest.raises(js.ShardingError, match=r"like= holds 3 arrays, but the plan lays out only 1 arguments: it is "
                                               r"another function's plan"):
        ckpt.restore(tmp_path, other, like=(params, opt))


def test_a_damaged_record_is_named_and_deleting_it_reads_the_step_unchecked(tmp_path):
    _two_steps(tmp_path)
    (tmp_path / "2" / "jshard_files.json").write_text('{"format": "jshard.checkpoint.files/1", "files": {"a": 3}}')
    target = {"w": NamedSharding(DATA8, P("dp"))}
    with pytest.raises(js.ShardingError, match=re.escape("jshard_files.json: the record of the step's files is itself "
                                                         "damaged, so they cannot be checked (delete it to read the "
                                                         "step unchecked)")):
        ckpt.restore(tmp_path, target)
    (tmp_path / "2" / "jshard_files.json").unlink()
    np.testing.assert_array_equal(np.asarray(ckpt.restore(tmp_path, target)["w"]),
                                  np.arange(4096, dtype=np.float32).reshape(64, 64) * 2)
