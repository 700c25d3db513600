"""The CUDA backend of graph trees: inspect a call's inputs, warm up, record, replay, restore.

Layer L8 (beside ``capture``): uses ``capture``, ``memory``, ``graph`` and the framework
adapters; ``tree`` drives it. Inputs are classified per call:
- *static*: torch ``nn.Parameter``s, the parameters and buffers of an ``nn.Module`` argument,
  tensors marked with ``cgraw.mark_static`` or ``torch._dynamo.mark_static_address``, and
  positions in ``static_argnums``. Read in place; their address is checked on every call.
- *tree outputs*: outputs of earlier graphed calls in this generation. Read in place; checked too.
- *eager*: everything else. Copied into a placeholder by a memcpy node at the start of the graph,
  whose source pointer is patched before a launch only when it changed.
Eager inputs found mutated at warm-up are copied back by a memcpy node at the end of the graph.

Outputs are classified at record time: memory the recording allocated in the tree's pool is
*owned* (aliased per call, poisoned when its generation ends); an output that is an input or a
view of one is rebuilt from the caller's input on every call (as eager returns it); any other
tensor (a parameter, a closure buffer) is returned as is. Only owned memory is ever poisoned.

Tensors a function reads through its closure (found by the warm-up's observer,
``interop.observe``) are kept alive by the recording and their addresses checked on every call;
a moved one, or a module assignment anywhere since the recording, makes the node warm up again.
"""

from __future__ import annotations

import logging
import sys

from cgraw import _cuda, buckets
from cgraw import stream as _streams
from cgraw.arrays import (
    _SINGLE,
    EAGER,
    LEAF,
    STATIC,
    TREE,
    _alias,
    _alias_maker,
    _base_ptr,
    _clone,
    _copy_into,
    _device_index,
    _empty_like,
    _equal,
    _flatten,
    _is_contiguous,
    _is_torch,
    _nbytes,
    _NoType,
    _ptr,
    _replace,
    _spec,
    _unflatten,
    _view_of,
)
from cgraw.capture import capture
from cgraw.errors import CaptureError
from cgraw.interop import observe as _observe
from cgraw.interop import torch_c
from cgraw.interop.torch_tree import TorchTreeState
from cgraw.memory import DevicePool
from cgraw.tree import Rewarm, SkipCall, Warm

log = logging.getLogger("cgraw")

OVERWRITTEN = (
    "accessing tensor output of a cgraw graph that has been overwritten by a subsequent run "
    "(output of graphed function {name!r}); clone it (.clone()) before the graphed functions run "
    "again, or call cgraw.mark_step_begin() where a new step begins"
)

_static_ids: dict[int, object] = {}  # id(tensor) -> weakref, filled by mark_static

OWNED, EXTERNAL = "owned", "external"  # output kinds; an input alias is a tuple (j, base)


def mark_static(x):
    """Mark a tensor or array as a static input of graphed functions (read in place, never copied)."""
    import weakref

    key = id(x)
    _static_ids[key] = weakref.ref(x, lambda _r, k=key: _static_ids.pop(k, None))
    return x


class Call:
    """One call's inputs: the signature ``key``, tensor ``leaves`` with their kinds and pointers,
    and the specs that rebuild the arguments around them."""

    __slots__ = ("key", "leaves", "kinds", "ptrs", "arg_spans", "arg_specs", "kwarg_specs", "rows", "bucket",
                 "padded")

    def __init__(self, key, leaves, kinds, ptrs, arg_spans, arg_specs=None, kwarg_specs=None):
        self.key = key
        self.leaves = leaves
        self.kinds = kinds
        self.ptrs = ptrs
        self.arg_spans = arg_spans  # (first leaf, leaf count) of each positional argument
        self.arg_specs = arg_specs  # one spec per positional argument (arrays._flatten)
        self.kwarg_specs = kwarg_specs  # [(name, spec)] in sorted name order, or None
        self.bucket = None  # padding buckets (cgraw.buckets): the bucket, the call's rows and
        self.rows = None  # the padded leaves, when the function has buckets and the call fits one
        self.padded = frozenset()


class Recording:
    """A recorded node: the graph, its input copies, its outputs and what keeps them alive."""

    __slots__ = ("graph", "exec_rt", "copies_in", "slow_in", "copies_back", "fixed", "kinds", "out_leaves",
                 "out_kinds", "owned_idx", "alias0", "out_spec", "out_ptrs", "spans", "keep", "bucket", "padded",
                 "out_rows", "capture_ms", "instantiate_ms", "name", "external", "ext_ptrs", "same_external",
                 "epoch")


class CudaBackend:
    """Does the work of one device's ``TreeManager``."""

    def __init__(self, device):
        self.device = device
        self.pool = DevicePool(device, name=f"tree{device.ordinal}")
        self._torch = None
        self._tts = None  # torch's side of the pool: interop.torch_tree.TorchTreeState
        self._tensor = _NoType  # torch.Tensor when torch is loaded: exact-type fast paths
        self._messages: dict[str, str] = {}
        if "torch" in sys.modules:
            torch_c.check()
            self._torch = sys.modules["torch"]
            self._tensor = self._torch.Tensor
            self._poison = torch_c.api()._set_storage_access_error_msg
            self._tts = TorchTreeState.for_pool(self.pool)
            _observe.install_module_hooks()
        _streams.refresh()

    # ------------------------------------------------------------------ inputs

    def inspect(self, fn, args, kwargs, tree_outputs) -> Call:
        leaves, key_parts, kinds, ptrs, specs = [], [], [], [], []
        dev = None
        static_pos = fn.static_argnums
        spans = []
        T = self._tensor
        for i, a in enumerate(args):
            first = len(leaves)
            if type(a) is T and i not in static_pos:  # the common case, without generic dispatch
                try:
                    p = a.data_ptr()
                except RuntimeError as exc:  # sparse, meta, ...: no storage to copy or read in place
                    raise SkipCall(f"a tensor input has no data pointer ({exc})") from None
                leaves.append(a)
                key_parts.append((a.shape, a.stride(), a.dtype))
                kinds.append(STATIC if id(a) in _static_ids else (TREE if p in tree_outputs else EAGER))
                ptrs.append(p)
                spans.append((first, 1))
                specs.append(LEAF)
                continue
            specs.append(_flatten(a, leaves, key_parts, kinds, ptrs, STATIC if i in static_pos else None))
            spans.append((first, len(leaves) - first))
        kwarg_specs = None
        if kwargs:
            kwarg_specs = []
            for k in sorted(kwargs):
                key_parts.append(k)
                kwarg_specs.append((k, _flatten(kwargs[k], leaves, key_parts, kinds, ptrs, None)))
        for j, t in enumerate(leaves):
            d = t.get_device() if type(t) is T else _device_index(t)
            if d < 0:
                raise SkipCall("CPU tensors or ops: an input lives on the CPU")
            if dev is None:
                dev = d
            elif d != dev:
                raise SkipCall("tensors on several devices")
            if kinds[j] is None:
                p = ptrs[j]
                if id(t) in _static_ids:
                    kinds[j] = STATIC
                elif p in tree_outputs:
                    kinds[j] = TREE
                else:
                    kinds[j] = EAGER
        if dev is not None and dev != self.device.ordinal:
            raise SkipCall(f"inputs on device {dev}, but this tree is on device {self.device.ordinal}")
        # the kinds are not part of the key: the first call of a path sees warm-up outputs (eager)
        # where later calls see tree outputs; a recording checks its kinds in moved()
        call = Call(tuple(key_parts), leaves, kinds, ptrs, spans, specs, kwarg_specs)
        if fn.pad_buckets:
            chosen = buckets.choose(fn.pad_buckets, leaves, kinds, EAGER)
            if chosen is not None:
                call.rows, call.bucket, call.padded = chosen
                call.key = buckets.padded_key(key_parts, leaves, call.padded, call.bucket)
        return call

    def moved(self, rec: Recording, call: Call) -> str | None:
        if call.kinds != rec.kinds:
            return f"input kinds changed (0 eager, 1 static, 2 tree output): {rec.kinds} -> {call.kinds}"
        ptrs = call.ptrs
        for j, p in rec.fixed:
            if ptrs[j] != p:
                what = "static input" if call.kinds[j] == STATIC else "tree-output input"
                return f"{what} {j} moved from 0x{p:x} to 0x{ptrs[j]:x}"
        if rec.epoch != _observe._epoch[0]:
            return Rewarm("a module's parameter, buffer or submodule was reassigned since the recording "
                          "(the tensors it reads through its closure may have changed)")
        same = rec.same_external
        if same is not None and not same(rec.ext_ptrs):
            return Rewarm("a tensor the function reads through its closure moved (model.half(), .to(), "
                          "param.data = ...)")
        return None

    # ------------------------------------------------------------------ warm-up, record, replay

    def warmup(self, fn, call: Call, args, kwargs) -> Warm:
        """Run eagerly; report which eager inputs the function mutated (compared by content), the
        tensors it reads through its closure, and a reason to skip it, if any."""
        before = [(j, _clone(t)) for j, t in enumerate(call.leaves) if call.kinds[j] == EAGER]
        torch = self._torch
        obs = None
        epoch = _observe._epoch[0]
        if torch is not None:
            # a backward pass unpacks saved tensors: then the recording must route allocations
            # by stream, where autograd's device thread allocates, rather than by thread
            def unpacked(x):
                fn.runs_backward = True
                return x

            if not _observe.is_compiled(fn.fn):
                obs = _observe.observer(call.leaves)
            with torch.autograd.graph.saved_tensors_hooks(lambda x: x, unpacked):
                if obs is not None:
                    with obs:
                        out = fn.fn(*args, **kwargs)
                else:
                    out = fn.fn(*args, **kwargs)
        else:
            out = fn.fn(*args, **kwargs)
        mutated = tuple(j for j, copy in before if not _equal(copy, call.leaves[j]))
        for j in mutated:
            if not _is_contiguous(call.leaves[j]):
                log.warning("cgraw: %s mutates non-contiguous eager input %d", fn.name, j)
        declared = tuple(j for i in fn.mutates if i < len(call.arg_spans)
                         for j in range(call.arg_spans[i][0], sum(call.arg_spans[i])) if call.kinds[j] == EAGER)
        w = Warm(out, mutated + tuple(j for j in declared if j not in mutated))
        out_leaves: list = []
        try:
            _spec(out, out_leaves)
        except SkipCall as exc:
            w.skip = str(exc)
        if w.skip is None:
            w.skip = _cpu_output(out_leaves)
        if obs is not None:
            if obs.unsafe is not None:
                w.skip = (f"calls custom op {obs.unsafe}, tagged torch._C.Tag.cudagraph_unsafe (as torch's "
                          "CUDAGraph Trees, cgraw runs such functions eagerly)")
            elif w.skip is None and obs.cpu_random is not None:
                w.skip = (f"CPU tensors or ops: CPU random numbers ({obs.cpu_random}) would repeat on every "
                          "replay")
            w.external = obs.external(list(call.leaves) + out_leaves)
        w.epoch = _observe._epoch[0] if _observe._epoch[0] == epoch else -1
        return w

    def record(self, fn, call: Call, args, kwargs, mutated, external=(), epoch=-1) -> Recording:
        leaves, kinds = call.leaves, call.kinds
        for j in mutated:
            if kinds[j] == EAGER and not _is_contiguous(leaves[j]):
                raise SkipCall("skipping cudagraphs due to mutated inputs (a non-contiguous eager input)")
        # An eager input living in the tree's own pool (h = f(h) across a new branch: the previous
        # step's output) may sit in blocks the checkpoint restore just freed, where this
        # recording's placeholders can land. Copy it out first; nothing has written there yet.
        in_pool = self._pool_owner()
        for j, t in enumerate(leaves):
            if kinds[j] == EAGER and in_pool(call.ptrs[j]):
                clone = _clone(t)
                leaves[j] = clone
                call.ptrs[j] = _ptr(clone)
        rec = Recording()
        rec.name = fn.name
        cap = capture(pool=self.pool, device=self.device, warm_cublas=_config().warm_cublas, _tree=True,
                      _route="stream" if fn.runs_backward else "thread")
        placeholders = {}
        reason = None
        try:
            with cap as g:
                stream = g.capture_stream.handle
                for j, t in enumerate(leaves):
                    if kinds[j] == EAGER:
                        ph = buckets.empty_rows(t, call.bucket) if j in call.padded else _empty_like(t)
                        placeholders[j] = ph
                        # a contiguous input is copied by a memcpy node whose source is patched per
                        # call; a non-contiguous one is copied eagerly before each launch (replay),
                        # never by a captured kernel, which would bake in this call's address
                        if _nbytes(t) and _is_contiguous(t):
                            _cuda.memcpy_dtod_async(_ptr(ph), call.ptrs[j], _nbytes(t), stream)
                new_args, new_kwargs = _replace(call.arg_specs, call.kwarg_specs, leaves, placeholders)
                out = fn.fn(*new_args, **new_kwargs)
                for j in mutated:
                    if kinds[j] == EAGER and _nbytes(leaves[j]):
                        _cuda.memcpy_dtod_async(call.ptrs[j], _ptr(placeholders[j]), _nbytes(leaves[j]), stream)
        except CaptureError as exc:
            reason = _skip_reason(exc)
        except BaseException:
            placeholders.clear()  # nothing of the failed capture stays alive through this frame
            raise
        if reason is not None:
            # raised outside the except block, so no traceback keeps the failed capture's tensors
            # alive: torch's pool gets their blocks back as they die
            placeholders.clear()
            raise SkipCall(reason)
        try:
            rec = self._finish_recording(rec, g, call, placeholders, mutated, out)
        except BaseException as exc:
            g.close()
            if isinstance(exc, SkipCall):
                exc.dirty = True  # the capture's blocks are in the pool: restore before recording
            raise
        rec.external = tuple(external)
        _observe.watch(rec.external)
        rec.ext_ptrs = [_ptr(t) for t in rec.external]
        rec.same_external = _observe.ptrs_check(rec.external) if rec.external else None
        # a module assignment between the warm-up and now: the closure tensors found at warm-up
        # may not be the ones this recording reads, so the next call warms up again
        rec.epoch = _observe._epoch[0] if epoch == _observe._epoch[0] else -1
        return rec

    def _finish_recording(self, rec, g, call, placeholders, mutated, out) -> Recording:
        leaves, kinds = call.leaves, call.kinds
        rec.graph = g
        rec.exec_rt = _cuda.rt_exec_handle(g._exec)
        rec.capture_ms, rec.instantiate_ms = g.capture_ms, g.instantiate_ms
        memcpys = _memcpy_nodes(g)
        rec.copies_in, rec.slow_in, rec.copies_back = [], [], []
        for j, ph in placeholders.items():
            dst, t = _ptr(ph), leaves[j]
            if not _nbytes(t):
                continue
            if _is_contiguous(t):
                node = memcpys.get((dst, call.ptrs[j]))
                if node is None:
                    raise SkipCall("could not find the input-copy node in the captured graph")
                rec.copies_in.append([j, _cuda.rt_node_handle(node), dst, _nbytes(t), call.ptrs[j],
                                      _row_bytes(call, j)])
            else:
                rec.slow_in.append((j, ph))
        for j in mutated:
            if kinds[j] == EAGER and _nbytes(leaves[j]):
                src = _ptr(placeholders[j])
                node = memcpys.get((call.ptrs[j], src))
                if node is None:
                    raise SkipCall("could not find the copy-back node in the captured graph")
                rec.copies_back.append([j, _cuda.rt_node_handle(node), src, _nbytes(leaves[j]), call.ptrs[j],
                                        _row_bytes(call, j)])
        rec.fixed = [(j, call.ptrs[j]) for j in range(len(leaves)) if kinds[j] != EAGER]
        rec.kinds = list(kinds)
        out_leaves: list = []
        rec.out_spec = _spec(out, out_leaves)
        reason = _cpu_output(out_leaves)
        if reason is not None:
            raise SkipCall(reason)
        rec.out_leaves = out_leaves
        rec.out_kinds = self._output_kinds(call, placeholders, out_leaves)
        rec.owned_idx = [i for i, k in enumerate(rec.out_kinds) if k is OWNED]
        owned = [out_leaves[i] for i in rec.owned_idx]
        rec.out_ptrs = [p for p in (_ptr(t) for t in owned) if p]
        # one owned output: its alias maker, bound once (t.detach for torch, a.view for CuPy)
        rec.alias0 = (_alias_maker(out_leaves[0]) if rec.out_spec is _SINGLE and call.bucket is None
                      and rec.out_kinds[0] is OWNED else None)
        rec.bucket, rec.padded = call.bucket, call.padded
        rec.out_rows = buckets.out_rows(out_leaves, call.bucket) if call.bucket is not None else []
        rec.keep = (list(placeholders.values()), out)
        # only storages in torch's MemPool take part in its checkpoints: a torch view of CuPy
        # memory (torch.from_dlpack) has a DLPack deleter and lives in cgraw's own pool
        rec.spans = [] if self._tts is None else self._tts.spans(list(placeholders.values()) + owned)
        return rec

    def _output_kinds(self, call: Call, placeholders: dict, out_leaves: list) -> list:
        """Per output: OWNED (recorded in the tree's pool), ``(j, base)`` (input ``j`` or a view
        of it, rebuilt from the caller's input each call) or EXTERNAL (returned as is)."""
        leaves, kinds = call.leaves, call.kinds
        by_base = {}
        for j, ph in placeholders.items():
            if call.bucket is None and _is_contiguous(leaves[j]):
                by_base[_base_ptr(ph)] = (j, ph)
        for j, t in enumerate(leaves):
            if kinds[j] != EAGER:
                by_base.setdefault(_base_ptr(t), (j, t))
        in_pool = self._pool_owner()
        out = []
        for t in out_leaves:
            b = _base_ptr(t)
            hit = by_base.get(b)
            if hit is not None:
                j, base = hit
                v = _view_of(leaves[j], t, base)
                if v is not None:
                    out.append(_InputAlias(j, t, base))
                    continue
            out.append(OWNED if in_pool(b) else EXTERNAL)
        return out

    def _pool_owner(self):
        """``ptr -> bool``: whether memory lies in the tree's pool (cgraw's part or torch's)."""
        owns = self.pool.owns
        if self._tts is None:
            return lambda p: bool(p) and owns(p)
        torch_owns = self._tts.pool.owner_of()
        return lambda p: bool(p) and (owns(p) or torch_owns(p))

    def replay(self, rec: Recording, call: Call):
        if rec.bucket is not None:
            return self._replay_padded(rec, call)
        ptrs = call.ptrs
        for c in rec.copies_in:
            p = ptrs[c[0]]
            if p != c[4]:
                err = _cuda.memcpy_node_set_1d_raw(rec.exec_rt, c[1], c[2], p, c[3], _cuda.MEMCPY_D2D)[0]
                if err:
                    raise _cuda.rt_error(err, "cudaGraphExecMemcpyNodeSetParams1D")
                c[4] = p
        for c in rec.copies_back:
            p = ptrs[c[0]]
            if p != c[4]:
                err = _cuda.memcpy_node_set_1d_raw(rec.exec_rt, c[1], p, c[2], c[3], _cuda.MEMCPY_D2D)[0]
                if err:
                    raise _cuda.rt_error(err, "cudaGraphExecMemcpyNodeSetParams1D")
                c[4] = p
        if rec.slow_in:
            self._slow_copies(rec, call, None)
        rec.graph.replay()
        alias0 = rec.alias0
        if alias0 is not None:
            o = alias0()
            return o, (o,)
        outs = self._outputs(rec, call)
        return _unflatten(rec.out_spec, iter(outs)), [outs[i] for i in rec.owned_idx]

    def _outputs(self, rec: Recording, call: Call) -> list:
        outs = []
        for t, k in zip(rec.out_leaves, rec.out_kinds):
            if k is OWNED:
                outs.append(_alias(t))
            elif k is EXTERNAL:
                outs.append(t)
            else:
                outs.append(k.rebuild(call.leaves[k.j]))
        return outs

    def _slow_copies(self, rec: Recording, call: Call, rows) -> None:
        """Copy non-contiguous eager inputs into their placeholders, on the stream the replay
        will run on (``stream.current_ptr``), whichever framework's current stream that is."""
        target = _streams._current(self.device.ordinal)
        for j, ph in rec.slow_in:
            dst = ph[:rows] if rows is not None and j in rec.padded else ph
            _copy_on(dst, call.leaves[j], target)

    def _replay_padded(self, rec: Recording, call: Call):
        """``replay`` of a padding-bucket recording: the padded inputs' copy nodes also get this
        call's byte count, the outputs are cut back to its rows."""
        n, ptrs = call.rows, call.ptrs
        for c in rec.copies_in:
            p, count = ptrs[c[0]], (c[5] * n if c[5] else c[3])
            if p != c[4] or count != c[3]:
                err = _cuda.memcpy_node_set_1d_raw(rec.exec_rt, c[1], c[2], p, count, _cuda.MEMCPY_D2D)[0]
                if err:
                    raise _cuda.rt_error(err, "cudaGraphExecMemcpyNodeSetParams1D")
                c[3], c[4] = count, p
        for c in rec.copies_back:
            p, count = ptrs[c[0]], (c[5] * n if c[5] else c[3])
            if p != c[4] or count != c[3]:
                err = _cuda.memcpy_node_set_1d_raw(rec.exec_rt, c[1], p, c[2], count, _cuda.MEMCPY_D2D)[0]
                if err:
                    raise _cuda.rt_error(err, "cudaGraphExecMemcpyNodeSetParams1D")
                c[3], c[4] = count, p
        if rec.slow_in:
            self._slow_copies(rec, call, n)
        rec.graph.replay()
        outs = self._outputs(rec, call)
        for i in rec.out_rows:
            outs[i] = outs[i][:n]
        owned = [outs[i] for i in rec.owned_idx]
        if rec.out_spec is _SINGLE:
            return outs[0], owned
        return _unflatten(rec.out_spec, iter(outs)), owned

    def output_ptrs(self, rec: Recording):
        return rec.out_ptrs

    def num_nodes(self, rec: Recording) -> int:
        return rec.graph.num_nodes

    def discard(self, rec: Recording) -> None:
        rec.graph.close()
        rec.keep = None
        _observe.unwatch(rec.external)
        rec.external = ()
        rec.same_external = None

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
            self._tts.apply_restore(torch_ckpt, plan)

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
        """Poison (or, with ``user_visible`` cloning, clone out) the owned outputs handed out."""
        torch = self._torch
        if torch is None:
            return
        T, poison, messages = self._tensor, self._poison, self._messages
        for name, t in handed:
            if not isinstance(t, T):
                continue  # CuPy arrays cannot be poisoned (see the README)
            if cloning == "user_visible":
                with torch.no_grad():
                    t.set_(t.clone())
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
            from cgraw import _defer

            _defer.release(self._torch.cuda.empty_cache)


class _InputAlias:
    """An output that is input ``j`` or a view of it: rebuilt from the caller's input each call."""

    __slots__ = ("j", "same", "torch", "shape", "stride", "delta")

    def __init__(self, j: int, out, base):
        self.j = j
        self.same = out is base
        self.torch = _is_torch(out)
        if self.torch:
            self.shape, self.stride = tuple(out.shape), tuple(out.stride())
            self.delta = out.storage_offset() - base.storage_offset()
        else:
            self.shape, self.stride = out.shape, out.strides
            self.delta = int(out.data.ptr) - int(base.data.ptr)

    def rebuild(self, leaf):
        if self.same:
            return leaf
        if self.torch:
            return leaf.as_strided(self.shape, self.stride, leaf.storage_offset() + self.delta)
        cupy = sys.modules["cupy"]
        return cupy.ndarray(self.shape, leaf.dtype, leaf.data + self.delta, self.stride)


# ---------------------------------------------------------------------- helpers


def _config():
    from cgraw.tree import config

    return config


def _cpu_output(out_leaves) -> str | None:
    """Why a function returning these leaves must run eagerly (a CPU tensor a replay would return
    unchanged), or None."""
    for t in out_leaves:
        if _is_torch(t) and t.get_device() < 0:
            return ("CPU tensors or ops: the function returns a CPU tensor, which a replay would return "
                    "unchanged (as torch's CUDAGraph Trees, cgraw runs such functions eagerly)")
    return None


def _copy_on(dst, src, target: int) -> None:
    """``dst[...] = src`` on stream ``target`` (a raw handle), whichever framework owns ``dst``."""
    if _is_torch(dst):
        torch = sys.modules["torch"]
        if torch_c.api()._cuda_getCurrentRawStream(dst.get_device()) == target:
            dst.copy_(src)
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(target, device=dst.device)):
            dst.copy_(src)
        return
    cupy = sys.modules["cupy"]
    if cupy.cuda.get_current_stream().ptr == target:
        _copy_into(dst, src)
        return
    from cgraw.interop.cupy import _external_stream
    from cgraw.stream import Stream

    with _external_stream(cupy, Stream.from_handle(target, dst.device.id), dst.device.id):
        _copy_into(dst, src)


def _row_bytes(call: Call, j: int) -> int:
    """Bytes per row of a padded eager input (its copy node's count is rows x this), else 0."""
    return _nbytes(call.leaves[j]) // call.rows if j in call.padded else 0


def _memcpy_nodes(g) -> dict:
    """(dst, src) -> node handle of every memcpy node of the graph."""
    out = {}
    for h in _cuda.graph_get_nodes(g._graph):
        if int(_cuda.graph_node_get_type(h)) == int(_cuda.NodeType.CU_GRAPH_NODE_TYPE_MEMCPY):
            out[_cuda.graph_memcpy_node_dst_src(h)] = h
    return out


def _skip_reason(exc: CaptureError) -> str:
    text = exc.description or str(exc)
    if "host synchronisation" in text:
        return "host synchronisation during capture (" + text + ")"
    if "random numbers" in text:
        return "torch random numbers (" + text + ")"
    return text

