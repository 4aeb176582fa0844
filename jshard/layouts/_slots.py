"""Strategy slots: what one input or output of `shard` / `parallelize` may be given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

from jax.sharding import PartitionSpec

from jshard._errors import ShardingError
from jshard.layouts._layout import Layout
from jshard.layouts._strategy import (
    TensorLayout,
    canonicalize_strategy,
    with_repeated_calculation,
)

Slot = tuple[int, ...] | TensorLayout | PartitionSpec | None
"""One input's or output's strategy after canonicalization."""


def canonicalize_slot(value: object, *, call: str, what: str) -> Slot:
    """One strategy slot: a tuple of ints, a `Layout` call's `TensorLayout`, a `PartitionSpec`, or None."""
    if value is None or isinstance(value, (TensorLayout, PartitionSpec)):
        return value
    if isinstance(value, Layout):
        raise TypeError(
            f"{call}: {what} is the Layout {value!r} itself; call it with one alias per tensor dim, "
            f"e.g. {what}=layout(\"dp\", \"None\")."
        )
    return canonicalize_strategy(value, call=call, what=what)


def canonicalize_slots(values: object, *, call: str, what: str) -> tuple[Slot, ...]:
    """A whole `in_strategy` / `out_strategy`: a tuple with one slot per input or output."""
    if isinstance(values, (TensorLayout, PartitionSpec)) or not isinstance(values, Sequence) or isinstance(values, str):
        raise TypeError(
            f"{call}: {what} must be a tuple with one entry per tensor, e.g. {what}=((2, 1), (1, 4)); "
            f"got {values!r}."
        )
    return tuple(canonicalize_slot(v, call=call, what=f"{what}[{i}]") for i, v in enumerate(values))


@overload
def layout_of(slot: None, device_count: int, *, call: str, op: str, what: str) -> None: ...
@overload
def layout_of(slot: tuple[int, ...] | TensorLayout | PartitionSpec, device_count: int, *, call: str, op: str,
              what: str) -> TensorLayout: ...
@overload
def layout_of(slot: Slot, device_count: int, *, call: str, op: str, what: str) -> TensorLayout | None: ...
def layout_of(slot: Slot, device_count: int, *, call: str, op: str, what: str) -> TensorLayout | None:
    """A slot as a full-device-count layout: a lone tuple is its own device matrix (+ repeats)."""
    if slot is None:
        return None
    if isinstance(slot, PartitionSpec):
        raise ShardingError(f"{call}: {what}={slot} is a PartitionSpec; use a strategy tuple or a Layout here.")
    if isinstance(slot, TensorLayout):
        if slot.device_count != device_count:
            raise ShardingError(
                f"{call}: {what}={slot.describe()} comes from a Layout whose device matrix "
                f"{list(slot.device_matrix)} holds {slot.device_count} devices, but the program runs on "
                f"{device_count}. A Layout's device matrix must multiply to the device count."
            )
        return slot
    layout = TensorLayout(slot, tuple((d,) for d in range(len(slot))))
    return with_repeated_calculation(layout, device_count, call=call, op=op, what=f"{what}={slot}")
