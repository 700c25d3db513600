"""The one module that reaches into torch's private API (``torch._C``, ``torch._ops``, ``torch.utils._pytree``,
``torch._inductor``'s partition hook and config keys).

Layer L1: imports only ``errors``; torch is found in ``sys.modules`` (cgraw never imports it).
Every private name cgraw uses is listed in ``NEEDED`` with what it is for. Names are looked up on
first use and cached; a missing one raises ``TorchApiError`` naming the installed torch version,
the missing call and the range cgraw supports, instead of an ``AttributeError`` deep inside a
capture. ``check()`` looks them all up at once (a tree does so when it is created).
"""

from __future__ import annotations

import operator
import sys

from cgraw.errors import CgrawError

SUPPORTED = "2.11.x"  # keep in step with pyproject.toml's torch extra

# private name -> what cgraw uses it for
NEEDED = {
    "_cuda_getCurrentRawStream": "the caller's current stream (replays run there)",
    "_cuda_getCheckpointState": "graph-tree checkpoints of the tree's torch MemPool",
    "_cuda_setCheckpointPoolState": "restoring a checkpoint before recording a new branch",
    "_has_Standard_Deleter": "finding the storage that owns a MemPool block",
    "_construct_storage_from_data_pointer": "giving a block back a deleter-holding owner",
    "_set_storage_access_error_msg": "poisoning outputs of an ended generation",
    "_cuda_beginAllocateCurrentStreamToPool": "routing autograd's device thread during a recording",
    "_cuda_endAllocateToPool": "ending that routing",
    "_cuda_releasePool": "ending that routing",
    "_cuda_clearCublasWorkspaces": "keeping cuBLAS workspaces inside a recording",
    "_cuda_memorySnapshot": "reading torch's segments, always with None (see memory_segments)",
    "_storage_Use_Count": "whether memory a graph tree handed out is still used (a view or .detach() of an output)",
}


class TorchApiError(CgrawError, RuntimeError):
    """The installed torch lacks a private function cgraw relies on."""


class _Api:
    """``torch._C`` functions, looked up once each: ``api()._cuda_getCheckpointState(...)``."""

    def __init__(self, torch):
        self._torch = torch
        self.version = getattr(torch, "__version__", "unknown")

    def __getattr__(self, name):
        if name not in NEEDED:
            raise AttributeError(name)
        fn = getattr(self._torch._C, name, None)
        if fn is None:
            raise TorchApiError(
                f"cgraw needs torch._C.{name} ({NEEDED[name]}), which torch {self.version} does not have; "
                f"cgraw supports torch {SUPPORTED}: install a supported torch, or pin cgraw's torch extra")
        self.__dict__[name] = fn  # later lookups skip __getattr__
        return fn


_api: _Api | None = None


def api() -> _Api:
    """The cached private-API table of the torch the process has imported."""
    global _api
    a = _api
    torch = sys.modules.get("torch")
    if a is None or a._torch is not torch:
        if torch is None:
            raise TorchApiError("torch is not imported")
        a = _api = _Api(torch)
    return a


def check() -> None:
    """Look up every needed private function now; raise one error naming all that are missing."""
    a = api()
    missing = [n for n in NEEDED if getattr(a._torch._C, n, None) is None]
    if missing:
        raise TorchApiError(
            f"cgraw needs torch._C.{', torch._C.'.join(missing)}, which torch {a.version} does not have; "
            f"cgraw supports torch {SUPPORTED}")


def cudagraph_unsafe_tag():
    """``torch._C.Tag.cudagraph_unsafe`` (custom ops that must not be captured), or None."""
    tags = getattr(api()._torch._C, "Tag", None)
    return getattr(tags, "cudagraph_unsafe", None)


def nondeterministic_seeded_tag():
    """``torch._C.Tag.nondeterministic_seeded`` (random-number ops), or None."""
    tags = getattr(api()._torch._C, "Tag", None)
    return getattr(tags, "nondeterministic_seeded", None)


def higher_order_operator_class():
    """``torch._ops.HigherOrderOperator`` (``torch.cond``, ``while_loop``, ``scan``, ``map``: operators
    whose arguments include Python callables), or None."""
    ops = getattr(api()._torch, "_ops", None)
    return getattr(ops, "HigherOrderOperator", None)


def operator_classes() -> tuple:
    """The classes of torch's operator objects (``torch._ops.OperatorBase``, ``OpOverloadPacket``):
    callables a higher-order operator takes as operators, not as bodies."""
    ops = getattr(api()._torch, "_ops", None)
    return tuple(c for c in (getattr(ops, "OperatorBase", None), getattr(ops, "OpOverloadPacket", None))
                 if isinstance(c, type))


def top_saved_tensors_hooks():
    """The innermost ``saved_tensors_hooks`` pair of this thread, ``(pack, unpack)``, or None (also
    where torch lacks ``torch._C._autograd._top_saved_tensors_default_hooks``)."""
    top = getattr(getattr(api()._torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(True)


def graph_task_id():
    """``torch._C._current_graph_task_id``: called, -1 outside a backward pass and the running
    backward's id inside one; None where torch lacks it."""
    return getattr(api()._torch._C, "_current_graph_task_id", None)


def pytree():
    """``torch.utils._pytree`` (the container registry torch users know), or None."""
    mod = sys.modules.get("torch.utils._pytree")
    if mod is None and "torch" in sys.modules:
        try:
            import importlib

            mod = importlib.import_module("torch.utils._pytree")
        except Exception:  # an optional convenience: cgraw's own container rules still apply
            return None
    if mod is None or not hasattr(mod, "SUPPORTED_NODES"):
        return None
    return mod


# torch._C getters of the process-wide settings that change which kernels eager torch runs, by
# group (interop.torch.kernel_state): "guarded" are what dynamo's GlobalStateGuard also checks, "core"
# reaches every function, "cudnn" convolutions, batch norms and recurrent layers, "sdp" scaled
# dot-product attention. A name the installed torch lacks is left out: that setting does not exist there.
KERNEL_STATE = {
    "guarded": ("_get_cublas_allow_tf32", "_get_float32_matmul_precision",
                "_get_cublas_allow_fp16_reduced_precision_reduction",
                "_get_cublas_allow_bf16_reduced_precision_reduction", "_get_deterministic_algorithms",
                "_get_deterministic_algorithms_warn_only", "_is_torch_function_enabled"),
    "core": ("_get_cublas_allow_fp16_accumulation", "_get_deterministic_fill_uninitialized_memory"),
    "cudnn": ("_get_cudnn_enabled", "_get_cudnn_benchmark", "_get_cudnn_deterministic", "_get_cudnn_allow_tf32"),
    "sdp": ("_get_flash_sdp_enabled", "_get_mem_efficient_sdp_enabled", "_get_math_sdp_enabled",
            "_get_cudnn_sdp_enabled", "_get_math_sdp_allow_fp16_bf16_reduction"),
}


def kernel_state_getters() -> dict[str, tuple]:
    """``{group: (getter, ...)}`` of ``KERNEL_STATE``'s functions the installed torch has."""
    C = api()._torch._C
    return {group: tuple(f for f in (getattr(C, n, None) for n in names) if f is not None)
            for group, names in KERNEL_STATE.items()}


def global_state_guard():
    """``torch._C._dynamo.guards.GlobalStateGuard`` (dynamo's one-call check that grad mode,
    autocast, TF32 and the other global settings its compiled frames assume still hold), or None."""
    dynamo = getattr(api()._torch._C, "_dynamo", None)
    guards = getattr(dynamo, "guards", None)
    return getattr(guards, "GlobalStateGuard", None)


def grad_mode_setter():
    """``torch._C._set_grad_enabled`` (sets grad mode, in C: a fifth of ``torch.no_grad()``'s cost
    as a context manager), or ``torch.set_grad_enabled``, which does the same called as a function."""
    torch = api()._torch
    return getattr(torch._C, "_set_grad_enabled", None) or torch.set_grad_enabled


def view_base(t):
    """``t._base``: the tensor ``t`` is a view of, or None."""
    return t._base


def version(t) -> int | None:
    """``t._version``: its version counter, which every in-place write through it or a view of it
    bumps (even one that leaves its values as they were); None for an inference tensor, which
    has none."""
    try:
        return t._version
    except RuntimeError:
        return None


def storage_users(t):
    """A callable counting the references to ``t``'s storage (every tensor over it, views and
    ``.detach()`` aliases included), through a weak reference to the storage, as torch's trees
    see whether outputs are alive; it keeps neither ``t`` nor its memory alive."""
    from torch.multiprocessing.reductions import StorageWeakRef

    ref = StorageWeakRef(t.untyped_storage())
    count = api()._storage_Use_Count

    def users() -> int:
        return count(ref.cdata)
    return users


def reuse_probe():
    """What ``trees.outputs.Reuse`` asks of the tensors it hands out again (``frameworks.Ops.reuse_probe``):
    ``(holders, marks, settle)``, or None where torch lacks ``torch._C.TensorBase._use_count`` (a graph
    tree then makes new output objects at every replay). ``holders``: that count, the references to a
    tensor's C++ object (its Python object's, and any C++ holder's: autograd's saved tensors), 1 when
    only the Python object holds it."""
    holders = getattr(getattr(api()._torch._C, "TensorBase", None), "_use_count", None)
    return None if holders is None else (holders, _marks, _settle)


_version, _requires_grad = operator.attrgetter("_version"), operator.attrgetter("requires_grad")


def _marks(ts) -> tuple:
    """Version counters (every in-place write, ``squeeze_``, ``set_``, ``resize_`` moves them) and data
    pointers (``t.data = other`` moves them) of tensors ``ts``. An inference tensor (made under
    ``torch.inference_mode()``) has no counter and may be written in place unseen: its marks equal
    no others, so its objects are made anew at every replay."""
    try:
        versions = list(map(_version, ts))
    except RuntimeError:  # "Inference tensors do not track version counter"
        versions = [object()]
    return versions, list(map(api()._torch.Tensor.data_ptr, ts))


def _settle(ts) -> bool:
    """Whether tensors ``ts`` may be handed out again: not if one is a leaf that requires grad
    (``requires_grad_()``: a backward would add to its ``.grad``) or keeps its ``.grad``
    (``retain_grad()``). One that autograd.Function made an output of (AOT autograd's forward) requires
    grad with a ``grad_fn``: it is detached in place, which lets go of its step's autograd graph
    (the next forward makes it an output again)."""
    rg = list(map(_requires_grad, ts))
    if True not in rg:
        return True
    made = [t for t, r in zip(ts, rg) if r]
    if any(t.grad_fn is None or t.retains_grad for t in made):
        return False
    for t in made:
        t.detach_()
    return True


def memory_segments() -> list:
    """Every segment of torch's CUDA caching allocator, as ``torch.cuda.memory_snapshot()`` lists
    them, each with its ``segment_pool_id``; callers filter.

    Always ``_cuda_memorySnapshot(None)``. torch 2.11 reads a ``(pool id, include_traces)`` tuple
    argument with ``THPObjectPtr(PyTuple_GetItem(arg, i))``: it releases, for each item, a reference
    it never took. So ``MemPool.snapshot()`` and ``torch.cuda.memory_snapshot(pool_id)`` free the
    id's int while its tuple still holds it, once the process has made more than 256 MemPools
    (Python 3.12's ints up to 256 are immortal; on 3.11 even ``memory_snapshot()`` drains the
    refcounts of 0 and True): a later allocation then crashes, as the one-process GPU tier, which
    makes far more MemPools than that, would. With None torch parses nothing.
    """
    snapshot = api()._cuda_memorySnapshot
    try:
        return snapshot(None)["segments"]
    except TypeError:  # a torch whose snapshot takes no argument at all (none to mishandle)
        return snapshot()["segments"]


# private names outside torch._C, by dotted path -> what cgraw uses them for (looked up by
# ``private``; the torch.compile backend, ``interop.torch.partitions``)
NEEDED_ELSEWHERE = {
    "torch._inductor.utils.set_customized_partition_wrappers":
        "wrapping each of Inductor's graph partitions in a graphed function (backend='cgraw')",
    "torch._inductor.compile_fx.compile_fx": "compiling a dynamo graph with Inductor (backend='cgraw')",
    "torch._inductor.compile_fx.compile_fx_inner": "Inductor's per-graph compile, run with the partition wrapper",
    "torch._functorch.config":
        "turning AOT autograd's cache off for the backend's compiles (its hits apply the partition wrapper "
        "without saying which graph is the forward and which the backward)",
    "torch._guards.TracingContext": "where AOT autograd collects a forward's output strides for its backward",
    "torch._inductor.utils.set_tracing_context_output_strides":
        "reporting a partitioned graph's output strides, which Inductor skips once a partition wrapper is installed",
    "torch._inductor.output_code.maybe_realign_inputs":
        "realigning a partitioned graph's misaligned inputs, which Inductor skips once a partition wrapper is installed",
    "torch._dynamo.utils.counters":
        "whether dynamo compiled during a recording, whose capture that breaks (dynamo_frames)",
}
# torch._inductor.config keys the backend sets (``inductor_config_keys``)
INDUCTOR_CONFIG = {
    "graph_partition": "cutting Inductor's code into partitions around what cannot be graphed",
    "triton.cudagraphs": "keeping Inductor's own CUDA graphs off under backend='cgraw'",
}


def private(dotted: str):
    """The object at ``dotted`` (a key of ``NEEDED_ELSEWHERE``), its module imported; raises
    ``TorchApiError`` naming it when the installed torch lacks it."""
    import importlib

    if dotted not in NEEDED_ELSEWHERE:
        raise KeyError(f"{dotted} is not listed in interop.torch.private_api.NEEDED_ELSEWHERE")
    a = api()
    module, _, name = dotted.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise TorchApiError(
            f"cgraw needs {dotted} ({NEEDED_ELSEWHERE[dotted]}), which torch {a.version} does not have "
            f"({exc}); cgraw supports torch {SUPPORTED}") from exc
    return obj


def dynamo_frames() -> int:
    """Frames torch.compile (dynamo) has set out to compile in this process so far
    (``torch._dynamo.utils.counters["frames"]["total"]``, counted before each compile, failed ones
    included); 0 while dynamo is not loaded (nothing is imported to find out: not ``private``)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return 0
    try:
        return int(counters["frames"]["total"])
    except Exception:  # noqa: BLE001 -- another torch's counters: no compile is seen
        return 0


def aot_runtime_work() -> str | None:
    """What AOT autograd's runtime wrapper does in Python around the graph being compiled, which a
    replay of the whole compiled callable would not redo, or None: an input whose sizes, strides or
    storage the graph changes (``x.unsqueeze_(0)``, ``x.set_(...)``), ops with side effects (effect
    tokens), functionalized random numbers. Read from the ``ViewAndMutationMeta`` AOT autograd
    sets on ``torch._guards.TracingContext`` before it calls the inner compile; unreadable counts."""
    guards = sys.modules.get("torch._guards")
    try:
        meta = guards.TracingContext.try_get().fw_metadata
        infos, tokens = list(meta.input_info), meta.tokens
        rng = bool(getattr(meta, "is_rng_op_functionalized", False))
    except Exception as exc:  # noqa: BLE001 -- another torch, or no tracing context: say so
        return f"AOT autograd's metadata of the graph could not be read ({type(exc).__name__}: {exc})"
    changed = [j for j, info in enumerate(infos) if info.mutates_metadata or info.mutates_storage_metadata]
    if changed:
        return (f"it changes the sizes, strides or storage of graph input(s) {changed} (x.unsqueeze_(0), "
                f"x.set_()), which AOT autograd's wrapper redoes in Python at every call")
    if tokens:
        return f"it runs {len(tokens)} op(s) with side effects (effect tokens)"
    if rng:
        return "AOT autograd functionalizes its random numbers (functionalize_rng_ops)"
    return None


def partition_wrapper_slot():
    """The object holding Inductor's current partition wrapper (its ``wrapper`` attribute), or None
    where torch keeps it elsewhere: read only to put back what another user installed."""
    import importlib

    utils = importlib.import_module("torch._inductor.utils")
    slot = getattr(utils, "_unstable_customized_partition_wrapper", None)
    return slot if hasattr(slot, "wrapper") else None


def inductor_config_keys() -> None:
    """Raise ``TorchApiError`` naming every key of ``INDUCTOR_CONFIG`` that the installed torch's
    ``torch._inductor.config`` lacks."""
    import importlib

    cfg = importlib.import_module("torch._inductor.config")
    missing = []
    for key in INDUCTOR_CONFIG:
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            missing.append(key)
    if missing:
        raise TorchApiError(
            f"cgraw needs torch._inductor.config.{', torch._inductor.config.'.join(missing)}, which torch "
            f"{api().version} does not have; cgraw supports torch {SUPPORTED}")


_MISSING = object()


def _reset() -> None:
    """Forget the cached table (tests swap the torch module)."""
    global _api
    _api = None


__all__ = ["INDUCTOR_CONFIG", "KERNEL_STATE", "NEEDED", "NEEDED_ELSEWHERE", "SUPPORTED", "TorchApiError", "api", "check", "cudagraph_unsafe_tag",
           "global_state_guard", "graph_task_id", "higher_order_operator_class", "inductor_config_keys", "kernel_state_getters",
           "memory_segments", "nondeterministic_seeded_tag", "operator_classes", "partition_wrapper_slot",
           "private", "pytree", "reuse_probe", "storage_users",
           "top_saved_tensors_hooks"]
