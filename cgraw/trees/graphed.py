"""``@cgraw.graphed`` and the functions around it: one graph tree per thread and device.

Layer L9 (public API). ``calls`` classifies a call, ``manager`` decides, ``cuda_backend`` does the CUDA work; this module
keeps the registry of trees and the user-facing helpers (``mark_step_begin``, ``mark_static``,
``unsafe``, ``report``, ``reset``).

Threads. A graphed function called on a thread runs in that thread's tree for the device (made at
the thread's first call there): its own pool, capture stream and generations, as torch's trees are
kept per thread. ``mark_step_begin()`` and ``reset()`` act on the calling thread's trees;
``report()`` lists every thread's. A thread's trees are released when the thread ends, without
poisoning what they handed out (the thread may have passed its results on). Trees grow one at a
time across the process (``manager.SERIAL``); replays on different threads run side by side.
"""

from __future__ import annotations

import collections.abc
import functools
import itertools
import sys
import threading
import warnings
import weakref

from cgraw.trees import buckets, manager as _tree
from cgraw.trees.calls import mark_static
from cgraw.runtime import capture as _capture
from cgraw.runtime.capture import capturing
from cgraw.runtime.device import Device
from cgraw.errors import ResourceLeakWarning, UnsafeCallError
from cgraw.trees.manager import TreeManager
from cgraw.trees.config import config
from cgraw.trees.cuda_backend import CudaBackend
from cgraw.trees.nodes import next_fn_id


class _ThreadTrees(threading.local):
    """The calling thread's trees, by device ordinal. ``token`` lives as long as the thread: its
    finalizer releases the thread's trees once the thread has ended (``_thread_ended``)."""

    def __init__(self) -> None:
        self.trees: dict[int, TreeManager] = {}
        self.token: _ThreadToken | None = None
        self.inline = 0  # captures running on the thread: graphed calls inside them run inline


class _ThreadToken:
    __slots__ = ("number", "__weakref__")

    def __init__(self, number: int):
        self.number = number


_here = _ThreadTrees()


def _inline_begin() -> None:
    """A capture begins on this thread: its graphed calls run their functions inline, as part of
    the graph it records (``TreePool.busy``)."""
    _here.inline += 1
    for mgr in _here.trees.values():
        mgr.busy += 1


def _inline_end() -> None:
    _here.inline -= 1
    for mgr in _here.trees.values():
        mgr.busy = max(0, mgr.busy - 1)


_capture.NESTING.append((_inline_begin, _inline_end))
_lock = threading.Lock()
# every live thread's trees: (thread number, device ordinal) -> (thread name, tree); guarded by _lock.
# Never take manager.SERIAL while holding _lock (a tree that grows may make another device's tree).
_all: dict[tuple[int, int], tuple[str, TreeManager]] = {}
_thread_numbers = itertools.count(1)


class _ThisThread(collections.abc.Mapping):
    """``_managers[ordinal]``: the calling thread's tree on a device (tests and benchmarks read it)."""

    def __getitem__(self, ordinal: int) -> TreeManager:
        return _here.trees[ordinal]

    def __iter__(self):
        return iter(list(_here.trees))

    def __len__(self) -> int:
        return len(_here.trees)


_managers = _ThisThread()
_tensor_type = [None, None]  # [torch.Tensor, torch.nn.Parameter] once torch is loaded


def _manager(ordinal: int) -> TreeManager:
    """The calling thread's tree on device ``ordinal``, made at the thread's first call there."""
    here = _here
    mgr = here.trees.get(ordinal)
    if mgr is None:
        if _tensor_type[0] is None and "torch" in sys.modules:
            torch = sys.modules["torch"]
            _tensor_type[1] = torch.nn.Parameter
            _tensor_type[0] = torch.Tensor
        with _lock:
            mgr = _new_tree(ordinal)
            token = here.token
            if token is None:
                token = here.token = _ThreadToken(next(_thread_numbers))
                weakref.finalize(token, _thread_ended, token.number).atexit = False
            _all[(token.number, ordinal)] = (threading.current_thread().name, mgr)
        mgr.busy = here.inline
        here.trees[ordinal] = mgr
    return mgr


def _new_tree(ordinal: int) -> TreeManager:
    """A new tree on device ``ordinal`` for the calling thread (the CPU tests swap this factory)."""
    dev = Device(ordinal).set_current()
    mgr = TreeManager(CudaBackend(dev), device_index=ordinal)
    mgr.backend.mgr = mgr  # a backward asks its tree for the plan (interop.torch.autograd)
    return mgr


def _thread_ended(number: int) -> None:
    """Finalizer of a thread's token, run as the thread ends: release its trees. Never raises."""
    if sys.is_finalizing():
        return
    with _lock:
        ended = [key for key in _all if key[0] == number]
        trees = [_all.pop(key)[1] for key in ended]
    for mgr in trees:
        try:
            mgr.release()
        except Exception as exc:  # noqa: BLE001 - a finalizer: the tree's memory may stay reserved
            try:
                warnings.warn(ResourceLeakWarning(f"releasing the graph tree of an ended thread raised {exc!r}"),
                              stacklevel=2)
            except Exception:  # noqa: BLE001
                pass


def _every_tree() -> list[tuple[int, str, TreeManager]]:
    """``(device ordinal, thread name, tree)`` of every live thread, by device, then thread."""
    with _lock:
        items = sorted(_all.items())
    return sorted(((ordinal, name, mgr) for (_, ordinal), (name, mgr) in items), key=lambda t: t[0])


class GraphedFunction:
    """A function whose calls are warmed up, recorded and replayed by the calling thread's graph tree
    of their device."""

    kernel_groups = None  # groups of kernel-choosing settings its warm-ups showed it reads (growth.learn_kernel_groups)
    kernel_getters = None  # the getters of those settings read on each call; None: every group
    compiled_groups = frozenset()  # groups its code fixed when compiled (Inductor's): not read per call
    copies_out = False  # a graphed backward's outputs are copied out (interop.torch.autograd); never a user's
    writes_inputs = False  # a warm-up found it writing an eager input (or it declares mutates): see input_plan.shared_memory
    shared_memo = None  # input_plan.shared_memory's measures of its inputs read in place, by key
    inputs_guarded = False  # its caller guarantees its tensor inputs' dtypes and devices (the torch.compile backend's partitions)
    static_positions = ()  # with inputs_guarded: positions of tensors its caller keeps at one address (read in place)
    guarded_kinds = None  # with inputs_guarded: (static_positions, {argument types: (leading tensors, their kinds)}) (calls.inspect)
    continues_step = False  # a call of it never begins a generation: it follows another piece of one compiled graph
    is_backward = False

    def __init__(self, fn, *, static_argnums=(), mutates=(), pad_buckets=None):
        if not callable(fn):
            raise TypeError(f"cgraw.graphed needs a callable, not {type(fn).__name__}")
        self.fn = fn
        self.name = _unique(_name_of(fn))
        self.fn_id = next_fn_id()
        self.static_argnums = frozenset(_ints("static_argnums", static_argnums))
        self.mutates = tuple(_ints("mutates", mutates))
        self.writes_inputs = bool(self.mutates)
        self.pad_buckets = buckets.check(pad_buckets)
        self.plain = not self.static_argnums and not self.pad_buckets  # calls.inspect's hot path applies
        reason = getattr(fn, "_cgraw_unsafe", None)
        self.unsafe_reason = None if reason is None else f"marked @cgraw.unsafe ({reason})"
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if args:
            a = args[0]
            t = type(a)
            if t is _tensor_type[0] or t is _tensor_type[1]:  # fast path: a torch tensor or parameter first
                d = a.get_device()
                if d >= 0:
                    mgr = _here.trees.get(d)
                    if mgr is not None:
                        return mgr.call_here(self, args, kwargs)
        return _manager(_device_of(args, kwargs)).call_here(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<cgraw.graphed {self.name}>"


def graphed(fn=None, *, static_argnums=(), mutates=(), pad_buckets=None):
    """Make ``fn`` a graphed function: ``@cgraw.graphed`` or ``cgraw.graphed(fn, static_argnums=(0,))``.

    Args:
        static_argnums: positions read in place (never copied); their addresses are checked on
            every call and a change re-records.
        mutates: positions of eager inputs the function writes in place (found at warm-up by
            comparing contents too); they are copied back after each replay.
        pad_buckets: sizes of the leading (batch) dimension to record, e.g. ``(1, 2, 4, 8)``: a
            call with ``n`` rows replays the recording of the smallest bucket ``>= n``, with its
            eager inputs padded and its outputs cut back to ``n`` rows. Only for functions whose
            rows are independent; see ``cgraw.trees.buckets``.
    """
    kw = dict(static_argnums=static_argnums, mutates=mutates, pad_buckets=pad_buckets)
    if fn is None:
        return lambda f: GraphedFunction(f, **kw)
    return GraphedFunction(fn, **kw)


def unsafe(fn=None, *, reason: str = "must not be captured"):
    """Mark a function that must never be captured.

    Graphed directly, it always runs eagerly. Called inside a capture it raises
    ``cgraw.errors.UnsafeCallError``, which ends the capture: ``cgraw.capture()`` then raises a
    ``CaptureError`` naming the function, and a graphed function runs eagerly with that reason.
    """
    if fn is None:
        return lambda f: unsafe(f, reason=reason)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if capturing():
            raise UnsafeCallError(f"calls @cgraw.unsafe function {fn.__qualname__!r} ({reason})")
        return fn(*args, **kwargs)

    wrapper._cgraw_unsafe = reason
    return wrapper


def mark_step_begin() -> None:
    """Begin a new generation in the calling thread's trees, on every device: outputs they handed
    out so far become invalid. Other threads' generations go on."""
    for mgr in list(_here.trees.values()):
        mgr.mark_step_begin()


def report(*, file=None) -> str:
    """Per function: recordings, re-records and why, replays, skips and why, capture and
    instantiate time; per tree (every thread's): pool bytes and the tree itself; then the compiled
    functions that run without cgraw, and why (``note_without_graphs``). Printed and returned."""
    with _tree.SERIAL:  # other threads' trees do not grow meanwhile
        text = _report_lines(_every_tree())
    with _lock:
        ungraphed = list(_without_graphs.items())
    if ungraphed:
        lines = [] if text.startswith("cgraw: no graphed") else [text]
        lines.append("compiled code that runs without cgraw's graphs:")
        lines += [f"  {name}: {why}" for name, why in ungraphed]
        text = "\n".join(lines)
    print(text, file=file or sys.stdout)
    return text


_without_graphs: dict[str, str] = {}  # name -> why it runs without graphs; guarded by _lock


def note_without_graphs(name: str, reason: str) -> None:
    """Record that the compiled code ``name`` runs without cgraw's graphs, and why (the
    ``torch.compile`` backend: a partition it does not graph, a compile that fell back to Inductor);
    ``report()`` lists it until ``forget_without_graphs()``."""
    with _lock:
        _without_graphs[name] = reason


def without_graphs() -> dict[str, str]:
    """``{name: reason}`` of the compiled code ``note_without_graphs`` recorded."""
    with _lock:
        return dict(_without_graphs)


def forget_without_graphs() -> None:
    """Clear what ``note_without_graphs`` recorded."""
    with _lock:
        _without_graphs.clear()


def tree_here(ordinal: int) -> TreeManager | None:
    """The calling thread's tree on device ``ordinal``, or None before its first graphed call there."""
    return _here.trees.get(ordinal)


def _report_lines(trees) -> str:
    lines = []
    for ordinal, thread, mgr in trees:
        pool = mgr.backend.pool
        st = pool.stats() if not pool.closed else None
        torch_bytes = pool.torch_reserved_bytes if not pool.closed else 0
        lines.append(f"device {ordinal}, thread {thread}: pool reserved {_mib(st.reserved_bytes if st else 0)} "
                     f"(+{_mib(torch_bytes)} through torch), {len(mgr.nodes())} tree node(s)")
        for s in list(mgr.stats.values()):  # the owning thread may add one meanwhile
            lines.append(f"  {s.name}: {s.recordings} recording(s), {s.rerecords} re-record(s), "
                         f"{s.replays} replay(s), {s.warmups} warm-up(s), {s.eager_calls} eager call(s), "
                         f"{s.variants} input signature(s), capture {s.capture_ms:.1f} ms, "
                         f"instantiate {s.instantiate_ms:.1f} ms")
            if s.promoted:
                lines.append("    made a root function: called cgraw.config.path_repeat_limit times on one path")
            for r in s.rerecord_reasons[-5:]:
                lines.append(f"    re-recorded: {r}")
            for r, n in list(s.skip_reasons.items()):
                lines.append(f"    skipped {n}x: {r}")
        for n in mgr.nodes():
            if n.recording is not None:
                k = mgr.backend.random_draws(n.recording)
                draws = f", {k} random draw(s) per replay" if k else ""
                notes = mgr.backend.input_notes(n.recording)
                inputs = ""
                if notes:
                    rebound = sum(1 for why in notes.values() if why is None)
                    inputs = f", {rebound} input(s) rebound, {len(notes) - rebound} copied"
                lines.append(f"    node {n.fn.name} depth {n.depth}: {mgr.backend.num_nodes(n.recording)} graph nodes"
                             + draws + inputs)
                for leaf, why in sorted(notes.items()):
                    if why is not None:
                        lines.append(f"      input {leaf} copied: {why}")
        lines.append(mgr.describe())
    return "\n".join(lines) if lines else "cgraw: no graphed function has run"


def tree_text(device: int = 0) -> str:
    """The calling thread's tree of ``device`` as text: which recording follows which."""
    mgr = _here.trees.get(device)
    return mgr.describe() if mgr is not None else f"no graph tree on device {device} in this thread"


def reset() -> None:
    """Free the calling thread's trees, their recordings and their pools. Memory that outputs
    handed out still use stays valid until they are gone; the rest goes back once no capture
    routes allocations. Other threads' trees stay (each is freed when its thread ends)."""
    here = _here
    mgrs = list(here.trees.values())
    here.trees.clear()
    if here.token is not None:
        with _lock:
            for key in [k for k in _all if k[0] == here.token.number]:
                del _all[key]
    for mgr in mgrs:
        mgr.reset()


def _name_of(fn) -> str:
    """A short name for reports and logs: a function's qualified name, a module's class (never a
    ``repr``, which for a model runs to hundreds of lines)."""
    import types

    if isinstance(fn, functools.partial):
        return f"partial({_name_of(fn.func)})"
    orig = getattr(fn, "_torchdynamo_orig_callable", None)
    if orig is not None:
        return f"{_name_of(orig)} (compiled)"
    mod = getattr(fn, "_orig_mod", None)  # torch.compile(module): an OptimizedModule
    if mod is not None and type(fn).__name__ == "OptimizedModule":
        return f"{_name_of(mod)} (compiled)"
    if isinstance(fn, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return fn.__qualname__
    q = getattr(fn, "__qualname__", None)
    if isinstance(q, str) and not isinstance(fn, type):
        return q
    return type(fn).__qualname__ if not isinstance(fn, type) else fn.__qualname__


_names: dict[str, int] = {}  # name -> graphed functions given it so far; guarded by _lock


def _unique(name: str) -> str:
    """``name``, or ``name#2``, ``name#3``... when other graphed functions already have it."""
    with _lock:
        n = _names.get(name, 0) + 1
        _names[name] = n
    return name if n == 1 else f"{name}#{n}"


def _device_of(args, kwargs) -> int:
    from cgraw.trees.arrays import ops_of

    for a in itertools.chain(args, kwargs.values() if kwargs else ()):
        ops = ops_of(a)
        if ops is not None:
            d = ops.device(a)
            if d >= 0:
                return d
    return Device.current().ordinal


def _ints(name, values) -> list[int]:
    if isinstance(values, int):
        values = (values,)
    out = []
    for v in values:
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must hold non-negative ints, got {v!r}")
        out.append(v)
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


__all__ = ["GraphedFunction", "config", "graphed", "mark_static", "mark_step_begin", "report", "reset",
           "tree_text", "unsafe"]
