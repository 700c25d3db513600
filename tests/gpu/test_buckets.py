"""GPU tier for padding buckets (``cgraw.graphed(fn, pad_buckets=...)``): calls of many batch
sizes replay one recording per bucket; every result is compared with eager execution of the same
function on the unpadded inputs (fresh random data each call)."""

from __future__ import annotations

import pytest

import cgraw

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")


def _stats(f):
    from cgraw.trees.graphed import _managers

    return _managers[0].stats[f.fn_id]


def test_torch_rowwise_mlp_one_recording_per_bucket():
    w1, b1 = torch.randn(16, 32, device="cuda"), torch.randn(32, device="cuda")
    w2 = torch.randn(32, 8, device="cuda")

    def body(x, scale):
        h = torch.relu(x @ w1 + b1)
        return (h @ w2) * scale, h.sum(dim=1)

    f = cgraw.graphed(body, pad_buckets=(4, 8))
    for n in (3, 4, 1, 8, 5, 2, 7, 6, 9, 3, 8, 1):
        x, scale = torch.randn(n, 16, device="cuda"), torch.rand(n, 1, device="cuda")
        got, ref = f(x, scale), body(x, scale)
        for g, r in zip(got, ref):
            assert g.shape == r.shape
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    st = _stats(f)
    # nodes: bucket 4, bucket 8 and the exact size 9 (past the largest bucket)
    assert (st.warmups, st.recordings, st.rerecords) == (3, 2, 0)
    assert st.replays == 7 and st.eager_calls == 0


def test_cupy_and_a_mutated_padded_input():
    def body(a, s):
        return cp.tanh(a) * s + a.sum(axis=1, keepdims=True)

    f = cgraw.graphed(body, pad_buckets=(8,))
    for n in (5, 8, 3, 6, 1):
        a = cp.random.standard_normal((n, 12), dtype=cp.float32)
        s = cp.random.standard_normal((n, 1), dtype=cp.float32)
        got, ref = f(a, s), body(a, s)
        assert got.shape == ref.shape and cp.allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert _stats(f).recordings == 1 and _stats(f).replays == 3

    def scale_in_place(x):
        x.mul_(2.0)
        return x.sum(dim=1)

    g = cgraw.graphed(scale_in_place, pad_buckets=(4,))
    cgraw.mark_step_begin()  # g begins its own generations (a root), not a path after f
    for n in (3, 2, 4, 1, 3):
        x = torch.randn(n, 6, device="cuda")
        x0 = x.clone()
        out = g(x)
        torch.testing.assert_close(x, x0 * 2.0)  # exactly the call's rows were copied back
        torch.testing.assert_close(out, (x0 * 2.0).sum(dim=1))
        assert out.shape == (n,)
    assert _stats(g).recordings == 1


def test_noncontiguous_padded_input_and_overwritten_output():
    def body(x):
        return x * 3.0 + 1.0

    f = cgraw.graphed(body, pad_buckets=(8,))
    kept = None
    for n in (5, 3, 7, 2):
        x = torch.randn(16, n, device="cuda").t()  # (n, 16), not contiguous
        got = f(x)
        torch.testing.assert_close(got, body(x))
        if n == 3:
            kept = got
    with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
        kept.sum()
    assert _stats(f).recordings == 1 and _stats(f).replays == 2


def test_outputs_whose_rows_are_not_their_first_dimension_run_eagerly_and_match_eager():
    """An output with the rows in its second dimension (``y.t()``), a returned ``x.shape[0]`` and
    an output whose shape does not follow the rows: every call returns eager's shapes and values."""
    w = torch.randn(16, 8, device="cuda")

    def transposed(x):
        return (x @ w).t()

    def counted(x):
        return x @ w, x.shape[0], w.sum(dim=1)

    for body, replays in ((transposed, False), (counted, False)):
        f = cgraw.graphed(body, pad_buckets=(8,))
        cgraw.mark_step_begin()
        for n in (5, 5, 5, 3, 8, 6):
            x = torch.randn(n, 16, device="cuda")
            got, ref = f(x), body(x)
            got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
            for g, r in zip(got, ref):
                if isinstance(r, torch.Tensor):
                    assert g.shape == r.shape
                    torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
                else:
                    assert g == r
        assert (_stats(f).replays > 0) == replays


def test_a_row_view_of_a_padded_input_is_the_callers_memory():
    """``x[:, 1:]`` returned under ``pad_buckets``: eager's view of the caller's ``x`` on every call
    (same address, written through), valid after the next step."""

    def body(x):
        return x * 2.0, x[:, 1:]

    f = cgraw.graphed(body, pad_buckets=(8,))
    for n in (5, 5, 5, 3, 8, 6):
        x = torch.randn(n, 16, device="cuda")
        y, v = f(x)
        torch.testing.assert_close(y, x * 2.0)
        assert v.shape == (n, 15) and v.data_ptr() == x[:, 1:].data_ptr()
        cgraw.mark_step_begin()
        v.fill_(1.0)
        assert bool((x[:, 1:] == 1.0).all())
    assert _stats(f).replays >= 3
