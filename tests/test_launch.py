"""`jshard launch` with small Python workers (no JAX in them), and `jshard k8s`'s manifest.

The launcher runs in this process through `jshard._cli.main` (its workers are subprocesses), except
where a signal must reach it. Everything binds 127.0.0.1 only.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

import jshard as js
from jshard._cli import main
from jshard._launch import worker_command
from jshard._worker import WRAPPER

REPO = pathlib.Path(__file__).resolve().parents[1]


def script(tmp_path, body: str) -> str:
    """A worker script: `body` runs with `rank` and `os`, `sys`, `time` at hand."""
    path = tmp_path / "worker.py"
    path.write_text("import os, signal, sys, time\nrank = int(os.environ['JSHARD_PROCESS_ID'])\n" + body)
    return str(path)


def test_workers_get_the_environment_jshard_init_reads_and_one_log_each(tmp_path, capsys):
    worker = script(tmp_path, "print('env', rank, *(os.environ[k] for k in ('JSHARD_COORDINATOR', "
                              "'JSHARD_NUM_PROCESSES', 'JSHARD_LOCAL_DEVICES', 'JSHARD_INIT_TIMEOUT')))\n")
    logs = tmp_path / "logs"
    assert main(["launch", "--worker-num", "3", "--devices-per-worker", "2", "--master-port", "29531",
                 "--cluster-time-out", "7", "--log-dir", str(logs), worker]) == 0
    for rank in range(3):
        assert (logs / f"worker_{rank}.log").read_text() == f"env {rank} 127.0.0.1:29531 3 2 7\n"
    launcher = (logs / "launcher.log").read_text()
    assert "node 0: ranks 0..2 of 3, coordinator 127.0.0.1:29531" in launcher
    assert "all 3 worker(s) on this node exited 0" in launcher
    assert "env 0" not in capsys.readouterr().out  # a log dir without --join: nothing streamed


def test_join_streams_every_worker_prefixed_by_rank(tmp_path, capsys):
    worker = script(tmp_path, "print('hello from', rank)\n")
    assert main(["launch", "--worker-num", "2", "--log-dir", str(tmp_path / "logs"), "--join", worker]) == 0
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


def test_node_rank_runs_its_share_of_the_global_ranks(tmp_path, capsys):
    worker = script(tmp_path, "print('rank', rank, 'of', os.environ['JSHARD_NUM_PROCESSES'])\n")
    assert main(["launch", "--worker-num", "4", "--local-worker-num", "2", "--node-rank", "1",
                 "--master-port", "29533", "--", sys.executable, worker]) == 0
    out = capsys.readouterr().out
    assert "[rank 2] rank 2 of 4" in out and "[rank 3] rank 3 of 4" in out and "[rank 0]" not in out


def test_a_failing_worker_stops_the_others_and_its_status_is_returned(tmp_path, capsys):
    worker = script(tmp_path, "print('working', rank, flush=True)\n"
                              "if rank == 1:\n    print('giving up', flush=True)\n    sys.exit(3)\n"
                              "time.sleep(120)\n")
    start = time.monotonic()
    assert main(["launch", "--worker-num", "3", "--cluster-time-out", "5", "--log-dir", str(tmp_path / "l"),
                 worker]) == 3
    assert time.monotonic() - start < 20  # the sleepers were stopped, not waited for
    err = capsys.readouterr().err
    assert "jshard launch: rank 1 exited with status 3" in err
    assert "  | working 1\n  | giving up" in err
    assert "stopping the other 2 worker(s) on this node: ranks 0, 2" in err
    assert "exit status 3 (rank 1)" in err


def test_the_cause_is_named_not_the_peer_that_noticed_it(tmp_path, capsys):
    """Rank 1 dies by SIGKILL a moment after rank 0 fails on the dead connection (as gloo reports it):
    the launcher names rank 1 and its signal, not rank 0's consequence, though it saw rank 0 first."""
    worker = script(tmp_path, "if rank == 0:\n    raise RuntimeError('UNKNOWN: Gloo all-reduce failed: Read error "
                              "[127.0.0.1]:1: Connection reset by peer')\n"
                              "time.sleep(0.4)\nprint('rank 1 goes', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert main(["launch", "--worker-num", "2", "--cluster-time-out", "5", "--log-dir", str(tmp_path / "l"),
                 worker]) == 128 + 9
    err = capsys.readouterr().err
    assert "jshard launch: rank 1 was killed by SIGKILL" in err and "exit status 137 (rank 1)" in err
    assert "rank 0 raised" not in err
    assert "also failed on this node (after rank 1, a consequence where a peer went away): rank 0 (RuntimeError: " in err


def test_a_peer_failure_alone_is_reported_when_no_cause_shows(tmp_path, capsys):
    worker = script(tmp_path, "if rank == 0:\n    raise RuntimeError('Connection reset by peer')\ntime.sleep(120)\n")
    start = time.monotonic()
    assert main(["launch", "--worker-num", "2", "--cluster-time-out", "5", "--log-dir", str(tmp_path / "l"),
                 worker]) == 1
    assert time.monotonic() - start < 20
    assert "rank 0 raised RuntimeError: Connection reset by peer" in capsys.readouterr().err


def test_an_exception_names_its_rank_and_its_last_lines_and_leaves_a_failure_record(tmp_path, capsys):
    worker = script(tmp_path, "print('working', rank, flush=True)\n"
                              "if rank == 1:\n    raise RuntimeError('data file missing on rank 1')\n"
                              "time.sleep(120)\n")
    logs = tmp_path / "l"
    (logs).mkdir()
    (logs / "failure_0.json").write_text('{"rank": 0, "type": "OSError", "time": 0}')  # a previous run's: ignored
    assert main(["launch", "--worker-num", "2", "--cluster-time-out", "5", "--log-dir", str(logs), worker]) == 1
    err = capsys.readouterr().err
    assert "jshard launch: rank 1 raised RuntimeError: data file missing on rank 1 and exited with status 1" in err
    assert f'  |   File "{worker}", line 5, in <module>\n' \
           "  |     raise RuntimeError('data file missing on rank 1')\n" \
           "  | RuntimeError: data file missing on rank 1\n" in err
    assert "_worker.py" not in err and "runpy" not in err  # the wrapper's frames are left out
    assert "stopping the other 1 worker(s) on this node: ranks 0" in err and "exit status 1 (rank 1)" in err
    record = json.loads((logs / "failure_1.json").read_text())
    assert (record["rank"], record["type"], record["status"]) == (1, "RuntimeError", 1)
    assert not (logs / "failure_0.json").exists()


def test_a_python_command_after_the_dashes_runs_through_the_wrapper(tmp_path, capsys):
    worker = script(tmp_path, "if rank == 0:\n    sys.exit('no data')\ntime.sleep(120)\n")
    assert main(["launch", "--worker-num", "2", "--cluster-time-out", "5", "--", sys.executable, worker]) == 1
    err = capsys.readouterr().err
    assert "jshard launch: rank 0 exited with status 1 (sys.exit('no data')); its last 1 log line(s):\n  | no data" in err


def test_a_wrapped_script_sees_sys_path_and_argv_as_python_gives_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "extra"))
    worker = script(tmp_path, "print('path', sys.path[0] == os.path.dirname(__file__), "
                              "os.environ['PYTHONPATH'] in sys.path, sys.argv, __name__)\n")
    assert main(["launch", "--worker-num", "1", "--", sys.executable, worker, "--steps", "3"]) == 0
    assert f"[rank 0] path True True {[worker, '--steps', '3']} __main__" in capsys.readouterr().out


@pytest.mark.parametrize(
    "command, wrapped",
    [
        (["train.py", "--steps", "3"], [sys.executable, WRAPPER, "train.py", "--steps", "3"]),
        (["python3", "train.py"], ["python3", WRAPPER, "train.py"]),
        (["/usr/bin/python", "-m", "pkg.train", "-x"], ["/usr/bin/python", WRAPPER, "-m", "pkg.train", "-x"]),
        (["python", "-c", "pass"], ["python", "-c", "pass"]),
        (["./run.sh", "train.py"], ["./run.sh", "train.py"]),
    ],
    ids=["script", "python-script", "python-module", "python-c", "other-program"],
)
def test_python_scripts_and_modules_run_through_the_failure_wrapper(command, wrapped):
    assert worker_command(command) == wrapped


def test_init_s_excepthook_ends_the_process_at_once_with_a_failure_record(tmp_path):
    program = ("import atexit, os, sys, time\nfrom jshard._worker import install_excepthook\n"
               "atexit.register(lambda: time.sleep(60))  # stands for JAX's shutdown barrier\n"
               "install_excepthook()\nraise KeyError('shard 3')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), JSHARD_FAILURE_DIR=str(tmp_path), JSHARD_PROCESS_ID="2")
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 1 and "KeyError: 'shard 3'" in done.stderr
    record = json.loads((tmp_path / "failure_2.json").read_text())
    assert (record["rank"], record["type"], record["message"]) == (2, "KeyError", "'shard 3'")
    assert record["lines"][-1] == "KeyError: 'shard 3'"


def test_gloo_s_connection_chatter_is_left_out_of_the_stream_but_kept_in_the_log(tmp_path, capsys):
    chatter = "[Gloo] Rank {} is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
    worker = script(tmp_path, f"print({chatter!r}.format(rank))\n"
                              "print('[Gloo] Rank 3[Gloo] Rank 2 is connected to 3 peer ranks. Expected number of "
                              "connected peer ranks is : 3')\nprint('step 1 done')\n")
    assert main(["launch", "--worker-num", "2", "--log-dir", str(tmp_path / "l"), "--join", worker]) == 0
    out = capsys.readouterr().out
    assert "Gloo" not in out and "peer ranks" not in out and "[rank 1] step 1 done" in out
    assert chatter.format(1) in (tmp_path / "l" / "worker_1.log").read_text()


def _terminated(tmp_path, worker: str, *flags: str) -> tuple[int, str]:
    """`jshard launch` of 2 `worker`s (with `flags`), sent SIGTERM once both wrote their `ready<rank>`
    file: its exit status and stderr."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launcher = subprocess.Popen([sys.executable, "-m", "jshard", "launch", "--worker-num", "2", *flags, worker],
                                env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    return launcher.returncode, err


def test_sigterm_to_the_launcher_reaches_the_workers(tmp_path):
    ready = tmp_path / "ready"
    worker = script(tmp_path, f"signal.signal(signal.SIGTERM, lambda *a: (print('worker', rank, 'got SIGTERM', "
                              f"flush=True), sys.exit(7)))\nopen(r'{ready}' + str(rank), 'w').close()\n"
                              "time.sleep(120)\n")
    status, err = _terminated(tmp_path, worker, "--log-dir", str(tmp_path / "l"))
    assert status == 143, err
    assert "got SIGTERM; forwarding it to the workers" in err
    assert "stopped by SIGTERM sent to the launcher (forwarded to the workers): rank 0 exited with status 7" in err
    for rank in (0, 1):
        assert f"worker {rank} got SIGTERM" in (tmp_path / "l" / f"worker_{rank}.log").read_text()


def test_workers_of_a_launcher_killed_with_sigkill_end_themselves(tmp_path):
    pid_file = tmp_path / "pid"
    worker = script(tmp_path, f"import jshard\njshard.init()\nopen(r'{pid_file}', 'w').write(str(os.getpid()))\n"
                              "time.sleep(120)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launcher = subprocess.Popen([sys.executable, "-m", "jshard", "launch", "--worker-num", "1", "--log-dir",
                                 str(tmp_path / "l"), worker], env=env)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    worker_pid = int(pid_file.read_text())
    launcher.kill()
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker_pid), "the worker outlived its launcher"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_worker_ignoring_sigterm_is_killed_after_the_time_out(tmp_path, capsys):
    worker = script(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                              "if rank == 0:\n    sys.exit(5)\ntime.sleep(120)\n")
    start = time.monotonic()
    assert main(["launch", "--worker-num", "2", "--cluster-time-out", "2", "--log-dir", str(tmp_path / "l"),
                 worker]) == 5
    assert time.monotonic() - start < 15
    assert "stopping the other 1 worker(s) on this node: ranks 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--worker-num", "3", "--local-worker-num", "2", "w.py"], "--worker-num 3 is not a multiple of --local-worker-num 2"),
        (["--worker-num", "4", "--local-worker-num", "2", "--node-rank", "2", "--master-port", "1", "w.py"],
         "--node-rank 2 with 2 node(s) (4 / 2); ranks run 0..1"),
        (["--worker-num", "4", "--local-worker-num", "2", "w.py"], "2 nodes need one --master-port"),
        (["--worker-num", "2"], "no COMMAND"),
        (["--worker-num", "0", "w.py"], "must be positive"),
        (["--devices-per-worker", "0", "w.py"], "--devices-per-worker must be positive"),
    ],
    ids=["not-a-multiple", "node-rank", "no-port", "no-command", "no-workers", "no-devices"],
)
def test_bad_arguments_exit_2_with_the_reason(args, message, capsys):
    assert main(["launch", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_command_that_cannot_start_exits_127(tmp_path, capsys):
    assert main(["launch", "--worker-num", "2", "--", str(tmp_path / "no-such-program")]) == 127
    assert "error: cannot start" in capsys.readouterr().err


def test_a_coordinator_port_in_use_is_refused(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["launch", "--worker-num", "2", "--master-port", str(port), script(tmp_path, "")]) == 2
    assert f"the coordinator port 127.0.0.1:{port} is already in use; choose another --master-port" in \
        capsys.readouterr().err


def test_launch_help_documents_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    out = capsys.readouterr().out
    for option in ("--worker-num", "--local-worker-num", "--master-addr", "--master-port", "--node-rank",
                   "--log-dir", "--join", "--cluster-time-out", "--devices-per-worker", "Exit status"):
        assert option in out


# `jshard k8s`


def test_k8s_prints_an_indexed_job_and_a_headless_service_wired_for_init(capsys):
    assert main(["k8s", "--worker-num", "4", "--image", "me/train:1", "--name", "gpt", "--port", "9000",
                 "--gpus-per-worker", "8", "--", "python", "train.py", "--steps", "100"]) == 0
    service, job = yaml.safe_load_all(capsys.readouterr().out)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": "gpt"}
    assert service["spec"]["ports"][0]["port"] == 9000
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "gpt" and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] == "me/train:1"
    assert container["command"] == ["python", "train.py", "--steps", "100"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e for e in container["env"]}
    assert env["JSHARD_COORDINATOR"]["value"] == "gpt-0.gpt:9000"  # pod 0 of the Job, through the Service
    assert env["JSHARD_NUM_PROCESSES"]["value"] == "4"
    assert env["JSHARD_HANG_TIMEOUT"]["value"] == "600"  # jshard.init's watchdog, as under jshard launch
    assert env["JSHARD_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--worker-num", "0", "--image", "i", "--", "python"], "--worker-num must be positive"),
        (["--worker-num", "2", "--image", "i"], "no COMMAND"),
        (["--worker-num", "2", "--image", "i", "--name", "Bad_Name", "--", "python"], "must be a DNS label"),
        (["--worker-num", "2", "--image", "i", "--hang-timeout", "-1", "--", "python"], "--hang-timeout must be 0"),
    ],
    ids=["no-workers", "no-command", "bad-name", "bad-hang-timeout"],
)
def test_k8s_bad_arguments(args, message, capsys):
    assert main(["k8s", *args]) == 2
    assert message in capsys.readouterr().err


# The hang watchdog, signals to the launcher, the coordinator's bind address.


def fake_jax(tmp_path) -> str:
    """A module under a `jax/_src/` directory, so the watchdog takes its frames for JAX's: `collective()`
    blocks as a collective waiting for a peer does; `compile(s)` stands for an XLA compile."""
    src = tmp_path / "fake" / "jax" / "_src"
    src.mkdir(parents=True)
    (src / "dispatch.py").write_text("import time\ndef collective():\n    time.sleep(120)\n")
    (src / "compiler.py").write_text("import time\ndef compile(s):\n    time.sleep(s)\n")
    return f"sys.path.insert(0, r'{src}')\nimport dispatch, compiler\n"


def test_a_hung_rank_is_named_its_stacks_dumped_and_the_job_ended(tmp_path, capsys):
    """Rank 1 sleeps in its own code while rank 0, after two steps, waits inside a JAX call: the job
    ends with status 124 soon after --hang-timeout, naming rank 1, with every rank's stack in its log."""
    worker = script(tmp_path, fake_jax(tmp_path) + f"open(r'{tmp_path}/pid' + str(rank), 'w').write(str(os.getpid()))\n"
                    "if rank == 1:\n    time.sleep(120)\n"
                    "for step in range(2):\n    print('step', step, flush=True)\n    time.sleep(0.3)\n"
                    "dispatch.collective()\n")
    logs = tmp_path / "l"
    start = time.monotonic()
    assert main(["launch", "--worker-num", "2", "--hang-timeout", "2", "--cluster-time-out", "2",
                 "--log-dir", str(logs), worker]) == 124
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err
    assert "the job is hung: rank 1 did not arrive: its main thread has made no progress for" in err
    assert f"{worker}:7 in <module>, not in a JAX call" in err
    assert "rank 0 for " in err and f"waiting inside a JAX call at {worker}:11 in <module>" in err
    assert "exit status 124 (rank 1 made no progress)" in err
    for rank, line in ((0, 'in collective'), (1, f'File "{worker}", line 7 in <module>')):
        log = (logs / f"worker_{rank}.log").read_text()
        assert "most recent call first" in log and line in log, log
        assert not _alive(int((tmp_path / f"pid{rank}").read_text()))


def test_a_rank_compiling_gets_the_compile_allowance(tmp_path, capsys):
    """Rank 1 waits 1.5 s (past --hang-timeout 1) in its own code while rank 0 compiles for 4 s:
    within the compile allowance, nobody is hung. Rank 1 starts waiting once rank 0 is about to
    compile (a file says so; it spins until then, which the watchdog sees as progress), so a slow
    process start on a loaded machine does not count."""
    flag = tmp_path / "compiling"
    worker = script(tmp_path, fake_jax(tmp_path) + f"if rank == 0:\n    open(r'{flag}', 'w').close()\n"
                    "    compiler.compile(4)\n"
                    f"else:\n    while not os.path.exists(r'{flag}'):  # spinning: its stack moves, it is no hang\n"
                    "        pass\n"
                    "    time.sleep(1.5)\nprint('done', rank)\n")
    assert main(["launch", "--worker-num", "2", "--hang-timeout", "1", "--compile-timeout", "30",
                 worker]) == 0
    assert "[rank 0] done 0" in capsys.readouterr().out


def test_a_peer_timing_out_names_the_rank_that_never_came(tmp_path, capsys):
    """Rank 0 fails on gloo's connect deadline (as when a peer never reaches the first collective);
    rank 1, stuck in its own code, is named as the cause, not rank 0."""
    worker = script(tmp_path, "if rank == 1:\n    time.sleep(120)\ntime.sleep(1.5)\n"
                    "raise RuntimeError('Gloo context initialization failed: Timed out waiting for peer 1')\n")
    start = time.monotonic()
    assert main(["launch", "--worker-num", "2", "--cluster-time-out", "2", "--log-dir", str(tmp_path / "l"),
                 worker]) == 124
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err
    assert "rank 0 failed waiting for a peer (RuntimeError: Gloo context" in err
    assert "rank 1 did not arrive" in err and "exit status 124 (rank 1 made no progress)" in err


def test_the_hang_analysis_waits_for_compiles_and_says_when_the_culprit_is_elsewhere():
    from jshard._hang import find_hang, hang_report

    waiting = {"since": 0.0, "inside": "jax", "compiling": False, "where": "jax/_src/array.py:1 in _value",
               "user": "train.py:9 in <module>"}
    compiling = {**waiting, "since": 5.0, "compiling": True}
    assert find_hang({0: waiting, 1: compiling}, 20.0, 10.0, 60.0) is None  # rank 1 compiles: wait for it
    assert find_hang({0: waiting, 1: compiling}, 70.0, 10.0, 60.0) == 1  # past its allowance: it is the one
    assert find_hang({0: waiting, 1: {**waiting, "since": 2.0}}, 9.0, 10.0, 60.0) is None
    report = hang_report(0, {0: waiting, 1: {**waiting, "since": 2.0}}, 12.0, 10.0, [], other_nodes=True)
    assert "every rank here waits inside a JAX call, rank 0 longest" in report
    assert "The rank that did not arrive is most likely on another node (see its launcher's report)" in report
    alone = hang_report(0, {0: waiting, 1: {**waiting, "since": 2.0}}, 12.0, 10.0, [])
    assert "No rank is stuck in its own code: the ranks most likely entered different collectives" in alone


def test_init_s_watchdog_ends_a_stuck_process_without_a_launcher(tmp_path):
    program = "import time, jshard\njshard.init(hang_timeout=1)\ntime.sleep(60)\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JSHARD_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 124, done.stderr
    assert "jshard: process 0 made no progress for" in done.stderr
    assert "in its own code at <string>:3 in <module>" in done.stderr and "most recent call first" in done.stderr


def test_sigterm_to_the_launcher_is_named_not_blamed_on_a_worker(tmp_path):
    """Workers that catch SIGTERM and go on (as JAX's runtime does) are SIGKILLed after the grace; the
    launcher reports the SIGTERM it got and exits 143, naming no worker as the failure."""
    ready = tmp_path / "ready"
    worker = script(tmp_path, f"signal.signal(signal.SIGTERM, lambda *a: None)\nopen(r'{ready}' + str(rank), 'w')\n"
                              "while True:\n    time.sleep(0.05)\n")
    status, err = _terminated(tmp_path, worker, "--cluster-time-out", "1")
    assert status == 143, err
    assert "stopped by SIGTERM sent to the launcher (forwarded to the workers): rank 0 was killed by SIGKILL" in err
    assert "exit status 143 (SIGTERM)" in err and "rank 0 was killed by SIGKILL (log" not in err


@pytest.mark.parametrize("address, bound", [("10.1.2.3:8118", "10.1.2.3:8118"), ("localhost:9000", "127.0.0.1:9000"),
                                            ("[::1]:9000", "[::1]:9000")], ids=["ip", "name", "ipv6"])
def test_the_coordinator_listens_on_the_address_given_only(address, bound, monkeypatch):
    from jshard import _distributed

    seen = {}
    monkeypatch.setattr(_distributed.jax.distributed, "initialize", lambda *a, **k: seen.update(k))
    monkeypatch.setattr(_distributed, "install_excepthook", lambda: None)
    monkeypatch.setattr(_distributed, "share_progress", lambda: None)
    monkeypatch.setattr(_distributed, "_gloo_on_loopback", lambda host: None)
    _distributed._join(address, 2, 0, 5)
    assert seen["coordinator_bind_address"] == bound


def test_a_pod_s_own_name_binds_its_own_address_before_its_dns_record_exists(monkeypatch):
    from jshard import _distributed

    monkeypatch.setattr(_distributed.socket, "gethostname", lambda: "localhost")
    assert _distributed._bind_address("localhost.no-such-service.invalid:8118") == "127.0.0.1:8118"
    with pytest.raises(js.ShardingError, match=r"cannot resolve the coordinator host 'node-7\.invalid' to listen"):
        _distributed._bind_address("node-7.invalid:8118")
