"""Autograd through graphed functions, torch's side (``cgraw.trees.autograd``, section 8).

Layer L7: torch is only used once the user has imported it. ``TorchAutograd`` is a mixin of
``cuda_backend.CudaBackend`` (the ``with_backward`` and ``orphan`` of the ``nodes.Backend``
protocol); the pieces a recording needs (``capture_inputs``, ``run_saving``, ``grad_info``)
are called from its ``record`` while ``cgraw.config.autograd`` is True (the default). The GPU tier
runs it on the H200 (``tests/gpu/test_autograd.py``); the CPU tier drives it with CPU tensors
(``tests/unit/test_torch_autograd_cpu.py``).

- A replayed forward's outputs that require grad come out of ``_Graphed`` (a
  ``torch.autograd.Function``) whose inputs are the call's leaves that require grad and the
  closure tensors (parameters) that do, so autograd's own AccumulateGrad writes ``.grad``.
- Its backward asks the tree for the plan: TREE calls the forward node's ``BackwardFn``
  through ``TreeManager.call_backward`` (``torch.autograd.grad`` with ``retain_graph=True`` of
  the autograd graph the capture left, warmed up, recorded and replayed as a node of the path);
  RECOMPUTE runs the function again eagerly from its inputs; ERROR raises with the reason.
- Eager forwards (warm-up, skipped nodes) get a tap: an identity ``Function`` whose backward
  reports to the ticket and passes the gradients on into the eager graph.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref

from cgraw.trees import nodes as tree_nodes
from cgraw.trees.arrays import STATIC, TREE, out_spec, replace_leaves, unflatten
from cgraw.trees.autograd import BackwardPlan
from cgraw.errors import CgrawError, SkipCall
from cgraw.interop.torch import private_api


class NoRebind:
    """The settings ``rebind.proof.plan`` reads, with eager inputs always copied: a backward
    reads the placeholders the forward saved, so they must hold this call's inputs."""

    rebind_inputs = False


class GradInfo:
    """What a forward recording made with grad enabled keeps for its backward."""

    __slots__ = ("leaves", "params", "out_idx", "outs", "ins", "saved", "ext", "flags")

    def __init__(self, leaves, params, out_idx, outs, ins, saved, ext):
        self.leaves = leaves  # indices of the call's leaves that require grad
        self.params = params  # closure tensors that require grad (the same objects every call)
        self.out_idx = out_idx  # indices of the recording's outputs that require grad
        self.outs = outs  # those outputs as captured: the roots of the capture-time autograd graph
        self.ins = ins  # what the capture read for leaves and params (the graph's inputs)
        self.saved = saved  # tensors autograd saved during the capture (the pool's blocks)
        self.ext = ext  # every closure tensor, and whether each required grad at the capture
        self.flags = [getattr(t, "requires_grad", False) for t in ext]

    def stale(self) -> str | None:
        """Why the recording's autograd graph no longer matches its closure, or None."""
        if [getattr(t, "requires_grad", False) for t in self.ext] != self.flags:
            return ("requires_grad of a tensor the function reads through its closure changed (a "
                    "sub-module frozen or unfrozen)")
        return None


def _same(x):
    return x


_tls = threading.local()  # .hooks: the saved_tensors_hooks cgraw pushed last on this thread, or None
_step_aside = [False]  # torch.autograd.graph.disable_saved_tensors_hooks wrapped (once per process)


@contextlib.contextmanager
def saving_hooks(pack, unpack):
    """``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` that step aside for torch.func's
    transforms (``grad``, ``vjp``, ``jacrev``, ``hessian``): they refuse to run under any
    saved-tensor hooks (``disable_saved_tensors_hooks`` raises), and the function's eager code has
    none. Inside such a transform these hooks are off, so tensors saved there pass unseen (the
    warm-up's ``Observer`` sees a backward run there by other means)."""
    torch = sys.modules["torch"]
    if not _step_aside[0]:
        _wrap_disable(torch.autograd.graph)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    prev = getattr(_tls, "hooks", None)
    with hooks:
        _tls.hooks = hooks
        try:
            yield
        finally:
            _tls.hooks = prev


def _wrap_disable(graph) -> None:
    orig = graph.disable_saved_tensors_hooks

    @contextlib.contextmanager
    def disable_saved_tensors_hooks(error_message):
        hooks = getattr(_tls, "hooks", None)
        top = private_api.top_saved_tensors_hooks() if hooks is not None else None
        if top is None or top[0] is not hooks.pack_hook:  # not cgraw's on top: torch decides
            with orig(error_message):
                yield
            return
        hooks.__exit__(None, None, None)
        _tls.hooks = None
        try:
            with orig(error_message):
                yield
        finally:
            hooks.__enter__()
            _tls.hooks = hooks

    disable_saved_tensors_hooks.__wrapped__ = orig
    graph.disable_saved_tensors_hooks = disable_saved_tensors_hooks
    _step_aside[0] = True


def capture_inputs(call, placeholders: dict) -> dict:
    """What a capture with grad enabled reads per leaf: placeholders (eager leaves) and detached
    aliases (leaves read in place) of the leaves that require grad, marked to require it, so
    the capture's autograd graph starts at them and holds nothing of the caller's. The aliases
    are also read through (``subs[LEAF_ALIASES]``, for ``run_saving``): a module argument's
    parameters reach the function through the module, not as arguments."""
    subs = dict(placeholders)
    read = subs[LEAF_ALIASES] = {}
    for j, t in enumerate(call.leaves):
        if getattr(t, "requires_grad", False):
            s = placeholders.get(j)
            subs[j] = (t.detach() if s is None else s).requires_grad_()
            if s is None:
                read[id(t)] = subs[j]
    return subs


ALIASES = "closure aliases"  # the key of ``subs`` under which ``run_saving`` leaves them
LEAF_ALIASES = "leaf aliases"  # the key of ``subs`` under which ``capture_inputs`` leaves the leaves' ones


def run_saving(fn, args, kwargs, saved: list, subs: dict, external=()):
    """``fn(*args, **kwargs)``, appending each tensor autograd saves to ``saved``.

    Closure tensors that require grad are read through fresh detached aliases (``subs[ALIASES]``,
    by ``id`` of the tensor), so the capture-time autograd graph ends at leaves made inside the
    capture. torch (2.11) fixes an AccumulateGrad node's stream when the node is made; the one of
    a parameter made by an eager step on the default stream stays alive while that step's graph
    does (the previous ``loss``), and the captured backward's engine then makes the default stream
    wait on the capture: ``cudaErrorStreamCaptureImplicit`` (seen on the H200). The
    aliases' gradients go to the parameters through ``_Graphed``, outside any capture."""
    aliases = subs[ALIASES] = {id(t): t.detach().requires_grad_() for t in external
                               if getattr(t, "requires_grad", False)}
    aliases.update(subs.get(LEAF_ALIASES, ()))

    def pack(x):
        saved.append(x)
        return x

    with saving_hooks(pack, _same), _read_through(aliases):
        return fn(*args, **kwargs)


def _read_through(aliases: dict):
    """A ``TorchFunctionMode`` that hands every torch function the alias of a tensor in ``aliases``."""
    if not aliases:
        return contextlib.nullcontext()
    torch = sys.modules["torch"]
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    tensor = torch.Tensor

    def sub(x):
        return aliases.get(id(x), x) if isinstance(x, tensor) else x

    class ReadThroughAliases(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            args, kwargs = tree_map(sub, (args, kwargs or {}))
            return func(*args, **kwargs)

    return ReadThroughAliases()


def grad_info(rec, call, subs: dict, saved: list) -> GradInfo | None:
    """The ``GradInfo`` of a recording (``out_leaves``, ``owned_idx``, ``external`` set), or None
    when none of its own outputs requires grad or nothing it reads does."""
    leaves = [j for j, t in enumerate(call.leaves) if getattr(t, "requires_grad", False)]
    ext = tuple(rec.external)
    params = [t for t in ext if getattr(t, "requires_grad", False)]
    out_idx = [i for i in rec.owned_idx if getattr(rec.out_leaves[i], "requires_grad", False)]
    if not out_idx or not (leaves or params):
        return None
    outs = [rec.out_leaves[i] for i in out_idx]
    aliases = subs.get(ALIASES, {})
    ins = [subs[j] for j in leaves] + [aliases.get(id(t), t) for t in params]
    return GradInfo(leaves, params, out_idx, outs, ins, saved, ext)


REENTRANT_CHECKPOINT = (
    "its outputs come out of torch.utils.checkpoint(use_reentrant=True), whose backward refuses "
    "torch.autograd.grad, the call a recorded backward makes; pass use_reentrant=False (torch's "
    "recommendation) to have it graphed"
)


def reentrant_checkpoint(out_leaves, in_leaves) -> str | None:
    """Why a function runs eagerly when autograd goes through graphed functions: its outputs'
    autograd graph, walked back to its inputs, has a ``torch.utils.checkpoint(use_reentrant=True)``
    node (``CheckpointFunctionBackward``); else None."""
    stop = {id(getattr(t, "grad_fn", None)) for t in in_leaves}
    stack = [t.grad_fn for t in out_leaves if getattr(t, "grad_fn", None) is not None]
    seen: set = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        if type(node).__name__ == "CheckpointFunctionBackward":
            return REENTRANT_CHECKPOINT
        stack.extend(n for n, _ in node.next_functions)
    return None


class BackwardFn:
    """The backward of one forward node: a graphed function of the tree (``call_backward``)
    that differentiates the autograd graph of the node's current recording."""

    static_argnums = frozenset()
    mutates = ()
    pad_buckets = None
    plain = True
    inputs_guarded = False
    unsafe_reason = None
    is_backward = True  # autograd's device thread allocates: route the capture by stream
    copies_out = True  # its outputs leave the tree's memory (copied_out) before anyone sees them: no poisoning

    def __init__(self, node):
        self.fn_id = tree_nodes.next_fn_id()
        self.name = f"{node.fn.name}.backward"
        ref = weakref.ref(node)

        def backward(*grads):
            g = ref().recording.grad
            return tuple(sys.modules["torch"].autograd.grad(g.outs, g.ins, grads, retain_graph=True,
                                                            allow_unused=True))

        self.fn = backward

    def __repr__(self) -> str:
        return f"<cgraw backward {self.name}>"


class _Link:
    """One call's outputs and what their backward needs: ``_Graphed``'s ``ctx.link``."""

    __slots__ = ("backend", "ticket", "info", "fn", "call", "kept", "outs", "__weakref__")

    def __init__(self, backend, ticket, info=None, fn=None, call=None):
        self.backend, self.ticket, self.info, self.fn, self.call = backend, ticket, info, fn, call
        self.kept = None  # copies of the inputs in the tree's memory (orphaned: the recompute's)
        self.outs = None  # the outputs forward() hands out, set just before it runs

    def backward(self, grads):
        torch = sys.modules["torch"]
        ticket = self.ticket
        kind, reason = self.backend.mgr.backward_plan(ticket, grad_enabled=torch.is_grad_enabled())
        if kind is BackwardPlan.ERROR:
            raise CgrawError(f"cgraw: the backward of {ticket.name} cannot run: {reason}")
        if self.info is None:  # a tap of an eager forward: its own graph continues
            res = grads
        elif kind is BackwardPlan.TREE:
            res = copied_out(self.backend.mgr.call_backward(self.backend.backward_fn(ticket.node), tuple(grads)))
        else:
            res = self.recompute(grads)
        ticket.backward_ran()
        return tuple(res)

    def recompute(self, grads):
        """The function again, eagerly from its inputs, differentiated (``create_graph`` when grad
        mode is on inside the backward)."""
        torch = sys.modules["torch"]
        info, call = self.info, self.call
        leaves = self.kept if self.kept is not None else call.leaves
        create = torch.is_grad_enabled()
        # differentiable (create_graph, double backward): from the caller's inputs themselves, so
        # the gradients' own graph reaches them, as eager's does; else from detached aliases, but
        # for static inputs (a module argument's parameters reach the function through the module)
        subs = {j: leaves[j] if (create or call.kinds[j] == STATIC) and leaves[j] is call.leaves[j]
                else leaves[j].detach().requires_grad_() for j in info.leaves}
        args, kwargs = replace_leaves(call.arg_specs, call.kwarg_specs, leaves, subs)
        with torch.enable_grad():
            out = self.fn(*args, **kwargs)
        flat: list = []
        out_spec(out, flat)
        return torch.autograd.grad([flat[i] for i in info.out_idx], [subs[j] for j in info.leaves] + info.params,
                                   grads, create_graph=create, allow_unused=True)


def copied_out(grads) -> tuple:
    """The backward graph's gradients copied out of the tree's memory (its next replay overwrites
    them) into fresh tensors that AccumulateGrad then takes as they are (handing it the tree's
    tensors made it clone each one: a launch per parameter). One ``torch._foreach_mul(srcs, 1.0)``
    allocates them in C++ and copies them in one multi-tensor kernel: ``x * 1.0`` is ``x`` bit for
    bit for every value but NaN's payload (a NaN stays a NaN); H200 profile: a Python
    ``empty_like`` per gradient and ``_foreach_copy_`` cost more host time than the clones saved."""
    torch = sys.modules["torch"]
    srcs = [g for g in grads if g is not None]
    if not srcs:
        return tuple(grads)
    with torch.no_grad():
        dsts = torch._foreach_mul(srcs, 1.0)
    if len(srcs) == len(grads):
        return tuple(dsts)
    it = iter(dsts)
    return tuple(None if g is None else next(it) for g in grads)


_function: list = [None]  # [_Graphed], made once torch is loaded


def _graphed_function():
    cls = _function[0]
    if cls is None:
        torch = sys.modules["torch"]

        class _Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, link, *inputs):
                ctx.link = link
                outs, link.outs = link.outs, None
                return tuple(o.detach() for o in outs)

            @staticmethod
            def backward(ctx, *grads):
                return (None,) + ctx.link.backward(grads)

        cls = _function[0] = _Graphed
    return cls


def _apply(link, ins, outs, first: bool = True) -> tuple:
    link.outs = outs
    if first:
        weakref.finalize(link, link.ticket.freed)  # the link dies with the autograd graph that holds it
        link.ticket.data = weakref.ref(link)  # never strong: the finalizer holds the ticket
    return _graphed_function().apply(link, *ins)


def _tap(link, outs) -> list:
    """The outputs of an eager forward, each through an identity ``_Graphed`` of its own (all with
    one link): a backward from one of them runs only its own eager graph, as eager's does (one
    node over all of them ran, and freed, the others' graphs too)."""
    return [_apply(link, [t], [t], first=k == 0)[0] for k, t in enumerate(outs)]


class TorchAutograd:
    """``with_backward`` and ``orphan`` of the ``nodes.Backend`` protocol, for torch. The
    backend sets ``mgr`` (its ``TreeManager``) and calls ``grad_views`` when a generation ends."""

    mgr = None
    # [(function name, weak reference, ticket)] of the outputs ``_Graphed`` handed out, until their
    # generation has ended (``grad_views``); the tree calls ``end_generation`` while any is listed
    autograd_views: list = ()

    def with_backward(self, ticket, out, call):
        flat: list = []
        rec = ticket.recording
        try:
            spec = out_spec(out, flat)
        except SkipCall:
            # an eager forward whose output no graph can hand out (a sparse tensor): it is never
            # recorded, its backward is eager's own graph; untapped, so it never holds a generation
            # (a replayed output only comes from a recording, which out_spec accepted)
            ticket.never_needed()
            return out
        if rec is None:  # an eager forward: tap its outputs that require grad
            node = ticket.node
            idx = [i for i, t in enumerate(flat) if getattr(t, "requires_grad", False)]
            if not idx or (node is not None and node.warm is not None and node.warm.runs_backward):
                ticket.never_needed()
                return out
            outs = _tap(_Link(self, ticket), [flat[i] for i in idx])
        else:
            info = rec.grad
            if info is None:
                ticket.never_needed()
                return out
            idx = info.out_idx
            link = _Link(self, ticket, info, ticket.node.fn.fn, call)
            outs = _apply(link, [call.leaves[j] for j in info.leaves] + info.params, [flat[i] for i in idx])
            views = self.__dict__.setdefault("autograd_views", [])
            views.extend((ticket.name, weakref.ref(b), ticket) for b in outs)
        for i, b in zip(idx, outs):
            flat[i] = b
        return unflatten(spec, iter(flat))

    def orphan(self, tickets: list) -> None:
        """Keep copies of the inputs in the tree's memory that a recompute will read."""
        torch = sys.modules["torch"]
        for t in tickets:
            link = None if t.data is None else t.data()
            if link is None or not t.pool_inputs:
                continue
            if link.info is None:
                t.lost = ("its forward ran eagerly on inputs in the tree's memory, and its generation "
                          "ended before its backward; call cgraw.mark_step_begin() where a step begins, "
                          "before its forward, or clone the inputs")
                continue
            with torch.no_grad():
                link.kept = [x.detach().clone() if k == TREE else x
                             for x, k in zip(link.call.leaves, link.call.kinds)]

    def backward_fn(self, node) -> BackwardFn:
        fns = self.__dict__.setdefault("_backward_fns", weakref.WeakKeyDictionary())
        bfn = fns.get(node)
        if bfn is None:
            bfn = fns[node] = BackwardFn(node)
        return bfn

    def grad_views(self) -> list:
        """``[(function name, output)]`` handed out by ``_Graphed`` in generations that have ended
        (poisoned or cloned out with the tree's own outputs, which they alias)."""
        views = self.__dict__.get("autograd_views")
        if not views:
            return []
        ended, live = [], []
        for item in views:
            name, ref, ticket = item
            if ticket.generation == ticket.book.generation:
                live.append(item)
            else:
                b = ref()
                if b is not None:
                    ended.append((name, b))
        self.autograd_views = live
        return ended
