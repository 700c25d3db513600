"""A graphed call's inputs, classified: the decisions graph trees make about arguments.

Layer L6: pure Python over ``arrays`` (no CUDA, frameworks through their ``Ops``). ``manager``
calls it for every call; backends only read what it decides.

- ``inspect``: flatten the arguments into array *leaves* with their kinds, pointers and ops, and
  build the call's signature *key* (shapes, strides, dtypes, containers, scalars by value).
  Kinds: *static* (``nn.Parameter``s, a module argument's parameters and buffers, tensors marked
  with ``cgraw.mark_static`` or ``torch._dynamo.mark_static_address``, positions in
  ``static_argnums``: read in place), *tree output* (an output of an earlier graphed call in this
  generation: read in place), *eager* (everything else: copied into a placeholder).
- fast paths with the same result: one exact tensor; exact tensors and parameters only; a function
  whose caller guarantees its inputs' dtypes and devices (``inputs_guarded``: the backend's
  partitions), keyed by ``GUARDED``, the number of tensors and the sizes after them.
- inputs sharing memory (``input_plan.shared_memory``): once a warm-up shows a function writing an
  eager input (``writes_inputs``), the key of each of its calls notes which inputs overlap an eager
  one. What a recording assumed of its inputs, and how a call differs, is ``trees.input_plan``.
- padding buckets (``cgraw.trees.buckets``): the bucket a call is recorded under, part of its key.
- grad mode (``use_grad_mode``): with autograd recording, the key gains ``(GRAD, indices of the
  leaves that require grad)`` (``cgraw.trees.autograd``); otherwise ``(REQUIRES_GRAD, those
  indices)`` when a leaf requires grad (a function may branch on ``x.requires_grad``).
- the settings that choose kernels (``use_kernel_state``, ``interop.torch.kernel_state``): the key
  ends with an id of their values; the cuDNN and attention flags are read only for a function
  whose warm-up ran such ops (``growth.learn_kernel_groups``).
"""

from __future__ import annotations

import operator
import weakref

from cgraw.trees import buckets
from cgraw.trees.arrays import EAGER, LEAF, STATIC, TORCH, TREE, NoType, flatten
from cgraw.trees.frameworks import CONJ_NEG
from cgraw.trees.input_plan import SHARED, KeyMark, shared_memory
from cgraw.errors import SkipCall

__all__ = ["EAGER", "GRAD", "GUARDED", "REQUIRES_GRAD", "SHARED", "STATIC", "TREE", "Call", "grad_enabled",
           "guarded_tail", "inspect", "kernel_state", "mark_static", "shared_memory", "use_grad_mode",
           "use_kernel_state"]

_static_ids: dict[int, object] = {}  # id(array) -> weakref, filled by mark_static
_tensor = [NoType, NoType]  # [torch.Tensor, torch.nn.Parameter] once torch is loaded: the exact-type fast path
_grad_mode: list = [None]  # [a probe: does autograd record now?] (torch.is_grad_enabled), or [None]
_call = getattr(operator, "call", None) or operator.methodcaller("__call__")  # operator.call: Python 3.11+
_kernel: list = [None, ()]  # [interop.torch.kernel_state.KernelState, its getters of every group], or [None, ()]


GRAD = KeyMark("GRAD")  # heads the key entry of a call made with grad enabled: equal to no other key entry
GUARDED = KeyMark("GUARDED")  # heads the key of a call of a function whose caller guarantees its inputs' dtypes
REQUIRES_GRAD = KeyMark("REQUIRES_GRAD")  # heads the key entry of the leaves that require grad, with grad disabled


def mark_static(x):
    """Mark a tensor or array as a static input of graphed functions (read in place, never copied)."""
    key = id(x)
    _static_ids[key] = weakref.ref(x, lambda _r, k=key: _static_ids.pop(k, None))
    return x


def use_torch(tensor_type, parameter_type=NoType) -> None:
    """Enable the exact-type fast path for ``torch.Tensor`` and ``torch.nn.Parameter`` arguments (a
    tree does, once torch is loaded): a parameter is a static input."""
    _tensor[0] = tensor_type
    _tensor[1] = parameter_type


def use_grad_mode(probe) -> None:
    """Make grad mode part of every call's key: ``probe()`` says whether autograd records now
    (``torch.is_grad_enabled``, False under ``no_grad`` and ``inference_mode``); None, the
    default, leaves keys as they were."""
    _grad_mode[0] = probe


def use_kernel_state(ks) -> None:
    """End every call's key with ``ks.state(getters)``, the id of the settings that choose kernels
    now (an ``interop.torch.kernel_state.KernelState``; None: keys are what they were)."""
    _kernel[0] = ks
    _kernel[1] = () if ks is None else ks.getters(None)


def kernel_state():
    """The ``KernelState`` whose settings id ends every call's key (``use_kernel_state``), or None."""
    return _kernel[0]


def grad_enabled() -> bool:
    """Whether the installed probe says autograd records now (False without a probe)."""
    p = _grad_mode[0]
    return p is not None and bool(p())


_NO_LEAF_GRAD = (GRAD, ())  # the key entry of the common case: no leaf requires grad


def _grad_entry(leaves, kinds) -> tuple:
    """The key entry of a call made with grad enabled: which leaves require grad, and which of
    them are eager autograd leaves already holding a ``.grad`` (a backward inside the function
    would add to it; ``cuda_backend`` runs such calls eagerly). A graphed call's hot path: a list
    comprehension, and the shared entry when no leaf requires grad."""
    req = [j for j, t in enumerate(leaves) if getattr(t, "requires_grad", False)]
    if not req:
        return _NO_LEAF_GRAD
    held = tuple(j for j in req if kinds[j] == EAGER and getattr(leaves[j], "is_leaf", False)
                 and getattr(leaves[j], "grad", None) is not None)
    return (GRAD, tuple(req), held)


class Call:
    """One call's inputs: the signature ``key``; per leaf the array, its kind, pointer and ops;
    the specs that rebuild the arguments around the leaves; the padding bucket, if any."""

    __slots__ = ("key", "leaves", "kinds", "ptrs", "ops", "arg_spans", "arg_specs", "kwarg_specs", "rows",
                 "bucket", "padded", "grad")

    def __init__(self, key, leaves, kinds, ptrs, ops, arg_spans, arg_specs, kwarg_specs=None):
        self.key = key
        self.leaves = leaves
        self.kinds = kinds
        self.ptrs = ptrs
        self.ops = ops  # arrays.Ops per leaf
        self.arg_spans = arg_spans  # (first leaf, leaf count) of each positional argument
        self.arg_specs = arg_specs  # one spec per positional argument (arrays.flatten)
        self.kwarg_specs = kwarg_specs  # [(name, spec)] in the caller's order, or None
        self.bucket = None  # padding buckets (cgraw.trees.buckets): the bucket, the call's rows and
        self.rows = None  # the padded leaves, when the function has buckets and the call fits one
        self.padded = frozenset()
        self.grad = False  # made with grad enabled (use_grad_mode): its outputs' backward may run


def inspect(fn, args, kwargs, tree_outputs, device: int) -> Call:
    """Classify a call of graphed function ``fn`` (``static_argnums``, ``pad_buckets``) on the
    tree of ``device``; ``tree_outputs`` maps the data pointers of this generation's outputs.
    Raises ``SkipCall`` for arguments a graph cannot take."""
    T, P = _tensor
    if not kwargs and fn.plain:
        if len(args) == 1 and type(args[0]) is T:  # the hottest path: one tensor
            return _inspect_tensor(fn, args, tree_outputs, device)
        if fn.inputs_guarded:
            return _inspect_guarded(fn, args, tree_outputs, device)
        for a in args:
            if type(a) is not T and type(a) is not P:
                break
        else:  # the hot path: plain tensors only, no options (one pass per property, no generic dispatch)
            return _inspect_tensors(fn, args, tree_outputs, device)
    return _inspect_general(fn, args, kwargs, tree_outputs, device)


def _inspect_general(fn, args, kwargs, tree_outputs, device: int) -> Call:
    """``inspect`` of any call: every argument flattened, every leaf checked."""
    T, P = _tensor
    leaves, key_parts, kinds, ptrs, ops, specs, spans = [], [], [], [], [], [], []
    static_pos = fn.static_argnums
    for i, a in enumerate(args):
        first = len(leaves)
        if (type(a) is T or type(a) is P) and i not in static_pos:  # the common case, without generic dispatch
            try:
                p = a.data_ptr()
            except RuntimeError as exc:  # sparse, meta, ...: no storage to copy or read in place
                raise SkipCall(f"a tensor input has no data pointer ({exc})") from None
            if a.is_conj() or a.is_neg():
                raise SkipCall(CONJ_NEG)
            leaves.append(a)
            key_parts.append((a.shape, a.stride(), a.dtype))
            kinds.append(STATIC if type(a) is P or id(a) in _static_ids else (TREE if p in tree_outputs else EAGER))
            ptrs.append(p)
            ops.append(TORCH)
            spans.append((first, 1))
            specs.append(LEAF)
            continue
        specs.append(flatten(a, leaves, key_parts, kinds, ptrs, ops, STATIC if i in static_pos else None))
        spans.append((first, len(leaves) - first))
    kwarg_specs = None
    if kwargs:
        kwarg_specs = []
        for k in kwargs:  # the caller's order: a function taking **kwargs sees them so
            key_parts.append(k)
            kwarg_specs.append((k, flatten(kwargs[k], leaves, key_parts, kinds, ptrs, ops, None)))
    dev = None
    for j, t in enumerate(leaves):
        d = ops[j].device(t)
        if d < 0:
            raise SkipCall("CPU tensors or ops: an input lives on the CPU")
        if dev is None:
            dev = d
        elif d != dev:
            raise SkipCall("tensors on several devices")
        if kinds[j] is None:
            if id(t) in _static_ids:
                kinds[j] = STATIC
            elif ptrs[j] in tree_outputs:
                kinds[j] = TREE
            else:
                kinds[j] = EAGER
    if dev is not None and dev != device:
        raise SkipCall(f"inputs on device {dev}, but this tree is on device {device}")
    # the kinds are not part of the key: the first call of a path sees warm-up outputs (eager)
    # where later calls see tree outputs; a recording checks its kinds in moved()
    call = Call(tuple(key_parts), leaves, kinds, ptrs, ops, spans, specs, kwarg_specs)
    if fn.pad_buckets:
        chosen = buckets.choose(fn.pad_buckets, leaves, kinds, EAGER)
        if chosen is not None:
            call.rows, call.bucket, call.padded = chosen
            call.key = buckets.padded_key(key_parts, leaves, call.padded, call.bucket)
    _key_tail(fn, call, leaves, kinds, ptrs)
    return call


def _key_tail(fn, call: Call, leaves, kinds, ptrs) -> None:
    """End ``call``'s key with the entries that do not describe one argument: inputs sharing
    memory (a function writing its inputs), grad mode, the settings that choose kernels. With grad
    disabled, which leaves require grad (a function may branch on it), but not for a function
    whose inputs are guarded (compiled code, which never reads it)."""
    if len(leaves) > 1 and getattr(fn, "writes_inputs", False):
        pairs = _shared(fn, leaves, kinds, ptrs, call.ops, call.key)
        if pairs:
            call.key = call.key + ((SHARED, pairs),)
    p = _grad_mode[0]
    if p is not None and p():
        call.grad = True
        call.key = call.key + (_grad_entry(leaves, kinds),)
    elif not fn.inputs_guarded:
        req = tuple(j for j, t in enumerate(leaves) if getattr(t, "requires_grad", False))
        if req:
            call.key = call.key + ((REQUIRES_GRAD, req),)
    ks = _kernel[0]
    if ks is not None:
        call.key = call.key + (_settings_id(ks, getattr(fn, "kernel_getters", None) or _kernel[1]),)


def _shared(fn, leaves, kinds, ptrs, ops, key) -> tuple:
    """``shared_memory`` of a call of ``fn`` with ``key`` so far, through ``fn``'s memo."""
    memo = getattr(fn, "shared_memo", None)
    if memo is None:
        memo = fn.shared_memo = {}
    return shared_memory(leaves, kinds, ptrs, ops, memo, key)


def _settings_id(ks, getters) -> int:
    """``ks.state(getters)`` (``interop.torch.kernel_state.KernelState``), its common case inline:
    the newest guard holds and these values have an id."""
    recent = ks.recent
    if recent:
        newest = recent[0]
        if newest[0].check():
            sid = ks.ids.get((newest[1], tuple(map(_call, getters))))
            if sid is not None:
                return sid
    return ks.state(getters)


_PLAIN: dict[int, tuple] = {}  # n -> (ops, arg spans, arg specs) of n plain tensor arguments (shared, read-only)
_ONE = ((TORCH,), ((0, 1),), (LEAF,))  # _PLAIN[1]
_ONE_REQUIRES_GRAD = (REQUIRES_GRAD, (0,))  # the key entry of one tensor that requires grad, with grad disabled


def _inspect_tensor(fn, args, tree_outputs, device: int) -> Call:
    """``_inspect_tensors`` of one exact ``torch.Tensor``: the same result, with the key made as
    one tuple and ``_settings_id`` inline."""
    a = args[0]
    try:
        p = a.data_ptr()
    except RuntimeError as exc:  # sparse, meta, ...: no storage to copy or read in place
        raise SkipCall(f"a tensor input has no data pointer ({exc})") from None
    if a.is_conj() or a.is_neg():
        raise SkipCall(CONJ_NEG)
    if a.get_device() != device:
        _wrong_device(args, device)
    kinds = [STATIC if _static_ids and id(a) in _static_ids else (TREE if p in tree_outputs else EAGER)]
    probe = _grad_mode[0]
    grad = probe is not None and probe()
    ks = _kernel[0]
    if ks is None:
        sid = None
    else:  # _settings_id, inline
        getters = getattr(fn, "kernel_getters", None) or _kernel[1]
        recent = ks.recent
        sid = ks.ids.get((recent[0][1], tuple(map(_call, getters)))) if recent and recent[0][0].check() else None
        if sid is None:
            sid = ks.state(getters)
    part = (a.shape, a.stride(), a.dtype)
    if grad:
        entry = _NO_LEAF_GRAD if not a.requires_grad else _grad_entry(args, kinds)
    else:
        entry = _ONE_REQUIRES_GRAD if a.requires_grad else None
    if entry is None:
        key = (part,) if sid is None else (part, sid)
    else:
        key = (part, entry) if sid is None else (part, entry, sid)
    call = Call(key, [a], kinds, [p], *_ONE)
    call.grad = grad
    return call


def _inspect_tensors(fn, args, tree_outputs, device: int) -> Call:
    """``inspect`` of a call whose arguments are all exact ``torch.Tensor``s or ``nn.Parameter``s
    (static), of a function
    without ``static_argnums``, ``pad_buckets`` or keyword arguments: the same result, faster
    (the key is built once, with its grad and settings entries)."""
    n = len(args)
    shared = _PLAIN.get(n)
    if shared is None:
        shared = _PLAIN[n] = ((TORCH,) * n, tuple((j, 1) for j in range(n)), (LEAF,) * n)
    try:
        if n == 1:
            a = args[0]
            p = a.data_ptr()
            ptrs = [p]
            parts = [(a.shape, a.stride(), a.dtype)]
            if a.is_conj() or a.is_neg():
                raise SkipCall(CONJ_NEG)
            if a.get_device() != device:
                _wrong_device(args, device)
            if type(a) is _tensor[1] or (_static_ids and id(a) in _static_ids):
                kinds = [STATIC]
            else:
                kinds = [TREE if p in tree_outputs else EAGER]
        else:
            ptrs = [a.data_ptr() for a in args]
            parts = [(a.shape, a.stride(), a.dtype) for a in args]
            if any(a.is_conj() or a.is_neg() for a in args):
                raise SkipCall(CONJ_NEG)
            for a in args:
                if a.get_device() != device:
                    _wrong_device(args, device)
            P = _tensor[1]
            if _static_ids or any(type(a) is P for a in args):
                kinds = [STATIC if type(a) is P or id(a) in _static_ids else (TREE if p in tree_outputs else EAGER)
                         for a, p in zip(args, ptrs)]
            elif tree_outputs:
                kinds = [TREE if p in tree_outputs else EAGER for p in ptrs]
            else:
                kinds = [EAGER] * n
    except RuntimeError as exc:  # sparse, meta, ...: no storage to copy or read in place
        raise SkipCall(f"a tensor input has no data pointer ({exc})") from None
    if n > 1 and getattr(fn, "writes_inputs", False):
        pairs = _shared(fn, args, kinds, ptrs, shared[0], tuple(parts))
        if pairs:
            parts.append((SHARED, pairs))
    probe = _grad_mode[0]
    grad = probe is not None and probe()
    if grad:  # one tensor that does not require grad: the shared entry, without the general scan
        parts.append(_NO_LEAF_GRAD if n == 1 and not args[0].requires_grad else _grad_entry(args, kinds))
    elif n == 1:
        if args[0].requires_grad:
            parts.append(_ONE_REQUIRES_GRAD)
    else:
        for a in args:  # a loop, no generator: none requires grad in the common case
            if a.requires_grad:
                parts.append((REQUIRES_GRAD, tuple(j for j, b in enumerate(args) if b.requires_grad)))
                break
    ks = _kernel[0]
    if ks is not None:
        parts.append(_settings_id(ks, getattr(fn, "kernel_getters", None) or _kernel[1]))
    call = Call(tuple(parts), list(args), kinds, ptrs, *shared)
    call.grad = grad
    return call


def _inspect_guarded(fn, args, tree_outputs, device: int) -> Call:
    """``inspect`` of a call of a function whose inputs' dtypes and devices its caller guarantees
    (``inputs_guarded``: the backend's partitions of Inductor's code, run under dynamo's guards on
    every graph input's dtype, device, sizes and strides; the other tensors are buffers the code
    allocates itself, never conjugate or negative views, all on one device). Its key holds the
    number of tensors and the arguments after them (the partition's symbolic sizes), not each
    tensor's sizes and strides, which the guards and Inductor's asserts fix for one compiled graph
    (torch's trees key Inductor's graphs so too); reading a hundred tensors' layouts cost more than
    the rest of such a call. Kinds stay out of the key (the recording checks them). Tensors at
    ``fn.static_positions`` (module buffers, ``mark_static_address``) are static. Per tuple of
    argument types the leading tensors and their kinds are worked out once (``_guarded_kinds``).
    A call whose arguments do not start with a tensor takes ``inspect``'s general path."""
    T, types = _tensor[0], tuple(map(type, args))
    memo, fixed = getattr(fn, "guarded_kinds", None), getattr(fn, "static_positions", ())
    if memo is None or memo[0] is not fixed:
        memo = fn.guarded_kinds = (fixed, {})
    known = memo[1].get(types)
    if known is None:
        if len(memo[1]) >= 64:  # a bound: argument types rarely vary for one compiled graph
            memo[1].clear()
        known = memo[1][types] = _guarded_kinds(types, fixed)
    n, base = known
    if n == 0:  # no tensor first, or a non-tensor among the tensors: the general path classifies the call
        return _inspect_general(fn, args, {}, tree_outputs, device)
    tensors = args[:n] if n < len(args) else args
    kinds = list(base)  # STATIC for a parameter and at the static positions, else EAGER
    try:
        ptrs = list(map(T.data_ptr, tensors))  # the unbound method: a parameter's too
    except RuntimeError as exc:  # sparse, meta, ...: no storage to copy or read in place
        raise SkipCall(f"a tensor input has no data pointer ({exc})") from None
    if tensors[0].get_device() != device:
        _wrong_device(tensors, device)
    if tree_outputs and not tree_outputs.keys().isdisjoint(ptrs):  # outputs of the calls before it
        for j, p in enumerate(ptrs):  # a plain tensor's (at a static position too); a parameter stays static
            if p in tree_outputs and types[j] is T:
                kinds[j] = TREE
    if _static_ids:  # marked static: whatever else it is
        for j, a in enumerate(tensors):
            if id(a) in _static_ids:
                kinds[j] = STATIC
    parts = [GUARDED, n]
    leaves = list(tensors)
    shared = _PLAIN.get(n)
    if shared is None:
        shared = _PLAIN[n] = ((TORCH,) * n, tuple((j, 1) for j in range(n)), (LEAF,) * n)
    ops, spans, specs = shared
    if n < len(args):
        ops, spans, specs = list(ops), list(spans), list(specs)
        for a in args[n:]:
            first = len(leaves)
            specs.append(flatten(a, leaves, parts, kinds, ptrs, ops, None))
            spans.append((first, len(leaves) - first))
        if len(leaves) > n:  # an array among the sizes: the general path classifies it
            return _inspect_general(fn, args, {}, tree_outputs, device)
    call = Call(tuple(parts), leaves, kinds, ptrs, ops, spans, specs)
    _key_tail(fn, call, leaves, kinds, ptrs)
    return call


def guarded_tail(fn, args) -> tuple | None:
    """The end of the key of a call of ``inputs_guarded`` ``fn`` with tensors ``args`` made now, after
    ``(GUARDED, n)``, where none is a tree output or shares memory with another: ``()`` or ``(settings
    id,)``; None where it holds more or other kinds (grad mode records, one is marked static)."""
    p = _grad_mode[0]
    if (p is not None and p()) or (_static_ids and not _static_ids.keys().isdisjoint(map(id, args))):
        return None
    ks = _kernel[0]
    return () if ks is None else (_settings_id(ks, getattr(fn, "kernel_getters", None) or _kernel[1]),)


def _guarded_kinds(types, fixed) -> tuple:
    """``(n, kinds)`` of a guarded call with arguments of ``types``: ``n`` leading tensors (0: take the
    general path) and their kinds but for tree outputs and ``mark_static``: STATIC for a parameter
    and at the positions ``fixed`` (``static_positions``), else EAGER."""
    kind_of = {_tensor[0]: EAGER, _tensor[1]: STATIC}
    n = len(types)
    while n and types[n - 1] not in kind_of:  # the symbolic sizes after the tensors
        n -= 1
    if n == 0 or any(t not in kind_of for t in types[:n]):
        return 0, ()
    return n, tuple(STATIC if j in fixed else kind_of[t] for j, t in enumerate(types[:n]))


def _wrong_device(args, device: int):
    """Raise the ``SkipCall`` of tensor arguments not all on ``device``."""
    d = next(d for d in (a.get_device() for a in args) if d != device)
    if d < 0:
        raise SkipCall("CPU tensors or ops: an input lives on the CPU")
    if len({a.get_device() for a in args}) > 1:
        raise SkipCall("tensors on several devices")
    raise SkipCall(f"inputs on device {d}, but this tree is on device {device}")
