"""The `jshard` command line: `jshard demo` trains the reference GPT on simulated devices."""

from __future__ import annotations

import argparse
import sys
import time

PRESET_HELP = "data: batch cut over all devices; tensor: Megatron weights cut over all devices; 2d: 2-way data x n/2-way tensor"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jshard", description="MindSpore-style automatic parallelism for JAX.")
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
    demo.add_argument("--preset", choices=("data", "tensor", "2d"), default="2d", help=PRESET_HELP + " (default 2d)")
    demo.add_argument("--batch", type=int, default=16, help="global batch size (default 16)")
    demo.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    demo.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    return parser


_SUMMARY_LINES = 24


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    return 2  # pragma: no cover - argparse requires a command


def _demo(args: argparse.Namespace) -> int:
    import jshard

    jshard.simulate_devices(args.devices)  # before anything else touches JAX's backend

    import jax
    import numpy as np
    import optax
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jshard import models
    from jshard.propagate import audit

    console = Console(highlight=False)
    cfg = models.GPTConfig(n_layers=args.layers)
    preset = models.preset(args.preset, args.devices)
    params = models.init_gpt(cfg, jax.random.key(args.seed))
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(args.seed)
    batch = models.copy_task_batch(rng, cfg, args.batch)
    loss_fn = lambda p, b, pr: models.gpt_loss(p, b, cfg, pr)
    step = models.parallel_train_step(loss_fn, optimizer, params, opt_state, batch, preset, models.GPT_RULES)

    console.rule(f"jshard demo: GPT ({cfg.n_layers} layers, d_model {cfg.d_model}) on {args.devices} simulated CPU devices")
    console.print(f"preset [bold]{preset.name}[/]: data parallel {preset.dp} x tensor parallel {preset.mp}")
    console.print(f"column-parallel matmul in_strategy = {preset.column(3)}, row-parallel = {preset.row(3)}")
    t0 = time.perf_counter()
    plan = step.plan(params, opt_state, batch)
    compiled = step.lower(params, opt_state, batch).compile()
    console.print(f"traced, planned and compiled in {time.perf_counter() - t0:.1f} s\n")
    lines = plan.summary().splitlines()
    shown = lines[:_SUMMARY_LINES] + ([f"... {len(lines) - _SUMMARY_LINES} more source lines: print(plan.summary())"]
                                      if len(lines) > _SUMMARY_LINES else [])
    console.print("\n".join(shown), markup=False, soft_wrap=True)
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
