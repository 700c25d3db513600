"""A CPU emulator of CUDA-graph replay, and a tree backend built on it (``CpuGraphBackend``).

Why: the other CPU stand-ins (``torch_cpu_backend.CpuTorchBackend``, ``fake_tree_backend``) "replay"
by running the Python function again, so they cannot see what a real replay gets wrong because
Python ran at record time only: a Python scalar baked into a kernel argument, a Python branch
taken once, a value read on the host. This emulator replays the *ops*, not the Python.

``record(fn, *args, **kwargs)`` runs ``fn`` once under ``GraphRecorder`` (a ``TorchDispatchMode``)
that logs every aten op (func, args, kwargs, result). ``CpuGraph.replay()`` runs the logged ops
again, in order, on the same tensor objects (fixed addresses):

- an op that makes a new tensor runs again and its result is written into the tensor it returned
  at record time (``recorded.copy_(result)``: that tensor keeps its storage, as a graph's output
  keeps its address);
- in-place and ``out=`` ops (mutable schemas) run again on the recorded tensors;
- views (``view``, ``t()``, slicing, ``detach``, ``split``...) are not run: the view objects of the
  recording share the storage of their base, which never moves, so they read its new contents (an
  op that may alias and copied instead, ``reshape`` under inference mode, runs again as a copy);
- ``empty*`` factories are not run (a graph leaves such memory as it is);
- Python scalars in op arguments stay as recorded: baked in, as in a graph's kernel arguments;
- a recording computes nothing that outlives it, as a capture runs nothing: writes of in-place ops
  into memory made outside it (an input, a closure buffer) are undone when it ends, so only
  replays write there;
- a tensor not made inside the recording (a placeholder, a closure tensor, a static input) is read
  by identity: its contents at replay time. A replay refuses (``CannotEmulate``) when such a
  tensor's storage moved since the recording (a graph would read the old address).

What it refuses while recording (``CannotEmulate``, or its subclass ``HostRead``):

- reading a device value on the host (``.item()``, ``bool(t)``, ``torch.equal``, any op returning a
  Python value) and ops whose output shape depends on values (``nonzero``, boolean masks,
  ``unique``): a CUDA capture refuses these too (``HostRead``; the backend turns it into a skip,
  as ``cuda_backend`` does with the capture's error);
- random-number ops (tagged ``nondeterministic_seeded``): the emulator does not model cgraw's
  generator offsets;
- ops that swap a tensor's storage (``set_``, ``resize_``, ``resize_as_``);
- higher-order operators (``torch.cond``...).

A copy to the host that bypasses torch's dispatcher on the CPU (``.tolist()``, ``.numpy()``,
``numpy.asarray(t)``, printing a tensor) is refused too (``HostRead``), as a capture refuses it.
Not seen: ``data_ptr()`` and other reads of metadata; they happen once, at record time, like
every Python statement.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from cgraw.errors import SkipCall
from cgraw.interop.torch import observe
from cgraw.trees import buckets
from cgraw.trees.arrays import EAGER, TORCH, TREE, argument_objects, names_inputs, out_spec, replace_leaves, unflatten
from cgraw.trees.nodes import ModeRewarm, Rewarm, Warm, split_external
from cgraw.trees.outputs import reuse_for
from cgraw.trees.recording import (EXTERNAL, OWNED, ClosureView, InputAlias, RowsView, repeated_leaves, rows_view,
                                   tree_views)
from torch_cpu_backend import CpuTorchBackend, copy_span, placeholders

aten = torch.ops.aten


class CannotEmulate(RuntimeError):
    """An op (or a change of a tensor between replays) the emulator cannot replay faithfully."""


class HostRead(CannotEmulate):
    """A device value read on the host during a recording: a CUDA stream capture refuses it."""


_STORAGE_SWAPS = {"set_", "resize_", "resize_as_", "resize_as_sparse_", "_resize_output_"}
_UNWRITTEN = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
_VALUE_SHAPED = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def _tensors(x) -> list:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _storage_ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def _aliases(out, args) -> bool:
    """Whether every tensor ``out`` holds shares storage with a tensor of ``args``. Under inference
    mode (autograd's keys excluded) ops such as ``reshape`` reach the recorder undecomposed: their
    schema says they may alias, and they copy when they cannot view. A capture records the copy's
    kernel, so a replay runs it again."""
    ins = {_storage_ptr(t) for t in _tensors(args)}
    return all(_storage_ptr(t) in ins for t in _tensors(out))


_BY_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _draws(func, args, kwargs) -> bool:
    """Whether a seeded op draws: attention with ``dropout_p`` 0 or a dropout with ``train`` False does not."""
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("dropout_p", "train"):
            v = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            return bool(v)
    return True


def _kind(func, args=(), kwargs=None) -> str:
    """How a replay treats ``func`` (called with ``args``): 'run' (mutable: again, in place),
    'view' (kept), 'skip' (unwritten memory) or 'copy' (again, into the recorded result). Raises
    what it cannot replay."""
    if not isinstance(func, torch._ops.OpOverload):
        raise CannotEmulate(f"{func} is not an aten op (a higher-order operator): the emulator cannot replay it")
    name = func._schema.name.split("::")[-1]
    if func in _BY_INDEX and len(args) > 1 and not any(  # integer indices: a fixed shape, no host read
            t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1]):
        pass
    elif func is aten._local_scalar_dense.default or any(t in func.tags for t in _VALUE_SHAPED):
        raise HostRead(f"{func} reads a device value on the host (or makes a value-dependent shape)")
    if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs or {}):
        raise CannotEmulate(f"{func} draws random numbers: the emulator does not model cgraw's generators")
    if name in _STORAGE_SWAPS:
        raise CannotEmulate(f"{func} may give a tensor new storage: a graph's addresses are fixed")
    if func._schema.is_mutable:
        return "run"
    if func.is_view or any(r.alias_info is not None for r in func._schema.returns):
        return "view"
    if name in _UNWRITTEN:
        return "skip"
    return "copy"


class _Op:
    __slots__ = ("func", "args", "kwargs", "out", "kind")

    def __init__(self, func, args, kwargs, out, kind):
        self.func, self.args, self.kwargs, self.out, self.kind = func, args, kwargs, out, kind

    def __repr__(self) -> str:
        return f"<{self.kind} {self.func}>"


class GraphRecorder(TorchDispatchMode):
    """Logs every aten op while active; ``outside`` holds the tensors read that it did not make."""

    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.made: set[int] = set()  # ids of the tensors ops returned (kept alive by the log)
        self.outside: dict[int, tuple] = {}  # id -> (tensor, storage address at record time)
        self.before: dict[int, tuple] = {}  # storage address -> (storage, its contents before a write)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        for t in _tensors((args, kwargs)):
            if id(t) not in self.made and id(t) not in self.outside:
                self.outside[id(t)] = (t, _storage_ptr(t))
        if kind == "run":  # an in-place op: keep what it may overwrite of memory made outside
            outside = {_storage_ptr(t) for t, _ in self.outside.values()}
            for t in _tensors((args, kwargs)):
                p = _storage_ptr(t)
                if p in outside and p not in self.before:
                    self.before[p] = (t.untyped_storage(), t.untyped_storage().clone())
        out = func(*args, **kwargs)
        if any(not isinstance(x, torch.Tensor) and x is not None for x in tree_flatten(out)[0]):
            raise HostRead(f"{func} returned a Python value ({type(out).__name__}) to the host")
        if kind == "view" and not _aliases(out, args):
            kind = "copy"  # an op that views where it can and copies otherwise (reshape of an expanded tensor)
        for t in _tensors(out):
            self.made.add(id(t))
        self.ops.append(_Op(func, args, kwargs, out, kind))
        return out

    def undo_writes(self) -> None:
        """Put back what in-place ops wrote into memory made outside the recording."""
        with torch.no_grad():
            for storage, contents in self.before.values():
                storage.copy_(contents)
        self.before.clear()


class _Weak:
    """A tensor of the op log held weakly (``CpuGraph.hold_weakly``): a graph holds an address."""

    __slots__ = ("ref",)

    def __init__(self, ref):
        self.ref = ref


class _Slot:
    """A tree-output input of the op log (``CpuGraph.read_from_call``): read at the call's leaf ``j``."""

    __slots__ = ("j",)

    def __init__(self, j):
        self.j = j


_leaves: list = []  # the leaves of the call a replay runs for (``CpuGraph.replay``)


def _resolve(x):
    if type(x) is _Slot:
        return _leaves[-1][x.j]
    if type(x) is _Weak:
        t = x.ref()
        if t is None:
            raise CannotEmulate("a tensor the recording read is gone: a graph would read freed memory")
        return t
    return x


class CpuGraph:
    """The op log of one recording; ``replay()`` runs it again at the recorded tensors."""

    def __init__(self, recorder: GraphRecorder):
        self.ops = recorder.ops
        self.outside = list(recorder.outside.values())
        self.made_storages = {_storage_ptr(t) for op in self.ops for t in _tensors(op.out)}
        self.replays = 0

    def made(self, t) -> bool:
        """Whether ``t``'s memory was allocated inside the recording (a graph's own memory)."""
        p = _storage_ptr(t)  # a tree-output input (a slot) is where the recording read it
        return p in self.made_storages and not any(
            (ptr if type(o) is _Slot else _storage_ptr(_resolve(o))) == p for o, ptr in self.outside)

    def hold_weakly(self, refs) -> None:
        """Hold the tensors behind the weak references ``refs`` weakly from now on, as a CUDA graph
        holds their addresses only (the tree does not replay a recording once they are gone)."""
        self._substitute({id(t): _Weak(r) for r in refs if (t := r()) is not None})

    def read_from_call(self, leaves: dict) -> None:
        """Read the tensors ``leaves`` maps (leaf index -> tensor: the call's tree-output inputs) at
        the leaves of the call each replay runs for, holding none of them, as a graph reads such
        an input at its address (a tree output, which the tree keeps in place)."""
        self._substitute({id(t): _Slot(j) for j, t in leaves.items()})

    def _substitute(self, table: dict) -> None:
        """Put ``table[id(t)]`` in place of each tensor ``t`` of the log it names."""
        if not table:
            return

        def swap(x):
            return table.get(id(x), x) if isinstance(x, torch.Tensor) else x
        for op in self.ops:
            op.args, op.kwargs, op.out = tree_map(swap, (op.args, op.kwargs, op.out))
        self.outside = [(swap(t), ptr) for t, ptr in self.outside]

    def replay(self, leaves=()) -> None:
        _leaves.append(leaves)
        try:
            self._replay()
        finally:
            _leaves.pop()

    def _replay(self) -> None:
        for t, ptr in self.outside:
            t = _resolve(t)
            if _storage_ptr(t) != ptr:
                raise CannotEmulate(f"a tensor the recording read moved (storage 0x{ptr:x} -> "
                                    f"0x{_storage_ptr(t):x}): a graph would read its old address")
        # a graph replays kernels, past every dispatch: autocast, active at a replay, casts nothing
        # again (the ops logged are what autocast dispatched at the recording)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for op in self.ops:
                if op.kind == "view" or op.kind == "skip":
                    continue
                args, kwargs, out = tree_map(_resolve, (op.args, op.kwargs, op.out))
                res = op.func(*args, **kwargs)
                if op.kind == "copy":
                    for old, new in zip(_tensors(out), _tensors(res), strict=True):
                        if old is not new:
                            old.copy_(new)
        self.replays += 1

    def __repr__(self) -> str:
        return f"<CpuGraph {len(self.ops)} ops, {len(self.outside)} tensors read from outside>"


def record(fn, *args, **kwargs):
    """Run ``fn`` once under a ``GraphRecorder``; returns ``(CpuGraph, fn's result)``. Inside it
    ``torch.cuda.is_current_stream_capturing()`` is True, as inside a capture on the GPU: code that
    asks (transformers' ``is_tracing``) takes the branch it takes under a capture."""
    rec = GraphRecorder()
    cuda = torch.cuda
    was = cuda.is_current_stream_capturing
    cuda.is_current_stream_capturing = lambda: True
    T = torch.Tensor
    copies = {name: T.__dict__.get(name) for name in _HOST_COPIES}
    for name in _HOST_COPIES:
        setattr(T, name, _refused(name))
    try:
        with rec:
            out = fn(*args, **kwargs)
    finally:
        cuda.is_current_stream_capturing = was
        for name, m in copies.items():
            if m is None:
                delattr(T, name)
            else:
                setattr(T, name, m)
        rec.undo_writes()
    return CpuGraph(rec), out


# copies of a tensor to the host that bypass the dispatcher on the CPU; of a device tensor they
# synchronise with it, which a capture refuses
_HOST_COPIES = ("tolist", "numpy", "__array__", "__repr__")


def _refused(name):
    def refused(self, *args, **kwargs):
        raise HostRead(f"Tensor.{name}() copies a device tensor to the host")
    return refused


# ---------------------------------------------------------------------- the tree backend


class _ClosureReads(TorchDispatchMode):
    """A warm-up's observer (as ``interop.torch.observe``'s, which sees CUDA tensors only): the
    tensors read that are neither arguments nor made during the call. Holds them weakly."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = {id(t) for t in inputs}
        self.made: set[int] = set()
        self.seen: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors((args, kwargs)):
            i = id(t)
            if i not in self.made and i not in self.inputs and i not in self.seen:
                self.seen[i] = weakref.ref(t)
        ins = _tensors((args, kwargs))
        for t in _tensors(out):  # as observe's: an in-place op returns its argument, not made here
            if not any(t is a for a in ins):
                self.made.add(id(t))
        return out

    def external(self, exclude) -> list:
        skip = {id(t) for t in exclude}
        return [t for i, r in self.seen.items()
                if (t := r()) is not None and i not in skip and i not in self.made]


class GraphRecording:
    """A recording replayed by the emulator (``nodes.Replayable``); what ``recording.Recording``
    holds on the GPU, minus the CUDA graph."""

    grad = None  # calls with grad go to CpuTorchBackend's recordings
    reuse = None  # new output objects at every replay (trees.outputs.Reuse: test_output_reuse_cpu.py)
    keyed = ()
    capture_ms = instantiate_ms = 0.0

    def __init__(self, backend, fn):
        self.backend, self.fn, self.name = backend, fn, fn.name
        self.discarded = False
        self.replays = 0
        self.users: list = []

    def replay(self, call, first=False):
        why = None if first else self.stale()
        return self.backend.replay_graph(self, call) if why is None else why

    def stale(self):
        """``recording.Recording.stale``: module reassignments, train/eval switches, moved closure tensors."""
        if self.epoch != observe.epoch_now[0]:
            return Rewarm("a module's parameter, buffer or submodule was reassigned since the recording")
        if self.mode_epoch != observe.mode_epoch_now[0]:
            return ModeRewarm("a module switched between training and evaluation since the recording")
        keyed = [r() for r in self.keyed]
        if None in keyed or [t.data_ptr() for t in (*self.external, *keyed)] != self.ext_ptrs:
            return Rewarm("a tensor the function reads through its closure moved")
        return None


class CpuGraphBackend(CpuTorchBackend):
    """``CpuTorchBackend`` whose recordings are replayed by the emulator, as ``cuda_backend`` and
    ``recording`` replay a graph: eager inputs copied into placeholders, the op log replayed,
    written eager inputs copied back, outputs handed out as aliases of the recording's tensors
    (owned), rebuilt from the caller's input (an input or a view of one), or as they are (a
    closure tensor returned). A call made with grad enabled that autograd records is recorded by
    ``CpuTorchBackend`` (Python runs again on its replays): the emulator leaves autograd out.
    Calls are keyed as ``CudaBackend`` keys them (``keys_as_cuda``, see ``cpu_tree``).
    """

    keys_as_cuda = True

    def __init__(self):
        super().__init__()
        observe.install_module_hooks()  # module reassignments and train/eval switches are counted
        self.graphs: list[CpuGraph] = []

    def warmup(self, fn, call, args, kwargs):
        epoch, mode = observe.epoch_now[0], observe.mode_epoch_now[0]
        obs = _ClosureReads(call.leaves)
        with obs:
            w = super().warmup(fn, call, args, kwargs)
        out_leaves: list = []
        try:
            out_spec(w.out, out_leaves, argument_objects(call.arg_specs, call.kwarg_specs))
        except SkipCall as exc:  # as trees.warmup: an output no replay can hand out runs eagerly
            w.skip = str(exc)
        w.external = tuple(obs.external(list(call.leaves) + out_leaves)) + tuple(w.external)
        w.epoch = epoch if observe.epoch_now[0] == epoch else -1
        w.mode_epoch = mode if observe.mode_epoch_now[0] == mode else -1
        return w

    def record(self, fn, call, warm: Warm):
        if call.grad and not warm.runs_backward:
            return super().record(fn, call, warm)
        self.log.append(("record", fn.name))
        rec = GraphRecording(self, fn)
        leaves, kinds = call.leaves, call.kinds
        rec.placeholders = placeholders(call)
        for j in call.padded:  # padding buckets: the bucket's rows, the call's copied in (cuda_backend.record)
            t = leaves[j]
            ph = rec.placeholders[j] = torch.zeros((call.bucket, *t.shape[1:]), dtype=t.dtype)
            ph[:call.rows].copy_(t)
        rec.fixed = [(j, t, t.data_ptr()) for j, t in enumerate(leaves) if kinds[j] != EAGER]
        args, kwargs = replace_leaves(call.arg_specs, call.kwarg_specs, leaves, rec.placeholders)
        try:
            with torch.no_grad():
                rec.graph, out = record(fn.fn, *args, **kwargs)
        except HostRead as exc:  # cuda_backend._skip_reason's words for the capture's error
            raise SkipCall(f"host synchronisation during capture ({exc})") from None
        self.graphs.append(rec.graph)
        rec.out_leaves = []
        rec.spec = out_spec(out, rec.out_leaves, argument_objects(call.arg_specs, call.kwarg_specs))
        rec.out_kinds = [self._out_kind(rec, call, t) for t in rec.out_leaves]
        rec.owned_idx = [i for i, k in enumerate(rec.out_kinds) if k is OWNED]
        rec.out_rows = ([i for i in buckets.out_rows(rec.out_leaves, call.bucket, warm.rows, rec.spec)
                         if rec.out_kinds[i] is OWNED] if call.bucket is not None else [])
        rec.out_ptrs = [rec.out_leaves[i].data_ptr() for i in rec.owned_idx]
        # as cuda_backend.record: a compiled piece hands out its output objects again (trees.outputs.Reuse)
        rec.out_alias = [t.detach if k is OWNED else None for t, k in zip(rec.out_leaves, rec.out_kinds)]
        rec.tree_views, rec.out_same = tree_views(call, rec.out_kinds), repeated_leaves(rec.out_leaves)
        rec.out_args, rec.bucket = names_inputs(rec.spec), call.bucket
        rec.reuse = reuse_for(fn, rec)
        rec.mutated = [j for j in warm.mutated if kinds[j] == EAGER]
        rec.graph.read_from_call({j: leaves[j] for j, _, _ in rec.fixed if kinds[j] == TREE})
        rec.fixed = [(j, None, ptr) for j, _, ptr in rec.fixed]  # the tree keeps them in place
        rec.external, keyed = split_external(warm)  # as cuda_backend.record: keyed ones held weakly
        rec.keyed = warm.keyed
        rec.graph.hold_weakly(warm.keyed)
        observe.watch(rec.external)
        rec.ext_ptrs = [t.data_ptr() for t in (*rec.external, *keyed)]
        rec.epoch = observe.epoch_now[0] if warm.epoch == observe.epoch_now[0] else -1
        rec.mode_epoch = warm.mode_epoch
        return rec

    def _out_kind(self, rec, call, t):
        """``recording.output_kinds``: an input or a view of one (``InputAlias``), memory the
        recording made (OWNED), a view of a closure tensor (``ClosureView``), or anything else
        (EXTERNAL)."""
        base = _storage_ptr(t)
        for j, ph in rec.placeholders.items():
            if j in call.padded and _storage_ptr(ph) == base:  # the tree's memory on the GPU
                if t is ph:
                    return InputAlias(j, t, ph, TORCH)
                return RowsView(j, t, ph, TORCH) if rows_view(t, ph, call.leaves[j]) else OWNED
            if _storage_ptr(ph) == base and TORCH.view_of(call.leaves[j], t, ph) is not None:
                return InputAlias(j, t, ph, TORCH)
        for j, leaf, _ in rec.fixed:
            if _storage_ptr(leaf) == base and TORCH.view_of(leaf, t, leaf) is not None:
                return InputAlias(j, t, leaf, TORCH)
        if rec.graph.made(t):
            return OWNED
        base = t._base  # a view of a closure tensor: made anew per call (recording.ClosureView)
        if base is not None and base.dtype == t.dtype and not (t.is_conj() or t.is_neg()):
            return ClosureView(t, base)
        return EXTERNAL

    def first_replay(self, rec, call):
        if not isinstance(rec, GraphRecording):
            return super().first_replay(rec, call)
        rec.users = [(u, u()) for u in (TORCH.users(rec.out_leaves[i]) for i in rec.owned_idx) if u is not None]
        return rec.replay(call, first=True)

    def replay_graph(self, rec: GraphRecording, call):
        self.log.append(("replay", rec.name))
        assert not rec.discarded
        for j, leaf, ptr in rec.fixed:  # the tree promised these are where the recording read them
            if call.leaves[j].data_ptr() != ptr:
                raise CannotEmulate(f"input {j} of {rec.name} (read in place) moved; a graph reads its old address")
        n = call.rows
        with torch.no_grad():
            for j, ph in rec.placeholders.items():
                if j in call.padded:
                    ph[:n].copy_(call.leaves[j])
                else:
                    copy_span(ph, call.leaves[j])
            rec.graph.replay(call.leaves)
            for j in rec.mutated:  # the graph's copy-back nodes
                ph = rec.placeholders[j]
                copy_span(call.leaves[j], ph[:n] if j in call.padded else ph)
        rec.replays += 1
        take = None if rec.reuse is None else iter(objs := rec.reuse.take(rec)).__next__  # recording.Recording.replay
        outs = []
        for t, k in zip(rec.out_leaves, rec.out_kinds):
            if k is OWNED:
                outs.append(t.detach() if take is None else take())
            elif k is EXTERNAL:
                outs.append(t)
            elif isinstance(k, ClosureView):
                outs.append(k.rebuild())
            else:
                outs.append(k.rebuild(call.leaves[k.j]))
        for i in rec.out_rows:  # padding buckets: the call's rows of the bucket's
            outs[i] = outs[i][:n]
        owned = objs if take is not None else [outs[i] for i in rec.owned_idx + list(tree_views(call, rec.out_kinds))]
        return unflatten(rec.spec, iter(outs), argument_objects(call.arg_specs, call.kwarg_specs)), owned

    def discard(self, rec):
        rec.discarded = True
        if isinstance(rec, GraphRecording):
            observe.unwatch(rec.external)
            if rec.reuse is not None:
                rec.reuse.forget()
