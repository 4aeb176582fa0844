"""The heuristic search of a level's core (`_level.py`): the units the exact eliminations leave
(three neighbours or more). From the axis left unused, then each of the heaviest units pinned to
each of its candidates with the rest decided in program order (`_spread`), each start is improved by
single moves and the best per pinned unit polished with moves of two neighbours at once
(`_improve`); min-sum message passing (`_believed`) gives one more start, moving blocks of units no
single or pairwise move does. A unit's cost against its neighbours' picks (`_local`) and a pair's
joint move (`_pair`) are evaluated once per class of units (`_class_of`: the same operator of
identical layers, by its arrays' contents) and kept in the level's `Shared`, so identical layers are
weighed once.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from jshard.search._graph import Assignment
from jshard.search._shared import Eliminated, Shared

_PASSES = 4
_ROOTS = 4  # the heaviest units tried with each candidate, one after another, per level
_BELIEFS = 32  # the core's min-sum message passing: rounds at most
_HEAVY = 0.1  # ... among those with at least this share of the heaviest one's compute
_UNSEEN: Any = object()  # a key not yet in a cache whose values may be None
_FAR = 2.0**100  # `_believed`: a missing candidate's cost (units have fewer than the most): never the least


class Core:
    """The core search of a `Level` (`jshard.search._level`), which inherits it: it reads the level's
    own costs (`unary`), tables and neighbours (`tables`, `nbrs`), candidates (`cands`), its
    `Shared` (`_shared`), the eliminations it recorded or replays (`_eliminated`, `_replays`,
    `_touched`) and its order of units by weight (`weight`).
    """

    unary: list[np.ndarray]
    tables: dict[tuple[int, int], np.ndarray]
    nbrs: dict[int, set[int]]
    cands: list[list[Assignment]]
    weight: Callable[[int], tuple[float, int]]
    _shared: Shared
    _eliminated: Eliminated | None
    _replays: Eliminated | None
    _touched: tuple[set[int], set[tuple[int, int]]]

    def _energy(self, choice: dict[int, int]) -> float:
        """The core's energy under `choice`, summed in the order `choice` and the tables hold."""
        units = np.fromiter(choice.keys(), int, len(choice))
        picks = np.fromiter(choice.values(), int, len(choice))
        total = sum(self._flat[self._offset[units] + picks].tolist())
        self._picked[units] = picks
        a, b, offset, width = self._ends
        return total + sum(self._flat_tables[offset + self._picked[a] * width + self._picked[b]].tolist())

    def _local(self, k: int, choice: dict[int, int]) -> tuple[np.ndarray, int, int, tuple[bool, ...]]:
        """Unit `k`'s own cost per candidate against its neighbours decided in `choice`, its
        cheapest candidate, the entry's number (its place in `_locals`: `_pair` keys by it, an int
        hashed faster than the entry's key) and, per candidate, whether the cheapest costs less.
        Units of one class (the same costs and tables: one operator of identical layers) with the
        same neighbours' picks share one entry of `_locals`, so identical layers are weighed once."""
        key = (self._class[k], tuple(map(choice.get, self._ids[k])))  # None: not decided yet
        found = self._locals.get(key)
        if found is None:
            cost = self.unary[k]
            for j, t in self.around[k]:
                if j in choice:
                    cost = cost + t[:, choice[j]]
            c = int(cost.argmin())
            found = self._locals[key] = (cost, c, len(self._locals), tuple((cost[c] < cost).tolist()))
        return found

    def _prepare_core(self, core: list[int]) -> None:
        """The core's neighbourhoods, each unit's class (its own costs and tables, as bytes) and
        the flat arrays `_energy` reads; a replayed level's (`_replay`) patched from its level's
        where its costs or tables changed."""
        shared = self._shared
        self._locals, self._pairs = shared.locals, shared.pairs
        self._known = len(self._locals) + len(self._pairs)  # evaluated before: `evaluations` counts what this adds
        self._picked = np.zeros(len(self.cands), int)
        if self._replays is not None and self._replays.prepared is not None:
            self._patch_core(self._replays)
            return
        tables, nbrs = self.tables, self.nbrs
        self._ids = {k: tuple(sorted(nbrs[k])) for k in core}
        self._picks_of = {k: _picks_of(ids) for k, ids in self._ids.items()}
        self.around = {k: [(j, tables[(k, j)] if k < j else tables[(j, k)].T) for j in ids]  # `_table`, inlined
                       for k, ids in self._ids.items()}
        self._table_class = [self._content(t) for t in tables.values()]
        self._class = {k: self._class_of(k) for k in core}
        n = len(self.cands)
        self._offset = np.zeros(n, int)
        self._offset[core] = np.cumsum([0] + [len(self.unary[k]) for k in core[:-1]])
        self._flat = np.concatenate([self.unary[k] for k in core])
        tables = list(self.tables.values())
        sizes = [t.size for t in tables]
        self._flat_tables = np.concatenate([t.ravel() for t in tables]) if tables else np.zeros(0)
        self._ends = (np.array([a for a, _ in self.tables], int), np.array([b for _, b in self.tables], int),
                      np.cumsum([0] + sizes[:-1]).astype(int), np.array([t.shape[1] for t in tables], int))
        if self._eliminated is not None and self._replays is None:  # for the levels barred from this one
            self._eliminated.prepared = (self._ids, self._picks_of, self.around, self._table_class, self._class, self._offset,
                                         self._flat, self._flat_tables, self._ends)

    def _patch_core(self, done: Eliminated) -> None:
        """`_prepare_core` for a replayed level: its level's core (`done.prepared`) with the costs
        and tables the replay changed (`_touched`) read again, and the classes of the units they reach."""
        assert done.prepared is not None  # `_prepare_core` calls this only then
        ids, self._picks_of, around, table_class, classes, self._offset, flat, flat_tables, self._ends = done.prepared
        self._ids, self.around, self._table_class, self._class = ids, dict(around), list(table_class), dict(classes)
        self._flat, self._flat_tables = flat.copy(), flat_tables.copy()
        units, stale = self._touched
        tables, offset, starts = self.tables, self._offset, self._ends[2]
        for key in stale:
            n, t = done.table_at[key], tables[key]
            self._table_class[n] = self._content(t)
            self._flat_tables[starts[n]:starts[n] + t.size] = t.ravel()
        for k in units:
            self._flat[offset[k]:offset[k] + len(self.unary[k])] = self.unary[k]
        for k in units | {k for key in stale for k in key}:
            self.around[k] = [(j, tables[(k, j)] if k < j else tables[(j, k)].T) for j in ids[k]]
            self._class[k] = self._class_of(k)

    def _content(self, t: np.ndarray, transposed: bool = False) -> int:
        """The id of array `t`'s (transposed) shape and bytes, among the level's and those on its base
        (`Shared`), read once per array held."""
        seen = self._shared.seen
        found = seen.get((id(t), transposed))
        if found is None:
            x = t.T if transposed else t
            contents = self._shared.contents
            found = seen[(id(t), transposed)] = (t, contents.setdefault((x.shape, x.tobytes()), len(contents)))
        return found[1]

    def _class_of(self, k: int) -> int:
        """Core unit `k`'s class: its own costs' and its tables' contents."""
        tables, content = self.tables, self._content
        classes = self._shared.classes
        key = (content(self.unary[k]), tuple(content(tables[(k, j)]) if k < j else content(tables[(j, k)], True)
                                             for j in self._ids[k]))
        return classes.setdefault(key, len(classes))

    def _search_core(self, core: list[int]) -> dict[int, int]:
        if not core:
            return {}
        self._prepare_core(core)
        self.classes = len(set(self._class.values()))
        weight = self.weight
        heaviest = max(weight(k)[0] for k in core)
        roots = [k for k in sorted(core, key=weight, reverse=True) if weight(k)[0] >= _HEAVY * heaviest][:_ROOTS]
        unused = dict.fromkeys(core, 0)
        best = (self._energy(unused), unused)
        start = dict(unused)
        self._improve(core, start, set(), pairs=False)
        best = min(best, (self._energy(start), start), key=lambda t: t[0])
        pinned: dict[int, int] = {}
        for root in roots:
            found = None
            for c in range(len(self.cands[root])):
                choice = self._spread(core, {**pinned, root: c})
                self._improve(core, choice, set(pinned) | {root}, pairs=False)
                total = self._energy(choice)
                if found is None or total < found[0]:
                    found = (total, choice, c)
            assert found is not None  # every unit has a candidate
            pinned[root] = found[2]
            choice = found[1]
            self._improve(core, choice, set(pinned), pairs=True)  # the root's best, polished with pairwise moves
            total = self._energy(choice)
            if total < best[0]:
                best = (total, choice)
        choice = self._believed(core)
        self._improve(core, choice, set(), pairs=True)
        best = min(best, (self._energy(choice), choice), key=lambda t: t[0])
        self.evaluations = len(self._locals) + len(self._pairs) - self._known
        return best[1]

    def _believed(self, core: list[int]) -> dict[int, int]:
        """Each core unit's cheapest candidate under min-sum message passing (loopy belief
        propagation) over the core's tables: every unit tells each neighbour, per candidate of the
        neighbour, the least it adds given what its other neighbours told it, `_BELIEFS` rounds at
        most or until no message changes. Exact on a tree; on the core's cycles it weighs a change
        of many units at once (a block of operators moving from the batch to the experts' dim, which
        no single or pairwise move finds), so it is one more start of the core search."""
        if not self.tables:
            return {k: int(self.unary[k].argmin()) for k in core}
        width, unary, src, tables = self._beliefs(core)
        n_pairs = len(src) // 2
        dst = np.concatenate([src[n_pairs:], src[:n_pairs]])
        back = np.concatenate([np.arange(n_pairs) + n_pairs, np.arange(n_pairs)])  # the reverse message
        told = np.zeros((width, 2 * n_pairs))  # message n: from unit src[n] to unit dst[n], per dst's candidate
        bins = (dst + len(core) * np.arange(width)[:, None]).ravel()  # [dst's candidate, dst]: one bincount
        joint = np.empty_like(tables)

        def believed(told: np.ndarray) -> np.ndarray:  # each unit's own costs and all it was told
            return unary + np.bincount(bins, weights=told.ravel(), minlength=unary.size).reshape(unary.shape)

        for _ in range(_BELIEFS):
            np.add((believed(told).take(src, axis=1) - told.take(back, axis=1))[:, None, :], tables, out=joint)
            sent = joint.min(0)  # least over src's candidates
            sent -= sent.min(0)
            done = bool((np.abs(sent - told) <= 1e-12 * np.abs(told)).all())  # `np.allclose(rtol=1e-12, atol=0)`: all finite
            told = sent
            if done:
                break
        picks = believed(told).argmin(0)
        return {k: int(picks[n]) for n, k in enumerate(core)}

    def _beliefs(self, core: list[int]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """What `_believed` reads of the core: the most candidates a unit has, the own costs
        `[candidate, unit]` and each message's source unit and table `[src's candidate, dst's
        candidate, message]` (a missing candidate costs `_FAR`); a replayed level's (`_replay`) its
        level's, copied where the replay changed costs or tables (`_touched`), as in `_patch_core`."""
        done = self._replays
        if done is not None and done.beliefs is not None:
            width, unary, src, tables = done.beliefs
            units, stale = self._touched
            at = {k: n for n, k in enumerate(done.core)}
            if units:
                unary = unary.copy()
                for k in units:
                    unary[:, at[k]] = _FAR
                    unary[:len(self.unary[k]), at[k]] = self.unary[k]
            if stale:
                tables, n_pairs = tables.copy(), len(src) // 2
                for key in stale:
                    n, t = done.table_at[key], self.tables[key]
                    tables[:t.shape[0], :t.shape[1], n] = t
                    tables[:t.shape[1], :t.shape[0], n + n_pairs] = t.T
            return width, unary, src, tables
        at = {k: n for n, k in enumerate(core)}
        width = max(len(self.unary[k]) for k in core)
        unary = np.full((width, len(core)), _FAR)  # [candidate, unit]: reductions run over the first axis
        for n, k in enumerate(core):
            unary[:len(self.unary[k]), n] = self.unary[k]
        pairs = list(self.tables.items())
        n_pairs = len(pairs)
        src = np.array([at[a] for (a, _), _ in pairs] + [at[b] for (_, b), _ in pairs])
        tables = np.full((width, width, 2 * n_pairs), _FAR)  # [src's candidate, dst's candidate, message]
        shapes: dict[tuple, list[int]] = collections.defaultdict(list)  # filled per shape, not per table
        for n, (_, t) in enumerate(pairs):
            shapes[t.shape].append(n)
        for (rows, columns), ns in shapes.items():
            block = np.stack([pairs[n][1] for n in ns], axis=-1)
            tables[:rows, :columns, ns] = block
            tables[:columns, :rows, np.array(ns) + n_pairs] = block.transpose(1, 0, 2)
        if self._eliminated is not None and done is None:  # for the levels barred from this one
            self._eliminated.beliefs = (width, unary, src, tables)
        return width, unary, src, tables

    def _spread(self, core: list[int], pinned: dict[int, int]) -> dict[int, int]:
        """The pinned units, then the others in program order, each against those decided before
        it: a cut made upstream flows down the program."""
        choice = dict(pinned)
        known, classes, ids, picked = self._locals, self._class, self._ids, choice.get
        for k in core:
            if k not in choice:  # `_local`, its cache read inline
                choice[k] = (known.get((classes[k], tuple(map(picked, ids[k])))) or self._local(k, choice))[1]
        return choice

    def _improve(self, core: list[int], choice: dict[int, int], keep: set[int], pairs: bool) -> None:
        """Single moves (a unit against all its neighbours) until none lowers the energy, then,
        with `pairs`, moves of two neighbours at once; again while those find any (a few rounds).
        A worklist revisits only the neighbours of a unit that moved."""
        dirty = [k for k in core if k not in keep]
        known, classes, ids, picks_of = self._locals, self._class, self._ids, self._picks_of
        for _ in range(_PASSES):
            queued = set(dirty)
            while dirty:
                k = dirty.pop()
                queued.discard(k)
                found = known.get((classes[k], picks_of[k](choice))) or self._local(k, choice)  # `_local`, inlined
                if found[3][choice[k]]:
                    choice[k] = found[1]
                    for j in ids[k]:
                        if j not in queued and j not in keep:
                            queued.add(j)
                            dirty.append(j)
            if not pairs:
                return
            local = {k: known.get((classes[k], picks_of[k](choice))) or self._local(k, choice)
                     for k in core}  # each against all its neighbours
            pair_moves, table_class = self._pairs, self._table_class
            for n, ((a, b), t) in enumerate(self.tables.items()):
                if a in keep or b in keep:
                    continue
                la, lb, pa, pb = local[a], local[b], choice[a], choice[b]
                move = pair_moves.get((table_class[n], la[2], lb[2], pa, pb), _UNSEEN)  # `_pair`, inlined where known
                if move is _UNSEEN:
                    move = self._pair(n, t, la, lb, pa, pb)
                if move is not None:
                    choice[a], choice[b] = move
                    moved = {j for j, _ in self.around[a] + self.around[b]} | {a, b}
                    local.update((j, self._local(j, choice)) for j in moved)
                    dirty += [j for j in moved if j not in keep]
            if not dirty:
                return

    def _pair(self, n: int, t: np.ndarray, local_a: tuple, local_b: tuple, a: int, b: int) -> tuple[int, int] | None:
        """The best joint move of table `n`'s two units (their `_local` entries `local_a`, `local_b`
        against all their neighbours, picks `a`, `b`), or None where none lowers the energy; once
        per class."""
        key = (self._table_class[n], local_a[2], local_b[2], a, b)
        if key not in self._pairs:
            la, lb = local_a[0], local_b[0]
            joint = (la - t[:, b])[:, None] + (lb - t[a, :])[None, :] + t
            ca, cb = divmod(int(joint.argmin()), joint.shape[1])
            self._pairs[key] = (ca, cb) if joint[ca, cb] < joint[a, b] else None
        return self._pairs[key]


def _picks_of(ids: tuple[int, ...]) -> Callable[[dict[int, int]], tuple]:
    """What `Core._local` keys a core unit's entry by, its neighbours' (`ids`) picks in a choice
    that decides them all, as one C call (`operator.itemgetter`), as a tuple whatever their number."""
    if len(ids) >= 2:
        return operator.itemgetter(*ids)
    return lambda choice: tuple(choice[j] for j in ids)
