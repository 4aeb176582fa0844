"""`audit`: the collectives and per-device memory of a compiled program, read from XLA's own output.

The figures come from the program XLA will run, after SPMD partitioning: the collectives from the
HLO text of `jax.stages.Compiled.as_text()`, the memory from `Compiled.memory_analysis()`. Nothing is
estimated from the jaxpr, so the audit sees what the partitioner really inserted. Arguments and
results in host memory (`pinned_host`: offloaded state) are counted apart from the device's (see
`memory_figures`), so the peak is the device's.

Payload convention, in bytes per device for one execution of the instruction: the operand bytes
of an `all-reduce`, `reduce-scatter` (the tensor before the scatter) or `all-to-all`; the result bytes of an `all-gather` (the gathered tensor). Combined
(tuple-shaped) collectives sum their elements. An asynchronous pair counts once, at its `-start`
(the `-done` carries no payload of its own); an `all-gather-start` result is the tuple (operands,
gathered), so its payload is its result bytes less its operand bytes.

A `collective-permute` sends only from the sources in its `source_target_pairs`: on a device that is
a source its payload is its operand bytes, on any other device (idle in that permute) 0. Its bytes
per device are the busiest device's: the most that one device sends over all the permutes of the
program (trip-weighted), per `Collective` and per kind in `Audit.bytes` (`Collective.sent` keeps
each device's sum).

Group size is the number of devices in one replica group, whichever way XLA prints the groups:
explicit (`{{0,1},{2,3}}`: 2), iota (`[2,4]<=[8]`: 4), mesh axes
(`mesh['x'=2,'y'=4] {'y'}`: 4, a sub-axis `'y':(1)2`: 2) or empty (`{}`: every device of the
program). A `collective-permute` has source-target pairs instead; its group is the largest set of
devices its pairs connect.

Loops and calls: an instruction counts once per execution. A `while` body runs `n` times when XLA
records `known_trip_count` `n` in the loop's `backend_config`, its condition `n + 1` times; nested
loops multiply. Fusions, calls, reducers and conditional branches run with their caller's weight
(every branch counted, so a conditional gives an upper bound). A loop without a known trip count
weighs 1 and is counted in `Audit.unknown_trip_counts`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Callable, Iterator

import jax

from jshard._errors import api_boundary
from jshard._format import human_bytes

_KINDS = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
_WIDTHLESS = {"pred": 8, "token": 0}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LAID_OUT = re.compile(r"[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?")
_HOST_SPACE = "S(5)"
"""How an HLO layout marks an array in host memory (XLA's `Layout::kHostMemorySpace`)."""
_ALIAS = re.compile(r"\{(\d*)[\d,\s]*\}\s*:\s*\(\d+")
"""One `input_output_alias` entry, `{output index}: (parameter, {index}, kind)`: the output's top index."""
_DEVICE_FIGURES = ("argument", "output", "temp", "alias", "code")
_HOST_FIGURES = ("argument", "output", "temp", "alias")


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """The collectives of one kind and replica-group size in a compiled program.

    Attributes:
      kind: `all-reduce`, `all-gather`, `reduce-scatter`, `all-to-all` or `collective-permute`.
      count: executions, weighted by the trip counts of the loops around them.
      bytes: payload bytes per device over all those executions (see the module docstring); for
        `collective-permute` the busiest device's, `max(sent)`.
      group_size: devices per replica group.
      sent: `collective-permute` only: the trip-weighted bytes each device sends (index: device id),
        0 where a device is no source of the permute; empty for other kinds. Not compared.
    """

    kind: str
    count: float
    bytes: float
    group_size: int
    sent: tuple[float, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"Collective: kind {self.kind!r} is not one of {', '.join(_KINDS)}.")
        if self.group_size < 1:
            raise ValueError(f"Collective: group_size must be at least 1, got {self.group_size}.")


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryFigures:
    """Per-device memory of a compiled program, as XLA's buffer assignment reports it, device memory
    and host memory (`pinned_host` arguments and results) apart.

    Attributes:
      argument_bytes / output_bytes / temp_bytes: the arguments, results and scratch buffers in
        device memory.
      alias_bytes: device bytes shared between arguments and results (donated buffers).
      code_bytes: generated code.
      host_argument_bytes / host_output_bytes / host_alias_bytes: the same in host memory.
      host_temp_bytes: scratch buffers in host memory where the backend reports them (XLA:CPU does
        not: its temporaries all count as the device's).
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    code_bytes: int
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_temp_bytes: int = 0
    host_alias_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """`argument + output + temp - alias` in device memory: an upper bound on the device bytes
        live at once.

        Buffer assignment may free arguments early or reuse them, so the true peak can be lower.
        """
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def host_bytes(self) -> int:
        """`argument + output + temp - alias` in host memory (0 where the program keeps nothing there)."""
        return self.host_argument_bytes + self.host_output_bytes + self.host_temp_bytes - self.host_alias_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Audit:
    """What a compiled program communicates and holds, per device.

    Attributes:
      collectives: one `Collective` per (kind, group size), sorted by kind then group size.
      memory: the program's `MemoryFigures`.
      unknown_trip_counts: `while` loops XLA gave no trip count; their collectives count once.

    Examples:
      >>> report = Audit((Collective("all-reduce", 5.0, 10240.0, 4),),
      ...                MemoryFigures(1536, 512, 4256, 0, 0), unknown_trip_counts=0)
      >>> report.count("all-reduce"), report.bytes()
      (5.0, 10240.0)
      >>> print(report.summary())
      kind                 count       bytes  groups
      all-reduce               5      10 KiB  4
      memory per device: argument 1.5 KiB, output 512 B, temp 4.156 KiB, alias 0 B, code 0 B
      peak (upper bound): 6.156 KiB
    """

    collectives: tuple[Collective, ...]
    memory: MemoryFigures
    unknown_trip_counts: int

    def count(self, kind: str | None = None) -> float:
        """Trip-weighted executions of `kind` (every kind when None)."""
        return sum((c.count for c in self._of(kind)), 0.0)

    def bytes(self, kind: str | None = None) -> float:
        """Trip-weighted payload bytes per device of `kind` (every kind when None, summed over kinds).

        `collective-permute`: the busiest device's bytes, the most that one device sends over every
        permute of the program (devices idle in a permute's `source_target_pairs` send nothing), so
        permutes of different group sizes are added device by device before the maximum."""
        if kind is None:
            return sum((self.bytes(k) for k in dict.fromkeys(c.kind for c in self.collectives)), 0.0)
        found = list(self._of(kind))
        if kind == "collective-permute" and found and all(c.sent for c in found):
            width = max(len(c.sent) for c in found)
            return max(sum(c.sent[d] for c in found if d < len(c.sent)) for d in range(width))
        return sum((c.bytes for c in found), 0.0)

    def by_kind(self) -> dict[str, tuple[float, float]]:
        """`kind -> (count, bytes)` for each kind present, group sizes merged."""
        return {kind: (self.count(kind), self.bytes(kind)) for kind in dict.fromkeys(c.kind for c in self.collectives)}

    def summary(self) -> str:
        """A short table of the collectives, then the memory figures."""
        lines = [f"{'kind':<20}{'count':>6}{'bytes':>12}  groups" if self.collectives else "no collectives"]
        for kind, (count, size) in self.by_kind().items():
            groups = ", ".join(str(c.group_size) for c in self._of(kind))
            lines.append(f"{kind:<20}{count:>6g}{human_bytes(size):>12}  {groups}")
        if self.unknown_trip_counts:
            lines.append(f"{self.unknown_trip_counts} while loop(s) without a known trip count, counted once")
        m = self.memory
        lines += [f"memory per device: {_figures(m, '', _DEVICE_FIGURES)}",
                  f"peak (upper bound): {human_bytes(m.peak_bytes)}"]
        if any(getattr(m, f"host_{name}_bytes") for name in _HOST_FIGURES):
            lines.append(f"host memory per device: {_figures(m, 'host_', _HOST_FIGURES)}; "
                         f"held {human_bytes(m.host_bytes)}")
        return "\n".join(lines)

    def _of(self, kind: str | None) -> Iterator[Collective]:
        if kind is not None and kind not in _KINDS:
            raise ValueError(f"Audit: unknown collective kind {kind!r}; use one of {', '.join(_KINDS)} or None.")
        return (c for c in self.collectives if kind in (None, c.kind))


def _figures(memory: MemoryFigures, prefix: str, names: tuple[str, ...]) -> str:
    """`argument 1.5 KiB, output 512 B, ...`: the figures `names` of `memory` (`prefix` + name + `_bytes`)."""
    return ", ".join(f"{name} {human_bytes(getattr(memory, f'{prefix}{name}_bytes'))}" for name in names)


@api_boundary
def audit(compiled: jax.stages.Compiled) -> Audit:
    """Counts the collectives and reads the per-device memory of a compiled program.

    Args:
      compiled: `jax.jit(f).lower(*args).compile()`.

    Returns:
      An `Audit`; see the module docstring for how payloads, group sizes and loops are counted.

    Raises:
      TypeError: if `compiled` is not a `jax.stages.Compiled` (a `Lowered` needs `.compile()`).
      ValueError: if the backend reports no memory analysis, or the HLO text cannot be read.

    Examples:
      >>> import numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
      >>> f = jax.jit(lambda x: x @ x.T, in_shardings=NamedSharding(mesh, P(None, "b")),
      ...             out_shardings=NamedSharding(mesh, P()))
      >>> report = audit(f.lower(jax.numpy.ones((16, 32))).compile())
      >>> report.by_kind()  # the f32[16,16] partial products, summed over "b"
      {'all-reduce': (1.0, 1024.0)}
      >>> report.collectives[0].group_size
      4
    """
    if not isinstance(compiled, jax.stages.Compiled):
        raise TypeError(
            f"jshard.audit expects a jax.stages.Compiled, got {type(compiled).__name__}. "
            "Pass jax.jit(f).lower(*args).compile()."
        )
    text = _uncommented(compiled.as_text())
    collectives, unknown = read_collectives(text)
    return Audit(collectives, _memory(compiled, lambda: text.split("\n", 1)[0]), unknown)


def memory_figures(compiled: jax.stages.Compiled) -> MemoryFigures:
    """The per-device memory of a compiled program (`audit(compiled).memory` without reading its
    collectives).

    Host memory apart: where the backend reports host bytes (`memory_analysis()`'s `host_*` sizes),
    they are XLA's; where it reports none (XLA:CPU, whose device and host memory are one RAM, counts
    `pinned_host` arguments and results with the device's), the entry computation's layout says which
    arguments and results live in host memory (memory space `S(5)`), and its `input_output_alias`
    which of them are donated: their bytes are moved from the device's figures to the host's.

    Raises:
      ValueError: if the backend reports no memory analysis.
    """
    return _memory(compiled, lambda: _uncommented(compiled.as_text().split("\n", 1)[0]))


def _uncommented(text: str) -> str:
    # XLA numbers long operand lists with comments (`/*index=5*/%x`); they are not part of names.
    return re.sub(r"/\*.*?\*/", "", text)


def _memory(compiled: jax.stages.Compiled, header: Callable[[], str]) -> MemoryFigures:
    """`compiled`'s memory figures; `header`: its HLO module's header line, read only where the
    backend reports no host bytes (the budget check's compiled peak reads no collectives, so the
    whole text is not uncommented for it)."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError("jshard.audit: this backend reports no memory analysis for the compiled program.")
    device = (stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes)
    host = (stats.host_argument_size_in_bytes, stats.host_output_size_in_bytes, stats.host_alias_size_in_bytes)
    if not any(host) and not stats.host_temp_size_in_bytes:
        host = _host_buffers(header())
        device = tuple(d - h for d, h in zip(device, host))
    return MemoryFigures(
        argument_bytes=int(device[0]),
        output_bytes=int(device[1]),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(device[2]),
        code_bytes=int(stats.generated_code_size_in_bytes),
        host_argument_bytes=int(host[0]),
        host_output_bytes=int(host[1]),
        host_temp_bytes=int(stats.host_temp_size_in_bytes),
        host_alias_bytes=int(host[2]),
    )


def _host_buffers(header: str) -> tuple[float, float, float]:
    """Bytes of the host-memory (`S(5)`) arguments, results and donated results of an HLO module,
    from its header line's `entry_computation_layout={(params)->result}` and `input_output_alias`."""
    params, _, result = _attribute(header, "entry_computation_layout").partition("->")
    results = _operands(result[1:]) if result.startswith("(") else [result]
    host = [_host_array_bytes(r) for r in results]
    aliased = {int(index or 0) for index in _ALIAS.findall(_attribute(header, "input_output_alias"))}
    return (sum(map(_host_array_bytes, _operands(params[1:]) if params else [])), sum(host),
            sum(host[i] for i in aliased if i < len(host)))


def _attribute(header: str, name: str) -> str:
    """The text inside `name={...}` of an HLO module's header line ("" where it has none)."""
    start = header.find(f" {name}={{")
    if start < 0:
        return ""
    start += len(name) + 2
    return header[start + 1 : _close(header, start)].strip()


def _host_array_bytes(shape: str) -> float:
    """Bytes of the arrays of an HLO shape whose layout puts them in host memory (`{1,0:S(5)}`)."""
    return sum(_shape_bytes(array) for array in _LAID_OUT.findall(shape) if _HOST_SPACE in array)


@dataclasses.dataclass(frozen=True, slots=True)
class _Instr:
    """One HLO instruction: `name = shape opcode(operands), attributes`; `rest` follows `opcode(`."""

    name: str
    shape: str
    opcode: str
    rest: str


def read_collectives(text: str) -> tuple[tuple[Collective, ...], int]:
    """The trip-weighted collectives of an HLO module's text, and its loops of unknown trip count."""
    computations, entry = _computations(text)
    header = text.split("\n", 1)[0]
    devices = math.prod(int(n) for n in re.findall(r"\b(?:num_partitions|replica_count)=(\d+)", header))
    totals: dict[tuple[str, int], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    sent: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)  # group -> device -> bytes
    weights = _weights(computations, entry)
    for name, weight in weights.items():
        shapes = {instr.name: instr.shape for instr in computations[name]}
        for instr in computations[name]:
            kind = instr.opcode.removesuffix("-start")
            if kind in _KINDS:
                group = _group_size(instr.rest, devices)
                total = totals[kind, group]
                total[0] += weight
                payload = weight * _payload(instr, kind, shapes)
                if kind == "collective-permute":
                    for source in {int(a) for a, _ in _pairs(instr.rest)}:
                        sent[group][source] += payload
                else:
                    total[1] += payload
    unknown = sum(i.opcode == "while" and _trip(i) is None for n in weights for i in computations[n])
    width = max([devices, *(d + 1 for per in sent.values() for d in per)])
    found = []
    for (kind, group), (count, size) in totals.items():
        if kind == "collective-permute":
            per = tuple(float(sent[group][d]) for d in range(width))
            found.append(Collective(kind, count, max(per, default=0.0), group, per))
        else:
            found.append(Collective(kind, count, size, group))
    return tuple(sorted(found, key=lambda c: (c.kind, c.group_size))), unknown


def _computations(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """Splits the module into computations (name -> instructions) and names the entry."""
    computations: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{") and not line.startswith("HloModule"):
            head = re.match(r"(ENTRY\s+)?%?([^\s(]+)", line)
            assert head is not None  # a computation's first line, which names it
            current = computations.setdefault(head[2], [])
            entry = head[2] if head[1] else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (instr := _instruction(line)):
            current.append(instr)
    if not entry:
        raise ValueError("jshard.audit: the compiled program's HLO text has no ENTRY computation.")
    return computations, entry


def _instruction(line: str) -> _Instr | None:
    match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if match is None:
        return None
    text = line[match.end() :]
    end = _close(text, 0) + 1 if text.startswith("(") else text.find(" ")
    op = re.match(r"\s*([\w\-]+)\(", text[end:]) if end > 0 else None
    if op is None:
        return None
    return _Instr(match[1], text[:end], op[1], text[end + op.end() :])


def _close(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start`, counting `()`, `[]` and `{}` alike."""
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] in "([{") - (text[i] in ")]}")
        if depth == 0:
            return i
    raise ValueError(f"jshard.audit: unbalanced brackets in HLO text: {text!r}")


def _weights(computations: dict[str, list[_Instr]], entry: str) -> dict[str, float]:
    """How many times each computation reachable from `entry` runs per execution of the program."""
    weights: dict[str, float] = collections.Counter()
    stack = [(entry, 1.0)]
    while stack:
        name, weight = stack.pop()
        if name not in computations:
            raise ValueError(f"jshard.audit: the HLO text calls computation {name!r} but never defines it.")
        weights[name] += weight
        for instr in computations[name]:
            stack.extend((callee, weight * factor) for callee, factor in _calls(instr))
    return weights


def _calls(instr: _Instr) -> list[tuple[str, float]]:
    """The computations `instr` calls, each with how many times it runs per execution of `instr`."""
    if instr.opcode in ("async-update", "async-done"):
        return []  # the same computation as their async-start: count it once
    trip = _trip(instr) if instr.opcode == "while" else None
    factors = {} if trip is None else {"body": trip, "condition": trip + 1}
    return [
        (callee, float(factors.get(attribute, 1)))
        for attribute, value in _CALLEE.findall(_STRING.sub('""', instr.rest))
        for callee in re.findall(r"%?([\w.\-]+)", value)
    ]


def _trip(instr: _Instr) -> int | None:
    match = _TRIP.search(instr.rest)
    return int(match[1]) if match else None


def _payload(instr: _Instr, kind: str, shapes: dict[str, str]) -> float:
    """Bytes per device moved by one execution of the collective `instr` (see the module docstring)."""
    operands = sum(_operand_bytes(operand, shapes) for operand in _operands(instr.rest))
    if kind != "all-gather":
        return operands
    result = _shape_bytes(instr.shape)
    return result - operands if instr.opcode.endswith("-start") else result


def _operands(rest: str) -> list[str]:
    """The operands that open `rest` (the text after `opcode(`), split at their top-level commas."""
    text = rest[: _close("(" + rest, 0) - 1]
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [part.strip() for part in [*parts, text[start:]] if part.strip()]


def _operand_bytes(operand: str, shapes: dict[str, str]) -> float:
    """Bytes of an operand printed as `%name` (looked up) or `f32[8]{0} %name` (shape inline)."""
    shape, _, name = operand.rpartition(" ")
    if shape:
        return _shape_bytes(shape)
    if name.lstrip("%") not in shapes:
        raise ValueError(f"jshard.audit: no shape for operand {name!r} in the HLO text.")
    return _shape_bytes(shapes[name.lstrip("%")])


def _shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape such as `f32[8,16]{1,0}` or a tuple of them (summed)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        elements = 1
        for dim in filter(None, dims.split(",")):
            elements *= int(dim.strip().removeprefix("<="))
        total += elements * _element_bits(dtype) / 8
    return total


def _element_bits(dtype: str) -> int:
    """Bits of an HLO element type: `pred` 8, `token` 0, else the width in its name (`bf16`, `f8e4m3fn`)."""
    if dtype in _WIDTHLESS:
        return _WIDTHLESS[dtype]
    width = re.search(r"\d+", dtype)
    if width is None:
        raise ValueError(f"jshard.audit: unknown HLO element type {dtype!r}.")
    return int(width[0])


def _group_size(attributes: str, devices: int) -> int:
    """Devices per replica group of a collective, from `replica_groups=` or `source_target_pairs=`."""
    at = attributes.find("replica_groups=")
    if at < 0:
        return _permute_group(_pairs(attributes))
    groups = attributes[at + len("replica_groups=") :]
    if groups.startswith("{{"):
        return len(groups[2 : groups.index("}")].split(","))
    if groups.startswith("["):
        return int(groups[1 : groups.index("]")].split(",")[-1])
    if groups.startswith("mesh["):
        return _mesh_group(groups)
    return devices  # `{}`: one group of every device


def _mesh_group(groups: str) -> int:
    """Group size of `mesh['x'=2,'y'=4](, device_ids=...) {'y'}`: the product of the named axes."""
    mesh = groups[: _close(groups, 4) + 1]
    sizes = dict(re.findall(r"'?([\w.\-]+)'?=(\d+)", mesh))
    axes = re.match(r"(?:,\s*device_ids=\(.*?\))?\s*\{([^}]*)\}", groups[len(mesh) :])
    if axes is None:
        raise ValueError(f"jshard.audit: cannot read the replica groups {groups[:80]!r}.")
    size = 1
    for axis in filter(None, axes[1].split(",")):
        name, _, sub = axis.strip().partition(":")
        size *= int(sub.rpartition(")")[2]) if sub else int(sizes[name.strip("'\"")])
    return size


def _pairs(attributes: str) -> list[tuple[str, str]]:
    """The `(source, target)` device ids of a collective-permute's `source_target_pairs`."""
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attributes)
    return re.findall(r"\{(\d+),(\d+)\}", pairs[1]) if pairs else []


def _permute_group(pairs: list[tuple[str, str]]) -> int:
    """The most devices that a collective-permute's source-target pairs connect."""
    groups: list[set[str]] = []
    for source, target in pairs:
        touching = [group for group in groups if source in group or target in group]
        groups = [group for group in groups if not any(group is t for t in touching)]
        groups.append({source, target}.union(*touching))
    return max((len(group) for group in groups), default=1)

