"""CPU tests of the torch side of autograd through graphed functions (``interop.torch.autograd``).

The real ``TreeManager`` and the real ``_Graphed`` Function, ``BackwardFn`` and recording helpers,
over CPU torch with ``torch_cpu_backend.CpuTorchBackend`` standing in for the CUDA backend (a
replay writes its results into the capture's own tensors, as a graph does). Gradients and
parameters are compared with eager torch bitwise (same CPU kernels). Nothing here needs CUDA;
the same scenarios on the H200 are in tests/gpu/test_autograd.py.
"""

from __future__ import annotations

import copy
import gc
import logging

import pytest

torch = pytest.importorskip("torch")

from torch_cpu_backend import CpuTorchBackend, TorchFn, cpu_as_device0  # noqa: E402

from cgraw.trees import calls
from cgraw.trees import config as tree_config
from cgraw.errors import CgrawError  # noqa: E402
from cgraw.trees.manager import NodeState, TreeManager
from cgraw.trees.config import config  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def _autograd(monkeypatch):
    with cpu_as_device0(monkeypatch):
        tree_config.grad_probe(torch.is_grad_enabled)
        config.autograd = True
        yield
        config.autograd = True  # the default (a test may turn it off)
        tree_config.grad_probe(None)
        assert calls._grad_mode[0] is None


@pytest.fixture
def tree():
    be = CpuTorchBackend()
    mgr = TreeManager(be)
    be.mgr = mgr
    torch.manual_seed(16)
    return mgr


def mlp(seed=0, frozen=False):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if frozen:
        m[0].requires_grad_(False)
    return m


def graphed(mgr, model, name="mlp"):
    return TorchFn(model, mgr, name=name, params=list(model.parameters()))


def assert_same(a_model, b_model, exact=True):
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.equal(p, q), n
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert same(p.grad, q.grad), n


def backward_kinds(mgr):
    return [e for e in mgr.backend.log if e[1].endswith(".backward")]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_training_steps_equal_eager_and_replay_the_backward(tree, opt):
    model = mlp()
    ref = copy.deepcopy(model)
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if opt == "sgd" else (lambda ps: torch.optim.Adam(ps, lr=1e-2))
    o1, o2 = make(model.parameters()), make(ref.parameters())
    f = graphed(tree, model)
    for step in range(8):
        x = torch.randn(5, 8)
        out = f(x)
        assert out.requires_grad
        loss = (out * out).sum()
        loss.backward()
        o1.step()
        o1.zero_grad()
        rl = (ref(x) ** 2).sum()
        assert torch.equal(loss.detach(), rl.detach())
        rl.backward()
        o2.step()
        o2.zero_grad()
        assert_same(model, ref)
    be = tree.backend
    assert be.count("record", "mlp") == 1 and be.count("record", "mlp.backward") == 1
    assert be.count("replay", "mlp.backward") >= 5


def test_gradients_accumulate_and_never_alias_the_recording(tree):
    model, ref = mlp(), mlp()
    f = graphed(tree, model)
    for _ in range(4):
        x = torch.randn(3, 8)
        f(x).sum().backward()
        ref(x).sum().backward()
    assert_same(model, ref)
    bnode = [n for n in tree.nodes() if n.fn.name == "mlp.backward" and n.state is NodeState.RECORDED]
    assert bnode
    ptrs = {t.data_ptr() for n in bnode for t in n.recording.out_leaves}
    assert not ptrs & {p.grad.data_ptr() for p in model.parameters()}


def test_grad_of_an_input_and_a_frozen_sub_module(tree):
    model, ref = mlp(frozen=True), mlp(frozen=True)
    f = graphed(tree, model)
    for _ in range(4):
        x = torch.randn(3, 8, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        f(x).pow(2).sum().backward()
        ref(xr).pow(2).sum().backward()
        assert torch.equal(x.grad, xr.grad)
    assert_same(model, ref)
    assert model[0].weight.grad is None


def test_unfreezing_warms_the_node_up_again(tree):
    model, ref = mlp(frozen=True), mlp(frozen=True)
    f = graphed(tree, model)
    for step in range(6):
        if step == 3:
            model[0].requires_grad_(True)
            ref[0].requires_grad_(True)
        x = torch.randn(3, 8)
        f(x).sum().backward()
        ref(x).sum().backward()
    assert_same(model, ref)
    assert any("requires_grad" in r for r in tree.stats[f.fn_id].rerecord_reasons)


def test_no_grad_calls_select_a_forward_only_recording(tree):
    model = mlp()
    f = graphed(tree, model)
    for _ in range(3):
        x = torch.randn(2, 8)
        f(x).sum().backward()
        with torch.no_grad():
            y = f(x)
        assert not y.requires_grad
        assert torch.equal(y, model(x).detach())
        with torch.inference_mode():
            assert not f(x).requires_grad
    keys = {n.key for n in tree.nodes() if n.fn is f}
    assert len(keys) == 2  # with grad (GRAD in the key) and without


def test_backward_never_called_stays_correct(tree):
    model, ref = mlp(), mlp()
    f = graphed(tree, model)
    for step in range(5):
        x = torch.randn(2, 8)
        out = f(x)
        assert torch.equal(out.detach(), ref(x).detach())
        if step % 2:
            out.sum().backward()
            ref(x).sum().backward()
        del out
        gc.collect()
    assert_same(model, ref)


def test_backward_after_a_second_forward(tree):
    model, ref = mlp(), mlp()
    f = graphed(tree, model)
    for _ in range(4):
        x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
        a, b = f(x1), f(x2)  # f -> f: two sets of saved activations
        (a.pow(2).sum() + b.sum()).backward()
        (ref(x1).pow(2).sum() + ref(x2).sum()).backward()
        assert_same(model, ref)


def test_two_graphed_functions_chained(tree):
    m1, m2 = mlp(1), torch.nn.Linear(4, 3)
    r1, r2 = copy.deepcopy(m1), copy.deepcopy(m2)
    f1, f2 = graphed(tree, m1, "m1"), graphed(tree, m2, "m2")
    for _ in range(5):
        x = torch.randn(2, 8, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        f2(f1(x)).pow(2).sum().backward()
        r2(r1(xr)).pow(2).sum().backward()
        assert torch.equal(x.grad, xr.grad)
    assert_same(m1, r1)
    assert_same(m2, r2)
    assert tree.backend.count("replay", "m1.backward") >= 2


def test_a_graph_alive_through_the_loss_keeps_the_path_and_a_freed_one_ends_it(tree):
    """``loss = f(x).pow(2).sum()`` keeps f's autograd graph (its output tensor is gone): a
    graphed function called before the backward extends the path, and the gradients equal
    eager's. After the backward, with the loss and every output dropped, the next new function
    starts from a root; so does one after an evaluation with grad enabled whose output is
    dropped (its graph goes with it)."""
    model, ref = mlp(), mlp()
    f = graphed(tree, model)
    g = TorchFn(lambda z: z * 2.0 - 1.0, tree, name="g")
    h = TorchFn(lambda z: z + 0.5, tree, name="h")
    for _ in range(4):
        x = torch.randn(3, 8)
        loss = f(x).pow(2).sum()
        z = torch.randn(5)
        assert torch.equal(g(z), z * 2.0 - 1.0)
        assert [n.fn.name for n in tree.current.path()] == ["mlp", "g"]
        loss.backward()
        ref(x).pow(2).sum().backward()
        assert_same(model, ref)
        del loss
        assert torch.equal(h(z), z + 0.5)
        assert [n.fn.name for n in tree.current.path()] == ["h"]
        tree.mark_step_begin()
    f(torch.randn(3, 8))  # evaluation with grad enabled, the output dropped
    assert torch.equal(h(z), z + 0.5)
    assert [n.fn.name for n in tree.current.path()] == ["h"]
    assert tree.stats[g.fn_id].replays == 2 and tree.stats[h.fn_id].replays >= 2


def test_create_graph_recomputes_and_double_backward_matches(tree, caplog):
    model, ref = mlp(), mlp()
    f = graphed(tree, model)
    for _ in range(3):
        x = torch.randn(2, 8, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        (gx,) = torch.autograd.grad(f(x).pow(2).sum(), x, create_graph=True)
        (gr,) = torch.autograd.grad(ref(xr).pow(2).sum(), xr, create_graph=True)
        assert torch.equal(gx, gr)
        gx.sum().backward()
        gr.sum().backward()
        assert_same(model, ref, exact=False)  # autograd sums the paths in another order
    assert any("create_graph" in r for r in tree.stats[f.fn_id].skip_reasons)


def test_backward_after_the_generation_ended_recomputes(tree, caplog):
    m1, m2 = mlp(), torch.nn.Linear(4, 3)
    r1, r2 = copy.deepcopy(m1), copy.deepcopy(m2)
    f1, f2 = graphed(tree, m1, "m1"), graphed(tree, m2, "m2")
    for _ in range(4):
        x = torch.randn(2, 8)
        out = f2(f1(x))
        tree.mark_step_begin()  # orphans both forwards; f2 read f1's output in the tree's memory
        out.sum().backward()
        r2(r1(x)).sum().backward()
    assert_same(m1, r1)
    assert_same(m2, r2)


def test_eval_interleaved_with_training_and_dynamic_shapes(tree):
    model, ref = mlp(), mlp()
    f = graphed(tree, model)
    for step in range(6):
        x = torch.randn(2 + step % 3, 8)
        f(x).sum().backward()
        ref(x).sum().backward()
        with torch.no_grad():
            assert torch.equal(f(x[:1]), ref(x[:1]))
    assert_same(model, ref)


def test_an_error_plan_raises_the_reason(tree):
    model = mlp()
    f = graphed(tree, model)
    x = torch.randn(2, 8)
    f(x).sum().backward()
    out = f(x)
    ticket = tree.book.tickets[-1]
    ticket.lost = "kept inputs are gone"
    with pytest.raises(CgrawError, match="kept inputs are gone"):
        out.sum().backward()


def test_tickets_report_freed_and_never_needed(tree):
    f = TorchFn(lambda x: x * 2, tree, name="double")
    f(torch.randn(3))  # no input requires grad: nothing to differentiate
    assert tree.book.tickets[-1].released and not tree.book.tickets[-1].needed
    model = mlp()
    g = graphed(tree, model)
    out = g(torch.randn(2, 8))
    t = tree.book.tickets[-1]
    assert not t.released
    del out
    gc.collect()
    assert t.released


def test_autograd_off_keeps_keys_as_on_main(tree, caplog):
    config.autograd = False
    model = mlp()
    f = graphed(tree, model)
    caplog.set_level(logging.INFO)
    for _ in range(3):
        out = f(torch.randn(2, 8))
    assert not out.requires_grad and not tree.book.tickets
    assert all(len(n.key) == 1 for n in tree.nodes())


def test_an_output_a_graph_cannot_hand_out_runs_eagerly_with_grad_enabled(tree):
    """A function returning a sparse tensor with grad enabled (the tap of the eager forward
    must not flatten the output and raise SkipCall out of the user's call, as it did on the H200): it runs
    eagerly, returns eager's result every call, and the reason is kept."""
    def sparse_out(x):
        return (x * 2.0).to_sparse()

    f = TorchFn(sparse_out, tree, name="sparse_out")
    for _ in range(4):
        x = torch.randn(4, 4)
        got = f(x)
        assert got.layout is torch.sparse_coo and torch.equal(got.to_dense(), x * 2.0)
    x = torch.randn(4, 4, requires_grad=True)  # an input that requires grad: the eager graph is eager's
    f(x).to_dense().sum().backward()
    assert torch.equal(x.grad, torch.full((4, 4), 2.0))


def test_gradients_leave_the_tree_in_one_foreach_copy_that_accumulate_grad_keeps(tree, monkeypatch):
    """Each replayed backward copies its gradients out of the tree's memory with one
    ``_foreach_mul(srcs, 1.0)``; with ``.grad`` set to None AccumulateGrad keeps those copies as they
    are (no clone per parameter), and they never alias the backward recording's outputs. The
    backward's own outputs are not handed out, so the generation's end does not poison them."""
    from cgraw.interop.torch import autograd as torch_autograd

    copies, made, aliased = [], [], []
    real_mul, real_out = torch._foreach_mul, torch_autograd.copied_out
    monkeypatch.setattr(torch, "_foreach_mul", lambda t, c: (copies.append((len(t), c)), real_mul(t, c))[1])

    def tree_outs():
        return {t.data_ptr() for n in tree.nodes() if n.fn.name == "mlp.backward" and n.state is NodeState.RECORDED
                for t in n.recording.out_leaves}

    def spy(grads):
        out = real_out(grads)
        made.append({g.data_ptr() for g in out if g is not None})
        aliased.append(bool(made[-1] & tree_outs()))  # checked while both are alive: freed addresses are reused
        return out

    monkeypatch.setattr(torch_autograd, "copied_out", spy)
    model, ref = mlp(), mlp()
    f = graphed(tree, model)
    n_params = len(list(model.parameters()))
    for _ in range(6):
        x = torch.randn(3, 8)
        f(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        assert_same(model, ref)
        if made:
            assert {p.grad.data_ptr() for p in model.parameters()} == made[-1]  # kept, not cloned again
        assert not [name for name, _ in tree.outs.handed if name == "mlp.backward"]
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert len(made) >= 3 and copies.count((n_params, 1.0)) == len(made)  # one copy of every gradient per replay
    assert tree_outs() and not any(aliased)


def test_copied_out_keeps_every_value_bit_for_bit_and_the_gaps():
    from cgraw.interop.torch.autograd import copied_out

    a = torch.tensor([-0.0, 0.0, 1e-45, -1e-40, float("inf"), -float("inf"), 3.5, float("nan")])
    b = torch.randn(4, 3).t()  # a transposed gradient keeps its strides
    h = torch.randn(5).half()
    out = copied_out((None, a, b, None, h))
    assert out[0] is None and out[3] is None and len(out) == 5
    for src, got in ((a, out[1]), (b, out[2]), (h, out[4])):
        assert got.data_ptr() != src.data_ptr() and got.dtype == src.dtype and got.stride() == src.stride()
        same = got.view(torch.int16 if got.dtype == torch.half else torch.int32)
        want = src.view(torch.int16 if src.dtype == torch.half else torch.int32)
        nan = torch.isnan(src)
        assert torch.equal(same[~nan], want[~nan]) and torch.isnan(got[nan]).all()
    assert copied_out((None, None)) == (None, None)
