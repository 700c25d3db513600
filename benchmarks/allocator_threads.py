"""Why cgraw lets torch allocate its own segments: Python allocator callbacks can deadlock.

``python -m benchmarks.allocator_threads``: two ways to route torch's allocations into a private
``torch.cuda.MemPool`` during a driver stream capture, each run in a child process while a second
thread calls torch's memory APIs and allocates in a tight loop:

- ``python_callbacks``: the MemPool's segments come from Python through ctypes callbacks
  (``torch._C._cuda_customAllocator``), an earlier design of cgraw's. torch calls them
  while it holds its allocator mutex; a callback needs the GIL. The other thread holds the GIL
  and waits for the same mutex (``torch.cuda.memory_allocated``), so both can wait forever.
- ``torch_allocator``: a plain ``torch.cuda.MemPool()``; torch ``cudaMalloc``s the segments
  itself and no Python runs under the mutex. This is what cgraw does now.

Each child runs up to ``--captures`` captures, each into a new MemPool so that every capture
needs new segments; a child that has not finished after ``--timeout`` seconds is killed and
counted as hung. Writes ``benchmarks/results/allocator_threads.json``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

CHILD = r'''
import ctypes, sys, threading, time
import torch
from cuda.bindings import driver as drv

design, n = sys.argv[1], int(sys.argv[2])
torch.cuda.init()
x = torch.ones(8, device="cuda")
_keep = []

def new_pool():
    if design == "torch_allocator":
        return torch.cuda.MemPool()
    ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    def alloc(size, device, stream):
        err, ptr = drv.cuMemAlloc(size)          # cuda-bindings releases the GIL here
        return None if err else int(ptr)
    def free(ptr, size, device, stream):
        drv.cuMemFree(ptr)
    a, f = ALLOC(alloc), FREE(free)
    _keep.append((a, f))
    custom = torch._C._cuda_customAllocator(ctypes.cast(a, ctypes.c_void_p).value,
                                             ctypes.cast(f, ctypes.c_void_p).value)
    return torch.cuda.MemPool(custom)

stop = threading.Event()
other = {"calls": 0}
def hammer():
    while not stop.is_set():
        torch.cuda.memory_allocated()
        torch.cuda.memory_stats()
        t = torch.empty(1 << 16, device="cuda")
        del t
        other["calls"] += 1

th = threading.Thread(target=hammer, daemon=True)
th.start()
s = torch.cuda.Stream()
mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
done = 0
for i in range(n):
    mp = new_pool()
    with torch.cuda.use_mem_pool(mp), torch.cuda.stream(s):
        (err,) = drv.cuStreamBeginCapture(s.cuda_stream, mode)
        assert not err, err
        y = x * 2.0
        z = torch.empty((i % 7 + 1) << 20, device="cuda")
        err, graph = drv.cuStreamEndCapture(s.cuda_stream)
        assert not err, err
        drv.cuGraphDestroy(graph)
    del y, z, mp
    done += 1
    if done % 50 == 0:
        print("progress", done, other["calls"], flush=True)
stop.set()
th.join()
print("done", done, other["calls"], flush=True)
'''


def run_child(design: str, captures: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, design, str(captures)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        hung = True
    seconds = time.perf_counter() - t0
    done, other = 0, 0
    for line in out.splitlines():
        parts = line.split()
        if parts[:1] in (["progress"], ["done"]):
            done, other = int(parts[1]), int(parts[2])
    return {"design": design, "captures_asked": captures, "captures_done": done,
            "other_thread_iterations": other, "hung": hung, "returncode": None if hung else proc.returncode,
            "seconds": round(seconds, 2), "tail": out[-400:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.allocator_threads")
    ap.add_argument("--captures", type=int, default=500)
    ap.add_argument("--timeout", type=float, default=40.0)
    args = ap.parse_args(argv)
    from benchmarks._harness import Report

    rep = Report("allocator_threads")
    for design in ("python_callbacks", "torch_allocator"):
        row = run_child(design, args.captures, args.timeout)
        rep.add(**{k: v for k, v in row.items() if k != "tail"})
        rep.rows[-1]["tail"] = row["tail"]
    print("wrote", rep.save({"captures": args.captures, "timeout_s": args.timeout}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
