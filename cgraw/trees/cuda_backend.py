"""The CUDA backend of graph trees: warm up, record, replay, restore, end generations.

Layer L8 (beside ``capture``): uses ``capture``, ``memory``, ``graph``, ``recording`` and the
framework adapters; ``manager`` drives it (the ``nodes.Backend`` protocol) with calls that
``calls.inspect`` classified. Per eager input a recording copies the caller's array into a
placeholder by a memcpy node at the start of the graph, re-pointed before a launch only when the
caller's address changed (``recording.InputCopy``); eager inputs found mutated at warm-up (or
declared in ``mutates``) are copied back by a memcpy node at the end of the graph.

Outputs are classified at record time: memory the recording allocated in the tree's pool is
*owned* (aliased per call, or by the last call's aliases where compiled code dropped them:
``outputs.Reuse``; poisoned when its generation ends); an output that is an input or a view of
one is rebuilt from the caller's input on every call (as eager returns it); any other tensor
(a parameter, a closure buffer) is returned as is, a view of one made anew per call
(``recording.output_kinds``). Only owned memory is ever poisoned.

Tensors a function reads through its closure (found by the warm-up's observer,
``interop.torch.observe``) are kept alive by the recording and their addresses checked on every call
(``stale``); a moved one, or a module assignment anywhere since the recording, makes the node
warm up again.
"""

from __future__ import annotations

import logging
import sys

from cgraw import _cuda
from cgraw.trees import buckets, warmup as pool_warmup
from cgraw.rebind import proof as rebind_proof, ranges as rebind_ranges
from cgraw.runtime import stream as _streams
from cgraw.trees.arrays import EAGER, TORCH, argument_objects, names_inputs, one_leaf, ops_of, out_spec, replace_leaves
from cgraw.trees.calls import Call, use_kernel_state, use_torch
from cgraw.runtime.capture import capture
from cgraw.errors import CaptureError, CudaError, SkipCall, UnsafeCallError
from cgraw.interop.torch import observe as _observe, private_api
from cgraw.interop.torch.autograd import NoRebind, TorchAutograd, capture_inputs, grad_info, run_saving
from cgraw.interop.torch.kernel_state import kernel_state
from cgraw.interop.torch.checkpoints import TorchTreeState
from cgraw.runtime.memory import DevicePool
from cgraw.trees.recording import OWNED, InputCopy, Recording, output_kinds, repeated_leaves, tree_views
from cgraw.trees.nodes import Warm, capture_failed, split_external
from cgraw.trees.config import config, grad_probe
from cgraw.trees.input_plan import demote_in_pool
from cgraw.trees.outputs import reuse_for

log = logging.getLogger("cgraw")

OVERWRITTEN = (
    "accessing tensor output of a cgraw graph that has been overwritten by a subsequent run "
    "(output of graphed function {name!r}); clone it (.clone()) before the graphed functions run "
    "again, or call cgraw.mark_step_begin() where a new step begins"
)


class CudaBackend(TorchAutograd):
    """Does the work of one device's ``TreeManager`` (the ``nodes.Backend`` protocol; autograd: the mixin)."""

    def __init__(self, device):
        self.device = device
        self.pool = DevicePool(device, name=f"tree{device.ordinal}")
        self._torch = None
        self._tts = None  # torch's side of the pool: interop.torch.checkpoints.TorchTreeState
        self._messages: dict[str, str] = {}
        self.warm_in_pool = True  # warm-ups run inside the pool (cgraw.trees.warmup) until one keeps state there
        if "torch" in sys.modules:
            private_api.check()
            self._torch = sys.modules["torch"]
            use_torch(self._torch.Tensor, self._torch.nn.Parameter)
            self._tts = TorchTreeState.for_pool(self.pool)
            _observe.install_module_hooks()
            grad_probe(self._torch.is_grad_enabled)  # grad mode joins the key while config.autograd
            use_kernel_state(kernel_state())  # so do the settings that choose kernels (autocast, TF32, ...)
        _streams.refresh()

    # ------------------------------------------------------------------ warm-up, record, replay

    def warmup(self, fn, call: Call, args, kwargs) -> Warm:
        """Run eagerly, inside the pool where ``warmup.usable`` (``warmup.run``)."""
        return pool_warmup.run(self, fn, call, args, kwargs)

    def warm_restores(self, fn, call: Call) -> bool:
        if not pool_warmup.usable(self, fn, call):
            return False
        in_pool = self._pool_owner()  # (a written static input there: no restore; the recording refuses it)
        return demote_in_pool(fn, call, in_pool) is None and not any(
            k == EAGER and in_pool(p) for k, p in zip(call.kinds, call.ptrs, strict=True))

    def record(self, fn, call: Call, warm: Warm) -> Recording:
        leaves, kinds, ops, mutated = call.leaves, call.kinds, call.ops, warm.mutated
        in_pool = self._pool_owner()
        if (why := demote_in_pool(fn, call, in_pool)) is not None:  # else such inputs are copied out as eager ones
            raise SkipCall(why)
        for j in mutated:
            if kinds[j] == EAGER and _node_bytes(call, j) != ops[j].nbytes(leaves[j]):
                raise SkipCall("skipping cudagraphs due to mutated inputs (an eager input whose elements have "
                               "gaps or overlaps between them)")
        # a backward inside the function differentiates with respect to the placeholders of the eager
        # inputs that require grad: autograd leaves too (the warm-up saw it leave .grad as it was);
        # with grad disabled they require grad too: a function may read x.requires_grad
        no_grad = not call.grad and self._torch is not None and not self._torch.is_grad_enabled()
        leaf_grad = [j for j, t in enumerate(leaves) if (warm.runs_backward or no_grad) and kinds[j] == EAGER
                     and getattr(t, "requires_grad", False)]
        if warm.runs_backward and any(leaves[j].grad is not None for j in leaf_grad):
            raise SkipCall("an eager input's .grad holds a gradient that a backward inside the function adds to")
        # An eager input in the tree's pool (h = f(h) across a new branch) may sit in blocks the restore
        # just freed, where this recording's placeholders can land: copy it out first (nothing wrote there)
        fed_back = [j for j in range(len(leaves)) if kinds[j] == EAGER and in_pool(call.ptrs[j])]
        for j in fed_back:
            clone = ops[j].clone_layout(leaves[j])
            leaves[j] = clone
            call.ptrs[j] = ops[j].ptr(clone)
        rec = Recording(fn.name)
        cap = capture.for_tree(self.pool, self.device, warm_cublas=config.warm_cublas,
                               route="stream" if warm.runs_backward else "thread",
                               empty_cache=config.empty_cache_on_record, compiled=_observe.is_compiled(fn.fn))
        placeholders, saved = {}, []  # saved: what autograd saves, when the capture records a backward
        grad, subs, reason = call.grad and not warm.runs_backward, placeholders, None
        frames = private_api.dynamo_frames()
        try:
            with cap as g:
                stream = g.capture_stream
                for j, t in enumerate(leaves):
                    if kinds[j] == EAGER:
                        o = ops[j]
                        # the function sees the caller's layout (sizes, strides, offset), so it
                        # runs the kernels eager runs and returns outputs with eager's strides
                        ph = buckets.empty_rows(t, call.bucket) if j in call.padded else o.empty_layout(t)
                        if j in leaf_grad:
                            ph.requires_grad_()
                        placeholders[j] = ph
                        # an input is copied by a memcpy node over its span (source patched per call);
                        # one whose span is mostly gaps element by element before each launch (replay),
                        # never by a captured kernel, which would bake in this call's address
                        n = _node_bytes(call, j)
                        if n:
                            stream.copy_dtod(o.ptr(ph), call.ptrs[j], n)
                subs = capture_inputs(call, placeholders) if grad else placeholders
                new_args, new_kwargs = replace_leaves(call.arg_specs, call.kwarg_specs, leaves, subs)
                out = (run_saving(fn.fn, new_args, new_kwargs, saved, subs, warm.external) if grad
                       else fn.fn(*new_args, **new_kwargs))
                for j in mutated:
                    if kinds[j] == EAGER and ops[j].nbytes(leaves[j]):
                        stream.copy_dtod(call.ptrs[j], ops[j].ptr(placeholders[j]), _node_bytes(call, j))
        except (CaptureError, UnsafeCallError) as exc:
            reason = _skip_reason(exc)
        except BaseException:
            for h in (placeholders, subs, saved):  # nothing of the failed capture stays alive through this frame
                h.clear()
            raise
        if reason is not None:
            # raised outside the except block, so no traceback keeps the failed capture's tensors
            # alive: torch's pool gets their blocks back as they die
            for h in (placeholders, subs, saved):
                h.clear()
            raise capture_failed(reason, private_api.dynamo_frames() != frames)
        try:
            self._finish_recording(rec, g, call, placeholders, warm, out, fed_back)
        except BaseException as exc:
            g.close()
            if isinstance(exc, SkipCall):
                exc.dirty = True  # the capture's blocks are in the pool: restore before recording
            raise
        rec.reuse = reuse_for(fn, rec)  # compiled code's pieces hand their output objects out again
        # the closure tensors the node's key names (warm.keyed: a StaticCache's, reached through an
        # argument) are held weakly, as the node holds them: once they die no call matches the key
        strong, keyed = split_external(warm)
        rec.external, rec.keyed = tuple(warm.external), warm.keyed  # all of them, for the backward's inputs
        if grad and self._tts is not None:  # the saved tensors are the recording's blocks too
            rec.grad = grad_info(rec, call, subs, saved)
            rec.spans = self._tts.spans(list(rec.keep[0]) + [rec.out_leaves[i] for i in rec.owned_idx] + saved)
        rec.external = strong
        _observe.watch(rec.external)
        rec.ext_ptrs = [ops_of(t).ptr(t) for t in (*rec.external, *keyed)]
        rec.same_external = _observe.ptrs_check(rec.external, rec.keyed) if rec.ext_ptrs else None
        # a module assignment between the warm-up and now: the closure tensors found at warm-up
        # may not be the ones this recording reads, so the next call warms up again
        rec.epoch_now = _observe.epoch_now
        rec.epoch = _observe.epoch_now[0] if warm.epoch == _observe.epoch_now[0] else -1
        rec.mode_now = _observe.mode_epoch_now
        rec.mode_epoch = warm.mode_epoch
        return rec

    def _finish_recording(self, rec: Recording, g, call: Call, placeholders: dict, warm: Warm, out, fed_back) -> None:
        leaves, kinds, ops, mutated = call.leaves, call.kinds, call.ops, warm.mutated
        rec.graph = g
        rec.exec_, rec.ordinal = g.exec_handle(), g.device.ordinal
        rec.rng_sync = None if g.rng is None else g.rng.sync
        rec.setter = g.exec_memcpy_setter()
        rec.copy_slow = self._slow_copies
        rec.capture_ms, rec.instantiate_ms = g.capture_ms, g.instantiate_ms
        memcpys = g.memcpy_nodes()
        copies_back = []
        for j, ph in placeholders.items():
            t, o = leaves[j], ops[j]
            if not o.nbytes(t):
                continue
            dst, n = o.ptr(ph), _node_bytes(call, j)
            if n:
                node = memcpys.get((dst, call.ptrs[j]))
                if node is None:
                    raise SkipCall("could not find the input-copy node in the captured graph")
                rec.copies.append(InputCopy(j, node, dst, call.ptrs[j], n, _row_bytes(call, j), back=False))
            else:
                rec.slow_in.append((j, ph))
        for j in mutated:
            n = _node_bytes(call, j)
            if kinds[j] == EAGER and n:
                src = ops[j].ptr(placeholders[j])
                node = memcpys.get((call.ptrs[j], src))
                if node is None:
                    raise SkipCall("could not find the copy-back node in the captured graph")
                copies_back.append(InputCopy(j, node, src, call.ptrs[j], n, _row_bytes(call, j), back=True))
        rec.copies.extend(copies_back)
        out_leaves: list = []
        rec.out_spec = out_spec(out, out_leaves, argument_objects(call.arg_specs, call.kwarg_specs))
        rec.out_args = names_inputs(rec.out_spec)
        reason = pool_warmup.cpu_output(out_leaves)
        if reason is not None:
            raise SkipCall(reason)
        rec.out_leaves = out_leaves
        rec.out_kinds = self._output_kinds(call, placeholders, out_leaves)
        rec.out_alias = [ops_of(t).alias_maker(t) if k is OWNED else None
                         for t, k in zip(out_leaves, rec.out_kinds)]
        rec.owned_idx = [i for i, k in enumerate(rec.out_kinds) if k is OWNED]
        rec.tree_views = tree_views(call, rec.out_kinds)
        rec.out_same = repeated_leaves(out_leaves)
        owned = [out_leaves[i] for i in rec.owned_idx]
        rec.out_ptrs = [p for p in (ops_of(t).ptr(t) for t in owned) if p]
        # one owned output, alone or in a tuple or list of one (Inductor's code): its alias maker, bound once
        if call.bucket is None and rec.out_kinds == [OWNED] and (seq := one_leaf(rec.out_spec)) is not False:
            rec.alias0, rec.seq0 = rec.out_alias[0], seq  # (t.detach for torch, a.view for CuPy)
        rec.bucket, rec.padded = call.bucket, call.padded
        rec.out_rows = ([i for i in buckets.out_rows(out_leaves, call.bucket, warm.rows, rec.out_spec)
                         if rec.out_kinds[i] is OWNED]
                        if call.bucket is not None else [])  # inputs and closure tensors are returned whole
        rec.keep = (list(placeholders.values()), out)
        # only storages in torch's MemPool take part in its checkpoints: a torch view of CuPy
        # memory (torch.from_dlpack) has a DLPack deleter and lives in cgraw's own pool
        rec.spans = [] if self._tts is None else self._tts.spans(list(placeholders.values()) + owned)
        # which eager inputs may be read in place: proven on the first replay
        rec.in_pool = self._pool_owner()  # segments of now: later ones hold nothing this graph writes
        rec.stage = self._stage
        try:
            # a backward reads the placeholders the forward saved: copied inputs, only when one can run
            backward = call.grad and any(getattr(t, "requires_grad", False) for t in out_leaves)
            rebind_proof.plan(rec, g, call, placeholders, NoRebind if backward else config, fed_back)
        except CudaError as exc:
            rec.proof = None
            rec.input_notes = {c.leaf: f"cgraw could not read the graph's nodes ({exc.call}: {exc.name})"
                               for c in rec.copies if not c.back}

    def _stage(self, rec: Recording, call: Call, rebind):  # a Recording's ``stage``
        """``rebind`` given: copy its input on the replay's stream into the copy an earlier call on
        that stream staged (``InputRebind.staging``; the graph already points there), else into
        fresh memory at the recording's alignment, kept for the next call; return its address.
        None: after the launch, copy the staged inputs the function writes back into the caller's
        arrays (``rec.staged``)."""
        target = _streams.current_getter(self.device.ordinal)
        if rebind is None:
            for r, copy in rec.staged:
                if r.back:
                    _copy_on(call.leaves[r.leaf], copy, call.ops[r.leaf], target)
            return None
        j = rebind.leaf
        o, t = call.ops[j], call.leaves[j]
        copy = rebind.staging(target)
        if copy is None:
            copy = o.empty_layout(t, align=rebind.base & 255)  # the recording's alignment, which its kernels assume
            rebind.held = (copy, target)
        # one driver copy of the span (torch's strides are never negative; the layouts match), where
        # the device's context is current (a legacy stream handle means the current context's stream)
        if o is TORCH and _cuda.native(_cuda.ctx_get_current()) == _cuda.native(self.device.context):
            _cuda.memcpy_dtod_async(o.ptr(copy), o.ptr(t), o.span(t), target)
        else:
            _copy_on(o.flat_span(copy), o.flat_span(t), o, target)
        rec.staged.append((rebind, copy))
        return o.ptr(copy)

    def first_replay(self, rec: Recording, call: Call):
        """The recording's first call: its inputs read in place where ``rebind.proof.prove`` shows
        that is safe, else as recorded. Returns what ``Recording.replay`` returns. Before it, the
        users of the owned outputs' memory are counted: what the recording itself holds, once the
        capture's temporaries are gone, is the baseline above which an alias is alive."""
        rec.users = [(u, u()) for u in (ops_of(t).users(t) for t in (rec.out_leaves[i] for i in rec.owned_idx))
                     if u is not None]
        if rec.proof is None:
            return rec.replay(call, first=True)
        return rebind_proof.prove(self, rec, call)

    def drop_placeholders(self, rec: Recording, placeholders: list) -> None:
        """Let placeholders no graph node reads any more go back to the pool: nothing keeps them
        then, torch's owner of their block included (otherwise it keeps a 64 MiB placeholder of a
        rebound input allocated for the life of the recording; ``tools/probes/pool_probe.py``)."""
        gone = {id(p) for p in placeholders}
        rec.keep = ([p for p in rec.keep[0] if id(p) not in gone], rec.keep[1])
        if self._tts is not None:
            for p in placeholders:
                if ops_of(p) is TORCH:
                    self._tts.owners.pop(p.untyped_storage().data_ptr(), None)
            rec.spans = self._tts.spans(rec.keep[0] + [rec.out_leaves[i] for i in rec.owned_idx])

    def input_notes(self, rec: Recording) -> dict:
        """``{leaf: None (read in place) or why it is copied}`` of the contiguous eager inputs."""
        return rec.input_notes

    def _output_kinds(self, call: Call, placeholders: dict, out_leaves: list) -> list:
        """``recording.output_kinds`` of a recording in this tree's pool."""
        return output_kinds(call, placeholders, out_leaves, self._pool_owner())

    def _pool_owner(self):
        """``ptr -> bool``: whether memory lies in the tree's pool (cgraw's part or torch's) now."""
        return rebind_ranges.pool_at_record(self.pool, None if self._tts is None else self._tts.pool)

    def _slow_copies(self, rec: Recording, call: Call, rows) -> None:  # a Recording's ``copy_slow``
        """Copy non-contiguous eager inputs into their placeholders, on the stream the replay
        will run on (``stream.current_ptr``), whichever framework's current stream that is."""
        target = _streams.current_getter(self.device.ordinal)
        for j, ph in rec.slow_in:
            dst = ph[:rows] if rows is not None and j in rec.padded else ph
            _copy_on(dst, call.leaves[j], call.ops[j], target)

    def num_nodes(self, rec: Recording) -> int:
        return rec.graph.num_nodes

    def random_draws(self, rec: Recording) -> int:
        """Random-number kernels in the recording (fresh numbers on every replay)."""
        return 0 if rec.graph.rng is None else rec.graph.rng.draws

    def discard(self, rec: Recording) -> None:
        rec.proof, rec.rebinds = None, []
        rec.graph.close()
        rec.keep = None
        _observe.unwatch(rec.external)
        rec.external, rec.keyed, rec.same_external = (), (), None
        if rec.reuse is not None:
            rec.reuse.forget()

    # ------------------------------------------------------------------ pool checkpoints

    def snapshot(self):
        return (self.pool.snapshot(), None if self._tts is None else self._tts.checkpoint())

    def restore(self, snap, on_path: list, off_path: list) -> None:
        cg, torch_ckpt = snap
        plan = None
        if self._tts is not None and torch_ckpt is not None:
            # every check torch would make, before anything changes: RestoreRefused otherwise
            plan = self._tts.plan_restore(torch_ckpt, [r.spans for r in on_path])
        self.pool.restore(cg)
        if plan is not None:
            # torch's owners of blocks change here, and with them what the recordings on the path
            # hold of their outputs' memory: their baselines move by as much (callers' aliases do not)
            before = [[u() for u, _ in r.users] for r in on_path]
            self._tts.apply_restore(torch_ckpt, plan)
            for r, counts in zip(on_path, before):
                r.users = [(u, base + u() - c) for (u, base), c in zip(r.users, counts)]

    def renew(self):
        """Start over on a fresh pool. The old pool is not closed: whatever still holds its memory
        (outputs handed out, a stashed tensor) keeps it valid, and it is released once all of
        that is gone. Returns the new root checkpoint."""
        self.pool = DevicePool(self.device, name=f"tree{self.device.ordinal}")
        if self._torch is not None:
            self._tts = TorchTreeState.for_pool(self.pool)
        return self.snapshot()

    # ------------------------------------------------------------------ generations

    def end_generation(self, handed: list, cloning: str | None) -> None:
        """Poison (or, with ``user_visible`` cloning, clone out) the owned torch outputs handed
        out (CuPy arrays cannot be poisoned, see the README: they are skipped)."""
        tts = self._tts
        if tts is None:
            return
        views = self.grad_views()  # the autograd outputs that alias them
        if views:
            handed = list(handed) + views
        elif not handed:  # a root function called in a loop, its last output dropped
            return
        if cloning == "user_visible":
            tts.clone_out([t for _, t in handed if ops_of(t).poisonable])
            return
        poison, messages = tts.poison, self._messages
        for name, t in handed:
            if not ops_of(t).poisonable:
                continue
            msg = messages.get(name)
            if msg is None:
                msg = messages[name] = OVERWRITTEN.format(name=name)
            poison(t, msg)

    def close(self) -> None:
        """Drop the tree's pool. Memory still referenced (outputs handed out, CuPy arrays) stays
        valid; the pool's segments go back once nothing uses them and no capture routes."""
        self.pool = None
        self._tts = None
        if self._torch is not None:
            from cgraw._cuda import defer

            defer.release(self._torch.cuda.empty_cache)


# ---------------------------------------------------------------------- helpers


def _copy_on(dst, src, ops, target: int) -> None:
    """``dst[...] = src`` on stream ``target`` (a raw handle), whichever framework owns ``dst``."""
    if ops is TORCH:
        torch = sys.modules["torch"]
        if torch.cuda.current_stream(dst.device).cuda_stream == target:
            dst.copy_(src)
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(target, device=dst.device)):
            dst.copy_(src)
        return
    cupy = sys.modules["cupy"]
    if cupy.cuda.get_current_stream().ptr == target:
        ops.copy_into(dst, src)
        return
    from cgraw.interop.cupy.pools import external_stream
    from cgraw.runtime.stream import Stream

    with external_stream(cupy, Stream.from_handle(target, dst.device.id), dst.device.id):
        ops.copy_into(dst, src)


def _node_bytes(call: Call, j: int) -> int:
    """Bytes the memcpy node of eager input ``j`` copies (``Ops.node_bytes``; a padded input's
    placeholder is contiguous, so only a contiguous one), or 0: copied element by element."""
    o, t = call.ops[j], call.leaves[j]
    if j in call.padded:
        return o.nbytes(t) if o.contiguous(t) else 0
    return o.node_bytes(t)


def _row_bytes(call: Call, j: int) -> int:
    """Bytes per row of a padded eager input (its copy node's count is rows x this), else 0."""
    return call.ops[j].nbytes(call.leaves[j]) // call.rows if j in call.padded else 0


def _skip_reason(exc) -> str:
    if isinstance(exc, UnsafeCallError):
        return str(exc)
    text = exc.description or str(exc)
    if "host synchronisation" in text:
        return "host synchronisation during capture (" + text + ")"
    if "random numbers" in text:
        return "torch random numbers (" + text + ")"
    return text
