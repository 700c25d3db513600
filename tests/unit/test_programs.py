"""CPU tier of the differential random walk: tests/helpers/programs.py.

The generator must be deterministic and its programs valid; the interpreter must be
deterministic on a numpy namespace; and a program walked through the real
``cgraw.trees.manager.TreeManager``, on the fake backend of tests/helpers/fake_tree_backend.py, must match
the same walk run eagerly, bit for bit. The GPU tier (tests/gpu/test_random_walk.py) runs the
same walks with real torch and CuPy.

The fake backend stores every tensor as a flat float64 range and poisons every handed-out output
at a generation's end, CuPy's too; its namespace says so (``cupy_outputs_poisoned``), and the
walk then never passes a CuPy output across an explicit mark. Its "frameworks" are one tensor
type, so ``from_dlpack`` is the identity there: mixed functions exercise the tree logic, not the
DLPack exchange.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import programs
import pytest
from fake_tree_backend import EAGER_BASE, FakeFn, FakeT, FakeTreeBackend, assign, new

from allocator import check_invariants
from cgraw.trees.manager import NodeState, TreeManager
from cgraw.trees.config import config

SEEDS = range(40)
GPU_SEEDS = range(4)  # the seeds tests/gpu/test_random_walk.py walks


@pytest.fixture(autouse=True)
def _default_config():
    saved = dataclasses.asdict(config)
    for k, v in dataclasses.asdict(type(config)()).items():
        setattr(config, k, v)
    yield
    for k, v in saved.items():
        setattr(config, k, v)


# ---------------------------------------------------------------------- the generator


def test_generator_is_deterministic_per_seed():
    for seed in SEEDS:
        assert programs.generate(seed) == programs.generate(seed)
    assert len({programs.generate(s) for s in SEEDS}) == len(SEEDS)


@pytest.mark.parametrize("seed", SEEDS)
def test_programs_are_valid(seed):
    prog = programs.generate(seed)
    assert programs.problems(prog) == [], prog.describe()
    assert 3 <= len(prog.functions) <= 6
    assert prog.shape in programs.SHAPES
    chain = {f.name: f for f in prog.functions if not f.is_root}
    for f in prog.functions:
        assert 2 <= len(f.ops) <= 5 and f.ops[-1].name in programs.SQUASH_OPS
        assert f.in_shape == f.out_shape == prog.shape
        for s in f.succ:  # shapes and frameworks chain
            assert s in chain and chain[s].in_fw == f.out_fw and chain[s].in_shape == f.out_shape
        fws = f.frameworks_along()
        if f.tag == "mixed":
            assert f.switches and len(set(fws)) == 2 and fws[-1] == f.out_fw  # converts mid-body
        else:
            assert not f.switches and set(fws) == {f.tag} == {f.in_fw} == {f.out_fw}
        assert not (f.mutates and f.is_root)
    assert any(f.succ[0] != f.succ[1] for f in prog.functions), "a data-dependent branch"
    assert any(f.in_fw != f.out_fw for f in prog.functions), "outputs cross between frameworks"
    assert {f.in_fw for f in prog.functions} | {f.out_fw for f in prog.functions} == {"torch", "cupy"}


def test_programs_mix_frameworks_and_features_across_seeds():
    progs = [programs.generate(s) for s in SEEDS]
    fns = [f for p in progs for f in p.functions]
    assert {f.tag for f in fns} == set(programs.TAGS)
    assert any(len({f.tag for f in p.functions}) >= 2 for p in progs)
    assert {(f.in_fw, f.out_fw) for f in fns if f.tag == "mixed"} == {
        ("torch", "cupy"), ("cupy", "torch"), ("torch", "torch"), ("cupy", "cupy")}
    assert {p.shape for p in progs} == set(programs.SHAPES)
    assert {len(p.functions) for p in progs} == {3, 4, 5, 6}
    assert {len(p.roots) for p in progs} == {1, 2}
    assert {o.name for f in fns for o in f.ops} == set(programs.BODY_OPS)
    assert any(f.mutates for f in fns) and any(f.mutate_arg for f in fns)
    assert {f.n_args for f in fns} == {1, 2}


def test_program_checker_rejects_broken_programs():
    prog = programs.generate(3)
    f = prog.functions[0]
    bad_succ = dataclasses.replace(f, succ=(prog.roots[0], f.succ[1]))
    bad_mut = dataclasses.replace(f, mutates=True)
    bad_shape = dataclasses.replace(f, out_shape=(5,))
    for g in (bad_succ, bad_mut, bad_shape):
        broken = dataclasses.replace(prog, functions=(g,) + prog.functions[1:])
        assert programs.problems(broken)


# ---------------------------------------------------------------------- the interpreter, eager


def test_interpreter_is_deterministic_on_numpy():
    ns = programs.numpy_namespace()
    for seed in range(8):
        prog = programs.generate(seed)
        a = programs.run(prog, ns, 400, graphed=False)
        b = programs.run(prog, ns, 400, graphed=False)
        assert a.calls >= 400 and a.calls == b.calls and a.steps == b.steps
        assert programs.compare(a, b) == []
        assert [e[:2] + e[3:] for e in a.log] == [e[:2] + e[3:] for e in b.log]
        for e in a.log:
            if e.what == "out":
                assert e.value.dtype == np.float32 and e.value.shape == prog.shape
                assert np.isfinite(e.value).all()
        assert sum(a.fn_calls.values()) == a.calls
        assert a.marks >= len(prog.roots)  # every root's first root call follows a mark


def test_compare_reports_differences():
    ns = programs.numpy_namespace()
    prog = programs.generate(5)
    a = programs.run(prog, ns, 200, graphed=False)
    b = programs.run(prog, ns, 200, graphed=False)
    assert programs.compare(a, b) == []
    k = next(i for i, e in enumerate(b.log) if e.what == "out")
    v = b.log[k].value.copy()
    v.reshape(-1)[0] = np.nextafter(v.reshape(-1)[0], np.float32(np.inf))  # one ulp
    b.log[k] = b.log[k]._replace(value=v)
    (msg,) = programs.compare(a, b)
    assert "differs from eager" in msg and "1 of" in msg
    z = a.log[k].value.copy()
    z.reshape(-1)[0] = 0.0
    nz = z.copy()
    nz.reshape(-1)[0] = -0.0  # equal to 0.0, but not bitwise
    a.log[k] = a.log[k]._replace(value=z)
    b.log[k] = b.log[k]._replace(value=nz)
    (msg,) = programs.compare(a, b)
    assert "different bits" in msg


def test_gpu_seeds_exercise_every_feature():
    """What the GPU tier's walks (seeds 0..3, 2,000 calls each) cover, summed over the seeds,
    and that each of them records its last tree node long before call 500 (the GPU tier checks
    that the pool stops growing after it). numpy computes in float32 like the GPU, so its walks
    follow the GPU's closely, though not exactly (sin, tanh and exp may differ in the last bit)."""
    ns = programs.numpy_namespace()
    total = programs.RunResult()
    tags, mutating, two_args, crossings, n_roots = set(), False, False, set(), set()
    for seed in GPU_SEEDS:
        prog = programs.generate(seed)
        crossings |= {(f.in_fw, f.out_fw) for f in prog.functions if f.tag == "mixed"}
        n_roots.add(len(prog.roots))
        r = programs.run(prog, ns, 2000, graphed=False)
        assert r.settled_at < 400, (seed, r.settled_at)
        leaves = {p for p in programs.node_probabilities(prog) if len(p) in prog.lengths}
        assert set(r.paths) == leaves, seed  # every path of the program was walked
        for name in ("marks", "kept_reads", "expected_raises", "not_read"):
            setattr(total, name, getattr(total, name) + getattr(r, name))
        total.bits.update(r.bits)
        total.recurrent.update(r.recurrent)
        tags |= {f.tag for f in prog.functions}
        mutating |= any(f.mutates for f in prog.functions)
        two_args |= any(f.n_args == 2 for f in prog.functions)
    assert tags == set(programs.TAGS) and mutating and two_args and n_roots == {1, 2}
    assert crossings >= {("torch", "cupy"), ("cupy", "torch")}
    assert total.marks and total.not_read
    # h = f(h) on a torch output (its generation ended by the root call itself), and on a CuPy
    # output after an explicit mark (CuPy outputs are not poisoned)
    assert total.recurrent["torch", "inferred"] and total.recurrent["cupy", "mark"]
    assert total.expected_raises and total.kept_reads > total.expected_raises  # same-step reads too
    assert total.bits[0] and total.bits[1]


# ---------------------------------------------------------------------- through the real TreeManager


class FakeOps:
    """A framework over the fake backend's tensors (flat float64 ranges)."""

    def __init__(self, backend: FakeTreeBackend):
        self.be = backend

    def fresh(self, host):
        return self.be.tensor(host.reshape(-1))

    def to_host(self, x):
        return x.value

    def from_dlpack(self, x):
        return x

    def mul(self, x, c):
        return new(x.value * c)

    def addc(self, x, c):
        return new(x.value + c)

    def add(self, x, y):
        return new(x.value + y.value)

    def mul_arg(self, x, y):
        return new(x.value * y.value)

    def abs(self, x):
        return new(np.abs(x.value))

    def sin(self, x):
        return new(np.sin(x.value))

    def tanh(self, x):
        return new(np.tanh(x.value))

    def exp_clamp(self, x, lo, hi):
        return new(np.exp(np.clip(x.value, lo, hi)))

    def where_gt(self, x, c, y):
        with np.errstate(invalid="ignore"):  # a capture computes on NaN placeholders
            return new(np.where(x.value > c, x.value, y.value))

    def iadd(self, x, y):
        assign(x, x.value + (y.value if isinstance(y, FakeT) else y))


def fake_namespace(backend) -> programs.Namespace:
    ops = FakeOps(backend)
    return programs.Namespace(ops, ops, overwritten_pattern="from an ended generation",
                              cupy_outputs_poisoned=True, owned_by_tree=lambda t: t.ptr < EAGER_BASE)


def walk_fake(prog, n_calls: int, *, graphed: bool):
    be = FakeTreeBackend()  # new()/assign() talk to the latest backend made
    mgr = TreeManager(be)
    res = programs.run(prog, fake_namespace(be), n_calls, graphed=graphed, mark_step_begin=mgr.mark_step_begin,
                       graphed_decorator=lambda f: FakeFn(f, mgr), probe=lambda: (be.count("record"),
                       be.source.reserved_bytes), probe_at=range(1, n_calls + 4))
    return res, be, mgr


@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_walk_through_tree_manager_matches_eager(seed):
    prog = programs.generate(seed)
    n = 700
    eager, _, _ = walk_fake(prog, n, graphed=False)
    got, be, mgr = walk_fake(prog, n, graphed=True)
    assert programs.compare(got, eager) == [], prog.describe()
    assert got.calls == eager.calls >= n
    assert got.raised == got.expected_raises
    assert got.expected_raises + got.kept_valid == eager.expected_raises
    stats = list(mgr.stats.values())
    assert sum(s.rerecords for s in stats) == 0 and sum(s.eager_calls for s in stats) == 0
    assert sum(s.replays for s in stats) > 0.8 * got.calls
    assert all(n.state is NodeState.RECORDED for n in mgr.nodes())
    roots = {mgr.roots[k].fn.name for k in mgr.roots}
    assert roots == {r for r in prog.roots if got.fn_calls[r]}, "chain functions never begin a path"
    assert max(n.depth for n in mgr.nodes()) <= max(prog.lengths) - 1
    # every path recorded, and the pool's reserve settled, well before the end
    records_500, reserved_500 = got.probes[500]
    assert got.probes[got.calls] == (records_500, reserved_500)
    check_invariants(be.pool)
    mgr.reset()
    assert be.source.reserved_bytes == 0


def test_walks_settle_early_across_seeds():
    """The tree records its last node where the walk reaches a path prefix for the second time,
    last (``settled_at``), long before call 500 (where the GPU tier starts watching the pool)."""
    for seed in range(12):
        prog = programs.generate(seed)
        res, be, mgr = walk_fake(prog, 500, graphed=True)
        records = [res.probes[i][0] for i in range(1, res.calls + 1)]
        assert records.index(records[-1]) + 1 == res.settled_at, seed
        assert res.settled_at < 400, (seed, res.settled_at)
        assert len(mgr.nodes()) == len(programs.node_probabilities(prog)), seed
        assert be.count("record") == len(mgr.nodes())
        mgr.reset()
