"""The big sweep behind tests/test_property.py: many random programs and layout pairs, every outcome
counted by kind, every mismatch listed.

    PYTHONPATH=. python tests/sweep_property.py --programs 2000 --pairs 200 [--seed 0] [--out FILE]

A program either runs, equals one device and moves the bytes its plan predicts per kind of collective
(within 2%), or is refused with a `ShardingError`; anything else is a mismatch: `values` (differs
from one device), `bytes <kind>` (mispriced), `error <type>` (some other exception). A layout pair
(`src` -> `dst` over a mesh of `MESHES`) is a mismatch where `redistribution` prices a kind otherwise than
XLA compiles the `stages` the engine constrains. Not a test (pytest collects test_*.py only); its
cases are drawn as the tests draw theirs (`tests/_programs.py`), so a listed mismatch replays as an
`@example` there.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _programs(count: int, seed: int, modes) -> list:
    """`count` programs drawn by hypothesis from `seed` (the same draw for the same arguments)."""
    from _programs import programs
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    drawn = []

    @seeded(seed)
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(programs(modes=modes))
    def collect(program):
        drawn.append(program)

    collect()
    return drawn[:count]


def _pairs(count: int, seed: int, mesh: dict[str, int]) -> list:
    """Random `(shape, src, dst)` over `mesh` (axis name -> size): each axis on some dim or none, in
    a random order, dims sized so both cuts divide."""
    import math

    import numpy as np

    rng = np.random.default_rng(seed)
    pairs = []
    while len(pairs) < count:
        rank = int(rng.integers(1, 4))
        shape = tuple(int(rng.choice([4, 8, 16])) for _ in range(rank))

        def spec():
            dims = [[] for _ in range(rank)]
            for a in rng.permutation(sorted(mesh)):
                where = int(rng.integers(-1, rank))
                if where >= 0:
                    dims[where].append(str(a))
            return tuple(tuple(d) for d in dims)

        src, dst = spec(), spec()
        cut = lambda axes: math.prod(mesh[a] for a in axes)
        if src != dst and all(n % cut(a) == 0 and n % cut(b) == 0 for n, a, b in zip(shape, src, dst)):
            pairs.append((shape, src, dst))
    return pairs


def check_program(program) -> tuple[str, str]:
    """(outcome, detail): `ok`, `refused`, `values`, `bytes <kind>`, `error <type>`."""
    import jax
    import jax.numpy as jnp
    from _tolerance import assert_close

    import jshard as js

    args = [jnp.asarray(a) for a in program.arguments()]
    try:
        step = program.parallelized()
        try:
            out = step(*args)
        except js.ShardingError:
            return "refused", ""
        terms, scale = program.bound(args)
        try:
            assert_close(out, jax.jit(program.fn)(*args), terms=terms, scale=scale)
        except AssertionError as e:
            return "values", str(e)[:300]
        plan = step.plan(*args)
        report = js.audit(step.lower(*args).compile())
        predicted, compiled = plan.predicted(), {k: b for k, (_, b) in report.by_kind().items()}
        bad = [(k, predicted.get(k, 0.0), compiled.get(k, 0.0)) for k in sorted(set(predicted) | set(compiled))
               if abs(predicted.get(k, 0.0) - compiled.get(k, 0.0)) > 0.02 * max(predicted.get(k, 0.0),
                                                                              compiled.get(k, 0.0))]
        if bad:
            return "bytes " + ",".join(k for k, _, _ in bad), "; ".join(f"{k}: predicted {p:g} B, compiled {c:g} B"
                                                                      for k, p, c in bad)
        return "ok", ""
    except Exception as e:  # noqa: BLE001 - a sweep counts every failure, by its type
        return f"error {type(e).__name__}", "".join(traceback.format_exception_only(e))[-400:]


def check_pair(shape, src, dst, mesh: dict[str, int]) -> tuple[str, str]:
    """(outcome, detail) of one layout pair, compiled and priced as `test_property` does."""
    from test_property import compiled_and_priced

    got, predicted = compiled_and_priced(shape, src, dst, dict(mesh))
    bad = sorted(k for k in set(got) | set(predicted) if abs(got.get(k, 0) - predicted.get(k, 0)) > 0.02 * max(
        got.get(k, 0), predicted.get(k, 0)))
    if bad:
        return "bytes " + ",".join(bad), f"predicted {predicted}, compiled {got}"
    return "ok", ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tests/sweep_property.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=2000, help="random programs (2/3 semi_auto, 1/3 auto or data)")
    parser.add_argument("--pairs", type=int, default=200, help="random layout pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the mismatches here, one a line")
    args = parser.parse_args(argv)

    import jshard

    jshard.simulate_devices(8)
    import jax
    from test_property import MESHES  # the meshes layout pairs are drawn over, as the tests draw them

    jax.config.update("jax_numpy_rank_promotion", "raise")
    start = time.perf_counter()
    cases = []
    semi = args.programs * 2 // 3
    cases += [("program", p) for p in _programs(semi, args.seed, ("semi_auto",))]
    cases += [("program", p) for p in _programs(args.programs - semi, args.seed + 1, ("auto", "data"))]
    for mesh in MESHES:
        cases += [("pair", (*p, mesh)) for p in _pairs(args.pairs // len(MESHES), args.seed, mesh)]
    counts, lines = collections.Counter(), []
    for i, (what, case) in enumerate(cases):
        outcome, detail = check_program(case) if what == "program" else check_pair(*case)
        counts[(what, outcome)] += 1
        if outcome not in ("ok", "refused"):
            lines.append(f"{what} {outcome}: {detail}\n    {case!r}")
            print(lines[-1], flush=True)
        if (i + 1) % 100 == 0:
            jax.clear_caches()
            print(f"-- {i + 1}/{len(cases)} in {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\n{len(cases)} cases in {time.perf_counter() - start:.0f} s")
    for (what, outcome), n in sorted(counts.items()):
        print(f"  {what:8s} {outcome:30s} {n}")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
