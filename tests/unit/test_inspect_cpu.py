"""CPU tests of ``cgraw.trees.calls.inspect``: how a graphed call's arguments are classified and which
ones make it skip, with CuPy-shaped stand-ins (no device and no CuPy needed); and of a
recording's padded replay (``cgraw.trees.recording``)."""

from __future__ import annotations

import contextlib
import types

import pytest

import cgraw
from cgraw.trees import calls
from cgraw.trees.calls import EAGER, STATIC, TREE
from cgraw.errors import SkipCall


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


class _Tree:
    """Classifies calls as the tree of device ``ordinal`` does."""

    def __init__(self, ordinal: int = 0):
        self.ordinal = ordinal

    def inspect(self, fn, args, kwargs, tree_outputs):
        return calls.inspect(fn, args, kwargs, tree_outputs, self.ordinal)


def _backend(ordinal: int = 0) -> _Tree:
    return _Tree(ordinal)


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


def _fake_launch(monkeypatch) -> list:
    """The raw launch a recording's replay inlines, recorded instead of run: ``[(exec, stream)]``."""
    from cgraw.trees import recording
    from cgraw.runtime import stream

    launches = []
    monkeypatch.setattr(recording, "_launch", lambda exec_, ptr: launches.append((exec_, ptr)) or (0,))
    monkeypatch.setattr(stream, "current_getter", lambda ordinal: 0x5000 + ordinal)
    return launches


def test_padded_replay_patches_counts_and_cuts_outputs(monkeypatch):
    from cgraw.trees.arrays import SINGLE
    from cgraw.trees.recording import OWNED, InputCopy, Recording

    patched = []

    def setter(node, dst, src, count):
        patched.append((node, dst, src, count))

    launches = _fake_launch(monkeypatch)
    rec = Recording("f")
    rec.bucket, rec.padded, rec.setter, rec.exec_ = 8, frozenset({0}), setter, "exec"
    # input 0 padded (64 bytes a row, recorded with 5 rows), input 1 not (fixed 128 bytes);
    # a mutated padded input is copied back: row count patched too (dst is the caller's tensor)
    rec.copies = [InputCopy(0, "n0", 0xA00, 0x100, 5 * 64, 64, back=False),
                  InputCopy(1, "n1", 0xB00, 0x200, 128, 0, back=False),
                  InputCopy(0, "b0", 0xA00, 0x100, 5 * 64, 64, back=True)]
    rec.out_leaves = [SliceableArray(0xC00, (8, 16)), SliceableArray(0xD00, (3,))]
    rec.out_spec = ("seq", tuple, [("t",), ("t",)])
    rec.out_kinds, rec.owned_idx = [OWNED, OWNED], [0, 1]
    rec.out_alias = [t.view for t in rec.out_leaves]
    rec.out_rows = [0]

    def call(n, p0=0x100, p1=0x200):
        c = types.SimpleNamespace(rows=n, ptrs=[p0, p1], leaves=[None, None])
        out, owned = rec.replay(c)
        # every owned output is handed out, CuPy's too: the tree watches whether they live
        assert owned == (list(out) if isinstance(out, tuple) else [out])
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
    assert launches == [("exec", 0x5000)] * 4
    rec.out_spec, rec.out_leaves, rec.out_rows = SINGLE, [SliceableArray(0xC00, (8, 16))], [0]
    rec.out_kinds, rec.owned_idx, rec.out_alias = [OWNED], [0], [rec.out_leaves[0].view]
    assert call(6).shape == (6, 16)


def test_plain_replay_patches_only_moved_inputs_and_hands_out_its_owned_output(monkeypatch):
    from cgraw.trees.recording import OWNED, InputCopy, Recording

    patched, launches = [], _fake_launch(monkeypatch)
    rec = Recording("g")
    rec.setter = lambda node, dst, src, count: patched.append((node, dst, src, count))
    rec.exec_, rec.ordinal = "exec", 1
    rec.copies = [InputCopy(0, "n0", 0xA00, 0x100, 256, 0, back=False),
                  InputCopy(1, "n1", 0xB00, 0x200, 128, 0, back=False)]
    out_arr = SliceableArray(0xC00, (4, 16))
    rec.out_leaves, rec.out_kinds, rec.owned_idx = [out_arr], [OWNED], [0]
    rec.out_alias = [out_arr.view]
    from cgraw.trees.arrays import SINGLE
    rec.out_spec, rec.alias0 = SINGLE, out_arr.view

    def call(p0, p1):
        return rec.replay(types.SimpleNamespace(rows=None, ptrs=[p0, p1], leaves=[None, None]))

    out, owned = call(0x100, 0x200)
    assert patched == [] and out.data.ptr == 0xC00 and out is not out_arr and owned == (out,)
    call(0x300, 0x200)
    call(0x300, 0x200)  # the node already holds 0x300: no second patch
    assert patched == [("n0", 0xA00, 0x300, 256)] and launches == [("exec", 0x5001)] * 3


@pytest.mark.parametrize("wrap", [lambda o: o, lambda o: (o,), lambda o: [o]], ids=["alone", "tuple", "list"])
def test_one_owned_output_alone_or_in_a_sequence_of_one_is_handed_out_by_the_fastest_replay(monkeypatch, wrap):
    """Inductor's code returns its one output in a tuple or list of one: the replay hands out a fresh
    alias of it inside the same kind of sequence, as ``unflatten`` would, and owns it."""
    torch = pytest.importorskip("torch")
    from cgraw.trees.arrays import one_leaf, out_spec, unflatten
    from cgraw.trees.recording import OWNED, Recording

    _fake_launch(monkeypatch)
    out_t = torch.randn(4, 16)
    rec = Recording("g")
    rec.exec_, rec.ordinal = "exec", 1
    rec.out_spec = out_spec(wrap(out_t), rec.out_leaves)
    rec.out_kinds, rec.owned_idx, rec.out_alias = [OWNED], [0], [out_t.detach]
    seq = one_leaf(rec.out_spec)
    assert seq is not False
    rec.alias0, rec.seq0 = out_t.detach, seq
    out, owned = rec.replay(types.SimpleNamespace(rows=None, ptrs=[], leaves=[]))
    want = unflatten(rec.out_spec, iter(owned))
    assert type(out) is type(want) and len(owned) == 1 and owned[0] is not out_t
    assert (out if seq is None else out[0]) is owned[0] and owned[0].data_ptr() == out_t.data_ptr()


def test_only_one_array_alone_or_in_a_tuple_or_list_of_one_has_the_fastest_replay():
    torch = pytest.importorskip("torch")
    from cgraw.trees.arrays import one_leaf, out_spec

    a, b = torch.randn(4), torch.randn(4)
    for out in ((a, b), [(a,)], (a, 3), {"k": a}, [a, a], ((a,),)):
        assert one_leaf(out_spec(out, [])) is False, out


def test_a_replay_hands_out_fresh_aliases_of_every_output_in_order_whether_or_not_all_are_owned(monkeypatch):
    """A recording whose output leaves are all its own (a compiled piece's activations) hands out
    a fresh alias of each, in order, all of them owned, one object for a leaf returned twice; with
    an external leaf among them, that leaf is handed out as it is and is not owned."""
    from cgraw.trees.recording import EXTERNAL, OWNED, Recording

    _fake_launch(monkeypatch)
    arrays = [SliceableArray(0xC00 + 0x100 * i, (i + 2, 4)) for i in range(4)]
    for external in (False, True):
        rec = Recording("piece")
        rec.exec_ = "exec"
        rec.out_leaves = arrays + [arrays[1]]  # the last leaf is the second one again
        rec.out_spec = ("seq", tuple, [("t",)] * 5)
        rec.out_kinds = [OWNED, OWNED, EXTERNAL if external else OWNED, OWNED, OWNED]
        rec.owned_idx = [i for i, k in enumerate(rec.out_kinds) if k is OWNED]
        rec.out_alias = [t.view if k is OWNED else None for t, k in zip(rec.out_leaves, rec.out_kinds)]
        rec.out_same = ((4, 1),)
        assert (rec.all_owned is None) == external
        out, owned = rec.replay(types.SimpleNamespace(rows=None, ptrs=[], leaves=[]))
        assert [o.data.ptr for o in out] == [t.data.ptr for t in rec.out_leaves]
        assert out[4] is out[1] and all(o is not t for o, t in zip(out, arrays) if o is not arrays[2])
        assert (out[2] is arrays[2]) == external
        want = [out[i] for i in range(5) if not (external and i == 2)]
        assert len(owned) == len(want) and all(a is b for a, b in zip(owned, want))


def test_generation_end_poisons_the_torch_outputs_and_skips_cupy_ones(monkeypatch):
    """Replays hand out their owned outputs of every framework (the tree watches whether they
    live); the CUDA backend poisons the torch ones still alive and passes over CuPy arrays,
    which cannot be poisoned."""
    from cgraw.trees import frameworks
    from cgraw.trees.cuda_backend import CudaBackend

    class TorchLike:
        pass

    monkeypatch.setattr(frameworks, "_registered", [(TorchLike, frameworks.TORCH)])
    monkeypatch.setattr(frameworks, "_by_type", {})
    poisoned, cloned = [], []
    tts = types.SimpleNamespace(poison=lambda t, msg: poisoned.append((t, msg)), clone_out=cloned.append)
    be = types.SimpleNamespace(_tts=tts, _messages={}, grad_views=list)
    t, a = TorchLike(), FakeArray(0xC00)
    CudaBackend.end_generation(be, [("f", t), ("g", a)], None)
    assert [x for x, _ in poisoned] == [t] and "'f'" in poisoned[0][1]
    CudaBackend.end_generation(be, [("f", t), ("g", a)], "user_visible")
    assert cloned == [[t]]  # the torch outputs, in one call: storages shared among them are copied once


# ---------------------------------------------------------------------- the plain-tensor fast path


def _on_device0(torch, monkeypatch):
    """A tensor and a parameter type whose instances say they live on device 0, installed as the
    exact types ``calls.inspect``'s fast paths look for."""

    class OnDevice0(torch.Tensor):
        def get_device(self):
            return 0

    class ParamOnDevice0(torch.nn.Parameter):
        def get_device(self):
            return 0

    monkeypatch.setattr(calls, "_tensor", [OnDevice0, ParamOnDevice0])
    return OnDevice0, ParamOnDevice0


@pytest.mark.parametrize("keyed", ["bare", "grad_and_settings"])
def test_the_plain_tensor_fast_path_classifies_as_the_generic_path(torch_mod, monkeypatch, keyed):
    """``calls.inspect`` takes a shortcut when every argument is an exact ``torch.Tensor`` or
    ``nn.Parameter`` (no options), and a shorter one for a single tensor: its Call must equal the
    generic path's, for tree outputs, marked tensors and parameters (static) alike, and with grad
    mode and the kernel-choosing settings in the key (grad on and off, inputs requiring grad,
    settings flipped between calls).
    CPU tensors of a subclass that reports device 0 stand in for CUDA ones."""
    import random

    torch = torch_mod
    if keyed == "grad_and_settings":
        from cgraw.interop.torch.kernel_state import KernelState

        monkeypatch.setattr(calls, "_grad_mode", [torch.is_grad_enabled])
        ks = KernelState(torch)
        monkeypatch.setattr(calls, "_kernel", [ks, ks.getters(None)])
    OnDevice0, ParamOnDevice0 = _on_device0(torch, monkeypatch)  # the exact types of the fast path

    def arg():
        t = torch.randn(rng.choice([(4,), (2, 3), (3, 2)]))
        grad = keyed != "bare" and rng.random() < 0.3
        if rng.random() < 0.25:
            return ParamOnDevice0(t, requires_grad=grad)
        t = t.as_subclass(OnDevice0)
        return t.requires_grad_() if grad else t

    rng = random.Random(7)
    for trial in range(200):
        n = rng.randint(1, 4)
        args = tuple(arg() for _ in range(n))
        if rng.random() < 0.3:
            args = args + (args[0],)  # the same tensor twice
        tree_outputs = {a.data_ptr(): object() for a in args if rng.random() < 0.4}
        marked = [calls.mark_static(a) for a in args if rng.random() < 0.2]
        fast_fn, generic_fn = _fn(), _fn()
        generic_fn.plain = False  # the same function, made to take the generic path
        with contextlib.ExitStack() as stack:
            if keyed != "bare":
                if rng.random() < 0.5:
                    stack.enter_context(torch.no_grad())
                if rng.random() < 0.3:
                    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
                if rng.random() < 0.3:
                    stack.enter_context(torch.inference_mode())
            fast = calls.inspect(fast_fn, args, {}, tree_outputs, 0)
            generic = calls.inspect(generic_fn, args, {}, tree_outputs, 0)
        assert fast.grad == generic.grad, trial
        for field in ("key", "kinds", "ptrs", "arg_spans", "arg_specs", "kwarg_specs", "bucket", "rows", "padded"):
            assert list(getattr(fast, field) or []) == list(getattr(generic, field) or []), (trial, field)
        assert list(fast.ops) == list(generic.ops) and all(o is calls.TORCH for o in fast.ops)
        assert fast.leaves == list(args) and generic.leaves == list(args)
        params = [a for a in args if type(a) is ParamOnDevice0]
        assert (STATIC in fast.kinds) == bool(marked or params)
        for a, kind in zip(args, fast.kinds):  # a parameter is static, as the framework says
            if type(a) is ParamOnDevice0:
                assert kind == STATIC and calls.TORCH.static(a)
        del marked
    with pytest.raises(SkipCall, match="inputs on device 0, but this tree is on device 1"):
        calls.inspect(_fn(), (torch.randn(3).as_subclass(OnDevice0),), {}, {}, 1)


def test_a_call_whose_input_dtypes_its_caller_guarantees_classifies_as_the_generic_path(torch_mod, monkeypatch):
    """A graphed function whose caller guarantees its inputs' dtypes and devices
    (``inputs_guarded``: the torch.compile backend's partitions) takes a shorter path through
    ``calls.inspect``: its Call equals the generic path's in every field but the key, for
    parameters (static), tree outputs and eager tensors, followed by the partition's sizes as ints.
    Its key tells apart what selects another recording of one compiled graph: the number of
    tensors, a size argument, grad mode; not a tensor's kind, and not its shape or strides, which
    dynamo's guards fix for the compiled graph (torch's trees key Inductor's graphs the same way)."""
    import random

    torch = torch_mod
    OnDevice0, ParamOnDevice0 = _on_device0(torch, monkeypatch)
    monkeypatch.setattr(calls, "_grad_mode", [torch.is_grad_enabled])
    rng = random.Random(11)

    def tensor(shape):
        t = torch.randn(shape)
        if rng.random() < 0.3:
            return ParamOnDevice0(t, requires_grad=rng.random() < 0.5)
        return t.as_subclass(OnDevice0)

    def asserted_fn():
        f = _fn()
        f.inputs_guarded = True
        return f

    for trial in range(200):
        n = rng.randint(1, 5)
        args = tuple(tensor(rng.choice([(4,), (2, 3)])) for _ in range(n)) + tuple(
            rng.randint(1, 9) for _ in range(rng.randint(0, 2)))
        tree_outputs = {a.data_ptr(): object() for a in args[:n] if rng.random() < 0.4}
        with contextlib.ExitStack() as stack:
            if rng.random() < 0.5:
                stack.enter_context(torch.no_grad())
            fast = calls.inspect(asserted_fn(), args, {}, tree_outputs, 0)
            generic_fn = _fn()
            generic_fn.plain = False
            generic = calls.inspect(generic_fn, args, {}, tree_outputs, 0)
        for field in ("kinds", "ptrs", "arg_spans", "arg_specs"):
            assert list(getattr(fast, field)) == list(getattr(generic, field)), (trial, field)
        assert fast.grad == generic.grad and fast.kwarg_specs is None and generic.kwarg_specs is None
        assert list(fast.ops) == list(generic.ops) and fast.leaves == list(args[:n]) == generic.leaves
        one_tensor = len(args) == 1 and type(args[0]) is OnDevice0  # the one-tensor path checks it all
        assert (fast.key == generic.key) if one_tensor else (fast.key[0] is calls.GUARDED), trial

    f = asserted_fn()
    x, w = tensor((4, 3)).as_subclass(OnDevice0), ParamOnDevice0(torch.randn(3, 3), requires_grad=False)

    def key(*args):
        return calls.inspect(f, args, {}, {}, 0).key

    assert key(x, w, 4) == key(torch.randn(4, 3).as_subclass(OnDevice0), w, 4)  # another tensor, same shape
    # sizes and strides are not read: for one compiled graph the guards fix them
    assert key(x, w, 4) == key(torch.randn(3, 4).as_subclass(OnDevice0).t(), w, 4)
    assert key(x, w, 4) != key(x, 4) and key(x, w, 4) != key(x, w, x, 4)  # the number of tensors
    assert key(x, w, 4) != key(x, w, 5)  # a partition's size argument
    assert key(x, w, 4) == key(x, torch.randn(3, 3).as_subclass(OnDevice0), 4)  # a parameter, then a tensor like it
    with torch.no_grad():
        without_grad = key(x, w, 4)
    with torch.enable_grad():
        assert key(x, w, 4) != without_grad  # grad mode
    assert key(x, w, 4) != key(x, w)
    # arguments that do not start with a tensor: the generic path
    assert calls.inspect(f, (4, x), {}, {}, 0).key[0] is not calls.GUARDED
    # declared static positions (the compiled graph's static inputs): an eager tensor there is
    # static, a tree output stays one, a parameter stays static
    y = tensor((4, 3)).as_subclass(OnDevice0)
    f.static_positions = (0, 1, 2)
    kinds = calls.inspect(f, (x, y, w, tensor((2,)).as_subclass(OnDevice0)), {}, {y.data_ptr(): object()}, 0).kinds
    assert list(kinds) == [STATIC, TREE, STATIC, EAGER]


def test_a_recording_is_stale_after_a_module_assignment_or_a_moved_closure_tensor():
    """``Recording.stale`` (the replay check of what the warm-up learned): a module assignment
    since the recording, or a closure tensor at another address, asks for a new warm-up."""
    from cgraw.trees.recording import Recording
    from cgraw.trees.nodes import Rewarm

    epoch = [5]
    rec = Recording("f")
    rec.epoch, rec.epoch_now = 5, epoch
    addresses = [0x100, 0x200]
    rec.ext_ptrs = [0x100, 0x200]
    rec.same_external = lambda ptrs: list(addresses) == ptrs
    assert rec.stale() is None
    addresses[1] = 0x300  # param.data = ... on a closure tensor
    reason = rec.stale()
    assert isinstance(reason, Rewarm) and "closure moved" in reason
    addresses[1] = 0x200
    epoch[0] = 6  # model.layer = ... anywhere since the recording
    reason = rec.stale()
    assert isinstance(reason, Rewarm) and "reassigned" in reason
    rec.epoch = -1  # a module was assigned between the warm-up and the recording: warm up again
    assert isinstance(rec.stale(), Rewarm)


def test_a_stale_recording_launches_nothing_and_returns_why(monkeypatch):
    """``Recording.replay`` checks what the warm-up learned first: out of date, it launches nothing
    and returns the ``Rewarm`` reason (the tree warms the node up again); the first replay, made
    right after recording, is not checked."""
    from cgraw.trees.arrays import SINGLE
    from cgraw.trees.nodes import Rewarm
    from cgraw.trees.recording import OWNED, Recording

    launches = _fake_launch(monkeypatch)
    rec = Recording("f")
    rec.exec_, rec.ordinal = "exec", 0
    out_arr = SliceableArray(0xC00, (4,))
    rec.out_leaves, rec.out_kinds, rec.owned_idx = [out_arr], [OWNED], [0]
    rec.out_alias, rec.out_spec, rec.alias0 = [out_arr.view], SINGLE, out_arr.view
    epoch = [3]
    rec.epoch, rec.epoch_now = 3, epoch
    call = types.SimpleNamespace(rows=None, ptrs=[], leaves=[])
    out, owned = rec.replay(call)
    assert len(launches) == 1 and owned == (out,)
    epoch[0] = 4  # a module assignment since the recording
    why = rec.replay(call)
    assert isinstance(why, Rewarm) and "reassigned" in why and len(launches) == 1
    out, _ = rec.replay(call, first=True)
    assert len(launches) == 2 and out.data.ptr == 0xC00


def test_a_tree_capture_takes_a_thread_or_stream_route_only():
    from cgraw.runtime.capture import capture

    with pytest.raises(ValueError, match="route"):
        capture.for_tree(None, None, warm_cublas=False, route="device")
    cap = capture.for_tree(None, None, warm_cublas=False, route="stream")
    assert (cap._tree, cap._route) == (True, "stream")


def test_one_guarded_function_called_many_ways_classifies_each_call_as_the_generic_path(torch_mod, monkeypatch):
    """A guarded function remembers, per tuple of argument types, its leading tensors and their
    kinds. Calls of one such function that vary the types, the tree outputs, ``mark_static`` and its
    ``static_positions`` between calls get, every one, the kinds of the generic path with the static
    positions applied (an eager tensor there is static, a tree output stays one, a parameter static)."""
    import random

    torch = torch_mod
    OnDevice0, ParamOnDevice0 = _on_device0(torch, monkeypatch)
    rng = random.Random(5)
    f = _fn()
    f.inputs_guarded = True
    pool = [torch.randn(3).as_subclass(OnDevice0) for _ in range(6)] + [
        ParamOnDevice0(torch.randn(3), requires_grad=False) for _ in range(3)]
    marked = [calls.mark_static(pool[0])]
    generic_fn = _fn()
    generic_fn.plain = False
    for trial in range(300):
        if rng.random() < 0.1:
            f.static_positions = tuple(sorted(rng.sample(range(5), rng.randint(0, 3))))
        n = rng.randint(1, 5)
        args = tuple(rng.choice(pool) for _ in range(n)) + tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 2)))
        if len(args) == 1:
            continue  # the one-tensor path, not the guarded one
        tree_outputs = {a.data_ptr(): object() for a in args[:n] if rng.random() < 0.4}
        got = calls.inspect(f, args, {}, tree_outputs, 0)
        want = list(calls.inspect(generic_fn, args, {}, tree_outputs, 0).kinds)
        for j in f.static_positions:
            if j < n and want[j] is EAGER:
                want[j] = STATIC
        assert got.key[0] is calls.GUARDED and list(got.kinds) == want, (trial, f.static_positions)
        assert list(got.ptrs) == [a.data_ptr() for a in args[:n]]
    # a non-tensor among the tensors: the general path, every time
    assert calls.inspect(f, (pool[1], "x", pool[2]), {}, {}, 0).key[0] is not calls.GUARDED
    assert calls.inspect(f, (pool[1], "x", pool[2]), {}, {}, 0).key[0] is not calls.GUARDED
    del marked
