"""Control flow on the device: a conjugate-gradient solve of a 2-D Poisson system (5-point stencil
on an n x n grid, written with slicing, so no library call) run three ways, each checked against
the host loop first (same iteration count, solution within 1e-10 relative), then timed:

- ``eager``: ``cgraw.while_loop`` outside a capture: the host reads the residual after every
  iteration (one synchronisation per iteration);
- ``graph_per_iteration``: one iteration captured with ``cgraw.capture()`` (body and next
  predicate), replayed from a host loop that reads the predicate after each replay;
- ``one_launch``: the whole loop captured as one WHILE node (``cgraw.while_loop`` inside
  ``cgraw.capture()``): one replay per solve, one synchronisation.

Wall microseconds per solve (submission plus completion: ``host_sync_us`` with a synchronise in the
timed region), the systems interleaved by rounds, and the speedups over ``eager`` per round with a
bootstrap interval. Beside them, the one-iteration graph replayed as many times back to back with
no host read (``body_graph_us_per_iteration``: the body's device time, gaps between launches
included) and ``one_launch`` per iteration over it. ``--framework`` picks CuPy (default) or torch; sizes with ``--sizes``.
``python3 -m benchmarks.control_flow [--quick]`` writes ``benchmarks/results/control_flow.json``
(``control_flow_quick.json``); also part ``control_flow`` of ``python3 -m benchmarks``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks._harness import Report, bootstrap_ci, no_gpu

SIZES = (32, 64, 128)
QUICK_SIZES = (32,)
ROUNDS, QUICK_ROUNDS = 15, 5
TOL = 1e-8
MAXIT = 5000


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.control_flow", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"grid {QUICK_SIZES} only, {QUICK_ROUNDS} rounds")
    ap.add_argument("--framework", choices=("cupy", "torch"), default="cupy")
    ap.add_argument("--sizes", type=lambda s: tuple(int(v) for v in s.split(",")), default=None,
                    help="grid sizes n (n x n unknowns), comma-separated")
    return ap.parse_args(argv)


def problem(n: int):
    """``(matvec, cond_fn, body_fn)`` of CG on the n x n Poisson matrix, for CuPy arrays and torch
    tensors alike."""
    def matvec(v):
        u = v.reshape(n, n)
        out = 4 * u
        out[1:, :] -= u[:-1, :]
        out[:-1, :] -= u[1:, :]
        out[:, 1:] -= u[:, :-1]
        out[:, :-1] -= u[:, 1:]
        return out.reshape(-1)

    def cond_fn(x, r, p, rs, k):
        return (rs > TOL * TOL) & (k < MAXIT)

    def body_fn(x, r, p, rs, k):
        ap = matvec(p)
        alpha = rs / (p * ap).sum()
        x = x + alpha * p
        r = r - alpha * ap
        rs_new = (r * r).sum()
        return x, r, r + (rs_new / rs) * p, rs_new, k + 1

    return matvec, cond_fn, body_fn


def _arrays(fw: str, n: int, seed: int):
    import numpy as np

    b = np.random.default_rng(seed).standard_normal(n * n)
    if fw == "cupy":
        import cupy as cp

        return cp, cp.asarray(b), (lambda: cp.cuda.get_current_stream().synchronize()), cp.zeros((), dtype=cp.int32)
    import torch

    return (torch, torch.as_tensor(b, device="cuda"), torch.cuda.synchronize,
            torch.zeros((), dtype=torch.int32, device="cuda"))


def _systems(cgraw, b, k0, sync, n: int):
    """The three solves of ``A x = b`` as no-argument callables returning ``(x, iterations)``."""
    _, cond_fn, body_fn = problem(n)
    zeros = b * 0

    def start():
        return (zeros, b, b, (b * b).sum(), k0)

    def eager():
        out = cgraw.while_loop(cond_fn, body_fn, start())
        return out[0], int(out[4])

    # one iteration: the carried state lives in fixed arrays the graph reads and writes
    state = [v * 1 for v in start()]
    with cgraw.capture() as g_iter:
        nxt = body_fn(*state)
        for dst, src in zip(state, nxt):
            dst[...] = src
        pred = cond_fn(*state)

    def per_iteration():
        for dst, src in zip(state, start()):
            dst[...] = src
        go = bool(cond_fn(*state))
        while go:
            g_iter.replay()
            go = bool(pred)  # the host reads the predicate the replay computed
        return state[0], int(state[4])

    def body_chain(iterations: int):
        """The one-iteration graph replayed ``iterations`` times back to back, no host read: the
        body's device time per iteration (gaps between launches included)."""
        for dst, src in zip(state, start()):
            dst[...] = src
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            g_iter.replay()
        sync()
        return (time.perf_counter_ns() - t0) / 1e3 / iterations

    with cgraw.capture() as g_loop:
        loop_out = cgraw.while_loop(cond_fn, body_fn, start())

    def one_launch():
        g_loop.replay()
        sync()
        return loop_out[0], int(loop_out[4])

    return {"eager": eager, "graph_per_iteration": per_iteration, "one_launch": one_launch}, (g_iter, g_loop), body_chain


def main(argv=None) -> int:
    args = _parse(argv)
    if no_gpu():
        return 2
    import cgraw

    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    rep = Report("control_flow_quick" if args.quick else "control_flow")
    summary = {}
    for n in sizes:
        _, b, sync, k0 = _arrays(args.framework, n, seed=n)
        systems, graphs, body_chain = _systems(cgraw, b, k0, sync, n)
        ref_x, ref_k = systems["eager"]()
        ok = {}
        for name, fn in systems.items():
            def check(fn=fn):
                x, k = fn()
                sync()
                err = float(abs(x - ref_x).max()) / max(float(abs(ref_x).max()), 1e-30)
                if k != ref_k or err > 1e-10:
                    raise AssertionError(f"{k} iterations (eager {ref_k}), relative difference {err:.2e}")
            ok[name] = rep.check(f"{name}@{n}", check)
        samples = {name: [] for name in systems if ok[name]}
        for _ in range(rounds):
            for name in samples:
                sync()
                t0 = time.perf_counter_ns()
                systems[name]()
                sync()
                samples[name].append((time.perf_counter_ns() - t0) / 1e3)
        row = {"n": n, "unknowns": n * n, "iterations": ref_k, "framework": args.framework}
        for name, v in samples.items():
            row[f"{name}_us"] = statistics.median(v)
            if name != "eager" and "eager" in samples:
                ratios = [e / s for e, s in zip(samples["eager"], v)]
                row[f"{name}_speedup"] = statistics.median(ratios)
                row[f"{name}_speedup_ci"] = bootstrap_ci([ratios])
        if "one_launch" in samples:
            row["body_graph_us_per_iteration"] = statistics.median(body_chain(ref_k) for _ in range(rounds))
            row["one_launch_us_per_iteration"] = row["one_launch_us"] / ref_k
            row["one_launch_over_body_graph"] = row["one_launch_us_per_iteration"] / row["body_graph_us_per_iteration"]
            if "graph_per_iteration" in samples:
                row["one_launch_over_graph_per_iteration"] = row["one_launch_us"] / row["graph_per_iteration_us"]
        summary[n] = rep.add(**row)
        for g in graphs:
            g.close()
    path = rep.save({"summary": summary, "method": {
        "rounds": rounds, "tol": TOL, "maxit": MAXIT,
        "timing": "wall us per solve, a synchronise before and inside the timed region; systems interleaved by round"}})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
