"""CPU tier: random programs of graphed functions, replayed by the CUDA-graph emulator, against eager.

Each seed builds 2-4 small torch functions (elementwise ops, matmul, reductions, views, in-place
writes of an input, inputs or views of inputs returned, several outputs) and a script of calls
(fresh inputs, outputs of earlier calls of the step or of earlier steps, a static ``nn.Parameter``
updated in place between steps, the same tensor twice, outputs dropped, ``mark_step_begin()``).
The script runs for several steps through the real ``TreeManager`` over ``CpuGraphBackend``
(warm-up, recording, replays of the op log, generations) and, side by side, eagerly on clones.
Every output, every argument and every tensor still held is compared bitwise after each call,
except outputs of an ended generation (poisoned by design: the guide's "Generations").
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from cpu_graph import CpuGraphBackend  # noqa: E402
from torch_cpu_backend import TorchFn, cpu_tree  # noqa: E402

pytestmark = pytest.mark.torch

N = 4  # every tensor that can be an argument is N x N
STEPS = 7

UNARY = {
    "sin": torch.sin, "tanh": torch.tanh, "abs": torch.abs, "relu": torch.relu,
    "affine": lambda a: a * 0.5 + 0.25, "neg": torch.neg,
}
BINARY = {"add": torch.add, "mul": torch.mul, "sub": torch.sub, "mm": lambda a, b: (a @ b) * 0.25}
REDUCE = {  # a reduction broadcast back to N x N (a dense result, never an expanded view)
    "center": lambda a: a - a.mean(dim=0, keepdim=True),
    "rowmax": lambda a: a * a.amax(dim=1, keepdim=True).tanh(),
    "total": lambda a: a + a.sum() * 0.1,
}
VIEWS = {"t": lambda a: a.t(), "reshape": lambda a: a.reshape(N * N).view(N, N) if a.is_contiguous() else a.t().t()}
# In-place writes that change (almost) any input. The guide, "Mutation": an eager input the warm-up
# wrote (its contents or its version counter changed) is copied back after each replay.
WRITES = {
    "mul_": lambda a, v: a.mul_(0.5).add_(0.375),
    "add_": lambda a, v: a.add_(v).add_(1.0),
    "rows_": lambda a, v: a[1:3].add_(1.0),
    "copy_": lambda a, v: a.copy_(v * 0.5 + a + 1.0),
}
# outputs of one function (the last computed value always comes first)
OUTS = ("value", "arg", "arg_t", "arg_rows", "value_rows", "value_sum", "again")
# and views of another dtype (a separate test, so the seeds above keep their programs)
BITS = OUTS + ("arg_bits", "arg_rows_bits", "value_bits")


def same(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


KINDS = ["un", "un", "bin", "bin", "red", "view", "write"]


def make_fn(rng, nargs, name, out_kinds=OUTS, kinds=KINDS):
    """A random function of ``nargs`` N x N tensors; ``fn.writes``: the arguments it writes."""
    body, computed, views_of = [], [], {}  # views_of: env index -> the argument it views
    nvals = nargs
    writes = set()
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(kinds)
        i, j = rng.randrange(nvals), rng.randrange(nvals)
        if kind == "write":
            a = rng.randrange(nargs)
            srcs = computed or [None]
            body.append(("write", rng.choice(sorted(WRITES)), a, rng.choice(srcs)))
            writes.add(a)
            continue
        if kind == "un":
            body.append(("un", rng.choice(sorted(UNARY)), i))
        elif kind == "bin":
            body.append(("bin", rng.choice(sorted(BINARY)), i, j))
        elif kind == "red":
            body.append(("red", rng.choice(sorted(REDUCE)), i))
        else:
            body.append(("view", rng.choice(sorted(VIEWS)), i))
            if i < nargs or i in views_of:
                views_of[nvals] = views_of.get(i, i)
        if kind != "view" or nvals not in views_of:
            computed.append(nvals)
        nvals += 1
    if not computed:
        body.append(("un", "affine", 0))
        computed.append(nvals)
        nvals += 1
    outs = [("value", computed[-1])]
    for _ in range(rng.randint(0, 2)):
        k = rng.choice(out_kinds)
        outs.append((k, rng.randrange(nargs) if k.startswith("arg") else rng.choice(computed)))

    def fn(*args):
        env = list(args)
        for op in body:
            if op[0] == "write":
                _, w, a, src = op
                WRITES[w](args[a], env[src] if src is not None else args[a] * 0.0)
            elif op[0] == "un":
                env.append(UNARY[op[1]](env[op[2]]))
            elif op[0] == "bin":
                env.append(BINARY[op[1]](env[op[2]], env[op[3]]))
            elif op[0] == "red":
                env.append(REDUCE[op[1]](env[op[2]]))
            else:
                env.append(VIEWS[op[1]](env[op[2]]))
        res = []
        for k, i in outs:
            if k == "value":
                res.append(env[i])
            elif k == "arg":
                res.append(args[i])
            elif k == "arg_t":
                res.append(args[i].t())
            elif k == "arg_rows":
                res.append(args[i][1:3])
            elif k == "arg_bits":
                res.append(args[i].view(torch.int32))
            elif k == "arg_rows_bits":
                res.append(args[i][1:3].view(torch.int16))
            elif k == "value_bits":
                res.append(env[i].view(torch.int32))
            elif k == "value_rows":
                res.append(env[i][1:])
            elif k == "value_sum":
                res.append(env[i].sum(dim=0))
            else:
                res.append(res[-1])
        return res[0] if len(res) == 1 else tuple(res)

    fn.__name__ = fn.__qualname__ = name
    fn.writes, fn.nargs, fn.desc = frozenset(writes), nargs, (body, outs)
    return fn


def make_script(rng, fns):
    """One step's calls: ``(function index, argument sources, outputs to drop after the call)``."""
    script = []
    for c in range(rng.randint(2, 5)):
        fi = rng.randrange(len(fns))
        srcs = []
        for p in range(fns[fi].nargs):
            r = rng.random()
            if r < 0.35 or (c == 0 and r < 0.6):
                srcs.append(("fresh",))
            elif r < 0.65:
                srcs.append(("out", rng.randrange(8)))
            elif r < 0.78:
                srcs.append(("held",))
            elif r < 0.9:
                srcs.append(("param",))
            else:
                srcs.append(("twice", rng.randrange(p)) if p else ("fresh",))
        script.append((fi, srcs, rng.random() < 0.25))
    return script


class Twin:
    """A tensor handed to or by the graphed side, and its eager twin."""

    __slots__ = ("real", "ref", "origin", "what", "gen")

    def __init__(self, real, ref, origin, what, gen=None):
        self.real, self.ref, self.origin, self.what, self.gen = real, ref, origin, what, gen


def _sp(t):
    return t.untyped_storage().data_ptr()


def run_seed(mgr, seed, out_kinds=OUTS):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    fns = [make_fn(rng, rng.randint(1, 3), f"f{k}", out_kinds) for k in range(rng.randint(2, 4))]
    graphed = [TorchFn(f, mgr) for f in fns]
    script = make_script(rng, fns)
    marks = rng.random() < 0.6
    param = torch.nn.Parameter(torch.randn(N, N))
    param_ref = torch.nn.Parameter(param.detach().clone())
    P = Twin(param, param_ref, "param", "param")
    fresh_keep = []  # the fresh inputs stay alive, so their storage addresses stay theirs
    held: list[Twin] = []  # tensors from earlier steps still held
    backend = mgr.backend

    def ended(t):
        """Whether ``t`` is in the memory of a generation that ended: poisoned, or a view of a tree
        output that a graphed function returned as an input alias (not poisoned, as "a view you
        took of an output is not poisoned"; still "valid until the next generation begins")."""
        return any(t.real is p for p in backend.poisoned) or (t.origin == "owned" and t.gen != mgr.generation)

    def origin_of(t):
        if _sp(t) == _sp(param):
            return "param"
        if any(_sp(t) == _sp(f) for f in fresh_keep):
            return "fresh"
        return "owned" if any(g.made(t) for g in backend.graphs) else "eager"

    def usable(t):
        return t.real.shape == (N, N) and t.real.dtype == torch.float32

    def fresh(tag):
        x = torch.randn(N, N)
        fresh_keep.append(x)
        return Twin(x, x.clone(), "fresh", tag)

    for step in range(STEPS):
        calls = script
        if step >= 3 and rng.random() < 0.3:  # now and then a step of another shape
            calls = make_script(rng, fns)
        if marks or rng.random() < 0.2:
            mgr.mark_step_begin()
        step_outs: list[Twin] = []
        for c, (fi, srcs, drop) in enumerate(calls):
            fn = fns[fi]
            args: list[Twin] = []
            for p, src in enumerate(srcs):
                live = [t for t in step_outs if not ended(t) and usable(t)]
                old = [t for t in held if not ended(t) and usable(t)]
                if src[0] == "out" and live:
                    a = live[src[1] % len(live)]
                elif src[0] == "held" and old:
                    a = rng.choice(old)
                elif src[0] == "param":
                    a = P
                elif src[0] == "twice":
                    a = args[src[1]]
                else:
                    a = fresh(f"s{step}c{c}a{p}")
                # The guide, "Mutation": "Writes to a static input or a tree output are not looked
                # for, so an eager argument that views one of those (`f(w, w[0])` with `w` a
                # parameter the function updates in place) reads it as it was when the call began."
                # So a function that writes gets no second argument sharing memory with a parameter
                # or a tree output (the same tensor twice is fine; eager inputs sharing memory are
                # fine: they run eagerly, as the guide says).
                if fn.writes and any(b is not a and _sp(b.real) == _sp(a.real)
                                       and (a.origin, b.origin) != ("fresh", "fresh") for b in args):
                    a = fresh(f"s{step}c{c}a{p}")
                args.append(a)
            where = f"seed {seed} step {step} call {c} ({fn.__name__} {fn.desc}, args {[a.what for a in args]})"
            got = graphed[fi](*[a.real for a in args])
            want = fn(*[a.ref for a in args])
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            # An argument in the memory of the generation this call ended (the inference rule)
            # is poisoned after the call ("Outputs in the tree's memory are valid until the next
            # generation begins"): so are the input aliases of it the call returns (itself, or a
            # view rebuilt on it, which is not poisoned, as "a view you took of an output").
            dead = {_sp(a.real) for a in args if ended(a)}
            handed = {id(r()) for _, r in mgr.outs.handed}
            valid = [not any(g is p for p in backend.poisoned) and (_sp(g) not in dead or id(g) in handed)
                     for g in got]
            for k, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g.shape == w.shape and g.stride() == w.stride(), where
                if valid[k]:
                    same(g, w, f"{where}: output {k}")
            for k, a in enumerate(args):
                if not ended(a):
                    same(a.real, a.ref, f"{where}: argument {k} ({a.what}) after the call")
            for t in held + step_outs:  # nothing else held changed otherwise than eagerly
                if not ended(t):
                    same(t.real, t.ref, f"{where}: held tensor {t.what}")
            if not drop:
                for k, (g, w) in enumerate(zip(got, want)):
                    if valid[k]:  # held and compared; arguments only of N x N float32 (usable)
                        step_outs.append(Twin(g, w, origin_of(g), f"s{step}c{c}o{k}", mgr.generation))
            del got, want
        held = [t for t in held + step_outs if not ended(t)]
        if len(held) > 6:  # drop some of what earlier steps made
            held = rng.sample(held, 4)
        with torch.no_grad():
            param.mul_(0.9).add_(0.05)
            param_ref.mul_(0.9).add_(0.05)
    same(param, param_ref, f"seed {seed}: the parameter")
    return mgr


SEEDS = list(range(40))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_programs_of_graphed_functions_match_eager_bitwise(monkeypatch, seed):
    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        run_seed(mgr, seed)


@pytest.mark.parametrize("seed", range(100, 124))
def test_random_programs_returning_views_of_other_dtypes_match_eager_bitwise(monkeypatch, seed):
    """Outputs viewing an input (or a value) as another dtype (``x.view(torch.int32)``): eager's
    view of the caller's input, written through by the functions that write it."""
    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        run_seed(mgr, seed, BITS)


def test_the_fuzz_replays_most_calls_and_runs_few_eagerly(monkeypatch):
    replays = eager = calls = 0
    for seed in SEEDS[:10]:
        with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
            run_seed(mgr, seed)
            for st in mgr.stats.values():
                replays += st.replays
                eager += st.eager_calls
                calls += st.warmups + st.recordings + st.replays + st.eager_calls
    assert replays > calls // 3, (replays, eager, calls)


def test_a_root_function_writing_its_argument_fed_its_previous_output_matches_eager(monkeypatch):
    """``h = f(h)`` with ``f`` writing ``h`` in place: ``h`` is an output of the ending generation,
    in the memory where the replay writes its own output, so such a call runs eagerly."""
    def f(h):
        out = h * 2.0
        h.add_(1.0)
        return out

    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        g = TorchFn(f, mgr)
        h, ref = torch.ones(4), torch.ones(4)
        for _ in range(4):  # warm-up, recording, then replays: h is the previous generation's output
            h, ref = g(h), f(ref)
        same(h, ref, "h = f(h)")  # eager 16.0; cgraw: 6.0 (its input plus one, copied back over it)


def test_a_root_function_writing_a_state_and_fed_its_previous_output_replays(monkeypatch):
    """``h = f(h, cache)`` with ``f`` writing ``cache`` in place, not ``h`` (a decoder writing its
    key-value cache, fed its previous token): the copy back of ``cache`` lands on ``cache``, not where
    the replay writes its new output, so every call after the recording replays and matches eager."""
    def f(h, cache):
        cache.add_(h)
        return cache * 0.5 + h

    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        g = TorchFn(f, mgr)
        h, cache = torch.ones(4), torch.zeros(4)
        ref_h, ref_cache = h.clone(), cache.clone()
        for _ in range(6):
            h, ref_h = g(h, cache), f(ref_h, ref_cache)
            same(h, ref_h, "h")
            same(cache, ref_cache, "cache")
        st = mgr.stats[g.fn_id]
        assert (st.warmups, st.recordings, st.replays, st.eager_calls) == (1, 1, 4, 0), st


# ---------------------------------------------------------------------- autograd


def run_grad_seed(mgr, seed):
    """Random functions without writes, called with inputs that require grad (fresh leaves, a
    parameter, outputs of earlier calls), then one backward per step: every output and every
    gradient equal eager's, step after step (warm-ups, recordings and replays)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    fns = [make_fn(rng, rng.randint(1, 3), f"g{k}", OUTS, KINDS[:-1]) for k in range(rng.randint(2, 3))]
    graphed = [TorchFn(f, mgr) for f in fns]
    script = [(fi, [rng.randrange(64) for _ in range(fns[fi].nargs)]) for fi in
              (rng.randrange(len(fns)) for _ in range(rng.randint(2, 4)))]
    w = torch.nn.Parameter(torch.randn(N, N))
    w_ref = torch.nn.Parameter(w.detach().clone())
    for step in range(5):
        mgr.mark_step_begin()
        fresh = [torch.randn(N, N, requires_grad=True) for _ in range(2)]
        fresh_ref = [x.detach().clone().requires_grad_() for x in fresh]
        pool = list(zip(fresh, fresh_ref)) + [(w, w_ref)]
        held = []
        for c, (fi, picks) in enumerate(script):
            args = [pool[p % len(pool)] for p in picks]
            where = f"seed {seed} step {step} call {c} ({fns[fi].__name__} {fns[fi].desc})"
            got = graphed[fi](*[a for a, _ in args])
            want = fns[fi](*[r for _, r in args])
            got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
            for k, (g, r) in enumerate(zip(got, want, strict=True)):
                same(g.detach(), r.detach(), f"{where}: output {k}")
                assert g.requires_grad == r.requires_grad, where
                if g.requires_grad:
                    held.append((g, r))
                    if g.shape == (N, N):
                        pool.append((g, r))
        if not held:
            continue
        sum((g * (k + 1)).sum() for k, (g, _) in enumerate(held)).backward()
        sum((r * (k + 1)).sum() for k, (_, r) in enumerate(held)).backward()
        for k, (x, r) in enumerate(list(zip(fresh, fresh_ref)) + [(w, w_ref)]):
            assert (x.grad is None) == (r.grad is None), f"seed {seed} step {step}: leaf {k} grad"
            if x.grad is not None:
                torch.testing.assert_close(x.grad, r.grad, msg=lambda m: f"seed {seed} step {step}: leaf {k}: {m}")
    return mgr


@pytest.mark.parametrize("seed", range(200, 230))
def test_random_programs_differentiated_every_step_match_eager(monkeypatch, seed):
    from torch_cpu_backend import CpuTorchBackend

    from cgraw.trees import config as tree_config

    with cpu_tree(monkeypatch, CpuTorchBackend) as mgr, torch.enable_grad():
        tree_config.grad_probe(torch.is_grad_enabled)
        try:
            run_grad_seed(mgr, seed)
        finally:
            tree_config.grad_probe(None)
