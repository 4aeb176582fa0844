"""The reference GPT train step on one real GPU: `jshard.parallelize(step, devices=1, mode="data")`
against the same step under plain `jax.jit`, with the same donation and the same inputs.

`python -m benchmarks._gpu --out PATH.json` measures and writes a JSON; `gpu_section()` renders
`benchmarks/gpu_results.json` (the committed copy of one such run) for `BENCHMARKS.md`.

Per dtype (float32 params with JAX's default GPU matmul precision; bfloat16 params, the same
code): each program's first call (trace, plan, compile), a few warm-up steps, then rounds of
`steps` back-to-back steps of each program, the order alternating every round, timed to
`block_until_ready`; per program the median over rounds of the per-step time. Each program runs
its own chain of parameters and Adam state (donated), from equal copies of the same initial ones.
Beside them: the precision each matmul ran in (its operands' dtypes in the step's jaxpr, and a
probe of JAX's default float32 matmul against float64), the MFU against the matching H100 peak,
XLA's cost analysis, and the forward / forward + backward times of the hand-written step.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "gpu_results.json"
FLOPS_FORMULA = (
    "model FLOPs/step = 6·N·T + 12·L·d·S·T, N = parameters less the token and position embedding tables "
    "(lookups, no matmul), T = batch·seq_len tokens, L layers, d = d_model, S = seq_len "
    "(the attention term counts the full S×S scores, as the model computes them under its causal mask)"
)
# Dense peaks of the H100 SXM (the H200 has the same compute), TFLOP/s.
PEAKS = {"TF32": 494.7, "BF16": 989.4, "FP32": 66.9}
_DTYPES = ("float32", "bfloat16")
FENCED = "the residual stream's gradient fenced (`GPTConfig(fence_grads=True)`, under both programs), "
QUICK = ("bfloat16 only, the reference GPT at 8 layers, d_model 4096, 32 heads, d_ff 16384, seq_len 1024, "
         "batch 8 (1.9 B parameters: large enough that its matmuls, not its elementwise work, set the step "
         f"time), {FENCED}variants cudnn then base, 4 rounds of 4 steps, a 250 s budget (base is not started "
         "past it)")
QUICK_SIZE = dict(layers=8, d_model=4096, heads=32, d_ff=16384, seq=1024, batch=8, vocab=32768)
"""`--quick`'s model and batch (`QUICK`), the arguments' names; `benchmarks._gpu_profile` profiles the same."""
TINY_SIZE = dict(layers=2, d_model=64, heads=4, d_ff=256, seq=32, batch=4, vocab=256)
"""`--tiny`'s model and batch: a smoke test on a CPU."""
VARIANTS = ("base", "cudnn", "offload", "recompute")
QUICK_VARIANTS = ("cudnn", "base")
"""`--quick` runs these, in this order: each first call compiles a new program (about 95 s on an H100 at
2026-11-27 for base or offload; the recompute's mostly reuses the base step's autotuned kernels, 12 s),
so the device command's 560 s hold two variants."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks._gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    p.add_argument("--tiny", action="store_true", help="a tiny model and few steps: a smoke test (CPU is fine)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--d-ff", type=int, default=4096)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--scan", action="store_true", help="the scanned stack (GPTConfig(scan=True))")
    p.add_argument("--fence-grads", action="store_true",
                   help="the residual stream's gradient made whole at each residual add (GPTConfig(fence_grads=True))")
    p.add_argument("--dtypes", default=",".join(_DTYPES), help="comma-separated: float32, bfloat16")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per program after the first call")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="back-to-back steps per program per round")
    p.add_argument("--variants", default="base",
                   help="comma-separated: base (the step), cudnn (the attention through "
                        "`jax.nn.dot_product_attention(implementation=\"cudnn\")`), recompute (every block "
                        "`jshard.recompute`d), offload (jshard with `offload=(\"optimizer\",)` beside the base step "
                        "under jax.jit)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip the variants not yet started once this many seconds have passed")
    p.add_argument("--quick", action="store_true",
                   help=f"the prepared H100 check (under 8 minutes): {QUICK}")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.tiny:
        vars(args).update(TINY_SIZE)
        args.warmup, args.rounds, args.steps = 1, 2, 2
    if args.quick:
        vars(args).update(QUICK_SIZE)
        args.dtypes, args.variants, args.warmup, args.rounds, args.steps = "bfloat16", ",".join(QUICK_VARIANTS), 2, 4, 4
        args.fence_grads = True
        args.budget_s = 250.0 if args.budget_s is None else args.budget_s
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    import jax

    results = {
        "command": " ".join(["python -m benchmarks._gpu", *argv]),
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "jshard_commit": _commit(),
    }
    print(f"{results['device']} ({results['platform']}), jax {results['jax']}", flush=True)
    began = time.perf_counter()
    results["matmul"] = _matmul_probe(small=args.tiny)
    print(f"matmul: {results['matmul']}", flush=True)
    results["bandwidth"] = _bandwidth_probe(small=args.tiny)
    print(f"bandwidth: {results['bandwidth']}", flush=True)
    config, batch_size = _config(args)
    results.update(_sizes(config, batch_size))
    print(f"config: {results['config']}, {results['params']:,} params, "
          f"{results['model_flops_per_step'] / 1e12:.3f} model TFLOP/step", flush=True)
    results["runs"] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    jitted: dict = {}  # one jax.jit per step function, shared by the variants: compiled once
    for dtype in args.dtypes.split(","):
        for variant in args.variants.split(","):
            if args.budget_s is not None and time.perf_counter() - began > args.budget_s:
                results.setdefault("skipped", []).append(f"{dtype} {variant}: past the {args.budget_s:.0f} s budget")
                print(f"skipped {dtype} {variant}: past the budget", flush=True)
                continue
            try:
                run = measure(config, batch_size, dtype, args.warmup, args.rounds, args.steps, results, variant, jitted)
            except Exception as e:  # a variant that cannot run here (no cuDNN) is a result; the next still runs
                run = {"dtype": dtype, "variant": variant, "programs": {}, "error": _error(f"{dtype} {variant}", e)}
            results["runs"].append(run)
            args.out.write_text(json.dumps(results, indent=1))  # after each run: a later crash keeps it
            print(json.dumps({k: v for k, v in run.items() if k != "programs"}), flush=True)
        jitted.clear()
    results["seconds"] = time.perf_counter() - began
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(gpu_section(args.out))
    print(f"wrote {args.out}")
    return 0


def _config(args):
    from jshard import models

    cfg = models.GPTConfig(vocab=args.vocab, seq_len=args.seq, d_model=args.d_model, n_heads=args.heads,
                           n_layers=args.layers, d_ff=args.d_ff, scan=args.scan,
                           fence_grads=args.fence_grads)
    return cfg, args.batch


def _sizes(cfg, batch: int) -> dict[str, Any]:
    import jax
    import numpy as np

    from jshard import models

    shapes = jax.eval_shape(functools.partial(models.init_gpt, cfg), jax.random.key(0))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    n = total - int(np.prod(shapes["embed"].shape)) - int(np.prod(shapes["pos"].shape))
    tokens = batch * cfg.seq_len
    flops = 6 * n * tokens + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len * tokens
    config = {"vocab": cfg.vocab, "seq_len": cfg.seq_len, "d_model": cfg.d_model, "n_heads": cfg.n_heads,
              "n_layers": cfg.n_layers, "d_ff": cfg.d_ff, "scan": cfg.scan, "fence_grads": cfg.fence_grads,
              "batch": batch, "optimizer": "adam"}
    return {"config": config, "params": total, "flop_params": n, "tokens_per_step": tokens,
            "model_flops_per_step": flops, "flops_formula": FLOPS_FORMULA}


def measure(cfg, batch_size: int, dtype: str, warmup: int, rounds: int, steps: int, meta: dict,
            variant: str = "base", jitted: dict | None = None) -> dict[str, Any]:
    """jshard's program and the hand-written one for `variant` at `dtype`: first calls, losses, XLA's
    FLOPs, jshard's predicted step time, then the alternating rounds.

    `variant`: `"base"` (the step), `"cudnn"` (the step with the attention through
    `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash attention, under both
    programs), `"recompute"` (every block `jshard.recompute`d, full policy, under both programs) or `"offload"` (jshard with `offload=("optimizer",)`, Adam's state in host memory,
    beside the base step under `jax.jit`). `jitted` caches `jax.jit` programs by step across calls."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jshard
    from jshard import models

    jitted = {} if jitted is None else jitted
    base = jitted.setdefault(("step", cfg), gpt_step(cfg))
    changed = {"recompute": {"recompute": "full"}, "cudnn": {"attention_implementation": "cudnn"}}.get(variant)
    step = gpt_step(dataclasses.replace(cfg, **changed)) if changed else base
    params = jax.tree.map(lambda x: x.astype(dtype), models.init_gpt(cfg, jax.random.key(0)))
    opt_state = optax.adam(1e-4).init(params)
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, batch_size)
    # The precision each matmul runs in follows its operands' dtypes in the traced step, not the
    # parameters' dtype alone: count the dot FLOPs per operand dtype.
    dots = dot_flops(step, params, opt_state, batch)
    modes = {pair: (meta["matmul"]["float32_default"] if "float32" in pair else
                    "BF16" if pair == "bfloat16 x bfloat16" else pair) for pair in dots}
    share = {}
    for pair, f in dots.items():
        share[modes[pair]] = share.get(modes[pair], 0.0) + f / sum(dots.values())
    precision = " + ".join(f"{m} {v:.0%}" for m, v in sorted(share.items(), key=lambda kv: -kv[1])) if len(share) > 1 \
        else next(iter(share), "none")
    peaks = {m: _peak(meta["device"], m) for m in share}
    peak = 1 / sum(v / peaks[m] for m, v in share.items()) if peaks and all(peaks.values()) else None
    out: dict[str, Any] = {"dtype": dtype, "variant": variant, "matmul_precision": precision, "peak_tflops": peak,
                           "dot_flops": dots, "programs": {}, "error": ""}
    fresh = lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree)  # own buffers: donation is safe

    programs: dict[str, Any] = {}
    states: dict[str, list] = {}
    kind = next((k for k in ("H100", "H200") if k in meta["device"]), None)
    try:
        cost = jshard.CostModel.for_device(kind) if kind else None
        par = jshard.parallelize(step, devices=1, mode="data", donate_argnums=(0, 1), cost_model=cost,
                                 offload=("optimizer",) if variant == "offload" else None)
        plan = par.plan(params, opt_state, batch)
        out["predicted"] = _predicted(plan, kind)
        states["jshard"] = list(jax.device_put((fresh(params), fresh(opt_state), batch), plan.in_shardings))
        programs["jshard"] = par
    except Exception as e:  # a jshard failure is a result: record it, still measure the hand-written step
        out["error"] = _error("jshard.parallelize / plan", e)
    programs["jax.jit"] = jitted.setdefault(("jit", step), jax.jit(step, donate_argnums=(0, 1)))
    states["jax.jit"] = list(jax.device_put((fresh(params), fresh(opt_state), batch), jax.devices()[0]))
    del params, opt_state

    for name in list(programs):
        rec = out["programs"][name] = {}
        try:
            state = states[name]
            start = time.perf_counter()
            new_p, new_o, loss = programs[name](*state)
            loss = float(loss)
            rec["first_call_s"] = time.perf_counter() - start
            rec["loss_first_step"] = loss
            states[name] = [new_p, new_o, state[2]]
            lowered = programs[name].lower(*states[name])  # the same signature: jit's cache, no new compile
            rec["xla_flops"] = _flops(lowered)  # the HLO before XLA's passes: every dot counted
            compiled = lowered.compile()
            rec["xla_flops_compiled"] = _flops(compiled)  # on GPU, library calls (cuBLAS) count nothing
            rec["memory"] = _memory(compiled)
            for _ in range(warmup):
                new_p, new_o, loss = programs[name](*states[name])
                states[name][:2] = [new_p, new_o]
            jax.block_until_ready(loss)
            print(f"{dtype} {variant} {name}: first call {rec['first_call_s']:.1f} s, loss "
                  f"{rec['loss_first_step']:.4f}, XLA flops {rec['xla_flops']}", flush=True)
        except Exception as e:
            out["error"] += ("; " if out["error"] else "") + _error(name, e)
            del programs[name], out["programs"][name]
            states.pop(name, None)

    per_step: dict[str, list[float]] = {name: [] for name in programs}
    last_loss: dict[str, float] = {}
    names = list(programs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            prog, state = programs[name], states[name]
            start = time.perf_counter()
            for _ in range(steps):
                new_p, new_o, loss = prog(*state)
                state[:2] = [new_p, new_o]
            jax.block_until_ready((new_p, new_o, loss))
            per_step[name].append((time.perf_counter() - start) / steps)
            last_loss[name] = float(loss)

    peak = out["peak_tflops"]
    for name in programs:
        rec, med = out["programs"][name], statistics.median(per_step[name])
        rec.update(step_ms=med * 1e3, step_ms_rounds=[t * 1e3 for t in per_step[name]],
                   tokens_per_s=meta["tokens_per_step"] / med, model_tflops=meta["model_flops_per_step"] / med / 1e12,
                   loss_last=last_loss[name], steps=rounds * steps + warmup + 1)
        rec["mfu"] = rec["model_tflops"] / peak if peak else None
    if "jax.jit" in programs and variant == "base":
        out["breakdown_ms"] = _breakdown(cfg, states["jax.jit"][0], states["jax.jit"][2],
                                         out["programs"]["jax.jit"]["step_ms"])
        print(f"{dtype} breakdown (jax.jit): {out['breakdown_ms']}", flush=True)
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_memory_bytes"] = stats.get("peak_bytes_in_use")
    if "jshard" in programs and out.get("predicted"):
        out["predicted"]["measured_over_predicted"] = out["programs"]["jshard"]["step_ms"] / out["predicted"]["step_ms"]
    if len(programs) == 2:
        j, h = out["programs"]["jshard"], out["programs"]["jax.jit"]
        out["ratio"] = j["step_ms"] / h["step_ms"]
        out["ratio_rounds"] = statistics.median(a / b for a, b in zip(per_step["jshard"], per_step["jax.jit"]))
        out["loss_rel_diff"] = abs(j["loss_first_step"] - h["loss_first_step"]) / abs(h["loss_first_step"])
        out["loss_tolerance"] = 1e-3 if dtype == "float32" else 1e-2
        out["loss_ok"] = out["loss_rel_diff"] <= out["loss_tolerance"]
    for name in list(programs):
        del programs[name], states[name]
    return out


def gpt_step(cfg):
    """The reference GPT's train step for `cfg` (Adam, learning rate 1e-4): what the GPU run measures
    and `benchmarks._predicted` plans."""
    import optax

    from jshard import models

    return models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optax.adam(1e-4))


def _predicted(plan, kind: str | None) -> dict[str, Any]:
    """jshard's own prediction of the step: the plan's compute and collective time on the cost model
    (`CostModel.for_device(kind)`), the offload's host-link time, and the recompute report's peak."""
    work, offload = plan.work, plan.offload
    out: dict[str, Any] = {"cost_model": kind or "default"}
    if work is not None:
        out.update(compute_ms=work.compute_seconds * 1e3, comm_ms=work.comm_seconds * 1e3, flops=work.flops)
    out["host_link_ms"] = offload.seconds * 1e3 if offload is not None else 0.0
    out["step_ms"] = out.get("compute_ms", 0.0) + out.get("comm_ms", 0.0) + out["host_link_ms"]
    return out


def _memory(compiled) -> dict[str, float] | None:
    """The compiled program's own memory figures (XLA's `memory_analysis`), bytes."""
    try:
        m = compiled.memory_analysis()
    except Exception:
        return None
    if m is None:
        return None
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
            "host_argument_size_in_bytes", "host_temp_size_in_bytes")
    return {k: float(getattr(m, k)) for k in keys if getattr(m, k, None) is not None}


def _bandwidth_probe(small: bool) -> dict[str, float]:
    """Device-memory bandwidth (a jitted copy of one large array, bytes read + written over time) and
    the host link's, each way (`jax.device_put` to and from `pinned_host` memory), in GB/s."""
    import jax
    import jax.numpy as jnp

    n = (1 << 20) if small else (1 << 28)  # 1 GiB of float32 on a GPU
    out: dict[str, float] = {"bytes": 4.0 * n}
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    copy(x).block_until_ready()
    out["device_gbps"] = 2 * 4 * n / _median_s(lambda: copy(x).block_until_ready()) / 1e9
    try:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
        on_host = jax.device_put(x, host).block_until_ready()
        out["to_host_gbps"] = 4 * n / _median_s(lambda: jax.device_put(x, host).block_until_ready()) / 1e9
        out["from_host_gbps"] = 4 * n / _median_s(lambda: jax.device_put(on_host, dev).block_until_ready()) / 1e9
    except Exception as e:  # no pinned_host memory on this backend
        out["host_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def _median_s(fn, times: int = 7) -> float:
    runs = []
    for _ in range(times):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def _breakdown(cfg, params, batch, step_ms: float) -> dict[str, float]:
    """Milliseconds of the forward loss alone and of forward + backward (`jax.jit`, no optimizer),
    beside the whole step's: where the step's time goes."""
    import jax

    from jshard import models

    loss = lambda p, b: models.gpt_loss(p, b, cfg)
    out = {}
    for what, fn in (("forward", jax.jit(loss)), ("forward+backward", jax.jit(jax.value_and_grad(loss)))):
        jax.block_until_ready(fn(params, batch))
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(5):
                result = fn(params, batch)
            jax.block_until_ready(result)
            runs.append((time.perf_counter() - start) / 5 * 1e3)
        out[what] = statistics.median(runs)
        del result
    out["step"] = step_ms
    return out


def dot_flops(fn, *args) -> dict[str, float]:
    """FLOPs of every `dot_general` in `fn`'s jaxpr (2·output size·contracted size; scan bodies times
    their length), summed per operand dtypes (`"bfloat16 x bfloat16"`). Shapes only: runs anywhere."""
    import math

    import jax
    from jax.extend import core as jcore

    totals: dict[str, float] = {}

    def walk(jaxpr, times: int) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                a, b = eqn.invars[0].aval, eqn.invars[1].aval
                k = math.prod(a.shape[i] for i in contract)
                key = f"{a.dtype} x {b.dtype}"
                totals[key] = totals.get(key, 0.0) + 2.0 * math.prod(eqn.outvars[0].aval.shape) * k * times
            inner = times * eqn.params["length"] if eqn.primitive.name == "scan" else times
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jcore.ClosedJaxpr):
                        walk(sub.jaxpr, inner)
                    elif isinstance(sub, jcore.Jaxpr):
                        walk(sub, inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, 1)
    return totals


def _matmul_probe(small: bool) -> dict[str, Any]:
    """Which precision JAX's default float32 matmul runs in here (its error against float64), and
    the matmul ceilings measured with one large square product per dtype."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((1024, 1024)), rng.standard_normal((1024, 1024))
    ref = a @ b
    got = np.asarray(jax.jit(jnp.matmul)(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)), np.float64)
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    probe: dict[str, Any] = {"float32_default_rel_err": err,
                             # float32 lands near 1e-7, TF32 (10-bit mantissa) near 3e-4
                             "float32_default": "TF32" if err > 1e-5 else "FP32",
                             "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision)}
    n = 512 if small else 8192
    for dtype in _DTYPES:
        x = jax.random.normal(jax.random.key(2), (n, n), dtype)
        y = jax.random.normal(jax.random.key(3), (n, n), dtype)
        mm = jax.jit(jnp.matmul)
        mm(x, y).block_until_ready()
        times = []
        for _ in range(10):
            start = time.perf_counter()
            mm(x, y).block_until_ready()
            times.append(time.perf_counter() - start)
        probe[f"ceiling_tflops_{dtype}"] = 2 * n**3 / statistics.median(times) / 1e12
    probe["ceiling_size"] = n
    return probe


def _peak(device: str, precision: str) -> float | None:
    return PEAKS.get(precision) if ("H100" in device or "H200" in device) else None


def _flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float(cost["flops"]) if cost and "flops" in cost else None


def _error(where: str, e: BaseException) -> str:
    tail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:]).strip()
    print(f"ERROR in {where}:\n{traceback.format_exc()}", flush=True)
    return f"{where}: {type(e).__name__}: {e} [{tail[-600:]}]"


def _jaxlib_version() -> str:
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:
        return "unknown"


def _commit() -> str:
    from benchmarks._report import commit

    return commit()


# --- the report section ---------------------------------------------------------------------------


def _run_notes(run: dict, r: dict) -> list[str]:
    """The notes under the table for one run of `r`: prediction, losses, errors, FLOPs, breakdown."""
    notes: list[str] = []
    tag = f"{run['dtype']} {run.get('variant', 'base')}"
    pred = run.get("predicted")
    if pred and pred.get("step_ms"):
        notes.append(f"{tag}: jshard's prediction on `CostModel.for_device({pred['cost_model']!r})`: compute "
                     f"{pred.get('compute_ms', 0):.2f} ms ({pred.get('flops', 0) / 1e12:.2f} TFLOP), collectives "
                     f"{pred.get('comm_ms', 0):.2f} ms, host link {pred['host_link_ms']:.2f} ms")
    if "loss_rel_diff" in run:
        notes.append(f"{tag}: first-step losses differ by {run['loss_rel_diff']:.1e} relative "
                     f"({'within' if run['loss_ok'] else 'OUTSIDE'} {run['loss_tolerance']:.0e})")
    if run.get("error"):
        notes.append(f"{tag}: error: {run['error'].splitlines()[0][:400]}")
    if run.get("variant") == "cudnn":
        c = r["config"]
        half = 6 * c["n_layers"] * c["d_model"] * c["seq_len"] * r["tokens_per_step"]
        notes.append(f"{tag}: the formula counts the attention's full S×S scores, as the einsums compute them; "
                     f"cuDNN's kernel skips the tiles the causal mask covers, {half / 1e12:.3f} TFLOP/step "
                     f"({half / r['model_flops_per_step']:.1%} of the formula) it does not compute")
    lowered = {name: p["xla_flops"] for name, p in run["programs"].items() if p.get("xla_flops")}
    compiled = {name: p["xla_flops_compiled"] for name, p in run["programs"].items() if p.get("xla_flops_compiled")}
    parts = []
    if lowered:
        parts.append("of the lowered step " + ", ".join(f"{n} {f / 1e12:.3f}" for n, f in lowered.items()))
    if compiled:
        parts.append("of the compiled step " + ", ".join(f"{n} {f / 1e12:.3f}" for n, f in compiled.items())
                     + " (on GPU the cuBLAS GEMM calls count nothing there)")
    notes.append(f"{tag}: XLA's cost analysis, TFLOP/step: " + ("; ".join(parts) or "none available")
                 + (f"; peak memory in use {run['peak_memory_bytes'] / 2**30:.1f} GiB (process-wide, all "
                    f"runs so far)" if run.get("peak_memory_bytes") else ""))
    if run.get("dot_flops"):
        dots = run["dot_flops"]
        total = sum(dots.values())
        split = ", ".join(f"{pair} {f / total:.0%}" for pair, f in sorted(dots.items(), key=lambda kv: -kv[1]))
        notes.append(f"{tag}: the step's jaxpr has {total / 1e12:.3f} TFLOP of dots "
                     f"({total / r['model_flops_per_step']:.4f}× the formula), by operand dtypes: {split}")
        both = dots.get("bfloat16 x bfloat16", 0.0) / total
        if run["dtype"] == "bfloat16" and both < 0.5:
            notes.append(
                f"{run['dtype']}: bfloat16 parameters did not make a bfloat16 model: only {both:.0%} of the dot FLOPs "
                "have two bfloat16 operands. The reference GPT divides its attention scores by `np.sqrt(d // n_heads)`, "
                "a NumPy float64 scalar, which (unlike a Python float) is not weakly typed and promotes the scores, "
                "and the residual stream after the first attention, to float32; most of its matmuls ran in float32 (TF32), "
                "and its MFU above is against the peak weighted accordingly")
    if run.get("breakdown_ms"):
        b = run["breakdown_ms"]
        notes.append(f"{tag}: where the step goes (jax.jit): forward loss {b['forward']:.2f} ms, "
                     f"forward + backward {b['forward+backward']:.2f} ms, whole step with Adam {b['step']:.2f} ms")
        ceiling = r["matmul"].get(f"ceiling_tflops_{run['dtype']}")
        if ceiling and run.get("dot_flops"):
            dots_ms = sum(run["dot_flops"].values()) / ceiling / 1e9
            notes.append(f"{tag}: the step's dots at the measured {ceiling:.0f} TFLOP/s matmul ceiling take "
                         f"{dots_ms:.1f} ms; the optimizer update (step − forward + backward) {b['step'] - b['forward+backward']:.1f} ms; "
                         f"the remaining {b['step'] - dots_ms - (b['step'] - b['forward+backward']):.1f} ms is the "
                         f"forward and backward passes' other work (softmax over the S×S scores, norms, GELU, the loss) "
                         f"and the dots' shortfall from the ceiling")
    return notes

def gpu_section(path: Path = RESULTS) -> str:
    """The `BENCHMARKS.md` section for the GPU run in `path`; "" when there is none."""
    path = Path(path)
    if not path.exists():
        return ""
    r = json.loads(path.read_text())
    c = r["config"]
    kind = next((k for k in ("H100", "H200", "A100") if k in r["device"]), r["device"])
    lines = [
        f"## GPU: reference GPT train step ({kind})",
        "",
        f"Not measured by `python -m benchmarks` (simulated CPU devices): read from `benchmarks/gpu_results.json`, "
        f"written by `{r['command']}` on {r['date']}, on one {r['device']} with jax {r['jax']} "
        f"(jaxlib {r.get('jaxlib', '?')}), jshard commit {r.get('jshard_commit', '?')}.",
        "",
        f"- model: the reference GPT (`jshard.models`, {'scanned' if c['scan'] else 'unrolled'} blocks), "
        f"{FENCED if c.get('fence_grads') else ''}"
        f"{c['n_layers']} layers, d_model {c['d_model']}, {c['n_heads']} heads, d_ff {c['d_ff']}, "
        f"vocab {c['vocab']}, seq_len {c['seq_len']}, batch {c['batch']}; {r['params']:,} parameters, Adam; "
        f"{r['tokens_per_step']:,} tokens/step",
        "- programs: `jshard.parallelize(step, devices=1, mode=\"data\", donate_argnums=(0, 1))` and "
        "`jax.jit(step, donate_argnums=(0, 1))`, the same train step and inputs; variant cudnn: the attention "
        "through `jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=\"cudnn\")` "
        "(`GPTConfig.attention_implementation`: cuDNN's fused flash attention) under both, base: as einsums and a "
        "softmax over the masked S×S scores; variant recompute: every block "
        "`jshard.recompute`d (full) under both; variant offload: jshard with `offload=(\"optimizer\",)` (Adam's "
        "state in host memory) beside the base step under `jax.jit`. predicted: jshard's own step time for its "
        "plan (`Plan.work`, and `Plan.offload`'s host-link time), on `CostModel.for_device` of the device",
        "",
        "| dtype (matmuls) | variant | program | step | predicted | tokens/s | model TFLOP/s | MFU | jshard / jax.jit "
        "| first call | loss, first step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes = []
    for run in r["runs"]:
        for name, p in run["programs"].items():
            ratio = "-"
            if name == "jshard" and "ratio" in run:
                ratio = f"{run['ratio']:.3f} (rounds: {run['ratio_rounds']:.3f})"
            mfu = "-" if p.get("mfu") is None else f"{p['mfu']:.1%}"
            variant = run.get("variant", "base")
            shown = ("offload" if variant == "offload" and name == "jshard"
                     else "base" if variant == "offload" else variant)
            pred = run.get("predicted") if name == "jshard" else None
            predicted = (f"{pred['step_ms']:.2f} ms ({p['step_ms'] / pred['step_ms']:.2f}× measured/predicted)"
                         if pred and pred.get("step_ms") else "-")
            lines.append(
                f"| {run['dtype']} ({run['matmul_precision']}) | {shown} | {name} | {p['step_ms']:.2f} ms | "
                f"{predicted} | {p['tokens_per_s']:,.0f} | {p['model_tflops']:.1f} | {mfu} | {ratio} | "
                f"{p['first_call_s']:.1f} s | {p['loss_first_step']:.4f} |"
            )
        notes += _run_notes(run, r)
    if r.get("bandwidth"):
        b = r["bandwidth"]
        host = (f"; host link (`jax.device_put` to / from `pinned_host`) {b['to_host_gbps']:.1f} / "
                f"{b['from_host_gbps']:.1f} GB/s" if "to_host_gbps" in b else "")
        notes.append(f"measured bandwidths, {b['bytes'] / 2**30:.2f} GiB: device memory (a jitted elementwise pass, "
                     f"bytes read + written) {b['device_gbps']:.0f} GB/s{host}")
    if r.get("skipped"):
        notes.append("not run: " + "; ".join(r["skipped"]))
    if r.get("unfinished"):
        notes.append("not finished: " + r["unfinished"])
    m = r["matmul"]
    peaks = ", ".join(f"{run['dtype']} {run['peak_tflops']:.1f}" for run in r["runs"] if run.get("peak_tflops"))
    lines += [
        "",
        f"- {r['flops_formula']}: {r['model_flops_per_step'] / 1e12:.3f} TFLOP/step (N = {r['flop_params']:,}).",
        f"- MFU: model TFLOP/s over the dense peak of the H100 SXM for the precision the matmuls ran in "
        f"(TF32 494.7, BF16 989.4 TFLOP/s; where the dots mix precisions, weighted by their FLOPs: {peaks}); a dot's "
        f"precision is read off its operands' dtypes in the step's jaxpr. "
        f"float32 runs with JAX's default GPU matmul precision (`jax_default_matmul_precision` "
        f"{m['jax_default_matmul_precision']}): a 1024² float32 product differs from float64 by "
        f"{m['float32_default_rel_err']:.1e} relative, i.e. {m['float32_default']}. Measured ceilings, one "
        f"{m['ceiling_size']}² product: float32 {m['ceiling_tflops_float32']:.0f} TFLOP/s, "
        f"bfloat16 {m['ceiling_tflops_bfloat16']:.0f} TFLOP/s. The bfloat16 run casts every parameter (and so "
        f"Adam's state) to bfloat16 and runs the same code.",
        "- step: median over rounds of (time of back-to-back steps until `block_until_ready`) / steps; the two "
        "programs alternate which goes first each round, each carrying its own donated parameters and Adam state "
        "from equal copies; ratio: jshard's median over jit's (rounds: median of the per-round ratios). First call: "
        "trace (+ jshard's plan) + compile + one step.",
    ]
    lines += [f"- {n}" for n in notes]
    profile = path.parent / "gpu_profile.json"
    if profile.exists():
        lines.append(f"- {profile_note(json.loads(profile.read_text()))}")
    return "\n".join(lines) + "\n"


def profile_note(p: dict[str, Any]) -> str:
    """One line on the kernels of a profiled step (`benchmarks/gpu_profile.json`, written by
    `python -m benchmarks._gpu_profile`)."""
    kinds = ", ".join(f"{k} {ms:.1f}" for k, ms in p["by_kind_ms"].items() if ms >= 0.5)
    largest = p["top"][0]["name"] if p["top"] else "-"
    return (f"where the step's kernels go (`{p['command']}`, {p['device']}, jax {p['jax']}, attention {p['attention']}, "
            f"the residual stream's gradient {'fenced' if p.get('fence_grads') else 'not fenced'}): "
            f"{p['kernel_ms_per_step']:.1f} ms of kernels per step ({p['step_ms_unprofiled']:.1f} ms unprofiled), "
            f"by kind, ms: {kinds}; largest kernel {largest}. {p.get('finding', '')}").rstrip()


if __name__ == "__main__":
    sys.exit(main())
