"""Planning an unrolled model: identical layers (same operators, shapes and wiring) share the
search's per-unit work (candidates, layouts, costs, redistribution tables), as a scanned body is
planned once."""

import dataclasses
import gc
import itertools

import jax
import numpy as np
import optax
import pytest

import jshard as js
import jshard.compile._program as program
import jshard.plan._records as records
import jshard.search._assemble as assemble_module
import jshard.search._core as core_module
import jshard.search._graph as search_graph
import jshard.search._level as level_module
import jshard.search._recursive as recursive
import jshard.search._search as search_module
import jshard.search._shared as shared_module
import jshard.search._ties as ties_module
from jshard import models
from jshard._collector import collector_paused


def _plan(n_layers: int, **options) -> js.Plan:
    cfg = models.GPTConfig(vocab=64, seq_len=16, d_model=64, n_heads=8, n_layers=n_layers, d_ff=256, scan=False)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = jax.eval_shape(lambda: models.init_gpt(cfg, jax.random.key(0)))
    batch = tuple(jax.ShapeDtypeStruct((64, 16), t) for t in (np.int32, np.int32, np.float32))
    return js.parallelize(step, devices=64, mode="auto", **options).plan(params, jax.eval_shape(optimizer.init, params), batch)


@pytest.fixture(scope="module")
def layouts_computed():
    """Per layer count: the layouts the search derived from factors (`write_spec` calls), and the plan."""
    counted = {}
    with pytest.MonkeyPatch.context() as mp:
        calls = [0]
        original = search_graph.write_spec

        def counting(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        mp.setattr(search_graph, "write_spec", counting)
        for n in (2, 4):
            calls[0] = 0
            plan = _plan(n)
            counted[n] = (calls[0], plan)
    return counted


def test_identical_layers_reuse_the_search_work(layouts_computed):
    (two, plan2), (four, plan4) = layouts_computed[2], layouts_computed[4]
    assert plan4.search.units > 1.7 * plan2.search.units  # twice the layers: about twice the decisions
    assert two > 0 and four <= 1.05 * two  # ... but no new layouts to derive: the new layers repeat the old



@pytest.mark.parametrize("search", ["recursive", "propagation"])
def test_identical_layers_share_their_records(search, monkeypatch):
    """The searched operators of identical layers share their records' fields, made once (`Plan.ops`
    at depth), and every record is the one made for its operator alone; the propagation engine's
    name the operator each took its layout from, so few are alike there."""
    made = []
    fields, alike = records._Records._fields, records._Records._alike
    monkeypatch.setattr(records._Records, "_fields", lambda self, i, *rest: made.append(i) or fields(self, i, *rest))
    shared = _plan(4, search=search).ops
    shared_made = len(made)
    monkeypatch.setattr(records._Records, "_alike", lambda self, i, node: (i, *alike(self, i, node)))
    alone = _plan(4, search=search).ops
    assert len(made) - shared_made == len(alone)  # keyed by position too: no record shares another's
    assert shared == alone
    assert shared_made < (len(shared) / 5 if search == "recursive" else len(shared))


def test_records_made_through_their_slots_are_the_constructor_s():
    """`build_ops` fills each record's slots directly (`_made`): every record equals, hashes as and
    is as frozen as the one `OpRecord`'s own constructor makes from its fields."""
    for record in _plan(2).ops:
        again = dataclasses.replace(record)  # through `OpRecord.__init__`
        assert again == record and hash(again) == hash(record) and repr(again) == repr(record)
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.index = 0  # type: ignore[misc]


@pytest.fixture(scope="module")
def replayed():
    """Per layer count (6, 12): the plan, the size of each replayed level (its classes) and the
    operators `assemble` priced (`_Priced`: one per distinct pricing); under `("checks", n)`, per
    boundary check its classes and the search's units; under `("decisions", n)`, the decisions
    `assemble` made and how many distinct `Decision` objects they are."""
    found = {}
    with pytest.MonkeyPatch.context() as mp:
        sizes, pricings, checks, assembled = [], [], [], []
        assemble = search_module.assemble
        original = ties_module.Ties.__init__
        priced = assemble_module._Priced.__init__
        checking = ties_module.Ties.checking.__func__

        def counting_checks(cls, search, runs):
            ties = checking(cls, search, runs)
            checks.append((len(ties.reps), len(search.g.units)))
            return ties

        def counting(ties, search, replay=True):
            original(ties, search, replay)
            if replay:
                sizes.append((len(ties.reps), ties.replayed, ties.runs))

        def kept(p, *args):
            priced(p, *args)
            pricings.append(p)

        mp.setattr(ties_module.Ties, "__init__", counting)
        mp.setattr(assemble_module._Priced, "__init__", kept)
        mp.setattr(ties_module.Ties, "checking", classmethod(counting_checks))
        mp.setattr(search_module, "assemble", lambda g, choice: assembled.append(assemble(g, choice)) or assembled[-1])
        for n in (6, 12):
            sizes.clear()
            pricings.clear()
            checks.clear()
            assembled.clear()
            plan = _plan(n)
            found[n] = (plan, list(sizes), [len(p._decided) for p in pricings])
            found[("checks", n)] = list(checks)
            decisions = assembled[-1].decisions
            found[("decisions", n)] = (len(decisions), len({id(d) for d in decisions.values()}))
    return found


def test_identical_layers_are_weighed_once(replayed):
    """The core heuristic weighs a class of identical units once, and the interior layers of the
    unrolled loop are one class each: the level's units, its distinct units and its runs stay flat
    while the decisions double (deterministic figures, not wall time)."""
    (plan6, sizes6, _), (plan12, sizes12, _) = replayed[6], replayed[12]
    assert plan12.search.units > 1.9 * plan6.search.units
    assert sizes6 == [(sizes6[0][0], sizes6[0][1], sizes6[0][2])] and sizes6[0][2] > 0  # one run of the search
    (level6, replayed6, runs6), (level12, replayed12, runs12) = sizes6[0], sizes12[0]
    assert level12 == level6 and runs12 == runs6  # the same units searched per level at twice the depth
    assert replayed12 > replayed6 > 0
    assert plan12.search.unit_classes == plan6.search.unit_classes > 0
    assert f"({plan12.search.unit_classes} unit classes, {plan12.search.evaluations} cost evaluations)" in plan12.search.line()


def test_identical_layers_are_priced_once_for_the_plan(replayed):
    """`assemble` prices an operator of identical layers (the same factors, arrays, assignment and
    layouts met) once: at twice the depth, twice the operators and the same pricings."""
    (plan6, _, priced6), (plan12, _, priced12) = replayed[6], replayed[12]
    assert len(plan12.ops) > 1.9 * len(plan6.ops)
    assert priced6 == priced12 and priced6[0] > 0


def test_identical_layers_share_one_decision(replayed):
    """`assemble` gives the operators of identical layers (the same pricing and rejected move) one
    `Decision`: at twice the depth, twice the decisions and as many distinct ones."""
    (made6, distinct6), (made12, distinct12) = replayed[("decisions", 6)], replayed[("decisions", 12)]
    assert made12 > 1.9 * made6
    assert distinct12 == distinct6 < made6 / 2


def test_planning_pauses_the_garbage_collector_and_restores_it():
    """`compile.build` pauses Python's cyclic garbage collector while it traces and plans (its passes
    would walk every equation and unit again), and leaves it as it was."""
    seen = []

    def step(x):
        seen.append(gc.isenabled())
        return x * 2.0

    assert gc.isenabled()
    js.parallelize(step, devices=8).plan(jax.ShapeDtypeStruct((8, 4), np.float32))
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        js.parallelize(step, devices=8).plan(jax.ShapeDtypeStruct((16, 4), np.float32))
        assert not gc.isenabled()  # paused by the caller: left paused
    finally:
        gc.enable()


def test_objects_made_while_paused_skip_the_young_generations_and_are_still_collected():
    """On leaving `collector_paused` what was made inside moves to the collector's oldest generation
    (the next young pass does not walk it), cycles among it are still freed by a full pass, and
    objects the caller froze stay frozen."""

    class Cycle:
        """An object that holds another: two of them make a cycle only a collector pass frees."""

    def made(n):
        with collector_paused():
            for _ in range(n):
                a, b = Cycle(), Cycle()
                a.b, b.a = b, a

    made(1000)
    assert gc.get_count()[0] < 1000 and gc.get_freeze_count() == 0
    assert gc.collect() >= 2000  # nothing kept for ever
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        made(10)
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_reading_the_plan_records_pauses_the_garbage_collector(monkeypatch):
    """`Plan.ops` (made on its first read: tens of thousands of records at depth) is made with the
    collector paused, and leaves it as it was."""
    seen = []
    build = program.build_ops
    monkeypatch.setattr(program, "build_ops", lambda *args: seen.append(gc.isenabled()) or build(*args))
    plan = js.parallelize(lambda x: x * 2.0, devices=8).plan(jax.ShapeDtypeStruct((8, 4), np.float32))
    assert seen == [] and gc.isenabled()  # not made until read
    assert plan.ops and seen == [False] and gc.isenabled()


def test_replaying_the_interior_layers_plans_what_the_full_search_plans(replayed):
    """The 12-layer plan with no replay (`Search(replay=False)`: every unit decided on its own at
    every level) is the replayed one: the same strategies, layouts and predicted cost."""
    full = _plan(12, search=js.Search(replay=False))
    plan = replayed[12][0]
    assert full.search.seconds == plan.search.seconds
    assert full.ops == plan.ops and full.in_specs == plan.in_specs and full.out_specs == plan.out_specs


def test_runs_are_found_as_periods_of_the_units_colours():
    """A run: a stretch where every unit's colour equals the one a period later, at least
    `2 * _WINDOW + 2` periods; what does not repeat (the ends) stays out."""
    colour = np.array([9, 8] + [1, 2, 3, 2] * 5 + [7, 1, 2])
    assert ties_module._runs(colour) == [(2, 4, 5)]
    assert ties_module._runs(np.array([9] + [1, 2, 3] * (2 * ties_module._WINDOW + 1) + [7])) == []


def test_weighing_a_class_once_picks_what_weighing_each_unit_picks(layouts_computed, monkeypatch):
    """The same plan with every core unit its own class (nothing shared between identical layers)."""
    original = level_module.Level._prepare_core
    fresh = itertools.count()  # ids no other core's unit or table holds (levels share their evaluations)

    def unshared(level, core):
        original(level, core)
        level._class = {k: next(fresh) for k in core}
        level._table_class = [next(fresh) for _ in level.tables]

    monkeypatch.setattr(level_module.Level, "_prepare_core", unshared)
    alone = _plan(2)
    shared = layouts_computed[2][1]
    assert alone.search.unit_classes > shared.search.unit_classes
    assert alone.ops == shared.ops and alone.in_specs == shared.in_specs and alone.out_specs == shared.out_specs


def test_the_boundary_check_reads_what_the_replayed_level_computed(monkeypatch):
    """The boundary check (every unit its own class) weighs the replayed level's units on the same
    base: it reads the tables that level computed (`Shared`, and the search's tables by layouts,
    `_Recursive.tables`) instead of pricing the edges again, and plans what levels that compute
    everything afresh plan (deterministic counts)."""
    priced = [0]
    edge_seconds = search_graph.SearchGraph.edge_seconds

    def counting(g, *args):
        priced[0] += 1
        return edge_seconds(g, *args)

    monkeypatch.setattr(search_graph.SearchGraph, "edge_seconds", counting)
    shared = _plan(6)
    shared_priced, priced[0] = priced[0], 0
    original = level_module.Level.__init__

    def afresh(level, search, group, base, lam, ties, like=None, barred=(frozenset(), 0.0)):
        search.tables, search.layout_lists = {}, {}  # no table made before is read
        search.shared.pop(group, None)  # nor what a level on the same axes computed before (an earlier run's)
        original(level, search, group, base, lam, ties, barred=barred)

    monkeypatch.setattr(level_module.Level, "__init__", afresh)
    fresh = _plan(6)
    assert 0 < shared_priced < priced[0]
    assert fresh.search.seconds == shared.search.seconds
    assert fresh.ops == shared.ops and fresh.in_specs == shared.in_specs and fresh.out_specs == shared.out_specs


def test_an_edge_table_is_made_once_per_value_and_layouts(monkeypatch):
    """An edge's table of redistribution seconds reads only the value and the two lists of layouts its
    ends give it, so units of other kinds, on other levels, that give the same lists read the one
    table (`_Recursive.tables`): fewer tables made than the levels ask for, and the plan of levels
    that make each table afresh (deterministic counts)."""
    asked, made = [0], [0]
    table, init = shared_module.Shared.table, level_module.Level.__init__

    def counting(shared, *args):
        asked[0] += 1
        before = len(shared._tables)
        found = table(shared, *args)
        made[0] += len(shared._tables) - before
        return found

    monkeypatch.setattr(shared_module.Shared, "table", counting)
    shared = _plan(4)
    assert 0 < made[0] < asked[0]

    def afresh(level, search, *args, **kwargs):
        search.tables, search.layout_lists = {}, {}  # no table made before is read
        init(level, search, *args, **kwargs)

    monkeypatch.setattr(level_module.Level, "__init__", afresh)
    fresh = _plan(4)
    assert fresh.search.seconds == shared.search.seconds and fresh.ops == shared.ops


def test_the_boundary_check_is_flat_in_depth(replayed):
    """The boundary check after replay weighs each unit on its own except the middle layers of the
    long runs, one class per position as in the replay: at twice the depth, twice the units and
    about the same classes (deterministic counts, not wall time)."""
    (checks6,), (checks12,) = replayed[("checks", 6)], replayed[("checks", 12)]
    (classes6, units6), (classes12, units12) = checks6, checks12
    assert units12 > 1.9 * units6
    assert classes6 < units6 and classes12 < 1.1 * classes6


def test_a_seed_is_read_by_where_the_level_gives_its_axis():
    """The boundary check seeds a unit with the choice of another of its kind (its class in the
    replay, or the layer beside the middle ones): a unit's candidates hold its own base, so the
    choice is read as the factor the level's axis went to, not as an index."""
    mine = [{0: ("a",)}, {0: ("a",), 1: ("b",)}, {0: ("a", "b")}]  # base {0: ("a",)}, axis "b": none, 1, 0
    theirs = [{}, {0: ("b",)}, {1: ("b",)}]  # base {}: none, 0, 1
    assert [recursive._seat(a, ("b",), mine) for a in theirs] == [0, 2, 1]
    assert recursive._seat({2: ("b",)}, ("b",), mine) == 0  # given where this unit cannot: none


def test_the_middle_layers_take_the_choice_beside_them():
    """`Ties.waved`: the middle layers' class of each position of a tied run takes the pick of the
    same position in the layer named (from the start, or from the end where negative); the rest
    stays."""
    ties = ties_module.Ties.__new__(ties_module.Ties)
    ties.tied, ties.window = [(1, 2, 6)], 2  # a run of 6 layers of 2 units from unit 1: layers 2, 3 tied
    ties.of = [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11]  # units 5, 7 one class, 6, 8 another
    picks = [10 * c for c in range(12)]
    moved = lambda source, middle: picks[source] + 1  # noqa: E731
    assert ties.waved(picks, 1, moved) == [0, 10, 20, 30, 40, 31, 41, 70, 80, 90, 100, 110]
    assert ties.waved(picks, -2, moved) == [0, 10, 20, 30, 40, 71, 81, 70, 80, 90, 100, 110]


@pytest.mark.parametrize("big", [False, True], ids=["mixed-radix", "ranks"])
def test_edges_are_grouped_by_one_key_per_row(big):
    """`_row_keys`: rows of non-negative ints keyed by one number each, equal where the rows are (read
    in mixed radix where that fits in 63 bits, else the rows' ranks)."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 3, (200, 5))
    if big:
        rows[:, 0] *= 1 << 40  # the radixes' product passes 2**63
        rows[:, 2] *= 1 << 40
    keys = ties_module._row_keys(rows)
    same_rows = (rows[:, None, :] == rows[None, :, :]).all(-1)
    assert (same_rows == (keys[:, None] == keys[None, :])).all()


def test_a_barred_level_reads_its_level_s_beliefs(monkeypatch):
    """A level barred from another's combined sets (`_Recursive._closed`) reads the min-sum arrays its
    level made (`Core._beliefs`), patched where its tolls reach, and plans what building them afresh
    plans."""
    beliefs = core_module.Core._beliefs
    read = [0]

    def counting(level, core):
        read[0] += level._replays is not None and level._replays.beliefs is not None
        return beliefs(level, core)

    monkeypatch.setattr(core_module.Core, "_beliefs", counting)
    shared = _plan(6)
    assert read[0] > 0

    def afresh(level, core):
        if level._replays is not None:
            level._replays.beliefs = None
        return beliefs(level, core)

    monkeypatch.setattr(core_module.Core, "_beliefs", afresh)
    fresh = _plan(6)
    assert fresh.search.seconds == shared.search.seconds
    assert fresh.ops == shared.ops and fresh.in_specs == shared.in_specs and fresh.out_specs == shared.out_specs
