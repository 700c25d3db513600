"""CPU tests of ``cgraw.trees.manager.TreeManager`` (graph trees) on a fake backend over ``allocator.Pool``.

The fake (tests/helpers/fake_tree_backend.py) simulates device memory, so a replay that writes
over a live output is caught when that output is read, and each replay recomputes its result
from the current inputs, so results are compared with eager runs of the same functions.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import Counter

import hypothesis.strategies as st
import numpy as np
import pytest
from fake_tree_backend import (
    EAGER_BASE,
    FakeFn,
    FakeT,
    FakeTreeBackend,
    Overwritten,
    assign,
    new,
    release,
    spy_inspect,
)
from hypothesis import HealthCheck, given, settings

import cgraw.trees.manager
from allocator import check_invariants
from cgraw.errors import CgrawError
from cgraw.trees.manager import NodeState, TreeManager
from cgraw.trees.config import config

MiB = 1 << 20


# ---------------------------------------------------------------------- fixtures and helpers


class Tree:
    """A manager on a fresh fake backend, and helpers to build functions and check results."""

    def __init__(self, **pool_kwargs):
        self.be = FakeTreeBackend(**pool_kwargs)
        self.pool = self.be.pool
        self.mgr = TreeManager(self.be)

    def fn(self, f, **kw) -> FakeFn:
        return FakeFn(f, self.mgr, **kw)

    def tensor(self, values) -> FakeT:
        return self.be.tensor(values)

    def eager(self, f: FakeFn, *args, **kwargs):
        """What ``f`` returns run eagerly, as arrays (the reference for graphed results)."""
        assert self.be.mode == "eager"
        return values(f.fn(*args, **kwargs))

    def node(self, *names: str):
        """The node reached by following ``names`` from the roots (unique at each level)."""
        level = list(self.mgr.roots.values())
        node = None
        for name in names:
            found = [n for n in level if n.fn.name == name]
            assert len(found) == 1, f"{len(found)} nodes named {name!r} at {names}"
            node = found[0]
            level = list(node.children.values())
        return node

    def recorded_paths(self) -> set:
        return {tuple(n.fn.name for n in node.path()) for node in self.mgr.nodes()
                if node.state is NodeState.RECORDED}

    def all_paths(self) -> list:
        return sorted(tuple(n.fn.name for n in node.path()) for node in self.mgr.nodes())


def values(out):
    if isinstance(out, FakeT):
        return out.value
    if isinstance(out, (tuple, list)):
        return type(out)(values(x) for x in out)
    if isinstance(out, dict):
        return {k: values(v) for k, v in out.items()}
    return out


def assert_same(out, ref) -> None:
    got = values(out)
    if isinstance(ref, np.ndarray):
        assert isinstance(got, np.ndarray) and got.shape == ref.shape
        assert np.array_equal(got, ref), "graphed result differs from the eager one"
    elif isinstance(ref, (tuple, list)):
        assert type(got) is type(ref) and len(got) == len(ref)
        for g, r in zip(got, ref, strict=True):
            assert_same(g, r)
    else:
        assert got == ref


def in_pool(t: FakeT) -> bool:
    return t.ptr < EAGER_BASE


@pytest.fixture(autouse=True)
def _spy(monkeypatch):
    """Calls are classified by the real ``cgraw.trees.calls.inspect``, logged by the fake backend."""
    monkeypatch.setattr(cgraw.trees.manager, "inspect", spy_inspect)


@pytest.fixture(autouse=True)
def _restore_config(saved_config):
    """cgraw.config put back after each test (tests/conftest.py)."""


@pytest.fixture
def tree():
    t = Tree()
    yield t
    check_invariants(t.pool)


@pytest.fixture
def rng():
    return np.random.default_rng()


def rand(rng, n: int) -> np.ndarray:
    """Random values, never zero, of both signs."""
    return rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n)


# ---------------------------------------------------------------------- test functions


def affine(x):
    return new(x.value * 1.5 + 0.25)


def double(x):
    return new(x.value * 2.0 - 1.0)


def square(x):
    return new(x.value * x.value + 0.5)


def with_weight(w, x):
    return new(x.value * w.value + 1.0)


def pair(x):
    tmp = new(x.value + 3.0)
    out = (new(tmp.value * 0.5), new(x.value - tmp.value))
    release(tmp)
    return out


# ---------------------------------------------------------------------- 1. lifecycle


def test_lifecycle_warmup_then_record_then_replay(tree, rng):
    f = tree.fn(affine)
    st_ = None
    ptrs = []
    for i in range(6):
        x = tree.tensor(rand(rng, 1000))
        ref = tree.eager(f, x)
        out = f(x)
        assert_same(out, ref)
        st_ = tree.mgr.stats[f.fn_id]
        node = tree.node("affine")
        if i == 0:
            assert (st_.warmups, st_.recordings, st_.replays) == (1, 0, 0)
            assert node.state is NodeState.WARMED and not in_pool(out)
            assert tree.be.count("warmup") == 1 and tree.be.count("record") == 0
        elif i == 1:
            # recorded, then replayed once for this call's result (a capture computes nothing)
            assert (st_.warmups, st_.recordings, st_.replays) == (1, 1, 0)
            assert node.state is NodeState.RECORDED and in_pool(out)
            assert tree.be.count("record") == 1 and tree.be.count("replay") == 1
            assert tree.pool.block_at(out.ptr) is not None
        else:
            assert (st_.warmups, st_.recordings, st_.replays) == (1, 1, i - 1)
            assert tree.be.count("replay") == i
        if i >= 1:
            ptrs.append(out.ptr)
    assert len(set(ptrs)) == 1, "every replay hands out the same recorded memory"
    assert tree.be.count("warmup") == 1 and tree.be.count("record") == 1
    assert st_.capture_ms == 0.5 and st_.instantiate_ms == 0.25
    assert st_.eager_calls == 0 and st_.variants == 1 and st_.rerecords == 0
    assert tree.mgr.generation == 5  # each call of a root function begins a new generation


def test_structured_outputs_replay_correctly(tree, rng):
    f = tree.fn(pair)
    for _ in range(4):
        x = tree.tensor(rand(rng, 300))
        ref = tree.eager(f, x)
        out = f(x)
        assert isinstance(out, tuple) and len(out) == 2
        assert_same(out, ref)
    assert tree.node("pair").state is NodeState.RECORDED
    assert set(tree.be.output_ptrs(tree.node("pair").recording)) == {t.ptr for t in out}
    assert out[0].ptr != out[1].ptr


def test_mutated_eager_input_is_copied_back_on_replay(tree, rng):
    def bump(x):
        assign(x, x.value + 1.0)
        return new(x.value * 2.0)

    f = tree.fn(bump)
    for i in range(4):
        v = rand(rng, 200)
        x = tree.tensor(v)
        out = f(x)
        assert np.array_equal(x.value, v + 1.0), f"call {i}: the input was not updated in place"
        assert np.array_equal(out.value, (v + 1.0) * 2.0)
    rec = tree.node("bump").recording
    assert rec.mutated == (0,) and tree.node("bump").mutated == (0,)


# ---------------------------------------------------------------------- 2. the seed example

N = 3 * MiB // 16  # 1.5 MiB of float64: every output gets its own segment


def seed_functions(tree):
    def g1(x):
        tmp = new(x.value * 2.0)
        out = new(tmp.value - x.value * 0.5 + 1.0)
        release(tmp)
        return out

    def g2(y):
        v = y.value
        return new(np.concatenate([v * 1.25, v + 3.0]))

    def g3(y):
        v = y.value
        return new(np.concatenate([np.sqrt(np.abs(v)), v * v]))

    def g4(z):
        v = z.value
        return new(v[:N] * 0.5 - v[N:])

    return [tree.fn(g) for g in (g1, g2, g3, g4)]


def seed_step(tree, fns, branch: int, x):
    """One step of the seed model: g1, then g2 or g3 (a host-side branch), then g4."""
    g1, g2, g3, g4 = fns
    mid = g2 if branch == 2 else g3
    ref = tree.eager(g4, tree.tensor(tree.eager(mid, tree.tensor(tree.eager(g1, x)))))
    y = g1(x)
    assert_same(y, tree.eager(g1, x))
    z = mid(y)
    w = g4(z)
    assert_same(w, ref)
    assert_same(y, tree.eager(g1, x))  # g1's output is still intact at the end of the step
    return w


def walk_seed(branches, rng, fns=None, tree=None):
    tree = tree or Tree()
    fns = fns or seed_functions(tree)
    for b in branches:
        seed_step(tree, fns, b, tree.tensor(rand(rng, N)))
    return tree, fns


def test_seed_example_shape_results_and_memory(rng):
    branches = [2] * 7 + [3] * 7
    rng.shuffle(branches)
    branches = [2, 3] + list(branches)  # both branches early, then a random order
    tree, fns = walk_seed(branches, rng)
    records = tree.be.count("record")
    walk_seed([2, 3, 3, 2], rng, fns, tree)
    assert tree.be.count("record") == records, "once every path is recorded, steps only replay"
    # exactly 1->2->4 and 1->3->4, every node recorded
    assert tree.all_paths() == sorted([("g1",), ("g1", "g2"), ("g1", "g2", "g4"), ("g1", "g3"), ("g1", "g3", "g4")])
    assert tree.recorded_paths() == set(tree.all_paths())
    assert [r.fn.name for r in tree.mgr.roots.values()] == ["g1"]
    assert sorted(c.fn.name for c in tree.node("g1").children.values()) == ["g2", "g3"]
    for mid in ("g2", "g3"):
        assert [k.fn.name for k in tree.node("g1", mid).children.values()] == ["g4"]
    assert tree.node("g1", "g2", "g4") is not tree.node("g1", "g3", "g4")
    check_invariants(tree.pool)

    # memory: both paths share g1's checkpoint, so they cost max(path 2, path 3), not the sum
    both = tree.be.source.reserved_bytes
    only2 = walk_seed([2] * 8, rng)[0].be.source.reserved_bytes
    only3 = walk_seed([3] * 8, rng)[0].be.source.reserved_bytes
    assert both == max(only2, only3)
    assert both < only2 + only3 - 2 * MiB  # well below two paths side by side
    assert tree.be.max_source_reserved == both


def test_seed_new_branch_after_replay_restores_once_to_g1(rng):
    tree, fns = walk_seed([2] * 5, rng)
    assert tree.recorded_paths() == {("g1",), ("g1", "g2"), ("g1", "g2", "g4")}
    restores = len(tree.be.restores)
    rec_g1 = tree.node("g1").recording
    off_before = {id(n.recording) for n in tree.mgr.nodes()
                  if n.recording is not None and n.fn.name != "g1"}
    walk_seed([3] * 5, rng, fns, tree)
    added = tree.be.restores[restores:]
    assert len(added) == 1, f"{len(added)} restores for the new branch"
    snap, on_path, off_path = added[0]
    g1 = tree.node("g1")
    assert snap is g1.checkpoint
    assert on_path == [rec_g1]
    assert {id(r) for r in off_path} == off_before
    # alternating now only replays: no restore, no record
    records = tree.be.count("record")
    walk_seed([2, 3, 2, 3, 3, 2], rng, fns, tree)
    assert len(tree.be.restores) == restores + 1 and tree.be.count("record") == records
    check_invariants(tree.pool)


def test_consumer_of_graphed_output_records_on_second_call(tree, rng):
    # its first call gets a warm-up output (eager), the second a tree output: same node all along
    a, b = tree.fn(affine), tree.fn(double)
    for _ in range(2):
        x = tree.tensor(rand(rng, 100))
        assert_same(b(a(x)), tree.eager(b, tree.tensor(tree.eager(a, x))))
    st_b = tree.mgr.stats[b.fn_id]
    assert (st_b.warmups, st_b.recordings, st_b.variants, st_b.rerecords) == (1, 1, 1, 0)
    assert tree.all_paths() == [("affine",), ("affine", "double")]


def test_input_kind_change_rerecords(tree, rng):
    a, b = tree.fn(affine), tree.fn(double)
    for _ in range(3):
        x = tree.tensor(rand(rng, 100))
        b(a(x))
    x = tree.tensor(rand(rng, 100))
    ya = a(x)
    copy = tree.tensor(ya.value)  # the same signature, but an eager input where a tree output was
    assert_same(b(copy), tree.eager(b, copy))
    st_b = tree.mgr.stats[b.fn_id]
    assert st_b.rerecords == 1 and st_b.rerecord_reasons[0].startswith("input kinds changed")
    assert tree.all_paths() == [("affine",), ("affine", "double")]


# ---------------------------------------------------------------------- 3. generations


def test_mark_step_begin_ends_generation_with_everything_handed_out(tree, rng):
    a, b = tree.fn(affine), tree.fn(double)
    for gen in range(4):
        x = tree.tensor(rand(rng, 64))
        ya = a(x)
        yb = b(ya)
        ref_b = tree.eager(b, tree.tensor(tree.eager(a, x)))
        assert_same(yb, ref_b)
        if gen == 3:
            config.generation_cloning = "user_visible"
        told = len(tree.be.generations)
        tree.mgr.mark_step_begin()
        assert tree.mgr.generation == gen + 1
        if gen == 0:
            # warm-ups: their outputs are the caller's ordinary memory, never handed out, never
            # poisoned, and they keep their values past the generation: the backend has nothing to do
            assert len(tree.be.generations) == told
            assert not in_pool(ya) and not in_pool(yb)
            assert_same(yb, ref_b)
            continue
        assert len(tree.be.generations) == told + 1
        handed, cloning = tree.be.generations[-1]
        assert cloning == (None if gen < 3 else "user_visible")
        assert [name for name, _ in handed] == ["affine", "double"]
        assert handed[0][1] is ya and handed[1][1] is yb
        if gen < 3:  # the backend poisons what was handed out
            with pytest.raises(Overwritten, match="'double'"):
                _ = yb.value
        else:  # or, with generation_cloning, hands the user a private copy
            assert_same(yb, ref_b)
            assert not in_pool(yb)
        assert tree.mgr.current is None and tree.mgr.tree_outputs == {} and tree.mgr.outs.handed == []
        assert tree.mgr.generation == gen + 1
    told = len(tree.be.generations)
    tree.mgr.mark_step_begin()  # an empty generation still ends, without asking the backend
    assert tree.mgr.generation == 5 and len(tree.be.generations) == told


def test_inference_rule_root_call_starts_new_generation(tree, rng):
    f = tree.fn(affine)
    x = tree.tensor(rand(rng, 128))
    y1 = f(x)
    assert tree.be.generations == []
    y2 = f(x)  # my_model: y1 = f(x); y2 = f(x)
    # y1 is the warm-up's output, the caller's memory, never poisoned: the backend has nothing to do
    assert tree.be.generations == [] and tree.mgr.generation == 1
    assert y1.poisoned is None and y2.poisoned is None
    assert_same(y1, tree.eager(f, x))
    y3 = f(x)
    assert len(tree.be.generations) == 1 and tree.mgr.generation == 2
    handed, _ = tree.be.generations[0]
    assert len(handed) == 1 and handed[0][0] == "affine" and handed[0][1] is y2
    assert y2.poisoned == "affine" and y3.poisoned is None
    assert_same(y3, tree.eager(f, x))
    assert f.fn_id in tree.mgr.root_fns
    assert tree.all_paths() == [("affine",)]


def test_a_root_function_in_a_loop_ends_each_generation_steadily_with_its_output_dropped_or_held(tree, rng):
    """``f(x)`` then ``y = f(x)`` in a loop: every call begins a generation. With the last output
    dropped the backend is never asked to poison anything; with it held, each call hands the
    backend exactly that output, which is poisoned; the pool and the tree's bookkeeping stay put."""
    f = tree.fn(affine)
    x = tree.tensor(rand(rng, 64))
    ref = values(affine(x))
    for _ in range(3):  # warm-up, recording, first replay
        f(x)
    reserved, stats = tree.be.source.reserved_bytes, tree.pool.stats()
    told, gen = len(tree.be.generations), tree.mgr.generation
    for _ in range(500):  # dropped: each call's output dies before the next call
        assert_same(f(x), ref)
    assert tree.mgr.generation == gen + 500 and len(tree.be.generations) == told
    assert len(tree.mgr.outs.handed) == 1 and len(tree.mgr.tree_outputs) == 1 and tree.mgr.book.tickets == []
    y = f(x)
    for i in range(500):  # held: the last output is alive when the next call begins
        last, y = y, f(x)
        handed, cloning = tree.be.generations[-1]
        assert [t for _, t in handed] == [last] and cloning is None
        assert last.poisoned == "affine" and y.poisoned is None
        assert_same(y, ref)
    assert len(tree.be.generations) == told + 500 and tree.mgr.generation == gen + 1001
    assert tree.be.source.reserved_bytes == reserved and tree.pool.stats() == stats
    assert tree.be.count("record") == 1 and tree.mgr.stats[f.fn_id].replays == 1 + 1001
    check_invariants(tree.pool)


def test_non_root_function_called_twice_becomes_child(tree, rng):
    a, g = tree.fn(affine), tree.fn(square)
    for _ in range(5):
        x = tree.tensor(rand(rng, 32))
        y = a(x)
        z1 = g(y)
        z2 = g(z1)
        r1 = tree.eager(g, tree.tensor(tree.eager(a, x)))
        assert_same(z1, r1)
        assert_same(z2, tree.eager(g, tree.tensor(r1)))
        assert tree.mgr.current.fn is g and tree.mgr.current.parent.fn is g
        tree.mgr.mark_step_begin()
    # no inferred generation; the first one's outputs were warm-ups', never handed out
    assert tree.mgr.generation == 5 and len(tree.be.generations) == 4
    assert g.fn_id not in tree.mgr.root_fns and a.fn_id in tree.mgr.root_fns
    assert ("affine", "square", "square") in tree.recorded_paths()


def test_repeated_non_root_function_deepens_the_path_until_made_a_root(tree, rng):
    """The README's "a function that is not a root extends the path, one node per call, while
    outputs of the path are alive": after one call of ``a``, every call of ``g`` whose outputs
    are kept is a node one deeper (warmed up, never recorded while no later generation comes
    back; 12 calls stay under ``config.path_repeat_limit``); ``mark_step_begin()`` before its next
    call makes ``g`` a root, recorded once and replayed."""
    a, g = tree.fn(affine), tree.fn(double)
    kept = [a(tree.tensor(rand(rng, 16)))]
    for i in range(1, 13):
        x = tree.tensor(rand(rng, 16))
        kept.append(g(x))
        assert_same(kept[-1], tree.eager(g, x))
        assert len(tree.mgr.current.path()) == i + 1  # a -> g -> g -> ...
    st = tree.mgr.stats[g.fn_id]
    assert (st.warmups, st.recordings, st.replays) == (12, 0, 0)
    assert g.fn_id not in tree.mgr.root_fns
    tree.mgr.mark_step_begin()
    for _ in range(12):
        x = tree.tensor(rand(rng, 16))
        assert_same(g(x), tree.eager(g, x))
        assert tree.mgr.current.parent is None  # each call begins a generation: g is a root
    assert g.fn_id in tree.mgr.root_fns
    assert (st.warmups, st.recordings, st.replays) == (13, 1, 10)


def test_function_repeated_past_the_limit_on_one_path_becomes_a_root(tree, rng, caplog):
    """``prefill`` once, then ``decode`` in a loop that never calls a root again: past
    ``config.path_repeat_limit`` nodes of ``decode`` on the path, ``decode`` becomes a root (a
    warning, once): one recording, replayed, the tree bounded; results equal eager throughout."""
    config.path_repeat_limit = 6
    prefill, decode = tree.fn(affine), tree.fn(double)
    tok = prefill(tree.tensor(rand(rng, 16)))
    with caplog.at_level(logging.WARNING, logger="cgraw"):
        for _ in range(40):
            ref = tree.eager(decode, tok)
            tok = decode(tok)  # the previous token is this call's argument: readable until copied in
            assert_same(tok, ref)
    st = tree.mgr.stats[decode.fn_id]
    assert st.promoted and decode.fn_id in tree.mgr.root_fns
    assert st.recordings == 1 and st.replays == 40 - 6 - 2
    assert len(tree.mgr.nodes()) == 1 + 6 + 1  # prefill, the 6 abandoned path nodes, decode's root
    assert sum("path_repeat_limit" in r.getMessage() for r in caplog.records) == 1


def test_two_functions_alternating_past_the_limit_keep_their_path(tree, rng):
    """``logits = model(tok); tok = sample(logits)`` after one ``prefill``: ``model`` becomes the
    root, and ``sample`` stays its child (one recorded path model -> sample, replayed)."""
    def shrink(x):
        return new(np.tanh(x.value) * 0.9 + 0.05)

    def halve(x):
        return new(x.value * 0.5 - 0.1)

    config.path_repeat_limit = 4
    prefill, model, sample = tree.fn(affine), tree.fn(shrink), tree.fn(halve)
    tok = prefill(tree.tensor(rand(rng, 8)))
    for _ in range(30):
        ref = tree.eager(sample, tree.tensor(tree.eager(model, tok)))
        tok = sample(model(tok))
        assert_same(tok, ref)
    assert model.fn_id in tree.mgr.root_fns and sample.fn_id not in tree.mgr.root_fns
    assert tree.node("shrink", "halve").state is NodeState.RECORDED
    assert tree.mgr.stats[sample.fn_id].replays > 20


def test_path_repeat_limit_zero_keeps_deepening_the_path(tree, rng):
    config.path_repeat_limit = 0
    f, g = tree.fn(affine), tree.fn(double)
    kept = [f(tree.tensor(rand(rng, 8)))]
    for _ in range(100):
        kept.append(g(tree.tensor(rand(rng, 8))))
    assert len(tree.mgr.current.path()) == 101 and not tree.mgr.stats[g.fn_id].promoted


def counts(tree, f) -> tuple:
    st_ = tree.mgr.stats[f.fn_id]
    return st_.warmups, st_.recordings, st_.replays, st_.eager_calls


def loop_dropping_outputs(tree, g, rng, n: int) -> list:
    """``g(x)`` ``n`` times, each result compared with eager and dropped; ``(warm-ups,
    recordings, replays)`` of ``g`` after each call."""
    seen = []
    for _ in range(n):
        x = tree.tensor(rand(rng, 16))
        assert_same(g(x), tree.eager(g, x))
        seen.append(counts(tree, g)[:3])
    return seen


def test_a_function_after_another_whose_outputs_died_starts_from_a_root(tree, rng):
    """``f(x)`` once, then ``g(x)`` ten times with every output dropped: the path ends before
    ``g``'s first call (everything it made is dead), so ``g`` is recorded at its second call and
    replayed from its third, exactly as when ``g`` is the first function called."""
    f, g = tree.fn(affine), tree.fn(double)
    f(tree.tensor(rand(rng, 16)))
    seen = loop_dropping_outputs(tree, g, rng, 10)
    assert seen[:3] == [(1, 0, 0), (1, 1, 0), (1, 1, 1)]
    assert counts(tree, g) == (1, 1, 8, 0)
    assert tree.all_paths() == [("affine",), ("double",)] and g.fn_id in tree.mgr.root_fns
    # the simulated backend keeps nothing it hands out alive: liveness is the caller's alone
    y = g(tree.tensor(rand(rng, 16)))
    assert in_pool(y)
    ref = weakref.ref(y)
    del y
    assert ref() is None
    alone = Tree()
    assert loop_dropping_outputs(alone, alone.fn(double), rng, 10) == seen


@pytest.mark.parametrize("first", ["warm-up", "warm-up in the pool", "replay", "skipped"])
def test_a_live_output_of_any_node_keeps_the_path(rng, first):
    """While an output of the path is alive (a warm-up's outside or inside the pool, a replay's,
    an eager run's of a skipped node), the next function extends the path; once it is dropped, the
    next new node starts from a root."""
    tree = Tree()
    tree.be.warm_in_pool = first == "warm-up in the pool"
    f, g, h = tree.fn(affine, name="f"), tree.fn(double, name="g"), tree.fn(square, name="h")
    if first == "skipped":
        tree.be.record_skip["f"] = "host synchronisation during capture"
    for _ in range({"warm-up": 0, "warm-up in the pool": 0, "replay": 2, "skipped": 1}[first]):
        f(tree.tensor(rand(rng, 16)))
        tree.mgr.mark_step_begin()
    y = f(tree.tensor(rand(rng, 16)))
    assert tree.node("f").state is {"replay": NodeState.RECORDED, "skipped": NodeState.SKIPPED}.get(
        first, NodeState.WARMED)
    assert in_pool(y) == (first in ("replay", "warm-up in the pool"))
    x = tree.tensor(rand(rng, 16))
    assert_same(g(x), tree.eager(g, x))
    assert [n.fn.name for n in tree.mgr.current.path()] == ["f", "g"]
    del y
    x = tree.tensor(rand(rng, 16))
    assert_same(h(x), tree.eager(h, x))
    assert tree.mgr.current.parent is None and tree.mgr.current.fn is h


def test_an_alias_of_a_dead_output_passed_in_keeps_the_path(tree, rng):
    """The output object is gone, but the call reads its memory (a tree-output input): the path
    under way is still in use."""
    f, g = tree.fn(affine), tree.fn(double)
    for _ in range(2):  # warmed up, recorded: f's outputs are the tree's memory from now on
        f(tree.tensor(rand(rng, 16)))
    for _ in range(3):
        tree.mgr.mark_step_begin()
        y = f(tree.tensor(rand(rng, 16)))
        assert in_pool(y)
        alias = FakeT(y.ptr, y.nbytes, y.mem)  # a view the tree never handed out
        ref = values(y)
        del y
        assert_same(g(alias), tree.eager(g, tree.tensor(ref)))
        assert [n.fn.name for n in tree.mgr.current.path()] == ["affine", "double"]
    assert counts(tree, g)[:3] == (1, 1, 1)


def test_kept_outputs_deepen_the_path_and_the_limit_still_makes_a_root(tree, rng, caplog):
    """``config.path_repeat_limit`` stays the backstop for paths whose outputs stay alive."""
    config.path_repeat_limit = 6
    f, g = tree.fn(affine), tree.fn(double)
    kept = [f(tree.tensor(rand(rng, 16)))]
    with caplog.at_level(logging.WARNING, logger="cgraw"):
        for i in range(20):
            x = tree.tensor(rand(rng, 16))
            kept.append(g(x))
            assert_same(kept[-1], tree.eager(g, x))
            if i < 6:
                assert len(tree.mgr.current.path()) == i + 2
    st_ = tree.mgr.stats[g.fn_id]
    assert st_.promoted and (st_.warmups, st_.recordings, st_.replays) == (7, 1, 12)
    assert sum("path_repeat_limit" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------------- 4. tree outputs


def test_tree_outputs_are_offered_within_a_generation_only(tree, rng):
    a, b = tree.fn(affine), tree.fn(double)
    old = None
    for gen in range(4):
        x = tree.tensor(rand(rng, 64))
        ya = a(x)
        assert tree.be.inspected[-1] == ("affine", {})  # a generation begins with none
        b(ya)
        name, offered = tree.be.inspected[-1]
        assert name == "double"
        if gen >= 1:  # affine is recorded from the 2nd generation on
            assert offered == {ya.ptr: tree.node("affine")}
            assert tree.mgr.tree_outputs[ya.ptr] is tree.node("affine")
        old = ya
        tree.mgr.mark_step_begin()
        assert tree.mgr.tree_outputs == {}
    # an output of an earlier generation is not a tree output any more (and reading it fails)
    b_root = tree.fn(square)
    with pytest.raises(Overwritten, match="'affine'"):
        b_root(old)
    assert tree.be.inspected[-1] == ("square", {})
    # nor after a generation begun by the inference rule
    a(tree.tensor(rand(rng, 64)))
    a(tree.tensor(rand(rng, 64)))
    assert tree.be.inspected[-1] == ("affine", {})


# ---------------------------------------------------------------------- 5. re-record


def chain3(tree):
    a = tree.fn(affine)
    b = tree.fn(with_weight, static_argnums=(0,))
    c = tree.fn(square)

    def step(x, w):
        ya = a(x)
        yb = b(w, ya)
        yc = c(yb)
        ra = tree.eager(a, x)
        rb = tree.eager(b, w, tree.tensor(ra))
        assert_same(ya, ra)
        assert_same(yb, rb)
        assert_same(yc, tree.eager(c, tree.tensor(rb)))
        return ya, yb, yc

    return a, b, c, step


def test_rerecord_when_static_input_moves(tree, rng):
    a, b, c, step = chain3(tree)
    w = tree.tensor(rand(rng, 256))
    for _ in range(5):
        step(tree.tensor(rand(rng, 256)), w)
    na, nb, nc = tree.node("affine"), tree.node("affine", "with_weight"), tree.node("affine", "with_weight", "square")
    assert all(n.state is NodeState.RECORDED for n in (na, nb, nc))
    rec_a, rec_b, rec_c = na.recording, nb.recording, nc.recording
    warm_c, recs_c = tree.mgr.stats[c.fn_id].warmups, tree.mgr.stats[c.fn_id].recordings

    w2 = tree.tensor(rand(rng, 256))  # same signature, new address: the static input moved
    x = tree.tensor(rand(rng, 256))
    start = len(tree.be.log)
    ya = a(x)
    yb = b(w2, ya)
    assert nc.state is NodeState.WARMED and nc.recording is None  # descendants went back to WARMED
    log = tree.be.log[start:]
    st_b = tree.mgr.stats[b.fn_id]
    assert st_b.rerecords == 1 and len(st_b.rerecord_reasons) == 1
    assert st_b.rerecord_reasons[0].startswith("static input 0 moved from ")
    assert tree.be.discards == [rec_b, rec_c]
    assert not rec_a.discarded
    kinds = [e[0] for e in log]
    i_restore = kinds.index("restore")
    assert log[i_restore][1] is na.checkpoint, "re-recording restores the parent's checkpoint"
    assert tree.be.restores[-1][1:] == ([rec_a], [])  # on the path: the parent's recording only
    assert kinds.index("discard") < i_restore < kinds.index("record")
    assert kinds.count("restore") == 1 and kinds.count("warmup") == 0
    assert nb.recording is not rec_b and nb.state is NodeState.RECORDED
    assert_same(yb, tree.eager(b, w2, tree.tensor(tree.eager(a, x))))
    yc = c(yb)
    assert_same(yc, tree.eager(c, tree.tensor(yb.value)))
    st_c = tree.mgr.stats[c.fn_id]
    assert st_c.warmups == warm_c and st_c.recordings == recs_c + 1  # recorded without warm-up
    assert nc.state is NodeState.RECORDED and st_c.rerecords == 0
    assert kinds.count("restore") == 1 and [e[0] for e in tree.be.log[start:]].count("restore") == 1
    # from now on: replays only
    records = tree.be.count("record")
    for _ in range(3):
        step(tree.tensor(rand(rng, 256)), w2)
    assert tree.be.count("record") == records and tree.mgr.stats[b.fn_id].rerecords == 1


def test_rerecord_of_root_restores_the_root_checkpoint(tree, rng):
    a, b, c, step = chain3(tree)
    w = tree.tensor(rand(rng, 64))
    for _ in range(5):
        step(tree.tensor(rand(rng, 64)), w)
    old = [n.recording for n in tree.mgr.nodes() if n.recording is not None]
    assert len(old) == 3
    tree.be.force_moved["affine"] = "tree-output input 0 moved (forced)"
    restores, warmups = len(tree.be.restores), tree.be.count("warmup")
    step(tree.tensor(rand(rng, 64)), w)
    assert tree.be.restores[restores][0] is tree.mgr.root_checkpoint
    assert tree.be.restores[restores][1] == []
    assert all(r.discarded for r in old) and len(tree.be.discards) == 3
    assert tree.mgr.stats[a.fn_id].rerecord_reasons == ["tree-output input 0 moved (forced)"]
    # the whole path was recorded again in the same step, without new warm-ups
    path = [tree.node("affine"), tree.node("affine", "with_weight"), tree.node("affine", "with_weight", "square")]
    assert all(n.state is NodeState.RECORDED and n.recording not in old for n in path)
    assert [tree.mgr.stats[f.fn_id].recordings for f in (a, b, c)] == [2, 2, 2]
    assert tree.be.count("warmup") == warmups


def test_exception_inside_a_capture_leaves_no_blocks_behind(tree, rng):
    boom = []

    def fragile(x):
        t = new(x.value * 3.0)  # allocated in the capture before the failure
        if boom:
            raise ValueError("user code failed")
        out = new(t.value + 1.0)
        release(t)
        return out

    f = tree.fn(fragile)
    f(tree.tensor(rand(rng, 700)))
    boom.append(1)
    with pytest.raises(ValueError, match="user code failed"):
        f(tree.tensor(rand(rng, 700)))
    assert tree.node("fragile").state is NodeState.WARMED
    boom.clear()
    x = tree.tensor(rand(rng, 700))
    assert_same(f(x), tree.eager(f, x))
    rec = tree.node("fragile").recording
    # the failed capture's blocks were given back by a restore before recording again
    assert dict(tree.pool.snapshot().live) == rec.live
    assert tree.be.restores and tree.be.restores[-1][0] is tree.mgr.root_checkpoint


def test_dirty_skip_forces_a_restore_before_the_next_recording(tree, rng):
    a, b, c = tree.fn(affine), tree.fn(double, name="b"), tree.fn(square)
    tree.be.record_skip_dirty["b"] = "could not find the input-copy node in the captured graph"
    for gen in range(4):
        x = tree.tensor(rand(rng, 300))
        ya = a(x)
        yb = b(ya)
        if gen == 1:  # b's recording failed after its capture: its blocks are still in the pool
            assert tree.node("affine", "b").state is NodeState.SKIPPED
            assert tree.mgr.pool_state is not tree.node("affine")
            assert len(tree.pool.snapshot().live) > len(tree.node("affine").checkpoint.live)
        yc = c(yb)
        if gen == 1:  # c's recording restored a's checkpoint first: b's blocks are gone
            assert tree.be.restores[-1][0] is tree.node("affine").checkpoint
            assert dict(tree.pool.snapshot().live) == {**tree.node("affine").recording.live,
                                                       **tree.node("affine", "b", "square").recording.live}
        rb = tree.eager(b, tree.tensor(tree.eager(a, x)))
        assert_same(yc, tree.eager(c, tree.tensor(rb)))
        tree.mgr.mark_step_begin()


def test_failed_rerecord_can_be_retried(tree, rng):
    boom = []

    def weighted(w, x):
        if boom:
            raise ValueError("user code failed")
        return new(x.value * w.value + 1.0)

    a, b = tree.fn(affine), tree.fn(weighted, static_argnums=(0,))
    w = tree.tensor(rand(rng, 64))
    for _ in range(3):
        b(w, a(tree.tensor(rand(rng, 64))))
    assert tree.node("affine", "weighted").state is NodeState.RECORDED
    w2 = tree.tensor(rand(rng, 64))  # moved: the next call re-records, and the capture raises
    boom.append(1)
    with pytest.raises(ValueError, match="user code failed"):
        b(w2, a(tree.tensor(rand(rng, 64))))
    boom.clear()
    x = tree.tensor(rand(rng, 64))
    ya = a(x)
    out = b(w2, ya)  # the failure was the user's and is gone: this call must work
    assert_same(out, tree.eager(b, w2, tree.tensor(tree.eager(a, x))))
    assert tree.node("affine", "weighted").state is NodeState.RECORDED


# ---------------------------------------------------------------------- 6. skips


def skip_warnings(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and f"skipping cudagraphs for {name}" in r.getMessage()]


def test_skip_from_inspect_runs_eagerly_and_logs_each_reason_once(tree, rng, caplog):
    caplog.set_level(logging.INFO, logger="cgraw")
    s = tree.fn(affine, name="s")
    tree.be.inspect_skip["s"] = "reason one"
    for _ in range(3):
        x = tree.tensor(rand(rng, 50))
        out = s(x)
        assert_same(out, tree.eager(s, x))
        assert not in_pool(out)
    tree.be.inspect_skip["s"] = "reason two"
    for _ in range(2):
        s(tree.tensor(rand(rng, 50)))
    st_ = tree.mgr.stats[s.fn_id]
    assert st_.skip_reasons == {"reason one": 3, "reason two": 2} and st_.eager_calls == 5
    assert (st_.warmups, st_.recordings, st_.replays) == (0, 0, 0)
    assert tree.mgr.nodes() == [] and s.fn_id not in tree.mgr.root_fns
    msgs = skip_warnings(caplog, "s")
    assert len(msgs) == 2 and "reason one" in msgs[0] and "reason two" in msgs[1]


def test_inspect_skip_mid_path_keeps_the_path(tree, rng, caplog):
    a, b = tree.fn(affine), tree.fn(double)
    cpu = tree.fn(lambda x, arr: new(x.value + arr), name="cpu")  # numpy input: the fake skips it
    for _ in range(4):
        x = tree.tensor(rand(rng, 40))
        arr = rand(rng, 40)
        ya = a(x)
        yc = cpu(ya, arr)
        yb = b(yc)
        ra = tree.eager(a, x)
        assert_same(yb, tree.eager(b, tree.tensor(ra + arr)))
        tree.mgr.mark_step_begin()
    assert tree.recorded_paths() == {("affine",), ("affine", "double")}
    assert tree.mgr.stats[cpu.fn_id].eager_calls == 4
    assert len(skip_warnings(caplog, "cpu")) == 1 and "CPU" in skip_warnings(caplog, "cpu")[0]


def test_skip_from_record_marks_node_skipped(tree, rng, caplog):
    a, c = tree.fn(affine), tree.fn(square)
    r = tree.fn(double, name="r")
    tree.be.record_skip["r"] = "host synchronisation during capture"
    for gen in range(5):
        x, x2 = tree.tensor(rand(rng, 96)), tree.tensor(rand(rng, 96))
        ya = a(x)
        yr = r(x2)
        if gen == 1:  # the failed capture's blocks are gone: the pool is back at a's checkpoint
            na = tree.node("affine")
            assert tree.pool.snapshot().live == na.checkpoint.live
            assert tree.mgr.pool_state is na
        yc = c(yr)
        assert_same(ya, tree.eager(a, x))
        assert_same(yr, tree.eager(r, x2))
        assert not in_pool(yr)
        assert_same(yc, tree.eager(c, tree.tensor(tree.eager(r, x2))))
        tree.mgr.mark_step_begin()
    nr = tree.node("affine", "r")
    assert nr.state is NodeState.SKIPPED and nr.skip_reason == "host synchronisation during capture"
    assert nr.recording is None
    assert tree.be.count("record", "r") == 1, "a skipped node is never captured again"
    st_r = tree.mgr.stats[r.fn_id]
    assert (st_r.warmups, st_r.recordings, st_r.eager_calls) == (1, 0, 4)
    assert st_r.skip_reasons == {"host synchronisation during capture": 4}
    assert len(skip_warnings(caplog, "r")) == 1
    # the node after the skipped one is recorded on top of the last recorded ancestor
    assert tree.node("affine", "r", "square").state is NodeState.RECORDED
    assert ("affine", "r", "square") in tree.recorded_paths()


def test_unsafe_function_always_runs_eagerly(tree, rng, caplog):
    u = tree.fn(affine, name="u", unsafe_reason="marked @cgraw.unsafe (prints)")
    for _ in range(4):
        x = tree.tensor(rand(rng, 30))
        out = u(x)
        assert_same(out, tree.eager(u, x))
        assert not in_pool(out)
    st_ = tree.mgr.stats[u.fn_id]
    assert st_.eager_calls == 4 and st_.skip_reasons == {"marked @cgraw.unsafe (prints)": 4}
    assert tree.be.count("inspect") == 0 and tree.mgr.nodes() == []
    assert len(skip_warnings(caplog, "u")) == 1


def test_dynamic_shapes_warn_once_past_the_limit(tree, rng, caplog):
    f = tree.fn(affine)
    limit = config.dynamic_shape_warn_limit
    sizes = [8 * (k + 1) for k in range(limit + 3)]
    for _ in range(2):
        for n in sizes:
            x = tree.tensor(rand(rng, n))
            assert_same(f(x), tree.eager(f, x))
    warns = [r.getMessage() for r in caplog.records if "input signatures" in r.getMessage()]
    assert len(warns) == 1 and f"called with {limit + 1} input signatures" in warns[0]
    st_ = tree.mgr.stats[f.fn_id]
    assert st_.variants == limit + 3 and st_.recordings == limit + 3 and st_.eager_calls == 0


def test_skip_dynamic_graphs_runs_extra_variants_eagerly(tree, rng, caplog):
    config.skip_dynamic_graphs = True
    config.dynamic_shape_warn_limit = 2
    f = tree.fn(affine)
    for rnd in range(3):
        for n in (16, 32, 48, 64):
            x = tree.tensor(rand(rng, n))
            out = f(x)
            assert_same(out, tree.eager(f, x))
            assert in_pool(out) == (rnd > 0 and n <= 32)  # the first two signatures are graphed
    st_ = tree.mgr.stats[f.fn_id]
    assert st_.variants == 4 and st_.recordings == 2 and st_.warmups == 2
    assert st_.eager_calls == 6 and tree.be.count("record") == 2
    skipped = [n for n in tree.mgr.nodes() if n.state is NodeState.SKIPPED]
    assert len(skipped) == 2 and all("dynamic shapes" in n.skip_reason for n in skipped)
    assert len(skip_warnings(caplog, "affine")) == 1


def test_skipped_dynamic_variant_stays_eager_elsewhere_in_the_tree(tree, rng):
    config.skip_dynamic_graphs = True
    config.dynamic_shape_warn_limit = 1
    f, p, q = tree.fn(affine), tree.fn(double), tree.fn(square)
    y = p(tree.tensor(rand(rng, 8)))  # kept: f's calls extend the path
    f(tree.tensor(rand(rng, 16)))  # first signature of f (f is never a root here)
    tree.mgr.mark_step_begin()
    y = q(tree.tensor(rand(rng, 8)))
    f(tree.tensor(rand(rng, 32)))  # second signature: over the limit, so eager
    assert tree.node("square", "affine").state is NodeState.SKIPPED
    for _ in range(3):
        tree.mgr.mark_step_begin()
        y = p(tree.tensor(rand(rng, 8)))
        f(tree.tensor(rand(rng, 32)))  # the same over-the-limit signature, now under p
    del y
    st_ = tree.mgr.stats[f.fn_id]
    assert st_.eager_calls == 4, "the over-the-limit signature was graphed under another parent"
    assert st_.warmups == 1 and st_.recordings == 0


# ---------------------------------------------------------------------- 7. threads


def test_call_from_another_thread_raises(tree, rng):
    f = tree.fn(affine)
    f(tree.tensor(rand(rng, 8)))
    x = tree.tensor(rand(rng, 8))
    errors = []

    def other():
        try:
            f(x)
        except Exception as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], CgrawError)
    assert "thread" in str(errors[0]) and "'affine'" in str(errors[0])
    assert tree.mgr.stats[f.fn_id].warmups == 1 and tree.be.count("inspect") == 1


# ---------------------------------------------------------------------- 8. describe, reset


def test_describe_lists_the_tree_in_order(tree, rng):
    a, b, c = tree.fn(affine), tree.fn(double), tree.fn(square)
    s = tree.fn(pair, name="s")
    tree.be.record_skip["s"] = "no capture here"
    for _ in range(3):
        x = tree.tensor(rand(rng, 24))
        ya, yb = a(x), b(x)  # kept: each call extends the path
        c(x)
        tree.mgr.mark_step_begin()
        ya = a(x)
        s(x)
        tree.mgr.mark_step_begin()
    del ya, yb
    nn = {n.fn.name: tree.be.num_nodes(n.recording) for n in tree.mgr.nodes() if n.recording is not None}
    assert tree.mgr.describe() == "\n".join([
        "cgraw tree on device 0: generation 6",
        f"  affine [recorded, {nn['affine']} graph nodes]",
        f"    double [recorded, {nn['double']} graph nodes]",
        f"      square [recorded, {nn['square']} graph nodes]",
        "    s [skipped] (no capture here)",
    ])
    tree.mgr.mark_step_begin()
    tree.fn(affine, name="lone")(tree.tensor(rand(rng, 24)))
    assert tree.mgr.describe().endswith("\n  lone [warmed]")


def test_reset_discards_every_recording_and_closes(tree, rng):
    tree, _ = walk_seed([2, 3, 2, 3, 2, 3, 2, 3], rng, tree=tree)
    recs = [n.recording for n in tree.mgr.nodes() if n.recording is not None]
    assert len(recs) == 5
    tree.mgr.reset()
    assert all(r.discarded for r in recs) and len(tree.be.discards) == 5
    assert tree.be.closed == 1 and tree.pool.closed
    assert tree.mgr.roots == {} and tree.mgr.nodes() == [] and tree.mgr.root_fns == set()
    assert tree.mgr.current is None and tree.mgr.tree_outputs == {} and tree.mgr.outs.handed == []
    assert tree.be.log[-1] == ("close",)
    assert tree.be.source.reserved_bytes == 0
    check_invariants(tree.pool)


def test_reset_ends_the_current_generation_before_freeing(tree, rng):
    a, b = tree.fn(affine), tree.fn(double)
    for _ in range(3):
        ya = a(tree.tensor(rand(rng, 16)))
        yb = b(ya)
    ends = len(tree.be.generations)
    tree.mgr.reset()
    assert len(tree.be.generations) == ends + 1, "reset() did not end the current generation"
    handed, _ = tree.be.generations[-1]
    assert [o for _, o in handed] == [ya, yb]
    last_end = max(i for i, e in enumerate(tree.be.log) if e[0] == "end_generation")
    assert last_end < tree.be.log.index(("close",))
    assert yb.poisoned == "double"


# ---------------------------------------------------------------------- 9. random walks

OPS = [
    lambda v: v * 1.5 + 0.25,
    lambda v: v * v - 0.5,
    lambda v: np.sqrt(np.abs(v)) + 1.0,
    lambda v: -v + 2.0,
    lambda v: np.cumsum(v) * 0.01,
]


def make_walk_fn(op, out_n: int, use_temp: bool, with_static: bool):
    if with_static:
        def f(w, x):
            v = op(x.value)
            return new(np.resize(v, out_n) + w.value[0])
    else:
        def f(x):
            v = op(x.value)
            if use_temp:
                t = new(v)
                v = t.value * 0.5
                release(t)
            return new(np.resize(v, out_n))
    return f


_walk_coverage: Counter = Counter()  # what the random walks exercised (for a look when tuning)

fn_spec = st.tuples(st.integers(0, len(OPS) - 1), st.sampled_from([16, 64, 200, 700]),
                    st.booleans(), st.booleans())
call_spec = st.tuples(st.integers(0, 5), st.sampled_from(["prev", "prev", "fresh", "fresh2"]))
# A "program" is one step of a model: a few calls. Programs branch off earlier ones (a shared
# prefix, then their own calls), and a schedule runs them in random order, so paths repeat and
# branch, as in a training loop with host-side decisions.
branch_spec = st.tuples(st.integers(0, 3), st.integers(0, 4), st.lists(call_spec, min_size=0, max_size=3))
event_spec = st.tuples(st.integers(0, 3), st.sampled_from(["", "", "mark", "move", "drop"]), st.integers(0, 5))


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(fn_spec, min_size=3, max_size=6),
       base=st.lists(call_spec, min_size=1, max_size=5),
       branches=st.lists(branch_spec, min_size=0, max_size=3),
       schedule=st.lists(event_spec, min_size=1, max_size=30),
       uncapturable=st.integers(-1, 10), dirty=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_random_walks_match_eager_and_never_overlap_on_the_path(specs, base, branches, schedule,
                                                               uncapturable, dirty, seed):
    rng = np.random.default_rng(seed)
    tree = Tree()
    fns, statics = [], {}
    for i, (op, out_n, use_temp, with_static) in enumerate(specs):
        f = tree.fn(make_walk_fn(OPS[op], out_n, use_temp, with_static), name=f"f{i}",
                    static_argnums=(0,) if with_static else ())
        fns.append(f)
        if with_static:
            statics[i] = tree.tensor(rand(rng, 4))
    if uncapturable < len(fns):  # at most one function cannot be recorded (a skipped node)
        hook = tree.be.record_skip_dirty if dirty else tree.be.record_skip
        hook[f"f{uncapturable}"] = "cannot be captured"
    programs = [base]
    for parent, cut, own in branches:
        src = programs[parent % len(programs)]
        programs.append(src[:cut % (len(src) + 1)] + own or base)

    live: list = []  # (result, expected) handed out in this generation
    for prog, event, which in schedule:
        if event == "mark":
            tree.mgr.mark_step_begin()
            live = []
        elif event == "drop":  # every output dies: the next new node may start from a root
            live, out, x, args, o = [], None, None, None, None
        elif event == "move" and which % len(fns) in statics:  # a static input gets a new address
            statics[which % len(fns)] = tree.tensor(rand(rng, 4))
        prev = None
        for i, src in programs[prog % len(programs)]:
            i %= len(fns)
            if src == "prev" and prev is not None:
                x = prev
                if fns[i].fn_id in tree.mgr.root_fns and tree.mgr.current is not None:
                    x = tree.tensor(prev.value)  # this call ends prev's generation: a user clones
            else:
                x = tree.tensor(rand(rng, 24 if src == "fresh" else 40))
            args = (statics[i], x) if i in statics else (x,)
            expected = tree.eager(fns[i], *args)  # before the call, while every input is intact
            gen = tree.mgr.generation
            root_call = fns[i].fn_id in tree.mgr.root_fns and tree.mgr.current is not None
            out = fns[i](*args)
            if tree.mgr.generation != gen:
                # a root function began a new generation, or nothing of the ended one was alive
                assert root_call or tree.mgr.stats[fns[i].fn_id].promoted or not live, "a path in use was ended"
                live = []
            assert_same(out, expected)
            live.append((out, expected))
            for o, e in live:  # nothing handed out in this generation was overwritten
                assert_same(o, e)
            prev = out
            check_path_and_tree(tree)
    _walk_coverage.update(records=tree.be.count("record"), replays=tree.be.count("replay"),
                          restores=len(tree.be.restores), discards=len(tree.be.discards),
                          rerecords=sum(s.rerecords for s in tree.mgr.stats.values()),
                          skipped=sum(n.state is NodeState.SKIPPED for n in tree.mgr.nodes()),
                          deep=sum(n.depth >= 2 and n.state is NodeState.RECORDED for n in tree.mgr.nodes()))
    tree.mgr.reset()
    check_invariants(tree.pool)
    assert tree.be.source.reserved_bytes == 0


def check_path_and_tree(tree) -> None:
    """The recorded blocks of the nodes on the current path never overlap each other; a node is
    RECORDED exactly when it holds a live recording; the pool's bookkeeping is consistent."""
    ranges = []
    if tree.mgr.current is not None:
        for node in tree.mgr.current.path():
            if node.recording is not None:
                ranges.extend(node.recording.live.items())
    ranges.sort()
    for (p0, s0), (p1, _) in itertools.pairwise(ranges):
        assert p0 + s0 <= p1, f"recorded blocks 0x{p0:x}+{s0} and 0x{p1:x} overlap on the current path"
    for node in tree.mgr.nodes():
        assert (node.state is NodeState.RECORDED) == (node.recording is not None), node
        assert node.recording is None or not node.recording.discarded, node
    check_invariants(tree.pool)


def test_recurrent_state_passed_back_into_a_root_function(tree, rng):
    """``h = f(h)``: the previous step's output is this call's argument. It stays readable until
    the call has copied it in, is poisoned afterwards, and every step equals eager."""
    f = tree.fn(affine)
    h = tree.tensor(rand(rng, 256))
    ref = values(h)
    for _ in range(8):
        ref_h = tree.tensor(ref)
        ref = tree.eager(f, ref_h)
        prev, prev_ref = h, values(ref_h)
        h = f(h)
        assert_same(h, ref)
        if prev is not h and in_pool(prev):  # a replay's output: the tree's memory
            with pytest.raises(Overwritten):
                values(prev)
        elif prev is not h:  # the caller's own tensor or a warm-up's output: still valid
            np.testing.assert_array_equal(values(prev), prev_ref)
    assert tree.mgr.stats[f.fn_id].replays >= 5


def test_failed_restore_renews_the_pool_and_stays_correct(tree, rng, caplog):
    """If the pool cannot be put back (memory held outside the tree), the tree starts over on a
    fresh pool, logs why, and later calls are still correct."""
    f, g, h = tree.fn(affine, name="f"), tree.fn(affine, name="g"), tree.fn(affine, name="h")
    for i in range(4):
        x = tree.tensor(rand(rng, 64))
        ref = tree.eager(f, x)
        y = f(x)
        assert_same(y, ref)
        assert_same(g(y), tree.eager(g, tree.tensor(values(y))))
    real_restore = tree.be.restore

    def failing(*a, **k):
        tree.be.restore = real_restore
        raise RuntimeError("Any stale tensors which are being manually freed must be passed")

    tree.be.restore = failing
    with caplog.at_level(logging.WARNING, logger="cgraw"):
        for i in range(4):
            x = tree.tensor(rand(rng, 64))
            y = f(x)
            assert_same(y, tree.eager(f, x))
            z = h(y)  # a new branch after a replay: needs a restore, which fails once
            assert_same(z, tree.eager(h, tree.tensor(values(y))))
    assert "fresh pool" in caplog.text
    assert tree.be.count("renew") == 1


def _all_ids(args) -> set:
    """Every argument's id and those of everything inside its tuples, lists and dicts, recursively."""
    out = set()
    for x in args:
        out.add(id(x))
        if type(x) in (tuple, list):
            out |= _all_ids(x)
        elif type(x) is dict:
            out |= _all_ids(list(x.values()))
    return out


_leaf_objects = [object() for _ in range(8)]
_nested = st.recursive(
    st.sampled_from(_leaf_objects) | st.integers(0, 3),
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.integers(0, 5), inner, max_size=3),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(args=st.lists(_nested, max_size=6), wanted_idx=st.sets(st.integers(0, 7), max_size=4))
def test_a_root_call_finds_the_ending_generations_outputs_among_its_arguments_at_any_depth(args, wanted_idx):
    """``ids_among_args`` (which outputs of the ending generation a root call takes as arguments,
    kept readable until it has copied them in) finds exactly the wanted objects present anywhere in
    the arguments' tuples, lists and dict values, and the containers themselves."""
    from cgraw.trees.nodes import ids_among_args

    wanted = {id(_leaf_objects[i]) for i in wanted_idx}
    if args and isinstance(args[0], (list, tuple, dict)):
        wanted.add(id(args[0]))  # a container among the wanted ids is found too
    assert ids_among_args(tuple(args), wanted) == wanted & _all_ids(args)
