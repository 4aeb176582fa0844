"""Where an operator came from, as its author looks for it: the innermost frame of the user's own code.

JAX's own choice (`source_info_util.summarize`) skips JAX and the standard library only, so in a
virtual environment an Adam update points into optax and a Flax layer into flax. Here a frame inside
any installed package (a `site-packages` or `dist-packages` folder) is skipped too, except jshard's
own reference models; a notebook cell's file (`/tmp/ipykernel_.../123.py`) is named as IPython names
it in tracebacks (`In[7]`).
"""

from __future__ import annotations

import functools
import os
import re
import sys

from jshard._compat import source_info_util

_INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]")
_JSHARD = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_source(info, *, strict: bool = False) -> str:
    """`file:line:column (function)` of the user's innermost frame in a jaxpr equation's `source_info`;
    where every frame is a library's, the first one JAX itself would name (`strict`: `""`); `""` with none."""
    return _frames_source(info.traceback, strict)


@functools.lru_cache(maxsize=1 << 14)
def _frames_source(traceback, strict: bool) -> str:
    """`user_source` of one traceback; JAX's tracebacks compare (and hash) by their frames, so the
    equations an unrolled loop's layers made at one line are read once."""
    frames = list(source_info_util.user_frames(traceback))
    frame = next((f for f in frames if is_user_file(f.file_name)), None if strict or not frames else frames[0])
    if frame is None:
        return ""
    where = f"{display_file(frame.file_name)}:{frame.start_line}"
    where += f":{frame.start_column}" if frame.start_column else ""
    return f"{where} ({frame.function_name})"


def is_user_file(path: str) -> bool:
    """Whether a frame in `path` is the user's code: not inside an installed package (jshard's own
    reference models, which stand for the user's code in its demos, excepted)."""
    return path.startswith(_JSHARD) or _INSTALLED.search(path) is None


def display_file(path: str) -> str:
    """`path`, or `In[7]` for the file IPython compiled a notebook cell to."""
    shell = _ipython()
    name = getattr(getattr(shell, "compile", None), "format_code_name", None)  # IPython >= 7.26
    named = name(path) if name is not None else None
    return named[1] if named else path


def _ipython():
    ipython = sys.modules.get("IPython")
    return None if ipython is None else ipython.get_ipython()


def caller(skipped: tuple[str, ...] = ("jshard._", "jshard.context", "functools")) -> str:
    """`file:line` of the innermost frame outside the modules named `skipped*`: the user's call."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(skipped):
        frame = frame.f_back
    return "?" if frame is None else f"{display_file(frame.f_code.co_filename).rsplit('/', 1)[-1]}:{frame.f_lineno}"
