"""torch's ``torch.cond`` and ``torch._higher_order_ops.while_loop`` inside captures: the same
conditional nodes as ``cgraw.cond`` and ``cgraw.while_loop``.

Layer L8 (beside ``control.nodes``): the handlers are registered with cgraw's torch dispatch modes
(``interop.torch.modes.register_higher_order``), which every capture that routes torch's random
numbers pushes. A call is taken only inside a running capture, with a CUDA predicate on the
capture's device and CUDA tensors for the operands or carried values; anything else is left to
torch (eagerly, which reads the predicate on the host: a capture then fails with that reason, and
a graphed function runs eagerly). ``while_loop``'s ``additional_inputs`` are passed to both
functions after the carried values, as torch does.

Inside a graphed function's warm-up that draws with cgraw's kernels, torch runs ``while_loop`` on
the host and cgraw follows its iterations (``warm_up_loop``): random numbers drawn in the loop are
those its recording's WHILE node draws, as in ``cgraw.while_loop``'s host path.
"""

from __future__ import annotations

from cgraw.control import nodes, plan
from cgraw.interop.torch import modes as _modes
from cgraw.rng import device as _rng_device
from cgraw.runtime import capture as _capture
from cgraw.trees.frameworks import TORCH, ops_of


def install() -> None:
    """Register the handlers (once; idempotent)."""
    _modes.register_higher_order("cond", torch_cond)
    _modes.register_higher_order("while_loop", torch_while_loop)


def _on_device(values, ordinal: int, *, sizes: bool = False) -> bool:
    """Whether every value is a CUDA tensor on ``ordinal``; with ``sizes``, Python ints may be among
    them (a compiled frame with dynamic shapes passes its symbolic sizes to the branches as ints)."""
    return all((sizes and type(v) is int) or (ops_of(v) is TORCH and v.get_device() == ordinal) for v in values)


def torch_cond(args, kwargs, reenter, run):
    """``cond(pred, true_fn, false_fn, operands)`` as IF node(s), or ``NotImplemented``."""
    cap = _capture.active()
    if cap is None or kwargs or len(args) != 4:
        return NotImplemented
    pred, true_fn, false_fn, operands = args
    ordinal = cap.graph.device.ordinal
    if not _on_device([pred], ordinal) or not _on_device(plan.flatten(tuple(operands))[1], ordinal, sizes=True):
        return NotImplemented
    return nodes.cond(cap, pred, reenter(true_fn), reenter(false_fn), tuple(operands))


def torch_while_loop(args, kwargs, reenter, run):
    """``while_loop(cond_fn, body_fn, carried_inputs, additional_inputs)`` as a WHILE node, or
    ``NotImplemented``; outside captures, ``warm_up_loop``."""
    cap = _capture.active()
    if cap is None:
        return warm_up_loop(args, kwargs, run)
    if kwargs or len(args) not in (3, 4):
        return NotImplemented
    cond_fn, body_fn, carried = args[:3]
    extra = tuple(args[3]) if len(args) == 4 else ()
    ordinal = cap.graph.device.ordinal
    spec, leaves, paths = plan.flatten(tuple(carried), "carried_inputs")
    if not _on_device(leaves, ordinal) or not _on_device(plan.flatten(extra)[1], ordinal, sizes=True):
        return NotImplemented
    cond_fn, body_fn = reenter(cond_fn), reenter(body_fn)
    return nodes.while_loop(cap, lambda *c: cond_fn(*c, *extra), lambda *c: body_fn(*c, *extra),
                            spec, leaves, paths)


def warm_up_loop(args, kwargs, run):
    """torch's ``while_loop`` run by torch (``run``) inside a warm-up that draws with cgraw's
    kernels, its draws those of the WHILE node it becomes in the recording (``rng.plan.LoopDraws``):
    torch evaluates the condition first and then after every body, so the draws are set up after
    the first evaluation and an iteration ends after each later one. Every cgraw mode on the stack
    sees the operator (the warm-up's and the random-number router's): the outermost follows the
    loop, the others leave it to torch. ``NotImplemented`` elsewhere."""
    if not _rng_device.warming() or kwargs or len(args) not in (3, 4):
        return NotImplemented
    cond_fn = args[0]
    if getattr(cond_fn, "cgraw_follows_loop", False):
        return NotImplemented  # a mode further out on the stack follows this loop already
    draws: list | None = None

    def cond(*values):
        nonlocal draws
        pred = cond_fn(*values)
        if draws is None:
            draws = _rng_device.loop_draws()
        else:
            for d in draws:
                d.iteration_done()
        return pred

    cond.cgraw_follows_loop = True
    try:
        return run((cond, *args[1:]), kwargs)
    finally:
        for d in draws or ():
            d.done()
