"""The launcher's half of the hang watchdog: which rank holds a job up, and the report that says so.

Each worker writes a progress record (`jshard._worker.watch_progress`): since when its main thread's
Python stack has not changed, where it stands, and whether it waits inside a JAX call (a collective,
a transfer) or in its own code. A job is hung when some rank has made no progress for the hang
timeout and no rank is compiling within the compile allowance. The rank that did not arrive is the
one stuck in its own code (a sleep, a read, a lock) while the others wait inside JAX for it; where
every rank waits inside JAX, the one that stopped first.
"""

from __future__ import annotations

from collections.abc import Mapping

from jshard._worker import describe, stalled_for


def find_hang(records: Mapping[int, dict], now: float, timeout: float, compile_timeout: float) -> int | None:
    """The rank that holds the job up, or None while it is not hung (`records`: rank -> progress)."""
    live = {r: x for r, x in records.items() if x.get("inside") != "exit"}
    if not any(stalled_for(x, now, timeout, compile_timeout) for x in live.values()):
        return None
    if any(x.get("compiling") and not stalled_for(x, now, timeout, compile_timeout) for x in live.values()):
        return None  # a rank still compiling within its allowance: the others wait for it
    own_code = {r: x for r, x in live.items() if x.get("inside") == "user" and not x.get("compiling")}
    over = {r: x for r, x in live.items() if x.get("compiling") and stalled_for(x, now, timeout, compile_timeout)}
    candidates = over or own_code or live
    return min(candidates, key=lambda r: (candidates[r]["since"], r))


def hang_report(culprit: int, records: Mapping[int, dict], now: float, timeout: float,
                missing: list[int], other_nodes: bool = False) -> str:
    """One paragraph: the rank that did not arrive, and where each rank waits (`records` holds this
    node's ranks; `other_nodes`: the job has ranks elsewhere too)."""
    x = records[culprit]
    if x.get("inside") == "jax" and not x.get("compiling"):
        why = ("The rank that did not arrive is most likely on another node (see its launcher's report); else the "
               "ranks entered different collectives." if other_nodes else "No rank is stuck in its own code: the "
               "ranks most likely entered different collectives (a step or a save run by some ranks only?).")
        text = (f"the job is hung: every rank here waits inside a JAX call, rank {culprit} longest: its main thread "
                f"has made no progress for {now - x['since']:.1f} s (hang timeout {timeout:g} s), {describe(x)}. {why}")
    else:
        text = (f"the job is hung: rank {culprit} did not arrive: its main thread has made no progress for "
                f"{now - x['since']:.1f} s (hang timeout {timeout:g} s), {describe(x)}.")
    others = [f"rank {r} for {now - y['since']:.1f} s, {describe(y)}" for r, y in sorted(records.items())
              if r != culprit and y.get("inside") != "exit"]
    if others:
        text += " The others wait (most likely for it): " + "; ".join(others) + "."
    if missing:
        text += f" No progress record from rank(s) {', '.join(map(str, missing))} (not a Python worker?)."
    return text + (" Every rank's Python stack (faulthandler) is at the end of its log. Find what rank "
                   f"{culprit} waits for there (a file system, a lock, a data loader); raise the hang timeout "
                   "where one step legitimately takes longer.")


def explain(rank: int, records: Mapping[int, dict], now: float, timeout: float, compile_timeout: float) -> str:
    """The report a process without a launcher prints when it ends itself (`jshard._worker`'s
    watchdog, given this by `jshard.init`): the rank that did not arrive (this one where none
    stands out) and where each waits."""
    culprit = find_hang(records, now, timeout, compile_timeout)
    return hang_report(rank if culprit is None else culprit, records, now, timeout, [])
