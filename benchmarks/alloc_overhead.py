"""CPU benchmark of the allocator hot path: ns per malloc+free pair on ``IntRangeSource``.

Imports only ``allocator`` (no CUDA), so allocator changes can be measured on any machine:
``python3 -m benchmarks.alloc_overhead``. The pool first holds ``n_live`` live blocks of mixed
sizes; then loops of malloc+free pairs of random sizes are timed with ``perf_counter_ns``. Writes
``benchmarks/results/alloc_overhead.json`` (the run's record names the host CPU: the figure
depends on it).
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
import time

from allocator import IntRangeSource, Pool

LOOP_PAIRS = 10_000  # pairs per timed loop


def _sizes(rng: random.Random, n: int) -> list[int]:
    """Mostly small tensors, some medium, a few over the small-segment threshold."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.70:
            out.append(rng.randint(1, 64 << 10))
        elif r < 0.97:
            out.append(rng.randint(64 << 10, 1 << 20))
        else:
            out.append(rng.randint(1 << 20, 8 << 20))
    return out


def run(n_live: int = 1000, pairs: int = 200_000, repeats: int = 7, seed: int = 0) -> dict:
    """Time malloc+free pairs against a pool holding ``n_live`` live blocks.

    ``pairs`` pairs are timed per repeat, in loops of ``LOOP_PAIRS``; median and p90 are over all
    loops of all repeats, in ns per pair.
    """
    rng = random.Random(seed)
    pool = Pool(IntRangeSource(), name="bench")
    live = [pool.malloc(n) for n in _sizes(rng, 2 * n_live)]
    rng.shuffle(live)
    for block in live[n_live:]:  # free half, in random order, so the free lists are fragmented
        pool.free(block)
    sizes = _sizes(rng, LOOP_PAIRS)
    malloc, free = pool.malloc, pool.free
    loops = max(1, pairs // LOOP_PAIRS)
    per_pair_ns = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(LOOP_PAIRS // 10):  # warm-up
            free(malloc(sizes[0]))
        for _ in range(repeats):
            for _ in range(loops):
                t0 = time.perf_counter_ns()
                for n in sizes:
                    free(malloc(n))
                per_pair_ns.append((time.perf_counter_ns() - t0) / len(sizes))
    finally:
        if gc_was_enabled:
            gc.enable()
    stats = pool.stats()
    pool.close()
    per_pair_ns.sort()
    return {
        "system": "cgraw.allocator",
        "source": "host",
        "median_ns_per_pair": round(statistics.median(per_pair_ns), 1),
        "p90_ns_per_pair": round(per_pair_ns[min(len(per_pair_ns) - 1, int(0.9 * len(per_pair_ns)))], 1),
        "n_live": n_live,
        "segments": stats.segments,
        "free_blocks": stats.free_blocks,
        "pairs": loops * len(sizes) * repeats,
        "python": platform.python_version(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.alloc_overhead")
    ap.add_argument("--n-live", type=int, default=1000)
    ap.add_argument("--pairs", type=int, default=200_000, help="timed pairs per repeat")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args([] if argv is None else argv)
    from benchmarks._harness import Report

    rep = Report("alloc_overhead", gpu=False)  # CPU only: no driver, no GPU probe
    result = run(n_live=args.n_live, pairs=args.pairs, repeats=args.repeats)
    rep.add(**result, median_us_per_pair=round(result["median_ns_per_pair"] / 1e3, 3), target_us=2.0)
    print(f"{'system':<18}{'n_live':>8}{'median ns/pair':>16}{'p90 ns/pair':>14}")
    print(f"{result['system']:<18}{result['n_live']:>8}{result['median_ns_per_pair']:>16.1f}"
          f"{result['p90_ns_per_pair']:>14.1f}")
    print(f"results: {rep.save()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
