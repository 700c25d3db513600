"""Duck-typed helpers over torch tensors and CuPy arrays for graph trees: flattening a call's
arguments into leaves and a signature, rebuilding arguments and outputs, and the per-framework
one-liners (pointer, size, contiguity, copies, aliases).

Layer L6: no CUDA; torch and CuPy are reached through ``sys.modules`` only (the caller has
imported them).
"""

from __future__ import annotations

import sys

from cgraw.tree import SkipCall

EAGER, STATIC, TREE = 0, 1, 2
_SINGLE = object()  # the output spec of a function returning one tensor


def _is_tensor(x) -> bool:
    m = type(x).__module__
    return (m.startswith("torch") and hasattr(x, "data_ptr")) or (m.startswith("cupy") and hasattr(x, "data"))


def _flatten(a, leaves, key, kinds, ptrs, forced) -> None:
    t = type(a)
    mod = t.__module__
    if mod.startswith("torch"):
        torch = sys.modules["torch"]
        if isinstance(a, torch.Tensor):
            leaves.append(a)
            key.append((a.shape, a.stride(), a.dtype))
            kinds.append(STATIC if forced is not None or isinstance(a, torch.nn.Parameter) else None)
            ptrs.append(a.data_ptr())
            return
        if isinstance(a, torch.nn.Module):
            key.append(("module", id(a)))
            for x in list(a.parameters()) + list(a.buffers()):
                _flatten(x, leaves, key, kinds, ptrs, STATIC)
            return
    elif mod.startswith("cupy") and hasattr(a, "data") and hasattr(a, "strides"):
        leaves.append(a)
        key.append((a.shape, a.strides, a.dtype.str))
        kinds.append(forced)
        ptrs.append(int(a.data.ptr))
        return
    if t in (tuple, list):
        key.append((t, len(a)))
        for x in a:
            _flatten(x, leaves, key, kinds, ptrs, forced)
        return
    if t is dict:
        key.append((dict, tuple(sorted(a))))
        for k in sorted(a):
            _flatten(a[k], leaves, key, kinds, ptrs, forced)
        return
    try:
        hash(a)
    except TypeError:
        raise SkipCall(f"an argument of type {t.__name__} is neither a tensor nor hashable") from None
    key.append((t, a))


def _replace(args, kwargs, leaves, placeholders):
    """Rebuild args/kwargs with placeholders in place of the eager leaves."""
    if not placeholders:
        return args, kwargs
    counter = {"i": -1}

    def sub(a):
        if _is_tensor(a):
            counter["i"] += 1
            j = counter["i"]
            return placeholders.get(j, a)
        t = type(a)
        if t.__module__.startswith("torch") and isinstance(a, sys.modules["torch"].nn.Module):
            counter["i"] += len(list(a.parameters())) + len(list(a.buffers()))
            return a
        if t in (tuple, list):
            return t(sub(x) for x in a)
        if t is dict:
            return {k: sub(a[k]) for k in sorted(a)}
        return a

    new_args = tuple(sub(a) for a in args)
    new_kwargs = {k: sub(kwargs[k]) for k in sorted(kwargs)} if kwargs else kwargs
    return new_args, new_kwargs


def _spec(out, leaves: list):
    """Flatten an output structure; returns a spec for ``_unflatten``."""
    if _is_tensor(out):
        leaves.append(out)
        return _SINGLE if len(leaves) == 1 else ("t",)
    t = type(out)
    if t in (tuple, list):
        return (t, [_spec_inner(x, leaves) for x in out])
    if t is dict:
        return (dict, [(k, _spec_inner(v, leaves)) for k, v in out.items()])
    return ("v", out)


def _spec_inner(x, leaves):
    if _is_tensor(x):
        leaves.append(x)
        return ("t",)
    return _spec(x, leaves)


def _unflatten(spec, it):
    kind = spec[0]
    if kind == "t":
        return next(it)
    if kind == "v":
        return spec[1]
    if kind is dict:
        return {k: _unflatten(s, it) for k, s in spec[1]}
    return kind(_unflatten(s, it) for s in spec[1])


def _alias(t):
    """A new object over the same memory: each call's outputs are distinct objects."""
    if type(t).__module__.startswith("torch"):
        return t.detach()
    return t.view()


class _NoType:
    """Stands for torch.Tensor when torch is not loaded: no object has this exact type."""


def _alias_maker(t):
    return t.detach if type(t).__module__.startswith("torch") else t.view


def _base_ptr(t) -> int:
    """Start of the allocation a tensor or array views."""
    if type(t).__module__.startswith("torch"):
        return t.untyped_storage().data_ptr()
    mem = t.data.mem
    return int(mem.ptr) if mem is not None else int(t.data.ptr)


def _ptr(t) -> int:
    return t.data_ptr() if type(t).__module__.startswith("torch") else int(t.data.ptr)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if type(t).__module__.startswith("torch") else t.nbytes


def _device_index(t) -> int:
    if type(t).__module__.startswith("torch"):
        return t.get_device()
    return t.device.id


def _is_contiguous(t) -> bool:
    if type(t).__module__.startswith("torch"):
        return t.is_contiguous()
    return t.flags.c_contiguous


def _empty_like(t):
    if type(t).__module__.startswith("torch"):
        return sys.modules["torch"].empty(t.shape, dtype=t.dtype, device=t.device)
    return sys.modules["cupy"].empty(t.shape, dtype=t.dtype)


def _copy_into(dst, src) -> None:
    if type(dst).__module__.startswith("torch"):
        dst.copy_(src)
    else:
        dst[...] = src


def _clone(t):
    return t.clone() if type(t).__module__.startswith("torch") else t.copy()


def _equal(a, b) -> bool:
    if type(a).__module__.startswith("torch"):
        return bool(sys.modules["torch"].equal(a, b))
    return bool(sys.modules["cupy"].array_equal(a, b))
