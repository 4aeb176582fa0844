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
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # run as `python .../jshard/_worker.py`: Python put jshard/ first on sys.path,
    del sys.path[0]  # where its modules could shadow the standard library's for the imports below

import contextlib
import json
import os
import runpy
import time
import traceback
from pathlib import Path

FAILURE_DIR = "JSHARD_FAILURE_DIR"
WRAPPER = os.path.abspath(__file__)
"""This file, which `python WRAPPER script.py args` runs as `run(["script.py", "args"])`."""
RECORD_LINES = 12
"""How many of the traceback's last lines a failure record keeps."""


def failure_path(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank `rank` writes its failure record in `directory`."""
    return Path(directory) / f"failure_{rank}.json"


def read_failure(directory: str | os.PathLike, rank: int) -> dict | None:
    """Rank `rank`'s failure record, or None where it wrote none (or a torn one)."""
    try:
        return json.loads(failure_path(directory, rank).read_text())
    except (OSError, ValueError):
        return None


def fail(exc: BaseException, status: int) -> None:
    """Prints `exc`'s traceback (less this module's and runpy's frames), writes the failure record
    and ends the process with `status` at once, without JAX's shutdown barrier."""
    lines = _traceback_lines(exc)
    try:
        sys.stderr.write("".join(lines))
        _write_record(exc, status, lines)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream must not keep the process alive
                stream.flush()
        os._exit(status)


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
    path = failure_path(directory, int(rank))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _message(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r})"
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


if __name__ == "__main__":
    run(sys.argv[1:])
