"""CPU tests of what a graph tree keeps alive of the objects a call's key names by identity (a
tensor reached through an argument's attributes: a transformers ``StaticCache``'s keys and values):
nothing. A node keyed by an object that is gone matches no call again (a new object at its reused
address included) and is dropped when the tree next grows, its recording with it."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from addresses import at_reused_address  # noqa: E402
from cpu_graph import CpuGraphBackend  # noqa: E402
from torch_cpu_backend import TorchFn, cpu_as_device0, cpu_tree  # noqa: E402

from cgraw.trees import calls  # noqa: E402
from cgraw.trees.arrays import weaken_key  # noqa: E402
from cgraw.trees.input_plan import changed_argument, python_state  # noqa: E402

pytestmark = pytest.mark.torch


class _Holder:
    """A plain object argument holding a tensor (as a cache holds its keys and values)."""

    def __init__(self, t):
        self.t = t


def _add(h, x):
    return x + h.t


@pytest.mark.parametrize("backend", [None, CpuGraphBackend], ids=["rerun", "emulated"])
def test_a_tensor_reached_through_an_argument_attribute_and_then_dropped_is_freed(monkeypatch, backend):
    """The warm-up reads ``h.t`` (the emulating backend notes it as a tensor read through the
    closure); once the caller replaces it, nothing of the tree keeps it alive."""
    with cpu_tree(monkeypatch, backend) as mgr:
        f = TorchFn(_add, mgr)
        h, x = _Holder(torch.randn(4)), torch.randn(4)
        torch.testing.assert_close(f(h, x), x + h.t)
        old = weakref.ref(h.t)
        h.t = torch.randn(4)
        gc.collect()
        assert old() is None
        torch.testing.assert_close(f(h, x), x + h.t)


def _add_into(h, x, y):
    x.add_(h.t + y)  # writes its input: each call's key notes inputs sharing memory (input_plan.shared_memory)
    return x * 2


def test_a_tensor_named_by_the_key_of_a_function_writing_its_inputs_is_freed_once_dropped(monkeypatch):
    with cpu_tree(monkeypatch) as mgr:
        f = TorchFn(_add_into, mgr)
        h = _Holder(torch.randn(4))
        for _ in range(4):
            x, y = torch.randn(4), torch.randn(4)
            want = (x + h.t + y) * 2
            torch.testing.assert_close(f(h, x, y), want)
        assert getattr(f, "writes_inputs", False) and f.shared_memo  # the memo of its inputs' extents
        old = weakref.ref(h.t)
        h.t = torch.randn(4)
        gc.collect()
        assert old() is None


def test_a_node_keyed_by_a_dropped_tensor_is_dropped_with_its_recording_when_the_tree_grows(monkeypatch):
    with cpu_tree(monkeypatch) as mgr:
        f = TorchFn(_add, mgr)
        h, x = _Holder(torch.randn(4)), torch.randn(4)
        f(h, x)
        f(h, x)  # recorded
        (node,) = mgr.nodes()
        rec = node.recording
        assert rec is not None and mgr.stats[f.fn_id].recordings == 1
        h.t = torch.randn(4)
        gc.collect()
        torch.testing.assert_close(f(h, x), x + h.t)
        assert rec.discarded
        assert [n.recording for n in mgr.nodes()] == [None]  # only the new node, warmed up
        assert all(len(seen) == 1 for seen in mgr._keys_seen.values())


def test_a_new_tensor_at_a_dropped_tensors_reused_address_selects_a_new_recording(monkeypatch):
    with cpu_tree(monkeypatch) as mgr:
        f = TorchFn(_add, mgr)
        h, x = _Holder(torch.ones(4)), torch.randn(4)
        f(h, x)
        f(h, x)
        f(h, x)
        st = mgr.stats[f.fn_id]
        assert (st.warmups, st.recordings, st.replays) == (1, 1, 1)
        old = id(h.t)
        h.t = at_reused_address(lambda: setattr(h, "t", None), old, lambda: torch.full((4,), 2.0))
        assert id(h.t) == old  # CPython gave the new tensor the dropped one's address
        torch.testing.assert_close(f(h, x), x + 2.0)
        assert (st.warmups, st.recordings, st.replays) == (2, 1, 1)


def test_a_filed_key_naming_a_dropped_tensor_equals_no_key_of_a_tensor_at_its_address(monkeypatch):
    with cpu_as_device0(monkeypatch):
        fn = TorchFn(_add, None)
        h, x = _Holder(torch.randn(4)), torch.randn(4)
        filed = calls.inspect(fn, (h, x), {}, {}, 0).key
        (ref,) = weaken_key(filed)
        assert filed == calls.inspect(fn, (h, x), {}, {}, 0).key
        old = id(h.t)
        h.t = at_reused_address(lambda: setattr(h, "t", None), old, lambda: torch.randn(4))
        assert ref() is None
        assert filed != calls.inspect(fn, (h, x), {}, {}, 0).key


def test_a_python_state_snapshot_sees_an_attribute_replaced_at_the_same_address():
    """The snapshot holds what it names by address: a tensor made after the old one is dropped
    cannot take its address and pass for it."""
    h = _Holder(torch.randn(4))
    before = python_state((h,), {})
    h.t = None
    h.t = torch.randn(4)
    assert changed_argument(before, (h,), {}) is not None
    old = weakref.ref(h.t)
    snap = python_state((h,), {})
    h.t = None
    assert old() is not None
    del snap
    assert old() is None


def test_a_tensor_reached_through_an_argument_attribute_of_a_recorded_node_is_freed_once_dropped(monkeypatch):
    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        f = TorchFn(_add, mgr)
        h, x = _Holder(torch.randn(4)), torch.randn(4)
        f(h, x)
        f(h, x)  # recorded
        h.t.copy_(torch.randn(4))
        torch.testing.assert_close(f(h, x), x + h.t)  # replayed: reads h.t's contents now
        st = mgr.stats[f.fn_id]
        assert (st.recordings, st.replays) == (1, 1)
        (node,) = mgr.nodes()
        rec = node.recording
        old = weakref.ref(h.t)
        h.t = torch.randn(4)
        gc.collect()
        assert old() is None
        torch.testing.assert_close(f(h, x), x + h.t)
        assert rec.discarded and (st.recordings, st.replays) == (1, 1)
