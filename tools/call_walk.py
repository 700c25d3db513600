"""The path of a graphed call's replay through cgraw's modules, and its host time.

``python3 -m tools.call_walk`` traces one replay of ``@cgraw.graphed`` over a one-tensor function
and prints the modules of ``cgraw/`` it runs code in, in order ("stays"), and how often the path
comes back to a module it had left ("returns"), for three calls: a root function's (its last
output dropped), one that extends the path, and a root function's while its last output is held
(the backend poisons it); ``--time`` adds the host time per call.

Without ``--device`` it runs on the CPU (torch needed): the real ``GraphedFunction``,
``TreeManager``, ``calls`` and ``Recording.replay``, over CPU tensors that report device 0, with
the two CUDA calls of a replay replaced by C functions that do nothing (on a GPU both are C
functions too, ``cuGraphLaunch`` and torch's current-stream query, and leave no Python frame).
``--device`` runs the real ``@cgraw.graphed`` on CUDA device 0. ``--time`` also times a call of
a function whose inputs are guarded (``inputs_guarded``: a piece of ``torch.compile(backend="cgraw")``)
with 120 tensors, as a model's parameters and buffers make it, and one that also returns 160
outputs of the tree's memory, as a training forward's piece returns the activations it saves,
with new output objects at each call and handed out again (``reuse_outputs``, as the backend's
pieces hand them out).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cgraw"
PIECE_TENSORS = 120  # tensors of the compiled piece timed with --time
PIECE_OUTPUTS = 160  # outputs of the training forward's piece timed with --time (ResNet-18's: 162)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m tools.call_walk", description=__doc__.split("\n")[0])
    ap.add_argument("--device", action="store_true", help="trace the real CUDA replay on device 0")
    ap.add_argument("--time", action="store_true", help="also time a call (median of 7 runs of 20,000 calls)")
    return ap.parse_args(argv)


def module_of(filename: str) -> str | None:
    """``cgraw.trees.manager`` for ``.../cgraw/trees/manager.py``; None outside ``cgraw/``."""
    path = pathlib.Path(filename).resolve()
    try:
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
    except ValueError:
        return None
    if rel.parts[0] != "cgraw":
        return None
    parts = rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts
    return ".".join(parts)


def walk(call) -> list[str]:
    """The modules of ``cgraw/`` that ``call()`` runs lines of, consecutive repeats merged."""
    seen: list[str] = []

    def tracer(frame, event, arg):
        mod = module_of(frame.f_code.co_filename)
        if mod is None:
            return None  # no line events outside cgraw
        if event == "line" and (not seen or seen[-1] != mod):
            seen.append(mod)
        return tracer

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return seen


def returns(stays: list[str]) -> int:
    """How often the path comes back to a module it had left."""
    return len(stays) - len(set(stays))


def per_call_us(fn, n: int = 20_000, reps: int = 7) -> float:
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(runs)


def _cpu_setup():
    """A graphed function and its input on the CPU, replaying a real ``Recording``."""
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from torch_cpu_backend import CpuTorchBackend

    from cgraw.interop.torch.kernel_state import kernel_state
    from cgraw.runtime import stream
    from cgraw.trees.calls import use_kernel_state, use_torch
    from cgraw.trees.config import grad_probe
    from cgraw.trees import graphed as graphed_mod
    from cgraw.trees import arrays, outputs, recording
    from cgraw.trees.manager import TreeManager

    torch.Tensor.get_device = lambda self: 0  # CPU tensors stand for device 0's
    # the two CUDA calls of a replay, as C functions that do nothing: the current-stream query
    # (device 0 -> stream 1) and cuGraphLaunch(exec 0, stream 1) -> divmod(0, 1) = (0, 0): success
    stream.current_getter = (1).__add__
    recording._launch = divmod

    # what the CUDA backend sets up once torch is imported: the tensor fast path, grad mode and the
    # settings that choose kernels in every call's key
    use_torch(torch.Tensor, torch.nn.Parameter)
    grad_probe(torch.is_grad_enabled)
    use_kernel_state(kernel_state())

    class Rec(recording.Recording):
        discarded = False  # the CPU backend's discard() marks it

    class Backend(CpuTorchBackend):
        def warmup(self, fn, call, args, kwargs):
            w = super().warmup(fn, call, args, kwargs)
            w.groups = frozenset()
            return w

        def record(self, fn, call, warm):
            out = fn.fn(*call.leaves)
            rec = Rec(fn.name)
            rec.exec_ = 0
            if isinstance(out, tuple):  # a piece's outputs, every one of them the tree's memory
                rec.out_spec = arrays.out_spec(out, leaves := [], ())
                rec.out_leaves, rec.out_kinds = leaves, [recording.OWNED] * len(leaves)
                rec.owned_idx, rec.out_alias = list(range(len(leaves))), [t.detach for t in leaves]
                rec.out_ptrs, rec.keep = [t.data_ptr() for t in leaves], out
                rec.reuse = outputs.reuse_for(fn, rec)  # as cuda_backend.record
                return rec
            rec.out_leaves, rec.out_kinds, rec.owned_idx = [out], [recording.OWNED], [0]
            rec.out_ptrs, rec.keep = [out.data_ptr()], out
            rec.alias0 = out.detach
            return rec

        def first_replay(self, rec, call):
            return rec.replay(call)

    def new_tree(ordinal):
        mgr = TreeManager(Backend(), device_index=ordinal)
        mgr.backend.mgr = mgr
        return mgr

    graphed_mod._new_tree = new_tree  # the factory the CPU tests swap
    return torch.randn(16)


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    import torch

    import cgraw

    x = torch.randn(16, device="cuda") if args.device else _cpu_setup()

    @cgraw.graphed
    def double(t):
        return t * 2

    @cgraw.graphed
    def shift(t):
        return t + 1

    def step():  # two functions in a step: double begins a generation, shift extends its path
        return shift(double(x))

    for _ in range(4):  # warm-ups, recordings, first replays
        step()
    held = []

    def hold():  # y = double(x) in a loop: the last output is alive when the next call begins
        held[0] = double(x)

    cases = {
        "root": ("a call of a root function (each call begins a generation)", lambda: double(x)),
        "path": ("a call that extends the path under way (a model's second graphed function)",
                 lambda: shift(double(x))),
        "held": ("a call of a root function while the last one's output is held (the backend poisons it)", hold),
    }
    for name, (what, call) in cases.items():
        if name == "path":
            a = double(x)
            call = lambda: shift(a)  # noqa: E731 -- trace shift(a) alone
        elif name == "held":
            held.append(double(x))
        stays = walk(call)
        print(f"{name}: {what}")
        print("  stays:", " -> ".join(m.removeprefix("cgraw.") for m in stays))
        print(f"  {len(stays)} stays in {len(set(stays))} modules, {returns(stays)} returns to a module already left")
    if args.time:
        print(f"step of two graphed calls: {per_call_us(step):.2f} us; one root call: {per_call_us(lambda: double(x)):.2f} us; "
              f"x.detach(): {per_call_us(x.detach):.2f} us; empty call: {per_call_us(lambda: None):.2f} us")
        # a piece of compiled code: 120 tensors (a model's parameters and buffers), inputs guarded by dynamo
        xs = [x.new_empty(64, 8).normal_() for _ in range(PIECE_TENSORS)]
        piece = cgraw.graphed(lambda *ts: ts[0] * 2)
        piece.inputs_guarded = True
        for _ in range(4):
            piece(*xs)
        with torch.no_grad():
            print(f"a compiled piece's call, {PIECE_TENSORS} tensors, grad off: "
                  f"{per_call_us(lambda: piece(*xs), n=2_000):.2f} us")
        # a training forward's piece: the tensors in, the activations its backward reads out, each
        # of them the tree's memory (views of one buffer here: one kernel, whatever the count)
        forward = cgraw.graphed(lambda *ts: ts[0].new_empty(PIECE_OUTPUTS, 64, 8).fill_(1.0).unbind(0))
        forward.inputs_guarded = True
        with torch.no_grad():
            for _ in range(4):
                forward(*xs)
            print(f"a training forward's piece, {PIECE_TENSORS} tensors in, {PIECE_OUTPUTS} out, grad off: "
                  f"{per_call_us(lambda: forward(*xs), n=2_000):.2f} us")
        # the same as the backend makes it: its output objects handed out again (trees.outputs.Reuse)
        again = cgraw.graphed(lambda *ts: ts[0].new_empty(PIECE_OUTPUTS, 64, 8).fill_(1.0).unbind(0))
        again.inputs_guarded = again.reuse_outputs = True
        with torch.no_grad():
            for _ in range(4):
                again(*xs)
            print(f"the same, its output objects handed out again (the backend's pieces): "
                  f"{per_call_us(lambda: again(*xs), n=2_000):.2f} us")
    cgraw.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
