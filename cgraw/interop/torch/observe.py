"""What a graphed function's warm-up does, seen from torch's dispatcher; and module changes.

Layer L7: torch is imported lazily (only once the user has imported it).

A warm-up runs the function eagerly once. Under ``Observer`` (a ``TorchDispatchMode``, so it sees
every aten and custom op below autograd, at no cost to later replays) cgraw learns:

- ``unsafe``: a custom op tagged ``torch._C.Tag.cudagraph_unsafe`` ran (torch's trees skip such
  functions; so does cgraw);
- ``cpu_random``: a random-number op made a CPU tensor (a replay would repeat the numbers);
- ``ops``: the names of the ops that ran (which kernel-choosing settings the function depends
  on, ``interop.torch.kernel_state.groups_of``);
- ``backward``: an op ran inside a backward pass (``torch.autograd.grad``, ``torch.func.grad``):
  the recording then routes allocations by stream, where autograd's device thread allocates;
- ``external``: tensors the function read that are neither its arguments nor made during the
  call, and are still alive after it: closure tensors, such as a model's weights reached through
  ``self``, or a buffer it writes in place (``self.count.add_(1)``). A recording reads them by address, so cgraw keeps them alive and checks their
  addresses on every call (``model.half()``, ``param.data = ...`` move them).

The Observer is a ``interop.torch.modes.mode_base()`` mode: the bodies of higher-order operators
(``torch.cond``, ``while_loop``, ``scan``) are observed like any other code, and torch.compile'd
code called inside the function is compiled during the warm-up and runs compiled under it. Of
compiled code the Observer sees only what goes through the dispatcher (extern kernels such as
``mm``, custom and fallback ops, the seeds of Inductor's random numbers), not the tensors its
Triton kernels read: closure tensors read only there are not in ``external``. A function that is
itself ``torch.compile``d (``cgraw.graphed(torch.compile(f))``) is not observed.

``mode_epoch_now`` counts switches of any module between training and evaluation (``model.train()``,
``model.eval()``): a recording made in the other mode warms up again (``Recording.stale``).

``epoch()`` counts assignments that replace a tensor some recording reads through its closure:
a parameter, buffer or submodule of any ``nn.Module`` (``m.bias = nn.Parameter(...)``), seen
through torch's global registration hooks, whose old value is one of the ``watch``ed tensors (or,
for a submodule, holds one). A recording made in an earlier epoch warms up again. Assignments
that replace nothing watched (building a new model) change nothing.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref

from cgraw.interop.torch import private_api, modes as torch_modes

epoch_now = [0]  # assignments that replaced a watched tensor so far; one list, so holders see it change
mode_epoch_now = [0]  # switches of any module between training and evaluation (Module.train) so far
_hooks_installed = [False]
_observer_cls: list = [None]
_watched: dict[int, int] = {}  # id(tensor) -> recordings reading it through their closure


def epoch() -> int:
    return epoch_now[0]


def watch(tensors) -> None:
    for t in tensors:
        _watched[id(t)] = _watched.get(id(t), 0) + 1


def unwatch(tensors) -> None:
    for t in tensors:
        n = _watched.get(id(t), 0) - 1
        if n > 0:
            _watched[id(t)] = n
        else:
            _watched.pop(id(t), None)


def _replaces_watched(old) -> bool:
    if old is None or not _watched:
        return False
    if id(old) in _watched:
        return True
    params = getattr(old, "parameters", None)
    if callable(params):  # a submodule replaced: any of its tensors watched?
        try:
            return any(id(t) in _watched for t in list(old.parameters()) + list(old.buffers()))
        except Exception:
            return True
    return False


def _param_hook(module, name, value):
    if _replaces_watched(getattr(module, "_parameters", {}).get(name)):
        epoch_now[0] += 1


def _buffer_hook(module, name, value):
    if _replaces_watched(getattr(module, "_buffers", {}).get(name)):
        epoch_now[0] += 1


def _module_hook(module, name, value):
    if _replaces_watched(getattr(module, "_modules", {}).get(name)):
        epoch_now[0] += 1


def install_module_hooks() -> None:
    """Watch module assignments from now on (once per process)."""
    if _hooks_installed[0]:
        return
    torch = sys.modules["torch"]
    m = torch.nn.modules.module
    for name, hook in (("register_module_parameter_registration_hook", _param_hook),
                       ("register_module_buffer_registration_hook", _buffer_hook),
                       ("register_module_module_registration_hook", _module_hook)):
        reg = getattr(m, name, None)
        if reg is not None:
            reg(hook)
    _patch_train(torch.nn.Module)
    _hooks_installed[0] = True


def _patch_train(module_cls) -> None:
    """Count switches between training and evaluation: ``Module.train(mode)`` (``eval()`` calls it)
    wrapped so that a call that changes any module's ``training`` flag adds one to ``mode_epoch_now``.
    A recording made in one mode is stale in the other (dropout, batch norm run differently);
    a flag assigned directly (``m.training = False``) is not seen."""
    original = module_cls.train
    if getattr(original, "_cgraw_counts_modes", False):
        return

    nested = threading.local()  # train() calls itself on every child: only the outermost call counts

    @functools.wraps(original)
    def train(self, mode=True):
        if getattr(nested, "depth", 0):
            return original(self, mode)
        changed = isinstance(mode, bool) and any(m.training != mode for m in self.modules())
        nested.depth = 1
        try:
            out = original(self, mode)
        finally:
            nested.depth = 0
        if changed:
            mode_epoch_now[0] += 1
        return out

    train._cgraw_counts_modes = True
    module_cls.train = train


def is_compiled(fn) -> bool:
    """Whether ``fn`` is a ``torch.compile``d function or module."""
    return (getattr(fn, "_torchdynamo_orig_callable", None) is not None
            or type(fn).__name__ == "OptimizedModule" or hasattr(fn, "_orig_mod"))


def _tensors(x, out: list, T) -> None:
    if isinstance(x, T):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _tensors(v, out, T)
    elif isinstance(x, dict):
        for v in x.values():
            _tensors(v, out, T)


def observer(inputs):
    """An ``Observer`` for a warm-up whose tensor arguments are ``inputs``."""
    cls = _observer_cls[0]
    if cls is None:
        cls = _observer_cls[0] = _make_observer_class()
    return cls(inputs)


def _make_observer_class():
    torch = sys.modules["torch"]
    unsafe_tag = private_api.cudagraph_unsafe_tag()
    seeded_tag = private_api.nondeterministic_seeded_tag()
    graph_task = private_api.graph_task_id()
    T = torch.Tensor

    class Observer(torch_modes.mode_base()):
        def __init__(self, inputs):
            super().__init__()
            self.inputs = {id(t) for t in inputs}
            self.created: set[int] = set()
            self.seen: dict[int, weakref.ref] = {}
            self.unsafe: str | None = None
            self.cpu_random: str | None = None
            self.ops: set = set()  # namespace::overload names of the ops that ran (kernel_state.groups_of)
            self.backward = False  # an op ran inside a backward pass (torch.func.grad's too)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.is_higher_order(func):
                out = self.run_higher_order(func, args, kwargs)
            else:
                out = func(*args, **(kwargs or {}))
            try:
                self._note(func, args, kwargs, out)
            except Exception:  # bookkeeping must never break the user's function
                pass
            return out

        def _note(self, func, args, kwargs, out) -> None:
            self.ops.add(f'{getattr(func, "namespace", "aten")}::{getattr(func, "__name__", "")}')
            if not self.backward and graph_task is not None and graph_task() != -1:
                self.backward = True
            tags = getattr(func, "tags", ())
            if self.unsafe is None and unsafe_tag is not None and unsafe_tag in tags:
                self.unsafe = str(func)
            ins: list = []
            _tensors(args, ins, T)
            if kwargs:
                _tensors(kwargs, ins, T)
            created, inputs, seen = self.created, self.inputs, self.seen
            for t in ins:
                i = id(t)
                if i not in created and i not in inputs and i not in seen and t.is_cuda:
                    seen[i] = weakref.ref(t)
            outs: list = []
            _tensors(out, outs, T)
            for t in outs:  # an in-place or out= op returns its argument: made before, not here
                if not any(t is a for a in ins):
                    created.add(id(t))
            # random numbers made on the CPU (every output on the CPU: torch.rand(3), bernoulli_ of
            # a CPU tensor); not a CUDA op that also returns its CPU seed and offset (sdpa's)
            if (self.cpu_random is None and seeded_tag is not None and seeded_tag in tags and outs
                    and not any(t.is_cuda for t in outs)):
                self.cpu_random = str(func)

        def external(self, exclude) -> list:
            """Closure tensors: read, not arguments, not made here, still alive now."""
            skip = {id(t) for t in exclude}
            out = []
            for i, r in self.seen.items():
                t = r()
                if t is not None and i not in skip and i not in self.created:
                    out.append(t)
            return out

    return Observer


def ptrs_check(tensors, refs=()):
    """A function ``ptrs -> bool`` telling whether ``tensors``, then the tensors behind the weak
    references ``refs``, still have the data pointers ``ptrs`` (a list): C-level ``map``s over
    ``Tensor.data_ptr``. A dead reference makes it False (the recording can never replay)."""
    ts, rs = tuple(tensors), tuple(refs)
    data_ptr = sys.modules["torch"].Tensor.data_ptr
    if not rs:
        def same(ptrs: list) -> bool:
            return list(map(data_ptr, ts)) == ptrs
        return same
    deref = weakref.ref.__call__

    def same_keyed(ptrs: list) -> bool:
        try:
            return list(map(data_ptr, ts)) + list(map(data_ptr, map(deref, rs))) == ptrs
        except TypeError:  # a reference is dead: data_ptr(None)
            return False
    return same_keyed
