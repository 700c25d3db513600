"""The pool side of a graph tree: restoring the pool's bookkeeping to a node's checkpoint, moving
to a fresh pool, dropping recordings. A mixin of ``manager.TreeManager`` (its ``backend``, ``roots``,
``root_checkpoint``, ``pool_state`` and ``tree_outputs``).

Layer L6: pure bookkeeping; the backend does the work.
"""

from __future__ import annotations

import logging

from cgraw.trees.nodes import NodeState, TreeNode

log = logging.getLogger("cgraw")


class Unknown:
    """Marker: the pool's bookkeeping matches no live node (force a restore before recording)."""


UNKNOWN = Unknown()


class TreePool:
    """Checkpoints and recordings of a ``manager.TreeManager``'s pool."""

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
