"""A root node's replay prepared once it is recorded: the hot path of a whole compiled graph's call.

Layer L6: pure Python over ``calls`` and ``nodes`` (no CUDA; frameworks through the argument types).

A function whose caller guarantees its inputs (``inputs_guarded``: ``torch.compile(backend="cgraw")``'s
whole graph, called once per token of a decode loop) and that begins each step (a root function) is
called with the same argument types, kinds and key at every call: everything ``calls.inspect`` works
out for such a call but its pointers is fixed by the recording. ``Prepared`` holds what a call must
still match: its argument types, the settings that choose kernels (``calls.guarded_tail``), the
addresses of the inputs read in place. ``manager.TreeManager`` replays a call that matches without
classifying it again: its new step, the replay and the bookkeeping are the generic path's own.

A call that does not match in any way takes the generic path before anything has changed, which
decides it as it always does: other argument types, another device, a moved static input, other
settings, grad mode recording, a tensor marked static, a tree output of the generation among the
inputs, a pending backward, keyword arguments, the node re-recorded, re-keyed or dropped, a static
position demoted. What shows only once the step has begun (an input read in place moved; for a
function that writes its inputs, inputs sharing memory or an output of the ended step it writes)
sends the call down the generic path after the step, as a new step's call goes. ``prepare``
checks, against ``calls.inspect`` itself, that a call fitting those conditions would get the
recording's key and kinds.
"""

from __future__ import annotations

from cgraw.trees.arrays import LEAF, TORCH
from cgraw.trees.calls import GUARDED, Call, guarded_tail, inspect
from cgraw.trees.input_plan import shared_memory
from cgraw.trees.nodes import NodeState

RECORDED = NodeState.RECORDED


class Prepared:
    """What a call of ``fn`` must match to replay root ``node``'s recording ``rec`` directly:
    ``types`` of its arguments (all tensors), ``tail`` (``calls.guarded_tail`` now), the pointers
    at ``fixed_at`` equal to ``fixed_ptrs``; ``usable`` False where the node's calls cannot (``why``;
    the generic path then runs without building it again until the node or its recording changes).
    ``slot``: the node's entry among the roots; ``specs``: a call's ops, spans and specs."""

    __slots__ = ("fn", "node", "rec", "plan", "key", "head", "slot", "types", "kinds", "tail", "static_positions",
                 "fixed_at", "fixed_ptrs", "data_ptr", "specs", "usable", "why", "builds")

    def __init__(self, fn, node):
        self.fn, self.node, self.rec, self.plan = fn, node, node.recording, node.plan
        self.usable = False
        self.why = None  # why it is not usable
        self.builds = 1  # how many were made for the function since its recordings last changed


def prepare(fn, node, args, device: int) -> Prepared:
    """``Prepared`` of root ``node`` of ``fn`` just after a call with ``args`` reached it (its
    recording's first replay, or a replay): ``usable`` where every later call with the same argument
    types and settings, no tree output and no marked tensor among its inputs, is classified as
    ``calls.inspect`` classified this one after a new step (same key, same kinds)."""
    p = Prepared(fn, node)
    tail = guarded_tail(fn, args)
    if tail is None or not (fn.inputs_guarded and fn.plain) or len(args) < 2 or node.parent is not None \
            or node.state is not RECORDED or p.plan is None or p.rec is None:
        p.why = "not a recorded root of a whole graph called without grad or marked tensors"
        return p
    types = tuple(map(type, args))
    data_ptr = getattr(types[0], "data_ptr", None)
    try:
        call = inspect(fn, args, {}, {}, device)  # as after a new step: no tree output among its inputs
    except Exception as exc:  # noqa: BLE001 -- only whether to prepare: the generic path decides every call
        p.why = f"its call is not classified ({exc})"
        return p
    n = len(args)
    if call.key != node.key or call.key != (GUARDED, n, *tail) or len(call.leaves) != n or data_ptr is None:
        p.why = f"its call's key {call.key} is not its node's {node.key} of {n} tensors"
        return p
    if call.kinds != p.plan.kinds:
        p.why = f"its call's input kinds {call.kinds} are not its recording's {p.plan.kinds}"
        return p
    p.key, p.head, p.slot, p.types, p.kinds, p.tail = node.key, (GUARDED, n), (fn.fn_id, node.key), types, \
        list(call.kinds), tail
    p.static_positions = getattr(fn, "static_positions", ())
    p.fixed_at, p.fixed_ptrs, p.data_ptr = p.plan.fixed_at, p.plan.fixed_ptrs, data_ptr
    p.specs = ((TORCH,) * n, tuple((j, 1) for j in range(n)), (LEAF,) * n)
    p.usable = True
    return p


def call_of(p: Prepared, args, ptrs) -> Call:
    """The ``calls.Call`` ``calls.inspect`` would make of ``args`` (at ``ptrs``) matching ``p``."""
    return Call(p.key, list(args), list(p.kinds), ptrs, *p.specs)


def shares_memory(p: Prepared, args, ptrs) -> bool:
    """Whether an eager input of a call matching ``p`` (at ``ptrs``) shares memory with another input:
    its key then holds the pairs (``input_plan.shared_memory``, asked of a function known to write its
    inputs), which ``p``'s does not; through the function's memo, as ``calls.inspect`` asks it."""
    fn = p.fn
    memo = getattr(fn, "shared_memo", None)
    if memo is None:
        memo = fn.shared_memo = {}
    return bool(shared_memory(args, p.kinds, ptrs, p.specs[0], memo, p.head))


__all__ = ["Prepared", "call_of", "prepare", "shares_memory"]
