"""GPU tier for autograd through graphed functions (``cgraw.trees.autograd``), with
``cgraw.config.autograd = True`` (the default). A backward capture needs the closure tensors read
through aliases (a parameter's AccumulateGrad node would otherwise run on the default stream); the
``.sum()`` cases are below.

Each training test runs the forward graphed and ``loss.backward()`` + ``optimizer.step()``
outside, beside an eager deep copy of the model on the same fresh random inputs, and compares
gradients (after each backward) and parameters (after each step): bitwise for the MLP, tight
tolerances where cuDNN, SDPA or a different cuBLAS workspace may pick other kernels.
"""

from __future__ import annotations

import copy

import pytest
from gpu_data import full_fp32, trand

import cgraw

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees", "autograd_on")]
torch = pytest.importorskip("torch")

STEPS = 20
TOL = dict(rtol=2e-4, atol=2e-5)


@pytest.fixture
def autograd_on():
    prev, cgraw.config.autograd = cgraw.config.autograd, True  # the default
    with full_fp32():
        yield
    cgraw.config.autograd = prev


def _mgr():
    from cgraw.trees.graphed import _managers

    return _managers[0]


def _backward_stats():
    return [s for s in _mgr().stats.values() if s.name.endswith(".backward")]


def _in_pool(t) -> bool:
    return _mgr().backend._pool_owner()(t.data_ptr())


def _opt(name, params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9) if name == "sgd" else torch.optim.Adam(params, lr=1e-3)


def _compare(model, ref, exact, what):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        for a, b, kind in ((p, q, "param"), (p.grad, q.grad, "grad")):
            assert (a is None) == (b is None), f"{what}: {kind} {n}"
            if a is None:
                continue
            if exact:
                assert torch.equal(a, b), f"{what}: {kind} {n} differs"
            else:
                torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {kind} {n}: {m}")
        if p.grad is not None:
            assert not _in_pool(p.grad), f"{n}.grad aliases the tree's pool"


def _train(model, batch, loss_fn, opt_name, *, exact, steps=STEPS, accumulate=1, forward=None):
    """``steps`` steps of graphed forward + eager backward and optimizer, beside eager."""
    ref = copy.deepcopy(model)
    g = cgraw.graphed(forward(model) if forward else model)
    r = forward(ref) if forward else ref
    opt, ropt = _opt(opt_name, model.parameters()), _opt(opt_name, ref.parameters())
    for step in range(steps):
        for _ in range(accumulate):
            inputs = batch()
            loss = loss_fn(g(*inputs), inputs)
            rloss = loss_fn(r(*inputs), inputs)
            assert loss.requires_grad
            loss.backward()
            rloss.backward()
        _compare(model, ref, exact, f"step {step} gradients")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        _compare(model, ref, exact, f"step {step} parameters")
    assert sum(s.replays for s in _backward_stats()) >= steps - 3, cgraw.report()
    return g, ref


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_mlp_training_equals_eager_bitwise(opt):
    _train(_mlp(), lambda: (trand(32, 64),), lambda out, _: out.pow(2).mean(), opt, exact=True)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_resnet18_training(opt):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    try:
        model = tv.models.resnet18(num_classes=10).cuda()
        _train(model, lambda: (trand(4, 3, 64, 64), torch.randint(0, 10, (4,), device="cuda")),
               lambda out, inp: torch.nn.functional.cross_entropy(out, inp[1]), opt, exact=False,
               forward=lambda m: (lambda x, y: m(x)))
    finally:
        torch.backends.cudnn.deterministic = False


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_gpt2_training(opt):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=500, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).cuda().train()

    def batch():
        return (torch.randint(0, 500, (2, 32), device="cuda"),)

    def loss_fn(logits, inp):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 500), inp[0][:, 1:].reshape(-1))

    _train(model, batch, loss_fn, opt, exact=False, forward=lambda m: (lambda ids: m(ids).logits))


def test_gradient_accumulation():
    _train(_mlp(), lambda: (trand(16, 64),), lambda out, _: out.pow(2).mean(), "sgd", exact=True, accumulate=3)


def test_frozen_sub_module():
    model = _mlp()
    model[0].requires_grad_(False)
    _train(model, lambda: (trand(32, 64),), lambda out, _: out.pow(2).mean(), "adam", exact=True)
    assert model[0].weight.grad is None


# ``loss(out, r)``: "weighted" sums out * r (r fresh and random: a dense incoming gradient), compared
# bitwise; "sum" is out.sum(), compared within SUM_TOL. On the H200 (a probe of 6 steps)
# graphed .sum() gradients differed from eager by one or two ulps (relative 5e-8 to 1e-7) in the
# weight gradient of the last layer only, and were bitwise equal with the incoming gradient
# materialised (out.backward(ones)) on both sides or with a mean-of-squares loss: sum's gradient is
# a stride-0 expansion, which the graph reads from a contiguous copy; its GEMM then rounds otherwise
# (mechanism not proven; a follow-up).
SUM_TOL = dict(rtol=1e-6, atol=1e-5)
LOSSES = ["weighted", "sum"]


def _loss(kind, out, r):
    return (out * r).sum() if kind == "weighted" else out.sum()


def _compare_loss(kind, model, ref, what):
    if kind == "weighted":
        _compare(model, ref, True, what)
        return
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **SUM_TOL, msg=lambda m, n=n: f"{what}: grad {n}: {m}")


@pytest.mark.parametrize("kind", LOSSES)
def test_grad_with_respect_to_an_input(kind):
    model = _mlp()
    ref = copy.deepcopy(model)
    g = cgraw.graphed(model)
    for _ in range(STEPS):
        x = trand(8, 64).requires_grad_()
        xr = x.detach().clone().requires_grad_()
        r = trand(8, 10)
        _loss(kind, g(x), r).backward()
        _loss(kind, ref(xr), r).backward()
        assert torch.equal(x.grad, xr.grad) and not _in_pool(x.grad)
    _compare_loss(kind, model, ref, "input grads")


def test_eval_calls_interleaved_with_training():
    model = _mlp()
    ref = copy.deepcopy(model)
    g = cgraw.graphed(model)
    for step in range(STEPS):
        x = trand(32, 64)
        g(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        with torch.no_grad():
            y = g(x)
            assert not y.requires_grad and torch.equal(y, ref(x))
        if step % 3 == 0:  # evaluation with grad enabled, outputs dropped unused
            y = g(x)
            assert y.requires_grad and torch.equal(y.detach(), ref(x).detach())
            del y
    _compare(model, ref, True, "interleaved")
    assert len(_mgr().nodes()) < 12, _mgr().describe()  # the path did not keep deepening


def test_two_graphed_functions_chained():
    m1, m2 = _mlp(), torch.nn.Linear(10, 4).cuda()
    r1, r2 = copy.deepcopy(m1), copy.deepcopy(m2)
    g1, g2 = cgraw.graphed(m1), cgraw.graphed(m2)
    for _ in range(STEPS):
        x = trand(16, 64).requires_grad_()
        xr = x.detach().clone().requires_grad_()
        g2(g1(x)).pow(2).sum().backward()
        r2(r1(xr)).pow(2).sum().backward()
        assert torch.equal(x.grad, xr.grad)
    _compare(m1, r1, True, "first")
    _compare(m2, r2, True, "second")
    assert len(_backward_stats()) == 2 and all(s.replays for s in _backward_stats())


@pytest.mark.parametrize("kind", LOSSES)
def test_backward_never_called_stays_correct(kind):
    model = _mlp()
    ref = copy.deepcopy(model)
    g = cgraw.graphed(model)
    for step in range(STEPS):
        x = trand(32, 64)
        out = g(x)
        assert torch.equal(out.detach(), ref(x).detach())
        if step % 4 == 3:
            r = trand(32, 10)
            _loss(kind, out, r).backward()
            _loss(kind, ref(x), r).backward()
    _compare_loss(kind, model, ref, "sometimes trained")


@pytest.mark.parametrize("kind", LOSSES)
def test_backward_after_a_second_forward(kind):
    model = _mlp()
    ref = copy.deepcopy(model)
    g = cgraw.graphed(model)
    for _ in range(STEPS):
        x1, x2, r = trand(8, 64), trand(8, 64), trand(8, 10)
        a, b = g(x1), g(x2)
        (a.pow(2).sum() + _loss(kind, b, r)).backward()
        (ref(x1).pow(2).sum() + _loss(kind, ref(x2), r)).backward()
    _compare_loss(kind, model, ref, "two forwards")


def test_dynamic_shapes_under_backward():
    model = _mlp()
    ref = copy.deepcopy(model)
    g = cgraw.graphed(model)
    for step in range(STEPS):
        x = trand((8, 16, 24)[step % 3], 64)
        g(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
    _compare(model, ref, True, "dynamic shapes")


def test_create_graph_and_double_backward_recompute():
    model = _mlp()
    ref = copy.deepcopy(model)
    g = cgraw.graphed(model)
    for _ in range(6):
        x = trand(8, 64).requires_grad_()
        xr = x.detach().clone().requires_grad_()
        (gx,) = torch.autograd.grad(g(x).pow(2).sum(), x, create_graph=True)
        (gr,) = torch.autograd.grad(ref(xr).pow(2).sum(), xr, create_graph=True)
        torch.testing.assert_close(gx, gr, **TOL)
        gx.sum().backward()
        gr.sum().backward()
    _compare(model, ref, False, "double backward")
    assert any("create_graph" in r for s in _mgr().stats.values() for r in s.skip_reasons)


def test_make_graphed_callables_module_and_function():
    model = _mlp()
    ref = copy.deepcopy(model)
    fn = lambda a, b: torch.tanh(a) * b  # noqa: E731
    gm, gf = cgraw.make_graphed_callables((model, fn), ((trand(32, 64),),
                                                         (trand(4, 4).requires_grad_(), trand(4, 4))))
    opt, ropt = _opt("sgd", model.parameters()), _opt("sgd", ref.parameters())
    for _ in range(STEPS):
        cgraw.mark_step_begin()
        x = trand(32, 64)
        gm(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        a = trand(4, 4).requires_grad_()
        gf(a, trand(4, 4)).sum().backward()
        assert a.grad is not None
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    _compare(model, ref, True, "make_graphed_callables")
    model.eval()  # a training flag other than at capture: the original forward, eagerly
    x = trand(32, 64)
    assert torch.equal(gm(x), ref.eval()(x))
    with pytest.raises(ValueError):
        cgraw.make_graphed_callables(model, (x,), pool=object())


def test_whole_step_graphing_keeps_working():
    model = _mlp()
    ref = copy.deepcopy(model)
    opt, ropt = _opt("sgd", model.parameters()), _opt("sgd", ref.parameters())

    def step(m, o, x):
        loss = m(x).pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad(set_to_none=False)
        return loss.detach()

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    g = cgraw.graphed(lambda x: step(model, opt, x))
    for _ in range(STEPS):
        x = trand(32, 64)
        torch.testing.assert_close(g(x), step(ref, ropt, x), **TOL)
    _compare(model, ref, False, "whole step")
