"""What differs between cuda-bindings 12.8+ and 13.x, chosen once when ``cgraw._cuda`` is imported.

Layer L1. Imports nothing: the package's ``__init__`` (``cgraw._cuda`` is the only package that
imports ``cuda.bindings``) passes the binding modules to ``select``, and the CPU tests pass fakes
shaped like either major version. The calls every hot path makes (``cuGraphLaunch``,
``cudaGraphExecMemcpyNodeSetParams1D``) are the same in both and stay plain bound functions in
``_cuda.graphs``. The differences cgraw meets:

- ``cuStreamGetCaptureInfo`` / ``cuGraphGetEdges``: 13.x returns edge data
  (``(err, status, id, graph, deps, edge_data, n)`` / ``(err, from, to, edge_data, n)``); 12.x's
  plain names ask without it, a lossy query the driver documents as ``CUDA_ERROR_LOSSY_QUERY``
  when edges carry data (programmatic dependent launch), so on 12.x the edge-aware ``_v3`` /
  ``_v2`` are used. A CUDA 12.0-12.2 driver lacks those: the first call then falls back to the
  plain name for good, its result widened to 13.x's shape.
- ``cuGraphAddNode``: 13.x takes edge data (``(graph, deps, edge_data, n, params)``), 12.x's
  plain name does not (``(graph, deps, n, params)``); ``graph_add_node`` takes 12.x's arguments.
  ``cuStreamUpdateCaptureDependencies`` likewise (13.x ``(stream, deps, edge_data, n, flags)``,
  12.x ``(stream, deps, n, flags)``); ``update_capture_dependencies`` takes 12.x's arguments.
- ``cuda.bindings.utils.get_cuda_native_handle`` does not exist in 12.8 (no ``utils`` module);
  the handle types' ``int()`` is their native value there.
"""

from __future__ import annotations

from types import SimpleNamespace


def bindings_major(version: str) -> int:
    """The major version of a cuda-bindings version string (``"12.9.4"`` -> 12); 0 if unreadable."""
    try:
        return int(str(version).split(".", 1)[0])
    except ValueError:
        return 0


def _widened(legacy, at: int):
    """``legacy`` with ``None`` inserted at ``at`` in its result: 12.x's shape made 13.x's."""
    def call(*args):
        res = legacy(*args)
        return res[:at] + (None,) + res[at:]
    call.__name__ = getattr(legacy, "__name__", "legacy")
    return call


def _first_that_loads(preferred, legacy):
    """Call ``preferred`` until the driver shows whether it has it, then the one that works only.

    ``RuntimeError`` is what cuda-bindings raises for an entry point the driver lacks
    (``FunctionNotFoundError``); the fallback is kept only when ``legacy`` then succeeds, so a
    missing driver still raises its own error and decides nothing.
    """
    chosen: list = []

    def call(*args):
        if chosen:
            return chosen[0](*args)
        try:
            res = preferred(*args)
        except RuntimeError:
            res = legacy(*args)
            chosen.append(legacy)
            return res
        chosen.append(preferred)
        return res
    call.__name__ = getattr(preferred, "__name__", "preferred")
    call.chosen = chosen  # which one this driver has, once the first call succeeded
    return call


def _edge_aware(drv, major: int, name: str, versioned: str, data_at: int):
    plain = getattr(drv, name)
    if major >= 13 or major == 0:  # 13.x (or an unreadable version): the plain name takes edge data
        return plain
    newer = getattr(drv, versioned, None)
    if newer is None:  # bindings older than 12.3
        return _widened(plain, data_at)
    return _first_that_loads(newer, _widened(plain, data_at))


def select(drv, utils, version: str) -> SimpleNamespace:
    """The adapters for the installed bindings: ``drv`` is ``cuda.bindings.driver``, ``utils``
    ``cuda.bindings.utils`` or None, ``version`` ``cuda.bindings.__version__``."""
    major = bindings_major(version)
    native_handle = getattr(utils, "get_cuda_native_handle", None) or int
    return SimpleNamespace(
        version=str(version),
        major=major,
        # (err, status, id, graph, deps, edge_data, n) on every version
        capture_info=_edge_aware(drv, major, "cuStreamGetCaptureInfo", "cuStreamGetCaptureInfo_v3", 5),
        # (err, from, to, edge_data, n) on every version
        graph_get_edges=_edge_aware(drv, major, "cuGraphGetEdges", "cuGraphGetEdges_v2", 3),
        # (graph, deps, n, params) on every version
        graph_add_node=_add_node(drv, major),
        # (stream, deps, n, flags) on every version
        update_capture_dependencies=_without_edge_data(drv, major, "cuStreamUpdateCaptureDependencies"),
        native_handle=native_handle,
    )


def _add_node(drv, major: int):
    return _without_edge_data(drv, major, "cuGraphAddNode")


def _without_edge_data(drv, major: int, name: str):
    """``name`` called with 12.x's arguments (``(first, deps, n, last)``): on 13.x the edge data
    (``None``: plain edges) goes between the dependencies and their count."""
    plain = getattr(drv, name, None)
    if major >= 13 or major == 0:
        def call(first, deps, n, last):
            return plain(first, deps, None, n, last)
        call.__name__ = name
        return call
    return plain
