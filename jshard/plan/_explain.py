"""`Plan.explain`: why one operator got its strategy, in words."""

from __future__ import annotations

import re

from jshard._format import human_bytes
from jshard.plan._records import source_str, strategies_str
from jshard.rules import FALLBACKS

_MAX_CHAIN = 8
_REGION = re.compile(r"policy='auto' -> '\w+', region (\d+)")


def explain(plan, op) -> str:
    """The operator's strategy, the anchor it came from and the chain between, its cost, and the best
    alternative it rejected."""
    where = f"{source_str(op.source)}, {'backward' if op.backward else 'forward'}" + (f", inside {op.inside}" if op.inside else "")
    lines = [f"op #{op.index} {op.primitive} ({where})"]
    lines.append(f"  strategy: in {strategies_str(op.in_strategy)} -> out {strategies_str(op.out_strategy)}; origin {op.origin}")
    if op.origin == "user" and op.annotation:
        call = op.annotation if op.annotation.startswith("jshard.") else f"jshard.shard({op.annotation})"
        lines.append(f"  set by the user: {call} at {source_str(op.source)}")
    elif op.origin == "model":
        lines.append(f"  set by the model: its own sharding of this result at {source_str(op.source)} (a with_sharding_constraint, "
                     f"a logical constraint, or its type on Explicit mesh axes)")
    elif op.origin == "searched":
        how = "" if plan.search is None else f" (search={plan.search.search}, {plan.search.status})"
        lines.append(f"  chosen by the strategy search{how}: the least-cost plan over every operator together")
        if plan.offload is not None and plan.offload.why:
            lines.append(f"  planned with the {'+'.join(plan.offload.what)} state in host memory, streamed each step "
                         f"({human_bytes(plan.offload.moved_bytes)} per device both ways): {plan.offload.why}")
    elif op.origin == "default":
        reason = FALLBACKS.get(op.primitive, "no sharding rule for this primitive") if not op.ruled else "no anchor reaches it"
        lines.append(f"  left replicated ({reason}); XLA decides its layout")
    else:
        chain = _chain(plan, op)
        anchor = chain[-1]
        lines.append(f"  came from: {_anchor(plan, anchor)}")
        if len(chain) > 1:
            shown = [f"#{i} {plan.ops[i].primitive}" for i in reversed(chain[:_MAX_CHAIN]) if isinstance(i, int)]
            more = f"... {len(chain) - _MAX_CHAIN} more ... -> " if len(chain) > _MAX_CHAIN else ""
            lines.append("  through: " + more + " -> ".join(shown))
    if op.primitive == "shard_map":
        lines.append("  a manual region (jax.shard_map, as jshard.attention runs a cut sequence's attention in): its "
                     "operands and results laid out by its own specs, the collectives its body runs priced as written")
    if op.comms:
        paid = "; ".join(f"{k} of {human_bytes(b)} over {'×'.join(a)}" for k, b, a in op.comms)
        lines.append(f"  cost paid: {paid} ({op.seconds * 1e6:.8g} us predicted)" + _hidden(plan, op))
        if op.origin == "user" and not op.backward:
            lines.append("  the user's strategy binds: it is kept, and these collectives run inside the operator to "
                         "honour it (no cheaper layout of the engine's replaces it)")
    elif op.origin != "default":
        lines.append("  cost paid: none (no redistribution, no partial sums)")
    lines += _details(op)
    if op.recompute:
        lines.append(_recompute(plan, op))
    return "\n".join(lines)


def _details(op) -> list[str]:
    """The lines for a user's cut the operator gathers, the alternative it rejected, its difference
    from MindSpore and the argument layouts weighed for it, where it has them."""
    lines = []
    if op.gathered:
        lines.append(f"  the user's cut is not kept here: {op.gathered}. Cut it as this operator takes it, or give it "
                     "and the operand it meets one Layout")
    if op.rejected:
        lines.append(f"  best rejected alternative: {op.rejected}")
    if op.note:
        lines.append(f"  differs from MindSpore: {op.note}")
    if op.weighed:
        lines.append(f"  layouts weighed for the whole program (bandwidth and compute; a value at the memory peak: made finer): {op.weighed}")
    return lines


def _recompute(plan, op) -> str:
    """Why the operator is (or is not) run again in the backward pass."""
    why = (f"{op.recompute}, the user's jax.checkpoint (or a remat built on it)" if op.recompute.startswith("jax.")
           else f"{op.recompute}, the user's jshard.recompute call")
    if "mp_comm_recompute=False" in op.recompute:
        why += "; the results of its collectives are kept from the forward pass, not communicated again"
    region = _REGION.search(op.recompute)
    chosen = [r for r in (plan.search.regions if plan.search is not None and region else ())
              if r.region == int(region.group(1))]
    if chosen:
        why += (f"; the search's choice for it under the memory budget, the least recompute whose estimated peak "
                f"fits: {chosen[0].text()}")
    if op.recomputed:
        return f"  recomputed: the backward pass runs this forward operator again instead of keeping its result ({why})"
    if op.backward:
        return f"  in the backward pass of a recompute region ({why})"
    again = any(o.recomputed and (o.source, o.primitive) == (op.source, op.primitive) for o in plan.ops)
    if again:
        return f"  in a recompute region ({why}): its result is not kept for the backward pass, which runs it again"
    return f"  in a recompute region ({why}): not run again in the backward pass (its policy saves the result, or the backward pass does not need it)"


def _chain(plan, op) -> list:
    """Operator indices from `op` back to its anchor; the last entry is the anchor (an index, or
    `"arg"`/`"user"`/`"peak"`)."""
    chain: list = [op.index]
    seen = {op.index}
    current = op
    while True:
        via = current.via
        if not via.isdigit():
            chain.append(via or "user")
            return chain
        i = int(via)
        if i in seen:
            return chain
        seen.add(i)
        chain.append(i)
        current = plan.ops[i]
        if current.origin in ("user", "model"):
            return chain


def _anchor(plan, anchor) -> str:
    if anchor == "arg":
        return ("an argument whose layout is fixed (in_strategy, a shard call's input, the model's own "
                "placement on your mesh, or the batch)")
    if anchor == "peak":
        return ("a value held at the predicted memory peak, made as a user of it takes it (weighed over the whole "
                "program: less memory per device for at most 1% more predicted time)")
    if anchor == "user":
        return "a sharding constraint of a jshard.shard call"
    if anchor == "model":
        return "a sharding constraint of the model's own (with_sharding_constraint or a logical constraint)"
    op = plan.ops[anchor]
    name = f" [{op.annotation}]" if op.annotation else ""
    return f"#{op.index} {op.primitive}{name} ({op.origin}, {source_str(op.source)})"



def _hidden(plan, op) -> str:
    """What of `op`'s collectives runs beside compute (`WorkReport.hidden_ops`), as a line; or ""."""
    hidden = plan.work.hidden(op.index) if plan.work is not None else 0.0
    if not hidden:
        return ""
    return (f"\n  of which {hidden * 1e6:.4g} us run beside compute that does not wait for them (the cost model's "
            f"device overlaps collectives with compute)")
