"""``@cgraw.graphed`` and the functions around it: one graph tree per device.

Layer L9 (public API). ``calls`` classifies a call, ``tree`` decides, ``treeexec`` does the CUDA work; this module
keeps the per-device registry and the user-facing helpers (``mark_step_begin``, ``mark_static``,
``unsafe``, ``report``, ``reset``).
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading

from cgraw import buckets
from cgraw.calls import mark_static
from cgraw.capture import capturing
from cgraw.device import Device
from cgraw.errors import UnsafeCallError
from cgraw.tree import TreeManager, config
from cgraw.treeexec import CudaBackend
from cgraw.treetypes import next_fn_id

_lock = threading.Lock()
_managers: dict[int, TreeManager] = {}  # device ordinal -> tree; guarded by _lock


_tensor_type = [None]  # [torch.Tensor] once torch is loaded


def _manager(ordinal: int) -> TreeManager:
    mgr = _managers.get(ordinal)
    if mgr is None:
        with _lock:
            mgr = _managers.get(ordinal)
            if mgr is None:
                if _tensor_type[0] is None and "torch" in sys.modules:
                    _tensor_type[0] = sys.modules["torch"].Tensor
                dev = Device(ordinal).set_current()
                mgr = _managers[ordinal] = TreeManager(CudaBackend(dev), device_index=ordinal)
                mgr.backend.mgr = mgr  # a backward asks its tree for the plan (interop.torch_autograd)
    return mgr


class GraphedFunction:
    """A function whose calls are warmed up, recorded and replayed by its device's graph tree."""

    kernel_groups = None  # groups of kernel-choosing settings its warm-ups showed it reads (calls.learn_kernel_groups)
    kernel_getters = None  # the getters of those settings read on each call; None: every group

    def __init__(self, fn, *, static_argnums=(), mutates=(), pad_buckets=None):
        if not callable(fn):
            raise TypeError(f"cgraw.graphed needs a callable, not {type(fn).__name__}")
        self.fn = fn
        self.name = _unique(_name_of(fn))
        self.fn_id = next_fn_id()
        self.static_argnums = frozenset(_ints("static_argnums", static_argnums))
        self.mutates = tuple(_ints("mutates", mutates))
        self.pad_buckets = buckets.check(pad_buckets)
        self.plain = not self.static_argnums and not self.pad_buckets  # calls.inspect's hot path applies
        reason = getattr(fn, "_cgraw_unsafe", None)
        self.unsafe_reason = None if reason is None else f"marked @cgraw.unsafe ({reason})"
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if args:
            a = args[0]
            if type(a) is _tensor_type[0]:  # fast path: a torch tensor first
                d = a.get_device()
                if d >= 0:
                    mgr = _managers.get(d)
                    if mgr is not None:
                        return mgr.call(self, args, kwargs)
        return _manager(_device_of(args, kwargs)).call(self, args, kwargs)

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
            rows are independent; see ``cgraw.buckets``.
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
    """Begin a new generation on every device: outputs handed out so far become invalid."""
    for mgr in list(_managers.values()):
        mgr.mark_step_begin()


def report(*, file=None) -> str:
    """Per function: recordings, re-records and why, replays, skips and why, capture and
    instantiate time; per tree: pool bytes and the tree itself. Printed and returned."""
    lines = []
    for ordinal, mgr in sorted(_managers.items()):
        pool = mgr.backend.pool
        st = pool.stats() if not pool.closed else None
        torch_bytes = pool.torch_reserved_bytes if not pool.closed else 0
        lines.append(f"device {ordinal}: pool reserved {_mib(st.reserved_bytes if st else 0)} "
                     f"(+{_mib(torch_bytes)} through torch), {len(mgr.nodes())} tree node(s)")
        for s in mgr.stats.values():
            lines.append(f"  {s.name}: {s.recordings} recording(s), {s.rerecords} re-record(s), "
                         f"{s.replays} replay(s), {s.warmups} warm-up(s), {s.eager_calls} eager call(s), "
                         f"{s.variants} input signature(s), capture {s.capture_ms:.1f} ms, "
                         f"instantiate {s.instantiate_ms:.1f} ms")
            if s.promoted:
                lines.append("    made a root function: called cgraw.config.path_repeat_limit times on one path")
            for r in s.rerecord_reasons[-5:]:
                lines.append(f"    re-recorded: {r}")
            for r, n in s.skip_reasons.items():
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
    text = "\n".join(lines) if lines else "cgraw: no graphed function has run"
    print(text, file=file or sys.stdout)
    return text


def tree_text(device: int = 0) -> str:
    """The tree of ``device`` as text: which recording follows which."""
    mgr = _managers.get(device)
    return mgr.describe() if mgr is not None else f"no graph tree on device {device}"


def reset() -> None:
    """Free every tree, its recordings and its pool. Memory that outputs handed out still use
    stays valid until they are gone; the rest goes back once no capture routes allocations.
    Must be called from the thread that owns the trees."""
    with _lock:
        mgrs = list(_managers.values())
        for mgr in mgrs:
            mgr.check_thread("cgraw.reset()")
        _managers.clear()
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
    from cgraw.arrays import ops_of

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
