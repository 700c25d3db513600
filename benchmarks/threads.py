"""Graphed calls from several threads: throughput and device memory of a small MLP, against eager.

``python3 -m benchmarks.threads``: for 1, 2 and 8 threads (``--threads``), every thread calls the
model in a loop for ``--seconds`` (its own CUDA stream, two input batches of its own, alternated),
through three systems, in a shuffled order in each of ``--rounds`` rounds:

- ``eager``: the model itself;
- ``graphed``: ``@cgraw.graphed`` as it is: each thread calls it and gets its own graph tree
  (its own pool, capture stream and generations);
- ``one_tree``: the other design, one tree per device with calls serialised: a single owning
  thread runs the graphed model for every caller (a queue), and clones each output before
  handing it back (the next call overwrites the tree's output).

Before timing, every thread's result is checked against eager on its own inputs; a system whose
check fails is recorded under ``failed_checks`` and not timed. Throughput is calls per second of
all threads together, from the start signal until every thread's stream has drained. Memory is
read after the warm-up, while the threads wait for the start signal: device memory in use
(``cudaMemGetInfo``), torch's reserved and allocated bytes, and the bytes of the threads' graph
tree pools, each against the same readings taken just before the threads started. Writes
``benchmarks/results/threads.json`` (``--out``): every run and, per system and thread count, the
median over rounds and the ratio to eager.
"""

from __future__ import annotations

import argparse
import gc
import queue
import random
import statistics
import sys
import threading
import time

from benchmarks._harness import Report, no_gpu

WIDTH, DEPTH, BATCH, IN_FEATURES = 256, 4, 16, 64
SYSTEMS = ("eager", "graphed", "one_tree")
WARM_CALLS = 6
DEADLINE_S = 300.0
MiB = 1 << 20


def _model(torch):
    torch.manual_seed(0)
    layers, width = [], IN_FEATURES
    for _ in range(DEPTH - 1):
        layers += [torch.nn.Linear(width, WIDTH), torch.nn.GELU()]
        width = WIDTH
    layers.append(torch.nn.Linear(width, 16))
    return torch.nn.Sequential(*layers).cuda().eval()


class _OneTree:
    """One owning thread runs the graphed model for every caller; outputs are cloned out."""

    def __init__(self, torch, model):
        import cgraw

        self.torch, self.requests = torch, queue.Queue()
        self.f = cgraw.graphed(model)
        self.thread = threading.Thread(target=self._serve, name="one-tree-owner", daemon=True)
        self.thread.start()

    def _serve(self):
        torch = self.torch
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.no_grad():
            while True:
                item = self.requests.get()
                if item is None:
                    return
                x, ready, box = item
                stream.wait_event(ready)  # the caller's input is written
                try:
                    box["out"] = self.f(x).clone()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    box["error"] = exc
                done = torch.cuda.Event()
                done.record(stream)
                box["done"] = done
                box["event"].set()

    def __call__(self, x):
        torch = self.torch
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        box = {"event": threading.Event()}
        self.requests.put((x, ready, box))
        if not box["event"].wait(DEADLINE_S):
            raise TimeoutError("the owning thread did not answer")
        if "error" in box:
            raise box["error"]
        torch.cuda.current_stream().wait_event(box["done"])  # the output is written
        return box["out"]

    def close(self):
        self.requests.put(None)
        self.thread.join(DEADLINE_S)


def _memory(torch) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"used": total - free, "reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}


def _tree_bytes(mgr) -> int:
    pool = mgr.backend.pool
    return 0 if pool is None or pool.closed else pool.stats().reserved_bytes + pool.torch_reserved_bytes


def run_once(torch, model, system: str, n_threads: int, seconds: float) -> dict:
    """One system at one thread count: check, warm up, read memory, time. Returns the run's row
    fields, with ``error`` set (and nothing timed) when a thread's check failed."""
    import cgraw

    graphed_mod = sys.modules["cgraw.trees.graphed"]
    cgraw.reset()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = _memory(torch)
    owner = f = None
    if system == "eager":
        f = model
    elif system == "graphed":
        f = cgraw.graphed(model)
    else:
        f = owner = _OneTree(torch, model)
    ready, go = (threading.Barrier(n_threads + 1, timeout=DEADLINE_S) for _ in range(2))
    stop = threading.Event()
    counts, errors, tree_bytes, stats = [0] * n_threads, [], [0] * n_threads, [None] * n_threads

    def calls(i):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.no_grad():
            xs = [torch.randn(BATCH, IN_FEATURES, device="cuda") for _ in range(2)]
            for k in range(WARM_CALLS):
                torch.testing.assert_close(f(xs[k % 2]), model(xs[k % 2]), rtol=1e-5, atol=1e-5)
            stream.synchronize()
            if system == "graphed":
                tree_bytes[i] = _tree_bytes(graphed_mod._managers[0])
            ready.wait()
            go.wait()
            n = 0
            while not stop.is_set():
                f(xs[n & 1])
                n += 1
            stream.synchronize()
            counts[i] = n
            if system == "graphed":
                st = graphed_mod._managers[0].stats[f.fn_id]
                stats[i] = {"recordings": st.recordings, "replays": st.replays, "eager_calls": st.eager_calls}

    def worker(i):
        try:
            calls(i)
        except threading.BrokenBarrierError:
            pass  # another thread failed: its error is the one reported
        except BaseException as exc:  # noqa: BLE001 - the check's verdict, reported by the main thread
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}"[:500])
            ready.abort()
            go.abort()

    threads = [threading.Thread(target=worker, args=(i,), name=f"caller-{i}") for i in range(n_threads)]
    for t in threads:
        t.start()
    elapsed, after = 0.0, before
    try:
        ready.wait()
        after = _memory(torch)
        t0 = time.perf_counter()
        go.wait()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(DEADLINE_S)
        elapsed = time.perf_counter() - t0
        if any(t.is_alive() for t in threads):
            errors.append(f"a thread still ran {DEADLINE_S:.0f} s after the stop signal")
    except threading.BrokenBarrierError:
        if not errors:
            errors.append("a thread failed before the start signal")
    finally:
        stop.set()
        for t in threads:
            t.join(DEADLINE_S)
        if owner is not None:
            owner.close()
    row = {"system": system, "threads": n_threads, "seconds": round(elapsed, 3)}
    if errors:
        row["error"] = "; ".join(errors)
        return row
    total = sum(counts)
    row.update(calls_per_s=total / elapsed, us_per_call_per_thread=elapsed * 1e6 * n_threads / max(total, 1),
               calls_by_thread=counts,
               used_mib=(after["used"] - before["used"]) / MiB,
               torch_reserved_mib=(after["reserved"] - before["reserved"]) / MiB,
               torch_allocated_mib=(after["allocated"] - before["allocated"]) / MiB)
    if system == "graphed":
        row["tree_pool_mib_by_thread"] = [b / MiB for b in tree_bytes]
        row["tree_stats_by_thread"] = stats
    return row


def summarise(rows: list) -> dict:
    """Per system and thread count: median calls/s and memory over rounds; per thread count, the
    median per-round ratio of each system's calls/s to eager's."""
    out: dict = {}
    good = [r for r in rows if "error" not in r]
    for system in SYSTEMS:
        for n in sorted({r["threads"] for r in good}):
            mine = [r for r in good if r["system"] == system and r["threads"] == n]
            if not mine:
                continue
            entry = {k: statistics.median(r[k] for r in mine)
                     for k in ("calls_per_s", "us_per_call_per_thread", "used_mib", "torch_reserved_mib",
                               "torch_allocated_mib")}
            eager = {r["round"]: r["calls_per_s"] for r in good if r["system"] == "eager" and r["threads"] == n}
            ratios = [r["calls_per_s"] / eager[r["round"]] for r in mine if r["round"] in eager]
            if ratios:
                entry["calls_per_s_vs_eager"] = statistics.median(ratios)
            entry["runs"] = len(mine)
            out[f"{system} x{n}"] = entry
    return out


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.threads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=_counts, default=(1, 2, 8), help="comma-separated thread counts")
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per run")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (each runs every system at every count)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/threads.json)")
    args = ap.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        ap.error(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    counts, systems = args.threads, args.systems
    if no_gpu():
        return 2

    import torch

    import cgraw

    rep = Report("threads")
    model = _model(torch)
    rng = random.Random(0)
    for r in range(args.rounds):
        for n in counts:
            order = list(systems)
            rng.shuffle(order)
            for system in order:
                row = run_once(torch, model, system, n, args.seconds)
                row["round"] = r
                if "error" in row:
                    rep.failed_checks[f"{system} x{n} round {r}"] = row["error"][:1000]
                    print(f"[threads] CHECK FAILED, not timed: {system} x{n}: {row['error'][:300]}", flush=True)
                    rep.rows.append(row)
                    continue
                if f"{system} x{n}" not in rep.checked:
                    rep.checked.append(f"{system} x{n}")
                rep.add(**{k: v for k, v in row.items() if not isinstance(v, list)})
                rep.rows[-1].update(row)
    cgraw.reset()
    extra = {"summary": summarise(rep.rows),
             "workload": {"model": f"MLP {IN_FEATURES}-{'-'.join([str(WIDTH)] * (DEPTH - 1))}-16, GELU, eval, "
                                   f"torch.no_grad()", "batch": BATCH, "warm_calls": WARM_CALLS,
                          "seconds": args.seconds, "rounds": args.rounds,
                          "streams": "each calling thread has its own torch.cuda.Stream"}}
    for key, entry in extra["summary"].items():
        print(f"[threads] {key}: {entry['calls_per_s']:.0f} calls/s"
              + (f" ({entry['calls_per_s_vs_eager']:.2f}x eager)" if "calls_per_s_vs_eager" in entry else "")
              + f", device memory +{entry['used_mib']:.1f} MiB", flush=True)
    print(f"[threads] wrote {rep.save(extra, args.out)}", flush=True)
    return 1 if rep.failed_checks else 0


def _counts(text: str) -> tuple:
    try:
        counts = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive thread counts, e.g. 1,2,8")
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
