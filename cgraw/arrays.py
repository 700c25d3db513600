"""Duck-typed helpers over torch tensors and CuPy arrays for graph trees: flattening a call's
arguments and outputs into leaves, a signature and a *spec* that rebuilds them, and the
per-framework one-liners (pointer, size, contiguity, copies, aliases).

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

from cgraw.interop import torch_c
from cgraw.tree import SkipCall

EAGER, STATIC, TREE = 0, 1, 2
LEAF = ("t",)  # the spec of a tensor leaf
_SINGLE = object()  # the output spec of a function returning one tensor

_tensor_type: list = [None]  # [torch.Tensor] once torch is loaded


def _torch_tensor():
    T = _tensor_type[0]
    if T is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            T = _tensor_type[0] = torch.Tensor
    return T


def _is_torch(x) -> bool:
    T = _torch_tensor()
    if T is not None and isinstance(x, T):
        return True
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy") and hasattr(x, "data") and hasattr(x, "strides")


def _is_tensor(x) -> bool:
    return _is_torch(x) or _is_cupy(x)


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


def _static_marked(t) -> bool:
    """Whether torch code marked ``t`` as living at a fixed address (``torch._dynamo.mark_static_address``;
    transformers' static caches do): such tensors are read in place, like parameters."""
    return getattr(t, "_dynamo_static_input_type", None) is not None


# ---------------------------------------------------------------------- inputs


def _flatten(a, leaves, key, kinds, ptrs, forced):
    """Append ``a``'s tensor leaves (with kinds and pointers) and signature parts; return its spec.

    A tensor's signature part is the only 3-tuple ``(shape, strides, dtype)`` (``buckets``
    relies on it); containers add 2-tuples.
    """
    t = type(a)
    if _is_torch(a):
        if a.layout is not sys.modules["torch"].strided:
            raise SkipCall(f"sparse or other non-strided tensors ({a.layout}) are not supported")
        leaves.append(a)
        key.append((a.shape, a.stride(), a.dtype))
        static = forced is not None or isinstance(a, sys.modules["torch"].nn.Parameter) or _static_marked(a)
        kinds.append(STATIC if static else None)
        ptrs.append(a.data_ptr())
        return LEAF
    if _is_cupy(a):
        leaves.append(a)
        key.append((a.shape, a.strides, a.dtype.str))
        kinds.append(forced)
        ptrs.append(int(a.data.ptr))
        return LEAF
    if t is tuple or t is list:
        key.append((t, len(a)))
        return ("seq", t, [_flatten(x, leaves, key, kinds, ptrs, forced) for x in a])
    if t is dict:
        key.append((dict, tuple(a)))
        return ("dict", dict, tuple(a), [_flatten(v, leaves, key, kinds, ptrs, forced) for v in a.values()])
    if _is_module(a):
        key.append(("module", id(a)))
        n0 = len(leaves)
        for x in list(a.parameters()) + list(a.buffers()):
            _flatten(x, leaves, key, kinds, ptrs, STATIC)
        return ("mod", a, len(leaves) - n0)
    node = _pytree_node(t)
    if node is not None:
        children, context = node.flatten_fn(a)
        try:
            key.append((t, _frozen(context)))
        except TypeError:
            raise SkipCall(f"an argument of type {t.__name__} has an unhashable pytree context") from None
        return ("pytree", t, context, [_flatten(x, leaves, key, kinds, ptrs, forced) for x in children])
    if _is_namedtuple(a):
        key.append((t, t._fields))
        return ("nt", t, [_flatten(x, leaves, key, kinds, ptrs, forced) for x in a])
    if _is_structseq(a):
        key.append((t, len(a)))
        return ("ss", t, [_flatten(x, leaves, key, kinds, ptrs, forced) for x in a])
    if isinstance(a, dict):
        key.append((t, tuple(a)))
        return ("dictsub", a, tuple(a), [_flatten(v, leaves, key, kinds, ptrs, forced) for v in a.values()])
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        names = tuple(f.name for f in dataclasses.fields(a))
        key.append((t, names))
        return ("dc", a, names, [_flatten(getattr(a, n), leaves, key, kinds, ptrs, forced) for n in names])
    try:
        hash(a)
    except TypeError:
        raise SkipCall(f"an argument of type {t.__name__} is neither a tensor, a container nor hashable") from None
    key.append((t, a))
    return ("v", a)


def _rebuild(spec, it):
    """The structure ``spec`` describes, with its leaves taken in order from ``it``."""
    kind = spec[0]
    if kind == "t":
        return next(it)
    if kind == "v":
        return spec[1]
    if kind == "seq":
        return spec[1](_rebuild(s, it) for s in spec[2])
    if kind == "dict":
        return dict(zip(spec[2], [_rebuild(s, it) for s in spec[3]]))
    if kind == "mod":
        for _ in range(spec[2]):
            next(it)
        return spec[1]
    if kind == "pytree":
        node = _pytree_node(spec[1])
        return node.unflatten_fn([_rebuild(s, it) for s in spec[3]], spec[2])
    if kind == "nt":
        return spec[1](*[_rebuild(s, it) for s in spec[2]])
    if kind == "ss":
        return spec[1]([_rebuild(s, it) for s in spec[2]])
    if kind == "dictsub":
        new = copy.copy(spec[1])
        values = [_rebuild(s, it) for s in spec[3]]
        dict.clear(new)
        dict.update(new, zip(spec[2], values))
        return new
    if kind == "dc":
        new = copy.copy(spec[1])
        for name, s in zip(spec[2], spec[3]):
            object.__setattr__(new, name, _rebuild(s, it))
        return new
    raise AssertionError(f"unknown spec {kind!r}")


def _replace(arg_specs, kwarg_specs, leaves, placeholders):
    """Rebuild a call's args and kwargs with placeholders in place of the eager leaves."""
    it = iter([placeholders.get(j, t) for j, t in enumerate(leaves)])
    new_args = tuple(_rebuild(s, it) for s in arg_specs)
    new_kwargs = {k: _rebuild(s, it) for k, s in kwarg_specs} if kwarg_specs else {}
    return new_args, new_kwargs


# ---------------------------------------------------------------------- outputs


def _spec(out, leaves: list):
    """Flatten an output structure (same container rules as inputs; anything else is a constant);
    returns a spec for ``_unflatten``. Raises SkipCall for outputs a replay cannot reproduce."""
    if _is_tensor(out):
        _out_leaf(out, leaves)
        return _SINGLE
    return _out_spec(out, leaves)


def _out_leaf(x, leaves) -> None:
    if _is_torch(x) and x.layout is not sys.modules["torch"].strided:
        raise SkipCall(f"the function returns a sparse or other non-strided tensor ({x.layout}), whose "
                       "memory a graph cannot hand out again")
    leaves.append(x)


def _out_spec(x, leaves):
    if _is_tensor(x):
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


def _unflatten(spec, it):
    if spec is _SINGLE:
        return next(it)
    return _rebuild(spec, it)


# ---------------------------------------------------------------------- per framework


def _alias(t):
    """A new object over the same memory: each call's outputs are distinct objects."""
    if _is_torch(t):
        return t.detach()
    return t.view()


class _NoType:
    """Stands for torch.Tensor when torch is not loaded: no object has this exact type."""


def _view_of(leaf, out, base):
    """``out`` viewed ``base`` (a placeholder, or the leaf at record time); the same view of
    ``leaf``, which has ``base``'s layout. None when the view cannot be carried over."""
    if _is_torch(out):
        if out.dtype != base.dtype or leaf.dtype != base.dtype:
            return None
        if out is base:
            return leaf
        delta = out.storage_offset() - base.storage_offset()
        return leaf.as_strided(out.shape, out.stride(), leaf.storage_offset() + delta)
    if out.dtype != base.dtype:
        return None
    if out is base:
        return leaf
    cupy = sys.modules["cupy"]
    return cupy.ndarray(out.shape, out.dtype, leaf.data + (int(out.data.ptr) - int(base.data.ptr)), out.strides)


def _alias_maker(t):
    return t.detach if _is_torch(t) else t.view


def _base_ptr(t) -> int:
    """Start of the allocation a tensor or array views."""
    if _is_torch(t):
        return t.untyped_storage().data_ptr()
    mem = t.data.mem
    return int(mem.ptr) if mem is not None else int(t.data.ptr)


def _ptr(t) -> int:
    return t.data_ptr() if _is_torch(t) else int(t.data.ptr)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if _is_torch(t) else t.nbytes


def _device_index(t) -> int:
    if _is_torch(t):
        return t.get_device()
    return t.device.id


def _is_contiguous(t) -> bool:
    if _is_torch(t):
        return t.is_contiguous()
    return t.flags.c_contiguous


def _empty_like(t):
    if _is_torch(t):
        return sys.modules["torch"].empty(t.shape, dtype=t.dtype, device=t.device)
    return sys.modules["cupy"].empty(t.shape, dtype=t.dtype)


def _copy_into(dst, src) -> None:
    if _is_torch(dst):
        dst.copy_(src)
    else:
        dst[...] = src


def _clone(t):
    return t.clone() if _is_torch(t) else t.copy()


def _equal(a, b) -> bool:
    if _is_torch(a):
        return bool(sys.modules["torch"].equal(a, b))
    return bool(sys.modules["cupy"].array_equal(a, b))
