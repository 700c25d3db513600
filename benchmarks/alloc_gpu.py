"""Allocator pairs on the GPU machine: cgraw ``DevicePool`` against CuPy's ``MemoryPool`` and
torch's caching allocator, each holding 1,000 live blocks, in one run.

A "pair" is one malloc and one free of a random size (mostly small), host nanoseconds, median of
loops. cgraw's and CuPy's figures are the pools' own calls; torch's is ``torch.empty`` + ``del``.
"""

from __future__ import annotations

import argparse
import random

from benchmarks._harness import Report, host_us, no_gpu
from benchmarks.alloc_overhead import _sizes

N_LIVE = 1000


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.alloc_gpu", description=__doc__.split("\n\n")[0])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    _parse(argv)
    if no_gpu():
        return 2
    import cgraw

    rep = Report("alloc_gpu")
    rng = random.Random(1)
    sizes = _sizes(rng, 4096)
    it = {"i": 0}

    def next_size():
        i = it["i"] = (it["i"] + 1) & 4095
        return sizes[i]

    pool = cgraw.DevicePool(0, name="bench")
    live = [pool.malloc(n) for n in _sizes(rng, N_LIVE)]
    malloc, free = pool.malloc, pool.free
    r = host_us(lambda: free(malloc(next_size())), loops=10_000)
    rep.add(system="cgraw.DevicePool", ns_per_pair=r["median_us"] * 1e3)
    for b in live:
        free(b)
    pool.close()
    try:
        import cupy as cp
    except ImportError as exc:
        rep.peer_missing("cupy", str(exc))
    else:
        mp = cp.cuda.MemoryPool()
        live = [mp.malloc(n) for n in _sizes(rng, N_LIVE)]
        r = host_us(lambda: mp.malloc(next_size()), loops=10_000)  # freed as the MemoryPointer dies
        rep.add(system="cupy.MemoryPool", ns_per_pair=r["median_us"] * 1e3)
        del live
        mp.free_all_blocks()
    try:
        import torch
    except ImportError as exc:
        rep.peer_missing("torch", str(exc))
    else:
        live = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in _sizes(rng, N_LIVE)]
        empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda")
        r = host_us(lambda: empty(next_size(), dtype=u8, device=dev), loops=10_000)
        rep.add(system="torch caching allocator (torch.empty+del)", ns_per_pair=r["median_us"] * 1e3)
        del live
    print(f"results: {rep.save()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
