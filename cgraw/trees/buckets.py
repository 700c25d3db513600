"""Padding buckets: one recording serves every batch size up to a bucket.

``cgraw.graphed(fn, pad_buckets=(1, 2, 4, 8, 16))``: when a call's first eager tensor input has
``n`` rows (its leading dimension) and ``n`` fits a bucket, the smallest bucket ``b >= n`` is
recorded instead of ``n``. Every eager tensor input whose leading dimension is ``n`` is *padded*:
its placeholder has ``b`` rows, of which the call's ``n`` are copied in (the copy node's byte
count is patched per call) and the rest hold whatever an earlier call left there. Every tensor
output whose leading dimension is ``b`` is returned as its first ``n`` rows. This is what LLM
servers do for batch sizes, and it is only right for functions whose rows are independent
(row-wise layers, attention within a row); a function that reduces over the batch sees the
padding rows.

Layer L6: pure logic over duck-typed torch tensors and CuPy arrays (``shape``, slicing); no CUDA.
"""

from __future__ import annotations

from cgraw.errors import SkipCall
from cgraw.trees.arrays import ops_of, out_spec


def check(buckets) -> tuple[int, ...]:
    """The bucket sizes, sorted; TypeError/ValueError for anything but positive ints."""
    if buckets is None:
        return ()
    try:
        sizes = tuple(buckets)
    except TypeError:
        raise TypeError(f"pad_buckets must be a sequence of positive ints, not {type(buckets).__name__}") from None
    for b in sizes:
        if type(b) is not int or b < 1:
            raise ValueError(f"pad_buckets must hold positive ints, got {b!r}")
    return tuple(sorted(set(sizes)))


def choose(buckets: tuple[int, ...], leaves, kinds, eager) -> tuple[int, int, frozenset] | None:
    """``(rows, bucket, padded leaf indices)`` for a call, or None when it is not padded: no eager
    input with a leading dimension, zero rows, or more rows than the largest bucket."""
    n = None
    for j, t in enumerate(leaves):
        if kinds[j] == eager and len(t.shape) >= 1:
            n = t.shape[0]
            break
    if not n or n > buckets[-1]:
        return None
    b = next(b for b in buckets if b >= n)
    padded = frozenset(j for j, t in enumerate(leaves)
                       if kinds[j] == eager and len(t.shape) >= 1 and t.shape[0] == n)
    return n, b, padded


def padded_key(key_parts, leaves, padded: frozenset, bucket: int) -> tuple:
    """The call's signature with the padded inputs' leading dimension replaced by the bucket.

    In a call's key, the entries of tensor leaves are the only 3-tuples (shape, strides, dtype),
    in leaf order; containers, scalars, modules and keyword names are 2-tuples or strings. A
    padded input's strides give way to whether it is contiguous: they depend on the row count
    when it is not, and its placeholder is contiguous either way; but a contiguous input is
    copied by a memcpy node and another one element by element, so that stays in the key."""
    out, leaf = [], 0
    for part in key_parts:
        if type(part) is tuple and len(part) == 3:
            if leaf in padded:
                shape, _strides, dtype = part
                t = leaves[leaf]
                layout = "contiguous" if ops_of(t).contiguous(t) else "strided"
                part = ((bucket, *tuple(shape)[1:]), layout, dtype)
            leaf += 1
        out.append(part)
    out.append(("pad", bucket))
    return tuple(out)


def empty_rows(t, rows: int):
    """A new contiguous tensor or array like ``t`` but with ``rows`` rows (inside a capture: from
    the tree's pool)."""
    return ops_of(t).empty((rows, *tuple(t.shape)[1:]), t)


def warm_rows(rows: int, out) -> tuple:
    """What a warm-up's result ``out``, made eagerly from ``rows`` rows, tells a recording of its
    bucket: ``(rows, the shapes of its array leaves, its other values)``."""
    leaves: list = []
    spec = out_spec(out, leaves)
    return rows, [tuple(t.shape) for t in leaves], _values(spec)


def out_rows(out_leaves, bucket: int, warm=None, spec=None) -> list[int]:
    """Indices of the outputs to cut back to the call's rows. ``warm``: ``warm_rows`` of the warm-up
    (made from another row count than the bucket's): the outputs whose first dimension followed the
    rows, all else equal; a Python value or another dimension that followed them raises
    ``SkipCall`` (a replay would return the bucket's). Else the tensors whose first dimension is the
    bucket. ``spec``: the recording's ``out_spec``."""
    if warm is None or warm[0] == bucket:
        return [i for i, t in enumerate(out_leaves)
                if hasattr(t, "shape") and len(t.shape) >= 1 and t.shape[0] == bucket]
    n, shapes, values = warm
    if len(shapes) != len(out_leaves) or (spec is not None and _values(spec) != values):
        raise SkipCall("under pad_buckets it returns a Python value that follows the row count (x.shape[0]), "
                       "which a replay would return as recorded, for the bucket's rows")
    cut = []
    for i, (w, t) in enumerate(zip(shapes, out_leaves)):
        r = tuple(t.shape)
        if r == w:
            continue
        if len(r) == len(w) and r[0] == bucket and w[0] == n and r[1:] == w[1:]:
            cut.append(i)
            continue
        raise SkipCall(f"under pad_buckets output {i} has shape {r} for the bucket's {bucket} rows and {w} "
                       f"for {n}: its rows are not (only) its first dimension, so it cannot be cut back")
    return cut


def _values(spec) -> list:
    """The plain values (``("v", x)``) in an output spec, depth first."""
    if isinstance(spec, tuple) and spec and spec[0] == "v":
        return [spec[1]]
    found: list = []
    if isinstance(spec, (tuple, list)):
        for s in spec:
            if isinstance(s, (tuple, list)):
                found.extend(_values(s))
    return found
