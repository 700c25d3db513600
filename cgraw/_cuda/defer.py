"""Nothing is freed while a capture routes allocations: releases wait for the last capture to end.

Layer L1: imports ``errors``. Every cgraw capture, on any thread, is counted from before it enters
torch's and CuPy's pool routing until after it leaves it. While the count is non-zero, finalizers
and explicit releases (``cuGraphExecDestroy``, ``cuMemFree``, a torch ``MemPool`` dropped) are
queued instead of run; the capture that brings the count back to zero runs the queue. Why:
torch aborts the process when a ``MemPool`` is destroyed while any capture routes into a pool
(``captures_underway.empty()`` is asserted in ``synchronize_and_free_events``), and ``cuMemFree``
or a synchronising destroy on a capturing thread invalidates its capture.

The count is process-wide, not per thread, because torch's assertion is. Queued work runs under
``lock`` (re-entrant: a release may drop the last reference to another deferred object), so a
capture that begins on another thread waits until the queue is empty.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import warnings

from cgraw.errors import ResourceLeakWarning

# Test mode: gc.collect() at every capture boundary and in every allocation made while a capture
# routes allocations, so finalizers (graphs, pools, torch MemPools) fire at the worst moments.
CGRAW_GC_STRESS = os.environ.get("CGRAW_GC_STRESS", "").strip().lower() in ("1", "true", "yes", "on")

lock = threading.RLock()  # guards active_count and the queue; held to keep captures from beginning
active_count = 0  # captures routing allocations now, all threads; guarded by lock
_queue: list = []  # (fn, args) waiting for active_count == 0; guarded by lock


def active() -> bool:
    """Whether any cgraw capture routes allocations now (on any thread)."""
    return active_count > 0


def release(fn, *args) -> None:
    """Run ``fn(*args)`` now, or once no capture routes allocations. Never raises."""
    if active_count:
        with lock:
            if active_count:
                _queue.append((fn, args))
                return
    _run(fn, args)


def capture_begins() -> None:
    """Count a capture in (before it routes any allocation)."""
    global active_count
    with lock:
        active_count += 1


def capture_ends() -> None:
    """Count a capture out (after its routing ended); the last one runs the queued releases."""
    global active_count
    with lock:
        active_count -= 1
        if active_count < 0:
            active_count = 0
        while active_count == 0 and _queue:
            fn, args = _queue.pop(0)
            _run(fn, args)


def pending() -> int:
    """Releases waiting for the captures now running to end (tests and diagnostics)."""
    return len(_queue)


def _run(fn, args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # a release runs from finalizers: it must never raise
        if not sys.is_finalizing():
            try:
                warnings.warn(ResourceLeakWarning(f"deferred release {getattr(fn, '__name__', fn)} "
                                                  f"raised {exc!r}"), stacklevel=2)
            except Exception:
                pass


def gc_stress() -> None:
    """Under ``CGRAW_GC_STRESS=1``, collect garbage now (a no-op otherwise)."""
    if CGRAW_GC_STRESS:
        gc.collect()


__all__ = ["active", "capture_begins", "capture_ends", "gc_stress", "pending", "release"]
