"""The CUDA backend of graph trees: inspect a call's inputs, warm up, record, replay, restore.

Layer L6 (beside ``capture``): uses ``capture``, ``memory``, ``graph`` and the framework
adapters; ``tree`` drives it. Inputs are classified per call:
- *static*: torch ``nn.Parameter``s, the parameters and buffers of an ``nn.Module`` argument,
  anything passed to ``cgraw.mark_static``, and positions in ``static_argnums``. Read in place;
  their address is checked on every call.
- *tree outputs*: outputs of earlier graphed calls in this generation. Read in place; checked too.
- *eager*: everything else. Copied into a placeholder by a memcpy node at the start of the graph,
  whose source pointer is patched before a launch only when it changed.
Eager inputs found mutated at warm-up are copied back by a memcpy node at the end of the graph.
"""

from __future__ import annotations

import gc
import logging
import sys

from cgraw import _cuda, buckets
from cgraw.arrays import (
    _SINGLE,
    EAGER,
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
    _is_tensor,
    _nbytes,
    _NoType,
    _ptr,
    _replace,
    _spec,
    _unflatten,
)
from cgraw.capture import capture
from cgraw.errors import CaptureError
from cgraw.memory import DevicePool
from cgraw.tree import SkipCall

log = logging.getLogger("cgraw")

OVERWRITTEN = (
    "accessing tensor output of a cgraw graph that has been overwritten by a subsequent run "
    "(output of graphed function {name!r}); clone it (.clone()) before the graphed functions run "
    "again, or call cgraw.mark_step_begin() where a new step begins"
)

_static_ids: dict[int, object] = {}  # id(tensor) -> weakref, filled by mark_static


def mark_static(x):
    """Mark a tensor or array as a static input of graphed functions (read in place, never copied)."""
    import weakref

    key = id(x)
    _static_ids[key] = weakref.ref(x, lambda _r, k=key: _static_ids.pop(k, None))
    return x


class Call:
    """One call's inputs: the signature ``key``, tensor ``leaves`` with their kinds and pointers."""

    __slots__ = ("key", "leaves", "kinds", "ptrs", "arg_spans", "rows", "bucket", "padded")

    def __init__(self, key, leaves, kinds, ptrs, arg_spans):
        self.key = key
        self.leaves = leaves
        self.kinds = kinds
        self.ptrs = ptrs
        self.arg_spans = arg_spans  # (first leaf, leaf count) of each positional argument
        self.bucket = None  # padding buckets (cgraw.buckets): the bucket, the call's rows and
        self.rows = None  # the padded leaves, when the function has buckets and the call fits one
        self.padded = frozenset()


class Recording:
    """A recorded node: the graph, its input copies, its outputs and what keeps them alive."""

    __slots__ = ("graph", "exec_rt", "copies_in", "slow_in", "copies_back", "fixed", "kinds", "out_leaves",
                 "alias0", "out_spec", "out_ptrs", "spans", "keep", "bucket", "padded", "out_rows", "capture_ms", "instantiate_ms", "name")


class CudaBackend:
    """Does the work of one device's ``TreeManager``."""

    def __init__(self, device):
        self.device = device
        self.pool = DevicePool(device, name=f"tree{device.ordinal}")
        self._torch = None
        self._tensor = _NoType  # torch.Tensor when torch is loaded: exact-type fast paths
        self._messages: dict[str, str] = {}
        if "torch" in sys.modules:
            from cgraw.interop.torch import mempool_for

            self._torch = sys.modules["torch"]
            self._tensor = self._torch.Tensor
            self._poison = self._torch._C._set_storage_access_error_msg
            self.mempool = mempool_for(self.pool)
            self._torch_device = self._torch.device("cuda", device.ordinal)
        # data pointer -> the torch storage that holds the allocator's deleter for that block of
        # the tree's MemPool, for every block of a recording (placeholders and outputs)
        self._owners: dict[int, object] = {}

    # ------------------------------------------------------------------ inputs

    def inspect(self, fn, args, kwargs, tree_outputs) -> Call:
        leaves, key_parts, kinds, ptrs = [], [], [], []
        dev = None
        static_pos = fn.static_argnums
        spans = []
        T = self._tensor
        for i, a in enumerate(args):
            first = len(leaves)
            if type(a) is T and i not in static_pos:  # the common case, without generic dispatch
                p = a.data_ptr()
                leaves.append(a)
                key_parts.append((a.shape, a.stride(), a.dtype))
                kinds.append(STATIC if id(a) in _static_ids else (TREE if p in tree_outputs else EAGER))
                ptrs.append(p)
                spans.append((first, 1))
                continue
            _flatten(a, leaves, key_parts, kinds, ptrs, STATIC if i in static_pos else None)
            spans.append((first, len(leaves) - first))
        if kwargs:
            for k in sorted(kwargs):
                key_parts.append(k)
                _flatten(kwargs[k], leaves, key_parts, kinds, ptrs, None)
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
        call = Call(tuple(key_parts), leaves, kinds, ptrs, spans)
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
        return None

    # ------------------------------------------------------------------ warm-up, record, replay

    def warmup(self, fn, call: Call, args, kwargs):
        """Run eagerly; report which eager inputs the function mutated (compared by content)."""
        before = [(j, _clone(t)) for j, t in enumerate(call.leaves) if call.kinds[j] == EAGER]
        torch = self._torch
        if torch is not None:
            # a backward pass unpacks saved tensors: then the recording must route allocations
            # by stream, where autograd's device thread allocates, rather than by thread
            def unpacked(x):
                fn.runs_backward = True
                return x

            with torch.autograd.graph.saved_tensors_hooks(lambda x: x, unpacked):
                out = fn.fn(*args, **kwargs)
        else:
            out = fn.fn(*args, **kwargs)
        mutated = tuple(j for j, copy in before if not _equal(copy, call.leaves[j]))
        for j in mutated:
            if not _is_contiguous(call.leaves[j]):
                log.warning("cgraw: %s mutates non-contiguous eager input %d", fn.name, j)
        declared = tuple(j for i in fn.mutates if i < len(call.arg_spans)
                         for j in range(call.arg_spans[i][0], sum(call.arg_spans[i])) if call.kinds[j] == EAGER)
        return out, mutated + tuple(j for j in declared if j not in mutated)

    def record(self, fn, call: Call, args, kwargs, mutated) -> Recording:
        leaves, kinds = call.leaves, call.kinds
        for j in mutated:
            if kinds[j] == EAGER and not _is_contiguous(leaves[j]):
                raise SkipCall("skipping cudagraphs due to mutated inputs (a non-contiguous eager input)")
        # An eager input living in the tree's own pool (h = f(h) across a new branch: the previous
        # step's output) may sit in blocks the checkpoint restore just freed, where this
        # recording's placeholders can land. Copy it out first; nothing has written there yet.
        for j, t in enumerate(leaves):
            if kinds[j] == EAGER and self._in_pool(call.ptrs[j]):
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
                new_args, new_kwargs = _replace(args, kwargs, leaves, placeholders)
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
            return self._finish_recording(rec, g, call, placeholders, mutated, out)
        except BaseException as exc:
            g.close()
            if isinstance(exc, SkipCall):
                exc.dirty = True  # the capture's blocks are in the pool: restore before recording
            raise

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
        rec.out_leaves = out_leaves
        rec.out_ptrs = [p for p in (_ptr(t) for t in out_leaves if _is_tensor(t)) if p]
        # one output: its alias maker, bound once (t.detach for torch, a.view for CuPy)
        rec.alias0 = _alias_maker(out_leaves[0]) if rec.out_spec is _SINGLE and call.bucket is None else None
        rec.bucket, rec.padded = call.bucket, call.padded
        rec.out_rows = buckets.out_rows(out_leaves, call.bucket) if call.bucket is not None else []
        rec.keep = (list(placeholders.values()), out)
        # only storages in torch's MemPool take part in its checkpoints: a torch view of CuPy
        # memory (torch.from_dlpack) has a DLPack deleter and lives in cgraw's own pool
        state = self.pool.torch_state
        rec.spans = [] if state is None else _storage_spans(list(placeholders.values()) + out_leaves,
                                                             state[1].owns, self._owners)
        return rec

    def _in_pool(self, ptr: int) -> bool:
        if ptr and self.pool.owns(ptr):
            return True
        state = self.pool.torch_state
        return bool(ptr) and state is not None and state[1].owns(ptr)

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
        for j, ph in rec.slow_in:
            _copy_into(ph, call.leaves[j])
        rec.graph.replay()
        alias0 = rec.alias0
        if alias0 is not None:
            return alias0()
        return _unflatten(rec.out_spec, iter([_alias(t) for t in rec.out_leaves]))

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
        for j, ph in rec.slow_in:
            _copy_into(ph[:n] if j in rec.padded else ph, call.leaves[j])
        rec.graph.replay()
        outs = [_alias(t) for t in rec.out_leaves]
        for i in rec.out_rows:
            outs[i] = outs[i][:n]
        if rec.out_spec is _SINGLE:
            return outs[0]
        return _unflatten(rec.out_spec, iter(outs))

    def output_ptrs(self, rec: Recording):
        return rec.out_ptrs

    def num_nodes(self, rec: Recording) -> int:
        return rec.graph.num_nodes

    def discard(self, rec: Recording) -> None:
        rec.graph.close()
        rec.keep = None

    # ------------------------------------------------------------------ pool checkpoints

    def snapshot(self):
        torch_state = None
        if self._torch is not None:
            torch_state = self._torch._C._cuda_getCheckpointState(self.device.ordinal, self.mempool.id)
        return (self.pool.snapshot(), torch_state)

    def restore(self, snap, on_path: list, off_path: list) -> None:
        cg, torch_state = snap
        self.pool.restore(cg)
        if self._torch is not None and torch_state is not None:
            self._restore_torch(torch_state, on_path)

    def _restore_torch(self, torch_state, on_path: list) -> None:
        """Put torch's MemPool back to ``torch_state`` (see ``_owners`` in ``__init__``).

        torch's ``setCheckpointPoolState`` frees every block of the pool, re-allocates the
        checkpoint's, and then wants (a) one stale storage, holding the allocator's deleter, for
        each block it freed for good, whose deleter it swaps for a no-op, and (b) storages without
        a deleter context for the re-allocated blocks that should get one. A swapped storage keeps
        its context, so it can never take a deleter back: a block whose recording is on the path
        again gets a fresh owner built from its pointer, as torch's own trees build replay outputs.
        """
        torch = self._torch
        # tensors that died in reference cycles still hold blocks: collect them first. torch's
        # restore is not atomic (it frees the pool's blocks before it validates), so it must not
        # be tried and retried.
        gc.collect()
        has_deleter = torch._C._has_Standard_Deleter
        owners = self._owners
        wanted = {p: n for r in on_path for p, n in r.spans}
        stale = [s._cdata for p, s in owners.items() if p not in wanted and has_deleter(s._cdata)]
        adopted = {}
        for p, n in wanted.items():
            s = owners.get(p)
            if s is None or not has_deleter(s._cdata):
                adopted[p] = torch._C._construct_storage_from_data_pointer(p, self._torch_device, n)
        try:
            torch._C._cuda_setCheckpointPoolState(self.device.ordinal, torch_state, stale,
                                                  [s._cdata for s in adopted.values()])
        finally:
            # whatever torch did, a stale owner's deleter is gone or its block is lost: drop it
            kept = {p: s for p, s in owners.items() if p in wanted}
            kept.update(adopted)
            self._owners = kept

    def renew(self):
        """Start over on a fresh pool (the old one is left to whatever still holds its memory).
        Used when a checkpoint cannot be restored because something outside the tree holds
        memory of the pool. Returns the new root checkpoint."""
        self.pool = DevicePool(self.device, name=f"tree{self.device.ordinal}")
        if self._torch is not None:
            from cgraw.interop.torch import mempool_for

            self.mempool = mempool_for(self.pool)
            self._owners = {}
        return self.snapshot()

    def aliases_input(self, out, call: Call) -> bool:
        """Whether a (warm-up) output shares memory with one of the call's inputs: such outputs
        belong to the caller and are never poisoned."""
        leaves: list = []
        _spec(out, leaves)
        if not leaves:
            return False
        inputs = {_base_ptr(t) for t in call.leaves}
        return any(_base_ptr(t) in inputs for t in leaves)

    # ------------------------------------------------------------------ generations

    def end_generation(self, handed: list, cloning: str | None) -> None:
        torch = self._torch
        if torch is None:
            return
        T, poison, messages = self._tensor, self._poison, self._messages
        for name, out in handed:
            if type(out) is T and cloning is None:  # the common case: one tensor
                msg = messages.get(name)
                if msg is None:
                    msg = messages[name] = OVERWRITTEN.format(name=name)
                poison(out, msg)
                continue
            leaves: list = []
            _spec(out, leaves)
            for t in leaves:
                if isinstance(t, T):
                    if cloning == "user_visible":
                        with torch.no_grad():
                            t.set_(t.clone())
                    else:
                        poison(t, OVERWRITTEN.format(name=name))

    def close(self) -> None:
        self.pool.close()
        if self._torch is not None:
            self.mempool = None
            self._owners = {}
            self.pool.torch_state = None
            self._torch.cuda.empty_cache()  # torch hands the tree's segments back to cgraw


# ---------------------------------------------------------------------- helpers


def _config():
    from cgraw.tree import config

    return config


def _storage_spans(objs, in_mempool, owners: dict) -> list[tuple[int, int]]:
    """``(data pointer, bytes)`` of the storages of the torch tensors among ``objs`` whose memory
    is in torch's MemPool (``in_mempool(ptr)``), once each; a storage not yet in ``owners`` is
    entered there as its block's owner."""
    out, seen = [], set()
    for t in objs:
        if type(t).__module__.startswith("torch") and hasattr(t, "untyped_storage"):
            s = t.untyped_storage()
            p = s.data_ptr()
            if p and p not in seen and in_mempool(p):
                seen.add(p)
                out.append((p, s.nbytes()))
                owners.setdefault(p, s)
    return out


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

