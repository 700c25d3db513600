"""``cgraw.while_loop`` and ``cgraw.cond``: the public functions and their host path.

Layer L8 (beside ``runtime.capture``, whose running capture decides the path): outside a capture
the loop and the branch run on the host, with the semantics they have on the device; inside
one they become conditional nodes (``cgraw.control.nodes``). Arrays are seen through graph
trees' per-framework ``Ops`` (``trees.frameworks``): torch tensors, CuPy arrays, and types tests
register; NumPy arrays and Python scalars work on the host path.

Host path, the rules the device path has too:

- the carried values are copied first (a body that writes them in place never writes the
  caller's arrays, and the results never alias them), as the device path copies them into the
  buffers its graph keeps;
- every ``body_fn`` result is checked against the carried values: same structure, frameworks,
  shapes and dtypes (``ControlFlowError`` names the first difference);
- a predicate is a boolean or integer scalar (a one-element array, nonzero is true), read on the
  host each time (a synchronisation on the device's stream, as ``bool(t)`` is);
- ``cond`` runs only the branch taken and returns its result as it is: the other branch does
  not run, so nothing is compared; the device path captures both branches and checks that their
  results agree (structure, frameworks, shapes, dtypes; device arrays only).
"""

from __future__ import annotations

import math

from cgraw.control import hops, nodes, plan
from cgraw.control.nodes import describe
from cgraw.errors import ControlFlowError
from cgraw.rng import device as rng_device
from cgraw.runtime import capture as _capture
from cgraw.trees.frameworks import ops_of


def while_loop(cond_fn, body_fn, carried):
    """Run ``body_fn`` while ``cond_fn`` holds, on the device inside a capture.

    ``carried`` is a tuple (or list) of values; ``cond_fn(*carried)`` returns a boolean scalar
    (a 0-d torch tensor or CuPy array: nonzero is true) and ``body_fn(*carried)`` the next
    carried values, with the same structure, shapes and dtypes. Returns the final carried values
    as a tuple; the arrays passed in are never written.

    Outside a capture the loop runs on the host, reading the predicate each iteration. Inside
    ``cgraw.capture()`` or a graphed function's recording it becomes one WHILE conditional node:
    the whole loop runs in the graph's launch, the predicate never leaves the device.

    Example::

        def cond_fn(x, n):
            return (x.norm() > 1e-3) & (n < 100)

        def body_fn(x, n):
            return x * 0.5, n + 1

        x, n = cgraw.while_loop(cond_fn, body_fn, (x0, torch.zeros((), dtype=torch.int64, device="cuda")))

    Raises:
        ControlFlowError: a result differs from the carried values, or a predicate is not a
            boolean scalar.
        CaptureError: inside a capture, the driver has no conditional nodes (before 12.4) or the
            body does what a conditional body cannot (an event, a host function, a stream-ordered
            allocation); the message names it and the workaround. Random numbers drawn in the body
            are fresh on every iteration.
    """
    if not isinstance(carried, (tuple, list)):
        raise ControlFlowError(f"carried must be a tuple or list of values, not {type(carried).__name__}")
    if not callable(cond_fn) or not callable(body_fn):
        raise ControlFlowError("cond_fn and body_fn must be callables taking the carried values")
    spec, leaves, paths = plan.flatten(tuple(carried), "carried")
    cap = _capture.active()
    if cap is not None:
        return nodes.while_loop(cap, cond_fn, body_fn, spec, leaves, paths)
    nodes.preload(leaves)
    leaves = [_copy(x) for x in leaves]
    expected = (spec, [describe(x) for x in leaves], paths)
    values = plan.unflatten(spec, leaves)
    pred = cond_fn(*values)
    draws = rng_device.loop_draws()  # inside a graphed function's warm-up: draw as the device loop draws
    try:
        while truth(pred, "cond_fn"):
            out = body_fn(*values)
            got = plan.flatten(out, "body_fn's result")
            plan.check_same("body_fn's result", expected, (got[0], [describe(x) for x in got[1]], got[2]),
                            "the carried values")
            values = plan.unflatten(got[0], got[1])
            pred = cond_fn(*values)
            for d in draws:
                d.iteration_done()
    finally:
        for d in draws:
            d.done()
    return values


def cond(pred, true_fn, false_fn, operands=()):
    """``true_fn(*operands)`` if ``pred`` holds, else ``false_fn(*operands)``; on the device
    inside a capture.

    ``pred`` is a boolean scalar (a 0-d torch tensor or CuPy array, nonzero is true; a Python
    bool picks the branch at once, also inside a capture). Both branches return the same
    structure of arrays with the same shapes and dtypes.

    Outside a capture only the branch taken runs, and its result is returned unchecked. Inside
    ``cgraw.capture()`` or a graphed function's recording both branches are captured, their
    results are checked against each other, and the call becomes an
    IF conditional node with two bodies (two IF nodes, the second on the negated predicate, on
    drivers before 12.8); the result lives in buffers the graph writes from either branch.

    Raises:
        ControlFlowError: the branches' results differ, or ``pred`` is not a boolean scalar.
        CaptureError: inside a capture, as for ``while_loop``.
    """
    if not callable(true_fn) or not callable(false_fn):
        raise ControlFlowError("true_fn and false_fn must be callables taking the operands")
    if not isinstance(operands, (tuple, list)):
        raise ControlFlowError(f"operands must be a tuple or list, not {type(operands).__name__}")
    cap = _capture.active()
    if cap is not None and ops_of(pred) is not None:
        return nodes.cond(cap, pred, true_fn, false_fn, tuple(operands))
    nodes.preload([pred])
    fn = true_fn if truth(pred, "pred") else false_fn
    return fn(*operands)


def truth(p, who: str) -> bool:
    """The host value of a predicate: a bool, an int, or a one-element array (nonzero is true)."""
    if isinstance(p, (bool, int)):
        return bool(p)
    shape = getattr(p, "shape", None)
    if shape is not None and math.prod(tuple(shape)) == 1 and hasattr(p, "dtype"):
        kind = _dtype_kind(p)
        if kind in ("b", "i", "u"):
            return bool(p)
        raise ControlFlowError(f"{who} returned a scalar of dtype {p.dtype}; a predicate is a boolean or integer "
                               "scalar (compare floating values: x.norm() > tol)")
    what = f"an array of shape {tuple(shape)}" if shape is not None else f"a {type(p).__name__}"
    raise ControlFlowError(f"{who} returned {what}; a predicate is a boolean or integer scalar (reduce it first: "
                           "(x > 0).all(), x.any())")


def _dtype_kind(p) -> str:
    """``"b"``, ``"i"``, ``"u"``, ``"f"`` or ``"c"`` for a torch, CuPy or NumPy scalar's dtype."""
    dt = p.dtype
    kind = getattr(dt, "kind", None)  # NumPy and CuPy dtypes
    if isinstance(kind, str):
        return kind
    if getattr(dt, "is_complex", False):
        return "c"
    if getattr(dt, "is_floating_point", False):
        return "f"
    return "b" if str(dt).endswith("bool") else ("u" if str(dt).endswith("uint8") else "i")


def _copy(x):
    """A copy of a carried value (arrays are copied, everything else is kept)."""
    ops = ops_of(x)
    if ops is not None:
        return ops.clone(x)
    copy = getattr(x, "copy", None)
    return copy() if callable(copy) and hasattr(x, "shape") else x


hops.install()
