"""`OpRecord`: one operator of a planned program, as a person reads it, and `build_ops`, which makes
them from the OpGraph and a planning result."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from jshard._context import Annotation
from jshard._format import var_str
from jshard.cost import Comm
from jshard.graph import AUTO_LABEL, COMM_KEPT_LABEL, CONSTRAINT, JSHARD_SCOPE, PARAMETER_SCOPE, RECOMPUTE_SCOPE, Node
from jshard.layouts import FineMesh, Spec, Strategy, TensorLayout, spec_from_pspec, to_pspec, typed_spec
from jshard.plan._notes import mindspore_note

ORIGINS = ("user", "model", "propagated", "searched", "default")
"""Where an operator's strategy came from: a `shard` call, the model's own sharding (its
`with_sharding_constraint`s, logical constraints, or types on `Explicit` mesh axes), the propagation
engine, the search, or nowhere (left to XLA's own propagation from the anchors)."""

_SHARD_SCOPE = "jshard_shard"
_SCOPE = re.compile(_SHARD_SCOPE + r"\d+")
_PARAMETER = re.compile(PARAMETER_SCOPE + r"(\d+)")
_RECOMPUTE = re.compile(RECOMPUTE_SCOPE + r"(\w+)")
_AUTO = re.compile(AUTO_LABEL + r"(\d+)_(\w+)")
_RERUN = "rematted_computation"
"""The name scope JAX gives the forward operators a remat equation runs again in the backward pass."""


class OpLayout(NamedTuple):
    """An operator's layouts over the fine mesh, as the engine decided them.

    Attributes:
      in_specs / out_specs: each operand's `Spec` (loop bodies' results and parameters follow).
      implied: whether XLA infers the results' layouts from the inputs alone (no constraint).
    """

    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    implied: bool


@dataclasses.dataclass(frozen=True, slots=True)
class OpRecord:
    """One operator of the planned program.

    Attributes:
      index: position in program order (nested jaxprs flattened in place).
      primitive: the JAX primitive (`dot_general`, `add`, ...).
      source: `file:line (function)` of the user code that made it.
      in_shapes / out_shapes: shapes as `f32[8,64]`.
      in_strategy / out_strategy: MindSpore tuples per operand (None: not fixed by jshard).
      in_specs / out_specs: the same as `PartitionSpec`s over the plan's mesh.
      origin: `user`, `model`, `propagated`, `searched` or `default`.
      annotation: the `shard`ed function it belongs to, or `""`.
      backward: whether it belongs to the backward pass.
      inside: the enclosing loop or branch primitive, or `""`.
      comms: predicted collectives (`Comm`: kind, bytes per device, mesh axes) per call of the
        program (weighted by loop trip counts): redistributing its inputs and its partial sums.
      seconds: their predicted α–β time.
      via: the index of the operator (or `"arg"`, `"user"`) whose layout this one took.
      rejected: the best alternative it did not take, described, or `""`.
      weighed: for an operator taking a free argument or a default-cut batch array directly, the
        layouts global propagation weighed for it, with the whole program's predicted seconds
        under each (`jshard.propagate.propagate_globally`), described; else `""`.
      ruled: False where jshard has no sharding rule for the primitive (left replicated).
      recompute: the recompute region it belongs to, `jshard.recompute(policy='selective')` or
        `jax.checkpoint(policy=full)` (a bare `jax.checkpoint`, `flax.linen.remat`, ...), or `""`;
        a region the search chose for, its choice and number: `jshard.recompute(policy='auto' ->
        'selective', region 0)` (`'none'` too: not recomputed; `Plan.search.regions` says why);
        `, mp_comm_recompute=False` follows the policy where the region keeps the results of its
        collectives instead of communicating again (`jshard.recompute(fn, mp_comm_recompute=False)`).
        A forward operator of a bare `jax.checkpoint` region is known by the backward pass's run
        of it (the same source line and primitive); one the policy saves is not run again, so it
        is named only inside `jshard.recompute`.
      recomputed: whether it is the backward pass's run of a forward operator again (what recompute
        costs), rather than its first run or a gradient operator.
      layout: for a propagated or searched operator, its operands' layouts over the fine mesh,
        loop bodies included: what emission and `Plan.load` need to rebuild the same program.
      note: where its input strategy is a cut MindSpore's own operator refuses and jshard accepts (a
        cut split axis, a slice not taking the whole of a cut dim, ...), the difference in words.
      gathered: where the operator takes a value a `shard` call cut (an `in_strategy` input, a
        `parameter_plan` parameter, its `out_strategy`) with fewer cuts than given, which value,
        which cut and over which mesh axes XLA all-gathers it there, in words; `""` else. Such an
        operator's strategy is the engine's (`origin` `propagated` or `searched`), not the user's.
    """

    index: int
    primitive: str
    source: str
    in_shapes: tuple[str, ...]
    out_shapes: tuple[str, ...]
    in_strategy: tuple[Strategy | None, ...] | None
    out_strategy: tuple[Strategy | None, ...] | None
    in_specs: tuple[PartitionSpec | None, ...] | None
    out_specs: tuple[PartitionSpec | None, ...] | None
    origin: str
    annotation: str = ""
    backward: bool = False
    inside: str = ""
    comms: tuple[Comm, ...] = ()
    seconds: float = 0.0
    via: str = ""
    rejected: str = ""
    weighed: str = ""
    ruled: bool = True
    recompute: str = ""
    recomputed: bool = False
    layout: OpLayout | None = None
    note: str = ""
    gathered: str = ""


_SET_INDEX, *_SET_FIELDS = (getattr(OpRecord, f.name).__set__ for f in dataclasses.fields(OpRecord))
"""The setters of `OpRecord`'s slots: its index's, then each field's after it in order (`_made`)."""


def _made(index: int, fields: tuple) -> OpRecord:
    """`OpRecord(index, *fields)`, its slots set directly: the frozen dataclass's `__init__` sets
    each through `object.__setattr__` (2.3 us a record where this takes 1.7), and `build_ops`
    makes records by the ten thousand from `fields` it made (and checked) once per operator alike."""
    record = object.__new__(OpRecord)
    _SET_INDEX(record, index)
    for set_field, value in zip(_SET_FIELDS, fields):
        set_field(record, value)
    return record


_FIELDS = tuple((f.name, f.default) for f in dataclasses.fields(OpRecord))[1:]
"""`OpRecord`'s fields after `index`, in order, with their defaults (`_Records.record`)."""
_NAMES = frozenset(name for name, _ in _FIELDS)


def source_str(source: str) -> str:
    """A source location as plans print it: the file's last two path parts (`models/_gpt.py:106:15
    (attention)`), so a plan reads the same on every machine; `no source line` for none."""
    if not source:
        return "no source line"
    where, _, function = source.partition(" ")
    return "/".join(where.split("/")[-2:]) + (f" {function}" if function else "")


def strategies_str(value) -> str:
    """Per-operand strategy tuples as plans print them: `((2, 1), (1, 4))`, `-` for none."""
    if value is None:
        return "-"
    return "(" + ", ".join("-" if s is None else str(s) for s in value) + ("," if len(value) == 1 else "") + ")"


def build_ops(
    nodes: Sequence[Node], annotations: Sequence[Annotation], fine: FineMesh, result=None
) -> tuple[OpRecord, ...]:
    """One `OpRecord` per operator; the main operator of each `shard` call carries its strategy.

    Sharding constraints themselves are not operators and are left out. In a `shard` region the
    main operator is its first `dot_general` (else convolution, else gather, else its first
    operator); it carries the call's strategies where they are one per operand of it. With a propagation
    `result`, every operator it decided carries its strategy (`origin="propagated"`, `searched`
    where the strategy search chose it, or `user` inside a `shard` region's forward pass). An
    operator whose result the model pins itself (a constraint of its own right after it, or its
    type on `Explicit` mesh axes) has `origin="model"`, its result's layout the model's.
    """
    records = _Records(nodes, annotations, fine, result)
    return tuple(records.record(i, node) for i, node in enumerate(nodes) if i in records.number)


class _Records:
    """Makes the `OpRecord`s of one program. The record of an operator is a function of what
    `_alike` keys it by (everything it reads but its position), so operators alike, the same
    operator of identical layers, share one record's fields, made once."""

    def __init__(self, nodes: Sequence[Node], annotations: Sequence[Annotation], fine: FineMesh, result):
        self.by_scope = {a.scope: a for a in annotations}
        self.scopes = [_innermost(n.scope) for n in nodes]
        self.main = _main_operators(nodes, self.scopes, self.by_scope)
        self.number = numbered(nodes)
        self.stands_for = _standing_for(nodes, self.scopes, self.main, self.number)
        self.regions, rerun = recompute_regions(nodes)
        self.rerun = set(rerun)
        self.cuts = _cutter(dict(zip(fine.names, fine.sizes)))
        self.model = _model_pinned(nodes)
        self.models = {i for i, n in enumerate(nodes) if _is_model_constraint(n)}
        self.fine, self.result = fine, result
        self.given = _given_cuts(nodes, self.by_scope)
        self.fields: dict = {}
        self.parts: dict[int, tuple[tuple, str]] = {}  # id() of a decision `result` holds -> `_parts`' answer

    def record(self, i: int, node: Node) -> OpRecord:
        """The record of operator `i`, `node`."""
        key = self._alike(i, node)
        fields = self.fields.get(key)
        if fields is None:  # in `OpRecord`'s order after its index: records by the ten thousand are made positionally
            made = self._fields(i, node, *key[-2:])
            assert made.keys() <= _NAMES, made.keys() - _NAMES  # every field made is one of OpRecord's
            fields = self.fields[key] = tuple(made[name] if default is dataclasses.MISSING else made.get(name, default)
                                              for name, default in _FIELDS)
        return _made(self.number[i], fields)

    def _alike(self, i: int, node: Node) -> tuple:
        """What the record of operator `i` reads: its node's primitive, source, scope, place and
        operand types, and its decision's parts (by identity: the search gives operators alike the
        same ones, and `result` keeps them alive); last, the `weighed` and `via` it shows."""
        result, scope, model, given = self.result, self.scopes[i], self.model, self.given
        decision = None if result is None else result.decisions.get(i)
        parts, via = ((), "") if decision is None else self.parts.get(id(decision)) or self._parts(decision)
        weighed = _weighed(node, result.weighed, self.cuts) if result is not None and result.weighed else ""
        return (node.eqn.primitive, node.source, node.scope, node.inside, node.weight,
                tuple([v.aval for v in node.inputs]), tuple([v.aval for v in node.outputs]),
                scope in self.by_scope and self.main.get(scope) is node, self.regions.get(i, ""), i in self.rerun,
                result is None or i not in result.unruled,
                tuple([model.get(v) for v in node.outputs]) if model else (),  # the layouts the model pins
                parts,
                tuple([given.get(v) if isinstance(v, jcore.Var) else None for v in node.inputs]) if given else (),
                weighed, via)  # `given`: none where no `shard` call cuts a value, nothing to key by

    def _parts(self, decision) -> tuple[tuple, str]:
        """A decision's parts as `_alike` keys them, and the `via` it shows; once per decision (the
        search gives operators alike one: `_alike` reads it from `parts` first)."""
        found = self.parts[id(decision)] = (
            (id(decision.in_specs), id(decision.out_specs), id(decision.comms), id(decision.rejected),
             decision.seconds, decision.implied), _via(decision.via, self.stands_for, self.models))
        return found

    def _fields(self, i: int, node: Node, weighed: str, via: str) -> dict:
        """Every field of operator `i`'s record but its index."""
        ann = self.by_scope.get(self.scopes[i])
        user = ann is not None and not node.backward
        fields: dict[str, Any] = dict(origin="user" if user else "default", in_strategy=None, out_strategy=None,
                                      in_specs=None, out_specs=None)
        # the call's strategies are its main operator's where they are one per operand of it (else
        # the call has inputs the operator does not take: the operator's own layouts say more)
        if (ann is not None and self.main.get(self.scopes[i]) is node and len(ann.in_layouts) == len(node.inputs)
                and self._takes_inputs(node, ann)):
            fields.update(
                in_strategy=_strategy_tuple(ann.in_layouts), out_strategy=_strategy_tuple(ann.out_layouts),
                in_specs=_spec_tuple(ann.in_layouts, self.fine), out_specs=_spec_tuple(ann.out_layouts, self.fine),
            )
        given = fields["in_strategy"]  # the call's, where they are the operator's: what MindSpore's would take
        decision = None if self.result is None else self.result.decisions.get(i)
        if decision is not None:
            fields.update(self._decided(node, decision, user, fields["in_strategy"] is None), via=via)
            gathered = self._gathered(node, decision) if user else ""
            if gathered:  # the user's cut is not what it takes: its layout is the engine's, from the other anchors
                own = via == str(self.number.get(i))  # its own shard call's input constraint, which it stands for
                fields.update(self._decided(node, decision, False, True), gathered=gathered, via="user" if own else via)
        pinned = [self.model.get(v) for v in node.outputs]
        if not user and pinned and all(p is not None for p in pinned):
            fields.update(origin="model", out_specs=tuple(map(to_pspec, pinned)),
                          out_strategy=tuple(map(self.cuts, pinned)))
            typed = [typed_spec(getattr(v, "aval", None)) for v in node.inputs]
            if all(t is not None for t in typed):  # on Explicit axes the operands' types say what runs
                fields.update(in_specs=tuple(map(to_pspec, typed)), in_strategy=tuple(map(self.cuts, typed)))
        result = self.result
        fields["note"] = mindspore_note(node.primitive, node.eqn.params, [getattr(getattr(v, "aval", None), "shape", ()) for v in node.inputs],
                                        given if given is not None else fields["in_strategy"])
        return dict(
            primitive=node.primitive, source=node.source, in_shapes=tuple(var_str(v) for v in node.inputs),
            out_shapes=tuple(var_str(v) for v in node.outputs), annotation=ann.name if ann is not None else "",
            backward=node.backward, inside=node.inside, ruled=result is None or i not in result.unruled,
            recompute=self.regions.get(i, ""), recomputed=i in self.rerun, weighed=weighed, **fields,
        )

    def _takes_inputs(self, node: Node, ann: Annotation) -> bool:
        """Whether the operator's operands may be the `shard` call's inputs in order: none is another of
        the call's constraints' results (a `parameter_plan` parameter's, an input's the call's strategy
        for that operand leaves unconstrained), as in a Linen `apply` whose matmul takes `(x, kernel)`
        where the call takes `(params, x)`."""
        for v, lay in zip(node.inputs, ann.in_layouts):
            cut = self.given.get(v) if isinstance(v, jcore.Var) else None
            if cut is not None and cut.scope == ann.scope and (cut.kind != "in" or lay is None):
                return False
        return True

    def _gathered(self, node: Node, decision) -> str:
        """Which operands a `shard` call cut (`_given_cuts`) the operator takes with cuts dropped, in words."""
        assert self.result is not None  # a decision was made
        found = []
        for j, v in enumerate(node.inputs):
            cut = self.given.get(v) if isinstance(v, jcore.Var) else None
            if cut is None or j >= len(decision.in_specs) or v not in self.result.values:
                continue
            have, want = self.result.values[v], decision.in_specs[j]
            dropped = sorted({a for dim in have for a in dim} - {a for dim in want for a in dim})
            if dropped:
                found.append(f"operand {j} ({var_str(v)}) comes cut {self.cuts(have)} by {cut.what} and is taken as "
                             f"{self.cuts(want)}: XLA all-gathers it over mesh axis {', '.join(dropped)} here")
        return "; ".join(found)

    def _decided(self, node: Node, decision, user: bool, strategies: bool) -> dict:
        """The fields a decision gives an operator's record (its strategies too, where `strategies`)."""
        n_in, n_out = len(node.inputs), len(node.outputs)
        fields = dict(
            origin="user" if user else "searched" if decision.via == "searched" else "propagated",
            comms=tuple(Comm(c.kind, c.bytes * node.weight, c.axes) for c in decision.comms),
            seconds=decision.seconds, rejected=_rejected(decision.rejected, n_in, n_out, self.cuts),
            layout=OpLayout(decision.in_specs, decision.out_specs, decision.implied),
        )
        if strategies:
            ins, outs = decision.in_specs[:n_in], decision.out_specs[:n_out]
            fields.update(in_strategy=tuple(map(self.cuts, ins)), out_strategy=tuple(map(self.cuts, outs)),
                          in_specs=tuple(map(to_pspec, ins)), out_specs=tuple(map(to_pspec, outs)))
        return fields


_PRINCIPAL = ("dot_general", "conv_general_dilated", "gather")
"""The primitives that are a `shard` call's operator where the call holds one (MatMul, Conv2D,
Gather), before every other: the call's strategy is theirs."""


def _main_operators(nodes: Sequence[Node], scopes: Sequence[str], by_scope: dict) -> dict[str, Node]:
    """Per `shard` region's scope, its main operator: its first forward `dot_general` (else
    convolution, else gather), else its first forward operator with one operand per entry of the
    call's strategy (an `add` after the broadcast of its smaller operand), else its first."""
    main: dict[str, Node] = {}

    def rank(node, scope):
        if node.primitive in _PRINCIPAL:
            return _PRINCIPAL.index(node.primitive)
        ann = by_scope.get(scope)
        return len(_PRINCIPAL) + (ann is None or len(ann.in_layouts) != len(node.inputs))

    for node, scope in zip(nodes, scopes):
        if scope and not node.backward and not _moves(node):
            if scope not in main or rank(node, scope) < rank(main[scope], scope):
                main[scope] = node
    return main


class _Cut(NamedTuple):
    """A value a `shard` call's constraint made: the call's scope, which constraint (`in`: an
    `in_strategy` input's, `parameter`: a `parameter_plan` parameter's, `out`: its `out_strategy`'s)
    and that in words."""

    scope: str
    kind: str
    what: str


def _given_cuts(nodes: Sequence[Node], by_scope: dict) -> dict[jcore.Var, _Cut]:
    """Value -> the `_Cut` that made it, for the results of every `shard` call's constraints in the
    forward pass."""
    given: dict = {}
    made: set = set()  # the values operators of a shard call make (an output constraint takes one)
    if not by_scope:  # no shard call
        return given
    for node in nodes:
        ann = by_scope.get(_innermost(node.scope))
        if ann is None or node.backward:
            continue
        if not _moves(node):
            made.update(node.outputs)
            continue
        if not isinstance(node.inputs[0], jcore.Var):
            continue
        param = _PARAMETER.search(node.scope)
        if param is not None and int(param.group(1)) < len(ann.params):
            kind, what = "parameter", f"the parameter_plan entry for {ann.params[int(param.group(1))][0]} of"
        else:
            kind, what = ("out", "the out_strategy of") if node.inputs[0] in made else ("in", "an in_strategy entry of")
        cut = _Cut(ann.scope, kind, f"{what} jshard.shard({ann.name}) at {source_str(ann.source)}")
        given.update(dict.fromkeys(node.outputs, cut))
    return given


def _standing_for(nodes: Sequence[Node], scopes: Sequence[str], main: dict[str, Node], number: dict[int, int]):
    """Node index -> the record index it is named by: its own, or for a `shard` call's constraint
    its main operator's."""
    stands_for = dict(number)
    if not main:  # no shard call: each operator stands for itself
        return stands_for
    node_index = {id(n): i for i, n in enumerate(nodes)}
    for i in range(len(nodes)):
        main_node = main.get(scopes[i])
        if i not in number and main_node is not None:
            stands_for[i] = number[node_index[id(main_node)]]
    return stands_for


def recompute_regions(nodes: Sequence[Node]) -> tuple[dict[int, str], list[int]]:
    """Node index -> the recompute region it belongs to (see `OpRecord.recompute`), and the nodes
    that run a forward operator again in the backward pass (`OpRecord.recomputed`)."""
    found: dict[int, str] = {}
    again: dict[tuple[str, str], str] = {}
    rerun = []
    for i, node in enumerate(nodes):
        named = RECOMPUTE_SCOPE in node.scope and _RECOMPUTE.search(node.scope)  # the regex where it may match
        if named:
            found[i] = _region_name(named.group(1))
        elif node.remat:
            found[i] = f"jax.checkpoint(policy={node.remat})"
        if node.remat and _RERUN in node.scope:
            again.setdefault((node.source, node.primitive), found[i])
            rerun.append(i)
    if again:  # a forward operator the backward pass runs again belongs to its region too
        for i, node in enumerate(nodes):
            if i not in found and not node.backward and (node.source, node.primitive) in again:
                found[i] = again[node.source, node.primitive]
    return found, rerun


def _region_name(label: str) -> str:
    """`OpRecord.recompute` for a `jshard.recompute` region's scope label: its policy, or for a
    region the search chose for (`policy="auto"`) its number and the policy it got."""
    kept = label.endswith(COMM_KEPT_LABEL)
    label = label.removesuffix(COMM_KEPT_LABEL)
    comm = ", mp_comm_recompute=False" if kept else ""
    auto = _AUTO.fullmatch(label)
    if auto is None:
        return f"jshard.recompute(policy={label!r}{comm})"
    return f"jshard.recompute(policy='auto' -> {auto.group(2)!r}, region {auto.group(1)}{comm})"


def _cutter(sizes):
    """`spec -> strategy tuple` over a mesh with axis `sizes`, memoized for one plan."""

    @functools.lru_cache(maxsize=None)
    def cuts(spec) -> Strategy:
        return tuple(math.prod(sizes[a] for a in axes) for axes in spec)

    return cuts


def _via(via: str, number: dict[int, int], models: set[int]) -> str:
    if via.isdigit():
        i = int(via)
        return str(number[i]) if i in number else "model" if i in models else "user"
    return via


def numbered(nodes: Sequence[Node]) -> dict[int, int]:
    """Node index -> the index of its `OpRecord` (operators that only lay a value out have none)."""
    return {i: k for k, i in enumerate(i for i, n in enumerate(nodes) if not _moves(n))}


def _moves(node: Node) -> bool:
    """Whether `node` only lays a value out: a sharding constraint, or jshard's own `reshard` (a
    `shard` call's on `Explicit` axes), recorded with the operator it serves, not as one."""
    return node.primitive == CONSTRAINT or (node.primitive == "reshard" and JSHARD_SCOPE in node.scope)


def _is_model_constraint(node: Node) -> bool:
    """A sharding constraint the model made itself (not a `shard` call's or jshard's own)."""
    return node.primitive == CONSTRAINT and JSHARD_SCOPE not in node.scope


def _model_pinned(nodes: Sequence[Node]) -> dict:
    """Value -> `Spec` the model pins: its type's on `Explicit` mesh axes, or the layout of a
    constraint of the model's own it flows straight into."""
    pinned = {}
    typed: dict = {}  # aval -> `typed_spec`'s answer: avals are interned, so identical layers share theirs
    for node in nodes:
        for v in node.outputs:
            aval = getattr(v, "aval", None)
            spec = typed[aval] if aval in typed else typed.setdefault(aval, typed_spec(aval))
            if spec is not None:
                pinned[v] = spec
        if _is_model_constraint(node) and isinstance(node.inputs[0], jcore.Var):
            v = node.inputs[0]
            pinned.setdefault(v, spec_from_pspec(node.eqn.params["sharding"].spec, len(v.aval.shape)))
    return pinned


def _rejected(rejected, n_in: int, n_out: int, cuts) -> str:
    if rejected is None:
        return ""
    ins, outs, seconds = rejected.in_specs, rejected.out_specs, rejected.seconds
    strategy = f"{strategies_str(tuple(map(cuts, ins[:n_in])))} -> {strategies_str(tuple(map(cuts, outs[:n_out])))}"
    return f"{strategy} at {seconds * 1e6:.8g} us"


def _weighed(node: Node, weighed: dict, cuts) -> str:
    """The layouts weighed for the arguments `node` takes directly, each with its predicted seconds."""
    found = []
    for v in dict.fromkeys(v for v in node.inputs if isinstance(v, jcore.Var) and v in weighed):
        tried = ", ".join(f"{cuts(w.spec)} {w.how} {w.seconds * 1e6:.6g} us" + (" (chosen)" if w.chosen else "")
                          for w in sorted(weighed[v], key=lambda w: w.seconds))
        found.append(f"{var_str(v)}: {tried}")
    return "; ".join(found)


@functools.lru_cache(maxsize=4096)
def _innermost(scope: str) -> str:
    found = _SCOPE.findall(scope) if _SHARD_SCOPE in scope else ()  # the regex where it may match
    return found[-1] if found else ""


def _strategy_tuple(layouts: Sequence[TensorLayout | None]):
    return tuple(None if lay is None else lay.strategy for lay in layouts)


def _spec_tuple(layouts: Sequence[TensorLayout | None], fine: FineMesh):
    return tuple(None if lay is None else fine.partition_spec(lay) for lay in layouts)
