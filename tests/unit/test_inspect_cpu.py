"""CPU tests of ``CudaBackend.inspect``: how a graphed call's arguments are classified and which
ones make it skip, with CuPy-shaped stand-ins (no device and no CuPy needed)."""

from __future__ import annotations

import types

import pytest

import cgraw
from cgraw.tree import SkipCall
from cgraw.treeexec import EAGER, STATIC, TREE, CudaBackend


class FakeArray:
    """Looks like a ``cupy.ndarray`` to ``inspect``: module, ``data.ptr``, strides, device."""

    __module__ = "cupy.fake"

    def __init__(self, ptr: int, shape=(4,), device: int = 0, dtype: str = "<f4"):
        self.data = types.SimpleNamespace(ptr=ptr)
        self.shape = shape
        self.strides = (4,) * len(shape)
        self.dtype = types.SimpleNamespace(str=dtype)
        self.device = types.SimpleNamespace(id=device)


def _backend(ordinal: int = 0) -> CudaBackend:
    b = object.__new__(CudaBackend)
    b.device = types.SimpleNamespace(ordinal=ordinal)
    b._tensor = type("NoTensor", (), {})
    return b


def _fn(**kw):
    return cgraw.graphed(lambda *a, **k: None, **kw)


def test_inputs_on_another_device_than_the_tree_skip_with_the_reason():
    with pytest.raises(SkipCall, match="inputs on device 1, but this tree is on device 0"):
        _backend(0).inspect(_fn(), (FakeArray(0x100, device=1),), {}, {})


def test_inputs_on_several_devices_skip():
    with pytest.raises(SkipCall, match="tensors on several devices"):
        _backend(0).inspect(_fn(), (FakeArray(0x100, device=0), FakeArray(0x200, device=1)), {}, {})


def test_kinds_eager_tree_output_and_static():
    x, y, w = FakeArray(0x100), FakeArray(0x200), FakeArray(0x300)
    call = _backend().inspect(_fn(static_argnums=(2,)), (x, y, w), {}, {0x200: object()})
    assert call.kinds == [EAGER, TREE, STATIC]
    assert call.ptrs == [0x100, 0x200, 0x300]


def test_containers_scalars_and_none_are_part_of_the_key():
    b, f = _backend(), _fn()
    x = FakeArray(0x100)
    k1 = b.inspect(f, ([x, {"a": x}], 3, None), {"s": 1.5}, {}).key
    k2 = b.inspect(f, ([x, {"a": x}], 4, None), {"s": 1.5}, {}).key
    k3 = b.inspect(f, ([x, {"a": x}], 3, None), {"s": 1.5}, {}).key
    assert k1 == k3 and k1 != k2  # a scalar that changes its value selects another recording
    shapes = b.inspect(f, (FakeArray(0x100, shape=(8,)),), {}, {}).key
    dtypes = b.inspect(f, (FakeArray(0x100, dtype="<f8"),), {}, {}).key
    assert len({shapes, dtypes, b.inspect(f, (x,), {}, {}).key}) == 3
