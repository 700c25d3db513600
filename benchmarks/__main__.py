"""``python3 -m benchmarks``: the quick run, a few minutes on one GPU, then one summary table.

The quick run is the parts a user compares cgraw by, each in its ``--quick`` form (fewer sizes and
rounds; figures for a first look, not for the README): ``launch`` (replay and launch overhead
against eager, raw launches and the frameworks' own graphs), ``graphed`` (the per-call cost of a
graphed function against a hand-made ``torch.cuda.CUDAGraph`` with ``copy_``, reduce-overhead and
the driver's floor) and ``models`` (GPT-2 at batch 1: eager, cgraw, a hand-made graph and
reduce-overhead). Each writes its JSON under ``--out-dir`` (default ``benchmarks/results/``, as
``*_quick.json``); the table is read back from those files.

``--full`` runs every part in its full form, each writing its JSON under ``benchmarks/results/``.
Order: the real models, memory side by side with torch's trees, then the microbenchmarks (launch
overhead, graphed call and its pieces, workloads, graph-safe random numbers and what following
the frameworks' seeds costs a call, allocator, eager overhead), then which CuPy functions a
capture records (cupy_coverage: a table, not timings) and CuPy-only loops, then training steps
(autograd through graphed functions against whole-step graphs, make_graphed_callables and
reduce-overhead), then graphed calls from 1, 2 and 8 threads (throughput and memory against eager
and one serialised tree), then control flow on the device (a conjugate-gradient solve in one
launch against a host loop of per-iteration graphs and eager), then zero-copy inputs (rebind; last, because it rewrites kernel
arguments of live graphs, and a sticky CUDA error there would fail every later part of the process).
``--only PART[,PART]`` runs those parts of the full run (in this order).

With no GPU it exits with status 2 and a one-line reason. A part that raises is reported and the
others still run; the exit status is then 1. The CPU-only allocator figure is
``python3 -m benchmarks.alloc_overhead``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback

from benchmarks import summary
from benchmarks._harness import RESULTS_DIR, no_gpu

# part -> (module, arguments of its main in the full run); every module also has ``_parse(argv)``,
# its command line parsed and nothing run
PARTS = {
    "models": ("benchmarks.models", []),
    "memory": ("benchmarks.memory", []),
    "launch": ("benchmarks.launch_overhead", []),
    "graphed": ("benchmarks.graphed_call", []),
    "profile": ("benchmarks.profile_graphed", []),
    "workloads": ("benchmarks.workloads", []),
    "rng": ("benchmarks.rng", []),
    "rng_seed": ("benchmarks.rng_seed", []),
    "alloc": ("benchmarks.alloc_gpu", []),
    "eager": ("benchmarks.eager_overhead", []),
    "cupy_coverage": ("benchmarks.cupy_coverage", []),
    "cupy_loops": ("benchmarks.cupy_loops", []),
    "training": ("benchmarks.training", []),
    "threads": ("benchmarks.threads", []),
    "control_flow": ("benchmarks.control_flow", []),
    "decode_loop": ("benchmarks.decode_loop", []),
    "rebind": ("benchmarks.rebind", []),
}

# the quick run, in order: part -> (arguments of its main, its JSON's name under --out-dir)
QUICK = {
    "launch": (["--quick"], "launch_overhead_quick.json"),
    "graphed": (["--quick"], "graphed_call_quick.json"),
    "models": (["--quick", "--only", "gpt2_b1"], "models_quick.json"),
}

# the JSON the full run's parts write, for the summary table (parts the table reads only)
FULL_FILES = {"launch": "launch_overhead.json", "graphed": "graphed_call.json", "models": "models.json"}


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true",
                    help=f"every part in its full form ({', '.join(PARTS)}), JSON under benchmarks/results/")
    ap.add_argument("--only", type=_parts, default=None,
                    help=f"comma-separated parts of the full run, of: {', '.join(PARTS)}")
    ap.add_argument("--out-dir", default=None,
                    help="where the quick run writes its JSON (default benchmarks/results/)")
    ap.add_argument("--sizes", default=None, help="chain lengths for the launch part, comma-separated")
    args = ap.parse_args(argv)
    args.full = args.full or args.only is not None
    if args.full and args.out_dir is not None:
        ap.error("--out-dir applies to the quick run; the full run writes under benchmarks/results/")
    return args


def plan(args) -> list[tuple[str, str, list, str | None]]:
    """``(part, module, arguments, JSON path or None)`` in running order; the path is where the
    summary table reads the part's figures (None: the table has no row for the part)."""
    steps = []
    if args.full:
        for part, (module, part_args) in PARTS.items():
            if args.only is None or part in args.only:
                path = os.path.join(RESULTS_DIR, FULL_FILES[part]) if part in FULL_FILES else None
                steps.append((part, module, list(part_args), path))
    else:
        out_dir = args.out_dir or RESULTS_DIR
        for part, (part_args, name) in QUICK.items():
            path = os.path.join(out_dir, name)
            steps.append((part, PARTS[part][0], [*part_args, "--out", path], path))
    if args.sizes is not None:
        steps = [(p, m, [*a, "--sizes", args.sizes] if p == "launch" else a, j) for p, m, a, j in steps]
    return steps


def main(argv=None) -> int:
    args = _parse(argv)
    if no_gpu():
        return 2
    steps = plan(args)
    if args.out_dir is not None:
        os.makedirs(args.out_dir, exist_ok=True)
    what = "full run" if args.full else "quick run (a few minutes; every part in its full form: --full)"
    print(f"[benchmarks] {what}: {', '.join(p for p, *_ in steps)}", flush=True)
    t_start = time.perf_counter()
    failed, status = [], {}
    for part, module, part_args, _ in steps:
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(module)
            rc = mod.main(part_args)
        except Exception:  # noqa: BLE001 -- one part's failure must not hide the others' results
            traceback.print_exc()
            rc = "raised"
        status[part] = rc
        print(f"[benchmarks] part {part}: {time.perf_counter() - t0:.1f} s, status {rc}", flush=True)
        if rc not in (None, 0):
            failed.append(part)
    _print_summary(steps, status, time.perf_counter() - t_start, quick=not args.full)
    if failed:
        print(f"[benchmarks] failed parts: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _print_summary(steps, status: dict, total_s: float, *, quick: bool) -> None:
    run_id = os.environ.get("CGRAW_RUN_ID")  # set by the first part's report, shared by the others
    rows = []
    for part, _, _, path in steps:
        if path is None:
            continue
        doc, why = summary.load(path, run_id)
        if doc is None and status.get(part) not in (None, 0):
            why = f"the part ended with status {status[part]} ({why})"
        rows += summary.rows_for(part, doc, why)
    if not rows:
        return
    note = "; quick figures: fewer sizes and rounds" if quick else ""
    print(f"\n[benchmarks] summary of run {run_id} ({total_s:.0f} s{note}); "
          f"cgraw/peer below 1: cgraw takes less time", flush=True)
    print(summary.table(rows), flush=True)


def _parts(text: str) -> frozenset:
    parts = frozenset(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(parts - set(PARTS))
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown or text!r}; choose from {', '.join(PARTS)}")
    return parts


if __name__ == "__main__":
    raise SystemExit(main())
