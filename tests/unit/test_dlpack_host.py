"""kDLCPU capsule round-trips through numpy.from_dlpack, plus cgraw.dlpack.structs's import side (no GPU)."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

from cgraw.dlpack import structs as dlpack, capsules
from cgraw.dlpack.structs import kDLCPU
from cgraw.dlpack.capsules import make_capsule, parse_capsule

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


def random_array(shape, dtype, rng=None) -> np.ndarray:
    rng = rng or np.random.default_rng()
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) > 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return rng.standard_normal(shape).astype(dt)


def data_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def write_through(out: np.ndarray, src: np.ndarray, new, legacy: bool) -> None:
    """Writes via the consumer land in the source. numpy imports legacy capsules read-only
    (they cannot carry READ_ONLY), so there we write the source and read the consumer."""
    if legacy:
        assert not out.flags.writeable
        src[...] = new
        np.testing.assert_array_equal(out, new)
    else:
        out[...] = new
        np.testing.assert_array_equal(src, new)


class Counter:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


class HostExporter:
    """Minimal DLPack producer over a numpy array's memory (owner = the array)."""

    def __init__(self, arr, *, legacy=False, readonly=False, on_release=None):
        self.arr, self.legacy, self.readonly, self.on_release = arr, legacy, readonly, on_release

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        a = self.arr
        strides = tuple(s // a.itemsize for s in a.strides)
        return make_capsule(data_ptr(a), a.shape, strides, a.dtype, (kDLCPU, 0), owner=a,
                            versioned=dlpack.wants_versioned(max_version) and not self.legacy,
                            readonly=self.readonly, on_release=self.on_release)

    def __dlpack_device__(self):
        return (kDLCPU, 0)


@pytest.fixture(autouse=True)
def no_leaked_exports():
    gc.collect()
    assert capsules.live_exports() == 0
    yield
    gc.collect()
    assert capsules.live_exports() == 0, "a DLPack export was never released"


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_values_zero_copy_and_write_through(dtype, legacy):
    rng = np.random.default_rng()
    src = random_array((3, 5), dtype, rng)
    out = np.from_dlpack(HostExporter(src, legacy=legacy))
    assert out.dtype == src.dtype and out.shape == src.shape
    np.testing.assert_array_equal(out, src)
    assert data_ptr(out) == data_ptr(src)
    write_through(out, src, random_array((3, 5), dtype, rng), legacy)


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
@pytest.mark.parametrize(
    "view",
    [
        pytest.param(lambda a: a.T, id="transposed"),
        pytest.param(lambda a: a[::2, 1::3], id="strided"),
        pytest.param(lambda a: a[::-1, ::2], id="negative-stride"),
        pytest.param(lambda a: a[1, 2, ...].reshape(()), id="0d-view"),
        pytest.param(lambda a: a[:, None, 3], id="broadcast-axis"),
    ],
)
def test_non_contiguous_views(view, legacy):
    base = random_array((6, 7), "float64")
    src = view(base)
    out = np.from_dlpack(HostExporter(src, legacy=legacy))
    assert out.shape == src.shape and out.strides == src.strides
    assert data_ptr(out) == data_ptr(src)
    np.testing.assert_array_equal(out, src)
    write_through(out, src, random_array(src.shape, "float64"), legacy)
    np.testing.assert_array_equal(view(base), out)


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_zero_dim(legacy):
    src = np.asarray(np.random.default_rng().standard_normal(), dtype=np.float32)
    out = np.from_dlpack(HostExporter(src, legacy=legacy))
    assert out.shape == () and out[()] == src[()]
    assert data_ptr(out) == data_ptr(src)
    write_through(out, src, np.float32(7.5), legacy)


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0, 2)])
def test_size_zero(shape, legacy):
    rel = Counter()
    src = random_array(shape, "int32")
    cap = HostExporter(src, legacy=legacy).__dlpack__(max_version=(1, 0))
    view = parse_capsule(cap)
    assert view.ptr == 0  # data=NULL for size-0 tensors, per the spec
    assert view.shape == shape
    view.release()
    out = np.from_dlpack(HostExporter(src, legacy=legacy, on_release=rel))
    assert out.shape == shape and out.dtype == np.int32
    del out
    gc.collect()
    assert rel.calls == 1


@pytest.mark.parametrize("readonly", [False, True])
def test_readonly_flag(readonly):
    src = random_array((4, 4), "float32")
    out = np.from_dlpack(HostExporter(src, readonly=readonly))
    assert out.flags.writeable is (not readonly)
    np.testing.assert_array_equal(out, src)


def test_readonly_is_dropped_for_legacy_capsules():
    cap = HostExporter(random_array(3, "int8"), legacy=True, readonly=True).__dlpack__()
    view = parse_capsule(cap)
    assert view.versioned is False and view.readonly is False
    view.release()


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_release_once_when_consumer_dies_and_owner_kept_alive(legacy):
    rel = Counter()
    src = random_array((8, 3), "float64")
    expected = src.copy()
    src_ref = weakref.ref(src)
    exporter = HostExporter(src, legacy=legacy, on_release=rel)
    out = np.from_dlpack(exporter)
    del src, exporter
    gc.collect()
    assert src_ref() is not None, "owner died while the consumer still used its memory"
    assert rel.calls == 0
    np.testing.assert_array_equal(out, expected)
    view = out[1:]  # views keep the consumer's base (and so the export) alive
    del out
    gc.collect()
    assert rel.calls == 0 and src_ref() is not None
    del view
    gc.collect()
    assert rel.calls == 1
    assert src_ref() is None


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_unconsumed_capsule_releases_once(legacy):
    rel = Counter()
    src = random_array(5, "uint16")
    src_ref = weakref.ref(src)
    cap = HostExporter(src, legacy=legacy, on_release=rel).__dlpack__(max_version=(1, 0))
    del src
    gc.collect()
    assert capsules.live_exports() == 1 and src_ref() is not None
    del cap
    gc.collect()
    assert rel.calls == 1
    assert src_ref() is None


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_parse_own_capsule(legacy):
    rel = Counter()
    base = random_array((4, 6), "complex64")
    src = base[:, ::2].T
    cap = HostExporter(src, legacy=legacy, readonly=True, on_release=rel).__dlpack__(
        max_version=(1, 1))
    view = parse_capsule(cap)
    assert view.ptr == data_ptr(src)
    assert view.shape == (3, 4)
    assert view.strides == tuple(s // src.itemsize for s in src.strides) == (2, 6)
    assert view.dtype == np.complex64
    assert view.device == (kDLCPU, 0)
    assert view.versioned is (not legacy)
    assert view.readonly is (not legacy)
    with pytest.raises(ValueError, match="already consumed"):
        parse_capsule(cap)
    del cap
    gc.collect()
    assert rel.calls == 0  # the renamed capsule's destructor must not free it
    view.release()
    view.release()
    assert rel.calls == 1 and view.is_released


def test_parse_view_released_by_gc_and_from_another_thread():
    rel = Counter()
    src = random_array(4, "int64")
    view = parse_capsule(HostExporter(src, on_release=rel).__dlpack__(max_version=(1, 0)))
    del view
    gc.collect()
    assert rel.calls == 1

    view = parse_capsule(HostExporter(src, on_release=rel).__dlpack__(max_version=(1, 0)))
    t = threading.Thread(target=view.release)
    t.start()
    t.join()
    assert rel.calls == 2 and view.is_released


def test_parse_byte_offset():
    src = random_array(10, "float32")
    cap = make_capsule(data_ptr(src), (3,), (2,), src.dtype, (kDLCPU, 0), owner=src,
                       versioned=True, byte_offset=8)
    view = parse_capsule(cap)
    assert view.ptr == data_ptr(src) + 8
    view.release()


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
@pytest.mark.parametrize("dtype", ["bool", "int16", "uint64", "float16", "complex128"])
def test_parse_numpy_capsule(dtype, max_version):
    src = random_array((5, 4), dtype).T
    src_ref = weakref.ref(src)
    cap = src.__dlpack__(max_version=max_version)
    view = parse_capsule(cap)
    assert view.versioned is (max_version is not None)
    assert view.ptr == data_ptr(src)
    assert view.shape == (4, 5)
    assert view.strides == (1, 4)
    assert view.dtype == np.dtype(dtype)
    assert view.device == (kDLCPU, 0)
    assert view.readonly is False
    with pytest.raises(ValueError, match="already consumed"):
        parse_capsule(cap)
    del src, cap
    gc.collect()
    assert src_ref() is not None  # numpy's export holds the array until we release
    view.release()
    gc.collect()
    assert src_ref() is None


def test_parse_numpy_readonly_capsule():
    src = random_array(6, "float64")
    src.flags.writeable = False
    view = parse_capsule(src.__dlpack__(max_version=(1, 0)))
    assert view.readonly is True and view.ptr == data_ptr(src)
    view.release()


def test_parse_rejects_unsupported_major_version_and_releases():
    rel = Counter()
    src = random_array(3, "int32")
    cap = HostExporter(src, on_release=rel).__dlpack__(max_version=(1, 0))
    addr = dlpack.capsule_get_pointer_obj(cap, b"dltensor_versioned")
    dlpack.DLManagedTensorVersioned.from_address(addr).version.major = 2
    with pytest.raises(BufferError, match="major version 2"):
        parse_capsule(cap)
    assert rel.calls == 1
    del cap
    gc.collect()
    assert rel.calls == 1


def test_parse_rejects_non_dlpack_objects():
    with pytest.raises(TypeError, match="PyCapsule"):
        parse_capsule(object())
    probe = dlpack.capsule_new(id(dlpack), b"cgraw.test.other", None)
    with pytest.raises(TypeError, match="not a DLPack capsule"):
        parse_capsule(probe)


def test_parse_unsupported_dtype_releases():
    rel = Counter()
    src = random_array(4, "uint8")
    cap = make_capsule(data_ptr(src), (4,), (1,), src.dtype, (kDLCPU, 0), owner=src,
                       versioned=True, on_release=rel)
    addr = dlpack.capsule_get_pointer_obj(cap, b"dltensor_versioned")
    dlpack.DLManagedTensorVersioned.from_address(addr).dl_tensor.dtype.code = 10  # an fp8 code
    with pytest.raises(TypeError, match="code=10"):
        parse_capsule(cap)
    assert rel.calls == 1


def test_on_release_exception_becomes_warning():
    def boom():
        raise RuntimeError("boom")

    src = random_array(2, "float32")
    out = np.from_dlpack(HostExporter(src, on_release=boom))
    with pytest.warns(RuntimeWarning, match="boom"):
        del out
        gc.collect()
    assert capsules.live_exports() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_mapping_roundtrip(dtype):
    dt = np.dtype(dtype)
    key = dlpack.to_dl_dtype(dt)
    assert key == dlpack.to_dl_dtype(dt.type) == dlpack.to_dl_dtype(dtype)
    assert key[1] == dt.itemsize * 8 and key[2] == 1
    assert dlpack.from_dl_dtype(*key) == dt


def test_dtype_codes():
    assert dlpack.to_dl_dtype(np.bool_) == (dlpack.kDLBool, 8, 1)
    assert dlpack.to_dl_dtype(np.int8) == (dlpack.kDLInt, 8, 1)
    assert dlpack.to_dl_dtype(np.uint32) == (dlpack.kDLUInt, 32, 1)
    assert dlpack.to_dl_dtype(np.float16) == (dlpack.kDLFloat, 16, 1)
    assert dlpack.to_dl_dtype(np.complex128) == (dlpack.kDLComplex, 128, 1)
    assert dlpack.to_dl_dtype("=i8") == (dlpack.kDLInt, 64, 1)


def test_bfloat16_mapping():
    assert dlpack.to_dl_dtype("bfloat16") == (dlpack.kDLBfloat, 16, 1)
    assert dlpack.from_dl_dtype(dlpack.kDLBfloat, 16, 1) == "bfloat16"
    src = random_array(6, "uint16")  # bfloat16 bit patterns
    view = parse_capsule(make_capsule(data_ptr(src), (6,), (1,), "bfloat16", (kDLCPU, 0),
                                      owner=src, versioned=True))
    assert view.dtype == "bfloat16"
    view.release()


@pytest.mark.parametrize(
    "dtype",
    [np.dtype("O"), np.dtype("M8[ns]"), np.dtype(">f4"), np.dtype([("a", "<i4")]), "U3",
     None, "not-a-dtype", object()],
)
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match="unsupported dtype for DLPack"):
        dlpack.to_dl_dtype(dtype)
    with pytest.raises(TypeError, match="unsupported dtype"):
        make_capsule(0, (1,), (1,), dtype, (kDLCPU, 0), owner=None, versioned=True)


@pytest.mark.parametrize("key", [(2, 8, 1), (2, 32, 4), (10, 8, 1), (0, 1, 1), (5, 32, 1)])
def test_unsupported_dl_dtype(key):
    with pytest.raises(TypeError, match=f"code={key[0]}"):
        dlpack.from_dl_dtype(*key)


@pytest.mark.parametrize(
    "shape,strides,kw",
    [((2, 3), (3,), {}), ((2,), (1,), {"byte_offset": -1}), ((1 << 63,), (1,), {})],
    ids=["ndim-mismatch", "negative-byte-offset", "overflow"],
)
def test_make_capsule_rejects_bad_fields(shape, strides, kw):
    with pytest.raises(ValueError):
        make_capsule(0, shape, strides, np.float32, (kDLCPU, 0), owner=None, versioned=True, **kw)


@pytest.mark.parametrize(
    "stream,expected",
    [(None, 1), (1, 1), (2, 2), (0x7F00_DEAD_BEE0, 0x7F00_DEAD_BEE0), (np.int64(5), 5), (-1, None)],
)
def test_normalize_consumer_stream(stream, expected):
    assert dlpack.normalize_consumer_stream(stream) == expected


@pytest.mark.parametrize("stream,exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                        (True, TypeError), ("1", TypeError)])
def test_normalize_consumer_stream_rejects(stream, exc):
    with pytest.raises(exc):
        dlpack.normalize_consumer_stream(stream)


@pytest.mark.parametrize("max_version,expected",
                         [(None, False), ((0, 8), False), ((1, 0), True), ((2, 1), True)])
def test_wants_versioned(max_version, expected):
    assert dlpack.wants_versioned(max_version) is expected


def test_registry_empty_after_mixed_use():
    srcs = [random_array((3, 3), "float32") for _ in range(4)]
    outs = [np.from_dlpack(HostExporter(s, legacy=i % 2 == 1)) for i, s in enumerate(srcs)]
    caps = [HostExporter(s).__dlpack__(max_version=(1, 0)) for s in srcs]
    views = [parse_capsule(c) for c in caps[:2]]
    assert capsules.live_exports() == 8  # 4 held by numpy arrays, 4 by capsules (2 of them parsed)
    del outs, caps
    gc.collect()
    assert capsules.live_exports() == 2
    for v in views:
        v.release()
    assert capsules.live_exports() == 0
