"""Zero-copy eager inputs of graph trees: plan at record time, prove at the first replay.

Layer L8 (beside ``cuda_backend``, which calls it): uses ``_cuda``, ``rebind`` (the pure scan),
``rebind.ranges`` (the device ranges a graph reaches) and ``recording``; no framework import.

A recording copies each contiguous eager input into a placeholder by a memcpy node
(``recording.InputCopy``). ``plan`` reads every node of the captured graph and finds the
kernel-argument words and 1-D memcpy addresses that point into a placeholder (``rebind.scan``);
``prove`` then decides, on the recording's first call, whether those words are *all* of the
ways the graph reaches the input, by running the call twice:

1. every device range the graph's nodes point at (kernel-argument words, memcpy and memset
   addresses, and one level of pointer tables found in small ranges) is saved; the graph is
   replayed as recorded (copies on) and the ranges' contents after it are kept;
2. the ranges are put back, the input copies are disabled (``cuGraphNodeSetEnabled``), the words
   rewritten to the caller's addresses, the placeholders poisoned (0xFF bytes, NaN, for floating
   inputs; zeros for integer ones, which cannot send an index out of bounds), and the graph
   replayed again; its ranges' contents must equal the first replay's, byte for byte.

The generator records a graph that draws random numbers reads are among those ranges, and the
host's side of its generators (torch's offset, CuPy's ``_rk_seed``, the records' mirror,
``rng.plan.GraphRng.save``) is put back with them: the second replay draws what the first drew, and
the generators move once. The proof holds ``rng.plan.STEP`` meanwhile, so no other thread's replay
starts from a generator state that is put back.

An input that was memory of the tree's pool when the graph was recorded (an earlier call's output
fed back, as a decoded token is) keeps its copy without a proof: read in place, every replay would
first stage it into a copy by a driver call of its own (the graph may write that memory), where
its copy node, which runs before any other node of the graph, costs no driver call while the input
stays at one address. So does a small read-only input that views its block at an offset (a window
such as ``positions[i:i+1]``): the next window is a few bytes further, less aligned than the
recording's, and would be staged the same way; its copy node is re-pointed by one driver call.

Equal: the inputs are read in place from now on (``recording.InputRebind``) and their
placeholders are freed. Different (a read the scan did not see, a non-deterministic kernel):
the ranges are put back once more, the graph is restored as recorded and replayed with its
copies; the inputs keep them, with the reason in ``report()``. So the call runs once as far as
anything outside the graph can tell, whatever the outcome. Inputs read through a pointer table
in device memory, written by a memset node, or whose graph holds a host node or packed kernel
arguments keep their copies without a proof. A graph whose ranges exceed ``SNAPSHOT_LIMIT`` (or
a quarter of the free device memory) is not proven: its inputs keep their copies.

An input the function writes is recorded with a copy back (the warm-up saw the write, or the
function declares it in ``mutates``). A write no warm-up can see, of the values the input held,
into an array without a version counter (``cupy.maximum(x, 0, out=x)`` on non-negative values)
stays in the copy where the input keeps one: ``mutates=`` declares it.
"""

from __future__ import annotations

import ctypes
import logging

from cgraw import _cuda
from cgraw._cuda import defer
from cgraw.rebind import ranges as _mem
from cgraw.runtime import stream as _streams
from cgraw._cuda import kernels as _k
from cgraw.errors import CudaError
from cgraw.rebind.scan import WORD, Placeholder, Plan, scan
from cgraw.trees.recording import InputRebind
from cgraw.rng.plan import STEP

log = logging.getLogger("cgraw")

SNAPSHOT_LIMIT = 1 << 30  # bytes of device ranges one proof may save (three copies are made)
BIG_INPUT = 1 << 20  # an input this large is read in place however many nodes read it (its copy costs device time)
WINDOW_INPUT = 64 << 10  # a read-only view at an offset into its block, smaller than this, keeps its copy
OFF = "cgraw.config.rebind_inputs is False"
PADDED = "a padded input (padding bucket): its copy node also sets the rows of this call"
DIFFER = ("a replay reading it in place did not equal the replay with its copy (a read cgraw's "
          "argument scan cannot see, or kernels whose results vary run to run)")
POINTER_TABLE = "it is read through a pointer table in device memory, which cgraw does not rewrite"
MEMSET = "a memset node writes into it (cgraw re-points kernel arguments and 1-D copies only)"
COPY_SHAPE = "a 2-D or 3-D copy node reads or writes it (cgraw re-points 1-D copies only)"
TWO_INPUTS = "one copy node moves data between two eager inputs (cgraw re-points one end only)"
FED_BACK = ("it was memory of the tree's pool when the graph was recorded (an earlier call's output fed "
            "back, as a decoded token is): its copy node reads it before any node of the graph runs, with "
            "no driver call while it stays at one address, where read in place it would be staged into a "
            "copy by a driver call before every launch (the graph may write that memory)")
WINDOW = ("it views its block at an offset (a slice such as positions[i:i+1]), and such a window moves by "
          "less than the 256-byte alignment the graph's kernels were recorded for: read in place, every such "
          "call would stage it into a copy by a driver call before the launch, where its copy node takes one "
          "re-point (read-only views of 64 KiB or more are read in place)")

_ALLOWED_TYPES = ("CU_GRAPH_NODE_TYPE_KERNEL", "CU_GRAPH_NODE_TYPE_MEMCPY", "CU_GRAPH_NODE_TYPE_MEMSET",
                  "CU_GRAPH_NODE_TYPE_EMPTY", "CU_GRAPH_NODE_TYPE_WAIT_EVENT",
                  "CU_GRAPH_NODE_TYPE_EVENT_RECORD")

DIFFER_SRC = r"""
extern "C" __global__ void cgraw_rebind_differ(const unsigned long long* a, const unsigned long long* b,
                                               unsigned long long n, unsigned int* flag) {
  unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    if (a[i] != b[i]) { *flag = 1u; return; }
  }
}
"""
DIFFER_NAME = "cgraw_rebind_differ"
_DIFFER_TYPES = (_k.ARG_PTR, _k.ARG_PTR, _k.ARG_U64, _k.ARG_PTR)


class Pending:
    """What ``prove`` needs, made by ``plan``: the graph's kernel arguments and copy addresses,
    and per candidate input its ``InputRebind`` (words into ``KernelArgs`` buffers)."""

    __slots__ = ("rebinds", "placeholders", "values", "copy_nodes")

    def __init__(self, rebinds: list, placeholders: dict, values: set, copy_nodes: dict):
        self.rebinds = rebinds  # [InputRebind]
        self.placeholders = placeholders  # leaf -> (placeholder array, base, nbytes)
        self.values = values  # every 8-byte word and copy address of the graph (device pointers or not)
        self.copy_nodes = copy_nodes  # leaf -> [InputCopy] (its copy in, and back when mutated)


def plan(rec, g, call, placeholders: dict, config, fed_back=()) -> None:
    """Fill ``rec.input_notes`` and, when an input may be read in place, ``rec.proof``. The leaves
    ``fed_back`` were memory of the tree's pool at the recording, and small read-only inputs that
    view their block at an offset are windows that move by less than the kernels' alignment: both
    keep their copies."""
    copies_in = [c for c in rec.copies if not c.back]
    notes = rec.input_notes = {c.leaf: None for c in copies_in}
    for leaf in fed_back:
        if leaf in notes:
            notes[leaf] = FED_BACK
    written = {c.leaf for c in rec.copies if c.back}
    for c in copies_in:
        j = c.leaf
        if notes[j] is None and j not in written and c.count < WINDOW_INPUT:
            o, t = call.ops[j], call.leaves[j]
            if o.ptr(t) != o.base_ptr(t):
                notes[j] = WINDOW
    if not any(why is None for why in notes.values()):
        return
    if not config.rebind_inputs:
        _all(notes, OFF)
        return
    if call.bucket is not None:
        _all(notes, PADDED)
        return
    copy_handles = {_cuda.native(c.node) for c in rec.copies}
    T = _cuda.NodeType
    allowed = {int(getattr(T, n)) for n in _ALLOWED_TYPES if hasattr(T, n)}
    kernel_t, memcpy_t, memset_t = (int(T.CU_GRAPH_NODE_TYPE_KERNEL), int(T.CU_GRAPH_NODE_TYPE_MEMCPY),
                                    int(T.CU_GRAPH_NODE_TYPE_MEMSET))
    kernels, kargs, memcpys = [], {}, {}
    fixed: list[tuple[int, str, int]] = []  # addresses that cannot be re-pointed: memsets, 2-D/3-D copies
    fixed_why: dict[int, str] = {}
    values: set[int] = set()
    for i, nd in enumerate(g.node_handles()):
        t = int(_cuda.graph_node_get_type(nd))
        if t not in allowed:
            _all(notes, f"the graph holds a {_type_name(t)} node, which cgraw's proof replay would run twice")
            return
        if t == kernel_t:
            p, args = _cuda.graph_kernel_node_args(nd)
            if args is None:
                _all(notes, "a kernel of the graph takes its arguments packed ('extra'), which cgraw cannot read")
                return
            kernels.append((i, args))
            kargs[i] = (nd, p, args)
            for _, blob in args:
                for off in range(0, len(blob) - WORD + 1, WORD):
                    values.add(int.from_bytes(blob[off:off + WORD], "little"))
        elif t == memcpy_t:
            ext = _cuda.graph_memcpy_node_extent(nd)
            if ext is None:
                dst, src = _cuda.graph_memcpy_node_dst_src(nd)
                fixed += [(i, "dst", dst), (i, "src", src)]
                fixed_why[i] = COPY_SHAPE
                values.update((dst, src))
                continue
            values.update(ext[:2])
            if _cuda.native(nd) not in copy_handles:
                memcpys[i] = (nd, *ext)
        elif t == memset_t:
            dst, _n = _cuda.graph_memset_node_extent(nd)
            fixed.append((i, "dst", dst))
            fixed_why[i] = MEMSET
            values.add(dst)
    ph_info = {}
    for c in copies_in:
        ph = placeholders[c.leaf]
        ph_info[c.leaf] = (ph, c.fixed, c.count)
    phs = [Placeholder(leaf, base, n) for leaf, (_, base, n) in ph_info.items()]
    copy_refs = [(i, f, a) for i, (_, dst, src, _n) in memcpys.items() for f, a in (("dst", dst), ("src", src))]
    words, refs = scan(kernels, phs, copy_refs)
    for r in scan([], phs, fixed)[1]:
        notes[r.leaf] = fixed_why[r.node]
    by_node: dict[int, set] = {}
    for r in refs:
        by_node.setdefault(r.node, set()).add(r.leaf)
    for leaves in by_node.values():
        if len(leaves) > 1:
            for leaf in leaves:
                notes[leaf] = TWO_INPUTS
    cands = [leaf for leaf, why in notes.items() if why is None]
    if not cands:
        return
    pl = Plan(words, refs).restricted(cands)
    n_copies: dict = {}
    for c in rec.copies:
        n_copies[c.leaf] = n_copies.get(c.leaf, 0) + 1
    for leaf in cands:
        why = dearer(len(pl.nodes_of(leaf)) + sum(1 for r in pl.refs if r.leaf == leaf), n_copies[leaf],
                     ph_info[leaf][2], config.rebind_node_margin)
        if why is not None:
            notes[leaf] = why
    cands = [leaf for leaf in cands if notes[leaf] is None]
    if not cands:
        return
    pl = pl.restricted(cands)
    kas = {}
    for i in pl.by_node:
        nd, p, args = kargs[i]
        kas[i] = _cuda.KernelArgs(rec.exec_, nd, p, [a for _, a in args])
    rebinds = []
    for leaf in cands:
        base = ph_info[leaf][1]
        ws = [(kas[w.node].word(w.param, w.offset), w.delta) for w in pl.words if w.leaf == leaf]
        ks = list({id(kas[w.node]): kas[w.node] for w in pl.words if w.leaf == leaf}.values())
        ms = []
        for r in pl.refs:
            if r.leaf != leaf:
                continue
            nd, dst, src, n = memcpys[r.node]
            rt = _cuda.rt_node_handle(nd)
            ms.append((rt, r.delta, None, dst, src, n) if r.field == "dst" else (rt, None, r.delta, dst, src, n))
        rebinds.append(InputRebind(leaf, base, ws, ks, ms, back=leaf in written))
    copy_nodes = {leaf: [c for c in rec.copies if c.leaf == leaf] for leaf in cands}
    rec.proof = Pending(rebinds, {leaf: ph_info[leaf] for leaf in cands}, values, copy_nodes)


def dearer(n_nodes: int, n_copies: int, nbytes: int, margin: int) -> str | None:
    """Why an input of ``nbytes`` read by ``n_nodes`` graph nodes keeps its ``n_copies`` copy nodes
    (its copy in, and back when the function writes it), or None when it is read in place. A moved
    input costs one driver call per node to re-point (about 1 us on the H200), one per copy node
    to update its copy: re-pointing is chosen when it touches at most ``margin`` nodes more than
    the copy (``cgraw.config.rebind_node_margin``), or when the input is ``BIG_INPUT`` or larger,
    whose copy costs the device a full read and write."""
    if n_nodes <= n_copies + margin or nbytes >= BIG_INPUT:
        return None
    size = f"{nbytes} bytes" if nbytes < 1024 else f"{nbytes / 1024:.0f} KiB"
    return (f"read by {n_nodes} graph nodes: re-pointing them when it moves (a driver call each) costs more "
            f"than updating its {n_copies} copy node(s) for its {size} (inputs of 1 MiB or more "
            "are read in place whatever the count; cgraw.config.rebind_node_margin allows more nodes)")


def _all(notes: dict, why: str) -> None:
    for leaf in notes:
        notes[leaf] = why


def _type_name(t: int) -> str:
    try:
        return _cuda.NodeType(t).name.replace("CU_GRAPH_NODE_TYPE_", "").lower()
    except Exception:  # noqa: BLE001
        return str(t)


# ---------------------------------------------------------------------- the proof


def prove(backend, rec, call):
    """The recording's first call: decide which inputs are read in place (see the module's
    docstring) and return the call's ``(outputs, owned outputs)`` from exactly one effective run.
    cgraw's own failures (reading the graph, allocating the saved copies, the driver refusing a
    rewritten node) keep the copies with the reason; a failure of the graph itself is raised."""
    pend, rec.proof = rec.proof, None
    notes = rec.input_notes
    stream = _cuda.stream_handle(_streams.current_getter(rec.ordinal))
    phs = {leaf: (base, n) for leaf, (_, base, n) in pend.placeholders.items()}
    try:
        _cuda.ctx_synchronize()  # every caller's work is done: the ranges hold what the call sees
        blocks = _mem.Blocks(backend.pool)
        cache: dict = {}
        ranges = _mem.ranges(pend.values, blocks, list(phs.values()), cache)
        hit, more = _mem.tables(_mem.merge(ranges), phs, blocks, cache)
        ranges = _mem.merge(ranges + more)
    except CudaError as exc:
        _note(notes, pend.rebinds, f"cgraw could not read what its graph points at ({exc.call}: {exc.name})")
        return rec.replay(call, first=True)
    for leaf in hit:
        notes[leaf] = POINTER_TABLE
    rebinds = [r for r in pend.rebinds if notes[r.leaf] is None]
    if not rebinds:
        return rec.replay(call, first=True)
    total = sum((n + WORD - 1) // WORD * WORD for _, n in ranges)
    size = max(total, WORD)
    free, _ = _cuda.mem_get_info()
    if total > min(SNAPSHOT_LIMIT, free // 4):
        _note(notes, rebinds, f"the memory its graph reaches ({total / (1 << 20):.0f} MiB) is more than cgraw "
                              "saves to prove that reading inputs in place is safe")
        return rec.replay(call, first=True)
    bufs: list[int] = []
    held = False
    try:
        try:
            saved, after_a, after_b, flag = (_alloc(bufs, size), _alloc(bufs, size), _alloc(bufs, size),
                                             _alloc(bufs, WORD))
            for b in (saved, after_a, after_b, flag):
                _k.memset_d8_async(b, 0, size if b != flag else WORD, stream)
            _pack(ranges, saved, stream, out=True)
        except CudaError as exc:
            _note(notes, rebinds, f"cgraw could not save what its graph reaches ({exc.call}: {exc.name})")
            return rec.replay(call, first=True)
        gens = None if rec.rng_sync is None else rec.graph.rng  # its generators (rng.plan.GraphRng)
        if gens is not None:  # other threads' replays wait: the generators go back between the replays
            STEP.acquire()
            held = True
            generators = gens.save()
        rec.replay(call, first=True)  # A: as recorded, with the copies
        _pack(ranges, after_a, stream, out=True)
        _pack(ranges, saved, stream, out=False)
        if gens is not None:
            gens.restore(generators)
        try:
            _switch(rec, pend, rebinds, on=True)
            for r in rebinds:
                base, n = phs[r.leaf]
                _k.memset_d8_async(base, _poison(pend.placeholders[r.leaf][0]), n, stream)
            result = rec.replay(call, first=True)  # B: reading the caller's inputs in place
            _pack(ranges, after_b, stream, out=True)
            why = None if _equal(rec.ordinal, after_a, after_b, total, flag, stream) else DIFFER
        except CudaError as exc:
            why = f"the driver refused a rewritten node ({exc.call}: {exc.name})"
        if why is None:
            _note(notes, rebinds, None)
            backend.drop_placeholders(rec, [pend.placeholders[r.leaf][0] for r in rebinds])
            return result
        log.info("cgraw: %s: inputs %s keep their copies: %s", rec.name, [r.leaf for r in rebinds], why)
        _pack(ranges, saved, stream, out=False)
        if gens is not None:
            gens.restore(generators)
        _switch(rec, pend, rebinds, on=False)
        _note(notes, rebinds, why)
        return rec.replay(call, first=True)  # as recorded: the call's one effective run
    except BaseException:
        if rec.rebinds:
            try:
                _switch(rec, pend, rebinds, on=False)
            except Exception:  # noqa: BLE001 -- the original error is the one to report
                pass
        _note(notes, [r for r in rebinds if notes.get(r.leaf) is None], "the proof replay failed")
        raise
    finally:
        if held:
            STEP.release()
        try:
            _cuda.stream_synchronize(stream)
        finally:
            for b in bufs:
                defer.release(_cuda.mem_free, b)


def _note(notes: dict, rebinds, why) -> None:
    for r in rebinds:
        notes[r.leaf] = why


def _poison(ph) -> int:
    """The byte a placeholder is filled with before the in-place replay: 0xFF (NaN) for floating
    and complex inputs; 0 for integers and bools, so that a read the scan missed cannot send an
    index out of bounds (a device assert would end the process)."""
    dt = getattr(ph, "dtype", None)
    if getattr(dt, "is_floating_point", False) or getattr(dt, "is_complex", False):
        return 0xFF
    return 0xFF if getattr(dt, "kind", "") in ("f", "c") else 0


def _alloc(bufs: list, n: int) -> int:
    p = _cuda.mem_alloc(n)
    bufs.append(p)
    return p


def _pack(ranges, buf: int, stream, *, out: bool) -> None:
    """Copy the ranges into ``buf`` (packed, 8-byte aligned), or back out of it."""
    off = 0
    for base, n in ranges:
        if out:
            _cuda.memcpy_dtod_async(buf + off, base, n, stream)
        else:
            _cuda.memcpy_dtod_async(base, buf + off, n, stream)
        off += (n + WORD - 1) // WORD * WORD


def _equal(ordinal: int, a: int, b: int, total: int, flag: int, stream) -> bool:
    func = _k.function(ordinal, DIFFER_NAME, lambda _name: DIFFER_SRC)
    n = max(total, WORD) // WORD
    grid = max(1, min(1024, (n + 255) // 256))
    _k.launch(func, grid, 256, (a, b, n, flag), _DIFFER_TYPES, stream)
    out = ctypes.c_uint32(0)
    _cuda.stream_synchronize(stream)
    _cuda.memcpy_dtoh(ctypes.addressof(out), flag, 4)
    return out.value == 0


def _switch(rec, pend: Pending, rebinds: list, *, on: bool) -> None:
    """Read ``rebinds``' inputs in place (their copy nodes disabled), or go back to the copies."""
    leaves = {r.leaf for r in rebinds}
    for leaf in leaves:
        for c in pend.copy_nodes[leaf]:
            _cuda.graph_exec_node_set_enabled(rec.exec_, c.node, not on)
    if on:
        rec.copies = [c for c in rec.copies if c.leaf not in leaves]
        rec.rebinds = list(rebinds)
        return
    for r in rec.rebinds:
        if r.ptr == r.base:
            continue
        for w, d in r.words:
            w.value = r.base + d
        for k in r.kernels:
            try:
                k()
            except CudaError:  # refused again: the node still holds what it held before the refusal
                log.debug("cgraw: %s: a kernel node refused its recorded arguments back", rec.name)
        for node, dd, sd, dst, src, n in r.memcpys:
            rec.setter(node, dst, src, n)
        r.ptr = r.base
    rec.rebinds = []
    kept = {id(c) for c in rec.copies}
    for leaf in leaves:
        rec.copies.extend(c for c in pend.copy_nodes[leaf] if id(c) not in kept)
    rec.copies.sort(key=lambda c: c.back)  # copies in before copies back, as recorded
