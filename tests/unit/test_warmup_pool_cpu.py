"""CPU tier of the warm-up inside the tree's pool (``cgraw.trees.warmup``).

The tree's side (``TreeManager._warm``) runs on the fake backend of
tests/helpers/fake_tree_backend.py made with ``warm_in_pool=True``: a warm-up allocates pool
blocks, and memory a later capture reuses wipes what was there, so an output left readable over
reused memory fails its read (``Clobbered``). ``PoolWarmup.settle``, the CUDA backend's account
of what a warm-up left, runs on CPU torch tensors against a fake torch pool (torch tests only).
"""

from __future__ import annotations

import gc
import logging
import weakref

import numpy as np
import programs
import pytest
from fake_tree_backend import EAGER_BASE, FakeFn, FakeTreeBackend, Overwritten, new, release
from test_programs import fake_namespace
from test_tree_logic import rand

from allocator import check_invariants
from cgraw.trees.manager import NodeState, TreeManager
from cgraw.trees.config import config


@pytest.fixture(autouse=True)
def _restore_config(saved_config):
    """cgraw.config put back after each test (tests/conftest.py)."""


@pytest.fixture
def rng():
    return np.random.default_rng()


def affine(x):
    tmp = new(x.value * 1.5)
    out = new(tmp.value + 0.25)
    release(tmp)
    return out


def double(x):
    return new(x.value * 2.0 - 1.0)


def make(warm_in_pool=True):
    be = FakeTreeBackend(warm_in_pool=warm_in_pool)
    return be, TreeManager(be)


def test_warm_up_output_is_in_the_pool_and_handed_out(rng):
    be, mgr = make()
    f = FakeFn(affine, mgr)
    x = be.tensor(rand(rng, 300))
    y1 = f(x)
    assert y1.ptr < EAGER_BASE  # the warm-up's output lies in the tree's pool
    assert np.array_equal(y1.value, x.value * 1.5 + 0.25)
    assert [(name, r()) for name, r in mgr.outs.handed] == [("affine", y1)]
    y2 = f(be.tensor(rand(rng, 300)))  # a root function's call: the generation ends first
    with pytest.raises(Overwritten, match="'affine'"):
        _ = y1.value
    assert y2.poisoned is None
    # its recording restored the root checkpoint first, which gave the warm-up's blocks back
    assert be.restores and be.restores[-1][0] is mgr.root_checkpoint
    assert dict(be.pool.snapshot().live) == mgr.roots[next(iter(mgr.roots))].recording.live
    check_invariants(be.pool)


def test_warm_up_outside_the_pool_when_turned_off(rng):
    be, mgr = make(warm_in_pool=False)
    f = FakeFn(affine, mgr)
    y1 = f(be.tensor(rand(rng, 300)))
    assert y1.ptr >= EAGER_BASE and mgr.outs.handed == []
    f(be.tensor(rand(rng, 300)))
    assert y1.poisoned is None and y1.value is not None


def test_h_equals_f_of_h_from_a_warm_up_output(rng):
    be, mgr = make()
    f = FakeFn(affine, mgr)
    h = be.tensor(rand(rng, 64))
    ref = h.value.copy()
    for _ in range(12):
        h = f(h)  # the previous output (a warm-up's, then a replay's) is this call's input
        ref = ref * 1.5 + 0.25
        assert np.allclose(h.value, ref)
    assert mgr.stats[f.fn_id].recordings == 1 and mgr.stats[f.fn_id].replays == 10


def test_chain_and_new_branches_match_eager_with_every_warm_up_in_the_pool(rng):
    be, mgr = make()
    a, b, c = FakeFn(affine, mgr), FakeFn(double, mgr), FakeFn(affine, mgr, name="c")
    for step in range(16):
        x = be.tensor(rand(rng, 200))
        ya = a(x)
        yb = (b if step % 3 else c)(ya)  # the second branch is warmed up after the first replays
        ra = x.value * 1.5 + 0.25
        rb = ra * 2.0 - 1.0 if step % 3 else ra * 1.5 + 0.25
        assert np.array_equal(yb.value, rb)
        mgr.mark_step_begin()
    assert all(n.state is NodeState.RECORDED for n in mgr.nodes())
    check_invariants(be.pool)
    mgr.reset()
    assert be.source.reserved_bytes == 0


def test_state_kept_beyond_the_outputs_moves_the_tree_to_a_fresh_pool(rng, caplog):
    be, mgr = make()
    a, b = FakeFn(affine, mgr), FakeFn(double, mgr, name="step")
    be.warm_stash.add("step")  # its warm-up keeps a block, as an optimizer's first step does
    x = be.tensor(rand(rng, 100))
    a(x)
    mgr.mark_step_begin()
    ya = a(x)  # recorded: the tree has a recording when the stash comes, its output alive
    with caplog.at_level(logging.INFO, logger="cgraw"):
        y = b(be.tensor(rand(rng, 100)))
    assert any("moves to a fresh pool" in r.getMessage() and "step" in r.getMessage() for r in caplog.records)
    assert be.count("renew") == 1
    assert [(name, r()) for name, r in mgr.outs.handed] == [("affine", ya)]  # not step's: valid in the old pool
    kept = be.kept[0]
    for _ in range(8):
        mgr.mark_step_begin()
        x = be.tensor(rand(rng, 100))
        assert np.array_equal(b(a(x)).value, (x.value * 1.5 + 0.25) * 2.0 - 1.0)
        assert np.array_equal(kept.value, np.ones(2))  # never freed, never overwritten
    assert y.poisoned is None and y.value is not None
    assert not be.warm_in_pool  # later warm-ups run outside the pool
    assert be.count("renew") == 1


def test_failed_warm_up_forces_a_restore_before_the_next_recording(rng):
    be, mgr = make()
    boom = [1]

    def fragile(x):
        t = new(x.value * 3.0)
        if boom:
            raise ValueError("user code failed")
        return t

    f = FakeFn(fragile, mgr)
    with pytest.raises(ValueError, match="user code failed"):
        f(be.tensor(rand(rng, 50)))
    boom.clear()
    f(be.tensor(rand(rng, 50)))  # warm-up again: the one that raised taught nothing
    assert mgr.stats[f.fn_id].warmups == 2 and mgr.stats[f.fn_id].recordings == 0
    mgr.mark_step_begin()
    restores = len(be.restores)
    x = be.tensor(rand(rng, 50))
    assert np.array_equal(f(x).value, x.value * 3.0)
    assert len(be.restores) == restores + 1
    check_invariants(be.pool)


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_with_warm_ups_in_the_pool_matches_eager(seed):
    prog = programs.generate(seed)
    n = 500
    runs = []
    for graphed in (False, True):
        be, mgr = make()
        res = programs.run(prog, fake_namespace(be), n, graphed=graphed, mark_step_begin=mgr.mark_step_begin,
                           graphed_decorator=lambda f, mgr=mgr: FakeFn(f, mgr))
        runs.append((res, be, mgr))
    (eager, _, _), (got, be, mgr) = runs
    assert programs.compare(got, eager) == [], prog.describe()
    assert got.calls == eager.calls >= n
    assert got.raised == got.expected_raises
    stats = list(mgr.stats.values())
    assert sum(s.rerecords for s in stats) == 0 and sum(s.eager_calls for s in stats) == 0
    assert be.warm_in_pool and be.count("renew") == 0
    check_invariants(be.pool)


# ---------------------------------------------------------------------- PoolWarmup.settle (torch)


class FakeTorchPool:
    """``allocated()`` of a torch MemPool: the storages of the tensors tracked and still alive."""

    def __init__(self):
        self.refs: list = []

    def track(self, t):
        self.refs.append(weakref.ref(t))
        return t

    def allocated(self) -> dict:
        return {r().untyped_storage().data_ptr(): 8 for r in self.refs if r() is not None}


class FakeTts:
    def __init__(self):
        self.pool = FakeTorchPool()
        self.spanned: list = []

    def spans(self, tensors):
        self.spanned.extend(tensors)
        return [(t.untyped_storage().data_ptr(), 8) for t in tensors]


def settle_case(make_outputs, skip=None):
    torch = pytest.importorskip("torch")
    from cgraw.trees import warmup

    tts = FakeTts()
    old = tts.pool.track(torch.randn(3))  # allocated before the warm-up: never counted
    pool = type("Pool", (), {"capture_stream": "capture stream"})()
    pw = warmup.PoolWarmup(pool, tts)
    pw.before = set(tts.pool.allocated())
    out = make_outputs(torch, tts, pw)
    res = pw.settle(list(out), skip)
    return res, tts, out, old


def test_settle_hands_out_outputs_and_registers_their_owners():
    (in_pool, handed, stash), tts, out, _ = settle_case(lambda torch, tts, pw: (tts.pool.track(torch.randn(4)),))
    assert in_pool and stash is None and handed == [out[0]] and tts.spanned == [out[0]]


def test_settle_with_nothing_left_reports_nothing():
    (in_pool, handed, stash), _, _, old = settle_case(lambda torch, tts, pw: ())
    assert (in_pool, handed, stash) == (False, (), None)


def test_settle_counts_a_block_kept_elsewhere_as_state():
    kept = []

    def outputs(torch, tts, pw):
        kept.append(tts.pool.track(torch.randn(5)))  # an optimizer's buffer
        return (tts.pool.track(torch.randn(4)),)

    (in_pool, handed, stash), tts, _, _ = settle_case(outputs)
    assert in_pool and handed == () and "1 block(s)" in stash and tts.spanned == []


def test_settle_ignores_temporaries_collected_from_cycles():
    def outputs(torch, tts, pw):
        cycle: list = [tts.pool.track(torch.randn(7))]
        cycle.append(cycle)  # garbage in a reference cycle: gc.collect frees it
        return (tts.pool.track(torch.randn(4)),)

    gc.disable()
    try:
        (in_pool, handed, stash), _, out, _ = settle_case(outputs)
    finally:
        gc.enable()
    assert in_pool and stash is None and handed == [out[0]]


def test_settle_after_autograd_saved_something_hands_nothing_out():
    from cgraw.trees import warmup

    def outputs(torch, tts, pw):
        pw.pack(tts.pool.track(torch.randn(6)))  # torch.enable_grad() inside: autograd saved it
        return (tts.pool.track(torch.randn(4)),)

    (in_pool, handed, stash), tts, _, _ = settle_case(outputs)
    assert in_pool and handed == () and "autograd graph" in stash and tts.spanned == []
    assert warmup._PINNED.pop() == "capture stream"


def test_settle_of_a_skipped_function_hands_nothing_out():
    (in_pool, handed, stash), tts, _, _ = settle_case(lambda torch, tts, pw: (tts.pool.track(torch.randn(4)),),
                                                      skip="CPU tensors or ops")
    assert in_pool and handed == () and "runs eagerly from now on (CPU tensors or ops)" in stash
    assert tts.spanned == []


def test_settle_of_outputs_that_require_grad_hands_nothing_out():
    def outputs(torch, tts, pw):
        w = torch.randn(4, requires_grad=True)
        return (tts.pool.track(w * 2.0),)

    (in_pool, handed, stash), tts, _, _ = settle_case(outputs)
    assert in_pool and handed == () and "autograd graph" in stash and tts.spanned == []
    from cgraw.trees import warmup

    assert warmup._PINNED and warmup._PINNED[-1] == "capture stream"  # never destroyed
    warmup._PINNED.pop()


_w_global = None  # a module a function reaches through a global name (set by the test below)


def test_calls_autograd_records_warm_up_outside_the_pool(saved_config):
    """``warmup.usable``: grad mode off, or on with nothing requiring grad that the function
    reaches directly, warms up in the pool; an input, closure cell, global, bound module or
    partial argument that requires grad keeps the warm-up outside."""
    torch = pytest.importorskip("torch")
    import functools

    from cgraw.trees import warmup

    class Backend:
        _tts, warm_in_pool, _torch = object(), True, torch

    class Fn:
        def __init__(self, f):
            self.fn = f

    class Call:
        def __init__(self, *leaves):
            self.leaves = leaves

    def usable(f, *leaves):
        return warmup.usable(Backend, Fn(f), Call(*leaves))

    global _w_global
    x, w = torch.randn(4), torch.randn(4, requires_grad=True)
    lin = torch.nn.Linear(4, 4)
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    assert config.warmup_in_pool  # the default
    assert usable(torch.sin, x)  # grad mode on, nothing requires grad: autograd records nothing
    assert usable(lambda t: frozen(t) * 2.0, x)
    assert not usable(torch.sin, w)  # an input requires grad
    assert not usable(lambda t: lin(t) * 2.0, x)  # a closure over a module with trainable parameters
    assert not usable(lambda t: t * w, x)  # a closure over a tensor that requires grad
    assert not usable(lin, x) and not usable(lin.forward, x)  # the module, or its bound forward
    assert not usable(functools.partial(torch.mul, w), x)
    _w_global = lin
    assert not usable(lambda t: _w_global(t), x)  # a global name
    _w_global = None
    with torch.no_grad():
        assert usable(torch.sin, w) and usable(lin, x)  # grad mode off: nothing is recorded
        f = Fn(torch.sin)
        f.is_backward = True
        assert not warmup.usable(Backend, f, Call(x))
        Backend.warm_in_pool = False  # a warm-up of this tree kept state in its pool
        assert not usable(torch.sin, x)
        Backend.warm_in_pool = True
        config.warmup_in_pool = False
        assert not usable(torch.sin, x)


def _widen(y):
    tmp = new(np.abs(y.value) + 1.0)  # temporaries: a warm-up needs more than its output
    tmp2 = new(np.log(tmp.value))
    release(tmp)
    out = new(tmp2.value * y.value)
    release(tmp2)
    return out


@pytest.mark.parametrize("restore", [True, False])
def test_new_branch_warm_up_reuses_the_other_branch_memory(rng, monkeypatch, restore):
    """The seed's two branches (1 -> 2 -> 4, 1 -> 3 -> 4) with warm-ups in the pool: the second
    branch's warm-up runs after the pool is restored to its recorded parent's checkpoint, so it
    reuses what the first branch's recordings hold and the pool stays at the larger path's size
    (test_tree's max-of-paths test on the GPU). Without the restore it grows."""
    be, mgr = make()
    if not restore:
        monkeypatch.setattr(be, "warm_restores", lambda fn, call: False)
    f1, f2, f3, f4 = (FakeFn(affine, mgr, name="f1"), FakeFn(double, mgr, name="f2"), FakeFn(_widen, mgr, name="f3"),
                      FakeFn(double, mgr, name="f4"))

    def step(branch):
        x = be.tensor(rand(rng, 1 << 18))  # 2 MiB: a segment per block
        out = f4((f2 if branch else f3)(f1(x)))
        y = x.value * 1.5 + 0.25
        z = y * 2.0 - 1.0 if branch else np.log(np.abs(y) + 1.0) * y
        assert np.allclose(out.value, z * 2.0 - 1.0)
        mgr.mark_step_begin()

    for _ in range(4):
        step(True)
    one_path = be.source.reserved_bytes
    for b in [False, True, False, False, True]:
        step(b)
    both = be.source.reserved_bytes
    assert all(n.state is NodeState.RECORDED for n in mgr.nodes())
    check_invariants(be.pool)
    if restore:
        assert both <= one_path, (both, one_path)
    else:
        assert both > one_path, (both, one_path)
