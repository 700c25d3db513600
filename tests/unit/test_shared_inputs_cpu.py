"""CPU tier: inputs that share memory with an input the function writes in place.

A recording copies each eager input into a placeholder of its own, so ``f(x, x[2:])`` with ``f``
writing its first argument would read a stale second one inside the graph, and copy both back
over each other. Once a warm-up shows that a function writes an eager input, the key of each of
its calls notes which inputs share memory (``calls.shared_memory``); a call where a written input
shares memory with another one gets a node of its own, which runs eagerly with the reason. Calls
on separate tensors keep replaying. Real torch tensors on the CPU, the real ``TreeManager`` and
the CPU stand-in of the CUDA backend (which copies written eager inputs back after each replay).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch")

from torch_cpu_backend import TorchFn, cpu_tree  # noqa: E402

from cgraw.trees import calls  # noqa: E402
from cgraw.trees.manager import NodeState  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def mgr(monkeypatch):
    with cpu_tree(monkeypatch) as m:
        yield m


def _write_first_read_second(a, b):
    a.add_(1.0)
    return b * 2.0


def _eager(x_before, view):
    x = x_before.clone()
    out = _write_first_read_second(x, view(x))
    return x, out


def test_a_written_input_and_a_view_of_it_run_eagerly_and_separate_tensors_replay(mgr):
    f = TorchFn(_write_first_read_second, mgr)
    for _ in range(3):  # separate tensors: warm-up (finds the write), recording, replay
        mgr.mark_step_begin()
        x, y = torch.randn(8), torch.randn(8)
        x0 = x.clone()
        out = f(x, y)
        torch.testing.assert_close(x, x0 + 1.0)  # copied back
        torch.testing.assert_close(out, y * 2.0)
    for _ in range(3):  # the second argument is a view of the first
        mgr.mark_step_begin()
        x = torch.randn(8)
        ref_x, ref_out = _eager(x, lambda t: t[2:])
        out = f(x, x[2:])
        torch.testing.assert_close(x, ref_x)
        torch.testing.assert_close(out, ref_out)
    for _ in range(2):  # separate tensors again: the recording replays
        mgr.mark_step_begin()
        x, y = torch.randn(8), torch.randn(6)
        x0 = x.clone()
        torch.testing.assert_close(f(x, y), y * 2.0)
        torch.testing.assert_close(x, x0 + 1.0)
    st = mgr.stats[f.fn_id]
    assert st.eager_calls >= 2 and any("share memory" in r for r in st.skip_reasons), st
    skipped = [n for n in mgr.nodes() if n.state is NodeState.SKIPPED]
    assert len(skipped) == 1 and "writes input 0" in skipped[0].skip_reason


def test_the_same_tensor_passed_twice_to_a_writer_matches_eager(mgr):
    f = TorchFn(_write_first_read_second, mgr)
    for _ in range(5):
        mgr.mark_step_begin()
        x = torch.randn(8)
        ref_x, ref_out = _eager(x, lambda t: t)
        out = f(x, x)
        torch.testing.assert_close(x, ref_x)
        torch.testing.assert_close(out, ref_out)


def test_a_function_that_writes_nothing_keeps_replaying_overlapping_inputs(mgr):
    """Without a write, the separate copies of overlapping inputs hold what eager reads."""
    f = TorchFn(lambda a, b: a * 2.0 + b.sum(), mgr)
    for _ in range(5):
        mgr.mark_step_begin()
        x = torch.randn(8)
        torch.testing.assert_close(f(x, x[2:]), x * 2.0 + x[2:].sum())
    st = mgr.stats[f.fn_id]
    assert (st.warmups, st.recordings, st.replays, st.eager_calls) == (1, 1, 3, 0)
    assert not getattr(f, "writes_inputs", False)


def test_shared_memory_pairs_overlapping_leaves_with_an_eager_one():
    x = torch.randn(16)
    w = torch.randn(4)
    leaves = [x, x[4:8], w, x[12:]]
    kinds = [calls.EAGER, calls.EAGER, calls.EAGER, calls.STATIC]
    ptrs = [t.data_ptr() for t in leaves]
    ops = [calls.TORCH] * 4
    assert calls.shared_memory(leaves, kinds, ptrs, ops) == ((0, 1), (0, 3))
    kinds = [calls.STATIC, calls.EAGER, calls.EAGER, calls.STATIC]
    assert calls.shared_memory(leaves, kinds, ptrs, ops) == ((0, 1),)  # two static ones are read in place
    assert calls.shared_memory([x[:4], x[4:8]], [calls.EAGER] * 2, [x.data_ptr(), x[4:].data_ptr()],
                               ops[:2]) == ()  # side by side, not overlapping


def test_shared_memory_sees_a_view_with_negative_strides_reaching_below_its_first_element():
    # CuPy's a[::-1] starts at a's last element and reaches down to its first
    from types import SimpleNamespace

    from cgraw.trees.frameworks import CUPY

    flipped = SimpleNamespace(shape=(4,), strides=(-8,), itemsize=8)
    plain = SimpleNamespace(shape=(4,), strides=(8,), itemsize=8)
    assert CUPY.reach(flipped) == (24, 8)
    assert CUPY.reach(SimpleNamespace(shape=(0, 3), strides=(-8, 8), itemsize=8)) == (0, 0)
    base = 4096
    ops = [CUPY, CUPY]
    # a (at base) and a[::-1] (its first element at base + 24): they overlap
    assert calls.shared_memory([plain, flipped], [calls.EAGER, calls.STATIC], [base, base + 24], ops) == ((0, 1),)
    # a[::-1] of another array just above a's end: apart
    assert calls.shared_memory([plain, flipped], [calls.EAGER, calls.STATIC], [base, base + 56], ops) == ()


def test_shared_memory_is_empty_without_an_eager_leaf():
    x = torch.randn(16)
    leaves = [x, x[4:8]]
    assert calls.shared_memory(leaves, [calls.STATIC, calls.TREE], [t.data_ptr() for t in leaves],
                               [calls.TORCH] * 2) == ()


class _Settings:
    """A plain object argument: equal only to itself, with attributes a function reads."""

    def __init__(self, scale):
        self.scale = scale
        self.offsets = [0.5]


def test_a_plain_object_argument_whose_attribute_is_set_anew_selects_another_recording(mgr):
    f = TorchFn(lambda x, s: x * s.scale + s.offsets[0], mgr)
    s = _Settings(2.0)
    for scale in (2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 2.0):
        mgr.mark_step_begin()
        s.scale = scale
        x = torch.randn(8)
        torch.testing.assert_close(f(x, s), x * scale + 0.5)
    st = mgr.stats[f.fn_id]
    assert st.variants == 2 and st.eager_calls == 0, st
    s.offsets = [1.5]  # a new list: another recording (an element changed in place would not be seen)
    x = torch.randn(8)
    torch.testing.assert_close(f(x, s), x * 2.0 + 1.5)
    assert mgr.stats[f.fn_id].variants == 3


class _Extent:
    """A leaf with the bytes it reaches below and from its address."""

    def __init__(self, below, above):
        self.below, self.above = below, above


class _ExtentOps:
    @staticmethod
    def reach(t):
        return (t.below, t.above)


def _overlapping(leaves, kinds, ptrs) -> tuple:
    """Every pair of leaves, one of them eager, whose byte ranges intersect (the definition)."""
    ranges = [(p - t.below, p + t.above) for p, t in zip(ptrs, leaves)]
    return tuple((j, k) for j in range(len(leaves)) for k in range(j + 1, len(leaves))
                 if calls.EAGER in (kinds[j], kinds[k]) and ranges[j][0] < ranges[k][1] and ranges[k][0] < ranges[j][1])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_shared_memory_with_a_memo_finds_every_overlapping_pair(data):
    """Calls of one function: the leaves read in place keep or change their addresses, the eager
    ones move at each call; with the function's memo the pairs are those of the definition (every
    pair compared) every time."""
    n = data.draw(st.integers(2, 9))
    kinds = data.draw(st.lists(st.sampled_from([calls.EAGER, calls.STATIC, calls.TREE]), min_size=n, max_size=n))
    leaves = [_Extent(data.draw(st.sampled_from([0, 0, 8])), data.draw(st.sampled_from([0, 8, 16, 64, 256])))
              for _ in range(n)]
    ops = [_ExtentOps] * n
    memo = {}
    ptrs = [data.draw(st.integers(0, 40)) * 8 for _ in range(n)]
    for _ in range(data.draw(st.integers(1, 6))):
        for j in range(n):  # eager leaves move at every call, the others sometimes
            if kinds[j] == calls.EAGER or data.draw(st.integers(0, 3)) == 0:
                ptrs[j] = data.draw(st.integers(0, 40)) * 8
        want = _overlapping(leaves, kinds, ptrs)
        assert calls.shared_memory(leaves, kinds, list(ptrs), ops, memo, ("key", n)) == want
        assert calls.shared_memory(leaves, kinds, list(ptrs), ops) == want  # without a memo


def test_shared_memory_sees_a_large_leaf_past_a_small_one_inside_it():
    # read in place: [0, 100) and [10, 20) inside it; the eager [50, 60) overlaps only the large one
    leaves = [_Extent(0, 100), _Extent(0, 10), _Extent(0, 10)]
    kinds = [calls.STATIC, calls.TREE, calls.EAGER]
    assert calls.shared_memory(leaves, kinds, [0, 10, 50], [_ExtentOps] * 3, {}, "k") == ((0, 2),)


def test_shared_memory_measures_the_leaves_read_in_place_once_while_they_stay():
    measured = []

    class Counting(_ExtentOps):
        @staticmethod
        def reach(t):
            measured.append(t)
            return (t.below, t.above)

    leaves = [_Extent(0, 16), _Extent(0, 64), _Extent(0, 64)]
    kinds, ops, memo = [calls.EAGER, calls.STATIC, calls.TREE], [Counting] * 3, {}
    for p in (200, 300, 1010):
        pairs = calls.shared_memory(leaves, kinds, [p, 1000, 5000], ops, memo, "k")
    assert pairs == ((0, 1),)  # the last eager address lies inside the static leaf
    assert measured.count(leaves[1]) == 1 and measured.count(leaves[0]) == 3
    calls.shared_memory(leaves, kinds, [0, 1000, 6000], ops, memo, "k")  # a tree output moved: measured again
    assert measured.count(leaves[1]) == 2
