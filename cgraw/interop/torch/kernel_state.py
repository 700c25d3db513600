"""The process-wide torch settings that choose which kernels eager code runs, as part of a graphed
call's signature: a recording made under one setting is never replayed under another.

Layer L7: torch's private getters only through ``interop.torch.private_api``; torch is found in
``sys.modules``.

Eager torch picks kernels from state outside the arguments: autocast (enabled and dtype per
device type, its cache), TF32 and reduced-precision reductions in cuBLAS, the float32 matmul
precision, deterministic algorithms (and their filling of uninitialised memory), the default
dtype, inference mode, cuDNN's flags (enabled, benchmark, deterministic, TF32) and the
scaled-dot-product-attention backends. ``KernelState`` turns the current values into a small int
that ``calls.inspect`` appends to the call's key, so each combination selects a recording of its
own, as dynamo's global-state guard selects a compiled frame.

Cost. Reading every getter costs about 1 µs a call. Most of the state is what dynamo's
``GlobalStateGuard`` checks in one C call (about 0.1 µs), so those values are read again only when
that check fails (a few recent guards are kept, so a loop alternating two states reads nothing);
the settings outside it (inference mode, fp16 accumulation, the deterministic fill) are read on
every call, the cuDNN and attention groups only for functions whose warm-up ran such ops
(``groups_of``; a function not yet warmed up reads them all), and the attention group not for
code Inductor compiled (``COMPILED``: its code runs the backend the flags chose at its compile).
An op outside torch's namespaces (``torch.library.custom_op``, an extension's op) runs its body
below the warm-up's dispatch mode, out of its sight: a function that ran one reads every group,
compiled or not (``OPAQUE``).
A guard is used only if it is seen to notice a change of autocast (the newest of its fields);
otherwise every value is read on every call.
"""

from __future__ import annotations

import operator
import sys
import threading

from cgraw.interop.torch import private_api

GROUPS = ("cudnn", "sdp")  # the groups read only for functions that need them; "core" is always read
# the groups Inductor's code does not read when it runs: it lowers attention to the op of the backend
# the flags chose when it compiled (torch's FX graph cache keys on them for that reason)
COMPILED = frozenset({"sdp"})
# namespaces of torch's own ops: a dispatch mode sees the ops inside them, or the op is the kernel the
# groups name. An op of any other namespace runs its body unseen, so its function reads every group
TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "higher_order", "inductor", "_c10d_functional",
                              "c10d", "profiler", "debugprims", "rngprims"})
OPAQUE = "opaque"  # in groups_of's answer: such an op ran; what compiled code fixed does not cover it
_RECENT = 4  # guards kept for states seen recently

# op-name fragments (aten overload names, lower case) that put a function in a group
_GROUP_OPS = {
    "cudnn": ("conv", "cudnn", "batch_norm", "rnn", "lstm", "gru", "grid_sampler", "ctc_loss"),
    "sdp": ("attention", "sdpa", "scaled_dot_product"),
}


def groups_of(op_names) -> frozenset:
    """The groups of settings that ops named ``op_names`` (``namespace::overload`` names; aten's
    without a namespace) depend on: every group and ``OPAQUE`` if one is outside torch's namespaces."""
    found = set()
    for n in op_names:
        ns, sep, n = n.lower().rpartition("::")
        if sep and ns not in TORCH_NAMESPACES:
            return frozenset((*GROUPS, OPAQUE))
        for g, frags in _GROUP_OPS.items():
            if g not in found and any(f in n for f in frags):
                found.add(g)
    return frozenset(found)


class KernelState:
    """``state(groups)``: a small int naming the current value of every setting in ``core`` and
    in ``groups`` (a tuple of group names, or None for all)."""

    def __init__(self, torch):
        getters = private_api.kernel_state_getters()
        self._torch = torch
        self._core = (torch.is_inference_mode_enabled, *getters["core"])
        self._guarded_getters = getters["guarded"]
        self._groups = {g: getters[g] for g in GROUPS}
        self._devices = tuple(d for d in ("cuda", "cpu") if _autocast_readable(torch, d))
        # public for ``trees.calls``, which inlines ``state``'s common case (the newest guard holds):
        # ``ids[(recent[0][1], tuple(g() for g in getters))]``
        self.ids: dict = {}  # values -> id
        self._by_groups: dict = {}  # groups -> the getters read per call
        guard = private_api.global_state_guard()
        self._guard_cls = guard if guard is not None and _guard_sees_changes(torch, guard) else None
        self.recent: list = []  # [(guard, id of the values it covers)], newest first; never emptied
        self._lock = threading.Lock()  # threads change recent and ids one at a time

    # ------------------------------------------------------------------ per call

    def getters(self, groups, fixed=frozenset()) -> tuple:
        """The getters read on every call of a function in ``groups`` (None: every group), less the
        groups ``fixed`` by its compiled code unless an op outside its sight ran (``OPAQUE``)."""
        key = None if groups is None else frozenset(groups)
        if key is not None and OPAQUE not in key:
            key -= fixed
        got = self._by_groups.get(key)
        if got is None:
            names = GROUPS if key is None else [g for g in GROUPS if g in key]
            got = self._core + tuple(f for g in names for f in self._groups[g])
            self._by_groups[key] = got
        return got

    def state(self, getters) -> int:
        """The id of the current settings: the guarded ones and ``getters``' values."""
        recent = self.recent
        gid = recent[0][1] if recent and recent[0][0].check() else self._guarded()
        values = (gid, tuple(map(_call, getters)))
        try:
            return self.ids[values]
        except KeyError:
            with self._lock:
                return self.ids.setdefault(values, len(self.ids))

    def _guarded(self) -> int:
        """The id of the settings dynamo's guard covers, from a recent guard that still holds or
        read anew (without a usable guard: read on every call)."""
        with self._lock:
            return self._guarded_locked()

    def _guarded_locked(self) -> int:
        recent = self.recent
        for k in range(1, len(recent)):
            if recent[k][0].check():
                recent.insert(0, recent.pop(k))
                return recent[0][1]
        torch = self._torch
        values = (torch.get_default_dtype(), torch.is_autocast_cache_enabled(),
                  *[torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in self._devices],
                  *map(_call, self._guarded_getters))
        gid = self.ids.setdefault(values, len(self.ids))
        if self._guard_cls is not None:
            recent.insert(0, (self._guard_cls(), gid))
            del recent[_RECENT:]
        return gid


def _autocast_readable(torch, device: str) -> bool:
    try:
        torch.is_autocast_enabled(device)
        torch.get_autocast_dtype(device)
    except Exception:  # a device type this torch build has no autocast state for
        return False
    return True


def _guard_sees_changes(torch, guard_cls) -> bool:
    """Whether a fresh guard fails after this thread's autocast state changes (changed and put
    back at once). Only thread-local state is flipped: a process-wide one (TF32, the default
    dtype) would change what other threads' eager code runs meanwhile. Guards that check autocast
    also check TF32 and the default dtype (dynamo added autocast to a guard that had both); a torch
    whose guard misses autocast is read in full instead."""
    try:
        before = torch.is_autocast_enabled("cuda")
        g = guard_cls()
        torch.set_autocast_enabled("cuda", not before)
        try:
            return not g.check()
        finally:
            torch.set_autocast_enabled("cuda", before)
    except Exception:  # noqa: BLE001 - any surprise: do without the guard
        return False


_call = getattr(operator, "call", None) or operator.methodcaller("__call__")  # operator.call: Python 3.11+
_state: list = [None]


def kernel_state() -> KernelState:
    """The process's ``KernelState`` (made once torch is imported)."""
    ks = _state[0]
    if ks is None or ks._torch is not sys.modules.get("torch"):
        ks = _state[0] = KernelState(sys.modules["torch"])
    return ks


__all__ = ["COMPILED", "GROUPS", "OPAQUE", "TORCH_NAMESPACES", "KernelState", "groups_of", "kernel_state"]
