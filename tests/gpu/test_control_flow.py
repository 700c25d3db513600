"""GPU tier of cgraw.while_loop and cgraw.cond inside captures and graphed functions: every replay
gets fresh random inputs and is compared with the host path (the same functions run eagerly,
one host synchronisation per iteration). The ``pool`` fixture checks that no block leaked and the
autouse fixture that no graph did."""

from __future__ import annotations

import re

import numpy as np
import pytest
from gpu_data import rng, trand

import cgraw

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

TOL = 1e-4


def _halving():
    def cond_fn(x, n):
        return ((x - 2).norm() > TOL) & (n < 1000)

    def body_fn(x, n):
        return x * 0.5 + 1, n + 1

    return cond_fn, body_fn


def _halving_captured(pool, size: int):
    """``(graph, x0, n0, x, n)``: the halving loop captured on ``x0`` (``size`` values) and ``n0``."""
    cond_fn, body_fn = _halving()
    x0 = trand(size) * 100
    n0 = torch.zeros((), dtype=torch.int64, device="cuda")
    with cgraw.capture(pool=pool) as g:
        x, n = cgraw.while_loop(cond_fn, body_fn, (x0, n0))
    return g, x0, n0, x, n


def test_torch_while_until_device_norm(pool, tmp_path):
    cond_fn, body_fn = _halving()
    g, x0, n0, x, n = _halving_captured(pool, 4096)
    text = str(g)  # the loop's node, then its body's nodes (the set-condition kernel among them)
    assert "CONDITIONAL (WHILE)" in text and "body 0 of NODE" in text, text
    (loop,) = [n for n in g.nodes() if n.type == "CONDITIONAL"]
    assert loop.condition == "while" and any(k.kernel and "cgraw_set_condition" in k.kernel for k in loop.bodies[0])
    with open(g.to_dot(str(tmp_path / "loop.dot"))) as f:
        dot = f.read()
    assert "cgraw_set_condition" in dot, "the Graphviz view does not draw the loop's body"  # a kernel only the body has
    for _ in range(3):
        x0.copy_(trand(4096) * float(rng.uniform(1, 1000)))
        g.replay()
        hx, hn = cgraw.while_loop(cond_fn, body_fn, (x0, n0))
        torch.cuda.synchronize()
        assert int(n) == int(hn) > 5
        torch.testing.assert_close(x, hx, rtol=0, atol=0)
        assert int(n0) == 0  # the carried inputs are never written


def test_swap_body_keeps_every_value(pool):
    a0, b0 = trand(64), trand(64)
    k0 = torch.zeros((), dtype=torch.int32, device="cuda")

    def cond_fn(a, b, k):
        return k < 7

    def body_fn(a, b, k):
        return b, a + b, k + 1  # a result that is another carried buffer: staged before the copies

    with cgraw.capture(pool=pool) as g:
        a, b, k = cgraw.while_loop(cond_fn, body_fn, (a0, b0, k0))
    for _ in range(2):
        a0.copy_(trand(64))
        b0.copy_(trand(64))
        g.replay()
        ha, hb, hk = cgraw.while_loop(cond_fn, body_fn, (a0, b0, k0))
        torch.cuda.synchronize()
        assert torch.equal(a, ha) and torch.equal(b, hb) and int(k) == 7


def test_in_place_body(pool):
    x0 = trand(256).abs() + 1

    def body_fn(x, n):
        x.mul_(0.5)
        n.add_(1)
        return x, n

    with cgraw.capture(pool=pool) as g:
        x, n = cgraw.while_loop(lambda x, n: x.max() > 1e-2, body_fn,
                                (x0, torch.zeros((), dtype=torch.int64, device="cuda")))
    g.replay()
    hx, hn = cgraw.while_loop(lambda x, n: x.max() > 1e-2, body_fn,
                              (x0, torch.zeros((), dtype=torch.int64, device="cuda")))
    torch.cuda.synchronize()
    assert int(n) == int(hn) and torch.equal(x, hx)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_takes_each_branch(pool, sign):
    a = trand(1000)

    def t(v):
        return v.relu() * 2, v.sum()

    def f(v):
        return -v.abs(), v.mean()

    with cgraw.capture(pool=pool) as g:
        y, s = cgraw.cond(a.sum() > 0, t, f, (a,))
    for flip in (sign, -sign, sign):
        a.copy_(flip * torch.rand(1000, device="cuda"))
        g.replay()
        ey, es = t(a) if a.sum() > 0 else f(a)
        torch.cuda.synchronize()
        assert torch.equal(y, ey)
        torch.testing.assert_close(s, es)


def test_nested_while_in_cond(pool):
    x0 = trand(128) * 50

    def t(x):
        n0 = torch.zeros((), dtype=torch.int64, device="cuda")
        return cgraw.while_loop(lambda v, n: v.abs().max() > 1, lambda v, n: (v * 0.5, n + 1), (x, n0))

    def f(x):
        return x.clone(), torch.full((), -1, dtype=torch.int64, device="cuda")

    def prog(x):
        return cgraw.cond(x[0] > 0, t, f, (x,))

    with cgraw.capture(pool=pool) as g:
        y, n = prog(x0)
    for _ in range(4):
        x0.copy_(trand(128) * float(rng.uniform(1, 100)))
        g.replay()
        ey, en = prog(x0)
        torch.cuda.synchronize()
        assert torch.equal(y, ey) and int(n) == int(en)


def test_body_allocations_come_from_the_pool(pool):
    seen = []

    def body_fn(x, n):
        tmp = torch.empty_like(x)
        seen.append(tmp.data_ptr())
        torch.mul(x, 0.25, out=tmp)
        return tmp + 1, n + 1

    x0 = trand(2048) * 10
    with cgraw.capture(pool=pool) as g:
        x, n = cgraw.while_loop(lambda x, n: n < 5, body_fn, (x0, torch.zeros((), dtype=torch.int64, device="cuda")))
    owns = pool.torch_state.owner_of()
    assert seen and all(owns(p) for p in seen) and owns(x.data_ptr())
    eager_x = torch.randn(2048, device="cuda")  # eager work between replays never gets the body's blocks
    g.replay()
    ref = x0.clone()
    for _ in range(5):
        ref = ref * 0.25 + 1
    torch.cuda.synchronize()
    assert torch.equal(x, ref) and not owns(eager_x.data_ptr())


def test_a_loop_whose_condition_fails_at_once_returns_the_carried_values(pool):
    cond_fn, body_fn = _halving()
    g, x0, n0, x, n = _halving_captured(pool, 1024)
    for start in (2.0, 50.0, 2.0):  # at 2 everywhere the condition fails before the first iteration
        x0.copy_(torch.full_like(x0, start) if start == 2.0 else trand(1024) * start)
        g.replay()
        hx, hn = cgraw.while_loop(cond_fn, body_fn, (x0, n0))
        torch.cuda.synchronize()
        assert int(n) == int(hn) and (int(n) == 0) == (start == 2.0)
        assert torch.equal(x, hx) and x.data_ptr() != x0.data_ptr()


def test_a_body_that_raises_while_captured_ends_the_capture_cleanly(pool):
    def body_fn(x, n):
        if x.shape[0] > 0:
            raise KeyError("the user's own")
        return x, n

    x0 = trand(64)
    with pytest.raises(KeyError, match="the user's own"):
        with cgraw.capture(pool=pool):
            cgraw.while_loop(lambda x, n: n < 3, body_fn, (x0, torch.zeros((), dtype=torch.int64, device="cuda")))
    assert pool.capture_stream.capture_status == 0
    cond_fn, halve = _halving()
    with cgraw.capture(pool=pool) as g:  # the pool and the stream capture again
        x, n = cgraw.while_loop(cond_fn, halve, (x0 * 100, torch.zeros((), dtype=torch.int64, device="cuda")))
    g.replay()
    torch.cuda.synchronize()
    assert int(n) > 5 and float((x - 2).norm()) <= TOL


def test_a_body_mixing_torch_and_cupy_through_dlpack(pool):
    cp = pytest.importorskip("cupy")

    def body_fn(t, c, k):
        as_cupy = cp.from_dlpack(t)  # the torch value seen by CuPy, no copy
        c2 = c * 0.5 + as_cupy.sum() * 1e-3
        t2 = torch.from_dlpack(c2) + t * 0.25  # and back
        return t2, c2, k + 1

    t0, c0 = trand(256), cp.asarray(rng.standard_normal(256).astype(np.float32))
    k0 = torch.zeros((), dtype=torch.int64, device="cuda")
    with cgraw.capture(pool=pool) as g:
        t, c, k = cgraw.while_loop(lambda t, c, k: k < 7, body_fn, (t0, c0, k0))
    for _ in range(2):
        t0.copy_(trand(256))
        c0[...] = cp.asarray(rng.standard_normal(256).astype(np.float32))
        g.replay()
        ht, hc, hk = cgraw.while_loop(lambda t, c, k: k < 7, body_fn, (t0, c0, k0))
        torch.cuda.synchronize()
        assert int(k) == int(hk) == 7
        torch.testing.assert_close(t, ht, rtol=1e-5, atol=1e-6)
        assert cp.allclose(c, hc, rtol=1e-5, atol=1e-6)
    del t, c, k, ht, hc, hk


def test_body_with_an_event_is_refused(pool):
    def body_fn(x):
        ev = torch.cuda.Event(external=True)
        ev.record()
        return (x + 1,)

    with pytest.raises(cgraw.CaptureError) as ei:
        with cgraw.capture(pool=pool):
            cgraw.while_loop(lambda x: x.sum() < 100, body_fn, (trand(4),))
    assert "event" in str(ei.value).lower()
    assert pool.capture_stream.capture_status == 0


def test_loop_after_a_joined_fork_runs(pool):
    """The loop pauses the capture stream: work forked before it and joined back is fine."""
    x0 = trand(64)
    side = torch.cuda.Stream()  # made outside the capture
    with cgraw.capture(pool=pool) as g:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            y = x0 * 2
        main.wait_stream(side)
        (v,) = cgraw.while_loop(lambda v: v.abs().max() < 1000, lambda v: (v * 2,), (y,))
    g.replay()
    ref = x0 * 2
    while ref.abs().max() < 1000:
        ref = ref * 2
    torch.cuda.synchronize()
    assert torch.equal(v, ref)


def test_loop_after_an_unjoined_fork_is_refused(pool):
    """Pausing would end a capture with a side stream left unjoined: cgraw refuses first."""
    x0 = trand(64)
    side = torch.cuda.Stream()  # made outside the capture
    with pytest.raises(cgraw.CaptureError) as ei:
        with cgraw.capture(pool=pool):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x0 * 2
            cgraw.while_loop(lambda v: v.sum() < 0, lambda v: (v,), (x0,))
    chain, e = [], ei.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(getattr(c, "name", "") == "CONDITIONAL_AFTER_UNJOINED_FORK" for c in chain), chain
    assert pool.capture_stream.capture_status == 0


def _drawing_loop(rows: int, k: int, rand, cat):
    """A loop of ``rows`` iterations, each drawing ``k`` uniforms into the last row of a carried
    table (the rows shift up): after it, every row is one iteration's draws."""

    def cond_fn(h, i):
        return i < rows

    def body_fn(h, i):
        return cat([h[1:], rand(1, k)]), i + 1

    return cond_fn, body_fn


def _distinct_uniform_rows(h) -> bool:
    rows = [tuple(r) for r in h.tolist()]
    return len(set(rows)) == len(rows) and bool(((h >= 0) & (h < 1)).all())


def test_random_draws_in_a_loop_body_are_fresh_on_every_iteration(pool):
    rows, k = 16, 2048
    cond_fn, body_fn = _drawing_loop(rows, k, lambda *s: torch.rand(*s, device="cuda"), torch.cat)
    h0 = trand(rows, k) - 2  # every row is replaced by the loop
    i0 = torch.zeros((), dtype=torch.int64, device="cuda")
    with cgraw.capture(pool=pool) as g:
        h, i = cgraw.while_loop(cond_fn, body_fn, (h0, i0))
    g.replay()
    first = h.clone()
    assert int(i) == rows and _distinct_uniform_rows(first)
    assert abs(float(first.mean()) - 0.5) < 0.01  # 32768 uniforms
    g.replay()
    assert not torch.equal(first, h)  # and fresh on every replay
    # torch's seed governs them: same seed, same numbers; another seed, others
    torch.manual_seed(1234)
    g.replay()
    seeded = h.clone()
    torch.manual_seed(1234)
    g.replay()
    assert torch.equal(seeded, h)
    torch.manual_seed(1235)
    g.replay()
    assert not torch.equal(seeded, h) and _distinct_uniform_rows(h)
    del h, i


def test_random_draws_in_nested_loop_bodies_are_fresh(pool):
    inner_cond, inner_body = _drawing_loop(4, 512, lambda *s: torch.rand(*s, device="cuda"), torch.cat)

    def outer_body(h, i):
        j0 = torch.zeros((), dtype=torch.int64, device="cuda")
        h, _ = cgraw.while_loop(inner_cond, inner_body, (h, j0))
        return h, i + 1

    h0 = trand(12, 512) - 2
    i0 = torch.zeros((), dtype=torch.int64, device="cuda")
    with cgraw.capture(pool=pool) as g:
        h, i = cgraw.while_loop(lambda h, i: i < 3, outer_body, (h0, i0))
    g.replay()
    assert int(i) == 3 and _distinct_uniform_rows(h)  # 3 x 4 inner iterations, 12 fresh rows
    del h, i


def test_cupy_random_draws_in_a_loop_body_are_fresh_and_seeded(pool):
    cp = pytest.importorskip("cupy")
    rows, k = 8, 1024
    cond_fn, body_fn = _drawing_loop(rows, k, lambda *s: cp.random.rand(*s), cp.concatenate)
    h0 = cp.asarray(rng.standard_normal((rows, k))) - 10
    i0 = cp.zeros((), dtype=cp.int32)
    with cgraw.capture(pool=pool) as g:
        h, i = cgraw.while_loop(cond_fn, body_fn, (h0, i0))
    cp.random.seed(7)
    g.replay()
    first = h.copy()
    assert int(i) == rows and _distinct_uniform_rows(first)
    cp.random.seed(7)
    g.replay()
    assert bool((first == h).all())
    g.replay()
    assert not bool((first == h).all())
    del h, i, first


def test_random_draws_in_a_branch_are_fresh(pool):
    a = trand(256)
    with cgraw.capture(pool=pool) as g:
        y = cgraw.cond(a.sum() > -1e9, lambda v: v + torch.rand_like(v), lambda v: v.clone(), (a,))
    g.replay()
    first = y.clone()
    g.replay()
    torch.cuda.synchronize()
    assert not torch.equal(first, y) and bool(((y - a) >= 0).all() & ((y - a) < 1).all())


@pytest.mark.usefixtures("fresh_trees")
def test_graphed_function_with_a_while_loop():
    @cgraw.graphed
    def halve(x):
        n0 = torch.zeros((), dtype=torch.int64, device=x.device)
        return cgraw.while_loop(lambda v, n: (v.abs().max() > 1) & (n < 64), lambda v, n: (v * 0.5, n + 1), (x, n0))

    for _ in range(5):
        x = trand(512) * float(rng.uniform(1, 1e4))
        v, n = halve(x)
        ref, k = x.clone(), 0
        while ref.abs().max() > 1 and k < 64:
            ref, k = ref * 0.5, k + 1
        assert int(n) == k and torch.equal(v, ref)
        cgraw.mark_step_begin()
    text = cgraw.report()
    assert re.search(r"halve: 1 recording\(s\), 0 re-record\(s\), 3 replay\(s\), 1 warm-up\(s\), 0 eager call\(s\)",
                     text), text


@pytest.mark.usefixtures("fresh_trees")
def test_graphed_function_with_a_refused_body_runs_eagerly():
    @cgraw.graphed
    def marked(x):
        def body_fn(v):
            torch.cuda.Event(external=True).record()  # an event node: no conditional body holds one
            return (v + v.abs() + 1,)

        return cgraw.while_loop(lambda v: v.sum() < 1e3, body_fn, (x,))[0]

    for _ in range(4):
        x = trand(16).abs()
        y = marked(x)
        ref = x.clone()
        while ref.sum() < 1e3:
            ref = ref + ref.abs() + 1
        assert torch.equal(y, ref)
        cgraw.mark_step_begin()
    text = cgraw.report()
    assert "event record" in text and re.search(r"marked: 0 recording\(s\)", text), text


@pytest.mark.usefixtures("fresh_trees")
def test_graphed_function_drawing_in_a_loop_body_is_recorded_and_draws_fresh_numbers():
    @cgraw.graphed
    def noisy(x):
        return cgraw.while_loop(lambda v: v.sum() < 1e3, lambda v: (v + torch.rand_like(v) + 1,), (x,))[0]

    seen = []
    for _ in range(5):
        x = trand(16).abs()
        y = noisy(x)
        d = y - x  # the sum of one uniform plus 1 per iteration, per element
        assert bool((y.sum() >= 1e3).all()) and bool((d >= 1).all())
        seen.append((y - x).clone())
        cgraw.mark_step_begin()
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:]))
    text = cgraw.report()
    assert re.search(r"noisy: 1 recording\(s\), 0 re-record\(s\), 3 replay\(s\), 1 warm-up\(s\), 0 eager call\(s\)",
                     text), text


# ---------------------------------------------------------------- CuPy: conjugate gradient


def _poisson(cp, n):
    def matvec(v):
        u = v.reshape(n, n)
        out = 4 * u
        out[1:, :] -= u[:-1, :]
        out[:-1, :] -= u[1:, :]
        out[:, 1:] -= u[:, :-1]
        out[:, :-1] -= u[:, 1:]
        return out.reshape(-1)

    return matvec


def _cg(cp, matvec, tol, maxit):
    def cond_fn(x, r, p, rs, k):
        return (rs > tol * tol) & (k < maxit)

    def body_fn(x, r, p, rs, k):
        ap = matvec(p)
        alpha = rs / (p * ap).sum()
        x = x + alpha * p
        r = r - alpha * ap
        rs_new = (r * r).sum()
        p = r + (rs_new / rs) * p
        return x, r, p, rs_new, k + 1

    return cond_fn, body_fn


def test_cupy_conjugate_gradient_in_one_launch(pool):
    cp = pytest.importorskip("cupy")
    n, tol, maxit = 24, 1e-8, 2000
    matvec = _poisson(cp, n)
    cond_fn, body_fn = _cg(cp, matvec, tol, maxit)
    b = cp.asarray(rng.standard_normal(n * n))
    x0 = cp.zeros(n * n)
    r0 = b.copy()
    k0 = cp.zeros((), dtype=cp.int32)
    with cgraw.capture(pool=pool) as g:
        rs0 = (r0 * r0).sum()
        x, r, p, rs, k = cgraw.while_loop(cond_fn, body_fn, (x0, r0, r0, rs0, k0))
    for _ in range(3):
        b[...] = cp.asarray(rng.standard_normal(n * n))
        r0[...] = b
        g.replay()
        hx, hr, hp, hrs, hk = cgraw.while_loop(cond_fn, body_fn, (x0, r0, r0, (r0 * r0).sum(), k0))
        assert int(k) == int(hk) and 10 < int(k) < maxit
        assert cp.allclose(x, hx, rtol=1e-12, atol=1e-12)
        assert float(cp.linalg.norm(matvec(x) - b)) <= 10 * tol * float(cp.linalg.norm(b)) + 10 * tol
    del x, r, p, rs, k, hx, hr, hp, hrs, hk


def test_cupy_routed_matmul_in_a_loop_body(pool):
    cp = pytest.importorskip("cupy")
    a = cp.asarray(rng.standard_normal((32, 32)).astype(np.float32)) / 32
    v0 = cp.asarray(rng.standard_normal(32).astype(np.float32))
    k0 = cp.zeros((), dtype=cp.int32)

    def body_fn(v, k):
        return a @ v + v, k + 1

    with cgraw.capture(pool=pool) as g:
        v, k = cgraw.while_loop(lambda v, k: k < 6, body_fn, (v0, k0))
    g.replay()
    hv, hk = cgraw.while_loop(lambda v, k: k < 6, body_fn, (v0, k0))
    assert int(k) == 6 and cp.allclose(v, hv, rtol=1e-5, atol=1e-6)
    del v, k, hv, hk


# ---------------------------------------------------------------- torch's own operators


def test_torch_cond_and_while_loop_become_conditional_nodes(pool):
    from torch._higher_order_ops import while_loop

    a = trand(300)
    scale = torch.full((), 0.5, device="cuda")

    def prog(a):
        # exp of a scaled input stays finite: a loop halving inf would never end, eager's as well
        y = torch.cond(a.mean() > 0, lambda v: v * 2, lambda v: (v / 8).exp(), (a,))
        n0 = torch.zeros((), dtype=torch.int64, device="cuda")
        return while_loop(lambda v, n: v.abs().max() > 1, lambda v, n: (v * scale, n + 1), (y, n0))

    with cgraw.capture(pool=pool) as g:
        v, n = prog(a)
    assert str(g).count("CONDITIONAL") == 2
    for _ in range(4):
        a.copy_(trand(300) * float(rng.uniform(1, 50)))
        g.replay()
        ev, en = prog(a)  # eager: torch's own operators, the predicate read on the host
        torch.cuda.synchronize()
        assert int(n) == int(en) and torch.equal(v, ev)
