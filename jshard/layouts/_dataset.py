"""The dataset policy: MindSpore's `dataset_strategy`, one strategy per batch array.

`"data_parallel"` cuts dim 0 of every array over all devices, `"full_batch"` gives every device the
whole batch, and a sequence holds one strategy tuple or `Layout` call per array. `parallelize`, the
pipeline and `jshard.data`'s loader all take their batch layouts from here.
"""

from __future__ import annotations

from collections.abc import Sequence

from jshard._errors import ShardingError
from jshard.layouts._slots import Slot, canonicalize_slot
from jshard.layouts._strategy import TensorLayout

DatasetStrategy = str | Sequence[tuple[int, ...] | TensorLayout]
"""`"data_parallel"`, `"full_batch"`, or one strategy tuple / `Layout` call per array of the batch."""

DATASET_STRATEGIES = ("data_parallel", "full_batch")
"""The named dataset strategies."""


def check_dataset_strategy(strategy: object, *, call: str, tuples: bool = True) -> None:
    """Raises `ShardingError` for a `dataset_strategy` that is none of its accepted forms (only the
    named ones where `tuples` is False)."""
    if strategy in DATASET_STRATEGIES:
        return
    if not tuples or isinstance(strategy, str) or not isinstance(strategy, Sequence):
        named = f"{call}: dataset_strategy={strategy!r} is not one of {DATASET_STRATEGIES}"
        raise ShardingError(named + "." if not tuples else named + ", nor one strategy per batch array; give "
                            "\"data_parallel\", \"full_batch\", or one strategy tuple per batch array, e.g. "
                            "((1, 1, 2, 4),) for one NHWC image array.")


def dataset_slots(ndims: Sequence[int], strategy: DatasetStrategy, n: int, *, call: str) -> list[Slot]:
    """One strategy slot per batch array (given by its number of dims) over `n` devices.

    Examples:
      >>> dataset_slots([2, 0], "data_parallel", 8, call="f")
      [(8, 1), ()]
    """
    check_dataset_strategy(strategy, call=call)
    if strategy == "data_parallel":
        return [(n,) + (1,) * (d - 1) if d else () for d in ndims]
    if strategy == "full_batch":
        return [(1,) * d for d in ndims]
    if len(strategy) != len(ndims):
        raise ShardingError(f"{call}: dataset_strategy has {len(strategy)} entries {tuple(strategy)}, but the batch "
                            f"has {len(ndims)} arrays; give one strategy per array.")
    slots = [canonicalize_slot(s, call=call, what=f"dataset_strategy[{i}]") for i, s in enumerate(strategy)]
    for i, (slot, d) in enumerate(zip(slots, ndims)):
        rank = slot.rank if isinstance(slot, TensorLayout) else len(slot)
        if rank != d:
            raise ShardingError(f"{call}: dataset_strategy[{i}]={slot} has {rank} entries, but batch array {i} has "
                                f"{d} dims; give one entry per dim.")
    return slots


def check_batch_rows(shape: Sequence[int], n: int, *, call: str, where: str) -> None:
    """`dataset_strategy="data_parallel"` needs `n` to divide the batch array's rows."""
    if shape and shape[0] % n:
        raise ShardingError(
            f"{call}: dataset_strategy='data_parallel' cuts dim 0 of the batch input {where} (shape "
            f"{list(shape)}) over {n} devices, but {n} does not divide {shape[0]}. Use a batch size that is a "
            f"multiple of {n}, give this argument an in_strategy, or pass dataset_strategy='full_batch'."
        )
