"""Where the host time of a steady-state graphed call goes: the whole call, ``Graph.replay()``
against a raw ``cuGraphLaunch`` of the same executable on the same stream, and the pieces of a
call that can be run on their own (input inspection, the recording's check, the input-copy patch,
the output alias, poisoning the previous output).

Every piece is timed in bursts of ``--burst`` calls (``perf_counter_ns`` around the burst), with a
synchronise after each burst, outside the timed region: every burst starts on a drained launch
queue, so a figure is the host's cost and never the device time of queued replays. The pieces are
interleaved, in a shuffled order, over ``--rounds`` rounds; each figure is the median over rounds
(p10 and p90 beside it), in µs per call. ``Graph.replay`` / raw launch ratios are medians of the
per-round ratios with a bootstrap 95% interval, judged against the target of 1.10x. Every launch
path is checked against eager before it is timed. What the pieces do not cover (the tree's own
bookkeeping) is reported as a remainder, marked ``derived``.

The hot path's targets are judged in the same interleaved rounds: a graphed call with one
alternating 4 KB input against the driver's floor on the same executable (the driver calls that
re-point the graph at the moved input, a copied input's memcpy node or the kernel nodes that read
an input read in place, plus a raw launch; at most 1.6x) and against a hand-made
``torch.cuda.CUDAGraph`` with ``copy_`` (at most 0.7x); with the same input every call against a
raw launch (at most 1.3x).

``python -m benchmarks.profile_graphed [--inputs K] [--burst N] [--rounds R] [--cprofile]`` on the
GPU machine; writes ``benchmarks/results/profile_graphed.json``. ``--cprofile`` also prints the
top functions by own time over ``--cprofile-calls`` graphed calls (not saved).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from benchmarks._harness import Report, bootstrap_ci, no_gpu, percentile, verdict
from benchmarks.graphed_call import _fn, _hand_graph, _repoint

REPLAY_TARGET = 1.10  # Graph.replay() host cost / raw cuGraphLaunch
NUMEL = 1024


def _calls(fn, *args):
    """A burst runner: ``run(n)`` calls ``fn(*args)`` n times and returns the elapsed nanoseconds.
    The loop calls ``fn`` itself (no wrapper in between) for up to two arguments."""
    clock = time.perf_counter_ns
    if not args:
        def run(n: int) -> int:
            t0 = clock()
            for _ in range(n):
                fn()
            return clock() - t0
    elif len(args) == 1:
        (a,) = args

        def run(n: int) -> int:
            t0 = clock()
            for _ in range(n):
                fn(a)
            return clock() - t0
    elif len(args) == 2:
        a, b = args

        def run(n: int) -> int:
            t0 = clock()
            for _ in range(n):
                fn(a, b)
            return clock() - t0
    else:
        def run(n: int) -> int:
            t0 = clock()
            for _ in range(n):
                fn(*args)
            return clock() - t0
    return run


def _pieces(g, xs, xs2, ts):
    """``{name: (factory, kind, check)}``; each factory returns a burst runner, ``check`` names the
    check against eager its launch path must have passed. A factory that fails (a private name
    changed) makes its piece unavailable, with the reason, instead of stopping the run."""
    import torch

    from cgraw import _cuda
    from cgraw.trees import calls, input_plan
    from cgraw.runtime import stream as _streams
    from cgraw.trees.graphed import _managers

    mgr = _managers[xs[0].get_device()]
    backend = mgr.backend
    args, args2 = tuple(xs), tuple(xs2)

    def node_of():
        return next(n for n in mgr.nodes() if n.fn is g and n.recording is not None)

    def rec_of():
        return node_of().recording

    launch = _cuda.graph_launch_raw
    pieces = {}

    def whole_same():
        return _calls(g, *args) if len(args) <= 2 else _calls(lambda: g(*args))

    def whole_alt():
        both, clock = (args, args2), time.perf_counter_ns

        def run(n):
            t0 = clock()
            for i in range(n):
                g(*both[i & 1])
            return clock() - t0

        return run

    def replay_current():
        return _calls(rec_of().graph.replay)

    def raw_current():
        return _calls(launch, rec_of().graph._exec, _streams.current_ptr(0))

    def replay_explicit():
        return _calls(rec_of().graph.replay, ts)

    def raw_explicit():
        return _calls(launch, rec_of().graph._exec, ts.cuda_stream)

    def replay_in_stream_ctx():
        replay, clock = rec_of().graph.replay, time.perf_counter_ns

        def run(n):
            with torch.cuda.stream(ts):
                t0 = clock()
                for _ in range(n):
                    replay()
                return clock() - t0

        return run

    def empty_call():
        return _calls(lambda: None)

    def stream_lookup():
        return _calls(_streams.current_getter, 0)

    def inspect():
        return _calls(lambda: calls.inspect(g, args, {}, mgr.tree_outputs, mgr.device_index))

    def moved():
        node = node_of()
        call = calls.inspect(g, args, {}, mgr.tree_outputs, mgr.device_index)
        rec = node.recording
        return _calls(lambda: input_plan.moved(node.plan, call) or rec.stale())

    def patch():
        rec = rec_of()
        c = next((c for c in rec.copies if not c.back), None)
        if c is None:
            raise LookupError("the recording has no input-copy node")
        set_1d, d2d, clock = _cuda.memcpy_node_set_1d_raw, _cuda.MEMCPY_D2D, time.perf_counter_ns
        exec_rt = rec.setter.exec_
        srcs = (xs[0].data_ptr(), xs2[0].data_ptr())
        (err,) = set_1d(exec_rt, c.node, c.fixed, c.ptr, c.count, d2d)
        if err:
            raise RuntimeError(f"cudaGraphExecMemcpyNodeSetParams1D failed: {err}")

        def run(n):
            t0 = clock()
            for i in range(n):
                set_1d(exec_rt, c.node, c.fixed, srcs[i & 1], c.count, d2d)
            elapsed = clock() - t0
            set_1d(exec_rt, c.node, c.fixed, c.ptr, c.count, d2d)  # back to what the recording believes
            return elapsed

        return run

    def alias():
        rec = rec_of()
        make = rec.alias0
        if make is None:
            raise LookupError("no single-output alias maker (rec.alias0) on this recording")
        return _calls(make)

    def end_generation():
        rec, clock = rec_of(), time.perf_counter_ns
        t, name = rec.out_leaves[0], rec.name

        def run(n):
            handed = [[(name, t.detach())] for _ in range(n)]  # one output per generation, as a call
            t0 = clock()
            for h in handed:
                backend.end_generation(h, None)
            return clock() - t0

        return run

    def poison_only():
        rec, clock = rec_of(), time.perf_counter_ns
        t, poison, msg = rec.out_leaves[0], backend._tts.poison, "overwritten (profile_graphed)"

        def run(n):
            fresh = [t.detach() for _ in range(n)]
            t0 = clock()
            for a in fresh:
                poison(a, msg)
            return clock() - t0

        return run

    def floor_alt():
        """The driver's floor of an alternating call: the driver calls that re-point the graph at
        the input (``graphed_call._repoint``) and one raw launch on the recording's own executable."""
        rec = rec_of()
        repoint, held, what = _repoint(rec, 0)
        if repoint is None:
            raise LookupError(what)
        exec_, ptr, clock = rec.graph._exec, _streams.current_ptr(0), time.perf_counter_ns
        srcs = (xs[0].data_ptr(), xs2[0].data_ptr())

        def run(n):
            t0 = clock()
            for i in range(n):
                repoint(srcs[i & 1])
                launch(exec_, ptr)
            elapsed = clock() - t0
            repoint(held.ptr)  # back to what the recording believes
            return elapsed

        return run

    def hand_alt():
        """The peer: a hand-made torch.cuda.CUDAGraph of the same function, inputs ``copy_``-ed in."""
        both, clock = (args, args2), time.perf_counter_ns
        hand = _hand_graph(len(args))

        def run(n):
            t0 = clock()
            for i in range(n):
                hand(both[i & 1])
            return clock() - t0

        return run

    # name: (factory, kind, the check its launch path must have passed)
    pieces["graphed call, same inputs"] = (whole_same, "call", None)
    pieces["graphed call, alternating inputs"] = (whole_alt, "call", None)
    pieces[FLOOR_ALT] = (floor_alt, "launch", CHECKS["raw"])
    pieces[HAND_ALT] = (hand_alt, "peer", CHECKS["hand"])
    pieces["Graph.replay() (current stream)"] = (replay_current, "launch", CHECKS["replay"])
    pieces["raw cuGraphLaunch (current stream)"] = (raw_current, "launch", CHECKS["raw"])
    pieces["Graph.replay(stream) (explicit torch stream)"] = (replay_explicit, "launch", CHECKS["replay_stream"])
    pieces["raw cuGraphLaunch (explicit torch stream)"] = (raw_explicit, "launch", CHECKS["raw_stream"])
    pieces["Graph.replay() inside torch.cuda.stream(s)"] = (replay_in_stream_ctx, "launch", CHECKS["replay_ctx"])
    pieces["(baseline) an empty Python call in the loop"] = (empty_call, "baseline", None)
    pieces["current-stream lookup (stream.current_getter)"] = (stream_lookup, "piece", None)
    pieces["input inspection (calls.inspect)"] = (inspect, "piece", None)
    pieces["recording check (input_plan.moved + Recording.stale)"] = (moved, "piece", None)
    pieces["input-copy patch (cudaGraphExecMemcpyNodeSetParams1D)"] = (patch, "piece", None)
    pieces["output alias (rec.alias0: detach)"] = (alias, "piece", None)
    pieces["poisoning (backend.end_generation, 1 output)"] = (end_generation, "piece", None)
    pieces["poison call alone (_set_storage_access_error_msg)"] = (poison_only, "piece", None)
    return pieces


FLOOR_ALT = "floor: input re-point + raw cuGraphLaunch, alternating inputs"
HAND_ALT = "torch.cuda.CUDAGraph + copy_, alternating inputs"
TARGETS = (  # the hot path's targets: (label, numerator piece, denominator piece, at most)
    ("graphed call alternating / floor", "graphed call, alternating inputs", FLOOR_ALT, 1.6),
    ("graphed call alternating / hand-made CUDAGraph + copy_", "graphed call, alternating inputs", HAND_ALT, 0.7),
    ("graphed call same inputs / raw cuGraphLaunch", "graphed call, same inputs", "raw cuGraphLaunch (current stream)",
     1.3),
)
CHECKS = {
    "hand": "profile: torch.cuda.CUDAGraph + copy_",
    "replay": "profile: Graph.replay()",
    "raw": "profile: raw cuGraphLaunch (current stream)",
    "replay_stream": "profile: Graph.replay(stream)",
    "raw_stream": "profile: raw cuGraphLaunch (explicit stream)",
    "replay_ctx": "profile: Graph.replay() inside torch.cuda.stream(s)",
}


def _check_launches(rep: Report, g, xs, ts) -> None:
    """Each launch path recomputes the recording's output for ``xs`` (the inputs last passed)."""
    import torch

    from cgraw import _cuda
    from cgraw.runtime import stream as _streams
    from cgraw.trees.graphed import _managers

    mgr = _managers[xs[0].get_device()]
    rec = next(n for n in mgr.nodes() if n.fn is g and n.recording is not None).recording
    out, ref = rec.out_leaves[0], _fn(*xs)
    launch = _cuda.graph_launch_raw

    def via(name, fn):
        def check():
            with torch.no_grad():
                out.fill_(float("nan"))
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, ref)

        rep.check(name, check)

    def in_ctx():
        with torch.cuda.stream(ts):
            rec.graph.replay()

    def hand_check():
        hand = _hand_graph(len(xs))
        for inputs in (xs, [x * 2 for x in xs], xs):
            torch.testing.assert_close(hand(inputs), _fn(*inputs))

    rep.check(CHECKS["hand"], hand_check)
    via(CHECKS["replay"], rec.graph.replay)
    via(CHECKS["raw"], lambda: launch(rec.graph._exec, _streams.current_ptr(0)))
    via(CHECKS["replay_stream"], lambda: rec.graph.replay(ts))
    via(CHECKS["raw_stream"], lambda: launch(rec.graph._exec, ts.cuda_stream))
    via(CHECKS["replay_ctx"], in_ctx)


def _device_us_per_replay(replay, reps: int = 200) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _cprofile(g, xs, calls: int, sync) -> None:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for i in range(calls):
        g(*xs)
        if i % 100 == 99:
            sync()
    pr.disable()
    sync()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_graphed", description=__doc__.split("\n\n")[0])
    ap.add_argument("k_pos", nargs="?", type=int, help=argparse.SUPPRESS)  # the old positional form
    ap.add_argument("--inputs", "-k", type=int, default=1, help="eager 4 KB inputs per call")
    ap.add_argument("--burst", type=int, default=100, help="calls per timed burst")
    ap.add_argument("--rounds", type=int, default=101, help="bursts per piece (interleaved)")
    ap.add_argument("--cprofile", action="store_true", help="also print a cProfile listing")
    ap.add_argument("--cprofile-calls", type=int, default=20000)
    return ap.parse_args([] if argv is None else argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if no_gpu():
        return 2
    k = args.k_pos or args.inputs

    import torch

    import cgraw
    from cgraw.runtime import stream as _streams

    rep = Report("profile_graphed")
    sync = torch.cuda.synchronize
    cgraw.reset()
    xs = [torch.randn(NUMEL, device="cuda") for _ in range(k)]
    xs2 = [torch.randn(NUMEL, device="cuda") for _ in range(k)]
    g = cgraw.graphed(_fn)
    ts = torch.cuda.Stream()

    def graphed_same_as_eager():
        for _ in range(3):  # warm-up, record, replay
            torch.testing.assert_close(g(*xs), _fn(*xs))
        for inputs in (xs2, xs, xs2, xs):  # every call patches the input copies; ends on xs
            torch.testing.assert_close(g(*inputs), _fn(*inputs))

    if not rep.check("profile: graphed call", graphed_same_as_eager):
        rep.save()
        return 1
    _check_launches(rep, g, xs, ts)
    g(*xs)
    sync()

    runners, unavailable, kinds = {}, {}, {}
    for name, (factory, kind, check) in _pieces(g, xs, xs2, ts).items():
        if check is not None and check in rep.failed_checks:
            unavailable[name] = "its launch path failed the check against eager: not timed"
            continue
        try:
            runners[name] = factory()
        except Exception as exc:  # noqa: BLE001 -- a piece that cannot be isolated is reported, not fatal
            unavailable[name] = f"{type(exc).__name__}: {exc}"
            continue
        kinds[name] = kind
    for name, why in unavailable.items():
        print(f"[profile_graphed] piece unavailable: {name}: {why}", flush=True)

    for run in runners.values():  # warm-up
        for _ in range(3):
            run(args.burst)
            sync()
    samples = {name: [] for name in runners}
    order = list(runners)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            sync()
            samples[name].append(runners[name](args.burst) / args.burst / 1e3)
    sync()
    g(*xs)  # the tree is still correct after all that
    sync()
    rep.check("profile: graphed call after the timing", lambda: torch.testing.assert_close(g(*xs2), _fn(*xs2)))

    results = {}
    for name in runners:
        v = sorted(samples[name])
        results[name] = statistics.median(v)
        rep.add(piece=name, kind=kinds[name], us_per_call=statistics.median(v), p10_us=percentile(v, 0.1),
                p90_us=percentile(v, 0.9), burst=args.burst, rounds=args.rounds)
    parts = ("Graph.replay() (current stream)", "input inspection (calls.inspect)",
             "recording check (input_plan.moved + Recording.stale)", "output alias (rec.alias0: detach)",
             "poisoning (backend.end_generation, 1 output)")
    whole = "graphed call, same inputs"
    if whole in results and all(p in results for p in parts):
        rest = results[whole] - sum(results[p] for p in parts)
        rep.add(piece="remainder: tree bookkeeping", kind="derived", us_per_call=rest,
                formula=f"{whole} - ({' + '.join(parts)})")

    ratios = {}
    for label, a, b in (("current stream", "Graph.replay() (current stream)", "raw cuGraphLaunch (current stream)"),
                        ("explicit torch stream", "Graph.replay(stream) (explicit torch stream)",
                         "raw cuGraphLaunch (explicit torch stream)")):
        if a in samples and b in samples:
            per_round = [x / y for x, y in zip(samples[a], samples[b])]
            ci = bootstrap_ci([per_round])
            ratios[label] = {"ratio": statistics.median(per_round), "ci95": list(ci), "target": REPLAY_TARGET,
                             "verdict": verdict(ci, REPLAY_TARGET)}
            rep.add(piece=f"ratio Graph.replay / raw cuGraphLaunch ({label})", kind="ratio",
                    ratio=ratios[label]["ratio"], ci95_low=ci[0], ci95_high=ci[1],
                    verdict=ratios[label]["verdict"])
    targets = {}
    for label, a, b, most in TARGETS:
        if a in samples and b in samples:
            per_round = [x / y for x, y in zip(samples[a], samples[b])]
            ci = bootstrap_ci([per_round])
            targets[label] = {"ratio": statistics.median(per_round), "ci95": list(ci), "target": most,
                              "verdict": verdict(ci, most)}
            rep.add(piece=f"target: {label}", kind="ratio", ratio=targets[label]["ratio"], ci95_low=ci[0],
                    ci95_high=ci[1], target=most, verdict=targets[label]["verdict"])
    rec = next(n for n in sys.modules["cgraw.trees.graphed"]._managers[xs[0].get_device()].nodes()
               if n.fn is g and n.recording is not None).recording
    device_us = _device_us_per_replay(rec.graph.replay)
    extra = {"k": k, "burst": args.burst, "rounds": args.rounds, "ratios": ratios, "targets": targets,
             "floor_repoint": _repoint(rec, 0)[2],
             "device_us_per_replay": device_us, "unavailable": unavailable,
             "graph_nodes": rec.graph.num_nodes,
             "current_stream_ptr": _streams.current_ptr(0)}
    rep.add(piece="device time per replay (CUDA events, 200 replays)", kind="device", us_per_call=device_us)
    path = rep.save(extra)
    _print_table(results, ratios)
    print(f"results: {path}")
    if args.cprofile:
        _cprofile(g, xs, args.cprofile_calls, sync)
    cgraw.reset()
    return 1 if rep.failed_checks else 0  # a system that differs from eager fails the part


def _print_table(results: dict, ratios: dict) -> None:
    print(f"{'piece':62s} {'us/call':>8s}")
    for name, us in results.items():
        print(f"{name:62s} {us:8.2f}")
    for label, r in ratios.items():
        lo, hi = r["ci95"]
        print(f"Graph.replay / raw cuGraphLaunch ({label}): {r['ratio']:.3f}x (95% CI {lo:.3f}-{hi:.3f}; "
              f"target <= {r['target']:.2f}x: {r['verdict']})")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
