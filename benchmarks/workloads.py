"""Realistic steps and tree memory, each system in the same run.

(c) a torch MLP inference step (batch 1 and 32), a CuPy Jacobi stencil loop of 50 kernels, and a
    mixed torch -> CuPy -> torch step: host microseconds per call (submit + synchronise), eager
    against ``@cgraw.graphed`` and the peers that apply;
(d) tree memory: pool bytes of a two-branch tree against the larger branch alone and against two
    separately captured graphs.
Every graphed result is checked against eager before timing.
"""

from __future__ import annotations

import gc

import numpy as np

from benchmarks._harness import Report, alternating, host_sync_us


def _mlp(rep: Report) -> None:
    import torch

    import cgraw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10)).cuda().eval()
    sync = torch.cuda.synchronize
    for batch in (1, 32):
        xs = [torch.randn(batch, 256, device="cuda") for _ in range(2)]

        @torch.no_grad()
        def step(x):
            return model(x).softmax(-1)

        cgraw.reset()
        g = cgraw.graphed(step)
        for x in xs * 2:
            torch.testing.assert_close(g(x), step(x), rtol=1e-4, atol=1e-5)
        row = {"eager_us": host_sync_us(alternating(step, xs), sync, loops=300)["median_us"],
               "cgraw_graphed_us": host_sync_us(alternating(g, xs), sync, loops=300)["median_us"]}
        static = xs[0].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(static)
        torch.cuda.current_stream().wait_stream(s)
        tg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tg):
            static_out = step(static)

        def hand(x):
            static.copy_(x)
            tg.replay()
            return static_out

        row["torch_cudagraph_copy_us"] = host_sync_us(alternating(hand, xs), sync, loops=300)["median_us"]
        try:
            torch._dynamo.reset()
            ro = torch.compile(step, mode="reduce-overhead")

            def ro_call(x):
                torch.compiler.cudagraph_mark_step_begin()
                return ro(x)

            for x in xs * 3:
                torch.testing.assert_close(ro_call(x), step(x), rtol=1e-4, atol=1e-5)
            row["reduce_overhead_us"] = host_sync_us(alternating(ro_call, xs), sync, loops=300)["median_us"]
        except Exception as exc:
            rep.peer_missing(f"torch.compile reduce-overhead (mlp batch {batch})", repr(exc)[:300])
        rep.add(workload="mlp_inference", batch=batch, **row)
        cgraw.reset()


def _stencil(rep: Report) -> None:
    import cupy as cp

    import cgraw

    sync = cp.cuda.Device().synchronize
    rng = np.random.default_rng()

    def jacobi(u, f):
        for _ in range(10):  # 5 kernels an iteration: 50 kernels
            nb = cp.roll(u, 1, 0) + cp.roll(u, -1, 0) + cp.roll(u, 1, 1)
            u = 0.25 * (nb + cp.roll(u, -1, 1) - f)
        return u

    us = [cp.asarray(rng.standard_normal((256, 256)).astype(np.float32)) for _ in range(2)]
    f = cp.asarray(rng.standard_normal((256, 256)).astype(np.float32))
    cgraw.reset()
    g = cgraw.graphed(jacobi)
    for u in us * 2:
        assert cp.allclose(g(u, f), jacobi(u, f), rtol=1e-5, atol=1e-5)
    row = {"eager_us": host_sync_us(alternating(jacobi, us, f), sync, loops=100)["median_us"],
           "cgraw_graphed_us": host_sync_us(alternating(g, us, f), sync, loops=100)["median_us"]}
    static = us[0].copy()
    cs = cp.cuda.Stream(non_blocking=True)
    with cs:
        jacobi(static, f)
        cs.begin_capture()
        out = jacobi(static, f)
        cgraph = cs.end_capture()

    def cupy_graph(u, f_):
        static[...] = u
        cgraph.launch(cp.cuda.Stream.null)
        return out

    row["cupy_graph_copy_us"] = host_sync_us(alternating(cupy_graph, us, f), sync, loops=100)["median_us"]
    rep.add(workload="cupy_jacobi_50_kernels", **row)
    cgraw.reset()


def _mixed(rep: Report) -> None:
    import cupy as cp
    import torch

    import cgraw

    sync = torch.cuda.synchronize
    w = torch.randn(128, 128, device="cuda")

    def step(x):
        h = x @ w
        c = cp.tanh(cp.from_dlpack(h)) * 2.0 + 1.0
        return torch.from_dlpack(c).softmax(-1)

    xs = [torch.randn(32, 128, device="cuda") for _ in range(2)]
    cgraw.reset()
    g = cgraw.graphed(step)
    for x in xs * 2:
        torch.testing.assert_close(g(x), step(x), rtol=1e-4, atol=1e-5)
    rep.add(workload="mixed_torch_cupy_step", eager_us=host_sync_us(alternating(step, xs), sync, loops=300)["median_us"],
            cgraw_graphed_us=host_sync_us(alternating(g, xs), sync, loops=300)["median_us"])
    cgraw.reset()


def _tree_memory(rep: Report) -> None:
    import torch

    import cgraw
    from cgraw.graphed import _managers

    n = 4 << 20  # 16 MiB tensors

    def e1(x):
        return x * 2.0

    def e2(y):
        return torch.sin(y) + y

    def e3(y):
        return torch.cos(y) * y

    def pool_bytes():
        p = _managers[0].backend.pool
        return p.torch_reserved_bytes + p.stats().reserved_bytes

    def walk(branches):
        cgraw.reset()
        g1, g2, g3 = cgraw.graphed(e1), cgraw.graphed(e2), cgraw.graphed(e3)
        for b in branches:
            x = torch.randn(n, device="cuda")
            y = g1(x)
            out = g2(y) if b else g3(y)
            ref = e2(e1(x)) if b else e3(e1(x))
            torch.testing.assert_close(out, ref)
        return pool_bytes()

    one = walk([True] * 4)
    both = walk([True, False] * 4)
    cgraw.reset()
    sep = 0
    graphs = []
    for fn2 in (e2, e3):
        x = torch.randn(n, device="cuda")
        with cgraw.capture() as gr:
            fn2(e1(x))
        graphs.append((gr, x))
        sep += gr.pool.torch_reserved_bytes + gr.pool.stats().reserved_bytes
    rep.add(workload="tree_memory_two_branches", larger_branch_alone_bytes=one, two_branch_tree_bytes=both,
            two_separate_graphs_bytes=sep, ratio_tree_vs_branch=both / one, ratio_tree_vs_separate=both / sep)
    del graphs
    gc.collect()
    cgraw.reset()


def main(argv=None) -> int:
    rep = Report("workloads")
    _mlp(rep)
    _stencil(rep)
    _mixed(rep)
    _tree_memory(rep)
    print(f"results: {rep.save()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
