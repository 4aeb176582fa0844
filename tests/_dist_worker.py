"""A worker for tests/test_distributed.py, run alone (1 process x 8 devices) or under `jshard launch`.

`train OUT`: trains the small reference GPT with the 2-D preset (data 2 x tensor 4, over 8 devices
in all), each process reading only its rows of each batch through `jshard.data.ShardedLoader`;
with `--ckpt DIR` it resumes from the latest checkpoint and saves (asynchronously) every
`--ckpt-every` steps; with `--die-at K` process `--die-rank` kills itself with SIGKILL after step K.
It writes `OUT/rank<process id>.json` (losses by step, rows read) after every step.

`matmul OUT`: a 2-D `shard`ed matmul over all devices; writes its result (for the nodes test).

`fail OUT --fail-at K --how raise|exit|hang`: that matmul step after step; after step K process
`--die-rank` raises `RuntimeError` (`raise`), calls `sys.exit(3)` (`exit`) or sleeps in its own code
(`hang`, as a rank stuck on a dead file system) while the others go on to their next step's
collective, as a training job's ranks would.
"""

import argparse
import functools
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.multihost_utils import process_allgather

import jshard
import jshard.checkpoint
from jshard import models
from jshard.data import ShardedLoader, shard_batch

T0 = time.perf_counter()
CFG = models.GPTConfig(vocab=16, seq_len=8, d_model=32, n_heads=4, n_layers=1, d_ff=64)
BATCH = 8


def _write(out, record):
    path = os.path.join(out, f"rank{jax.process_index()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def init_params():
    """The GPT's parameters drawn with NumPy (same values in every process, no compile)."""
    shapes = jax.eval_shape(functools.partial(models.init_gpt, CFG), jax.random.key(0))
    rng = np.random.default_rng(0)

    def one(path, s):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(s.shape, np.float32)
        return (0.0 if "bias" in name else 0.2) * rng.standard_normal(s.shape).astype(np.float32)

    return jax.tree_util.tree_map_with_path(one, shapes)


def shard_batch_agrees(data, loader, first, preset) -> bool:
    """`shard_batch` from this process's rows of batch 0 and `"full_batch"` from all of them give the
    loader's batch 0."""
    lo, hi = loader.rows
    mine = shard_batch(tuple(x[lo:hi] for x in data), [preset.batch(2)] * 3)
    full = shard_batch(tuple(x[:BATCH] for x in data), "full_batch")
    same = jax.jit(lambda a, b, c: [jnp.array_equal(x, y) & jnp.array_equal(x, z) for x, y, z in zip(a, b, c)])
    return all(bool(v) for v in same(first, mine, full))


def train(args, info):
    preset = models.preset("2d", jax.device_count())
    data = models.copy_task_batch(np.random.default_rng(0), CFG, BATCH * args.steps)
    reads = []

    def read(start, stop):
        reads.append([start, stop])
        return tuple(x[start:stop] for x in data)

    loader = ShardedLoader(read, BATCH, [(BATCH, CFG.seq_len)] * 3, [preset.batch(2)] * 3)
    optimizer = optax.adam(3e-3)
    params = init_params()
    opt_state = optimizer.init(params)
    loss_fn = lambda p, b, pr: models.gpt_loss(p, b, CFG, pr)
    first = loader.batch(0)
    step = models.parallel_train_step(loss_fn, optimizer, params, opt_state, first, preset, models.GPT_RULES)
    plan = step.plan(params, opt_state, first)
    print(f"planned ({time.perf_counter() - T0:.1f} s)", flush=True)
    start = 0
    if args.ckpt and jshard.checkpoint.latest_step(args.ckpt) is not None:
        start = jshard.checkpoint.latest_step(args.ckpt)
        params, opt_state = jshard.checkpoint.restore(args.ckpt, plan)
        print(f"resumed from step {start}", flush=True)
    record = {"info": info._asdict(), "losses": {}, "reads": reads, "rows": list(loader.rows), "start": start,
              "shard_batch_agrees": shard_batch_agrees(data, loader, first, preset)}
    pending = None
    for k in range(start, args.steps):
        params, opt_state, loss = step(params, opt_state, loader.batch(k))
        record["losses"][k + 1] = float(loss)
        print(f"step {k + 1} loss {float(loss):.6f} ({time.perf_counter() - T0:.1f} s)", flush=True)
        if pending is not None:
            print(f"saved step {pending.wait()}", flush=True)
            pending = None
        if args.ckpt and (k + 1) % args.ckpt_every == 0:
            pending = jshard.checkpoint.save(args.ckpt, (params, opt_state), plan, step=k + 1, blocking=False)
        _write(args.out, record)
        if args.die_at == k + 1 and info.process_id == args.die_rank:
            print(f"rank {info.process_id} kills itself with SIGKILL at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if pending is not None:
        print(f"saved step {pending.wait()}", flush=True)
    print(f"finished ({time.perf_counter() - T0:.1f} s)", flush=True)


def matmul(args, info):
    n = jax.device_count()
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 100
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 100
    mm = jshard.parallelize(lambda x, w: jshard.shard(jnp.matmul, ((2, n // 2), (n // 2, 1)))(x, w), devices=n)
    y = mm(x, w)
    owners = sorted({d.process_index for d in y.sharding.device_set})
    _write(args.out, {"info": info._asdict(), "y": process_allgather(y, tiled=True).tolist(), "owners": owners,
                      "ranks": [[d.id, d.process_index] for d in mm.plan(x, w).mesh.devices.flat]})


def fail(args, info):
    n = jax.device_count()
    mm = jshard.parallelize(lambda x, w: jshard.shard(jnp.matmul, ((2, n // 2), (n // 2, 1)))(x, w), devices=n)
    x, w = np.ones((8, 16), np.float32), np.ones((16, 8), np.float32)
    for k in range(args.steps):
        y = mm(x, w)
        print(f"step {k + 1}: {float(y[0, 0])}", flush=True)
        if k + 1 == args.fail_at and info.process_id == args.die_rank:
            print(f"rank {info.process_id} fails at {time.time():.3f}", flush=True)
            if args.how == "raise":
                raise RuntimeError(f"data file missing on rank {info.process_id}")
            if args.how == "hang":
                time.sleep(600)
            sys.exit(3)


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("train", "matmul", "fail"))
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--fail-at", type=int, default=2)
    p.add_argument("--how", choices=("raise", "exit", "hang"), default="raise")
    return p.parse_args(argv)


def main(argv=None, info=None):
    """Runs one worker; `info` given (the suite's own process) skips `jshard.init()`."""
    info = jshard.init() if info is None else info  # first: joins the job, or simulates devices alone
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    {"train": train, "matmul": matmul, "fail": fail}[args.what](args, info)


if __name__ == "__main__":
    sys.exit(main())
