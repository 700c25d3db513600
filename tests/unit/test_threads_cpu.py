"""CPU tests of graphed functions called from several threads: the registry of ``cgraw.graphed``
(one tree per thread and device), generations per thread, trees of ended threads released, the
process-wide ``RecordingLock`` trees grow under, and a backward run on another thread than its
forward's.

Trees are made by the real registry (``GraphedFunction.__call__``) over the fake backend of
``tests/helpers/fake_tree_backend.py`` (``graphed._new_tree`` swapped); every thread waits with a
timeout, so a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import sys
import threading
import time

import numpy as np
import pytest
from fake_tree_backend import GRAD, FakeFn, FakeTreeBackend, Overwritten, new, save, spy_inspect

import cgraw
import cgraw.trees.graphed  # the module (cgraw.graphed, the attribute, is the function)
import cgraw.trees.manager
from cgraw.trees import calls
from cgraw.trees.autograd import BUSY
from cgraw.trees.graphed import GraphedFunction
from cgraw.trees.manager import SERIAL, NodeState, TreeManager
from cgraw.trees.nodes import RecordingLock

graphed_mod = sys.modules["cgraw.trees.graphed"]
WAIT_S = 20.0  # the longest any thread here waits for another


class Made:
    """The trees the registry made during a test: ``(thread ident, backend, tree)``."""

    def __init__(self):
        self.trees: list = []
        self._lock = threading.Lock()

    def factory(self, ordinal: int) -> TreeManager:
        be = FakeTreeBackend()
        mgr = TreeManager(be, device_index=ordinal)
        be.mgr = mgr
        with self._lock:
            self.trees.append((threading.get_ident(), be, mgr))
        return mgr

    def of(self, ident: int) -> list:
        return [(be, mgr) for t, be, mgr in self.trees if t == ident]


@pytest.fixture
def made(monkeypatch):
    monkeypatch.setattr(cgraw.trees.manager, "inspect", spy_inspect)
    m = Made()
    monkeypatch.setattr(graphed_mod, "_new_tree", m.factory)
    cgraw.reset()
    yield m
    cgraw.reset()
    mine = {id(mgr) for _, _, mgr in m.trees}
    left = [name for _, (name, mgr) in list(graphed_mod._all.items()) if id(mgr) in mine]
    assert not left, f"trees of these threads are still registered: {left}"


@pytest.fixture
def inputs():
    """An eager-only backend for inputs made on any thread (never busy, so never a thread's own)."""
    return FakeTreeBackend()


def affine(x):
    return new(x.value * 1.5 + 0.25)


def square(x):
    return new(x.value * x.value)


def run_threads(n: int, target, *args) -> list:
    """Run ``target(i, *args)`` on ``n`` threads at once; their results, or raise the first error."""
    start = threading.Barrier(n, timeout=WAIT_S)
    out, errors = [None] * n, []

    def body(i):
        try:
            start.wait()
            out[i] = target(i, *args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), name=f"worker-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (deadlock?)"
    if errors:
        raise errors[0]
    return out


# ---------------------------------------------------------------------- one tree per thread


def test_each_thread_gets_its_own_tree_and_results_equal_eager(made, inputs):
    f = cgraw.graphed(affine)

    def calls_f(i):
        rng = np.random.default_rng()
        for _ in range(12):
            v = rng.uniform(-2, 2, 32)
            out = f(inputs.tensor(v))
            np.testing.assert_array_equal(out.value, v * 1.5 + 0.25)
        return threading.get_ident()

    idents = run_threads(4, calls_f)
    assert sorted(t for t, _, _ in made.trees) == sorted(idents)  # one tree per thread, made there
    for t, be, mgr in made.trees:
        assert mgr.owner_thread == t
        st = mgr.stats[f.fn_id]
        assert (st.warmups, st.recordings, st.replays) == (1, 1, 10)
    assert all(be.closed == 1 for _, be, _ in made.trees)  # the threads ended: their trees went


def test_generations_are_per_thread(made, inputs):
    f, g = cgraw.graphed(affine), cgraw.graphed(square)
    x = inputs.tensor(np.arange(1.0, 9.0))
    for _ in range(3):
        out_main = f(x)
    worker_has_output, main_marked = threading.Event(), threading.Event()
    seen = {}

    def worker():
        for _ in range(3):
            out = g(x)
        worker_has_output.set()
        assert main_marked.wait(WAIT_S)
        seen["worker output after main's step"] = out.value.copy()
        cgraw.mark_step_begin()  # ends the worker's generation only
        with pytest.raises(Overwritten):
            _ = out.value

    t = threading.Thread(target=worker)
    t.start()
    assert worker_has_output.wait(WAIT_S)
    np.testing.assert_array_equal(out_main.value, x.value * 1.5 + 0.25)
    (main_tree,) = [mgr for _, mgr in made.of(threading.get_ident())]
    generation = main_tree.generation
    cgraw.mark_step_begin()  # ends main's generation, not the worker's
    with pytest.raises(Overwritten):
        _ = out_main.value
    main_marked.set()
    t.join(WAIT_S)
    assert not t.is_alive()
    np.testing.assert_array_equal(seen["worker output after main's step"], x.value * x.value)
    assert main_tree.generation == generation + 1  # the worker's step did not end one here


def test_reset_frees_only_the_calling_threads_trees(made, inputs):
    f = cgraw.graphed(affine)
    x = inputs.tensor(np.ones(8))
    ready, main_reset, done = threading.Event(), threading.Event(), {}

    def worker():
        for _ in range(3):
            f(x)
        ready.set()
        assert main_reset.wait(WAIT_S)
        out = f(x)  # still replays: main's reset left this thread's tree alone
        done["value"] = out.value.copy()
        done["replays"] = graphed_mod._managers[0].stats[f.fn_id].replays

    t = threading.Thread(target=worker)
    t.start()
    assert ready.wait(WAIT_S)
    for _ in range(3):
        f(x)
    (main_be, _), = made.of(threading.get_ident())
    (worker_be, _), = made.of(t.ident)
    cgraw.reset()
    assert main_be.closed == 1 and worker_be.closed == 0
    assert len(graphed_mod._managers) == 0
    main_reset.set()
    t.join(WAIT_S)
    assert done["replays"] == 2
    np.testing.assert_array_equal(done["value"], np.full(8, 1.75))


def test_report_lists_every_threads_tree(made, inputs, monkeypatch):
    from allocator import Pool

    monkeypatch.setattr(Pool, "torch_reserved_bytes", 0, raising=False)  # what report() reads of a DevicePool
    f = cgraw.graphed(affine)
    x = inputs.tensor(np.ones(4))
    ready, finish = threading.Event(), threading.Event()

    def worker():
        for _ in range(3):
            f(x)
        ready.set()
        assert finish.wait(WAIT_S)

    t = threading.Thread(target=worker, name="server-worker")
    t.start()
    assert ready.wait(WAIT_S)
    f(x)
    try:
        text = cgraw.report(file=io.StringIO())
    finally:
        finish.set()
        t.join(WAIT_S)
    heads = [ln for ln in text.splitlines() if ln.startswith("device 0, thread ")]
    assert len(heads) == 2, text
    assert any("thread server-worker:" in h for h in heads) and any(threading.current_thread().name in h for h in heads)
    assert "1 recording(s)" in text and "0 recording(s)" in text


# ---------------------------------------------------------------------- threads that end


def test_trees_of_ended_threads_are_released_and_their_outputs_stay_valid(made, inputs):
    f = cgraw.graphed(affine)
    handed = {}

    def worker():
        x = inputs.tensor(np.arange(4.0))
        for _ in range(3):
            out = f(x)
        handed["out"] = out  # a replay's output, in the tree's pool, passed to another thread

    t = threading.Thread(target=worker)
    t.start()
    t.join(WAIT_S)
    (be, mgr), = made.of(t.ident)
    assert be.closed == 1 and mgr.nodes() == []  # released as the thread ended
    assert all(r.discarded for r in be.recordings)
    assert not [k for k in graphed_mod._all if graphed_mod._all[k][1] is mgr]
    np.testing.assert_array_equal(handed["out"].value, np.arange(4.0) * 1.5 + 0.25)  # not poisoned


def test_a_thread_pool_leaves_no_tree_once_shut_down(made, inputs):
    f = cgraw.graphed(affine)

    def call(i):
        v = np.random.default_rng().uniform(-1, 1, 16)
        return np.array_equal(f(inputs.tensor(v)).value, v * 1.5 + 0.25)

    with cf.ThreadPoolExecutor(max_workers=8) as ex:
        assert all(ex.map(call, range(400)))
    assert 1 <= len(made.trees) <= 8
    assert all(be.closed == 1 for _, be, _ in made.trees)


def test_a_new_thread_gets_a_new_tree_even_with_a_reused_ident(made, inputs):
    f = cgraw.graphed(affine)
    x = inputs.tensor(np.ones(4))
    for _ in range(6):
        t = threading.Thread(target=lambda: [f(x) for _ in range(3)])
        t.start()
        t.join(WAIT_S)
    assert len(made.trees) == 6  # idents are often reused; trees never are
    assert all(mgr.stats[f.fn_id].warmups == 1 for _, _, mgr in made.trees)


# ---------------------------------------------------------------------- trees grow one at a time


def test_trees_grow_one_at_a_time_and_replays_run_meanwhile(made, inputs):
    in_warmup, let_go = threading.Event(), threading.Event()
    log = []

    def slow(x):
        log.append(("slow warm-up begins", time.monotonic()))
        in_warmup.set()
        assert let_go.wait(WAIT_S)
        log.append(("slow warm-up ends", time.monotonic()))
        return new(x.value + 1.0)

    slow_f, f, g = cgraw.graphed(slow), cgraw.graphed(affine), cgraw.graphed(square)
    x = inputs.tensor(np.ones(4))
    for _ in range(3):
        f(x)  # main's f is recorded
    t = threading.Thread(target=lambda: slow_f(x))
    t.start()
    assert in_warmup.wait(WAIT_S)  # the worker holds the lock, inside a warm-up
    assert SERIAL.holder == t.ident
    for _ in range(20):  # replays need no lock
        np.testing.assert_array_equal(f(x).value, np.full(4, 1.75))
    grown = threading.Event()

    def grow():
        g(x)  # a new node: waits for the worker's warm-up
        log.append(("g warmed up", time.monotonic()))
        grown.set()

    grower = threading.Thread(target=grow)  # its own tree, made at once; its first call waits
    grower.start()
    assert not grown.wait(0.2)
    let_go.set()
    t.join(WAIT_S)
    assert grown.wait(WAIT_S)
    grower.join(WAIT_S)
    assert [e for e, _ in log] == ["slow warm-up begins", "slow warm-up ends", "g warmed up"]
    assert SERIAL.holder is None


def test_the_recording_lock_is_reentrant_and_takes_a_guest():
    lock = RecordingLock()
    host_in, guest_done, release_host = threading.Event(), threading.Event(), threading.Event()
    results = {}

    def host():
        with lock, lock:
            host_in.set()
            assert release_host.wait(WAIT_S)

    def guest():
        results["guest"] = lock.acquire(host=h.ident, blocking=False)
        results["nested"] = lock.acquire()  # a guest's nested acquisition never waits
        lock.release()
        lock.release()
        guest_done.set()

    def stranger():
        results["stranger"] = lock.acquire(blocking=False)

    h = threading.Thread(target=host)
    h.start()
    assert host_in.wait(WAIT_S)
    for target in (guest, stranger):
        th = threading.Thread(target=target)
        th.start()
        th.join(WAIT_S)
    assert results == {"guest": True, "nested": True, "stranger": False}
    release_host.set()
    h.join(WAIT_S)
    assert lock.holder is None and lock.acquire(blocking=False)
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()


# ---------------------------------------------------------------------- backward on another thread


class Routed(FakeFn):
    """A fake graphed function whose calls go through the real registry, as GraphedFunction's do."""

    __call__ = GraphedFunction.__call__


def cube(x):
    s = new(x.value * x.value)  # saved for the backward, like an activation
    save(s)
    return new(s.value * x.value)


def cube_fn():
    """x**3; its gradient 3 x**2 g from the input (eager) or from the saved x**2 (captured)."""
    return Routed(cube, backward=lambda g, x: new(g.value * 3.0 * (x.value * x.value)),
                  backward_saved=lambda g, s: new(g.value * 3.0 * s.value))


@pytest.fixture
def grad_mode():
    calls.use_grad_mode(GRAD.probe)
    yield
    calls.use_grad_mode(None)


def test_a_backward_never_waits_for_another_threads_recording(made, inputs, grad_mode):
    f = cube_fn()
    x = inputs.tensor(np.linspace(0.5, 2.0, 8), requires_grad=True)
    out = [f(x) for _ in range(2)][-1]  # warmed up, recorded
    (be, mgr), = made.of(threading.get_ident())
    holding, release = threading.Event(), threading.Event()

    def other_thread_records():
        with SERIAL:
            holding.set()
            assert release.wait(WAIT_S)

    h = threading.Thread(target=other_thread_records)
    h.start()
    assert holding.wait(WAIT_S)
    grads = {}
    autograd = threading.Thread(target=lambda: grads.setdefault("g", be.backward(out, np.ones(8))))
    autograd.start()
    autograd.join(WAIT_S)
    assert not autograd.is_alive(), "the backward waited for the other thread's lock"
    release.set()
    h.join(WAIT_S)
    np.testing.assert_array_equal(grads["g"].value, 1.0 * 3.0 * (x.value * x.value))
    assert be.count("warmup", "cube.backward") == 0  # ran eagerly, outside the tree
    bst = [s for s in mgr.stats.values() if s.name == "cube.backward"]
    assert bst and BUSY in bst[0].skip_reasons
    for _ in range(3):  # the lock is free again: the backward goes through the tree
        out = f(x)
        g = be.backward(out, np.ones(8))
        np.testing.assert_array_equal(g.value, 1.0 * 3.0 * (x.value * x.value))
    backward_nodes = [n for n in mgr.nodes() if n.fn.name == "cube.backward"]
    assert backward_nodes and backward_nodes[0].state is NodeState.RECORDED


def test_a_backward_enters_while_its_forwards_thread_holds_the_lock(made, inputs, grad_mode):
    """The owning thread's warm-up runs a backward pass (autograd's thread does it meanwhile)."""
    f = cube_fn()
    x = inputs.tensor(np.linspace(0.5, 2.0, 8), requires_grad=True)
    out = [f(x) for _ in range(2)][-1]
    (be, mgr), = made.of(threading.get_ident())
    grads = {}

    def step(y):  # graphed: its warm-up holds the lock while "autograd's thread" runs f's backward
        t = threading.Thread(target=lambda: grads.setdefault("g", be.backward(out, np.ones(8))))
        t.start()
        t.join(WAIT_S)
        assert not t.is_alive()
        return new(y.value)

    with GRAD.off():
        cgraw.graphed(step)(inputs.tensor(np.ones(2)))
    np.testing.assert_array_equal(grads["g"].value, 1.0 * 3.0 * (x.value * x.value))
    bst = [s for s in mgr.stats.values() if s.name == "cube.backward"]
    assert bst and bst[0].warmups == 1 and BUSY not in bst[0].skip_reasons


# ---------------------------------------------------------------------- torch's autograd (CPU torch)


@pytest.fixture
def torch_trees(monkeypatch):
    """The registry over ``torch_cpu_backend.CpuTorchBackend`` trees, with CPU tensors as device 0,
    autograd through graphed functions on: the real ``_Graphed`` Function routes each backward."""
    torch = pytest.importorskip("torch")
    from torch_cpu_backend import CpuTorchBackend, cpu_as_device0


    from cgraw.trees import config as tree_config

    made = []

    def factory(ordinal):
        be = CpuTorchBackend()
        mgr = TreeManager(be, device_index=ordinal)
        be.mgr = mgr
        made.append((threading.get_ident(), be, mgr))
        return mgr

    monkeypatch.setattr(graphed_mod, "_new_tree", factory)
    with cpu_as_device0(monkeypatch):
        tree_config.grad_probe(torch.is_grad_enabled)
        cgraw.config.autograd = True
        cgraw.reset()
        try:
            yield torch, made
        finally:
            cgraw.reset()
            tree_config.grad_probe(None)


def _mlp(torch, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _graphed_mlp(torch, seed):
    import copy

    model = _mlp(torch, seed)
    f = cgraw.graphed(lambda x: model(x))
    f.params = list(model.parameters())  # what the CPU backend's warm-up "observes" in the closure
    return f, model, copy.deepcopy(model)


def _same_grads(model, ref) -> bool:
    return all(p.grad is not None and p.grad.equal(q.grad) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.torch
def test_a_backward_run_on_another_thread_goes_to_its_forwards_tree(torch_trees):
    torch, made = torch_trees
    to_main, done, finish = [], [threading.Event(), threading.Event()], threading.Event()
    lock = threading.Lock()
    results = {}

    def worker(i):
        f, model, ref = _graphed_mlp(torch, seed=i)
        gen = torch.Generator().manual_seed(100 + i)
        ok = []
        for _ in range(5):
            x = torch.randn(5, 8, generator=gen)
            out = f(x)
            with lock:
                to_main.append((i, out))
            assert done[i].wait(WAIT_S)  # main ran the backward of this call
            done[i].clear()
            (ref(x) ** 2).sum().backward()
            ok.append(_same_grads(model, ref))
            model.zero_grad()
            ref.zero_grad()
        results[i] = ok
        assert finish.wait(WAIT_S)  # the tree stays alive until main has looked at it

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(10):
            deadline = time.monotonic() + WAIT_S
            while not to_main and time.monotonic() < deadline:
                time.sleep(0.001)
            with lock:
                i, out = to_main.pop(0)
            (out * out).sum().backward()  # autograd runs it here, on main's thread
            done[i].set()
        assert len(graphed_mod._managers) == 0  # main made no tree of its own
        trees = {t: be for t, be, _ in made}
        for t in threads:
            be = trees[t.ident]
            backward = [e for e in be.log if len(e) > 1 and e[1].endswith(".backward")]
            assert ("record", backward[0][1]) in backward and len([e for e in backward if e[0] == "replay"]) >= 2
    finally:
        finish.set()
        for t in threads:
            t.join(WAIT_S)
    assert results == {0: [True] * 5, 1: [True] * 5}


@pytest.mark.torch
def test_a_backward_after_its_forwards_thread_ended_recomputes(torch_trees):
    torch, made = torch_trees
    handed = {}

    def worker():
        f, model, ref = _graphed_mlp(torch, seed=3)
        x = torch.randn(4, 8)
        for _ in range(3):
            out = f(x)  # the last one is a replay
        handed.update(out=out, x=x, model=model, ref=ref)

    t = threading.Thread(target=worker)
    t.start()
    t.join(WAIT_S)
    (_, _, mgr), = made
    assert mgr.nodes() == []  # released as the thread ended
    (handed["out"] ** 2).sum().backward()
    (handed["ref"](handed["x"]) ** 2).sum().backward()
    assert _same_grads(handed["model"], handed["ref"])
    assert any("backward ran recompute" in r for s in mgr.stats.values() for r in s.skip_reasons)


def test_graphed_calls_inside_a_capture_of_their_thread_run_inline(made, inputs):
    """While a capture runs on a thread (``runtime.capture.NESTING``'s hooks), that thread's
    graphed calls run their functions inline, trees made meanwhile included; other threads' calls
    and the thread's calls after the capture are tree calls."""
    from cgraw.runtime import capture as capture_mod

    f = cgraw.graphed(affine)
    v = np.linspace(-1, 1, 8)
    f(inputs.tensor(v))  # this thread's tree exists before the capture
    begin, end = zip(*capture_mod.NESTING)
    for hook in begin:
        hook()
    try:
        np.testing.assert_array_equal(f(inputs.tensor(v)).value, v * 1.5 + 0.25)
        other = run_threads(1, lambda i: (f(inputs.tensor(v)), threading.get_ident())[1])[0]
    finally:
        for hook in end:
            hook()
    for _ in range(3):
        f(inputs.tensor(v))
    mine = [mgr for t, _, mgr in made.trees if t == threading.get_ident()]
    theirs = [mgr for t, _, mgr in made.trees if t == other]
    assert len(mine) == 1 and mine[0].busy == 0
    st = mine[0].stats[f.fn_id]
    assert st.warmups + st.recordings + st.replays == 4  # the call inside the capture is none of them
    assert theirs[0].stats[f.fn_id].warmups == 1  # another thread is not inside the capture
