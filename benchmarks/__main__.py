"""``python -m benchmarks``: every benchmark part in one run, each writing its JSON under results/.

Order: the real models, memory side by side with torch's trees, then the microbenchmarks (launch
overhead, graphed call and its pieces, workloads, graph-safe random numbers, allocator, eager
overhead), then which CuPy functions a capture records (cupy_coverage, issue 17: a table, not
timings) and CuPy-only loops, then training steps (issue 16: autograd through graphed functions
against whole-step graphs, make_graphed_callables and reduce-overhead), then graphed calls from
1, 2 and 8 threads (throughput and memory against eager and one serialised tree), then zero-copy inputs
(rebind, issue 12; last, because it drives the newest runtime code and a sticky CUDA error there
would fail every later part of the process). ``--only PART[,PART]``
runs those parts (in this order). With no GPU it exits with status 2 and a one-line reason. A part
that raises is reported and the others still run; the exit status is then 1. The CPU-only
allocator figure is ``python -m benchmarks.alloc_overhead``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

from benchmarks._harness import no_gpu

# part -> (module, arguments of its main)
PARTS = {
    "models": ("benchmarks.models", []),
    "memory": ("benchmarks.memory", []),
    "launch": ("benchmarks.launch_overhead", None),
    "graphed": ("benchmarks.graphed_call", []),
    "profile": ("benchmarks.profile_graphed", []),
    "workloads": ("benchmarks.workloads", []),
    "rng": ("benchmarks.rng", []),
    "alloc": ("benchmarks.alloc_gpu", []),
    "eager": ("benchmarks.eager_overhead", []),
    "cupy_coverage": ("benchmarks.cupy_coverage", []),
    "cupy_loops": ("benchmarks.cupy_loops", []),
    "training": ("benchmarks.training", []),
    "threads": ("benchmarks.threads", []),
    "rebind": ("benchmarks.rebind", []),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks")
    ap.add_argument("--only", type=_parts, default=None, help=f"comma-separated parts of: {', '.join(PARTS)}")
    ap.add_argument("--sizes", default="1,16,256,1024", help="chain lengths for the launch benchmark")
    args = ap.parse_args(argv)

    if no_gpu():
        return 2
    failed = []
    for part, (module, part_args) in PARTS.items():
        if args.only is not None and part not in args.only:
            continue
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(module)
            rc = mod.main(["--sizes", args.sizes] if part_args is None else part_args)
        except Exception:  # noqa: BLE001 -- one part's failure must not hide the others' results
            traceback.print_exc()
            rc = "raised"
        print(f"[benchmarks] part {part}: {time.perf_counter() - t0:.1f} s, status {rc}", flush=True)
        if rc not in (None, 0):
            failed.append(part)
    if failed:
        print(f"[benchmarks] failed parts: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _parts(text: str) -> frozenset:
    parts = frozenset(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(parts - set(PARTS))
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown or text!r}; choose from {', '.join(PARTS)}")
    return parts


if __name__ == "__main__":
    raise SystemExit(main())
