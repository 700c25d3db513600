"""What the torch random-number router changes in torch while a capture routes, and where it looks.

Layer L7: torch is found in ``sys.modules``; used by ``interop.torch.rng`` only.

While any capture routes torch's random numbers (counted, across threads):

- ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` runs on torch's math backend on the
  capturing thread, so its dropout is a ``native_dropout`` the router draws;
- ``torch.cuda.get_rng_state`` and ``set_rng_state`` answer, on a stream being captured where
  torch refuses to read or set its generator (``assertNotCapturing``), with the generator's state
  when the routing began, and set nothing. ``torch.utils.checkpoint`` calls them on every forward
  and recomputation; no captured work reads torch's generator (the router draws every number), so
  that state is the generator's state throughout the capture.

``checkpoint_region`` tells the router when a draw happens inside a ``torch.utils.checkpoint``
with ``preserve_rng_state=True`` (its default): its recomputation puts torch's generator back and
expects the same numbers, which graphed draws cannot give again (they are drawn by cgraw's kernels
when the graph replays; the recomputation may run in another graph, or eagerly on torch's own),
so the router refuses such draws.
"""

from __future__ import annotations

import os
import sys
import threading

_tls = threading.local()  # .active: the RngStream of this thread's routing capture, else None
_patch_lock = threading.Lock()
# routings under way, and those with the SDPA wrapper (guarded by _patch_lock)
_patch = {"count": 0, "sdpa": 0, "orig": None, "wrapper": None, "get": None, "set": None}
_held: dict = {}  # device -> torch's generator state when the first routing on it began (under _patch_lock)


def install(stream, *, sdpa: bool = True) -> None:
    """Patch (first routing) and note this thread's routing ``stream`` (an ``rng.plan.RngStream``).
    ``sdpa``: this routing needs ``F.scaled_dot_product_attention``'s wrapper (not for a
    recording of torch.compile'd code: dynamo guards on that global and would compile again)."""
    _tls.active = stream
    try:
        _install(stream.device, sdpa)
    except BaseException:
        _tls.active = None
        raise


def remove(*, sdpa: bool = True) -> None:
    """End this thread's routing; unpatch after the last one."""
    _tls.active = None
    _remove(sdpa)


def _install(device: int, sdpa: bool) -> None:
    torch = sys.modules["torch"]
    F = torch.nn.functional
    with _patch_lock:
        if sdpa and _patch["sdpa"] == 0:
            orig = F.scaled_dot_product_attention
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def scaled_dot_product_attention(*args, **kwargs):
                p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
                if p and getattr(_tls, "active", None) is not None:
                    with sdpa_kernel([SDPBackend.MATH]):
                        return orig(*args, **kwargs)
                return orig(*args, **kwargs)

            scaled_dot_product_attention.__wrapped__ = orig
            _patch["orig"], _patch["wrapper"] = orig, scaled_dot_product_attention
            F.scaled_dot_product_attention = scaled_dot_product_attention
        _patch["sdpa"] += bool(sdpa)
        if _patch["count"] == 0:
            _patch["get"], _patch["set"] = _patch_generator_state(torch.cuda)
        if device not in _held:
            try:
                _held[device] = torch.cuda.default_generators[device].get_state()
            except (IndexError, RuntimeError):  # no such generator: torch's own error stands
                pass
        _patch["count"] += 1


def _remove(sdpa: bool) -> None:
    torch = sys.modules.get("torch")
    with _patch_lock:
        if _patch["count"] <= 0:
            return
        _patch["count"] -= 1
        if sdpa and _patch["sdpa"] > 0:
            _patch["sdpa"] -= 1
            if _patch["sdpa"] == 0:
                F = torch.nn.functional
                if F.scaled_dot_product_attention is _patch["wrapper"]:
                    F.scaled_dot_product_attention = _patch["orig"]
                _patch["orig"] = _patch["wrapper"] = None
        if _patch["count"] == 0:
            for name, key in (("get_rng_state", "get"), ("set_rng_state", "set")):
                orig, wrapper = _patch[key] or (None, None)
                if getattr(torch.cuda, name, None) is wrapper and orig is not None:
                    setattr(torch.cuda, name, orig)
            _patch["get"] = _patch["set"] = None
            _held.clear()


def _patch_generator_state(cuda) -> tuple:
    """Wrap ``cuda.get_rng_state``/``set_rng_state`` so that, on a stream being captured, where torch
    refuses (``assertNotCapturing``), they read the state held at the routing's start and set
    nothing; ``((orig, wrapper), (orig, wrapper))``."""
    orig_get, orig_set = cuda.get_rng_state, cuda.set_rng_state

    def get_rng_state(device="cuda"):
        try:
            return orig_get(device)
        except RuntimeError:
            held = _held.get(_device_index(cuda, device))
            if held is None or not cuda.is_current_stream_capturing():
                raise
            return held.clone()

    def set_rng_state(new_state, device="cuda"):
        try:
            return orig_set(new_state, device)
        except RuntimeError:
            if not cuda.is_current_stream_capturing():
                raise
            return None  # no captured work reads torch's generator: its state stays as it was

    get_rng_state.__wrapped__, set_rng_state.__wrapped__ = orig_get, orig_set
    cuda.get_rng_state, cuda.set_rng_state = get_rng_state, set_rng_state
    return (orig_get, get_rng_state), (orig_set, set_rng_state)


def _device_index(cuda, device) -> int:
    """The ordinal ``torch.cuda.get_rng_state(device)`` means (an int, ``"cuda:1"``, a ``torch.device``)."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        index = int(device.rsplit(":", 1)[1]) if ":" in device else None
    else:
        index = getattr(device, "index", None)
    return cuda.current_device() if index is None else index


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def checkpoint_region() -> str | None:
    """``"forward"`` or ``"recomputation"`` when this thread runs inside a ``torch.utils.checkpoint``
    that puts torch's random state back for its recomputation (``preserve_rng_state``), else None.
    Read from the Python stack (only when a draw is routed): the reentrant forward
    (``CheckpointFunction.forward``) and backward, the non-reentrant ``checkpoint`` call (with grad
    enabled: otherwise it keeps nothing to recompute) and its ``recompute_fn``."""
    torch = sys.modules["torch"]
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code.co_filename.endswith(_CHECKPOINT_FILE):
            where = _region(code.co_name, f.f_locals, torch)
            if where is not None:
                return where
        f = f.f_back
    return None


def _region(name: str, loc: dict, torch) -> str | None:
    """What one frame of torch/utils/checkpoint.py says (see ``checkpoint_region``)."""
    if name == "forward" and "preserve_rng_state" in loc:  # CheckpointFunction.forward
        grads = any(getattr(a, "requires_grad", False) for a in loc.get("args", ()))
        return "forward" if loc["preserve_rng_state"] and grads else None
    if name == "backward" and "ctx" in loc:  # CheckpointFunction.backward
        return "recomputation" if getattr(loc["ctx"], "preserve_rng_state", True) else None
    if name == "recompute_fn":
        return "recomputation" if loc.get("preserve_rng_state", True) else None
    if name == "checkpoint" and "preserve" in loc and not loc.get("use_reentrant", False):
        return "forward" if loc["preserve"] and torch.is_grad_enabled() else None
    return None
