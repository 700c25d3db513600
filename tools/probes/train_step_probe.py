"""Where a ResNet-18 training step under ``torch.compile(backend="cgraw")`` spends its time, against
``mode="reduce-overhead"``: the kernels of a step by name, and the host time of a step alone.

A diagnostic, not a benchmark (``benchmarks.models`` times the step). Both systems compile the
model of ``benchmarks.models``' ``resnet18_train`` workload (loss, ``backward()`` and SGD eager,
gradients set to None) and warm up; then, per system:

- **kernels**: ``torch.profiler`` over four steps: per kernel name, launches and device time per
  step, and the names whose device time differs most between the systems;
- **host**: ten steps timed while a long sleep kernel holds the GPU behind, so that no step waits
  for the device, and ten steps each started on an idle GPU (a step of more launches than the
  device's queue holds waits for room behind the sleep): the host's own time per step, three
  rounds in turns;
- **syncs**: whether a step synchronises with the device (``torch.cuda.set_sync_debug_mode``);
- **split** (``--split``): ten steps per system, each from an idle GPU, with the inclusive host
  time per step of the step's eager parts (``zero_grad``, the compiled model's call, ``backward()``,
  SGD's step), of Inductor's compiled forward and backward (``CompiledFxGraph.__call__``: each
  system's graph runtime inside), of torch's trees (``CUDAGraphTreeManager.run``, a node's run and
  its graph's replay) and of the parts of cgraw's call (``whole_graph_probe.Split``; a part torch
  or cgraw lacks is left out, said so).

A step whose host time exceeds its kernels' device time is bound by the host, and the system
with the cheaper host path is faster however alike their kernels are.

From the repository root, on a GPU: ``python3 -m tools.probes.train_step_probe [--split]``; it
writes what it prints to ``train_step_probe.json`` in ``$OUT`` (or the current directory), with
the run's record (``benchmarks._harness.environment``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
import warnings

from tools.probes.whole_graph_probe import SPLIT_PARTS, Split


def _systems():
    import torch

    from benchmarks import models

    wl = models._build("resnet18_train")
    x, y = wl.inputs()
    backend = wl.new_step(lambda m: torch.compile(m, backend="cgraw", dynamic=False), set_to_none=True)
    ro = wl.new_step(lambda m: torch.compile(m, mode="reduce-overhead", dynamic=False), set_to_none=True)
    mark = torch.compiler.cudagraph_mark_step_begin

    def ro_step():
        mark()  # torch requires it before each step
        return ro(x, y)

    return {"reduce_overhead": ro_step, "cgraw_backend": lambda: backend(x, y)}


def kernels(step, steps: int = 4) -> dict:
    """``{kernel name: (launches, device us)}`` per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    agg: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:90]]
            a[0] += 1
            a[1] += getattr(e, "device_time_total", 0.0)
    return {k: (n / steps, us / steps) for k, (n, us) in agg.items()}


def host_us(step, steps: int = 10) -> float:
    """The host's time per step while the GPU is held behind by a sleep kernel."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles: no step waits for the device
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    us = (time.perf_counter() - t0) / steps * 1e6
    torch.cuda.synchronize()
    return us


def syncs(step, steps: int = 3) -> list[str]:
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.probes.train_step_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of host timing, the systems in turns")
    ap.add_argument("--split", action="store_true", help="also time the parts of each system's step")
    args = ap.parse_args(argv)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    systems = _systems()
    for _ in range(8):  # compiles, warm-ups, recordings
        for step in systems.values():
            step()
    per = {name: kernels(step) for name, step in systems.items()}
    record: dict = {name: {} for name in systems}
    for name, ks in per.items():
        n_syncs = len(syncs(systems[name]))
        record[name].update(kernels=round(sum(n for n, _ in ks.values())), kernel_us=sum(us for _, us in ks.values()),
                            syncs_per_3_steps=n_syncs)
        print(f"{name}: {record[name]['kernels']} kernels, {record[name]['kernel_us']:.0f} us "
              f"of kernel time per step; syncs per 3 steps: {n_syncs}")
    a, b = per["reduce_overhead"], per["cgraw_backend"]
    rows = sorted(((b.get(k, (0, 0))[1] - a.get(k, (0, 0))[1], k) for k in set(a) | set(b)), key=lambda r: -abs(r[0]))
    print(f"{'backend - RO us':>16}  kernel")
    for diff, k in rows[:12]:
        print(f"{diff:16.1f}  {k}")
    times: dict = {name: ([], []) for name in systems}
    order = list(systems)
    for _ in range(args.rounds):
        for name in order:
            times[name][0].append(host_us(systems[name]))
            times[name][1].append(idle_us(systems[name]))
        order.reverse()
    for name, (held, idle) in times.items():
        record[name].update(host_held_us=held, host_idle_us=idle)
        print(f"{name}: host {min(held):.0f}-{max(held):.0f} us per step with the GPU held behind, "
              f"{min(idle):.0f}-{max(idle):.0f} us from an idle GPU")
    if args.split:
        for name, step in systems.items():
            record[name]["split"] = split_step(name, step)
    print(f"results: {save(record)}")
    return 0


def save(record: dict) -> str:
    """Write ``record`` with the run's record to ``train_step_probe.json`` in ``$OUT`` (or the
    current directory); return its path."""
    from benchmarks._harness import environment

    path = os.path.join(os.environ.get("OUT") or ".", "train_step_probe.json")
    with open(path, "w") as fh:
        json.dump({"benchmark": "train_step_probe", "environment": environment(), "systems": record}, fh, indent=1)
    return path


# (label, module, attribute) timed by --split, nested as the labels' indentation shows: the step's
# eager parts, then Inductor's compiled forward and backward (inside the compiled call and backward()),
# inside them torch's trees or cgraw's call (whole_graph_probe's parts)
STEP_PARTS = (
    ("zero_grad", "torch.optim.optimizer", "Optimizer.zero_grad"),
    ("compiled model call", "torch._dynamo.eval_frame", "OptimizedModule.__call__"),
    ("backward()", "torch.autograd", "backward"),
    ("optimizer step", "torch.optim.sgd", "SGD.step"),
    ("Inductor's compiled code", "torch._inductor.output_code", "CompiledFxGraph.__call__"),
    ("  torch's trees", "torch._inductor.cudagraph_trees", "CUDAGraphTreeManager.run"),
    ("  torch's node run", "torch._inductor.cudagraph_trees", "CUDAGraphNode.run"),
    ("    torch's replay", "torch.cuda.graphs", "CUDAGraph.replay"),
    *(("  " + label, module, attr) for label, module, attr in SPLIT_PARTS),
    ("      with backward", "cgraw.trees.manager", "TreeManager._with_backward"),
)


def present(parts) -> tuple[list, list]:
    """``(parts whose callable exists, labels of those that do not)``."""
    import importlib

    have, missing = [], []
    for label, module, attr in parts:
        try:
            owner = importlib.import_module(module)
            for name in attr.split("."):
                owner = getattr(owner, name)
            have.append((label, module, attr))
        except (ImportError, AttributeError):
            missing.append(label.strip())
    return have, missing


def idle_us(step, steps: int = 10) -> float:
    """The host's time per step, each step started on an idle GPU (synchronized after it, not
    timed): a step of more launches than the device's queue holds does not wait for room in it,
    as it may behind ``host_us``' sleep kernel."""
    import torch

    total = 0
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        step()
        total += time.perf_counter_ns() - t0
    torch.cuda.synchronize()
    return total / steps / 1e3


def split_step(name: str, step, steps: int = 10) -> dict:
    """Print the inclusive host time per step of each part of ``STEP_PARTS`` over ``steps`` steps,
    each started on an idle GPU (``idle_us``); return ``{"step_us", "wrapper_us", "parts": {label:
    [us per step, calls per step]}, "missing": [labels]}``."""
    import torch

    parts, missing = present(STEP_PARTS)
    with Split(parts) as split:
        us = idle_us(step, steps)
    print(f"split {name}: {us:.0f} us per step, host alone from an idle GPU, with the wrappers "
          f"({split.overhead_ns / 1e3:.2f} us per wrapped call)" + (f"; not here, left out: {missing}" if missing else ""))
    timed = {label: [split.ns[label] / steps / 1e3, split.calls[label] / steps] for label, _, _ in parts
             if split.calls[label]}
    for label, (part_us, calls) in timed.items():
        print(f"  {label:28s} {part_us:9.1f} us per step, {calls:.1f} calls")
    torch.cuda.synchronize()
    return {"step_us": us, "wrapper_us": split.overhead_ns / 1e3, "parts": timed, "missing": missing}


if __name__ == "__main__":
    raise SystemExit(main())
