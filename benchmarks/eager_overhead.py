"""Does cgraw slow eager torch down? Eager op cost in a process that never captured against one
that captured (and keeps) several torch graphs. Each measurement is its own child process; the
two kinds alternate over rounds so machine drift hits both alike.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from benchmarks._harness import Report, host_sync_us


def _child(kind: str) -> None:
    import torch

    x = torch.randn(1024, device="cuda")
    keep = []
    if kind == "captured":
        import cgraw

        for _ in range(4):
            with cgraw.capture() as g:
                _ = torch.sin(x) * 2.0
            keep.append(g)

    def op():
        return x * 1.0001  # allocates through torch's caching allocator

    r = host_sync_us(op, torch.cuda.synchronize, loops=2000, repeats=9)
    print(json.dumps({"kind": kind, "us": r["median_us"]}))


def main(rounds: int = 4) -> dict:
    rep = Report("eager_overhead")
    samples = {"plain": [], "captured": []}
    for _ in range(rounds):
        for kind in ("plain", "captured"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.eager_overhead", "--child", kind],
                                 capture_output=True, text=True, check=True)
            samples[kind].append(json.loads(out.stdout.strip().splitlines()[-1])["us"])
    plain, captured = statistics.median(samples["plain"]), statistics.median(samples["captured"])
    rep.add(workload="eager torch x*1.0001 (alloc), host us per op incl. sync", plain_us=plain,
            after_cgraw_captures_us=captured, ratio=captured / plain, rounds=rounds)
    rep.save({"samples": samples})
    return {"plain_us": plain, "captured_us": captured, "ratio": captured / plain}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        print(main())
