"""``python -m benchmarks``: the launch-overhead benchmark, then the allocator comparison.

With no GPU it exits with status 2 and a one-line reason. ``--only launch`` or ``--only alloc``
runs one part; the CPU-only allocator figure is ``python -m benchmarks.alloc_overhead``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks")
    ap.add_argument("--only", choices=["launch", "alloc", "eager", "graphed", "workloads"], default=None)
    ap.add_argument("--sizes", default="1,16,256,1024", help="chain lengths for the launch benchmark")
    args = ap.parse_args(argv)

    from cgraw import _cuda

    ok, reason = _cuda.driver_available()
    if not ok:
        print(f"benchmarks need a CUDA GPU: {reason}", file=sys.stderr)
        return 2
    if args.only in (None, "launch"):
        from benchmarks import launch_overhead

        launch_overhead.main(["--sizes", args.sizes])
    if args.only in (None, "graphed"):
        from benchmarks import graphed_call

        graphed_call.main([])
    if args.only in (None, "workloads"):
        from benchmarks import workloads

        workloads.main([])
    if args.only in (None, "alloc"):
        from benchmarks import alloc_gpu

        alloc_gpu.main([])
    if args.only in (None, "eager"):
        from benchmarks import eager_overhead

        eager_overhead.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
