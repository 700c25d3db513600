"""Device memory that eager, cgraw's trees and torch's trees add while running the same program.

``python -m benchmarks.memory`` runs each (program, system) pair in its own child process
(``python -m benchmarks.memory --child PROGRAM SYSTEM``), one after another: ``cuMemGetInfo`` counts
the whole device, so two children at once would see each other's memory. Programs:

- ``two_branch``: the seed document's tree program, ``y = f1(x); z = f2(y) if y.sum() > 0 else
  f3(y); out = f4(z)``, on float32 tensors of ``--mib`` MiB (64). The input's sign alternates by
  step, so the host condition takes both branches and the tree grows ``1 -> 2 -> 4`` and
  ``1 -> 3 -> 4``. Each function is elementwise with temporaries. The seed's ``f4`` multiplies by
  ``rand_like``; here it is deterministic, so results compare with eager's bitwise.
- ``two_branch_eager``: the same, as a test loop runs it: the input alternates between two tensors
  made once, and each step's eager reference is computed right after its graphed calls.
- ``gpt2``: a transformers GPT-2 forward under ``no_grad`` (4 layers, width 256, batch 8, 32 tokens,
  random weights).
- ``resnet_train``: a whole torchvision ResNet-18 training step (forward, cross-entropy,
  backward, SGD with momentum). Batch 8 at ``--resnet-size`` (224) pixels, TF32 off.

Systems: ``eager``; ``cgraw`` (each function ``@cgraw.graphed``, ``cgraw.mark_step_begin()`` every
step; cgraw's defaults: a warm-up autograd records nothing in runs inside the tree's pool,
``cgraw.trees.warmup``); ``cgraw_warm_outside`` (the same with
``cgraw.config.warmup_in_pool = False``: every warm-up outside the pool, in torch's global cache);
``torch_trees``
(each function ``torch.compile(mode="reduce-overhead")``,
``torch.compiler.cudagraph_mark_step_begin()`` every step; for the ResNet step the model is
compiled and loss, ``backward()`` and SGD run eagerly, torch's documented way: a whole step
compiled in reduce-overhead mode failed on the H200 with "accessing tensor output of CUDAGraphs
that has been overwritten"); ``torch_trees_aten`` (``torch.compile(backend="cudagraphs")``: torch's
same trees over the ATen kernels, without Inductor's fusion, so the gap to ``cgraw`` is the trees'
own; ``two_branch`` only unless ``--systems`` asks); ``cgraw_backend`` (each function
``torch.compile(backend="cgraw")``: Inductor's kernels in cgraw's trees, compiled as
``torch_trees`` compiles, ``cgraw.mark_step_begin()`` every step).

Each child reads free device bytes (``torch.cuda.mem_get_info``, i.e. ``cuMemGetInfo``) at its
baseline (after CUDA init, a tiny op, and the program's model and optimizer), after the steps and
a synchronise, and again after ``gc.collect()`` and ``torch.cuda.empty_cache()``. The last step's
inputs and result stay alive, as a user's variables would. Each child also records torch's
reserved bytes, the peak allocated above the baseline and the bytes of torch's private pools (the
tree pools). Only then is the last step's result checked against eager on the same inputs.
Writes ``benchmarks/results/memory.json`` after every child (``complete`` false, and ``not_run``
naming the pairs left, until the last one has run); ``--skip-compile`` leaves torch's trees out.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import signal
import subprocess
import sys
import time
import traceback

from benchmarks._harness import REPO_ROOT, Report

PROGRAMS = ("two_branch", "two_branch_eager", "gpt2", "resnet_train")
SYSTEMS = ("eager", "cgraw", "cgraw_warm_outside", "torch_trees", "torch_trees_aten", "cgraw_backend")
COMPILED = ("torch_trees", "torch_trees_aten", "cgraw_backend")
DEFAULT_SYSTEMS = {"two_branch": SYSTEMS, "two_branch_eager": SYSTEMS[:4] + SYSTEMS[5:],
                   "gpt2": SYSTEMS[:4] + SYSTEMS[5:], "resnet_train": SYSTEMS[:4] + SYSTEMS[5:]}
DEFAULT_STEPS = {"two_branch": 12, "two_branch_eager": 12, "gpt2": 10, "resnet_train": 10}
PLAIN_TIMEOUT_S = 90.0  # eager and cgraw children; torch.compile children get --timeout
RESULT_TAG = "CGRAW_MEMORY_RESULT "
MIB = 1 << 20

BASELINE = ("free device bytes (cuMemGetInfo) after CUDA init, one tiny op and the program's model, optimizer and "
            "constant tensors; every step's inputs are made inside the run, as a user would, so they count in the "
            "growth; the last step's inputs and result are alive at every later reading")

GPT2_VOCAB, GPT2_BATCH, GPT2_SEQ = 1000, 8, 32
RESNET_BATCH = 8


# ---------------------------------------------------------------- child: systems


def _wrap(system: str, fn):
    if system == "eager":
        return fn
    if system in ("cgraw", "cgraw_warm_outside"):
        import cgraw

        cgraw.config.warmup_in_pool = system == "cgraw"  # cgraw.trees.warmup; True by default
        return cgraw.graphed(fn)
    import torch

    if system == "torch_trees":
        return torch.compile(fn, mode="reduce-overhead")
    if system == "torch_trees_aten":
        return torch.compile(fn, backend="cudagraphs")
    if system == "cgraw_backend":
        return torch.compile(fn, backend="cgraw")
    raise ValueError(f"unknown system {system!r}")


def _step_begin(system: str) -> None:
    if system.startswith("cgraw"):
        import cgraw

        cgraw.mark_step_begin()
    elif system in COMPILED:
        import torch

        torch.compiler.cudagraph_mark_step_begin()


# ---------------------------------------------------------------- child: programs


class _TwoBranch:
    """The seed document's two-branch program on ``--mib`` MiB float32 tensors."""

    def __init__(self, system: str, dev, args):
        import torch

        def f1(x):  # GRAPH 1 of the seed
            return x * x * x

        def f2(y):  # GRAPH 2
            return (torch.tanh(y) + 1.0) * y

        def f3(y):  # GRAPH 3
            a = y.abs()
            return torch.log(a + 1.0) * a

        def f4(z):  # GRAPH 4 (the seed multiplies by rand_like)
            return z * torch.sigmoid(z)

        self.torch = torch
        self.n = args.mib * MIB // 4
        self.dev = dev
        self.eager = (f1, f2, f3, f4)
        self.fns = [_wrap(system, f) for f in self.eager]
        self.branches = {"f2": 0, "f3": 0}

    def before_last_step(self) -> None:
        pass

    def step(self, i: int):
        g1, g2, g3, g4 = self.fns
        x = self.torch.randn(self.n, device=self.dev).add_(1.0 if i % 2 == 0 else -1.0)
        y = g1(x)
        if y.sum() > 0:  # a host condition on the data, as in the seed
            self.branches["f2"] += 1
            z = g2(y)
        else:
            self.branches["f3"] += 1
            z = g3(y)
        return x, g4(z)

    def check(self, kept) -> None:
        x, out = kept
        f1, f2, f3, f4 = self.eager
        y = f1(x)
        ref = f4(f2(y) if y.sum() > 0 else f3(y))
        self.torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

    def extra(self) -> dict:
        return {"tensor_mib": self.n * 4 / MIB, "branches_taken": dict(self.branches)}


class _GPT2:
    """A transformers GPT-2 forward (logits) under ``no_grad``."""

    def __init__(self, system: str, dev, args):
        import torch
        import transformers

        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=GPT2_VOCAB, n_positions=128,
                                      bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
        model = transformers.GPT2LMHeadModel(cfg).to(dev).eval()

        def forward(ids):
            return model(input_ids=ids, use_cache=False).logits

        self.torch = torch
        self.dev = dev
        self.eager = forward
        self.fns = [_wrap(system, forward)]

    def before_last_step(self) -> None:
        pass

    def step(self, i: int):
        ids = self.torch.randint(0, GPT2_VOCAB, (GPT2_BATCH, GPT2_SEQ), device=self.dev)
        with self.torch.no_grad():
            return ids, self.fns[0](ids)

    def check(self, kept) -> None:
        ids, logits = kept
        with self.torch.no_grad():
            ref = self.eager(ids)
        self.torch.testing.assert_close(logits, ref, rtol=1e-3, atol=1e-3)

    def extra(self) -> dict:
        return {"batch": GPT2_BATCH, "seq": GPT2_SEQ, "layers": 4, "width": 256}


def _sgd_step(model, opt, x, y, set_to_none=False):
    import torch

    opt.zero_grad(set_to_none=set_to_none)  # None under torch's trees: grads are tree outputs
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()  # SGD's momentum buffers are made by the first step
    return loss.detach()


class _ResNetTrain:
    """A whole torchvision ResNet-18 training step, one function.

    The check replays the last step eagerly on a twin built from the state saved (to the host)
    just before it: one step of cuDNN's nondeterministic backward stays far inside 1e-3."""

    def __init__(self, system: str, dev, args):
        import torch
        import torchvision

        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.manual_seed(0)
        model = torchvision.models.resnet18(weights=None).to(dev).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        self.torch, self.torchvision = torch, torchvision
        self.dev, self.size = dev, args.resnet_size
        self.model, self.opt = model, opt
        if system in COMPILED:
            # torch's way to train under its trees: the model is compiled (forward and AOT backward
            # replay in the tree), loss, backward() and SGD run eagerly. A whole step compiled in
            # reduce-overhead mode graph-breaks at backward() and fails ("accessing tensor output of
            # CUDAGraphs that has been overwritten", H200, torch 2.11).
            forward = _wrap(system, model)
            self.fns = [lambda x, y: _sgd_step(forward, opt, x, y, set_to_none=True)]
        else:
            self.fns = [_wrap(system, lambda x, y: _sgd_step(model, opt, x, y))]
        self.saved = None

    def before_last_step(self) -> None:
        # host copies only: no device memory is allocated inside the measured run
        params = list(self.model.parameters())
        bufs = [self.opt.state.get(p, {}).get("momentum_buffer") for p in params]
        self.saved = ({k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                      [None if b is None else b.detach().cpu().clone() for b in bufs])

    def step(self, i: int):
        x = self.torch.randn(RESNET_BATCH, 3, self.size, self.size, device=self.dev)
        y = self.torch.randint(0, 1000, (RESNET_BATCH,), device=self.dev)
        return x, y, self.fns[0](x, y)

    def check(self, kept) -> None:
        torch = self.torch
        x, y, loss = kept
        state, bufs = self.saved
        twin = self.torchvision.models.resnet18(weights=None).to(self.dev).train()
        twin.load_state_dict(state)
        opt = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)
        for p, b in zip(twin.parameters(), bufs, strict=True):
            if b is not None:
                opt.state[p]["momentum_buffer"] = b.to(self.dev)
        ref = _sgd_step(twin, opt, x, y)
        torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
        got = self.model.state_dict()
        for name, t in twin.state_dict().items():
            torch.testing.assert_close(got[name], t, rtol=1e-3, atol=1e-3, msg=lambda m, n=name: f"{n}: {m}")

    def extra(self) -> dict:
        return {"batch": RESNET_BATCH, "image_size": self.size, "momentum_buffers_saved":
                None if self.saved is None else sum(b is not None for b in self.saved[1])}


class _TwoBranchEager(_TwoBranch):
    """``two_branch`` as a test loop runs it: the input alternates between two tensors made once,
    and the eager reference of each step is computed right after the graphed one (its temporaries
    come from torch's cache between graphed calls)."""

    def __init__(self, system: str, dev, args):
        super().__init__(system, dev, args)
        torch = self.torch
        self.inputs = [torch.randn(self.n, device=dev).add_(1.0), torch.randn(self.n, device=dev).sub_(1.0)]

    def step(self, i: int):
        g1, g2, g3, g4 = self.fns
        x = self.inputs[i % 2]
        y = g1(x)
        if y.sum() > 0:
            self.branches["f2"] += 1
            z = g2(y)
        else:
            self.branches["f3"] += 1
            z = g3(y)
        out = g4(z)
        f1, f2, f3, f4 = self.eager
        ref_y = f1(x)
        ref = f4(f2(ref_y) if ref_y.sum() > 0 else f3(ref_y))
        self.equal_steps += bool(self.torch.equal(out, ref))
        return x, out

    equal_steps = 0

    def extra(self) -> dict:
        return {**super().extra(), "steps_bitwise_equal_to_eager": self.equal_steps}


PROGRAM_CLASSES = {"two_branch": _TwoBranch, "two_branch_eager": _TwoBranchEager, "gpt2": _GPT2,
                   "resnet_train": _ResNetTrain}


# ---------------------------------------------------------------- child: readings


def _gpu_processes() -> list | None:
    """Processes with a context on the device, per nvidia-smi (a check that nothing else, such as a
    compile worker, moved the device-wide free bytes); None when nvidia-smi is missing."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None


def _private_pool_bytes(torch) -> int:
    """Bytes of segments in torch's private pools (graph and MemPool pools): the tree pools."""
    total = 0
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            total += seg["total_size"]
    return total


def _cgraw_details(device_index: int) -> dict:
    import cgraw
    from cgraw.trees.graphed import _managers  # private: per-function counts and pool bytes, as workloads.py reads

    buf = io.StringIO()
    cgraw.report(file=buf)
    out = {"report": buf.getvalue()[:4000]}
    mgr = _managers.get(device_index)
    if mgr is not None:
        pool = mgr.backend.pool
        if not pool.closed:
            out["tree_pool_bytes"] = pool.torch_reserved_bytes + pool.stats().reserved_bytes
        # False when a warm-up kept state in the pool: the tree moved to a fresh pool (cgraw.trees.warmup)
        out["warmups_in_pool_at_end"] = bool(getattr(mgr.backend, "warm_in_pool", False))
        out["functions"] = {}
        # every graphed function of the tree: the program's own, or the partitions of its compiled code
        for st in list(mgr.stats.values()):
            out["functions"][st.name] = {"warmups": st.warmups, "recordings": st.recordings,
                                         "rerecords": st.rerecords, "replays": st.replays,
                                         "eager_calls": st.eager_calls, "skip_reasons": dict(st.skip_reasons)}
    return out


def _torch_trees_details(torch, device_index: int) -> dict:
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    breaks = counters["graph_break"]
    out = {"graph_breaks": sum(breaks.values()), "graph_break_reasons": [str(r)[:200] for r in list(breaks)[:5]],
           "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
           "unique_graphs": counters["stats"]["unique_graphs"],
           "cudagraph_trees_config": torch._inductor.config.triton.cudagraph_trees}
    mgr = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    if mgr is not None:
        nodes, stack = 0, list(mgr.get_roots())
        while stack:
            node = stack.pop()
            nodes += 1
            for kids in node.children.values():
                stack.extend(kids)
        out["tree_nodes"] = nodes
    return out


def _child(program: str, system: str, args, rec: dict) -> None:
    """Run one program under one system, filling ``rec`` as readings arrive (a failure keeps them)."""
    rec.update(baseline=BASELINE, steps=args.steps)
    import torch

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    index = (dev.index or 0) if cuda else 0

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def free():
        return torch.cuda.mem_get_info(dev)[0] if cuda else None

    t0 = time.perf_counter()
    if cuda:
        torch.cuda.init()
        torch.ones(1, device=dev).add_(1.0)
        sync()
        rec["total_bytes"] = torch.cuda.mem_get_info(dev)[1]
    rec["free_at_init_bytes"] = free()
    prog = PROGRAM_CLASSES[program](system, dev, args)
    sync()
    rec["free_at_baseline_bytes"] = free_base = free()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        rec["allocated_at_baseline_bytes"] = alloc_base = torch.cuda.memory_allocated(dev)
        rec["reserved_at_baseline_bytes"] = torch.cuda.memory_reserved(dev)
    rec["setup_s"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    kept = None
    for i in range(args.steps):
        _step_begin(system)
        if i == args.steps - 1:
            prog.before_last_step()
        kept = prog.step(i)
    sync()
    rec["run_s"] = time.perf_counter() - t1
    if cuda:
        rec["free_after_run_bytes"] = free_run = free()
        rec["grown_bytes"] = free_base - free_run
        rec["grown_from_init_bytes"] = rec["free_at_init_bytes"] - free_run
        rec["reserved_bytes"] = torch.cuda.memory_reserved(dev)
        rec["allocated_bytes"] = torch.cuda.memory_allocated(dev)
        rec["peak_allocated_above_baseline_bytes"] = torch.cuda.max_memory_allocated(dev) - alloc_base
        rec["private_pool_bytes"] = _private_pool_bytes(torch)
        rec["gpu_processes"] = _gpu_processes()
        gc.collect()
        torch.cuda.empty_cache()
        sync()
        rec["free_after_empty_cache_bytes"] = free_empty = free()
        rec["grown_after_empty_cache_bytes"] = free_base - free_empty
        rec["reserved_after_empty_cache_bytes"] = torch.cuda.memory_reserved(dev)
        rec["private_pool_after_empty_cache_bytes"] = _private_pool_bytes(torch)
    rec.update(prog.extra())
    if system.startswith("cgraw"):
        rec["cgraw"] = _cgraw_details(index)
    elif system in COMPILED:
        rec["torch_trees"] = _torch_trees_details(torch, index)
    # checked after every reading: the eager reference allocates memory of its own
    try:
        prog.check(kept)
        rec["result_checked"] = True
    except AssertionError as exc:
        rec["result_checked"] = False
        rec["check_error"] = str(exc)[:600]


def _child_main(program: str, system: str, args) -> int:
    rec = {"program": program, "system": system}
    try:
        _child(program, system, args, rec)
        rc = 0
    except BaseException as exc:  # noqa: BLE001 -- reported on the result line, then a non-zero exit
        rec["error"] = f"{type(exc).__name__}: {exc}"[:800]
        rec["traceback_tail"] = traceback.format_exc()[-2000:]
        rc = 1
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(rec, default=str), flush=True)
    return rc


# ---------------------------------------------------------------- parent


def _run_child(program: str, system: str, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.memory", "--child", program, system, "--steps",
           str(args.steps or DEFAULT_STEPS[program]), "--mib", str(args.mib), "--resnet-size", str(args.resnet_size),
           "--device", args.device]
    timeout = args.timeout if system in COMPILED else PLAIN_TIMEOUT_S
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    # its own session, so that a timeout kills the child's compile workers with it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
    rec = {}
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            rec = json.loads(line[len(RESULT_TAG):])
    rec.setdefault("program", program)
    rec.setdefault("system", system)
    rec["child_s"] = round(time.perf_counter() - t0, 1)
    if timed_out:
        rec["error"] = f"timed out after {timeout:.0f} s (killed)"
    elif not rec.get("error") and proc.returncode != 0:
        rec["error"] = f"child exited with status {proc.returncode}, no result: {err.strip()[-300:]}"
    if rec.get("error"):
        rec["stderr_tail"] = err[-2000:]
    return rec


def _add_row(rep: Report, rec: dict) -> None:
    """One row per child. A child whose last result differed from eager gets null figures, as a
    failed check leaves a system untimed elsewhere (its readings stay under ``children``)."""
    program, system = rec["program"], rec["system"]
    ok = None
    if rec.get("result_checked") is not None:

        def child_check():
            if rec.get("check_error") is not None:
                raise AssertionError(f"the child's last result differs from eager: {rec['check_error']}")

        ok = rep.check(f"{program}: {system}", child_check)
    keys = {"grown_mib": "grown_bytes", "grown_after_empty_cache_mib": "grown_after_empty_cache_bytes",
            "reserved_mib": "reserved_bytes", "peak_allocated_mib": "peak_allocated_above_baseline_bytes",
            "tree_pool_mib": "private_pool_bytes"}
    figures = {k: _mib(rec, v) if ok is not False else None for k, v in keys.items()}
    error = rec.get("error") or (None if ok is not False else "result differs from eager (see failed_checks)")
    procs = rec.get("gpu_processes")
    rep.add(program=program, system=system, **figures, result_checked=ok, error=error, child_s=rec.get("child_s"),
            gpu_processes_seen=None if procs is None else len(procs))


def _mib(rec: dict, key: str):
    v = rec.get(key)
    return None if v is None else round(v / MIB, 1)


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def _ratios(rows: list[dict]) -> dict:
    """Per program: cgraw against each torch-trees system and every system against eager, before
    and after ``empty_cache``."""
    by = {(r["program"], r["system"]): r for r in rows if r["grown_mib"] is not None}
    out: dict = {}
    for program in dict.fromkeys(r["program"] for r in rows):
        cmp = {}
        pairs = [("cgraw", "torch_trees"), ("cgraw", "torch_trees_aten"), ("cgraw_warm_outside", "torch_trees"),
                 ("cgraw", "cgraw_warm_outside"), ("cgraw_backend", "torch_trees")]
        pairs += [(s, "eager") for s in SYSTEMS if s != "eager"]
        for a, b in pairs:
            ra, rb = by.get((program, a)), by.get((program, b))
            if ra is None or rb is None:
                continue
            cmp[f"{a}/{b}"] = {"grown": _ratio(ra["grown_mib"], rb["grown_mib"]),
                               "grown_after_empty_cache": _ratio(ra["grown_after_empty_cache_mib"],
                                                                 rb["grown_after_empty_cache_mib"])}
        out[program] = cmp
    return out


def _table(rows: list[dict]) -> str:
    head = (f"{'program':<13}{'system':<17}{'grown MiB':>10}{'after e_c':>10}{'reserved':>10}{'peak+':>9}"
            f"{'pools':>9}  checked  error")
    lines = [head, "-" * len(head)]

    def cell(v, w):
        return f"{'-' if v is None else v:>{w}}"

    for r in rows:
        lines.append(f"{r['program']:<13}{r['system']:<17}{cell(r['grown_mib'], 10)}"
                     f"{cell(r['grown_after_empty_cache_mib'], 10)}{cell(r['reserved_mib'], 10)}"
                     f"{cell(r['peak_allocated_mib'], 9)}{cell(r['tree_pool_mib'], 9)}  "
                     f"{r['result_checked']!s:<7}  {(r['error'] or '')[:70]}")
    lines.append("grown: cuMemGetInfo growth over the run; after e_c: after gc + empty_cache; reserved: torch's; "
                 "peak+: peak allocated above the baseline; pools: torch's private pools (the tree pools)")
    return "\n".join(lines)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)}")
    ap.add_argument("--systems", default=None,
                    help=f"comma-separated, of {', '.join(SYSTEMS)} (default: torch_trees_aten for two_branch only)")
    ap.add_argument("--skip-compile", action="store_true", help="leave out torch.compile's systems (a quick run)")
    ap.add_argument("--steps", type=int, default=None, help="steps per child (default: 12 two_branch, 10 others)")
    ap.add_argument("--mib", type=int, default=64, help="tensor size of the two-branch program")
    ap.add_argument("--resnet-size", type=int, default=224, help="image side of the ResNet-18 step")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per torch.compile child (others: 90)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/memory.json)")
    ap.add_argument("--force", action="store_true", help="run the children even if the driver probe fails")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": program logic only, no readings
    ap.add_argument("--child", nargs=2, metavar=("PROGRAM", "SYSTEM"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        program, system = args.child
        if program not in PROGRAMS or system not in SYSTEMS:
            ap.error(f"unknown program or system: {program} {system}")
        return args
    args.program_list = [p for p in args.programs.split(",") if p]
    bad = [p for p in args.program_list if p not in PROGRAMS]
    args.system_list = None if args.systems is None else [s for s in args.systems.split(",") if s]
    bad += [s for s in args.system_list or () if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown program or system: {', '.join(bad)}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if args.child:
        program, system = args.child
        args.steps = args.steps or DEFAULT_STEPS[program]
        return _child_main(program, system, args)

    programs, systems = args.program_list, args.system_list
    if args.device == "cuda" and not args.force:
        from cgraw import _cuda

        ok, reason = _cuda.driver_available()
        if not ok:
            print(f"benchmarks.memory needs a CUDA GPU: {reason}", file=sys.stderr)
            return 2

    rep = Report("memory", gpu=args.device == "cuda")
    details = {}
    config = {"mib": args.mib, "steps": {p: args.steps or DEFAULT_STEPS[p] for p in programs},
              "resnet_size": args.resnet_size, "timeout_s": args.timeout, "plain_timeout_s": PLAIN_TIMEOUT_S,
              "skip_compile": args.skip_compile, "device": args.device}
    todo = [(program, system) for program in programs for system in systems or DEFAULT_SYSTEMS[program]
            if not (args.skip_compile and system in COMPILED)]
    for k, (program, system) in enumerate(todo):
        rec = _run_child(program, system, args)
        details[f"{program}/{system}"] = rec
        _add_row(rep, rec)
        # saved after every child: a run stopped early keeps what it measured, and says so
        rep.save({"baseline": BASELINE, "config": config, "ratios": _ratios(rep.rows), "children": details,
                  "complete": False, "not_run": [f"{p}/{s}" for p, s in todo[k + 1:]]}, path=args.out)
    ratios = _ratios(rep.rows)
    print(_table(rep.rows))
    for program, cmp in ratios.items():
        for pair, r in cmp.items():
            if pair.startswith(("cgraw/torch", "cgraw_backend/torch")):
                print(f"{program}: {pair} grown {r['grown']}x, after empty_cache {r['grown_after_empty_cache']}x")
    path = rep.save({"baseline": BASELINE, "config": config, "ratios": ratios, "children": details,
                     "complete": True, "not_run": []}, path=args.out)
    print(f"results: {path}")
    return 1 if any(r["error"] for r in rep.rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
