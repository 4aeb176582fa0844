"""MindSpore conformance: cases translated from MindSpore's own parallel unit tests.

Each case names the MindSpore test it translates (`tests/ut/python/parallel/<file>::<test>`, read in
`mindspore-ai/mindspore_test` at `_ms.MS_COMMIT`): a network MindSpore compiles runs under
`jshard.parallelize` and equals one device (with the strategies MindSpore asserts, where it asserts
them); a network MindSpore refuses raises `jshard.ShardingError` naming the problem. Networks are
written anew in JAX with small shapes; device counts above the 8 simulated devices are planned on an
abstract mesh.
"""
