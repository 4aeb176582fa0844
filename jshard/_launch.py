"""`jshard launch`: starts a job's workers on this node (MindSpore `msrun`'s counterpart).

Each worker is the user's command with the environment `jshard.init()` reads (`JSHARD_COORDINATOR`,
`JSHARD_NUM_PROCESSES`, `JSHARD_PROCESS_ID`, and `JSHARD_LOCAL_DEVICES` with
`--devices-per-worker`). Node `--node-rank r` runs global ranks `r * local .. r * local + local - 1`;
node 0's first worker hosts the coordination service on `--master-addr:--master-port`.

The launcher keeps every worker's output (one log per worker under `--log-dir`, streamed with
`--join`), forwards SIGINT and SIGTERM to the workers, and watches them: when one exits non-zero it
reports the rank, its exit status and either its exception (the failure record `jshard._worker`
writes: a Python script runs through `jshard/_worker.py`, so an exception or a non-zero `sys.exit`
ends the worker at once instead of hanging in JAX's shutdown barrier) or its last log lines, stops
the others (SIGTERM, then SIGKILL after `--cluster-time-out` or `STOP_GRACE` seconds, whichever is
shorter) and exits with that first failing status. Where several workers fail at once (the others
of a job often fail *because* one did), the cause is the one reported: a worker whose exception says
a peer went away (`PEER_LOST`: gloo's connection reset, a coordination-service heartbeat) is a
consequence, so a worker that failed on its own (killed by a signal, or another exception) is named
before it, whichever the launcher saw first; among causes, the earliest. A consequence seen alone
waits up to `CAUSE_WAIT` seconds for its cause to show; where none shows, a rank stuck in its own code
(its progress record, below) is named as the one the others waited for.

The hang watchdog: every Python worker writes a progress record (`jshard._worker.watch_progress`),
and a job where a rank has made no progress for `--hang-timeout` seconds (default 600, NCCL's; a
rank inside an XLA compile gets `--compile-timeout`, default 1800) is ended: every worker dumps its
threads' Python stacks to its log (faulthandler, on SIGUSR1), the launcher reports the rank that did
not arrive and where each waits (`jshard._hang`), stops them all and exits with `HANG_STATUS` (124).

A SIGINT or SIGTERM to the launcher (how a scheduler stops a job) is forwarded to the workers, who
get `STOP_GRACE` seconds before SIGKILL; the launcher then reports the signal it got, how each worker
ended, and exits with 128 + that signal (130, 143), blaming no worker.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from jshard._distributed import (
    COORDINATOR,
    INIT_TIMEOUT,
    LAUNCHER_PID,
    LOCAL_DEVICES,
    NUM_PROCESSES,
    PROCESS_ID,
)
from jshard._hang import find_hang, hang_report
from jshard._worker import (
    COMPILE_TIMEOUT,
    DEFAULT_COMPILE_TIMEOUT,
    DEFAULT_HANG_TIMEOUT,
    FAILURE_DIR,
    HANG_STATUS,
    HANG_TIMEOUT,
    WRAPPER,
    failure_path,
    interval,
    progress_path,
    read_failure,
    read_progress,
)

TAIL_LINES = 20
STOP_GRACE = 5.0
"""Seconds (at most; `--cluster-time-out` if shorter) a worker gets to exit after SIGTERM before
SIGKILL. JAX's distributed runtime catches SIGTERM (its preemption notice), so a worker blocked in a
collective may never exit on SIGTERM alone."""
GLOO_CHATTER = re.compile(r"\[Gloo\] Rank \d+| is connected to \d+ peer ranks\. Expected number of connected "
                          r"peer ranks is : \d+")
"""What gloo prints to stdout (std::cout, no setting silences it) each time a worker connects to its
peers; two workers' threads may interleave it mid-line. Kept in the worker logs, left out of the
`--join` stream and the failure report."""
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Connection refused|Broken pipe|[Ss]ocket closed|"
                       r"heartbeat|[Cc]oordination service|[Tt]imed out|DEADLINE_EXCEEDED|remote process exited",
                       re.S)
"""What a worker's exception says when it failed because another worker went away, or did not come
(gloo's connect deadline, a barrier's time-out)."""
STACK_WAIT = 1.0
"""Seconds the launcher gives hung workers to dump their stacks (faulthandler) before it stops them."""
CAUSE_WAIT = 1.0
"""Seconds the launcher waits, when every failed worker failed because a peer went away, for the
worker that went away to show (it may exit a moment later than the peer that noticed it)."""
LAUNCH_DESCRIPTION = """\
Starts --local-worker-num workers of a --worker-num job on this node, each running COMMAND with the
environment jshard.init() reads. COMMAND is a script (`train.py args`, run with this Python) or any
command after `--`. One node:
  python -m jshard launch --worker-num 2 --devices-per-worker 4 --log-dir logs train.py
Two nodes (run on each, with its --node-rank):
  python -m jshard launch --worker-num 4 --local-worker-num 2 --master-addr 10.0.0.1 \\
      --master-port 8118 --node-rank 0 -- python train.py
Exit status: 0 when every worker exits 0; otherwise the first failing worker's status (128 + signal
for a worker killed by a signal); 124 when a rank made no progress for --hang-timeout (the report
names it; every worker's Python stack is in its log); 128 + signal when the launcher itself got
SIGINT or SIGTERM (forwarded to the workers); 2 for bad arguments or a coordinator port already in use.
"""


def launch_parser(sub) -> None:
    """Adds the `launch` subcommand to the `jshard` command line's subparsers."""
    p = sub.add_parser("launch", help="start a multi-process job's workers on this node (msrun)",
                       description=LAUNCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker-num", type=int, default=1, help="processes in the whole job (default 1)")
    p.add_argument("--local-worker-num", type=int, default=None,
                   help="processes on this node (default --worker-num: one node)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="coordinator port on node 0 (default: a free port, one node only)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--log-dir", default=None,
                   help="write worker_<rank>.log per worker and launcher.log here (default: stream to stdout)")
    p.add_argument("--join", action="store_true", help="also stream the workers' logs to stdout, prefixed by rank")
    p.add_argument("--cluster-time-out", type=float, default=300.0,
                   help="seconds for the job to form, and for the others to stop once one fails (default 300)")
    p.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT,
                   help="seconds a rank may make no progress before the job is ended (default 600; 0: never)")
    p.add_argument("--compile-timeout", type=float, default=DEFAULT_COMPILE_TIMEOUT,
                   help="seconds a rank may spend in one XLA compile (default 1800)")
    p.add_argument("--devices-per-worker", type=int, default=None,
                   help="simulated CPU devices per worker (rehearse a cluster on a laptop)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="script.py [args], or -- program [args]")


def run_launch(args: argparse.Namespace) -> int:
    """The `launch` subcommand: checks the arguments, runs the workers, returns the exit status."""
    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    local = args.worker_num if args.local_worker_num is None else args.local_worker_num
    problem = _check(args, command, local)
    if problem:
        print(f"jshard launch: error: {problem}", file=sys.stderr)
        return 2
    port = args.master_port if args.master_port is not None else _free_port(args.master_addr)
    if args.node_rank == 0 and not _port_free(args.master_addr, port):
        print(f"jshard launch: error: the coordinator port {args.master_addr}:{port} is already in use; "
              "choose another --master-port.", file=sys.stderr)
        return 2
    job = _Job(args, command, local, f"{args.master_addr}:{port}")
    return job.run()


def worker_command(command: Sequence[str]) -> list[str]:
    """The command each worker runs: a Python script (`train.py args` with this Python, `python
    train.py args`, `python -m module args`) through `jshard._worker.run`, so that its failure ends it
    at once with a failure record; any other program as given."""
    command = list(command)
    if command[0].endswith(".py"):
        return [sys.executable, WRAPPER, *command]
    python = os.path.basename(command[0]).startswith("python")
    if python and len(command) > 1 and (command[1].endswith(".py") or command[1] == "-m" and len(command) > 2):
        return [command[0], WRAPPER, *command[1:]]
    return command


def _check(args, command, local) -> str:
    if not command:
        return "no COMMAND: give a script (train.py args) or `-- program args`."
    if args.worker_num < 1 or local < 1:
        return f"--worker-num ({args.worker_num}) and --local-worker-num ({local}) must be positive."
    if args.worker_num % local:
        return (f"--worker-num {args.worker_num} is not a multiple of --local-worker-num {local}; every node "
                "runs the same number of workers.")
    nodes = args.worker_num // local
    if not 0 <= args.node_rank < nodes:
        return f"--node-rank {args.node_rank} with {nodes} node(s) ({args.worker_num} / {local}); ranks run 0..{nodes - 1}."
    if nodes > 1 and args.master_port is None:
        return f"{nodes} nodes need one --master-port that every node is given."
    if args.devices_per_worker is not None and args.devices_per_worker < 1:
        return f"--devices-per-worker must be positive, got {args.devices_per_worker}."
    if args.cluster_time_out <= 0:
        return f"--cluster-time-out must be positive, got {args.cluster_time_out}."
    if args.hang_timeout < 0 or args.compile_timeout <= 0:
        return (f"--hang-timeout ({args.hang_timeout:g}) must be 0 (no watchdog) or positive, and --compile-timeout "
                f"({args.compile_timeout:g}) positive.")
    return ""


def _free_port(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    """Whether node 0 can bind its coordinator port (where `host` is not this machine's, say yes
    and let `jshard.init()` report it)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: only a listener blocks it
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno not in (98, 48)  # EADDRINUSE (Linux, macOS)
    return True


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _Worker:
    """One worker process, its rank, its log and the last lines it wrote."""

    def __init__(self, rank: int, proc: subprocess.Popen, log: Path | None):
        self.rank, self.proc, self.log = rank, proc, log
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.reader: threading.Thread | None = None
        self.ended: float | None = None  # when the launcher first saw it exit (time.time())


class _Job:
    """The workers of one node, watched until they all exit or one fails."""

    def __init__(self, args, command: Sequence[str], local: int, coordinator: str):
        self.args, self.command, self.local, self.coordinator = args, list(command), local, coordinator
        self.log_dir = Path(args.log_dir) if args.log_dir else None
        self.stream = args.join or self.log_dir is None
        self.lock = threading.Lock()
        self.launcher_log: TextIO | None = None
        self.workers: list[_Worker] = []
        self.kill_at: float | None = None  # after a forwarded signal: when to SIGKILL the rest
        self.signalled: int | None = None  # the first SIGINT / SIGTERM the launcher got
        self.next_look = 0.0  # when to read the progress records next (time.monotonic())
        self.failures = self.log_dir  # where workers write failure records (a temporary directory without a log dir)

    def say(self, text: str) -> None:
        """A message to stderr, and to launcher.log stamped with the time (UTC, to the millisecond)."""
        line = f"jshard launch: {text}"
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}"
        with self.lock:
            print(line, file=sys.stderr, flush=True)
            if self.launcher_log is not None:
                self.launcher_log.write(f"{stamp} {line}\n")
                self.launcher_log.flush()

    def run(self) -> int:
        if self.log_dir is None:
            with tempfile.TemporaryDirectory(prefix="jshard-launch-") as failures:
                self.failures = Path(failures)
                return self._run()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.launcher_log = open(self.log_dir / "launcher.log", "a")
        return self._run()

    def _run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            first = self.args.node_rank * self.local
            self.say(f"node {self.args.node_rank}: ranks {first}..{first + self.local - 1} of {self.args.worker_num}, "
                     f"coordinator {self.coordinator}, command: {' '.join(self.command)}")
            try:
                for rank in range(first, first + self.local):
                    self.workers.append(self._start(rank))
            except OSError as e:
                self.say(f"error: cannot start {self.command[0]!r}: {e.strerror}")
                _stop(self.workers, 0)
                return 127
            return self._watch()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for w in self.workers:
                if w.reader is not None:
                    w.reader.join(timeout=5)
            if self.launcher_log is not None:
                self.launcher_log.close()

    def _env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({COORDINATOR: self.coordinator, NUM_PROCESSES: str(self.args.worker_num),
                    PROCESS_ID: str(rank), INIT_TIMEOUT: f"{self.args.cluster_time_out:g}",
                    LAUNCHER_PID: str(os.getpid()), FAILURE_DIR: str(self.failures), "PYTHONUNBUFFERED": "1"})
        if self.args.devices_per_worker is not None:
            env[LOCAL_DEVICES] = str(self.args.devices_per_worker)
        if self.args.hang_timeout > 0:
            env.update({HANG_TIMEOUT: f"{self.args.hang_timeout:g}", COMPILE_TIMEOUT: f"{self.args.compile_timeout:g}"})
        return env

    def _start(self, rank: int) -> _Worker:
        log = self.log_dir / f"worker_{rank}.log" if self.log_dir is not None else None
        assert self.failures is not None  # set by run() (the log dir, or a temporary directory) before any worker
        failure_path(self.failures, rank).unlink(missing_ok=True)  # a previous run's, in the same log dir
        progress_path(self.failures, rank).unlink(missing_ok=True)
        proc = subprocess.Popen(worker_command(self.command), env=self._env(rank), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        worker = _Worker(rank, proc, log)
        worker.reader = threading.Thread(target=self._pump, args=(worker,), daemon=True)
        worker.reader.start()
        return worker

    def _pump(self, worker: _Worker) -> None:
        """Copies a worker's output to its log (and stdout with --join), keeping its last lines."""
        sink = open(worker.log, "w") if worker.log is not None else None
        assert worker.proc.stdout is not None  # started with stdout=PIPE
        try:
            for raw in worker.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                if sink is not None:
                    sink.write(line + "\n")
                    sink.flush()
                line = _without_chatter(line)
                if line is None:
                    continue
                worker.tail.append(line)
                if self.stream:
                    with self.lock:
                        print(f"[rank {worker.rank}] {line}", flush=True)
        finally:
            worker.proc.stdout.close()
            if sink is not None:
                sink.close()

    def _forward(self, signum, frame) -> None:
        grace = min(self.args.cluster_time_out, STOP_GRACE)
        self.say(f"got {signal.Signals(signum).name}; forwarding it to the workers (SIGKILL for those still "
                 f"running in {grace:g} s)")
        if self.kill_at is None:
            self.kill_at = time.monotonic() + grace
            self.signalled = signum
        for w in self.workers:
            _signal(w.proc, signum)

    def _watch(self) -> int:
        """Polls the workers; on the first failure reports its cause and stops the rest."""
        wait_cause = None  # when a failure whose peer went away stops waiting for that peer
        while True:
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                for w in self.workers:
                    _signal(w.proc, signal.SIGKILL)
            running = [w for w in self.workers if w.proc.poll() is None]
            for w in self.workers:
                if w.ended is None and w.proc.returncode is not None:
                    w.ended = time.time()
            if self.signalled is not None:
                if not running:
                    return self._signalled()
                time.sleep(0.05)
                continue
            hung = self._hung(running)
            if hung is not None:
                return self._end_hung(hung, running)
            failed = [w for w in self.workers if w.proc.returncode not in (None, 0)]
            causes = [w for w in failed if not self._peer_lost(w)]
            if failed and not causes and running and wait_cause is None:
                wait_cause = time.monotonic() + CAUSE_WAIT
            if causes or (failed and (not running or time.monotonic() > wait_cause)):
                stuck = self._stuck_in_own_code(running) if not causes else None
                if stuck is not None:
                    self.say(f"rank {min(failed, key=self._failed_at).rank} failed waiting for a peer "
                             f"({self._why(min(failed, key=self._failed_at))}); the peer is rank {stuck.rank}:")
                    return self._end_hung(stuck, running)
                return self._fail(min(causes or failed, key=self._failed_at), running)
            if not running:
                self.say(f"all {len(self.workers)} worker(s) on this node exited 0")
                return 0
            time.sleep(0.05)

    def _records(self, workers: list[_Worker]) -> dict[int, dict]:
        assert self.failures is not None  # set by run() (the log dir, or a temporary directory) before any worker
        records = {w.rank: read_progress(self.failures, w.rank) for w in workers}
        return {r: x for r, x in records.items() if x is not None}

    def _hung(self, running: list[_Worker]) -> _Worker | None:
        """The worker holding the job up, where a rank has made no progress for --hang-timeout."""
        if self.args.hang_timeout <= 0 or time.monotonic() < self.next_look:
            return None
        self.next_look = time.monotonic() + interval(self.args.hang_timeout)
        rank = find_hang(self._records(running), time.time(), self.args.hang_timeout, self.args.compile_timeout)
        return next((w for w in running if w.rank == rank), None)

    def _stuck_in_own_code(self, running: list[_Worker]) -> _Worker | None:
        """A running worker stuck in its own code (not in a JAX call) since before its peers failed."""
        records = self._records(running)
        stuck = [w for w in running if w.rank in records and records[w.rank].get("inside") == "user"
                 and time.time() - records[w.rank]["since"] > CAUSE_WAIT]
        return min(stuck, key=lambda w: records[w.rank]["since"]) if stuck else None

    def _end_hung(self, culprit: _Worker, running: list[_Worker]) -> int:
        """Dumps every worker's stacks into its log, reports the rank that did not arrive, stops the job."""
        records = self._records(running)
        for w in running:
            if w.rank in records:  # the Python process (the worker, or its child) that registered faulthandler
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(records[w.rank]["pid"], signal.SIGUSR1)
        time.sleep(STACK_WAIT)
        missing = [w.rank for w in running if w.rank not in records]
        other_nodes = self.args.worker_num > self.local
        self.say(hang_report(culprit.rank, records, time.time(), self.args.hang_timeout, missing, other_nodes)
                 + (f" Logs: {self.log_dir}." if self.log_dir is not None else ""))
        self.say(f"stopping the {len(running)} worker(s) on this node: ranks {', '.join(str(w.rank) for w in running)}")
        _stop(running, self.args.cluster_time_out)
        self.say(f"exit status {HANG_STATUS} (rank {culprit.rank} made no progress)")
        return HANG_STATUS

    def _signalled(self) -> int:
        """The report once every worker has ended after the launcher got a signal: no worker is blamed."""
        assert self.signalled is not None  # _run calls this only once a signal was forwarded
        name = signal.Signals(self.signalled).name
        ends = [f"rank {w.rank} {_ending(w.proc.returncode)}" for w in self.workers]
        self.say(f"stopped by {name} sent to the launcher (forwarded to the workers): {', '.join(ends)}. "
                 f"exit status {128 + self.signalled} ({name})")
        return 128 + self.signalled

    def _peer_lost(self, worker: _Worker) -> bool:
        """Whether `worker` failed because another worker went away (its exception says so)."""
        record = read_failure(self.failures, worker.rank)
        return record is not None and PEER_LOST.search(f"{record['type']}: {record['message']}") is not None

    def _why(self, worker: _Worker) -> str:
        """A worker's failure in a few words: its exception's type and message, else its exit status."""
        record = read_failure(self.failures, worker.rank)
        if record is not None and record["type"] != "SystemExit":
            return f"{record['type']}: {record['message'][:160]}"
        return f"exit status {_status(worker.proc.returncode)}"

    def _failed_at(self, worker: _Worker) -> float:
        """When a worker failed: its failure record's time, else when the launcher saw it exit."""
        record = read_failure(self.failures, worker.rank)
        return record["time"] if record else worker.ended

    def _fail(self, failed: _Worker, running: list[_Worker]) -> int:
        status = _status(failed.proc.returncode)
        code = failed.proc.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        where = f" (log: {failed.log})" if failed.log is not None else ""
        if failed.reader is not None:
            failed.reader.join(timeout=2)
        record = read_failure(self.failures, failed.rank)
        if record is not None and record["type"] != "SystemExit":
            lines = "\n".join(f"  | {line}" for line in record["lines"])
            self.say(f"rank {failed.rank} raised {record['type']}: {record['message']} and {how}{where}; "
                     f"its traceback's last lines:\n{lines}")
        else:
            how += f" ({record['message']})" if record is not None else ""
            lines = "\n".join(f"  | {line}" for line in failed.tail) or "  | (no output)"
            self.say(f"rank {failed.rank} {how}{where}; its last {len(failed.tail)} log line(s):\n{lines}")
        if any("RegisterTask" in line or "could not form the job" in line for line in failed.tail):
            self.say(f"the job did not form within --cluster-time-out {self.args.cluster_time_out:g} s: not all "
                     f"--worker-num {self.args.worker_num} processes reached the coordinator {self.coordinator}. "
                     "Start every node (jshard launch with the same --worker-num, --master-addr and --master-port, "
                     "each with its --node-rank), and check that node 0 is reachable.")
        after = [w for w in self.workers if w is not failed and w not in running and w.proc.returncode not in (None, 0)]
        if after:  # failed too, most likely because `failed` did (a peer gone)
            self.say(f"also failed on this node (after rank {failed.rank}, a consequence where a peer went away): "
                     + ", ".join(f"rank {w.rank} ({self._why(w)})" for w in after))
        if running:
            self.say(f"stopping the other {len(running)} worker(s) on this node: ranks "
                     f"{', '.join(str(w.rank) for w in running)}")
            _stop(running, self.args.cluster_time_out)
        self.say(f"exit status {status} (rank {failed.rank})")
        return status


def _without_chatter(line: str) -> str | None:
    """`line` less gloo's connection messages (`GLOO_CHATTER`); None where nothing else is left."""
    rest = GLOO_CHATTER.sub("", line)
    if rest == line:
        return line
    return rest if rest.strip() else None


def _signal(proc: subprocess.Popen, signum: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            return


def _stop(workers: list[_Worker], grace: float) -> None:
    """SIGTERM, then SIGKILL for whoever is still there after `grace` seconds (at most `STOP_GRACE`)."""
    for w in workers:
        _signal(w.proc, signal.SIGTERM)
    deadline = time.monotonic() + min(grace, STOP_GRACE)
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        time.sleep(0.05)
    for w in workers:
        _signal(w.proc, signal.SIGKILL)
        w.proc.wait()


def _ending(returncode: int) -> str:
    """How a worker ended, in words."""
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return "exited 0" if returncode == 0 else f"exited with status {returncode}"


def _status(returncode: int) -> int:
    """A worker's exit status as a shell reports it: 128 + the signal for a killed worker."""
    return 128 - returncode if returncode < 0 else returncode
