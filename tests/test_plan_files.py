"""plan.json (`Plan.save` / `Plan.load`): an exact round trip, the earlier format still read, and every
bad file (cut short, not JSON, another format, hand-edited) a `ShardingError` naming the file and
what is wrong, with nothing in it executed."""

import json
import os
import pathlib
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard as js
from jshard.plan import Later, _io

V1 = pathlib.Path(__file__).with_name("data") / "plan_v1_ffn.json"


def _ffn(x, w1, w2):  # tests/data/plan_v1_ffn.json was saved (format 1) from this function's gradient
    h = js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w1)
    return jnp.tanh(h) @ w2


_grad = jax.grad(lambda x, w1, w2: _ffn(x, w1, w2).sum(), argnums=(1, 2))
ARGS = tuple(np.random.default_rng(k).standard_normal(s).astype(np.float32)
             for k, s in enumerate([(8, 16), (16, 32), (32, 8)]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    plan = js.parallelize(_grad, devices=8).plan(*ARGS)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return plan, path, path.read_text()


def test_round_trip_is_exact(saved):
    plan, path, _ = saved
    loaded = js.Plan.load(path)
    assert loaded.ops == plan.ops
    assert (loaded.in_specs, loaded.out_specs) == (plan.in_specs, plan.out_specs)
    assert (loaded.fine.sizes, loaded.fine.names, loaded.mode, loaded.propagation) == (
        plan.fine.sizes, plan.fine.names, plan.mode, plan.propagation)


def test_the_operator_records_are_made_on_their_first_read(saved):
    plan = js.parallelize(_grad, devices=8).plan(*ARGS)
    assert isinstance(plan.__dict__["ops"], Later)  # planning alone made none
    again = plan.replace(work=None)
    assert isinstance(again.__dict__["ops"], Later)
    assert again.ops == plan.ops == saved[0].ops  # the same records as a plan that made them at once
    assert plan.__dict__["ops"] is plan.ops  # made once, then kept


def test_the_file_is_one_operator_per_line_with_sources_once(saved):
    plan, _, text = saved
    data = json.loads(text)
    assert data["format"] == "jshard.plan/2"
    assert len(data["sources"]) == len({op.source for op in plan.ops})
    for op, line in zip(plan.ops, text.split('"ops": [\n')[1].splitlines()):
        assert json.loads(line.strip().rstrip(",")) == data["ops"][op.index]
    propagated = next(d for d in data["ops"] if d["origin"] == "propagated")
    assert "in_strategy" not in propagated and "layout" in propagated  # the strategy follows from the layout


def test_format_1_files_still_load_and_rebuild_the_program():
    """The file's operators load as it wrote them (its layouts, strategies and priced collectives, not a
    fresh plan's: the engine's pricing has changed since), and the program rebuilt from them equals jit."""
    loaded = js.Plan.load(V1)
    written = json.loads(V1.read_text())["ops"]
    assert len(loaded.ops) == len(written) == len(js.parallelize(_grad, devices=8).plan(*ARGS).ops)
    for op, line in zip(loaded.ops, written):
        assert (op.index, op.primitive, op.origin, op.source) == (line["index"], line["primitive"], line["origin"],
                                                                  line["source"])
        assert op.in_strategy == _tuples(line["in_strategy"]) and op.out_strategy == _tuples(line["out_strategy"])
        assert op.layout.in_specs == _tuples(line["layout"]["in"]) and op.layout.out_specs == _tuples(line["layout"]["out"])
        assert [(c.kind, c.bytes, c.axes) for c in op.comms] == [(k, b, tuple(a)) for k, b, a in line["comms"]]
    rebuilt = js.parallelize(_grad, devices=8, plan=loaded)
    for got, want in zip(rebuilt(*ARGS), jax.jit(_grad)(*ARGS)):
        tolerance = 64 * np.finfo(np.float32).eps * float(np.max(np.abs(want)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tolerance)


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def test_a_failed_save_keeps_the_previous_file(saved, tmp_path, monkeypatch):
    plan, _, text = saved
    path = tmp_path / "plan.json"
    path.write_text(text)

    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(_io.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        plan.save(path)
    assert path.read_text() == text and os.listdir(tmp_path) == ["plan.json"]


def _edited(text, edit):
    data = json.loads(text)
    edit(data)
    return json.dumps(data)


def _set(path, value):
    def edit(data):
        *keys, last = path
        for k in keys:
            data = data[k]
        if value is KeyError:
            del data[last]
        else:
            data[last] = value

    return edit


BAD = {
    "cut short": (lambda t: t[: len(t) // 2],
                  r"valid JSON: .* \(line \d+, column \d+\); it ends before its closing brace \(cut short"),
    "empty": (lambda t: "", r"valid JSON: Expecting value \(line 1, column 1\); it ends before its closing"),
    "not an object": (lambda t: "[1, 2]", r'a jshard plan file: format: the file holds a list \[1, 2\] with no '
                                          r'"format" key'),
    "another format": (lambda t: '{"format": "other"}', r"a jshard plan file: format 'other', expected one of "
                                                        r"\('jshard.plan/1', 'jshard.plan/2'\)\."),
    "a newer format": (lambda t: _edited(t, _set(["format"], "jshard.plan/9")),
                       r"format 'jshard.plan/9', .* \(written by a newer jshard: upgrade jshard to read it\)"),
    "a missing key": (lambda t: _edited(t, _set(["ops", 1, "in_shapes"], KeyError)),
                      r"1 problem\(s\):\n  ops\[1\]: missing key 'in_shapes'\nWas it edited by hand\?"),
    "a wrong type": (lambda t: _edited(t, _set(["mesh", "sizes", 0], "2")),
                     r"mesh.sizes\[0\]: expected an integer, got a string \"2\""),
    "an unknown key": (lambda t: _edited(t, _set(["ops", 0, "strategy"], [[2, 1]])), r"ops\[0\]: unknown key 'strategy'"),
    "an unknown axis": (lambda t: _edited(t, _set(["ops", 1, "layout", "in", 0], [["d0"], ["d9"]])),
                        r"axis name\(s\) \['d9'\] used, but the mesh has only \['d0', 'd1', 'd2'\]"),
    "a wrong rank": (lambda t: _edited(t, _set(["ops", 1, "layout", "out", 0], [["d0"]])),
                     r"ops\[1\] \(\w+\)\.layout\.out\[0\]: 1 dim\(s\) for f32\[\d+,\d+\]"),
    "an axis used twice": (lambda t: _edited(t, _set(["ops", 1, "layout", "out", 0], [["d0"], ["d0"]])),
                           r"layout\.out\[0\]: an axis cuts two dims, or one dim twice"),
    "an unknown origin": (lambda t: _edited(t, _set(["ops", 2, "origin"], "guessed")),
                          r"ops\[2\] \(\w+\)\.origin: 'guessed' is not one of \('user', 'model', 'propagated'"),
    "a source out of range": (lambda t: _edited(t, _set(["ops", 2, "source"], 99)),
                              r"\.source: 99 is not a position in sources"),
}


@pytest.mark.parametrize("damage", BAD, ids=list(BAD))
def test_a_bad_file_names_itself_and_what_is_wrong(saved, tmp_path, damage):
    _, _, text = saved
    change, message = BAD[damage]
    path = tmp_path / "plan.json"
    path.write_text(change(text))
    names_the_file = re.escape(f"jshard.Plan.load({str(path)!r}): {path} is not ")
    with pytest.raises(js.ShardingError, match=names_the_file + "(?s:.*)" + message):
        js.Plan.load(path)


def test_every_problem_of_an_edited_file_is_listed_at_once(saved, tmp_path):
    _, _, text = saved
    data = json.loads(text)
    for k in range(15):
        data["ops"][k]["primitive"] = k
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(js.ShardingError, match=r"15 problem\(s\):\n(  ops\[\d+\]\.primitive: .*\n){12}  \.\.\. and 3 more"):
        js.Plan.load(path)


class _Payload:
    def __reduce__(self):
        return (os.mkdir, (str(_Payload.target),))


def test_nothing_in_a_file_is_executed(tmp_path):
    _Payload.target = tmp_path / "executed"
    path = tmp_path / "plan.json"
    path.write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(js.ShardingError, match=r"is not a text file \(byte 0 is not UTF-8\)"):
        js.Plan.load(path)
    assert not _Payload.target.exists()


def test_a_plan_on_named_layout_axes_rebuilds_without_its_strategies(tmp_path):
    """A plan whose mesh the user's Layouts named (dp, mp_0, mp_1) is rebuilt on that mesh, names
    and all, from the file alone (no in_strategy given again)."""
    lay = js.Layout((2, 4), ("dp", "mp"))
    x, w1, w2 = ARGS
    made = js.parallelize(_grad, devices=8, in_strategy=(lay("dp", "None"), lay("None", "mp"), None)).plan(x, w1, w2)
    assert set(made.fine.names) == {"dp", "mp_0", "mp_1"}
    made.save(tmp_path / "plan.json")
    rebuilt = js.parallelize(_grad, devices=8, plan=js.Plan.load(tmp_path / "plan.json"))
    assert rebuilt.plan(x, w1, w2).fine.names == made.fine.names
    for got, want in zip(rebuilt(x, w1, w2), jax.jit(_grad)(x, w1, w2)):
        tolerance = 64 * np.finfo(np.float32).eps * float(np.max(np.abs(want)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tolerance)


def test_a_file_edited_within_its_schema_warns_or_with_strict_is_refused(saved, tmp_path):
    """Inputs' layouts changed by hand, still a valid plan: Plan.load warns (the program follows the file,
    so the values stay right), strict=True refuses; a file as saved loads without a word."""
    plan, path, text = saved
    assert js.Plan.load(path, strict=True).ops == plan.ops
    assert json.loads(text)["digest"].startswith("sha256:")
    edited = tmp_path / "plan.json"
    edited.write_text(_edited(text, _set(["inputs", 0], None)))
    names = re.escape(f"jshard.Plan.load({str(edited)!r}): {edited} was edited since Plan.save wrote it")
    with pytest.warns(js.PlanEditedWarning, match=names + ".*pass strict=True to refuse such files"):
        loaded = js.Plan.load(edited)
    assert loaded.in_specs[0] is None
    with pytest.raises(js.ShardingError, match=names + ".*or load it with strict=False"):
        js.Plan.load(edited, strict=True)
    with pytest.raises(js.ShardingError, match=r"holds no digest \(it was written before jshard kept them"):
        js.Plan.load(V1, strict=True)


@pytest.mark.parametrize("content, message", [
    (None, r"cannot be read: No such file or directory\. Give the path of a file Plan\.save wrote"),
    ("[" * 100_000 + "]" * 100_000, r"is nested deeper than any plan is"),
], ids=["missing", "nested"])
def test_a_missing_or_deeply_nested_file_is_a_sharding_error(tmp_path, content, message):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(js.ShardingError, match=re.escape(f"jshard.Plan.load({str(path)!r}): {path} ") + message):
        js.Plan.load(path)
