"""GPU tier of the warm-up inside the tree's pool (``cgraw.trees.warmup``,
``cgraw.config.warmup_in_pool``, on by default, for calls autograd records nothing in): results
equal eager, warm-up outputs handed out as a replay's are, state a warm-up keeps stays valid, mixed
torch and CuPy on the caller's streams, eager inputs mutated in place; calls autograd records warm
up outside the pool (or, when the module was out of sight, move the tree to a fresh pool) and train
as eager."""

from __future__ import annotations

import logging

import pytest
from gpu_data import trand

import cgraw
from cgraw.trees.config import config

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _warm_in_pool():
    old = config.warmup_in_pool
    config.warmup_in_pool = True
    yield
    config.warmup_in_pool = old


def _backend():
    from cgraw.trees.graphed import _managers

    return _managers[0].backend


def _in_tree_pool(t) -> bool:
    return _backend()._tts.pool.owner_of()(t.untyped_storage().data_ptr())


@torch.no_grad()
def test_warm_up_output_lies_in_the_pool_and_ends_with_its_generation():
    def body(x):
        t = torch.sin(x) * 3.0  # a temporary: its memory goes back to the pool
        return t.cos() + x

    f = cgraw.graphed(body)
    x = trand(1 << 20)
    y1 = f(x)
    torch.testing.assert_close(y1, body(x))
    assert _in_tree_pool(y1)
    assert _backend().warm_in_pool
    cgraw.mark_step_begin()
    with pytest.raises(RuntimeError, match="overwritten"):
        _ = y1 + 1
    for _ in range(4):
        x = trand(1 << 20)
        torch.testing.assert_close(f(x), body(x))
        cgraw.mark_step_begin()
    assert _backend().warm_in_pool


@torch.no_grad()
def test_warm_up_outside_the_pool_when_turned_off():
    config.warmup_in_pool = False
    f = cgraw.graphed(lambda x: x * 2.0 + 1.0)
    x = trand(4096)
    y1 = f(x)
    cgraw.mark_step_begin()
    f(trand(4096))
    torch.testing.assert_close(y1, x * 2.0 + 1.0)  # still readable: the caller's own memory


@torch.no_grad()
def test_seed_two_branch_program_equals_eager():
    def f1(x):
        return torch.tanh(x * 1.5) + x

    def f2(y):
        return torch.sin(y) * 2.0 + y

    def f3(y):
        return torch.cos(y.abs()) - y

    def f4(z):
        return z * z + 0.5

    g1, g2, g3, g4 = (cgraw.graphed(fn) for fn in (f1, f2, f3, f4))
    for step in range(12):
        x = trand(1 << 18) * (1.0 if step % 2 else -1.0) + (0.5 if step % 2 else -0.5)
        y = g1(x)
        z = g2(y) if float(y.sum()) > 0 else g3(y)
        out = g4(z)
        ry = f1(x)
        ref = f4(f2(ry) if float(ry.sum()) > 0 else f3(ry))
        torch.testing.assert_close(out, ref)
        cgraw.mark_step_begin()
    assert _backend().warm_in_pool
    from cgraw.trees.graphed import _managers

    assert all(st.eager_calls == 0 and st.recordings == st.warmups for st in _managers[0].stats.values())


@torch.no_grad()
def test_h_equals_f_of_h_from_a_warm_up_output():
    def body(h):
        return torch.tanh(h @ w) + 0.1 * h

    w = trand(64, 64) * 0.1
    f = cgraw.graphed(body)
    h = ref = trand(8, 64)
    for _ in range(10):
        h = f(h)
        ref = body(ref)
        torch.testing.assert_close(h, ref, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_state_kept_by_a_warm_up_stays_valid(caplog):
    class Acc(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.total = None  # made on the first call, inside the warm-up

        def forward(self, x):
            if self.total is None:
                self.total = torch.zeros_like(x)
            self.total.add_(x)
            return self.total * 2.0

    m, ref = Acc(), Acc()
    f = cgraw.graphed(m)
    g = cgraw.graphed(lambda x: torch.exp(x * 0.1))  # a recording exists when the state is made
    g(trand(256))
    cgraw.mark_step_begin()
    g(trand(256))
    with caplog.at_level(logging.INFO, logger="cgraw"):
        for _ in range(6):
            x = trand(256)
            torch.testing.assert_close(f(x), ref(x))
            torch.testing.assert_close(m.total, ref.total)
            cgraw.mark_step_begin()
    assert any("moves to a fresh pool" in r.getMessage() for r in caplog.records)
    assert not any("cannot restore" in r.getMessage() for r in caplog.records)
    assert not _backend().warm_in_pool


@torch.no_grad()
def test_mixed_torch_and_cupy_on_a_side_stream_equals_eager():
    cp = pytest.importorskip("cupy")

    def body(x):
        y = torch.sin(x) + 1.0
        c = cp.from_dlpack(y)
        c = cp.tanh(c * 2.0)  # CuPy reads torch's result: both on the warm-up's stream
        return torch.from_dlpack(c) * y

    f = cgraw.graphed(body)
    s = torch.cuda.Stream()
    for _ in range(4):
        x = trand(1 << 20)
        s.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
        with torch.cuda.stream(s), cp.cuda.ExternalStream(s.cuda_stream):
            out = f(x)
            got = out.clone()
        torch.cuda.current_stream().wait_stream(s)
        torch.testing.assert_close(got, body(x))
        cgraw.mark_step_begin()


def test_a_call_autograd_records_warms_up_outside_the_pool():
    lin = torch.nn.Linear(64, 64).cuda()
    f = cgraw.graphed(lambda t: lin(t) * 2.0)  # grad mode on: autograd records the call
    x = trand(8, 64)
    y = f(x)
    assert y.requires_grad and not _in_tree_pool(y)
    assert _backend().warm_in_pool  # not a stash: the warm-up simply ran outside
    cgraw.mark_step_begin()
    with torch.no_grad():
        g = cgraw.graphed(lambda t: lin(t) * 3.0)
        z = g(x)
        assert _in_tree_pool(z)
        torch.testing.assert_close(z, lin(x) * 3.0)


def test_grad_mode_on_without_trainable_state_warms_up_in_the_pool():
    """Grad mode on (no ``no_grad``), nothing requiring grad: the warm-up runs in the pool, its
    output is handed out as a replay's, and an eager input it mutates is mutated as eager does."""
    assert config.warmup_in_pool

    def body(x, acc):
        acc.mul_(0.5).add_(x)  # mutates an eager input
        return torch.sigmoid(x) * acc

    f = cgraw.graphed(body)
    for i in range(6):
        x = trand(1 << 16)
        acc = trand(1 << 16)
        ref_acc = acc.clone()
        ref = body(x, ref_acc)
        y = f(x, acc)
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(acc, ref_acc)
        assert not y.requires_grad
        if i == 0:
            assert _in_tree_pool(y)
        cgraw.mark_step_begin()
    assert _backend().warm_in_pool


def test_module_out_of_sight_records_a_graph_and_moves_the_pool():
    """The module is reached through an object the pre-check does not open (this once
    segfaulted on the H200): the warm-up runs in the pool, records an autograd graph, the tree moves to
    a fresh pool, and the backwards of the warm-up and of the replays give eager gradients."""
    import copy

    class Holder:
        pass

    torch.manual_seed(3)
    holder = Holder()
    holder.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
    ref = copy.deepcopy(holder.net)
    f = cgraw.graphed(lambda t: holder.net(t) * 2.0)
    for i in range(5):
        x = trand(16, 32)
        y = f(x)
        assert y.requires_grad
        if i == 0:
            assert not _backend().warm_in_pool  # the graph was seen after the warm-up
        y.square().mean().backward()
        (ref(x) * 2.0).square().mean().backward()
        for p, q in zip(holder.net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            p.grad = q.grad = None
        cgraw.mark_step_begin()


@torch.no_grad()
def test_enable_grad_inside_a_call_made_without_grad():
    w = (trand(32, 32) * 0.2).requires_grad_()

    def body(x):
        with torch.enable_grad():
            return torch.tanh(x @ w)

    f = cgraw.graphed(body)
    x = trand(8, 32)
    y = f(x)  # warmed up in the pool, but autograd recorded a graph: the tree moves to a fresh pool
    assert not _backend().warm_in_pool
    ref_w = w.detach().clone().requires_grad_()
    with torch.enable_grad():
        torch.testing.assert_close(y, torch.tanh(x @ ref_w))
        y.sum().backward()  # its nodes run on the replaced pool's capture stream, kept alive
        torch.tanh(x @ ref_w).sum().backward()
    torch.testing.assert_close(w.grad, ref_w.grad)


def test_training_forward_gives_eager_gradients():
    old = config.autograd
    config.autograd = True
    try:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)).cuda()
        import copy

        ref = copy.deepcopy(model)
        f = cgraw.graphed(model)
        for _ in range(4):
            x = trand(8, 16)
            f(x).square().mean().backward()
            ref(x).square().mean().backward()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
                p.grad = q.grad = None
            cgraw.mark_step_begin()
    finally:
        config.autograd = old


@pytest.mark.parametrize("empty", [True, False])
def test_recording_releases_torch_cached_memory_first(saved_config, empty):
    """``config.empty_cache_on_record`` (default on): a tree recording empties torch's cache of
    free blocks first, as ``torch.cuda.graph`` does before every capture; off, the cache stays."""
    saved_config.empty_cache_on_record = empty
    f = cgraw.graphed(lambda x: torch.sin(x) * 2.0 + 1.0)
    x = trand(4096)
    torch.testing.assert_close(f(x), torch.sin(x) * 2.0 + 1.0)  # warm-up
    cached = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del cached  # 64 MiB free in torch's cache
    before = torch.cuda.memory_reserved()
    torch.testing.assert_close(f(x), torch.sin(x) * 2.0 + 1.0)  # recorded
    after = torch.cuda.memory_reserved()
    if empty:
        assert after <= before - (60 << 20), (before, after)
    else:
        assert after >= before, (before, after)


def test_in_pool_warm_up_counts_as_routing():
    """While a warm-up routes allocations to the tree's pool, releases wait (``cgraw._cuda.defer``),
    as during a capture: torch asserts when a MemPool is released or its cache emptied then."""
    from cgraw._cuda import defer

    seen = []

    def body(x):
        seen.append(defer.active())
        return x * 3.0

    f = cgraw.graphed(body)
    x = trand(4096)
    y = f(x)
    assert seen == [True] and _in_tree_pool(y)
    assert not defer.active()
    torch.testing.assert_close(y, x * 3.0)
