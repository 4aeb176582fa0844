"""Sharding propagation: from the anchors, every other operator takes the layout that costs least.

MindSpore's `sharding_propagation`, over a flattened jaxpr. Anchors are the user's sharding
constraints (`jshard.shard` calls) and the arguments whose layout is fixed (`in_strategy`, the
batch). A breadth-first walk leaves each decided operator for its neighbours in both directions;
an operator takes the candidate strategy (one per known neighbour layout, and their merge) whose
cost is least: redistribution of its known operands and its own partial sums first (α–β seconds),
compute per device second. An operator whose inputs are still undecided waits for them while
anything else can move. Values used by several operators (a parameter) are laid out once, by the
first; the others redistribute. Operators no walk reaches, and primitives without a rule, stay
replicated and are counted (`Plan.coverage`). After the walk, an operator that leaves partial sums
and whose users all took its result in one finer layout sums into that layout where it is cheaper
(an embedding gradient's scatter-add all-reduces its vocabulary slice, not the whole table); then,
walking back, an operator whose users all take its results in another layout makes them in that
layout where moving its inputs costs less than moving its results (a batch norm's backward
broadcast of a vector cut over the channels, where the activations it meets are cut over the
batch: the vector is gathered, not the activation moved); then an operator that made a value
whole where every user slices it one way makes it in that layout where nothing more moves (a
dropout mask's random bits drawn from a scalar key, an embedding gradient scattered from updates
gathered over the batch); last, partial sums are summed again into their users' layout, as that
walk back has cut those users finer (an embedding gradient through the optimizer's elementwise
update into a parameter cut over the vocabulary: its users made whole from it before the walk back,
in the parameter's cut after it, so it all-reduces its slice, not the table).
The greedy walk's choices for free arguments and a default-cut batch are weighed again over the
whole program by `propagate_globally` (`_global.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import re
from collections.abc import Collection, Mapping, Sequence

from jax.extend import core as jcore

from jshard.cost import Comm, CostModel, array_of, local_bytes, redistribution
from jshard.graph import CONSTRAINT, JSHARD_SCOPE, Node
from jshard.layouts import Spec, constraint_spec
from jshard.propagate._assignments import keeps_cut, merge_reads, read_together
from jshard.propagate._charges import charge_constraints, unpriced_dead
from jshard.propagate._manual import MANUAL, manual_comms, manual_seconds, manual_specs
from jshard.propagate._result import Decision, Rejected, Result
from jshard.rules import Factors, OpTable, expressible, neighbours_of, read_assignment, shape_of, write_spec

_SHARD_SCOPE = JSHARD_SCOPE + "shard"
"""The scope prefix of a `shard` call's constraints (`jshard_shard<k>`)."""
_SHARD_CALL = re.compile(_SHARD_SCOPE + r"\d+")
"""One `shard` call's scope (`jshard_shard<k>`): the operators inside it carry it too."""


class Engine:
    """One propagation over `nodes` on a mesh with axes `axis_size`."""

    def __init__(self, nodes: Sequence[Node], axis_size: Mapping[str, int], cost: CostModel | None = None,
                 table: OpTable | None = None, memo: dict | None = None):
        """`table`: the nodes' `OpTable`, where one is at hand; `memo`: the choices of earlier runs
        over the same `table` (an operator met in the same layouts is not chosen again)."""
        self.nodes, self.axis_size, self.cost = nodes, dict(axis_size), cost or CostModel()
        self.table = table or OpTable(nodes)
        t = self.table
        self.factors, self.vars, self.unruled = t.factors, t.vars, t.unruled
        self.producer, self.consumers = t.producer, t.consumers
        self.values: dict = {}
        self.why: dict = {}
        self.decisions: dict[int, Decision] = {}
        self.entered: set[int] = set()
        self._memo: dict = {} if memo is None else memo
        self.invariant = _invariants(nodes)
        self.moved: dict[int, float] = {}  # memory traffic per operator (`OpTable.traffic`), set by `run`

    def run(self, anchors: Mapping, outputs: Collection = ()) -> Result:
        """Propagates from `anchors` (var → `Spec`: fixed arguments) and the constraints; `outputs`,
        the program's results, keep the layout they are made in."""
        queue: collections.deque[int] = collections.deque()
        self.moved = self.table.traffic(outputs) if self.cost.memory_bandwidth else {}
        for v, spec in anchors.items():
            self.values[v] = spec
            self.why[v] = "peak" if v in self.producer else "arg"  # a value made finer for the memory peak
            queue.extend(i for i, _ in self.consumers[v])
        for i, node in enumerate(self.nodes):
            fix = {CONSTRAINT: self._fix_constraint, MANUAL: self._fix_manual}.get(node.primitive)
            if fix is not None:  # a constraint, or a manual region laid out by its own specs
                fix(i, node)
                queue.extend(self._neighbours(i))
        waiting: list[int] = []  # a heap: the earliest waiting operator goes first
        while True:
            while queue:
                i = queue.popleft()
                if i in self.decisions or i in self.unruled:
                    continue
                if self._waits(i):
                    heapq.heappush(waiting, i)
                    continue
                if self._decide(i):
                    queue.extend(self._neighbours(i))
                    if i not in self.decisions:
                        queue.append(i)  # entered a loop: leave it once its body is planned
            while waiting and not queue:
                i = heapq.heappop(waiting)  # one without known operands comes back when a neighbour decides
                if i not in self.decisions and self._decide(i):
                    queue.extend(self._neighbours(i))
                    if i not in self.decisions:
                        queue.append(i)
            if not queue:
                break
        kept = {v for v in outputs if isinstance(v, jcore.Var)}
        self._sum_into_users(kept)
        self._made_as_used(kept)
        self._cut_at_source(kept)
        self._sum_into_users(kept)  # the users the walk back cut finer: their partial sums summed so
        result = Result(self.decisions, self.values, self.unruled)
        # An operator that decided priced its output's way into a constraint; an argument, or
        # another constraint (one `shard` call's output into the next one's input), did not.
        charge_constraints(self.nodes, result, self.axis_size, self.cost, priced=self._priced)
        unpriced_dead(self.nodes, result, outputs)
        return result

    def _fix_constraint(self, i: int, node: Node) -> None:
        out = node.outputs[0]
        spec = constraint_spec(node.eqn.params["sharding"], len(shape_of(out)))
        self.values[out] = spec
        self.why[out] = i
        self.decisions[i] = Decision((spec,), (spec,), (), 0.0, "user", None, False)

    def _fix_manual(self, i: int, node: Node) -> None:
        self.decisions[i] = self.manual(i, node)

    def manual(self, i: int, node: Node) -> Decision:
        """A `shard_map` region's decision: its results made in its `out_specs` (recorded as the
        values' layouts), its body's collectives its cost; its operands' moves into its
        `in_specs` are charged after the walk (`charge_constraints`)."""
        ins, outs = manual_specs(node.eqn)
        for v, spec in zip(node.outputs, outs):
            self.values[v] = spec
            self.why[v] = i
        comms = manual_comms(node.eqn)
        seconds = manual_seconds(comms, self.axis_size, self.cost) * node.weight
        return Decision(ins, outs, comms, seconds, "user", None, False)

    def _neighbours(self, i: int) -> list[int]:
        ins, outs = self.vars[i]
        found = [j for v in outs if isinstance(v, jcore.Var) for j, _ in self.consumers[v]]
        found += [self.producer[v] for v in ins if isinstance(v, jcore.Var) and v in self.producer]
        found += [j for v in ins if isinstance(v, jcore.Var) and v not in self.producer for j, _ in self.consumers[v]]
        return [j for j in found if j not in self.decisions]

    def _waits(self, i: int) -> bool:
        ins, _ = self.vars[i]
        if self.nodes[i].bodies and i not in self.entered:
            ins = list(self.nodes[i].inputs)  # a loop is entered from its outer operands alone
        return any(
            isinstance(v, jcore.Var) and v not in self.values and v in self.producer
            and self.producer[v] not in self.decisions
            for v in ins
        )

    def _known(self, i: int) -> list[tuple[int, Spec, str]]:
        """`(operand index, layout, where from)` for each operand whose layout is already fixed."""
        ins, outs = self.vars[i]
        known = []
        for k, v in enumerate(ins):
            if isinstance(v, jcore.Var) and v in self.values:
                known.append((k, self.values[v], self._source(v)))
        for k, v in enumerate(outs):
            if self._provisional(i, v):
                continue  # the loop's own guess: its body's users were charged from it (`_settle`)
            if v in self.values:
                known.append((len(ins) + k, self.values[v], self._source(v)))
                continue
            for j, pos in self.consumers.get(v, ()):
                if j in self.decisions:
                    known.append((len(ins) + k, self.decisions[j].in_specs[pos], str(j)))
                    break
        return known

    def _priced(self, v) -> bool:
        j = self.producer.get(v)
        return j in self.decisions and self.nodes[j].primitive != CONSTRAINT

    def _provisional(self, i: int, v) -> bool:
        """Whether `v` is a body parameter of loop `i` laid out only by entering it: the layout the
        loop guessed from its outer operands, not a neighbour's decision. Leaving the loop, its body's
        users say what the parameter must be, and the loop's choice lays it out (`_settle`)."""
        return i in self.entered and self.why.get(v) == i

    def _settle(self, i: int, outs, out_specs) -> None:
        """Lays out the body parameters loop `i` guessed on entry as it decided, and restates the
        redistribution its body's users were charged from the guess."""
        for v, spec in zip(outs, out_specs):
            if self._provisional(i, v) and self.values[v] != spec:
                self._relayout(v, spec)

    def move_at_start(self, v, spec: Spec) -> None:
        """Argument `v` arrives laid out as `spec`: its users, who took it as the run laid it out,
        are charged its move from `spec` (once per layout: `share_moves`, after)."""
        self._relayout(v, spec)
        self.why[v] = "arg"

    def _relayout(self, v, spec: Spec) -> None:
        """Lays out `v` as `spec` after its users decided: each user's charge for moving `v` into
        the layout it takes is restated from the new layout."""
        old, self.values[v] = self.values[v], spec
        for j, pos in self.consumers.get(v, ()):
            d = self.decisions.get(j)
            if d is None:
                continue
            comms = list(d.comms)
            for c in redistribution(*array_of(v), old, d.in_specs[pos], self.axis_size, self.cost.alltoall):
                if c in comms:  # a later user's charge for a move an earlier one paid was dropped
                    comms.remove(c)
            comms += redistribution(*array_of(v), spec, d.in_specs[pos], self.axis_size, self.cost.alltoall)
            seconds = self._paid(j, comms)
            self.decisions[j] = dataclasses.replace(d, comms=tuple(comms), seconds=seconds)

    def _sum_into_users(self, outputs: set) -> None:
        """Partial sums summed into the layout their users take. An operator that leaves partial
        sums decides before its users do, from its inputs alone, and sums them in the layout those
        give (an embedding gradient's scatter-add: the whole table). Where every user then takes the
        sum in one finer layout (the table cut over the vocabulary), summing in that layout is
        cheaper: the all-reduce moves the device's own slice, and the slicing it saves was free.
        The operator takes it where its α–β seconds are less; its old layouts are the rejected
        alternative. A program result keeps its layout."""
        for i in sorted(self.decisions):
            f, d = self.factors.get(i), self.decisions[i]
            if f is None or not f.reduced or self.nodes[i].bodies or self.nodes[i].primitive == CONSTRAINT:
                continue
            ins, outs = self.vars[i]
            wanted = self._users_layout(outs, outputs)
            a = self._assignment(f, d)
            if wanted is None or wanted == d.out_specs or a is None or not any(a.get(g) for g in f.reduced):
                continue
            finer = dict(a)
            for dims, spec in zip(f.outputs, wanted):
                finer.update(read_assignment(dims, spec, f.sizes, self.axis_size) or {})
            if not self._refines(f, a, finer, d.out_specs, wanted):
                continue
            relaid = self._relaid_inputs(i, f, finer, d)
            if relaid is None:
                continue
            in_specs, known = relaid
            known += [(len(ins) + k, spec, "") for k, spec in enumerate(wanted)]
            old, new = self.score(i, f, a, known), self.score(i, f, finer, known)
            if new[:2] >= old[:2]:
                continue
            self.decisions[i] = dataclasses.replace(
                d, in_specs=in_specs, out_specs=wanted, comms=new[2], seconds=new[0], implied=False,
                rejected=Rejected(d.in_specs, d.out_specs, d.seconds))
            for v, spec in zip(outs, wanted):
                self._relayout(v, spec)

    def _made_as_used(self, outputs: set) -> None:
        """Values made in one layout and taken by every user in another: made in the users' layout
        instead, where moving the operator's inputs there costs less than moving its results. An
        operator decides from its known neighbours, often its inputs alone: in a batch norm's
        backward pass, the broadcast of a per-channel vector cut over the channels (as the
        sharded scale is) makes a whole activation cut so, and the elementwise operators after it
        follow, while the activations they meet and the users of their results are cut over the
        batch; each then moves an activation (an all-to-all) where gathering the vector would do.
        A convolution's backward pass reverses a sharded kernel where it lies and gathers the
        reversed copy, where the gather of the kernel its forward pass made would do.
        Walking back from the users, such an operator takes its users' layout where its moves
        there (its inputs' less those another operator makes already, its partial sums') cost less
        than it and its users paid before; its producers are weighed after it, against their users'
        new layouts. A program result keeps its layout."""
        for i, f, d, outs, wanted in self._relaid_outputs(outputs):
            a = read_together(f.outputs, wanted, f.sizes, self.axis_size)
            if (a is None or not expressible(f, a, self.axis_size)
                    or any(write_spec(dims, a, f.sizes, self.axis_size) != w for dims, w in zip(f.outputs, wanted))):
                continue
            relaid = self._relaid_inputs(i, f, a, d)
            if relaid is None:
                continue
            in_specs, known = relaid
            seconds, _, comms, _ = self.score(i, f, a, known)
            before = d.seconds - self._moved_already(i, d.in_specs) + sum(
                self._users_pay(v, old, spec) for v, old, spec in zip(outs, d.out_specs, wanted))
            if seconds - self._moved_already(i, in_specs) >= before * (1 - 1e-9):
                continue
            self.decisions[i] = dataclasses.replace(
                d, in_specs=in_specs, out_specs=wanted, comms=comms, seconds=seconds, via="",
                rejected=Rejected(d.in_specs, d.out_specs, before), implied=not comms and self.implied(i, f, a))
            for v, spec in zip(outs, wanted):
                self._relayout(v, spec)

    def _paid(self, i: int, comms: Sequence[Comm]) -> float:
        """Seconds operator `i` pays for `comms`, as often as it runs."""
        return self.nodes[i].weight * sum(self.cost.time(c, self.axis_size) for c in comms)

    def _users_pay(self, v, src: Spec, dst: Spec) -> float:
        """Seconds `v`'s users are charged for moving it from `src` into `dst`."""
        moved = redistribution(*array_of(v), src, dst, self.axis_size, self.cost.alltoall)
        paid = 0.0
        for j, _ in self.consumers.get(v, ()):
            comms = self.decisions[j].comms
            paid += self._paid(j, [c for c in moved if c in comms])
        return paid

    def _moved_already(self, i: int, in_specs: Sequence[Spec]) -> float:
        """Seconds of operator `i`'s input moves into `in_specs` that another operator, as often,
        makes already (XLA moves one value into one layout once: `share_moves`)."""
        node, saved = self.nodes[i], 0.0
        for v, dst in zip(self.vars[i][0], in_specs):
            src = self.values.get(v) if isinstance(v, jcore.Var) else None
            if src is None or src == dst:
                continue
            if any(j != i and j in self.decisions and self.decisions[j].in_specs[pos] == dst
                   and self.nodes[j].weight == node.weight for j, pos in self.consumers.get(v, ())):
                moved = redistribution(*array_of(v), src, dst, self.axis_size, self.cost.alltoall)
                saved += self._paid(i, moved)
        return saved

    def _cut_at_source(self, outputs: set) -> None:
        """Values made whole where every user slices them: made in the users' layout instead. An
        operator decides from its known neighbours; where none is cut (a dropout mask's random bits
        from a scalar key, a zero table broadcast from a scalar), it makes the value whole and the
        elementwise operators after it follow, so every device holds and computes all of it while
        its user (the `select_n` that applies the mask) takes a slice. Walking back from the users,
        an operator whose users all take its results in one finer layout, and which can work in it
        without moving anything more (its inputs sliced locally, no partial sums), takes that layout; its
        own producers then see it take their values finer. An operator that moves its inputs (the
        embedding gradient's scatter-add, its updates gathered whole over the batch) takes the finer
        layout where it moves exactly the same: it then writes its own rows of the table, not the
        whole table it used to slice. No collective changes; each device holds and computes its
        slice. A program result keeps its layout."""
        for i, f, d, outs, wanted in self._relaid_outputs(outputs):
            a = self._assignment(f, d)
            if a is None:
                continue
            finer = dict(a)
            for dims, spec in zip(f.outputs, wanted):
                finer.update(read_assignment(dims, spec, f.sizes, self.axis_size) or {})
            if any(finer.get(g) for g in f.reduced) or not self._refines(f, a, finer, d.out_specs, wanted):
                continue
            relaid = self._relaid_inputs(i, f, finer, d)
            if relaid is None:
                continue
            in_specs, known = relaid
            comms = self.score(i, f, finer, known)[2]
            if sorted(comms) != sorted(self.score(i, f, a, known)[2]):
                continue  # it would move its inputs otherwise
            kept = list(d.comms)
            for v, old, spec in zip(outs, d.out_specs, wanted):  # the moves into its users' layout it paid
                for c in redistribution(*array_of(v), old, spec, self.axis_size, self.cost.alltoall):
                    if c in kept:
                        kept.remove(c)
            self.decisions[i] = dataclasses.replace(
                d, in_specs=in_specs, out_specs=wanted, comms=tuple(kept),
                seconds=self._paid(i, kept),
                implied=not comms and self.implied(i, f, finer))
            for v, spec in zip(outs, wanted):
                self._relayout(v, spec)

    def _relaid_outputs(self, outputs: set):
        """Walking back from the program's end, each operator (no loop, branch or constraint, no
        results a body takes) whose users all take its results in one layout other than it made
        them in: `(index, factors, decision, results, that layout)`."""
        for i in sorted(self.decisions, reverse=True):
            f, d, node = self.factors.get(i), self.decisions[i], self.nodes[i]
            if f is None or node.bodies or node.primitive == CONSTRAINT:
                continue
            _, outs = self.vars[i]
            wanted = self._users_layout(outs, outputs)
            if wanted is not None and wanted != d.out_specs and not self._bodies_take(outs):
                yield i, f, d, outs, wanted

    def _relaid_inputs(self, i: int, f: Factors, a, d: Decision):
        """Operator `i`'s input layouts under assignment `a`, and its inputs' known layouts (`score`'s
        `known`); None where `a` would lay out otherwise a parameter `i` laid out (its other users
        took it so), or an input a `shard` call's strategy laid out for it (`_binding`)."""
        ins, _ = self.vars[i]
        in_specs = tuple(write_spec(dims, a, f.sizes, self.axis_size) for dims in f.inputs)
        if any(isinstance(v, jcore.Var) and s != t and (self.why.get(v) == i or self._bound(i, v, s))
               for v, s, t in zip(ins, d.in_specs, in_specs)):
            return None
        known = [(k, self.values[v], self._source(v)) for k, v in enumerate(ins)
                 if isinstance(v, jcore.Var) and v in self.values]
        return in_specs, known

    def _bodies_take(self, outs) -> bool:
        """Whether a loop, branch or remat region takes any of `outs` (its body's layouts follow it)."""
        return any(self.nodes[j].bodies for v in outs for j, _ in self.consumers.get(v, ()))

    def _users_layout(self, outs, outputs: set) -> tuple[Spec, ...] | None:
        """The one layout every user of each of `outs` takes it in, or None (no users, users that
        differ or did not decide, or a program result)."""
        wanted = []
        for v in outs:
            users = self.consumers.get(v, ())
            specs = {self.decisions[j].in_specs[pos] for j, pos in users if j in self.decisions}
            if v in outputs or not users or len(specs) != 1 or any(j not in self.decisions for j, _ in users):
                return None
            wanted.append(specs.pop())
        return tuple(wanted)

    def _assignment(self, f: Factors, d: Decision):
        """The factor axes of decision `d`, read back from its operands' layouts (None: unreadable)."""
        a: dict = {}
        for dims, spec in zip(f.operands, d.in_specs + d.out_specs):
            read = read_assignment(dims, spec, f.sizes, self.axis_size)
            if read is None:
                return None
            a.update(read)
        return a

    def _refines(self, f: Factors, a, finer, out_specs, wanted) -> bool:
        """Whether assignment `finer` only adds cuts to `a` (each factor keeps its axes, major first,
        and may take more after them: a gradient cut over `mp_0` as its users cut it over `(mp_0,
        mp_1)`), lays the outputs out as `wanted`, a finer layout of `out_specs` (each dim keeps its
        axes, major first), and uses no mesh axis twice where factors meet."""
        if (any(finer[g][: len(axes)] != axes for g, axes in a.items())
                or not expressible(f, finer, self.axis_size)):
            return False
        if any(t[: len(s)] != s for old, new in zip(out_specs, wanted) for s, t in zip(old, new)):
            return False
        if any(write_spec(dims, finer, f.sizes, self.axis_size) != w for dims, w in zip(f.outputs, wanted)):
            return False
        for together in f.joined:
            used = [x for g in together for x in finer.get(g, ())]
            if len(used) != len(set(used)):
                return False
        return True

    def _source(self, v) -> str:
        why = self.why.get(v)
        return "arg" if why == "arg" else str(why)

    def _decide(self, i: int) -> bool:
        known = self._known(i)
        if not known:
            return False
        if self.nodes[i].bodies and i not in self.entered:
            return self._enter(i, known)
        f = self.factors[i]
        ins, outs = self.vars[i]
        key = (id(f), self.nodes[i].weight, tuple((k, spec) for k, spec, _ in known))
        if key not in self._memo:  # an unrolled model meets the same operator in the same layouts per layer
            self._memo[key] = self._choose(i, f, known)
        in_specs, out_specs, comms, seconds, j, rejected, implied = self._memo[key]
        via = known[j][2] if j is not None else ""
        self.decisions[i] = Decision(in_specs, out_specs, comms, seconds, via, rejected, implied)
        self._settle(i, outs, out_specs)
        for v, spec in zip(ins, in_specs):
            if isinstance(v, jcore.Var) and v not in self.values and v not in self.producer:
                self.values[v] = spec  # a free argument (a parameter) is laid out by its first user
                self.why[v] = i
        for v, spec in zip(outs, out_specs):
            if v not in self.values:
                self.values[v] = spec
                self.why[v] = i
        return True

    def _choose(self, i: int, f: Factors, known):
        """The least-cost candidate for node `i`: its layouts, comms, seconds, the position in `known`
        of the layout it took, the best rejected alternative, and whether its outputs are implied."""
        candidates = self._binding(i, f, known, self._candidates(f, known))
        first = self.score(i, f, candidates[0], known)
        if first[0] == 0.0:  # the merge of every known layout, with nothing to move: MindSpore takes it at once
            scored = [((0.0, first[1], 0), first, candidates[0])]
        else:
            scored = sorted(((s[0], s[1], n), s, a) for n, a in enumerate(candidates) for s in
                            [first if n == 0 else self.score(i, f, a, known)])
        _, (seconds, _, comms, j), best = scored[0]
        rejected = None
        if len(scored) > 1:
            _, (r_seconds, *_), r = scored[1]
            rejected = Rejected(
                tuple(write_spec(d, r, f.sizes, self.axis_size) for d in f.inputs),
                tuple(write_spec(d, r, f.sizes, self.axis_size) for d in f.outputs),
                r_seconds,
            )
        in_specs = tuple(write_spec(d, best, f.sizes, self.axis_size) for d in f.inputs)
        out_specs = tuple(write_spec(d, best, f.sizes, self.axis_size) for d in f.outputs)
        return in_specs, out_specs, comms, seconds, j, rejected, not comms and self.implied(i, f, best)

    def _binding(self, i: int, f: Factors, known, candidates: list[dict]) -> list[dict]:
        """`candidates`, keeping only those that take as they are the inputs a `shard` call's
        strategy laid out for operator `i` (its constraints on the call's inputs), where any does:
        a user's cut is never replaced by a cheaper layout of the engine's (MindSpore's strategies
        bind; an operator outside the call may take its result cut finer, `keeps_cut`). Where none can
        take them so, the cheapest redistributes them."""
        n_in = len(self.vars[i][0])
        fixed = [(k, spec, self._outside(i, int(src))) for k, spec, src in known
                 if k < n_in and src.isdigit() and self._user_constraint(int(src))]
        if not fixed or self.nodes[i].backward:
            return candidates
        kept = [a for a in candidates if all(keeps_cut(write_spec(f.operands[k], a, f.sizes, self.axis_size), spec, outside)
                                             for k, spec, outside in fixed)]
        return kept or candidates

    def _outside(self, i: int, j: int) -> bool:
        """Whether operator `i` lies outside the `shard` call whose constraint is node `j` (it takes
        that call's result, so it may cut the result finer where that moves nothing)."""
        calls = _SHARD_CALL.findall(self.nodes[j].scope)
        return not calls or not re.search(rf"\b{calls[-1]}\b", self.nodes[i].scope)

    def _bound(self, i: int, v, spec: Spec) -> bool:
        """Whether operator `i` takes input `v` as a `shard` call's constraint laid it out (`spec`)."""
        why = self.why.get(v)
        return (isinstance(why, int) and self._user_constraint(why) and self.values.get(v) == spec
                and not self.nodes[i].backward)

    def _user_constraint(self, j: int) -> bool:
        """Whether node `j` is a `shard` call's constraint in the forward pass."""
        node = self.nodes[j]
        return node.primitive == CONSTRAINT and _SHARD_SCOPE in node.scope and not node.backward

    def _enter(self, i: int, known) -> bool:
        """A loop or branch in two steps: entering lays out its bodies' parameters from the outer
        operands, so the body is planned before the loop's results are (they follow the body's)."""
        f = self.factors[i]
        node = self.nodes[i]
        best = self._candidates(f, known)[0]
        _, outs = self.vars[i]
        for v, dims in list(zip(outs, f.outputs))[len(node.outputs):]:
            if v not in self.values:
                self.values[v] = write_spec(dims, best, f.sizes, self.axis_size)
                self.why[v] = i
        self.entered.add(i)
        return True

    def _candidates(self, f: Factors, known) -> list[dict]:
        # A layout the operator cannot take as it is (a dim it needs whole arrives cut: the half a
        # rotary embedding slices off a key cut over its head dim) still says how to cut the rest:
        # only that dim is gathered, not the whole operand.
        reads = [read_assignment(f.operands[k], spec, f.sizes, self.axis_size, kept=True) for k, spec, _ in known]
        merged: dict = reads[0] if len(reads) == 1 else {}
        yielded: list[dict] = []
        if len(reads) > 1:
            together = neighbours_of(f)  # factors that share an operand: they may not share an axis
            merged = merge_reads(reads, together, partial=False)
            # the later operands' cuts first, the earlier ones keeping the axes left to them: a batch
            # cut over (dp, ep) meeting experts cut over ep keeps dp (expert parallel's all-to-all)
            yielded = [merge_reads(reads[::-1], together, partial=True)]
        # Each read without its partial-sum factors too: gather the contracted cut, keep the rest.
        kept = [{g: axes for g, axes in a.items() if g not in f.reduced} for a in reads if f.reduced]
        out, seen = [], set()
        for a in [merged] + reads + yielded + kept + [{}]:
            key = tuple(sorted(a.items()))
            if key not in seen and (not a or expressible(f, a, self.axis_size)):
                seen.add(key)
                out.append(a)
        return out

    def score(self, i, f: Factors, a, known):
        """`(seconds, compute, comms, via)` of assignment `a` for node `i`: the comms of its known
        operands' redistribution and of its partial sums, then its compute per device; `via` is the
        position in `known` of the layout it takes as it is."""
        ins, outs = self.vars[i]
        operands = ins + outs
        node = self.nodes[i]
        comms: list[Comm] = []
        best_fit = None
        for j, (k, spec, _) in enumerate(known):
            want = write_spec(f.operands[k], a, f.sizes, self.axis_size)
            moved = []
            if spec != want:
                src, dst = (spec, want) if k < len(ins) else (want, spec)
                moved = redistribution(*array_of(operands[k]), src, dst, self.axis_size, self.cost.alltoall)
                once = self.invariant.get(operands[k])
                if once is not None and k < len(ins) and once < node.weight:
                    # XLA hoists the redistribution of a loop-invariant value out of the loop: it
                    # runs once per loop, not once per iteration (per iteration: its share).
                    moved = [c._replace(bytes=c.bytes * once / node.weight) for c in moved]
            comms += moved
            if not moved and any(want) and best_fit is None:
                best_fit = j
        # One all-reduce per cut reduced factor, over its axes: XLA sums the partial results of each
        # reduced dim on its own (two cut dims of a reduce or a contraction: two all-reduces).
        partial = [tuple(a[fac]) for fac in sorted(f.reduced) if a.get(fac)]
        for d, v in zip(f.outputs, outs) if partial else ():
            spec = write_spec(d, a, f.sizes, self.axis_size)
            comms += [Comm("all-reduce", local_bytes(*array_of(v), spec, self.axis_size), axes) for axes in partial]
        seconds = self._paid(i, comms)
        cut = math.prod(self.axis_size[x] for axes in a.values() for x in axes)
        compute = node.weight * self.cost.compute_seconds(f.flops / cut, self.moved.get(i, 0.0) / cut,
                                                          i in self.table.matmul)
        if best_fit is None and known:
            best_fit = 0
        return seconds, compute, tuple(comms), best_fit

    def implied(self, i: int, f: Factors, a) -> bool:
        """Whether XLA infers the outputs' layouts from the one input's alone (no constraint needed):
        an operator of one non-scalar input whose dims all pass through, one factor each (unary
        elementwise, transpose, a scalar broadcast). Where inputs meet, a dim must be whole, a cut
        factor is new or partial sums are left, XLA's own propagation may choose otherwise."""
        if any(a.get(fac) for fac in f.reduced):
            return False
        ins, outs = self.vars[i]
        arrays = [(dims, v) for dims, v in zip(f.inputs, ins) if dims]
        if len(arrays) != 1:
            return False
        for dims, v in arrays + list(zip(f.outputs, outs)):
            if any(len(d) != 1 for d, n in zip(dims, array_of(v)[0]) if n > 1):
                return False
        from_inputs = {fac for d in arrays[0][0] for fac in d}
        return all(fac in from_inputs for fac in a)


def _invariants(nodes: Sequence[Node]) -> dict:
    """Loop-invariant body parameters (a `scan`'s consts, a `while`'s body and condition consts)
    -> the weight of their loop."""
    found = {}
    for node in nodes:
        p = node.eqn.params
        if node.primitive == "scan":
            counts = [p["num_consts"]]
        elif node.primitive == "while":
            counts = [p["cond_nconsts"], p["body_nconsts"]]
        else:
            continue
        for (invars, _), n in zip(node.bodies, counts):
            found.update((v, node.weight) for v in invars[:n])
    return found


def propagate(nodes: Sequence[Node], anchors: Mapping, axis_size: Mapping[str, int], cost: CostModel | None = None,
              outputs: Collection = ()) -> Result:
    """Runs the engine; see the module docstring. `outputs`: the program's results."""
    return Engine(nodes, axis_size, cost).run(anchors, outputs)


