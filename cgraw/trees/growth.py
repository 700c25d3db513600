"""How a graph tree grows: a node's warm-up, recording and re-recording, and its eager runs.

Layer L6: pure bookkeeping, like ``manager`` (a mixin of ``manager.TreeManager``, which decides
when a call grows the tree; this module does it): the backend (``nodes.Backend``) runs the
function, captures it and restores the pool; the warm-up's lessons come from ``input_plan``.
"""

from __future__ import annotations

import logging

from cgraw.errors import SkipCall
from cgraw.trees import nodes as tree_nodes
from cgraw.trees.calls import kernel_state
from cgraw.trees.config import config
from cgraw.trees.input_plan import InputPlan, check_shared_writes, declared_mutations, unseen_eager, warm_up
from cgraw.trees.nodes import FunctionStats, NodeState, Rewarm, TreeNode
from cgraw.trees.pool import UNKNOWN

log = logging.getLogger("cgraw")


class TreeGrowth:
    """The ``manager.TreeManager`` side of growing the tree (a mixin): ``_warm``, ``_record`` and
    ``_rerecord`` of a node, the eager runs of skipped nodes and calls, the outputs a recording
    hands out, and the count of a function's input signatures."""

    def _rerecord(self, node: TreeNode, fn, call, reason, args, kwargs):
        st = node.stats
        st.rerecords += 1
        st.rerecord_reasons.append(str(reason))
        log.info("cgraw: re-recording %s: %s", fn.name, reason)
        self._drop_subtree_of(node)
        if isinstance(reason, Rewarm):
            node.note_rewarm(reason, st.replays)
            if node.rewarms > config.rewarm_limit:
                node.state = NodeState.SKIPPED
                node.skip_reason = (f"warmed up again {node.rewarms} times ({reason}); set "
                                    "cgraw.config.rewarm_limit to allow more")
                return self._eager_node(node, call, args, kwargs)
            return self._warm(node, fn, st, call, args, kwargs)
        if unseen_eager(node.warm.kinds, call):  # see _grow: what the function writes into it is unknown
            return self._warm(node, fn, st, call, args, kwargs)
        return self._record(node, fn, st, call, args, kwargs)

    def _warm(self, node: TreeNode, fn, st: FunctionStats, call, args, kwargs):
        """Run the function eagerly once (lazy first-use work happens outside any capture). A
        warm-up inside the tree's pool hands out its outputs there, as a replay does; one that left
        blocks held by something else there (``Warm.stash``) moves the tree to a fresh pool, so
        that no restore frees them."""
        st.warmups += 1
        self.current = node
        parent = node.parent
        if ((parent is None or parent.state is NodeState.RECORDED) and self.pool_state is not parent
                and self.backend.warm_restores(fn, call)):
            # an in-pool warm-up reuses what other branches' recordings hold, as a recording does
            # (torch's trees restore before warm-ups too); else a new branch raises the pool's peak
            self._restore_to(parent)
        try:
            with self.running_python():
                w = warm_up(self.backend.warmup, fn, call, args, kwargs)
        except BaseException:
            self.pool_state = UNKNOWN  # it may have left blocks in the pool
            raise
        if w.in_pool:
            self.pool_state = UNKNOWN
            if w.stash is not None:
                log.info("cgraw: the warm-up of %s %s; the graph tree moves to a fresh pool and warms up "
                         "outside it from now on", fn.name, w.stash)
                self._renew()
                self.pool_state = None
            else:
                self.outs.hand(fn.name, w.handed)
        self.outs.watch(w.out, call)
        if w.groups is not None:  # file the node under the key its next call will have
            tree_nodes.rekey(self.roots, node, learn_kernel_groups(fn, w.groups, call.key))
        declared = declared_mutations(fn, call)
        w.mutated = tuple(w.mutated) + tuple(j for j in declared if j not in w.mutated)
        tree_nodes.hold_external(w, node.refs)
        w.kinds = tuple(call.kinds)
        if w.mutated and not getattr(fn, "writes_inputs", False):
            fn.writes_inputs = True  # its calls' keys note inputs sharing memory (input_plan.shared_memory)
        node.warm = w
        node.state = NodeState.WARMED
        if w.skip is not None:
            node.state = NodeState.SKIPPED
            node.skip_reason = w.skip
            self._note_skip(fn, st, w.skip)
        out, w.out, w.handed = w.out, None, ()  # the node keeps what the warm-up learned, not its result
        if w.again:
            node.warm = None  # warm up again at the next call
        return out

    def _record(self, node: TreeNode, fn, st: FunctionStats, call, args, kwargs):
        parent = node.parent
        anchor = tree_nodes.recorded_ancestor(parent)
        if self.pool_state is not anchor:
            self._restore_to(anchor)
        try:
            check_shared_writes(call, node.warm.mutated)
            with tree_nodes.external_for_record(node.warm), self.running_python():
                rec = self.backend.record(fn, call, node.warm)
        except SkipCall as exc:
            node.failed_recording(exc, config.rewarm_limit)  # SKIPPED, or warm up again (nodes.capture_failed)
            # a failed capture put the pool back itself; a recording that failed after its capture
            # left blocks behind, so the next recording must restore first
            self.pool_state = UNKNOWN if exc.dirty else anchor
            return self._eager_node(node, call, args, kwargs)
        except BaseException:
            self.pool_state = UNKNOWN  # the pool may hold the failed recording's blocks
            raise
        node.recording = rec
        node.plan = InputPlan(call)
        node.state = NodeState.RECORDED
        st.recordings += 1
        st.capture_ms += rec.capture_ms
        st.instantiate_ms += rec.instantiate_ms
        try:
            # recording computes nothing: replay for this call (the backend may free placeholders
            # it proved unneeded here, so the checkpoint follows)
            out, owned = self.backend.first_replay(rec, call)
        finally:
            node.checkpoint = self.backend.snapshot()
            self.pool_state = node
        self.current = node
        self._register(node, owned)
        return out

    def _note_skip(self, fn, st: FunctionStats, reason: str) -> None:
        if reason not in st.skip_reasons:
            log.warning("cgraw: skipping cudagraphs for %s: %s", fn.name, reason)
            st.skip_reasons[reason] = 0

    def _eager_node(self, node: TreeNode, call, args, kwargs):
        """Run a SKIPPED node's function eagerly as the path's next node."""
        self.current = node
        out = self._eager(node.fn, node.stats, node.skip_reason, args, kwargs)
        self.outs.watch(out, call)
        return out

    def _eager(self, fn, st: FunctionStats, reason: str, args, kwargs):
        if reason not in st.skip_reasons:
            log.warning("cgraw: skipping cudagraphs for %s: %s", fn.name, reason)
        st.skip_reasons[reason] = st.skip_reasons.get(reason, 0) + 1
        st.eager_calls += 1
        return fn.fn(*args, **kwargs)

    def _register(self, node: TreeNode, owned) -> None:
        """Note the outputs of a replay that live in the tree's memory (``owned``): they are
        tree-output inputs of later calls, and are poisoned when the generation ends."""
        for ptr in node.recording.out_ptrs:
            self.tree_outputs[ptr] = node
        if getattr(node.fn, "copies_out", False):  # a backward's are copied out before anyone sees them
            return
        if node.recording.reuse is not None:  # objects handed out again (trees.outputs.Reuse)
            self.outs.reused.append((node.fn.name, node.recording, owned))
        else:
            self.outs.hand(node.fn.name, owned)

    def _new_variant(self, fn, st: FunctionStats, key) -> bool:
        """Count input signatures per function; True when this one must run eagerly."""
        seen = self._keys_seen.setdefault(fn.fn_id, {})
        idx = seen.get(key)
        limit = config.dynamic_shape_warn_limit
        if idx is not None:  # seen before, perhaps under another parent: same verdict
            return config.skip_dynamic_graphs and idx >= limit
        idx = seen[key] = len(seen)
        st.variants = len(seen)
        if idx == limit:
            log.warning("cgraw: %s has been called with %d input signatures (dynamic shapes); each one "
                        "is recorded separately. Pad inputs to a few shapes, or set "
                        "cgraw.config.skip_dynamic_graphs = True", fn.name, len(seen))
        return config.skip_dynamic_graphs and idx >= limit


def learn_kernel_groups(fn, groups, key: tuple) -> tuple | None:
    """A warm-up of ``fn`` ran ops depending on the setting ``groups`` (``interop.torch.kernel_state.GROUPS``
    names; None: unknown), of which its calls read all but ``fn.compiled_groups`` (those its code
    fixed when it was compiled), unless an op out of the warm-up's sight ran (``OPAQUE``). If that
    narrows or widens what ``fn``'s calls read, set it and return ``key`` (the warmed call's key)
    ending with the id of the settings under the new reading, which is what the function's next
    call under the same settings will have; else None."""
    ks = kernel_state()
    if ks is None or groups is None:
        return None
    old = getattr(fn, "kernel_groups", None)
    new = frozenset(groups) if old is None else old | frozenset(groups)
    if new != old:
        fn.kernel_groups = new
        fn.kernel_getters = ks.getters(new, getattr(fn, "compiled_groups", frozenset()))
    # also when unchanged: the call may have been keyed before another thread's warm-up learned them
    return key[:-1] + (ks.state(fn.kernel_getters),)


__all__ = ["TreeGrowth", "learn_kernel_groups"]
