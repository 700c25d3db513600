"""Launch overhead: eager torch/CuPy against cgraw replay and its peers, same work, same run.

Peers: eager torch, eager CuPy, ``torch.cuda.CUDAGraph``, CuPy's ``Stream.begin_capture`` graphs,
and a raw cuda-python ``cuGraphLaunch``/``cudaGraphLaunch`` of the very executable cgraw replays.
Workload: a chain of N dependent tiny kernels (``y *= 1.0001`` on 1,024 floats), N = 1, 16, 256,
1024. Device time per kernel comes from CUDA events around R replays; host time is
``perf_counter`` around loops of submissions ("submit") or submissions plus a synchronise ("sync").
"""

from __future__ import annotations

import argparse
import gc

import numpy as np

from benchmarks._harness import Report, host_sync_us, host_us

SIZES = (1, 16, 256, 1024)
NUMEL = 1024


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

    import cgraw
    from cgraw import _cuda

    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for n in sizes:
        y = torch.randn(NUMEL, device=dev)
        y0 = y.clone()

        def step():
            for _ in range(n):
                y.mul_(1.0001)

        # correctness first: a replay equals the eager chain
        with cgraw.capture() as g:
            step()
        y.copy_(y0)
        g.replay()
        ref = y0.clone()
        for _ in range(n):
            ref.mul_(1.0001)
        torch.testing.assert_close(y, ref, rtol=0, atol=0)

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

        loops = max(20, 2000 // n)
        rows = {
            "eager": (step, None),
            "cgraw.replay": (g.replay, None),
            "raw cuGraphLaunch": (raw_launch, None),
            "torch.cuda.CUDAGraph": (tg.replay, None),
        }
        for system, (fn, _) in rows.items():
            dev_ms = _events_ms(fn, reps if system != "eager" else max(5, reps // 4), start, end, sync)
            submit = host_us(fn, loops=loops, sync=sync)
            full = host_sync_us(fn, sync, loops=max(10, loops // 4))
            rep.add(workload="chain", framework="torch", n=n, system=system,
                    device_us_per_kernel=dev_ms * 1e3 / n, submit_us_per_step=submit["median_us"],
                    sync_us_per_step=full["median_us"], sync_us_per_kernel=full["median_us"] / n)
        g.close()
        del tg
        gc.collect()


def cupy_chain(rep: Report, sizes, reps: int) -> None:
    import cupy as cp

    import cgraw

    sync = cp.cuda.Device().synchronize
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
    rng = np.random.default_rng()
    for n in sizes:
        y = cp.asarray(rng.standard_normal(NUMEL).astype(np.float32))
        y0 = y.copy()

        def step():
            for _ in range(n):
                cp.multiply(y, np.float32(1.0001), out=y)

        step()  # warm the kernel cache
        with cgraw.capture() as g:
            step()
        y[...] = y0
        g.replay()
        ref = y0.copy()
        for _ in range(n):
            cp.multiply(ref, np.float32(1.0001), out=ref)
        assert cp.array_equal(y, ref), "cgraw replay differs from eager CuPy"

        cs = cp.cuda.Stream(non_blocking=True)
        with cs:
            cs.begin_capture()
            step()
            cg = cs.end_capture()
        legacy = cp.cuda.Stream.null
        rows = {"eager": step, "cgraw.replay": g.replay, "cupy Graph.launch": lambda: cg.launch(legacy)}
        loops = max(20, 2000 // n)
        for system, fn in rows.items():
            dev_ms = _events_ms(fn, reps if system != "eager" else max(5, reps // 4), s_ev, e_ev, sync)
            submit = host_us(fn, loops=loops, sync=sync)
            full = host_sync_us(fn, sync, loops=max(10, loops // 4))
            rep.add(workload="chain", framework="cupy", n=n, system=system,
                    device_us_per_kernel=dev_ms * 1e3 / n, submit_us_per_step=submit["median_us"],
                    sync_us_per_step=full["median_us"], sync_us_per_kernel=full["median_us"] / n)
        g.close()
        gc.collect()


def replay_cost(rep: Report) -> dict:
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
    samples = {k: [] for k in systems}
    for _ in range(5):
        for k, fn in systems.items():
            samples[k].append(host_us(fn, loops=2000, repeats=3, sync=sync)["median_us"])
    for k, v in samples.items():
        out[k] = float(np.median(v))
        rep.add(workload="replay_1node", system=k, submit_us=out[k])
    out["ratio_cgraw_vs_raw_cuGraphLaunch"] = out["cgraw.replay"] / out["raw cuGraphLaunch"]
    out["ratio_cgraw_vs_raw_cudaGraphLaunch"] = out["cgraw.replay"] / out["raw cudaGraphLaunch"]
    out["ratio_cgraw_vs_torch"] = out["cgraw.replay"] / out["torch.cuda.CUDAGraph.replay"]
    rep.add(workload="replay_1node", system="ratios",
            vs_raw_cu=out["ratio_cgraw_vs_raw_cuGraphLaunch"],
            vs_raw_cuda=out["ratio_cgraw_vs_raw_cudaGraphLaunch"], vs_torch=out["ratio_cgraw_vs_torch"])
    g.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.launch_overhead")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--frameworks", default="torch,cupy")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rep = Report("launch_overhead")
    extra = {}
    fws = args.frameworks.split(",")
    if "torch" in fws:
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            rep.peer_missing("torch", str(exc))
        else:
            extra["replay_1node"] = replay_cost(rep)
            torch_chain(rep, sizes, args.reps)
    if "cupy" in fws:
        try:
            import cupy  # noqa: F401
        except ImportError as exc:
            rep.peer_missing("cupy", str(exc))
        else:
            cupy_chain(rep, sizes, args.reps)
    path = rep.save(extra)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
