"""The pure decisions of device control flow: structures, node kinds, copies, body rules.

Layer L1 (pure): no CUDA, no framework; tested on the CPU. ``cgraw.control.flow`` (the host
path) and ``cgraw.control.nodes`` (the capture path) describe each array leaf as a ``Leaf``
(framework, shape, dtype) and ask this module:

- ``flatten`` / ``unflatten``: carried values and branch results as leaves plus a spec (tuples,
  lists and dicts nest; anything else is a leaf), with each leaf's path (``[1]['a']``) for errors;
- ``check_same``: whether a body's result has the carried values' structure, shapes and dtypes
  (``ControlFlowError`` naming the first difference);
- ``node_steps``: which conditional nodes a loop or a branch becomes on a driver version;
- ``copy_plan``: how a body's results reach the carried buffers, which keep fixed addresses;
- ``body_violations``: the node types a conditional body may not hold, in the user's words.
"""

from __future__ import annotations

from dataclasses import dataclass

from cgraw.errors import CaptureError, ControlFlowError

CONDITIONAL_NODES = 12040  # cuGraphConditionalHandleCreate, IF and WHILE nodes
IF_ELSE_NODES = 12080  # an IF node with two bodies (the second runs when the condition is 0)


@dataclass(frozen=True)
class Leaf:
    """One leaf as the checks see it: ``framework`` (``"torch"``, ``"cupy"``, ``"array"`` for
    other arrays, ``"host"`` for anything else), ``shape`` and ``dtype`` (strings; a host leaf's
    dtype is its type name and its shape is ``()``)."""

    framework: str
    shape: tuple = ()
    dtype: str = ""

    def text(self) -> str:
        if self.framework == "host":
            return f"a host value of type {self.dtype}"
        return f"a {self.framework} array of shape {tuple(self.shape)} and dtype {self.dtype}"


# --------------------------------------------------------------------------- structures

def flatten(tree, path: str = "") -> tuple[object, list, list[str]]:
    """``(spec, leaves, paths)`` of ``tree``: tuples and lists (one kind, ``"seq"``: a body may
    return a list for a tuple) and dicts nest, everything else is a leaf."""
    leaves: list = []
    paths: list[str] = []
    spec = _flatten(tree, path, leaves, paths)
    return spec, leaves, paths


def _flatten(x, path: str, leaves: list, paths: list):
    if isinstance(x, (tuple, list)) and not hasattr(type(x), "_fields"):
        return ("seq", tuple(_flatten(v, f"{path}[{i}]", leaves, paths) for i, v in enumerate(x)))
    if isinstance(x, dict):
        keys = tuple(x)
        return ("dict", keys, tuple(_flatten(x[k], f"{path}[{k!r}]", leaves, paths) for k in keys))
    leaves.append(x)
    paths.append(path or "the value")
    return "leaf"


def unflatten(spec, leaves) -> object:
    """The structure ``spec`` with ``leaves`` in order (sequences come back as tuples)."""
    it = iter(leaves)
    return _unflatten(spec, it)


def _unflatten(spec, it):
    if spec == "leaf":
        return next(it)
    if spec[0] == "seq":
        return tuple(_unflatten(s, it) for s in spec[1])
    return {k: _unflatten(s, it) for k, s in zip(spec[1], spec[2])}


def _spec_text(spec) -> str:
    if spec == "leaf":
        return "one value"
    if spec[0] == "seq":
        return f"a sequence of {len(spec[1])}"
    return f"a dict with keys {list(spec[1])}"


def check_same(what: str, expected: tuple, got: tuple, reference: str) -> None:
    """Raise ``ControlFlowError`` unless ``got`` = ``(spec, leaves, paths)`` of ``Leaf``s has
    ``expected``'s structure, frameworks, shapes and dtypes. ``what`` names the result checked
    (``"body_fn's result"``), ``reference`` what it is checked against (``"the carried values"``)."""
    (espec, eleaves, epaths), (gspec, gleaves, _) = expected, got
    if espec != gspec:
        raise ControlFlowError(f"{what} has the structure {_spec_text(gspec)} ({_shape_of(gspec)}) where "
                               f"{reference} have {_spec_text(espec)} ({_shape_of(espec)}); return the same "
                               "structure (a tuple with one entry per carried value)")
    for e, g, p in zip(eleaves, gleaves, epaths):
        if e.framework != g.framework:
            diff = f"is {g.text()} where {reference} hold {e.text()}"
        elif tuple(e.shape) != tuple(g.shape):
            diff = f"has shape {tuple(g.shape)} where {reference} have {tuple(e.shape)}"
        elif e.dtype != g.dtype:
            diff = f"has dtype {g.dtype} where {reference} have {e.dtype}"
        else:
            continue
        raise ControlFlowError(f"{what} at {p} {diff}: shapes and dtypes must not change (on the device the "
                               "values live in fixed buffers); cast or reshape inside the function")


def _shape_of(spec) -> str:
    if spec == "leaf":
        return "*"
    if spec[0] == "seq":
        return "(" + ", ".join(_shape_of(s) for s in spec[1]) + ("," if len(spec[1]) == 1 else "") + ")"
    return "{" + ", ".join(f"{k!r}: {_shape_of(s)}" for k, s in zip(spec[1], spec[2])) + "}"


# --------------------------------------------------------------------------- node kinds

@dataclass(frozen=True)
class Step:
    """One conditional node: ``kind`` (``"if"``, ``"while"``), ``size`` (bodies) and whether its
    handle is set to the negated predicate (the ELSE of two IF nodes)."""

    kind: str
    size: int = 1
    negate: bool = False


def version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def node_steps(what: str, driver_version: int) -> list[Step]:
    """The conditional nodes of a ``"while"`` loop or a ``"cond"`` on a driver of ``driver_version``
    (``cuDriverGetVersion``: 12040 is 12.4). Raises ``CaptureError`` before 12.4."""
    if driver_version < CONDITIONAL_NODES:
        raise CaptureError(
            "cuGraphConditionalHandleCreate", 0, "CONDITIONAL_NODES_UNSUPPORTED",
            f"cgraw.{'while_loop' if what == 'while' else 'cond'} inside a capture needs conditional graph "
            f"nodes, which CUDA drivers have from 12.4; this driver is {version_text(driver_version)}",
            "update the NVIDIA driver, or call it outside the capture (it then runs on the host; a "
            "graph of one iteration replayed from a host loop is the usual alternative)")
    if what == "while":
        return [Step("while")]
    if what != "cond":
        raise ValueError(f"unknown control flow {what!r}")
    if driver_version >= IF_ELSE_NODES:
        return [Step("if", 2)]
    return [Step("if"), Step("if", 1, True)]


# --------------------------------------------------------------------------- copies

@dataclass(frozen=True)
class CopyPlan:
    """How a body's results reach the carried buffers: ``skip`` (the result is the buffer itself,
    written in place), ``stage`` (the result overlaps a buffer another copy writes first: cloned
    before any copy), ``copy`` (every index not skipped, in order)."""

    skip: tuple[int, ...]
    stage: tuple[int, ...]
    copy: tuple[int, ...]


def copy_plan(results: list[tuple[int, int]], buffers: list[tuple[int, int]], same: list[bool]) -> CopyPlan:
    """``results[i]`` and ``buffers[i]``: ``(first byte, one past the last)`` of result ``i`` and of
    carried buffer ``i`` (``(0, -1)``: unknown, treated as overlapping everything); ``same[i]``:
    result ``i`` is buffer ``i`` (same address and layout)."""
    n = len(buffers)
    skip = tuple(i for i in range(n) if same[i])
    written = [j for j in range(n) if not same[j]]
    stage = []
    for i in range(n):
        if same[i]:
            continue
        if any(_overlap(results[i], buffers[j]) for j in written):
            stage.append(i)
    return CopyPlan(skip, tuple(stage), tuple(written))


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    if a[1] < 0 or b[1] < 0:
        return True
    if a[1] <= a[0] or b[1] <= b[0]:  # empty
        return False
    return a[0] < b[1] and b[0] < a[1]


# --------------------------------------------------------------------------- body rules

ALLOWED_IN_BODY = frozenset({"KERNEL", "MEMCPY", "MEMSET", "EMPTY", "GRAPH", "CONDITIONAL"})

_WHY = {
    "EVENT_RECORD": ("an event record (torch.cuda.Event.record, cupy.cuda.Event.record, or a fork to a side "
                     "stream)", "record events and fork side streams outside the loop or branch"),
    "WAIT_EVENT": ("an event wait (stream.wait_event, or a side stream joined through an event recorded "
                   "outside the body)", "join side streams outside the loop or branch"),
    "HOST": ("a host function (a host callback, or a host-to-device upload that cgraw stages through a host "
             "node, such as cupy.asarray of a NumPy array)", "make such arrays before the loop or branch"),
    "MEM_ALLOC": ("a stream-ordered allocation (cudaMallocAsync, CuPy's MemoryAsyncPool)",
                  "allocate before the loop, or let cgraw's pool place the memory (the default allocators)"),
    "MEM_FREE": ("a stream-ordered free (cudaFreeAsync, CuPy's MemoryAsyncPool)",
                 "allocate before the loop, or let cgraw's pool place the memory (the default allocators)"),
}


def body_violations(type_names) -> list[str]:
    """What in a body's node types (``"KERNEL"``, ``"HOST"``, ...) a conditional body cannot hold,
    one message per kind, each naming the workaround."""
    out = []
    for t in dict.fromkeys(type_names):
        if t in ALLOWED_IN_BODY:
            continue
        what, fix = _WHY.get(t, (f"a {t.lower()} node", "move that work outside the loop or branch"))
        out.append(f"{what}: conditional bodies hold only kernels, copies, memsets and nested "
                   f"conditionals; {fix}")
    return out


HOST_PREDICATE = (
    "{who} returned {what} inside a capture; a loop's condition must be a device scalar (a 0-d torch "
    "tensor or CuPy array on the capture's device), which the graph reads on every iteration")
