"""Profile the graphed-call hot path: cProfile of many steady-state calls, plus timings of the
pieces a call is made of (launch, output alias, poisoning, input inspection).

``python -m benchmarks.profile_graphed [k]`` on the GPU machine; prints the top functions by own time.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import timeit


def main(k: int = 1) -> None:
    import torch

    import cgraw
    from cgraw import _cuda

    def fn(*xs):
        out = xs[0] * 2.0
        for x in xs[1:]:
            out = out + x
        return out

    xs = [torch.randn(1024, device="cuda") for _ in range(k)]
    g = cgraw.graphed(fn)
    for _ in range(5):
        g(*xs)
    torch.cuda.synchronize()
    n = 20000
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        g(*xs)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    mgr = sys.modules["cgraw.graphed"]._managers[0]
    node = next(iter(mgr.roots.values()))
    rec = node.recording
    t = rec.out_leaves[0]
    y = t.detach()
    msg = "x"
    pieces = {
        "whole call": lambda: g(*xs),
        "Graph.replay": rec.graph.replay,
        "raw cuGraphLaunch": lambda: _cuda.graph_launch_raw(rec.graph._exec, _cuda.drv.CUstream(0)),
        "t.detach()": t.detach,
        "poison (_set_storage_access_error_msg)": lambda: torch._C._set_storage_access_error_msg(t.detach(), msg),
        "backend.inspect": lambda: mgr.backend.inspect(g, tuple(xs), None, {}),
        "x.data_ptr()": xs[0].data_ptr,
        "x.stride()": xs[0].stride,
        "x.get_device()": xs[0].get_device,
    }
    del y
    for name, f in pieces.items():
        reps = 20000
        dt = min(timeit.repeat(f, number=reps, repeat=5)) / reps * 1e6
        print(f"{name:45s} {dt:7.2f} us")
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
