"""What graphing a whole compiled graph gains on the Llama decode step: the backend's host time per
token graphed whole against the same backend by partitions and a graph over Inductor's whole
compiled callable.

By partitions (``torch.compile(backend="cgraw", options={"whole_graph": False})``,
``backend_partitions``), every token still runs dynamo's guards, AOT autograd's runtime wrapper
and Inductor's Python ``call`` around the partition. Where Inductor makes one partition and
nothing runs outside it (an inference graph), the backend graphs the compiled callable as a whole
by default (``cgraw_backend``): dynamo's guards, then a replay. Beside it, ``whole_graph``: a
dynamo backend that compiles with Inductor (no partition wrapper, no CUDA graphs) and returns
``cgraw.graphed`` over the compiled callable, its inputs guarded by dynamo and the graph's
parameters and marked static inputs (transformers' ``StaticCache``) read in place. A diagnostic,
not a test: it checks the tokens against eager's and prints per-token host times, the systems
timed in turns (one 64-token decode each per round).
``backend_fixed_token`` is ``cgraw_backend`` fed its token from one tensor (each step's token
copied into it) rather than a clone at a new address, so only one of its graph's copy nodes is
re-pointed per token. Two floors are timed beside them: ``dynamo_floor``, a backend whose graph returns fixed outputs
(dynamo's guards and input gathering alone), and ``loop_floor``, the decode loop with no model.
"host alone" is the best of three decodes timed while a sleep kernel holds the GPU behind: the
host's own time per token, which a system bound by its kernels hides in the first figure. "device
alone" is the GPU's time per token in the same decodes (CUDA events from the sleep's end to the
decode's last work, all of it queued behind the sleep and run back to back): where the first
figure exceeds both, the host waits for the GPU inside a call.

``--split SYSTEM`` times the parts of cgraw's call in three decodes of SYSTEM, the GPU held behind:
each part's inclusive time per token (``Split``: a ``perf_counter_ns`` wrapper around the callable,
whose own cost per wrapped call is printed beside), so the host's time per token divides into
dynamo's and the rest, cgraw's call: the prepared replay of a whole graph (its settings id, its
check of inputs sharing memory) or the generic path's classification, then the replay (its
staleness check, the nodes re-pointed at moved inputs, staging copies, the current stream, launch
and outputs).

``--prepared-ab N`` times the backend's decode as the benchmark calls it (each token fed back, no
clone) in N rounds, with its whole graph's prepared replay (``cgraw.trees.prepared``) on and off in
turns in one process: GPU free and host alone per token, and the median of the paired differences.

From the repository root, on a GPU: ``python3 -m tools.probes.whole_graph_probe [--rounds 7]
[--profile cgraw_backend] [--split cgraw_backend] [--split-free cgraw_backend] [--prepared-ab 30]``. ``--split-free``
times the same parts with the GPU free: a part that waits for the GPU (a driver call that blocks
until a launch in flight ends) takes longer there than in ``--split``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import time

# (label, module, attribute): cgraw's call, nested as the labels' indentation shows
SPLIT_PARTS = (
    ("graphed call", "cgraw.trees.graphed", "GraphedFunction.__call__"),
    ("  new step", "cgraw.trees.manager", "TreeManager._begin_step"),
    ("    ended step's outputs", "cgraw.trees.manager", "TreeManager._take_outputs"),
    ("    generation's end", "cgraw.trees.manager", "TreeManager._end_generation"),
    ("  fed-back outputs poisoned", "cgraw.trees.cuda_backend", "CudaBackend.end_generation"),
    ("  prepared replay", "cgraw.trees.manager", "TreeManager._replay_prepared"),
    ("    settings id", "cgraw.trees.manager", "guarded_tail"),
    ("    inputs sharing memory", "cgraw.trees.manager", "shares_memory"),
    ("    call made", "cgraw.trees.manager", "call_of"),
    ("    path moves on", "cgraw.trees.manager", "TreeManager._replayed"),
    ("  manager call", "cgraw.trees.manager", "TreeManager._call"),
    ("    classify and key", "cgraw.trees.calls", "_inspect_guarded"),
    ("    replay", "cgraw.trees.recording", "Recording.replay"),
    ("      stale check", "cgraw.trees.recording", "Recording.stale"),
    ("      copy node re-point", "cgraw._cuda.graphs", "MemcpyNodeSetter.__call__"),
    ("      input re-point", "cgraw.trees.recording", "InputRebind.patch"),
    ("      staged buffer", "cgraw.trees.recording", "InputRebind.staging"),
    ("      context check", "cgraw._cuda", "ctx_get_current"),
    ("      staging copy", "cgraw._cuda", "memcpy_dtod_async"),
    ("      copies back", "cgraw.trees.cuda_backend", "_copy_on"),
    ("      current stream", "cgraw.runtime.stream", "current_getter"),
    ("      launch", "cgraw.trees.recording", "_launch"),
    ("      outputs", "cgraw.trees.recording", "Recording._outputs"),
    ("      outputs handed out again", "cgraw.trees.outputs", "Reuse.take"),
)


def _timed(label, f, ns: dict, calls: dict):
    """``f`` adding its inclusive ``perf_counter_ns`` time to ``ns[label]`` and a call to ``calls[label]``."""
    clock = time.perf_counter_ns

    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return f(*args, **kwargs)
        finally:
            ns[label] += clock() - t0
            calls[label] += 1

    return timed


class Split:
    """While active, the inclusive ``perf_counter_ns`` time and the number of calls of each
    ``(label, module, attribute)`` of ``parts`` (``attribute``: a module's function, or
    ``Class.method``), the originals put back on exit. ``overhead_ns``: one wrapped call's own cost."""

    def __init__(self, parts):
        self.parts = parts
        self.ns = dict.fromkeys((label for label, _, _ in parts), 0)
        self.calls = dict.fromkeys(self.ns, 0)
        self._saved = []
        self.overhead_ns = _overhead()

    def __enter__(self):
        for label, module, attr in self.parts:
            owner = importlib.import_module(module)
            cls, _, name = attr.rpartition(".")
            if cls:
                owner = getattr(owner, cls)
            # a class's own or inherited function, unbound; a module's function as it is
            original = inspect.getattr_static(owner, name) if cls else getattr(owner, name)
            self._saved.append((owner, name, original, not cls or name in owner.__dict__))
            setattr(owner, name, _timed(label, original, self.ns, self.calls))
        return self

    def __exit__(self, *exc):
        for owner, name, original, own in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # inherited: the base's function shows through again
        self._saved.clear()
        return False


def _overhead(n: int = 20000) -> float:
    """A wrapped call's own cost in ns: a wrapped empty function against the bare one."""
    def empty():
        return None

    timed = _timed("x", empty, {"x": 0}, {"x": 0})
    t0 = time.perf_counter_ns()
    for _ in range(n):
        timed()
    t1 = time.perf_counter_ns()
    for _ in range(n):
        empty()
    return max(0.0, ((t1 - t0) - (time.perf_counter_ns() - t1)) / n)


def whole_graph_backend(gm, example_inputs):
    """A dynamo backend: Inductor's compiled callable as one graphed function."""
    import torch
    from torch._inductor.compile_fx import compile_fx

    import cgraw

    compiled = compile_fx(gm, example_inputs)

    def whole(*args):
        return compiled(*args)

    whole.__qualname__ = whole.__name__ = "whole graph"
    g = cgraw.graphed(whole)
    g.inputs_guarded = True  # dynamo guards every graph input's dtype, device, sizes and strides
    g.static_positions = tuple(i for i, t in enumerate(example_inputs)
                               if isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None))
    return g


def floor_backend(gm, example_inputs):
    """A dynamo backend whose compiled graph runs once and then returns the same outputs: what is
    left of a call is dynamo's part (its guards, the prologue that gathers the graph's inputs), the
    floor of any backend's host time. Its tokens are wrong after the first step; it is timed only."""
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(gm, example_inputs)
    memo = []

    def floor(*args):
        if not memo:
            memo.append(compiled(*args))
        return memo[0]

    return floor


def _systems(wl, cache):
    import torch

    from benchmarks import models

    def cloned(inner):
        return lambda tok, pos: inner(tok, pos).clone()

    out = {}
    for name in ("reduce_overhead", "cgraw_backend", "cgraw_over_compile"):
        call, _ = models._make_call(name, wl.step, (cache,))
        out[name] = cloned(call) if name in ("reduce_overhead", "cgraw_backend") else call
        if name == "cgraw_backend":
            out[name].fed_back = call  # as benchmarks.models calls it (--prepared-ab)
            out["backend_fixed_token"] = _fixed_token(call)
    compiled = torch.compile(wl.step, backend=whole_graph_backend, dynamic=False)
    out["whole_graph"] = cloned(lambda tok, pos: compiled(tok, pos, cache))
    by_parts = torch.compile(wl.step, backend="cgraw", dynamic=False,
                             options={"name": "parts", "whole_graph": False})
    out["backend_partitions"] = cloned(lambda tok, pos: by_parts(tok, pos, cache))
    floor = torch.compile(wl.step, backend=floor_backend, dynamic=False)
    out["dynamo_floor"] = cloned(lambda tok, pos: floor(tok, pos, cache))
    out["loop_floor"] = cloned(lambda tok, pos: tok)  # the decode loop and the clone alone
    return out


def _fixed_token(call):
    """``call`` fed its token from one tensor that each step's token is copied into, where the other
    systems clone it (a new address every other token): the graph's copy node for the token is then
    never re-pointed, only the window of the positions moves."""
    buf = []

    def step(tok, pos):
        if not buf:
            buf.append(tok.clone())
        elif tok is not buf[0]:
            buf[0].copy_(tok)  # the prefill's token
        return buf[0].copy_(call(buf[0], pos))

    return step


TIMED_ONLY = ("dynamo_floor", "loop_floor")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.probes.whole_graph_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", default=None, metavar="SYSTEM",
                    help="after the timings, cProfile three decodes of SYSTEM (the GPU held behind) and "
                         "print the 30 functions with the most time of their own")
    ap.add_argument("--split", default=None, metavar="SYSTEM",
                    help="after the timings, the parts of cgraw's call per token in three decodes of SYSTEM "
                         "(the GPU held behind)")
    ap.add_argument("--split-free", default=None, metavar="SYSTEM",
                    help="the same split with the GPU free: a part that waits for the GPU shows its wait")
    ap.add_argument("--prepared-ab", type=int, default=0, metavar="N",
                    help="after the timings, N rounds of the backend's decode with its prepared replay on and off")
    args = ap.parse_args(argv)
    import torch

    import cgraw
    from benchmarks import models

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    wl = models._build("llama_decode")
    ref = wl.reference_tokens()
    cache = wl.new_cache()
    systems = _systems(wl, cache)
    for name, call in systems.items():  # compile, warm up, record; then the tokens against eager's
        for _ in range(3):
            got = models._decode(call, wl.prefill(cache), wl.positions, collect=True)
        d = models._first_divergence(got, ref)
        if name in TIMED_ONLY:
            print(f"{name}: timed only (returns a fixed token)", flush=True)
            continue
        print(f"{name}: tokens {'equal eager' if d is None else f'differ from eager from token {d}'}", flush=True)
    times: dict = {name: [] for name in systems}
    order = list(systems)
    for _ in range(args.rounds):
        for name in order:
            tok = wl.prefill(cache)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            models._decode(systems[name], tok, wl.positions, collect=False)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / len(wl.positions) * 1e6)
        order.reverse()
    held: dict = {name: [] for name in systems}
    queued: dict = {name: [] for name in systems}
    for _ in range(3):  # the host's own time: the GPU held behind by a sleep kernel, no token waits for it
        for name in order:
            tok = wl.prefill(cache)
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()  # fires when the sleep ends: the decode's work then runs back to back
            t0 = time.perf_counter()
            models._decode(systems[name], tok, wl.positions, collect=False)
            held[name].append((time.perf_counter() - t0) / len(wl.positions) * 1e6)
            end.record()
            torch.cuda.synchronize()
            queued[name].append(start.elapsed_time(end) * 1e3 / len(wl.positions))
        order.reverse()
    for name, ts in times.items():
        print(f"{name:20s} {statistics.median(ts):8.1f} us per token (min {min(ts):.1f}, max {max(ts):.1f}); "
              f"host alone {min(held[name]):.1f}; device alone {min(queued[name]):.1f}")
    if args.profile:
        _profile(systems[args.profile], wl, cache)
    if args.split:
        _split(systems[args.split], wl, cache)
    if args.split_free:
        _split(systems[args.split_free], wl, cache, hold=False)
    if args.prepared_ab:
        _prepared_ab(systems["cgraw_backend"].fed_back, wl, cache, args.prepared_ab)
    print(cgraw.report())
    return 0


def _profile(call, wl, cache) -> None:
    """cProfile of three decodes by ``call``, the GPU held behind by a sleep kernel (host time only)."""
    import cProfile
    import io
    import pstats

    import torch

    from benchmarks import models

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    prof.enable()
    for _ in range(3):
        models._decode(call, wl.prefill(cache), wl.positions, collect=False)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def _split(call, wl, cache, hold: bool = True) -> None:
    """``Split`` of three decodes by ``call``, the GPU held behind by a sleep kernel (``hold``: the
    host's own time) or free (a part that waits for the GPU then shows its wait): the host time per
    token, and each part's inclusive time and calls per token."""
    import torch

    from benchmarks import models

    tokens, total, drained = 3 * len(wl.positions), 0, 0
    labels = [label for label, _, _ in SPLIT_PARTS]
    ns, calls = dict.fromkeys(labels, 0), dict.fromkeys(labels, 0)
    with Split(SPLIT_PARTS) as split:
        for _ in range(3):
            tok = wl.prefill(cache)  # eager: outside the counts
            torch.cuda.synchronize()
            ns0, calls0 = dict(split.ns), dict(split.calls)
            if hold:
                torch.cuda._sleep(1_000_000_000)
            t0 = time.perf_counter_ns()
            models._decode(call, tok, wl.positions, collect=False)
            total += time.perf_counter_ns() - t0
            for label in ns:
                ns[label] += split.ns[label] - ns0[label]
                calls[label] += split.calls[label] - calls0[label]
            torch.cuda.synchronize()
            drained += time.perf_counter_ns() - t0
    how = "host alone" if hold else f"the GPU free ({drained / tokens / 1e3:.1f} us with the last synchronise)"
    print(f"split: {total / tokens / 1e3:.1f} us per token, {how}, with the wrappers "
          f"({split.overhead_ns / 1e3:.2f} us per wrapped call)")
    for label in ns:
        print(f"  {label:24s} {ns[label] / tokens / 1e3:8.2f} us per token, {calls[label] / tokens:.2f} calls")

def _prepared_ab(call, wl, cache, rounds: int) -> None:
    """The backend's decode by ``call``, as ``benchmarks.models`` calls it (each token fed back), its
    whole graph's prepared replay on and off in turns (``Prepared.usable``): per token, GPU free and
    host alone."""
    import torch

    from benchmarks import models
    from cgraw.trees.graphed import tree_here

    for _ in range(3):
        models._decode(call, wl.prefill(cache), wl.positions, collect=False)
    mgr = tree_here(torch.cuda.current_device())
    preps = [p for p in mgr.prepared.values() if p.usable and p.fn.name.startswith(models.BACKEND_NAME)]
    if len(preps) != 1:
        print(f"prepared-ab: {len(preps)} usable prepared replays of the backend's graph, not one; "
              f"{[(p.fn.name, p.why) for p in mgr.prepared.values()]}")
        return
    (prep,) = preps
    free: dict = {True: [], False: []}
    held: dict = {True: [], False: []}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            prep.usable = on
            for hold, out in ((False, free), (True, held)):
                tok = wl.prefill(cache)
                torch.cuda.synchronize()
                if hold:
                    torch.cuda._sleep(300_000_000)
                t0 = time.perf_counter()
                models._decode(call, tok, wl.positions, collect=False)
                out[on].append((time.perf_counter() - t0) / len(wl.positions) * 1e6)
                torch.cuda.synchronize()
    prep.usable = True
    ok = models._decode(call, wl.prefill(cache), wl.positions, collect=True) == wl.reference_tokens()
    for on in (True, False):
        print(f"prepared replay {'on ' if on else 'off'}: GPU free {statistics.median(free[on]):.1f} us per token "
              f"(min {min(free[on]):.1f}); host alone {statistics.median(held[on]):.1f} (min {min(held[on]):.1f})")
    diff = statistics.median(a - b for a, b in zip(held[True], held[False]))
    print(f"prepared replay, host alone, on minus off (median of {rounds} pairs): {diff:+.1f} us per token; "
          f"tokens {'equal eager' if ok else 'differ from eager'}")


if __name__ == "__main__":
    raise SystemExit(main())
