"""What the calls of one generation of a graph tree handed out, held weakly, so that the tree sees
when all of it is dead (``manager.TreeManager._path_is_dead``), and what to poison when it ends
(``manager.TreeManager._take_outputs`` takes them then).

Layer L6: pure Python over ``arrays``/``frameworks`` (no CUDA, frameworks through their ``Ops``).
"""

from __future__ import annotations

import weakref

from cgraw.trees.arrays import ops_of, out_spec
from cgraw.errors import SkipCall


class PathOutputs:
    """What the calls of one generation made, held weakly, so that the tree sees when all of it
    is dead (torch's trees keep weak references to their outputs' storages for this). ``handed``:
    ``[(function name, weak reference)]`` of outputs in the tree's memory, invalidated when the
    generation ends if still alive. ``watched``: weak references to the other outputs of its
    warm-ups and eager runs, never invalidated, but a later call depends on the path while one
    is alive (``a = f(x)`` warmed up outside the pool, then ``g(a)``). ``memory``: ``(users,
    baseline)`` of the warm-up outputs in the tree's memory (``Ops.users``): a view or
    ``.detach()`` alias of one keeps its memory in use after the output itself is gone.
    Recordings' outputs are counted the same way through ``Replayable.users``
    (``memory_in_use``)."""

    __slots__ = ("handed", "watched", "memory")

    def __init__(self) -> None:
        self.handed: list = []
        self.watched: list = []
        self.memory: list = []

    def hand(self, name: str, outs) -> None:
        """Outputs of a warm-up in the tree's memory, which only the caller holds: each output
        object over a block counts one user above what the tree holds of it."""
        outs = list({id(t): t for t in outs}.values())
        for t in outs:
            self.handed.append((name, _ref(t)))
        by_memory: dict = {}
        for t in outs:
            ops = ops_of(t)
            if ops.users(t) is not None:  # a framework that can count them
                by_memory.setdefault(ops.base_ptr(t), []).append((ops, t))
        for same in by_memory.values():
            ops, t = same[0]
            users = ops.users(t)
            self.memory.append((users, users() - len(same)))

    def watch(self, out, call) -> None:
        """Watch the arrays of ``out`` but ``call``'s inputs, views of them at the same address
        and static arrays."""
        leaves: list = []
        try:
            out_spec(out, leaves)
        except SkipCall:
            pass  # an output no graph can hand out (a sparse tensor): the leaves before it are watched
        if not leaves:
            return
        ins, ptrs = {id(t) for t in call.leaves}, set(call.ptrs)
        for t in leaves:
            ops = ops_of(t)
            if id(t) in ins or ops.static(t) or _ptr(ops, t) in ptrs:
                continue
            try:
                self.watched.append(_ref(t))
            except TypeError:  # an array type without weak references: alive until the generation ends
                self.watched.append(_always)

    def alive(self) -> bool:
        """Whether any output of the generation, or any alias of a warm-up's, is alive."""
        for _, r in self.handed:
            if r() is not None:
                return True
        return any(r() is not None for r in self.watched) or memory_in_use(self.memory)


def memory_in_use(users) -> bool:
    """Whether any of ``[(users, baseline)]`` counts more references than its baseline."""
    return any(count() > base for count, base in users)


_ref = weakref.ref


def _ptr(ops, t) -> int | None:
    try:
        return ops.ptr(t)
    except RuntimeError:  # no storage (a meta tensor): no address to share with an input
        return None


def _always() -> bool:
    return True


__all__ = ["PathOutputs", "memory_in_use"]
