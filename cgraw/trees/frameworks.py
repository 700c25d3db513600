"""Arrays of every framework, as graph trees see them: one ``Ops`` object per framework
(``TORCH``, ``CUPY``: pointer, bytes, device, layout, contiguity, clone, compare, empty arrays of
a shape or of another array's layout, alias), found once per type by ``ops_of``.

Layer L6: no CUDA; torch and CuPy are reached through ``sys.modules`` only (the caller has
imported them).

Layouts. A recording's function sees each eager input in a placeholder of the caller's layout
(``Ops.empty_layout``: sizes, strides, and the storage offset, or its alignment where the offset
is far into a large storage), so eager's kernels run and outputs get eager's strides. One memcpy
node moves the input's *span* (its first element to its last, gaps included) when that is at
most twice its elements or they may overlap (``Ops.node_bytes``); an input that is mostly gaps is
copied element by element before each launch.
"""

from __future__ import annotations

import sys

from cgraw.errors import SkipCall
from cgraw.interop.torch import private_api

_tensor_type: list = [None]  # [torch.Tensor] once torch is loaded


def _torch_tensor():
    T = _tensor_type[0]
    if T is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            T = _tensor_type[0] = getattr(torch, "Tensor", None)
    return T


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

    def node_bytes(self, t) -> int:
        """Bytes one memcpy node copies to move ``t`` into a placeholder of its layout
        (``empty_layout``): its span, when that is at most twice its elements' bytes or its
        elements may overlap; else 0 (its elements are copied one by one, before each launch)."""
        n = self.nbytes(t)
        s = self.span(t)
        if not n or s < 0:
            return n if n and self.contiguous(t) else 0
        return s if s <= 2 * n or self.may_overlap(t) else 0

    def clone_layout(self, t):
        """A copy of ``t`` with its layout (``empty_layout``), gaps included."""
        c = self.empty_layout(t)
        if not self.nbytes(t):
            return c
        if self.span(t) < 0:  # a placeholder without t's layout (CuPy's negative strides)
            self.copy_into(c, t)
        else:
            self.copy_into(self.flat_span(c), self.flat_span(t))
        return c

    def static(self, t) -> bool:
        """Whether the framework marks ``t`` as living at a fixed address (read in place)."""
        return False

    def span(self, t) -> int:
        """Bytes from ``t``'s first element to one past its last (a dense array: its bytes)."""
        return self.nbytes(t)

    def reach(self, t) -> tuple:
        """``(below, above)``: the bytes ``t``'s elements occupy before its first element's
        address and from it on (0 and the span with non-negative strides)."""
        return (0, self.span(t))

    def users(self, t):
        """A callable counting what references ``t``'s memory now (any array over it), or None
        when the framework cannot tell; it does not keep ``t`` alive."""
        return None

    def version(self, t) -> int | None:
        """A count that every in-place write to ``t`` raises, or None when the framework keeps none."""
        return None

    def reuse_probe(self):
        """What ``trees.outputs.Reuse`` asks of the arrays it hands out again, or None where the
        framework cannot tell: ``(holders, marks, settle)``; ``holders(a)`` counts the references to
        array ``a`` beyond its own Python object (1 when only that object holds it), ``marks(arrays)``
        gives what in-place changes to their memory or layout move (equal while none ran),
        ``settle(arrays)`` whether they may be handed out again as new arrays would be, once the state a
        new array would not hold is dropped where that is safe (a tensor's autograd history)."""
        return None


CONJ_NEG = ("a conjugate or negative view input (x.conj(), torch._neg_view): a recording copies its memory, "
            "not its values; call .resolve_conj() or .resolve_neg() first")


class _TorchOps(Ops):
    __slots__ = ()
    name = "torch"
    poisonable = True

    def check(self, t) -> None:
        torch = sys.modules["torch"]
        if t.layout is not torch.strided:
            raise SkipCall(f"sparse or other non-strided tensors ({t.layout}) are not supported")
        if t.is_conj() or t.is_neg():
            raise SkipCall(CONJ_NEG)
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            raise SkipCall(f"a tensor subclass input ({type(t).__name__}): a recording's placeholders are plain "
                           "tensors, so its own behaviour would not run in the graph")

    def key(self, t):
        return (t.shape, t.stride(), t.dtype)

    def static(self, t) -> bool:
        # nn.Parameter, or torch._dynamo.mark_static_address (transformers' static caches)
        return (isinstance(t, sys.modules["torch"].nn.Parameter)
                or getattr(t, "_dynamo_static_input_type", None) is not None)

    def ptr(self, t) -> int:
        return t.data_ptr()

    def users(self, t):
        return private_api.storage_users(t)

    def version(self, t) -> int | None:
        return private_api.version(t)

    def reuse_probe(self):
        return private_api.reuse_probe()

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

    def span(self, t) -> int:
        """Bytes from ``t``'s first element to one past its last (its strides are never negative)."""
        return span_elements(t.shape, t.stride()) * t.element_size()

    def reach(self, t) -> tuple:
        return (0, t.nbytes if t.is_contiguous() else span_elements(t.shape, t.stride()) * t.element_size())

    def empty_layout(self, t, align=None):
        """A new tensor with ``t``'s sizes, strides and dtype, and its storage offset where that
        costs at most the tensor's span again (else its alignment modulo 256 bytes): what a
        recording's function sees in place of ``t``. ``align``: start at that address modulo 256
        instead (a copy for a recording made with another alignment)."""
        torch = sys.modules["torch"]
        n = span_elements(t.shape, t.stride())
        off = (layout_offset(t.storage_offset(), n, t.element_size()) if align is None
               else align // t.element_size())
        if off == 0 and t.is_contiguous():
            return torch.empty(t.shape, dtype=t.dtype, device=t.device)
        base = torch.empty(off + n, dtype=t.dtype, device=t.device)
        return base.as_strided(t.shape, t.stride(), off)

    def may_overlap(self, t) -> bool:
        return may_overlap(t.shape, t.stride())

    def flat_span(self, t):
        """A 1-D view of ``t``'s span (its elements and the gaps between them)."""
        return t.as_strided((span_elements(t.shape, t.stride()),), (1,), t.storage_offset())

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
        if leaf.dtype != base.dtype or out.is_conj() or out.is_neg():
            return None  # a conjugate or negative view's bit would be lost by as_strided
        if out is base:
            return leaf
        if out.dtype != base.dtype:  # x.view(torch.int32), x.real, torch.view_as_real(x)
            delta = out.storage_offset() * out.element_size() - base.storage_offset() * base.element_size()
            return retyped_view(leaf, out.dtype, out.shape, out.stride(), delta)
        delta = out.storage_offset() - base.storage_offset()
        return leaf.as_strided(out.shape, out.stride(), leaf.storage_offset() + delta)


class _CupyOps(Ops):
    __slots__ = ()
    name = "cupy"

    def key(self, t):
        return (t.shape, t.strides, t.dtype.str)

    def users(self, t):
        mem = t.data.mem  # every array over the allocation holds it (a view too)
        if mem is None:
            return None
        getrefcount = sys.getrefcount
        return lambda: getrefcount(mem)

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

    def span(self, t) -> int:
        """Bytes from ``t``'s first element to one past its last; -1 with a negative stride."""
        if any(s < 0 for s in t.strides):
            return -1
        size = t.itemsize
        return span_elements(t.shape, [s // size for s in t.strides]) * size if all(
            s % size == 0 for s in t.strides) else -1

    def reach(self, t) -> tuple:
        """``(below, above)`` in bytes from the first element's address; negative strides reach below."""
        below, above = 0, t.itemsize
        for size, stride in zip(t.shape, t.strides):
            if size == 0:
                return (0, 0)
            if stride < 0:
                below -= (size - 1) * stride
            else:
                above += (size - 1) * stride
        return (below, above)

    def empty_layout(self, t, align=None):
        """A new array with ``t``'s shape, strides and dtype, at its offset from the start of its
        allocation where that costs at most its span again (else that offset's alignment modulo
        256 bytes; ``align``: at that address modulo 256 instead); C-contiguous when ``t`` has a
        negative or unaligned stride."""
        cupy = sys.modules["cupy"]
        if (t.flags.c_contiguous and not align) or self.span(t) < 0:
            return cupy.empty(t.shape, dtype=t.dtype)
        size = t.itemsize
        n = self.span(t) // size
        off = (layout_offset((self.ptr(t) - self.base_ptr(t)) // size, n, size) if align is None
               else align // size)
        base = cupy.empty(off + n, dtype=t.dtype)
        return cupy.ndarray(t.shape, t.dtype, base.data + off * size, t.strides)

    def may_overlap(self, t) -> bool:
        return self.span(t) < 0 or may_overlap(t.shape, [s // t.itemsize for s in t.strides])

    def flat_span(self, t):
        """A 1-D view of ``t``'s span (its elements and the gaps between them)."""
        return sys.modules["cupy"].ndarray((self.span(t) // t.itemsize,), t.dtype, t.data)

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
        if out is base:
            return leaf
        cupy = sys.modules["cupy"]
        return cupy.ndarray(out.shape, out.dtype, leaf.data + (int(out.data.ptr) - int(base.data.ptr)),
                            out.strides)


def retyped_view(leaf, dtype, shape, stride, delta: int):
    """A view of ``leaf``'s memory as ``dtype`` with ``shape`` and ``stride`` (in ``dtype``'s
    elements), starting ``delta`` bytes after ``leaf``'s first element: an output that viewed an
    input as another dtype, rebuilt over the caller's input. A view of ``leaf`` (it shares its
    memory and version counter); complex and real reinterpretations keep autograd's graph, as
    ``torch.view_as_real`` does."""
    torch = sys.modules["torch"]
    size = leaf.element_size()
    flat = leaf.as_strided((leaf.untyped_storage().nbytes() // size,), (1,), 0)  # the whole storage
    if flat.is_complex() and dtype == flat.real.dtype:
        typed = torch.view_as_real(flat).reshape(-1)
    elif dtype.is_complex and torch.empty(0, dtype=dtype).real.dtype == flat.dtype:
        typed = torch.view_as_complex(flat[:flat.numel() // 2 * 2].view(-1, 2))
    else:
        raw = flat.view(torch.uint8)
        typed = raw[:raw.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
    return typed.as_strided(shape, stride, (leaf.storage_offset() * size + delta) // dtype.itemsize)


def span_elements(shape, strides) -> int:
    """Elements from the first to one past the last of a view with non-negative ``strides``
    (0 when it is empty)."""
    n = 1
    for size, stride in zip(shape, strides):
        if size == 0:
            return 0
        n += (size - 1) * stride
    return n


def layout_offset(offset: int, span: int, itemsize: int) -> int:
    """A placeholder's storage offset for a view at ``offset`` elements spanning ``span``: the same
    offset when it costs at most the span again, else the same alignment modulo 256 bytes."""
    if offset <= max(span, 1):
        return offset
    return offset % max(256 // itemsize, 1)


def may_overlap(shape, strides) -> bool:
    """Whether two elements of a view may share memory (False is certain, True is not)."""
    extent = 0
    for size, stride in sorted(((z, s) for z, s in zip(shape, strides) if z > 1), key=lambda d: d[1]):
        if stride <= extent:
            return True
        extent += (size - 1) * stride
    return False


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


__all__ = ["CUPY", "TORCH", "Ops", "is_torch", "layout_offset", "may_overlap", "ops_of", "register", "retyped_view",
           "span_elements"]
