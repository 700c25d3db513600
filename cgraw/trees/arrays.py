"""The flattening of a graphed call's arguments and outputs into array leaves, a signature and a
*spec* that rebuilds them. What each framework's arrays offer is ``cgraw.trees.frameworks``' ``Ops``
(re-exported here: ``TORCH``, ``CUPY``, ``ops_of``, ``is_torch``, ``register``).

Layer L6: no CUDA; torch and CuPy are reached through ``sys.modules`` only (the caller has
imported them), torch's container registry through ``interop.torch.private_api``.

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
import enum
import struct
import sys
import weakref

from cgraw.errors import SkipCall
from cgraw.trees.frameworks import CUPY, TORCH, Ops, is_torch, ops_of, register
from cgraw.interop.torch import private_api

EAGER, STATIC, TREE = 0, 1, 2
LEAF = ("t",)  # the spec of a tensor leaf
SINGLE = object()  # the output spec of a function returning one tensor


def is_module(x) -> bool:
    """Whether ``x`` is a ``torch.nn.Module`` (False without torch)."""
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
    pt = private_api.pytree()
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
    if _is_torch_value(t):  # torch.Size: torch's pytree would hand it back as a plain tuple
        key.append(_value(a))
        return ("v", a)
    if is_module(a):
        key.append(("module", a))  # the module itself: equal only to itself, kept alive by the key
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
    if t.__hash__ is object.__hash__ and not callable(a) and hasattr(a, "__dict__"):
        # a plain object equals only itself: keyed by its attributes' values instead, so that one
        # set anew selects another recording and an equal one made anew per call replays (what
        # the recording's Python read of it, it read of an equal object)
        key.append((t, _attributes(a, 0)))
    else:
        key.append(_value(a))
    return ("v", a)


_VALUES = (int, float, bool, str, bytes, complex, type(None))


def _value(v) -> tuple:
    """A value's key part: its type, and floats by their bits (``-0.0`` is not ``0.0``, and a NaN
    equals a NaN of the same bits)."""
    t = type(v)
    if t is float:
        return (t, struct.pack("<d", v))
    if t is complex:
        return (t, struct.pack("<dd", v.real, v.imag))
    if isinstance(v, float):  # numpy.float64 and other float subclasses
        return (t, struct.pack("<d", v))
    if isinstance(v, complex):
        return (t, struct.pack("<dd", v.real, v.imag))
    return (t, v)


class _Same:
    """An attribute value in a key, equal only to itself (by identity, hashed by its address). A
    call's key holds it strongly; ``weaken_key`` makes a filed key hold it weakly where it can, so a
    tree node keyed by it keeps nothing alive, and once it is gone the key equals no key again (a
    new object at its reused address included)."""

    __slots__ = ("v", "ref", "h")

    def __init__(self, v):
        self.v = v
        self.ref = None  # a weak reference to it once weakened (then ``v`` is None)
        self.h = id(v)

    def target(self):
        """The object, or None once a weakened key's object is gone."""
        r = self.ref
        return self.v if r is None else r()

    def __eq__(self, other):  # on the graphed call's path (the node lookup): target() inlined
        if type(other) is not _Same:
            return False
        r = self.ref
        t = self.v if r is None else r()
        r = other.ref
        return t is not None and t is (other.v if r is None else r())

    def __hash__(self):
        return self.h


_deaths = [0]  # objects a weakened key named that are gone, counted by their references' callback


def _gone(_ref) -> None:
    _deaths[0] += 1


def key_deaths() -> int:
    """How many objects named by weakened keys are gone so far (a tree prunes when it grows)."""
    return _deaths[0]


def weaken_key(key) -> tuple:
    """Make the identity parts of ``key`` (a call's key, about to be filed in a tree node) hold
    their objects weakly, where the objects take weak references; return those references (each
    dead once its object is gone: the key then matches no call). Idempotent."""
    refs = []
    todo = [key]
    while todo:
        x = todo.pop()
        t = type(x)
        if t is tuple or t is frozenset:
            todo.extend(x)
        elif t is _Same:
            if x.ref is None:
                try:
                    x.ref = weakref.ref(x.v, _gone)
                except TypeError:  # no weak references to it: the key keeps it, as before
                    continue
                x.v = None
            refs.append(x.ref)
    return tuple(refs)


def names_dead(refs) -> bool:
    """Whether any of a key's references (``weaken_key``) is dead."""
    for r in refs:
        if r() is None:
            return True
    return False


_DEPTH = 4  # how deep nested containers and plain objects of an attribute are keyed by value


def _attributes(a, depth: int) -> tuple:
    """``a``'s attributes, as a key part, by ``_by_value``."""
    return tuple((name, _by_value(v, depth)) for name, v in sorted(vars(a).items()))


def _by_value(v, depth: int):
    """An attribute's key part: numbers, strings, None, enums and torch's dtypes and devices by
    type and value; tuples (namedtuples too), lists, sets, dicts and plain objects by their items' key parts (a list
    changed in place selects another recording); anything else (a tensor, a module, a function,
    what lies deeper than ``_DEPTH``) by identity."""
    t = type(v)
    if t in _VALUES:
        return _value(v)
    if depth < _DEPTH:
        if t is tuple or t is list or _is_namedtuple(v):
            return (t, tuple(_by_value(x, depth + 1) for x in v))
        if t is set or t is frozenset:
            return (t, frozenset(_by_value(x, depth + 1) for x in v))
        if t is dict:
            return (t, tuple((_by_value(k, depth + 1), _by_value(x, depth + 1)) for k, x in v.items()))
        if isinstance(v, enum.Enum) or _is_torch_value(t):
            return (t, v)
        if (t.__hash__ is object.__hash__ and not callable(v) and hasattr(v, "__dict__")
                and ops_of(v) is None and not is_module(v)):
            return (t, _attributes(v, depth + 1))
    return _Same(v)


_TORCH_VALUES = frozenset({"dtype", "device", "Size", "layout", "memory_format"})


def _is_torch_value(t: type) -> bool:
    """Whether ``t`` is one of torch's immutable value types (``torch.Size``, ``torch.dtype``...)."""
    return t.__module__ == "torch" and t.__name__ in _TORCH_VALUES


def rebuild(spec, it, objects=None):
    """The structure ``spec`` describes, with its leaves taken in order from ``it`` and the
    arguments an output spec names (``("in", k)``) from ``objects`` (``argument_objects``)."""
    kind = spec[0]
    if kind == "t":
        return next(it)
    if kind == "v":
        return spec[1]
    if kind == "in":
        return objects[spec[1]]
    if kind == "seq":
        return spec[1](rebuild(s, it, objects) for s in spec[2])
    if kind == "dict":
        return dict(zip(spec[2], [rebuild(s, it, objects) for s in spec[3]]))
    if kind == "mod":
        for _ in range(spec[2]):
            next(it)
        return spec[1]
    if kind == "pytree":
        node = _pytree_node(spec[1])
        return node.unflatten_fn([rebuild(s, it, objects) for s in spec[3]], spec[2])
    if kind == "nt":
        return spec[1](*[rebuild(s, it, objects) for s in spec[2]])
    if kind == "ss":
        return spec[1]([rebuild(s, it, objects) for s in spec[2]])
    if kind == "dictsub":
        new = copy.copy(spec[1])
        values = [rebuild(s, it, objects) for s in spec[3]]
        dict.clear(new)
        dict.update(new, zip(spec[2], values))
        return new
    if kind == "dc":
        new = copy.copy(spec[1])
        for name, s in zip(spec[2], spec[3]):
            object.__setattr__(new, name, rebuild(s, it, objects))
        return new
    raise AssertionError(f"unknown spec {kind!r}")


def replace_leaves(arg_specs, kwarg_specs, leaves, placeholders):
    """Rebuild a call's args and kwargs with placeholders in place of the eager leaves."""
    it = iter([placeholders.get(j, t) for j, t in enumerate(leaves)])
    new_args = tuple(rebuild(s, it) for s in arg_specs)
    new_kwargs = {k: rebuild(s, it) for k, s in kwarg_specs} if kwarg_specs else {}
    return new_args, new_kwargs


# ---------------------------------------------------------------------- outputs


def argument_objects(arg_specs, kwarg_specs) -> list:
    """The objects a call passes that are neither arrays nor containers (its ``("v", object)``
    specs), in the order of its specs: the same positions for every call of one key."""
    found: list = []

    def walk(spec):
        if spec[0] == "v":
            found.append(spec[1])
        for s in _children(spec):
            walk(s)

    for s in arg_specs:
        walk(s)
    for _, s in kwarg_specs or ():
        walk(s)
    return found


def out_spec(out, leaves: list, objects=None):
    """Flatten an output structure (same container rules as inputs; anything else is a constant);
    returns a spec for ``unflatten``. An object cgraw cannot take apart that is one of the call's
    ``objects`` (``argument_objects``; a decode step returning the cache it was given) is the
    caller's object on every call (``("in", k)``). Raises SkipCall for outputs a replay cannot
    reproduce."""
    if ops_of(out) is not None:
        _out_leaf(out, leaves)
        return SINGLE
    ids = {id(o): k for k, o in enumerate(objects)} if objects else None
    return _out_spec(out, leaves, ids)


def _out_leaf(x, leaves) -> None:
    if ops_of(x) is TORCH and x.layout is not sys.modules["torch"].strided:
        raise SkipCall(f"the function returns a sparse or other non-strided tensor ({x.layout}), whose "
                       "memory a graph cannot hand out again")
    leaves.append(x)


def _out_spec(x, leaves, ids=None):
    if ops_of(x) is not None:
        _out_leaf(x, leaves)
        return LEAF
    t = type(x)
    if t is tuple or t is list:
        return ("seq", t, [_out_spec(v, leaves, ids) for v in x])
    if t is dict:
        return ("dict", dict, tuple(x), [_out_spec(v, leaves, ids) for v in x.values()])
    if _is_torch_value(t):
        return ("v", x)
    node = _pytree_node(t)
    if node is not None:
        children, context = node.flatten_fn(x)
        return ("pytree", t, context, [_out_spec(v, leaves, ids) for v in children])
    if _is_namedtuple(x):
        return ("nt", t, [_out_spec(v, leaves, ids) for v in x])
    if _is_structseq(x):
        return ("ss", t, [_out_spec(v, leaves, ids) for v in x])
    if isinstance(x, dict):
        return ("dictsub", x, tuple(x), [_out_spec(v, leaves, ids) for v in x.values()])
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = tuple(f.name for f in dataclasses.fields(x))
        return ("dc", x, names, [_out_spec(getattr(x, n), leaves, ids) for n in names])
    if t.__module__ == "numpy" and t.__name__ == "ndarray":
        raise SkipCall("CPU tensors or ops: the function returns a NumPy array, which a replay "
                       "would return unchanged")
    if not (t in _VALUES or isinstance(x, (enum.Enum, type)) or t.__module__ == "torch"):
        if ids and id(x) in ids:
            return ("in", ids[id(x)])
        raise SkipCall(f"the function returns a {t.__name__} object, which cgraw cannot take apart: a "
                       "replay would hand out the recording's object again, tensors and all")
    return ("v", x)


def unflatten(spec, it, objects=None):
    if spec is SINGLE:
        return next(it)
    return rebuild(spec, it, objects)


def builder(spec):
    """``build(outs, objects)``, the same as ``unflatten(spec, iter(outs), objects)``, made once for
    a recording's outputs: a flat tuple or list of arrays and argument objects (what Inductor's
    partitions return) is built in one comprehension, without a call per leaf."""
    if spec is SINGLE:
        return _first
    if type(spec) is tuple and spec[0] == "seq" and spec[1] in (tuple, list) and all(
            c[0] in ("t", "in") for c in spec[2]):
        typ, picks, n = spec[1], [], 0
        for c in spec[2]:
            picks.append((True, n) if c[0] == "t" else (False, c[1]))
            n += c[0] == "t"
        if n == len(picks):
            return lambda outs, objects: typ(outs)
        return lambda outs, objects: typ([outs[k] if leaf else objects[k] for leaf, k in picks])
    return lambda outs, objects: rebuild(spec, iter(outs), objects)


def one_leaf(spec):
    """How output ``spec`` holds one array: None (alone), ``tuple`` or ``list`` (Inductor's code's), else False."""
    if spec is SINGLE:
        return None
    seq = type(spec) is tuple and spec[0] == "seq" and spec[2] == [LEAF] and spec[1]
    return seq if seq in (tuple, list) else False


def _first(outs, objects):
    return outs[0]


def _children(spec) -> list:
    kind = spec[0]
    if kind in ("seq", "nt", "ss"):
        return spec[2]
    if kind in ("dict", "dictsub", "dc", "pytree"):
        return spec[3]
    return []


def names_inputs(spec) -> bool:
    """Whether an output ``spec`` hands out one of the call's argument objects (``("in", k)``)."""
    if spec is SINGLE:
        return False
    return spec[0] == "in" or any(names_inputs(s) for s in _children(spec))


class NoType:
    """Stands for torch.Tensor when torch is not loaded: no object has this exact type."""


__all__ = ["CUPY", "EAGER", "LEAF", "SINGLE", "STATIC", "TORCH", "TREE", "Ops", "argument_objects", "builder", "flatten",
           "is_torch", "is_module", "key_deaths", "names_dead", "names_inputs", "one_leaf", "ops_of", "out_spec",
           "rebuild", "register", "replace_leaves", "unflatten", "weaken_key"]
