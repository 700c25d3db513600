"""The pool side of a graph tree: restoring the pool's bookkeeping to a node's checkpoint, moving
to a fresh pool, dropping recordings. A mixin of ``manager.TreeManager`` (its ``backend``, ``roots``,
``root_checkpoint``, ``pool_state`` and ``tree_outputs``).

Layer L6: pure bookkeeping; the backend does the work.
"""

from __future__ import annotations

import contextlib
import logging

from cgraw.trees.arrays import key_deaths, names_dead, weaken_key
from cgraw.trees.nodes import NodeState, TreeNode

log = logging.getLogger("cgraw")


class Unknown:
    """Marker: the pool's bookkeeping matches no live node (force a restore before recording)."""


UNKNOWN = Unknown()


class TreePool:
    """Checkpoints and recordings of a ``manager.TreeManager``'s pool."""

    deaths_seen = 0  # arrays.key_deaths() when no node named a dead object any more
    busy = 0  # > 0 while a function's Python runs for the tree (a warm-up, a recording) or a capture runs on its thread

    @contextlib.contextmanager
    def running_python(self):
        """While the block runs, a graphed call on this tree's thread runs its function inline: its
        work is part of the warm-up or the graph being captured around it (``manager.call_here``)."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1

    def drop_dead_keys(self) -> None:
        """Drop the nodes whose key names an object that is gone (``arrays.names_dead``: a tensor
        reached through an argument's attributes, dropped by its caller), with everything below
        them: no call can reach them again. Their recordings go as a re-recording's do. A node on
        the path under way stays until the path has moved on. The tree calls it as it grows,
        under its lock, with no capture running."""
        deaths = key_deaths()
        if deaths == self.deaths_seen:
            return
        on_path = set() if self.current is None else {id(n) for n in self.current.path()}
        dropped, kept_dead, todo = [], False, [self.roots]
        while todo:
            siblings = todo.pop()
            for k, n in list(siblings.items()):
                if not names_dead(n.refs):
                    todo.append(n.children)
                elif id(n) in on_path:
                    kept_dead = True
                    todo.append(n.children)
                else:
                    del siblings[k]
                    dropped.extend(n.walk())
        if not kept_dead:
            self.deaths_seen = deaths
        for seen in self._keys_seen.values():  # a dead key is no signature a call can have again
            for key in [key for key in seen if names_dead(weaken_key(key))]:
                del seen[key]
        if not dropped:
            return
        self._forget_recordings(dropped)
        ids = {id(n) for n in dropped}
        if id(self.pool_state) in ids:
            self.pool_state = UNKNOWN
        self.tree_outputs = {p: n for p, n in self.tree_outputs.items() if id(n) not in ids}

    def _restore_to(self, anchor: TreeNode | None) -> None:
        """Make the pool's bookkeeping the checkpoint at the end of ``anchor``'s recording."""
        path = set() if anchor is None else {id(n) for n in anchor.path()}
        on_path, off_path = [], []
        for n in self.nodes():
            if n.state is NodeState.RECORDED and n.recording is not None:
                (on_path if id(n) in path else off_path).append(n.recording)
        snap = self.root_checkpoint if anchor is None else anchor.checkpoint
        try:
            self.backend.restore(snap, on_path, off_path)
        except Exception as exc:
            # something outside the tree (a traceback, a global) holds memory the checkpoint
            # would hand out again: start over on a fresh pool rather than risk a wrong result
            log.warning("cgraw: cannot restore the graph tree's pool (%s); re-recording the tree "
                        "on a fresh pool", exc)
            self._renew()
            anchor = None
        self.pool_state = anchor

    def _renew(self) -> None:
        self._forget_recordings(self.nodes())
        self.root_checkpoint = self.backend.renew()
        self.tree_outputs = {}

    def _forget_recordings(self, nodes) -> None:
        """Discard the recordings of ``nodes``; recorded ones are WARMED again (recorded anew
        when a call reaches them)."""
        self.prepared.clear()
        for n in nodes:
            if n.recording is not None:
                self.backend.discard(n.recording)
                n.recording = None
                n.checkpoint = None
                n.plan = None
            if n.state is NodeState.RECORDED:
                n.state = NodeState.WARMED

    def _drop_subtree_of(self, node: TreeNode) -> None:
        """A node is re-recorded: its old recording and its descendants' recordings go. The
        descendants stay in the tree as WARMED nodes and are recorded again when a call reaches
        them."""
        self._forget_recordings(node.walk())  # the node itself too: _record sets it again on success
        ps = self.pool_state
        if ps is not None and not (any(n is ps for n in self.nodes()) and ps.recording is not None):
            self.pool_state = UNKNOWN

    def nodes(self) -> list[TreeNode]:
        out = []
        for r in self.roots.values():
            out.extend(r.walk())
        return out


__all__ = ["UNKNOWN", "TreePool", "Unknown"]
