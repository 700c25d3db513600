"""Compile time of one compiled system of the models benchmark alone: the wall time of
``torch.compile`` and the first three calls of a workload, in this process, with empty Inductor
and Triton caches (a cold compile, nothing else compiling beside it). ``benchmarks.models
--compile-jobs 3`` compiles three systems at once, which shares the host's cores between them;
this times one at a time. With ``--profile``, the same under cProfile: the cumulative time of
cgraw's functions and of Inductor's compile phases (where a system's extra compile time goes).

A diagnostic, not a benchmark: run it once per system, in turns, each in a fresh process.
From the repository root, on a GPU: ``python3 -m tools.probes.compile_probe cgraw_backend
llama_decode [--profile]`` (systems: ``reduce_overhead``, ``cgraw_backend``,
``cgraw_over_compile``; workloads: ``benchmarks.models``'s inference and decode workloads).
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time

CGRAW_PARTS = r"cgraw/(trees|interop|_cuda|rebind|runtime)"
INDUCTOR_PARTS = (r"(compile_fx|codecache|autotune|benchmark|async_compile|triton_heuristics|graph.py"
                  r"|scheduler|select_algorithm)")


def _first_calls(models, torch, wl, system: str) -> None:
    """``torch.compile`` of ``wl`` as ``system`` makes it, then three calls, then a synchronise."""
    if wl.kind == "decode":
        cache = wl.new_cache()
        call, _ = models._make_call(system, wl.step, (cache,))
        tok = wl.prefill(cache)
        for i in range(3):
            tok = call(tok, wl.positions[i:i + 1]).clone()
    else:
        call, _ = models._make_call(system, wl.fn)
        xs = wl.inputs()
        for _ in range(3):
            call(*xs)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("system")
    ap.add_argument("workload")
    ap.add_argument("--profile", action="store_true", help="cProfile the compile and print its parts")
    args = ap.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="cgraw_compile_probe_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # before torch reads them: a cold compile
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    import cProfile
    import pstats

    import torch

    from benchmarks import models

    models._fp32(torch)
    wl = models._build(args.workload)
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    _first_calls(models, torch, wl, args.system)
    if prof is not None:
        prof.disable()
    print(f"{args.system} {args.workload}: torch.compile and the first 3 calls {time.perf_counter() - t0:.2f} s, "
          f"profiled={prof is not None}", flush=True)
    if prof is not None:
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(CGRAW_PARTS, 25)
        stats.sort_stats("cumulative").print_stats(INDUCTOR_PARTS, 18)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
