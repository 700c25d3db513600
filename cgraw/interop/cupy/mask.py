"""``a[mask] = scalar`` on CuPy arrays inside a capture, without the host read.

Layer L7: CuPy is reached through ``sys.modules``.

CuPy assigns through a boolean mask by counting the mask's true elements on the host first
(``_scatter_op_mask_single`` -> ``_prepare_mask_indexing_single`` -> ``int(...)``, seen on the H200
under ``cupyx.scipy.special.logsumexp``/``log_softmax`` and ``cupy.linalg.lstsq``/
``pinv``: ``x_max[~isfinite(x_max)] = 0``, ``s1[s <= cutoff] = 0``), which no graph can do. With a
scalar value the count is not needed: the assignment is ``cupy.copyto(a, value, casting="unsafe",
where=mask)`` (the mask broadcast over the trailing axes it does not cover), one elementwise kernel.

While a capture routes CuPy, ``cupy.ndarray.__setitem__`` (a Python class over the Cython
``_ndarray_base``) is a wrapper (``install``: process-global, counted; ``uninstall``: the last one
puts back what was there). On the capturing thread, inside the capture proper, with CuPy's current
stream being the capture stream, a key that is a CuPy bool array whose shape leads the target's,
and a value that is a Python or NumPy scalar or a 0-d CuPy array, it calls ``copyto``; everything
else (other threads, eager code, array values whose order matters, integer or tuple keys) goes to
CuPy's own ``__setitem__`` unchanged, so an array value through a mask still fails as a host
synchronisation, named as such.
"""

from __future__ import annotations

import sys
import threading

_SCALARS = (bool, int, float, complex)
_tls = threading.local()  # .stream: the capture stream's pointer while this thread's capture routes CuPy


def mask_shape(target_shape: tuple, key_shape: tuple) -> tuple | None:
    """The shape to view a boolean key of ``key_shape`` as, to broadcast it over ``target_shape``
    (``a[mask]`` selects along the leading axes), or None when CuPy's own path must take it."""
    k = len(key_shape)
    if k == 0 or k > len(target_shape) or tuple(target_shape[:k]) != tuple(key_shape):
        return None
    return tuple(key_shape) + (1,) * (len(target_shape) - k)


def scalar_value(value, numpy, ndarray) -> bool:
    """Whether ``value`` assigns one value to every selected element (no order to respect)."""
    if isinstance(value, (*_SCALARS, numpy.generic)):
        return True
    return isinstance(value, ndarray) and value.ndim == 0


def _wrap(original):
    def __setitem__(self, key, value):  # noqa: N807 -- the slot it replaces
        stream = getattr(_tls, "stream", None)
        if stream is not None and _capturing():
            cupy = sys.modules["cupy"]
            nd = cupy.ndarray
            if (isinstance(key, nd) and key.dtype.kind == "b" and scalar_value(value, sys.modules["numpy"], nd)
                    and int(cupy.cuda.get_current_stream().ptr) == stream):
                shape = mask_shape(self.shape, key.shape)
                if shape is not None:
                    cupy.copyto(self, value, casting="unsafe", where=key.reshape(shape))
                    return
        original(self, key, value)

    __setitem__._cgraw_original = original
    return __setitem__


def _capturing() -> bool:
    from cgraw.runtime import memory

    return getattr(memory.thread_state, "capturing", 0) > 0


_install_lock = threading.Lock()
_installs = 0  # captures routing CuPy's mask assignments; guarded by _install_lock
_state: list = []  # [(class, wrapper, the class's own __setitem__ or None)] while installed


def install(cupy) -> str:
    """Make ``cupy.ndarray.__setitem__`` the wrapper (counted); ``""`` or why it was not."""
    global _installs
    with _install_lock:
        if _installs == 0:
            cls = getattr(cupy, "ndarray", None)
            if cls is None:
                return "this CuPy has no ndarray"
            base = getattr(cls, "__setitem__", None)
            if base is None:
                return "this CuPy's ndarray has no __setitem__"
            own = cls.__dict__.get("__setitem__")
            wrapper = _wrap(base)
            try:
                cls.__setitem__ = wrapper
            except TypeError as exc:  # a Cython (static) type: nothing to do
                return f"cupy.ndarray.__setitem__ cannot be wrapped ({exc})"
            _state[:] = [(cls, wrapper, own)]
        _installs += 1
        return ""


def uninstall() -> None:
    """Undo one ``install``; the last puts the class's own ``__setitem__`` back (or removes the
    wrapper) if the wrapper is still set."""
    global _installs
    with _install_lock:
        _installs -= 1
        if _installs > 0 or not _state:
            _installs = max(_installs, 0)
            return
        (cls, wrapper, own), = _state
        _state.clear()
        if cls.__dict__.get("__setitem__") is wrapper:
            if own is None:
                del cls.__setitem__
            else:
                cls.__setitem__ = own


def enter(stream_ptr: int) -> None:
    _tls.stream = int(stream_ptr)


def leave() -> None:
    _tls.stream = None


__all__ = ["enter", "install", "leave", "mask_shape", "scalar_value", "uninstall"]
