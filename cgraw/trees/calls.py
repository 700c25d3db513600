"""A graphed call's inputs, classified: the decisions graph trees make about arguments.

Layer L6: pure Python over ``arrays`` (no CUDA, frameworks through their ``Ops``). ``manager``
calls it for every call; backends only read what it decides.

- ``inspect``: flatten the arguments into array *leaves* with their kinds, pointers and ops, and
  build the call's signature *key* (shapes, strides, dtypes, containers, scalars by value).
  Kinds: *static* (``nn.Parameter``s, a module argument's parameters and buffers, tensors marked
  with ``cgraw.mark_static`` or ``torch._dynamo.mark_static_address``, positions in
  ``static_argnums``: read in place), *tree output* (an output of an earlier graphed call in this
  generation: read in place), *eager* (everything else: copied into a placeholder).
- ``InputPlan``: what a recording assumed of its inputs (kinds, addresses read in place);
  ``moved`` says why a call no longer fits it.
- ``declared_mutations``: the eager leaves of the positions a function declared in ``mutates``.
- inputs sharing memory (``shared_memory``): once a warm-up shows a function writing an eager
  input (``writes_inputs``), the key of each of its calls notes which inputs overlap an eager one,
  and ``check_shared_writes`` refuses to record such a call when a written input is among them;
  ``unseen_eager`` says when a warm-up read in place an input that is now eager (warm up again).
- padding buckets (``cgraw.trees.buckets``): the bucket a call is recorded under, part of its key.
- grad mode (``use_grad_mode``): with autograd recording, the key gains ``(GRAD, indices of the
  leaves that require grad)``, so calls under ``torch.no_grad()`` select recordings of their own
  (``cgraw.trees.autograd``). Otherwise (grad disabled, or no probe installed) it gains
  ``(REQUIRES_GRAD, those indices)`` when a leaf requires grad: a function may branch on
  ``x.requires_grad`` under ``no_grad`` too, and its recording's placeholder requires grad then.
- the settings that choose kernels (``use_kernel_state``: autocast, TF32, deterministic
  algorithms, the default dtype, inference mode, cuDNN and attention flags; see
  ``interop.torch.kernel_state``): the key ends with an id of their current values, so a call made under
  other settings selects (or makes) a recording of its own. A function reads the cuDNN and
  attention flags only once its warm-up has shown it runs such ops (``learn_kernel_groups``).
"""

from __future__ import annotations

import sys
import weakref

from cgraw.trees import buckets
from cgraw.trees.arrays import EAGER, LEAF, STATIC, TORCH, TREE, NoType, flatten, out_spec
from cgraw.trees.frameworks import CONJ_NEG
from cgraw.errors import SkipCall

__all__ = ["EAGER", "GRAD", "REQUIRES_GRAD", "SHARED", "STATIC", "TREE", "Call", "InputPlan", "check_shared_writes",
           "declared_mutations", "grad_enabled", "inspect", "learn_kernel_groups", "mark_static", "moved",
           "shared_memory", "unseen_eager", "use_grad_mode", "use_kernel_state", "warm_up"]

_static_ids: dict[int, object] = {}  # id(array) -> weakref, filled by mark_static
_tensor = [NoType, NoType]  # [torch.Tensor, torch.nn.Parameter] once torch is loaded: the exact-type fast path
_grad_mode: list = [None]  # [a probe: does autograd record now?] (torch.is_grad_enabled), or [None]
_kernel: list = [None, ()]  # [interop.torch.kernel_state.KernelState, its getters of every group], or [None, ()]


class _Mark:
    """A key entry's head, equal only to itself."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


GRAD = _Mark("GRAD")  # heads the key entry of a call made with grad enabled
SHARED = _Mark("SHARED")  # heads the key entry of a call whose eager inputs share memory with other inputs
REQUIRES_GRAD = _Mark("REQUIRES_GRAD")  # heads the key entry of the leaves that require grad, with grad disabled


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


def learn_kernel_groups(fn, groups, key: tuple) -> tuple | None:
    """A warm-up of ``fn`` ran ops depending on the setting ``groups`` (``interop.torch.kernel_state.GROUPS``
    names; None: unknown). If that narrows or widens what ``fn``'s calls read, set it and return
    ``key`` (the warmed call's key) ending with the id of the settings under the new reading, which
    is what the function's next call under the same settings will have; else None."""
    ks = _kernel[0]
    if ks is None or groups is None:
        return None
    old = getattr(fn, "kernel_groups", None)
    new = frozenset(groups) if old is None else old | frozenset(groups)
    if new != old:
        fn.kernel_groups = new
        fn.kernel_getters = ks.getters(new)
    # also when unchanged: the call may have been keyed before another thread's warm-up learned them
    return key[:-1] + (ks.state(fn.kernel_getters),)


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
        for a in args:
            if type(a) is not T and type(a) is not P:
                break
        else:  # the hot path: plain tensors only, no options (one pass per property, no generic dispatch)
            return _inspect_tensors(fn, args, tree_outputs, device)
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
    if len(leaves) > 1 and getattr(fn, "writes_inputs", False):
        pairs = shared_memory(leaves, kinds, ptrs, ops)
        if pairs:
            call.key = call.key + ((SHARED, pairs),)
    p = _grad_mode[0]
    if p is not None and p():
        call.grad = True
        call.key = call.key + (_grad_entry(leaves, kinds),)
    else:
        req = tuple(j for j, t in enumerate(leaves) if getattr(t, "requires_grad", False))
        if req:
            call.key = call.key + ((REQUIRES_GRAD, req),)
    ks = _kernel[0]
    if ks is not None:
        call.key = call.key + (ks.state(getattr(fn, "kernel_getters", None) or _kernel[1]),)
    return call


_PLAIN: dict[int, tuple] = {}  # n -> (ops, arg spans, arg specs) of n plain tensor arguments (shared, read-only)


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
        pairs = shared_memory(args, kinds, ptrs, shared[0])
        if pairs:
            parts.append((SHARED, pairs))
    probe = _grad_mode[0]
    grad = probe is not None and probe()
    if grad:  # one tensor that does not require grad: the shared entry, without the general scan
        parts.append(_NO_LEAF_GRAD if n == 1 and not args[0].requires_grad else _grad_entry(args, kinds))
    elif n == 1:
        if args[0].requires_grad:
            parts.append((REQUIRES_GRAD, (0,)))
    else:
        for a in args:  # a loop, no generator: none requires grad in the common case
            if a.requires_grad:
                parts.append((REQUIRES_GRAD, tuple(j for j, b in enumerate(args) if b.requires_grad)))
                break
    ks = _kernel[0]
    if ks is not None:
        parts.append(ks.state(getattr(fn, "kernel_getters", None) or _kernel[1]))
    call = Call(tuple(parts), list(args), kinds, ptrs, *shared)
    call.grad = grad
    return call


def _wrong_device(args, device: int):
    """Raise the ``SkipCall`` of tensor arguments not all on ``device``."""
    d = next(d for d in (a.get_device() for a in args) if d != device)
    if d < 0:
        raise SkipCall("CPU tensors or ops: an input lives on the CPU")
    if len({a.get_device() for a in args}) > 1:
        raise SkipCall("tensors on several devices")
    raise SkipCall(f"inputs on device {d}, but this tree is on device {device}")


class InputPlan:
    """What a recording assumed of its inputs: their kinds, and the addresses of the leaves it
    reads in place (static and tree-output inputs), as ``(leaf index, pointer)``."""

    __slots__ = ("kinds", "fixed")

    def __init__(self, call: Call):
        self.kinds = list(call.kinds)
        self.fixed = [(j, p) for j, p in enumerate(call.ptrs) if call.kinds[j] != EAGER]


def moved(plan: InputPlan, call: Call) -> str | None:
    """Why ``call`` cannot replay a recording made under ``plan`` (a re-record reason), or None."""
    if call.kinds != plan.kinds:
        return f"input kinds changed (0 eager, 1 static, 2 tree output): {plan.kinds} -> {call.kinds}"
    ptrs = call.ptrs
    for j, p in plan.fixed:
        if ptrs[j] != p:
            what = "static input" if call.kinds[j] == STATIC else "tree-output input"
            return f"{what} {j} moved from 0x{p:x} to 0x{ptrs[j]:x}"
    return None


def shared_memory(leaves, kinds, ptrs, ops) -> tuple:
    """``(j, k)`` (``j < k``) of the leaves whose memory overlaps where one of them is eager (copied
    into a recording's placeholder): ``f(x, x[2:])``. Asked only of the calls of a function known to
    write its inputs (``writes_inputs``): a recording's separate copies of the two would not see
    each other's writes, where eager code does."""
    spans = sorted((ptrs[j], ptrs[j] + max(ops[j].span(t), 0), j) for j, t in enumerate(leaves))
    pairs = []
    for a, (start, end, j) in enumerate(spans):
        for start2, _, k in spans[a + 1:]:
            if start2 >= end:
                break
            if EAGER in (kinds[j], kinds[k]):
                pairs.append((min(j, k), max(j, k)))
    return tuple(sorted(pairs))


def check_shared_writes(call: Call, written) -> None:
    """Raise ``SkipCall`` when an eager input the function writes (``written``: leaf indices) shares
    memory with another input of ``call``: no recording can run it as eager code does."""
    for entry in call.key:
        if type(entry) is tuple and entry and entry[0] is SHARED:
            for j, k in entry[1]:
                if j in written or k in written:
                    raise SkipCall(f"inputs {j} and {k} share memory and the function writes input "
                                   f"{j if j in written else k} in place; a recording copies an eager input "
                                   "into a placeholder of its own, so the other would not see the write")


def unseen_eager(seen, call: Call) -> bool:
    """Whether an input of ``call`` is eager (copied into a recording) where the warm-up that
    learned the function (``seen``: its call's kinds, or None) read it in place, as a tree output
    or a static input: the warm-up compared only its eager inputs' contents, so it did not learn
    whether the function writes into this one, which a recording must then copy back."""
    return seen is not None and any(k == EAGER and w != EAGER for k, w in zip(call.kinds, seen))


def declared_mutations(fn, call: Call) -> tuple:
    """Eager leaves of the positional arguments ``fn`` declared in ``mutates``."""
    spans, kinds = call.arg_spans, call.kinds
    return tuple(j for i in fn.mutates if i < len(spans)
                 for j in range(spans[i][0], sum(spans[i])) if kinds[j] == EAGER)



ARGUMENT_WRITTEN = ("it changes an argument in place (a list's or a dict's items, an object's attributes: "
                    "args.clear(), d['k'] = v, obj.n += 1); a replay runs no Python, so the change would not happen")


def warm_up(warmup, fn, call: Call, args, kwargs):
    """``warmup(fn, call, args, kwargs)`` (a backend's), which also notes, as a reason to run the
    function eagerly (``Warm.skip``), what no warm-up of a backend sees: that it changed a
    container or object argument in place (not a module's state, which has checks of its own), or
    that called with grad disabled it returned outputs that require grad (``_grad_inside``); under
    padding buckets, what its outputs tell of the rows (``buckets.warm_rows``)."""
    before = _python_state(args, kwargs)
    w = warmup(fn, call, args, kwargs)
    torch = sys.modules.get("torch")
    if w.skip is None and torch is not None and not torch.is_grad_enabled():
        w.skip = _grad_inside(call, w.out)
    if call.bucket is not None and w.skip is None:
        try:
            w.rows = buckets.warm_rows(call.rows, w.out)
        except SkipCall:
            pass  # an output no graph can hand out: the warm-up says so itself
    if before is not None and w.skip is None:
        try:
            after = _python_state(args, kwargs)
        except SkipCall:
            after = None
        if after != before:
            w.skip = ARGUMENT_WRITTEN
    return w


GRAD_INSIDE = ("its outputs require grad although grad mode is off at the call (torch.enable_grad() "
               "inside): a recording made with grad off hands out outputs without autograd's graph")


def _grad_inside(call: Call, out) -> str | None:
    """``GRAD_INSIDE`` when a call made with grad disabled returned a tensor that autograd made
    (it requires grad and has a ``grad_fn``) and that is not one of its inputs, else None (a
    parameter, or an input returned as it is, keeps requiring grad, and a replay returns it)."""
    leaves: list = []
    try:
        out_spec(out, leaves)
    except SkipCall:
        return None
    ins = {id(t) for t in call.leaves}
    made = [t for t in leaves if getattr(t, "grad_fn", None) is not None and id(t) not in ins]
    return GRAD_INSIDE if made else None


def _python_state(args, kwargs):
    """The arguments' structure as a key (``arrays.flatten``) and their array leaves' identities;
    None for plain tensor arguments or a module argument (nothing to compare)."""
    T, P = _tensor
    if not kwargs and all(type(a) is T or type(a) is P for a in args):
        return None
    torch = sys.modules.get("torch")
    values = list(args) + list(kwargs.values())
    if torch is not None and any(isinstance(a, torch.nn.Module) for a in values):
        return None
    leaves: list = []
    key: list = list(kwargs)
    for a in values:
        flatten(a, leaves, key, [], [], [], None)
    return key, [id(t) for t in leaves]
