"""CPU tier of hardening against real programs: the decisions behind the GPU fixes, without a device.

- private torch API detection (``interop.torch.private_api``), with a fake torch that hides a function;
- releases deferred while a capture routes allocations (``cgraw._cuda.defer``);
- names of graphed functions (``graphed._name_of``);
- container flattening of arguments and outputs (``arrays._flatten``/``rebuild``/``out_spec``);
- pinned streams in the allocator (graph memory never migrates to eager allocations);
- the stream handle of stream-like objects;
- the tree: tuples of recurrent state, warm-up outputs never poisoned, re-warm after a move.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import sys
import types
import warnings

import numpy as np
import pytest
from fake_tree_backend import FakeFn, FakeTreeBackend, Overwritten, new
from pool_helpers import FakeEvents

from allocator import IntRangeSource, Pool, check_invariants
from cgraw._cuda import defer
from cgraw.trees.arrays import EAGER, STATIC, flatten, out_spec, rebuild, replace_leaves, unflatten
from cgraw.errors import ResourceLeakWarning
from cgraw.trees.graphed import _name_of
from cgraw.interop.torch import private_api
from cgraw.trees.manager import Rewarm, SkipCall, TreeManager

MiB = 1 << 20


# ---------------------------------------------------------------------- private torch API


@pytest.fixture
def fake_torch(monkeypatch):
    """A ``torch`` module with every private function cgraw needs but one."""
    c = types.SimpleNamespace(**{name: (lambda *a, **k: None) for name in private_api.NEEDED})
    del c._cuda_setCheckpointPoolState
    fake = types.ModuleType("torch")
    fake.__version__ = "9.9.0"
    fake._C = c
    monkeypatch.setitem(sys.modules, "torch", fake)
    private_api._reset()
    yield fake
    private_api._reset()


def test_a_missing_private_torch_function_is_named_with_the_version(fake_torch):
    api = private_api.api()
    assert api._cuda_getCheckpointState is fake_torch._C._cuda_getCheckpointState  # found, cached
    with pytest.raises(private_api.TorchApiError) as ei:
        api._cuda_setCheckpointPoolState
    msg = str(ei.value)
    assert "torch._C._cuda_setCheckpointPoolState" in msg and "torch 9.9.0" in msg
    assert private_api.SUPPORTED in msg
    with pytest.raises(private_api.TorchApiError, match="_cuda_setCheckpointPoolState"):
        private_api.check()
    with pytest.raises(AttributeError):
        api.not_a_needed_name


def test_every_private_torch_name_cgraw_uses_is_declared():
    """No ``torch._C`` access outside cgraw/interop/torch/private_api.py: every private name goes through it."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "cgraw")
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py") and f != "private_api.py":
                text = open(os.path.join(dirpath, f)).read()
                assert "torch._C" not in text.replace("torch._C.Tag", ""), f


# ---------------------------------------------------------------------- deferred releases


def _torch_pool(torch, mempool, pool_id):
    """An ``interop.torch.TorchPool`` over a fake MemPool (its constructor would make a real one)."""
    from cgraw.interop.torch.pools import TorchPool

    tp = TorchPool.__new__(TorchPool)
    tp.torch, tp.device, tp.mempool, tp.id = torch, 0, mempool, pool_id
    return tp


def test_dropping_torchs_side_of_a_pool_frees_torchs_cublas_workspaces_first(fake_torch):
    """The workspace torch's warm-up matmul made for a pool's capture stream is a block
    of the pool's MemPool, held by torch's (handle, stream) map; unless it is freed before the
    MemPool goes, the MemPool's private pool keeps a segment for good. Deferred while a capture
    routes allocations, like every release."""
    from cgraw.runtime.memory import _drop_torch

    events = []
    fake_torch._C._cuda_clearCublasWorkspaces = lambda: events.append("clear workspaces")

    class MemPool:
        def __del__(self):
            events.append("MemPool destroyed")

    tp = _torch_pool(fake_torch, MemPool(), (0, 7))
    holder = [tp]
    del tp
    defer.capture_begins()
    try:
        defer.release(_drop_torch, holder[:])
        holder.clear()
        assert events == []  # a capture routes allocations: nothing yet
    finally:
        defer.capture_ends()
    assert events == ["clear workspaces", "MemPool destroyed"]


def test_a_failing_workspace_clear_still_drops_the_pool(fake_torch):
    from cgraw.runtime.memory import _drop_torch

    def boom():
        raise RuntimeError("no CUDA")

    fake_torch._C._cuda_clearCublasWorkspaces = boom
    tp = _torch_pool(fake_torch, object(), (0, 8))
    items = [tp]
    _drop_torch(items)  # never raises: it runs from finalizers
    assert items == []


def test_torch_segments_are_read_without_handing_torch_a_pool_id(fake_torch):
    """torch 2.11's _cuda_memorySnapshot releases a reference it never took to each item of a
    tuple argument: MemPool.snapshot() frees its pool id's int (a mortal int after 256 MemPools),
    which corrupts the heap and aborts the one-process GPU tier. cgraw asks
    with None and filters the segments itself."""

    asked = []
    segs = [
        {"device": 0, "address": 0x1000, "total_size": 512, "segment_pool_id": (0, 300),
         "blocks": [{"address": 0x1000, "size": 256, "state": "active_allocated", "requested_size": 200},
                    {"address": 0x1100, "size": 256, "state": "inactive"}]},
        {"device": 0, "address": 0x9000, "total_size": 64, "segment_pool_id": (0, 0), "blocks": []},
        {"device": 1, "address": 0x5000, "total_size": 128, "segment_pool_id": (0, 300), "blocks": []},
        {"device": 0, "address": 0x3000, "total_size": 256, "segment_pool_id": (0, 301), "blocks": []},
    ]

    def snapshot(arg):
        asked.append(arg)
        return {"segments": segs}

    fake_torch._C._cuda_memorySnapshot = snapshot

    class MemPool:
        def snapshot(self):
            raise AssertionError("MemPool.snapshot() hands torch the pool id")

    tp = _torch_pool(fake_torch, MemPool(), (0, 300))
    assert tp.segments() == [(0x1000, 512)]
    assert tp.allocated() == {0x1000: 200}
    assert tp.reserved_bytes() == 512 and tp.owner_of()(0x1100) and not tp.owner_of()(0x3000)
    assert private_api.memory_segments() is segs
    assert asked and all(a is None for a in asked)


def test_releases_wait_for_the_last_capture_and_keep_their_order():
    ran = []
    defer.release(ran.append, "now")
    assert ran == ["now"]
    defer.capture_begins()
    defer.capture_begins()  # two captures (threads) at once
    defer.release(ran.append, "a")
    defer.release(ran.append, "b")
    assert ran == ["now"] and defer.pending() == 2 and defer.active()
    defer.capture_ends()
    assert ran == ["now"]  # one capture still routes
    defer.capture_ends()
    assert ran == ["now", "a", "b"] and defer.pending() == 0 and not defer.active()


def test_a_failing_release_warns_and_the_others_still_run():
    ran = []

    def boom():
        raise RuntimeError("driver said no")

    defer.capture_begins()
    defer.release(boom)
    defer.release(ran.append, 1)
    with pytest.warns(ResourceLeakWarning, match="driver said no"):
        defer.capture_ends()
    assert ran == [1]


def test_a_release_that_releases_more_runs_them_too():
    ran = []

    def outer():
        defer.release(ran.append, "inner")
        ran.append("outer")

    defer.capture_begins()
    defer.release(outer)
    defer.capture_ends()
    assert ran == ["inner", "outer"]


# ---------------------------------------------------------------------- names


class _Callable:
    def __call__(self, x):
        return x


class _ModuleLike:
    """Like ``nn.Module``: ``__getattr__`` raises for unknown names, a huge ``repr``."""

    def __getattr__(self, name):
        raise AttributeError(name)

    def __repr__(self):
        return "Linear(in_features=...)\n" * 500

    def __call__(self, x):
        return x


class OptimizedModule:  # the name torch.compile gives its wrapper of a module
    def __init__(self, mod):
        self._orig_mod = mod


def test_names_are_short():
    def fn(x):
        return x

    assert _name_of(fn) == "test_names_are_short.<locals>.fn"
    assert _name_of(functools.partial(fn, 1)) == "partial(test_names_are_short.<locals>.fn)"
    assert _name_of(_Callable()) == "_Callable"
    assert _name_of(_ModuleLike()) == "_ModuleLike"
    assert _name_of(OptimizedModule(_ModuleLike())) == "_ModuleLike (compiled)"
    compiled = types.SimpleNamespace(_torchdynamo_orig_callable=fn)
    assert _name_of(compiled) == "test_names_are_short.<locals>.fn (compiled)"


def test_graphed_functions_with_one_name_get_numbers():
    import cgraw

    a, b = cgraw.graphed(_ModuleLike()), cgraw.graphed(_ModuleLike())
    assert a.name.startswith("_ModuleLike") and b.name.startswith("_ModuleLike#") and a.name != b.name
    assert "\n" not in a.name and len(b.name) < 40


# ---------------------------------------------------------------------- containers


class Arr:
    """A CuPy-shaped leaf (``arrays`` recognises CuPy arrays by module name)."""

    __module__ = "cupy.fake"

    def __init__(self, ptr: int, shape=(4,)):
        self.data = types.SimpleNamespace(ptr=ptr)
        self.shape = shape
        self.strides = (4,)
        self.dtype = types.SimpleNamespace(str="<f4")


Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Batch:
    x: object
    scale: float
    tags: tuple = ()


class Outputs(collections.OrderedDict):
    pass


def _flat(*args):
    leaves, key, kinds, ptrs, ops = [], [], [], [], []
    specs = [flatten(a, leaves, key, kinds, ptrs, ops, None) for a in args]
    return leaves, tuple(key), specs


def test_namedtuples_dataclasses_and_dict_subclasses_are_containers():
    x, y, z = Arr(0x100), Arr(0x200), Arr(0x300)
    out = Outputs(first=x, rest=[y, {"deep": z}])
    leaves, key, specs = _flat(Pair(x, y), Batch(z, 0.5, ("t",)), out)
    assert [leaf.data.ptr for leaf in leaves] == [0x100, 0x200, 0x300, 0x100, 0x200, 0x300]
    # rebuilt around other leaves: same types, same non-tensor values
    new_leaves = [Arr(0x1000 + i) for i in range(6)]
    it = iter(new_leaves)
    p, b, o = (rebuild(s, it) for s in specs)
    assert type(p) is Pair and p.a is new_leaves[0] and p.b is new_leaves[1]
    assert type(b) is Batch and b.x is new_leaves[2] and b.scale == 0.5 and b.tags == ("t",)
    assert type(o) is Outputs and list(o) == ["first", "rest"] and o["rest"][1]["deep"] is new_leaves[5]
    # the structure and the non-tensor values are part of the signature
    k2 = _flat(Pair(x, y), Batch(z, 0.25, ("t",)), out)[1]
    k3 = _flat(tuple((x, y)), Batch(z, 0.5, ("t",)), out)[1]
    assert key != k2 and key != k3 and key == _flat(Pair(x, y), Batch(z, 0.5, ("t",)), out)[1]


def test_struct_sequences_are_containers():
    st = os.stat(".")
    leaves, key, specs = _flat(st)
    assert leaves == [] and type(rebuild(specs[0], iter([]))) is type(st)


def test_placeholders_are_substituted_inside_containers():
    x, y = Arr(0x100), Arr(0x200)
    leaves, kinds, ptrs, key, ops = [], [], [], [], []
    specs = [flatten(Pair(x, 3), leaves, key, kinds, ptrs, ops, None),
             flatten(Batch(y, 2.0), leaves, key, kinds, ptrs, ops, STATIC)]
    ph = Arr(0x900)
    args, kwargs = replace_leaves(specs, None, leaves, {0: ph})
    assert args[0].a is ph and args[0].b == 3 and args[1].x is y and kinds == [None, STATIC]
    assert kwargs == {} and EAGER == 0


def test_unhashable_non_containers_are_refused_with_a_reason():
    class Opaque:
        __hash__ = None

    with pytest.raises(SkipCall, match="neither a tensor, a container nor hashable"):
        _flat(Opaque())


def test_outputs_keep_their_containers_and_numpy_outputs_are_refused():
    x, y = Arr(0x100), Arr(0x200)
    leaves = []
    spec = out_spec(Outputs(logits=x, pair=Pair(y, "label")), leaves)
    assert leaves == [x, y]
    out = unflatten(spec, iter([Arr(1), Arr(2)]))
    assert type(out) is Outputs and type(out["pair"]) is Pair and out["pair"].b == "label"
    with pytest.raises(SkipCall, match="NumPy array"):
        out_spec((x, np.zeros(3)), [])


# ---------------------------------------------------------------------- pinned streams


class PinnedPool(Pool):
    pinned: tuple = ()

    def _pinned_streams(self):
        return self.pinned


def test_blocks_of_a_pinned_stream_never_migrate_or_go_back_to_the_source():
    source, events = IntRangeSource(), FakeEvents()
    pool = PinnedPool(source, events=events)
    pool.pinned = (7,)  # stream 7: a live graph's capture stream
    g = pool.malloc(MiB, stream=7)
    pool.free(g)  # the graph still writes there on every replay
    e = pool.malloc(MiB, stream=0)  # an eager allocation: must not get the graph's block
    assert not (g.ptr <= e.ptr < g.ptr + g.size)
    assert pool.trim() == 0 or pool.stats().segments >= 1
    assert pool.owns(g.ptr)  # trim kept the pinned segment
    pool.free(e)
    pool.pinned = ()  # the graph died: the memory is ordinary again
    e2 = pool.malloc(MiB, stream=0)
    assert e2.ptr in (g.ptr, e.ptr)
    pool.free(e2)
    check_invariants(pool)
    pool.close()


# ---------------------------------------------------------------------- streams


def test_stream_handles_of_stream_like_objects():
    from cgraw.runtime.stream import stream_ptr

    class TorchLike:
        cuda_stream = 0x1234

    class Proto:
        def __cuda_stream__(self):
            return (0, 0x5678)

    assert stream_ptr(7) == 7
    assert stream_ptr(TorchLike()) == 0x1234
    assert stream_ptr(Proto()) == 0x5678
    with pytest.raises(TypeError, match="as a CUDA stream"):
        stream_ptr(object())


# ---------------------------------------------------------------------- the tree


def _pair_step(h, c):
    return new(np.tanh(h.value) * 0.5 + c.value * 0.25), new(c.value * 0.5 + 0.1)


def test_recurrent_state_in_a_tuple_is_never_read_after_poisoning():
    be = FakeTreeBackend()
    mgr = TreeManager(be)
    f = FakeFn(_pair_step, mgr, name="cell")
    h, c = be.tensor(np.ones(16)), be.tensor(np.full(16, 2.0))
    rh, rc = np.ones(16), np.full(16, 2.0)
    for _ in range(10):
        prev = (h, c)
        h, c = f(h, c)
        rh, rc = np.tanh(rh) * 0.5 + rc * 0.25, rc * 0.5 + 0.1
        np.testing.assert_allclose(h.value, rh)
        np.testing.assert_allclose(c.value, rc)
        if be.recordings and prev[0].ptr < (1 << 56):  # a replay's output: poisoned after the call
            with pytest.raises(Overwritten):
                prev[0].value
    assert be.count("replay") >= 7 and be.count("warmup") == 1


def test_a_rewarm_reason_warms_up_again_before_recording():
    be = FakeTreeBackend()
    mgr = TreeManager(be)

    def affine(x):
        return new(x.value * 2.0 + 1.0)

    f = FakeFn(affine, mgr)
    x = be.tensor(np.arange(8.0))
    for _ in range(3):
        f(x)
    assert (be.count("warmup"), be.count("record")) == (1, 1)
    be.force_moved["affine"] = Rewarm("a tensor the function reads through its closure moved")
    out = f(x)  # warms up again: eager result, then the next call records
    np.testing.assert_allclose(out.value, np.arange(8.0) * 2.0 + 1.0)
    assert (be.count("warmup"), be.count("record")) == (2, 1)
    f(x)
    assert be.count("record") == 2
    st = mgr.stats[f.fn_id]
    assert st.rerecords == 1 and "closure" in st.rerecord_reasons[0]


def test_a_warm_up_skip_reason_makes_the_function_eager_for_good():
    from cgraw.trees.manager import Warm

    be = FakeTreeBackend()
    mgr = TreeManager(be)
    real = be.warmup

    def warm_with_skip(fn, call, args, kwargs):
        w = real(fn, call, args, kwargs)
        return Warm(w.out, w.mutated, skip="calls custom op mylib.modify.default, tagged cudagraph_unsafe")

    be.warmup = warm_with_skip

    def affine(x):
        return new(x.value + 1.0)

    f = FakeFn(affine, mgr)
    for _ in range(4):
        x = be.tensor(np.arange(4.0))
        np.testing.assert_allclose(f(x).value, np.arange(4.0) + 1.0)
    st = mgr.stats[f.fn_id]
    assert be.count("record") == 0 and st.eager_calls == 3 and st.warmups == 1
    assert any("cudagraph_unsafe" in r for r in st.skip_reasons)


def test_no_stray_warnings_from_this_module():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _flat(Pair(Arr(1), Arr(2)))


def test_a_node_whose_closure_keeps_moving_runs_eagerly_after_the_limit():
    from cgraw.trees.manager import NodeState
    from cgraw.trees.config import config

    be = FakeTreeBackend()
    mgr = TreeManager(be)

    def affine(x):
        return new(x.value * 3.0)

    f = FakeFn(affine, mgr)
    x = be.tensor(np.arange(4.0))
    f(x)
    for _ in range(2 * (config.rewarm_limit + 2)):
        be.force_moved["affine"] = Rewarm("a tensor the function reads through its closure moved")
        np.testing.assert_allclose(f(x).value, np.arange(4.0) * 3.0)
    node = next(iter(mgr.roots.values()))
    assert node.state is NodeState.SKIPPED and "warmed up again" in node.skip_reason
    assert mgr.stats[f.fn_id].eager_calls >= 1


def test_only_assignments_replacing_a_watched_tensor_change_the_epoch():
    from cgraw.interop.torch import observe

    class Mod:
        def __init__(self):
            self._parameters = {"weight": object(), "bias": object()}
            self._buffers = {"running_mean": object()}
            self._modules = {}

    m = Mod()
    e0 = observe.epoch()
    observe._param_hook(Mod(), "weight", object())  # building another model: nothing watched
    assert observe.epoch() == e0
    observe.watch([m._parameters["weight"], m._buffers["running_mean"]])
    try:
        observe._param_hook(m, "bias", object())  # bias is not read by any recording
        assert observe.epoch() == e0
        observe._param_hook(m, "weight", object())
        assert observe.epoch() == e0 + 1
        observe._buffer_hook(m, "running_mean", object())
        assert observe.epoch() == e0 + 2
    finally:
        observe.unwatch([m._parameters["weight"], m._buffers["running_mean"]])
    observe._param_hook(m, "weight", object())
    assert observe.epoch() == e0 + 2


def _raise_in_frame(qualname: str, filename: str, msg: str) -> BaseException:
    """An exception whose traceback has one frame named like a Cython frame of CuPy."""

    def body():
        raise RuntimeError(msg)

    body.__code__ = body.__code__.replace(co_name=qualname, co_filename=filename)
    try:
        body()
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")


@pytest.mark.parametrize("qualname,filename", [
    ("cupy.cuda.memory.MemoryPointer.copy_from_host_async", "cupy/cuda/memory.pyx"),
    ("cupy._core.core._array_default", "cupy/_core/core.pyx"),
    ("cupy.cuda.pinned_memory.PinnedMemoryPool.malloc", "cupy/cuda/pinned_memory.pyx"),
    ("hostAlloc", "cupy_backends/cuda/api/runtime.pyx"),
])
def test_cupy_uploads_are_named_whatever_the_failing_frame(qualname, filename):
    from cgraw.interop.cupy.pools import HOST_SYNC, UPLOAD, CupyRouting

    msg = "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing"
    assert CupyRouting.classify(_raise_in_frame(qualname, filename, msg)) == UPLOAD
    # the same failure elsewhere is a host synchronisation
    other = _raise_in_frame("cupy.cuda.stream.Stream.synchronize", "cupy/cuda/stream.pyx", msg)
    assert CupyRouting.classify(other) == HOST_SYNC


def test_the_legacy_stream_made_to_wait_on_the_capture_is_named_not_called_a_host_sync():
    """torch's message on the H200 when autograd's engine makes the default stream wait on
    a capture: it is not a host synchronisation, and the message must say what it is."""
    from cgraw.interop.torch.pools import HOST_SYNC, LEGACY_WAIT, TorchRouting

    msg = ("CUDA error: operation would make the legacy stream depend on a capturing blocking stream\n"
           "Search for `cudaErrorStreamCaptureImplicit' in https://docs.nvidia.com/cuda/ for more information.")
    assert TorchRouting.classify(RuntimeError(msg)) == LEGACY_WAIT
    assert "AccumulateGrad" in LEGACY_WAIT and "non-blocking stream" in LEGACY_WAIT
    assert TorchRouting.classify(RuntimeError("operation not permitted when stream is capturing")) == HOST_SYNC


def test_a_capture_stream_is_never_destroyed_and_goes_to_the_next_pool_of_its_device(monkeypatch):
    """torch's allocator records events on every stream a block was used on when the block's
    tensor dies, which may be long after the tree whose capture stream it was: a pool's capture
    stream is leased, handed back when the pool is gone, and reused, never destroyed."""
    import types

    from cgraw.runtime import memory

    made = []

    def create(device):
        s = types.SimpleNamespace(device=device, n=len(made))
        made.append(s)
        return s

    monkeypatch.setattr(memory.Stream, "create", staticmethod(create))
    monkeypatch.setattr(memory, "_spare_streams", {})
    d0, d1 = types.SimpleNamespace(ordinal=0), types.SimpleNamespace(ordinal=1)
    a = memory._lease_stream(d0)
    b = memory._lease_stream(d0)
    memory._return_stream(0, a)
    assert memory._lease_stream(d1) is not a and len(made) == 3  # another device's pools never get it
    assert memory._lease_stream(d0) is a and len(made) == 3
    assert b is not a
