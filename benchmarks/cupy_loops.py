"""CuPy-only programs, eager against captured: what a CuPy user who
does not import torch gains with CuPy's matrix products running inside ``cgraw.capture()``.

Programs (float32, one GPU, one process):
  ``mlp``  three layers ``tanh(x @ W1)``, ``tanh(. @ W2)``, ``. @ W3`` (256 wide), batch 1 and 64;
  ``cg``   20 iterations of dense conjugate gradient on a 256 x 256 symmetric positive definite
           matrix: ``A @ p``, two dot products and three vector updates per iteration, every
           scalar kept on the device (no host check inside the loop).
Systems, host microseconds per call (``host_us_interleaved``: bursts of calls, systems shuffled in
every round, a synchronise after each burst outside the timed region):
  ``eager``     the CuPy code called directly;
  ``replay``    ``cgraw.capture()`` of the same code once, then ``g.replay()`` per call (the
                inputs are the captured arrays, refreshed in place before the check);
  ``graphed``   ``@cgraw.graphed`` of the same function, called with a fresh eager input array
                every call (a tree call: the input is rebound or copied, the output handed out).
Every system is checked against eager on new input values before it is timed (allclose; CG from
the same start). ``speedup`` = eager / system, per round, with a bootstrap interval over rounds.
``python3 -m benchmarks.cupy_loops [--quick]`` writes ``benchmarks/results/cupy_loops.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks._harness import Report, bootstrap_ci, host_us_interleaved, no_gpu

WIDTH, CG_N, CG_ITERS = 256, 256, 20
ROUNDS, LOOPS = 31, 20
QUICK_ROUNDS, QUICK_LOOPS = 5, 5


def _mlp(cp, batch: int):
    rng = cp.random.RandomState(1)
    ws = [rng.standard_normal((WIDTH, WIDTH), dtype=cp.float32) / WIDTH ** 0.5 for _ in range(3)]

    def f(x):
        h = cp.tanh(x @ ws[0])
        h = cp.tanh(h @ ws[1])
        return h @ ws[2]

    def make():
        return rng.standard_normal((batch, WIDTH), dtype=cp.float32)

    return f, make


def _cg(cp):
    rng = cp.random.RandomState(2)
    m = rng.standard_normal((CG_N, CG_N), dtype=cp.float32)
    a = m @ m.T / CG_N + cp.eye(CG_N, dtype=cp.float32)

    def f(b):
        x = cp.zeros_like(b)
        r = b.copy()
        p = r.copy()
        rr = cp.dot(r, r)
        for _ in range(CG_ITERS):
            ap = a @ p
            alpha = rr / cp.dot(p, ap)
            x += alpha * p
            r -= alpha * ap
            rr_new = cp.dot(r, r)
            p = r + (rr_new / rr) * p
            rr = rr_new
        return x

    def make():
        return rng.standard_normal((CG_N,), dtype=cp.float32)

    return f, make


def _systems(rep: Report, cp, cgraw, name: str, f, make, *, rounds: int, loops: int) -> dict:
    pool = cgraw.DevicePool(cgraw.Device(cp.cuda.Device().id).set_current(), name=f"bench-{name}")
    x_static = make()
    f(x_static)  # CuPy's kernels, plans and cuBLAS handle before any capture
    with cgraw.capture(pool=pool) as g:
        y_static = f(x_static)
    graphed = cgraw.graphed(f)
    inputs = [make() for _ in range(8)]
    k = [0]

    def eager():
        return f(inputs[0])

    def replay():
        g.replay()

    def call_graphed():
        k[0] = (k[0] + 1) % len(inputs)
        return graphed(inputs[k[0]])

    def check_replay():
        x_static[...] = make()
        g.replay()
        cp.testing.assert_allclose(y_static, f(x_static), rtol=1e-4, atol=1e-4)

    def check_graphed():
        for x in inputs[:4]:  # warm-up, recording, replays
            cp.testing.assert_allclose(graphed(x), f(x), rtol=1e-4, atol=1e-4)

    systems = {"eager": eager}
    if rep.check(f"{name}/replay", check_replay):
        systems["replay"] = replay
    if rep.check(f"{name}/graphed", check_graphed):
        systems["graphed"] = call_graphed
    sync = cp.cuda.Device().synchronize
    res = host_us_interleaved(systems, loops=loops, rounds=rounds, warmup=2, sync=sync)
    out = {}
    for sys_name, r in res.items():
        row = {"program": name, "system": sys_name, "median_us": r["median_us"], "p90_us": r["p90_us"]}
        if sys_name != "eager":
            ratios = [e / s for e, s in zip(res["eager"]["samples"], r["samples"], strict=True)]
            row["speedup"] = statistics.median(ratios)
            row["speedup_ci95"] = list(bootstrap_ci([ratios]))
        out[sys_name] = rep.add(**row)
    g.close()
    cgraw.reset()
    pool.close()
    return out


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.cupy_loops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds (a smoke run; figures not for the README)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if no_gpu():
        return 2
    import cupy as cp

    import cgraw

    rounds, loops = (QUICK_ROUNDS, QUICK_LOOPS) if args.quick else (ROUNDS, LOOPS)
    rep = Report("cupy_loops_quick" if args.quick else "cupy_loops")
    summary = {}
    for name, (f, make) in (("mlp_b1", _mlp(cp, 1)), ("mlp_b64", _mlp(cp, 64)), ("cg20", _cg(cp))):
        res = _systems(rep, cp, cgraw, name, f, make, rounds=rounds, loops=loops)
        summary[name] = {s: {"median_us": r["median_us"], "speedup": r.get("speedup")} for s, r in res.items()}
    path = rep.save({"summary": summary, "method": {
        "rounds": rounds, "loops": loops, "width": WIDTH, "cg": {"n": CG_N, "iterations": CG_ITERS},
        "timing": "host_us_interleaved: median over rounds of (burst wall time / loops); sync after each burst",
        "speedup": "median over rounds of eager_us / system_us in the same round; bootstrap 95% interval"}})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
