"""`traffic`: the device-memory bytes each operator moves once XLA has fused the program.

Counting every operator's inputs and outputs overstates what a compiled program moves several
times over: XLA fuses chains of elementwise and shape operators into one kernel, whose
intermediate values never leave the registers. The rule here is the general one XLA's fusion
passes follow, not a model of one program:

- kernels: every operator that is not fusible (a dot, a convolution, a gather or scatter, a sort,
  a collective, a reduction) is a kernel of its own; a fusible one (elementwise, broadcast,
  reshape, transpose, slice, ...) joins the kernel of its latest operand (`_Fusion`), so one that
  also reads a reduction's result runs in a kernel after that reduction, apart from the values
  made before it. Except: a reduction of each row (its operand's minor dim) read back beside the
  row it reduced, a softmax's or a norm's "diamond", stays in the kernel of that row (XLA's GPU
  row-reduction and softmax fusions), and a reduction takes a lone fusible producer into its
  kernel (input fusion);
- reads: an operator reads from memory the arguments, the results of other kernels and of
  operators not fusible, once per kernel; a broadcast, an iota, or a value made from iotas and
  literals alone (a causal mask) is recomputed in each kernel that reads it, never read;
- writes: a value is written where it is a result of the program or of a loop's body (its carry,
  its stacked outputs), or where some operator reads it from memory.

Loops and branches (`scan`, `while`, `cond`) move nothing of their own: their bodies' operators are
counted, weighted by the trip count like their FLOPs.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping, Sequence

from jax.extend import core as jcore

from jshard.cost import Fusion, value_bytes
from jshard.graph import CONSTRAINT, Node
from jshard.rules._elementwise import ELEMENTWISE
from jshard.rules._reduce import REDUCTIONS

MATMUL = frozenset({"dot_general", "conv_general_dilated", "dot_product_attention_fwd_wrapper",
                    "dot_product_attention_bwd_wrapper"})
"""Operators that run on the matrix units (`CostModel.matmul_flops`)."""

FUSIBLE = frozenset(ELEMENTWISE) - {"optimization_barrier"} | {
    "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "reshape", "concatenate", "pad", "slice",
    "dynamic_slice", "rev", "iota", CONSTRAINT}
"""Operators XLA fuses into one kernel with their consumers."""

FUSION = Fusion(FUSIBLE, frozenset(ELEMENTWISE) - {"optimization_barrier"})
"""The memory model's view of the same fusion in a loop body (`jshard.cost.live_ranges`): a fusible
operator's result read only by fusible operators holds no buffer; an elementwise one writes into an
operand that dies there."""

_REDUCING = FUSIBLE | set(REDUCTIONS) | {"argmax", "argmin", "reduce"}
"""Operators that take a fusible producer into their kernel."""

_RECOMPUTED = frozenset({"broadcast_in_dim", "iota"})
"""Fusible operators XLA repeats in every consumer rather than store their result."""

_CONTROL = frozenset({"scan", "while", "cond"})


def traffic(nodes: Sequence[Node], vars_: Mapping[int, tuple[list, list]], outputs: Collection = ()) -> dict[int, float]:
    """Bytes of device memory each operator reads and writes per run, on one device holding
    everything, under the fusion rule above (operators that move nothing are left out).

    Args:
      nodes: the flattened program.
      vars_: its `OpTable`'s operands of each operator.
      outputs: the program's results (written to memory whoever else reads them).
    """
    fused = _Fusion(nodes, vars_, frozenset(outputs))
    moved: dict[int, float] = {}
    seen: set = set()  # (value, maker, kernel): a kernel reads a value from memory once
    for i, node in enumerate(nodes):
        if node.primitive in _CONTROL:
            continue
        ins, outs = vars_[i]
        total = 0.0
        for v, p in zip(ins, fused.made[i]):
            if isinstance(v, jcore.Var) and fused.read(v, p, i):
                kernel = fused.kernel_of(i)
                if kernel is None or (v, p, kernel) not in seen:
                    total += value_bytes(v)
                    seen.add((v, p, kernel))
        total += sum(value_bytes(v) for v in outs if fused.written(v, i))
        if total:
            moved[i] = total
    return moved


class _Fusion:
    """Which kernel each fusible operator joins, and which values cross memory.

    A fusible operator joins the kernel of the latest of its operands' kernels (a value made by
    another kind of operator, or an argument, starts one of its own): an operator that also reads
    a reduction's result, say, runs after it, in a kernel apart from the values made before it.
    Values are told apart by the operator that made them: a sub-jaxpr JAX caches is inlined at
    every call with the same variables, so a variable's maker is the latest before each use.
    """

    def __init__(self, nodes, vars_, outputs: frozenset):
        self.nodes = nodes
        self.made: dict[int, list] = {}  # per operator, the maker of each input (None: an argument)
        self.readers: dict = collections.defaultdict(set)  # (value, maker) -> operators reading it
        self.kernel: dict[int, int] = {}
        self.row: dict[int, int] = {}  # a reduction of rows -> the kernel of what it reduces
        self.free: set[int] = set()  # fusible operators that read nothing from memory (masks made from iotas)
        latest: dict = {}
        for i, node in enumerate(nodes):
            ins, outs = vars_[i]
            made = self.made[i] = [latest.get(v) if isinstance(v, jcore.Var) else None for v in ins]
            for v, p in zip(ins, made):
                if isinstance(v, jcore.Var):
                    self.readers[(v, p)].add(i)
            ms = [p for v, p in zip(ins, made) if isinstance(v, jcore.Var)]
            if node.primitive in FUSIBLE:
                self.kernel[i] = max((self.kernel.get(p, self.row.get(p, p)) for p in ms if p is not None), default=-1)
                if all(p in self.free for p in ms):
                    self.free.add(i)
            elif _row_reduction(node) and ms:
                self.row[i] = -1 if ms[0] is None else self.kernel.get(ms[0], self.row.get(ms[0], ms[0]))
            for v in outs:
                latest[v] = i
        results = {v for node in nodes for _, outs in node.bodies for v in outs if isinstance(v, jcore.Var)}
        self.last = {v: latest.get(v) for v in (*outputs, *results)}  # a loop body's results: written each trip

    def kernel_of(self, j: int) -> int | None:
        """The kernel operator `j` runs in, if it joins one (a fusible operator, a row reduction)."""
        return self.kernel.get(j, self.row.get(j))

    def read(self, v, p: int | None, j: int) -> bool:
        """Whether operator `j` reads `v`, made by operator `p`, from device memory."""
        if p is None:
            return True  # an argument
        mine = self.kernel_of(j)
        if p not in self.kernel:  # a dot's (a reduction's, a gather's, ...) result: in memory, unless
            return not (p in self.row and mine == self.row[p])  # a row reduction read back in its kernel
        if mine is None:  # a reduction takes a lone fusible producer into its kernel
            return not (self.nodes[j].primitive in _REDUCING and self.readers[(v, p)] == {j})
        recomputed = p in self.free or self.nodes[p].primitive in _RECOMPUTED
        return not recomputed and mine != self.kernel[p]

    def written(self, v, p: int) -> bool:
        """Whether `v`, made by operator `p`, is written to device memory: a program result, or a
        value read from there."""
        return self.last.get(v, -2) == p or any(self.read(v, p, k) for k in self.readers.get((v, p), ()))


def _row_reduction(node: Node) -> bool:
    """Whether `node` reduces its operand's minor dim (a softmax's max and sum, a norm's mean)."""
    axes = node.eqn.params.get("axes")
    if node.primitive not in REDUCTIONS or axes is None or not node.eqn.invars:
        return False
    rank = len(getattr(node.eqn.invars[0].aval, "shape", ()))
    return rank > 0 and rank - 1 in tuple(axes)
