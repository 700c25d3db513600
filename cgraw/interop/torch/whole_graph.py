"""An inference graph as one graphed function: ``torch.compile(backend="cgraw")`` graphs Inductor's
whole compiled callable of a dynamo graph, rather than its partitions, where nothing of it runs
outside Inductor's one partition and AOT autograd's wrapper has nothing to redo in Python around it.
A call is then dynamo's guards and one launch: none of AOT autograd's or Inductor's Python runs.

Layer L7: reads torch's FX graphs and operators through ``interop.torch.private_api``; the graphed
function comes from the ``Runtime`` the backend passes in (``partitions.Runtime``).
"""

from __future__ import annotations

import operator
import sys

from cgraw.interop.torch import private_api

_getitem = operator.getitem


def outside_partitions(gm) -> str | None:
    """Why an op of ``gm`` (as Inductor lowers it) may run outside Inductor's partitions, or None: it
    cuts around CPU tensors, several devices, higher-order operators, data-dependent sizes and
    ``cudagraph_unsafe`` ops (``Scheduler.should_partition``); an op this cannot read counts. A
    graph with dynamic sizes is graphed by partitions too: its code reads the sizes in Python."""
    import importlib

    symbolic = importlib.import_module("torch.fx.experimental.symbolic_shapes")
    hop, unsafe = private_api.higher_order_operator_class(), private_api.cudagraph_unsafe_tag()
    devices = set()
    try:
        for node in gm.graph.nodes:
            target = node.target
            if node.op == "call_function" and target is not _getitem:
                if hop is not None and isinstance(target, hop):
                    return f"it runs the higher-order operator {target.name()} (control flow)"
                tags = getattr(target, "tags", None)
                if tags is None:
                    return f"it calls {target!r}, which is not an operator Inductor partitions"
                if unsafe is not None and unsafe in tags:
                    return f"it calls {target}, tagged torch._C.Tag.cudagraph_unsafe"
            elif node.op not in ("call_function", "placeholder", "output", "get_attr"):
                return f"it holds a {node.op} node"
            vals = node.meta.get("val")
            for v in vals if isinstance(vals, (list, tuple)) else (vals,):
                if hasattr(v, "device") and v.device.type != "meta":  # meta: a device chosen when it runs
                    devices.add(v.device)
                if v is not None and symbolic.free_unbacked_symbols(v):
                    return f"{node.name} has a size or value that depends on data"
                if node.op == "placeholder" and v is not None and symbolic.free_symbols(v):
                    # Inductor's code reads such sizes from its inputs in Python, which a replay of
                    # the whole graph would skip: its partitions take them as arguments instead
                    return f"input {node.name} has a dynamic (symbolic) size"
    except Exception as exc:  # noqa: BLE001 -- unreadable: say so rather than guess
        return f"its graph could not be read ({type(exc).__name__}: {exc})"
    if any(d.type != "cuda" for d in devices):
        return "it holds CPU tensors (Inductor runs their ops outside its partitions)"
    if len(devices) > 1:
        return f"it holds tensors of {len(devices)} devices"
    return None


def reason(wrapping, patches: dict, example_inputs) -> str | None:
    """Why the graph ``wrapping`` (a ``partitions.Wrapping``) saw compiled under Inductor settings
    ``patches`` from ``example_inputs`` is not one graphed function as a whole, or None: an
    inference graph of plain tensors whose one partition holds every op of it and around which AOT
    autograd's wrapper has nothing to redo in Python (``private_api.aot_runtime_work``)."""
    torch = sys.modules.get("torch")
    plain = (torch.Tensor, torch.nn.Parameter) if torch is not None else ()
    odd = sorted({type(t).__name__ for t in example_inputs if isinstance(t, plain) and type(t) not in plain})
    if odd:
        return f"it takes inputs of type {', '.join(odd)} (a tensor subclass is unwrapped at every call)"
    if cut_at := [op for op in patches.get("custom_should_partition_ops", ()) if _is_op(op)]:
        return f"Inductor cuts its graphs at {cut_at} (custom_should_partition_ops)"
    if wrapping.phases != {"inference"}:
        return f"it compiled as {sorted(wrapping.phases)}, not as one inference graph"
    if wrapping.outside is not None:
        return wrapping.outside
    if wrapping.inner_inputs != len(example_inputs):
        return (f"AOT autograd passes its graph {wrapping.inner_inputs} inputs for the {len(example_inputs)} "
                f"dynamo passes (it merges aliased or repeated inputs, or adds its own, at every call)")
    if wrapping.seen != 1 or len(wrapping.wrapped) != 1:
        return f"Inductor made {wrapping.seen} partition(s), {len(wrapping.wrapped)} of them graphed"
    return None


def _is_op(name: str) -> bool:
    """Whether ``namespace::op`` names a registered operator (cache markers name none)."""
    torch, (ns, _, op) = sys.modules.get("torch"), name.partition("::")
    return torch is not None and (not op or hasattr(getattr(torch.ops, ns), op.split(".")[0]))


def graphed_whole(compiled, example_inputs, runtime, name: str):
    """``compiled`` (Inductor's code of one dynamo graph) as one graphed function named ``name``, made
    by ``runtime`` (a ``partitions.Runtime``): a call is dynamo's guards and one launch. Its
    partition runs inline in the whole graph's warm-up and recording; where that capture fails, it
    runs as compiled, its partition graphed on its own. Dynamo guards every input; parameters and
    inputs dynamo marks static are read in place.

    dynamo calls an inference graph with grad mode as its caller has it (a ``torch.no_grad()``
    inside the compiled function is part of the graph), and AOT autograd's wrapper runs the graph
    with grad disabled: none of its outputs requires grad. The graphed function is called with
    grad disabled too, as its body runs anyway, so the tree sees a call that records no backward:
    no gradient entry in its key (which would read every parameter's ``requires_grad`` at every
    call), and a recording without autograd's bookkeeping (saved-tensor hooks, placeholders that
    require grad). The callable returned calls it so; ``cgraw_graphed`` is the graphed function."""

    def body(*args):
        return compiled(*args)

    body.__qualname__ = body.__name__ = name
    gf = runtime.graphed(body)
    gf.inputs_guarded = True
    gf.static_positions = tuple(j for j, t in enumerate(example_inputs)
                                if getattr(t, "_dynamo_static_input_type", None) is not None)
    grad_enabled, set_grad = sys.modules["torch"].is_grad_enabled, private_api.grad_mode_setter()

    def whole(*args):
        if not grad_enabled():
            return gf(*args)
        set_grad(False)
        try:
            return gf(*args)
        finally:
            set_grad(True)

    whole.__qualname__ = whole.__name__ = name
    whole.cgraw_graphed = gf
    return whole


__all__ = ["graphed_whole", "outside_partitions", "reason"]
