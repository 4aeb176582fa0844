"""Pipeline schedules as static tick tables: who runs which micro-batch's forward or backward when.

A schedule is built in two steps. `_device_orders` lists, per device, the order in which it runs
its operations (`F` forward, `B` backward) of each micro-batch on each of its model chunks: GPipe
(all forwards, then all backwards), 1F1B (`S - s - 1` warm-up forwards on stage `s`, then one
forward and one backward in turn, then the remaining backwards), or Megatron's interleaved 1F1B
(`v` chunks per device, micro-batches in groups of `S`). `_simulate` then plays those orders on a
clock of unit ticks (one chunk's forward or backward per tick): each device runs its next operation
as soon as its inputs arrived at an earlier tick, and idles otherwise. The resulting table is what
the SPMD program executes, tick by tick, and what the bubble fraction is read from.

Zero bubble (`"zb-h1"`, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ZB-H1): the backward
is split into `B` (the gradient of the chunk's input, which the previous stage waits for) and `W`
(the gradient of the chunk's parameters, which nobody waits for); forwards and `B`s follow 1F1B's
order, and a device that would idle runs a pending `W` instead. As in 1F1B, stage `s` holds at
most `S - s` micro-batches (a micro-batch is held from its forward to its `W`), so memory is
1F1B's; with forward, `B` and `W` one tick each the bubble is `(S - 1) / (3M + S - 1)`, a third of
1F1B's idle time (`_simulate_zero_bubble`).

`Schedule.permutes` says which `collective-permute`s each tick needs, each with exactly the
`(source, target)` pairs whose source sends at that tick (a stage idle at a tick, or running a
backward of the first stage or a forward of the last, leaves the pairs): none where nothing
crosses, one permute where every device sends and receives at most one value (a forward's output or
a backward's input gradient: 1F1B's steady state, neighbours swapping), else forward and backward
apart. `segments` groups consecutive ticks of one repeating pair pattern into loops, and a loop body
position permutes what all its repeats need; the cut is the fewest sends first, the fewest loops
second, so every device sends exactly what it must (`Schedule.sends`); interleaved, whose ticks
seldom repeat, takes the fewest loops in which no device sends more than 1.1x what must cross
(`_bounded_loops`: 5 loops at S = 4, M = 16 where exact pairs take 38).

Virtual stage `j` (`0 <= j < S * v`) runs on device `j % S` as its chunk `j // S`; with `v = 1` a
virtual stage is a stage.
"""

from __future__ import annotations

import dataclasses
import functools
import html
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")

# What a device does at a tick, as the program's `lax.switch` index.
IDLE, FORWARD, BACKWARD, WEIGHTS = range(4)
_KIND_CODE = {"F": FORWARD, "B": BACKWARD, "W": WEIGHTS}

# `Schedule.svg`'s colours: forward, backward (zero bubble: its `B`), zero bubble's `W`, idle.
KIND_COLOURS = {"F": "#80b1d3", "B": "#fdb462", "W": "#b3de69", ".": "#e5e5e5"}
_KIND_NAMES = {"F": "forward", "B": "backward (B: input gradient)", "W": "W: weight gradient", ".": "idle"}

# The kinds of a permute (`Schedule.permutes`, the word before its pairs): forwards' outputs (stage s
# to s + 1), backwards' input gradients (s + 1 to s), or each source either, as it ran ("FB").
PERMUTE_KINDS = ("F", "B", "FB")


class Op(NamedTuple):
    """One operation: `kind` "F" (forward), "B" (backward; with zero bubble only the input's
    gradient) or "W" (zero bubble: the parameters' gradient), on virtual stage `vstage`, for
    micro-batch `micro`."""

    kind: str
    vstage: int
    micro: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static tick table for `stages` devices, `micro_batches` micro-batches, `virtual` chunks each.

    Attributes:
      name: `"gpipe"`, `"1f1b"`, `"interleaved"` or `"zb-h1"`.
      stages: S, the pipeline devices (stage groups).
      micro_batches: M.
      virtual: v, model chunks per stage (1 unless interleaved).
      forward_only: an inference schedule (forwards only).
      ops: `ops[t][s]` is the `Op` stage `s` runs at tick `t`, or None (idle).
    """

    name: str
    stages: int
    micro_batches: int
    virtual: int
    forward_only: bool
    ops: tuple[tuple[Op | None, ...], ...]

    @property
    def ticks(self) -> int:
        return len(self.ops)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stage-ticks (every operation one tick: forward and backward cost alike)."""
        busy = sum(op is not None for row in self.ops for op in row)
        return 1.0 - busy / (self.ticks * self.stages)

    @property
    def split_backward(self) -> bool:
        """Whether backwards are split into `B` (input gradient) and `W` (parameter gradient)."""
        return self.name == "zb-h1" and not self.forward_only

    @property
    def theoretical_bubble(self) -> float:
        """(S - 1) / (v·M + S - 1): GPipe and 1F1B at v = 1; interleaving divides the bubble by ~v;
        zero bubble (ZB-H1, forward, `B` and `W` a tick each): (S - 1) / (3M + S - 1)."""
        s, m, v = self.stages, self.micro_batches, self.virtual
        return (s - 1) / (3 * m + s - 1) if self.split_backward else (s - 1) / (v * m + s - 1)

    def codes(self) -> np.ndarray:
        """`[ticks, stages]` int32 operation codes (`IDLE`, `FORWARD`, `BACKWARD`, `WEIGHTS`)."""
        out = np.zeros((self.ticks, self.stages), np.int32)
        for t, row in enumerate(self.ops):
            for s, op in enumerate(row):
                if op is not None:
                    out[t, s] = _KIND_CODE[op.kind]
        return out

    def field(self, name: str) -> np.ndarray:
        """`[ticks, stages]` int32: each operation's chunk (`"chunk"`) or micro-batch (`"micro"`)."""
        out = np.zeros((self.ticks, self.stages), np.int32)
        for t, row in enumerate(self.ops):
            for s, op in enumerate(row):
                if op is not None:
                    out[t, s] = op.vstage // self.stages if name == "chunk" else op.micro
        return out

    def running(self, ticks: Sequence[int]) -> frozenset[tuple[int, int]]:
        """`(code, vstage)` of every operation some stage runs at one of `ticks` (`(IDLE, -1)` where
        a stage idles): all that a program's loop body position over those ticks can be asked to
        run (`Running`), so it compiles only those operations.

        Examples:
          >>> s = build_schedule("1f1b", stages=2, micro_batches=2)
          >>> sorted(s.running([0])), sorted(s.running([4, 5]))  # the fill's first tick, the drain
          ([(0, -1), (1, 0)], [(0, -1), (2, 0), (2, 1)])
        """
        return frozenset((IDLE, -1) if op is None else (_KIND_CODE[op.kind], op.vstage)
                         for t in ticks for op in self.ops[t])

    def receives(self, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What arrives at each stage at the end of each tick from its neighbour: `(valid, chunk,
        micro)`, each `[ticks, stages]` int32. `kind="F"`: activations from the previous virtual
        stage; `"B"`: gradients from the next one."""
        valid, chunk, micro = (np.zeros((self.ticks, self.stages), np.int32) for _ in range(3))
        for t, op, s in self._sends(kind):
            j = op.vstage + (1 if kind == "F" else -1)
            to = j % self.stages
            valid[t, to], chunk[t, to], micro[t, to] = 1, j // self.stages, op.micro
        return valid, chunk, micro

    def _sends(self, kind: str):
        last = self.stages * self.virtual - 1
        for t, row in enumerate(self.ops):
            for s, op in enumerate(row):
                if op is not None and op.kind == kind and op.vstage != (last if kind == "F" else 0):
                    yield t, op, s

    def slots(self, what: str) -> int:
        """Buffer slots per chunk that one kind of stored value needs (slot = micro-batch mod slots).

        `what`: `"activations"` (received from the previous stage, until this stage's forward reads
        them), `"residuals"` (saved by a forward for its backward) or `"gradients"` (received from
        the next stage, until the backward reads them). With a split backward, residuals and
        gradients live on until the `W`. The slots are the fewest for which no two live values of
        one chunk on one stage share a slot.
        """
        when = {(op.kind, op.vstage, op.micro): t for t, row in enumerate(self.ops) for op in row if op is not None}
        end = "W" if self.split_backward else "B"
        lives: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        if what == "residuals":
            spans = [(op.vstage, op.micro, t, when.get((end, op.vstage, op.micro), t))
                     for t, row in enumerate(self.ops) for op in row if op is not None and op.kind == "F"]
        else:
            kind = "F" if what == "activations" else "B"
            step = 1 if kind == "F" else -1
            spans = [(op.vstage + step, op.micro, t, when["F" if kind == "F" else end, op.vstage + step, op.micro])
                     for t, op, _ in self._sends(kind)]
        for j, micro, start, end in spans:
            lives.setdefault((j % self.stages, j // self.stages), []).append((start, end, micro))
        for k in range(1, self.micro_batches + 1):
            if all(_fits(v, k) for v in lives.values()):
                return k
        return self.micro_batches

    def permutes(self) -> tuple[tuple[str, ...], ...]:
        """Per tick, the `collective-permute`s the program runs at it, each named `"KIND a>b c>d"`:
        its kind (`PERMUTE_KINDS`) and its `(source, target)` stage pairs (`pairs`). None where
        nothing crosses; one where each device sends and receives at most one value at that tick
        in every repeat of its loop, else a forward and a backward one.

        Examples:
          >>> build_schedule("1f1b", stages=3, micro_batches=3).permutes()[:6]
          (('F 0>1',), ('F 0>1 1>2',), ('F 0>1 1>2',), ('B 2>1',), ('B 1>0',), ('FB 1>2 2>1',))
        """
        return tuple(pattern for _, repeats, body in self.segments() for _ in range(repeats) for pattern in body)

    def tick_permutes(self) -> tuple[tuple[str, ...], ...]:
        """Per tick, the fewest permutes that tick needs on its own, each with only the pairs that
        send at it: the floor of a program that permutes tick by tick (`permutes` equals it where
        every loop's repeats send alike, which `segments` keeps to).

        Examples:
          >>> s = build_schedule("gpipe", stages=4, micro_batches=4)
          >>> s.tick_permutes() == s.permutes(), s.sends().tolist()
          (True, [4, 8, 8, 4])
        """
        return tuple(self._cover(n) for n in self._needed)

    def sends(self, permutes: tuple[tuple[str, ...], ...] | None = None) -> np.ndarray:
        """`[stages]` int: how many values each stage sends over the ticks of `permutes` (by default
        `self.permutes()`), one per permute in which it is a source. What must cross is `M` per
        boundary and direction, so an inner stage of a one-chunk schedule sends `2M` (`v·2M`
        interleaved), an end stage `M`."""
        out = np.zeros(self.stages, np.int64)
        for tick in self.permutes() if permutes is None else permutes:
            for name in tick:
                for source, _ in self.pairs(name):
                    out[source] += 1
        return out

    def pairs(self, name: str) -> set[tuple[int, int]]:
        """The `(source, target)` stage pairs of permute `name` (`"F 0>1 1>2"`; a bare `"F"` or `"B"`
        is every stage sending forward or backward to its neighbour)."""
        kind, *given = name.split()
        if given:
            return {tuple(int(x) for x in pair.split(">")) for pair in given}
        s = self.stages
        ring = range(s if self.virtual > 1 else s - 1)
        return {(i, (i + 1) % s) if kind == "F" else ((i + 1) % s, i) for i in ring}

    @staticmethod
    def kind(name: str) -> str:
        """The kind (`PERMUTE_KINDS`) of permute `name`."""
        return name.split()[0]

    def _cover(self, want: frozenset) -> tuple[str, ...]:
        """The permutes carrying `want`, `(source, target, kind)` sends: one where sources and
        targets are each distinct, else forward and backward apart (each direction's pairs are)."""
        if not want:
            return ()
        pairs = {(a, b) for a, b, _ in want}
        if len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs}):
            kinds = {k for _, _, k in want}
            return (_name("FB" if len(kinds) > 1 else kinds.pop(), pairs),)
        return tuple(_name(k, {(a, b) for a, b, kk in want if kk == k}) for k in ("F", "B"))

    @functools.cached_property
    def _needed(self) -> tuple[frozenset, ...]:
        """Per tick, the `(source, target, kind)` sends of that tick (kind "F" or "B")."""
        needed: list[set[tuple[int, int, str]]] = [set() for _ in range(self.ticks)]
        for kind, step in (("F", 1), ("B", -1)):
            for t, _, s in self._sends(kind):
                needed[t].add((s, (s + step) % self.stages, kind))
        return tuple(frozenset(n) for n in needed)

    @functools.cached_property
    def _segments(self):
        if self.virtual == 1:
            return _cheapest_loops(list(self._needed), self._cover, _EXACT)
        return _bounded_loops(list(self._needed), self._cover, self.stages, _SLACK * 2 * self.micro_batches * self.virtual)

    def segments(self) -> tuple[tuple[int, int, tuple[tuple[str, ...], ...]], ...]:
        """The ticks as loops of one repeating permute pattern: `(start, repeats, pattern)`, where
        the loop runs `repeats` times over `len(pattern)` ticks from tick `start`, and `pattern[k]`
        is the permutes of its `k`-th tick, one pattern for every repeat. The cut sends the fewest
        values (so a loop's repeats send alike, and no device sends at a tick where it has nothing
        to send), then runs the fewest permutes, then has the fewest loops and body ticks (code
        size). Fill and drain ticks differ from one another, so each stands alone (a loop of one
        trip, which XLA inlines): at S = 4, M = 16 GPipe and 1F1B are 12 and 14 loops, against 4
        each for a cut that permuted every pair of a pattern at every tick (about twice the compile
        time, +0.3% / +0.6% temp memory on the reference GPT). Interleaved, whose ticks seldom
        repeat (exact pairs take 38 loops at S = 4, M = 16), takes the fewest loops in which no
        device sends more than `_SLACK` (1.1) times what must cross, `2·M·v` (`_bounded_loops`):
        5 loops at S = 4, M = 16, 11 at M = 4, 3 and 1 at S = 2."""
        return self._segments

    def table(self) -> str:
        """The schedule as text: one row per stage, one column per tick; `F3` is micro-batch 3's
        forward, `b3` its backward, `.` idle; with chunks, `F3:1` is chunk 1.

        Examples:
          >>> print(build_schedule("gpipe", stages=2, micro_batches=2).table())
          tick     0   1   2   3   4   5
          stage 0  F0  F1  .   .   B0  B1
          stage 1  .   F0  F1  B0  B1  .
        """
        cells = [[_cell(op, self.stages, self.virtual) for op in row] for row in self.ops]
        width = max(3, *(len(c) + 1 for row in cells for c in row))
        head = "tick     " + "".join(f"{t:<{width}}" for t in range(self.ticks))
        lines = [head.rstrip()]
        for s in range(self.stages):
            lines.append((f"stage {s:<3}" + "".join(f"{row[s]:<{width}}" for row in cells)).rstrip())
        return "\n".join(lines)

    def picture(self, width: int | None = None) -> str:
        """One character per tick and stage: `F` forward, `B` backward, `.` idle; with `width`, no
        line longer than that: a longer schedule is drawn in blocks of ticks, each headed by its ticks.

        Examples:
          >>> print(build_schedule("1f1b", stages=2, micro_batches=3).picture())
          stage 0 |FF.BFB.B|
          stage 1 |.FBFBFB.|
          >>> print(build_schedule("1f1b", stages=2, micro_batches=3).picture(width=14))
          ticks 0-3
          stage 0 |FF.B|
          stage 1 |.FBF|
          ticks 4-7
          stage 0 |FB.B|
          stage 1 |BFB.|
        """
        marks = ["".join("." if row[s] is None else row[s].kind for row in self.ops) for s in range(self.stages)]
        ticks = len(self.ops)
        label = len(f"stage {self.stages - 1} ||")
        per = ticks if width is None else max(1, width - label)
        blocks = []
        for start in range(0, max(ticks, 1), per):
            end = min(start + per, ticks)
            head = [] if per >= ticks else [f"ticks {start}-{end - 1}"]
            blocks += head + [f"stage {s} |{m[start:end]}|" for s, m in enumerate(marks)]
        return "\n".join(blocks)

    def svg(self, cell: int = 22) -> str:
        """The table as an SVG picture, ticks across and stages down, `cell` pixels a tick: each
        operation a box coloured by its kind (`KIND_COLOURS`: forward, backward or zero bubble's `B`,
        `W`, idle) and labelled as in `table`; a legend of the kinds present under it. A notebook
        shows a `Schedule` as this picture (`_repr_svg_`); no plotting library is needed.

        Examples:
          >>> zb = build_schedule("zb-h1", stages=2, micro_batches=2)
          >>> picture = zb.svg()  # a box per tick and stage, and the legend's four kinds
          >>> picture.count("<rect") == zb.ticks * zb.stages + 4, "W: weight gradient" in picture
          (True, True)
        """
        label, top, h = 58, 34, cell * 0.8
        title = (f"{self.name}: S={self.stages}, M={self.micro_batches}"
                 f"{f', v={self.virtual}' if self.virtual > 1 else ''}, bubble {self.bubble_fraction:.3f}")
        parts = [_svg_text(0, 14, title, "start")]
        parts += [_svg_text(label + (t + 0.5) * cell, top - 6, str(t)) for t in range(0, self.ticks, 5)]
        for s in range(self.stages):
            y = top + s * h
            parts.append(_svg_text(label - 6, y + h / 2 + 4, f"stage {s}", "end"))
            for t, row in enumerate(self.ops):
                op, x = row[s], label + t * cell
                parts.append(f'<rect x="{x}" y="{y:.1f}" width="{cell}" height="{h:.1f}" '
                             f'fill="{KIND_COLOURS[op.kind if op else "."]}" stroke="white"/>')
                if op is not None:
                    parts.append(_svg_text(x + cell / 2, y + h / 2 + 3, _cell(op, self.stages, self.virtual), size=7))
        kinds = [k for k in KIND_COLOURS if any((op.kind if op else ".") == k for row in self.ops for op in row)]
        y, x = top + self.stages * h + 10, label
        for k in kinds:
            parts.append(f'<rect x="{x}" y="{y:.1f}" width="10" height="10" fill="{KIND_COLOURS[k]}"/>')
            parts.append(_svg_text(x + 14, y + 9, _KIND_NAMES[k], "start"))
            x += 24 + 6.6 * len(_KIND_NAMES[k])
        width = max(label + self.ticks * cell, x, 7 * len(title)) + 4
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y + 16:.0f}" '
                f'font-family="sans-serif" font-size="11">' + "".join(parts) + "</svg>")

    def _repr_svg_(self) -> str:
        return self.svg()


def _svg_text(x: float, y: float, text: str, anchor: str = "middle", size: int | None = None) -> str:
    font = f' font-size="{size}"' if size else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{font}>{html.escape(text)}</text>'


def _name(kind: str, pairs) -> str:
    return " ".join([kind, *(f"{a}>{b}" for a, b in sorted(pairs))])


def _cheapest_loops(needed: list[frozenset], cover, weights: tuple[Any, float], body: float = 0.5,
                    covers: dict | None = None) -> tuple:
    """Dynamic programming over the ticks: cut them into loops of period 1 to 3, each body position
    permuting `cover` of what its repeats need, for the least cost: `weights = (send, permute)` per
    send (a pair of a permute, per execution; a float, or a sequence of one weight per source
    stage) and per permute execution, plus 3/2 per loop and `body` per body tick after its first.
    `_EXACT`: the fewest sends, then permutes, then loops. `covers` keeps each union's permutes and
    their sources between calls."""
    send_weight, permute_weight = weights
    by_source = send_weight if isinstance(send_weight, Sequence) else None
    covers = {} if covers is None else covers

    def priced(u):
        if u not in covers:
            names = cover(u)
            covers[u] = (names, [int(pair.split(">")[0]) for name in names for pair in name.split()[1:]])
        names, sources = covers[u]
        sends = send_weight * len(sources) if by_source is None else sum(by_source[k] for k in sources)
        return names, sends + permute_weight * len(names)

    n = len(needed)
    best: list[tuple[float, tuple]] = [(float("inf"), ())] * n + [(0.0, ())]
    for t in range(n - 1, -1, -1):
        for period in (1, 2, 3):
            unions = [frozenset()] * period
            for repeats in range(1, (n - t) // period + 1):
                base = t + (repeats - 1) * period
                unions = [u | needed[base + k] for k, u in enumerate(unions)]
                if repeats == 1 and period > 1:
                    continue  # the same ticks as `period` loops of one
                positions = [priced(u) for u in unions]
                pattern = tuple(names for names, _ in positions)
                cost = repeats * sum(c for _, c in positions) + 1.5 + (period - 1) * body + best[t + repeats * period][0]
                if cost < best[t][0]:
                    best[t] = (cost, ((t, repeats, pattern), *best[t + repeats * period][1]))
    return best[0][1]


def _bounded_loops(needed: list[frozenset], cover, stages: int, bound: float) -> tuple:
    """The cheapest loops (`_cheapest_loops`) in which no stage sends more than `bound` values: a
    send starts at a fifth of a loop, and the weight of each stage that sends too much grows by a
    quarter until none does (exact pairs, the floor, always fit: a stage never needs to send more
    than what must cross). Stages with room to spare keep their cheap sends, so the end stages of
    an interleaved fill and drain share loops with the inner ones. A body of several ticks weighs
    2 loops a tick after its first: such a body keeps more temporary memory live (about 2% on the
    stacked reference GPT at S = 2, M = 4), so it is taken only where it saves several loops."""
    weights, covers = [0.2] * stages, {}
    for _ in range(64):
        segments = _cheapest_loops(needed, cover, (weights, 0.02), body=2.0, covers=covers)
        sends = np.zeros(stages, np.int64)
        for _, repeats, pattern in segments:
            for names in pattern:
                for name in names:
                    for pair in name.split()[1:]:
                        sends[int(pair.split(">")[0])] += repeats
        over = sends > bound
        if not over.any():
            return segments
        weights = [w * 1.25 if o else w for w, o in zip(weights, over)]
    return _cheapest_loops(needed, cover, _EXACT)


# `_cheapest_loops`' weights (send, permute) for one-chunk schedules: a send outweighs any number of
# permutes, a permute any loop structure (GPipe, 1F1B, zero bubble). Interleaved (`_bounded_loops`)
# lets a stage send up to `_SLACK` times what must cross: its ticks seldom repeat, so exact pairs
# would take 38 loops at S = 4, M = 16 and 49 at S = 2, and each loop body compiles the operations its
# ticks run (`running`).
_EXACT, _SLACK = (1e6, 1e3), 1.1


def _fits(lives: list[tuple[int, int, int]], k: int) -> bool:
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for start, end, micro in lives:
        by_slot.setdefault(micro % k, []).append((start, end))
    for spans in by_slot.values():
        spans.sort()
        if any(b_start < a_end for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
            return False
    return True


def _cell(op: Op | None, stages: int, virtual: int) -> str:
    if op is None:
        return "."
    text = f"{op.kind}{op.micro}"
    return text + (f":{op.vstage // stages}" if virtual > 1 else "")


def build_schedule(name: str, *, stages: int, micro_batches: int, virtual: int = 1,
                   forward_only: bool = False) -> Schedule:
    """The tick table of schedule `name` (see the module docstring); inputs are checked by the caller.

    Examples:
      >>> s = build_schedule("1f1b", stages=4, micro_batches=8)
      >>> s.ticks, round(s.bubble_fraction, 4), round(s.theoretical_bubble, 4)
      (22, 0.2727, 0.2727)
    """
    orders = _device_orders(name, stages, micro_batches, virtual, forward_only)
    if name == "zb-h1" and not forward_only:
        return Schedule(name, stages, micro_batches, virtual, forward_only, _simulate_zero_bubble(orders, stages))
    return Schedule(name, stages, micro_batches, virtual, forward_only, _simulate(orders, stages * virtual))


def _device_orders(name, stages, micro, virtual, forward_only) -> list[list[Op]]:
    orders = []
    for s in range(stages):
        if name == "interleaved":
            fwd, bwd = _interleaved_orders(s, stages, micro, virtual)
            warm = min((stages - s - 1) * 2 + (virtual - 1) * stages, micro * virtual)
        else:
            fwd = [Op("F", s, i) for i in range(micro)]
            bwd = [Op("B", s, i) for i in range(micro)]
            warm = micro if name == "gpipe" else min(stages - s - 1, micro)
        if forward_only:
            orders.append(fwd)
            continue
        order = fwd[:warm]
        for k in range(len(fwd) - warm):
            order += [fwd[warm + k], bwd[k]]
        orders.append(order + bwd[len(fwd) - warm:])
    return orders


def _interleaved_orders(s, stages, micro, virtual) -> tuple[list[Op], list[Op]]:
    """Megatron's interleaved order: micro-batches in groups of `stages`, each group through every
    chunk in turn (forwards: chunk 0 first; backwards: the last chunk first)."""
    fwd, bwd = [], []
    for g in range(0, micro, stages):
        group = range(g, min(g + stages, micro))
        fwd += [Op("F", c * stages + s, i) for c in range(virtual) for i in group]
        bwd += [Op("B", c * stages + s, i) for c in reversed(range(virtual)) for i in group]
    return fwd, bwd


def _simulate(orders: list[list[Op]], vstages: int) -> tuple[tuple[Op | None, ...], ...]:
    """Plays each device's order on unit ticks; an operation runs once its inputs are done."""
    done: set[tuple[str, int, int]] = set()
    nxt = [0] * len(orders)
    ticks = []
    while any(n < len(o) for n, o in zip(nxt, orders)):
        row: list[Op | None] = []
        for s, order in enumerate(orders):
            op = order[nxt[s]] if nxt[s] < len(order) else None
            row.append(op if op is not None and _ready(op, done, vstages) else None)
        if all(op is None for op in row):
            raise RuntimeError(f"pipeline schedule deadlocked at tick {len(ticks)}: {orders}")
        for s, op in enumerate(row):
            if op is not None:
                nxt[s] += 1
        done.update(row_op for row_op in row if row_op is not None)
        ticks.append(tuple(row))
    return tuple(ticks)


def _simulate_zero_bubble(orders: list[list[Op]], stages: int) -> tuple[tuple[Op | None, ...], ...]:
    """ZB-H1 on unit ticks: each device runs its next forward or `B` (1F1B's order) once its inputs
    are done and, for a forward, while it holds fewer than `S - s` micro-batches (forward run, `W`
    not yet); otherwise the oldest `W` whose `B` is done; otherwise it idles."""
    done: set[tuple[str, int, int]] = set()
    nxt, held, pending = [0] * stages, [0] * stages, [[] for _ in range(stages)]
    ticks = []
    while any(n < len(o) for n, o in zip(nxt, orders)) or any(pending):
        row: list[Op | None] = []
        for s, order in enumerate(orders):
            op = order[nxt[s]] if nxt[s] < len(order) else None
            if op is not None and _ready(op, done, stages) and (op.kind == "B" or held[s] < stages):
                nxt[s] += 1
                held[s] += op.kind == "F"
                row.append(op)
            elif pending[s]:
                held[s] -= 1
                row.append(pending[s].pop(0))
            else:
                row.append(None)
        if all(op is None for op in row):
            raise RuntimeError(f"pipeline schedule deadlocked at tick {len(ticks)}: {orders}")
        done.update(op for op in row if op is not None)
        for s, op in enumerate(row):
            if op is not None and op.kind == "B":
                pending[s].append(Op("W", op.vstage, op.micro))
        ticks.append(tuple(row))
    return tuple(ticks)


def _ready(op: Op, done: set, vstages: int) -> bool:
    if op.kind == "F":
        return op.vstage == 0 or ("F", op.vstage - 1, op.micro) in done
    return ("F", op.vstage, op.micro) in done and (op.vstage == vstages - 1 or ("B", op.vstage + 1, op.micro) in done)
