"""What a graph-tree recording holds, as named, slotted data for the replay hot path.

Layer L6: no framework imports (arrays through their ``arrays.Ops``); CUDA only as ``Graph.replay``
does it (one raw launch on the caller's current stream, inlined here: the hot path, after the
generators' step of a recording that draws random numbers) and through the memcpy-node setter
``Graph`` hands out.

- ``InputCopy``: a memcpy node that moves an eager input into its placeholder before the
  graph's work, or a mutated one back after it. Its caller-side pointer (and, for a padded input,
  its byte count) is re-pointed before a launch only when it changed: one ``patch`` for plain
  and padded replays.
- ``InputRebind``: an eager input read in place (``cgraw.rebind.proof``): the kernel-argument words and memcpy
  addresses that pointed into its placeholder, rewritten to the caller's address before a launch
  only when it changed (``rebind.proof`` proves it at record time).
- ``InputAlias``: an output that is an input or a view of one, rebuilt from the caller's input
  on every call (as eager returns it); ``ClosureView``: one that views a closure tensor, made
  anew on every call; ``output_kinds`` tells them apart from the recording's own outputs.
- ``Recording``: the graph, its copies, its outputs (owned by the tree's pool: aliased per call
  and poisoned when the generation ends; or returned as they are) and what keeps them alive.
"""

from __future__ import annotations

import operator

from cgraw import _cuda
from cgraw.runtime import stream as _streams
from cgraw.interop.torch import private_api
from cgraw.errors import SkipCall
from cgraw.trees.arrays import EAGER, TORCH, TREE, argument_objects, builder, ops_of
from cgraw.trees.frameworks import retyped_view
from cgraw.trees.nodes import ModeRewarm, Rewarm

OWNED, EXTERNAL = "owned", "external"  # output kinds; an input alias is an InputAlias
_launch = _cuda.graph_launch_raw


class InputCopy:
    """One input-copy node. ``fixed`` is the placeholder's address (the node's destination for a
    copy in, its source for a copy back); ``ptr`` and ``count`` are what the node holds now."""

    __slots__ = ("leaf", "node", "fixed", "ptr", "count", "row_bytes", "back")

    def __init__(self, leaf: int, node, fixed: int, ptr: int, count: int, row_bytes: int, back: bool):
        self.leaf = leaf  # index of the eager input among the call's leaves
        self.node = node  # the memcpy node (runtime handle, Graph.memcpy_nodes)
        self.fixed = fixed
        self.ptr = ptr  # the caller-side address the node holds
        self.count = count  # bytes the node copies
        self.row_bytes = row_bytes  # padded input: bytes per row (count = rows x this), else 0
        self.back = back  # copies the placeholder back into the caller's array (a mutated input)

    def patch(self, setter, ptr: int, count: int) -> None:
        """Re-point the node at the caller's ``ptr`` and copy ``count`` bytes from now on."""
        if self.back:
            setter(self.node, ptr, self.fixed, count)
        else:
            setter(self.node, self.fixed, ptr, count)
        self.ptr, self.count = ptr, count


class InputRebind:
    """One eager input whose kernels read (and write) the caller's memory in place. ``words``:
    ``(c_uint64 view into a KernelArgs buffer, delta)``; ``kernels``: the ``KernelArgs`` to hand
    to the executable after the words change; ``memcpys``: ``(node, dst delta or None, src delta
    or None, dst, src, bytes)`` of memcpy nodes that read or write it. ``held``: ``(copy, stream)``,
    the staged copy of a call whose input was less aligned than the recording's (or in the tree's
    pool), kept for the next such call on that stream: it is re-pointed once, not on every call."""

    __slots__ = ("leaf", "ptr", "base", "words", "kernels", "memcpys", "back", "held")

    def __init__(self, leaf: int, base: int, words: list, kernels: list, memcpys: list, back: bool = False):
        self.leaf = leaf
        self.base = base  # the placeholder's address at record time (what the words held)
        self.ptr = base  # the address the words hold now
        self.words, self.kernels, self.memcpys = words, kernels, memcpys
        self.back = back  # the function writes the input (staged copies are copied back)
        self.held = None

    def staging(self, stream: int):
        """The staged copy an earlier call on ``stream`` made, or None (none yet, or made on another
        stream: a copy into it on this one could overtake that stream's launch still reading it)."""
        held = self.held
        return held[0] if held is not None and held[1] == stream else None

    def patch(self, setter, ptr: int) -> None:
        """Point every word and memcpy address of this input at ``ptr``."""
        for w, d in self.words:
            w.value = ptr + d
        for k in self.kernels:
            k()
        for node, dd, sd, dst, src, n in self.memcpys:
            setter(node, dst if dd is None else ptr + dd, src if sd is None else ptr + sd, n)
        self.ptr = ptr


class InputAlias:
    """An output that is input ``j`` or a view of it: rebuilt from the caller's input each call.
    ``dtype``: torch, a view of it as another dtype (``x.view(torch.int32)``, ``x.real``), whose
    ``delta`` counts bytes, else None and ``delta`` counts elements; CuPy: the output's dtype,
    ``delta`` in bytes."""

    __slots__ = ("j", "same", "torch", "shape", "stride", "delta", "dtype")

    def __init__(self, j: int, out, base, ops):
        self.j = j
        self.same = out is base
        self.torch = ops is TORCH
        self.dtype = None
        if self.torch:
            self.shape, self.stride = tuple(out.shape), tuple(out.stride())
            self.delta = out.storage_offset() - base.storage_offset()
            if out.dtype != base.dtype:
                self.dtype = out.dtype
                self.delta = out.storage_offset() * out.element_size() - base.storage_offset() * base.element_size()
        else:
            self.shape, self.stride, self.dtype = out.shape, out.strides, out.dtype
            self.delta = ops.ptr(out) - ops.ptr(base)

    def rebuild(self, leaf):
        if self.same:
            return leaf
        if self.torch:
            if self.dtype is not None:
                return retyped_view(leaf, self.dtype, self.shape, self.stride, self.delta)
            return leaf.as_strided(self.shape, self.stride, leaf.storage_offset() + self.delta)
        return type(leaf)(self.shape, self.dtype, leaf.data + self.delta, self.stride)


class RowsView(InputAlias):
    """Under padding buckets, a view of padded input ``j`` whose first dimension is its rows
    (``x[:, 1:]``, ``x[:, 0]``, ``x.unsqueeze(1)``): rebuilt over the caller's rows."""

    __slots__ = ()

    def rebuild(self, leaf):
        return leaf.as_strided((leaf.shape[0],) + self.shape[1:], self.stride, leaf.storage_offset() + self.delta)


def rows_view(t, base, leaf) -> bool:
    """Whether ``t``, a torch view of ``base`` (the bucket's placeholder of contiguous padded input
    ``leaf``), keeps its rows in its first dimension and each of its rows in one of ``base``'s (a
    ``RowsView``)."""
    if t.dtype != base.dtype or t.is_conj() or t.is_neg() or not t.dim() or not leaf.is_contiguous():
        return False
    delta = t.storage_offset() - base.storage_offset()
    return t.shape[0] == base.shape[0] and t.stride(0) == base.stride(0) and 0 <= delta < base.stride(0)


class ClosureView:
    """An output that is a view of a tensor the function reads through its closure (a parameter's
    row, ``weight.T``): a new view of that tensor on every call, as eager makes one. The
    recording's own view object, handed out on every call, would carry what a caller attaches to
    it (a hook, ``retain_grad``) into later calls."""

    __slots__ = ("base", "shape", "stride", "offset")

    def __init__(self, out, base):
        self.base = base  # kept alive by the recording, as its other closure tensors
        self.shape, self.stride, self.offset = tuple(out.shape), tuple(out.stride()), out.storage_offset()

    def rebuild(self, _leaf=None):
        return self.base.as_strided(self.shape, self.stride, self.offset)


def tree_views(call, out_kinds) -> tuple:
    """Indices of the outputs that view (not are) a tree-output input of ``call``: the tree's
    memory, which the next generation overwrites, so they are handed out as owned ones are."""
    return tuple(i for i, k in enumerate(out_kinds)
                 if isinstance(k, InputAlias) and not k.same and call.kinds[k.j] == TREE)


def output_kinds(call, placeholders: dict, out_leaves: list, in_pool) -> list:
    """Per output of a recording of ``call``: OWNED (memory of the tree's pool: ``in_pool(ptr)``),
    an ``InputAlias`` (input ``j`` or a view of it, rebuilt from the caller's input each call; a
    ``RowsView`` of a padded one), a ``ClosureView`` or EXTERNAL (any other tensor, returned as it is)."""
    leaves, kinds, ops = call.leaves, call.kinds, call.ops
    by_base = {}
    for j, ph in placeholders.items():
        # the caller's layout; a padded one has the bucket's rows: only itself is the caller's input
        if j in call.padded or ops[j].key(ph)[1] == ops[j].key(leaves[j])[1]:
            by_base[ops[j].base_ptr(ph)] = (j, ph)
    for j, t in enumerate(leaves):
        if kinds[j] != EAGER:
            by_base.setdefault(ops[j].base_ptr(t), (j, t))
    out = []
    for t in out_leaves:
        o = ops_of(t)
        b = o.base_ptr(t)
        hit = by_base.get(b)
        if hit is not None:
            j, base = hit
            if ops[j] is o and (t is base if j in call.padded else o.view_of(leaves[j], t, base) is not None):
                out.append(InputAlias(j, t, base, o))
                continue
            if ops[j] is o and o is TORCH and j in call.padded and rows_view(t, base, leaves[j]):
                out.append(RowsView(j, t, base, o))
                continue
        if in_pool(b):
            out.append(OWNED)
            continue
        base = private_api.view_base(t) if o is TORCH else None
        same = base is not None and base.dtype == t.dtype and not (t.is_conj() or t.is_neg())
        if same and call.grad and base.requires_grad:
            raise SkipCall(CLOSURE_VIEW_GRAD)
        out.append(ClosureView(t, base) if same else EXTERNAL)
    return out


# why a function returning a view of a closure tensor that requires grad, called with grad on, runs eagerly
CLOSURE_VIEW_GRAD = ("returns a view of a tensor it reads through its closure that requires grad (a tied "
                     "weight's .T): the gradient reaching that view would not reach the tensor through the "
                     "graphed function's backward, so it runs eagerly; return the tensor itself, or call it "
                     "under torch.no_grad()")


class Recording:
    """A recorded tree node, everything its replays need, precomputed at record time."""

    __slots__ = (
        "name",  # the graphed function's name
        "graph",  # cgraw.Graph
        "exec_",  # its executable (the raw launch of the hot path)
        "ordinal",  # its device
        "setter",  # the executable's memcpy-node setter (Graph.exec_memcpy_setter)
        "copies",  # [InputCopy]: copies in, then copies back
        "rebinds",  # [InputRebind]: inputs read in place (no copy)
        "input_notes",  # {leaf: None (read in place) or why it is copied} for report()
        "proof",  # rebind.proof.Pending until the first replay proves (or refutes) rebinding, else None
        "in_pool",  # ptr -> bool: memory of the tree's pool (a rebound input there is staged)
        "stage",  # stage(rec, call, rebind) -> address of a staged copy of the input (see replay)
        "staged",  # [(rebind, staged copy)] of the last launch, alive until the next one
        "slow_in",  # [(leaf index, placeholder)]: non-contiguous eager inputs, copied eagerly
        "copy_slow",  # copy_slow(rec, call, rows or None): copies them on the replay's stream
        "out_leaves",  # the recording's output arrays, flattened
        "out_kinds",  # per output leaf: OWNED, EXTERNAL, an InputAlias or a ClosureView
        "_out_alias",  # per output leaf: the bound alias maker of an OWNED one (t.detach, a.view), else None
        "all_owned",  # the alias makers when every output leaf is OWNED (the property out_alias), else None
        "_out_spec",  # arrays.out_spec of the output structure (the property out_spec)
        "out_build",  # arrays.builder(out_spec), set with it: the structure from the output leaves
        "out_args",  # whether it hands out the call's own argument objects (arrays.names_inputs)
        "out_same",  # [(i, first)]: output leaf i is output leaf first (a function returning (y, y))
        "owned_idx",  # indices of the OWNED outputs
        "tree_views",  # indices of the outputs viewing a tree-output input: handed out, poisoned, as OWNED ones
        "out_ptrs",  # data pointers of the OWNED outputs (tree-output inputs of later calls)
        "users",  # [(users, baseline)] of the OWNED outputs' memory (frameworks.Ops.users): in use while above
        "alias0",  # one owned output, unpadded: its bound alias maker (the fastest replay)
        "seq0",  # with alias0: None (returned alone), or tuple or list (returned in a sequence of one)
        "bucket",  # padding bucket, or None
        "padded",  # leaf indices of the padded inputs
        "out_rows",  # output indices cut back to the call's rows (padded replays)
        "keep",  # (placeholders, outputs): alive as long as the recording
        "spans",  # torch storages in torch's MemPool this recording holds (checkpoint restores)
        "external",  # tensors read through the closure (kept alive, checked per call)
        "keyed",  # weak references to the closure tensors the node's key names (nodes.hold_external)
        "ext_ptrs",  # the addresses of both at record time
        "same_external",  # ptrs -> bool: whether they are still there (interop.torch.observe)
        "epoch",  # module-assignment count at record time, or -1
        "epoch_now",  # [the module-assignment count now] (interop.torch.observe.epoch_now)
        "mode_epoch",  # training/evaluation switch count at the warm-up, or -1
        "mode_now",  # [that count now] (interop.torch.observe.mode_epoch_now)
        "capture_ms",
        "instantiate_ms",
        "grad",  # interop.torch.autograd.GradInfo of a recording made with grad enabled, or None
        "rng_sync",  # the graph's random-number step before each launch (rng.plan.GraphRng.sync), or None
        "reuse",  # trees.outputs.Reuse: the output objects handed out again (compiled code's pieces), or None
    )

    def __init__(self, name: str):
        self.name = name
        self.graph = self.setter = self.copy_slow = self.exec_ = None
        self.ordinal = 0
        self.copies, self.slow_in = [], []
        self.rebinds, self.input_notes, self.proof = [], {}, None
        self.in_pool = self.stage = None
        self.staged = []
        self.out_leaves, self.out_kinds, self.out_alias, self.out_same = [], [], [], ()
        self.owned_idx, self.out_ptrs, self.users, self.tree_views = [], [], [], ()
        self._out_spec = self.out_build = self.alias0 = self.seq0 = self.bucket = None
        self.out_args = False
        self.padded = frozenset()
        self.out_rows = []
        self.keep = None
        self.spans = []
        self.external, self.ext_ptrs, self.same_external, self.epoch, self.epoch_now = (), [], None, -1, [-1]
        self.keyed = ()
        self.mode_epoch, self.mode_now = 0, [0]
        self.capture_ms = self.instantiate_ms = 0.0
        self.grad = None
        self.rng_sync = self.reuse = None

    # ------------------------------------------------------------------ the hot path

    def stale(self):
        """Why what the warm-up learned about the function's closure may be out of date (a
        ``Rewarm`` reason: the node warms up again), or None."""
        if self.epoch != self.epoch_now[0]:
            return Rewarm("a module's parameter, buffer or submodule was reassigned since the recording "
                          "(the tensors it reads through its closure may have changed)")
        if self.mode_epoch != self.mode_now[0]:
            return ModeRewarm("a module switched between training and evaluation (model.train(), model.eval()) "
                              "since the recording")
        same = self.same_external
        if same is not None and not same(self.ext_ptrs):
            return Rewarm("a tensor the function reads through its closure moved (model.half(), .to(), "
                          "param.data = ...)")
        why = None if self.grad is None else self.grad.stale()
        return None if why is None else Rewarm(why)

    @property
    def out_alias(self) -> list:
        return self._out_alias

    @out_alias.setter
    def out_alias(self, aliases) -> None:
        self._out_alias = aliases
        self.all_owned = tuple(aliases) if aliases and None not in aliases else None

    @property
    def out_spec(self):
        return self._out_spec

    @out_spec.setter
    def out_spec(self, spec) -> None:
        self._out_spec, self.out_build = spec, builder(spec)

    def replay(self, call, first: bool = False):
        """Launch for ``call`` (a ``calls.Call``): ``(outputs, the owned ones)``: the tree watches
        whether those are alive and invalidates them when the generation ends. When what the
        warm-up learned is out of date, nothing is launched and the ``Rewarm`` reason is returned
        (``stale``); ``first``: the recording's first call, made just after it, is not checked."""
        if not first:
            why = self.stale()
            if why is not None:
                return why
        if self.bucket is not None:
            return self._replay_padded(call)
        ptrs = call.ptrs
        for c in self.copies:
            p = ptrs[c.leaf]
            if p != c.ptr:
                c.patch(self.setter, p, c.count)
        if self.staged:
            self.staged = []
        for r in self.rebinds:
            p = ptrs[r.leaf]
            if p != r.ptr:
                # kernels chosen for the recording's alignment (vector loads, cuBLAS) must not get a
                # less aligned address, and one in the tree's pool may be memory this graph writes:
                # such an input is read from a copy instead (into the buffer an earlier such call kept)
                if (p - r.base) & 255 or self.in_pool(p):
                    p = self.stage(self, call, r)
                if p != r.ptr:
                    r.patch(self.setter, p)
        if self.slow_in:
            self.copy_slow(self, call, None)
        ptr = _streams.current_getter(self.ordinal)  # Graph.replay(), inlined
        sync = self.rng_sync
        if sync is not None:
            sync(ptr)
        err = _launch(self.exec_, ptr)[0]
        if err:
            self.graph.launch_failed(err, ptr)  # raises (or recovers on another current device)
        if self.staged:
            self.stage(self, call, None)  # copies written inputs back from their staged copies
        alias0 = self.alias0
        if alias0 is not None:
            o = alias0()
            seq = self.seq0
            return (o if seq is None else (o,) if seq is tuple else [o]), (o,)
        reuse = self.reuse
        if reuse is not None:  # the owned outputs' objects of the last replay where nothing holds them
            objs = reuse.take(self)  # (trees.outputs.Reuse); the other outputs are made as below
            return self.out_build(objs if self.all_owned is not None else self._outputs(call, objs), None), objs
        outs = self._outputs(call)
        # every output owned (a compiled piece's activations): all of them, in order
        owned = outs[:] if self.all_owned is not None else [outs[i] for i in self.owned_idx]
        if self.tree_views:
            owned += [outs[i] for i in self.tree_views]
        objects = argument_objects(call.arg_specs, call.kwarg_specs) if self.out_args else None
        return self.out_build(outs, objects), owned

    def _replay_padded(self, call):
        """``replay`` of a padding-bucket recording: the padded inputs' copy nodes also get this
        call's byte count, the outputs are cut back to its rows."""
        n, ptrs = call.rows, call.ptrs
        for c in self.copies:
            p, count = ptrs[c.leaf], (c.row_bytes * n if c.row_bytes else c.count)
            if p != c.ptr or count != c.count:
                c.patch(self.setter, p, count)
        if self.slow_in:
            self.copy_slow(self, call, n)
        ptr = _streams.current_getter(self.ordinal)
        sync = self.rng_sync
        if sync is not None:
            sync(ptr)
        err = _launch(self.exec_, ptr)[0]
        if err:
            self.graph.launch_failed(err, ptr)
        outs = self._outputs(call)
        for i in self.out_rows:
            outs[i] = outs[i][:n]
        owned = [outs[i] for i in self.owned_idx]
        if self.tree_views:
            owned += [outs[i] for i in self.tree_views]
        objects = argument_objects(call.arg_specs, call.kwarg_specs) if self.out_args else None
        return self.out_build(outs, objects), owned

    def _outputs(self, call, owned=None) -> list:
        """The output leaves of a replay for ``call``; ``owned``: the owned ones' objects, if made already."""
        makers = self.all_owned
        if makers is not None:  # a C loop: a training forward's piece hands out a hundred activations
            outs = list(map(_call, makers))
        else:
            outs = []
            take = None if owned is None else iter(owned).__next__
            for t, k, alias in zip(self.out_leaves, self.out_kinds, self.out_alias):
                if alias is not None:
                    outs.append(alias() if take is None else take())
                elif k is EXTERNAL:
                    outs.append(t)
                elif type(k) is ClosureView:
                    outs.append(k.rebuild())
                else:
                    outs.append(k.rebuild(call.leaves[k.j]))
        for i, first in self.out_same:  # one object returned twice is one object, as eager returns it
            outs[i] = outs[first]
        return outs


_call = getattr(operator, "call", None) or operator.methodcaller("__call__")  # operator.call: Python 3.11+


def repeated_leaves(leaves) -> tuple:
    """``(i, first)`` of each leaf that is the same object as an earlier leaf ``first``."""
    seen: dict = {}
    return tuple((i, seen[id(t)]) for i, t in enumerate(leaves) if seen.setdefault(id(t), i) != i)
