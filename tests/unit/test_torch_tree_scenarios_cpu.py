"""The scenarios of torch's own graph-tree tests (test/inductor/test_cudagraph_trees.py), run on
the CPU tier against the real ``TreeManager``.

Most use the simulated memory of tests/helpers/fake_tree_backend.py (a replay that writes over a
live output is caught when that output is read; every replay recomputes its result from the
current inputs, so results are compared with eager runs). The autograd ones use CPU torch through
tests/helpers/torch_cpu_backend.py. Each docstring names the torch test with the same scenario.
Where cgraw's documented behaviour (docs/guides/graph-trees.md) differs from torch's, the test
checks cgraw's.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from fake_tree_backend import Overwritten, assign, new
from test_tree_logic import Tree, assert_same, in_pool, rand, values

import cgraw.trees.manager
from allocator import check_invariants
from cgraw.trees.manager import NodeState
from cgraw.trees.config import config


@pytest.fixture(autouse=True)
def _spy(monkeypatch):
    """Calls are classified by the real ``cgraw.trees.calls.inspect``, logged by the fake backend."""
    from fake_tree_backend import spy_inspect

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


def two_outputs(x):
    return new(x.value + 1.0), new(x.value + 2.0)


def cube(x):
    return new(x.value * x.value * x.value)


def plus4(x):
    return new(x.value + 4.0)


def counts(tree, f):
    st = tree.mgr.stats[f.fn_id]
    return st.warmups, st.recordings, st.replays, st.rerecords


# ---------------------------------------------------------------------- liveness and checkpoints


@pytest.mark.parametrize("warm_in_pool", [False, True])
def test_an_output_dropped_before_the_next_recording_and_kept_later_is_never_overwritten(rng, warm_in_pool):
    """torch's trees: test_tensor_dies_between_checkpoint, test_aliased_output_checkpoint,
    test_checkpoint_shared_output_storage_deallocation. ``o1, o2 = f(x)``; ``g(o1)`` is warmed up and
    recorded in generations where ``o2`` was dropped first; in later generations ``o2`` is kept and
    must still read what eager computed after ``g`` replays."""
    tree = Tree()
    tree.be.warm_in_pool = warm_in_pool
    f, g = tree.fn(two_outputs), tree.fn(cube)
    for _ in range(4):
        x = tree.tensor(rand(rng, 32))
        o1, o2 = f(x)
        del o2
        z = g(o1)
        assert_same(z, tree.eager(g, tree.tensor(x.value + 1.0)))
        del o1, z
    assert tree.node("two_outputs", "cube").state is NodeState.RECORDED
    for _ in range(3):
        x = tree.tensor(rand(rng, 32))
        o1, o2 = f(x)
        z = g(o1)
        assert_same(z, tree.eager(g, tree.tensor(x.value + 1.0)))
        np.testing.assert_array_equal(values(o2), x.value + 2.0)
        np.testing.assert_array_equal(values(o1), x.value + 1.0)
    check_invariants(tree.pool)


def test_a_new_function_after_dead_outputs_starts_its_own_root(tree, rng):
    """torch's trees: test_end_recording_early, test_separate_recordings. ``f`` then ``g`` with every
    output dropped in between, three times: ``g`` never hangs under ``f``; each is a root, recorded
    once, and a later ``f`` replays."""
    f, g = tree.fn(cube, name="f"), tree.fn(plus4, name="g")
    for _ in range(3):
        x = tree.tensor(rand(rng, 8))
        out = f(x)
        assert_same(out, tree.eager(f, x))
        del out
        y = tree.tensor(rand(rng, 8))
        out = g(y)
        assert_same(out, tree.eager(g, y))
        del out
    x = tree.tensor(rand(rng, 8))
    assert_same(f(x), tree.eager(f, x))
    assert tree.all_paths() == [("f",), ("g",)]
    assert counts(tree, f)[:2] == (1, 1) and counts(tree, g)[:2] == (1, 1)


def test_input_signatures_are_separate_roots_and_a_kept_output_is_poisoned_on_switching(tree, rng):
    """torch's trees: test_run_simple, test_accumulate_multiple_recordings, test_dynamic_warmup. Two
    input sizes: each warms up once, records once, replays; an output of one recording kept while
    the other size runs belongs to an ended generation (poisoned, never silently overwritten)."""
    f = tree.fn(cube)
    x5, x6 = tree.tensor(rand(rng, 5)), tree.tensor(rand(rng, 6))
    f(x5)
    out1 = f(x5)  # recorded
    f(x6)
    out2 = f(x6)  # recorded: a generation began at each call of the root function
    with pytest.raises(Overwritten):
        values(out1)
    out3 = f(x5)  # replays the size-5 recording
    assert_same(out3, tree.eager(f, x5))
    with pytest.raises(Overwritten):
        values(out2)
    assert len(tree.mgr.roots) == 2 and tree.all_paths() == [("cube",), ("cube",)]
    st = tree.mgr.stats[f.fn_id]
    assert (st.warmups, st.recordings, st.variants, st.rerecords) == (2, 2, 2, 0)


# ---------------------------------------------------------------------- aliases among outputs


def test_an_output_returned_twice_and_a_returned_input(tree, rng):
    """torch's trees: test_aliased_storage_single_weakref, test_output_alias. ``(y, y, x)``: both
    ``y`` are one object, poisoned when the generation ends; the returned input is the caller's
    own tensor, never poisoned, and keeps no path alive once dropped."""

    def dup(x):
        y = new(x.value * 20.0)
        return y, y, x

    f, g = tree.fn(dup), tree.fn(plus4)
    for step in range(4):
        x = tree.tensor(rand(rng, 16))
        a, b, c = f(x)
        assert a is b and c is x
        np.testing.assert_array_equal(values(a), x.value * 20.0)
        tree.mgr.mark_step_begin()
        if step >= 1:  # recorded: a lies in the tree's memory
            assert in_pool(a)
            with pytest.raises(Overwritten):
                values(b)
        np.testing.assert_array_equal(values(c), x.value)
    tree.mgr.mark_step_begin()
    x = tree.tensor(rand(rng, 16))
    f(x)  # everything dropped at once
    y = tree.tensor(rand(rng, 16))
    assert_same(g(y), tree.eager(g, y))
    assert tree.mgr.current.parent is None  # the dead path ended: g starts from a root


def test_returned_static_inputs_and_closure_tensors_are_never_poisoned(tree, rng):
    """torch's trees: test_constant_output, test_alias_of_parameter, test_aliased_static_parameter,
    test_aliasing_static_ref. A function returning its static input (a parameter), a closure
    tensor and a new value: the first two are the very tensors, valid in every generation."""
    w = tree.tensor(rand(rng, 10))
    const = tree.tensor(np.arange(10.0))

    def mod(w, x):
        return w, const, new(w.value * x.value + 2.0)

    def tail(y):
        return new(y.value + 1.0)

    f = tree.fn(mod, static_argnums=(0,))
    g = tree.fn(tail)
    kept = []
    for _ in range(5):
        x = tree.tensor(rand(rng, 10))
        p, c, y = f(w, x)
        z = g(y)
        assert p is w and c is const
        assert_same(y, w.value * x.value + 2.0)
        assert_same(z, (w.value * x.value + 2.0) + 1.0)  # as eager rounds it: y, then + 1
        kept.append((p, c))
    for p, c in kept:  # every generation's are still readable
        np.testing.assert_array_equal(values(p), values(w))
        np.testing.assert_array_equal(values(c), np.arange(10.0))
    assert counts(tree, f)[:2] == (1, 1) and counts(tree, g)[:2] == (1, 1)


# ---------------------------------------------------------------------- mutation


def test_in_place_updates_of_a_tree_output_and_of_an_eager_input_match_eager(tree, rng):
    """torch's trees: test_mutation_cudagraph_managed_tensors, test_mutation_cudagraph_managed_tensor_warn.
    ``tmp = foo(x); mut(tmp)`` where ``mut`` adds 2 in place and returns its argument; then ``mut``
    of an eager copy, which must be updated as eager updates it. ``mut`` is first called with an
    eager input (the warm-up's output of ``foo``)."""

    def foo(x):
        return new(x.value + 1.0)

    def mut(t):
        assign(t, t.value + 2.0)
        return t

    f, m = tree.fn(foo), tree.fn(mut)
    for _ in range(4):
        tree.mgr.mark_step_begin()
        x = tree.tensor(rand(rng, 4))
        tmp = f(x)
        out = m(tmp)
        assert out is tmp
        np.testing.assert_array_equal(values(out), (x.value + 1.0) + 2.0)
    tree.mgr.mark_step_begin()
    x = tree.tensor(rand(rng, 4))
    tmp = f(x)
    copy = tree.tensor(values(tmp))
    assert m(copy) is copy
    np.testing.assert_array_equal(values(copy), (x.value + 1.0) + 2.0)
    np.testing.assert_array_equal(values(tmp), x.value + 1.0)


@pytest.mark.parametrize("mutates", [(), (0,)], ids=["undeclared", "declared"])
def test_in_place_update_of_an_eager_input_after_warm_up_on_a_tree_output(tree, rng, mutates):
    """torch's trees: test_mutation_cudagraph_managed_tensors (its last step). As above, but
    ``foo`` is recorded before ``mut`` is first called, so ``mut``'s warm-up sees a tree output.
    Called later with an eager tensor, ``mut`` warms up again (its first warm-up compared no eager
    input's contents), then records with the copy back: every call updates the caller's tensor."""

    def foo(x):
        return new(x.value + 1.0)

    def mut(t):
        assign(t, t.value + 2.0)
        return t

    f, m = tree.fn(foo), tree.fn(mut, mutates=mutates)
    for _ in range(2):  # foo warmed up and recorded
        f(tree.tensor(rand(rng, 4)))
    for _ in range(3):
        tree.mgr.mark_step_begin()
        x = tree.tensor(rand(rng, 4))
        tmp = f(x)
        np.testing.assert_array_equal(values(m(tmp)), (x.value + 1.0) + 2.0)
    tree.mgr.mark_step_begin()
    x = tree.tensor(rand(rng, 4))
    tmp = f(x)
    copy = tree.tensor(values(tmp))
    m(copy)
    np.testing.assert_array_equal(values(copy), (x.value + 1.0) + 2.0)  # eager: x + 1 + 2
    for _ in range(3):  # the recording with the copy back, then its replays
        tree.mgr.mark_step_begin()
        x = tree.tensor(rand(rng, 4))
        copy = tree.tensor(values(f(x)))
        assert m(copy) is copy
        np.testing.assert_array_equal(values(copy), (x.value + 1.0) + 2.0)


def test_a_closure_buffer_updated_in_place_matches_eager_every_call(tree, rng):
    """torch's trees: test_tensor_constant_mutation, test_mutation_on_inp (its module buffer). A
    buffer read through the closure and incremented in place at every call, as
    ``self.tensor_constant += 1`` does: every call, warm-up, recording and replays, adds one."""
    buf = tree.tensor(np.ones(6))
    ref = np.ones(6)

    def fwd(x):
        assign(buf, buf.value + 1.0)
        return new(x.value + buf.value)

    f = tree.fn(fwd)
    for _ in range(6):
        x = tree.tensor(rand(rng, 6))
        ref = ref + 1.0
        assert_same(f(x), x.value + ref)
        np.testing.assert_array_equal(values(buf), ref)
    assert counts(tree, f) == (1, 1, 4, 0)


# ---------------------------------------------------------------------- static inputs moving


def test_alternating_static_inputs_rerecord_and_every_result_matches_eager(tree, rng):
    """torch's trees: test_multi_dispatch_single_compile_param_inputs, test_multi_dispatch_child_node,
    test_multi_dispatch_parent_node, test_not_fallback_to_eager_if_have_not_recompiling_too_many_times.
    ``y = p_mul(x, p); out = add(y, x)`` with ``p`` switched between two parameters p1, p2, p1.
    torch keeps one recording per parameter address; cgraw re-records the node whose static input
    moved and drops its descendants (documented: "if their address changes the function is
    re-recorded"), so every switch costs one re-record and no call runs eagerly."""

    def p_mul(x, p):
        return new(x.value * p.value)

    def add(y, x):
        return new(y.value + x.value)

    pm, ad = tree.fn(p_mul, static_argnums=(1,)), tree.fn(add)
    p1, p2 = tree.tensor(rand(rng, 4)), tree.tensor(rand(rng, 4))
    switches = 0
    for i, p in enumerate((p1, p2, p1)):
        switches += i > 0
        for _ in range(5):
            x = tree.tensor(rand(rng, 4))
            out = ad(pm(x, p), x)
            assert_same(out, x.value * p.value + x.value)
        assert counts(tree, pm)[3] == switches
    assert tree.mgr.stats[pm.fn_id].eager_calls == 0 and tree.mgr.stats[ad.fn_id].eager_calls == 0
    assert all(r.startswith("static input 1 moved") for r in tree.mgr.stats[pm.fn_id].rerecord_reasons)
    assert tree.node("p_mul", "add").state is NodeState.RECORDED


def test_a_static_input_of_a_child_moving_rerecords_only_the_child(tree, rng):
    """torch's trees: test_multi_dispatch_child_node, test_rerecord_if_static_input_address_changed.
    ``y = cube(x); out = p_mul(y, p)``: p switching re-records ``p_mul`` only."""

    def p_mul(y, p):
        return new(y.value * p.value)

    c, pm = tree.fn(cube), tree.fn(p_mul, static_argnums=(1,))
    p1, p2 = tree.tensor(rand(rng, 4)), tree.tensor(rand(rng, 4))
    for p in (p1, p2, p1, p2):
        for _ in range(3):
            x = tree.tensor(rand(rng, 4))
            assert_same(pm(c(x), p), x.value * x.value * x.value * p.value)
    assert counts(tree, c)[1:4:2] == (1, 0)
    assert counts(tree, pm)[3] == 3


# ---------------------------------------------------------------------- autograd (CPU torch)


torch_only = pytest.mark.torch


@pytest.fixture
def ttree(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch_cpu_backend import CpuTorchBackend, cpu_as_device0

    from cgraw.trees import calls
    from cgraw.trees import config as tree_config

    with cpu_as_device0(monkeypatch):
        tree_config.grad_probe(torch.is_grad_enabled)
        config.autograd = True
        be = CpuTorchBackend()
        mgr = cgraw.trees.manager.TreeManager(be)
        be.mgr = mgr
        yield mgr
        config.autograd = True
        tree_config.grad_probe(None)
        assert calls._grad_mode[0] is None


def tfn(mgr, fn, name=None, params=()):
    from torch_cpu_backend import TorchFn

    return TorchFn(fn, mgr, name=name, params=params)


@torch_only
@pytest.mark.parametrize("create_graph", [False, True])
def test_a_second_backward_through_a_retained_graph_accumulates_as_eager(ttree, create_graph):
    """torch's trees: test_accumulate_grad. ``y = f(x)``; ``y.backward(g, retain_graph=True)`` then
    ``y.backward(g, create_graph=...)``: in place into the same ``x.grad`` without create_graph
    (twice the first gradient), out of place with it (the first ``x.grad`` object unchanged)."""
    import torch

    f = tfn(ttree, lambda x: x + 2, name="plus2")
    for _ in range(4):
        grad_output = torch.ones(5, 5)
        x = torch.randn(5, 5, requires_grad=True)
        y = f(x)
        y.backward(grad_output, retain_graph=True)
        x_grad = x.grad
        x_grad_clone = x.grad.clone()
        y.backward(grad_output, create_graph=create_graph)
        torch.testing.assert_close(y.detach(), x.detach() + 2, rtol=0, atol=0)
        if create_graph:
            assert torch.equal(x_grad, x_grad_clone) and x.grad is not x_grad
            assert torch.equal(x.grad, 2 * x_grad_clone)
        else:
            assert x.grad is x_grad and torch.equal(x_grad, 2 * x_grad_clone)
        ttree.mark_step_begin()


@torch_only
def test_backward_through_one_of_two_outputs(ttree):
    """torch's trees: test_forward_backward_not_called. ``x_out = fx(x); y_out = fy(y)`` (torch's
    graph break: two graphed functions on one path); only ``x_out.sum().backward()``: x gets eager's
    gradient, y none, at every step, and the pending backward of ``fy`` does not stop the steps."""
    import torch

    fx = tfn(ttree, lambda x: x * x * x, name="x_cube")
    fy = tfn(ttree, lambda y: y * y * y, name="y_cube")
    for _ in range(4):
        x, y = (torch.rand(4, 4, requires_grad=True) for _ in range(2))
        x_out, y_out = fx(x), fy(y)
        x_out.sum().backward()
        torch.testing.assert_close(x.grad, 3 * x.detach() ** 2)
        assert y.grad is None
        assert torch.equal(y_out.detach(), y.detach() ** 3)


@torch_only
def test_forwards_with_pending_backwards_then_one_backward(ttree):
    """torch's trees: test_warn_on_pending_backward, test_forward_generation. Forwards with grad whose
    results are rebound without a backward, then a backward of the last one: outputs and gradient
    equal eager's (cgraw extends the path while backwards are pending, where torch runs eagerly)."""
    import torch

    f = tfn(ttree, lambda x: x * x * x, name="cube")
    out = None
    for _ in range(6):
        x = torch.rand(4, 4, requires_grad=True)
        out = f(x)
        assert torch.equal(out.detach(), x.detach() ** 3)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 3 * x.detach() ** 2)
    ttree.mark_step_begin()
    g = tfn(ttree, lambda y: y * 12, name="times12")
    for _ in range(3):
        ones = torch.ones(4, 4, requires_grad=True)
        g(f(ones)).sum().backward()
        torch.testing.assert_close(ones.grad, torch.full((4, 4), 36.0))
        ttree.mark_step_begin()
    assert torch.equal(f(ones.detach()), torch.ones(4, 4))


@torch_only
def test_hooks_on_one_calls_output_do_not_reach_the_next_calls_output(ttree):
    """torch's trees: test_remove_hooks_on_cached_tensors. A hook registered on a replay's output is
    not found on the next call's output, and fires only for its own backward."""
    import torch

    f = tfn(ttree, lambda x: x * x, name="square")
    fired = []
    inp = torch.rand(4, requires_grad=True)
    for i in range(5):
        out = f(inp)
        assert not out._backward_hooks
        out.register_hook(lambda g, i=i: fired.append(i))
        out.sum().backward()
        assert fired[-1] == i and len(fired) == i + 1
    torch.testing.assert_close(inp.grad, 5 * 2 * inp.detach())
    gc.collect()



@torch_only
def test_a_double_backward_through_a_replayed_forward_reaches_its_input(ttree):
    """``g = autograd.grad(f(x).sum(), x, create_graph=True)``, then ``autograd.grad(g.sum(), x)``:
    the recomputed backward of a recorded forward differentiates from ``x`` itself, so the second
    derivative reaches ``x`` as eager's does (it ended at a detached copy: "not used in the graph")."""
    import torch

    f = tfn(ttree, lambda x: x.sin() * 2.0, name="sin2")
    for _ in range(5):
        x = torch.randn(6, requires_grad=True)
        (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        torch.testing.assert_close(g, 2.0 * x.detach().cos())
        torch.testing.assert_close(gg, -2.0 * x.detach().sin())
        ttree.mark_step_begin()
    assert ttree.stats[f.fn_id].recordings == 1


@torch_only
def test_a_module_argument_gets_eagers_gradients_on_every_call(ttree):
    """torch's trees: test_aliasing_static_ref's ``foo(mod, x)``. A module passed as an argument
    reaches the function with its parameters inside it: a recording with grad enabled reads them
    through the aliases its backward differentiates, so ``.grad`` accumulates as eager's (it got
    nothing from the recorded calls)."""
    import torch

    lin, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(lin.state_dict())
    f = tfn(ttree, lambda mod, x: mod(x).tanh(), name="apply")
    for _ in range(5):
        x = torch.randn(4, 3)
        f(lin, x).pow(2).sum().backward()
        ref(x).tanh().pow(2).sum().backward()
        torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad)
        ttree.mark_step_begin()
    assert ttree.stats[f.fn_id].replays >= 2


@torch_only
def test_separate_backwards_of_two_outputs_run_as_eagers_from_the_first_call(ttree):
    """``a, b = f(x)`` with independent graphs; ``a.sum().backward()`` then ``b.sum().backward()``:
    eager runs each graph once. The warm-up's outputs come out of a tap each, so the first
    backward does not run (and free) ``b``'s eager graph."""
    import torch

    f = tfn(ttree, lambda x: (x * 2.0, x * 3.0), name="two")
    for _ in range(4):
        x = torch.randn(3, requires_grad=True)
        a, b = f(x)
        a.sum().backward()
        b.sum().backward()
        torch.testing.assert_close(x.grad, torch.full((3,), 5.0))
        ttree.mark_step_begin()
