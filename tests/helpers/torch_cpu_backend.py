"""A CPU-torch stand-in for ``cgraw.trees.cuda_backend.CudaBackend``'s autograd, driving the real
``TreeManager`` and the real ``interop.torch.autograd`` (its ``TorchAutograd`` mixin, ``_Graphed``,
``BackwardFn``, ``capture_inputs``, ``run_saving``, ``grad_info``).

A "recording" runs the function once on its placeholders, as a capture does (with grad enabled:
on ``capture_inputs``' tensors, saving through ``run_saving``), and keeps those tensors. A
"replay" runs it again on the same placeholders and writes every result *into the tensors of
the capture* (outputs and the tensors autograd saved, through ``.data`` so no version counter
moves): what a replayed CUDA graph does at fixed addresses. So a backward through the tree
differentiates the capture-time graph with this replay's values, as on the GPU, and a forward
replayed again before that backward overwrites its saved tensors, as on the GPU.

CPU tensors report device 0 here (``cpu_as_device0``), so ``cgraw.trees.calls`` classifies them.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from cgraw.errors import SkipCall
from cgraw.trees.arrays import EAGER, TORCH, argument_objects, names_inputs, ops_of, out_spec, replace_leaves, unflatten
from cgraw.interop.torch import private_api
from cgraw.interop.torch.checkpoints import TorchTreeState
from cgraw.interop.torch.autograd import TorchAutograd, capture_inputs, grad_info, run_saving
from cgraw.trees.nodes import Warm, capture_failed, next_fn_id
from cgraw.trees.outputs import reuse_for
from cgraw.trees.recording import repeated_leaves


@contextlib.contextmanager
def cpu_as_device0(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    yield


@contextlib.contextmanager
def cpu_tree(monkeypatch, backend_cls=None):
    """A ``TreeManager`` over ``backend_cls`` (``CpuTorchBackend``), CPU tensors on device 0, no grad."""
    from cgraw.trees.manager import TreeManager

    with cpu_as_device0(monkeypatch), torch.no_grad(), keyed_as_cuda(getattr(backend_cls, "keys_as_cuda", False)):
        be = (backend_cls or CpuTorchBackend)()
        mgr = TreeManager(be)
        be.mgr = mgr
        yield mgr


@contextlib.contextmanager
def keyed_as_cuda(on: bool):
    """What ``cuda_backend.CudaBackend`` sets once torch is loaded, for as long as the block runs
    (when ``on``): parameters are static inputs, and grad mode and the settings that choose kernels
    (autocast, inference mode, TF32...) join every call's key."""
    if not on:
        yield
        return
    from cgraw.interop.torch.kernel_state import kernel_state
    from cgraw.trees import calls, config as tree_config

    before = (calls._tensor[0], calls._tensor[1], calls._kernel[0], tree_config._grad_probe[0])
    calls.use_torch(torch.Tensor, torch.nn.Parameter)
    tree_config.grad_probe(torch.is_grad_enabled)
    calls.use_kernel_state(kernel_state())
    try:
        yield
    finally:
        calls.use_torch(before[0], before[1])
        calls.use_kernel_state(before[2])
        tree_config.grad_probe(before[3])


class TorchFn:
    """Stands in for ``GraphedFunction``: ``params`` are the closure tensors its warm-up "observes"."""

    static_argnums = frozenset()
    mutates = ()
    pad_buckets = None
    plain = True
    inputs_guarded = False
    unsafe_reason = None

    def __init__(self, fn, mgr, *, name=None, params=()):
        self.fn, self.mgr = fn, mgr
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.fn_id = next_fn_id()
        self.params = tuple(params)

    def __call__(self, *args, **kwargs):
        return self.mgr.call(self, args, kwargs)


def copy_span(dst, src) -> None:
    """``dst[...] = src`` for two tensors of one layout (an input and its placeholder, a replay's
    result and the capture's tensor); overlapping ones (``expand``) by the bytes of their span, as
    the graph's memcpy nodes copy them."""
    if TORCH.may_overlap(src):
        TORCH.flat_span(dst).copy_(TORCH.flat_span(src))
    else:
        dst.copy_(src)


def placeholders(call) -> dict:
    """As ``cuda_backend.CudaBackend.record``: a copy of each eager input with its layout (sizes,
    strides and storage offset, ``Ops.clone_layout``: a strided view keeps its gaps, as the CUDA
    backend's ``empty_layout`` placeholders do), requiring grad where the input does while grad is
    disabled (the function sees ``x.requires_grad`` as eager's does)."""
    no_grad = not call.grad and not torch.is_grad_enabled()
    return {j: TORCH.clone_layout(t.detach()).requires_grad_(no_grad and t.requires_grad)
            for j, t in enumerate(call.leaves) if call.kinds[j] == EAGER}


class CpuRecording:
    def __init__(self, backend, fn):
        self.backend, self.fn, self.name = backend, fn, fn.name
        self.capture_ms = self.instantiate_ms = 0.0
        self.grad = None
        self.reuse = None  # new output objects at every replay (ReusingBackend: test_output_reuse_cpu.py)
        self.discarded = False
        self.replays = 0

    def replay(self, call, first=False):
        why = None if first else self.stale()
        return self.backend.replay(self, call) if why is None else why

    def stale(self):
        why = None if self.grad is None else self.grad.stale()
        return why


class Poisoned:
    """The outputs an ended generation poisoned, held weakly (poisoning keeps no reference to a
    tensor on the GPU, so it never counts as a user of the tree's memory); iterates the live ones."""

    def __init__(self):
        self._refs: list = []

    def append(self, t) -> None:
        self._refs.append(weakref.ref(t))

    def __iter__(self):
        return (t for r in self._refs if (t := r()) is not None)


class CpuTorchBackend(TorchAutograd):
    def __init__(self):
        self.log: list = []
        self.poisoned = Poisoned()

    # pool bookkeeping: nothing to do on the CPU
    def snapshot(self):
        return None

    def restore(self, snap, on_path, off_path):
        pass

    def renew(self):
        return None

    def close(self):
        pass

    def input_notes(self, rec):
        return {}

    def num_nodes(self, rec):
        return 1

    def random_draws(self, rec):
        return 0

    def discard(self, rec):
        rec.discarded = True

    def end_generation(self, handed, cloning):
        """As ``CudaBackend``: outputs of the ending generation are poisoned (here: listed), or with
        ``user_visible`` cloning moved to private copies (``TorchTreeState.clone_out``)."""
        self.log.append(("end_generation",))
        handed = list(handed) + self.grad_views()
        if cloning == "user_visible":
            TorchTreeState.clone_out([t for _, t in handed])
        else:
            for _, t in handed:
                self.poisoned.append(t)

    def warm_restores(self, fn, call) -> bool:
        return False  # warm-ups run outside the pool here

    def warmup(self, fn, call, args, kwargs):
        self.log.append(("warmup", fn.name))
        before = {j: (t.detach().clone(), TORCH.version(t)) for j, t in enumerate(call.leaves)
                  if call.kinds[j] == EAGER}
        w = Warm(fn.fn(*args, **kwargs))
        # as the CUDA backend: the eager inputs the function wrote, by content and version count
        w.mutated = tuple(j for j, (t, v) in before.items()
                          if not torch.equal(t, call.leaves[j].detach()) or TORCH.version(call.leaves[j]) != v)
        w.external = tuple(getattr(fn, "params", ()))
        w.runs_backward = getattr(fn, "is_backward", False)
        try:
            out_spec(w.out, [], argument_objects(call.arg_specs, call.kwarg_specs))
        except SkipCall as exc:  # as trees.warmup: an output no replay can hand out runs eagerly
            w.skip = str(exc)
        return w

    def record(self, fn, call, warm):
        self.log.append(("record", fn.name))
        rec = CpuRecording(self, fn)
        rec.placeholders = placeholders(call)
        grad = call.grad and not warm.runs_backward
        saved: list = []
        rec.subs = capture_inputs(call, rec.placeholders) if grad else rec.placeholders
        rec.args = replace_leaves(call.arg_specs, call.kwarg_specs, call.leaves, rec.subs)
        rec.external = tuple(warm.external)
        frames = private_api.dynamo_frames()
        out = self._run(rec, saved, grad, rec.subs)
        if private_api.dynamo_frames() != frames:  # on a GPU, compiling inside a capture breaks it
            raise capture_failed("the capture was invalidated by an operation that cannot be captured", True)
        rec.out_leaves = []
        rec.objects = argument_objects(call.arg_specs, call.kwarg_specs)  # what rec.args passes
        rec.spec = out_spec(out, rec.out_leaves, rec.objects)
        rec.owned_idx = list(range(len(rec.out_leaves)))
        rec.out_ptrs = [t.data_ptr() for t in rec.out_leaves]
        rec.saved = saved
        rec.grad = grad_info(rec, call, rec.subs, saved) if grad else None
        rec.mutated = [j for j in warm.mutated if call.kinds[j] == EAGER]  # copied back after each replay
        return rec

    def _run(self, rec, saved, grad, subs):
        args, kwargs = rec.args
        if not grad:  # as cuda_backend: without grad nothing is saved and nothing is aliased
            with torch.no_grad():
                return rec.fn.fn(*args, **kwargs)
        # a replay's aliases are its own (a graph replays the recording's)
        return run_saving(rec.fn.fn, args, kwargs, saved, subs, rec.external)

    def first_replay(self, rec, call):
        return self.replay(rec, call)

    def replay(self, rec, call):
        self.log.append(("replay", rec.name))
        assert not rec.discarded
        with torch.no_grad():
            for j, ph in rec.placeholders.items():
                copy_span(ph.data, call.leaves[j])
        saved: list = []
        out = self._run(rec, saved, rec.grad is not None, {})
        flat: list = []
        out_spec(out, flat, rec.objects)
        assert len(saved) == len(rec.saved)
        with torch.no_grad():
            for old, new in zip(rec.saved + rec.out_leaves, saved + flat):
                if old is not new:
                    copy_span(old.data, new)
        with torch.no_grad():
            for j in rec.mutated:  # the graph's copy-back nodes
                copy_span(call.leaves[j], rec.placeholders[j])
        rec.replays += 1
        outs = [t.detach() for t in rec.out_leaves]
        return unflatten(rec.spec, iter(outs), argument_objects(call.arg_specs, call.kwarg_specs)), outs

    def count(self, what, name=None):
        return sum(1 for e in self.log if e[0] == what and (name is None or e[1] == name))


class ReusingBackend(CpuTorchBackend):
    """``CpuTorchBackend`` whose recordings hand out their owned outputs' objects again, as
    ``cuda_backend.CudaBackend``'s do: ``reuse_for`` at the recording, the users of those outputs'
    memory counted before the first replay, ``Reuse.take`` where ``Recording.replay`` calls it. An
    output over an input's memory (its placeholder's, or one read in place) is not the recording's
    own (``recording.output_kinds``): it is made per replay."""

    def record(self, fn, call, warm):
        rec = super().record(fn, call, warm)
        # a graph reads the inputs it takes in place at their addresses and keeps no object of them (a
        # forward's objects, handed out again, would be held by its backward): each replay reads the call's
        rec.args = None
        inputs = {t.untyped_storage().data_ptr() for t in (*rec.placeholders.values(), *call.leaves)
                  if isinstance(t, torch.Tensor)}
        rec.owned_idx = [i for i, t in enumerate(rec.out_leaves) if t.untyped_storage().data_ptr() not in inputs]
        rec.out_alias = [t.detach if i in rec.owned_idx else None for i, t in enumerate(rec.out_leaves)]
        rec.tree_views, rec.out_same, rec.bucket = (), repeated_leaves(rec.out_leaves), None
        rec.out_args = names_inputs(rec.spec)
        rec.reuse = reuse_for(fn, rec)
        return rec

    def first_replay(self, rec, call):
        if rec.reuse is not None:
            rec.users = [(u, u()) for u in (ops_of(rec.out_leaves[i]).users(rec.out_leaves[i]) for i in rec.owned_idx)]
        return self.replay(rec, call)

    def replay(self, rec, call):
        rec.args = replace_leaves(call.arg_specs, call.kwarg_specs, call.leaves, rec.subs)
        try:
            out, flat = super().replay(rec, call)
        finally:
            rec.args = None
        if rec.reuse is None:
            return out, flat
        objs = rec.reuse.take(rec)
        for i, t in zip(rec.owned_idx, objs):
            flat[i] = t
        return unflatten(rec.spec, iter(flat), argument_objects(call.arg_specs, call.kwarg_specs)), objs

    def discard(self, rec):
        super().discard(rec)
        if rec.reuse is not None:
            rec.reuse.forget()
