"""A graph-tree node's warm-up inside the tree's pool, the way torch's trees warm up.

Layer L8, beside ``cuda_backend`` (which calls it). The function runs eagerly on the pool's capture
stream, with this thread's torch allocations routed to the tree's torch MemPool; torch's and
CuPy's current streams are that stream for the call. It first waits for the work queued on the
caller's streams, and the caller's streams wait for it after. What the warm-up frees goes back
to the pool, where the recordings that follow reuse it, instead of staying in torch's global
cache beside the pool (``benchmarks/memory.py``). CuPy's allocations are not routed.

Its outputs in the pool are handed out like a replay's: invalid once the generation ends, and
freed for good at the next restore (``TorchTreeState`` owns their blocks from here on). Blocks
it left in the pool that are neither its outputs nor saved for a backward (an optimizer's state
made on its first step, a buffer built lazily and kept on a module, the outputs of a function
that will run eagerly from now on) would be freed by the next restore under whoever holds them.
The warm-up reports them, and an autograd graph recorded in it (``Warm.stash``): the tree moves
to a fresh pool, which leaves them valid, and this backend warms up outside the pool from then on.
While it routes, the warm-up counts as a capture for ``cgraw._cuda.defer``; its check for mutated
inputs compares host copies, so it takes no device memory.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import sys

from cgraw._cuda import defer
from cgraw.trees.arrays import EAGER, TORCH, argument_objects, is_torch, ops_of, out_spec
from cgraw.runtime.capture import event_on
from cgraw.errors import SkipCall
from cgraw.interop.cupy import pools as _icupy, rng as _cupy_rng
from cgraw.interop.torch import observe as _observe, autograd as torch_autograd, private_api, rng as _torch_rng
from cgraw.interop.torch.kernel_state import groups_of
from cgraw.runtime.stream import Stream
from cgraw.trees.nodes import Warm
from cgraw.trees.config import config

log = logging.getLogger("cgraw")
_NULL = contextlib.nullcontext()


def usable(backend, fn, call) -> bool:
    """Whether ``fn``'s warm-up runs inside ``backend``'s pool: the setting is on, torch's side of
    the pool exists, and autograd records nothing in the call, as far as can be seen before it
    runs (``_records_grad``). A call autograd records stays outside: what it saves would be freed
    by a restore while a backward may still read it, and its backward nodes would run on the
    capture stream (on the H200 that aborted ``test_autograd``); one it records unseen (a module
    reached some other way) is caught after the warm-up (``PoolWarmup.settle``). Not for a
    backward (its outputs become ``.grad``s) or a function torch.compile owns."""
    return (config.warmup_in_pool and backend._tts is not None and backend.warm_in_pool
            and not getattr(fn, "is_backward", False) and not getattr(fn, "copies_out", False)
            and not _observe.is_compiled(fn.fn) and not _records_grad(backend._torch, fn.fn, call))


def _records_grad(torch, f, call) -> bool:
    """Grad mode is on and an input, or a tensor or module the function reaches directly (bound
    ``self``, closure cells, globals it names, a ``functools.partial``'s arguments), requires grad."""
    if not torch.is_grad_enabled():
        return False
    held = list(call.leaves)
    for _ in range(4):  # partials and bound methods of partials
        if isinstance(f, functools.partial):
            held += [f.args, *f.keywords.values()]
            f = f.func
            continue
        held += [f, getattr(f, "__self__", None)]
        f = getattr(f, "__func__", f)
        code = getattr(f, "__code__", None)
        if code is not None:
            held += [c.cell_contents for c in (f.__closure__ or ()) if _filled(c)]
            names = getattr(f, "__globals__", {})
            held += [names[n] for n in code.co_names if n in names]
        break
    Module, Tensor = torch.nn.Module, torch.Tensor
    for x in held:
        for y in (x if isinstance(x, (tuple, list)) else (x,)):
            if isinstance(y, Tensor) and y.requires_grad:
                return True
            if isinstance(y, Module) and any(p.requires_grad for p in y.parameters()):
                return True
    return False


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name bound after the function was made)
        return False
    return True


_PINNED: list = []  # capture streams autograd may still use after their pool was replaced


class PoolWarmup:
    """Context manager around a warm-up (see the module); ``settle`` says what it left."""

    def __init__(self, pool, tts):
        self.pool, self.tts = pool, tts
        self.before: set = set()
        self.saved: set = set()  # storages autograd saved (the pack hook adds them): a backward frees them
        self._ctxs: list = []
        self._callers: list[int] = []
        self._counted = False  # in cgraw._cuda.defer's count of routings

    def pack(self, x):
        """A ``saved_tensors_hooks`` pack hook: note ``x``'s storage, keep ``x``."""
        self.saved.add(_storage_ptr(x))
        return x

    def __enter__(self) -> "PoolWarmup":
        torch = sys.modules["torch"]
        dev = self.pool.device.ordinal
        stream = self.pool.capture_stream
        self.before = set(self.tts.pool.allocated())
        callers = {int(private_api.api()._cuda_getCurrentRawStream(dev))}
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            callers.add(int(cupy.cuda.get_current_stream().ptr))
        self._callers = sorted(callers - {stream.ptr})
        for ptr in {0, *self._callers}:
            stream.wait(event_on(self.pool.device, ptr))
        try:
            self._push(torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", dev))))
            if cupy is not None:
                from cgraw.interop.cupy.pools import external_stream

                self._push(external_stream(cupy, stream, dev))
            if config.warm_cublas:
                # the capture stream's cuBLAS and cuBLASLt workspaces (a matmul, an addmm with a
                # bias), made outside the pool: they outlive the call
                a = torch.ones((2, 2), device=torch.device("cuda", dev))
                torch.addmm(a[0], a, a @ a)
            # routed like a capture: nothing is freed meanwhile (torch asserts when a MemPool is
            # released or its cache emptied while any routing is underway; cgraw._cuda.defer)
            defer.capture_begins()
            self._counted = True
            self._push(torch.cuda.use_mem_pool(self.tts.pool.mempool, device=dev))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _push(self, ctx) -> None:
        ctx.__enter__()
        self._ctxs.append(ctx)

    def __exit__(self, *exc) -> bool:
        try:
            while self._ctxs:
                self._ctxs.pop().__exit__(None, None, None)
        finally:
            if self._counted:
                self._counted = False
                defer.capture_ends()
            done = self.pool.capture_stream.record()
            for ptr in self._callers:
                Stream.from_handle(ptr, self.pool.device).wait(done)
        return False

    def settle(self, out_leaves: list, skip: str | None):
        """``(in_pool, handed, stash)`` after the warm-up: whether it left blocks in the pool, its
        outputs there (their storages become their blocks' owners), and why blocks it left are
        held beyond them (then nothing is handed out), or None. ``skip``: why the function will
        run eagerly from now on, if it will."""
        new = set(self.tts.pool.allocated()) - self.before
        if not new:
            return False, (), None
        outs = [t for t in out_leaves if is_torch(t) and _storage_ptr(t) in new]
        graph = self.saved or any(getattr(t, "requires_grad", False) for t in out_leaves)
        if graph:
            _PINNED.append(self.pool.capture_stream)  # its backward nodes run there: never destroyed
        if skip is not None:
            return True, (), f"returned memory of the tree's pool but runs eagerly from now on ({skip})"
        if graph:
            return True, (), "recorded an autograd graph (torch.enable_grad() inside a call made without grad)"
        rest = new - {_storage_ptr(t) for t in outs} - self.saved
        if rest:  # a temporary in a reference cycle is not state: collect, look again
            gc.collect()
            rest &= set(self.tts.pool.allocated())
        if rest:
            return True, (), (f"left {len(rest)} block(s) of the tree's pool held beyond its outputs (state made "
                              "on the first call, such as an optimizer's buffers or a tensor kept on a module)")
        self.tts.spans(outs)
        return True, outs, None


def run(backend, fn, call, args, kwargs) -> Warm:
    """Run ``fn`` eagerly for ``backend`` (a ``cuda_backend.CudaBackend``), inside its pool where
    ``usable``; report which eager inputs it mutated (by content and version count), the tensors it reads
    through its closure, whether it ran a backward pass, a reason to skip it, if any, and what it
    left in the pool (``PoolWarmup.settle``)."""
    ops = call.ops
    torch = backend._torch
    obs = pw = None
    epoch, mode = _observe.epoch_now[0], _observe.mode_epoch_now[0]
    backward = [False]
    if torch is not None:
        # a backward pass unpacks saved tensors: then the recording must route allocations
        # by stream, where autograd's device thread allocates, rather than by thread
        def unpacked(x):
            backward[0] = True
            return x

        if not _observe.is_compiled(fn.fn):
            obs = _observe.observer(call.leaves)
        if usable(backend, fn, call):
            pw = PoolWarmup(backend.pool, backend._tts)
        grads = _input_grads(call)
        with torch_autograd.saving_hooks(pw.pack if pw else _same, unpacked), pw or _NULL:
            before = _copies(call)
            # draws as the replays will draw them (the observer above sees every op)
            with _warm_draws(backend, fn), obs if obs is not None else _NULL:
                out = fn.fn(*args, **kwargs)
            mutated = _mutated(call, before)
            del before
    else:
        before = _copies(call)
        with _warm_draws(backend, fn):
            out = fn.fn(*args, **kwargs)
        mutated = _mutated(call, before)
    # compiled code's pieces write buffers their compiler owns (Inductor reuses a backward's saved
    # activations, eager inputs at its warm-up): not the caller's business, so not warned of
    if not fn.inputs_guarded:
        for j in mutated:
            if not ops[j].contiguous(call.leaves[j]):
                log.warning("cgraw: %s mutates non-contiguous eager input %d", fn.name, j)
    w = Warm(out, mutated)
    w.runs_backward = backward[0] or (obs is not None and obs.backward) or getattr(fn, "is_backward", False)
    if torch is not None and w.runs_backward:
        w.skip = _grads_left(call, grads)
    out_leaves: list = []
    try:
        out_spec(out, out_leaves, argument_objects(call.arg_specs, call.kwarg_specs))
    except SkipCall as exc:
        w.skip = str(exc)
    if w.skip is None:
        w.skip = cpu_output(out_leaves)
    if w.skip is None and torch is not None and config.autograd:
        w.skip = torch_autograd.reentrant_checkpoint(out_leaves, call.leaves)
    if obs is not None:
        if obs.unsafe is not None:
            w.skip = (f"calls custom op {obs.unsafe}, tagged torch._C.Tag.cudagraph_unsafe (as torch's "
                      "CUDAGraph Trees, cgraw runs such functions eagerly)")
        elif w.skip is None and obs.cpu_random is not None:
            w.skip = (f"CPU tensors or ops: CPU random numbers ({obs.cpu_random}) would repeat on every "
                      "replay")
        w.external = obs.external(list(call.leaves) + out_leaves)
        w.groups = groups_of(obs.ops)
    w.epoch = _observe.epoch_now[0] if _observe.epoch_now[0] == epoch else -1
    w.mode_epoch = mode if _observe.mode_epoch_now[0] == mode else -1
    if pw is not None:
        w.in_pool, w.handed, w.stash = pw.settle(out_leaves, w.skip)
        backend.warm_in_pool = w.stash is None or w.skip is not None  # state kept beyond the call: never again
    return w


def _warm_draws(backend, fn):
    """The warm-up's random numbers drawn as its replays will draw them: torch's
    (``interop.torch.rng.WarmDraws``) once torch's CUDA is in use, CuPy's
    (``interop.cupy.rng.WarmDraws``) once ``cupy.random`` is in use."""
    dev = getattr(backend, "device", None)
    if dev is None:
        return _NULL
    torch = backend._torch
    draws = []
    if torch is not None and torch.cuda.is_initialized():
        draws.append(_torch_rng.WarmDraws(dev.ordinal, _observe.is_compiled(fn.fn)))
    if _icupy.cupy_module() is not None and _cupy_rng.drawing():
        try:
            draws.append(_cupy_rng.WarmDraws(dev.ordinal))
        except Exception as exc:  # noqa: BLE001 -- CuPy's draws are then its own: a warm-up never fails for it
            log.debug("cgraw: CuPy's random numbers are not routed in this warm-up: %r", exc)
    if len(draws) < 2:
        return draws[0] if draws else _NULL
    return _entered(draws)


@contextlib.contextmanager
def _entered(contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def cpu_output(out_leaves) -> str | None:
    """Why a function returning these leaves must run eagerly (a CPU tensor a replay would return
    unchanged), or None."""
    for t in out_leaves:
        if ops_of(t) is TORCH and t.get_device() < 0:
            return ("CPU tensors or ops: the function returns a CPU tensor, which a replay would return "
                    "unchanged (as torch's CUDAGraph Trees, cgraw runs such functions eagerly)")
    return None


def _input_grads(call) -> list:
    """``(leaf index, its .grad)`` of the eager inputs that are autograd leaves requiring grad."""
    return [(j, t.grad) for j, t in enumerate(call.leaves)
            if call.kinds[j] == EAGER and getattr(t, "requires_grad", False) and t.is_leaf]


def _grads_left(call, before: list) -> str | None:
    """Why a function that ran a backward must run eagerly: it left a gradient in an eager
    input's ``.grad`` (a replay would leave it in the recording's copy of the input), or an
    eager input requiring grad is not an autograd leaf (its backward would reach the caller's
    graph, which a recording cannot); else None."""
    for j, g in before:
        if call.leaves[j].grad is not g:
            return (f"a backward inside the function changes the .grad of eager input {j}, which a replay "
                    "would leave in the recording's copy of the input (clear it inside the function, or use "
                    "torch.autograd.grad)")
    for j, t in enumerate(call.leaves):
        if call.kinds[j] == EAGER and getattr(t, "requires_grad", False) and not t.is_leaf:
            return (f"eager input {j} requires grad but is not an autograd leaf: a backward inside the function "
                    "would reach the caller's autograd graph, which a replay cannot")
    return None


def _copies(call) -> list:
    """Host copies and version counts of the eager inputs, to tell afterwards which ones the
    function wrote. In host memory: device copies the size of every eager input stayed cached by
    torch (or, made in the pool, raised its high-water mark) after the warm-up
    (``benchmarks/memory.py``)."""
    return [(j, call.ops[j].snapshot(t), call.ops[j].version(t)) for j, t in enumerate(call.leaves)
            if call.kinds[j] == EAGER]


def _mutated(call, copies: list) -> tuple:
    """The eager inputs the function wrote: their contents changed, or their version count did (a
    write of the values they held, ``x.clamp_(min=0)`` on positive values, changes the caller's
    input on a later call)."""
    ops, leaves = call.ops, call.leaves
    return tuple(j for j, copy, v in copies
                 if not ops[j].same(copy, leaves[j]) or (v is not None and ops[j].version(leaves[j]) != v))


def _same(x):
    return x


def _storage_ptr(t) -> int:
    """The address of ``t``'s storage, or 0 (a tensor without one, such as a sparse tensor)."""
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001
        return 0
