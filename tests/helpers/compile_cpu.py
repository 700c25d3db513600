"""``torch.compile(model, backend=cgraw_backend)`` on the CPU, through the partition path.

On a GPU, Inductor's scheduler cuts the graph into partitions and cgraw's backend makes each one
a graphed function of the calling thread's tree. On the CPU it cuts none: ``Scheduler.should_partition``
(torch/_inductor/scheduler.py) gives every node that is not on a GPU the reason ``"cpu ops"``
(``if not node.is_gpu(): return f"{node.get_device()} ops"``), and a graph made only of such
nodes is one partition that is never wrapped. ``cpu_partitions`` asks again for such a node with
``is_gpu()`` true for that one check, so CPU nodes count as graphable and the checks after the
device's (``DeviceCopy``, ``Conditional``, unbacked sizes, ``cudagraph_unsafe`` ops) still cut
as on a GPU. Inductor's CPU code generation then emits ``partition_i(args)`` functions and
applies the partition wrapper exactly as it does for CUDA code.

The graphed functions the backend makes run in trees whose backend is ``CompileCpuBackend``
(``torch_cpu_backend.CpuTorchBackend``: a "replay" runs the partition again on the recording's
placeholders and writes the results into the recording's tensors), with CPU tensors reporting
device 0; it installs the module hooks a CUDA tree installs when it is made. Everything of the
backend and of Inductor runs as on a GPU: dynamo's guards and recompiles, AOT autograd's
forward and backward, Inductor's partitions and the wrapper's application, the tree's
decisions. What it does not show: anything of CUDA (captures and their failures, Triton kernels,
the pool's memory and its checkpoints, warm-ups inside the pool, an ended generation's outputs
are not poisoned, only logged), and Inductor's choices for a GPU (its CPU code is C++; layouts,
fusions and which ops fall back differ).

The FX graph cache keys on ``custom_should_partition_ops``: the harness adds ``CACHE_KEY`` to it
(an op name that does not exist, so nothing is cut there), so its entries (partitioned as no GPU
run would) and everyone else's stay apart.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch
from torch_cpu_backend import ReusingBackend, copy_span, cpu_as_device0

from cgraw.interop.torch import observe
from cgraw.interop.torch.backend import cgraw_backend
from cgraw.interop.torch.kernel_state import kernel_state
from cgraw.trees import calls
from cgraw.trees import config as tree_config
from cgraw.trees.arrays import EAGER, TORCH
from cgraw.trees.manager import TreeManager

graphed_mod = importlib.import_module("cgraw.trees.graphed")

CACHE_KEY = "cgraw::cpu_partitions_2"  # its version changes with the harness's rule for cutting
CPU_REASON = "cpu ops"  # Scheduler.should_partition's reason for a node of the CPU


class _Pool:
    """What ``cgraw.report()`` reads of a tree's pool: nothing is reserved on the CPU."""

    closed = False
    torch_reserved_bytes = 0

    def stats(self):
        return types.SimpleNamespace(reserved_bytes=0)


class CompileCpuBackend(ReusingBackend):
    """``CpuTorchBackend`` for trees that ``cgraw.graphed`` makes (``report()`` reads a pool); the
    backend's forward pieces hand out their output objects again (``ReusingBackend``).

    Its recording runs the partition once on the inputs read in place (static inputs, tree
    outputs), where a capture computes nothing, and the first replay runs it again. Inductor's
    backward partitions write into their inputs (the saved activations AOT autograd donates to the
    backward: ``buf15 = relu; del relu  # reuse``), so the recording puts back what its run wrote
    there, and the random-number generator's state, as if it had computed nothing."""

    def __init__(self):
        super().__init__()
        self.pool = _Pool()
        observe.install_module_hooks()  # as CudaBackend does: a tree watches module assignments

    def record(self, fn, call, warm):
        in_place = [(t, TORCH.clone_layout(t.detach())) for j, t in enumerate(call.leaves)
                    if call.kinds[j] != EAGER and isinstance(t, torch.Tensor)]
        rng = torch.get_rng_state()
        rec = super().record(fn, call, warm)
        torch.set_rng_state(rng)
        with torch.no_grad():
            for t, before in in_place:
                copy_span(t.data, before)  # no version counter moves (a forward saved the parameters)
        return rec


class Harness:
    """What ``cpu_partitions`` yields: ``trees`` (every tree made), ``compile(model, **options)``."""

    def __init__(self):
        self.trees: list[TreeManager] = []
        self.backends: list[CompileCpuBackend] = []

    def factory(self, ordinal: int) -> TreeManager:
        be = CompileCpuBackend()
        mgr = TreeManager(be, device_index=ordinal)
        be.mgr = mgr
        self.trees.append(mgr)
        self.backends.append(be)
        return mgr

    @staticmethod
    def compile(model, *, dynamic=None, mode=None, **options):
        """``torch.compile(model, backend=cgraw_backend, options=options)`` (this checkout's backend)."""
        return torch.compile(model, backend=cgraw_backend, options=options or None, dynamic=dynamic, mode=mode)

    @property
    def tree(self) -> TreeManager:
        return graphed_mod._managers[0]

    def partitions(self, prefix: str) -> dict:
        """``{name: FunctionStats}`` of the partitions of the compiled code named ``prefix``."""
        mgr = graphed_mod.tree_here(0)
        if mgr is None:
            return {}
        return {s.name: s for s in mgr.stats.values() if s.name.startswith(prefix) and "/partition " in s.name}


@contextlib.contextmanager
def cpu_partitions(monkeypatch):
    """Inductor partitions CPU graphs, and the backend's graphed functions run on CPU trees."""
    from torch._inductor import scheduler

    real = scheduler.Scheduler.should_partition

    def should_partition(self, node):
        why = real(self, node)
        if why != CPU_REASON:
            return why
        node.is_gpu = lambda: True  # for this check only: the ones after the device's apply
        try:
            return real(self, node)
        finally:
            del node.is_gpu

    h = Harness()
    monkeypatch.setattr(scheduler.Scheduler, "should_partition", should_partition)
    monkeypatch.setattr(graphed_mod, "_new_tree", h.factory)
    # a partition without tensor arguments (a function drawing random numbers) is on the current
    # CUDA device; here every tensor is on "device 0"
    monkeypatch.setattr(graphed_mod, "_device_of", lambda args, kwargs: 0)
    before = (calls._tensor[0], calls._tensor[1], calls._kernel[0])
    ops = list(torch._inductor.config.custom_should_partition_ops) + [CACHE_KEY]
    graphed_mod.reset()
    graphed_mod.forget_without_graphs()
    torch._dynamo.reset()
    with cpu_as_device0(monkeypatch), torch._inductor.config.patch(custom_should_partition_ops=ops):
        # what CudaBackend does once torch is loaded: parameters are static inputs, grad mode
        # and the settings that choose kernels join the key
        calls.use_torch(torch.Tensor, torch.nn.Parameter)
        tree_config.grad_probe(torch.is_grad_enabled)
        calls.use_kernel_state(kernel_state())
        try:
            yield h
        finally:
            graphed_mod.reset()
            torch._dynamo.reset()
            graphed_mod.forget_without_graphs()
            tree_config.grad_probe(None)
            calls.use_torch(before[0], before[1])
            calls.use_kernel_state(before[2])
