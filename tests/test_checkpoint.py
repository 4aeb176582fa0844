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
                       + re.escape("\nThe other steps are untouched: restore the previous verified one with step=1 "
                                   "(verified steps [1, 2]).")):
        ckpt.restore(tmp_path, target)
    np.testing.assert_array_equal(np.asarray(ckpt.restore(tmp_path, target, step=1)["w"]),
                                  np.arange(4096, dtype=np.float32).reshape(64, 64))


def test_a_step_without_its_record_is_never_read_and_restore_takes_the_latest_verified(tmp_path):
    """A step with no record of its files (its record deleted; an older jshard's async save the program
    never waited on, or a crash between its commit and the record) is refused by number, skipped by latest_step and restore(): a byte flipped in it
    is never read back as a wrong value."""
    shard, _ = _two_steps(tmp_path)
    (tmp_path / "2" / "jshard_files.json").unlink()
    _flip(shard)
    target = {"w": NamedSharding(DATA8, P("dp"))}
    assert ckpt.latest_step(tmp_path) == 1
    with pytest.raises(js.CheckpointError, match=re.escape(f"step 2 ({tmp_path / '2'}) cannot be verified: it has no "
                                                           "record of its files (jshard_files.json)") + ".*"
                       + re.escape("The latest verified step is 1, which restore() with no step takes (step=1).")):
        ckpt.restore(tmp_path, target, step=2)
    np.testing.assert_array_equal(np.asarray(ckpt.restore(tmp_path, target)["w"]),
                                  np.arange(4096, dtype=np.float32).reshape(64, 64))


def test_a_damaged_plan_file_is_named_and_the_state_still_restores(tmp_path):
    parallel, (params, opt), x = _step_and_state()
    ckpt.save(tmp_path, (params, opt), parallel.plan(params, opt, x), step=0)
    plan_file = tmp_path / "0" / "plan" / "metadata"
    _cut(plan_file)
    with pytest.raises(js.ShardingError, match=re.escape("step 0 is damaged; 1 file(s)") + ".*\n  plan/metadata: .*cut short"):
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


def test_a_damaged_record_is_named(tmp_path):
    _two_steps(tmp_path)
    (tmp_path / "2" / "jshard_files.json").write_text('{"format": "jshard.checkpoint.files/1", "files": {"a": 3}}')
    target = {"w": NamedSharding(DATA8, P("dp"))}
    with pytest.raises(js.ShardingError, match=re.escape("jshard_files.json: the record of the step's files is itself "
                                                         "damaged, so they cannot be checked\n") + ".*step=1"):
        ckpt.restore(tmp_path, target)
    np.testing.assert_array_equal(np.asarray(ckpt.restore(tmp_path, target, step=1)["w"]),
                                  np.arange(4096, dtype=np.float32).reshape(64, 64))


# Faults at the edges: a crash right after the commit, an exit without wait(), a target that cannot
# be written, a plan for more devices than the job has.

COMMITTED_CRASH = """
import os, signal, sys
import jshard
jshard.simulate_devices(8)
import numpy as np
import jshard.checkpoint as ckpt
from orbax.checkpoint._src.path import atomicity

rename = atomicity.async_path.rename

async def rename_and_crash(a, b):  # the step is published: die before anything after its rename runs
    await rename(a, b)
    if os.path.basename(b) == "2":
        print("crashing after the rename", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

atomicity.async_path.rename = rename_and_crash
ckpt.save(sys.argv[1], {"w": np.full((8, 4), 2.0, np.float32)}, step=2)
"""


def test_a_crash_right_after_the_commit_leaves_a_verified_step(tmp_path):
    """The record is written before Orbax's rename, so no step is ever visible without it."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    crashed = subprocess.run([sys.executable, "-c", COMMITTED_CRASH, str(tmp_path)], env=env, capture_output=True,
                             text=True, timeout=120)
    assert crashed.returncode == -9 and "crashing after the rename" in crashed.stdout, crashed.stderr
    assert (tmp_path / "2" / "jshard_files.json").exists() and ckpt.latest_step(tmp_path) == 2
    restored = ckpt.restore(tmp_path, {"w": NamedSharding(DATA8, P("dp"))})
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((8, 4), 2.0))


EXIT_WITHOUT_WAIT = """
import sys
import jshard
jshard.simulate_devices(8)
import numpy as np
import jshard.checkpoint as ckpt
ckpt.save(sys.argv[1], {"w": np.full((256, 256), 5.0, np.float32)}, step=7, blocking=False)
if sys.argv[2] == "fail":  # the directory vanishes under the save: finishing it at exit fails
    import orbax.checkpoint as ocp
    ocp.CheckpointManager.wait_until_finished = lambda self: (_ for _ in ()).throw(OSError(28, "No space left on device"))
"""


@pytest.mark.parametrize("how", ["finishes", "fail"])
def test_an_async_save_not_waited_on_is_finished_at_exit_or_its_loss_said(tmp_path, how):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_WAIT, str(tmp_path), how], env=env, capture_output=True,
                          text=True, timeout=120)
    if how == "finishes":
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        assert ckpt.latest_step(tmp_path) == 7
        restored = ckpt.restore(tmp_path, {"w": NamedSharding(DATA8, P("dp"))})
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((256, 256), 5.0))
    else:
        assert done.returncode == 1, done.stderr
        assert f"jshard.checkpoint: step 7 of {tmp_path} was not saved: the program exited before its async save " \
               "finished, and finishing it failed: CheckpointError: " in done.stderr
        assert "No space left on device" in done.stderr


FULL_DISK = """
import resource, signal, sys
import jshard
jshard.simulate_devices(8)
import numpy as np
import jshard.checkpoint as ckpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # any file past 4 KiB: as a full disk, EFBIG
try:
    ckpt.save(sys.argv[1], {"w": np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)}, step=1)
except ckpt.CheckpointError as e:
    print("CheckpointError:", e)
"""


def test_a_target_that_cannot_be_written_is_a_checkpoint_error(tmp_path):
    with pytest.raises(js.CheckpointError, match=re.escape("jshard.checkpoint.save('/sys/jshard-ckpt'): step 1 could "
                                                           "not be written: ") + ".*"
                       + re.escape("Free space on that file system, or give a directory this process can write")):
        ckpt.save("/sys/jshard-ckpt", {"w": np.ones((8, 4), np.float32)}, step=1)  # sysfs: read-only, even for root
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "c")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert f"CheckpointError: jshard.checkpoint.save({str(tmp_path / 'c')!r}): step 1 could not be written: " \
           in done.stdout, done.stdout + done.stderr


def test_a_saved_plan_for_more_devices_than_the_job_has_says_why_not(tmp_path):
    parallel, (params, opt), x = _step_and_state()
    big = js.parallelize(lambda p, o, x: (jax.tree.map(lambda w: w * 2, p), o), devices=16,
                         dataset_strategy="full_batch").plan(params, opt, x)
    ckpt.save(tmp_path, (params, opt), big, step=0)
    with pytest.raises(js.CheckpointError, match=re.escape("the plan lays the state out over 16 devices, and this job "
                                                           "has 8: a plan is made for one device count")):
        ckpt.restore(tmp_path, ckpt.load_plan(tmp_path), like=(params, opt))
    restored, _ = ckpt.restore(tmp_path, jax.tree.map(lambda _: NamedSharding(DATA8, P()), (params, opt)))
    np.testing.assert_array_equal(np.asarray(restored["w1"]), params["w1"])
