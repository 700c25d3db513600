"""Per-call host cost of a graphed function, against a hand-made torch.cuda.CUDAGraph with input
``copy_`` and against ``torch.compile(mode="reduce-overhead")`` (CUDAGraph Trees), same run.

Workload: ``k`` eager inputs of 4 KB (1,024 float32) and one output, ``out = x0*2 + x1 + ... ``.
Two input patterns: the same input tensors every call ("same": no memcpy-node update needed), and
two input sets used alternately ("alternating": every eager input's copy node is patched per call).
Also: time to first replay (warm-up + record + instantiate + replay) against one eager call; and,
for one input (k=1), the driver's floor on the same executable as a peer: a raw ``cuGraphLaunch``
("same") and one ``cudaGraphExecMemcpyNodeSetParams1D`` plus a raw ``cuGraphLaunch``
("alternating"), with the ratios of issue #10's targets.
Every system is checked against eager on both input sets before it is timed; one that differs is
recorded under ``failed_checks`` and not timed. The systems of one ``k`` are timed together in
interleaved rounds (41 rounds of 100-call bursts, shuffled order, a synchronise after each burst),
so that a drift of the machine's speed moves them alike; ratios are medians of per-round ratios.
The cost of each extra changed eager input (``extra_inputs``) is measured apart: graphed functions
of 1, 4 and 16 inputs timed in one set of interleaved rounds, the slope taken per round.
"""

from __future__ import annotations

import statistics
import sys
import time

from benchmarks._harness import Report, alternating, bootstrap_ci, host_sync_us, host_us_interleaved, verdict

NUMEL = 1024


def _fn(*xs):
    out = xs[0] * 2.0
    for x in xs[1:]:
        out = out + x
    return out


def run(rep: Report, ks=(1, 4, 16)) -> dict:
    _warm_process()
    out = {}
    for k in ks:
        out[k] = _run_k(rep, k)
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


def _run_k(rep: Report, k: int) -> dict:
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
    mgr = sys.modules["cgraw.graphed"]._managers[0]
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
    if k == 1 and "cgraw_same" in timed:
        timed.update(_floors(mgr, g, sets))

    res = host_us_interleaved(timed, loops=100, rounds=41, sync=sync)
    # the cgraw recording is still right after all that (the floors re-pointed its copy node)
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
                  **_targets(res))
    cgraw.reset()
    return row


def _floors(mgr, g, sets) -> dict:
    """The driver's floor for a graphed call of one eager input, on the recording's own
    executable, as burst-safe calls: a raw ``cuGraphLaunch`` on the current stream, and one
    memcpy-node re-point (the runtime's 1-D setter, called directly) plus that launch, alternating
    between the two inputs. The node is put back to what the recording believes after every call
    pair, so the graphed calls timed in the same rounds see it as they left it."""
    from cgraw import _cuda
    from cgraw import stream as _streams

    node = next(n for n in mgr.nodes() if n.fn is g and n.recording is not None)
    rec = node.recording
    c = next(c for c in rec.copies if not c.back)
    launch, set_1d, d2d = _cuda.graph_launch_raw, _cuda.memcpy_node_set_1d_raw, _cuda.MEMCPY_D2D
    exec_, exec_rt, ptr = rec.graph._exec, rec.setter.exec_, _streams.current_ptr(0)
    srcs = [xs[0].data_ptr() for xs in sets]
    other = srcs[1] if srcs[0] == c.ptr else srcs[0]
    state = {"i": 0}

    def raw():
        launch(exec_, ptr)

    def patch_and_launch():
        # alternate between the other input and the recording's own (a re-point every call),
        # ending each pair where the recording believes the node is
        state["i"] ^= 1
        set_1d(exec_rt, c.node, c.fixed, other if state["i"] else c.ptr, c.count, d2d)
        launch(exec_, ptr)

    return {"floor_raw_launch": raw, "floor_patch_and_launch": patch_and_launch}


def _ratio(res: dict, a: str, b: str):
    if a not in res or b not in res:
        return None
    return statistics.median([x / y for x, y in zip(res[a]["samples"], res[b]["samples"])])


TARGETS = {  # issue #10: (numerator, denominator, at most)
    "alternating_over_floor": ("cgraw_alternating", "floor_patch_and_launch", 1.6),
    "alternating_over_hand_cudagraph": ("cgraw_alternating", "hand_cudagraph_copy", 0.7),
    "same_over_raw_launch": ("cgraw_same", "floor_raw_launch", 1.3),
}


def _targets(res: dict) -> dict:
    """Per-round ratios of the interleaved rounds, with a bootstrap 95% interval and a verdict."""
    out = {}
    for name, (num, den, most) in TARGETS.items():
        if num in res and den in res:
            per_round = [x / y for x, y in zip(res[num]["samples"], res[den]["samples"])]
            ci = bootstrap_ci([per_round])
            out[name] = statistics.median(per_round)
            out[name + "_ci95"] = list(ci)
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
        # deeper one: run 20261201T120154Z-ebbb19a timed that by mistake)
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


def main(argv=None) -> int:
    rep = Report("graphed_call")
    run(rep)
    extra_inputs(rep)
    print(f"results: {rep.save()}")
    return 1 if rep.failed_checks else 0  # a system that differs from eager fails the part


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
