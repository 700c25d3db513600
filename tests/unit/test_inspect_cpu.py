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

    def __init__(self, ptr: int, shape=(4,), device: int = 0, dtype: str = "<f4", strides=None):
        self.data = types.SimpleNamespace(ptr=ptr)
        self.shape = shape
        self.strides = strides or tuple(4 * _prod(shape[i + 1:]) for i in range(len(shape)))
        self.flags = types.SimpleNamespace(c_contiguous=strides is None)
        self.dtype = types.SimpleNamespace(str=dtype)
        self.device = types.SimpleNamespace(id=device)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


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


# ---------------------------------------------------------------------- padding buckets


def test_pad_buckets_are_checked():
    assert _fn(pad_buckets=(8, 2, 4, 4)).pad_buckets == (2, 4, 8)
    assert _fn().pad_buckets == ()
    with pytest.raises(ValueError, match="positive ints"):
        _fn(pad_buckets=(0, 4))
    with pytest.raises(ValueError, match="positive ints"):
        _fn(pad_buckets=(2.0,))
    with pytest.raises(TypeError, match="sequence of positive ints"):
        _fn(pad_buckets=4)


def test_calls_in_one_bucket_share_a_signature():
    b, f = _backend(), _fn(pad_buckets=(4, 8))
    w = FakeArray(0x900, shape=(3, 16))  # a tree output with 3 rows: read in place, not padded

    def call(n, m=5):
        x = FakeArray(0x100, shape=(n, 16))
        mask = FakeArray(0x200, shape=(n,))
        other = FakeArray(0x300, shape=(m, 2))  # another leading dimension: not padded
        return b.inspect(f, ([x, mask], other, w, 2.5), {"flag": True}, {0x900: object()})

    c3, c4, c1 = call(3), call(4), call(1)
    assert c3.key == c4.key == c1.key
    assert (c3.rows, c3.bucket, c3.padded) == (3, 4, frozenset({0, 1}))
    assert c1.rows == 1 and c4.rows == 4
    c5, c8 = call(5, m=2), call(8, m=2)
    assert c5.key == c8.key != c3.key and c5.bucket == 8
    # an input whose leading dimension happens to equal the batch's is padded as well
    assert call(5).padded == frozenset({0, 1, 2}) and call(5).key != c5.key
    assert call(3, m=6).key != c3.key  # an unpadded input's shape still selects the recording
    c9 = call(9)
    assert c9.bucket is None and c9.rows is None and c9.key not in (c3.key, c5.key)
    c0 = call(0)
    assert c0.bucket is None


def test_the_padded_signature_replaces_only_padded_leading_dimensions():
    f = _fn(pad_buckets=(16,))
    x, y = FakeArray(0x100, shape=(5, 3)), FakeArray(0x200, shape=(7, 3))
    call = _backend().inspect(f, ((x, y), None), {}, {})
    tensor_parts = [p for p in call.key if type(p) is tuple and len(p) == 3]
    assert [p[0] for p in tensor_parts] == [(16, 3), (7, 3)]
    assert [p[1] for p in tensor_parts] == ["contiguous", (12, 4)]
    assert call.key[-1] == ("pad", 16)


def test_padded_signature_keeps_the_layout_not_the_strides():
    f, b = _fn(pad_buckets=(8,)), _backend()

    def key(n, strided):
        x = FakeArray(0x100, shape=(n, 16), strides=(4, 4 * n) if strided else None)
        return b.inspect(f, (x,), {}, {}).key

    assert key(3, True) == key(5, True)  # a transposed input's strides follow its row count
    assert key(3, False) == key(5, False)
    assert key(3, True) != key(3, False)  # copied by a memcpy node or element by element


class SliceableArray(FakeArray):
    """A FakeArray that can be aliased (``view``) and cut (``[:n]``), as replay does."""

    def view(self):
        return SliceableArray(self.data.ptr, self.shape)

    def __getitem__(self, s):
        return SliceableArray(self.data.ptr, (len(range(*s.indices(self.shape[0]))), *self.shape[1:]))


def test_padded_replay_patches_counts_and_cuts_outputs(monkeypatch):
    from cgraw import _cuda
    from cgraw.treeexec import _SINGLE, OWNED, Recording

    patched = []
    monkeypatch.setattr(_cuda, "memcpy_node_set_1d_raw",
                        lambda exec_, node, dst, src, count, kind: patched.append((node, dst, src, count)) or (0,))
    launches = []
    rec = Recording()
    rec.bucket, rec.padded, rec.exec_rt = 8, frozenset({0}), "exec"
    rec.graph = types.SimpleNamespace(replay=lambda: launches.append(1))
    # input 0 padded (64 bytes a row, recorded with 5 rows), input 1 not (fixed 128 bytes)
    rec.copies_in = [[0, "n0", 0xA00, 5 * 64, 0x100, 64], [1, "n1", 0xB00, 128, 0x200, 0]]
    # a mutated padded input is copied back: row count patched too (dst is the caller's tensor)
    rec.copies_back, rec.slow_in = [[0, "b0", 0xA00, 5 * 64, 0x100, 64]], []
    rec.out_leaves = [SliceableArray(0xC00, (8, 16)), SliceableArray(0xD00, (3,))]
    rec.out_spec = ("seq", tuple, [("t",), ("t",)])
    rec.out_kinds, rec.owned_idx = [OWNED, OWNED], [0, 1]
    rec.out_rows = [0]
    b = _backend()

    def call(n, p0=0x100, p1=0x200):
        c = types.SimpleNamespace(rows=n, ptrs=[p0, p1], leaves=[None, None])
        out, owned = b._replay_padded(rec, c)
        assert len(owned) == len(rec.owned_idx)  # owned outputs are handed out (poisoned later)
        return out

    out = call(5)  # as recorded: nothing to patch
    assert patched == [] and out[0].shape == (5, 16) and out[1].shape == (3,)
    out = call(2)
    assert patched == [("n0", 0xA00, 0x100, 2 * 64), ("b0", 0x100, 0xA00, 2 * 64)]
    assert out[0].shape == (2, 16)
    patched.clear()
    call(2, p1=0x300)  # only the unpadded input moved: its count stays
    assert patched == [("n1", 0xB00, 0x300, 128)]
    patched.clear()
    call(8, p0=0x400, p1=0x300)
    assert patched == [("n0", 0xA00, 0x400, 8 * 64), ("b0", 0x400, 0xA00, 8 * 64)]
    assert len(launches) == 4
    rec.out_spec, rec.out_leaves, rec.out_rows = _SINGLE, [SliceableArray(0xC00, (8, 16))], [0]
    rec.out_kinds, rec.owned_idx = [OWNED], [0]
    assert call(6).shape == (6, 16)
