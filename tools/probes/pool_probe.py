"""What makes up a graph tree's torch pool: the seed's two-branch program of ``benchmarks.memory``
(64 MiB tensors, 12 steps, grad mode on) through ``@cgraw.graphed``, with torch's allocation
history on. For every segment of the tree's MemPool (and of torch's global pool) it prints the
size and the Python frames that made the allocation that created it (``segment_alloc`` in
``torch.cuda.memory._snapshot()``'s device trace), and writes ``pool_probe.json`` to ``$OUT`` (or
the current directory; ``--out`` names another file): what to read when a tree's pool is larger
than torch's trees' on the same program (``benchmarks.memory``).

A diagnostic, not a benchmark. From the repository root (it imports ``benchmarks.memory``):
``python3 -m tools.probes.pool_probe [--warm-outside]``; needs a GPU.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys

from benchmarks._harness import REPO_ROOT

MIB = 1 << 20


def _frames(entry, limit: int = 4) -> list[str]:
    """The innermost frames of ``entry`` in this repository (cgraw, benchmarks, tools), as file:line name."""
    out = []
    for f in entry.get("frames") or ():
        name = f.get("filename", "")
        if REPO_ROOT in name or "/cgraw/" in name or "/benchmarks/" in name or "/tools/" in name:
            out.append(f"{os.path.relpath(name, REPO_ROOT)}:{f.get('line')} {f.get('name')}")
        if len(out) >= limit:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.probes.pool_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm-outside", action="store_true", help="cgraw.config.warmup_in_pool = False")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT") or ".", "pool_probe.json"))
    args = ap.parse_args(argv)
    import torch

    import cgraw
    from benchmarks.memory import _TwoBranch
    from cgraw.trees.graphed import _managers

    cgraw.config.warmup_in_pool = not args.warm_outside
    torch.cuda.init()
    torch.ones(1, device="cuda").sum()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=1 << 20)
    prog = _TwoBranch("cgraw", torch.device("cuda", 0), argparse.Namespace(mib=64))
    kept = None
    for i in range(12):
        kept = prog.step(i)
        cgraw.mark_step_begin()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    tree_id = tuple(_managers[0].backend._tts.pool.id)
    made = {}
    for trace in snap.get("device_traces", []):
        for e in trace:
            if e.get("action") == "segment_alloc":
                made[int(e["addr"])] = e
    rows = []
    for s in snap["segments"]:
        pid = tuple(s.get("segment_pool_id", (0, 0)))
        where = "tree" if pid == tree_id else ("global" if pid == (0, 0) else f"pool {pid}")
        e = made.get(int(s["address"]), {})
        blocks = [(round(b["size"] / MIB, 2), b["state"]) for b in s["blocks"]]
        rows.append({"pool": where, "mib": round(s["total_size"] / MIB, 2), "stream": s.get("stream"),
                     "blocks": blocks, "made_by": _frames(e), "made_for_mib": round(e.get("size", 0) / MIB, 2)})
    rows.sort(key=lambda r: (r["pool"], -r["mib"]))
    for r in rows:
        print(f"{r['pool']:<7}{r['mib']:>8.1f} MiB  stream {r['stream']}  blocks {r['blocks'][:4]}"
              f"{'...' if len(r['blocks']) > 4 else ''}\n        made for {r['made_for_mib']} MiB by "
              f"{' <- '.join(r['made_by'][:3]) or '(no frames)'}")
    total = {}
    for r in rows:
        total[r["pool"]] = round(total.get(r["pool"], 0) + r["mib"], 2)
    print("total MiB by pool:", total)
    buf = io.StringIO()
    cgraw.report(file=buf)
    report = buf.getvalue()
    print(report[:1500])
    doc = {"benchmark": "pool_probe", "commit": os.environ.get("CGRAW_GIT_COMMIT", ""),
           "warmup_in_pool": not args.warm_outside, "segments": rows, "total_mib": total,
           "report": report, "result_alive": kept is not None}
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
