"""GPU tier: higher-order operators (torch.cond, while_loop, scan), torch.utils.checkpoint and
torch.func transforms inside @cgraw.graphed functions. Every call gets fresh random inputs and is
compared with eager; the tree's statistics say whether the function was graphed or ran eagerly,
and with which reason. Calls: a warm-up, a recording, then replays."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import rng_stats as S
from gpu_data import full_fp32, trand

import cgraw

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
F = torch.nn.functional

CALLS = 6
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _mgr():
    from cgraw.trees.graphed import _managers

    return _managers[0]


def _stats(f):
    return _mgr().stats[f.fn_id]


def _assert_graphed(f, calls=CALLS):
    s = _stats(f)
    assert s.eager_calls == 0 and not s.skip_reasons, s.skip_reasons
    assert (s.warmups, s.recordings, s.replays) == (1, 1, calls - 2), (s.warmups, s.recordings, s.replays)


def _assert_eager(f, reason):
    s = _stats(f)
    assert s.recordings == 0 and s.eager_calls >= CALLS - 2, (s.recordings, s.eager_calls)
    reasons = " ".join(s.skip_reasons)
    assert reason in reasons, reasons
    assert reason in cgraw.report()


def _true_branch(x):
    return torch.sin(x) * 2.0


def _false_branch(x):
    return torch.cos(x) - 1.0


def _noise_branch(x):
    return torch.rand_like(x)


def _count_below_four(i, y):
    return i < 4


def _tanh_step(i, y):
    return i + 1, torch.tanh(y) * 1.5


def _tanh_scan(carry, row):
    nxt = torch.tanh(carry + row)
    return nxt, nxt * 2.0


# ---------------------------------------------------------------- torch.cond, while_loop, scan


def test_cond_on_a_device_predicate_is_graphed_as_a_conditional_node_and_equals_eager():
    def body(x):
        return torch.cond(x.sum() > 0, _true_branch, _false_branch, (x,)) + 1.0

    f = cgraw.graphed(body)
    for _ in range(CALLS):  # the sign of the sum varies from call to call
        x = trand(256) - 0.5
        torch.testing.assert_close(f(x), body(x), **TOL)
    _assert_graphed(f)
    for positive in (True, False):  # each branch on a replay
        x = trand(256) - 0.5
        x = x.abs() if positive else -x.abs()
        torch.testing.assert_close(f(x), body(x), **TOL)


def test_cond_on_a_host_predicate_is_graphed_and_its_branch_draws_fresh_numbers():
    def body(x):
        return torch.cond(torch.tensor(True), _noise_branch, _false_branch, (x,))

    f = cgraw.graphed(body)
    seen = []
    for _ in range(CALLS):
        u = f(trand(1 << 16))  # torch.rand_like inside the branch, routed to cgraw's generator
        assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
        seen.append(u.cpu().numpy())
    _assert_graphed(f)
    replays = seen[2:]
    for a, b in itertools.pairwise(replays):
        assert not np.array_equal(a, b), "two replays drew the same numbers"
    S.ks_continuous(replays[-1], S.uniform_cdf(), what="rand_like inside a cond branch")


def test_cond_with_a_host_predicate_in_a_capture_draws_fresh_numbers_per_replay():
    x = trand(1 << 14)
    pred = torch.tensor(True)
    torch.cond(pred, _noise_branch, _false_branch, (x,))  # Dynamo compiles torch.cond's wrapper here, not in capture
    with cgraw.capture() as g:
        y = torch.cond(pred, _noise_branch, _false_branch, (x,))
    got = []
    for _ in range(3):
        g.replay()
        u = y.cpu().numpy()
        assert u.min() >= 0.0 and u.max() < 1.0
        got.append(u)
    assert not np.array_equal(got[0], got[1]) and not np.array_equal(got[1], got[2])
    assert g.rng is not None


def test_while_loop_is_graphed_as_a_conditional_node_and_equals_eager():
    def body(x):
        start = torch.zeros((), device=x.device, dtype=torch.int64)
        return torch._higher_order_ops.while_loop(_count_below_four, _tanh_step, (start, x))[1]

    f = cgraw.graphed(body)
    for _ in range(CALLS):
        x = trand(128)
        torch.testing.assert_close(f(x), body(x), **TOL)
    _assert_graphed(f)


def test_scan_is_graphed_and_equals_eager():
    def body(xs, h0):
        return torch._higher_order_ops.scan(_tanh_scan, h0, xs)

    f = cgraw.graphed(body)
    for _ in range(CALLS):
        xs, h0 = trand(7, 32), trand(32)
        got, want = f(xs, h0), body(xs, h0)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)
    _assert_graphed(f)


# ---------------------------------------------------------------- torch.func


def test_func_grad_and_vmap_are_graphed_and_equal_eager():
    def loss(w, x):
        return (torch.tanh(x @ w) ** 2).mean()

    def body(x, w):
        g = torch.func.grad(loss)(w, x)
        per_row = torch.vmap(lambda r: torch.dot(r, w))(x)
        return g, per_row

    f = cgraw.graphed(body)
    with full_fp32():
        for _ in range(CALLS):
            x, w = trand(64, 32), trand(32)
            for a, b in zip(f(x, w), body(x, w)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    _assert_graphed(f)


# ---------------------------------------------------------------- torch.utils.checkpoint


class _Block(torch.nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.reentrant = reentrant

    def inner(self, x):
        return self.b(torch.relu(self.a(x)))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _train_beside_eager(model, make_input):
    """CALLS calls of the graphed model beside an eager copy: outputs and gradients compared."""
    ref = copy.deepcopy(model)
    f = cgraw.graphed(model)
    with full_fp32():
        for _ in range(CALLS):
            x = make_input()
            y, want = f(x), ref(x)
            torch.testing.assert_close(y, want, **TOL)
            y.square().sum().backward()
            want.square().sum().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
                p.grad = q.grad = None
    return f


def test_non_reentrant_checkpoint_is_graphed_forward_and_backward():
    torch.manual_seed(0)
    f = _train_beside_eager(_Block(reentrant=False).cuda(), lambda: trand(16, 64))
    _assert_graphed(f)
    back = [s for s in _mgr().stats.values() if s.name.endswith(".backward")]
    assert back and all(s.recordings >= 1 and s.eager_calls == 0 for s in back), [
        (s.name, s.recordings, s.eager_calls, s.skip_reasons) for s in back]


def test_reentrant_checkpoint_with_gradients_runs_eagerly_with_the_reason():
    torch.manual_seed(0)
    # the reentrant form differentiates only through an input that requires grad
    f = _train_beside_eager(_Block(reentrant=True).cuda(), lambda: trand(16, 64).requires_grad_())
    _assert_eager(f, "use_reentrant=True")


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpoint_without_gradients_is_graphed():
    torch.manual_seed(0)
    model = _Block(reentrant=True).cuda().requires_grad_(False)
    f = cgraw.graphed(model)
    with full_fp32():
        for _ in range(CALLS):
            x = trand(16, 64)
            torch.testing.assert_close(f(x), model(x), **TOL)
    _assert_graphed(f)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_that_draws_runs_eagerly_and_recomputes_the_same_mask(reentrant):
    """Non-reentrant: the recording refuses the draw (cgraw's numbers cannot be drawn again by the
    recomputation); reentrant: the warm-up already sends it eager (its backward refuses autograd.grad)."""
    from torch.utils.checkpoint import checkpoint

    def body(x):
        return checkpoint(lambda v: F.dropout(v, 0.5, training=True), x, use_reentrant=reentrant)

    f = cgraw.graphed(body)
    for _ in range(CALLS):
        x = trand(4096).requires_grad_()
        y = f(x)
        y.sum().backward()
        kept = y.detach() != 0
        # the recomputation in backward drew the forward's mask again (torch's promise, kept eagerly)
        torch.testing.assert_close(x.grad, kept.float() * 2.0)
        S.frequency_check(int(kept.sum()), kept.numel(), 0.5, what="dropout keep rate")
    _assert_eager(f, "use_reentrant=True" if reentrant else "graphed draws cannot do")
