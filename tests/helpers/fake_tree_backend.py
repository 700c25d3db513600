"""A CPU stand-in for ``cgraw.trees.cuda_backend.CudaBackend``, driving ``cgraw.trees.manager.TreeManager`` in tests.

Device memory is simulated: a ``FakeT`` ("tensor") is an address range whose contents (a float64
numpy array) live in ``Memory``. Writing a range wipes every *other* range it overlaps, so a graph
that clobbers a live output is caught when that output is read (``Clobbered``).

Graphed test functions are plain Python over ``FakeT``; they allocate results with ``new(values)``
and may drop temporaries with ``release(t)`` and write inputs in place with ``assign(t, values)``.
What those do depends on the backend's mode:

- eager (warm-up, ``TreeManager._eager``, reference runs): a fresh address outside the pool;
- warm (a warm-up of a backend made with ``warm_in_pool=True``, as the CUDA backend's
  ``cgraw.trees.warmup``): a block of the tree's pool, computed at once; ``release`` frees it. The
  warm-up hands out its outputs there and reports blocks held beyond them (``warm_stash``: names
  of functions that keep one) as ``Warm.stash``;
- capture (``record``): a block of the tree's ``allocator.Pool``; nothing is computed (outputs
  hold NaN, as a captured graph has not run yet); ``release`` frees the block;
- replay: the n-th allocation of the capture returns the same address and the value is computed
  from the current inputs, which is what a replayed graph does.

Like the CUDA backend, ``record`` copies eager inputs into pool placeholders, reads static and
tree-output inputs in place and copies mutated eager inputs back after a replay. Each replay
hands out new ``FakeT`` objects and the fake keeps none of them (nor a warm-up's outputs): an
output dies when the caller drops it, as a torch tensor does, so the tree's weak references see
what a test keeps (``TreeManager._path_is_dead``). Calls are classified by the real
``cgraw.trees.calls`` (``FakeT`` is registered as an array type with ``arrays.register``);
``spy_inspect`` wraps it to log and to inject skips.

Threads: ``new()``, ``release()``, ``assign()``, ``save()`` and the inspect spy talk to the backend
warming up, capturing or replaying on the calling thread, else to the one made last on that
thread, else to the one made last (``_ACTIVE``); an allocation that no backend of the thread
makes is eager. So trees of several threads, each on its own backend, run side by side.

Autograd (``cgraw.trees.autograd``), simulated: ``GRAD`` is the grad mode (install its probe with
``calls.use_grad_mode(GRAD.probe)``; ``GRAD.off()`` is ``torch.no_grad()``). A ``FakeFn`` made
with ``backward`` (the gradient of its first input, from the grad and the inputs) and
``backward_saved`` (the same from the grad and what the function ``save()``d) trains: after a
call made with grad enabled whose inputs require grad (or whose ``params_require_grad``), its
outputs require grad and carry the call's ticket. ``FakeTreeBackend.backward(out, grad)`` is
what ``loss.backward()`` does for that one call: it asks the tree for the plan and runs the
backward through the tree (reading the saved tensors of the forward's capture in place, as a
captured backward does), eagerly from the inputs, or from the copies ``orphan`` kept.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

import numpy as np

from allocator import IntRangeSource, Pool
from cgraw.trees import arrays, calls
from cgraw.trees.arrays import EAGER, replace_leaves
from cgraw.trees.autograd import BackwardPlan
from cgraw.errors import CgrawError, SkipCall
from cgraw.trees.manager import Warm

EAGER_BASE = 1 << 56  # eager addresses: far above anything the pool's IntRangeSource hands out
_ACTIVE: list = []  # the backend created last (new() and the others talk to it when the thread has none)
_HERE = threading.local()  # .busy: the backend not in eager mode on this thread; .home: the one made last here
_EAGER_LOCK = threading.Lock()  # eager address ranges are handed out to several threads


class Clobbered(AssertionError):
    """A read of memory that something else has overwritten (or that was never written)."""


class Memory:
    """Simulated device memory: ``ptr -> (nbytes, contents)``, pool and eager ranges apart."""

    def __init__(self) -> None:
        self.pool_cells: dict[int, tuple[int, np.ndarray]] = {}
        self.eager_cells: dict[int, tuple[int, np.ndarray]] = {}
        self._dead: list[int] = []  # eager ranges whose tensor died (finalizers run at any time)

    def _cells(self, ptr: int) -> dict:
        while self._dead:
            self.eager_cells.pop(self._dead.pop(), None)
        return self.eager_cells if ptr >= EAGER_BASE else self.pool_cells

    def write(self, ptr: int, nbytes: int, value: np.ndarray) -> None:
        value = np.asarray(value, dtype=np.float64)
        assert value.nbytes == nbytes, f"writing {value.nbytes} bytes into a {nbytes}-byte range"
        cells = self._cells(ptr)
        end = ptr + nbytes
        for q, (n, _) in list(cells.items()):
            if q != ptr and q < end and ptr < q + n:
                del cells[q]  # overwritten (partly): its old contents are gone
        cells[ptr] = (nbytes, value.copy())

    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        cell = self._cells(ptr).get(ptr)
        if cell is None or cell[0] != nbytes:
            raise Clobbered(f"memory 0x{ptr:x}+{nbytes} was overwritten by another range")
        return cell[1].copy()

    def drop(self, ptr: int) -> None:
        """Forget an eager range (called by a finalizer: only queues it, never mutates cells)."""
        self._dead.append(ptr)


class Overwritten(RuntimeError):
    """Reading an output handed out in an ended generation (what the torch backend's poisoning does)."""


class FakeT:
    """A device "tensor": ``nbytes`` float64 bytes at ``ptr``; ``.value`` reads them."""

    __slots__ = ("__weakref__", "mem", "nbytes", "poisoned", "ptr", "requires_grad", "ticket")

    def __init__(self, ptr: int, nbytes: int, mem: Memory):
        self.ptr, self.nbytes, self.mem = ptr, nbytes, mem
        self.poisoned: str | None = None
        self.requires_grad = False
        self.ticket = None  # the ticket of the graphed call that made it, when it requires grad

    @property
    def n(self) -> int:
        return self.nbytes // 8

    @property
    def value(self) -> np.ndarray:
        if self.poisoned is not None:
            raise Overwritten(f"accessing an output of graphed function {self.poisoned!r} from an "
                              "ended generation")
        return self.mem.read(self.ptr, self.nbytes)

    def __repr__(self) -> str:
        return f"FakeT(0x{self.ptr:x}, {self.nbytes})"


class FakeFn:
    """Stands in for ``cgraw.trees.graphed.GraphedFunction``; calling it goes through ``mgr``."""

    _ids = itertools.count(1)
    by_id: dict = {}  # fn_id -> FakeFn (what a ticket's fn_id names)

    def __init__(self, fn, mgr=None, *, name=None, static_argnums=(), mutates=(), unsafe_reason=None,
                 backward=None, backward_saved=None, params_require_grad=False):
        self.fn = fn
        self.mgr = mgr
        self.name = name or fn.__name__
        self.fn_id = next(self._ids)
        FakeFn.by_id[self.fn_id] = self
        self.backward = backward  # (grad, *inputs) -> grad of input 0, run eagerly
        self.backward_saved = backward_saved  # (grad, *saved) -> the same, from the saved tensors
        self.params_require_grad = params_require_grad
        self.static_argnums = frozenset(static_argnums)
        self.mutates = tuple(mutates)
        self.unsafe_reason = unsafe_reason
        self.pad_buckets = ()
        self.plain = not self.static_argnums
        self.inputs_guarded = False

    def __call__(self, *args, **kwargs):
        return self.mgr.call(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<FakeFn {self.name}>"


class FakeRecording:
    """One captured node: placeholders, the capture's allocations, what stays live, the outputs."""

    _ids = itertools.count(1)
    grad = None  # the fake backend records no backward
    reuse = None  # nor hands out its output objects again (trees.outputs.Reuse)

    def __init__(self, fn, call, mutated: tuple):
        self.id = next(self._ids)
        self.fn = fn
        self.name = fn.name
        self.mutated = tuple(j for j in mutated if call.kinds[j] == EAGER)
        self.placeholders: dict[int, tuple[int, int]] = {}  # leaf index -> (ptr, nbytes)
        self.allocs: list[tuple[int, int]] = []  # (ptr, nbytes) in capture order
        self.live: dict[int, int] = {}  # ptr -> block size, blocks held after the capture
        self.fixed: list[tuple[int, int]] = []
        self.kinds: tuple = tuple(call.kinds)
        self.out_ptrs: list[int] = []
        self.saved: list = []  # what the capture save()d (pool addresses every replay rewrites)
        self.discarded = False
        self.replays = 0
        self.capture_ms = 0.5
        self.instantiate_ms = 0.25

    def __repr__(self) -> str:
        return f"<FakeRecording #{self.id} {self.name}{' discarded' if self.discarded else ''}>"

    # the tree's hot path calls a recording directly (trees.nodes.Replayable): here, its backend
    def replay(self, call, first=False):
        why = None if first else self.stale()
        return self.backend.replay(self, call) if why is None else why

    def stale(self):
        return self.backend.stale(self)


def leaves_of(obj) -> list:
    """``FakeT`` leaves of a (nested tuple/list/dict) structure, in order."""
    if isinstance(obj, FakeT):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in leaves_of(x)]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in leaves_of(obj[k])]
    return []


def _map_leaves(obj, fn):
    """``obj`` with each ``FakeT`` leaf replaced by ``fn(leaf)``."""
    if isinstance(obj, FakeT):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_leaves(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_leaves(v, fn) for k, v in obj.items()}
    return obj


class FakeTreeBackend:
    """The ``nodes.Backend`` protocol over ``allocator.Pool(IntRangeSource())``. As with the CUDA
    backend, a capture that fails (a ``SkipCall`` or the user's exception) puts the pool back as
    it was before.

    Hooks for tests, by function name: ``inspect_skip`` (reason: classifying the call raises
    ``SkipCall``, through ``spy_inspect``), ``record_skip`` (reason: the capture fails),
    ``record_skip_dirty`` (reason: the recording fails after its capture, leaving its blocks in
    the pool: ``SkipCall`` with ``dirty=True``), ``force_moved`` (a re-record reason from
    ``stale``, once). ``log`` lists every protocol call in order (``inspect`` through the spy).
    """

    autograd_views = ()  # it attaches no backward of its own

    def __init__(self, *, warm_in_pool: bool = False, **pool_kwargs) -> None:
        self.warm_in_pool = warm_in_pool
        self.warm_stash: set = set()  # hook: these functions' warm-ups keep a pool block beyond their outputs
        self.kept: list = []  # what those keep (as an optimizer keeps its state)
        self._warm_blocks: dict = {}  # blocks of the warm-up under way: ptr -> weakref to its FakeT
        self._pools = 0
        self.source = IntRangeSource()
        self.pool = Pool(self.source, name="fake-tree", **pool_kwargs)
        self.mem = Memory()
        self._mode = "eager"
        self._cursor: list = []  # replay: the recording's allocations still to hand out
        self._capture: FakeRecording | None = None
        self._eager_next = EAGER_BASE
        self.log: list[tuple] = []
        self.recordings: list[FakeRecording] = []
        self.inspect_skip: dict[str, str] = {}
        self.record_skip: dict[str, str] = {}
        self.record_skip_dirty: dict[str, str] = {}
        self.force_moved: dict[str, str] = {}
        self.inspected: list[tuple[str, dict]] = []  # (fn name, copy of tree_outputs) per inspect
        self.generations: list[tuple[list, object]] = []  # (handed, cloning) per end_generation
        self.restores: list[tuple] = []  # (snap, on_path, off_path)
        self.discards: list[FakeRecording] = []
        self.closed = 0
        self.max_source_reserved = 0
        self.mgr = None  # the TreeManager, for backward()
        self.tickets: list = []  # every ticket handed to with_backward
        self.orphaned: list = []  # every ticket handed to orphan
        self.lose_orphans: str | None = None  # hook: orphan() cannot keep inputs (sets ticket.lost)
        self._bfns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward node -> its backward FakeFn
        _ACTIVE.append(self)
        del _ACTIVE[:-1]
        _HERE.home = self

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        """Eager, warm, capture or replay; a backend in any mode but eager is its thread's busy one."""
        self._mode = value
        _HERE.busy = None if value == "eager" else self

    # ------------------------------------------------------------------ allocation for test code

    def new(self, value, mode: str | None = None) -> FakeT:
        value = np.asarray(value, dtype=np.float64).ravel()
        nbytes = value.nbytes
        mode = mode or self.mode
        if mode == "eager":
            ptr = self._eager_range(nbytes)
            t = FakeT(ptr, nbytes, self.mem)
            self.mem.write(ptr, nbytes, value)
            weakref.finalize(t, self.mem.drop, ptr)
            return t
        if mode == "capture":
            block = self.pool.malloc(nbytes)
            rec = self._capture
            rec.allocs.append((block.ptr, nbytes))
            rec.live[block.ptr] = block.size
            self.mem.write(block.ptr, nbytes, np.full(value.shape, np.nan))  # nothing ran yet
            return FakeT(block.ptr, nbytes, self.mem)
        if mode == "warm":
            block = self.pool.malloc(nbytes)
            self.mem.write(block.ptr, nbytes, value)
            t = FakeT(block.ptr, nbytes, self.mem)
            self._warm_blocks[block.ptr] = weakref.ref(t)
            return t
        assert mode == "replay"
        ptr, n = self._cursor.pop(0)
        assert n == nbytes, f"replay allocates {nbytes} bytes where the capture allocated {n}"
        self.mem.write(ptr, nbytes, value)
        return FakeT(ptr, nbytes, self.mem)

    def _eager_range(self, nbytes: int) -> int:
        """A fresh eager address (never reused, with a gap: eager ranges never touch)."""
        with _EAGER_LOCK:
            ptr = self._eager_next
            self._eager_next += -(-nbytes // 512) * 512 + 512
        return ptr

    def release(self, t: FakeT) -> None:
        if self.mode == "warm" and t.ptr in self._warm_blocks:
            del self._warm_blocks[t.ptr]
            self.pool.free(t.ptr)
        if self.mode == "capture" and t.ptr in self._capture.live and t.ptr in dict(self._capture.allocs):
            del self._capture.live[t.ptr]
            self.pool.free(t.ptr)

    def assign(self, t: FakeT, value) -> None:
        if self.mode == "capture":
            return  # a capture runs nothing
        self.mem.write(t.ptr, t.nbytes, np.asarray(value, dtype=np.float64).ravel())

    def tensor(self, values, *, requires_grad: bool = False) -> FakeT:
        """An eager input tensor holding ``values`` (from any thread)."""
        t = self.new(values, mode="eager")
        t.requires_grad = requires_grad
        return t

    def save(self, t: FakeT) -> None:
        if self.mode == "capture":
            self._capture.saved.append(t)

    # ------------------------------------------------------------------ the protocol

    def snapshot(self):
        self.log.append(("snapshot",))
        return self.pool.snapshot()

    def restore(self, snap, on_path: list, off_path: list) -> None:
        self.log.append(("restore", snap))
        self.restores.append((snap, list(on_path), list(off_path)))
        live = dict(snap.live)
        for rec in on_path:  # what stays in use must be live in the checkpoint
            assert not rec.discarded, f"{rec} is on the path but was discarded"
            for ptr, size in rec.live.items():
                assert live.get(ptr) == size, f"{rec}: block 0x{ptr:x} not live in the checkpoint"
        assert not set(map(id, on_path)) & set(map(id, off_path))
        self.pool.restore(snap)

    def _warms_in_pool(self, fn) -> bool:
        return self.warm_in_pool and not getattr(fn, "copies_out", False)

    def warm_restores(self, fn, call) -> bool:
        return self._warms_in_pool(fn) and not any(
            k == EAGER and self.pool.owns(p) for k, p in zip(call.kinds, call.ptrs, strict=True))

    def warmup(self, fn, call, args, kwargs):
        self.log.append(("warmup", fn.name))
        before = [(j, t.value) for j, t in enumerate(call.leaves) if call.kinds[j] == EAGER]
        assert self.mode == "eager"
        in_pool = self._warms_in_pool(fn)
        self.mode, self._warm_blocks = ("warm" if in_pool else "eager"), {}
        try:
            out = fn.fn(*args, **kwargs)
            if in_pool and fn.name in self.warm_stash:
                self.kept.append(self.new(np.ones(2)))
        finally:
            self.mode = "eager"
        w = Warm(out, tuple(j for j, v in before if not np.array_equal(v, call.leaves[j].value)))
        blocks, self._warm_blocks = self._warm_blocks, {}
        left = set()
        for ptr, ref in blocks.items():  # a temporary that died gave its block back, as torch's do
            if ref() is None:
                self.pool.free(ptr)
            else:
                left.add(ptr)
        if left:
            w.in_pool = True
            outs = [t for t in leaves_of(out) if t.ptr in left]
            if left - {t.ptr for t in outs}:
                w.stash = "kept a block of the pool beyond its outputs"
                self.warm_in_pool = False
            else:
                w.handed = outs
        return w

    def _run(self, rec: FakeRecording, call):
        """Run the function as the graph does: eager leaves read from their placeholders, static
        and tree-output leaves from the addresses baked in at capture (``rec.fixed``, set once
        the capture is done), whatever the call passes now."""
        subs = {j: FakeT(p, n, self.mem) for j, (p, n) in rec.placeholders.items()}
        subs.update((j, FakeT(p, call.leaves[j].nbytes, self.mem)) for j, p in rec.fixed)
        new_args, new_kwargs = replace_leaves(call.arg_specs, call.kwarg_specs, call.leaves, subs)
        return rec.fn.fn(*new_args, **new_kwargs)

    def first_replay(self, rec: FakeRecording, call):
        return rec.replay(call, first=True)

    def input_notes(self, rec: FakeRecording) -> dict:
        return {}

    def record(self, fn, call, warm: Warm) -> FakeRecording:
        self.log.append(("record", fn.name))
        rec = FakeRecording(fn, call, warm.mutated)
        rec.backend = self
        if call.grad and (fn.params_require_grad or any(t.requires_grad for t in call.leaves)):
            rec.grad = "backward through the replays"  # as grad_info: its outputs require grad
        for j, t in enumerate(call.leaves):  # an eager input in the pool (a warm-up's output, h = f(h))
            if call.kinds[j] == EAGER and t.ptr < EAGER_BASE:  # may lie in blocks the restore freed: copy it out
                clone = self.tensor(t.value)
                call.leaves[j], call.ptrs[j] = clone, clone.ptr
        before = self.pool.snapshot()
        try:  # the capture
            for j, t in enumerate(call.leaves):
                if call.kinds[j] == EAGER:
                    block = self.pool.malloc(t.nbytes)
                    rec.placeholders[j] = (block.ptr, t.nbytes)
                    rec.live[block.ptr] = block.size
                    self.mem.write(block.ptr, t.nbytes, np.full(t.nbytes // 8, np.nan))
            self.mode, self._capture = "capture", rec
            try:
                out = self._run(rec, call)
            finally:
                self.mode, self._capture = "eager", None
            if fn.name in self.record_skip:
                raise SkipCall(self.record_skip[fn.name])
        except BaseException:
            self.pool.restore(before)  # a failed capture gives its blocks back
            raise
        if fn.name in self.record_skip_dirty:  # failed after the capture: blocks left behind
            raise SkipCall(self.record_skip_dirty[fn.name], dirty=True)
        rec.fixed = [(j, call.ptrs[j]) for j in range(len(call.leaves)) if call.kinds[j] != EAGER]
        allocated = {p for p, _ in rec.allocs}
        # only memory the capture allocated is the tree's (owned): an output that is an input is
        # rebuilt from the caller's input on every replay, as the CUDA backend does
        rec.out_ptrs = [t.ptr for t in leaves_of(out) if t.ptr in allocated]
        self.recordings.append(rec)
        return rec

    def replay(self, rec: FakeRecording, call):
        self.log.append(("replay", rec.name))
        assert not rec.discarded, f"replay of discarded {rec}"
        for j, (p, n) in rec.placeholders.items():  # the graph's copy-in nodes
            self.mem.write(p, n, call.leaves[j].value)
        self.mode, self._cursor = "replay", list(rec.allocs)
        try:
            out = self._run(rec, call)
            assert not self._cursor, f"replay of {rec} allocated less than its capture"
        finally:
            self.mode, self._cursor = "eager", []
        for j in rec.mutated:  # the graph's copy-back nodes
            p, n = rec.placeholders[j]
            self.mem.write(call.ptrs[j], n, self.mem.read(p, n))
        rec.replays += 1
        self.max_source_reserved = max(self.max_source_reserved, self.source.reserved_bytes)
        inputs = {p: j for j, (p, _) in rec.placeholders.items()}
        inputs.update((p, j) for j, p in rec.fixed)
        owned_ptrs = set(rec.out_ptrs)
        out = _map_leaves(out, lambda t: call.leaves[inputs[t.ptr]] if t.ptr in inputs else t)
        return out, [t for t in leaves_of(out) if t.ptr in owned_ptrs]

    def stale(self, rec: FakeRecording):
        """The backend's part of a replay check (the CUDA one's closure tensors): only the
        ``force_moved`` hook here; inputs are checked by ``cgraw.trees.input_plan.moved``."""
        self.log.append(("moved", rec.name))
        return self.force_moved.pop(rec.name, None)

    def renew(self):
        """A fresh pool; the old one is left as it is (the CUDA backend's fallback)."""
        self.log.append(("renew",))
        self._pools += 1  # the old pool's blocks stay valid: the new one's addresses never meet them
        self.source = IntRangeSource(base=(1 << 32) + self._pools * (1 << 44))
        self.pool = Pool(self.source, name="fake-tree")
        return self.snapshot()

    def output_ptrs(self, rec: FakeRecording):
        return list(rec.out_ptrs)

    def num_nodes(self, rec: FakeRecording) -> int:
        return len(rec.placeholders) + len(rec.allocs) + len(rec.mutated) + 1

    def random_draws(self, rec: FakeRecording) -> int:
        return 0

    def discard(self, rec: FakeRecording) -> None:
        self.log.append(("discard", rec.name))
        assert not rec.discarded, f"{rec} discarded twice"
        rec.discarded = True
        self.discards.append(rec)

    def end_generation(self, handed: list, cloning) -> None:
        """Like the torch backend: each handed-out tensor still alive is poisoned, or moved to a
        private copy with ``cloning="user_visible"``."""
        self.log.append(("end_generation", len(handed)))
        self.generations.append((list(handed), cloning))
        for name, t in handed:
            if cloning == "user_visible":
                value = t.value
                t.ptr = self._eager_range(t.nbytes)
                self.mem.write(t.ptr, t.nbytes, value)
                weakref.finalize(t, self.mem.drop, t.ptr)
            else:
                t.poisoned = name

    def close(self) -> None:
        self.log.append(("close",))
        self.closed += 1
        self.pool.close()

    # ------------------------------------------------------------------ autograd

    def with_backward(self, ticket, out, call):
        self.log.append(("with_backward", ticket.name))
        self.tickets.append(ticket)
        fn = FakeFn.by_id[ticket.fn_id]
        leaves = [] if call is None else list(call.leaves)
        if not (fn.params_require_grad or any(t.requires_grad for t in leaves)):
            ticket.never_needed()
            return out
        ticket.data = {"fn": fn, "inputs": leaves if call is not None else None}
        for t in leaves_of(out):
            t.requires_grad, t.ticket = True, ticket
        return out

    def orphan(self, tickets: list) -> None:
        """Keep eager copies of the inputs that live in the pool (a recompute reads them later)."""
        self.log.append(("orphan", len(tickets)))
        self.orphaned.extend(tickets)
        for t in tickets:
            if t.data is None or not t.pool_inputs:
                continue
            if self.lose_orphans is not None or t.data["inputs"] is None:
                t.lost = self.lose_orphans or "the inputs of a call run before it was classified are unknown"
                continue
            t.data["kept"] = [x if x.ptr >= EAGER_BASE else self.tensor(x.value) for x in t.data["inputs"]]

    def backward(self, out: FakeT, grad, *, create_graph: bool = False) -> FakeT:
        """``loss.backward()`` for the graphed call that made ``out``: the gradient of its first input."""
        ticket = out.ticket
        assert ticket is not None, f"{out} does not require grad"
        kind, reason = self.mgr.backward_plan(ticket, grad_enabled=create_graph)
        self.log.append(("backward", ticket.name, kind.value))
        g = grad if isinstance(grad, FakeT) else self.tensor(grad)
        fn = ticket.data["fn"]
        if kind is BackwardPlan.ERROR:
            raise CgrawError(f"backward of {ticket.name}: {reason}")
        if kind is BackwardPlan.TREE:
            with GRAD.off():  # autograd runs a backward with grad mode off
                res = self.mgr.call_backward(self._backward_fn(ticket), (g,))
        else:  # EAGER, RECOMPUTE: from the inputs (the copies orphan kept, where it kept some)
            res = fn.backward(g, *(ticket.data.get("kept") or ticket.data["inputs"]))
        ticket.backward_ran()
        return res

    def _backward_fn(self, ticket) -> "FakeFn":
        """The backward of the ticket's forward node: reads what the node's current recording saved."""
        node = ticket.node
        bfn = self._bfns.get(node)
        if bfn is None:
            fwd, ref = ticket.data["fn"], weakref.ref(node)

            def backward_of(g):
                return fwd.backward_saved(g, *ref().recording.saved)

            bfn = self._bfns[node] = FakeFn(backward_of, self.mgr, name=f"{fwd.name}.backward")
        return bfn

    # ------------------------------------------------------------------ queries for tests

    def count(self, what: str, name: str | None = None) -> int:
        return sum(1 for e in self.log if e[0] == what and (name is None or e[1] == name))


def _busy():
    return getattr(_HERE, "busy", None)


def _backend():
    """The backend test code on this thread talks to (the module docstring says which)."""
    return _busy() or getattr(_HERE, "home", None) or _ACTIVE[-1]


def new(value) -> FakeT:
    """Allocate a result holding ``value`` (use inside graphed test functions)."""
    be = _busy()
    return be.new(value) if be is not None else _backend().new(value, mode="eager")


def release(t: FakeT) -> None:
    """Drop a temporary (inside graphed test functions)."""
    be = _busy()
    if be is not None:
        be.release(t)


def assign(t: FakeT, value) -> None:
    """Write ``value`` into ``t`` in place (inside graphed test functions)."""
    be = _busy()
    if be is not None:
        be.assign(t, value)
    else:
        t.mem.write(t.ptr, t.nbytes, np.asarray(value, dtype=np.float64).ravel())


def save(t: FakeT) -> None:
    """Save ``t`` for the backward (inside graphed test functions; a capture keeps it)."""
    be = _busy()
    if be is not None:
        be.save(t)


class FakeGradMode:
    """The grad mode of the fake autograd: ``probe`` for ``calls.use_grad_mode``, ``off()`` as
    ``torch.no_grad()``."""

    def __init__(self) -> None:
        self.enabled = True

    def probe(self) -> bool:
        return self.enabled

    @contextlib.contextmanager
    def off(self):
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before


GRAD = FakeGradMode()


class _FakeOps(arrays.Ops):
    """``FakeT`` as an array type of ``cgraw.trees.arrays``: what ``cgraw.trees.calls`` reads of a leaf."""

    __slots__ = ()
    name = "fake"

    def key(self, t):
        return ((t.n,), (1,), "f8")

    def ptr(self, t) -> int:
        return t.ptr

    def nbytes(self, t) -> int:
        return t.nbytes

    def device(self, t) -> int:
        return 0


arrays.register(FakeT, _FakeOps())
_real_inspect = calls.inspect


def spy_inspect(fn, args, kwargs, tree_outputs, device):
    """``cgraw.trees.calls.inspect`` as the tree calls it, logged to the active fake backend, with its
    ``inspect_skip`` hook. Tests install it: ``monkeypatch.setattr(cgraw.trees.manager, "inspect", spy_inspect)``."""
    be = _backend() if _ACTIVE else None
    if be is not None:
        be.log.append(("inspect", fn.name))
        be.inspected.append((fn.name, dict(tree_outputs)))
        if fn.name in be.inspect_skip:
            raise SkipCall(be.inspect_skip[fn.name])
    return _real_inspect(fn, args, kwargs, tree_outputs, device)
