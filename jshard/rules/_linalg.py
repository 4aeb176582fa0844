"""Rules for batched linear algebra and FFTs: the leading (batch) dims shared by every operand and
result, the matrix (or transformed) dims whole.

`cholesky`, `eigh`, `eig`, `lu`, `qr`, `svd`, `schur`, `hessenberg`, `householder_product`,
`tridiagonal`, `triangular_solve`, `tridiagonal_solve` work on the last two dims (or, for the
tridiagonal solver, the last one) of their first operand and treat the dims before as a batch;
`fft` transforms its last `len(fft_lengths)` dims. MindSpore propagates through such operators by
their batch dims alone, as these rules do.
"""

from __future__ import annotations

import math

from jax.extend import core as jcore

from jshard.rules._factors import FactorBuilder, Factors, rule, shape_of

MATRIX = ("cholesky", "eigh", "eig", "lu", "qr", "svd", "schur", "hessenberg", "householder_product",
          "tridiagonal", "triangular_solve")


def _batched(eqn: jcore.JaxprEqn, core: int) -> Factors:
    """Every operand and result shares factors on the first dims of the first operand but its last
    `core`; the rest of each is whole."""
    shape = shape_of(eqn.invars[0])
    nb = max(len(shape) - core, 0)
    b = FactorBuilder()
    batch = b.dims(shape[:nb])

    def of(v):
        s = shape_of(v)
        if len(s) < nb or tuple(s[:nb]) != tuple(shape[:nb]):
            return tuple(() for _ in s)
        return tuple(batch) + tuple(() for _ in s[nb:])

    return b.build([of(v) for v in eqn.invars], [of(v) for v in eqn.outvars], flops=math.prod(shape) * shape[-1] if shape else 0)


@rule(*MATRIX)
def matrix(eqn: jcore.JaxprEqn) -> Factors:
    return _batched(eqn, 2)


@rule("tridiagonal_solve")
def tridiagonal_solve(eqn: jcore.JaxprEqn) -> Factors:
    """Diagonals `[..., m]` and right-hand sides `[..., m, n]`: the batch of the diagonals."""
    return _batched(eqn, 1)


@rule("fft")
def fft(eqn: jcore.JaxprEqn) -> Factors:
    return _batched(eqn, len(eqn.params["fft_lengths"]))
