"""GPU tier: a path whose outputs are all dead ends, so the next graphed function starts from a
root (torch's CUDAGraph Trees do the same). Each sequence, one function called once and then
another in a loop with every output dropped, is compared with eager on fresh random inputs and
with the same loop in a fresh tree (``cgraw.reset()``), where the looped function is the first
one called: the counts of warm-ups, recordings, replays and eager calls must be the same."""

from __future__ import annotations

import contextlib

import pytest
from gpu_data import full_fp32, trand

import cgraw

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")


def _counts(f) -> tuple:
    from cgraw.trees.graphed import _managers

    s = _managers[0].stats[f.fn_id]
    return s.warmups, s.recordings, s.replays, s.eager_calls


def _same(got, ref) -> None:
    if isinstance(ref, torch.Tensor):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        assert got == pytest.approx(ref, rel=1e-6)


def _loop(before, g, make_args, n: int = 10) -> tuple:
    """Call each ``(function, args)`` of ``before`` once, then ``g`` ``n`` times on fresh inputs;
    every output is dropped at once and every result compared with eager. ``g``'s counts."""
    for fn, args in before:
        fn(*args)
    for _ in range(n):
        args = make_args()
        ref = g.fn(*args)
        _same(g(*args), ref)
    return _counts(g)


def _after_and_first(before, g, make_args) -> tuple:
    """``g``'s counts after ``before``, and in a fresh tree where ``g`` is called first."""
    after = _loop(before, g, make_args)
    cgraw.mark_step_begin()
    cgraw.reset()
    first = _loop([], g, make_args)
    return after, first


def test_a_function_after_another_is_recorded_at_its_second_call():
    f = cgraw.graphed(lambda x: x * 2.0 + 1.0)
    g = cgraw.graphed(lambda x: torch.relu(x) * 3.0 - x)
    after, first = _after_and_first([(f, (trand(4096),))], g, lambda: (trand(4096),))
    assert after == first == (1, 1, 8, 0)  # warm-up, recording, 8 replays
    assert "1 recording(s), 0 re-record(s), 8 replay(s), 1 warm-up(s)" in cgraw.report()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_multihead_attention_after_an_add(grad):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).cuda().eval()
    add = cgraw.graphed(lambda a, b: a + b)

    @cgraw.graphed
    def attend(q):
        return mha(q, q, q, need_weights=False)[0]

    mode = contextlib.nullcontext() if grad else torch.no_grad()
    with full_fp32(), mode:
        after, first = _after_and_first([(add, (trand(8, 64), trand(8, 64)))], attend, lambda: (trand(2, 16, 64),))
    assert after == first and after[1:3] == (1, 8)


def test_a_function_returning_item_after_one_calling_nonzero():
    nz = cgraw.graphed(lambda x: x[torch.nonzero(x > 0, as_tuple=True)] * 2.0)
    item = cgraw.graphed(lambda x: (x * 2.0).sum().item())
    after, first = _after_and_first([(nz, (trand(1024),))], item, lambda: (trand(1024),))
    assert after == first == (1, 0, 0, 9)  # its second call cannot be captured: eager from then on
    from cgraw.trees.graphed import _managers

    assert any("host synchronisation" in r for r in _managers[0].stats[item.fn_id].skip_reasons)


def test_a_function_of_a_marked_static_unaligned_view_after_another():
    base = trand(4097)
    w = cgraw.mark_static(base[1:])  # 4 bytes past the allocation: unaligned for vector loads
    f = cgraw.graphed(lambda x: x.abs() + 0.5)
    scale = cgraw.graphed(lambda x, v: x * v + 1.0)

    def args():
        base.normal_()  # read in place: every replay sees the values of now
        return trand(4096), w

    after, first = _after_and_first([(f, (trand(4096),))], scale, args)
    assert after == first == (1, 1, 8, 0)


def test_outputs_kept_alive_or_a_view_of_one_keep_the_path():
    """A replayed output kept, or only a view of it, keeps the path: the next function extends it.
    With nothing of it alive, the next new function starts from a root."""
    from cgraw.trees.graphed import _managers

    f = cgraw.graphed(lambda x: x * 2.0 + 1.0)
    g = cgraw.graphed(lambda x: x.sin())
    h = cgraw.graphed(lambda x: x.cos())
    for _ in range(2):  # warmed up, recorded: f's output is the tree's memory from now on
        f(trand(4096))
    x = trand(4096)
    view = f(x)[1:]
    z = trand(4096)
    torch.testing.assert_close(g(z), z.sin())
    assert [n.fn for n in _managers[0].current.path()] == [f, g]
    torch.testing.assert_close(view, (x * 2.0 + 1.0)[1:])  # intact: g ran around it
    del view
    torch.testing.assert_close(h(z), z.cos())
    assert [n.fn for n in _managers[0].current.path()] == [h]


@pytest.mark.parametrize("alias", ["detach", "data"])
def test_a_detached_alias_of_an_output_stays_valid(alias):
    """Only an alias of an output survives (``f(x).detach()``): its memory is still in use, so
    the path is not ended and no later recording is given that memory."""
    f = cgraw.graphed(lambda x: x * 2.0 + 1.0)
    g = cgraw.graphed(lambda x: torch.sin(x) * 5.0)
    for _ in range(3):  # f warmed up, recorded, replayed
        cgraw.mark_step_begin()
        f(trand(1 << 16))
    cgraw.mark_step_begin()
    x = trand(1 << 16)
    kept = getattr(f(x), alias)() if alias == "detach" else f(x).data
    expected = kept.clone()
    for _ in range(6):  # g, first called now: it must not be given f's output memory
        y = trand(1 << 16)
        torch.testing.assert_close(g(y), torch.sin(y) * 5.0)
    torch.cuda.synchronize()
    assert torch.equal(kept, expected)
