"""`save` / `restore`: sharded train state on Orbax, resharded on the way back in.

A checkpoint directory holds one subdirectory per step (`<dir>/<step>/`), each with the state
(`state/`, every process writing the shards it holds) and, when given, the `Plan` that laid it out
(`plan/`, JSON as `Plan.save` writes it). Orbax writes a step into a temporary directory and renames
it into place only once every process has finished (its atomic finalize), so a crash mid-save
leaves the previous step as the latest one and never a half-written one.

`restore` reads the state onto any shardings: another device count, another strategy, another
mesh. Each process reads only the slices its devices hold; the values are the saved ones, bit for
bit.

Bad files are errors that name them, never wrong values: once a step is complete, the size and
CRC-32 of each of its files are recorded (`_files.py`), and `restore` / `load_plan` check the files
they read first. A damaged step, a directory another program wrote, or a file Orbax cannot read is
a `ShardingError` naming the file and the earlier complete step to restore instead; a damaged step
never touches the others. Only JSON and array data are read: nothing in a checkpoint is executed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jshard._distributed import host_major
from jshard._errors import ShardingError, api_boundary
from jshard._format import shape_str
from jshard.checkpoint._files import damage, record
from jshard.plan import Plan, load, to_json

_SHOWN = 12


class SaveHandle:
    """A save in progress (`save(..., blocking=False)`); `wait()` returns once it is on disk."""

    def __init__(self, manager: ocp.CheckpointManager | None, step: int, directory: str):
        self._manager, self.step, self.directory = manager, step, directory

    def wait(self) -> int:
        """Blocks until the step is finalized (and its files recorded); returns the step."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None
            if jax.process_index() == 0:
                record(os.path.join(self.directory, str(self.step)))
        return self.step

    @property
    def done(self) -> bool:
        return self._manager is None


@api_boundary
def save(directory: str | os.PathLike, state: Any, plan: Plan | None = None, *, step: int = 0,
         blocking: bool = True, keep: int | None = None) -> SaveHandle:
    """Writes `state` (a pytree of arrays, sharded or not) as step `step` of `directory`.

    Every process of a job calls it with its (global) arrays; each writes the shards it holds.

    Args:
      directory: the checkpoint directory (created if missing).
      state: the pytree to save, e.g. `(params, opt_state)`.
      plan: the `Plan` the state was laid out by, stored beside it (`load_plan`).
      step: the step number; a step already saved is an error.
      blocking: False returns at once while Orbax writes in the background; call `.wait()` on the
        handle (before the next save, and before exiting).
      keep: keep only the latest `keep` steps (default: all).

    Returns:
      A `SaveHandle` (already done when `blocking`).

    Raises:
      ShardingError: `step` is already in `directory`.

    Examples:
      >>> import tempfile, numpy as np
      >>> d = tempfile.mkdtemp()
      >>> save(d, {"w": np.ones((8, 2))}, step=1).done, latest_step(d)
      (True, 1)
    """
    directory = os.path.abspath(os.fspath(directory))
    manager = _manager(directory, create=True, async_=not blocking, keep=keep)
    if step in manager.all_steps():
        manager.close()
        raise ShardingError(f"jshard.checkpoint.save({directory!r}): step {step} is already saved there "
                            f"(steps {list(manager.all_steps())}). Save under a new step number.")
    items = {"state": ocp.args.StandardSave(state)}
    if plan is not None:
        items["plan"] = ocp.args.JsonSave(to_json(plan))
    manager.save(step, args=ocp.args.Composite(**items))
    handle = SaveHandle(manager, step, directory)
    if blocking:
        handle.wait()
    return handle


@api_boundary
def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete step in `directory`, or None (no directory, or no finished step)."""
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        return None
    with _manager(directory) as manager:
        return manager.latest_step()


@api_boundary
def load_plan(directory: str | os.PathLike, step: int | None = None) -> Plan | None:
    """The `Plan` saved with `step` (default the latest), or None if it was saved without one.

    Raises:
      ShardingError: no such step, or its plan file is damaged (naming the file).
    """
    call = f"jshard.checkpoint.load_plan({os.fspath(directory)!r})"
    directory = os.path.abspath(os.fspath(directory))
    step = _step(call, directory, step)
    _check_files(call, directory, step, "plan")
    path = os.path.join(directory, str(step), "plan", "metadata")
    return load(path, call) if os.path.exists(path) else None


@api_boundary
def restore(directory: str | os.PathLike, target: Any, *, step: int | None = None, like: Any = None) -> Any:
    """Reads step `step` (default the latest) of `directory` onto the shardings `target` names.

    Args:
      directory: the checkpoint directory.
      target: where the values go, one of
        - a pytree like the saved state of `jax.Array`s or `jax.ShapeDtypeStruct`s with shardings
          (shapes, dtypes and tree are checked against the checkpoint);
        - a pytree of `jax.sharding.Sharding`s (shapes and dtypes come from the checkpoint);
        - a `Plan`: the saved state is its function's leading arguments (a train step
          `step(params, opt_state, batch)` saved as `(params, opt_state)`), laid out as the plan
          lays them out. A plan read back by `Plan.load` holds no tree: pass `like=`.
      step: the step to read; default the latest complete one.
      like: with a loaded `Plan`, a pytree of the state's structure (arrays or shapes).

    Returns:
      The state, as global arrays on the target shardings.

    Raises:
      ShardingError: no such step; the target does not match the checkpoint (leaves missing or
        extra, other shapes), listing the mismatched leaves; the step is damaged (a file cut short,
        changed or missing, naming it) or was not written by `save`.
    """
    call = f"jshard.checkpoint.restore({os.fspath(directory)!r})"
    directory = os.path.abspath(os.fspath(directory))
    step = _step(call, directory, step)
    _check_files(call, directory, step, "state")
    with _manager(directory) as manager:
        saved = _saved_leaves(call, manager, directory, step)
        abstract = _abstract_target(call, target, like, saved)
        _check_match(call, step, saved, abstract)
        try:
            restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        except Exception as e:  # TensorStore raises bare Exceptions
            raise ShardingError(_unreadable_error(call, manager, directory, step, e)) from e
    return restored["state"]


def _check_files(call: str, directory: str, step: int, item: str) -> None:
    """Checks the files of `step`'s `item` against the record made when it was saved."""
    problems = damage(os.path.join(directory, str(step)), item + os.sep)
    if problems:
        with _manager(directory) as manager:
            earlier = _earlier(manager, step)
        raise ShardingError(
            f"{call}: step {step} is damaged; {len(problems)} file(s) in {os.path.join(directory, str(step))} differ "
            "from what was saved:\n  " + "\n  ".join(problems[:_SHOWN])
            + (f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else "") + f"\n{earlier}"
        )


def _saved_leaves(call: str, manager: ocp.CheckpointManager, directory: str, step: int) -> dict:
    """`path -> metadata` of every array of `step`'s state."""
    step_dir = os.path.join(directory, str(step))
    try:
        state = manager.item_metadata(step)["state"]
    except KeyError as e:
        items = sorted(p for p in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, p)))
        raise ShardingError(
            f"{call}: step {step} ({step_dir}) holds the items {items}, not the 'state' jshard.checkpoint.save "
            "writes: another program (Orbax's own CheckpointManager?) wrote this directory. Restore it with the "
            "program that wrote it, or give a directory jshard.checkpoint.save wrote."
        ) from e
    except Exception as e:  # its metadata cut short or changed
        raise ShardingError(_unreadable_error(call, manager, directory, step, e)) from e
    if state is None:
        raise ShardingError(_unreadable_error(call, manager, directory, step, FileNotFoundError(
            f"the state's metadata, {os.path.join(step_dir, 'state', '_METADATA')}, is missing")))
    return {_path(p): m for p, m in jax.tree_util.tree_flatten_with_path(state.tree)[0]}


def _unreadable_error(call: str, manager: ocp.CheckpointManager, directory: str, step: int, error: Exception) -> str:
    while (inner := error.__cause__ or error.__context__) is not None:  # TensorStore's own error names the file
        error = inner
    what = str(error).split(" [tensorstore_spec=")[0].split("\n")[0]
    what = what if len(what) <= 400 else what[:400] + " ..."
    return (f"{call}: step {step} ({os.path.join(directory, str(step))}) cannot be read: {type(error).__name__}: "
            f"{what}\nIts files were cut short, changed or removed after it was saved. {_earlier(manager, step)}")


def _earlier(manager: ocp.CheckpointManager, step: int) -> str:
    """Where a user whose `step` is damaged can go back to."""
    steps = sorted(manager.all_steps())
    earlier = [s for s in steps if s < step]
    if not earlier:
        return f"No earlier complete step to go back to (complete steps {steps}); save the state again."
    return (f"The other steps are untouched: restore the previous complete one with step={earlier[-1]} "
            f"(complete steps {steps}).")


def _manager(directory: str, *, create: bool = False, async_: bool = False, keep: int | None = None):
    options = ocp.CheckpointManagerOptions(create=create, enable_async_checkpointing=async_, max_to_keep=keep)
    handlers = {"state": ocp.StandardCheckpointHandler(), "plan": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _step(call: str, directory: str, step: int | None) -> int:
    steps = []
    if os.path.isdir(directory):
        with _manager(directory) as manager:
            steps = list(manager.all_steps())
    if step is None and steps:
        return max(steps)
    if step is not None and step in steps:
        return step
    have = f"its complete steps are {sorted(steps)}" if steps else "it holds no complete checkpoint"
    raise ShardingError(f"{call}: {'no step' if step is None else f'step {step} is not there'}: {have}. "
                        "Save one with jshard.checkpoint.save first, or give a step that exists.")


def _path(path: Sequence[Any]) -> str:
    """A tree path as Orbax keeps it (named tuples become dicts): `1/0/count`."""
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return "/".join(parts)


def _abstract_target(call: str, target: Any, like: Any, saved: dict) -> Any:
    """`target` as a pytree of `ShapeDtypeStruct`s with shardings."""
    if isinstance(target, Plan):
        target = _plan_shardings(call, target, like, len(saved))
    is_leaf = lambda x: isinstance(x, (Sharding, jax.ShapeDtypeStruct))
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_leaf)
    leaves = []
    for p, x in flat:
        if isinstance(x, Sharding):
            meta = saved.get(_path(p))
            shape, dtype = (meta.shape, meta.dtype) if meta is not None else ((), None)
            leaves.append(jax.ShapeDtypeStruct(shape, dtype, sharding=x))
        elif isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and x.sharding is not None:
            leaves.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding))
        else:
            raise TypeError(f"{call}: target leaf {_path(p) or '(root)'} is {type(x).__name__}; give a "
                            "jax.sharding.Sharding, a sharded jax.Array or a jax.ShapeDtypeStruct with a sharding.")
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _plan_shardings(call: str, plan: Plan, like: Any, count: int) -> Any:
    """The shardings a plan gives its leading arguments holding `count` leaves in all."""
    if plan.mesh is not None and plan.in_tree is not None and like is None:
        per_argument = plan.in_shardings
        taken, k = 0, 0
        while taken < count and k < len(per_argument):
            taken += len(jax.tree_util.tree_leaves(per_argument[k]))
            k += 1
        if taken != count:
            raise ShardingError(f"{call}: the checkpoint holds {count} arrays, but no run of the plan's leading "
                                f"arguments holds that many ({len(plan.in_specs)} in all); pass the shardings themselves.")
        return tuple(per_argument[:k])
    if like is None:
        raise ShardingError(f"{call}: a Plan read back by Plan.load keeps its shardings flat, not the state's "
                            "tree; pass like=<the state, or jax.eval_shape of it> along with the plan.")
    mesh = plan.mesh if plan.mesh is not None else plan.fine.jax_mesh(host_major(jax.devices())[: plan.device_count])
    leaves, treedef = jax.tree_util.tree_flatten(like)
    if len(leaves) > len(plan.in_specs):
        raise ShardingError(f"{call}: like= holds {len(leaves)} arrays, but the plan lays out only "
                            f"{len(plan.in_specs)} arguments: it is another function's plan. Pass the plan saved "
                            "with this state (jshard.checkpoint.load_plan), or the shardings themselves.")
    specs = [PartitionSpec() if s is None else s for s in plan.in_specs[: len(leaves)]]
    return jax.tree_util.tree_unflatten(treedef, [NamedSharding(mesh, s) for s in specs])


def _check_match(call: str, step: int, saved: dict, abstract: Any) -> None:
    """Checks the whole target against the checkpoint, then raises once with every mismatch."""
    wanted = {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    problems = [f"{p}: in the checkpoint, not in the target" for p in saved if p not in wanted]
    problems += [f"{p}: in the target, not in the checkpoint" for p in wanted if p not in saved]
    for p, x in wanted.items():
        meta = saved.get(p)
        if meta is not None and tuple(meta.shape) != tuple(x.shape):
            problems.append(f"{p}: saved {shape_str(meta.dtype, meta.shape)}, target {shape_str(x.dtype, x.shape)}")
        elif meta is not None:
            try:
                x.sharding.shard_shape(tuple(x.shape))
            except ValueError:
                problems.append(f"{p}: the target sharding {x.sharding.spec} does not divide {tuple(x.shape)}")
    if problems:
        shown = problems[:_SHOWN] + ([f"... and {len(problems) - _SHOWN} more"] if len(problems) > _SHOWN else [])
        raise ShardingError(
            f"{call}: step {step} does not fit the target; {len(problems)} leaf/leaves differ:\n  "
            + "\n  ".join(shown)
            + "\nRestore into the model (tree and shapes) that was saved, or convert the state yourself."
        )
