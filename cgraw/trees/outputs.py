"""What the calls of one generation of a graph tree handed out, held weakly, so that the tree sees
when all of it is dead (``manager.TreeManager._path_is_dead``), and what to poison when it ends
(``manager.TreeManager._take_outputs`` takes them then); and the output objects a recording of
compiled code hands out again (``Reuse``).

Layer L6: pure Python over ``arrays``/``frameworks`` (no CUDA, frameworks through their ``Ops``).
"""

from __future__ import annotations

import operator
import weakref
from sys import getrefcount

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

    __slots__ = ("handed", "watched", "memory", "reused")

    def __init__(self) -> None:
        self.handed: list = []
        self.watched: list = []
        self.memory: list = []
        self.reused: list = []  # [(function name, recording, the list of objects its Reuse handed out)]

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
        for _, rec, objs in self.reused:
            if rec.reuse.held(objs):
                return True
        return any(r() is not None for r in self.watched) or memory_in_use(self.memory)


class Reuse:
    """The output objects of one recording, handed out again at its next replay where nothing holds
    them any more and nothing changed them, as torch's trees hand out their cached outputs: a replay
    of a compiled piece that hands out 160 activations then costs a list, not 160 new tensors
    (``.detach()`` of each). For functions whose caller is compiled code (``reuse_outputs``: the
    torch.compile backend's forward and inference pieces), which reads their outputs and drops them.
    An object something still holds (a Python reference, or autograd's saved tensors in C++) is never
    handed out again: the replay makes new ones, and the generation's end poisons the held ones as
    any other output. Nor is one whose memory, layout or autograd state the caller changed in place
    (``squeeze_()``, ``t.data = ...``, ``requires_grad_()``, ``retain_grad()``).

    ``makers``: the alias makers of the recording's owned outputs; ``probe``: the framework's
    ``(holders, marks, settle)`` (``frameworks.Ops.reuse_probe``). ``objs``: the objects handed out
    last, or None; ``seen``: their marks when they were made; ``checked``: whether the end of the
    generation they were handed out in found them free and unchanged; ``made``: how many times
    objects were made."""

    __slots__ = ("makers", "holders", "marks", "settle", "objs", "seen", "delta", "checked", "made", "refs", "uses")

    def __init__(self, makers, probe):
        n = len(makers)
        self.makers = makers
        self.holders, self.marks, self.settle = probe
        self.objs, self.seen, self.delta, self.checked, self.made = None, None, (), False, 0
        # what getrefcount (its argument and the list) and holders count of an object only the list holds
        self.refs, self.uses = [2] * n, [1] * n

    def take(self, rec) -> list:
        """The objects recording ``rec`` hands out now: the last ones, where nothing else holds them and
        nothing changed them, else new ones (``rec.users`` counts the new objects as the recording's
        own: only a caller's alias of their memory keeps it in use)."""
        objs = self.objs
        if objs is not None:
            if self.checked or self.usable(objs):
                self.checked = False
                return objs
            self.drop(rec)
        users = rec.users
        before = [u() for u, _ in users]
        objs = self.objs = list(map(_call, self.makers))
        self.made += 1
        self.seen = self.marks(objs)
        self.delta = [u() - c for (u, _), c in zip(users, before)]
        rec.users = [(u, b + d) for (u, b), d in zip(users, self.delta)]
        return objs

    def held(self, objs) -> list:
        """The indices of the objects of ``objs`` that something besides the list holds."""
        refs = list(map(getrefcount, objs))
        uses = list(map(self.holders, objs))
        if refs == self.refs and uses == self.uses:
            return []
        return [i for i, (r, u) in enumerate(zip(refs, uses)) if r > 2 or u > 1]

    def usable(self, objs) -> bool:
        """Whether ``objs`` (the objects handed out last) may be handed out again: nothing holds them
        and nothing changed them since they were made."""
        return not self.held(objs) and self.unchanged(objs)

    def unchanged(self, objs) -> bool:
        """Whether nothing changed ``objs`` in place since they were made (their marks), and the framework
        lets them be handed out again (``settle``: autograd's state)."""
        return self.marks(objs) == self.seen and self.settle(objs)

    def forget(self) -> None:
        """Let go of the objects (their recording is discarded)."""
        self.objs = None

    def drop(self, rec) -> None:
        """Hand out new objects at the next replay of ``rec``."""
        if self.objs is not None:
            self.objs = None
            rec.users = [(u, b - d) for (u, b), d in zip(rec.users, self.delta)]
            self.delta = ()


def reuse_for(fn, rec) -> Reuse | None:
    """A ``Reuse`` for recording ``rec`` of ``fn``, where ``fn`` allows it (``reuse_outputs``), two or
    more of its outputs are the tree's memory (``rec.owned_idx``; the others, an input handed back
    for one, are made per replay as before), none is handed out twice, views a tree output or is an
    argument object, and their framework can tell what holds and what changed an array
    (``Ops.reuse_probe``); else None."""
    if not getattr(fn, "reuse_outputs", False) or len(rec.owned_idx) < 2:
        return None
    if rec.tree_views or rec.out_same or rec.out_args or rec.bucket is not None:
        return None
    ops = {ops_of(rec.out_leaves[i]) for i in rec.owned_idx}
    probe = ops.pop().reuse_probe() if len(ops) == 1 else None
    return None if probe is None else Reuse(tuple(rec.out_alias[i] for i in rec.owned_idx), probe)


def take_reused(reused: list, live: list) -> None:
    """Add ``(function name, object)`` of every object of ``reused`` (``PathOutputs.reused``) that is
    held to ``live``. A recording whose last objects are held, or were changed, makes new ones at its
    next replay; one whose objects are free and unchanged hands them out again unchecked."""
    for name, rec, objs in reused:
        reuse = rec.reuse
        idx = reuse.held(objs)
        if idx:
            live.extend((name, objs[i]) for i in idx)
        if reuse.objs is objs:
            if not idx and reuse.unchanged(objs):
                reuse.checked = True
            else:
                reuse.drop(rec)


def versions_of(items) -> list:
    """The version counters of the arrays of ``[(name, array)]`` (``Ops.version``; None where none is kept)."""
    return [ops_of(t).version(t) for _, t in items]


def written_since(items, versions, declared: set, out) -> list:
    """Of ``[(name, array)]`` (the arguments of a call that were outputs of the ending generation,
    ``versions_of`` them before it), those the call wrote in place (``declared`` names its id, or
    its version moved; an inference tensor has none: a decode loop's token fed back under
    ``torch.inference_mode()`` is not copied at every step), with the arrays of its output ``out``
    over their memory (views it made of them), so that they move to new memory together and stay
    views of one another."""
    written = [item for item, v in zip(items, versions)
               if id(item[1]) in declared or (v is not None and ops_of(item[1]).version(item[1]) != v)]
    if not written:
        return written
    leaves: list = []
    try:
        out_spec(out, leaves)
    except SkipCall:  # an output no replay hands out: nothing of it is in the tree's memory
        return written
    ids = {id(t) for _, t in written}
    name = written[0][0]
    try:
        bases = {ops_of(t).base_ptr(t) for _, t in written}
        return written + [(name, t) for t in leaves if id(t) not in ids and ops_of(t).base_ptr(t) in bases]
    except RuntimeError:  # an array without storage: none of its memory to move
        return written


def memory_in_use(users) -> bool:
    """Whether any of ``[(users, baseline)]`` counts more references than its baseline."""
    return any(count() > base for count, base in users)


_ref = weakref.ref
_call = getattr(operator, "call", None) or operator.methodcaller("__call__")  # operator.call: Python 3.11+


def _ptr(ops, t) -> int | None:
    try:
        return ops.ptr(t)
    except RuntimeError:  # no storage (a meta tensor): no address to share with an input
        return None


def _always() -> bool:
    return True


__all__ = ["PathOutputs", "Reuse", "memory_in_use", "reuse_for", "take_reused", "versions_of", "written_since"]
