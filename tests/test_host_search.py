"""The search knows the host: with a memory budget and no `offload=` given, `mode="auto"` weighs
keeping the optimizer state (then the parameters) in host memory, priced on the cost model's
host link, and the plan says so; the user's `offload=` wins. Numerics against one device."""

import jax
import numpy as np
import optax
import pytest
from _compiles import compiles
from _loop import run_steps
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models
from jshard._format import human_bytes
from jshard.cost import CostModel
from jshard.cost._devices import kind_of

WHOLE = 3600.0
"""`Search(time_limit=...)` for the tests of what the weighings weigh: the time limit bounds the whole of
planning, which on a loaded 2-core machine can pass before every candidate is weighed."""

HOST = "pinned_host"
STEPS = 3


@pytest.fixture(scope="module")
def gpt():
    """A small GPT with Adam on one device (nothing to cut: only the host can take state off it),
    its batches, the single-device run, and the search's estimated peaks with the state on the
    device and with the optimizer state in host memory."""
    cfg = models.GPTConfig(vocab=32, seq_len=8, d_model=32, n_heads=4, n_layers=2, d_ff=64, scan=True)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = models.init_gpt(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    batches = [models.copy_task_batch(rng, cfg, 8) for _ in range(STEPS)]
    state = optimizer.init(params)
    peak = {what: js.parallelize(step, devices=1, mode="auto", offload=what).plan(params, state, batches[0]).search.peak_bytes
            for what in [(), ("optimizer",)]}
    return step, params, state, batches, run_steps(jax.jit(step), params, state, batches), peak


def test_a_budget_only_host_state_meets_offloads_the_optimizer_and_equals_one_device(gpt):
    step, params, state, batches, (ref_params, ref_state, ref_losses), peak = gpt
    assert peak[("optimizer",)] < peak[()]  # the memory model: host state is off the device but while used
    budget = (peak[("optimizer",)] + peak[()]) / 2
    auto = js.parallelize(step, devices=1, mode="auto", search=js.Search(memory_budget=budget, time_limit=WHOLE))
    plan = auto.plan(params, state, batches[0])
    assert plan.offload.what == ("optimizer",)
    weighed = {w.policy: w for w in plan.search.offload}
    assert list(weighed) == ["none", "optimizer", "optimizer+parameters"]
    assert weighed["none"].seconds is None and weighed["optimizer"].chosen
    assert 0 < weighed["optimizer"].host_seconds < weighed["optimizer+parameters"].host_seconds
    assert plan.search.compiled_peak_bytes <= budget  # XLA's buffers, host-memory leaves taken out
    summary = " ".join(plan.summary().split())  # wrapped at 120 columns: read as one line
    assert "offload optimizer: " in summary and "offload weighed: none: no plan fits" in summary
    assert f"chosen by the search under memory_budget={human_bytes(budget)} per device: with the state on the " \
           f"device no plan fits" in summary
    dot = next(op for op in plan.ops if op.primitive == "dot_general")
    assert "planned with the optimizer state in host memory, streamed each step" in plan.explain(dot)

    compiled = auto.lower(params, state, batches[0]).compile()
    memory = js.audit(compiled).memory
    assert memory.peak_bytes == plan.search.compiled_peak_bytes  # the audit's device peak is the search's
    state_bytes = sum(np.size(x) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    assert memory.host_argument_bytes == memory.host_output_bytes == state_bytes  # one device: whole leaves
    ins = compiled.input_shardings[0]
    assert {sh.memory_kind for sh in jax.tree.leaves(ins[1])} == {HOST}  # every optimizer leaf
    assert {sh.memory_kind for sh in jax.tree.leaves((ins[0], ins[2]))} == {"device"}
    got_params, got_state, got_losses = run_steps(auto, params, state, batches)
    terms = STEPS * step_terms(params, batches[0])
    assert_close(got_losses, ref_losses, dtype=np.float32, terms=terms)
    assert_close((got_params, got_state), (ref_params, ref_state), terms=terms)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got_state)} == {HOST}


def test_a_budget_the_device_meets_offloads_nothing(gpt):
    step, params, state, batches, _, peak = gpt
    auto = js.parallelize(step, devices=1, mode="auto", cost_model=CostModel(memory=2 * peak[()], device="roomy"))
    plan = auto.plan(params, state, batches[0])
    assert plan.offload is None and plan.search.offload == ()  # the budget binds nothing: no streaming to pay
    assert plan.search.budget == 2 * peak[()] and "offload" not in plan.search.line()
    assert HOST not in {sh.memory_kind for sh in jax.tree.leaves(plan.in_shardings)}


def test_an_impossible_budget_names_offload_among_what_was_weighed(gpt):
    step, params, state, batches, _, _ = gpt
    auto = js.parallelize(step, devices=1, mode="auto", search=js.Search(memory_budget="64KiB"))
    with pytest.raises(js.MemoryBudgetError, match=(
            r"jshard.parallelize\(train_step\): memory_budget=64 KiB per device cannot be met on 1 devices "
            r"\(search='recursive'\): .* Offload weighed too \(the state kept in host memory between steps, streamed "
            r"over the host link\): optimizer: no plan fits \(least peak .*\); optimizer\+parameters: no plan fits "
            r"\(least peak .*\); none fits\.")) as e:
        auto.plan(params, state, batches[0])
    assert e.value.least_bytes > 64 * 2**10


def test_the_users_offload_wins(gpt):
    step, params, state, batches, _, peak = gpt
    budget = (peak[("optimizer",)] + peak[()]) / 2
    kept = js.parallelize(step, devices=1, mode="auto", search=js.Search(memory_budget=budget), offload=())
    with pytest.raises(js.MemoryBudgetError, match=r"cannot be met on 1 devices") as e:
        kept.plan(params, state, batches[0])
    assert "Offload weighed" not in str(e.value)
    both = js.parallelize(step, devices=1, mode="auto", offload=("optimizer", "parameters"),
                          cost_model=CostModel(memory=budget, device="small"))
    plan = both.plan(params, state, batches[0])
    assert plan.offload.what == ("optimizer", "parameters") and plan.search.offload == ()
    assert plan.offload.why == ""


def test_host_bandwidth_per_device_kind():
    assert CostModel.for_device("H100").host_bandwidth == 64e9  # PCIe Gen5 x16, one way
    assert CostModel.for_device("A100").host_bandwidth == 32e9  # PCIe Gen4 x16
    assert CostModel.for_device("GH200").host_bandwidth == 450e9  # NVLink-C2C
    assert kind_of("NVIDIA GH200 480GB")[0] == "GH200" and kind_of("NVIDIA H200")[0] == "H200"
    assert CostModel(host_bandwidth=1e9).host_seconds(3e9, 1e9) == 3.0  # full duplex: the larger way


def test_a_plan_the_search_offloaded_loads_with_its_state_in_host_memory(gpt, tmp_path):
    """The offload the search chose is in the plan file (`Plan.choices`): the loaded plan's program
    keeps the same leaves in host memory, where without it the device would hold them all."""
    step, params, state, batches, _, peak = gpt
    budget = (peak[("optimizer",)] + peak[()]) / 2
    plan = js.parallelize(step, devices=1, mode="auto", search=js.Search(memory_budget=budget, time_limit=WHOLE)).plan(
        params, state, batches[0])
    assert plan.choices == (("offload", ("optimizer",)),)
    plan.save(tmp_path / "plan.json")
    loaded = js.Plan.load(tmp_path / "plan.json")
    assert loaded.choices == plan.choices
    again = js.parallelize(step, devices=1, plan=loaded)
    assert again.plan(params, state, batches[0]).offload.host == plan.offload.host
    with pytest.raises(js.ShardingError, match="made with .'optimizer',. in host memory"):
        js.parallelize(step, devices=1, plan=loaded, offload=("optimizer", "parameters")).plan(params, state, batches[0])


def test_placements_that_cannot_beat_the_device_plan_are_not_planned(gpt):
    """Where the budget binds but no plan with the state in host memory can beat the plan on the
    device (the step's work split evenly over every device plus the least streaming, over the host
    link, is not below its seconds), no placement is searched; the plan says which and why, and
    the device plan's compiled program is held to the budget as ever, and is what the first call
    runs (its compile is the call's, not one more)."""
    step, params, state, batches, (_, _, ref_losses), _ = gpt
    slow = CostModel(host_bandwidth=1e3)  # streaming costs more than any step
    free = js.parallelize(step, devices=8, mode="auto", cost_model=slow).plan(params, state, batches[0]).search
    budget = 0.8 * free.peak_bytes
    auto = js.parallelize(step, devices=8, mode="auto", cost_model=slow, search=js.Search(memory_budget=budget,
                                                                                           time_limit=WHOLE))
    plan = auto.plan(params, state, batches[0])
    assert plan.search.status != "fits" and plan.offload is None  # the budget binds; the state stays
    assert plan.search.searches == 1 and plan.search.offload == ()
    assert plan.search.compiled_peak_bytes <= budget
    (line,) = plan.search.skipped
    assert line.startswith("offload not weighed, no plan with it can beat the plan on the device (")
    assert "optimizer (at least " in line and "optimizer+parameters (at least " in line
    assert "the work split over 8 devices" in line and line in plan.search.line()
    jax.clear_caches()  # the executable is the program's own, not JAX's cache's
    args = jax.device_put((params, state, batches[0]), plan.in_shardings)  # placed outside the count
    with compiles() as called:
        loss = auto(*args)[2]
    assert len(called) == 0
    assert_close(loss, ref_losses[0], dtype=np.float32, terms=step_terms(params, batches[0]))


def test_each_placement_weighed_reuses_the_device_searchs_unweighted_run(gpt, monkeypatch):
    """The searches of the placements a budget weighs differ in their memory model only, so the
    recursive search's run at memory weight 0 (which weighs no byte) is made once per planning and
    reused by each placement's search (`_recursive.solve`'s `unweighed`): fewer runs, one fewer per
    search after the first, and the same plan and the same placements weighed as when each search
    makes its own."""
    from jshard.search import _recursive, _search

    step, params, state, batches, _, _ = gpt
    free = js.parallelize(step, devices=8, mode="auto").plan(params, state, batches[0]).search
    runs = []
    made = _recursive._Recursive.run
    monkeypatch.setattr(_recursive._Recursive, "run", lambda self, lam: runs.append(lam) or made(self, lam))

    def planned():
        runs.clear()
        search = js.Search(memory_budget=0.8 * free.peak_bytes, time_limit=WHOLE)
        report = js.parallelize(step, devices=8, mode="auto", search=search).plan(params, state, batches[0]).search
        return report, len(runs), runs.count(0.0)

    reused, reused_runs, reused_first = planned()
    monkeypatch.setattr(_search, "_unweighed", lambda *_: None)
    alone, alone_runs, alone_first = planned()
    assert alone.searches > 1 and len(alone.offload) > 1, alone.line()  # placements were searched
    assert alone_first == alone.searches and reused_first == 1
    assert reused_runs == alone_runs - (alone.searches - 1)
    assert (reused.seconds, reused.peak_bytes, reused.status) == (alone.seconds, alone.peak_bytes, alone.status)
    assert reused.offload == alone.offload
