"""What runs around a `jshard launch` worker: a failure ends the process at once and says why.

A Python process that has joined a JAX distributed job does not end when its script raises: the
interpreter's exit destroys JAX's distributed client, whose shutdown barrier waits (up to 300 s)
for every other process, which are themselves blocked in a collective waiting for this one. So an
exception on one rank used to hang the whole job for minutes and surface as another rank's SIGABRT.

Here a failure instead prints its traceback, writes a *failure record* (`failure_<rank>.json`:
rank, exception type and message, the traceback's last lines, exit status, time) to the directory
`JSHARD_FAILURE_DIR` names, and ends the process with `os._exit`, skipping the barrier. The launcher
reads the record to name the failing rank and its exception, and stops the others.

Two ways in: `jshard launch` runs a Python script (`train.py`, `python train.py`, `python -m pkg`)
through this file (`python .../jshard/_worker.py script.py args`: it imports the standard library only,
so it runs under any interpreter), which catches every exception and every non-zero `sys.exit`;
and `jshard.init()`, in a job of several processes, installs `excepthook` for any other Python
command. A script that ends normally (status 0) leaves through JAX's shutdown as before.

Where `JSHARD_HANG_TIMEOUT` is set (the launcher's `--hang-timeout`, or `jshard.init(hang_timeout=)`),
`watch_progress` also starts the hang watchdog's eyes: a thread that looks at the main thread's Python
stack every `interval(timeout)` seconds and writes a *progress record* (`progress_<rank>.json`: since
when the stack has not changed, where it stands, whether it is inside a JAX call or compiling) beside
the failure records; and `faulthandler` dumps every thread's stack to the log on SIGUSR1, which the
launcher sends before it stops a hung job. A main thread blocked anywhere (a collective waiting for a
peer, a `time.sleep`, a read from a dead file system) keeps the very same frames; a running loop does
not. Without a launcher the thread itself ends the process once it has made no progress for the
timeout (`HANG_STATUS`, after dumping its stacks), as NCCL's watchdog ends a rank whose collective
does not finish.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # run as `python .../jshard/_worker.py`: Python put jshard/ first on sys.path,
    del sys.path[0]  # where its modules could shadow the standard library's for the imports below

import contextlib
import faulthandler
import json
import os
import runpy
import signal
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

FAILURE_DIR = "JSHARD_FAILURE_DIR"
HANG_TIMEOUT, COMPILE_TIMEOUT = "JSHARD_HANG_TIMEOUT", "JSHARD_COMPILE_TIMEOUT"
DEFAULT_HANG_TIMEOUT = 600.0
"""Seconds without progress that end a job (NCCL's watchdog default, 10 minutes)."""
DEFAULT_COMPILE_TIMEOUT = 1800.0
"""Seconds a process may spend in one XLA compile (its main thread inside JAX's compiler) before it
counts as hung: compiles of large programs take minutes."""
HANG_STATUS = 124
"""The exit status of a job (or, without a launcher, a process) ended for making no progress."""
WRAPPER = os.path.abspath(__file__)
"""This file, which `python WRAPPER script.py args` runs as `run(["script.py", "args"])`."""
RECORD_LINES = 12
"""How many of the traceback's last lines a failure record keeps."""


def failure_path(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank `rank` writes its failure record in `directory`."""
    return Path(directory) / f"failure_{rank}.json"


def progress_path(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank `rank` writes its progress record in `directory`."""
    return Path(directory) / f"progress_{rank}.json"


def read_progress(directory: str | os.PathLike, rank: int) -> dict | None:
    """Rank `rank`'s latest progress record, or None where it wrote none."""
    try:
        return json.loads(progress_path(directory, rank).read_text())
    except (OSError, ValueError):
        return None


def interval(timeout: float) -> float:
    """How often (seconds) the progress of a job with hang timeout `timeout` is looked at."""
    return min(1.0, max(0.05, timeout / 20))


def read_failure(directory: str | os.PathLike, rank: int) -> dict | None:
    """Rank `rank`'s failure record, or None where it wrote none (or a torn one)."""
    try:
        return json.loads(failure_path(directory, rank).read_text())
    except (OSError, ValueError):
        return None


def fail(exc: BaseException, status: int) -> None:
    """Prints `exc`'s traceback (less this module's and runpy's frames), writes the failure record
    and ends the process with `status` at once, without JAX's shutdown barrier.

    Where another thread is already ending the process (the hang watchdog, waiting for its peers),
    this one only prints: that thread's status stands. Where a peer's hang watchdog has ended it,
    `exc` (a collective whose peer left) follows from the hang, and the status is `HANG_STATUS`."""
    lines = _traceback_lines(exc)
    if not _ENDING.acquire(blocking=False):
        _write_out("".join(lines))
        while True:  # the thread ending the process exits it
            time.sleep(60)
    if status != HANG_STATUS and (ended := sorted(_shared(_ENDED))):
        status = HANG_STATUS
        lines.append(f"jshard: process {_WATCH.rank if _WATCH else '?'} ends with status {HANG_STATUS}: its error "
                     f"follows the hang that ended process(es) {', '.join(map(str, ended))}, whose report names "
                     "the rank that did not arrive.\n")
    try:
        _write_out("".join(lines))
        _write_record(exc, status, lines)
    finally:
        if status == HANG_STATUS and _WATCH is not None:
            _WATCH.leave()
        os._exit(status)


def _write_out(text: str) -> None:
    """Writes `text` to stderr and flushes both streams; a closed or broken stream is passed over."""
    with contextlib.suppress(Exception):
        sys.stderr.write(text)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def excepthook(kind, exc, tb) -> None:
    """`sys.excepthook` for a process in a job: an uncaught exception ends it at once (status 1)."""
    fail(exc.with_traceback(tb), 1)


def install_excepthook() -> None:
    """Has an uncaught exception in the main thread end this process at once (`excepthook`)."""
    sys.excepthook = excepthook


def exit_status(exc: BaseException) -> int:
    """The status a process ending with `exc` exits with, as Python would report it."""
    if isinstance(exc, SystemExit):
        code = exc.code
        return 0 if code is None else code if isinstance(code, int) else 1
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


def run(argv: list[str]) -> None:
    """Runs `script.py args` or `-m module args` as `python` would, ending through `fail` on an
    exception or a non-zero `sys.exit`."""
    module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    sys.path.insert(0, "" if module else os.path.dirname(os.path.abspath(target)))  # as `python` puts it
    watch_progress()
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except BaseException as e:
        status = exit_status(e)
        if status == 0:
            raise
        if isinstance(e, SystemExit) and isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        fail(e, status)


def watch_progress(timeout: float | None = None, compile_timeout: float | None = None, *,
                   enforce: bool = False, rank: int | None = None, explain: Any = None) -> bool:
    """Starts the progress thread (module docstring) once per process; with `enforce` (no launcher)
    it also ends the process when it has made no progress for `timeout` seconds, and shares its
    progress with the job's other processes through JAX's coordination service (its key-value
    store), so that the report names the rank that did not arrive. The timeouts default to
    `JSHARD_HANG_TIMEOUT` / `JSHARD_COMPILE_TIMEOUT`; no timeout (or 0) starts nothing; `rank`
    defaults to `JSHARD_PROCESS_ID`; `explain(rank, peers, now, timeout, compile_timeout)` words the
    report on the job's processes (`jshard._hang.explain`, passed by `jshard.init`: this module
    imports the standard library only). Returns whether a thread runs."""
    if os.environ.get(_WATCHED) == str(os.getpid()):  # the wrapper (run as __main__) and jshard.init
        return True  # hold two copies of this module: one thread per process
    timeout = float(timeout if timeout is not None else os.environ.get(HANG_TIMEOUT) or 0)
    compile_timeout = float(compile_timeout if compile_timeout is not None
                            else os.environ.get(COMPILE_TIMEOUT) or DEFAULT_COMPILE_TIMEOUT)
    if timeout <= 0:
        return False
    os.environ[_WATCHED] = str(os.getpid())
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    main = threading.main_thread().ident
    assert main is not None  # the main thread has started: it is running this
    watcher = _ProgressWatch(main, timeout, compile_timeout, enforce,
                             int(os.environ.get("JSHARD_PROCESS_ID", "0")) if rank is None else rank, explain)
    if enforce:
        global _WATCH
        _WATCH = watcher
    threading.Thread(target=watcher.run, name="jshard-progress", daemon=True).start()
    return True


_WATCHED = "_JSHARD_PROGRESS_WATCHED"


class _ProgressWatch:
    """Looks at the main thread's stack; writes the progress record; without a launcher, enforces."""

    def __init__(self, main: int, timeout: float, compile_timeout: float, enforce: bool, rank: int, explain: Any):
        self.main, self.timeout, self.compile_timeout, self.enforce = main, timeout, compile_timeout, enforce
        self.explain = explain
        self.directory, self.rank = os.environ.get(FAILURE_DIR), rank
        self.last: tuple[FrameType, int, int] | None  # the main thread's frame, last instruction and line
        self.last, self.since, self.changes = None, time.time(), 0

    def run(self) -> None:
        while True:
            record = self.look()
            if self.directory:
                with contextlib.suppress(OSError):
                    _write_json(progress_path(self.directory, self.rank), record)
            if self.enforce:
                self.share(record)
                if stalled_for(record, record["time"], self.timeout, self.compile_timeout):
                    self.end(record)
            time.sleep(interval(self.timeout))

    def share(self, record: dict) -> None:
        _post(f"{_KEY}{self.rank}", json.dumps(record))

    def peers(self) -> dict[int, dict]:
        """Every process's latest shared progress record, this one's included."""
        return {r: json.loads(v) for r, v in _shared(_KEY).items()}

    def leave(self) -> None:
        """Says that this process ends for a hang (a key its peers read: an error that follows in
        theirs is the hang's), in the process that hosts JAX's coordination service only once each
        peer has ended itself too or cannot be waited for (`wait_for_peers`): its exit takes the
        service down, and JAX then aborts every other process before its watchdog reports."""
        if getattr(_jax_distributed(), "service", None) is not None:
            self.wait_for_peers()
        _post(f"{_ENDED}{self.rank}", str(HANG_STATUS))

    def wait_for_peers(self) -> None:
        """Waits until every peer has ended for the hang, has exited, or is past the time its own
        watchdog would have ended it (its record's `since` plus its limit, plus `_SLACK`); one hang
        timeout and the slack at most."""
        step = interval(self.timeout)
        give_up = time.time() + self.timeout + _SLACK
        while (now := time.time()) < give_up:
            ended = _shared(_ENDED)
            due = [x["since"] + (self.compile_timeout if x.get("compiling") else self.timeout) + _SLACK
                   for r, x in self.peers().items() if r != self.rank and r not in ended and x.get("inside") != "exit"]
            if not due or now > max(due):
                break
            time.sleep(step / 2)
        time.sleep(step)  # the last peer between its key and its exit

    def look(self) -> dict:
        frame = sys._current_frames().get(self.main)
        if frame is None:  # the main thread has finished
            return {"rank": int(self.rank), "pid": os.getpid(), "since": time.time(), "time": time.time(),
                    "changes": self.changes, "inside": "exit", "compiling": False, "where": "", "user": ""}
        now = (frame, frame.f_lasti, frame.f_lineno)
        if self.last is None or any(a is not b and a != b for a, b in zip(now, self.last)):
            self.since, self.changes = time.time(), self.changes + 1
        self.last = now
        frames = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)[::-1]
        files = [f.filename for f in frames]
        ours = lambda name: any(f"{os.sep}{p}{os.sep}" in name for p in _LIBRARIES) or name.endswith(_SKIPPED)
        user = next((f for f in reversed(frames) if not ours(f.filename)), frames[-1])
        return {"rank": int(self.rank), "pid": os.getpid(), "since": self.since, "time": time.time(),
                "changes": self.changes, "compiling": any(n.endswith(_COMPILER) for n in files),
                "inside": "jax" if any(f"{os.sep}{p}{os.sep}" in files[-1] for p in _LIBRARIES) else "user",
                "where": _frame(frames[-1]), "user": _frame(user)}

    def end(self, record: dict) -> None:
        if not _ENDING.acquire(blocking=False):
            return  # another thread is ending the process already
        waited = record["time"] - record["since"]
        try:
            text = (f"jshard: process {self.rank} made no progress for {waited:.0f} s (hang timeout "
                    f"{self.timeout:g} s): {describe(record)}.")
            peers = {**self.peers(), self.rank: record}
            if len(peers) > 1 and self.explain is not None:
                text += " " + self.explain(self.rank, peers, record["time"], self.timeout, self.compile_timeout)
            print(f"{text} Its threads' stacks follow; ending it with status {HANG_STATUS} so that the job ends "
                  "rather than hold its allocation.", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(all_threads=True)
        finally:  # a broken stream must not leave the process running
            fail(TimeoutError(f"no progress for {waited:.0f} s: {describe(record)}"), HANG_STATUS)


_LIBRARIES = ("jax", "jaxlib", "jshard", "orbax", "flax", "optax")
_KEY, _ENDED = "jshard/progress/", "jshard/ended/"
_SHARING, _SHARING_LOCK = threading.Event(), threading.Lock()
_ENDING = threading.RLock()
"""Held by the thread ending the process (`fail`): another thread's failure meanwhile only prints."""
_WATCH: _ProgressWatch | None = None
"""This process's enforcing watchdog, where `jshard.init` started one."""
_SLACK = 5.0
"""Seconds the coordinator's process waits past a peer's own hang deadline for its report (a loaded
machine takes a while to print a report and dump the stacks)."""


def _jax_distributed() -> Any:
    """JAX's distributed state (`client`, `service`), where JAX is loaded."""
    return getattr(sys.modules.get("jax._src.distributed"), "global_state", None)


def _client() -> Any:
    """JAX's distributed client, while `share_progress` says it is connected and not shutting down."""
    return getattr(_jax_distributed(), "client", None) if _SHARING.is_set() else None


def _post(key: str, value: str) -> None:
    """Sets `key` in JAX's coordination service's key-value store, where it is reachable."""
    with _SHARING_LOCK:
        if (client := _client()) is not None:
            with contextlib.suppress(Exception):  # the coordinator gone: the job is failing anyway
                client.key_value_set(key, value, allow_overwrite=True)


def _shared(prefix: str) -> dict[int, str]:
    """Rank -> value of the keys `prefix<rank>` in the coordination service ({} where unreachable)."""
    with _SHARING_LOCK:
        client = _client()
        try:
            shared = client.key_value_dir_get(prefix) if client is not None else []
        except Exception:
            return {}
    return {int(k.rsplit("/", 1)[1]): v for k, v in shared}


def share_progress() -> None:
    """Lets the progress thread use JAX's coordination service: call it once `jax.distributed` has
    connected. Its key-value calls stop at interpreter exit, before JAX's own shutdown (registered
    earlier, so run later), as a call to a client shutting down would end the process."""
    import atexit

    def stop():
        with _SHARING_LOCK:
            _SHARING.clear()

    _SHARING.set()
    atexit.register(stop)
_COMPILER = os.path.join("jax", "_src", "compiler.py")
_SKIPPED = ("_worker.py", "runpy.py", "<frozen runpy>", "threading.py")


def _frame(f: traceback.FrameSummary) -> str:
    return f"{f.filename}:{f.lineno} in {f.name}"


def stalled_for(record: dict, now: float, timeout: float, compile_timeout: float) -> bool:
    """Whether a progress record says its process made no progress for longer than it may."""
    limit = compile_timeout if record.get("compiling") else timeout
    return record.get("inside") != "exit" and now - record["since"] > limit


def describe(record: dict) -> str:
    """Where a progress record's main thread waits, in words."""
    if record.get("compiling"):
        return f"compiling (JAX's compiler) for {record['user']}"
    if record.get("inside") == "jax":
        return f"waiting inside a JAX call at {record['user']} (innermost: {record['where']})"
    return f"in its own code at {record['user']}, not in a JAX call"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _traceback_lines(exc: BaseException) -> list[str]:
    if isinstance(exc, SystemExit):
        return []  # sys.exit is not an error to print: its status says it
    tb = exc.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).name in ("_worker.py", "runpy.py", "<frozen runpy>"):
        tb = tb.tb_next
    return traceback.format_exception(type(exc), exc, tb)


def _write_record(exc: BaseException, status: int, lines: list[str]) -> None:
    directory, rank = os.environ.get(FAILURE_DIR), os.environ.get("JSHARD_PROCESS_ID")
    if not directory or rank is None:
        return
    text = "".join(lines).rstrip("\n").splitlines()
    record = {"rank": int(rank), "type": type(exc).__name__, "message": _message(exc), "status": status,
              "lines": text[-RECORD_LINES:], "time": time.time()}
    _write_json(failure_path(directory, int(rank)), record)


def _message(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r})"
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


if __name__ == "__main__":
    run(sys.argv[1:])
