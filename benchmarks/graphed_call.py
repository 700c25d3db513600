"""Per-call host cost of a graphed function, against a hand-made torch.cuda.CUDAGraph with input
``copy_`` and against ``torch.compile(mode="reduce-overhead")`` (CUDAGraph Trees), same run.

Workload: ``k`` eager inputs of 4 KB (1,024 float32) and one output, ``out = x0*2 + x1 + ... ``.
Two input patterns: the same input tensors every call ("same": nothing to re-point), and two input
sets used alternately ("alternating": every eager input moves on every call, so the graph is
re-pointed at it: a copied input's memcpy node, or the kernel nodes that read a rebound one).
Also: time to first replay (warm-up + record + instantiate + replay) against one eager call; and,
for one input (k=1), the driver's floor on the same executable as a peer: a raw ``cuGraphLaunch``
("same") and the driver calls that re-point the graph at the other input plus a raw
``cuGraphLaunch`` ("alternating"), with the ratios of the hot path's targets.
Every system is checked against eager on both input sets before it is timed; one that differs is
recorded under ``failed_checks`` and not timed. The systems of one ``k`` are timed together in
interleaved rounds (41 rounds of 100-call bursts, shuffled order, a synchronise after each burst),
so that a drift of the machine's speed moves them alike; ratios are medians of per-round ratios.
The cost of each extra changed eager input (``extra_inputs``) is measured apart: graphed functions
of 1, 4 and 16 inputs timed in one set of interleaved rounds, the slope taken per round.

``python3 -m benchmarks.graphed_call [--quick] [--out PATH]`` writes
``benchmarks/results/graphed_call.json``; ``--quick`` (part of ``python3 -m benchmarks``) times one
input only, in 11 rounds, without ``extra_inputs``, and writes ``graphed_call_quick.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks._harness import (
    RESULTS_DIR,
    Report,
    alternating,
    bootstrap_ci,
    host_sync_us,
    host_us_interleaved,
    no_gpu,
    verdict,
)

NUMEL = 1024
KS, QUICK_KS = (1, 4, 16), (1,)
ROUNDS, QUICK_ROUNDS = 41, 11


def _fn(*xs):
    out = xs[0] * 2.0
    for x in xs[1:]:
        out = out + x
    return out


def run(rep: Report, ks=KS, rounds: int = ROUNDS) -> dict:
    _warm_process()
    out = {}
    for k in ks:
        out[k] = _run_k(rep, k, rounds)
    return out


_hand_graphs: dict = {}  # k -> the peer's replay function (one capture per process)


def _hand_graph(k: int):
    """``run(xs)``: copy ``xs`` into a hand-made torch.cuda.CUDAGraph's static inputs, replay it,
    return its static output."""
    hand = _hand_graphs.get(k)
    if hand is not None:
        return hand
    import torch

    static = [torch.randn(NUMEL, device="cuda") for _ in range(k)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _fn(*static)
    torch.cuda.current_stream().wait_stream(s)
    tg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(tg):
        out = _fn(*static)

    def hand(xs):
        for d, x in zip(static, xs):
            d.copy_(x)
        tg.replay()
        return out

    hand.keep = (tg, static, out)
    _hand_graphs[k] = hand
    return hand


def _warm_process() -> None:
    """The process's first CUDA work (context, torch's and cgraw's first capture) before anything
    is timed: time to first replay is that of a new function in a running program."""
    import torch

    import cgraw

    x = torch.randn(NUMEL, device="cuda")
    warm = cgraw.graphed(lambda a: a * 3.0 + 1.0)
    for _ in range(3):
        warm(x)
    torch.cuda.synchronize()
    cgraw.reset()


def _run_k(rep: Report, k: int, rounds: int) -> dict:
    import torch

    import cgraw

    sync = torch.cuda.synchronize
    sets = [[torch.randn(NUMEL, device="cuda") for _ in range(k)] for _ in range(2)]
    refs = [_fn(*xs) for xs in sets]
    state = {"i": 0}

    def same_as_eager(call):
        """``call(xs)`` equals eager for both input sets, twice over (so a graph is replayed)."""
        def check():
            for i in (0, 1, 0, 1):
                torch.testing.assert_close(call(sets[i]), refs[i])
        return check

    def alternate(call):
        def run():
            state["i"] ^= 1
            call(sets[state["i"]])
        return run

    timed = {}  # name -> no-argument call, all timed together in interleaved rounds

    # cgraw: first calls timed, then checked on both input sets
    cgraw.reset()
    g = cgraw.graphed(_fn)
    sync()
    t0 = time.perf_counter()
    for _ in range(3):  # warm-up, record (+ replay), replay
        r = g(*sets[0])
    sync()
    first3_ms = (time.perf_counter() - t0) * 1e3
    del r
    t0 = time.perf_counter()
    _fn(*sets[0])
    sync()
    eager_one_ms = (time.perf_counter() - t0) * 1e3
    if rep.check(f"graphed_call k={k}: cgraw.graphed", same_as_eager(lambda xs: g(*xs))):
        timed["cgraw_same"] = lambda: g(*sets[0])
        timed["cgraw_alternating"] = alternate(lambda xs: g(*xs))
    mgr = sys.modules["cgraw.trees.graphed"]._managers[0]
    stats = mgr.stats[g.fn_id]

    hand = _hand_graph(k)  # hand-made torch.cuda.CUDAGraph with static inputs and copy_

    if rep.check(f"graphed_call k={k}: torch.cuda.CUDAGraph + copy_", same_as_eager(hand)):
        timed["hand_cudagraph_copy"] = alternate(hand)

    # torch.compile reduce-overhead
    ro_first_ms = None
    try:
        torch._dynamo.reset()
        cf = torch.compile(_fn, mode="reduce-overhead")

        def ro_call(xs):
            torch.compiler.cudagraph_mark_step_begin()
            return cf(*xs)

        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            ro_call(sets[0])
        sync()
        ro_first_ms = (time.perf_counter() - t0) * 1e3
    except Exception as exc:  # noqa: BLE001 -- a peer that does not work is reported, not hidden
        rep.peer_missing(f"torch.compile reduce-overhead (k={k})", repr(exc)[:300])
    else:
        if rep.check(f"graphed_call k={k}: torch.compile reduce-overhead", same_as_eager(ro_call)):
            timed["reduce_overhead"] = alternate(ro_call)
    floor_repoint = None
    if k == 1 and "cgraw_same" in timed:
        floors, floor_repoint = _floors(_recording(mgr, g), sets)
        timed.update(floors)

    res = host_us_interleaved(timed, loops=100, rounds=rounds, sync=sync)
    # the cgraw recording is still right after all that (the floors re-pointed its graph)
    rep.check(f"graphed_call k={k}: cgraw.graphed after the timing", same_as_eager(lambda xs: g(*xs)))
    eager_us = host_sync_us(lambda: _fn(*sets[0]), sync, loops=500)["median_us"]

    def med(name):
        return res[name]["median_us"] if name in res else None

    same, alt, hand_us, ro_us = med("cgraw_same"), med("cgraw_alternating"), med("hand_cudagraph_copy"), \
        med("reduce_overhead")
    row = rep.add(workload="graphed_call", k=k, timing="interleaved rounds", cgraw_same_us=same,
                  cgraw_alternating_us=alt, hand_cudagraph_copy_us=hand_us, reduce_overhead_us=ro_us,
                  eager_sync_us=eager_us, cgraw_first3_ms=first3_ms, eager_one_call_ms=eager_one_ms,
                  cgraw_instantiate_ms=stats.instantiate_ms, cgraw_capture_ms=stats.capture_ms,
                  reduce_overhead_first5_ms=ro_first_ms,
                  ratio_vs_reduce_overhead=_ratio(res, "cgraw_alternating", "reduce_overhead"),
                  floor_raw_launch_us=med("floor_raw_launch"), floor_patch_and_launch_us=med("floor_patch_and_launch"),
                  floor_repoint=floor_repoint, rounds=rounds, **_targets(res, k))
    cgraw.reset()
    return row


def _recording(mgr, g):
    """The recording of graphed function ``g`` (its one recorded tree node)."""
    return next(n for n in mgr.nodes() if n.fn is g and n.recording is not None).recording


def _floors(rec, sets) -> tuple[dict, str]:
    """The driver's floor for a graphed call of one eager input, on the recording's own
    executable, as burst-safe calls: ``floor_raw_launch``, a raw ``cuGraphLaunch`` on the current
    stream; ``floor_patch_and_launch``, the driver calls that re-point the graph at the input
    (``_repoint``) plus that launch, alternating between the two inputs of ``sets``. Every second
    call points the graph back at the address the recording holds, so the graphed calls timed in
    the same rounds find it as they left it. Also returns what the re-point does (for the row);
    an input the graph neither copies nor reads in place has no re-point floor."""
    from cgraw import _cuda
    from cgraw.runtime import stream as _streams

    launch, exec_, stream = _cuda.graph_launch_raw, rec.graph._exec, _streams.current_ptr(0)

    def raw():
        launch(exec_, stream)

    floors = {"floor_raw_launch": raw}
    repoint, held, what = _repoint(rec, 0)
    if repoint is None:
        return floors, what
    a, b = (xs[0].data_ptr() for xs in sets)
    state = {"i": 0}

    def patch_and_launch():
        state["i"] ^= 1
        p = held.ptr
        if state["i"]:
            p = b if p == a else a
        repoint(p)
        launch(exec_, stream)

    floors["floor_patch_and_launch"] = patch_and_launch
    return floors, what


def _repoint(rec, leaf: int):
    """``(repoint(ptr), held, what)``: the bare driver calls that make ``rec``'s executable
    read eager input ``leaf`` at ``ptr``, without the runtime's bookkeeping; ``held.ptr`` is the
    address the recording believes the graph reads. A copied input: its memcpy node's source
    (``cudaGraphExecMemcpyNodeSetParams1D``). An input read in place: the recording's own
    argument buffers rewritten and handed to each kernel node that reads it
    (``cuGraphExecKernelNodeSetParams``), and its 1-D memcpy nodes re-pointed. ``(None, None,
    why)`` for an input that is neither."""
    from cgraw import _cuda

    set_1d, d2d, exec_rt = _cuda.memcpy_node_set_1d_raw, _cuda.MEMCPY_D2D, rec.setter.exec_
    c = next((c for c in rec.copies if c.leaf == leaf and not c.back), None)
    if c is not None:
        def repoint_copy(p):
            set_1d(exec_rt, c.node, c.fixed, p, c.count, d2d)

        return repoint_copy, c, "1 memcpy node (cudaGraphExecMemcpyNodeSetParams1D)"
    r = next((r for r in rec.rebinds if r.leaf == leaf), None)
    if r is None:
        return None, None, f"none: input {leaf} is neither copied nor read in place ({rec.input_notes.get(leaf)})"
    set_kernel = _cuda.drv.cuGraphExecKernelNodeSetParams
    words, memcpys = r.words, r.memcpys
    kernels = [(k.exec_, k.node, k.q) for k in r.kernels]

    def repoint_in_place(p):
        for w, d in words:
            w.value = p + d
        for e, node, q in kernels:
            set_kernel(e, node, q)
        for node, dd, sd, dst, src, n in memcpys:
            set_1d(exec_rt, node, dst if dd is None else p + dd, src if sd is None else p + sd, n, d2d)

    what = (f"{len(kernels)} kernel node(s) (cuGraphExecKernelNodeSetParams) and {len(memcpys)} memcpy node(s) "
            "(cudaGraphExecMemcpyNodeSetParams1D): the input is read in place")
    return repoint_in_place, r, what


def _ratio(res: dict, a: str, b: str):
    if a not in res or b not in res:
        return None
    return statistics.median([x / y for x, y in zip(res[a]["samples"], res[b]["samples"])])


TARGETS = {  # the hot path's targets: (numerator, denominator, at most per number of inputs k; None: no target)
    "alternating_over_floor": ("cgraw_alternating", "floor_patch_and_launch", {}),
    "alternating_over_hand_cudagraph": ("cgraw_alternating", "hand_cudagraph_copy", {1: 1.00, 4: 0.80}),
    "same_over_raw_launch": ("cgraw_same", "floor_raw_launch", {1: 3.0}),
}


def _targets(res: dict, k: int) -> dict:
    """Per-round ratios of the interleaved rounds, with a bootstrap 95% interval and, where ``k``
    inputs have a target, a verdict."""
    out = {}
    for name, (num, den, most_by_k) in TARGETS.items():
        if num in res and den in res:
            per_round = [x / y for x, y in zip(res[num]["samples"], res[den]["samples"])]
            ci = bootstrap_ci([per_round])
            out[name] = statistics.median(per_round)
            out[name + "_ci95"] = list(ci)
            most = most_by_k.get(k)
            if most is not None:
                out[name + "_target"] = most
                out[name + "_verdict"] = verdict(ci, most)
    return out


def extra_inputs(rep: Report, ks=(1, 4, 16)) -> dict | None:
    """Host µs per extra changed eager input: graphed functions of ``ks`` eager inputs, all
    alternating their inputs, timed together in interleaved rounds; the slope between two of them
    is taken per round (so a drift of the machine cancels), then its median and bootstrap 95%
    interval. (Medians of the per-``k`` rows above come from separate blocks of rounds, and their
    differences swung 0.5 to 5.0 µs between two runs minutes apart.)"""
    import torch

    import cgraw

    sync = torch.cuda.synchronize
    cgraw.reset()
    timed, checks = {}, {}
    for k in ks:
        sets = [[torch.randn(NUMEL, device="cuda") for _ in range(k)] for _ in range(2)]
        refs = [_fn(*xs) for xs in sets]
        g = cgraw.graphed(_fn)

        def check(g=g, sets=sets, refs=refs):
            for i in (0, 1, 0, 1, 0):  # warm-up, record, replays; both input sets
                torch.testing.assert_close(g(*sets[i]), refs[i])

        # each function a root: its first call on an empty path (called while another function's
        # path is under way, it would be recorded as that path's next node, and each call as a
        # deeper one, which is not what this row times)
        cgraw.mark_step_begin()
        if not rep.check(f"extra inputs k={k}: cgraw.graphed", check):
            return None
        timed[k], checks[k] = alternating(lambda xs, g=g: g(*xs), sets), check
    res = host_us_interleaved(timed, loops=100, rounds=41, sync=sync)
    for k in ks:  # each recording still equals eager after the timing
        rep.check(f"extra inputs k={k}: cgraw.graphed after the timing", checks[k])
    row = {"workload": "graphed_call_extra_inputs", "timing": "interleaved rounds, one set for all k",
           "target_us": 1.0}
    for k in ks:
        row[f"alternating_k{k}_us"] = res[k]["median_us"]
    base = ks[0]
    for k in ks[1:]:
        slopes = [(b - a) / (k - base) for a, b in zip(res[base]["samples"], res[k]["samples"])]
        ci = bootstrap_ci([slopes])
        row[f"extra_us_per_input_{base}_to_{k}"] = statistics.median(slopes)
        row[f"extra_us_per_input_{base}_to_{k}_ci95"] = list(ci)
        row[f"extra_us_per_input_{base}_to_{k}_verdict"] = verdict(ci, 1.0)
    cgraw.reset()
    return rep.add(**row)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.graphed_call", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"one eager input, {QUICK_ROUNDS} rounds, no extra-input slope (figures not for the README)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/graphed_call.json, "
                                                "graphed_call_quick.json with --quick)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if no_gpu():
        return 2
    rep = Report("graphed_call")
    if args.quick:
        run(rep, QUICK_KS, QUICK_ROUNDS)
    else:
        run(rep)
        extra_inputs(rep)
    out = args.out or os.path.join(RESULTS_DIR, "graphed_call_quick.json" if args.quick else "graphed_call.json")
    print(f"results: {rep.save({'options': {'quick': args.quick}}, path=out)}")
    return 1 if rep.failed_checks else 0  # a system that differs from eager fails the part


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
