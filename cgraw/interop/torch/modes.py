"""What every ``TorchDispatchMode`` cgraw pushes has in common: higher-order operators and torch.compile.

Layer L7: torch is found in ``sys.modules`` (imported lazily); the private names come from
``interop.torch.private_api``. The modes are the warm-up's ``Observer`` (``observe``) and the random-number router
``RngMode`` (``interop.torch.rng``); both derive from ``mode_base()``.

Higher-order operators (``torch.cond``, ``while_loop``, ``scan``, ``map``, ``invoke_subgraph``) reach
a mode as one call whose arguments include their bodies as callables; torch raises
``NotImplementedError`` for a mode that does not set ``supports_higher_order_operators``. cgraw's
modes run the operator with the mode off, as torch's protocol requires (its eager kernels assert
that no mode is active), and hand it every body wrapped so that the body runs with the mode pushed
again: the ops of a body are observed and routed exactly as the same ops outside it. An operator
that reads a device predicate on the host (eager ``torch.cond``, ``while_loop``) is a host
synchronisation: a capture fails on it and the graphed function runs eagerly with that reason,
unless a handler registered by name (``register_higher_order``: ``cgraw.control.flow`` registers
``cond`` and ``while_loop``, which become conditional nodes inside a capture) takes the call.

torch.compile: ``ignore_compile_internals()`` is True, so Dynamo compiles frames while the modes
are on the stack (torch 2.11's ``convert_frame`` skips a frame when
``any_torch_dispatch_mode_on_stack()`` finds a mode whose ``ignore_compile_internals()`` is False,
or, with ``config.inline_torch_dispatch_torch_compile`` off, when
``is_in_any_mode_without_ignore_compile_internals()``, which ``TorchDispatchMode.__enter__`` sets
from the same classmethod). Compilation runs with the modes popped; the compiled artifact runs
with them on and sends through them only what goes through the dispatcher: Inductor's extern
kernels (``mm``, ``addmm``), fallback and custom ops, and the seeds of its random numbers
(``aten.randint.low_out``), not its Triton kernels. A torch without the classmethod never asks
for it, and Dynamo then runs such frames uncompiled, as before.
"""

from __future__ import annotations

import sys

from cgraw.interop.torch import private_api

_base: list = [None]
_handlers: dict = {}  # higher-order operator name -> handler(args, kwargs, reenter); set at import


def register_higher_order(name: str, handler) -> None:
    """Let ``handler(args, kwargs, reenter, run)`` run the higher-order operator ``name`` when it
    reaches one of cgraw's modes. ``reenter(fn)`` is ``fn`` run with the mode pushed again;
    ``run(args, kwargs)`` runs torch's operator on them as an unhandled call runs (the mode off,
    every body reentering it). The handler returns the operator's result, or ``NotImplemented``
    to leave the call to torch."""
    _handlers[name] = handler


class _Reentering:
    """A body of a higher-order operator that runs with ``mode`` pushed again; every other
    attribute is the body's (a ``GraphModule``'s ``_boxed_call``, ``graph``, ``meta``)."""

    __slots__ = ("fn", "mode")

    def __init__(self, fn, mode):
        self.fn = fn
        self.mode = mode

    def __call__(self, *args, **kwargs):
        with self.mode:
            return self.fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fn, name)


def mode_base():
    """The ``TorchDispatchMode`` subclass cgraw's modes derive from (made once torch is imported)."""
    base = _base[0]
    if base is None:
        base = _base[0] = _make_base()
    return base


def _make_base():
    torch = sys.modules["torch"]
    from torch.utils._python_dispatch import TorchDispatchMode

    hop = private_api.higher_order_operator_class()
    not_bodies = (*private_api.operator_classes(), type, torch.Tensor)

    def body(x, mode):
        return _Reentering(x, mode) if callable(x) and not isinstance(x, not_bodies) else x

    class CgrawMode(TorchDispatchMode):
        supports_higher_order_operators = True

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

        @staticmethod
        def is_higher_order(func) -> bool:
            return hop is not None and isinstance(func, hop)

        def run_higher_order(self, func, args, kwargs):
            """Run higher-order operator ``func`` below this mode, its bodies under it."""
            def run(args, kwargs):
                return func(*(body(a, self) for a in args), **{k: body(v, self) for k, v in (kwargs or {}).items()})

            handler = _handlers.get(func.name()) if _handlers else None
            if handler is not None:
                out = handler(args, kwargs or {}, lambda fn: body(fn, self), run)
                if out is not NotImplemented:
                    return out
            return run(args, kwargs)

    return CgrawMode
