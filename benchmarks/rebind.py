"""Zero-copy inputs by rebinding kernel arguments: what an eager input costs a graphed
call when its recording reads the caller's tensor in place (``cgraw.config.rebind_inputs = True``
and a ``rebind_node_margin`` that re-points every reading node, system ``rebind``) against the copy
into a placeholder (``False``, system ``copy``) and against cgraw's defaults, which choose per
input the cheaper of the two (system ``chosen``, section (1) only); one GPU, one process, every
figure and ratio from the same run.

(1) ``per_input``: host microseconds per call of a graphed ``f(x)``, ``x`` float32 of 4 KB (1,024
    elements), where exactly K kernels read ``x`` (K = 1, 2, 4; ``x * 2``, then ``+ x.sin()``,
    ``+ x.cos()``, ``+ x.exp()``: the K - 1 additions read temporaries; one output). Address
    patterns: ``same`` (x0 on every call) and ``moving`` (x0 and x1 alternately, so the address
    changes on every call). The cost of a changed input is moving - same, taken per round (both
    patterns are timed in the same rounds). The target: at most 1.0 us for rebind at every
    K (a re-point costs one driver call per kernel node reading the input; ``tools/probes/rebind_probe``
    measured 1.48 us per node, so it is not expected to be met at any K). ``per_node_us``: the slope
    (delta at K=4 - delta at K=1) / 3. The target of ``chosen``: its delta at most 1.10x copy's at
    every K (it reads ``x`` in place at K = 1 and keeps the copy above).
(2) ``large``: f = ``x * 2`` (one kernel), address moving on every call, at 4 KB and at 256 MiB
    (64M float32). Host us per call for rebind and copy, both sizes in the same rounds (target:
    rebind's 256 MiB within 10% of its 4 KB). Device us per call from CUDA events around N calls,
    for rebind, copy and ``static``: ``cgraw.capture()`` of ``y = x0 * 2`` on the fixed 256 MiB x0,
    replayed (its kernel reads x0 in place; nothing is re-pointed or copied), timed in the same
    rounds as each system (target: rebind within 2% of static; copy adds a 256 MiB read and write
    per call).
Each system runs in its own block: ``cgraw.reset()``, the settings, freshly defined graphed
functions, each checked against eager (and ``cgraw.report()`` must say "1 input(s) rebound" for
rebind, and for chosen where it re-points), then timed; a call that fails is listed under
``failed_checks`` and not timed. Blocks rotate the systems' order. ``python3 -m benchmarks.rebind [--quick]`` writes
``benchmarks/results/rebind.json`` (``rebind_quick.json`` with ``--quick``); also part ``rebind``
of ``python3 -m benchmarks``.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import random
import re
import statistics
import sys
import time

from benchmarks._harness import (
    RESULTS_DIR,
    Report,
    alternating,
    bootstrap_ci,
    host_us_interleaved,
    no_gpu,
    percentile,
    verdict,
)

SMALL_NUMEL = 1024  # 4 KB of float32
LARGE_NUMEL = 64 << 20  # 256 MiB of float32
KS = (1, 2, 4)
SYSTEMS = ("rebind", "copy", "chosen")  # section (1)
LARGE_SYSTEMS = ("rebind", "copy")  # section (2): a 256 MiB input is read in place by default
REPOINT_ALL = 1 << 20  # rebind's cgraw.config.rebind_node_margin: re-point however many nodes read the input
SECTIONS = ("per_input", "large")
PATTERNS = ("same", "moving")
SAME_ORDER = (0, 0, 0, 0)  # warm-up, record (+ replay), two replays
MOVING_ORDER = (0, 1, 0, 1, 0)  # the same, the input moving on every call

PER_INPUT_TARGET_US = 1.0  # target: rebind's moving - same, for K <= 4
CHOSEN_TARGET = 1.10  # target: chosen's moving - same / copy's, for every K
LARGE_HOST_TARGET = 1.10  # target: rebind's host time at 256 MiB / at 4 KB
LARGE_DEVICE_TARGET = 1.02  # target: rebind's device time / static's

LOOPS = 100  # calls per timed burst (4 KB)
LARGE_LOOPS = 20  # calls per burst in the large section: its device work stays far below the launch queue
ROUNDS, QUICK_ROUNDS = 41, 11
DEVICE_CALLS = 40  # calls per CUDA-event measurement (about 5 ms of device time at 256 MiB)
DEVICE_ROUNDS, QUICK_DEVICE_ROUNDS = 21, 7
BLOCKS, QUICK_BLOCKS = 3, 1

METHOD = {
    "host_us": "perf_counter_ns around a burst of calls (no synchronise inside), divided by the calls; "
               "torch.cuda.synchronize after each burst, outside the timed region "
               "(harness.host_us_interleaved: 3 warm-up bursts, then rounds with the calls of one "
               "block in a shuffled order in each round). 4 KB: bursts of 100 calls; large section: 20",
    "blocks": "each system in its own block: cgraw.reset(), cgraw.config.rebind_inputs set, freshly "
              "defined graphed functions (each a root: cgraw.mark_step_begin() before its first "
              "call), checks, timing. Blocks alternate the systems' order (rebind, copy; copy, "
              "rebind; ...). Figures are medians over every round of a system's blocks; 95% "
              "intervals are percentile bootstraps, two-level (blocks, then rounds) with several blocks",
    "per_changed_input_us": "moving - same of the same K, per round (both in the same rounds), then "
                            "the median and its interval; verdict against 1.0 us (the target is "
                            "rebind's; copy's verdict is given for comparison)",
    "per_node_us": "(delta at K=4 - delta at K=1) / 3 per round: the host cost of re-pointing one "
                   "more kernel node reading the input",
    "rebind_vs_copy": "rebind's delta - copy's delta, and their ratio: medians from different "
                      "blocks (no interval); the same for chosen, whose ratio has the verdict against 1.10 "
                      "(met when at or under it)",
    "large_host_ratio": "host us at 256 MiB / at 4 KB per round (same system, same rounds), median "
                        "and interval; verdict for rebind against 1.10",
    "device_us": "torch.cuda.Event(enable_timing=True) on torch's current stream around 40 calls, "
                 "divided by 40; a call at 256 MiB runs far longer on the device than on the host, "
                 "so the events measure the device's work, not idle gaps. wall_us beside it: "
                 "perf_counter around the same calls plus torch.cuda.synchronize (it would expose "
                 "work launched on a stream the events do not see)",
    "static": "cgraw.capture() of y = x0 * 2 on the fixed 256 MiB x0 (captured once per run, "
              "checked against eager), replayed with Graph.replay() on the current stream; timed "
              "in the same rounds as each system, so system / static is taken per round",
    "large_device_ratio": "system device us / static device us per round, median and interval; "
                          "verdict for rebind against 1.02. device_minus_static_us: system - static per round "
                          "(for copy, its 256 MiB read and write; copy_extra_over_static divides it by static)",
    "checks": "per graphed function: every call of its order (same: x0 four times; moving: x0, x1, "
              "x0, x1, x0; warm-up, record, replays) compared with eager (torch.equal, else "
              "torch.testing.assert_close's tolerance); "
              "recorded once, never re-recorded, no eager call, no skip; its line in "
              "cgraw.report() must say '1 input(s) rebound' for rebind and must not say that an "
              "input was rebound for copy; for chosen it must say '1 input(s) rebound' where K is at "
              "most 1 + cgraw.config.rebind_node_margin's default, else '0 input(s) rebound, 1 copied'. "
              "After the timing: two more calls compared with eager, "
              "still no re-record or eager call, and at least as many replays as timed calls",
    "verdict": "'met' when the whole 95% interval is at or under the limit, 'missed' when all of it "
               "is above, else 'unresolved'; 'not measured' when a figure is missing",
    "precision": "float32",
    "memory": "large section, expected peak about 2 GiB: the two 256 MiB inputs, static's output, the "
              "recording's output (and copy's placeholder), eager's results during the checks; "
              "details.*.memory gives the device's used memory after each block",
}

# What this benchmark assumes of the runtime (so an integrator can adjust one place).
ASSUMED_API = {
    "cgraw.config.rebind_inputs": "bool, default True; read when a graphed function records: True "
                                  "rebinds kernel arguments to the caller's tensor, False copies "
                                  "into a placeholder (every input copied)",
    "cgraw.config.rebind_node_margin": "int, read when a graphed function records: an input under 1 MiB "
                                       "is read in place when at most this many nodes more than its "
                                       "copy nodes read it; absent: every provable input is read in place",
    "cgraw.report(file=...)": "each recorded node's line reads 'node NAME depth D: N graph nodes"
                              "..., R input(s) rebound, C copied'",
    "GraphedFunction.name, .fn_id": "as in cgraw.graphed; per-function counters in "
                                    "cgraw.trees.graphed._managers[device].stats[fn_id]",
}

_COUNTS = re.compile(r"(\d+) input\(s\) rebound, (\d+) copied")


class CheckFailed(Exception):
    """A system's result is not what eager's would be, or not what the system claims: not timed."""


# ---------------------------------------------------------------- pure helpers (CPU-tested)


def reads(k: int):
    """``f(x)`` in which exactly ``k`` kernels read ``x`` (1 to 4); the ``k - 1`` additions read
    temporaries; one output. Named ``reads_x_{k}`` (as ``cgraw.report()`` shows it)."""
    if not 1 <= k <= 4:
        raise ValueError(f"k={k} must be 1, 2, 3 or 4")

    def f(x):
        out = x * 2.0
        if k > 1:
            out = out + x.sin()
        if k > 2:
            out = out + x.cos()
        if k > 3:
            out = out + x.exp()
        return out

    f.__name__ = f.__qualname__ = f"reads_x_{k}"
    return f


def report_line(text: str, name: str) -> str | None:
    """The line of ``cgraw.report()``'s ``text`` for the recorded node of graphed function ``name``."""
    prefix = f"node {name} depth "
    for line in text.splitlines():
        if line.strip().startswith(prefix):
            return line.strip()
    return None


def rebound_counts(line: str | None) -> tuple[int, int] | None:
    """``(rebound, copied)`` from a report line, or None when the line does not say."""
    m = _COUNTS.search(line or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_report(system: str, line: str | None, k: int = 1, margin: int = 0) -> None:
    """Raise ``CheckFailed`` unless the node's report line fits ``system``: rebind must say
    "1 input(s) rebound"; copy must not say that an input was rebound; chosen (``margin``: its
    ``rebind_node_margin``) must read in place an input ``k`` nodes read when ``k <= 1 + margin``
    (one copy node), and keep the copy otherwise."""
    counts = rebound_counts(line)
    if system == "chosen":
        want = (1, 0) if k <= 1 + margin else (0, 1)
        if counts != want:
            raise CheckFailed(f"K={k}: the defaults should give {want[0]} input(s) rebound, {want[1]} copied: "
                              f"report line {line!r}")
    elif system == "rebind":
        if counts is None or counts[0] != 1:
            raise CheckFailed(f"the recording does not read its input in place: report line {line!r}")
    elif counts is not None and counts[0] != 0:
        raise CheckFailed(f"rebind_inputs=False, yet the report says an input was rebound: {line!r}")


def paired(a_groups, b_groups, op) -> list[list[float]]:
    """``op(a, b)`` per round, per block: lists of blocks, each a list of per-round samples."""
    return [[op(a, b) for a, b in zip(ga, gb, strict=True)] for ga, gb in zip(a_groups, b_groups, strict=True)]


def summarise(groups, limit: float | None = None) -> dict:
    """Median over every value of ``groups`` (blocks of per-round values), p90, its bootstrap 95%
    interval (two-level with several blocks) and, with ``limit``, the verdict."""
    values = sorted(v for g in groups for v in g)
    if not values:
        return {"median": None, "p90": None, "ci95": None, **({} if limit is None else {"verdict": "not measured"})}
    ci = bootstrap_ci(groups)
    out = {"median": statistics.median(values), "p90": percentile(values, 0.9), "ci95": list(ci),
           "blocks": len([g for g in groups if g]), "samples": len(values)}
    if limit is not None:
        out["verdict"] = verdict(ci, limit)
    return out


def flat(name: str, s: dict, unit: str = "_us") -> dict:
    """A ``summarise`` result as flat row fields: ``{name}{unit}``, ``{name}_p90{unit}``,
    ``{name}_ci95`` and, where there is one, ``{name}_verdict``."""
    out = {f"{name}{unit}": s["median"], f"{name}_p90{unit}": s["p90"], f"{name}_ci95": s["ci95"]}
    if "verdict" in s:
        out[f"{name}_verdict"] = s["verdict"]
    return out


def overall(verdicts) -> str:
    """'missed' if any verdict missed, 'met' if all met, else 'not measured' (one missing) or
    'unresolved'."""
    verdicts = list(verdicts)
    if "missed" in verdicts:
        return "missed"
    if verdicts and all(v == "met" for v in verdicts):
        return "met"
    if not verdicts or "not measured" in verdicts:
        return "not measured"
    return "unresolved"


def met(v: str) -> bool | None:
    return {"met": True, "missed": False}.get(v)


def block_order(block: int, systems: tuple[str, ...] = SYSTEMS) -> tuple[str, ...]:
    """The systems of block ``block``, rotated by one per block (two systems alternate)."""
    i = block % len(systems)
    return systems[i:] + systems[:i]


# ---------------------------------------------------------------- the runtime's side


def _set_rebind(system: str, margin: int | None = None) -> bool:
    """Set ``cgraw.config.rebind_inputs`` for ``system``, and ``rebind_node_margin`` where the
    runtime has it (rebind: ``REPOINT_ALL``; the others: ``margin``, the default); False when
    the runtime has no ``rebind_inputs`` (then copying is its only path, and rebind cannot run)."""
    import cgraw

    try:
        cgraw.config.rebind_inputs = system != "copy"
    except AttributeError:
        if system != "copy":
            raise CheckFailed("cgraw.config has no rebind_inputs setting: this runtime predates rebinding") from None
        return False
    if margin is not None:
        cgraw.config.rebind_node_margin = REPOINT_ALL if system == "rebind" else margin
    elif system == "chosen":
        raise CheckFailed("cgraw.config has no rebind_node_margin setting: every provable input is read in place")
    return True


def _fresh_tree() -> None:
    import torch

    import cgraw

    cgraw.reset()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _stats(g) -> dict:
    import torch

    from cgraw.trees.graphed import _managers

    mgr = _managers.get(torch.cuda.current_device())
    st = mgr.stats.get(g.fn_id) if mgr is not None else None
    if st is None:
        return {}
    return {"warmups": st.warmups, "recordings": st.recordings, "rerecords": st.rerecords, "replays": st.replays,
            "eager_calls": st.eager_calls, "skip_reasons": dict(st.skip_reasons),
            "rerecord_reasons": list(st.rerecord_reasons[-3:])}


def _same_as(got, want, what: str) -> None:
    """``torch.equal`` first (the same kernels on the same values: equal bits expected, and at
    256 MiB it needs no temporaries), else ``assert_close`` for the verdict and its message."""
    import torch

    if torch.equal(got, want):
        return
    try:
        torch.testing.assert_close(got, want)
    except AssertionError as exc:
        raise CheckFailed(f"{what} differs from eager: {exc}") from None


def _calls_equal(g, f, xs, order) -> None:
    for j, i in enumerate(order):
        got = g(xs[i])
        _same_as(got, f(xs[i]), f"call {j + 1} (input x{i})")
        del got


def _check(system: str, g, f, xs, order, k: int = 1, margin: int = 0) -> dict:
    """Eager's results on every call, recorded once and replayed, and the report's word on the
    input (see METHOD["checks"]); returns the report line and the counters."""
    import cgraw

    cgraw.mark_step_begin()  # a root: its first call on an empty path
    _calls_equal(g, f, xs, order)
    st = _stats(g)
    if st.get("recordings") != 1 or st.get("rerecords") or st.get("eager_calls") or st.get("skip_reasons"):
        raise CheckFailed(f"not recorded once and replayed: {st}")
    line = report_line(cgraw.report(file=io.StringIO()), g.name)
    check_report(system, line, k, margin)
    return {"report_line": line, "stats": st}


def _after_timing(g, f, xs, order, before: dict, timed_calls: int) -> None:
    _calls_equal(g, f, xs, order[-2:])
    st = _stats(g)
    if st.get("rerecords") != before.get("rerecords") or st.get("eager_calls") or st.get("skip_reasons"):
        raise CheckFailed(f"re-recorded, skipped or ran eagerly while timed: {st}")
    if st.get("replays", 0) - before.get("replays", 0) < timed_calls:
        raise CheckFailed(f"{st.get('replays', 0) - before.get('replays', 0)} replays for {timed_calls} timed calls")


def _pattern_call(g, xs, pattern: str):
    if pattern == "same":
        x0 = xs[0]
        return lambda: g(x0)
    return alternating(g, xs)


def _memory(torch) -> dict:
    free, total = torch.cuda.mem_get_info()
    return {"device_used_mib": (total - free) / 2**20,
            "torch_max_reserved_mib": torch.cuda.max_memory_reserved() / 2**20}


# ---------------------------------------------------------------- (1) per input


def _per_input_block(rep: Report, system: str, block: int, xs, *, rounds: int, details: dict,
                     margin: int | None) -> dict:
    """One system's block: ``{(k, pattern): per-round host us}`` for the calls that passed."""
    import torch

    import cgraw

    _fresh_tree()
    label = f"per_input {system} block {block}"
    info = details.setdefault("report_lines", {})
    if not rep.check(f"{label}: cgraw.config.rebind_inputs", lambda: _set_rebind(system, margin)):
        return {}
    timed, keep = {}, {}
    for k in KS:
        f = reads(k)
        for pattern in PATTERNS:
            g = cgraw.graphed(f)  # one function per pattern: a same-address call never follows a moved one
            order = SAME_ORDER if pattern == "same" else MOVING_ORDER
            detail: dict = {}
            name = f"{label}: K={k} {pattern}"
            if rep.check(name, lambda g=g, f=f, order=order, d=detail, k=k:
                         d.update(_check(system, g, f, xs, order, k, margin or 0))):
                timed[(k, pattern)] = _pattern_call(g, xs, pattern)
                keep[(k, pattern)] = (g, f, order, detail["stats"])
            info[name] = detail.get("report_line")
    if block == 0:
        details.setdefault("report_text", {})[f"per_input/{system}"] = cgraw.report(file=io.StringIO())
    if not timed:
        return {}
    res = host_us_interleaved(timed, loops=LOOPS, rounds=rounds, sync=torch.cuda.synchronize, seed=block)
    calls = rounds * LOOPS
    out = {}
    for key, (g, f, order, before) in keep.items():
        if rep.check(f"{label}: K={key[0]} {key[1]} after the timing",
                     lambda g=g, f=f, order=order, before=before: _after_timing(g, f, xs, order, before, calls)):
            out[key] = res[key]["samples"]
    details.setdefault("memory", {})[label] = _memory(torch)
    return out


def _per_input(rep: Report, *, blocks: int, rounds: int, margin: int | None) -> tuple[list, dict, dict, dict]:
    """Rows, summary, targets and details (report lines, memory, per-round samples) of section (1);
    ``margin``: the runtime's default ``rebind_node_margin`` (None: it has none)."""
    import torch

    xs = [torch.randn(SMALL_NUMEL, device="cuda") for _ in range(2)]
    details: dict = {}
    # samples[system][(k, pattern)] = {block: per-round host us} (the blocks where it passed)
    samples = {s: {} for s in SYSTEMS}
    for b in range(blocks):
        for system in block_order(b):
            got = _per_input_block(rep, system, b, xs, rounds=rounds, details=details, margin=margin)
            for key, v in got.items():
                samples[system].setdefault(key, {})[b] = v
    rows, summary, per_k = [], {}, {}
    for system in SYSTEMS:
        deltas, sys_summary = {}, {"same_us": {}, "moving_us": {}, "per_changed_input_us": {},
                                   "per_changed_input_ci95": {}}
        for k in KS:
            same, moving = samples[system].get((k, "same"), {}), samples[system].get((k, "moving"), {})
            deltas[k] = {b: [m - s for s, m in zip(same[b], moving[b], strict=True)]
                         for b in sorted(set(same) & set(moving))}
            s_same, s_moving = summarise(list(same.values())), summarise(list(moving.values()))
            s_delta = summarise(list(deltas[k].values()), PER_INPUT_TARGET_US)
            rows.append(rep.add(section="per_input", system=system, k=k, numel=SMALL_NUMEL,
                                **flat("same", s_same), **flat("moving", s_moving), **flat("delta", s_delta),
                                blocks=s_delta.get("blocks"), rounds_per_block=rounds))
            sys_summary["same_us"][k], sys_summary["moving_us"][k] = s_same["median"], s_moving["median"]
            sys_summary["per_changed_input_us"][k] = s_delta["median"]
            sys_summary["per_changed_input_ci95"][k] = s_delta["ci95"]
            if system == "rebind":
                per_k[k] = {"median_us": s_delta["median"], "ci95": s_delta["ci95"], "verdict": s_delta["verdict"]}
            details.setdefault("samples_us", {})[f"{system} K={k}"] = {"same": same, "moving": moving}
        both = sorted(set(deltas[KS[0]]) & set(deltas[KS[-1]]))
        span = KS[-1] - KS[0]
        slope = [[(d4 - d1) / span for d1, d4 in zip(deltas[KS[0]][b], deltas[KS[-1]][b], strict=True)] for b in both]
        s_slope = summarise(slope)
        sys_summary["per_node_us"], sys_summary["per_node_ci95"] = s_slope["median"], s_slope["ci95"]
        summary[system] = sys_summary
    chosen_k = {}
    for other in ("rebind", "chosen"):
        cmp = {}
        for k in KS:
            r, c = summary[other]["per_changed_input_us"][k], summary["copy"]["per_changed_input_us"][k]
            cmp[k] = {f"{other}_us": r, "copy_us": c,
                      f"{other}_minus_copy_us": None if r is None or c is None else r - c,
                      f"{other}_over_copy": r / c if r is not None and c else None}
            if other == "chosen":
                ratio = cmp[k]["chosen_over_copy"]
                chosen_k[k] = {"ratio": ratio, "verdict": "not measured" if ratio is None else
                               "met" if ratio <= CHOSEN_TARGET else "missed"}
        summary[f"per_changed_input_{other}_vs_copy"] = cmp
    v = overall(x["verdict"] for x in per_k.values())
    targets = {
        "per_input_rebind_moving_minus_same": {
            "what": "rebind: host us per call, moving - same, with K = 1, 2, 4 kernels reading the 4 KB input",
            "limit_us": PER_INPUT_TARGET_US, "per_k": per_k, "verdict": v, "met": met(v)},
    }
    v = overall(x["verdict"] for x in chosen_k.values())
    targets["per_input_chosen_over_copy"] = {
        "what": "chosen (cgraw's defaults): moving - same over copy's, K = 1, 2, 4 (ratio of medians from "
                "different blocks)", "limit": CHOSEN_TARGET, "per_k": chosen_k, "verdict": v, "met": met(v)}
    return rows, summary, targets, details


# ---------------------------------------------------------------- (2) large input


def _device_once(unit, calls: int, stream) -> tuple[float, float]:
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter_ns()
    start.record(stream)
    for _ in range(calls):
        unit()
    end.record(stream)
    torch.cuda.synchronize()
    wall_us = (time.perf_counter_ns() - t0) / 1e3 / calls
    return start.elapsed_time(end) * 1e3 / calls, wall_us


def _device_interleaved(units: dict, *, calls: int, rounds: int, seed: int) -> dict:
    """``{name: {"device_us": [per round], "wall_us": [per round]}}``, ``units`` measured once each
    round in a shuffled order, after one measurement each as warm-up."""
    import torch

    stream = torch.cuda.current_stream()
    for unit in units.values():
        _device_once(unit, calls, stream)
    names = list(units)
    rng = random.Random(seed)
    out = {n: {"device_us": [], "wall_us": []} for n in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for n in names:
            d, w = _device_once(units[n], calls, stream)
            out[n]["device_us"].append(d)
            out[n]["wall_us"].append(w)
    return out


def _static_graph(rep: Report, x):
    """``(graph, out)``: ``cgraw.capture()`` of ``x * 2`` on the fixed ``x``, checked; None if it fails."""
    import cgraw

    built = {}

    def build():
        with cgraw.capture() as sg:
            out = x * 2.0
        built["g"], built["out"] = sg, out
        for _ in range(2):
            out.zero_()
            sg.replay()
            _same_as(out, x * 2.0, "replay")

    if rep.check("large: static (cgraw.capture of x0 * 2, 256 MiB)", build):
        return built["g"], built["out"]
    if "g" in built:
        built["g"].close()
    return None


def _large_block(rep: Report, system: str, block: int, small, large, static, *, rounds: int, device_rounds: int,
                 details: dict, margin: int | None) -> dict:
    import torch

    import cgraw

    _fresh_tree()
    label = f"large {system} block {block}"
    if not rep.check(f"{label}: cgraw.config.rebind_inputs", lambda: _set_rebind(system, margin)):
        return {}
    info = details.setdefault("report_lines", {})
    fns, keep = {}, {}
    for size, xs in (("4KB", small), ("256MiB", large)):
        f = reads(1)
        f.__name__ = f.__qualname__ = f"times2_{size}"
        g = cgraw.graphed(f)
        detail: dict = {}
        name = f"{label}: {size} moving"
        if rep.check(name, lambda g=g, f=f, xs=xs, d=detail: d.update(_check(system, g, f, xs, MOVING_ORDER))):
            fns[size] = alternating(g, xs)  # one alternation for host and device timing: it moves every call
            keep[size] = (g, f, xs, detail["stats"])
        info[name] = detail.get("report_line")
    if block == 0:
        details.setdefault("report_text", {})[f"large/{system}"] = cgraw.report(file=io.StringIO())
    out: dict = {}
    if fns:
        res = host_us_interleaved(fns, loops=LARGE_LOOPS, rounds=rounds, sync=torch.cuda.synchronize, seed=block)
        out["host"] = {size: res[size]["samples"] for size in fns}
    if "256MiB" in fns:
        units = {"system": fns["256MiB"]}
        if static is not None:
            units["static"] = static[0].replay
        out["device"] = _device_interleaved(units, calls=DEVICE_CALLS, rounds=device_rounds, seed=block)
    details.setdefault("memory", {})[label] = _memory(torch)
    calls = {"4KB": rounds * LARGE_LOOPS, "256MiB": rounds * LARGE_LOOPS + (device_rounds + 1) * DEVICE_CALLS}
    for size, (g, f, xs, before) in keep.items():
        if not rep.check(f"{label}: {size} moving after the timing",
                         lambda g=g, f=f, xs=xs, before=before, n=calls[size]:
                         _after_timing(g, f, xs, MOVING_ORDER, before, n)):
            out.get("host", {}).pop(size, None)
            if size == "256MiB":
                out.pop("device", None)
    return out


def _large(rep: Report, *, blocks: int, rounds: int, device_rounds: int,
           margin: int | None) -> tuple[list, dict, dict, dict]:
    """Rows, summary, targets and details of section (2)."""
    import torch

    _fresh_tree()
    small = [torch.randn(SMALL_NUMEL, device="cuda") for _ in range(2)]
    large = [torch.randn(LARGE_NUMEL, device="cuda") for _ in range(2)]
    static = _static_graph(rep, large[0])
    details: dict = {}
    per = {s: [] for s in LARGE_SYSTEMS}  # system -> each block's result
    try:
        for b in range(blocks):
            for system in block_order(b, LARGE_SYSTEMS):
                per[system].append(_large_block(rep, system, b, small, large, static, rounds=rounds,
                                                device_rounds=device_rounds, details=details, margin=margin))
    finally:
        _fresh_tree()
        if static is not None:
            static[0].close()
    rows, summary, fig = [], {}, {}
    for system in LARGE_SYSTEMS:
        results = per[system]
        host = {size: [r["host"][size] for r in results if size in r.get("host", {})] for size in ("4KB", "256MiB")}
        ratio_host = [[b / a for a, b in zip(r["host"]["4KB"], r["host"]["256MiB"], strict=True)]
                      for r in results if {"4KB", "256MiB"} <= set(r.get("host", {}))]
        dev = [r["device"] for r in results if "device" in r]
        with_static = [d for d in dev if "static" in d]
        sys_dev = [d["system"]["device_us"] for d in with_static]
        static_dev = [d["static"]["device_us"] for d in with_static]
        f = fig[system] = {
            "host_4KB": summarise(host["4KB"]), "host_256MiB": summarise(host["256MiB"]),
            "host_256MiB_over_4KB": summarise(ratio_host, LARGE_HOST_TARGET),
            "device": summarise([d["system"]["device_us"] for d in dev]),
            "wall": summarise([d["system"]["wall_us"] for d in dev]),
            "static_device": summarise(static_dev),
            "device_over_static": summarise(paired(sys_dev, static_dev, lambda a, b: a / b), LARGE_DEVICE_TARGET),
            "device_minus_static": summarise(paired(sys_dev, static_dev, lambda a, b: a - b)),
        }
        rows.append(rep.add(section="large", system=system, pattern="moving", large_numel=LARGE_NUMEL,
                            **flat("host_4KB", f["host_4KB"]), **flat("host_256MiB", f["host_256MiB"]),
                            **flat("host_256MiB_over_4KB", f["host_256MiB_over_4KB"], ""),
                            **flat("device", f["device"]), **flat("wall", f["wall"]),
                            **flat("static_device", f["static_device"]),
                            **flat("device_over_static", f["device_over_static"], ""),
                            **flat("device_minus_static", f["device_minus_static"])))
        summary[system] = {name + ("" if "_over_" in name else "_us"): s["median"] for name, s in f.items()}
        details.setdefault("samples", {})[system] = {"host_us": host, "device": dev}
    static_meds = [summary[s]["static_device_us"] for s in LARGE_SYSTEMS if summary[s]["static_device_us"]]
    static_us = statistics.median(static_meds) if static_meds else None
    # x * 2 reads 256 MiB and writes 256 MiB
    summary["static"] = {"device_us": static_us,
                         "effective_GBps": 2 * LARGE_NUMEL * 4 / (static_us * 1e-6) / 1e9 if static_us else None}
    extra = summary["copy"]["device_minus_static_us"]
    # about 1.0 when the copy costs another full read and write of the input
    summary["copy_extra_over_static"] = extra / static_us if extra is not None and static_us else None
    targets = {}
    for name, key, limit, what in (
            ("large_host_256MiB_over_4KB", "host_256MiB_over_4KB", LARGE_HOST_TARGET,
             "rebind, address moving every call: host us per call at 256 MiB / at 4 KB"),
            ("large_device_over_static", "device_over_static", LARGE_DEVICE_TARGET,
             "rebind, 256 MiB, address moving every call: device us per call / static's (x0 captured in place)")):
        s = fig["rebind"][key]
        targets[name] = {"what": what, "limit": limit, "ratio": s["median"], "ci95": s["ci95"],
                         "verdict": s["verdict"], "met": met(s["verdict"])}
    return rows, summary, targets, details


# ---------------------------------------------------------------- run and report


def _f(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def _ci(ci, spec=".2f") -> str:
    return "-" if not ci else f"[{ci[0]:{spec}}, {ci[1]:{spec}}]"


def _print_tables(per_rows: list, large_rows: list) -> None:
    if per_rows:
        print(f"[rebind] per changed input, 4 KB: host us per call; delta = moving - same "
              f"(target <= {PER_INPUT_TARGET_US} us for rebind)")
        print(f"[rebind] {'system':<7} {'K':>2} {'same':>7} {'moving':>7} {'delta':>7} {'95% CI':>16}  verdict")
        for r in per_rows:
            print(f"[rebind] {r['system']:<7} {r['k']:>2} {_f(r['same_us']):>7} {_f(r['moving_us']):>7} "
                  f"{_f(r['delta_us']):>7} {_ci(r['delta_ci95']):>16}  {r['delta_verdict']}")
    if large_rows:
        print(f"[rebind] large, address moving every call: host us per call at 4 KB and 256 MiB (ratio target "
              f"<= {LARGE_HOST_TARGET} for rebind); device us per call at 256 MiB against static (target <= "
              f"{LARGE_DEVICE_TARGET} for rebind)")
        print(f"[rebind] {'system':<7} {'host 4KB':>9} {'host 256MiB':>11} {'ratio':>6} {'device':>8} {'static':>8} "
              f"{'ratio':>6}  verdicts (host, device)")
        for r in large_rows:
            print(f"[rebind] {r['system']:<7} {_f(r['host_4KB_us']):>9} {_f(r['host_256MiB_us']):>11} "
                  f"{_f(r['host_256MiB_over_4KB'], '.3f'):>6} {_f(r['device_us'], '.1f'):>8} "
                  f"{_f(r['static_device_us'], '.1f'):>8} {_f(r['device_over_static'], '.3f'):>6}  "
                  f"{r['host_256MiB_over_4KB_verdict']}, {r['device_over_static_verdict']}")


def _headline(summary: dict) -> dict:
    """The figures the issue asks about, from the sections' summaries (None where not measured)."""
    pi, lg = summary.get("per_input", {}), summary.get("large", {})
    out = {}
    for system in SYSTEMS:
        p, g = pi.get(system, {}), lg.get(system, {})
        out[system] = {"per_changed_input_us": p.get("per_changed_input_us"), "per_node_us": p.get("per_node_us"),
                       "host_256MiB_over_4KB": g.get("host_256MiB_over_4KB"),
                       "device_over_static": g.get("device_over_static"),
                       "device_minus_static_us": g.get("device_minus_static_us")}
    out["static_device_us"] = lg.get("static", {}).get("device_us")
    out["copy_extra_over_static"] = lg.get("copy_extra_over_static")
    return out


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.rebind", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_BLOCKS} block per system, {QUICK_ROUNDS} host rounds, {QUICK_DEVICE_ROUNDS} "
                         "device rounds")
    ap.add_argument("--only", default=None, help=f"comma-separated sections, of {', '.join(SECTIONS)}")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rebind.json, "
                                                "rebind_quick.json with --quick)")
    return ap.parse_args(argv)


def _sections(spec: str | None) -> list:
    if not spec:
        return list(SECTIONS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in SECTIONS]
    if bad or not names:
        raise SystemExit(f"unknown sections: {', '.join(bad) or spec!r} (choose from {', '.join(SECTIONS)})")
    return names


def main(argv=None) -> int:
    args = _parse(argv)
    sections = _sections(args.only)
    t_start = time.perf_counter()
    if no_gpu():
        return 2
    import torch

    import cgraw

    blocks = QUICK_BLOCKS if args.quick else BLOCKS
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    device_rounds = QUICK_DEVICE_ROUNDS if args.quick else DEVICE_ROUNDS
    rep = Report("rebind")
    has_setting = hasattr(cgraw.config, "rebind_inputs")
    saved = getattr(cgraw.config, "rebind_inputs", None)
    margin = getattr(cgraw.config, "rebind_node_margin", None)  # the default: system chosen's
    torch.manual_seed(0)
    summary: dict = {}
    targets: dict = {}
    details: dict = {}
    timings: dict = {}
    per_rows, large_rows = [], []
    try:
        if "per_input" in sections:
            t0 = time.perf_counter()
            per_rows, summary["per_input"], per_targets, details["per_input"] = \
                _per_input(rep, blocks=blocks, rounds=rounds, margin=margin)
            targets.update(per_targets)
            timings["per_input_s"] = time.perf_counter() - t0
        if "large" in sections:
            t0 = time.perf_counter()
            large_rows, summary["large"], large_targets, details["large"] = _large(
                rep, blocks=blocks, rounds=rounds, device_rounds=device_rounds, margin=margin)
            targets.update(large_targets)
            timings["large_s"] = time.perf_counter() - t0
    finally:  # the other parts of ``python -m benchmarks`` run in this process
        cgraw.reset()
        if has_setting:
            cgraw.config.rebind_inputs = saved
        if margin is not None:
            cgraw.config.rebind_node_margin = margin
    summary["headline"] = _headline(summary)
    _print_tables(per_rows, large_rows)
    for name, t in targets.items():
        print(f"[rebind] target {name}: {t['verdict']}", flush=True)
    total_s = time.perf_counter() - t_start
    out = args.out or os.path.join(RESULTS_DIR, "rebind_quick.json" if args.quick else "rebind.json")
    path = rep.save({"method": METHOD, "assumed_api": ASSUMED_API, "config_has_rebind_inputs": has_setting,
                     "summary": summary, "targets": targets, "details": details, "total_s": total_s,
                     "timings": timings,
                     "options": {"quick": args.quick, "sections": sections, "ks": KS, "small_numel": SMALL_NUMEL,
                                 "large_numel": LARGE_NUMEL, "blocks": blocks, "rounds": rounds,
                                 "loops": LOOPS, "large_loops": LARGE_LOOPS, "device_calls": DEVICE_CALLS,
                                 "device_rounds": device_rounds, "default_rebind_node_margin": margin}},
                    path=out)
    print(f"results: {path}")
    print(f"[rebind] total {total_s:.1f} s", flush=True)
    return 1 if rep.failed_checks else 0  # a system that fails its check fails the part


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
