"""Which form of context-parallel attention a cut sequence takes: each form's collectives per
device, priced by the `CostModel`, and the keys and values each holds, against its memory."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from jshard.cost import Comm, CostModel


class AttentionShape(NamedTuple):
    """One attention's sizes as each device of the sequence's group sees them before it runs.

    Attributes:
      batch: rows per device.
      length: the whole sequence's length.
      heads: query heads per device (after any tensor-parallel cut).
      kv_heads: key/value heads per device.
      head_dim: the width of one head.
      itemsize: bytes per element.
    """

    batch: int
    length: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int

    def block(self, parts: int, heads: int) -> float:
        """Bytes of one device's run of the sequence over `heads` heads."""
        return self.batch * self.length / parts * heads * self.head_dim * self.itemsize


class ContextChoice(NamedTuple):
    """The form a cut sequence's attention takes, and why.

    Attributes:
      form: `"gather"`, `"ring"` or `"ulysses"`.
      seconds: per form weighed, its forward collectives' predicted seconds.
      held: per form weighed, the bytes of keys and values each device holds while it attends.
      refused: per form not weighed, why.
      why: the choice in words.
    """

    form: str
    seconds: Mapping[str, float]
    held: Mapping[str, float]
    refused: Mapping[str, str]
    why: str


def comms(form: str, shape: AttentionShape, axes: tuple[str, ...], parts: int) -> list[Comm]:
    """The forward collectives of `form` per device, in the audit's convention (an all-gather's
    result bytes, every other kind's operand bytes)."""
    kv = shape.block(parts, shape.kv_heads)
    if form == "gather":
        return [Comm("all-gather", kv * parts, axes)] * 2
    if form == "ring":
        return [Comm("collective-permute", kv, axes)] * (2 * (parts - 1))
    q = shape.block(parts, shape.heads)
    return [Comm("all-to-all", q, axes)] * 2 + [Comm("all-to-all", kv, axes)] * 2


def refusal(form: str, shape: AttentionShape, parts: int, zigzag: bool, block: int | None = None,
            halved: bool = False) -> str | None:
    """Why `form` cannot run over `parts` devices, or None (`block`: the call's tile of keys, which
    must divide the ring's blocks, the sequence over `parts` and halved where `halved`, the zig-zag
    order of a causal mask)."""
    if form == "ulysses" and shape.kv_heads % parts:
        return (
            f"Ulysses cuts the heads {parts} ways, but {parts} does not divide the {shape.kv_heads} "
            f"key/value heads each device holds"
        )
    if zigzag and shape.length % (2 * parts):
        return f"the zig-zag order cuts the sequence into {2 * parts} chunks, which do not divide {shape.length}"
    keys = shape.length // parts // (2 if halved else 1)
    if form == "ring" and block is not None and keys % block:
        return f"the ring's blocks of {keys} keys do not divide into the call's tiles of block={block} keys"
    return None


def choose(
    shape: AttentionShape,
    axes: tuple[str, ...],
    axis_size: Mapping[str, int],
    cost: CostModel,
    zigzag: bool = False,
    block: int | None = None,
    halved: bool = False,
) -> ContextChoice:
    """The form of least predicted seconds among those whose keys and values fit `cost.memory`
    (all of them where it is None); a tie within 2% goes to the form holding less. Where the cost
    model overlaps collectives with compute (`CostModel.overlap`, a GPU's), each of the ring's
    passes runs beside the block before it, and only what the block's compute does not hide counts.
    A form `refusal` refuses (`block`, `halved`: as it takes them) is not weighed.

    Examples:
      >>> mha = AttentionShape(batch=1, length=32768, heads=32, kv_heads=32, head_dim=128, itemsize=2)
      >>> choose(mha, ("sp",), {"sp": 8}, CostModel()).form
      'ulysses'
      >>> gqa = mha._replace(kv_heads=4)
      >>> choose(gqa, ("sp",), {"sp": 8}, CostModel()).form
      'gather'
    """
    parts = math.prod(axis_size[a] for a in axes)
    refused = {f: why for f in ("gather", "ring", "ulysses") if (why := refusal(f, shape, parts, zigzag, block, halved))}
    held = {
        "gather": 2 * shape.block(1, shape.kv_heads),
        "ring": 4 * shape.block(parts, shape.kv_heads),
        "ulysses": 2 * shape.block(1, shape.kv_heads // parts if shape.kv_heads >= parts else 1),
    }
    held = {f: b for f, b in held.items() if f not in refused}
    seconds = {f: sum(cost.time(c, axis_size) for c in comms(f, shape, axes, parts)) for f in held}
    if "ring" in seconds and cost.overlap:  # each pass runs beside the block before it: what shows is the rest
        block = cost.compute_seconds(_block_flops(shape, parts) / (2 if zigzag else 1), matmul=True)
        step = seconds["ring"] / (parts - 1)
        seconds["ring"] = (parts - 1) * max(step - block, 2 * cost.group_latency(axes))
    fits = [f for f in held if cost.memory is None or held[f] <= cost.memory] or list(held)
    best = min(seconds[f] for f in fits)
    form = min((f for f in fits if seconds[f] <= 1.02 * best), key=lambda f: held[f])
    over = [f for f in held if f not in fits]
    why = (
        f"{form}: {seconds[form] * 1e6:.1f} us of collectives forward, least of "
        + ", ".join(f"{f} {seconds[f] * 1e6:.1f} us" for f in seconds if f != form)
        + (f"; {', '.join(over)} would hold more keys and values than the {cost.memory:.3g} bytes" if over else "")
        + "".join(f"; not {f}: {w}" for f, w in refused.items())
    )
    return ContextChoice(form, seconds, held, refused, why)


def _block_flops(shape: AttentionShape, parts: int) -> float:
    """The floating-point work of one device's queries on one block of keys and values: scores and
    weighted values, two products of `length / parts` rows by `length / parts` columns per head."""
    rows = shape.length / parts
    return 4 * shape.batch * rows * rows * shape.heads * shape.head_dim
