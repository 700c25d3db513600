"""Real models with random weights, every system in the same run: host and device time per call.

Models, built from configs (never loaded from a hub):
- ``gpt2_b1``, ``gpt2_b8``: a transformers GPT-2 (4 layers, n_embd 256, 4 heads), the logits of
  a forward at batch 1 and 8, sequence 32;
- ``llama_decode``: a transformers Llama decoder (2 layers, hidden 256) greedy-decoding 64 tokens
  with a ``StaticCache``; the unit is one decode step (token in, next token out), timed per
  token; the prefill runs eagerly and is not timed;
- ``resnet18_b8``: torchvision ResNet-18 inference, batch 8, 64x64 images;
- ``resnet18_train``: a ResNet-18 training step (forward, cross-entropy, backward, SGD with
  momentum), batch 8, 64x64, BatchNorm in training mode;
- ``vit_tiny_b8``: timm ``vit_tiny_patch16_224`` at 64x64, inference, batch 8.

Systems: ``eager``; ``cgraw_graphed`` (``@cgraw.graphed``); ``cgraw_capture`` (``cgraw.capture()``
and ``replay`` with static inputs); ``torch_cudagraph`` (a hand-made ``torch.cuda.CUDAGraph``);
``reduce_overhead`` (``torch.compile(mode="reduce-overhead")``); ``cgraw_over_compile``
(``@cgraw.graphed`` over ``torch.compile`` in its default mode); ``cgraw_backend``
(``torch.compile(backend="cgraw")``: an inference graph of one partition graphed whole, other
graphs' partitions graphed functions of cgraw's tree;
the summary gives its host time per call over the device time of ``cgraw_over_compile``'s bursts,
the same default-mode Inductor kernels replayed by one graph far ahead of the host). Every system
runs in its own child process (``--child WORKLOAD SYSTEM``), workload by workload, and a workload's
systems are timed in turns (``METHOD["interleaving"]``); a compile is capped in wall-clock time
(``--compile-cap``). Every system is checked against eager before it is timed (``Report.check``);
one that differs or fails is recorded under ``failed_checks``, with the reason in its row, and is
not timed. ``python3 -m benchmarks.models [--quick]`` writes ``benchmarks/results/models.json``
(``models_quick.json`` with ``--quick``) after every workload (``complete`` false, and ``not_run``
the pairs left, until the last one); ``METHOD`` below is saved with it.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from benchmarks._harness import REPO_ROOT, RESULTS_DIR, Report, no_gpu

DEVICE = "cuda"  # "cpu" with the hidden --device cpu: eager and compiled systems, the logic without figures
TAG = "@@models "  # prefixes the children's protocol lines (other output is ignored)

WORKLOADS = {  # name -> (package, kind)
    "gpt2_b1": ("transformers", "forward"),
    "gpt2_b8": ("transformers", "forward"),
    "llama_decode": ("transformers", "decode"),
    "resnet18_b8": ("torchvision", "forward"),
    "resnet18_train": ("torchvision", "train"),
    "vit_tiny_b8": ("timm", "forward"),
}
UNCOMPILED = ("eager", "cgraw_graphed", "cgraw_capture", "torch_cudagraph")
COMPILED = ("reduce_overhead", "cgraw_over_compile", "cgraw_backend")
SYSTEMS = UNCOMPILED + COMPILED
CGRAW_TREE_SYSTEMS = ("cgraw_graphed", "cgraw_over_compile", "cgraw_backend")
BACKEND_NAME = "bench"  # the name cgraw_backend's compiled code has in cgraw.report()

GPT2_VOCAB, GPT2_SEQ = 1000, 32
LLAMA_VOCAB, LLAMA_PROMPT, LLAMA_NEW = 1000, 8, 64
IMAGE_HW, IMAGE_BATCH, NUM_CLASSES = 64, 8, 10
TRAIN_CHECK_STEPS = 5
DECODE_MIN_EQUAL = 8

# float32, TF32 off in every process. Graph systems replay eager's own kernels: the tests' 1e-4
# leaves room for another cuBLAS/cuDNN algorithm or attention kernel (transformers materialises
# the causal mask while a stream captures). Compiled systems run inductor's fused kernels, which
# reorder reductions.
GRAPH_TOL = {"rtol": 1e-4, "atol": 1e-4}
TRAIN_GRAPH_TOL = {"rtol": 1e-4, "atol": 1e-5}  # one step from eager's state (test_third_party)
COMPILED_TOL = {"rtol": 2e-3, "atol": 2e-3}

# kind -> (calls per burst, repeats, warm-up calls); a decode burst is one 64-token decode and
# its warm-up counts decodes
LOOPS = {"forward": (200, 5, 20), "train": (50, 5, 5), "decode": (LLAMA_NEW, 15, 1)}
QUICK_LOOPS = {"forward": (50, 3, 5), "train": (10, 3, 2), "decode": (LLAMA_NEW, 2, 1)}
TIMING_CAP_S = {False: 180.0, True: 60.0}  # a ready child's timing, by --quick

METHOD = {
    "host_us": "median over repeats of the perf_counter time of a burst of N calls plus one "
               "torch.cuda.synchronize, divided by N (submit + completion); forward and training "
               "bursts alternate two input sets; a decode burst is one 64-token greedy decode, per "
               "token, after an eager prefill that is not timed",
    "submit_us": "the same bursts up to the return of the last call, before the synchronise (host "
                 "submission only)",
    "host_ref_us": "the host's speed beside each burst: a fixed pure-Python loop (no torch, no GPU) timed "
                   "just before the burst; median over repeats, and per burst in host_ref_bursts_us beside "
                   "host_bursts_us. This machine's CPU runs the same loop in two modes about 1.7x apart, "
                   "for seconds at a time, and a host-bound burst slows with it. host_ref_cpu_bursts_us: "
                   "the loop's CPU time in its thread (below its time when the thread waited: for the "
                   "GIL or the core); threads: the child's Python threads after its bursts",
    "device_us": "CUDA events on the current stream before the burst's first call and after its "
                 "last, divided by N: the device timeline of the burst, which includes the device's "
                 "idle gaps when the host is the bottleneck (eager)",
    "speedup": "eager / system, same run (eager's child timed in turns with the others). No speedup is given for a cgraw system that did not "
               "replay every timed call (eager fallback, re-record or eager call: graph_replayed false)",
    "summary_ratios": "cgraw / peer: below 1 means cgraw takes less time",
    "checks": "before timing, each system against eager: forward outputs with assert_close (graph "
              "systems rtol/atol 1e-4, compiled 2e-3) over three set-up calls (warm-up, record, "
              "replay; a compile's first calls) and two on fresh inputs; training: 5 steps, each "
              "from the eager model's state (parameters, buffers and momentum buffers copied in "
              "place), the loss and every state tensor after the step (graphs rtol 1e-4 atol 1e-5, "
              "compiled 2e-3); decode: the 65 greedy tokens of two decodes equal eager's, or, where "
              "a near-tie argmax flips, at least the first 8 (the divergence index is reported)",
    "precision": "float32; cuDNN and cuBLAS TF32 off in every process",
    "compile": "every system runs in a child process with its own empty Inductor and Triton "
               "cache directories (a cold compile); a workload's systems that compile nothing start "
               "together, then its compiled ones, up to --compile-jobs compiling at once "
               "(default 1; each with TORCHINDUCTOR_COMPILE_THREADS = cores / jobs unless set), each "
               "capped at --compile-cap seconds from its start until it is compiled and checked. "
               "compile_s is the wall time of the torch.compile(...) call (compile_call_s: "
               "reduce-overhead imports Inductor there, a backend named by a string does at its "
               "first call) plus the first three calls (decode: the first 64-token decode), "
               "setup_calls_s each of those calls",
    "decode": "each step is given the last step's token: reduce-overhead's loop clones it (torch's trees "
              "overwrite a previous generation's outputs when a recording ends), the static-input "
              "systems copy it into their input, @cgraw.graphed over torch.compile and the cgraw backend "
              "take it as it is (a tree keeps it readable until the call has copied it in)",
    "interleaving": "a workload's systems are timed in turns: each child runs its warm-up "
                    "calls, then one burst per turn, the children of the workload taking turns "
                    "(the order reversed every round) while the others wait on stdin; so a change "
                    "of the machine's speed during the run falls on every system alike",
}


class CheckFailed(Exception):
    """A system's result differs from eager's: the system is not timed."""


class Workload:
    """One model and its unit of work.

    ``kind`` "forward": ``fn(*inputs)`` returns the output. "train": ``new_step()`` returns a step
    bound to a fresh copy of the initial model and optimizer (``step.model``, ``step.opt``).
    "decode": ``step(tok, pos, cache)`` returns the next token; ``new_cache()``,
    ``prefill(cache)``, ``positions`` and ``reference_tokens()`` (eager's greedy tokens).
    """

    def __init__(self, name: str, kind: str, info: dict, **fields):
        self.name, self.kind, self.info = name, kind, info
        self.__dict__.update(fields)


# ---------------------------------------------------------------- models


def _gpt2(name: str) -> Workload:
    import torch
    import transformers

    batch = int(name.rsplit("_b", 1)[1])
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=GPT2_VOCAB, n_positions=128,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).to(DEVICE).eval()

    @torch.no_grad()
    def forward(ids):
        return model(input_ids=ids, use_cache=False).logits

    return Workload(name, "forward", {"model": "transformers GPT2LMHeadModel 4x256, 4 heads", "batch": batch,
                                      "seq": GPT2_SEQ, "unit": "call"},
                    fn=forward, inputs=lambda: (torch.randint(0, GPT2_VOCAB, (batch, GPT2_SEQ), device=DEVICE),))


def _image():
    import torch

    return torch.randn(IMAGE_BATCH, 3, IMAGE_HW, IMAGE_HW, device=DEVICE)


def _resnet(name: str) -> Workload:
    import torch
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=NUM_CLASSES).to(DEVICE)
    info = {"model": "torchvision resnet18", "batch": IMAGE_BATCH, "image": IMAGE_HW, "unit": "call"}
    if name == "resnet18_b8":
        model.eval()

        @torch.no_grad()
        def forward(x):
            return model(x)

        return Workload(name, "forward", info, fn=forward, inputs=lambda: (_image(),))

    model.train()  # BatchNorm in training mode
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def new_step(wrap=None, set_to_none=False):
        """A fresh copy of the model and optimizer and a step over them; ``wrap(model)`` (e.g.
        ``torch.compile``) is what the step calls for the forward pass. Whole-step graphs need
        gradients zeroed in place (``set_to_none=False``: they stay at their addresses); under
        torch's trees the gradients are outputs of the backward graph of an earlier generation,
        so they are set to None, torch's default."""
        m, o = copy.deepcopy((model, opt))  # taken before any step: every copy starts alike
        forward = m if wrap is None else wrap(m)

        def step(x, y):
            o.zero_grad(set_to_none=set_to_none)
            loss = torch.nn.functional.cross_entropy(forward(x), y)
            loss.backward()
            o.step()  # SGD's momentum buffers are made by the first step (a warm-up)
            return loss.detach()

        step.model, step.opt = m, o
        return step

    return Workload(name, "train", {**info, "optimizer": "SGD lr 0.01 momentum 0.9"}, new_step=new_step,
                    inputs=lambda: (_image(), torch.randint(0, NUM_CLASSES, (IMAGE_BATCH,), device=DEVICE)))


def _vit(name: str) -> Workload:
    import timm
    import torch

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE_HW,
                              num_classes=NUM_CLASSES).to(DEVICE).eval()

    @torch.no_grad()
    def forward(x):
        return model(x)

    return Workload(name, "forward", {"model": "timm vit_tiny_patch16_224", "batch": IMAGE_BATCH, "image": IMAGE_HW,
                                      "unit": "call"},
                    fn=forward, inputs=lambda: (_image(),))


def _llama(name: str) -> Workload:
    import inspect

    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(DEVICE).eval()
    prompt = torch.randint(0, LLAMA_VOCAB, (1, LLAMA_PROMPT), device=DEVICE)
    positions = torch.arange(LLAMA_PROMPT, LLAMA_PROMPT + LLAMA_NEW, device=DEVICE)
    # transformers 4.x wrote a StaticCache at ``cache_position``; 5.x keeps the write position in
    # the cache (a device tensor advanced in place) and takes positions from ``position_ids``
    takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters

    @torch.no_grad()
    def step(tok, pos, cache):
        kw = {"cache_position": pos} if takes_cache_position else {}
        out = model(input_ids=tok, position_ids=pos.unsqueeze(0), past_key_values=cache, use_cache=True, **kw)
        return out.logits[:, -1, :].argmax(-1, keepdim=True)

    def new_cache():
        return transformers.StaticCache(config=model.config, max_cache_len=LLAMA_PROMPT + LLAMA_NEW + 8)

    @torch.no_grad()
    def prefill(cache):
        cache.reset()  # zeroes the cache in place: its tensors keep their addresses
        kw = {"cache_position": torch.arange(LLAMA_PROMPT, device=DEVICE)} if takes_cache_position else {}
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, **kw).logits
        return logits[:, -1, :].argmax(-1, keepdim=True)

    memo = []

    def reference_tokens():
        if not memo:
            cache = new_cache()
            memo.append(_decode(lambda t, p: step(t, p, cache), prefill(cache), positions, collect=True))
        return memo[0]

    return Workload(name, "decode", {"model": "transformers LlamaForCausalLM 2x256, 4 heads, 2 kv heads",
                                     "batch": 1, "prompt": LLAMA_PROMPT, "new_tokens": LLAMA_NEW, "unit": "token",
                                     "passes_cache_position": takes_cache_position},
                    step=step, new_cache=new_cache, prefill=prefill, positions=positions,
                    reference_tokens=reference_tokens)


def _build(name: str) -> Workload:
    import torch

    torch.manual_seed(0)
    if name.startswith("gpt2"):
        return _gpt2(name)
    if name == "llama_decode":
        return _llama(name)
    if name.startswith("resnet18"):
        return _resnet(name)
    if name.startswith("vit"):
        return _vit(name)
    raise ValueError(f"unknown workload {name!r}")


def _decode(call, tok, positions, *, collect: bool):
    """``LLAMA_NEW`` greedy steps from ``tok`` (the prefill's token); the tokens when ``collect``."""
    import torch

    toks = [tok.clone()] if collect else None
    for i in range(LLAMA_NEW):
        tok = call(tok, positions[i:i + 1])
        if collect:
            toks.append(tok.clone())  # a graph's output is overwritten by the next step
    return torch.cat(toks, dim=1)[0].tolist() if collect else None


# ---------------------------------------------------------------- systems


def _make_call(system: str, fn, extra=(), *, backward: bool = False):
    """``call(*inputs)`` running ``fn(*inputs, *extra)`` as ``system`` does, and the
    ``GraphedFunction`` whose stats tell whether cgraw replayed (None for other systems)."""
    import torch

    if system == "eager":
        return ((lambda *xs: fn(*xs, *extra)) if extra else fn), None
    if system in ("cgraw_capture", "torch_cudagraph"):
        return _static_graph(lambda *xs: fn(*xs, *extra), system, backward=backward), None
    if system == "reduce_overhead":
        compiled = torch.compile(fn, mode="reduce-overhead", dynamic=False)
        mark = torch.compiler.cudagraph_mark_step_begin

        def call(*xs):
            mark()  # torch requires it before each step
            return compiled(*xs, *extra)

        return call, None
    if system == "cgraw_backend":
        compiled = torch.compile(fn, backend="cgraw", dynamic=False, options={"name": BACKEND_NAME})
        return ((lambda *xs: compiled(*xs, *extra)) if extra else compiled), Partitions(BACKEND_NAME)
    import cgraw

    if system == "cgraw_graphed":
        g = cgraw.graphed(fn)
    elif system == "cgraw_over_compile":
        g = cgraw.graphed(torch.compile(fn, dynamic=False))  # dynamo's guards run at warm-up and recording only
    else:
        raise ValueError(f"unknown system {system!r}")
    return ((lambda *xs: g(*xs, *extra)) if extra else g), g


def _static_graph(fn, system: str, *, backward: bool = False):
    """A call over static inputs. The first call copies its inputs into static tensors, runs ``fn``
    on them eagerly (the warm-up: a real step, whose result it returns) and captures ``fn``; later
    calls ``copy_`` their inputs into the static tensors, replay, and return the static output."""
    import torch

    state: dict = {}

    def call(*xs):
        if state:
            for dst, x in zip(state["static"], xs, strict=True):
                dst.copy_(x)
            state["replay"]()
            return state["out"]
        static = [x.clone() for x in xs]
        if system == "torch_cudagraph":
            side = torch.cuda.Stream()  # warm-up on a side stream, as torch's documentation does
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                first = fn(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(*static)
        else:
            import cgraw

            first = fn(*static)
            # the public API only: a step with a backward pass is captured as a user would (autograd's
            # device thread allocates on the capture stream); a failure is this system's row error
            with cgraw.capture() as graph:
                out = fn(*static)
        state.update(static=static, out=out, replay=graph.replay, graph=graph)
        return first

    return call


# ---------------------------------------------------------------- checks


class _WallEvent:
    """``--device cpu``: a CUDA event's interface over the wall clock."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def _sync() -> None:
    if DEVICE != "cpu":
        import torch

        torch.cuda.synchronize()


def _event():
    if DEVICE == "cpu":
        return _WallEvent()
    import torch

    return torch.cuda.Event(enable_timing=True)


def _timed_call(call, xs):
    _sync()
    t0 = time.perf_counter()
    out = call(*xs)
    _sync()
    return out, time.perf_counter() - t0


def _assert_close(got, want, tol: dict, what: str) -> None:
    import torch

    try:
        torch.testing.assert_close(got, want, **tol)
    except AssertionError as exc:
        raise CheckFailed(f"{what}: {exc}") from None


def _check_forward(wl: Workload, call, tol: dict) -> tuple[float, dict]:
    """Three set-up calls (warm-up, record, first replay; a compile's first calls) and two on fresh
    inputs, each compared with eager right away (a graph's output lives until the next call)."""
    calls_s = []
    for i in range(5):
        xs = wl.inputs()
        got, dt = _timed_call(call, xs)
        if i < 3:
            calls_s.append(dt)
        _assert_close(got, wl.fn(*xs), tol, f"call {i + 1}")
    return sum(calls_s), {"setup_calls_s": calls_s}


def _train_state(step) -> list:
    """What a training step carries to the next: parameters and buffers, then momentum buffers
    (None before the first step)."""
    state = list(step.model.state_dict().values())
    for p in step.model.parameters():
        st = step.opt.state.get(p)
        state.append(st.get("momentum_buffer") if st else None)
    return state


def _check_train(wl: Workload, call, step, tol: dict, ref=None) -> tuple[float, dict]:
    """Eager training of this model is chaotic (cuDNN's convolution and BatchNorm backward passes
    accumulate in nondeterministic order and BatchNorm at batch 8 amplifies it), so trajectories
    are not compared: before each step the system's parameters, buffers and momentum buffers are
    set to an eager model's, in place (graphs read them where they are); both take one step on the
    same batch; the loss and every state tensor must agree (as ``test_third_party`` does).

    ``ref``: the step to compare with (default: eager). Given, an eager step from the same state
    is taken as well, and the largest deviation of ``ref``'s state from it is reported
    (``max_abs_ref_vs_eager``), not checked."""
    import torch

    eager = None
    if ref is None:
        ref = wl.new_step()
    else:
        eager = wl.new_step()
    deviation = 0.0
    calls_s = []
    for i in range(TRAIN_CHECK_STEPS):
        with torch.no_grad():
            for t, t_ref in zip(_train_state(step), _train_state(ref), strict=True):
                if t is not None and t_ref is not None:
                    t.copy_(t_ref)
            if eager is not None:
                for t, t_ref in zip(_train_state(eager), _train_state(ref), strict=True):
                    if t is not None and t_ref is not None:
                        t.copy_(t_ref)
        xs = wl.inputs()
        got, dt = _timed_call(call, xs)
        if i < 3:
            calls_s.append(dt)
        _assert_close(got, ref(*xs), tol, f"step {i + 1}: loss")
        if eager is not None:
            eager(*xs)
            for t, t_e in zip(_train_state(ref), _train_state(eager), strict=True):
                if t is not None and t_e is not None and t.is_floating_point():
                    deviation = max(deviation, (t - t_e).abs().max().item())
        for k, (t, t_ref) in enumerate(zip(_train_state(step), _train_state(ref), strict=True)):
            if (t is None) != (t_ref is None):
                raise CheckFailed(f"step {i + 1}: state {k} exists in one model only")
            if t is not None:
                _assert_close(t, t_ref, tol, f"step {i + 1}: state {k}")
    detail = {"setup_calls_s": calls_s}
    if eager is not None:
        detail["max_abs_ref_vs_eager"] = deviation
    return sum(calls_s), detail


def _first_divergence(got: list, ref: list):
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            return i
    return None if len(got) == len(ref) else min(len(got), len(ref))


def _check_decode(wl: Workload, call, prefill) -> tuple[float, dict]:
    """Two decodes (the first holds the warm-up and recording, or the compile), each against
    eager's greedy tokens. Replayed graphs run eager's kernels and give eager's tokens; a compiled
    model may flip an argmax between two near-equal logits (float noise) and diverge from there, so
    the check asks for the first ``DECODE_MIN_EQUAL`` tokens equal and reports where they diverged."""
    ref = wl.reference_tokens()
    detail, setup_s = {}, 0.0
    for run in (1, 2):
        tok = prefill()
        _sync()
        t0 = time.perf_counter()
        got = _decode(call, tok, wl.positions, collect=True)
        _sync()
        if run == 1:
            setup_s = time.perf_counter() - t0
        d = _first_divergence(got, ref)
        detail[f"first_divergence_run{run}"] = d
        if d is not None and d < DECODE_MIN_EQUAL:
            raise CheckFailed(f"decode {run}: token {d} differs from eager's (got {got[:d + 4]}, eager {ref[:d + 4]})")
    detail["tokens_equal"] = detail["first_divergence_run1"] is None and detail["first_divergence_run2"] is None
    return setup_s, detail


# ---------------------------------------------------------------- timing


def _bursts(burst, n: int, repeats: int, prepare=None, turn=None) -> dict:
    """Per call: host time of a burst with and without its final synchronise, and the device time
    between events around it; medians over ``repeats``. ``prepare()`` (untimed) gives the state
    that ``burst(state)`` starts from; ``turn()`` (untimed) runs before each burst: a child process
    waits there while the other systems of its workload take their turn."""
    host, submit, device, ref, ref_cpu = [], [], [], [], []
    for _ in range(repeats):
        if turn is not None:
            turn()
        state = prepare() if prepare is not None else None
        _sync()
        ref.append(host_ref_us(ref_cpu))
        start, end = _event(), _event()
        t0 = time.perf_counter_ns()
        start.record()
        burst(state)
        end.record()
        t1 = time.perf_counter_ns()
        _sync()
        t2 = time.perf_counter_ns()
        host.append((t2 - t0) / n / 1e3)
        submit.append((t1 - t0) / n / 1e3)
        device.append(start.elapsed_time(end) * 1e3 / n)
    by_burst = {"host_bursts_us": [round(h, 2) for h in host], "host_ref_bursts_us": [round(r, 1) for r in ref],
                "host_ref_cpu_bursts_us": [round(r, 1) for r in ref_cpu], "threads": threading.active_count()}
    host.sort()
    return {"host_us": statistics.median(host), "host_p90_us": host[int(0.9 * (len(host) - 1))],
            "submit_us": statistics.median(submit), "device_us": statistics.median(device),
            "host_ref_us": statistics.median(ref), **by_burst, "loops": n, "repeats": repeats}


def host_ref_us(cpu: list | None = None) -> float:
    """The time of a fixed pure-Python loop (about 0.5 ms on a 2 GHz core): the host's speed now;
    its CPU time in this thread is appended to ``cpu``."""
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    s = 0
    for i in range(20000):
        s += i & 7
    t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    if cpu is not None:
        cpu.append((c1 - c0) / 1e3)
    return (t1 - t0) / 1e3


def _time(wl: Workload, call, loops: tuple, prefill=None, turn=None) -> dict:
    n, repeats, warm = loops
    if wl.kind == "decode":
        def burst(tok):
            _decode(call, tok, wl.positions, collect=False)

        for _ in range(warm):
            burst(prefill())
        res = _bursts(burst, LLAMA_NEW, repeats, prepare=prefill, turn=turn)
        res["timed_calls"] = (warm + repeats) * LLAMA_NEW
        return res
    pair = (wl.inputs(), wl.inputs())  # two input sets, alternated: inputs change address every call

    def burst(_):
        for k in range(n):
            call(*pair[k & 1])

    for k in range(warm):
        call(*pair[k & 1])
    res = _bursts(burst, n, repeats, turn=turn)
    res["timed_calls"] = warm + n * repeats
    return res


# ---------------------------------------------------------------- one (workload, system)


def _text(exc: BaseException, limit: int = 1500) -> str:
    return f"{type(exc).__name__}: {exc}"[:limit]


class Partitions:
    """The graphed partitions (and whole graphs: an inference graph of one partition, by default) of
    ``torch.compile(backend="cgraw")`` code named ``name``: their stats, summed (replays: the fewest of any partition, so one per call that replayed them all).
    Only the partitions of each dynamo frame's last compile count (names ``<name> [frame/compile]
    ...``): a frame recompiled stops calling its earlier compile's partitions; ``compiles`` says
    how many each frame had."""

    def __init__(self, name: str):
        self.prefix = f"{name} ["

    def stats(self, mgr) -> dict | None:
        import re

        parts = [s for s in list(mgr.stats.values())
                 if s.name.startswith(self.prefix) and ("/partition " in s.name or s.name.endswith("/whole graph"))]
        if not parts:
            return None
        ids = {id(s): tuple(int(v) for v in m.groups()) if (m := re.search(r"\[(\d+)/(\d+)\]", s.name)) else (-1, 0)
               for s in parts}
        last: dict = {}
        for frame, compile_ in ids.values():
            last[frame] = max(last.get(frame, 0), compile_)
        parts = [s for s in parts if ids[id(s)][1] == last[ids[id(s)][0]]]
        skips: dict = {}
        for s in parts:
            for r, n in s.skip_reasons.items():
                skips[f"{s.name}: {r}"] = n
        return {"partitions": len(parts), "compiles": {str(f): n + 1 for f, n in sorted(last.items())},
                "warmups": sum(s.warmups for s in parts),
                "recordings": sum(s.recordings for s in parts), "rerecords": sum(s.rerecords for s in parts),
                "replays": min(s.replays for s in parts), "eager_calls": sum(s.eager_calls for s in parts),
                "skip_reasons": skips, "rerecord_reasons": [r for s in parts for r in s.rerecord_reasons[-3:]]}


def _graph_stats(g):
    if g is None:
        return None
    import torch

    from cgraw.trees.graphed import _managers

    mgr = _managers.get(torch.cuda.current_device())
    if isinstance(g, Partitions):
        return g.stats(mgr) if mgr is not None else None
    st = mgr.stats.get(g.fn_id) if mgr is not None else None
    if st is None:
        return None
    return {"warmups": st.warmups, "recordings": st.recordings, "rerecords": st.rerecords, "replays": st.replays,
            "eager_calls": st.eager_calls, "skip_reasons": dict(st.skip_reasons),
            "rerecord_reasons": list(st.rerecord_reasons[-3:])}


class _Made:
    """``made(f, *args)``: ``f(*args)``, its time added to ``made.s``."""

    def __init__(self):
        self.s = 0.0

    def __call__(self, f, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            self.s += time.perf_counter() - t0


def _measure(wl: Workload, system: str, *, quick: bool, ready=None, turn=None) -> dict:
    """Build ``system`` for ``wl``, check it against eager, then time it. ``ready(row)`` runs
    between the check and the timing, ``turn()`` before each timed burst (a child process waits
    in both for its turn)."""
    row = {"workload": wl.name, "system": system, **wl.info}
    compiled = system in COMPILED
    loops = (QUICK_LOOPS if quick else LOOPS)[wl.kind]
    g = prefill = None
    made = _Made()  # the time of making the system's call: torch.compile(...) for the compiled ones
    try:
        if wl.kind == "decode":
            cache = wl.new_cache()
            call, g = made(_make_call, system, wl.step, (cache,))
            if system == "reduce_overhead":
                # the next step's input is this step's output, and cudagraph trees free a previous
                # generation's outputs when a recording ends: clone it out (one copy kernel, like
                # the static-input systems' copy_ of the token). cgraw's systems take it back as it
                # is: a tree keeps an output readable until the call it is given to has copied it in
                inner = call

                def call(tok, pos):
                    return inner(tok, pos).clone()

            def prefill():
                return wl.prefill(cache)

            setup_s, detail = _check_decode(wl, call, prefill)
        elif wl.kind == "train" and system == "reduce_overhead":
            # torch's documented way to train under its trees: the model is compiled (forward and
            # AOT backward graphs replay in the tree) and the loss, backward() and the optimizer
            # step run eagerly; a whole step compiled in reduce-overhead mode graph-breaks at
            # backward() and fails with "accessing tensor output of CUDAGraphs that has been
            # overwritten" (seen on the H200 with torch 2.11)
            import torch

            # inductor's training numerics differ from eager's beyond COMPILED_TOL (conv1's gradient:
            # 0.0076 absolute at near-zero elements on the H200), so the graphs are
            # checked against the same model compiled without them (torch.compile's default mode);
            # how far that reference is from eager is reported beside it. The reference is made
            # first, in both compiled training systems: its torch.compile(...) imports Inductor
            ref = wl.new_step(lambda m: torch.compile(m, dynamic=False), set_to_none=True)
            step = made(wl.new_step, lambda m: torch.compile(m, mode="reduce-overhead", dynamic=False), set_to_none=True)
            mark = torch.compiler.cudagraph_mark_step_begin

            def call(*xs):
                mark()
                return step(*xs)

            row["compiled_part"] = "model forward (and its AOT backward); loss, backward() and SGD eager"
            row["check_reference"] = "the same model under torch.compile's default mode (no graphs)"
            setup_s, detail = _check_train(wl, call, step, TRAIN_GRAPH_TOL, ref=ref)
        elif wl.kind == "train" and system == "cgraw_backend":
            # compiled as reduce_overhead is (the model; its forward and AOT backward partitions
            # in cgraw's tree; loss, backward() and SGD eager), checked against the same reference
            import torch

            ref = wl.new_step(lambda m: torch.compile(m, dynamic=False), set_to_none=True)
            step = made(wl.new_step, lambda m: torch.compile(m, backend="cgraw", dynamic=False,
                                                            options={"name": BACKEND_NAME}), set_to_none=True)
            call, g = step, Partitions(BACKEND_NAME)
            row["compiled_part"] = "model forward (and its AOT backward); loss, backward() and SGD eager"
            row["check_reference"] = "the same model under torch.compile's default mode (no graphs)"
            setup_s, detail = _check_train(wl, call, step, TRAIN_GRAPH_TOL, ref=ref)
        elif wl.kind == "train" and system == "cgraw_over_compile":
            # the whole step compiled, under cgraw's tree; checked, like reduce_overhead, against
            # the same step compiled without cgraw: inductor's numerics differ from eager's beyond
            # COMPILED_TOL on this model (0.0105 absolute on the H200 with cgraw running the compiled
            # step eagerly), which says nothing about cgraw
            import torch

            step = wl.new_step()
            call, g = made(_make_call, system, step, backward=True)
            ref_step = wl.new_step()
            compiled_ref = torch.compile(ref_step, dynamic=False)

            def ref(*xs):
                return compiled_ref(*xs)

            ref.model, ref.opt = ref_step.model, ref_step.opt
            row["check_reference"] = "the same step under torch.compile's default mode, without cgraw"
            setup_s, detail = _check_train(wl, call, step, TRAIN_GRAPH_TOL, ref=ref)
        elif wl.kind == "train":
            step = wl.new_step()
            call, g = made(_make_call, system, step, backward=True)
            setup_s, detail = _check_train(wl, call, step, TRAIN_GRAPH_TOL)
        else:
            call, g = made(_make_call, system, wl.fn)
            setup_s, detail = _check_forward(wl, call, COMPILED_TOL if compiled else GRAPH_TOL)
    except CheckFailed as exc:
        against = "its reference" if "check_reference" in row else "eager"
        row["check"] = f"differs from {against}: {str(exc)[:1500]}"
        row["cgraw"] = _graph_stats(g)
        return row
    except Exception as exc:  # noqa: BLE001 -- a system that fails is reported in its row, not hidden
        row["check"] = "not run"
        row["error"] = _text(exc)
        row["traceback_tail"] = traceback.format_exc()[-1500:]
        row["cgraw"] = _graph_stats(g)
        return row
    row["check"] = "reference" if system == "eager" else "ok"
    row.update(detail)
    row["setup_s"] = setup_s
    if compiled:
        # from the torch.compile(...) call on: reduce-overhead imports Inductor there, a backend
        # named by a string at its first call
        row["compile_call_s"] = made.s
        row["compile_s"] = made.s + setup_s
    before = _graph_stats(g)
    if ready is not None:
        ready(row)
    try:
        row.update(_time(wl, call, loops, prefill, turn))
    except Exception as exc:  # noqa: BLE001 -- reported in the row; the other systems still run
        row["error"] = f"while timing: {_text(exc)}"
    after = _graph_stats(g)
    if after is not None:
        row["cgraw"] = after
        timed = row.get("timed_calls", 0)
        row["graph_replayed"] = bool(
            after["recordings"] > 0 and not after["skip_reasons"] and after["eager_calls"] == 0
            and after["rerecords"] == before["rerecords"] and after["replays"] - before["replays"] >= timed)
    return row


# ---------------------------------------------------------------- child processes (compiled systems)


def _say(obj) -> None:
    sys.stdout.write(TAG + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


class _Child:
    """A compiled system in a child process. It compiles and checks, says "ready", waits for "go"
    on stdin, times, and says its result. Every wait here has a deadline."""

    def __init__(self, workload: str, system: str, cmd: list, env: dict):
        self.workload, self.system = workload, system
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in close()
        self.t0 = time.monotonic()
        # its own session, so that a kill takes the child's compile workers with it
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, start_new_session=True)
        self.msgs: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict | None = None
        self.result: dict | None = None
        self.failure: str | None = None
        self.t_end: float | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                try:
                    self.msgs.put(json.loads(line[len(TAG):]))
                except ValueError:
                    continue
        self.t_end = time.monotonic()
        self.msgs.put(None)  # end of output

    def _next(self, deadline: float):
        try:
            return self.msgs.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return "timeout"

    def wait_ready(self, cap_s: float) -> None:
        msg = self._next(self.t0 + cap_s)
        if msg == "timeout":
            self._fail(f"compile exceeded cap ({cap_s:g} s)")
        elif msg is None:
            self._fail(f"child exited (rc {self.proc.wait()}) before it was ready: {self.stderr_tail()}")
        elif msg.get("phase") == "ready":
            self.ready = msg
        else:
            self.result = msg  # its check failed or its set-up raised: nothing to time

    @property
    def timing(self) -> bool:
        """Ready, not failed, and its result not in yet."""
        return self.ready is not None and self.failure is None and self.result is None

    def go(self, cap_s: float) -> None:
        """Let the child run until its next turn (its warm-up calls, or one timed burst) or its
        result."""
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except OSError as exc:
            self._fail(f"child gone before timing: {exc}: {self.stderr_tail()}")
            return
        msg = self._next(time.monotonic() + cap_s)
        if msg == "timeout":
            self._fail(f"timing exceeded {cap_s:g} s")
        elif msg is None:
            self._fail(f"child exited (rc {self.proc.wait()}) while timing: {self.stderr_tail()}")
        elif msg.get("phase") != "turn":
            self.result = msg

    def _fail(self, why: str) -> None:
        self.failure = why
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # a child still waiting for "go" reads end-of-file and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def stderr_tail(self, nbytes: int = 1500) -> str:
        self.err.flush()
        size = self.err.seek(0, os.SEEK_END)
        self.err.seek(max(0, size - nbytes))
        return self.err.read().decode(errors="replace").strip()

    def row(self, concurrency: int) -> dict:
        row = dict(self.result or self.ready or {"workload": self.workload, "system": self.system})
        row.pop("phase", None)
        if self.failure is not None:
            row["error"] = self.failure
            row.setdefault("check", "not run")
        row["child_wall_s"] = (self.t_end or time.monotonic()) - self.t0
        row["compile_concurrency"] = concurrency
        self.err.seek(0)
        lines = self.err.read().decode(errors="replace").splitlines()
        skips = sorted({ln.strip()[:300] for ln in lines if "skipping cudagraphs" in ln})[:5]
        if skips:
            row["cudagraph_skip_messages"] = skips
        self.err.close()
        return row


def _child_cmd(workload: str, system: str, args) -> list:
    return [sys.executable, "-m", "benchmarks.models", "--child", workload, system, "--handshake",
            "--device", args.device, *(["--quick"] if args.quick else [])]


def _take_turns(kids: list, cap_s: float) -> None:
    """Time ready children together: each runs its warm-up, then one burst per turn, in rounds
    whose order is reversed after every round, until each has said its result."""
    for kid in kids:
        if kid.timing:
            kid.go(cap_s)  # its warm-up calls, up to its first turn
    order = list(kids)
    while any(kid.timing for kid in order):
        for kid in order:
            if kid.timing:
                kid.go(cap_s)
        order.reverse()


def _children(rep: Report, rows: dict, pairs: list, args, finished=None) -> None:
    """Each (workload, system) of ``pairs`` in a child process, workload by workload: the systems
    that compile nothing start together, the compiled ones ``--compile-jobs`` at a time, each with
    empty Inductor and Triton caches; then the workload's children take turns at their bursts and
    close before the next workload's start. ``finished(workload)`` is called after each workload's
    rows are added."""
    jobs = max(1, args.compile_jobs or 1)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    with tempfile.TemporaryDirectory(prefix="cgraw_models_", ignore_cleanup_errors=True) as caches:

        def start(w: str, s: str) -> _Child:
            cache = os.path.join(caches, f"{w}-{s}")  # a cold compile for every system
            kid_env = {**env, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
            return _Child(w, s, _child_cmd(w, s, args), kid_env)

        for workload in dict.fromkeys(w for w, _ in pairs):
            t0 = time.perf_counter()
            systems = [s for w, s in pairs if w == workload]
            plain = [s for s in systems if s not in COMPILED]
            compiled = [s for s in systems if s in COMPILED]
            waves = ([plain] if plain else []) + [compiled[i:i + jobs] for i in range(0, len(compiled), jobs)]
            kids: list = []
            done = False
            try:
                for wave in waves:
                    print(f"[models] {workload}: starting {', '.join(wave)} (cap {args.compile_cap:g} s)", flush=True)
                    started = [start(workload, s) for s in wave]
                    kids += started
                    for kid in started:  # each is waited for until its own cap
                        kid.wait_ready(args.compile_cap)
                _take_turns(kids, TIMING_CAP_S[args.quick])
                done = True
            finally:
                for kid in kids:
                    if done:
                        kid.close()
                    else:
                        kid.kill()  # interrupted: no child outlives the parent
            for kid in kids:  # eager first: the others' speedups are over its figures
                _add(rep, rows, kid.row(jobs if kid.system in COMPILED else len(plain)))
            print(f"[models] {workload}: {time.perf_counter() - t0:.1f} s", flush=True)
            if finished is not None:
                finished(workload)


def _child_main(args) -> int:
    workload, system = args.child
    head = {"phase": "result", "workload": workload, "system": system}
    if workload not in WORKLOADS or system not in SYSTEMS:
        _say({**head, "check": "not run", "error": "unknown workload or system"})
        return 2
    try:
        import torch

        _fp32(torch)
        _log_cudagraph_skips(torch)
        wl = _build(workload)
    except Exception as exc:  # noqa: BLE001 -- reported on the result line
        _say({**head, "check": "not run", "error": _text(exc), "traceback_tail": traceback.format_exc()[-1500:]})
        return 1

    def wait(phase: str, row=None):
        _say({**(row or {}), "phase": phase})
        if not sys.stdin.readline():  # the parent is gone or gave up on us
            raise SystemExit(1)

    row = _measure(wl, system, quick=args.quick, ready=(lambda row: wait("ready", row)) if args.handshake else None,
                   turn=(lambda: wait("turn")) if args.handshake else None)
    if system in COMPILED:
        row["dynamo"] = _dynamo_counters()
    _say({**row, "phase": "result"})
    return 0


def _log_cudagraph_skips(torch) -> None:
    """Have inductor log why it skipped CUDA graphs (to stderr, which the parent reads back); the
    log artifact's name differs between torch versions."""
    for name in ("cudagraphs", "perf_hints"):
        try:
            torch._logging.set_logs(**{name: True})
        except (ValueError, TypeError, AttributeError):  # not an artifact of this torch
            pass


def _dynamo_counters() -> dict:
    try:
        from torch._dynamo.utils import counters
    except ImportError as exc:
        return {"error": _text(exc)}
    return {"cudagraph_skips": counters["inductor"].get("cudagraph_skips", 0),
            "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"].get("unique_graphs", 0)}


# ---------------------------------------------------------------- run and report


def _fp32(torch) -> None:
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def _add(rep: Report, rows: dict, row: dict) -> None:
    """Record the row's check with ``rep.check`` (eager is the reference: only its failures), add
    the speedups over the same run's eager row, then print and keep the row."""
    check = row.get("check")
    if check != "reference" or row.get("error"):

        def verdict():
            if check not in ("ok", "reference"):
                raise CheckFailed(check if check != "not run" else f"not run: {row.get('error')}")

        rep.check(f"{row['workload']}: {row['system']}", verdict)
    eager = rows.get(row["workload"], {}).get("eager")
    if row["system"] != "eager" and row.get("host_us") and eager and eager.get("host_us"):
        if row["system"] in CGRAW_TREE_SYSTEMS and DEVICE != "cpu" and not row.get("graph_replayed"):
            row["speedup_host"] = row["speedup_device"] = None
            row["speedup_note"] = "cgraw did not replay every timed call: no graph speedup reported"
        else:
            row["speedup_host"] = eager["host_us"] / row["host_us"]
            row["speedup_device"] = eager["device_us"] / row["device_us"] if row.get("device_us") else None
    rows.setdefault(row["workload"], {})[row["system"]] = row
    rep.add(**row)


def figure(row: dict | None, key: str, *, device: str = "cuda"):
    """``row[key]`` when the row's figure counts (checked, no error, and for a cgraw tree system
    on the GPU, every timed call replayed), else None."""
    if not row or row.get("check") not in ("ok", "reference") or row.get("error") or not row.get(key):
        return None
    if row.get("system") in CGRAW_TREE_SYSTEMS and device != "cpu" and not row.get("graph_replayed"):
        return None
    return row[key]


def _summary(by_system: dict) -> dict:
    def fig(system, key):
        return figure(by_system.get(system), key, device=DEVICE)

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = {}
    for key, tag in (("host_us", "host"), ("device_us", "device")):
        eager, cg = fig("eager", key), fig("cgraw_graphed", key)
        out[f"cgraw_speedup_{tag}"] = ratio(eager, cg)
        out[f"cgraw_over_torch_cudagraph_{tag}"] = ratio(cg, fig("torch_cudagraph", key))
        out[f"cgraw_over_reduce_overhead_{tag}"] = ratio(cg, fig("reduce_overhead", key))
        out[f"cgraw_capture_over_torch_cudagraph_{tag}"] = ratio(fig("cgraw_capture", key),
                                                                 fig("torch_cudagraph", key))
        out[f"cgraw_over_compile_speedup_{tag}"] = ratio(eager, fig("cgraw_over_compile", key))
        out[f"cgraw_backend_over_reduce_overhead_{tag}"] = ratio(fig("cgraw_backend", key),
                                                                 fig("reduce_overhead", key))
    # the backend's host time over the device time of Inductor's kernels replayed without host
    # gaps: cgraw_over_compile's bursts (one graph of the same default-mode kernels, submitted far
    # ahead of the GPU) are that device time; the same bursts' events of a host-bound system are not
    # (the GPU waits for the host inside them)
    out["cgraw_backend_host_over_kernels_device"] = ratio(fig("cgraw_backend", "host_us"),
                                                          fig("cgraw_over_compile", "device_us"))
    ro = by_system.get("reduce_overhead") or {}
    skips = (ro.get("dynamo") or {}).get("cudagraph_skips")
    if skips:
        out["reduce_overhead_cudagraph_skips"] = skips
    return out


def _names(spec: str | None, universe, what: str) -> list:
    if not spec:
        return list(universe)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in universe]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(universe)})")
    return names


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls per burst and fewer repeats")
    ap.add_argument("--only", default=None, help=f"comma-separated workloads, of {', '.join(WORKLOADS)}")
    ap.add_argument("--systems", default=None, help=f"comma-separated systems, of {', '.join(SYSTEMS)}")
    ap.add_argument("--compile-cap", type=float, default=120.0,
                    help="seconds a compiled system's child may take to compile and check (default 120)")
    ap.add_argument("--compile-jobs", type=int, default=1,
                    help="compiled systems compiling at once (default 1: compile_s of each alone)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile systems")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/models.json, "
                                                "models_quick.json with --quick)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "SYSTEM"), help=argparse.SUPPRESS)
    ap.add_argument("--handshake", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)  # None: the command line


def main(argv=None) -> int:
    global DEVICE
    args = _parse(argv)
    DEVICE = args.device
    if args.child:
        return _child_main(args)
    t_start = time.perf_counter()
    if DEVICE != "cpu":
        if no_gpu():
            return 2
    import torch

    _fp32(torch)
    rep = Report("models", gpu=DEVICE != "cpu")
    names = _names(args.only, WORKLOADS, "workloads")
    systems = _names(args.systems, SYSTEMS, "systems")
    if args.no_compile:
        systems = [s for s in systems if s not in COMPILED]
    if DEVICE == "cpu":  # no CUDA graphs on the CPU: the plumbing only
        systems = [s for s in systems if s in ("eager", "reduce_overhead")]
    missing = {}
    for pkg in sorted({WORKLOADS[n][0] for n in names}):
        try:
            importlib.import_module(pkg)
        except Exception as exc:  # noqa: BLE001 -- a package that does not import is a missing peer
            missing[pkg] = _text(exc, 300)
            rep.peer_missing(pkg, missing[pkg])
    names = [n for n in names if WORKLOADS[n][0] not in missing]

    rows: dict = {}
    pairs = [(n, s) for n in names for s in systems]
    out = args.out or os.path.join(RESULTS_DIR, "models_quick.json" if args.quick else "models.json")

    def save(done: list) -> str:
        """The JSON of the workloads ``done`` so far; ``not_run`` lists the pairs of the others
        (a run stopped before its end keeps what it measured, ``complete`` false)."""
        summary = {name: _summary(by_system) for name, by_system in rows.items()}
        not_run = [f"{n}/{s}" for n, s in pairs if n not in done]
        return rep.save({"method": METHOD, "summary": summary, "total_s": time.perf_counter() - t_start,
                         "complete": not not_run, "not_run": not_run,
                         "options": {"quick": args.quick, "device": DEVICE, "workloads": names, "systems": systems,
                                     "compile_cap_s": args.compile_cap, "compile_jobs": args.compile_jobs,
                                     "loops": QUICK_LOOPS if args.quick else LOOPS}}, path=out)

    done: list = []
    if pairs:
        _children(rep, rows, pairs, args, finished=lambda w: (done.append(w), save(done)))

    for name, by_system in rows.items():
        s = _summary(by_system)
        known = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items() if v is not None)
        print(f"[models] summary {name}: {known or 'no ratio (systems missing or not checked)'}", flush=True)
    total_s = time.perf_counter() - t_start
    path = save(names)
    print(f"results: {path}")
    print(f"[models] total {total_s:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
