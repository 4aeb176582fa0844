"""`save` / `restore`: sharded train state on Orbax, resharded on the way back in.

A checkpoint directory holds one subdirectory per step (`<dir>/<step>/`), each with the state
(`state/`, every process writing the shards it holds) and, when given, the `Plan` that laid it out
(`plan/`, JSON as `Plan.save` writes it). Orbax writes a step into a temporary directory and renames
it into place only once every process has finished (its atomic finalize), so a crash mid-save
leaves the previous step as the latest one and never a half-written one.

`restore` reads the state onto any shardings: another device count, another strategy, another
mesh. Each process reads only the slices its devices hold; the values are the saved ones, bit for
bit.

Bad files are errors that name them, never wrong values: as a step is committed (before it becomes
visible), the size and CRC-32 of each of its files are recorded (`_files.py`, `_commit.py`), and
`restore` / `load_plan` check the files they read first. A step without that record cannot be
verified and is never read: `latest_step` and `restore()` skip it for the latest verified one, and
asking for it by number is an error naming both. A damaged or unverified step, a directory another
program wrote, a file Orbax cannot read, a target that cannot be written (a full disk, a read-only
directory) or a saved plan that does not fit this job's devices is a `CheckpointError` naming the
directory or file and what to do; a damaged step never touches the others. An async save not
waited on is finished at interpreter exit (`_commit.py`). Only JSON and array data are read:
nothing in a checkpoint is executed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jshard._distributed import host_major
from jshard._errors import CheckpointError, ShardingError, api_boundary
from jshard._format import shape_str
from jshard.checkpoint._commit import RecordedPath, pending, track
from jshard.checkpoint._files import RECORD, damage, verified
from jshard.plan import Plan, load, to_json

_SHOWN = 12


class SaveHandle:
    """A save in progress (`save(..., blocking=False)`); `wait()` returns once it is on disk.

    A handle not waited on is waited on at interpreter exit; where that fails, the process exits
    with status 1 naming the step that was lost.
    """

    def __init__(self, manager: ocp.CheckpointManager | None, step: int, directory: str):
        self._manager, self.step, self.directory = manager, step, directory

    def wait(self) -> int:
        """Blocks until the step is committed (its files recorded, then renamed into place).

        Returns:
          The step.

        Raises:
          CheckpointError: the step could not be written (a full disk, a directory made read-only).
        """
        manager, self._manager = self._manager, None
        pending.pop(id(self), None)
        if manager is not None:
            try:
                manager.wait_until_finished()
                manager.close()
            except Exception as e:
                raise CheckpointError(_write_error(f"jshard.checkpoint.save({self.directory!r})", self.step, e)) from e
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
      CheckpointError: `step` is already in `directory`, or the directory cannot be written (a full
        disk, a read-only file system, no permission), naming it.

    Examples:
      >>> import tempfile, numpy as np
      >>> d = tempfile.mkdtemp()
      >>> save(d, {"w": np.ones((8, 2))}, step=1).done, latest_step(d)
      (True, 1)
    """
    directory = os.path.abspath(os.fspath(directory))
    call = f"jshard.checkpoint.save({directory!r})"
    items = {"state": ocp.args.StandardSave(state)}
    if plan is not None:
        items["plan"] = ocp.args.JsonSave(to_json(plan))
    manager = None
    try:
        manager = _manager(directory, create=True, async_=not blocking, keep=keep)
        if step in manager.all_steps():
            manager.close()
            raise CheckpointError(f"{call}: step {step} is already saved there (steps {list(manager.all_steps())}). "
                                  "Save under a new step number.")
        manager.save(step, args=ocp.args.Composite(**items))
    except CheckpointError:
        raise
    except Exception as e:  # OSError, TensorStore's RESOURCE_EXHAUSTED / PERMISSION_DENIED
        if manager is not None:
            with contextlib.suppress(Exception):
                manager.close()
        raise CheckpointError(_write_error(call, step, e)) from e
    handle = SaveHandle(manager, step, directory)
    if blocking:
        handle.wait()
    else:
        track(handle)
    return handle


def _write_error(call: str, step: int, error: BaseException) -> str:
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
        assert error is not None  # the loop's condition
    what = str(error).split(" [tensorstore_spec=")[0].split("\n")[0][:400]
    return (f"{call}: step {step} could not be written: {type(error).__name__}: {what}. The earlier steps are "
            "untouched. Free space on that file system, or give a directory this process can write "
            "(not read-only, with permission), and save again.")


@api_boundary
def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest verified step in `directory` (complete, with the record of its files), or None."""
    steps = _verified_steps(os.path.abspath(os.fspath(directory)))
    return max(steps) if steps else None


@api_boundary
def load_plan(directory: str | os.PathLike, step: int | None = None) -> Plan | None:
    """The `Plan` saved with `step` (default the latest), or None if it was saved without one.

    Raises:
      CheckpointError: no such step, the step cannot be verified, or its plan file is damaged
        (naming the file).
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
      step: the step to read; default the latest verified one (`latest_step`).
      like: with a loaded `Plan`, a pytree of the state's structure (arrays or shapes).

    Returns:
      The state, as global arrays on the target shardings.

    Raises:
      ShardingError: the target does not match the checkpoint (leaves missing or extra, other
        shapes), listing the mismatched leaves.
      CheckpointError: no such step; the step cannot be verified (no record of its files: a save
        cut off, a record deleted), is damaged (a file cut short, changed or missing, naming it) or
        was not written by `save`; a loaded plan laid out for more devices than this job has.
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
            raise CheckpointError(_unreadable_error(call, manager, directory, step, e)) from e
    return restored["state"]


def _check_files(call: str, directory: str, step: int, item: str) -> None:
    """Checks the files of `step`'s `item` against the record made when it was saved."""
    problems = damage(os.path.join(directory, str(step)), item + os.sep)
    if problems is None:
        raise CheckpointError(_unverified_error(call, directory, step))
    if problems:
        with _manager(directory) as manager:
            earlier = _earlier(manager, step)
        raise CheckpointError(
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
        raise CheckpointError(_foreign_error(call, step_dir, step)) from e
    except Exception as e:  # its metadata cut short or changed
        raise CheckpointError(_unreadable_error(call, manager, directory, step, e)) from e
    if state is None:
        raise CheckpointError(_unreadable_error(call, manager, directory, step, FileNotFoundError(
            f"the state's metadata, {os.path.join(step_dir, 'state', '_METADATA')}, is missing")))
    return {_path(p): m for p, m in jax.tree_util.tree_flatten_with_path(state.tree)[0]}


def _foreign_error(call: str, step_dir: str, step: int) -> str:
    items = sorted(p for p in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, p)))
    return (f"{call}: step {step} ({step_dir}) holds the items {items}, not the 'state' jshard.checkpoint.save "
            "writes: another program (Orbax's own CheckpointManager?) wrote this directory. Restore it with the "
            "program that wrote it, or give a directory jshard.checkpoint.save wrote.")


def _unreadable_error(call: str, manager: ocp.CheckpointManager, directory: str, step: int, error: Exception) -> str:
    while (inner := error.__cause__ or error.__context__) is not None:  # TensorStore's own error names the file
        error = inner
    what = str(error).split(" [tensorstore_spec=")[0].split("\n")[0]
    what = what if len(what) <= 400 else what[:400] + " ..."
    return (f"{call}: step {step} ({os.path.join(directory, str(step))}) cannot be read: {type(error).__name__}: "
            f"{what}\nIts files were cut short, changed or removed after it was saved. {_earlier(manager, step)}")


def _earlier(manager: ocp.CheckpointManager, step: int) -> str:
    """Where a user whose `step` is damaged can go back to."""
    steps = _verified_steps(os.fspath(manager.directory))
    earlier = [s for s in steps if s < step]
    if not earlier:
        return f"No earlier verified step to go back to (verified steps {steps}); save the state again."
    return (f"The other steps are untouched: restore the previous verified one with step={earlier[-1]} "
            f"(verified steps {steps}).")


def _unverified_error(call: str, directory: str, step: int) -> str:
    step_dir = os.path.join(directory, str(step))
    if not os.path.isdir(os.path.join(step_dir, "state")):
        return _foreign_error(call, step_dir, step)
    steps = _verified_steps(directory)
    latest = (f"The latest verified step is {steps[-1]}, which restore() with no step takes (step={steps[-1]})."
              if steps else "No step there is verified; save the state again.")
    return (f"{call}: step {step} ({os.path.join(directory, str(step))}) cannot be verified: it has no record of "
            f"its files ({RECORD}), which jshard.checkpoint.save commits with every step, so a damaged file in it "
            "would be read as a wrong value. It was written by another program or an older jshard, or its "
            f"record was deleted. {latest}")


def _all_steps(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    with _manager(directory) as manager:
        return sorted(manager.all_steps())


def _verified_steps(directory: str) -> list[int]:
    """The complete steps of `directory` that hold the record of their files, oldest first."""
    return [s for s in _all_steps(directory) if verified(os.path.join(directory, str(s)))]


def _manager(directory: str, *, create: bool = False, async_: bool = False, keep: int | None = None):
    options = ocp.CheckpointManagerOptions(create=create, enable_async_checkpointing=async_, max_to_keep=keep,
                                           temporary_path_class=RecordedPath)
    handlers = {"state": ocp.StandardCheckpointHandler(), "plan": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _step(call: str, directory: str, step: int | None) -> int:
    steps = _all_steps(directory)
    good = _verified_steps(directory)
    if step is None and good:
        return good[-1]
    if step is None and steps:
        raise CheckpointError(_unverified_error(call, directory, steps[-1]))
    if step is not None and step in steps:
        return step
    have = f"its complete steps are {sorted(steps)}" if steps else "it holds no complete checkpoint"
    raise CheckpointError(f"{call}: {'no step' if step is None else f'step {step} is not there'}: {have}. "
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
    if plan.mesh is None and plan.device_count > jax.device_count():
        raise CheckpointError(
            f"{call}: the plan lays the state out over {plan.device_count} devices, and this job has "
            f"{jax.device_count()}: a plan is made for one device count. The checkpoint itself restores onto any "
            "device count: pass this job's shardings (a pytree of them), or plan the step again on "
            f"{jax.device_count()} devices and pass that plan.")
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
