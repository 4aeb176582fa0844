"""Multi-process runs on localhost through `jshard launch`, each compared with one process.

One job of 2 processes x 4 simulated devices trains the small reference GPT with the 2-D preset
(data 2 x tensor 4), checkpointing every 2 steps, and process 1 kills itself with SIGKILL after
step 3; the same command then runs again and resumes. The suite's own process (1 x 8 devices) runs
the same training uninterrupted as the reference. Several tests read those runs, so the costly part
happens once. Ports are picked free on 127.0.0.1; every subprocess has a timeout.
"""

import contextlib
import datetime
import io
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jshard as js
import jshard.checkpoint
from jshard._cli import main
from jshard._launch import STOP_GRACE

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKER = str(pathlib.Path(__file__).with_name("_dist_worker.py"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))
import _dist_worker  # noqa: E402
from _tolerance import assert_close, step_terms  # noqa: E402

STEPS, EVERY, DIE_AT = 4, 2, 3
TIMEOUT = 240


def worker_env(tmp: pathlib.Path) -> dict:
    """The suite's environment for subprocesses: this checkout's jshard first, JAX's compilation
    cache shared between the runs (the resumed run compiles nothing new), no stray job settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JSHARD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp / "jax_cache")
    return env


def launch(args, env, timeout=TIMEOUT, wait=True):
    """`jshard launch ARGS` in a subprocess: its CompletedProcess, or with `wait=False` its Popen."""
    command = [sys.executable, "-m", "jshard", "launch", *map(str, args)]
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def finish(launcher: subprocess.Popen, timeout=TIMEOUT) -> tuple[str, str]:
    """A launcher's output once it exits; past `timeout`, SIGTERM (which it forwards, then SIGKILLs
    its workers) so that no job outlives the test."""
    try:
        return launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.terminate()
        launcher.communicate(timeout=30)
        raise


def launch_here(args, env) -> subprocess.CompletedProcess:
    """`jshard launch ARGS` run by this process (no interpreter to start), its workers given `env`."""
    saved, err = dict(os.environ), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(env)
        with contextlib.redirect_stderr(err):
            code = main(["launch", *map(str, args)])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(args, code, "", err.getvalue())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terms(steps: int) -> int:
    """The terms `steps` train steps of the worker's GPT sum (tests/_tolerance.py): each adds its own."""
    batch = _dist_worker.models.copy_task_batch(np.random.default_rng(0), _dist_worker.CFG, _dist_worker.BATCH)
    return steps * step_terms(_dist_worker.init_params(), batch)


def losses(out: pathlib.Path, rank: int) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((out / f"rank{rank}.json").read_text())["losses"].items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference (1 x 8, in this process), the killed 2 x 4 job and its resumed rerun."""
    tmp = tmp_path_factory.mktemp("dist")
    env, out, ckpt = worker_env(tmp), tmp / "mp", tmp / "mp_ckpt"
    common = ["--worker-num", 2, "--devices-per-worker", 4, "--cluster-time-out", 60, "--log-dir"]
    job = [WORKER, "train", out, "--steps", STEPS, "--ckpt", ckpt, "--ckpt-every", EVERY]
    running = launch([*common, tmp / "logs1", *job, "--die-at", DIE_AT], env, wait=False)
    ref_out, ref_ckpt = tmp / "ref", tmp / "ref_ckpt"  # the reference runs meanwhile, in this process
    _dist_worker.main(["train", str(ref_out), "--steps", str(STEPS), "--ckpt", str(ref_ckpt),
                       "--ckpt-every", str(EVERY)])
    stdout, stderr = finish(running)
    killed = subprocess.CompletedProcess(running.args, running.returncode, stdout, stderr)
    killed_losses = {r: losses(out, r) for r in (0, 1)}
    resumed = launch_here([*common, tmp / "logs2", *job], env)
    return dict(ref=losses(ref_out, 0), ref_ckpt=ref_ckpt, killed=killed, ckpt=ckpt,
                killed_losses=killed_losses, resumed=resumed, resumed_record=json.loads((out / "rank0.json").read_text()),
                logs1=tmp / "logs1", logs2=tmp / "logs2", out=out)


def test_two_processes_give_one_process_losses_step_for_step(runs):
    ref = runs["ref"]
    assert sorted(ref) == list(range(1, STEPS + 1))
    for rank in (0, 1):
        before = runs["killed_losses"][rank]
        assert set(range(1, DIE_AT + 1)) <= set(before)
        for step, loss in before.items():
            assert_close(loss, ref[step], dtype=np.float32, terms=terms(step), err_msg=f"rank {rank} step {step}")
    after = {int(k): v for k, v in runs["resumed_record"]["losses"].items()}
    assert sorted(after) == list(range(EVERY + 1, STEPS + 1))
    for step, loss in after.items():
        assert_close(loss, ref[step], dtype=np.float32, terms=terms(step), err_msg=f"resumed step {step}")
    assert ref[STEPS] < ref[1]  # it trains


def test_a_killed_worker_is_detected_and_reported(runs):
    killed = runs["killed"]
    assert killed.returncode == 128 + 9, killed.stderr
    err = killed.stderr
    assert "jshard launch: rank 1 was killed by SIGKILL" in err
    assert "rank 1 kills itself with SIGKILL" in err  # its last log lines
    # rank 0 is stopped, or it had already failed on the lost connection: either way it is named
    assert "stopping the other 1 worker(s) on this node: ranks 0" in err or "also failed on this node" in err
    assert "exit status 137 (rank 1)" in err
    log = (runs["logs1"] / "worker_1.log").read_text()
    died = float(re.search(r"kills itself with SIGKILL at ([\d.]+)", log).group(1))
    launcher = (runs["logs1"] / "launcher.log").read_text()
    assert launcher.count("rank 1 was killed by SIGKILL") == 1
    seen, done = (_stamp(launcher, text) - died for text in ("rank 1 was killed", "exit status 137"))
    print(f"kill -9 of rank 1: reported after {seen:.2f} s, the job stopped after {done:.2f} s")
    assert seen < 3 and done < 3 + STOP_GRACE, "the launcher took too long to notice or to stop the job"
    assert (runs["logs1"] / "worker_0.log").exists()


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_worker_is_reported_at_once_not_after_jax_s_shutdown_barrier(tmp_path, how):
    """Rank 1 raises (or calls sys.exit(3)) while rank 0 waits in the next step's collective: the
    launcher names rank 1 and its exception at once and stops rank 0; JAX's shutdown barrier would
    have held both for 300 s and blamed rank 0's SIGABRT."""
    env, logs = worker_env(tmp_path), tmp_path / "logs"
    done = launch_here(["--worker-num", 2, "--devices-per-worker", 2, "--cluster-time-out", 60, "--log-dir", logs,
                        WORKER, "fail", tmp_path / "out", "--steps", 50, "--fail-at", 2, "--how", how], env)
    status, what = (1, "raised RuntimeError: data file missing on rank 1 and exited with status 1") if how == "raise" \
        else (3, "exited with status 3 (sys.exit(3))")
    assert done.returncode == status, done.stderr
    assert f"jshard launch: rank 1 {what}" in done.stderr
    if how == "raise":
        assert "  |     raise RuntimeError(f\"data file missing on rank {info.process_id}\")\n" \
               "  | RuntimeError: data file missing on rank 1" in done.stderr
    assert f"exit status {status} (rank 1)" in done.stderr
    failed = float(re.search(r"rank 1 fails at ([\d.]+)", (logs / "worker_1.log").read_text()).group(1))
    launcher = (logs / "launcher.log").read_text()
    seen, stopped = (_stamp(launcher, text) - failed for text in (f"rank 1 {what.split()[0]}", "exit status"))
    print(f"{how} on rank 1: reported after {seen:.2f} s, the job stopped after {stopped:.2f} s")
    assert seen < 5 and stopped < 5 + STOP_GRACE, "the launcher took too long to notice or to stop the job"


def test_a_hung_rank_is_found_while_the_others_wait_in_a_collective(tmp_path):
    """Rank 1 sleeps in its own code after step 2 while rank 0 waits in step 3's collective: the
    watchdog ends the job soon after --hang-timeout, naming rank 1 and where rank 0 waits, with both
    ranks' Python stacks in their logs (without it the job sat there for good)."""
    env, logs = worker_env(tmp_path), tmp_path / "logs"
    start = time.monotonic()
    done = launch_here(["--worker-num", 2, "--devices-per-worker", 2, "--cluster-time-out", 60, "--hang-timeout", 3,
                        "--log-dir", logs, WORKER, "fail", tmp_path / "out", "--steps", 50, "--fail-at", 2,
                        "--how", "hang"], env)
    assert done.returncode == 124, done.stderr
    assert time.monotonic() - start < TIMEOUT / 2
    err = done.stderr
    assert "the job is hung: rank 1 did not arrive" in err and "_dist_worker.py:" in err
    assert "not in a JAX call" in err and "rank 0 for " in err and "waiting inside a JAX call" in err
    for rank in (0, 1):
        assert "most recent call first" in (logs / f"worker_{rank}.log").read_text()


HANG_WITHOUT_LAUNCHER = """
import sys, time
import jshard
rank, port, busy = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
jshard.init(f"127.0.0.1:{port}", 2, rank, local_devices=1, hang_timeout=2)
import numpy as np
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("both here")
print("synced", flush=True)
if rank == 1:
    end = time.time() + busy  # computing for `busy` s first: rank 0 waits longer, so its watchdog fires first
    while time.time() < end:
        continue
    time.sleep(120)
multihost_utils.process_allgather(np.ones(2))
"""


@pytest.mark.parametrize("busy", [0.0, 1.0], ids=["together", "coordinator_first"])
def test_init_s_watchdog_names_the_hung_rank_without_a_launcher(tmp_path, busy):
    """Two processes started by hand (as SLURM would) with jshard.init(hang_timeout=2): rank 1 sleeps while
    rank 0 waits in a collective; rank 1's watchdog names it from the progress both shared through the
    coordination service, dumps its stacks and exits 124; rank 0 ends with 124 too. Process 0 hosts the
    coordination service, whose end would abort process 1 before it reports: where its watchdog fires
    first (rank 1 busy for a second before it sleeps), it waits for rank 1's report."""
    env, port = worker_env(tmp_path), free_port()
    procs = [subprocess.Popen([sys.executable, "-c", HANG_WITHOUT_LAUNCHER, str(r), str(port), str(busy)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    (out0, err0), (out1, err1) = (finish(p, timeout=120) for p in procs)
    assert "synced" in out0 and "synced" in out1, err0 + err1
    assert procs[1].returncode == 124, err1
    assert "jshard: process 1 made no progress for" in err1 and "the job is hung: rank 1 did not arrive" in err1
    assert "rank 0 for " in err1 and "waiting inside a JAX call" in err1 and "most recent call first" in err1
    assert procs[0].returncode == 124, err0
    # its own watchdog's report, or its collective's error once rank 1 left, said to follow the hang
    assert "the job is hung: rank 1 did not arrive" in err0 or "follows the hang that ended process(es) 1" in err0


def _stamp(launcher_log: str, text: str) -> float:
    """When launcher.log says `text`, in seconds since the epoch."""
    stamp = re.search(rf"^([\d-]+ [\d:.]+) jshard launch: {text}", launcher_log, re.M).group(1)
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc).timestamp()


def test_the_rerun_resumes_from_the_last_checkpoint_and_reaches_the_same_final_loss(runs):
    resumed = runs["resumed"]
    assert resumed.returncode == 0, resumed.stderr
    assert "all 2 worker(s) on this node exited 0" in resumed.stderr
    record = runs["resumed_record"]
    assert record["start"] == EVERY  # the step-2 save; step 3 was recomputed
    assert "resumed from step 2" in (runs["logs2"] / "worker_0.log").read_text()
    assert_close(record["losses"][str(STEPS)], runs["ref"][STEPS], dtype=np.float32, terms=terms(STEPS))
    assert jshard.checkpoint.latest_step(runs["ckpt"]) == STEPS


def test_each_process_reads_only_its_own_rows_and_shard_batch_agrees(runs):
    for rank in (0, 1):
        record = json.loads((runs["out"] / f"rank{rank}.json").read_text())
        own = [[start + 4 * rank, start + 4 * rank + 4] for start in range(EVERY * 8, STEPS * 8, 8)]
        assert record["rows"] == [4 * rank, 4 * rank + 4]
        assert record["reads"][1:] == own  # reads[0] is batch 0, read to plan
        assert record["info"]["num_processes"] == 2 and record["info"]["local_devices"] == 4
        assert record["shard_batch_agrees"] is True  # shard_batch from local rows, and from all with full_batch


def test_a_two_process_checkpoint_restores_exactly_onto_other_layouts(runs):
    like = _dist_worker.init_params()
    state_like = (like, jax.eval_shape(optax.adam(3e-3).init, like))
    devices = jax.devices()
    tensor = jax.sharding.Mesh(np.array(devices[:4]), ("mp",))
    data = jax.sharding.Mesh(np.array(devices), ("dp",))

    def onto(mesh, spec_of):
        return jax.tree.map(lambda x: NamedSharding(mesh, spec_of(x)), state_like)

    last_dim = lambda x: PartitionSpec(*([None] * (x.ndim - 1)), "mp") if x.ndim and x.shape[-1] % 4 == 0 else PartitionSpec()
    on_tensor = jshard.checkpoint.restore(runs["ckpt"], onto(tensor, last_dim))
    on_data = jshard.checkpoint.restore(runs["ckpt"], onto(data, lambda x: PartitionSpec()))
    reference = jshard.checkpoint.restore(runs["ref_ckpt"], onto(data, lambda x: PartitionSpec()))
    for a, b, r in zip(jax.tree.leaves(on_tensor), jax.tree.leaves(on_data), jax.tree.leaves(reference)):
        assert len(a.sharding.device_set) == 4 and len(b.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert_close(a, r, terms=terms(STEPS))  # Adam's state and parameters after STEPS steps
    plan = jshard.checkpoint.load_plan(runs["ckpt"])
    assert plan.device_count == 8 and plan.fine.sizes == (2, 2, 2)


def test_two_nodes_of_two_workers_through_node_rank(tmp_path):
    env, port, out = worker_env(tmp_path), free_port(), tmp_path / "out"
    common = ["--worker-num", 4, "--local-worker-num", 2, "--master-port", port, "--devices-per-worker", 2,
              "--cluster-time-out", 60]
    node1 = launch([*common, "--node-rank", 1, "--log-dir", tmp_path / "node1", WORKER, "matmul", out], env, wait=False)
    node0 = launch_here([*common, "--node-rank", 0, "--log-dir", tmp_path / "node0", WORKER, "matmul", out], env)
    results = [finish(node1), ("", node0.stderr)]
    for code, (_, err) in zip((node1.returncode, node0.returncode), results):
        assert code == 0, err
    assert "node 1: ranks 2..3 of 4" in results[0][1] and "node 0: ranks 0..1 of 4" in results[1][1]
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 100
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 100
    mm = js.parallelize(lambda x, w: js.shard(jax.numpy.matmul, ((2, 4), (4, 1)))(x, w), devices=8)
    alone = np.asarray(mm(x, w))  # the same program in one process of 8 devices
    for rank in range(4):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert record["info"] == {"process_id": rank, "num_processes": 4, "coordinator": f"127.0.0.1:{port}",
                                  "local_devices": 2, "devices": 8}
        assert_close(np.array(record["y"]), alone, dtype=np.float32, terms=16)  # a sum of 16 positive terms
        assert record["owners"] == [0, 1, 2, 3]
        # ranks fill one process before the next: the 4-way cut's fast half stays within a process
        assert [p for _, p in record["ranks"]] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_node_that_never_arrives_is_a_clear_error_within_the_time_out(tmp_path):
    env, port = worker_env(tmp_path), free_port()
    start = time.monotonic()
    only = launch_here(["--worker-num", 2, "--local-worker-num", 1, "--master-port", port, "--node-rank", 0,
                        "--devices-per-worker", 2, "--cluster-time-out", 3, WORKER, "matmul", tmp_path / "out"], env)
    assert only.returncode != 0, only.stderr
    assert time.monotonic() - start < 60
    # JAX's coordination client aborts the worker (SIGABRT) when the job does not form in time
    assert "the job did not form within --cluster-time-out 3 s: not all --worker-num 2 processes reached the " \
           f"coordinator 127.0.0.1:{port}" in only.stderr


def test_an_unreachable_coordinator_is_a_clear_error_within_the_time_out(tmp_path):
    env = dict(worker_env(tmp_path), JSHARD_COORDINATOR=f"127.0.0.1:{free_port()}", JSHARD_NUM_PROCESSES="2",
               JSHARD_PROCESS_ID="1", JSHARD_INIT_TIMEOUT="1")
    start = time.monotonic()
    alone = subprocess.run([sys.executable, "-c", "import jshard; jshard.init()"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert alone.returncode == 1 and time.monotonic() - start < 30
    assert "jshard.init(): process 1 of 2 cannot reach the coordinator at 127.0.0.1:" in alone.stderr
    assert "within 1 s (Connection refused). Start process 0" in alone.stderr


def test_init_is_a_no_op_in_one_process_and_idempotent():
    first, again = js.init(), js.init()
    assert first == again == js.ProcessInfo(0, 1, None, 8, 8)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"JSHARD_NUM_PROCESSES": "2", "JSHARD_PROCESS_ID": "0"}, "JSHARD_COORDINATOR missing"),
        ({"JSHARD_COORDINATOR": "127.0.0.1:1", "JSHARD_NUM_PROCESSES": "2", "JSHARD_PROCESS_ID": "2"},
         "process id 2 with 2 processes; ids run from 0 to 2 - 1"),
        ({"JSHARD_COORDINATOR": "nohost", "JSHARD_NUM_PROCESSES": "2", "JSHARD_PROCESS_ID": "0"},
         "coordinator 'nohost' is not host:port"),
        ({"JSHARD_COORDINATOR": "127.0.0.1:1", "JSHARD_NUM_PROCESSES": "two", "JSHARD_PROCESS_ID": "0"},
         "JSHARD_NUM_PROCESSES='two' is not an integer"),
        ({"JSHARD_COORDINATOR": "127.0.0.1:1", "JSHARD_NUM_PROCESSES": "2", "JSHARD_PROCESS_ID": "1"},
         "JAX has already started its backend in this process"),
    ],
    ids=["partial", "id-out-of-range", "no-port", "not-an-int", "too-late"],
)
def test_init_errors_name_the_setting_and_the_fix(monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(js.ShardingError, match=re.escape(message)):
        js.init()
