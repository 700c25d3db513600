"""Realistic steps and tree memory, each system in the same run.

(c) a torch MLP inference step (batch 1 and 32), a CuPy Jacobi stencil (10 iterations of 13
    kernels: 130 kernels; the JSON records the node count of cgraw's graph, which adds the
    input-copy nodes), and a mixed torch -> CuPy -> torch step: host microseconds per call
    (submit + synchronise), eager against ``@cgraw.graphed`` and the peers that apply;
(d) tree memory: pool bytes of a two-branch tree against the larger branch alone and against two
    separately captured graphs.
Every system's result (peers included) is checked against eager before it is timed; one that
differs is recorded under ``failed_checks`` and not timed (its figure is null).
"""

from __future__ import annotations

import argparse
import gc
import sys

import numpy as np

from benchmarks._harness import Report, alternating, host_sync_us, no_gpu


def _mlp(rep: Report) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10)).cuda().eval()
    for batch in (1, 32):
        _mlp_batch(rep, model, batch)


def _mlp_batch(rep: Report, model, batch: int) -> None:
    import torch

    import cgraw

    sync = torch.cuda.synchronize
    xs = [torch.randn(batch, 256, device="cuda") for _ in range(2)]

    @torch.no_grad()
    def step(x):
        return model(x).softmax(-1)

    def same_as_eager(call, calls=2):
        def check():
            for x in xs * calls:
                torch.testing.assert_close(call(x), step(x), rtol=1e-4, atol=1e-5)
        return check

    row = {"eager_us": host_sync_us(alternating(step, xs), sync, loops=300)["median_us"]}
    cgraw.reset()
    g = cgraw.graphed(step)
    row["cgraw_graphed_us"] = None
    if rep.check(f"mlp batch {batch}: cgraw.graphed", same_as_eager(g)):
        row["cgraw_graphed_us"] = host_sync_us(alternating(g, xs), sync, loops=300)["median_us"]

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

    row["torch_cudagraph_copy_us"] = None
    if rep.check(f"mlp batch {batch}: torch.cuda.CUDAGraph + copy_", same_as_eager(hand, calls=1)):
        row["torch_cudagraph_copy_us"] = host_sync_us(alternating(hand, xs), sync, loops=300)["median_us"]
    row["reduce_overhead_us"] = None
    try:
        torch._dynamo.reset()
        ro = torch.compile(step, mode="reduce-overhead")

        def ro_call(x):
            torch.compiler.cudagraph_mark_step_begin()
            return ro(x)

        for x in xs * 2:  # compile, warm up and record before the check
            ro_call(x)
    except Exception as exc:  # noqa: BLE001 -- a peer that does not work is reported, not hidden
        rep.peer_missing(f"torch.compile reduce-overhead (mlp batch {batch})", repr(exc)[:300])
    else:
        if rep.check(f"mlp batch {batch}: torch.compile reduce-overhead", same_as_eager(ro_call)):
            row["reduce_overhead_us"] = host_sync_us(alternating(ro_call, xs), sync, loops=300)["median_us"]
    rep.add(workload="mlp_inference", batch=batch, **row)
    cgraw.reset()


JACOBI_ITERATIONS = 10


def _jacobi(u, f):
    """``JACOBI_ITERATIONS`` iterations of 4 ``cp.roll``s (2 copy kernels each: CuPy rolls by
    assigning two slices) and 5 elementwise ops: 13 kernels an iteration."""
    import cupy as cp

    for _ in range(JACOBI_ITERATIONS):
        nb = cp.roll(u, 1, 0) + cp.roll(u, -1, 0) + cp.roll(u, 1, 1)
        u = 0.25 * (nb + cp.roll(u, -1, 1) - f)
    return u


def _graph_node_counts(fn) -> dict:
    """Node counts of the recordings of graphed function ``fn`` on device 0: total and by type."""
    from cgraw.trees.graphed import _managers

    mgr = _managers.get(0)
    by_type: dict[str, int] = {}
    total = 0
    if mgr is not None:
        for node in mgr.nodes():
            if node.fn is fn and node.recording is not None:
                for info in node.recording.graph.nodes():
                    by_type[info.type] = by_type.get(info.type, 0) + 1
                    total += 1
    return {"graph_nodes": total, "graph_nodes_by_type": by_type}


def _stencil(rep: Report) -> None:
    import cupy as cp

    import cgraw

    sync = cp.cuda.Device().synchronize
    rng = np.random.default_rng()
    jacobi = _jacobi
    us = [cp.asarray(rng.standard_normal((256, 256)).astype(np.float32)) for _ in range(2)]
    f = cp.asarray(rng.standard_normal((256, 256)).astype(np.float32))

    def same_as_eager(call):
        def check():
            for u in us * 2:
                assert cp.allclose(call(u, f), jacobi(u, f), rtol=1e-5, atol=1e-5), "differs from eager CuPy"
        return check

    row = {"iterations": JACOBI_ITERATIONS,
           "eager_us": host_sync_us(alternating(jacobi, us, f), sync, loops=100)["median_us"]}
    cgraw.reset()
    g = cgraw.graphed(jacobi)
    row["cgraw_graphed_us"] = None
    if rep.check("jacobi: cgraw.graphed", same_as_eager(g)):
        row.update(_graph_node_counts(g))
        row["cgraw_graphed_us"] = host_sync_us(alternating(g, us, f), sync, loops=100)["median_us"]
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

    row["cupy_graph_copy_us"] = None
    if rep.check("jacobi: CuPy graph + copy", same_as_eager(cupy_graph)):
        row["cupy_graph_copy_us"] = host_sync_us(alternating(cupy_graph, us, f), sync, loops=100)["median_us"]
    rep.add(workload="cupy_jacobi", **row)
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

    def check():
        for x in xs * 2:
            torch.testing.assert_close(g(x), step(x), rtol=1e-4, atol=1e-5)

    row = {"eager_us": host_sync_us(alternating(step, xs), sync, loops=300)["median_us"], "cgraw_graphed_us": None}
    cgraw.reset()
    g = cgraw.graphed(step)
    if rep.check("mixed step: cgraw.graphed", check):
        row["cgraw_graphed_us"] = host_sync_us(alternating(g, xs), sync, loops=300)["median_us"]
    rep.add(workload="mixed_torch_cupy_step", **row)
    cgraw.reset()


def _tree_memory(rep: Report) -> None:
    import torch

    import cgraw
    from cgraw.trees.graphed import _managers

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

    got = {}
    if not rep.check("tree memory: two-branch tree", lambda: got.update(one=walk([True] * 4),
                                                                         both=walk([True, False] * 4))):
        cgraw.reset()
        return
    one, both = got["one"], got["both"]
    cgraw.reset()
    sep = 0
    graphs = []
    for fn2 in (e2, e3):
        x = torch.randn(n, device="cuda")
        with cgraw.capture() as gr:
            out = fn2(e1(x))
        graphs.append((gr, fn2, x, out))
        sep += gr.pool.torch_reserved_bytes + gr.pool.stats().reserved_bytes

    def separate_graphs_equal_eager(graphs=graphs):
        for gr, fn2, x, out in graphs:
            gr.replay()
            torch.testing.assert_close(out, fn2(e1(x)))

    rep.check("tree memory: two separately captured graphs", separate_graphs_equal_eager)
    rep.add(workload="tree_memory_two_branches", larger_branch_alone_bytes=one, two_branch_tree_bytes=both,
            two_separate_graphs_bytes=sep, ratio_tree_vs_branch=both / one, ratio_tree_vs_separate=both / sep)
    del graphs
    gc.collect()
    cgraw.reset()


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.workloads", description=__doc__.split("\n\n")[0])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    _parse(argv)
    if no_gpu():
        return 2
    rep = Report("workloads")
    _mlp(rep)
    _stencil(rep)
    _mixed(rep)
    _tree_memory(rep)
    print(f"results: {rep.save()}")
    return 1 if rep.failed_checks else 0  # a system that differs from eager fails the part


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
