"""What following the frameworks' generators costs a replay that draws random numbers: host
microseconds per call with the generator step (``rng.plan.GraphRng.sync``) and without it, same run.

Systems (one GPU; ``host_us_interleaved``: bursts of calls, systems shuffled in every round, a
synchronise after each burst outside the timed region):
  ``graphed_on``  ``@cgraw.graphed`` ``f(x) = x + torch.rand_like(x)`` (1,024 float32), warm: each
                  call reads torch's CUDA generator (``initial_seed``, ``get_offset``) and
                  advances it (``set_offset``); no driver call while nothing else moves it;
  ``graphed_off`` the same function graphed apart, its recording's generator step removed (its
                  numbers are fresh per replay but follow no generator: the cost without it);
  ``replay_on`` / ``replay_off``  ``Graph.replay()`` of a ``cgraw.capture()`` of the same work;
  ``replay_moved_on`` / ``replay_moved_off``  as the replays, with torch's offset moved by 4
                  before every call (as an eager draw would): ``on`` then writes the generator
                  record on the replay's stream (one kernel launch) every call;
  ``cupy_replay_on`` / ``cupy_replay_off``  ``cupy.random.random`` captured, where CuPy is
                  installed (the step reads and advances ``RandomState._rk_seed``);
  ``torch_initial_seed``, ``torch_get_offset``, ``torch_set_offset``: torch's three calls alone.
``cost_us`` = median over rounds of (``*_on`` - ``*_off``) in the same round, with a bootstrap 95%
interval; the target is at most 0.5 us per call for ``graphed`` and ``replay``. Checks before
timing: after ``torch.manual_seed(0)`` three calls of the ``on`` systems give the same numbers
again after ``torch.manual_seed(0)`` and others after ``torch.manual_seed(1)``; every system's
values lie in ``[x, x + 1)`` and two calls differ.

``--cpu`` (no GPU): the step itself on stand-in generators, against the bare generator calls it
makes (``python3 -m benchmarks.rng_seed --cpu``; ``rng_seed_cpu.json``).
``python3 -m benchmarks.rng_seed [--quick]`` writes ``benchmarks/results/rng_seed.json``.
"""

from __future__ import annotations

import argparse
import functools
import operator
import os
import statistics
import sys
import types

from benchmarks._harness import RESULTS_DIR, Report, bootstrap_ci, host_us_interleaved, no_gpu, verdict

TARGET_US = 0.5
N = 1024
ROUNDS, LOOPS = 61, 200
QUICK_ROUNDS, QUICK_LOOPS = 9, 100
CPU_ROUNDS, CPU_LOOPS = 41, 20000


def _cost(res: dict, on: str, off: str) -> dict:
    """``on`` - ``off`` per round: median, bootstrap interval, verdict against ``TARGET_US``."""
    diffs = [a - b for a, b in zip(res[on]["samples"], res[off]["samples"], strict=True)]
    ci = bootstrap_ci([diffs])
    return {"cost_us": statistics.median(diffs), "ci95_us": ci, "verdict": verdict(ci, TARGET_US)}


# ----------------------------------------------------------------------------- the GPU run


def _check_seeded(torch, call, name: str) -> None:
    """``call()`` returns host values: same seed, same three calls; another seed, others."""
    def three(seed):
        torch.manual_seed(seed)
        return [call() for _ in range(3)]

    a, b, c = three(0), three(0), three(1)
    if not all(torch.equal(p, q) for p, q in zip(a, b, strict=True)):
        raise AssertionError(f"{name}: torch.manual_seed(0) twice gave other numbers")
    if any(torch.equal(p, q) for p, q in zip(a, c, strict=True)):
        raise AssertionError(f"{name}: seeds 0 and 1 gave the same numbers")


def _check_fresh(torch, x, call, name: str) -> None:
    y1, y2 = call(), call()
    for y in (y1, y2):
        d = y - x.cpu()
        if not bool(((d >= 0) & (d < 1)).all()):
            raise AssertionError(f"{name}: values outside [x, x + 1)")
    if torch.equal(y1, y2):
        raise AssertionError(f"{name}: two calls drew the same numbers")


def _recording(fn):
    from cgraw.trees.graphed import _managers

    for node in _managers[0].nodes():
        if node.fn is fn and node.recording is not None:
            return node.recording
    raise RuntimeError(f"{fn.name}: no recording")


def _torch_systems(rep, cgraw, torch) -> dict:
    x = torch.rand(N, device="cuda")

    def draw(t):
        return t + torch.rand_like(t)

    on, off = cgraw.graphed(draw), cgraw.graphed(lambda t: draw(t))
    for f in (on, off):
        for _ in range(3):
            f(x)
    rec_off = _recording(off)
    rec_off.rng_sync = None  # the same replay without the generator step
    with cgraw.capture() as g_on:
        y_on = draw(x)
    with cgraw.capture() as g_off:
        y_off = draw(x)
    g_off._rng_sync = None
    gen = torch.cuda.default_generators[0]

    def moved(replay):
        def run():
            gen.set_offset(gen.get_offset() + 4)
            replay()
        return run

    systems = {
        "graphed_on": lambda: on(x), "graphed_off": lambda: off(x),
        "replay_on": g_on.replay, "replay_off": g_off.replay,
        "replay_moved_on": moved(g_on.replay), "replay_moved_off": moved(g_off.replay),
    }
    host = {
        "graphed_on": lambda: on(x).cpu(), "graphed_off": lambda: off(x).cpu(),
        "replay_on": lambda: (g_on.replay(), y_on.cpu())[1], "replay_off": lambda: (g_off.replay(), y_off.cpu())[1],
        "replay_moved_on": lambda: (systems["replay_moved_on"](), y_on.cpu())[1],
        "replay_moved_off": lambda: (systems["replay_moved_off"](), y_off.cpu())[1],
    }
    timed = {}
    for name, fn in systems.items():
        def check(name=name):
            _check_fresh(torch, x, host[name], name)
            if name.endswith("_on"):
                _check_seeded(torch, host[name], name)
        if rep.check(name, check):
            timed[name] = fn
    timed["torch_initial_seed"] = gen.initial_seed
    timed["torch_get_offset"] = gen.get_offset
    timed["torch_set_offset"] = lambda: gen.set_offset(8)
    return timed


def _cupy_systems(rep, cgraw, cp) -> dict:
    x = cp.random.random(N)

    def draw():
        return x + cp.random.random(N)

    with cgraw.capture() as g_on:
        y_on = draw()
    with cgraw.capture() as g_off:
        y_off = draw()
    g_off._rng_sync = None
    out = {}
    for name, g, y in (("cupy_replay_on", g_on, y_on), ("cupy_replay_off", g_off, y_off)):
        def host(g=g, y=y):
            g.replay()
            return cp.asnumpy(y)

        def check(name=name, host=host):
            a, b = host(), host()
            d = a - cp.asnumpy(x)
            if not ((d >= 0) & (d < 1)).all() or (a == b).all():
                raise AssertionError(f"{name}: values outside [x, x + 1) or repeated")
            if name.endswith("_on"):
                runs = []
                for seed in (0, 0, 1):
                    cp.random.seed(seed)
                    runs.append([host() for _ in range(3)])
                if not all((p == q).all() for p, q in zip(runs[0], runs[1], strict=True)):
                    raise AssertionError(f"{name}: cupy.random.seed(0) twice gave other numbers")
                if any((p == q).all() for p, q in zip(runs[0], runs[2], strict=True)):
                    raise AssertionError(f"{name}: seeds 0 and 1 gave the same numbers")
        if rep.check(name, check):
            out[name] = g.replay
    return out


def _gpu(args) -> int:
    if no_gpu():
        return 2
    import torch

    import cgraw

    rounds, loops = (QUICK_ROUNDS, QUICK_LOOPS) if args.quick else (ROUNDS, LOOPS)
    rep = Report("rng_seed_quick" if args.quick else "rng_seed")
    systems = _torch_systems(rep, cgraw, torch)
    try:
        import cupy as cp
    except ImportError as exc:
        rep.peer_missing("cupy", str(exc))
    else:
        systems.update(_cupy_systems(rep, cgraw, cp))
    res = host_us_interleaved(systems, loops=loops, rounds=rounds, sync=torch.cuda.synchronize)
    for name, r in res.items():
        rep.add(system=name, median_us=r["median_us"], p90_us=r["p90_us"])
    costs = {}
    for pair in ("graphed", "replay", "replay_moved", "cupy_replay"):
        on, off = f"{pair}_on", f"{pair}_off"
        if on in res and off in res:
            costs[pair] = _cost(res, on, off)
            print(f"[{rep.name}] {pair}: +{costs[pair]['cost_us']:.3f} us per call "
                  f"(95% {costs[pair]['ci95_us'][0]:.3f}..{costs[pair]['ci95_us'][1]:.3f}), "
                  f"target {TARGET_US} us: {costs[pair]['verdict']}", flush=True)
    targeted = [costs[p]["verdict"] for p in ("graphed", "replay") if p in costs]
    overall = "met" if targeted and all(v == "met" for v in targeted) else (
        "missed" if "missed" in targeted else "unresolved")
    out = args.out or os.path.join(RESULTS_DIR, f"{rep.name}.json")
    path = rep.save({"costs": costs, "target_us": TARGET_US, "overall": overall, "method": {
        "rounds": rounds, "loops": loops, "n": N, "docstring": __doc__}}, path=out)
    print(f"[{rep.name}] overall (graphed and replay within {TARGET_US} us): {overall}")
    print(f"results: {path}")
    return 0


# ----------------------------------------------------------------------------- the CPU run


class _PyGen:
    """A stand-in torch generator in Python (each call a Python function call)."""

    def __init__(self):
        self.seed, self.offset = 1234, 0

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        self.offset = offset


def _c_gen():
    """A stand-in whose methods are C calls (``functools.partial`` of ``operator`` functions),
    like the C methods of ``torch.Generator`` less torch's own work inside them."""
    state = [1234, 0]
    return types.SimpleNamespace(initial_seed=functools.partial(operator.getitem, state, 0),
                                 get_offset=functools.partial(operator.getitem, state, 1),
                                 set_offset=functools.partial(operator.setitem, state, 1))


def _bare(gen, inc: int):
    """The generator calls the step cannot do without, and nothing else."""
    seed_of, offset_of, set_offset = gen.initial_seed, gen.get_offset, gen.set_offset

    def bare(stream):
        seed_of()
        set_offset(offset_of() + inc)

    return bare


def _cpu(args) -> int:
    from cgraw.rng import plan as rng

    rep = Report("rng_seed_cpu", gpu=False)
    writes = []
    systems = {}
    for label, make in (("python", _PyGen), ("c", _c_gen)):
        src = rng.Source(rng.TORCH, 0, 0x1000, lambda stream, base, pos: writes.append(pos))
        step = rng.TorchUse(make(), src, 1).sync
        bare = _bare(make(), 4)  # its own generator: the step's sees nothing move it
        systems[f"torch_step_{label}_gen"] = functools.partial(step, 7)
        systems[f"bare_calls_{label}_gen"] = functools.partial(bare, 7)
    states = types.SimpleNamespace(_random_states={0: types.SimpleNamespace(_rk_seed=5)})
    csrc = rng.Source(rng.CUPY, 0, 0x1020, lambda stream, base, pos: writes.append(pos))
    systems["cupy_step"] = functools.partial(rng.RkUse(states, 0, csrc, 1, 1024, None).sync, 7)
    systems["nothing"] = functools.partial(lambda stream: None, 7)
    rounds, loops = (9, 2000) if args.quick else (CPU_ROUNDS, CPU_LOOPS)
    res = host_us_interleaved(systems, loops=loops, rounds=rounds)
    for name, r in res.items():
        rep.add(system=name, median_us=r["median_us"], p90_us=r["p90_us"])
    own = {label: _cost(res, f"torch_step_{label}_gen", f"bare_calls_{label}_gen") for label in ("python", "c")}
    for label, c in own.items():
        print(f"[{rep.name}] the step's own work over the bare generator calls ({label} stand-in): "
              f"{c['cost_us'] * 1e3:.0f} ns", flush=True)
    if len(writes) != 3:  # one write per generator record, the first time
        raise AssertionError(f"the step wrote {len(writes)} times, expected 3")
    out = args.out or os.path.join(RESULTS_DIR, "rng_seed_cpu.json")
    path = rep.save({"own_work_us": own, "method": {"rounds": rounds, "loops": loops, "docstring": __doc__}},
                    path=out)
    print(f"results: {path}")
    return 0


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.rng_seed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds (a smoke run; figures not for the README)")
    ap.add_argument("--cpu", action="store_true", help="the step on stand-in generators, no GPU")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rng_seed.json)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    return _cpu(args) if args.cpu else _gpu(args)


if __name__ == "__main__":
    sys.exit(main())
