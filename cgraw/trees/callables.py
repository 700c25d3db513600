"""``cgraw.make_graphed_callables``: torch's ``make_graphed_callables`` on graph trees.

Layer L9 (public API, beside ``graphed``): torch only through ``sys.modules`` (the user has
imported it). Needs ``cgraw.config.autograd = True``, the default (``cgraw.trees.autograd``,
section 7); the GPU tier runs it on the H200 (``tests/gpu/test_autograd.py``).
"""

from __future__ import annotations

import sys

from cgraw.errors import CgrawError
from cgraw.trees.graphed import GraphedFunction, mark_step_begin
from cgraw.trees.config import config

_TREE_STEPS = 3  # warm-up, record (forwards; backwards warm up), replay (backwards record)


def make_graphed_callables(callables, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           pool=None):
    """Graphed versions of ``callables`` (functions or ``nn.Module``s), torch's signature.

    ``num_warmup_iters`` forward and backward passes on ``sample_args`` run eagerly; then the
    forwards (in tuple order) and their backwards (in reverse order) are recorded as one path of
    the device's graph tree. A module gets its ``forward`` replaced; called while its
    ``training`` flag differs from the one at capture it runs its original forward eagerly.
    A single callable (not a tuple) takes a tuple of sample tensors and is returned alone.

    Raises:
        ValueError: ``pool`` is not None (the tree owns its pool), or the arguments do not match.
        CgrawError: ``cgraw.config.autograd`` is False.
    """
    if pool is not None:
        raise ValueError("cgraw.make_graphed_callables: pool must be None (the graph tree of the device owns "
                         "its memory pool, shared by every graphed callable)")
    if not config.autograd:
        raise CgrawError("cgraw.make_graphed_callables needs cgraw.config.autograd = True (autograd through "
                         "graphed functions; True by default)")
    torch = sys.modules["torch"]
    just_one = not isinstance(callables, tuple)
    if just_one:
        callables, sample_args = (callables,), (sample_args,)
    if len(callables) != len(sample_args):
        raise ValueError(f"{len(callables)} callables but {len(sample_args)} tuples of sample args")
    for args in sample_args:
        if not isinstance(args, tuple) or not all(isinstance(a, torch.Tensor) for a in args):
            raise ValueError("sample_args must hold one tuple of tensors per callable")
    Module = torch.nn.Module
    forwards = [c.forward if isinstance(c, Module) else c for c in callables]
    graphed = [GraphedFunction(f) for f in forwards]
    for _ in range(num_warmup_iters):
        _step(torch, forwards, callables, sample_args, allow_unused_input)
    for _ in range(_TREE_STEPS):
        mark_step_begin()
        _step(torch, graphed, callables, sample_args, allow_unused_input)
    mark_step_begin()
    out = []
    for c, g, f in zip(callables, graphed, forwards):
        if isinstance(c, Module):
            c.forward = _module_forward(c, g, f, c.training)
            out.append(c)
        else:
            out.append(g)
    return out[0] if just_one else tuple(out)


def _step(torch, fns, callables, sample_args, allow_unused: bool) -> None:
    """Every forward in order, then their backwards in reverse order (``torch.autograd.grad``,
    no ``.grad`` written), as torch's capture does."""
    results = [fn(*args) for fn, args in zip(fns, sample_args)]
    for res, c, args in reversed(list(zip(results, callables, sample_args))):
        outs = [o for o in _flat(torch, res) if o.requires_grad]
        ins = [a for a in args if a.requires_grad]
        if isinstance(c, torch.nn.Module):
            ins += [p for p in c.parameters() if p.requires_grad]
        if outs and ins:
            torch.autograd.grad(outs, ins, [torch.ones_like(o) for o in outs], allow_unused=allow_unused)


def _flat(torch, x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _flat(torch, v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat(torch, v)]
    return []


def _module_forward(module, graphed, original, training: bool):
    def forward(*args, **kwargs):
        if module.training == training:
            return graphed(*args, **kwargs)
        return original(*args, **kwargs)

    return forward
