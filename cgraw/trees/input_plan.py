"""What a recording assumed of its inputs, and the decisions that compare a call with it.

Layer L6: pure Python over ``arrays``. ``calls.inspect`` classifies each call; these run after it:

- ``InputPlan``: a recording's input kinds and the addresses it reads in place; ``moved`` says
  why a call no longer fits it (a re-record reason).
- inputs sharing memory (``shared_memory``): once a warm-up shows a function writing an eager
  input (``writes_inputs``), the key of each of its calls notes which inputs overlap an eager one
  (an entry headed by ``SHARED``), and ``check_shared_writes`` refuses to record such a call when a
  written input is among them.
- ``unseen_eager``: a warm-up read in place an input that is now eager (warm up again).
- ``warm_up``: a backend's warm-up, with what the tree learns around it (below, and grad turned on
  inside a call made without it; the rows of a padded call's outputs).
- ``declared_mutations``: the eager leaves of the positions a function declared in ``mutates``.
- Python state (``python_state``, ``changed_argument``): a replay runs the device work of a call
  and none of its Python, so a function that reassigns an attribute of an argument object, or
  grows, shrinks or refills a list or dict it was given (a transformers ``DynamicCache`` growing
  by ``torch.cat``), would leave those changes undone on every replay. The tree compares a
  snapshot of what the arguments reach before and after a warm-up.
"""

from __future__ import annotations

import bisect
import itertools
import operator

import enum
import math
import sys

from cgraw.trees import buckets
from cgraw.trees.arrays import EAGER, STATIC, is_module, ops_of, out_spec, weaken_key
from cgraw.errors import SkipCall

__all__ = ["SHARED", "InputPlan", "KeyMark", "StateSnapshot", "changed_argument", "check_shared_writes",
           "declared_mutations", "moved", "python_state", "shared_memory", "state_change_verdict", "unseen_eager",
           "warm_up"]


class KeyMark:
    """A marker heading a key entry of its own kind: equal only to itself, printed by its name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


SHARED = KeyMark("SHARED")  # heads the key entry of a call whose eager inputs share memory with other inputs


class InputPlan:
    """What a recording assumed of its inputs: their kinds, and the addresses of the leaves it
    reads in place (static and tree-output inputs), as ``(leaf index, pointer)``."""

    __slots__ = ("kinds", "fixed", "fixed_at", "fixed_ptrs")

    def __init__(self, call):
        self.kinds = list(call.kinds)
        self.fixed = [(j, p) for j, p in enumerate(call.ptrs) if call.kinds[j] != EAGER]
        # a replay's check, in C: ``fixed_at(call.ptrs) == fixed_ptrs`` (None: nothing read in place)
        self.fixed_at = operator.itemgetter(*[j for j, _ in self.fixed]) if self.fixed else None
        self.fixed_ptrs = None if self.fixed_at is None else self.fixed_at(call.ptrs)


def moved(plan: InputPlan, call, fn=None) -> str | None:
    """Why ``call`` cannot replay a recording made under ``plan`` (a re-record reason), or None.
    A static input that compiled code declared (``fn.static_positions``: a module buffer, which
    dynamo gives Inductor as static) and that moved is an eager input of ``fn`` from now on, this
    call included, as is every other declared one that moved: a step that assigns new tensors to
    buffers re-records once, not every call."""
    if call.kinds != plan.kinds:
        return f"input kinds changed (0 eager, 1 static, 2 tree output): {plan.kinds} -> {call.kinds}"
    ptrs = call.ptrs
    for j, p in plan.fixed:
        if ptrs[j] != p:
            what = "static input" if call.kinds[j] == STATIC else "tree-output input"
            declared = getattr(fn, "static_positions", ())
            if j in declared:  # every declared one that moved, at once: one re-record
                gone = {k for k, q in plan.fixed if k in declared and ptrs[k] != q}
                _demote(fn, call, gone)
                return f"{what} {j} (a static input of the compiled graph) moved from 0x{p:x} to 0x{ptrs[j]:x}: " \
                       f"an eager input from now on, with {len(gone) - 1} other(s)"
            return f"{what} {j} moved from 0x{p:x} to 0x{ptrs[j]:x}"
    return None


def demote_in_pool(fn, call, in_pool) -> str | None:
    """The static inputs compiled code declared (``fn.static_positions``) that live in the tree's
    own pool (a module buffer assigned a compiled piece's output, kept past its generation) are eager
    inputs of ``fn`` from now on, this call included: the checkpoint restore before a warm-up or a
    recording may free their blocks, so they are copied out of the pool first, as every eager input
    there is. ``in_pool(ptr)``: the pool's test of an address. Where the function also writes one
    of them (``fn.mutates``), nothing is demoted and the reason it cannot be recorded is returned:
    its copy out of the pool would take the write, not the caller's buffer."""
    declared = getattr(fn, "static_positions", ())
    kinds, ptrs = call.kinds, call.ptrs
    gone = [j for j in declared if kinds[j] == STATIC and in_pool(ptrs[j])]
    if not gone:
        return None
    written = set(_declared_leaves(fn, call)).intersection(gone)
    if written:
        return (f"static input(s) {sorted(written)} of the compiled graph, which it writes in "
                "place, live in the graph tree's memory (a module buffer assigned a piece's output): it runs as "
                "Inductor compiled it")
    _demote(fn, call, gone)
    return None


def _demote(fn, call, gone) -> None:
    """The declared static inputs at ``gone`` are eager inputs of ``fn`` from now on, this call included."""
    fn.static_positions = tuple(j for j in fn.static_positions if j not in gone)
    for j in gone:
        call.kinds[j] = EAGER


def shared_memory(leaves, kinds, ptrs, ops, memo: dict | None = None, key=None) -> tuple:
    """``(j, k)`` (``j < k``) of the leaves whose memory overlaps where one of them is eager (copied
    into a recording's placeholder): ``f(x, x[2:])``. Asked only of the calls of a function known to
    write its inputs (``writes_inputs``): a recording's separate copies of the two would not see
    each other's writes, where eager code does. A graphed call asks it on every call of such a
    function (a decode step writing its cache, a training step updating BatchNorm's statistics),
    so with ``memo`` (the function's, ``{key: Fixed}``) and ``key`` (the call's key so far, which
    holds every leaf's layout, or for compiled code fixes it through dynamo's guards) the extents
    of the leaves read in place are measured once and reused while their addresses stay; only the
    eager leaves are measured per call."""
    if EAGER not in kinds:
        return ()
    if memo is None:
        memo = {}
    fixed = memo.get(key)
    if fixed is None or fixed.kinds != kinds or (fixed.get is not None and fixed.get(ptrs) != fixed.ptrs):
        if len(memo) >= MEMO_KEYS:
            memo.clear()
        weaken_key(key)  # the memo keeps alive nothing the key names (a StaticCache through an argument)
        fixed = memo[key] = Fixed(leaves, kinds, ptrs, ops)
    starts, ends, reach, idx = fixed.starts, fixed.ends, fixed.reach, fixed.idx
    spans = []
    pairs = []
    for j in fixed.eager:
        p = ptrs[j]
        below, above = ops[j].reach(leaves[j])
        s, e = p - below, p + above
        for t, e2, k in spans:  # the eager leaves before it
            if t < e and s < e2:
                pairs.append((k, j))
        spans.append((s, e, j))
        i = bisect.bisect_left(starts, e) - 1  # the leaves read in place that start before its end
        while i >= 0 and reach[i] > s:  # reach[i]: the furthest end among the first i + 1
            if ends[i] > s:
                k = idx[i]
                pairs.append((j, k) if j < k else (k, j))
            i -= 1
    if len(pairs) > 1:
        pairs.sort()
    return tuple(pairs)


MEMO_KEYS = 8  # keys a function's memo keeps (a function called with more signatures measures again)


class Fixed:
    """The leaves of one call that are read in place (static inputs, tree outputs), sorted by
    start: their extents, the furthest end up to each, and the addresses they were measured at
    (``get(ptrs)`` must still give ``ptrs``)."""

    __slots__ = ("eager", "ends", "get", "idx", "kinds", "ptrs", "reach", "starts")

    def __init__(self, leaves, kinds, ptrs, ops):
        self.kinds = list(kinds)
        self.eager = tuple(j for j, k in enumerate(kinds) if k == EAGER)
        rest = [j for j, k in enumerate(kinds) if k != EAGER]
        self.get = operator.itemgetter(*rest) if rest else None
        self.ptrs = None if self.get is None else self.get(ptrs)
        spans = []
        for j in rest:
            below, above = ops[j].reach(leaves[j])
            spans.append((ptrs[j] - below, ptrs[j] + above, j))
        spans.sort()
        self.starts = [s for s, _, _ in spans]
        self.ends = [e for _, e, _ in spans]
        self.idx = [j for _, _, j in spans]
        self.reach = list(itertools.accumulate(self.ends, max))


def check_shared_writes(call, written) -> None:
    """Raise ``SkipCall`` when an eager input the function writes (``written``: leaf indices) shares
    memory with another input of ``call``: no recording can run it as eager code does."""
    for entry in call.key:
        if type(entry) is tuple and entry and entry[0] is SHARED:
            for j, k in entry[1]:
                if j in written or k in written:
                    raise SkipCall(f"inputs {j} and {k} share memory and the function writes input "
                                   f"{j if j in written else k} in place; a recording copies an eager input "
                                   "into a placeholder of its own, so the other would not see the write")


def unseen_eager(seen, call) -> bool:
    """Whether an input of ``call`` is eager (copied into a recording) where the warm-up that
    learned the function (``seen``: its call's kinds, or None) read it in place, as a tree output
    or a static input: the warm-up compared only its eager inputs' contents, so it did not learn
    whether the function writes into this one, which a recording must then copy back."""
    return seen is not None and any(k == EAGER and w != EAGER for k, w in zip(call.kinds, seen))


def declared_mutations(fn, call) -> tuple:
    """Eager leaves of the positional arguments ``fn`` declared in ``mutates``."""
    kinds = call.kinds
    return tuple(j for j in _declared_leaves(fn, call) if kinds[j] == EAGER)


def _declared_leaves(fn, call):
    """The leaves of the positional arguments ``fn`` declared in ``mutates``."""
    spans = call.arg_spans
    return (j for i in fn.mutates if i < len(spans) for j in range(spans[i][0], sum(spans[i])))



_PLAIN = (int, float, bool, str, bytes, complex, type(None))
_DEPTH = 6  # levels of attributes and items a snapshot follows
_WIDTH = 256  # items of one list or dict it follows (more: its length and identity only)
_BUDGET = 4096  # containers and objects one snapshot follows in all (more: by identity)


class StateSnapshot(list):
    """``python_state``'s per-argument snapshots. It holds every object it names by address until
    it is dropped, so that no object made during the call can take a named one's address (CPython
    reuses a freed object's memory) and pass for it."""

    __slots__ = ("held",)


def python_state(args, kwargs) -> StateSnapshot | None:
    """One snapshot per argument of the Python state it reaches (arrays and modules by identity,
    plain values by value, lists, tuples, dicts and objects' attributes followed), or None when
    the call passes nothing but arrays (nothing to compare)."""
    values = list(args) + list(kwargs.values())
    if all(ops_of(a) is not None for a in values):
        return None
    held: list = []
    snap = StateSnapshot(_snapshot(a, _DEPTH, set(), held) for a in values)
    snap.held = held
    return snap


def _snapshot(x, depth: int, seen: set, held: list):
    t = type(x)
    if t in _PLAIN:
        return (t, x) if t is not float or not math.isnan(x) else (t, "nan")
    if ops_of(x) is not None or is_module(x) or isinstance(x, (enum.Enum, type)) or callable(x):
        held.append(x)
        return ("id", id(x))
    if t.__module__ == "torch":  # torch.Size, dtypes, devices: values
        return (t, x)
    held.append(x)  # named by its id below
    if depth == 0 or id(x) in seen or len(seen) >= _BUDGET:
        return ("id", id(x))
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        items = x if len(x) <= _WIDTH else ()
        return (t, id(x), len(x), tuple(_snapshot(v, depth - 1, seen, held) for v in items))
    if isinstance(x, dict):
        items = list(x.items()) if len(x) <= _WIDTH else []
        return (t, id(x), len(x), tuple((k, _snapshot(v, depth - 1, seen, held)) for k, v in items))
    attrs = getattr(x, "__dict__", None)
    if not isinstance(attrs, dict):
        return ("id", id(x))
    return (t, id(x), tuple((k, _snapshot(v, depth - 1, seen, held)) for k, v in list(attrs.items())))


def changed_argument(before, args, kwargs) -> str | None:
    """Which argument a call changed the Python state of (``before``: its ``python_state``), as
    the reason its replays cannot run it; None when none changed."""
    if before is None:
        return None
    after = python_state(args, kwargs)
    names = [f"argument {i}" for i in range(len(args))] + [f"argument {k!r}" for k in kwargs]
    values = list(args) + list(kwargs.values())
    for name, value, b, a in zip(names, values, before, after or ()):
        if a != b:
            return (f"it changes the Python state of its {name} ({type(value).__name__}) in place (an attribute, "
                    "list or dict reached from it was reassigned or resized: args.clear(), d['k'] = v, obj.n += 1, "
                    "a DynamicCache growing, a new StaticCache set up on first use), which a replay would not "
                    "redo: it runs no Python; keep such state in tensors made once and updated in place (one "
                    "StaticCache passed to every call or generate()), or keep this function eager")
    return None


def state_change_verdict(fn, skip: str | None, why: str | None) -> tuple[str | None, bool]:
    """What follows a warm-up of ``fn`` that changed an argument's Python state (``why``, from
    ``changed_argument``; ``skip``: the warm-up's own skip reason, which comes first):
    ``(skip reason, warm up again)``. The first time the node warms up again at its next call
    (state made lazily on first use, a cache filled once); the second time the function runs
    eagerly from now on (its ``unsafe_reason``), for every input signature."""
    if skip is not None or why is None:
        return skip, False
    fn.python_state_changes = getattr(fn, "python_state_changes", 0) + 1
    if fn.python_state_changes < 2:
        return None, True
    fn.unsafe_reason = why
    return why, False


def warm_up(warmup, fn, call, args, kwargs):
    """``warmup(fn, call, args, kwargs)`` (a backend's), which also notes what no backend's warm-up
    sees, as a reason to run the function eagerly (``Warm.skip``): that called with grad disabled
    it returned outputs that require grad (``_grad_inside``), or that it changed the Python state
    of an argument (``python_state``; ``Warm.again``: warm up once more first, see
    ``state_change_verdict``); under padding buckets, what its outputs tell of the rows
    (``buckets.warm_rows``)."""
    before = python_state(args, kwargs)
    w = warmup(fn, call, args, kwargs)
    torch = sys.modules.get("torch")
    if w.skip is None and torch is not None and not torch.is_grad_enabled():
        w.skip = _grad_inside(call, w.out)
    if call.bucket is not None and w.skip is None:
        try:
            w.rows = buckets.warm_rows(call.rows, w.out)
        except SkipCall:
            pass  # an output no graph can hand out: the warm-up says so itself
    w.skip, w.again = state_change_verdict(fn, w.skip, changed_argument(before, args, kwargs))
    return w


GRAD_INSIDE = ("its outputs require grad although grad mode is off at the call (torch.enable_grad() "
               "inside): a recording made with grad off hands out outputs without autograd's graph")


def _grad_inside(call, out) -> str | None:
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
