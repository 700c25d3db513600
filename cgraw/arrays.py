"""Arrays of any framework, for graph trees: one ``Ops`` object per framework (``TORCH``,
``CUPY``; pointer, bytes, device, contiguity, clone, compare, empty of a shape, alias), found once
per type by ``ops_of``; and the flattening of a call's arguments and outputs into leaves, a
signature and a *spec* that rebuilds them.

Layer L6: no CUDA; torch and CuPy are reached through ``sys.modules`` only (the caller has
imported them), torch's container registry through ``interop.torch_c``.

Containers (inputs and outputs alike): tuples, lists, dicts (and ``OrderedDict`` and other dict
subclasses), namedtuples (so ``PackedSequence``), dataclasses, and every type registered with
torch's pytree (``torch.utils._pytree``; transformers registers its ``ModelOutput``s there) are
flattened; their tensors are leaves and their structure is part of the call's signature. An
``nn.Module`` argument contributes its parameters and buffers as static leaves. Anything else must
be hashable and is part of the signature by value.
"""

from __future__ import annotations

import copy
import dataclasses
import sys

from cgraw.errors import SkipCall
from cgraw.interop import torch_c

EAGER, STATIC, TREE = 0, 1, 2
LEAF = ("t",)  # the spec of a tensor leaf
SINGLE = object()  # the output spec of a function returning one tensor

_tensor_type: list = [None]  # [torch.Tensor] once torch is loaded


def _torch_tensor():
    T = _tensor_type[0]
    if T is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            T = _tensor_type[0] = getattr(torch, "Tensor", None)
    return T


def _is_module(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_structseq(x) -> bool:
    """A C struct sequence such as ``torch.return_types.max`` (a tuple subclass without ``_fields``)."""
    return isinstance(x, tuple) and hasattr(type(x), "n_sequence_fields")


def _pytree_node(t):
    """torch's pytree registration of type ``t`` (for types cgraw has no own rule for), or None."""
    if "torch" not in sys.modules:
        return None
    pt = torch_c.pytree()
    return None if pt is None else pt.SUPPORTED_NODES.get(t)


def _frozen(x):
    """A hashable stand-in for a pytree context (lists and dicts become tuples)."""
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _frozen(v)) for k, v in x.items())
    hash(x)
    return x


# ---------------------------------------------------------------------- inputs


def flatten(a, leaves, key, kinds, ptrs, ops_list, forced):
    """Append ``a``'s array leaves (with kinds, pointers and ops) and signature parts; return its spec.

    An array's signature part is the only 3-tuple ``(shape, strides, dtype)`` (``buckets``
    relies on it); containers add 2-tuples. A leaf's kind is ``forced``, STATIC when its
    framework marks it so, or None (decided by the caller).
    """
    t = type(a)
    ops = ops_of(a)
    if ops is not None:
        ops.check(a)
        leaves.append(a)
        key.append(ops.key(a))
        kinds.append(STATIC if forced is not None or ops.static(a) else None)
        ptrs.append(ops.ptr(a))
        ops_list.append(ops)
        return LEAF
    if t is tuple or t is list:
        key.append((t, len(a)))
        return ("seq", t, [flatten(x, leaves, key, kinds, ptrs, ops_list, forced) for x in a])
    if t is dict:
        key.append((dict, tuple(a)))
        return ("dict", dict, tuple(a), [flatten(v, leaves, key, kinds, ptrs, ops_list, forced) for v in a.values()])
    if _is_module(a):
        key.append(("module", id(a)))
        n0 = len(leaves)
        for x in list(a.parameters()) + list(a.buffers()):
            flatten(x, leaves, key, kinds, ptrs, ops_list, STATIC)
        return ("mod", a, len(leaves) - n0)
    node = _pytree_node(t)
    if node is not None:
        children, context = node.flatten_fn(a)
        try:
            key.append((t, _frozen(context)))
        except TypeError:
            raise SkipCall(f"an argument of type {t.__name__} has an unhashable pytree context") from None
        return ("pytree", t, context, [flatten(x, leaves, key, kinds, ptrs, ops_list, forced) for x in children])
    if _is_namedtuple(a):
        key.append((t, t._fields))
        return ("nt", t, [flatten(x, leaves, key, kinds, ptrs, ops_list, forced) for x in a])
    if _is_structseq(a):
        key.append((t, len(a)))
        return ("ss", t, [flatten(x, leaves, key, kinds, ptrs, ops_list, forced) for x in a])
    if isinstance(a, dict):
        key.append((t, tuple(a)))
        return ("dictsub", a, tuple(a), [flatten(v, leaves, key, kinds, ptrs, ops_list, forced) for v in a.values()])
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        names = tuple(f.name for f in dataclasses.fields(a))
        key.append((t, names))
        return ("dc", a, names, [flatten(getattr(a, n), leaves, key, kinds, ptrs, ops_list, forced) for n in names])
    if t.__module__ == "numpy" and t.__name__ == "ndarray":
        raise SkipCall("CPU tensors or ops: a NumPy array input lives on the CPU (move it to the device "
                       "before the call)")
    try:
        hash(a)
    except TypeError:
        raise SkipCall(f"an argument of type {t.__name__} is neither a tensor, a container nor hashable") from None
    key.append((t, a))
    return ("v", a)


def rebuild(spec, it):
    """The structure ``spec`` describes, with its leaves taken in order from ``it``."""
    kind = spec[0]
    if kind == "t":
        return next(it)
    if kind == "v":
        return spec[1]
    if kind == "seq":
        return spec[1](rebuild(s, it) for s in spec[2])
    if kind == "dict":
        return dict(zip(spec[2], [rebuild(s, it) for s in spec[3]]))
    if kind == "mod":
        for _ in range(spec[2]):
            next(it)
        return spec[1]
    if kind == "pytree":
        node = _pytree_node(spec[1])
        return node.unflatten_fn([rebuild(s, it) for s in spec[3]], spec[2])
    if kind == "nt":
        return spec[1](*[rebuild(s, it) for s in spec[2]])
    if kind == "ss":
        return spec[1]([rebuild(s, it) for s in spec[2]])
    if kind == "dictsub":
        new = copy.copy(spec[1])
        values = [rebuild(s, it) for s in spec[3]]
        dict.clear(new)
        dict.update(new, zip(spec[2], values))
        return new
    if kind == "dc":
        new = copy.copy(spec[1])
        for name, s in zip(spec[2], spec[3]):
            object.__setattr__(new, name, rebuild(s, it))
        return new
    raise AssertionError(f"unknown spec {kind!r}")


def replace_leaves(arg_specs, kwarg_specs, leaves, placeholders):
    """Rebuild a call's args and kwargs with placeholders in place of the eager leaves."""
    it = iter([placeholders.get(j, t) for j, t in enumerate(leaves)])
    new_args = tuple(rebuild(s, it) for s in arg_specs)
    new_kwargs = {k: rebuild(s, it) for k, s in kwarg_specs} if kwarg_specs else {}
    return new_args, new_kwargs


# ---------------------------------------------------------------------- outputs


def out_spec(out, leaves: list):
    """Flatten an output structure (same container rules as inputs; anything else is a constant);
    returns a spec for ``unflatten``. Raises SkipCall for outputs a replay cannot reproduce."""
    if ops_of(out) is not None:
        _out_leaf(out, leaves)
        return SINGLE
    return _out_spec(out, leaves)


def _out_leaf(x, leaves) -> None:
    if ops_of(x) is TORCH and x.layout is not sys.modules["torch"].strided:
        raise SkipCall(f"the function returns a sparse or other non-strided tensor ({x.layout}), whose "
                       "memory a graph cannot hand out again")
    leaves.append(x)


def _out_spec(x, leaves):
    if ops_of(x) is not None:
        _out_leaf(x, leaves)
        return LEAF
    t = type(x)
    if t is tuple or t is list:
        return ("seq", t, [_out_spec(v, leaves) for v in x])
    if t is dict:
        return ("dict", dict, tuple(x), [_out_spec(v, leaves) for v in x.values()])
    node = _pytree_node(t)
    if node is not None:
        children, context = node.flatten_fn(x)
        return ("pytree", t, context, [_out_spec(v, leaves) for v in children])
    if _is_namedtuple(x):
        return ("nt", t, [_out_spec(v, leaves) for v in x])
    if _is_structseq(x):
        return ("ss", t, [_out_spec(v, leaves) for v in x])
    if isinstance(x, dict):
        return ("dictsub", x, tuple(x), [_out_spec(v, leaves) for v in x.values()])
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = tuple(f.name for f in dataclasses.fields(x))
        return ("dc", x, names, [_out_spec(getattr(x, n), leaves) for n in names])
    if t.__module__ == "numpy" and t.__name__ == "ndarray":
        raise SkipCall("CPU tensors or ops: the function returns a NumPy array, which a replay "
                       "would return unchanged")
    return ("v", x)


def unflatten(spec, it):
    if spec is SINGLE:
        return next(it)
    return rebuild(spec, it)


# ---------------------------------------------------------------------- per framework


class Ops:
    """What graph trees need of one framework's arrays. One instance per framework; ``ops_of``
    picks it once per type, and a call's input plan keeps it per leaf (``calls.Call.ops``)."""

    __slots__ = ()
    name = "?"
    poisonable = False  # end of a generation: reading a handed-out output raises (torch)

    def check(self, t) -> None:
        """Raise ``SkipCall`` for arrays a graph cannot read or hand out (sparse torch tensors)."""

    def key(self, t) -> tuple:
        """The array's part of a call's signature: ``(shape, strides, dtype)``."""
        raise NotImplementedError

    def static(self, t) -> bool:
        """Whether the framework marks ``t`` as living at a fixed address (read in place)."""
        return False


class _TorchOps(Ops):
    __slots__ = ()
    name = "torch"
    poisonable = True

    def check(self, t) -> None:
        if t.layout is not sys.modules["torch"].strided:
            raise SkipCall(f"sparse or other non-strided tensors ({t.layout}) are not supported")

    def key(self, t):
        return (t.shape, t.stride(), t.dtype)

    def static(self, t) -> bool:
        # nn.Parameter, or torch._dynamo.mark_static_address (transformers' static caches)
        return (isinstance(t, sys.modules["torch"].nn.Parameter)
                or getattr(t, "_dynamo_static_input_type", None) is not None)

    def ptr(self, t) -> int:
        return t.data_ptr()

    def base_ptr(self, t) -> int:
        """Start of the allocation ``t`` views."""
        return t.untyped_storage().data_ptr()

    def nbytes(self, t) -> int:
        return t.numel() * t.element_size()

    def device(self, t) -> int:
        return t.get_device()

    def contiguous(self, t) -> bool:
        return t.is_contiguous()

    def empty(self, shape, like):
        return sys.modules["torch"].empty(shape, dtype=like.dtype, device=like.device)

    def clone(self, t):
        return t.clone()

    def snapshot(self, t):
        """A host copy of ``t``'s bytes (a warm-up's mutation check: no device memory)."""
        return _torch_bytes(t)

    def same(self, snap, t) -> bool:
        """Whether ``t`` still holds ``snap``'s bytes (bitwise: NaNs equal themselves, -0.0 is not 0.0)."""
        return bool(sys.modules["torch"].equal(snap, _torch_bytes(t)))

    def copy_into(self, dst, src) -> None:
        dst.copy_(src)

    def alias_maker(self, t):
        """A bound method returning a new object over ``t``'s memory (each call's outputs are
        distinct objects)."""
        return t.detach

    def view_of(self, leaf, out, base):
        """``out`` viewed ``base`` (a placeholder, or the leaf at record time); the same view of
        ``leaf``, which has ``base``'s layout. None when the view cannot be carried over."""
        if out.dtype != base.dtype or leaf.dtype != base.dtype:
            return None
        if out is base:
            return leaf
        delta = out.storage_offset() - base.storage_offset()
        return leaf.as_strided(out.shape, out.stride(), leaf.storage_offset() + delta)


class _CupyOps(Ops):
    __slots__ = ()
    name = "cupy"

    def key(self, t):
        return (t.shape, t.strides, t.dtype.str)

    def ptr(self, t) -> int:
        return int(t.data.ptr)

    def base_ptr(self, t) -> int:
        mem = t.data.mem
        return int(mem.ptr) if mem is not None else int(t.data.ptr)

    def nbytes(self, t) -> int:
        return t.nbytes

    def device(self, t) -> int:
        return t.device.id

    def contiguous(self, t) -> bool:
        return t.flags.c_contiguous

    def empty(self, shape, like):
        return sys.modules["cupy"].empty(shape, dtype=like.dtype)

    def clone(self, t):
        return t.copy()

    def snapshot(self, t):
        return _cupy_bytes(t)

    def same(self, snap, t) -> bool:
        return bool((snap == _cupy_bytes(t)).all())

    def copy_into(self, dst, src) -> None:
        dst[...] = src

    def alias_maker(self, t):
        return t.view

    def view_of(self, leaf, out, base):
        if out.dtype != base.dtype:
            return None
        if out is base:
            return leaf
        cupy = sys.modules["cupy"]
        return cupy.ndarray(out.shape, out.dtype, leaf.data + (int(out.data.ptr) - int(base.data.ptr)),
                            out.strides)


def _torch_bytes(t):
    """``t``'s elements in host memory as one flat uint8 tensor (a copy even for a CPU tensor)."""
    h = t.detach().to("cpu", copy=True).resolve_conj().resolve_neg().contiguous()
    return h.reshape(-1).view(sys.modules["torch"].uint8)


def _cupy_bytes(t):
    """``t``'s elements in host memory as one flat uint8 numpy array."""
    import numpy

    return numpy.ascontiguousarray(sys.modules["cupy"].asnumpy(t)).reshape(-1).view(numpy.uint8)


TORCH = _TorchOps()
CUPY = _CupyOps()

_by_type: dict = {}  # type -> Ops or None, filled by ops_of
_registered: list = []  # (type, Ops) from register()


def register(cls: type, ops: Ops) -> None:
    """Treat instances of ``cls`` as arrays with ``ops`` (tests register a simulated array)."""
    _registered.append((cls, ops))
    _by_type.clear()


def ops_of(x) -> Ops | None:
    """The ``Ops`` of ``x``'s framework, or None when ``x`` is not an array. Worked out once per type."""
    t = type(x)
    try:
        return _by_type[t]
    except KeyError:
        pass
    ops = _detect(t, x)
    if "torch" in sys.modules or ops is not None:  # before torch loads, a type may still become one
        _by_type[t] = ops
    return ops


def _detect(t: type, x) -> Ops | None:
    for cls, ops in _registered:
        if issubclass(t, cls):
            return ops
    T = _torch_tensor()
    if T is not None and issubclass(t, T):
        return TORCH
    mod = t.__module__ or ""
    if mod.startswith("torch") and hasattr(x, "data_ptr"):
        return TORCH
    if mod.startswith("cupy") and hasattr(x, "data") and hasattr(x, "strides"):
        return CUPY
    return None


def is_torch(x) -> bool:
    return ops_of(x) is TORCH


class _NoType:
    """Stands for torch.Tensor when torch is not loaded: no object has this exact type."""
