"""The data of graph trees: node states, per-function statistics, tree nodes, and the ``Backend``
protocol a ``manager.TreeManager`` drives (with what a warm-up reports, ``Warm``). The settings are
``config``.

Layer L6: pure Python, no CUDA and no frameworks.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

from cgraw.errors import SkipCall
from cgraw.trees.input_plan import InputPlan


class NodeState(enum.Enum):
    WARMED = "warmed"
    RECORDED = "recorded"
    SKIPPED = "skipped"


_fn_ids = itertools.count()


def next_fn_id() -> int:
    """A new graphed function's id (``GraphedFunction``, a forward node's backward)."""
    return next(_fn_ids)


@dataclass
class FunctionStats:
    """What happened to one graphed function (``cgraw.report()``)."""

    name: str
    warmups: int = 0
    recordings: int = 0
    rerecords: int = 0
    rerecord_reasons: list = field(default_factory=list)
    replays: int = 0
    eager_calls: int = 0
    skip_reasons: dict = field(default_factory=dict)  # reason -> count
    capture_ms: float = 0.0
    instantiate_ms: float = 0.0
    variants: int = 0  # distinct input signatures seen
    promoted: bool = False  # made a root function by config.path_repeat_limit


class TreeNode:
    """One function on one path with one input signature. Parents are held weakly."""

    __slots__ = ("fn", "key", "_parent", "children", "state", "recording", "plan", "checkpoint", "depth",
                 "skip_reason", "warm", "stats", "rewarms", "mode_mark", "refs", "__weakref__")

    def __init__(self, fn, key, parent: "TreeNode | None", stats: "FunctionStats | None" = None):
        self.fn = fn
        self.key = key
        self._parent = None if parent is None else weakref.ref(parent)
        self.children: dict = {}
        self.state = NodeState.WARMED
        self.recording = None
        self.plan: InputPlan | None = None  # what the recording assumed of its inputs
        self.checkpoint = None
        self.depth = 0 if parent is None else parent.depth + 1
        self.skip_reason: str | None = None
        self.warm: Warm | None = None  # what the last warm-up learned
        self.stats = stats  # the function's FunctionStats (shared by its nodes)
        self.rewarms = 0
        self.mode_mark = -1  # the function's replay count at this node's last ModeRewarm
        self.refs: tuple = ()  # weak references to the objects its key names (arrays.weaken_key)

    def failed_recording(self, exc: SkipCall, limit: int) -> None:
        """After a recording that raised ``exc``: the node runs eagerly from now on (SKIPPED, with
        the reason), or, when the failure happens once (``exc.rewarm``) and the node has not warmed
        up again ``limit`` times, it warms up again at its next call."""
        self.skip_reason = str(exc)
        if exc.rewarm and self.rewarms < limit:
            self.rewarms += 1
            self.state, self.warm = NodeState.WARMED, None
        else:
            self.state = NodeState.SKIPPED

    def note_rewarm(self, reason, replays: int) -> None:
        """Count a warm-up forced by ``reason`` towards ``config.rewarm_limit``: a switch between
        training and evaluation (``ModeRewarm``) only when the function (``replays``: its replay
        count) has not replayed since the previous one."""
        if not isinstance(reason, ModeRewarm) or replays == self.mode_mark:
            self.rewarms += 1
        if isinstance(reason, ModeRewarm):
            self.mode_mark = replays

    @property
    def mutated(self) -> tuple:
        """Eager leaves the function writes (found at warm-up, or declared in ``mutates``)."""
        return () if self.warm is None else self.warm.mutated

    @property
    def parent(self) -> "TreeNode | None":
        return None if self._parent is None else self._parent()

    def path(self) -> list["TreeNode"]:
        """Nodes from the root to this one."""
        out = []
        n = self
        while n is not None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def walk(self):
        """This node and every node below it."""
        stack = [self]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def repeats(self, fn) -> int:
        """How many nodes of ``fn`` the path ending at this node holds."""
        k = 0
        n = self
        while n is not None:
            if n.fn is fn:
                k += 1
            n = n.parent
        return k

    def __repr__(self) -> str:
        return f"<TreeNode {self.fn.name} {self.state.value} depth={self.depth}>"


def rekey(roots: dict, node: TreeNode, key) -> None:
    """File ``node`` (a child of its parent, or one of ``roots``) under ``key`` instead, unless
    ``key`` is None or taken."""
    parent = node.parent
    siblings = roots if parent is None else parent.children
    fid = node.fn.fn_id
    if key is not None and (fid, key) not in siblings and siblings.get((fid, node.key)) is node:
        del siblings[(fid, node.key)]
        node.key = key
        siblings[(fid, key)] = node


def recorded_ancestor(node: "TreeNode | None") -> "TreeNode | None":
    """``node`` or its nearest ancestor that holds a recording (None: the root checkpoint)."""
    while node is not None and node.state is not NodeState.RECORDED:
        node = node.parent
    return node


def describe_nodes(head: str, roots, num_nodes) -> str:
    """``head``, then the trees under ``roots`` indented by depth (``num_nodes(recording)`` graph nodes each)."""
    lines = [head]

    def visit(n: TreeNode, indent: str):
        extra = f" ({n.skip_reason})" if n.state is NodeState.SKIPPED else ""
        nn = "" if n.recording is None else f", {num_nodes(n.recording)} graph nodes"
        lines.append(f"{indent}{n.fn.name} [{n.state.value}{nn}]{extra}")
        for c in n.children.values():
            visit(c, indent + "  ")

    for r in roots:
        visit(r, "  ")
    return "\n".join(lines)


class Rewarm(str):
    """A re-record reason (from a recording's ``stale``) after which the node must warm up again first:
    what the warm-up learned about the function (the tensors it reads through its closure) may
    be out of date."""


class ModeRewarm(Rewarm):
    """A ``Rewarm`` because a module switched between training and evaluation: counted against
    ``config.rewarm_limit`` only when the function has not replayed since its last one (a
    function that switches modes inside itself), not for a loop that trains and evaluates in turn."""


COMPILED_IN_CAPTURE = ("torch.compile compiled code during the recording (its guards failed at this call: state "
                      "made by an earlier call, such as an optimizer's), which a capture cannot hold; this call ran "
                      "eagerly and the next one warms up again")


def capture_failed(reason: str, compiled: bool) -> SkipCall:
    """The ``SkipCall`` of a recording whose capture failed with ``reason``; ``compiled``: dynamo
    set out to compile a frame during it, which is why it failed and happens once: warm up again."""
    if compiled:
        return SkipCall(f"{COMPILED_IN_CAPTURE}: {reason}", rewarm=True)
    return SkipCall(reason)


class Warm:
    """What a backend's warm-up returns: the eager result, the eager inputs it mutated, why the
    function must run eagerly from now on (or None), and what else a recording must know."""

    __slots__ = ("out", "mutated", "skip", "external", "epoch", "runs_backward", "mode_epoch", "in_pool",
                 "handed", "stash", "groups", "kinds", "rows", "again", "keyed")

    def __init__(self, out, mutated=(), skip=None, external=(), epoch=-1, runs_backward=False, mode_epoch=0):
        self.out = out
        self.mutated = mutated
        self.skip = skip
        self.external = external  # tensors read through the closure (kept alive, checked per call; see hold_external)
        self.epoch = epoch  # module-assignment count at the warm-up (backend-defined)
        self.runs_backward = runs_backward  # a backward pass ran inside (autograd's own thread allocates)
        self.mode_epoch = mode_epoch  # training/evaluation switch count at the warm-up, -1 if it switched
        self.in_pool = False  # it ran inside the tree's pool and left blocks there (restore before recording)
        self.handed = ()  # its outputs in the pool: invalid once the generation ends
        self.stash = None  # why blocks it left in the pool are held beyond its outputs (lazily made state), or None
        self.groups = None  # groups of kernel-choosing settings the ops it ran depend on (growth.learn_kernel_groups), or None
        self.kinds = None  # the kinds of the call it ran for (calls.EAGER, STATIC, TREE), set by the tree
        self.rows = None  # padding buckets: what its outputs tell of the rows (buckets.warm_rows), or None
        self.again = False  # it changed an argument's Python state for the first time: warm up once more
        self.keyed = ()  # weak references to the closure tensors its node's key names (see hold_external)


def hold_external(w: Warm, refs) -> None:
    """Keep weakly what ``w.external`` holds of the objects a node's key names (``refs``, from
    ``arrays.weaken_key``: a StaticCache's tensors reached through an argument's attributes), so
    a warmed node keeps none of them alive; ``external_for_record`` gives them back."""
    w.external = tuple(w.external)
    named = {id(t): r for r in refs if (t := r()) is not None}
    if not named or not w.external:
        return
    w.keyed = tuple(named[id(t)] for t in w.external if id(t) in named and named[id(t)]() is t)
    if w.keyed:
        w.external = tuple(t for t in w.external if not (id(t) in named and named[id(t)]() is t))


@contextlib.contextmanager
def external_for_record(w: Warm):
    """``w.external`` with the tensors ``hold_external`` keeps weakly, while a recording is made
    (a call whose key matched the node's: they are alive); the recording holds them from then on."""
    if not w.keyed:
        yield
        return
    strong = w.external
    w.external = strong + tuple(r() for r in w.keyed)
    try:
        yield
    finally:
        w.external = strong


def split_external(w: Warm) -> tuple:
    """While a recording is made (``external_for_record``): ``(w.external`` without the tensors the
    node's key names``, those tensors)``: a recording holds the first and references the second
    weakly, as the node does."""
    keyed = [r() for r in w.keyed]
    return tuple(t for t in w.external if not any(t is k for k in keyed)), keyed


class Replayable(Protocol):
    """A recording, as the tree's hot path uses it (no backend call in between)."""

    out_ptrs: list  # data pointers of the memory its outputs own in the pool
    users: list  # (users, baseline) of that memory: more than the baseline while an alias holds it
    capture_ms: float
    instantiate_ms: float
    grad: Any  # what a backward through its replays needs; None: its outputs need no backward ticket
    reuse: Any  # trees.outputs.Reuse: the output objects it hands out again (its owned outputs), or None

    def replay(self, call, first: bool = False) -> "tuple[Any, Any] | Rewarm":
        """Launch for ``call``: the outputs, and those in the tree's memory (watched while alive,
        invalidated when the generation ends). Or, launching nothing, why what the warm-up learned
        is out of date (the node warms up again); ``first``: the recording's first call, which the
        backend's ``first_replay`` makes right after recording, is not checked."""


class Backend(Protocol):
    """The work behind a ``TreeManager``. ``call`` is a ``calls.Call``; a recording is the
    backend's own ``Replayable``, which the tree stores, replays and hands back."""

    def warmup(self, fn, call, args, kwargs) -> Warm:
        """Run the function eagerly; report what a recording must know (or why to skip it)."""

    def warm_restores(self, fn, call) -> bool:
        """Whether ``fn``'s warm-up will run inside the pool and may reuse what restoring the
        pool to its parent's checkpoint frees (no eager input lies in the pool)."""

    def record(self, fn, call, warm: Warm) -> Replayable:
        """Capture the function for ``call``; ``SkipCall`` when it cannot be (``dirty`` when the
        capture's blocks stayed in the pool)."""

    def first_replay(self, rec, call) -> tuple[Any, Any]:
        """The recording's first call (``Replayable.replay``'s result); the backend may decide
        here how later replays take their inputs."""

    def input_notes(self, rec) -> dict:
        """Per eager input copied or read in place: None (in place) or why it is copied."""

    def num_nodes(self, rec) -> int:
        """Graph nodes of ``rec`` (reports)."""

    def discard(self, rec) -> None:
        """Release a recording."""

    def snapshot(self) -> Any:
        """A checkpoint of the pool's bookkeeping."""

    def restore(self, snap, on_path: list, off_path: list) -> None:
        """Make the pool's bookkeeping ``snap``; the recordings ``on_path`` stay in use."""

    def renew(self) -> Any:
        """Start over on a fresh pool; returns its root checkpoint."""

    # what the backend handed out itself that a generation's end invalidates (the outputs of the
    # backward nodes it attaches): while this is not empty, every generation's end calls
    # ``end_generation``, else only one with outputs handed out
    autograd_views: Any

    def end_generation(self, handed: list, cloning: str | None) -> None:
        """Invalidate (or clone out) the outputs handed out that are still alive, ``[(function
        name, output)]``; those the backend cannot invalidate (CuPy arrays) it passes over, and
        with them those in ``autograd_views`` whose generation has ended. A generation with
        nothing handed out and no ``autograd_views`` ends without this call."""

    def with_backward(self, ticket, out, call) -> Any:
        """Outputs of a call made with grad enabled (``call`` is None when the call ran eagerly
        before it was classified): give those that require grad a backward that reports to
        ``ticket`` (``cgraw.trees.autograd``), or call ``ticket.never_needed()`` when none does."""

    def orphan(self, tickets: list) -> None:
        """The generation of these forwards ends while their graph is alive and their backward has
        not run: keep what an eager recompute needs (inputs in the tree's memory, when
        ``pool_inputs``), or set ``ticket.lost``. Called before ``end_generation`` poisons anything."""

    def close(self) -> None:
        """Drop the pool."""


class RecordingLock:
    """One thread at a time grows any graph tree of the process: warm-ups, recordings (with their
    first replay and checkpoint), re-recordings and dropping recordings. Replays take no lock.

    Why process-wide, when each thread has its own tree: a recording's first replay synchronises
    the device (``rebind.proof.prove``) and a warm-up runs the user's eager code, either of which
    invalidates a capture running on another thread; torch's cuBLAS workspaces are cleared for
    every thread before each recording (torch's own trees serialise the same paths).

    Re-entrant. A *guest* shares the holder's turn: autograd's device thread runs the backward of
    a tree whose owning thread waits in ``backward()``, perhaps while it holds the lock (a warm-up
    that runs a backward pass); ``acquire(host=owner)`` then lets it in.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.holder: int | None = None  # thread ident; guarded by _cond
        self._depth = 0  # acquisitions not yet released, guests' included; guarded by _cond
        self._guests: dict[int, int] = {}  # thread ident -> its acquisitions as a guest; guarded by _cond

    def acquire(self, *, host: int | None = None, blocking: bool = True) -> bool:
        """Take the lock (or enter as ``host``'s guest while ``host`` holds it). With ``blocking``
        False, return False instead of waiting for another thread."""
        me = threading.get_ident()
        with self._cond:
            while True:
                holder = self.holder
                if holder is None or holder == me:
                    self.holder = me
                    self._depth += 1
                    return True
                if me in self._guests or (host is not None and holder == host):
                    self._guests[me] = self._guests.get(me, 0) + 1
                    self._depth += 1
                    return True
                if not blocking:
                    return False
                self._cond.wait()

    def release(self) -> None:
        me = threading.get_ident()
        with self._cond:
            n = self._guests.get(me)
            if n is not None:
                if n == 1:
                    del self._guests[me]
                else:
                    self._guests[me] = n - 1
            elif self.holder != me:
                raise RuntimeError("cgraw: the recording lock is released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self.holder = None
                self._cond.notify_all()

    def __enter__(self) -> "RecordingLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_CONTAINERS = frozenset((tuple, list, dict))


def ids_among_args(args, wanted: set) -> set:
    """The ids in ``wanted`` of the arguments and of everything inside their tuples, lists and dicts.
    A graphed call's hot path (each root call with an output of the ending generation alive): one
    level at a time in C loops, so a compiled partition's hundred flat tensor arguments cost two
    passes, where collecting every argument's id costs a Python step each."""
    found: set = set()
    level = args
    while level:
        found.update(wanted.intersection(map(id, level)))
        if _CONTAINERS.isdisjoint(map(type, level)):
            break
        inner: list = []
        for x in level:
            t = type(x)
            if t is tuple or t is list:
                inner.extend(x)
            elif t is dict:
                inner.extend(x.values())
        level = inner
    return found
