"""PNG plots from the JSON under benchmarks/results (``python -m benchmarks.plots``; needs matplotlib).

- per_kernel.png: host microseconds per kernel (submit + synchronise) against chain length N, and
  device microseconds per kernel, for every system of the launch-overhead benchmark;
- per_call.png: host microseconds per graphed call against the number of eager inputs;
- models.png: speedup over eager per model, one bar per system (``models.json``);
- memory.png: driver memory grown per program, one bar per system, before and after
  ``torch.cuda.empty_cache()`` (``memory.json``).

Each figure names the run its JSON came from (``run_id``); the launch and per-call figures are
meant to come from one run, and a warning is printed when their run ids differ. A missing JSON
skips its figure with a message; without matplotlib nothing is drawn and the reason is printed.
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks._harness import RESULTS_DIR


def _load(name: str) -> dict | None:
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        print(f"plots: {path} not found: its figure is skipped", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"plots: cannot read {path} ({exc}): its figure is skipped", file=sys.stderr)
    return None


def _run_of(doc: dict) -> str:
    return str(doc.get("run_id") or doc.get("environment", {}).get("run_id") or
               doc.get("environment", {}).get("date", "run unknown"))


def _gpu_of(doc: dict) -> str:
    return doc.get("environment", {}).get("gpu") or "GPU"


def _footer(fig, doc: dict, name: str) -> None:
    fig.text(0.01, 0.005, f"benchmarks/results/{name}.json, run {_run_of(doc)}", fontsize=7, alpha=0.7)


def per_kernel(plt, lo: dict) -> str:
    rows = [r for r in lo.get("rows", []) if r.get("workload") == "chain"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for fw, style in (("torch", "-"), ("cupy", "--")):
        systems = sorted({r["system"] for r in rows if r.get("framework") == fw})
        for s in systems:
            pts = sorted((r["n"], r.get("sync_us_per_kernel"), r.get("device_us_per_kernel"))
                         for r in rows if r.get("framework") == fw and r["system"] == s)
            for ax, col in ((axes[0], 1), (axes[1], 2)):
                xy = [(p[0], p[col]) for p in pts if p[col] is not None]
                if xy:
                    ax.plot([p[0] for p in xy], [p[1] for p in xy], style, marker="o", label=f"{fw}: {s}")
    for ax, title in zip(axes, ("host µs per kernel (submit + sync)", "device µs per kernel")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("kernels in the chain (N)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Launch overhead, chain of N tiny kernels ({_gpu_of(lo)})")
    _footer(fig, lo, "launch_overhead")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return _save(fig, "per_kernel.png")


def per_call(plt, gc_: dict) -> str:
    rows = sorted((r for r in gc_.get("rows", []) if "k" in r), key=lambda r: r["k"])
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for key, label in (("cgraw_same_us", "cgraw.graphed, same inputs"),
                       ("cgraw_alternating_us", "cgraw.graphed, alternating inputs"),
                       ("hand_cudagraph_copy_us", "torch.cuda.CUDAGraph + copy_"),
                       ("reduce_overhead_us", "torch.compile reduce-overhead"),
                       ("eager_sync_us", "eager torch (+sync)")):
        xy = [(r["k"], r[key]) for r in rows if r.get(key) is not None]
        if xy:
            ax.plot([p[0] for p in xy], [p[1] for p in xy], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("eager 4 KB inputs per call")
    ax.set_ylabel("host µs per call")
    ax.set_title(f"Per-call cost of a graphed function ({_gpu_of(gc_)})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _footer(fig, gc_, "graphed_call")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return _save(fig, "per_call.png")


_CASE_KEYS = ("case", "batch", "variant", "mode", "phase", "optimizer")  # what else tells two rows of one model apart


def _model_label(r: dict) -> str:
    parts = [str(r.get("model", "?"))]
    parts += [f"{k} {r[k]}" for k in _CASE_KEYS if r.get(k) is not None]
    return ", ".join(parts)


def _speedups(rows: list, key_us: str, key_speedup: str) -> dict:
    """``{model label: {system: speedup over eager}}``: the row's own speedup, else eager's time
    over the row's for the same model label; none for a row whose speedup the benchmark withheld
    (``speedup_note``: a cgraw system that did not replay every timed call)."""
    eager = {}
    for r in rows:
        if str(r.get("system", "")).startswith("eager") and r.get(key_us):
            eager[_model_label(r)] = r[key_us]
    out: dict = {}
    for r in rows:
        label, system = _model_label(r), r.get("system")
        if system is None:
            continue
        sp = r.get(key_speedup)
        if sp is None and r.get(key_us) and label in eager and not r.get("speedup_note"):
            sp = eager[label] / r[key_us]
        if sp is not None:
            out.setdefault(label, {})[str(system)] = float(sp)
    return out


def _grouped_bars(ax, data: dict, ylabel: str) -> None:
    """``data``: {group: {series: value}} drawn as groups of bars, one colour per series."""
    groups = list(data)
    series = []
    for g in groups:
        for s in data[g]:
            if s not in series:
                series.append(s)
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        ys = [data[g].get(s, 0.0) for g in groups]
        ax.bar(xs, ys, width=width, label=s)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    top = max((v for g in groups for v in data[g].values()), default=1.0)
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=min(3, max(1, len(series))), loc="upper left")


def models(plt, doc: dict) -> str | None:
    rows = [r for r in doc.get("rows", []) if isinstance(r, dict) and "model" in r]
    host = _speedups(rows, "host_us", "speedup_host")
    device = _speedups(rows, "device_us", "speedup_device")
    if not host and not device:
        print("plots: models.json has no rows with model, system and host_us/speedup_host: models.png skipped",
              file=sys.stderr)
        return None
    panels = [(d, t) for d, t in ((host, "host time"), (device, "device time")) if d]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.6 * len(host or device)), 4.5 * len(panels)),
                             squeeze=False)
    for ax, (data, what) in zip(axes[:, 0], panels):
        _grouped_bars(ax, data, f"speedup over eager ({what})")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"Real models: speedup over eager, {what} per call\n{_gpu_of(doc)}")
    _footer(fig, doc, "models")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return _save(fig, "models.png")


def memory(plt, doc: dict) -> str | None:
    rows = [r for r in doc.get("rows", []) if isinstance(r, dict) and "program" in r and "system" in r]
    panels = []
    for key, what in (("grown_mib", "driver memory grown (MiB)"),
                      ("grown_after_empty_cache_mib", "grown after torch.cuda.empty_cache() (MiB)")):
        data: dict = {}
        for r in rows:
            if r.get(key) is not None:
                data.setdefault(str(r["program"]), {})[str(r["system"])] = float(r[key])
        if data:
            panels.append((data, what))
    if not panels:
        print("plots: memory.json has no rows with program, system and grown_mib: memory.png skipped",
              file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (data, what) in zip(axes[0], panels):
        _grouped_bars(ax, data, what)
        ax.set_title(what)
    fig.suptitle(f"Memory: cgraw against torch's trees and eager ({_gpu_of(doc)})")
    _footer(fig, doc, "memory")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return _save(fig, "memory.png")


def _save(fig, name: str) -> str:
    path = os.path.join(RESULTS_DIR, name)
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"plots: matplotlib is not installed ({exc}); no PNG drawn "
              "(python3 -m pip install matplotlib, or the project's [bench] extra)", file=sys.stderr)
        return 0
    wrote = []
    lo, gc_ = _load("launch_overhead"), _load("graphed_call")
    if lo is not None and gc_ is not None and _run_of(lo) != _run_of(gc_):
        print(f"plots: warning: launch_overhead.json (run {_run_of(lo)}) and graphed_call.json "
              f"(run {_run_of(gc_)}) come from different runs", file=sys.stderr)
    for doc, draw in ((lo, per_kernel), (gc_, per_call), (_load("models"), models), (_load("memory"), memory)):
        if doc is None:
            continue
        path = draw(plt, doc)
        if path:
            wrote.append(os.path.basename(path))
        plt.close("all")
    print(f"plots: wrote {', '.join(wrote) if wrote else 'nothing'} in {RESULTS_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
