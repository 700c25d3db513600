"""``torch.compile(model, backend="cgraw")``: Inductor's kernels, cgraw's graph trees.

Layer L9 (public API, beside ``graphed``). The backend is registered through the
``torch_dynamo_backends`` entry point (``pyproject.toml``), so ``backend="cgraw"`` works without
``import cgraw``. Inductor compiles each dynamo graph (forward, and through AOT autograd the
backward) with its own CUDA graphs off and graph partition on. An inference graph that Inductor
keeps in one partition with nothing around it is one ``cgraw.graphed`` function as a whole
(``<name> inference/whole graph`` in ``cgraw.report()``; ``interop.torch.whole_graph``); otherwise
each partition it cuts is a ``cgraw.graphed`` function of the calling thread's tree, named
``<name> <phase>/partition <i> of <n>``. What is not graphed (an op Inductor cuts out, a
partition left out by ``options``, a compile that fell back to Inductor) runs as Inductor
compiled it, and ``report()`` says why. The torch side is
``interop.torch.partitions``; this module holds the decisions: options, names, fallback.

Options (``torch.compile(m, backend="cgraw", options={...})``):

- ``"name"``: the name of the compiled code in ``report()`` (default ``compiled <frame id>``);
- ``"partitions"``: ``"all"`` (default) or the indices of the partitions to graph (others run
  as Inductor compiled them);
- ``"fallback"``: ``"inductor"`` (default: a failure of cgraw's part of a compile falls back to
  Inductor without graphs, with the reason in ``report()``) or ``"raise"``;
- ``"inductor"``: a dict of ``torch._inductor.config`` settings for the compile (the backend
  keeps ``triton.cudagraphs`` off and ``graph_partition`` on);
- ``"whole_graph"``: ``True`` (default) or ``False``: an inference graph whose one partition
  holds every op (``whole_graph.reason``) is one graphed function as a whole, so a call runs none
  of AOT autograd's or Inductor's Python around the partition; with ``False``, or for any other
  graph (training, cut by Inductor, dynamic sizes), the partitions are graphed.
"""

from __future__ import annotations

import itertools
import logging
import threading

from cgraw.trees.graphed import graphed, note_without_graphs, tree_here

OPTIONS = ("name", "partitions", "fallback", "inductor", "whole_graph")
FALLBACKS = ("inductor", "raise")
_frames = itertools.count()
log = logging.getLogger("cgraw")
_lock = threading.Lock()


class Options:
    """The backend's ``options=``, checked."""

    __slots__ = ("name", "partitions", "fallback", "inductor", "whole_graph")

    def __init__(self, name=None, partitions="all", fallback="inductor", inductor=None, whole_graph=True):
        self.name = name
        self.partitions = partitions
        self.fallback = fallback
        self.inductor = inductor
        self.whole_graph = whole_graph

    @classmethod
    def parse(cls, options) -> "Options":
        """``options`` (None or a dict) as ``Options``; ``ValueError`` naming what is wrong."""
        if options is None:
            return cls()
        if not isinstance(options, dict):
            raise ValueError(f"backend='cgraw' takes options as a dict, not {type(options).__name__}")
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"backend='cgraw' has no option(s) {unknown}; its options are {list(OPTIONS)}")
        name = options.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"options['name'] must be a non-empty str, not {name!r}")
        parts = options.get("partitions", "all")
        if parts != "all":
            if isinstance(parts, (str, bytes)) or not hasattr(parts, "__iter__"):
                raise ValueError(f"options['partitions'] must be 'all' or partition indices, not {parts!r}")
            parts = frozenset(parts)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in parts):
                raise ValueError(f"options['partitions'] must hold non-negative ints, not {sorted(parts, key=str)}")
        fallback = options.get("fallback", "inductor")
        if fallback not in FALLBACKS:
            raise ValueError(f"options['fallback'] must be one of {list(FALLBACKS)}, not {fallback!r}")
        inductor = options.get("inductor")
        if inductor is not None and not (isinstance(inductor, dict) and all(isinstance(k, str) for k in inductor)):
            raise ValueError("options['inductor'] must be a dict of torch._inductor.config settings")
        whole = options.get("whole_graph", True)
        if not isinstance(whole, bool):
            raise ValueError(f"options['whole_graph'] must be True or False, not {whole!r}")
        return cls(name, parts, fallback, dict(inductor) if inductor else None, whole)

    def select(self, index: int) -> str | None:
        """Why partition ``index`` is not graphed, or None when it is."""
        if self.partitions == "all" or index in self.partitions:
            return None
        return f"left out by options['partitions'] ({sorted(self.partitions)})"


def label(options: Options, frame_id: str | None) -> str:
    """The name of one compiled dynamo graph in ``report()``."""
    base = options.name or "compiled"
    if frame_id:
        return f"{base} [{frame_id}]"
    with _lock:
        n = next(_frames)
    return f"{base} [{n}]"


def runtime():
    """cgraw's side of the backend for ``interop.torch.partitions``."""
    from cgraw.interop.torch.partitions import Runtime

    return Runtime(graphed_compiled, tree_here, note_without_graphs)


def graphed_compiled(fn):
    """``graphed(fn)`` for code Inductor compiled: the settings it fixed when it compiled
    (``kernel_state.COMPILED``: the attention backend, lowered to one backend's op) are not part of
    its calls' keys, as they do not change what its code runs."""
    from cgraw.interop.torch.kernel_state import COMPILED

    gf = graphed(fn)
    gf.compiled_groups = COMPILED
    return gf


def cgraw_backend(gm, example_inputs, *, options=None, mode=None):
    """The ``torch.compile`` backend ``"cgraw"`` (dynamo calls it once per graph it captures)."""
    from cgraw.interop.torch import partitions as torch_compile
    from cgraw.interop.torch import whole_graph

    opts = Options.parse(options)
    name = label(opts, _frame_id())
    rt = runtime()
    try:
        torch_compile.check()
        patches = torch_compile.config_patches(opts.inductor, mode)
        wrapping = torch_compile.Wrapping(name, rt, opts.select, whole=opts.whole_graph and opts.partitions == "all")
    except Exception as exc:  # noqa: BLE001 -- an unsupported torch: Inductor without graphs
        return _fall_back(opts, name, exc, gm, example_inputs)
    compiled = torch_compile.compile_graph(gm, example_inputs, wrapping, patches)
    if wrapping.whole:
        why = whole_graph.reason(wrapping, patches, example_inputs)
        if why is None:
            return whole_graph.graphed_whole(compiled, example_inputs, rt, f"{name} inference/whole graph")
        log.info("cgraw: %s is graphed by partitions, not as a whole: %s", name, why)
    if wrapping.seen == 0:
        note_without_graphs(name, "Inductor made no partition that can be graphed (every op runs where graphs "
                                  "cannot, or the graph holds no GPU kernel)")
    return compiled


def _fall_back(opts: Options, name: str, exc: BaseException, gm, example_inputs):
    if opts.fallback == "raise":
        raise exc
    from cgraw.interop.torch import partitions as torch_compile

    note_without_graphs(name, f"compiled by Inductor without graphs: {type(exc).__name__}: {exc}")
    return torch_compile.plain_compile(gm, example_inputs, opts.inductor)


def _frame_id() -> str | None:
    """dynamo's id of the frame being compiled (``0/0``), where torch tells it."""
    import sys

    guards = sys.modules.get("torch._guards")
    ctx = getattr(guards, "CompileContext", None)
    try:
        cid = ctx.current_compile_id() if ctx is not None else None
    except Exception:  # noqa: BLE001 -- only a name
        return None
    return None if cid is None else str(cid)


__all__ = ["FALLBACKS", "OPTIONS", "Options", "cgraw_backend", "label", "runtime"]
