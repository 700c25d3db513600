"""CPU tests of ``cgraw.interop.cupy.mask`` (``a[mask] = scalar`` inside captures) with a fake CuPy."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from cgraw.runtime import memory
from cgraw.interop.cupy import mask as cm

CAPTURE, OTHER = 0x5000, 0x6000


class Base:
    def __setitem__(self, key, value):
        self.log.append(("cupy", key, value))


class FakeArray(Base):
    """A NumPy array in a CuPy-shaped shell: ``ndarray`` is a Python class over a base, as in CuPy 14."""

    def __init__(self, a):
        self.a, self.log = np.asarray(a), []

    shape = property(lambda self: self.a.shape)
    ndim = property(lambda self: self.a.ndim)
    dtype = property(lambda self: self.a.dtype)

    def reshape(self, shape):
        return FakeArray(self.a.reshape(shape))


@pytest.fixture
def fake(monkeypatch):
    state = {"current": CAPTURE}
    copies = []

    def copyto(dst, src, casting="same_kind", where=True):
        copies.append((casting, where.shape))
        np.copyto(dst.a, src.a if isinstance(src, FakeArray) else src, casting=casting, where=where.a)

    cp = types.SimpleNamespace(ndarray=FakeArray, copyto=copyto,
                               cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(
                                   ptr=state["current"])))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(memory.thread_state, "capturing", 1, raising=False)
    yield cp, state, copies
    while cm._installs:
        cm.uninstall()
    cm.leave()
    assert "__setitem__" not in FakeArray.__dict__


def test_mask_shape_covers_leading_axes_only():
    assert cm.mask_shape((4, 3), (4, 3)) == (4, 3)
    assert cm.mask_shape((4, 3, 2), (4,)) == (4, 1, 1)
    assert cm.mask_shape((4, 3), (3,)) is None  # a mask over trailing axes: CuPy's own path
    assert cm.mask_shape((4,), (4, 1)) is None and cm.mask_shape((4,), ()) is None


def test_scalar_values_only():
    assert all(cm.scalar_value(v, np, FakeArray) for v in (0, 1.5, True, 2j, np.float32(3), np.int64(-1)))
    assert cm.scalar_value(FakeArray(np.float32(2)), np, FakeArray)
    assert not cm.scalar_value(FakeArray([1.0, 2.0]), np, FakeArray)  # values in the mask's order
    assert not cm.scalar_value([0.0], np, FakeArray)


def test_a_scalar_through_a_mask_is_one_copyto_on_the_capturing_thread_only(fake):
    cp, state, copies = fake
    assert cm.install(cp) == "" and "__setitem__" in FakeArray.__dict__
    x = FakeArray(np.array([[-1.0, 2.0], [3.0, -4.0]]))
    x[FakeArray(x.a < 0)] = 0  # outside enter(): CuPy's own
    assert copies == [] and len(x.log) == 1
    cm.enter(CAPTURE)
    x[FakeArray(x.a < 0)] = 0
    assert copies == [("unsafe", (2, 2))] and x.log[1:] == [] and (x.a >= 0).all()
    rows = FakeArray(np.arange(6).reshape(3, 2))
    rows[FakeArray(np.array([True, False, True]))] = 7.9  # leading axis; float into int: cast as NumPy does
    assert copies[-1] == ("unsafe", (3, 1)) and rows.a.tolist() == [[7, 7], [2, 3], [7, 7]]
    for key, value in ((FakeArray(x.a > 0), FakeArray([1.0, 2.0])),  # an array value: order matters
                       (FakeArray(np.array([1, 0])), 0),  # an integer key
                       (0, 5.0)):
        x[key] = value
    wide = FakeArray(np.zeros((2, 3)))
    wide[FakeArray(np.array([True, False, True]))] = 1.0  # a mask over the trailing axis
    assert len(copies) == 2 and len(x.log) == 4 and len(wide.log) == 1
    state["current"] = OTHER  # another stream: CuPy's own
    x[FakeArray(x.a > 0)] = 1.0
    assert len(copies) == 2 and len(x.log) == 5


def test_outside_the_capture_proper_cupy_keeps_it(fake, monkeypatch):
    cp, state, copies = fake
    cm.install(cp)
    cm.enter(CAPTURE)
    monkeypatch.setattr(memory.thread_state, "capturing", 0)
    x = FakeArray(np.ones(3))
    x[FakeArray(np.array([True, False, True]))] = 0.0
    assert copies == [] and len(x.log) == 1


def test_install_is_counted_and_restores_the_class(fake):
    cp, _, _ = fake
    assert cm.install(cp) == "" and cm.install(cp) == ""
    wrapper = FakeArray.__dict__["__setitem__"]
    cm.uninstall()
    assert FakeArray.__dict__["__setitem__"] is wrapper  # another capture still routes
    cm.uninstall()
    assert "__setitem__" not in FakeArray.__dict__ and FakeArray.__setitem__ is Base.__setitem__


def test_a_class_with_its_own_setitem_gets_it_back(fake):
    cp, _, _ = fake

    def own(self, key, value):
        pass

    FakeArray.__setitem__ = own
    try:
        cm.install(cp)
        assert FakeArray.__dict__["__setitem__"] is not own
        cm.uninstall()
        assert FakeArray.__dict__["__setitem__"] is own
    finally:
        del FakeArray.__setitem__


def test_an_immutable_class_is_reported_not_raised():
    cp = types.SimpleNamespace(ndarray=list)  # a static type: setattr raises TypeError
    why = cm.install(cp)
    assert "cannot be wrapped" in why and cm._installs == 0 and not cm._state
    assert "no __setitem__" in cm.install(types.SimpleNamespace(ndarray=type("Bare", (), {})))
    assert cm._installs == 0 and not cm._state
