"""The table ``python3 -m benchmarks`` prints last: headline figures read back from the JSON files
its parts wrote in the same run.

A row gives a part, what it measures, cgraw's figure, a peer, the peer's figure from the same
rounds or the same run, and cgraw / peer (below 1: cgraw takes less time). A figure that is
missing (its system failed its check against eager, or did not replay every timed call) prints as
``-``. A part whose JSON is missing or comes from another run gives one row that says so.
"""

from __future__ import annotations

import json

from benchmarks.models import figure

COLUMNS = ("part", "measure", "cgraw", "peer", "peer's", "cgraw/peer")


def launch_rows(doc: dict) -> list[tuple]:
    """The 1-node replay against a raw launch and torch's graph, and the longest chain of tiny
    kernels against eager and the frameworks' own graphs."""
    rows = doc.get("rows", [])
    replay = {r.get("system"): r.get("submit_us") for r in rows if r.get("workload") == "replay_1node"}
    out = [("launch", "1-node graph replay, host us (submit)", replay.get("cgraw.replay"), peer, replay.get(peer))
           for peer in ("raw cuGraphLaunch", "torch.cuda.CUDAGraph.replay")]
    for framework, peers in (("torch", ("eager", "torch.cuda.CUDAGraph")), ("cupy", ("eager", "cupy Graph.launch"))):
        chain = [r for r in rows if r.get("workload") == "chain" and r.get("framework") == framework]
        if not chain:
            continue
        n = max(r["n"] for r in chain)
        at_n = {r.get("system"): r for r in chain if r["n"] == n}
        for key, what in (("sync_us_per_kernel", "host us per kernel (submit + sync)"),
                          ("device_us_per_kernel", "device us per kernel")):
            for peer in peers:
                if key == "device_us_per_kernel" and peer == "eager":
                    continue  # eager's device timeline is mostly idle gaps: no peer for the device figure
                label = f"{framework} eager" if peer == "eager" else peer
                out.append(("launch", f"{framework} chain of {n} kernels, {what}",
                            (at_n.get("cgraw.replay") or {}).get(key), label, (at_n.get(peer) or {}).get(key)))
    return out


def graphed_rows(doc: dict) -> list[tuple]:
    """A graphed call of one 4 KB input, moving on every call and the same every call, against a
    hand-made torch graph with ``copy_``, reduce-overhead and the driver's floor (same rounds)."""
    row = next((r for r in doc.get("rows", []) if r.get("workload") == "graphed_call" and r.get("k") == 1), None)
    if row is None:
        return [("graphed", "graphed call of 1 input: no row", None, "", None)]
    moving = "graphed call, 1 moving 4 KB input, host us"
    return [
        ("graphed", moving, row.get("cgraw_alternating_us"), "torch.cuda.CUDAGraph + copy_",
         row.get("hand_cudagraph_copy_us")),
        ("graphed", moving, row.get("cgraw_alternating_us"), "torch.compile reduce-overhead",
         row.get("reduce_overhead_us")),
        ("graphed", moving, row.get("cgraw_alternating_us"), "driver floor: re-point + raw launch",
         row.get("floor_patch_and_launch_us")),
        ("graphed", "graphed call, 1 unchanged 4 KB input, host us", row.get("cgraw_same_us"), "raw cuGraphLaunch",
         row.get("floor_raw_launch_us")),
    ]


def models_rows(doc: dict) -> list[tuple]:
    """Per model: ``@cgraw.graphed`` against eager, a hand-made torch graph and reduce-overhead,
    and ``@cgraw.graphed`` over ``torch.compile`` against reduce-overhead (host us per call)."""
    device = (doc.get("options") or {}).get("device", "cuda")
    by_model: dict = {}
    for r in doc.get("rows", []):
        by_model.setdefault(r.get("workload"), {})[r.get("system")] = r
    out = []
    for name, systems in by_model.items():
        if "build" in systems and len(systems) == 1:
            out.append(("models", f"{name}: not built ({systems['build'].get('error', '')[:60]})", None, "", None))
            continue
        unit = next((r.get("unit") for r in systems.values() if r.get("unit")), "call")
        host = {s: figure(r, "host_us", device=device) for s, r in systems.items()}
        for peer, label in (("eager", "eager torch"), ("torch_cudagraph", "torch.cuda.CUDAGraph (hand-made)"),
                            ("reduce_overhead", "torch.compile reduce-overhead")):
            out.append(("models", f"{name}, host us per {unit}", host.get("cgraw_graphed"), label, host.get(peer)))
        if "cgraw_over_compile" in systems:
            out.append(("models", f"{name}, cgraw over torch.compile, host us per {unit}",
                        host.get("cgraw_over_compile"), "torch.compile reduce-overhead", host.get("reduce_overhead")))
    return out or [("models", "no model ran", None, "", None)]


EXTRACT = {"launch": launch_rows, "graphed": graphed_rows, "models": models_rows}


def load(path: str, run_id: str | None) -> tuple[dict | None, str | None]:
    """``(doc, None)`` for the JSON at ``path`` written by run ``run_id``, else ``(None, why)``."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None, f"no {path}"
    except (OSError, ValueError) as exc:
        return None, f"{path} does not read: {exc}"
    if run_id is None or doc.get("run_id") != run_id:
        return None, f"{path} comes from run {doc.get('run_id')}, not this one"
    return doc, None


def rows_for(part: str, doc: dict | None, why: str | None = None) -> list[tuple]:
    """The part's rows, or one row saying why it has none."""
    if doc is None:
        return [(part, f"no result: {why}", None, "", None)]
    return EXTRACT[part](doc)


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.2f}" if v < 100 else f"{v:,.0f}"


def table(rows: list[tuple]) -> str:
    """The rows as fixed-width text, one line each, under a header line."""
    cells = [COLUMNS]
    for part, measure, cg, peer, peer_v in rows:
        ratio = f"{cg / peer_v:.2f}" if cg is not None and peer_v else "-"
        cells.append((part, measure, _num(cg), peer or "", _num(peer_v) if peer else "", ratio if peer else ""))
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    right = {2, 4, 5}
    lines = []
    for c in cells:
        lines.append("  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(c, widths)))
                     .rstrip())
    return "\n".join(lines)
