"""Whether one thread dropping torch's cuBLAS workspaces, as a graph tree's recording does
(``torch._C._cuda_clearCublasWorkspaces()``, then ``torch.cuda.empty_cache()``), faults the
matmuls other threads run meanwhile. torch hands a cuBLASLt call its workspace as a raw pointer
taken under a lock it then releases, so a workspace freed and returned to the driver between that
and the kernel's launch would be read after its memory is gone.

Each order runs in a child process of its own (a fault is sticky in its context): ``WORKERS``
threads, each on its own stream, run ``torch.addmm`` (cuBLASLt's fused bias) and ``torch.mm``
(cuBLAS) in a loop and compare every 200th result with their first; one more thread drops the
workspaces and empties the cache in a loop (``clear_then_empty``, a recording's order;
``empty_then_clear``), or sleeps (``none``, the baseline). A row prints the matmul pairs, the
drops, the wrong results and the errors, and whether a final synchronise succeeded.

A diagnostic, not a benchmark. From the repository root, on a GPU: ``python3 -m
tools.probes.cublas_workspace_probe [--seconds 6] [--workers 24] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ORDERS = ("clear_then_empty", "empty_then_clear", "none")


def _child(order: str, seconds: float, workers: int) -> dict:
    """One order's run, in this process: its counts as a dict."""
    import threading
    import time

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    clear = torch._C._cuda_clearCublasWorkspaces
    stop = threading.Event()
    pairs, wrong, drops, errors = [], [], [], []

    def worker(i: int) -> None:
        stream = torch.cuda.Stream()
        gen = torch.Generator(device="cuda").manual_seed(i)
        n = bad = 0
        try:
            with torch.cuda.stream(stream):
                a, b = (torch.randn(s, device="cuda", generator=gen) for s in ((256, 256), (32, 256)))
                bias = torch.randn(256, device="cuda", generator=gen)
                first = (torch.addmm(bias, b, a), torch.mm(b, a))
                while not stop.is_set():
                    y1, y2 = torch.addmm(bias, b, a), torch.mm(b, a)
                    n += 1
                    if n % 200 == 0:
                        bad += int(not (torch.equal(y1, first[0]) and torch.equal(y2, first[1])))
                stream.synchronize()
        except Exception as exc:  # noqa: BLE001 -- a fault is the finding
            errors.append(f"worker {i}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        pairs.append(n)
        wrong.append(bad)

    def dropper() -> None:
        n = 0
        try:
            while not stop.is_set():
                if order == "clear_then_empty":
                    clear()
                    torch.cuda.empty_cache()
                elif order == "empty_then_clear":
                    torch.cuda.empty_cache()
                    clear()
                else:
                    time.sleep(0.0002)
                n += 1
        except Exception as exc:  # noqa: BLE001
            errors.append(f"dropper: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        drops.append(n)

    torch.mm(torch.ones(2, 2, device="cuda"), torch.ones(2, 2, device="cuda"))
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    threads.append(threading.Thread(target=dropper))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    try:
        torch.cuda.synchronize()
        final = "ok"
    except Exception as exc:  # noqa: BLE001
        final = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return {"order": order, "pairs": sum(pairs), "drops": sum(drops), "wrong": sum(wrong),
            "errors": errors[:3], "n_errors": len(errors), "final_sync": final}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="python3 -m tools.probes.cublas_workspace_probe")
    ap.add_argument("--seconds", type=float, default=6.0, help="run time of each order (default 6)")
    ap.add_argument("--workers", type=int, default=24, help="threads running matmuls (default 24)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each order (default 3)")
    ap.add_argument("--child", default=None, choices=ORDERS, help="internal: run one order here")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.seconds, args.workers)))
        return 0
    print(f"{'order':18s} {'matmul pairs':>12s} {'drops':>7s} {'wrong':>6s} {'errors':>6s}  final synchronise")
    faults = 0
    for _ in range(args.rounds):
        for order in ORDERS:
            cmd = [sys.executable, "-m", "tools.probes.cublas_workspace_probe", "--child", order,
                   "--seconds", str(args.seconds), "--workers", str(args.workers)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds + 120)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode != 0 or not lines:
                faults += 1
                print(f"{order:18s} child exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(lines[-1])
            faults += int(bool(r["n_errors"] or r["wrong"] or r["final_sync"] != "ok"))
            print(f"{order:18s} {r['pairs']:12d} {r['drops']:7d} {r['wrong']:6d} {r['n_errors']:6d}  {r['final_sync']}")
            for e in r["errors"]:
                print(f"    {e}")
    print(f"runs with a fault or a wrong result: {faults}")
    return 1 if faults else 0


if __name__ == "__main__":
    raise SystemExit(main())
