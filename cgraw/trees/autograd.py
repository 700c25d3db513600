"""Autograd through graphed functions: the design, and its pure bookkeeping.

Layer L6: pure Python; no torch at module level, no CUDA. Here and in ``manager``: the
pending-backward bookkeeping (``AutogradBook``, ``BackwardTicket``), the generation rule that
uses it (``TreeManager.call``), the choice of how one backward runs (``plan_backward``), the
backward as a node of the path (``TreeManager.call_backward``) and grad mode in the key
(``calls.use_grad_mode``). All of it is driven by backend-neutral events and tested on the CPU
with a fake backend. The torch side (section 8) is ``interop.torch.autograd`` and the grad parts
of ``cuda_backend.CudaBackend.record``, on while ``cgraw.config.autograd`` is True (the default; False:
no grad-mode probe, and outputs are detached from the second call on). The GPU tier runs it on the
H200 (``tests/gpu/test_autograd.py``).

1. Outputs that require grad. A call made with grad enabled whose tensor inputs, or closure
   tensors (parameters found at warm-up), require grad returns outputs that require grad. The
   torch backend applies a ``torch.autograd.Function`` after the tree has run the call: its
   inputs are the call's leaves and the closure tensors that require grad (so autograd's own
   AccumulateGrad writes ``.grad`` of parameters and inputs, accumulating as eager does); its
   forward hands back the outputs the replay (or warm-up) made; its backward asks
   ``TreeManager.backward_plan`` and runs the chosen plan. Integer and bool outputs are marked
   non-differentiable; outputs that are inputs or views of inputs follow autograd's rules for
   returned inputs (``mark_dirty`` for the ones the function writes).

2. Backward recordings belong to the tree. A forward recording is captured with grad enabled, so
   the capture leaves an autograd graph whose saved tensors sit at fixed addresses in the pool;
   each replay of the forward rewrites them. The backward of forward node N is a graphed
   function of its own (one per forward node, ``TreeManager.call_backward``): it runs
   ``torch.autograd.grad`` (``retain_graph=True``: the graph serves every later replay) on that
   capture-time graph, with the incoming gradients as its arguments (a gradient made by an
   earlier backward node is a tree output, read in place). It is called as the next node of the
   path, so ``g1 -> g2 -> backward(g2) -> backward(g1)``: the first backward after N's recording
   warms it up (eager, lazy first-use work outside any capture), the next records it after the
   parent's checkpoint, later ones replay. Because the backward node is a descendant of N,
   re-recording N drops it with the rest of N's subtree. Its outputs (the gradients) are tree
   outputs of the generation; autograd must copy them into ``.grad`` rather than steal them
   (the recording holds them, so AccumulateGrad cannot). Saved activations stay allocated
   until the generation ends (eager frees them as its backward goes), so peak memory can
   exceed eager's.

3. Saved activations stay valid. Within a generation each node runs once, so the saved tensors
   of every forward on the path are distinct memory that no later node of the path reuses (the
   tree records a child after its parent's checkpoint). The forward replayed twice before one
   backward (``a = f(x1); b = f(x2)``) is two nodes, ``f -> f``, with two sets of activations,
   because the second call does not begin a generation (4). A generation that ends while a
   backward can still run orphans its tickets (``AutogradBook.end_generation``): before
   anything is poisoned the backend keeps what a recompute needs for those whose backward has
   not run (``Backend.orphan``), and such a backward recomputes its forward eagerly from its
   inputs, with a logged reason (5).

4. The generation rule, beside ``cgraw.mark_step_begin()``. A call of a root function begins a
   new generation only when no backward of the current generation is pending. A ticket (one
   forward call made with grad enabled whose outputs require grad) is pending while its backward
   has not run, its autograd graph is alive, no backward of this generation ran after it (torch's
   trees wait for one backward, not all: ``mod2(mod1(x)).sum().backward()`` where one forward's
   backward never runs must not hold the step open), and its function trains: a backward of one
   of its forwards ran, and none of its graphs was freed unused since. So evaluation with grad
   enabled (outputs dropped without a backward) keeps the inference rule, deepening the path at
   most once; the first training step of a function, before any backward, may orphan a
   forward (5 keeps it correct). ``mark_step_begin()`` always begins a generation, pending or
   not: call it where a step begins, not between forward and backward. A forward whose backward
   runs outside cgraw's autograd but reads its outputs (a ``torch.compile(backend="cgraw")``
   training graph: AOT autograd's backward takes the forward pieces' outputs as its saved
   activations) holds the generation open from its first call until a backward runs
   (``TreeAutograd.hold_step``), as torch's trees do for a forward of a training graph.
   ``config.path_repeat_limit`` still bounds a path that a pending backward keeps deepening:
   past it the function begins a generation anyway, orphaning, with a warning (BPTT longer than
   the limit: raise it; sampling with grad enabled: use ``torch.no_grad()``).

5. What runs eagerly, and why (``plan_backward``, logged once per reason on the function).
   EAGER: the forward ran eagerly (warm-up, skipped, unsafe); its own autograd graph runs, in
   ordinary memory (``create_graph=True`` included). RECOMPUTE: the forward was replayed but
   its generation ended (orphaned), its recording was replaced, or the backward is
   differentiable (``create_graph=True``, double backward: grad mode is on inside the backward);
   the forward runs again eagerly from its saved inputs under the random-number state it used
   (as torch.utils.checkpoint does) and autograd differentiates it. ERROR: what a recompute
   needs is gone (``ticket.lost``, or a second ``retain_graph`` backward after the generation
   ended of a forward that read the tree's memory); the message names the fix. A backward node
   that cannot be captured (hooks that synchronise with the host) becomes SKIPPED like any
   node and runs eagerly with its reason. Python hooks that would run only at capture (a
   module's backward hooks, tensor hooks inside the function) are found at the backward's
   warm-up and make it SKIPPED.

6. Grad mode is part of the recording key (``calls.use_grad_mode``): with grad enabled the key
   gains ``(GRAD, indices of leaves that require grad, indices of eager leaves holding a .grad)``,
   so ``torch.no_grad()`` and ``inference_mode()`` calls select a forward-only recording of
   their own, and a function called both ways has two. Under no_grad the key has no such entry. Whether
   closure tensors require grad is checked per call with their addresses (freezing a
   sub-module warms the node up again).

7. ``cgraw.make_graphed_callables(callables, sample_args, num_warmup_iters=3,
   allow_unused_input=False, pool=None)``, torch's signature and semantics on this machinery:
   each callable becomes a graphed function whose module parameters are static inputs; at the
   call, ``num_warmup_iters`` forward and backward passes on ``sample_args`` run eagerly, then
   one step records the forwards in tuple order and their backwards in reverse order as one path
   of the device's tree (callables of a tuple share the pool, as in torch). The returned
   callables replay; a module whose ``training`` flag differs from the one at capture runs the
   original eagerly, as torch's do. Where torch needs the tuple run in capture order and the
   ``requires_grad`` state of ``sample_args``, the tree records another path or key instead of
   failing (a call under no_grad selects its own recording, 6). ``allow_unused_input`` goes to
   ``torch.autograd.grad``; ``pool`` other than None is refused with a ValueError (the tree owns
   its pool).

8. The torch side (``interop.torch.autograd``). The Function of 1 (and an identity Function
   tapping eager outputs, so every backward reports); the backward function of 2 and its
   warm-up, record and replay through ``call_backward``, called from autograd's device thread
   while the owning thread waits in ``backward()`` (torch copies its tree state into autograd
   threads); the three events from torch: ``backward_ran`` from the Function's backward,
   ``freed`` from a finalizer on an object only the autograd graph holds (the tree holds
   outputs weakly, ``trees.outputs.PathOutputs``, as torch's trees do, so a dropped output frees its
   graph; a live graph keeps the path under way, ``AutogradBook.graphs_alive``),
   ``never_needed`` when no output requires grad; ``Backend.orphan`` (clone the tree-output
   inputs of orphaned tickets out of the pool); ``calls.use_grad_mode(torch.is_grad_enabled)``;
   ``requires_grad`` of closure tensors in the per-call check; a switch between ``model.train()``
   and ``model.eval()`` makes a recording stale (``interop.torch.observe``); AccumulateGrad never
   aliases pool memory (``p.grad`` outside the pool after a replayed backward). The GPU tier
   (``tests/gpu/test_autograd.py``) checks gradients and parameters against eager (bitwise for an
   MLP) through the scenarios of torch's backward tests; ``benchmarks.training`` times a step.
"""

from __future__ import annotations

import enum
import logging
import threading
import weakref

from cgraw.trees.calls import TREE
from cgraw.errors import TreeError
from cgraw.trees.nodes import NodeState

__all__ = ["BUSY", "AutogradBook", "BackwardPlan", "BackwardTicket", "TreeAutograd", "plan_backward",
           "promotion_note"]

log = logging.getLogger("cgraw")
BUSY = "another thread was warming up or recording a graph tree (it ran eagerly this time)"


class BackwardPlan(enum.Enum):
    TREE = "tree"  # warm up, record or replay the backward as the next node of the path
    EAGER = "eager"  # the forward ran eagerly: its own autograd graph, in ordinary memory
    RECOMPUTE = "recompute"  # run the forward again eagerly from its inputs, then differentiate it
    ERROR = "error"  # nothing valid is left to differentiate


class BackwardTicket:
    """One forward call made with grad enabled whose outputs' backward may run.

    Events (any thread; they only set fields): ``backward_ran``, ``freed`` (autograd freed the
    graph), ``never_needed`` (no output required grad). The tree sets ``orphaned`` when the
    generation ends while the graph is alive; a backend sets ``lost`` when a recompute cannot
    be done, and keeps what it needs in ``data``.
    """

    __slots__ = ("book", "fn_id", "name", "_node", "recording", "generation", "seq", "pool_inputs",
                 "ran", "released", "needed", "orphaned", "lost", "data", "__weakref__")

    def __init__(self, book, fn_id, name, node, recording, generation, seq, pool_inputs):
        self.book = book
        self.fn_id = fn_id
        self.name = name
        self._node = None if node is None else weakref.ref(node)
        self.recording = recording  # the recording the forward replayed, or None (it ran eagerly)
        self.generation = generation
        self.seq = seq  # issue order in the book
        self.pool_inputs = pool_inputs  # an input lived in the tree's memory (a tree output)
        self.ran = 0  # backwards run (retain_graph allows more than one)
        self.released = False  # the graph is gone (freed, or never needed)
        self.needed = True
        self.orphaned = False
        self.lost: str | None = None
        self.data = None  # the backend's (its autograd context, inputs kept for a recompute)

    @property
    def node(self):
        return None if self._node is None else self._node()

    def backward_ran(self) -> None:
        self.ran += 1
        book = self.book
        book.trains[self.fn_id] = True
        if self.generation == book.generation:
            book.last_backward = book.seq  # every ticket issued so far is before this backward
            book.held.clear()  # and every hold (TreeAutograd.hold_step)

    def freed(self) -> None:
        if not self.released:
            self.released = True
            if not self.ran and self.needed:  # handed out with grad, dropped without a backward
                self.book.trains[self.fn_id] = False

    def never_needed(self) -> None:
        self.needed = False
        self.released = True

    def __repr__(self) -> str:
        state = "orphaned" if self.orphaned else ("freed" if self.released else "live")
        return f"<BackwardTicket {self.name} gen={self.generation} seq={self.seq} ran={self.ran} {state}>"


class AutogradBook:
    """The pending-backward bookkeeping of one tree (section 4 of the module docstring).

    ``tickets``, ``issue`` and ``end_generation`` belong to the owning thread; the tickets' events
    only write ``trains`` entries and ``last_backward``. With no ticket, a generation's end only
    advances ``generation`` and ``last_backward``; the tree does that itself, on the path of every
    call of a root function (``manager.TreeManager._end_generation``).
    """

    def __init__(self) -> None:
        self.generation = 0
        self.tickets: list[BackwardTicket] = []  # issued in this generation and not known freed
        self.seq = 0
        self.last_backward = 0  # self.seq when a backward of this generation last ran
        self.trains: dict[int, bool] = {}  # fn id -> whether its forwards' backwards run
        self.held: set = set()  # owners holding the generation open (TreeAutograd.hold_step)

    def issue(self, fn_id, name, node, recording, pool_inputs: bool) -> BackwardTicket:
        self.seq += 1
        t = BackwardTicket(self, fn_id, name, node, recording, self.generation, self.seq, pool_inputs)
        self.tickets.append(t)
        return t

    def graphs_alive(self) -> bool:
        """Whether the autograd graph of a forward of this generation is alive: what the user holds
        may be made from its outputs (autograd's own tensors, not the ones the tree handed out)."""
        self.tickets = [t for t in self.tickets if not t.released]
        return bool(self.tickets)

    def pending(self) -> list[BackwardTicket]:
        """The tickets that keep the current generation open."""
        live = [t for t in self.tickets if not t.released]
        self.tickets = live
        last, trains = self.last_backward, self.trains
        return [t for t in live if not t.ran and t.seq > last and trains.get(t.fn_id, False)]

    def end_generation(self) -> list[BackwardTicket]:
        """Begin the next generation. Every ticket whose graph is alive is orphaned; returned are
        those whose backward has not run (a recompute may need their inputs kept)."""
        orphans = []
        if self.tickets:
            for t in self.tickets:
                if not t.released:
                    t.orphaned = True
                    if not t.ran:
                        orphans.append(t)
            self.tickets = []
        self.held.clear()
        self.generation += 1
        self.last_backward = self.seq
        return orphans


def plan_backward(ticket: BackwardTicket, *, grad_enabled: bool = False) -> tuple[BackwardPlan, str | None]:
    """How the backward of ``ticket``'s forward runs, and why it does not run through the tree.

    Args:
        grad_enabled: grad mode inside the backward (``create_graph=True`` or a double backward).
    """
    if ticket.lost is not None:
        return BackwardPlan.ERROR, ticket.lost
    if ticket.orphaned and ticket.ran and ticket.pool_inputs:  # orphan() keeps inputs for first backwards only
        return BackwardPlan.ERROR, (
            "a second backward (retain_graph=True) after the forward's generation ended: inputs it read "
            "from the tree's memory are overwritten. Run the backwards before the next step, or clone the inputs")
    if ticket.recording is None:
        if ticket.orphaned and ticket.pool_inputs:
            return BackwardPlan.RECOMPUTE, (
                "its generation ended while its backward was pending and its eager forward saved "
                "inputs from the tree's memory; recomputed eagerly from copies of them")
        return BackwardPlan.EAGER, None
    if grad_enabled:
        return BackwardPlan.RECOMPUTE, (
            "create_graph=True or a double backward (grad mode on inside the backward) is not captured; "
            "the forward is recomputed eagerly and differentiated by autograd")
    if ticket.orphaned:
        return BackwardPlan.RECOMPUTE, (
            "its generation ended while its backward could still run (cgraw.mark_step_begin(), the "
            "next step's first call, cgraw.reset()), so its saved activations may be overwritten; "
            "recomputed eagerly. Call cgraw.mark_step_begin() where a step begins, before its forward")
    node = ticket.node
    if node is None or node.recording is not ticket.recording:
        return BackwardPlan.RECOMPUTE, "its recording was replaced after the forward ran; recomputed eagerly"
    return BackwardPlan.TREE, None


def promotion_note(name: str, limit: int) -> str:
    """The warning when ``config.path_repeat_limit`` begins a generation a pending backward held open."""
    return (f"cgraw: {name} was called {limit} times on one path while a backward of the step was "
            "pending; it now begins a generation anyway, so the pending backwards recompute their "
            "forwards eagerly. For evaluation or sampling use torch.no_grad(); for longer "
            "sequences (BPTT) raise cgraw.config.path_repeat_limit")


class TreeAutograd:
    """The ``manager.TreeManager`` side of autograd (a mixin): tickets of calls made with grad
    enabled, the plan of each backward, and the backward as a node of its forward's tree, run
    from autograd's device thread (``call_backward``)."""

    _backward_thread: int | None = None  # the thread running call_backward now

    def hold_step(self, owner) -> None:
        """A forward ran whose backward reads what it left in the tree's memory but runs outside
        cgraw's autograd (the AOT backward of a ``torch.compile(backend="cgraw")`` training graph,
        whose saved activations are outputs of its forward's graphed pieces): until a backward
        runs no root call begins a generation, as a pending ticket would (section 4). One backward
        ends every hold (``release_step``, or a ticket's ``backward_ran``), as torch's trees wait for
        one backward, not all: a forward whose backward never runs holds nothing after the next
        backward. A generation begun anyway (``mark_step_begin()``, ``path_repeat_limit``,
        ``reset()``) drops every hold too."""
        self.book.held.add(owner)

    def release_step(self, owner) -> None:
        """A backward of ``owner``'s graph ran (from autograd's thread too): every hold ends."""
        self.book.held.clear()

    def _orphan_pending(self) -> None:
        """Forwards whose backward may still run keep what a recompute reads (before poisoning)."""
        orphans = self.book.end_generation()
        if orphans:
            self.backend.orphan(orphans)

    def _with_backward(self, fn, node, out, call):
        """Issue the ticket of a call made with grad enabled; the backend gives the outputs that
        require grad a backward reporting to it. ``call`` is None for a call run before it was
        classified (its inputs may be the tree's memory)."""
        rec = node.recording if node is not None and node.state is NodeState.RECORDED else None
        ticket = self.book.issue(fn.fn_id, fn.name, node, rec, call is None or TREE in call.kinds)
        return self.backend.with_backward(ticket, out, call)

    def backward_plan(self, ticket, *, grad_enabled: bool = False):
        """``plan_backward``; a reason not to run through the tree is logged once and counted on
        the forward's function (``cgraw.report()``)."""
        kind, reason = plan_backward(ticket, grad_enabled=grad_enabled)
        st = self.stats.get(ticket.fn_id)
        if reason is not None and st is not None:
            what = f"backward ran {kind.value}: {reason}"
            if what not in st.skip_reasons:
                log.warning("cgraw: %s: %s", st.name, what)
            st.skip_reasons[what] = st.skip_reasons.get(what, 0) + 1
        return kind, reason

    def call_backward(self, fn, args):
        """Run ``fn``, the backward of a forward recorded in this generation (``backward_plan``
        said TREE), as the next node of the path. Autograd's device thread calls it while the
        owning thread waits in ``backward()``, so the thread is not checked; it never begins a
        generation. To warm up or record it enters the tree's lock as the owning thread's guest;
        when another thread holds the lock it runs eagerly this once (``BUSY``) instead of waiting."""
        if self.current is None:
            raise TreeError(f"{fn.name}: a backward through the tree needs its forward's generation")
        before, self._backward_thread = self._backward_thread, threading.get_ident()
        try:
            return self._call(fn, args, {})
        finally:
            self._backward_thread = before

    def _enter_serial(self) -> bool:
        """Take the tree's lock to grow it. A backward enters as the owning thread's guest, or not
        at all: the thread holding the lock may be waiting for this one (its warm-up runs a
        backward pass on autograd's device thread)."""
        if self._backward_thread != threading.get_ident():
            return self.serial.acquire()
        return self.serial.acquire(host=self.owner_thread, blocking=False)
