"""The `jshard` command line: `jshard demo` trains the reference GPT on simulated devices; `jshard
plan` plans a reference model or a user's function for N devices without materializing anything;
`jshard launch` starts a multi-process job's workers; `jshard k8s` prints a Kubernetes manifest;
`jshard --version`.

Errors are one paragraph on stderr, never a traceback: a `ShardingError` (`DeviceCountError`
included) from `demo` or `plan` prints as `jshard <command>: error: <message>` and exits 1; options
that do not fit (a preset the demo's GPT cannot split over `--devices`) exit 2 and name the options
that would (`_demo_preset`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import TextIO

PRESET_HELP = "data: batch cut over all devices; tensor: Megatron weights cut over all devices; 2d: 2-way data x n/2-way tensor"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jshard", description="MindSpore-style automatic parallelism for JAX.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train the reference GPT on simulated CPU devices with MindSpore strategy tuples",
        description="Trains the package's reference GPT on a copy task on N simulated CPU devices with a "
        "Megatron-style strategy written as MindSpore tuples; shows the mesh, the per-operator strategies, "
        "per-device memory and the collectives XLA emitted, then the training loss.",
    )
    demo.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    demo.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    demo.add_argument("--preset", choices=("data", "tensor", "2d"), default=None,
                      help=PRESET_HELP + " (default 2d, or the first of tensor, data that fits --devices)")
    demo.add_argument("--batch", type=int, default=16, help="global batch size (default 16)")
    demo.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    demo.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--summary-rows", type=int, default=24, metavar="N",
                      help="source lines of the plan summary to show (default 24; 0: all)")
    _plan_parser(sub)
    _multiprocess_parsers(sub)
    return parser


def _version() -> str:
    import jax

    import jshard

    return f"jshard {jshard.__version__} (jax {jax.__version__})"


def _multiprocess_parsers(sub) -> None:
    from jshard._k8s import k8s_parser
    from jshard._launch import launch_parser

    launch_parser(sub)
    k8s_parser(sub)


PLAN_DESCRIPTION = """\
Plans TARGET for N devices with jshard.parallelize (mode=auto: the strategy search) and prints the
plan summary, the planning time, the estimated peak memory per device against the budget and the
predicted collective bytes per device; where (nearly) nothing is cut, the summary says so, with the
data-parallel plan's predicted time beside the plan's. Nothing is materialized or compiled:
parameters and optimizer state are shapes (jax.eval_shape), and with more devices than are present
the plan is made on an abstract mesh, so a cluster-sized plan runs on a laptop.

TARGET is either
  a reference model's Adam train step, step(params, opt_state, batch), its state donated:
    gpt, gpt-scan (the blocks under lax.scan), mlp, resnet, moe; sized by the options below
    (defaults: the package's small configs, batch 16), e.g. a GPT-3-like plan:
      jshard plan gpt-scan --layers 96 --d-model 12288 --heads 96 --seq-len 2048 \\
        --batch 1536 --vocab 50257 --d-ff 49152 --devices 1024
  or MODULE:FUNCTION, your own function: MODULE is a dotted module name (importable, the current
  directory included) or a path to a .py file; FUNCTION takes no arguments and returns (fn, args):
  the function to parallelize and a tuple of example positional arguments (arrays or
  jax.ShapeDtypeStructs), or (fn, args, options) with options a dict of extra jshard.parallelize
  keyword arguments (e.g. {"donate_argnums": (0, 1)}):
      # mypkg/train.py
      def example():
          params = jax.eval_shape(init, jax.random.key(0))
          batch = jax.ShapeDtypeStruct((64, 512), jnp.float32)
          return train_step, (params, batch)
      jshard plan mypkg.train:example --devices 64

The search's memory budget is --memory-budget, else the memory of one --device (e.g. H100: 80 GiB),
else of the devices present; on an abstract mesh (more --devices than present) with neither, of an
H100 (80 GiB), so a plan no device could hold is never shown as a success. gpt-scan marks its block
jshard.recompute(policy="auto"), so the search weighs no, selective and full recompute of the
blocks and keeps the fastest plan that fits.

Exit status: 0 planned, 1 no plan (e.g. a memory budget nothing can meet, or the plan found holds more than
it: printed, marked "over", not saved), 2 bad arguments or TARGET.
"""


def _plan_parser(sub) -> None:
    from jshard._examples import SIZE_OPTIONS

    plan = sub.add_parser(
        "plan",
        help="plan a reference model or MODULE:FUNCTION for N devices (strategy search, no arrays made)",
        description=PLAN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("target", metavar="TARGET", help="gpt, gpt-scan, mlp, resnet, moe, or MODULE:FUNCTION")
    plan.add_argument("--devices", type=int, default=8,
                      help="devices to plan for (default 8); more than are present: an abstract mesh")
    plan.add_argument("--mode", choices=("auto", "semi_auto", "data"), default="auto",
                      help="jshard.parallelize mode (default auto: the strategy search)")
    plan.add_argument("--search", choices=("recursive", "ilp", "propagation"), default=None,
                      help="with --mode auto: the search (default recursive)")
    plan.add_argument("--memory-budget", metavar="BYTES", default=None,
                      help="with --mode auto: per-device memory the plan must fit, e.g. 16GiB, 512MiB, 2e9")
    plan.add_argument("--device", metavar="KIND", default=None,
                      help="the device kind to plan for (H100, H200, A100, GH200): the cost model's compute and link "
                           "rates, and its memory as the default --memory-budget (default: the devices present "
                           "if --devices fit them, else H100)")
    plan.add_argument("--enable-alltoall", action=argparse.BooleanOptionalAction, default=None,
                      help="let redistributions be all-to-alls (CostModel's alltoall; default on); "
                           "--no-enable-alltoall prices and emits them as all-gathers and slices")
    plan.add_argument("--replay", action=argparse.BooleanOptionalAction, default=None,
                      help="with the recursive search: decide an unrolled loop's interior layers as one and "
                           "replay the decision on each (Search's replay; default on); --no-replay "
                           "weighs every operator on its own")
    plan.add_argument("--time-limit", metavar="S", type=float, default=None,
                      help="seconds the whole planning may take, every search and weighing (default 60)")
    plan.add_argument("--quiet", action="store_true",
                      help="no progress line on stderr while the search runs (shown only on a terminal)")
    plan.add_argument("--save", metavar="PATH", default=None, help="write the plan as JSON (Plan.save)")
    plan.add_argument("--explain", metavar="K", type=int, default=0,
                      help="explain the K operators with the highest predicted collective cost")
    sizes = plan.add_argument_group("reference model size (each defaults to the model's small config)")
    sizes.add_argument("--batch", type=int, default=None, help="global batch size (default 16)")
    for flag, (dest, kind, text) in SIZE_OPTIONS.items():
        sizes.add_argument(flag, dest=dest, type=kind, default=None, help=text)


def main(argv: list[str] | None = None) -> int:
    from jshard._errors import ShardingError

    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "plan":
            return _plan(args)
    except ShardingError as e:  # DeviceCountError included: the message says it all
        print(f"jshard {args.command}: error: {str(e).removeprefix(f'jshard {args.command}: ')}", file=sys.stderr)
        return 1
    if args.command == "launch":
        from jshard._launch import run_launch

        return run_launch(args)
    if args.command == "k8s":
        from jshard._k8s import run_k8s

        return run_k8s(args)
    return 2  # pragma: no cover - argparse requires a command


def _demo(args: argparse.Namespace) -> int:
    import jshard
    from jshard import models

    if args.devices < 1:
        print(f"jshard demo: error: --devices must be positive, got {args.devices}.", file=sys.stderr)
        return 2
    cfg = models.GPTConfig(n_layers=args.layers)
    preset, note = _demo_preset(args, cfg)
    if preset is None:
        print(f"jshard demo: error: {note}", file=sys.stderr)
        return 2
    jshard.simulate_devices(args.devices)  # before anything else touches JAX's backend

    import jax
    import numpy as np
    import optax
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from jshard.audit import audit

    console = Console(highlight=False)
    params = models.init_gpt(cfg, jax.random.key(args.seed))
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(args.seed)
    batch = models.copy_task_batch(rng, cfg, args.batch)
    loss_fn = lambda p, b, pr: models.gpt_loss(p, b, cfg, pr)
    step = models.parallel_train_step(loss_fn, optimizer, params, opt_state, batch, preset, models.GPT_RULES)

    console.rule(f"jshard demo: GPT ({cfg.n_layers} layers, d_model {cfg.d_model}) on {args.devices} simulated CPU devices")
    console.print(f"preset [bold]{preset.name}[/]: data parallel {preset.dp} x tensor parallel {preset.mp}{note}")
    console.print(f"column-parallel matmul in_strategy = {preset.column(3)}, row-parallel = {preset.row(3)}")
    t0 = time.perf_counter()
    plan = step.plan(params, opt_state, batch)
    compiled = step.lower(params, opt_state, batch).compile()
    console.print(f"traced, planned and compiled in {time.perf_counter() - t0:.1f} s\n")
    rows = args.summary_rows if args.summary_rows > 0 else None
    summary = plan.summary(width=min(console.width, 120) if console.is_terminal else 120, limit=rows)
    console.print(summary, markup=False, soft_wrap=True)
    if summary.splitlines()[-1].endswith("more rows"):
        console.print("(the whole plan: jshard demo --summary-rows 0, with the same options)")
    console.print()
    console.print(audit(compiled).summary(), markup=False, soft_wrap=True)
    console.print()

    losses = []
    with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("train", total=args.steps, loss="...")
        for _ in range(args.steps):
            batch = models.copy_task_batch(rng, cfg, args.batch)
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
            bar.update(task, advance=1, loss=f"{losses[-1]:.3f}")
    marks = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4, len(losses) - 1})
    console.print("loss by step: " + ", ".join(f"{i + 1}: {losses[i]:.3f}" for i in marks))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    console.print(f"loss fell from {first:.3f} to {last:.3f} (mean of first and last 5 steps; chance is {np.log(cfg.vocab - 3):.3f})")
    return 0


def _demo_preset(args: argparse.Namespace, cfg) -> tuple:
    """`(preset, note)`: the preset `--preset` names (default: 2d, else the first of tensor, data that
    splits the GPT over `--devices`), or `(None, why)`, naming each preset's problem and the options
    that would run: another batch where only the batch is in the way, the nearest device counts."""
    from jshard import models

    n, batch = args.devices, args.batch
    names = [args.preset] if args.preset else ["2d", "tensor", "data"]
    problems = {name: _preset_problems(name, n, cfg, batch) for name in models.PRESETS}
    fits = next((name for name in names if not problems[name]), None)
    if fits is not None:
        note = "" if fits == names[0] else f" (2d does not fit {n} devices: {'; '.join(problems['2d'])})"
        return models.preset(fits, n), note
    would = [f"--preset {name}" for name in models.PRESETS if not problems[name]]
    for name in models.PRESETS:
        if problems[name] and all("batch" in p for p in problems[name]):  # only the batch is in the way
            dp = models.preset(name, n).dp
            would.append(f"--preset {name} --batch {-(-batch // dp) * dp}")
    counts = [m for m in range(1, 4 * n + 1) if any(not _preset_problems(x, m, cfg, batch) for x in names)]
    would += [f"--devices {m}" for m in sorted(sorted(counts, key=lambda m: (abs(m - n), m))[:2])]
    tried = "; ".join(f"--preset {name}: {', '.join(problems[name])}" for name in names)
    return None, (f"the demo's GPT (d_model {cfg.d_model}, d_ff {cfg.d_ff}, vocab {cfg.vocab}) and a batch of {batch} "
                  f"do not split over {n} devices with {'that preset' if args.preset else 'any preset'} ({tried}). "
                  f"These options would run: {'; '.join(would)}.")


def _preset_problems(name: str, n: int, cfg, batch: int) -> list[str]:
    from jshard import models
    from jshard._errors import ShardingError

    try:
        preset = models.preset(name, n)
    except ShardingError as e:
        return [str(e).split(": ", 1)[1].rstrip(".")]
    return models.gpt_split_problems(cfg, preset, batch)


DEFAULT_DEVICE = "H100"
"""The device kind `jshard plan` plans for on an abstract mesh with no `--memory-budget` or
`--device`: its memory is the budget, so a plan that fits no real device is not shown as a success."""


def _plan(args: argparse.Namespace) -> int:  # noqa: C901  (the `plan` command's flags, checked in turn)
    import jshard

    # 8 CPU stand-ins, before JAX starts. Where it has already started with another count (a
    # notebook, the tests), plan with the devices present: devices=N beyond them plans on an
    # abstract mesh, which is all `jshard plan` needs.
    with contextlib.suppress(jshard.DeviceCountError):
        jshard.simulate_devices(8)

    import jax

    from jshard._examples import SIZE_OPTIONS, TargetError, build
    from jshard._format import human_bytes
    from jshard.compile import Options, parse_bytes

    if args.devices < 1:
        print(f"jshard plan: error: --devices must be positive, got {args.devices}.", file=sys.stderr)
        return 2
    try:
        budget = parse_bytes(args.memory_budget)
    except ValueError:
        print(f"jshard plan: error: --memory-budget {args.memory_budget!r} is not a size (e.g. 16GiB, 512MiB, 2e9).",
              file=sys.stderr)
        return 2
    if args.mode != "auto" and args.time_limit is not None:
        print(f"jshard plan: error: --time-limit applies to the strategy search, --mode auto (not {args.mode}).",
              file=sys.stderr)
        return 2
    present = len(jax.devices())
    defaulted = budget is None and args.device is None and args.mode == "auto" and args.devices > present
    if defaulted:  # planned for a cluster: held to the memory of a device of one, not to none
        args.device = DEFAULT_DEVICE
    sizes = {dest: getattr(args, dest) for dest, _, _ in SIZE_OPTIONS.values()}
    try:
        example = build(args.target, sizes, args.batch)
    except TargetError as e:
        print(f"jshard plan: error: {e}", file=sys.stderr)
        return 2

    options = dict(example.options)
    options.update(devices=args.devices, mode=args.mode)
    import dataclasses

    from jshard.compile import grouped
    from jshard.cost import DEVICE_KINDS, CostModel

    given = {"method": args.search, "memory_budget": budget, "time_limit": args.time_limit, "replay": args.replay}
    search = grouped("search", options.get("search", "recursive"), "jshard plan")
    options["search"] = dataclasses.replace(search, **{k: v for k, v in given.items() if v is not None})
    costs = options.get("cost_model") or CostModel()
    if args.enable_alltoall is not None:
        options["cost_model"] = costs = dataclasses.replace(costs, alltoall=args.enable_alltoall)
    if args.device is not None:
        try:
            options["cost_model"] = CostModel.for_device(args.device, alltoall=costs.alltoall)
        except jshard.ShardingError:
            print(f"jshard plan: error: --device {args.device!r} is no known device kind; the known kinds are "
                  f"{', '.join(DEVICE_KINDS)}.", file=sys.stderr)
            return 2
    try:  # the option rules parallelize checks, reported as the CLI's usage errors
        Options.create(**options).check("jshard plan")
    except (jshard.ShardingError, TypeError) as e:
        print(f"jshard plan: error: {str(e).removeprefix('jshard plan: ')}", file=sys.stderr)
        return 2
    where = (f"{present} {jax.devices()[0].platform} device(s) present" if args.devices <= present
             else f"an abstract mesh (only {present} device(s) present: planning only)")
    print(f"jshard plan: {example.name} ({example.describe}) on {args.devices} devices, {where}", flush=True)
    if defaulted:
        print(f"jshard plan: no --memory-budget or --device: planned for {DEFAULT_DEVICE} devices, each holding "
              f"{human_bytes(options['cost_model'].memory)} (--device KIND or --memory-budget BYTES for another)",
              flush=True)

    t0 = time.perf_counter()
    try:
        with search_progress(sys.stderr, quiet=args.quiet):
            plan = jshard.parallelize(example.fn, **options).plan(*example.args)
    except jshard.ShardingError as e:
        print(f"jshard plan: no plan ({time.perf_counter() - t0:.1f} s): {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0

    print(plan.summary())
    print()
    print(f"planned in {seconds:.2f} s")
    report = plan.search
    if report is not None:
        against = "no memory budget" if report.budget is None else f"budget {human_bytes(report.budget)}"
        if report.budget is not None and report.budget_from != "memory_budget":
            against += f" ({report.budget_from})"
        over = report.budget is not None and report.held_bytes > report.budget
        fits = "" if report.budget is None else (" (over: the plan does not fit)" if over else " (fits)")
        line = f"estimated peak memory per device: {human_bytes(report.peak_bytes)}, {against}{fits}"
        if report.compiled_peak_bytes is not None:
            line += f"; compiled program holds {human_bytes(report.compiled_peak_bytes)}"
        print(line)
        if over:  # never printed as a success, nor saved
            print(f"jshard plan: no plan ({seconds:.1f} s): the plan found holds more than the budget of "
                  f"{human_bytes(report.budget)} per device (estimated {human_bytes(report.peak_bytes)}"
                  + ("" if report.compiled_peak_bytes is None else
                     f", compiled {human_bytes(report.compiled_peak_bytes)}")
                  + "). Raise --memory-budget, or plan for more --devices.", file=sys.stderr)
            return 1
    else:
        print(f"estimated peak memory per device: not estimated (mode={plan.mode}"
              + (", search=propagation" if plan.mode == "auto" else "") + " does not model memory)")
    kinds = ", ".join(f"{k} {human_bytes(b)}" for k, b in sorted(plan.predicted().items(), key=lambda kb: -kb[1]) if b)
    total = human_bytes(plan.predicted_bytes())
    print(f"predicted collectives per device per call: {total}" + (f" ({kinds})" if kinds else ""))
    if args.explain > 0:
        costly = sorted(plan.ops, key=lambda op: (op.seconds, sum(b for _, b, _ in op.comms)), reverse=True)
        costly = costly[: args.explain]
        print(f"\nthe {len(costly)} operator(s) with the highest predicted collective cost:")
        for op in costly:
            print()
            print(plan.explain(op))
    if args.save:
        try:
            plan.save(args.save)
        except OSError as e:
            print(f"jshard plan: error: cannot write the plan to {args.save}: {e.strerror or e}.", file=sys.stderr)
            return 1
        print(f"saved the plan to {args.save} (reuse: jshard.parallelize(fn, plan=jshard.Plan.load(path)))")
    return 0


class _ProgressLine(logging.Handler):
    """The search's progress records (`jshard.search`, INFO) as one line rewritten in place."""

    def __init__(self, stream):
        super().__init__(logging.INFO)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        self.stream.write(f"\r{record.getMessage()}\x1b[K")
        self.stream.flush()


@contextlib.contextmanager
def search_progress(stream: TextIO, quiet: bool) -> Iterator[None]:
    """Shows the strategy search's progress on `stream` while planning, where it is a terminal and
    not `quiet`; the line is erased at the end."""
    if quiet or not stream.isatty():
        yield
        return
    logger, handler = logging.getLogger("jshard.search"), _ProgressLine(stream)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        stream.write("\r\x1b[K")
        stream.flush()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
