"""Where the reference GPT's step spends its time on a GPU: one profiled run, its kernels summed.

`python -m benchmarks._gpu_profile --out DIR` compiles the train step `benchmarks._gpu --quick`
measures (`jax.jit`, the attention through cuDNN by default), runs a few steps under
`jax.profiler.trace` and sums the device's kernels by name and by kind (matrix multiplies,
attention, fused elementwise and reduction work, copies, the rest), per step: what stands between
the measured step and its matrix multiplies at the device's ceiling. It writes `DIR/profile.json`
(the summary) and `DIR/step.hlo.txt.gz` (the compiled program, to read a fusion's name back to its
operations). `--tiny` runs a small model (on a CPU too: there the host's threads stand for the
device's streams). Not part of `python -m benchmarks`: it needs a GPU to say anything about one.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

KINDS = (  # (kind, pattern on a kernel's name), first match wins
    ("attention", r"cudnn|fmha|flash|sdpa"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|cublas|matmul|dot"),
    ("scatter / gather", r"scatter|gather|dynamic.update.slice|dynamic.slice"),
    ("copy / transpose", r"copy|transpose|memcpy|memset|concatenate"),
    ("reduction fusion", r"reduce|input_"),
    ("elementwise fusion", r"fusion|loop_|elementwise"),
)


def kind(name: str) -> str:
    """The kind of kernel `name` is (`KINDS`), or "other"."""
    low = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, low)), "other")


def kernels(trace: dict, device: str) -> dict[str, tuple[float, int]]:
    """Microseconds and launches per kernel name of the complete events ("X") on processes whose
    name holds `device` (a Chrome-format trace, as `jax.profiler.trace(create_perfetto_trace=True)`
    writes it)."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    pids = {pid for pid, name in names.items() if device.lower() in name.lower()}
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("pid") in pids:
            out[e["name"]][0] += float(e.get("dur", 0.0))
            out[e["name"]][1] += 1
    return {name: (us, int(n)) for name, (us, n) in out.items()}


def summary(found: dict[str, tuple[float, int]], steps: int, top: int = 60) -> dict[str, Any]:
    """Per step: the kernels' total, each kind's milliseconds, the `top` kernels by time."""
    by_kind: dict[str, float] = defaultdict(float)
    for name, (us, _) in found.items():
        by_kind[kind(name)] += us / 1e3 / steps
    ranked = sorted(found.items(), key=lambda kv: -kv[1][0])[:top]
    return {"steps": steps, "kernel_ms_per_step": sum(us for us, _ in found.values()) / 1e3 / steps,
            "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n, "kind": kind(n), "ms_per_step": us / 1e3 / steps, "launches_per_step": c / steps}
                    for n, (us, c) in ranked]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="a small model: checks the script on a CPU")
    p.add_argument("--attention", default="cudnn", choices=("cudnn", "xla"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fence-grads", action="store_true", help="GPTConfig(fence_grads=True)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from benchmarks._gpu import QUICK_SIZE, TINY_SIZE, gpt_step
    from jshard import models

    s = TINY_SIZE if args.tiny else QUICK_SIZE
    size = dict(vocab=s["vocab"], seq_len=s["seq"], d_model=s["d_model"], n_heads=s["heads"], n_layers=s["layers"],
                d_ff=s["d_ff"])
    batch_size = s["batch"]
    cfg = models.GPTConfig(**size)
    cfg = dataclasses.replace(cfg, attention_implementation=args.attention, fence_grads=args.fence_grads)
    step = jax.jit(gpt_step(cfg), donate_argnums=(0, 1))
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), models.init_gpt(cfg, jax.random.key(0)))
    opt_state = optax.adam(1e-4).init(params)
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, batch_size)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    compiled = step.lower(params, opt_state, batch).compile()
    with gzip.open(args.out / "step.hlo.txt.gz", "wt") as f:
        f.write(compiled.as_text())
    print(f"compiled in {time.perf_counter() - began:.1f} s", flush=True)
    for _ in range(2):
        params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(args.steps):
        params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready(loss)
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    traced = args.out / "trace"
    with jax.profiler.trace(str(traced), create_perfetto_trace=True):
        for _ in range(args.steps):
            params, opt_state, loss = step(params, opt_state, batch)
        jax.block_until_ready(loss)
    path = next(traced.rglob("perfetto_trace.json.gz"))
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    device = "cpu" if jax.devices()[0].platform == "cpu" else "/device:GPU"
    found = kernels(trace, device)
    if not found:  # the device's processes are named otherwise: say which names there were
        names = sorted({e.get("args", {}).get("name", "") for e in trace["traceEvents"] if e.get("ph") == "M"})
        print(f"no kernels on processes named like {device!r}; processes: {names[:40]}", flush=True)
    out = {"command": " ".join(["python -m benchmarks._gpu_profile", *(sys.argv[1:] if argv is None else argv)]),
           "device": jax.devices()[0].device_kind, "fence_grads": args.fence_grads, "jax": jax.__version__, "config": size, "batch": batch_size,
           "attention": args.attention, "step_ms_unprofiled": step_ms, **summary(found, args.steps)}
    (args.out / "profile.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "top"}, indent=1))
    for row in out["top"][:40]:
        print(f"{row['ms_per_step']:8.3f} ms  x{row['launches_per_step']:<5g} {row['kind']:<20} {row['name'][:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
