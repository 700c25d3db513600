"""Graph-safe random numbers: cgraw's Philox kernels against torch's, a GPT-2 training
step with dropout, and the one-time NVRTC cost; every figure and ratio from the same run.

(1) ``kernels``: device microseconds per random-number kernel at 10^3..10^8 elements for
    ``torch.rand`` (float32), ``torch.randn`` (float32), ``torch.rand`` (bfloat16) and
    ``F.dropout(x, 0.1, training=True)`` (float32, the fused kernel: output and mask). Systems:
    ``cgraw`` (K copies of the op captured with ``cgraw.capture()`` and replayed; the graph's
    offset-advance kernel is part of each replay and is counted), ``torch_graph`` (the same K ops
    in a hand-made ``torch.cuda.CUDAGraph``, torch's own graph-safe generator) and ``eager``
    (K eager calls). The ratio is cgraw / torch_graph, kernel against kernel; the target
    is at most 1.5 at every size.
(2) ``train``: a transformers GPT-2 (4 layers, n_embd 256, 4 heads) training step (zero_grad,
    forward with labels, backward, AdamW(capturable=True)) at batch 8 x 64 as one
    ``@cgraw.graphed`` function against eager, with dropout 0.1 and 0.0: host and device
    microseconds per step, each speedup and the ratio of the two speedups.
(3) ``compile``: in a fresh child process, the first ``cgraw.capture()`` holding a ``torch.rand``
    (NVRTC compile and module load) against a second identical capture.
Every system is checked against eager before it is timed (random numbers: distribution and fresh
draws per replay, see ``METHOD``); one that fails is recorded under ``failed_checks`` and not
timed. ``python3 -m benchmarks.rng [--quick]`` writes ``benchmarks/results/rng.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

from benchmarks import models as _models
from benchmarks._harness import REPO_ROOT, RESULTS_DIR, Report, bootstrap_ci, no_gpu, percentile, verdict

TAG = "@@rng "  # prefixes the child's result line (other output is ignored)

OPS = {  # name -> what is timed (one kernel per call in torch and in cgraw)
    "rand_f32": "torch.rand(n) float32",
    "randn_f32": "torch.randn(n) float32",
    "rand_bf16": "torch.rand(n, dtype=torch.bfloat16)",
    "dropout_f32": "F.dropout(x, 0.1, training=True), x float32 (fused kernel: output and mask)",
}
DROPOUT_P = 0.1
SIZE_EXPONENTS = (3, 4, 5, 6, 7, 8)
QUICK_SIZE_EXPONENTS = (3, 5, 7)
TARGET_RATIO = 1.5  # target: cgraw / torch per kernel, at every size
ROUNDS, QUICK_ROUNDS = 7, 5
TARGET_MS, QUICK_TARGET_MS = 50.0, 20.0  # device time of one measurement (N graph replays)
MAX_UNITS = 20000

TRAIN_DROPOUTS = (0.1, 0.0)
TRAIN_BATCH, TRAIN_SEQ, TRAIN_VOCAB = 8, 64, 1000
TRAIN_LR = 1e-3
TRAIN_CHECK_STEPS = 5
TRAIN_LOSS_RTOL = 0.10  # dropout: graphed and eager masks differ; the losses agree within this

COMPILE_N = 1 << 20
CHILD_TIMEOUT_S = 180.0

METHOD = {
    "device_us_per_op": "CUDA events on torch's current stream around N units, divided by N * K; "
                        "a unit is one replay of a graph of K back-to-back copies of the op (cgraw, "
                        "torch_graph) or K eager calls (eager). N is calibrated so that a measurement "
                        "takes about target_ms of device time; K (ops_per_graph) falls with the size",
    "rounds": "the three systems of one (op, size) are measured in interleaved rounds, shuffled "
              "order in each; figures are medians over rounds (p90 beside them)",
    "ratio": "cgraw / reference, per round (same round, so a drift of the machine cancels), then "
             "the median; reference = torch_graph (kernel against kernel, both graph-replayed), or "
             "eager at sizes >= 10^6 (device-bound) where the torch graph is missing; "
             "ratio_vs_eager is given for every size",
    "verdict": "percentile-bootstrap 95% interval of the median per-round ratio: 'met' when all "
               "of it is <= target_ratio, 'missed' when all of it is above, else 'unresolved'; "
               "'not measured' when cgraw or the reference was not timed. Overall: 'missed' if "
               "any row missed, 'met' if every row met, else 'incomplete' (a row not measured) "
               "or 'unresolved'; target_met is True / False for those first two, else None",
    "graph_extras": "a cgraw replay also runs the graph's one advance kernel (the generator "
                    "record's position and key): counted, it is part of the cost (1/K of it per op); "
                    "its host step reads and advances torch's generator (no driver call while "
                    "nothing else moves it; rng_seed.py times it). A torch replay "
                    "first writes its generator's seed and offset (two small fill kernels before "
                    "the graph launch): counted too",
    "eager": "at small sizes the host submits slower than the device runs, so eager's interval "
             "holds the device's idle gaps: eager figures there are host-bound; at >= 10^6 the "
             "kernel dominates",
    "checks_kernels": "before timing, per (op, size): two replays (or calls) must draw different "
                      "numbers; mean and std within 8*std*sqrt(2/n) (+ 2^-8 for bfloat16) of "
                      "eager's; rand in [0, 1) ([0, 1] for bfloat16); randn finite; dropout: "
                      "zero fraction within 8*sqrt(2p(1-p)/n) of eager's and every kept element "
                      "equal to x / (1 - p) (rtol 1e-6); cgraw: the graph holds >= K draws "
                      "(Graph.rng.draws, where the graph reports it)",
    "train_host_us": "as models.py: median over repeats of the perf_counter time of a burst of "
                     "steps plus one torch.cuda.synchronize, divided by the steps; two batches "
                     "alternate; device_us from CUDA events around the burst",
    "train_checks": "dropout 0.1: 5 steps of the graphed and an eager copy from identical weights "
                    "on identical batches: every loss finite and the last within 10% of eager's "
                    "(the masks differ); the function recorded once and replayed (no skip reason, "
                    "no eager call, no re-record); its recording holds random-number kernels; two "
                    "replays from the same weights on the same batch give different losses (fresh "
                    "masks). Dropout 0.0: as models.py's training row, each of 5 steps from eager's "
                    "state (parameters, buffers, AdamW step/exp_avg/exp_avg_sq copied in place), "
                    "loss and every state tensor with rtol 1e-4 atol 1e-5",
    "train_speedup": "eager host_us / graphed host_us for each dropout, same run; none when cgraw "
                     "did not replay every timed call (graph_replayed false); "
                     "speedup_ratio = speedup at dropout 0.1 / speedup at dropout 0.0",
    "compile": "a child process: CUDA and cgraw's capture machinery warmed by a capture without "
               "random numbers, then the wall time (synchronised, one replay included) of the first "
               "capture holding torch.rand(2^20) against the median of three identical later ones; "
               "one_time_ms is their difference",
    "precision": "float32; cuDNN and cuBLAS TF32 off",
}

# What this benchmark assumes of cgraw's issue-11 API (so an integrator can adjust one place).
ASSUMED_API = {
    "torch.manual_seed(seed)": "seeds eager and graphed draws alike; called once with 0",
    "Graph.rng.draws": "random-number kernels in a captured graph (Graph.rng None when it draws none)",
    "recording graph": "a graphed function's recordings are cgraw.Graph objects at "
                       "_managers[device].nodes()[i].recording.graph (as workloads.py reads them)",
}


CheckFailed = _models.CheckFailed  # a system's result is not what eager's would be: it is not timed


# ---------------------------------------------------------------- kernels


def ops_per_graph(n: int) -> int:
    """K: ops per graph (and per eager unit), enough that launch gaps amortise at small sizes."""
    if n <= 10**5:
        return 64
    if n <= 10**6:
        return 32
    return 8 if n <= 10**7 else 4


def _op(name: str, n: int):
    """``(fn, x)``: a no-argument call of op ``name`` on ``n`` elements; ``x`` is dropout's input
    (made here, in [0.5, 1.5): no zero of its own), else None."""
    import torch
    import torch.nn.functional as F

    if name == "rand_f32":
        return (lambda: torch.rand(n, device="cuda")), None
    if name == "randn_f32":
        return (lambda: torch.randn(n, device="cuda")), None
    if name == "rand_bf16":
        return (lambda: torch.rand(n, device="cuda", dtype=torch.bfloat16)), None
    if name == "dropout_f32":
        x = torch.rand(n, device="cuda") + 0.5
        return (lambda: F.dropout(x, DROPOUT_P, training=True)), x
    raise ValueError(f"unknown op {name!r}")


def _chain(fn, k: int):
    """K calls of ``fn``; the last output is returned (earlier ones are freed as it goes)."""

    def body():
        out = None
        for _ in range(k):
            out = fn()
        return out

    return body


def _stats(out, x) -> dict:
    """Mean, std, range of ``out``; for dropout (``x`` given) its zero fraction and how many kept
    elements are not ``x / (1 - p)``."""
    import torch

    o = out.double()
    s = {"mean": o.mean().item(), "std": o.std().item(), "min": o.min().item(), "max": o.max().item(),
         "finite": bool(torch.isfinite(o).all().item())}
    if x is not None:
        zero = out == 0
        kept = ~zero
        want = x * (1.0 / (1.0 - DROPOUT_P))
        s["zero_frac"] = zero.double().mean().item()
        s["kept_wrong"] = int((~torch.isclose(out[kept], want[kept], rtol=1e-6, atol=0.0)).sum().item())
    return s


def _same_distribution(name: str, got: dict, ref: dict, n: int) -> None:
    res = 2.0**-8 if name == "rand_bf16" else 0.0
    tol = 8.0 * ref["std"] * math.sqrt(2.0 / n) + res
    bad = []
    if not got["finite"]:
        bad.append("non-finite values")
    for key in ("mean", "std"):
        if abs(got[key] - ref[key]) > tol:
            bad.append(f"{key} {got[key]:.6g} vs eager's {ref[key]:.6g} (tolerance {tol:.3g})")
    if name.startswith("rand_"):
        high_ok = got["max"] < 1.0 if name == "rand_f32" else got["max"] <= 1.0
        if got["min"] < 0.0 or not high_ok:
            bad.append(f"values outside [0, 1): min {got['min']}, max {got['max']}")
    if "zero_frac" in ref:
        ztol = 8.0 * math.sqrt(2.0 * DROPOUT_P * (1.0 - DROPOUT_P) / n)
        if abs(got["zero_frac"] - ref["zero_frac"]) > ztol:
            bad.append(f"zero fraction {got['zero_frac']:.5f} vs eager's {ref['zero_frac']:.5f} "
                       f"(tolerance {ztol:.3g})")
        if got["kept_wrong"]:
            bad.append(f"{got['kept_wrong']} kept element(s) differ from x / (1 - p)")
    if bad:
        raise CheckFailed("; ".join(bad))


def _check_draws(name: str, n: int, run, out, x, ref: dict) -> dict:
    """Two runs of ``run`` (a replay) leave different numbers in ``out``, distributed as eager's."""
    import torch

    run()
    torch.cuda.synchronize()
    a = out.clone()
    run()
    torch.cuda.synchronize()
    if torch.equal(a, out):
        raise CheckFailed("two replays drew the same numbers")
    got = _stats(a, x)
    _same_distribution(name, got, ref, n)
    return got


def _rng_draws(graph):
    """``graph.rng.draws`` (0 when the graph draws nothing), or None where a Graph has no ``rng``."""
    if not hasattr(graph, "rng"):
        return None
    rng = graph.rng
    return 0 if rng is None else int(rng.draws)


def _elapsed_ms(unit, n_units: int, stream) -> float:
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(n_units):
        unit()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def _calibrate(unit, stream, target_ms: float) -> int:
    """Units per measurement for about ``target_ms`` of device time (the first runs warm up; the
    faster of two runs at the final count sets it, so a one-off stall does not shorten them)."""
    unit()
    n = 2
    while True:
        ms = _elapsed_ms(unit, n, stream)
        if ms >= target_ms / 10 or n >= MAX_UNITS:
            break
        n *= 4
    ms = min(ms, _elapsed_ms(unit, n, stream))
    return max(3, min(MAX_UNITS, math.ceil(n * target_ms / max(ms, 1e-3))))


def _interleaved(systems: dict, stream, rounds: int, seed: int = 0) -> dict:
    """``{name: [device us per op, one per round]}``; ``systems[name] = (unit, n_units, k)``,
    measured once each round in a shuffled order."""
    names = list(systems)
    rng = random.Random(seed)
    out = {name: [] for name in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            unit, n_units, k = systems[name]
            out[name].append(_elapsed_ms(unit, n_units, stream) * 1e3 / (n_units * k))
    return out


def _kernel_row(rep: Report, name: str, n: int, *, rounds: int, target_ms: float) -> dict:
    import torch

    import cgraw

    k = ops_per_graph(n)
    label = f"kernels {name} n=1e{round(math.log10(n))}"
    stream = torch.cuda.current_stream()
    row = {"section": "kernels", "op": name, "n": n, "ops_per_graph": k}
    fn, x = _op(name, n)
    body = _chain(fn, k)
    ref = _stats(fn(), x)  # eager: the reference of the checks
    row["eager_stats"] = {key: ref[key] for key in ("mean", "std")}
    systems = {"eager": (body, k)}
    built: dict = {}

    def cgraw_graph():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with cgraw.capture() as g:
            out = body()
        torch.cuda.synchronize()
        row["cgraw_capture_ms"] = (time.perf_counter() - t0) * 1e3
        built["g"], built["g_out"] = g, out
        row["graph_nodes"] = g.num_nodes
        row["rng_draws"] = _rng_draws(g)
        if row["rng_draws"] is not None and row["rng_draws"] < k:
            raise CheckFailed(f"the graph holds {row['rng_draws']} random-number kernel(s), not {k}")
        _check_draws(name, n, lambda: g.replay(stream=stream), out, x, ref)

    if rep.check(f"{label}: cgraw.capture", cgraw_graph):
        replay = built["g"].replay
        systems["cgraw"] = (lambda: replay(stream=stream), k)

    try:
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's documentation does
            body()
        stream.wait_stream(side)
        built["tg"] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(built["tg"]):
            built["tg_out"] = body()
    except Exception as exc:  # noqa: BLE001 -- a peer that does not work is reported, not hidden
        rep.peer_missing(f"torch.cuda.CUDAGraph ({label})", repr(exc)[:300])
    else:
        if rep.check(f"{label}: torch.cuda.CUDAGraph",
                     lambda: _check_draws(name, n, built["tg"].replay, built["tg_out"], x, ref)):
            systems["torch_graph"] = (built["tg"].replay, k)

    if "cgraw" not in systems:  # no ratio without it: the peers are not timed either
        row["not_timed"] = "cgraw's check failed"
        systems = {}
    units = {s: _calibrate(unit, stream, target_ms) for s, (unit, _) in systems.items()}
    samples = _interleaved({s: (unit, units[s], kk) for s, (unit, kk) in systems.items()}, stream, rounds)
    row["units_per_measurement"] = units
    for s in ("cgraw", "torch_graph", "eager"):
        v = samples.get(s)
        row[f"{s}_us"] = statistics.median(v) if v else None
        row[f"{s}_p90_us"] = percentile(sorted(v), 0.9) if v else None
    reference = "torch_graph" if "torch_graph" in samples else ("eager" if n >= 10**6 else None)
    row["reference"] = reference
    row.update(_ratio(samples, "cgraw", reference))
    row["ratio_vs_eager"] = _ratio(samples, "cgraw", "eager")["ratio"]
    row["samples_us"] = samples

    if "g" in built:  # the graphs' memory goes back before the next size (the caller collects)
        built["g"].close()
    if "tg_out" in built:  # captured (a failed capture leaves nothing to reset)
        built["tg"].reset()
    return rep.add(**row)


def _ratio(samples: dict, num: str, den: str | None) -> dict:
    """The median per-round ratio ``num / den``, its bootstrap 95% interval and the verdict."""
    if den is None or num not in samples or den not in samples:
        return {"ratio": None, "ratio_ci95": None, "verdict": "not measured"}
    per_round = [a / b for a, b in zip(samples[num], samples[den], strict=True)]
    ci = bootstrap_ci([per_round])
    return {"ratio": statistics.median(per_round), "ratio_ci95": list(ci), "verdict": verdict(ci, TARGET_RATIO)}


def _kernels(rep: Report, exponents, *, rounds: int, target_ms: float) -> tuple[list, dict]:
    import torch

    rows = []
    for name in OPS:
        for e in exponents:
            rows.append(_kernel_row(rep, name, 10**e, rounds=rounds, target_ms=target_ms))
            gc.collect()
            torch.cuda.empty_cache()
    verdicts = [r["verdict"] for r in rows]
    if "missed" in verdicts:
        overall = "missed"
    elif verdicts and all(v == "met" for v in verdicts):
        overall = "met"
    elif "not measured" in verdicts or not verdicts:
        overall = "incomplete"
    else:
        overall = "unresolved"
    measured = [r for r in rows if r["ratio"] is not None]
    worst = max(measured, key=lambda r: r["ratio"], default=None)
    summary = {"target_ratio": TARGET_RATIO, "verdict": overall,
               "target_met": {"met": True, "missed": False}.get(overall),
               "rows_met": verdicts.count("met"), "rows": len(rows),
               "ratios": {name: {str(r["n"]): r["ratio"] for r in rows if r["op"] == name} for name in OPS},
               "worst": None if worst is None else {"op": worst["op"], "n": worst["n"], "ratio": worst["ratio"],
                                                    "verdict": worst["verdict"]}}
    return rows, summary


# ---------------------------------------------------------------- GPT-2 training step


def _gpt2_train(p: float):
    """A models.Workload of kind "train": GPT-2 with every dropout at ``p``, random weights from
    torch seed 0 (the same for every ``p``), AdamW(capturable=True) zeroing gradients in place."""
    import copy

    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=TRAIN_VOCAB, n_positions=128,
                                  resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).to("cuda").train()
    # a whole-step graph needs an optimizer without CPU state (README) and gradients zeroed in place
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, capturable=True)

    def new_step():
        m, o = copy.deepcopy((model, opt))  # taken before any step: every copy starts alike

        def step(ids, labels):
            o.zero_grad(set_to_none=False)
            loss = m(input_ids=ids, labels=labels, use_cache=False).loss
            loss.backward()
            o.step()
            return loss.detach()

        step.model, step.opt = m, o
        return step

    def inputs():
        ids = torch.randint(0, TRAIN_VOCAB, (TRAIN_BATCH, TRAIN_SEQ), device="cuda")
        return ids, ids.clone()

    info = {"model": "transformers GPT2LMHeadModel 4x256, 4 heads, sdpa", "batch": TRAIN_BATCH, "seq": TRAIN_SEQ,
            "dropout": p, "optimizer": f"AdamW lr {TRAIN_LR} capturable=True, zero_grad(set_to_none=False)",
            "unit": "training step"}
    return _models.Workload(f"gpt2_train_p{p}", "train", info, new_step=new_step, inputs=inputs)


def _adamw_state(step) -> list:
    """Parameters and buffers, then each parameter's AdamW state (None before the first step)."""
    state = list(step.model.state_dict().values())
    for p in step.model.parameters():
        st = step.opt.state.get(p) or {}
        state.extend(st.get(key) for key in ("step", "exp_avg", "exp_avg_sq"))
    return state


def _graphed_draws(g):
    """Random-number kernels over the recordings of graphed function ``g`` (None: not reported)."""
    import torch

    from cgraw.trees.graphed import _managers

    mgr = _managers.get(torch.cuda.current_device())
    if mgr is None:
        return None
    total, known = 0, False
    for node in mgr.nodes():
        graph = getattr(node.recording, "graph", None) if node.fn is g else None
        if graph is not None:
            draws = _rng_draws(graph)
            if draws is not None:
                total, known = total + draws, True
    return total if known else None


def _recorded_once(g) -> dict:
    st = _models._graph_stats(g)
    if st is None or st["recordings"] != 1 or st["rerecords"] or st["eager_calls"] or st["skip_reasons"]:
        raise CheckFailed(f"not recorded once and replayed: {st}")
    return st


def _check_dropout_step(wl, g, step) -> dict:
    """Dropout > 0: not bitwise; see METHOD["train_checks"]."""
    import torch

    ref = wl.new_step()
    batches = [wl.inputs() for _ in range(TRAIN_CHECK_STEPS)]
    got, want = [], []
    for ids, labels in batches:
        got.append(g(ids, labels).item())
        want.append(ref(ids, labels).item())
    if not all(math.isfinite(v) for v in got):
        raise CheckFailed(f"non-finite loss: {got}")
    rel = abs(got[-1] - want[-1]) / abs(want[-1])
    if rel > TRAIN_LOSS_RTOL:
        raise CheckFailed(f"loss after {TRAIN_CHECK_STEPS} steps {got[-1]:.5f}, eager's {want[-1]:.5f} "
                          f"({rel:.1%} apart, more than {TRAIN_LOSS_RTOL:.0%})")
    _recorded_once(g)
    draws = _graphed_draws(g)
    if draws == 0:
        raise CheckFailed("the recording holds no random-number kernel: dropout did not reach cgraw's RNG")
    params = [t.detach().clone() for t in step.model.parameters()]
    ids, labels = batches[0]
    first = g(ids, labels).item()
    with torch.no_grad():
        for t, saved in zip(step.model.parameters(), params, strict=True):
            t.copy_(saved)
    second = g(ids, labels).item()
    if first == second:
        raise CheckFailed("two replays from the same weights on the same batch gave the same loss: "
                          "the dropout masks repeat")
    return {"check_losses": got, "check_losses_eager": want, "check_last_loss_rel_diff": rel,
            "fresh_mask_losses": [first, second]}


def _check_same_state_step(wl, g, step) -> dict:
    """Dropout 0: models.py's training check, with AdamW's state."""
    import torch

    ref = wl.new_step()
    for i in range(TRAIN_CHECK_STEPS):
        with torch.no_grad():
            for t, t_ref in zip(_adamw_state(step), _adamw_state(ref), strict=True):
                if t is not None and t_ref is not None:
                    t.copy_(t_ref)
        xs = wl.inputs()
        _models._assert_close(g(*xs), ref(*xs), _models.TRAIN_GRAPH_TOL, f"step {i + 1}: loss")
        for j, (t, t_ref) in enumerate(zip(_adamw_state(step), _adamw_state(ref), strict=True)):
            if (t is None) != (t_ref is None):
                raise CheckFailed(f"step {i + 1}: state {j} exists in one model only")
            if t is not None:
                _models._assert_close(t, t_ref, _models.TRAIN_GRAPH_TOL, f"step {i + 1}: state {j}")
    _recorded_once(g)
    return {}


def _train_rows(rep: Report, p: float, loops: tuple) -> dict:
    import cgraw

    cgraw.reset()
    wl = _gpt2_train(p)
    eager = {"section": "train", "system": "eager", **wl.info, "check": "reference"}
    try:
        eager.update(_models._time(wl, wl.new_step(), loops))
    except Exception as exc:  # noqa: BLE001 -- reported in the row; the other rows still run
        eager["error"] = f"while timing: {_models._text(exc)}"
    rep.add(**eager)

    cgraw.reset()
    step = wl.new_step()
    g = cgraw.graphed(step)
    row = {"section": "train", "system": "cgraw_graphed", **wl.info, "check": "not run"}
    detail: dict = {}
    check = _check_dropout_step if p > 0 else _check_same_state_step
    if rep.check(f"gpt2 train dropout {p}: cgraw.graphed",
                 lambda: detail.update(check(wl, g, step))):
        row["check"] = "ok"
        row.update(detail)
        before = _models._graph_stats(g) or {}
        try:
            row.update(_models._time(wl, g, loops))
        except Exception as exc:  # noqa: BLE001 -- reported in the row; the other rows still run
            row["error"] = f"while timing: {_models._text(exc)}"
        after = _models._graph_stats(g)
        row["cgraw"] = after
        row["graph_replayed"] = bool(
            after and before and after["recordings"] > 0 and not after["skip_reasons"]
            and after["eager_calls"] == 0 and after["rerecords"] == before["rerecords"]
            and after["replays"] - before["replays"] >= row.get("timed_calls", 1 << 62))
    else:
        row["check"] = rep.failed_checks.get(f"gpt2 train dropout {p}: cgraw.graphed")
        row["cgraw"] = _models._graph_stats(g)
    row["rng_draws"] = _graphed_draws(g)
    if row.get("graph_replayed") and row.get("host_us") and eager.get("host_us"):
        row["speedup_host"] = eager["host_us"] / row["host_us"]
        row["speedup_device"] = eager["device_us"] / row["device_us"] if row.get("device_us") else None
    else:
        row["speedup_host"] = row["speedup_device"] = None
    rep.add(**row)
    return {"eager": eager, "cgraw_graphed": row}


def _train(rep: Report, loops: tuple) -> tuple[list, dict]:
    try:
        import transformers  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- a package that does not import is a missing peer
        rep.peer_missing("transformers", _models._text(exc, 300))
        return [], {}
    import torch

    import cgraw

    rows, summary = [], {}
    for p in TRAIN_DROPOUTS:
        pair = _train_rows(rep, p, loops)
        gc.collect()
        cgraw.reset()
        rows += [pair["eager"], pair["cgraw_graphed"]]
        gr = pair["cgraw_graphed"]
        summary[f"dropout_{p}"] = {"eager_host_us": pair["eager"].get("host_us"), "graphed_host_us": gr.get("host_us"),
                                   "speedup_host": gr.get("speedup_host"), "speedup_device": gr.get("speedup_device"),
                                   "rng_draws": gr.get("rng_draws")}
        torch.cuda.empty_cache()
    on, off = summary.get(f"dropout_{TRAIN_DROPOUTS[0]}", {}), summary.get(f"dropout_{TRAIN_DROPOUTS[1]}", {})
    for tag in ("host", "device"):
        a, b = on.get(f"speedup_{tag}"), off.get(f"speedup_{tag}")
        summary[f"speedup_ratio_{tag}"] = a / b if a is not None and b else None
    return rows, summary


# ---------------------------------------------------------------- one-time compile (child process)


def _child_compile() -> dict:
    import torch

    import cgraw

    try:
        from cgraw._cuda import kernels as _k
    except ImportError:
        _k = None
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    x = torch.ones(1 << 16, device="cuda")
    stream = torch.cuda.current_stream()

    def timed(body):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with cgraw.capture() as g:
            out = body()
        g.replay(stream=stream)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3, g, out

    def rand():
        return torch.rand(COMPILE_N, device="cuda")

    warm_ms, _, _ = timed(lambda: x * 2.0)  # cuBLAS, pools, the capture machinery: not the RNG's cost
    images = len(getattr(_k, "_images", ())) if _k is not None else None
    first_ms, g1, out1 = timed(rand)
    compiled = len(getattr(_k, "_images", ())) - images if images is not None else None
    a = out1.clone()
    g1.replay(stream=stream)
    torch.cuda.synchronize()
    if torch.equal(a, out1) or not (0.0 <= a.min().item() and a.max().item() < 1.0):
        raise CheckFailed("the first captured torch.rand does not draw fresh numbers in [0, 1) per replay")
    later = [timed(rand) for _ in range(3)]
    later_ms = [t for t, _, _ in later]
    second_ms = statistics.median(later_ms)
    return {"warm_capture_ms": warm_ms, "first_capture_ms": first_ms, "later_capture_ms": later_ms,
            "second_capture_ms": second_ms, "one_time_ms": first_ms - second_ms,
            "kernels_compiled": compiled, "first_graph_capture_ms": g1.capture_ms,
            "first_graph_instantiate_ms": g1.instantiate_ms, "later_graph_capture_ms": later[-1][1].capture_ms,
            "n": COMPILE_N}


def _compile(rep: Report) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "benchmarks.rng", "--child", "compile"]
    result: dict = {}
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                              check=False)
        for line in proc.stdout.splitlines():
            if line.startswith(TAG):
                result = json.loads(line[len(TAG):])
        if not result:
            result = {"error": f"child exited (rc {proc.returncode}) without a result: {proc.stderr[-1500:]}"}
    except subprocess.TimeoutExpired:
        result = {"error": f"child exceeded {CHILD_TIMEOUT_S:g} s"}

    def ok():
        if result.get("error"):
            raise CheckFailed(result["error"])

    rep.check("compile: first captured torch.rand in a fresh process", ok)
    rep.add(section="compile", **result)
    return {k: result.get(k) for k in ("first_capture_ms", "second_capture_ms", "one_time_ms", "kernels_compiled")}


def _child_main(what: str) -> int:
    if what != "compile":
        print(f"unknown child {what!r}", file=sys.stderr)
        return 2
    try:
        res = _child_compile()
    except Exception as exc:  # noqa: BLE001 -- reported on the result line
        res = {"error": _models._text(exc)}
    sys.stdout.write(TAG + json.dumps(res, default=str) + "\n")
    sys.stdout.flush()
    return 0 if not res.get("error") else 1


# ---------------------------------------------------------------- run and report


def _print_tables(kernel_rows: list, train_rows: list) -> None:
    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    if kernel_rows:
        print(f"[rng] device us per op; ratio = cgraw / reference (torch_graph), target <= {TARGET_RATIO}")
        print(f"[rng] {'op':<12} {'n':>9} {'K':>3} {'cgraw':>9} {'torch_graph':>11} {'eager':>9} {'ratio':>6}  verdict")
        for r in kernel_rows:
            print(f"[rng] {r['op']:<12} {r['n']:>9.0e} {r['ops_per_graph']:>3} {f(r['cgraw_us']):>9} "
                  f"{f(r['torch_graph_us']):>11} {f(r['eager_us']):>9} {f(r['ratio'], '.3f'):>6}  {r['verdict']}")
    if train_rows:
        print("[rng] GPT-2 training step, host us per step (burst + synchronise)")
        print(f"[rng] {'dropout':>7} {'system':<14} {'host_us':>9} {'device_us':>9} {'speedup':>7}  check")
        for r in train_rows:
            print(f"[rng] {r['dropout']:>7} {r['system']:<14} {f(r.get('host_us'), '.1f'):>9} "
                  f"{f(r.get('device_us'), '.1f'):>9} {f(r.get('speedup_host')):>7}  {str(r.get('check'))[:60]}")


SECTIONS = ("compile", "kernels", "train")


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.rng", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="sizes 1e3, 1e5, 1e7, fewer rounds and steps")
    ap.add_argument("--only", default=None, help=f"comma-separated sections, of {', '.join(SECTIONS)}")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated exponents of ten for the kernel sizes (default 3,4,5,6,7,8)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rng.json, "
                                                "rng_quick.json with --quick)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.child:
        return _child_main(args.child)
    sections = _models._names(args.only, SECTIONS, "sections")
    exponents = (tuple(int(e) for e in args.sizes.split(",") if e.strip()) if args.sizes
                 else QUICK_SIZE_EXPONENTS if args.quick else SIZE_EXPONENTS)
    t_start = time.perf_counter()
    if no_gpu():
        return 2
    import torch

    _models._fp32(torch)
    rep = Report("rng")
    summary: dict = {}
    timings: dict = {}
    if "compile" in sections:  # first: the child has the GPU to itself
        t0 = time.perf_counter()
        summary["compile"] = _compile(rep)
        timings["compile_s"] = time.perf_counter() - t0
    torch.manual_seed(0)  # graphs draw following torch's generator, as eager code does
    kernel_rows, train_rows = [], []
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    target_ms = QUICK_TARGET_MS if args.quick else TARGET_MS
    if "kernels" in sections:
        t0 = time.perf_counter()
        kernel_rows, summary["kernels"] = _kernels(rep, exponents, rounds=rounds, target_ms=target_ms)
        timings["kernels_s"] = time.perf_counter() - t0
    loops = (_models.QUICK_LOOPS if args.quick else _models.LOOPS)["train"]
    if "train" in sections:
        t0 = time.perf_counter()
        train_rows, summary["train"] = _train(rep, loops)
        timings["train_s"] = time.perf_counter() - t0
    _print_tables(kernel_rows, train_rows)
    k = summary.get("kernels")
    if k:
        print(f"[rng] kernels: {k['rows_met']}/{k['rows']} rows met cgraw/torch <= {TARGET_RATIO}; "
              f"overall {k['verdict']} (target_met={k['target_met']}); worst {k['worst']}", flush=True)
    t = summary.get("train")
    if t:
        print(f"[rng] train: speedup ratio (dropout {TRAIN_DROPOUTS[0]} / {TRAIN_DROPOUTS[1]}) host "
              f"{t.get('speedup_ratio_host')}", flush=True)
    total_s = time.perf_counter() - t_start
    out = args.out or os.path.join(RESULTS_DIR, "rng_quick.json" if args.quick else "rng.json")
    path = rep.save({"method": METHOD, "assumed_api": ASSUMED_API,
                     "summary": summary, "total_s": total_s, "timings": timings,
                     "options": {"quick": args.quick, "sections": sections, "sizes": [10**e for e in exponents],
                                 "ops": OPS, "rounds": rounds, "target_ms": target_ms,
                                 "ops_per_graph": {10**e: ops_per_graph(10**e) for e in exponents},
                                 "dropout_p": DROPOUT_P, "train_loops": loops, "train_dropouts": TRAIN_DROPOUTS}},
                    path=out)
    print(f"results: {path}")
    print(f"[rng] total {total_s:.1f} s", flush=True)
    return 1 if rep.failed_checks else 0  # a system that fails its check fails the part


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
