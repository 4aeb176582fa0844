"""MindSpore's `comm_fusion` and multi-copy as XLA compile options, per program and backend.

XLA merges independent collectives of one kind and replica group in combiner passes. What each
backend of the installed jaxlib honours (checked by compiling, `tests/test_comm_fusion.py`):

- GPU: one threshold per kind, `xla_gpu_all_reduce_combine_threshold_bytes`,
  `xla_gpu_all_gather_combine_threshold_bytes`, `xla_gpu_reduce_scatter_combine_threshold_bytes`
  (0: nothing merged).
- CPU: one pass, `cpu-all-reduce-combiner`, merging every independent all-reduce of a group up to
  fixed limits and reading none of those options; `xla_disable_hlo_passes` turns it off. XLA:CPU
  merges no all-gathers or reduce-scatters: each stays apart.

So a threshold of 0 is the combiner off; a threshold on the GPU is its option; a threshold the
backend cannot take (any on the CPU but 0, `index` everywhere) is met by jshard's own buckets where
it reduces the gradients itself (`jshard/_buckets.py`), and refused elsewhere. Multi-copy turns the
all-reduce combiner off: it would merge the copies' collectives into one, joining the copies.
"""

from __future__ import annotations

from typing import Any

from jshard._errors import ShardingError
from jshard.compile._groups import Communication, Fusion

GPU_OPTIONS = {"allreduce": "xla_gpu_all_reduce_combine_threshold_bytes",
               "allgather": "xla_gpu_all_gather_combine_threshold_bytes",
               "reducescatter": "xla_gpu_reduce_scatter_combine_threshold_bytes"}
"""Each kind's combiner threshold on XLA:GPU."""

GPUS = ("gpu", "cuda", "rocm")
"""The platform names of XLA:GPU's devices."""

CPU_COMBINER = "cpu-all-reduce-combiner"
"""XLA:CPU's all-reduce combiner pass, the one combiner that backend runs."""


def compiler_options(comm: Communication | None, platform: str | None, bucketed: bool) -> dict[str, Any]:
    """The XLA options that make `platform`'s combiners follow `comm` (`bucketed`: jshard emitted
    the gradients' all-reduces in its own buckets, which the all-reduce combiner must keep apart)."""
    if comm is None or platform is None:
        return {}
    off = comm.copies > 1 or bucketed or _threshold(comm.of("allreduce")) == 0
    if platform == "cpu":
        return {"xla_disable_hlo_passes": CPU_COMBINER} if off else {}
    options: dict[str, Any] = {}
    for kind, name in GPU_OPTIONS.items():
        threshold = 0 if kind == "allreduce" and off else _threshold(comm.of(kind))
        if threshold is not None:
            options[name] = threshold
    return options if platform in GPUS else {}


def combines(comm: Communication | None) -> bool:
    """Whether XLA's all-reduce combiner merges the program's independent all-reduces where jshard
    does not reduce the gradients itself (`compiler_options` turns it off for multi-copy and an
    all-reduce threshold of 0): what the search prices (`SearchGraph.combined_latency`)."""
    return comm is None or (comm.copies == 1 and _threshold(comm.of("allreduce")) != 0)


def check_fusion(comm: Communication | None, platform: str | None, bucketed: bool, call: str) -> None:
    """Refuses a configuration neither the backend's options nor jshard's buckets can follow.

    Raises:
      ShardingError: naming the kind, its configuration, why, and the fix.
    """
    if comm is None or platform is None:
        return
    if platform not in GPUS + ("cpu",):
        if comm.copies > 1 or bucketed or any(f.mode != "auto" for _, f in comm.fusion or ()):
            raise ShardingError(_unknown_backend_error(call, comm, platform))
        return
    for kind, fusion in comm.fusion or ():
        if fusion.mode == "auto" or fusion.threshold_bytes == 0 or (kind == "allreduce" and bucketed):
            continue
        if platform in GPUS and fusion.mode == "size":
            continue
        if fusion.mode == "index":
            why = "XLA's combiners take a threshold, not split indices"
        else:
            why = ("XLA:CPU's all-reduce combiner takes no threshold" if kind == "allreduce"
                   else f"XLA:CPU merges no {kind} at all")
        fix = ("wrap the gradient function in jshard.accumulate (loss, grads = jshard.accumulate(jax.value_and_grad("
               "loss_fn))(params, batch)) with the batch cut over the data-parallel axes (mode='data' or 'semi_auto'), "
               "so jshard buckets the gradients itself, or give " if kind == "allreduce" else "give ")
        raise ShardingError(f"{call}: Communication(fusion={{{kind!r}: {{'mode': {fusion.mode!r}, 'config': "
                            f"{fusion.config!r}}}}}) on {platform}: {why}, and jshard emits no {kind} of its own "
                            f"here to bucket. To follow it, {fix}mode 'auto' or 'size' 0 for {kind!r}.")


def _unknown_backend_error(call: str, comm: Communication, platform: str) -> str:
    return (f"{call}: {comm!r} on {platform}: jshard knows no option of XLA's {platform} backend that sets or turns "
            f"off its combiners, so it cannot keep copies or buckets apart there. Give fusion modes 'auto' and "
            f"copies=1 on {platform}, or drop communication=.")


def _threshold(fusion: Fusion | None) -> int | None:
    """The combiner threshold in bytes `fusion` asks of XLA: None where it leaves XLA's default
    (`auto`, or not given); 0 for `index` (jshard's buckets, kept apart)."""
    if fusion is None or fusion.mode == "auto":
        return None
    return 0 if fusion.mode == "index" else fusion.threshold_bytes
