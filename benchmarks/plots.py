"""PNG plots from the JSON under benchmarks/results (``python -m benchmarks.plots``; needs matplotlib).

- per_kernel.png: host microseconds per kernel (submit + synchronise) against chain length N, and
  device microseconds per kernel, for every system of the launch-overhead benchmark;
- per_call.png: host microseconds per graphed call against the number of eager inputs.
"""

from __future__ import annotations

import json
import os

from benchmarks._harness import RESULTS_DIR


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS_DIR, f"{name}.json")) as f:
        return json.load(f)


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo = _load("launch_overhead")
    rows = [r for r in lo["rows"] if r.get("workload") == "chain"]
    gpu = lo["environment"].get("gpu", "GPU")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for fw, style in (("torch", "-"), ("cupy", "--")):
        systems = sorted({r["system"] for r in rows if r["framework"] == fw})
        for s in systems:
            pts = sorted((r["n"], r["sync_us_per_kernel"], r["device_us_per_kernel"])
                         for r in rows if r["framework"] == fw and r["system"] == s)
            ns = [p[0] for p in pts]
            axes[0].plot(ns, [p[1] for p in pts], style, marker="o", label=f"{fw}: {s}")
            axes[1].plot(ns, [p[2] for p in pts], style, marker="o", label=f"{fw}: {s}")
    for ax, title in zip(axes, ("host µs per kernel (submit + sync)", "device µs per kernel")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("kernels in the chain (N)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Launch overhead, chain of N tiny kernels ({gpu})")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS_DIR, "per_kernel.png"), dpi=110)

    gc_ = _load("graphed_call")
    rows = [r for r in gc_["rows"] if "k" in r]
    ks = [r["k"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for key, label in (("cgraw_same_us", "cgraw.graphed, same inputs"),
                       ("cgraw_alternating_us", "cgraw.graphed, alternating inputs"),
                       ("hand_cudagraph_copy_us", "torch.cuda.CUDAGraph + copy_"),
                       ("reduce_overhead_us", "torch.compile reduce-overhead"),
                       ("eager_sync_us", "eager torch (+sync)")):
        ys = [r.get(key) for r in rows]
        if all(y is not None for y in ys):
            ax.plot(ks, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("eager 4 KB inputs per call")
    ax.set_ylabel("host µs per call")
    ax.set_title(f"Per-call cost of a graphed function ({gpu})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS_DIR, "per_call.png"), dpi=110)
    print("wrote per_kernel.png and per_call.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
