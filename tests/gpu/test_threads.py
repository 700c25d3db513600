"""GPU tier for graphed functions called from several threads: one graph tree per thread and
device, trees growing one at a time, replays side by side, trees of ended threads released.

Every call is compared with eager on the same fresh random inputs, on the calling thread's own
stream. Each test waits for its threads with a deadline: a deadlock fails the test (with every
thread's stack) instead of hanging the tier.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import faulthandler
import sys
import threading
import time

import pytest
from gpu_data import full_fp32

import cgraw
from cgraw._cuda import defer

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees", "fp32")]
torch = pytest.importorskip("torch")

DEADLINE_S = 240.0
TOL = dict(rtol=1e-5, atol=1e-5)
TRAIN_TOL = dict(rtol=2e-4, atol=2e-5)  # as tests/gpu/test_autograd.py where kernels may differ


@pytest.fixture
def fp32():
    with full_fp32():
        yield


def _registry():
    return sys.modules["cgraw.trees.graphed"]


def _my_stats(f):
    """The calling thread's statistics of ``f`` (its own tree on device 0)."""
    return _registry()._managers[0].stats[f.fn_id]


def _mlp(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 16)).cuda()


def _wait_all(futures, what: str) -> list:
    """The futures' results, or fail (with every thread's stack) when one is late or raised."""
    _, late = cf.wait(futures, timeout=DEADLINE_S)
    if late:
        faulthandler.dump_traceback(all_threads=True)
        pytest.fail(f"{what}: {len(late)} thread(s) still running after {DEADLINE_S:.0f} s (deadlock?)")
    return [f.result() for f in futures]


def _worker_trees_left(names) -> list:
    return [name for (_, _), (name, _) in list(_registry()._all.items()) if name in names]


# ---------------------------------------------------------------------- many threads, one model


@pytest.mark.parametrize("threads", [2, 8])
def test_a_graphed_mlp_from_many_threads_equals_eager(threads):
    model = _mlp().eval()
    f = cgraw.graphed(model)
    calls = 60
    start = threading.Barrier(threads, timeout=DEADLINE_S)
    names = set()

    def serve(i):
        names.add(threading.current_thread().name)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.no_grad():
            start.wait()  # every thread's first calls (warm-up, recording) at once
            for _ in range(calls):
                x = torch.randn(8 + i, 64, device="cuda")
                torch.testing.assert_close(f(x), model(x), **TOL)
        st = _my_stats(f)
        return st.warmups, st.recordings, st.replays, st.eager_calls, dict(st.skip_reasons)

    with cf.ThreadPoolExecutor(max_workers=threads) as ex:
        results = _wait_all([ex.submit(serve, i) for i in range(threads)], "serving threads")
    for stats in results:
        assert stats == (1, 1, calls - 2, 0, {}), stats
    assert not _worker_trees_left(names)  # each thread's tree went when the pool shut down
    assert defer.pending() == 0


def test_a_thread_records_while_another_replays():
    model_a, model_b = _mlp(1).eval(), _mlp(2).eval()
    fa, fb = cgraw.graphed(model_a), cgraw.graphed(model_b)
    a_recorded, b_done = threading.Event(), threading.Event()

    def replays():
        stream = torch.cuda.Stream()
        n, deadline = 0, time.monotonic() + DEADLINE_S / 2
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(3):
                x = torch.randn(16, 64, device="cuda")
                torch.testing.assert_close(fa(x), model_a(x), **TOL)
            a_recorded.set()
            while (not b_done.is_set() or n < 20) and time.monotonic() < deadline:  # while the other records
                x = torch.randn(16, 64, device="cuda")
                torch.testing.assert_close(fa(x), model_a(x), **TOL)
                n += 1
        st = _my_stats(fa)
        return n, (st.recordings, st.eager_calls)

    def records():
        stream = torch.cuda.Stream()
        try:
            assert a_recorded.wait(DEADLINE_S / 2)
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(6):
                    x = torch.randn(4, 64, device="cuda")
                    torch.testing.assert_close(fb(x), model_b(x), **TOL)
        finally:
            b_done.set()
        st = _my_stats(fb)
        return st.warmups, st.recordings, st.replays, st.eager_calls, dict(st.skip_reasons)

    with cf.ThreadPoolExecutor(max_workers=2) as ex:
        (n, a_stats), b_stats = _wait_all([ex.submit(replays), ex.submit(records)], "replaying and recording")
    assert b_done.is_set() and n >= 20 and a_stats == (1, 0)
    assert b_stats == (1, 1, 4, 0, {})  # the capture ran beside the other thread's replays and held


def test_mark_step_begin_and_reset_act_on_the_calling_thread():
    f = cgraw.graphed(lambda x: x * 2.0 + 1.0)
    x = torch.randn(256, device="cuda")
    for _ in range(3):
        out = f(x)  # a replay: its memory is the tree's
    errors = []

    def other():
        try:
            cgraw.mark_step_begin()  # this thread has no tree: nothing of main's ends
            cgraw.reset()
        except BaseException as exc:  # noqa: BLE001 - reported to the test's thread
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive() and not errors, errors
    torch.testing.assert_close(out, x * 2.0 + 1.0)  # still readable: main's generation goes on
    y = torch.randn(256, device="cuda")
    torch.testing.assert_close(f(y), y * 2.0 + 1.0)
    assert _my_stats(f).recordings == 1  # main's tree was not reset
    cgraw.mark_step_begin()
    with pytest.raises(RuntimeError, match="overwritten"):
        (out + 0).sum()


# ---------------------------------------------------------------------- training on two threads


def test_two_threads_train_through_their_own_trees():
    """Each thread's backward runs on autograd's device thread, as a node of that thread's tree."""
    prev, cgraw.config.autograd = cgraw.config.autograd, True
    steps = 12
    start = threading.Barrier(2, timeout=DEADLINE_S)

    def train(seed):
        model = _mlp(seed)
        ref = copy.deepcopy(model)
        opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
        g = cgraw.graphed(model)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            start.wait()
            for _ in range(steps):
                x = torch.randn(32, 64, device="cuda")
                g(x).pow(2).mean().backward()
                ref(x).pow(2).mean().backward()
                for p, q in zip(model.parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, **TRAIN_TOL)
                for o in (opt, ropt):
                    o.step()
                    o.zero_grad()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, **TRAIN_TOL)
        mine = _registry()._managers[0]
        backward = [s for s in mine.stats.values() if s.name.endswith(".backward")]
        return [(s.recordings, s.replays) for s in backward]

    try:
        with cf.ThreadPoolExecutor(max_workers=2) as ex:
            results = _wait_all([ex.submit(train, seed) for seed in (3, 4)], "training threads")
    finally:
        cgraw.config.autograd = prev
    for backward in results:
        # warmed up and recorded by the third step, or a step or two later when the other thread
        # held the recording lock just then (the backward then ran eagerly instead of waiting)
        assert len(backward) == 1 and backward[0][0] == 1 and backward[0][1] >= steps - 6, backward
    assert not [name for (_, _), (name, _) in list(_registry()._all.items()) if name.startswith("Dummy")]
