"""torch's side of ``torch.compile(model, backend="cgraw")``: Inductor compiles, cgraw graphs its partitions.

Layer L7: torch and Inductor through ``interop.torch.private_api`` (every private name is listed there);
cgraw's graphed functions come in through a ``Runtime`` (``cgraw.interop.torch.backend`` builds it), so
this module imports nothing above it.

How Inductor's partition hook works (torch 2.9 to 2.13; read in ``torch/_inductor``):

- With ``config.graph_partition`` on, the scheduler cuts the graph around what cannot be graphed
  (CPU ops, device copies, control flow, ops with unbacked (data-dependent) sizes, custom ops tagged
  ``torch._C.Tag.cudagraph_unsafe``) and generates one function per remaining piece. It does so
  only while ``config.triton.cudagraphs`` is on or a customized partition wrapper is installed
  (``Scheduler.should_partition``: otherwise one piece holds every op). So the wrapper must be
  installed while the graph is lowered.
- The wrapper is applied once, in ``CompiledFxGraph.post_compile`` (on a fresh compile and on a
  cache hit alike), as ``wrapper(partition_fn, CUDAGraphWrapperMetadata(num_partitions,
  partition_index))`` through the generated module's ``recursively_apply_fns``; it is never looked
  up at call time. So it is installed only while this backend's compiles run (``installed``) and
  put back afterwards: other ``torch.compile`` users of the process never see it.
- With a wrapper installed, ``post_compile`` returns right after applying it, skipping the report
  of the graph's output strides to AOT autograd (its backward then assumes eager's strides for
  saved activations Inductor laid out otherwise) and the realignment of misaligned inputs;
  ``finish_post_compile`` does both once ``inner_compile`` returns.
- The inputs a partition writes in place are known to Inductor (``mutated_input_idxs`` of the
  graph, mapped to each partition's inputs by ``partition_maps``, as torch's own CUDA graphs map
  them): they are declared to the partition's graphed function (``mutates``), so its replays
  copy them back even when the warm-up's write left their values as they were (``clamp_`` of
  values in range), which a warm-up cannot see in the data. The graph's static inputs
  (``static_input_idxs``: parameters, module buffers, tensors marked static) of a forward or
  inference graph are declared the same way, as inputs read in place (``declare_static``).
- The generated ``call`` invokes a partition as ``partition_i(args)``: one list of tensors, then
  the partition's symbolic sizes as ints, which the partition unpacks and clears
  (``args.clear()``) so that its inputs can die early; it returns a tuple of outputs.
- AOT autograd compiles the backward later than the forward when it can (lazy lowering); torch
  re-applies config patches there through the inner compile function, so the wrapper is
  installed inside ``inner_compile`` too, not only around ``compile_fx``.
- AOT autograd's cache, on a hit, post-compiles the forward and the backward without calling
  ``inner_compile``: nothing tells the wrapper which graph it wraps. The backend's compiles run
  with it off (``compile_graph``); Inductor's FX graph cache still serves inside ``inner_compile``.
- Inductor's FX graph cache keys on its config but not on the wrapper: an entry a compile
  without it made holds no partition functions. The backend's compiles name a marker in
  ``custom_should_partition_ops`` (an op that does not exist, so nothing is cut there) to key
  their entries apart; a torch without that key compiles with the FX graph cache off.
"""

from __future__ import annotations

import contextlib
import threading

from cgraw.interop.torch import observe, private_api, whole_graph

# Inductor settings every compile of the backend runs with
PATCHES = {"triton.cudagraphs": False, "graph_partition": True}
# names no op: keys the FX graph cache's entries apart; its version changes when what the backend's
# compiles cache changes (2: a forward's output strides reach its backward, ``finish_post_compile``)
CACHE_MARKER = "cgraw::partition_wrapper_2"
_lock = threading.Lock()  # guards the process-wide hook while a compile installs or restores it


class Runtime:
    """What the backend needs from cgraw above this layer: ``graphed(fn)`` makes a graphed function
    (its ``__qualname__`` is its name in ``report()``), ``tree_here(ordinal)`` the calling thread's
    tree, ``note(name, reason)`` records code that runs without graphs."""

    def __init__(self, graphed, tree_here, note):
        self.graphed, self.tree_here, self.note = graphed, tree_here, note


class Home:
    """What the partitions of one compiled graph share: ``manager``, where its forward partitions ran
    last (its backward partitions, run from autograd's thread, replay there too, as the next nodes
    of the path); ``forward_pending``, whether a forward of the training graph ran and no backward
    of it has run since; ``bypass``, whether the forward under way runs as Inductor compiled it."""

    __slots__ = ("tree", "forward_pending", "bypass", "first_forward")

    def __init__(self):
        self.tree = None
        self.forward_pending = False
        self.bypass = False
        self.first_forward = None  # the lowest index of the training forward's graphed partitions


# why a training graph's forward runs without cgraw's graphs while an earlier forward waits for its
# backward: the partitions are root functions of the tree, so a second forward would begin a new
# generation and reuse the memory of the first one's outputs, the activations its backward reads
PENDING = ("a forward ran while the backward of an earlier forward of the same graph had not (gradient "
           "accumulation over micro-batches): it runs as Inductor compiled it, without graphs, until a backward "
           "runs")


def adapt(fn, gf, home: Home, runtime: Runtime, in_backward, *, phase: str | None = None, index: int = 0):
    """The callable Inductor calls in place of partition ``fn`` (``index`` of its graph, compiled as
    ``phase``): it takes Inductor's argument list, clears it as the partition would, and calls
    graphed function ``gf`` with the items as positional arguments. ``in_backward()`` says whether
    autograd's backward pass is running. A forward of a training graph (``phase`` "forward") that
    begins while an earlier forward's backward has not run runs ``fn`` itself (``PENDING``), noted under
    ``gf.name``, the name ``report()`` lists it by."""
    training, name = phase == "forward", gf.name
    if training and (home.first_forward is None or index < home.first_forward):
        home.first_forward = index

    def partition(args):
        if in_backward():
            home.forward_pending = False
            tree = home.tree
            if tree is not None:
                tree.release_step(home)
            xs = tuple(args)
            args.clear()  # the generated code deletes its names first: the inputs die with this call
            if tree is not None and threading.get_ident() != tree.owner_thread:
                return tree.call_here(gf, xs, {})  # a backward is a node of its forward's path
            return gf(*xs)
        if training:
            if index == home.first_forward:  # a forward begins: Inductor calls its partitions in order
                home.bypass = home.forward_pending
                home.forward_pending = True
            if home.bypass:
                runtime.note(name, PENDING)
                return fn(args)
        xs = tuple(args)
        args.clear()
        out = gf(*xs)
        ordinal = _device_of(xs)
        if ordinal >= 0:
            home.tree = runtime.tree_here(ordinal)
        if training and home.tree is not None:
            home.tree.hold_step(home)  # its backward reads these outputs: no other root call begins a step
        return out

    partition.cgraw_graphed = gf
    partition.cgraw_partition = fn
    return partition


def cpu_beside_gpu(xs) -> str | None:
    """Why a partition called with ``xs`` runs as Inductor compiled it where one of its tensors lives
    on the CPU and another on a GPU, else None. dynamo passes a Python float it keeps symbolic
    (``dynamic=True``) as a 0-d CPU tensor, and the partition's kernel launches read its value,
    which a graph would fix at its capture; cgraw's recording copies its inputs on the GPU."""
    devices = [(j, x.get_device()) for j, x in enumerate(xs) if hasattr(x, "get_device")]
    if len({d for _, d in devices}) < 2 or all(d >= 0 for _, d in devices):
        return None
    j, x = next((j, xs[j]) for j, d in devices if d < 0)
    return (f"argument {j} (shape {tuple(getattr(x, 'shape', ()))}, {getattr(x, 'dtype', '?')}) lives on the CPU "
            "beside GPU tensors (a Python float "
            "that dynamo passes as a 0-d CPU tensor is read when the partition's kernels launch, which a "
            "graph fixes at its capture); it runs as Inductor compiled it")


def _device_of(xs) -> int:
    for x in xs:
        get = getattr(x, "get_device", None)
        if get is not None:
            return get()
    return -1


def graph_body(fn, name: str, owner: list | None = None):
    """``fn`` (a partition taking one list) as a function of positional arguments named ``name``.
    ``owner``: a list that holds its graphed function once made. The body runs at warm-ups, eager
    calls and recordings, never at a replay, and a function's first call is a warm-up: there it
    sees where each argument lives (fixed by dynamo's guards and the compiled code), and a CPU
    tensor beside GPU ones (``cpu_beside_gpu``) makes every later call run as Inductor compiled it."""

    def body(*xs):
        if owner and getattr(owner[0], "unsafe_reason", None) is None:
            why = cpu_beside_gpu(xs)
            if why is not None:
                owner[0].unsafe_reason = why
        return fn(list(xs))

    body.__qualname__ = body.__name__ = name
    return body


class Wrapping:
    """The partition wrapper of one backend compile: names the partitions, graphs the selected
    ones (``select(index) -> reason or None``), counts what it wrapped."""

    def __init__(self, label: str, runtime: Runtime, select, home: Home | None = None, whole: bool = False):
        self.label = label
        self.runtime = runtime
        self.select = select
        self.home = home or Home()
        self.phase = threading.local()  # the inner compile under way: "forward", "backward", ...
        self.wrapped: list[str] = []
        self.seen = 0
        self.first: dict = {}  # phase -> index of its graph's first graphed partition
        self.phases: set = set()  # the phases Inductor compiled ("inference", "forward", "backward")
        self.whole = whole  # whether the compile may graph an inference graph whole (read its FX graph)
        self.outside = "not looked at"  # why an inference graph's ops may run outside its partitions, or None
        self.inner_inputs = -1  # the inputs AOT autograd passes the inference graph it compiles

    def name(self, index: int, count: int) -> str:
        phase = getattr(self.phase, "value", None)
        head = f"{self.label} {phase}" if phase else self.label
        return f"{head}/partition {index} of {count}"

    def __call__(self, fn, metadata):
        self.seen += 1
        try:
            index, count = int(metadata.partition_index), int(metadata.num_partitions)
            name = self.name(index, count)
        except Exception as exc:  # noqa: BLE001 -- an unknown metadata: run the partition as compiled
            self.runtime.note(f"{self.label}/partition", f"Inductor's partition metadata is unreadable ({exc!r})")
            return fn
        try:
            why = self.select(index)
            if why is not None:
                self.runtime.note(name, why)
                return fn
            owner: list = []
            gf = self.runtime.graphed(graph_body(fn, name, owner))
            owner.append(gf)
            gf.inputs_guarded = True  # dynamo guards the graph inputs; Inductor allocates the rest (calls.inspect)
            phase = getattr(self.phase, "value", None)
            # the pieces after the graph's first graphed one run in its step: were one of them a root
            # function, its call would end the step while the earlier pieces' outputs are alive in
            # Inductor's frame, and its recording could not reuse their memory
            gf.continues_step = self.first.setdefault(phase, index) < index
            # Inductor's code and AOT autograd read a piece's outputs and drop them: its replays hand out
            # the same objects while nothing holds them (trees.outputs.Reuse), as torch's trees do. Not a
            # backward's: a gradient autograd's AccumulateGrad takes as .grad must be the caller's alone
            gf.reuse_outputs = phase in ("forward", "inference")
            wrapped = adapt(fn, gf, self.home, self.runtime, _in_backward(), phase=phase, index=index)
            made = getattr(self.phase, "made", None)
            if made is not None:
                made[index] = gf
        except Exception as exc:  # noqa: BLE001 -- never fail the compile: run the partition as compiled
            self.runtime.note(name, f"not graphed: {type(exc).__name__}: {exc}")
            return fn
        self.wrapped.append(name)
        return wrapped

    def inner(self, inner_compile):
        """``inner_compile`` (Inductor's per-graph compile) run with this wrapper installed, and
        the graph's phase in the names of its partitions."""

        def compile_with_wrapper(gm, example_inputs, **kwargs):
            phase = ("backward" if kwargs.get("is_backward") else
                     "inference" if kwargs.get("is_inference") else "forward")
            self.phases.add(phase)
            if phase == "inference" and self.whole:
                self.outside = whole_graph.outside_partitions(gm) or private_api.aot_runtime_work()
                self.inner_inputs = len(example_inputs)
            before, self.phase.value = getattr(self.phase, "value", None), phase
            made_before, self.phase.made = getattr(self.phase, "made", None), {}
            try:
                with installed(self):
                    compiled = inner_compile(gm, example_inputs, **kwargs)
                declare_mutations(compiled, self.phase.made)
                if phase != "backward":
                    declare_static(compiled, self.phase.made, kwargs.get("static_input_idxs"))
            finally:
                self.phase.value, self.phase.made = before, made_before
            finish_post_compile(compiled, example_inputs, kwargs.get("cudagraphs"))
            return compiled

        return compile_with_wrapper


def declare_mutations(compiled, made: dict) -> None:
    """Declare to each graphed partition (``made``: partition index -> graphed function) the
    positions of its inputs that ``compiled`` writes in place: the graph's mutated inputs
    (``mutated_input_idxs``) through the partition's ``input_index_mapping``."""
    maps = getattr(compiled, "partition_maps", None)
    mutated = getattr(compiled, "mutated_input_idxs", None)
    if not made or not maps or not mutated:
        return
    for index, gf in made.items():
        if index >= len(maps):
            continue
        pos = graph_positions(maps[index].input_index_mapping, mutated)
        if pos:
            gf.mutates = tuple(sorted(set(gf.mutates) | set(pos)))
            gf.writes_inputs = True


def graph_positions(input_index_mapping, graph_idxs) -> tuple:
    """The partition inputs that are graph inputs in ``graph_idxs`` (graph input indices)."""
    return tuple(j for j, g in enumerate(input_index_mapping) if g is not None and g in graph_idxs)


def declare_static(compiled, made: dict, static_input_idxs) -> None:
    """Declare to each graphed partition of a forward or inference graph the positions of its
    inputs that are the graph's static inputs (``static_input_idxs``, which dynamo and AOT autograd
    give Inductor: parameters, module buffers, tensors marked with
    ``torch._dynamo.mark_static_address`` such as transformers' static caches), which torch's trees
    read in place and never copy. cgraw's calls read them in place too (``calls.inspect``: a static
    input), where they would otherwise be eager inputs: copied on every call (a BatchNorm's running
    statistics, small and written in place) or rebound after a proof. A backward's "static" inputs
    are its saved activations, outputs of the forward's partitions (tree outputs, read in place
    already) unless that forward ran without graphs: they are not declared."""
    maps = getattr(compiled, "partition_maps", None)
    if not made or not maps or not static_input_idxs:
        return
    static = set(static_input_idxs)
    for index, gf in made.items():
        if index < len(maps):
            gf.static_positions = graph_positions(maps[index].input_index_mapping, static)


def finish_post_compile(compiled, example_inputs, ran_cudagraphs) -> None:
    """What ``CompiledFxGraph.post_compile`` leaves undone once a partition wrapper is installed (it
    applies the wrapper and returns): it reports the graph's output strides to AOT autograd, which
    compiles the backward for the strides the forward's saved activations really have (Inductor
    may give a convolution's output ``channels_last`` where eager's is contiguous: without them the
    backward assumes eager's, and Inductor's stride assertion fails or a kernel reads them as laid
    out otherwise), and it wraps the graph to realign misaligned inputs. Done here, after the
    compile, within AOT autograd's collection of the strides."""
    if getattr(compiled, "recursively_apply_fns", None) is None or getattr(compiled, "output_strides", None) is None:
        return  # not a graph Inductor generated with partitions
    ctx = private_api.private("torch._guards.TracingContext").try_get()
    if ctx is not None and ctx.output_strides is not None and not ctx.output_strides:
        private_api.private("torch._inductor.utils.set_tracing_context_output_strides")(example_inputs, compiled)
    if ran_cudagraphs is not None and not ran_cudagraphs:
        realign = private_api.private("torch._inductor.output_code.maybe_realign_inputs")
        realign(ran_cudagraphs, compiled, compiled.inputs_to_check, compiled.mutated_input_idxs)


def _in_backward():
    """A probe: whether autograd's backward pass runs on this thread now."""
    try:
        task = private_api.graph_task_id()
    except private_api.TorchApiError:  # torch not imported: no backward can run
        task = None
    if task is None:
        return lambda: False
    return lambda: task() != -1


@contextlib.contextmanager
def installed(wrapper):
    """Inductor's partition wrapper is ``wrapper`` inside the block; what was installed before
    (None, or another user's) comes back after it."""
    setter = private_api.private("torch._inductor.utils.set_customized_partition_wrappers")
    slot = private_api.partition_wrapper_slot()
    with _lock:
        before = None if slot is None else slot.wrapper
        setter(wrapper)
    try:
        yield
    finally:
        with _lock:
            setter(before)


def check() -> None:
    """Look up every private torch name the backend uses; ``TorchApiError`` names a missing one."""
    for dotted in private_api.NEEDED_ELSEWHERE:
        private_api.private(dotted)
    private_api.inductor_config_keys()


def config_patches(extra: dict | None, mode: str | None) -> dict:
    """Inductor's config for the backend's compiles: ``mode``'s options (``torch.compile``'s modes,
    without their CUDA graphs), the user's ``extra``, then ``PATCHES`` and the cache marker."""
    import importlib

    private_api.inductor_config_keys()
    inductor = importlib.import_module("torch._inductor")
    cfg = importlib.import_module("torch._inductor.config")
    out: dict = {}
    if mode not in (None, "default"):
        list_mode_options = getattr(inductor, "list_mode_options", None)
        if list_mode_options is None:
            raise private_api.TorchApiError(f"torch {private_api.api().version} has no torch._inductor.list_mode_options")
        out.update(list_mode_options(mode))
    out.update(extra or {})
    out.update(PATCHES)
    if hasattr(cfg, "custom_should_partition_ops"):
        ops = list(out.get("custom_should_partition_ops", cfg.custom_should_partition_ops))
        out["custom_should_partition_ops"] = ops + [CACHE_MARKER]
    else:
        out["fx_graph_cache"] = False
    return out


def compile_graph(gm, example_inputs, wrapping: Wrapping, patches: dict):
    """``gm`` compiled by Inductor under ``patches``, its partitions wrapped by ``wrapping``."""
    compile_fx = private_api.private("torch._inductor.compile_fx.compile_fx")
    inner = private_api.private("torch._inductor.compile_fx.compile_fx_inner")
    aot_config = private_api.private("torch._functorch.config")
    # AOT autograd's cache off: a hit applies the wrapper without inner_compile, so a partition would
    # not know whether it is a training graph's forward (whose second call before a backward must
    # run as compiled, ``PENDING``), a backward or an inference graph. Inductor's own (FX graph)
    # cache still serves, inside inner_compile.
    aot_cache = {"enable_autograd_cache": False} if hasattr(aot_config, "enable_autograd_cache") else {}
    with installed(wrapping), aot_config.patch(**aot_cache):
        compiled = compile_fx(gm, example_inputs, inner_compile=wrapping.inner(inner), config_patches=patches)
    # the hooks a tree installs when it is made (interop.torch.observe: module assignments) are
    # installed before dynamo builds the frame's guards, which hold the registration hooks of
    # torch.nn.Module as they are (a frame that assigns a module attribute reads them): made at
    # the first partition's call, they would fail the guard at the second and recompile the frame.
    # Not before compile_fx returns: a compile that restarts dynamo's analysis (Inductor's pass that
    # turns Python floats into tensors can) replays the trace, which must meet the hooks it met
    # the first time (a ModuleList sliced in the frame runs them through add_module)
    observe.install_module_hooks()
    return compiled


def plain_compile(gm, example_inputs, extra: dict | None):
    """``gm`` compiled by Inductor without graphs (the fallback)."""
    compile_fx = private_api.private("torch._inductor.compile_fx.compile_fx")
    return compile_fx(gm, example_inputs, config_patches={**(extra or {}), "triton.cudagraphs": False})


__all__ = ["CACHE_MARKER", "PATCHES", "PENDING", "Home", "Runtime", "Wrapping", "adapt", "check", "compile_graph",
           "cpu_beside_gpu", "config_patches",
           "declare_mutations", "finish_post_compile", "graph_body", "installed", "graph_positions",
           "plain_compile"]
