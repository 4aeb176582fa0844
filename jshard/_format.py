"""How jshard writes sizes and tensors in plans, reports and errors: one formatter for each, and the
two ways its tables leave a rich renderable: plain text of a fixed width, and HTML for notebooks.

Examples:
  >>> human_bytes(1600), human_bytes(16 * 2**30), human_bytes(512)
  ('1.562 KiB', '16 GiB', '512 B')
  >>> shape_str("float32", (784, 62)), shape_str("bfloat16", (8,), short=False)
  ('f32[784,62]', 'bfloat16[8]')
  >>> shape_str(jax.random.key(0).dtype, (8,))
  'key<fry>[8]'
"""

from __future__ import annotations

import functools
import html
import io
from collections.abc import Sequence

import jax
import numpy as np
from rich.console import Console

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_SHORT_DTYPES = (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i"), ("complex", "c"))


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at least 1, to 4 significant digits."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.0f} B"


def dtype_str(dtype: object) -> str:
    """A dtype as jaxprs print it: `f32`, `bf16`, `i32`, `u8`, `bool`, `key<fry>`."""
    name = dtype_name(dtype)
    return next((short + name[len(long) :] for long, short in _SHORT_DTYPES if name.startswith(long)), name)


def dtype_name(dtype: object) -> str:
    """NumPy's name of a dtype (`float32`), or JAX's for one NumPy does not know (`key<fry>`)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return str(dtype)
    return np.dtype(dtype).name


def shape_str(dtype: object, shape: Sequence[int], *, short: bool = True) -> str:
    """A tensor as jaxprs print it (`f32[784,62]`), or with NumPy's dtype name (`float32[784,62]`)."""
    name = "?" if dtype is None else dtype_str(dtype) if short else dtype_name(dtype)
    return f"{name}[{','.join(map(str, shape))}]"


def var_str(v: object, *, short: bool = True) -> str:
    """A jaxpr value's type: `f32[8,64]`."""
    aval = v.aval
    return _aval_str(getattr(aval, "shape", ()), getattr(aval, "dtype", None), short)


@functools.lru_cache(maxsize=4096)
def _aval_str(shape: tuple, dtype: object, short: bool) -> str:
    return shape_str(dtype, shape, short=short)


def plain_text(renderable: object, width: int = 120) -> str:
    """A rich renderable as plain text no wider than `width` columns: no colour, no trailing spaces."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, highlight=False, emoji=False, markup=False,
            force_terminal=False, force_jupyter=False).print(renderable)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines())


def html_table(headers: Sequence[str], rows: Sequence[Sequence[str]], caption: Sequence[str] = ()) -> str:
    """An HTML `<table>` of text cells (escaped), left-aligned, with `caption` lines above it."""
    cell = "<td style='text-align:left'>{}</td>"
    head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(cell.format(html.escape(c)) for c in row) + "</tr>" for row in rows)
    above = f"<p><code>{'<br>'.join(html.escape(line) for line in caption)}</code></p>" if caption else ""
    return f"<div>{above}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
