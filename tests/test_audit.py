"""`audit`: collectives and memory read from compiled programs, checked against figures derived by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jshard.audit import Audit, Collective, MemoryFigures, audit, read_collectives
from jshard.compile._program import compiled_held

F32 = 4
MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


def spec(*axes):
    return NamedSharding(MESH, P(*axes))


def compile_(f, in_shardings, out_shardings, *args):
    return jax.jit(f, in_shardings=in_shardings, out_shardings=out_shardings).lower(*args).compile()


@pytest.fixture(scope="module")
def contracted():
    """x f32[16,32] and w f32[32,8] cut along the contracted dim over "b"; the product replicated."""
    return compile_(jnp.matmul, (spec(None, "b"), spec("b", None)), spec(), jnp.ones((16, 32)), jnp.ones((32, 8)))


def test_replicating_a_2d_sharded_array_gathers_each_axis():
    compiled = compile_(lambda x: x, spec("a", "b"), spec(), jnp.ones((16, 32)))
    report = audit(compiled)
    # The [8,8] shard is gathered over "b" (4 devices) into [8,32], then over "a" (2) into [16,32].
    assert report.collectives == (
        Collective("all-gather", 1.0, 16 * 32 * F32, 2),
        Collective("all-gather", 1.0, 8 * 32 * F32, 4),
    )
    assert report.by_kind() == {"all-gather": (2.0, (8 * 32 + 16 * 32) * F32)}


def test_contracted_dim_sharded_matmul_all_reduces_the_output(contracted):
    report = audit(contracted)
    assert report.collectives == (Collective("all-reduce", 1.0, 16 * 8 * F32, 4),)
    assert report.unknown_trip_counts == 0


def test_collective_in_a_loop_counts_once_per_iteration():
    def f(x, w):
        return jax.lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c @ w), x)  # depends on the carry

    compiled = compile_(f, (spec(None, "b"), spec("b", None)), spec(None, "b"), jnp.ones((16, 32)), jnp.ones((32, 32)))
    report = audit(compiled)
    # Each iteration sums the f32[16,32] partial products over "b".
    assert report.collectives == (Collective("all-reduce", 5.0, 5 * 16 * 32 * F32, 4),)
    assert report.unknown_trip_counts == 0


def test_program_without_collectives_reports_zero():
    report = audit(compile_(lambda x: 2 * x, spec("a", "b"), spec("a", "b"), jnp.ones((16, 32))))
    assert (report.collectives, report.count(), report.bytes(), report.by_kind()) == ((), 0.0, 0.0, {})
    assert report.summary().startswith("no collectives\nmemory per device:")


def _block_collectives():
    """shard_map bodies over "b" on the f32[8,8] block of a P("a", "b") f32[16,32] array."""
    ring = [(i, (i + 1) % 4) for i in range(4)]
    return {
        "reduce-scatter": lambda x: jax.lax.psum_scatter(x, "b", scatter_dimension=1, tiled=True),
        "all-to-all": lambda x: jax.lax.all_to_all(x, "b", 0, 0, tiled=True),
        "collective-permute": lambda x: jax.lax.ppermute(x, "b", ring),
    }


@pytest.mark.parametrize("kind", sorted(_block_collectives()))
def test_shard_map_collectives_move_the_block(kind):
    body = jax.shard_map(_block_collectives()[kind], mesh=MESH, in_specs=P("a", "b"), out_specs=P("a", "b"))
    report = audit(jax.jit(body).lower(jnp.ones((16, 32))).compile())
    assert report.collectives == (Collective(kind, 1.0, 8 * 8 * F32, 4),)


def test_permute_bytes_are_what_the_busiest_device_sends():
    """A permute sends from its sources only: over "b" a loop of 3 trips sends the f32[8,8] block
    from b=0 and b=1 (pairs 0>1, 1>2), then one permute from b=2 (2>3); b=3 sends nothing. The
    busiest devices (b=0 and b=1 in each "a" row) send 3 blocks, not the 4 permutes' operands."""
    def f(x):
        x = jax.lax.fori_loop(0, 3, lambda i, c: jax.lax.ppermute(jnp.tanh(c), "b", [(0, 1), (1, 2)]), x)
        return jax.lax.ppermute(x, "b", [(2, 3)])

    body = jax.shard_map(f, mesh=MESH, in_specs=P("a", "b"), out_specs=P("a", "b"))
    report = audit(jax.jit(body).lower(jnp.ones((16, 32))).compile())
    block = 8 * 8 * F32
    assert report.collectives == (Collective("collective-permute", 1.0, block, 2),  # 2>3 and 6>7
                                  Collective("collective-permute", 3.0, 3 * block, 3))  # 0>1>2 and 4>5>6
    assert [c.sent for c in report.collectives] == [(0, 0, block, 0, 0, 0, block, 0),
                                                    (3 * block, 3 * block, 0, 0) * 2]
    assert report.by_kind() == {"collective-permute": (4.0, 3 * block)}
    assert report.bytes() == 3 * block


def test_memory_figures_are_xla_memory_analysis(contracted):
    stats, memory = contracted.memory_analysis(), audit(contracted).memory
    assert memory == MemoryFigures(
        argument_bytes=stats.argument_size_in_bytes,
        output_bytes=stats.output_size_in_bytes,
        temp_bytes=stats.temp_size_in_bytes,
        alias_bytes=stats.alias_size_in_bytes,
        code_bytes=stats.generated_code_size_in_bytes,
    )
    assert memory.argument_bytes == (16 * 8 + 8 * 8) * F32  # the two argument shards
    assert memory.output_bytes == 16 * 8 * F32
    assert memory.peak_bytes == memory.argument_bytes + memory.output_bytes + memory.temp_bytes - memory.alias_bytes


@pytest.mark.parametrize("donate", [(), (0,)], ids=["kept", "donated"])
def test_host_memory_arguments_and_results_are_off_the_device_peak(donate):
    """A `pinned_host` state (an offloaded optimizer's) and the result it becomes: XLA:CPU counts both
    with the device's buffers and reports no host bytes; the audit and `compiled_held` take them out
    alike, donated or not."""
    host = NamedSharding(MESH, P("a", "b"), memory_kind="pinned_host")
    step = jax.jit(lambda state, x: (state * 2, x @ x.T), in_shardings=(host, spec(None, "b")),
                   out_shardings=(host, spec()), donate_argnums=donate)
    args = (jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=host), jax.ShapeDtypeStruct((16, 32), jnp.float32))
    compiled = step.lower(*args).compile()
    stats, memory = compiled.memory_analysis(), audit(compiled).memory
    assert (stats.host_argument_size_in_bytes, stats.host_output_size_in_bytes) == (0, 0)  # the case read from HLO
    state = 8 * 8 * F32  # the state's f32[16,32] cut 2 x 4
    assert (memory.host_argument_bytes, memory.host_output_bytes) == (state, state)
    assert memory.host_alias_bytes == (state if donate else 0) == stats.alias_size_in_bytes
    assert memory.host_bytes == (state if donate else 2 * state)
    assert memory.argument_bytes == 16 * 8 * F32  # x's shard alone
    assert memory.output_bytes == stats.output_size_in_bytes - state
    assert memory.alias_bytes == 0
    held = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    assert memory.peak_bytes == held - memory.host_bytes == compiled_held(step, args)[1]
    assert "host memory per device: argument 256 B, output 256 B" in audit(compiled).summary()


def test_summary_names_kinds_counts_and_memory(contracted):
    lines = audit(contracted).summary().splitlines()
    assert lines[0].split() == ["kind", "count", "bytes", "groups"]
    assert lines[1].split() == ["all-reduce", "1", "512", "B", "4"]
    assert lines[2].startswith("memory per device: argument 768 B, output 512 B")
    assert lines[3].startswith("peak (upper bound): ")
    assert len(lines) == 4  # no host memory line: nothing lives there


def test_audit_is_hashable(contracted):
    assert hash(audit(contracted)) == hash(audit(contracted))


SYNTHETIC = """\
HloModule synthetic, num_partitions=8

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

cond (p: (s32[], bf16[4,8])) -> pred[] {
  p = (s32[], bf16[4,8]{1,0}) parameter(0)
  ROOT c = pred[] constant(true)
}

inner (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  p = (s32[], bf16[4,8]{1,0}) parameter(0)
  x = bf16[4,8]{1,0} get-tuple-element(p), index=1
  ags = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(x), replica_groups=[2,4]<=[8], dimensions={0}
  agd = bf16[16,8]{1,0} all-gather-done(ags), metadata={op_name="while/body=nowhere"}
  ars = s8[4,8]{1,0} all-reduce-start(s8[4,8]{1,0} %q), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=add
  ard = s8[4,8]{1,0} all-reduce-done(ars)
  ROOT t = (s32[], bf16[4,8]{1,0}) tuple(i, x)
}

outer (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  p = (s32[], bf16[4,8]{1,0}) parameter(0)
  w = (s32[], bf16[4,8]{1,0}) while(p), condition=cond, body=inner, backend_config={"known_trip_count":{"n":"2"}}
  m = pred[10]{0} constant({...})
  cps = (pred[10]{0}, pred[10]{0}) collective-permute-start(m), source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  cpd = pred[10]{0} collective-permute-done(cps)
  ROOT t = (s32[], bf16[4,8]{1,0}) tuple(i, x)
}

loose (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  p = (s32[], bf16[4,8]{1,0}) parameter(0)
  a2a = (f32[2,4]{1,0}, f32[2,4]{1,0}) all-to-all(f32[2,4]{1,0} %u, f32[2,4]{1,0} %v), replica_groups={}
  ROOT t = (s32[], bf16[4,8]{1,0}) tuple(i, x)
}

wrapped_gather (g: u32[2]) -> u32[16] {
  g = u32[2]{0} parameter(0)
  ROOT ag = u32[16]{0} all-gather(g), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

branch0 (z: f32[8,8]) -> f32[2,8] {
  z = f32[8,8]{1,0} parameter(0)
  ROOT rs = f32[2,8]{1,0} reduce-scatter(z), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=add
}

branch1 (z: f32[8,8]) -> f32[2,8] {
  z = f32[8,8]{1,0} parameter(0)
  ROOT s = f32[2,8]{1,0} slice(z), slice={[0:2], [0:8]}
}

ENTRY main (p0: (s32[], bf16[4,8]), e1: f32[8], e2: f64[2]) -> f32[8] {
  p0 = (s32[], bf16[4,8]{1,0}) parameter(0)
  e1 = f32[8]{0} parameter(1)
  e2 = f64[2]{0} parameter(2)
  w1 = (s32[], bf16[4,8]{1,0}) while(p0), condition=cond, body=outer, backend_config={"known_trip_count":{"n":"3"}}
  w2 = (s32[], bf16[4,8]{1,0}) while(p0), condition=cond, body=loose
  ar = (f32[8]{0}, f64[2]{0}) all-reduce(e1, e2), replica_groups=mesh['x'=2,'y'=4] {'x','y':(1)2}, to_apply=add
  as = ((u32[2]{0}), u32[16]{0}) async-start(g0), calls=wrapped_gather
  ad = u32[16]{0} async-done(as), calls=wrapped_gather
  k = s32[] constant(0)
  z0 = f32[8,8]{1,0} constant({...})
  c = f32[2,8]{1,0} conditional(k, z0, z0), branch_computations={branch0, branch1}
  ROOT r = f32[8]{0} get-tuple-element(ar), index=0
}
"""


def test_hlo_formats_loops_and_async_pairs():
    collectives, unknown = read_collectives(SYNTHETIC)
    assert collectives == (
        Collective("all-gather", 6.0, 6 * 16 * 8 * 2, 4),  # async pair in 3 x 2 nested loops; iota groups
        Collective("all-gather", 1.0, 16 * 4, 8),  # inside an async-start, counted once
        Collective("all-reduce", 6.0, 6 * 4 * 8 * 1, 2),  # s8, operand shape printed inline
        Collective("all-reduce", 1.0, 8 * 4 + 2 * 8, 4),  # combined f32 + f64; mesh groups, sub-axis
        Collective("all-to-all", 1.0, 2 * 2 * 4 * 4, 8),  # empty groups: every device; loop of unknown trips
        Collective("collective-permute", 3.0, 3 * 10 * 1, 2),  # pred; pairs {0,1} and {2,3}
        Collective("reduce-scatter", 1.0, 8 * 8 * 4, 2),  # a conditional branch, run with the caller's weight
    )
    assert unknown == 1


def test_summary_flags_loops_of_unknown_trip_count():
    report = Audit(read_collectives(SYNTHETIC)[0], MemoryFigures(0, 0, 0, 0, 0), unknown_trip_counts=1)
    assert report.count() == 6 + 1 + 6 + 1 + 1 + 3 + 1
    assert report.by_kind()["all-reduce"] == (7.0, 6 * 32 + 48)
    lines = report.summary().splitlines()
    assert lines[1].split() == ["all-gather", "7", "1.562", "KiB", "4,", "8"]  # 1600 bytes, two group sizes
    assert lines[6] == "1 while loop(s) without a known trip count, counted once"


def test_audit_asks_for_a_compiled_program():
    lowered = jax.jit(lambda x: x).lower(jnp.ones(4))
    with pytest.raises(TypeError, match=r"expects a jax.stages.Compiled, got Lowered\. Pass jax.jit\(f\)"):
        audit(lowered)


def test_unknown_kind_is_an_error(contracted):
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'; use one of all-gather, "):
        audit(contracted).count("allreduce")
    with pytest.raises(ValueError, match="kind 'psum' is not one of all-gather, all-reduce"):
        Collective("psum", 1.0, 4.0, 2)
    with pytest.raises(ValueError, match="group_size must be at least 1, got 0"):
        Collective("all-reduce", 1.0, 4.0, 0)


def test_backend_without_memory_analysis_is_an_error(contracted, monkeypatch):
    monkeypatch.setattr(contracted, "memory_analysis", lambda: None)
    with pytest.raises(ValueError, match="this backend reports no memory analysis"):
        audit(contracted)


def _entry(*lines):
    return "HloModule m, num_partitions=8\n\nENTRY main {\n" + "".join(f"  {line}\n" for line in lines) + "}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("HloModule m\n", "the compiled program's HLO text has no ENTRY computation", id="no-entry"),
        pytest.param(
            _entry("ROOT f = f32[] fusion(), calls=missing"),
            "the HLO text calls computation 'missing' but never defines it",
            id="undefined-computation",
        ),
        pytest.param(
            _entry("ROOT r = f32[4]{0} all-reduce(%y), replica_groups={}"),
            "no shape for operand '%y' in the HLO text",
            id="undefined-operand",
        ),
        pytest.param(
            _entry("ROOT r = f32[4]{0} all-reduce(f32[4]{0} y, replica_groups={}"),
            "unbalanced brackets in HLO text",
            id="unbalanced",
        ),
        pytest.param(
            _entry("ROOT r = opaque[4]{0} all-gather(f32[4]{0} y), replica_groups={}"),
            "unknown HLO element type 'opaque'",
            id="element-type",
        ),
        pytest.param(
            _entry("ROOT r = f32[4]{0} all-reduce(f32[4]{0} y), replica_groups=mesh['x'=8] 'x'"),
            r"cannot read the replica groups \"mesh\['x'=8\] 'x'\"",
            id="mesh-groups",
        ),
    ],
)
def test_unreadable_hlo_is_an_error(text, message):
    with pytest.raises(ValueError, match=f"^jshard.audit: {message}"):
        read_collectives(text)


def test_operand_lists_with_index_comments():
    """XLA writes `/*index=5*/` before the sixth operand of a long list; names must not include it."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    contracted = NamedSharding(mesh, P(None, "b"))

    def many(*xs):
        return tuple(x @ x.T for x in xs)

    args = [jnp.full((16, 32), float(i)) for i in range(7)]
    compiled = jax.jit(many, in_shardings=(contracted,) * 7, out_shardings=(NamedSharding(mesh, P()),) * 7).lower(*args).compile()
    report = audit(compiled)
    assert report.count("all-reduce") >= 1
    assert report.bytes("all-reduce") == 7 * 16 * 16 * 4  # seven f32[16,16] partial products
