"""`jshard.cost.redistribution`: the collectives between two layouts do not depend on the value's
shape, so the route is found once per pair of layouts and mesh; each collective's payload is the
value's bytes over the cut of the layout it moves (`local_bytes`), as priced before the route was
shared."""

import pytest

from jshard.cost import Comm, _collectives, local_bytes, redistribution

AXES = {"d0": 2, "d1": 2, "d2": 2}
MOVES = [  # (src, dst, the layout each collective moves, in order)
    ((("d0", "d1"), ()), ((), ("d0", "d1")), [(("d0", "d1"), ())]),  # an all-to-all of the rows' cut
    ((("d0",), ("d1",)), (("d0",), ()), [(("d0",), ())]),  # an all-gather: the payload is the gathered slice
    (((), ()), (("d0",), ("d1", "d2")), []),  # a finer layout: sliced locally
    ((("d0",), ("d1",)), (("d1",), ("d0",)), [(("d0",), ("d1",))]),  # axes swapped: a permute of the slice
]


@pytest.mark.parametrize("src,dst,moved", MOVES, ids=["all-to-all", "all-gather", "slice", "permute"])
def test_a_route_is_found_once_and_priced_per_shape(src, dst, moved):
    _collectives._route.cache_clear()
    small = redistribution((64, 32), 4, src, dst, AXES)
    large = redistribution((256, 96), 2, src, dst, AXES)
    info = _collectives._route.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert [c.kind for c in small] == [c.kind for c in large] and [c.axes for c in small] == [c.axes for c in large]
    for comms, shape, itemsize in ((small, (64, 32), 4), (large, (256, 96), 2)):
        assert [c.bytes for c in comms] == [local_bytes(shape, itemsize, layout, AXES) for layout in moved]


def test_the_route_is_per_mesh():
    src, dst = (("d0", "d1"), ()), ((), ("d0", "d1"))
    assert redistribution((64, 32), 4, src, dst, AXES) == [Comm("all-to-all", 64 * 32 * 4 / 4, ("d0", "d1"))]
    wider = {**AXES, "d1": 4}
    assert redistribution((64, 32), 4, src, dst, wider) == [Comm("all-to-all", 64 * 32 * 4 / 8, ("d0", "d1"))]
