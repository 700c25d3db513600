"""Launch overhead: eager torch/CuPy against cgraw replay and its peers, same work, same run.

Peers: eager torch, eager CuPy, ``torch.cuda.CUDAGraph``, CuPy's ``Stream.begin_capture`` graphs,
and a raw cuda-python ``cuGraphLaunch``/``cudaGraphLaunch`` of the very executable cgraw replays.
Workload: a chain of N dependent tiny kernels (``y *= 1.0001`` on 1,024 floats), N = 1, 16, 256,
1024. Device time per kernel comes from CUDA events around R replays; host time is
``perf_counter`` around loops of submissions ("submit") or submissions plus a synchronise ("sync").
Every system's result is compared with the eager chain (bitwise) before it is timed; one that
differs is recorded under ``failed_checks`` and not timed. The 1-node replay cost is timed in
bursts of ``REPLAY_BURST`` launches with a synchronise between bursts, systems interleaved over
rounds; its ratios are medians of per-round ratios with a bootstrap 95% interval.

``python3 -m benchmarks.launch_overhead [--quick] [--out PATH]`` writes
``benchmarks/results/launch_overhead.json``; ``--quick`` (part of ``python3 -m benchmarks``) runs
N = 1, 16, 256 with fewer repetitions and rounds and writes ``launch_overhead_quick.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import numpy as np

from benchmarks._harness import RESULTS_DIR, Report, bootstrap_ci, host_sync_us, host_us, no_gpu

SIZES, QUICK_SIZES = (1, 16, 256, 1024), (1, 16, 256)
REPS, QUICK_REPS = 50, 20  # replays between the CUDA events of one device-time figure
NUMEL = 1024
REPLAY_BURST = 100  # launches between synchronisations in replay_cost
REPLAY_ROUNDS, QUICK_REPLAY_ROUNDS = 41, 11


def _events_ms(launch, reps: int, start, end, sync) -> float:
    launch()
    sync()
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def torch_chain(rep: Report, sizes, reps: int) -> None:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for n in sizes:
        _torch_chain_n(rep, n, reps, start, end)
        gc.collect()


def _torch_chain_n(rep: Report, n: int, reps: int, start, end) -> None:
    import torch

    import cgraw
    from cgraw import _cuda

    sync = torch.cuda.synchronize
    y = torch.randn(NUMEL, device="cuda")
    y0 = y.clone()

    def step():
        for _ in range(n):
            y.mul_(1.0001)

    ref = y0.clone()
    for _ in range(n):
        ref.mul_(1.0001)
    with cgraw.capture() as g:
        step()

    tg = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on the side stream, as torch's docs ask
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(tg):
        step()

    raw_exec, legacy = g._exec, _cuda.drv.CUstream(0)
    raw = _cuda.drv.cuGraphLaunch

    def raw_launch():
        raw(raw_exec, legacy)

    same_as_eager = _torch_check(y, y0, ref, sync)
    rows = {
        "eager": step,
        "cgraw.replay": g.replay,
        "raw cuGraphLaunch": raw_launch,
        "torch.cuda.CUDAGraph": tg.replay,
    }
    _time_chain(rep, "torch", n, rows, same_as_eager, reps, start, end, sync)
    g.close()


def _torch_check(y, y0, ref, sync):
    """``same_as_eager(launch)``: a check that ``launch()`` turns ``y`` (reset to ``y0``) into
    ``ref`` bitwise."""
    import torch

    def same_as_eager(launch):
        def check():
            y.copy_(y0)
            launch()
            sync()
            torch.testing.assert_close(y, ref, rtol=0, atol=0)
        return check

    return same_as_eager


def _time_chain(rep: Report, framework: str, n: int, rows: dict, same_as_eager, reps: int, start, end,
                sync) -> None:
    """Check each system of a chain of ``n`` kernels against eager, then time it: device µs per
    kernel (events), host µs per step submitted, and submitted plus synchronised."""
    loops = max(20, 2000 // n)
    for system, fn in rows.items():
        # checked before it is timed (eager is the reference: it checks the harness)
        if not rep.check(f"{framework} chain n={n}: {system}", same_as_eager(fn)):
            continue
        dev_ms = _events_ms(fn, reps if system != "eager" else max(5, reps // 4), start, end, sync)
        submit = host_us(fn, loops=loops, sync=sync)
        full = host_sync_us(fn, sync, loops=max(10, loops // 4))
        rep.add(workload="chain", framework=framework, n=n, system=system,
                device_us_per_kernel=dev_ms * 1e3 / n, submit_us_per_step=submit["median_us"],
                sync_us_per_step=full["median_us"], sync_us_per_kernel=full["median_us"] / n)


def cupy_chain(rep: Report, sizes, reps: int) -> None:
    import cupy as cp

    start, end = cp.cuda.Event(), cp.cuda.Event()

    class _Ev:
        def __init__(self, e):
            self.e = e

        def record(self):
            self.e.record()

        def synchronize(self):
            self.e.synchronize()

        def elapsed_time(self, other):
            return cp.cuda.get_elapsed_time(self.e, other.e)

    s_ev, e_ev = _Ev(start), _Ev(end)
    for n in sizes:
        _cupy_chain_n(rep, n, reps, s_ev, e_ev)
        gc.collect()


def _cupy_chain_n(rep: Report, n: int, reps: int, s_ev, e_ev) -> None:
    import cupy as cp

    import cgraw

    sync = cp.cuda.Device().synchronize
    rng = np.random.default_rng()
    y = cp.asarray(rng.standard_normal(NUMEL).astype(np.float32))
    y0 = y.copy()

    def step():
        for _ in range(n):
            cp.multiply(y, np.float32(1.0001), out=y)

    step()  # warm the kernel cache
    ref = y0.copy()
    for _ in range(n):
        cp.multiply(ref, np.float32(1.0001), out=ref)
    with cgraw.capture() as g:
        step()

    cs = cp.cuda.Stream(non_blocking=True)
    with cs:
        cs.begin_capture()
        step()
        cg = cs.end_capture()
    legacy = cp.cuda.Stream.null

    def same_as_eager(launch):
        def check():
            y[...] = y0
            launch()
            sync()
            assert cp.array_equal(y, ref), "differs from eager CuPy"
        return check

    rows = {"eager": step, "cgraw.replay": g.replay, "cupy Graph.launch": lambda: cg.launch(legacy)}
    _time_chain(rep, "cupy", n, rows, same_as_eager, reps, s_ev, e_ev, sync)
    g.close()


def replay_cost(rep: Report, rounds: int = REPLAY_ROUNDS) -> dict:
    """Host cost of one replay of a 1-node graph: cgraw against raw launches of the same executable."""
    import torch
    from cuda.bindings import runtime as rt

    import cgraw
    from cgraw import _cuda

    y = torch.randn(NUMEL, device="cuda")
    with cgraw.capture() as g:
        y.mul_(1.0001)
    legacy = _cuda.drv.CUstream(0)
    exec_ = g._exec
    drv_launch = _cuda.drv.cuGraphLaunch
    rt_exec = rt.cudaGraphExec_t(_cuda.native(exec_))
    rt_stream = rt.cudaStream_t(0)
    rt_launch = rt.cudaGraphLaunch
    tg = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y.mul_(1.0001)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(tg):
        y.mul_(1.0001)
    sync = torch.cuda.synchronize
    out = {}
    # interleave the systems over rounds so drift hits them alike
    systems = {
        "cgraw.replay": g.replay,
        "raw cuGraphLaunch": lambda: drv_launch(exec_, legacy),
        "raw cudaGraphLaunch": lambda: rt_launch(rt_exec, rt_stream),
        "torch.cuda.CUDAGraph.replay": tg.replay,
    }
    y0 = y.clone()
    ref = y0 * 1.0001

    same_as_eager = _torch_check(y, y0, ref, sync)
    systems = {k: fn for k, fn in systems.items() if rep.check(f"replay_1node: {k}", same_as_eager(fn))}
    # bursts of REPLAY_BURST launches between synchronisations: the queue never fills, so the
    # figure is the host's cost and not the device time of the replays
    samples = {k: [] for k in systems}
    for _ in range(rounds):
        for k, fn in systems.items():
            samples[k].append(host_us(fn, loops=REPLAY_BURST, repeats=5, warmup=10, sync=sync)["median_us"])
    for k, v in samples.items():
        out[k] = float(np.median(v))
        rep.add(workload="replay_1node", system=k, submit_us=out[k], burst=REPLAY_BURST, rounds=rounds)
    ratios = {"ratio_cgraw_vs_raw_cuGraphLaunch": "raw cuGraphLaunch",
              "ratio_cgraw_vs_raw_cudaGraphLaunch": "raw cudaGraphLaunch",
              "ratio_cgraw_vs_torch": "torch.cuda.CUDAGraph.replay"}
    for key, peer in ratios.items():
        if "cgraw.replay" in samples and peer in samples:
            # per-round ratios: both systems were timed back to back in each round
            per_round = [a / b for a, b in zip(samples["cgraw.replay"], samples[peer])]
            out[key] = statistics.median(per_round)
            out[key + "_ci95"] = list(bootstrap_ci([per_round]))
    rep.add(workload="replay_1node", system="ratios", vs_raw_cu=out.get("ratio_cgraw_vs_raw_cuGraphLaunch"),
            vs_raw_cu_ci95=out.get("ratio_cgraw_vs_raw_cuGraphLaunch_ci95"),
            vs_raw_cuda=out.get("ratio_cgraw_vs_raw_cudaGraphLaunch"), vs_torch=out.get("ratio_cgraw_vs_torch"))
    g.close()
    return out


def _sizes(text: str) -> list:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"chain lengths are positive integers, comma-separated: {text!r}")
    return sizes


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.launch_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"chains of {', '.join(map(str, QUICK_SIZES))}, {QUICK_REPS} replays per device figure, "
                         f"{QUICK_REPLAY_ROUNDS} rounds of the 1-node replay (figures not for the README)")
    ap.add_argument("--sizes", type=_sizes, default=None,
                    help=f"chain lengths (default {','.join(map(str, SIZES))}; with --quick "
                         f"{','.join(map(str, QUICK_SIZES))})")
    ap.add_argument("--reps", type=int, default=None, help=f"replays per device figure (default {REPS})")
    ap.add_argument("--frameworks", default="torch,cupy")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/launch_overhead.json, "
                                                "launch_overhead_quick.json with --quick)")
    return ap.parse_args([] if argv is None else argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if no_gpu():
        return 2
    sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    reps = args.reps or (QUICK_REPS if args.quick else REPS)
    rep = Report("launch_overhead")
    extra = {"options": {"quick": args.quick, "sizes": sizes, "reps": reps}}
    fws = args.frameworks.split(",")
    if "torch" in fws:
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            rep.peer_missing("torch", str(exc))
        else:
            extra["replay_1node"] = replay_cost(rep, QUICK_REPLAY_ROUNDS if args.quick else REPLAY_ROUNDS)
            torch_chain(rep, sizes, reps)
    if "cupy" in fws:
        try:
            import cupy  # noqa: F401
        except ImportError as exc:
            rep.peer_missing("cupy", str(exc))
        else:
            cupy_chain(rep, sizes, reps)
    out = args.out or os.path.join(RESULTS_DIR, "launch_overhead_quick.json" if args.quick else "launch_overhead.json")
    path = rep.save(extra, path=out)
    print(f"results: {path}")
    return 1 if rep.failed_checks else 0  # a system that differs from eager fails the part


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
