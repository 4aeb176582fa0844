"""Float tolerances from the dtype and the numbers compared, never a constant tuned on one CPU.

Two programs that compute the same values in another order (8 devices against one, another vector
width, thread count or cache blocking) round differently. A sum of K terms rounds K - 1 times, each
time by at most eps/2 of the running sum, so each side is within (K - 1) * eps/2 * scale of the
exact value, scale being the sum of the terms' magnitudes (Higham's bound gamma_K, to first order,
for any order of summation), and the two sides within

    tol = terms * eps * scale,    eps = np.finfo(dtype).eps.

We take the worst case K, not the typical sqrt(K) of independent roundings: the order differs
from CPU to CPU, and a bound that holds for every order needs no safety factor tuned on one
machine. `terms` is K for one sum or dot product; along a chain of operations first-order errors
add, so pass the chain's sum (and a few for each transcendental: CPUs approximate tanh, exp, log
to a few ulps). `scale` defaults to the largest |desired| of the leaf: the terms' sum when they do
not cancel; pass it (e.g. max(|x| @ |w|)) where that is at hand and they do. (Terms of random
sign sum to about sqrt(K) below their magnitudes, a factor the worst case K still covers for the
typical error.) tol is one absolute bound per leaf: small elements are held to the rounding of
the large ones they were computed with.
"""

import math

import jax
import numpy as np


def tolerance(desired, *, dtype=None, terms=1, scale=None) -> float:
    """`terms * eps * scale` for one array: the most two orders of its computation may differ by."""
    info = np.finfo(dtype or np.asarray(desired).dtype)
    if scale is None:
        scale = float(np.max(np.abs(desired), initial=0.0))
    return float(terms * info.eps * max(scale, info.tiny))


def assert_close(actual, desired, *, dtype=None, terms=1, scale=None, err_msg=""):
    """Every float leaf of the pytree `actual` within `tolerance` of the same leaf of `desired`;
    integer and boolean leaves, and PRNG keys (their key data), equal.

    dtype: the precision the values were computed in; by default the leaf's, the coarser of the two
    (pass it for Python floats, which are float64 whatever they were computed in).
    """
    got, want = jax.tree.leaves(actual), jax.tree.leaves(desired)
    assert len(got) == len(want), f"{len(got)} leaves against {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = _key_data(a), _key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        if not (np.issubdtype(a.dtype, np.inexact) or np.issubdtype(b.dtype, np.inexact)):
            np.testing.assert_array_equal(a, b, err_msg=f"leaf {i} {err_msg}".rstrip())
            continue
        tol = tolerance(b, dtype=dtype or _coarser(a.dtype, b.dtype), terms=terms, scale=scale)
        np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=f"leaf {i}: {terms} terms, tol {tol:.3g} {err_msg}")


def fan_in(params) -> int:
    """How many terms one forward pass through every weight of `params` sums into a value: each
    weight (2 dims or more) adds its fan-in, the product of all its dims but the last (a stacked
    [layers, in, out] weight: layers * in; a conv kernel [h, w, in, out]: h * w * in). A rough
    count: the sums over activations (norms, softmax, attention) run over widths of the same size.
    """
    return sum(math.prod(np.shape(w)[:-1]) for w in jax.tree.leaves(params) if np.ndim(w) >= 2)


def step_terms(params, batch, *, backward=True) -> int:
    """The terms a train step's loss, gradients or updated parameters sum: forward (and backward)
    through every weight, then a sum over the batch (the loss's mean; a gradient's sum over the rows,
    tokens or pixels), of at most as many terms as the largest batch array has elements."""
    return (2 if backward else 1) * fan_in(params) + max(np.size(x) for x in jax.tree.leaves(batch))


def _coarser(*dtypes):
    """The float dtype with the larger eps (float32 results against a float64 reference: float32)."""
    return max((t for t in dtypes if np.issubdtype(t, np.inexact)), key=lambda t: np.finfo(t).eps)


def _key_data(x):
    """A typed PRNG key array as its raw key data (compared exactly); anything else as it is."""
    dtype = getattr(x, "dtype", None)
    return jax.random.key_data(x) if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else x
