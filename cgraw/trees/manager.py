"""Graph trees: the decisions of ``@cgraw.graphed`` (warm up, record, replay, re-record, skip).

Layer L6: pure bookkeeping, no CUDA, torch or CuPy: ``calls`` classifies each call's inputs (through
``arrays.Ops``), a *backend* does the work (``trees.nodes.Backend``; ``trees.cuda_backend.CudaBackend``).

Why a tree. Graphed functions share one memory pool per device. A CUDA graph bakes in every
address it touches, so a graph recorded after graph A must allocate around A's outputs, which are
still live when it runs. Calls of graphed functions in sequence therefore form *paths*: A then B,
or A then B'. Each distinct path is recorded once, as a chain of nodes from a root. B and B' are
siblings: they never run in the same pass, so B' may reuse B's memory. To record B' after A was
replayed, the pool's bookkeeping is restored to the checkpoint taken at the end of A's recording;
this is what keeps memory at max(A+B, A+B') rather than the sum.

Lifecycle of a node (one function on one path, one input signature):
- first call: WARMED. The function runs eagerly (lazy first-use work happens then).
- second call: RECORDED. The pool is restored to the parent's checkpoint, the function is
  captured, the graph replayed once for this call's result, and a checkpoint taken.
- later calls: replay. If a static input or a tree output moved, the node is re-recorded and its
  descendants are dropped.
- a function that cannot be captured is SKIPPED: it runs eagerly, its reason in ``cgraw.report()``
  (a capture torch.compile compiled inside: that call runs eagerly, the next warms up again).

Generations. A generation is one pass through the tree from a root. It begins at
``cgraw.mark_step_begin()``, or automatically when a *root function* (one that has begun a
generation before) is called while a path is under way: each call of the model's entry point
starts a new step (the inference rule). Outputs handed out in a generation are only valid until
the next one begins; then the backend poisons them (torch) or clones them
(``config.generation_cloning = "user_visible"``). Training: while a backward of the current
generation is pending (``cgraw.trees.autograd``, which also holds the design of autograd through
graphed functions), a root function's call does not begin one; it extends the path, so the
saved activations of the pending forwards are not overwritten.

A generation also ends when everything its path made is dead, as torch's trees end a path whose
outputs are all dead. Before a call would add or re-record a node (not before a replay), the tree
checks its weak references to the outputs of the path's calls (``trees.outputs.PathOutputs``): when
none is alive, none is the call's input and no autograd graph of the path's forwards is alive (a
pending backward's is), the call starts from a root, as if it were the first call of the process.
So ``f(x)``, then ``g(x)`` in a loop with its outputs dropped, records ``g`` at its second call.
While outputs stay alive, calls of a function that is not a root extend the path, up to
``config.path_repeat_limit``.

Threads. A tree belongs to the thread that made it, with its own generations, pool and capture
stream; trees grow under one process-wide ``RecordingLock``, replays take no lock. A backward is
a node of its forward's tree, run from autograd's thread (``TreeAutograd.call_backward``). A
graphed call inside another's warm-up or recording, or inside ``cgraw.capture()``, runs inline.
"""

from __future__ import annotations

import logging
import threading
import weakref

from cgraw.trees import nodes as tree_nodes
from cgraw.trees.autograd import BUSY, AutogradBook, TreeAutograd, promotion_note
from cgraw.trees.arrays import weaken_key
from cgraw.trees.calls import TREE, grad_enabled, guarded_tail, inspect
from cgraw.trees.growth import TreeGrowth
from cgraw.trees.input_plan import moved, unseen_eager
from cgraw.errors import CgrawError, SkipCall, TreeError
from cgraw.trees.outputs import PathOutputs, memory_in_use, take_reused, versions_of, written_since
from cgraw.trees.pool import UNKNOWN, TreePool
from cgraw.trees.nodes import Backend, FunctionStats, NodeState, Replayable, Rewarm, TreeNode, Warm
from cgraw.trees.config import config
from cgraw.trees.prepared import call_of, prepare, shares_memory

log = logging.getLogger("cgraw")
_ref = weakref.ref
RECORDED = NodeState.RECORDED
MISS = object()  # a call that does not match its prepared replay (``TreeManager._replay_prepared``)
PREPARE_LIMIT = 16  # a function's prepared replay made again this often for another node (no re-record between) stops

WRITES_KEPT = "it writes, in place, an output of the ending generation it gets as an input (h = f(h))"
SERIAL = tree_nodes.RecordingLock()  # the lock every tree grows under, unless it is given its own


class TreeManager(TreeAutograd, TreeGrowth, TreePool):
    """The tree of one thread on one device: roots, the current path, generations, the pool's
    checkpoints. Calls from another thread than the one that made it get a clear error (its
    captures and generations are that thread's). ``serial``: the lock the tree grows under.
    """

    def __init__(self, backend, *, device_index: int = 0, serial: tree_nodes.RecordingLock = SERIAL):
        self.backend = backend
        self.device_index = device_index
        self.serial = serial
        self.roots: dict = {}
        self.root_fns: set = set()
        self.current: TreeNode | None = None  # the node executed last in this generation
        self.generation = 0
        self.pool_state: TreeNode | None = None  # whose checkpoint the pool's bookkeeping equals
        self.root_checkpoint = backend.snapshot()
        self.tree_outputs: dict[int, TreeNode] = {}  # data pointer -> node, this generation
        self.outs = PathOutputs()  # what the calls of this generation made, held weakly
        self.stats: dict[int, FunctionStats] = {}
        self.owner_thread = threading.get_ident()
        self._keys_seen: dict[int, dict] = {}  # fn id -> {input signature: order first seen}
        self.book = AutogradBook()  # forwards whose backward may run (calls made with grad enabled)
        self.prepared: dict = {}  # fn id -> prepared.Prepared of its root node replayed last (cleared with recordings)

    # ------------------------------------------------------------------ generations

    def mark_step_begin(self) -> None:
        """End the current generation: outputs handed out so far become invalid."""
        self.check_thread("cgraw.mark_step_begin()")
        self._end_generation()

    def _end_generation(self, handed: list | None = None) -> None:
        """``handed``: the live outputs to invalidate, when the caller has taken them. Where nothing
        of the ending generation is alive (a root function called in a loop, its outputs dropped)
        this runs here alone: the book and the backend are called only when they have work."""
        if handed is None:
            handed = self._take_outputs()
        self.generation += 1
        book = self.book
        if book.tickets:
            self._orphan_pending()  # before the backend poisons what a recompute reads
        else:
            book.generation += 1  # what AutogradBook.end_generation does with no ticket to orphan
            book.last_backward = book.seq
        if book.held:
            book.held.clear()  # a generation begun anyway: the holding forwards' backwards read poisoned outputs
        backend = self.backend
        if handed or backend.autograd_views:
            backend.end_generation(handed, config.generation_cloning)
        self.tree_outputs = {}
        self.current = None

    def _take_outputs(self) -> list:
        """``[(function name, output)]`` of the outputs handed out in this generation that are alive
        now; the generation's ``PathOutputs`` forget everything. (A loop, no comprehension: every
        call of a root function ends a generation.)"""
        outs = self.outs
        live = []
        for name, r in outs.handed:
            t = r()
            if t is not None:
                live.append((name, t))
        outs.handed = []
        if outs.reused:
            take_reused(outs.reused, live)
            outs.reused = []
        if outs.watched:
            outs.watched = []
        if outs.memory:
            outs.memory = []
        return live

    def _path_is_dead(self, call) -> bool:
        """Whether nothing made on the path under way is in use: no output of its calls is alive
        (torch's ``all_outputs_are_dead``), none is this call's input, and no autograd graph of its
        forwards is alive (their outputs as autograd hands them out; a pending backward's saved
        activations are the path's memory too)."""
        if TREE in call.kinds or self.outs.alive() or self.book.graphs_alive():
            return False
        # a view or .detach() alias of an output outlives the output object: count its memory's users
        return not any(memory_in_use(getattr(n.recording, "users", ()))
                       for n in self.current.path() if n.recording is not None)

    def check_thread(self, what: str) -> None:
        """Raise a clear error when ``what`` is used from a thread that does not own this tree."""
        if threading.get_ident() != self.owner_thread:
            raise CgrawError(
                f"{what} called from a thread other than the one that owns this graph tree of device "
                f"{self.device_index}; each thread has its own trees: call graphed functions, "
                "cgraw.mark_step_begin() and cgraw.reset() as usual and they act on the calling thread's")

    # ------------------------------------------------------------------ the call

    def call(self, fn, args, kwargs):
        if threading.get_ident() != self.owner_thread:
            self.check_thread(f"graphed function {fn.name!r}")
        return self.call_here(fn, args, kwargs)

    def call_here(self, fn, args, kwargs):
        """``call`` unchecked (each thread gets its own trees); inline in this thread's warm-ups and captures."""
        if self.busy:
            return fn.fn(*args, **kwargs)
        p = self.prepared.get(fn.fn_id)
        if p is not None and p.usable and not kwargs:
            out = self._replay_prepared(p, fn, args)
            if out is not MISS:
                return out
        book = self.book
        if self.current is not None and fn.fn_id in self.root_fns and not (book.held or book.tickets and book.pending()):
            return self._call_in_new_step(fn, args, kwargs)  # the inference rule: a root function begins a step
        out = self._call(fn, args, kwargs)
        if fn.inputs_guarded and not kwargs:
            self._prepare(fn, args)
        return out

    def _replay_prepared(self, p, fn, args):
        """A call of ``fn`` that matches ``p`` (a ``prepared.Prepared`` of its root node): the generic
        path's new step and replay, without classifying the call. ``MISS``, nothing changed, where it
        does not match; where that shows only after the new step began (an input read in place moved), the
        generic path runs after it."""
        node, current = p.node, self.current
        if fn.unsafe_reason is not None or tuple(map(type, args)) != p.types or node.state is not RECORDED \
                or node.recording is not p.rec or node.plan is not p.plan or self.roots.get(p.slot) is not node \
                or getattr(fn, "static_positions", ()) is not p.static_positions or fn.fn_id not in self.root_fns:
            return MISS
        if current is None:
            if self.tree_outputs:
                return MISS
        elif self.book.held or self.book.tickets and self.book.pending():
            return MISS
        if guarded_tail(fn, args) != p.tail or args[0].get_device() != self.device_index:
            return MISS
        deferred = None if current is None else self._begin_step(args, True)  # (it may clone outputs out)
        writes = getattr(fn, "writes_inputs", False)
        kept = {id(t) for _, t in deferred} if deferred and writes else None
        versions = out = None  # (read only where the generic path runs: a replay writes no output it got)
        try:
            try:
                ptrs = list(map(p.data_ptr, args))
            except RuntimeError:  # no storage: the generic path says why
                ptrs = None
            at = p.fixed_at
            if ptrs is None or (at is not None and at(ptrs) != p.fixed_ptrs) or (writes and shares_memory(p, args, ptrs)) \
                    or (kept and node.warm is not None and any(id(args[j]) in kept for j in node.warm.mutated)):
                # an input read in place moved, inputs share memory, or it writes an output it gets:
                # the generic path decides, as after any new step
                versions = kept and versions_of(deferred)
                out = self._call(fn, args, {}, kept)
                return out
            call = call_of(p, args, ptrs)
            res = p.rec.replay(call)
            if type(res) is tuple:
                return self._replayed(fn, node, res, call)
            versions = kept and versions_of(deferred)
            out = self._call(fn, args, {}, kept)  # stale: launched nothing; the generic path warms up again
            return out
        finally:
            if deferred:
                self._end_kept(fn, args, deferred, versions, out)

    def _prepare(self, fn, args) -> None:
        """After a call of ``fn`` (a function whose caller guarantees its inputs) took the generic path:
        where it replayed or recorded a root node of ``fn``, prepare that node's later calls
        (``prepared.prepare``), once per node and recording, and no more than ``PREPARE_LIMIT`` times
        for calls that keep switching between its nodes (a re-recording starts the count again)."""
        node = self.current
        if node is None or node.fn is not fn or node.parent is not None or node.state is not RECORDED:
            return
        old = self.prepared.get(fn.fn_id)
        if old is None:
            self.prepared[fn.fn_id] = prepare(fn, node, args, self.device_index)
        elif old.node is not node or old.rec is not node.recording:
            if old.builds >= PREPARE_LIMIT:  # its calls keep switching nodes: the generic path serves them
                old.usable = False
                return
            p = self.prepared[fn.fn_id] = prepare(fn, node, args, self.device_index)
            p.builds = old.builds + 1

    def _call_in_new_step(self, fn, args, kwargs):
        """Begin a generation, then the call; ``_call`` runs it eagerly where it writes in place an output
        of the ending generation it gets (``kept``: their ids): its replay writes the new output there."""
        deferred = self._begin_step(args)
        versions = deferred and versions_of(deferred)  # (a first call learns only now whether it writes them)
        out = None
        try:
            kept = {id(t) for _, t in deferred} if deferred and getattr(fn, "writes_inputs", False) else None
            out = self._call(fn, args, kwargs, kept)
            if fn.inputs_guarded and not kwargs:
                self._prepare(fn, args)  # before the outputs it got are poisoned
            return out
        finally:
            if deferred:
                self._end_kept(fn, args, deferred, versions, out)

    def _end_kept(self, fn, args, kept: list, versions, out) -> None:
        """After the call that began a step, the ending generation's outputs that were its own
        arguments (``_begin_step``): those it wrote in place are state the caller goes on using (a
        static key-value cache one compiled function made and another writes at every step), so they
        are cloned out of the pool with the views of them its output ``out`` holds, as
        ``generation_cloning="user_visible"`` does; the others are poisoned (``outputs.written_since``)."""
        if versions and getattr(fn, "writes_inputs", False):
            # the inputs it declares it writes (Inductor's kernels write without moving versions)
            declared = {id(args[j]) for j in getattr(fn, "mutates", ()) if j < len(args)}
            written = written_since(kept, versions, declared, out)
        else:
            written = None
        if written:
            moving = set(map(id, (t for _, t in written)))
            kept = [item for item in kept if id(item[1]) not in moving]
            self.backend.end_generation(written, "user_visible")
        if kept:
            self.backend.end_generation(kept, None)

    def _begin_step(self, args, flat: bool = False) -> list:
        """Start a generation for a call of a root function. Outputs of the ending generation
        that are this call's own arguments (``h = f(h)``, ``h, c = f(h, c)``) stay readable until
        the call has copied them in (they are eager inputs now), and are poisoned after it.
        ``flat``: every argument is an array (nothing inside containers to look for)."""
        keep = []
        handed = self._take_outputs()
        if config.generation_cloning is None and handed:
            wanted = {id(t) for _, t in handed}
            ids = wanted.intersection(map(id, args)) if flat else tree_nodes.ids_among_args(args, wanted)
            if ids:
                keep = [item for item in handed if id(item[1]) in ids]
                handed = [item for item in handed if id(item[1]) not in ids]
        self._end_generation(handed)
        return keep

    def _call(self, fn, args, kwargs, kept=None):
        if fn.unsafe_reason is not None:
            return self._eager_call(fn, fn.unsafe_reason, args, kwargs)
        try:
            call = inspect(fn, args, kwargs, self.tree_outputs, self.device_index)
        except SkipCall as exc:
            return self._eager_call(fn, str(exc), args, kwargs)
        parent = self.current
        siblings = self.roots if parent is None else parent.children
        node = siblings.get((fn.fn_id, call.key))
        if kept and node is not None and node.warm and any(id(call.leaves[j]) in kept for j in node.warm.mutated):
            return self._eager_call(fn, WRITES_KEPT, args, kwargs)  # its copy back would overwrite the new output
        if node is not None and node.state is NodeState.RECORDED:  # the hot path: replay
            rec, plan = node.recording, node.plan
            reason = None
            at = plan.fixed_at  # the inputs read in place are where the recording read them
            if call.kinds != plan.kinds or (at is not None and at(call.ptrs) != plan.fixed_ptrs):
                reason = moved(plan, call, fn)
            res = rec.replay(call) if reason is None else None
            if type(res) is tuple:
                return self._replayed(fn, node, res, call)
            if res is not None:  # what the warm-up learned is out of date: nothing was launched
                reason = res
        elif node is not None and node.state is NodeState.SKIPPED:  # eager, without the lock
            out = self._eager_node(node, call, args, kwargs)
            return self._with_backward(fn, node, out, call) if call.grad else out
        else:
            reason = None
        if not self._enter_serial():
            return self._eager_call(fn, BUSY, args, kwargs)  # a backward: never wait (see call_backward)
        try:
            return self._grow(fn, call, parent, siblings, node, reason, args, kwargs)
        finally:
            self.serial.release()

    def _replayed(self, fn, node, res, call):
        """After a replay of ``node`` for ``call`` (``res``: the recording's outputs and the owned ones):
        the path moves on to it, its outputs are the generation's."""
        out, owned = res
        rec = node.recording
        node.stats.replays += 1
        self.current = node
        for ptr in rec.out_ptrs:
            self.tree_outputs[ptr] = node
        if owned and not getattr(fn, "copies_out", False):
            if rec.reuse is not None:  # objects handed out again: held ones are found at the generation's end
                self.outs.reused.append((fn.name, rec, owned))
            else:
                name, handed = fn.name, self.outs.handed
                for t in owned:  # a loop, no comprehension: one output is the common case
                    handed.append((name, _ref(t)))
        # a recording without a backward hands out outputs that need no ticket
        return self._with_backward(fn, node, out, call) if call.grad and rec.grad is not None else out

    def _grow(self, fn, call, parent, siblings, node, reason, args, kwargs):
        """A call that is neither a replay nor a skipped node's: a new node, a warm-up, a recording
        or a re-recording (``reason``). Under ``serial``."""
        self.drop_dead_keys()
        if parent is not None and not (getattr(fn, "copies_out", False) or getattr(fn, "continues_step", False)) \
                and self._path_is_dead(call):  # never a backward, nor a compiled graph's later piece (its frame
            # may hold the earlier pieces' outputs): every output of the path is dead, so end it (torch's trees
            # do) and this call starts from a root, as the process's first call would, re-records included
            self._end_generation()
            return self._call(fn, args, kwargs)
        if reason is not None:
            out = self._rerecord(node, fn, call, reason, args, kwargs)
        else:
            st = self._stats(fn)
            fresh = node is None
            if fresh:
                limit = config.path_repeat_limit
                if parent is not None and limit and parent.repeats(fn) >= limit:
                    return self._promote(fn, args, kwargs)
                node = TreeNode(fn, call.key, parent, st)
                node.refs = weaken_key(call.key)  # the node keeps alive nothing its key names
                siblings[(fn.fn_id, call.key)] = node
                if parent is None and not getattr(fn, "continues_step", False):  # (a later compiled piece)
                    self.root_fns.add(fn.fn_id)
                if self._new_variant(fn, st, call.key):
                    node.state = NodeState.SKIPPED
                    node.skip_reason = "dynamic shapes: more input signatures than config.dynamic_shape_warn_limit"
            if node.state is NodeState.SKIPPED:
                out = self._eager_node(node, call, args, kwargs)
            elif fresh or node.warm is None or unseen_eager(node.warm.kinds, call):
                # a warm-up that raised taught nothing, and one that read an input in place learned
                # nothing of what the function writes into it as a copied (eager) input: warm up again
                out = self._warm(node, fn, st, call, args, kwargs)
            else:
                out = self._record(node, fn, st, call, args, kwargs)
        return self._with_backward(fn, node, out, call) if call.grad else out

    def _eager_call(self, fn, reason: str, args, kwargs):
        out = self._eager(fn, self._stats(fn), reason, args, kwargs)
        return self._with_backward(fn, None, out, None) if grad_enabled() else out

    def _promote(self, fn, args, kwargs):
        """``fn`` keeps extending the path under way (``prefill(x)`` once, then ``decode(tok)`` in a
        loop: one node deeper per call, each warmed up, none replayed). Make it a root function:
        this call, and each later one, begins a generation, as the inference rule does."""
        log.warning("cgraw: %s was called %d times on one path of the graph tree (no root function "
                    "called in between); it now begins a generation at each call, like a root function. "
                    "Call cgraw.mark_step_begin() where your step begins, or raise "
                    "cgraw.config.path_repeat_limit for longer loops inside one step",
                    fn.name, config.path_repeat_limit)
        self.root_fns.add(fn.fn_id)
        self._stats(fn).promoted = True
        if self.book.held or self.book.tickets and self.book.pending():
            log.warning(promotion_note(fn.name, config.path_repeat_limit))
        return self._call_in_new_step(fn, args, kwargs)

    def _stats(self, fn) -> FunctionStats:
        return self.stats.get(fn.fn_id) or self.stats.setdefault(fn.fn_id, FunctionStats(fn.name))

    def reset(self) -> None:
        """End the generation, drop every node and recording; the backend frees the pool."""
        self.check_thread("cgraw.reset()")
        self.release(end_generation=True)

    def release(self, *, end_generation: bool = False) -> None:
        """Drop every node and recording; the backend frees the pool. From any thread, for the tree
        of a thread that has ended: outputs handed out stay valid while held, neither poisoned nor
        cloned (the thread may have passed them on); a pending backward recomputes its forward."""
        with self.serial:
            self._orphan_pending()
            handed = self._take_outputs()
            if end_generation:
                self.backend.end_generation(handed, config.generation_cloning)
            self._forget_recordings(self.nodes())
            self.roots.clear()
            self.root_fns.clear()
            self.current = None
            self.tree_outputs = {}
            self.pool_state = UNKNOWN
            self._keys_seen = {}
            self.backend.close()

    def describe(self) -> str:
        """A text view of the tree: which node follows which."""
        head = f"cgraw tree on device {self.device_index}: generation {self.generation}"
        return tree_nodes.describe_nodes(head, self.roots.values(), self.backend.num_nodes)


__all__ = ["SERIAL", "Backend", "FunctionStats", "NodeState", "Replayable", "Rewarm", "SkipCall", "TreeError",
           "TreeManager", "TreeNode", "Warm"]
