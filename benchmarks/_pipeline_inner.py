"""`python -m benchmarks._pipeline_inner`: strategies inside the stages of a step cut by tags (issue 17 item 3).

A 4-block model (d_model 32, up 128, vocab 16; 132 KiB of parameters), tagged two blocks a stage,
S = 2 under 1F1B with M = 4 on 4 simulated CPU devices (2 per stage), its blocks written with
`jshard.shard` tuples: Megatron's column / row cut at mp = 2, or the rows cut at dp = 2. Per
case: the packed parameters a device holds (`StagedProgram.device_bytes`, against its stage's
share), the compiled arguments and temp memory per device, the all-reduces and all-gathers the
audit reads (loops weighted by their trip counts), and loss and gradients against the one-device
step. Deterministic figures from compiled programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jshard as js
from benchmarks._table import Table, size

D, VOCAB, SEQ, LAYERS, ROWS = 32, 16, 8, 4, 16


def _params() -> dict:
    keys = iter(jax.random.split(jax.random.key(0), 2 + 2 * LAYERS))
    dense = lambda a, b: jax.random.normal(next(keys), (a, b)) / np.sqrt(a)
    return {"embed": jax.random.normal(next(keys), (VOCAB, D)) * 0.3, "head": dense(D, VOCAB),
            "layers": [{"up": dense(D, 4 * D), "down": dense(4 * D, D)} for _ in range(LAYERS)]}


def _blocks() -> dict:
    col = js.shard(jnp.matmul, in_strategy=((1, 1, 1), (1, 2)))
    row = js.shard(jnp.matmul, in_strategy=((1, 1, 2), (2, 1)))
    dp = js.shard(jnp.matmul, in_strategy=((2, 1, 1), (1, 1)))
    return {"mp = 2 (Megatron tuples)": lambda p, x: x + row(jax.nn.gelu(col(x, p["up"])), p["down"]),
            "dp = 2 (rows cut by tuples)": lambda p, x: x + dp(jax.nn.gelu(dp(x, p["up"])), p["down"])}


def _loss(block, tag: bool = True):
    t = js.pipeline_stage if tag else (lambda fn, k: fn)

    def loss(params, batch):
        tokens, targets = batch
        x = t(lambda e, i: e[i], 0)(params["embed"], tokens)
        for i, lp in enumerate(params["layers"]):
            x = t(block, i // 2)(lp, x)
        logits = t(lambda w, h: h @ w, 1)(params["head"], x)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1).mean()

    return loss


def inner_table() -> Table:
    """The two cases (see the module docstring)."""
    params = _params()
    tokens = np.random.default_rng(1).integers(0, VOCAB, (ROWS, SEQ))
    batch = (tokens, np.roll(tokens, -1, axis=1))
    plain = lambda p, x: x + jax.nn.gelu(x @ p["up"]) @ p["down"]
    ref = jax.jit(jax.value_and_grad(_loss(plain, tag=False)))(params, batch)
    out = []
    for name, block in _blocks().items():
        step = js.parallelize(_loss(block), devices=4, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="1f1b"))
        got = step(params, batch)
        compiled, program = step.compile(params, batch), step.program(params, batch)
        memory, kinds = compiled.memory_analysis(), js.audit(compiled).by_kind()
        err = max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
        count = lambda kind: "{:.0f} ({})".format(kinds.get(kind, (0, 0))[0], size(kinds.get(kind, (0, 0))[1]))
        out.append((name, f"{size(program.device_bytes())} of {size(max(program.stage_bytes()))}",
                    size(memory.argument_size_in_bytes), size(memory.temp_size_in_bytes), count("all-reduce"),
                    count("all-gather"), ", ".join(program.data_axes) or "-", f"{err:.1e}"))
    return Table(
        "Strategies inside tagged stages: parameters cut as the strategy cuts them, data parallel reduced once",
        "mp: a device holds its stage's cut weights / mp; dp: the gradients all-reduced once per step; both "
        "equal one device",
        ("inside each stage", "packed parameters per device of the stage's share", "arguments", "temp",
         "all-reduces (bytes)", "all-gathers (bytes)", "manual data axes", "max |x - 1 device| / max |x|"),
        tuple(out),
        (f"{LAYERS} blocks (d_model {D}, up {4 * D}), vocab {VOCAB}, {ROWS} rows of {SEQ}; S = 2, M = 4, 1F1B, 4 devices.",
         "mp: the embedding and head, which no strategy cuts, stay whole; the blocks' weights are packed by layout "
         "class (`jshard.pipeline.CutClass`), and so are the residuals and boundary values, in the layouts the "
         "strategies give them (`jshard.pipeline.stage_layouts`): the ff hidden values cut, the residual stream whole; "
         "nothing is gathered to be stored.",
         "dp: the rows' axis runs manual; the two all-reduces are the packed gradients and the loss."),
    )


def main() -> None:
    print(inner_table().markdown())


if __name__ == "__main__":
    js.simulate_devices(8)
    main()
