"""Rule for `conv_general_dilated`: a matmul over feature dims, slid over whole spatial dims.

Read from the dimension numbers, a convolution is MindSpore's Conv2D device matrix
`[batch, out features, in features]`: the batch passes from `lhs` to the output, the kernel's
output features to the output's features, and the input features are contracted (a cut leaves
partial sums, summed by an all-reduce). Spatial dims stay whole: a window reads its neighbours.

Read generically, the backward pass comes out right: the kernel gradient is a convolution whose
`lhs` batch dim is the input's features and whose contracted dim is the batch (its cut leaves the
partial sums data parallelism all-reduces); the input gradient contracts the output features.

With `feature_group_count > 1` each feature dim is `[group, within group]`: the group factor is
shared by the input features, the kernel's output features and the output's features, and only
the within-group input features are contracted. With `batch_group_count > 1` (the kernel gradient
of a grouped convolution) the batch is read in groups, and is kept whole.
"""

from __future__ import annotations

import math

from jax.extend import core as jcore

from jshard.rules._factors import DimFactors, FactorBuilder, Factors, rule, shape_of


@rule("conv_general_dilated")
def conv_general_dilated(eqn: jcore.JaxprEqn) -> Factors:
    p = eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    ls, rs, os = shape_of(eqn.invars[0]), shape_of(eqn.invars[1]), shape_of(eqn.outvars[0])
    b = FactorBuilder()
    lhs: list[DimFactors] = [() for _ in ls]
    rhs: list[DimFactors] = [() for _ in rs]
    out: list[DimFactors] = [() for _ in os]
    if p["batch_group_count"] == 1:
        lhs[lhs_spec[0]] = out[out_spec[0]] = (b.new(ls[lhs_spec[0]]),)
    groups = p["feature_group_count"]
    group: DimFactors = (b.new(groups),) if groups > 1 else ()
    rhs[rhs_spec[0]] = out[out_spec[1]] = group + (b.new(rs[rhs_spec[0]] // groups),)
    contracted = b.new(rs[rhs_spec[1]])
    lhs[lhs_spec[1]], rhs[rhs_spec[1]] = group + (contracted,), (contracted,)
    flops = 2 * math.prod(os) * math.prod(rs[d] for d in rhs_spec[1:])
    return b.build([lhs, rhs], [out], reduced=[contracted], flops=flops)
