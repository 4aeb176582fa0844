"""Rules for cuDNN's fused attention, the kernel `jax.nn.dot_product_attention(...,
implementation="cudnn")` calls on NVIDIA GPUs: its forward and backward primitives.

Each batch row and each head attends on its own, so the batch dim and the heads may be cut (XLA
partitions the kernel over them: JAX registers it with `custom_partitioning`); the sequence and
the head_dim stay whole. The queries, keys and values are cut alike (the kernel's partitioning
refuses them cut apart), so grouped-query attention (fewer key/value heads than query heads) keeps
the heads whole. Operands are told apart by shape: queries-like `[batch, length, heads, head_dim]`
(the queries, the output and its cotangent, the queries' gradient), keys-like `[batch, keys,
kv_heads, head_dim]`, the softmax statistics `[batch, heads, length]`; anything else (a bias, a
mask, sequence lengths) is whole. Only the `[batch, length, heads, head_dim]` layout has factors;
another layout leaves every operand whole.

FLOPs: the forward's two products, 4·batch·heads·length·keys·head_dim; the backward's five
(the scores recomputed), 2.5 times that; a causal mask halves both (the kernel skips the tiles
the mask covers).
"""

from __future__ import annotations

from jax.extend import core as jcore

from jshard.rules._factors import DimFactors, FactorBuilder, Factors, rule, shape_of

FORWARD, BACKWARD = "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"
BTNH = 0
"""`AttentionLayout.BTNH`: operands `[batch, length, heads, head_dim]`."""


@rule(FORWARD, BACKWARD)
def fused_attention(eqn: jcore.JaxprEqn) -> Factors:
    q, k = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    b = FactorBuilder()
    if len(q) != 4 or len(k) != 4 or eqn.params.get("layout") != BTNH:
        return b.build([_whole(v) for v in eqn.invars], [_whole(v) for v in eqn.outvars])
    (batch, length, heads, head_dim), (_, keys, kv_heads, _) = q, k
    n = b.new(batch)
    h: DimFactors = (b.new(heads),) if kv_heads == heads else ()  # cut only where q, k and v can share it
    forms: dict[tuple[int, ...], tuple[DimFactors, ...]] = {
        (batch, heads, length): ((n,), h, ()),
        (batch, keys, kv_heads, head_dim): ((n,), (), h, ()),
        (batch, length, heads, head_dim): ((n,), (), h, ()),
    }  # the queries' form last: where queries and keys are alike, theirs wins

    def of(v) -> tuple[DimFactors, ...]:
        return forms.get(shape_of(v), _whole(v))

    flops = 4.0 * batch * heads * length * keys * head_dim
    flops *= 0.5 if "CAUSAL" in str(eqn.params.get("mask_type", "")) else 1.0
    flops *= 2.5 if eqn.primitive.name == BACKWARD else 1.0
    return b.build([of(v) for v in eqn.invars], [of(v) for v in eqn.outvars], flops=flops)


def _whole(v) -> tuple[DimFactors, ...]:
    return tuple(() for _ in shape_of(v))
