"""The reference GPT's train step with each block wrapped (in `jax.checkpoint`, `jshard.recompute`,
or nothing), for the recompute tests."""

import jax

from jshard.models import _gpt


def gpt_step(cfg, preset, wrap):
    """`step(params, batch) -> (loss, params - 0.1 * grads)`, each block run as `wrap(block)`."""

    def loss(params, batch):
        tokens, targets, mask = batch
        x = _gpt._embed(params, tokens)
        for p in params["layers"]:
            x = wrap(lambda p, x: _gpt._block(p, x, cfg, preset))(p, x)
        return _gpt._masked_nll(_gpt._logits(params, x, preset), targets, mask)

    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return value, jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

    return step
