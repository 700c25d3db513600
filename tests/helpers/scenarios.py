"""Scenarios that could abort the process or hang it, run in a child process.

``python tests/helpers/scenarios.py NAME [NAME...]`` runs each named scenario in this one process,
in order, and prints ``PASS name`` or ``FAIL name: reason`` for each, then ``DONE``. A scenario
that aborts the process or deadlocks shows up to the caller (``tests/gpu/test_hardening.py``) as
a missing ``DONE``, a signal exit or a timeout, instead of killing the test run. Every result is
compared with eager execution on fresh random data.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import cgraw  # noqa: E402
from stress import settle  # noqa: E402

rng = np.random.default_rng()
SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def close(a, b, tol=1e-4):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@scenario
def capture_loop_rebinding_g():
    """``for b in ...: with cgraw.capture() as g:`` drops the previous graph (and its
    torch MemPool) while the next capture routes allocations."""
    w = torch.randn(64, 64, device="cuda")
    for rounds in range(3):
        for b in (1, 8, 4, 2):
            x = torch.randn(b, 64, device="cuda")
            with cgraw.capture() as g:
                y = torch.relu(x @ w) + 1.0
                c = cp.tanh(cp.from_dlpack(y))
            for _ in range(2):
                x.copy_(torch.randn(b, 64, device="cuda"))
                g.replay()
                close(y, torch.relu(x @ w) + 1.0)
                assert cp.allclose(c, cp.tanh(cp.from_dlpack(torch.relu(x @ w) + 1.0)), atol=1e-5)
    del g, y, c


@scenario
def graph_collected_by_gc_inside_a_capture():
    """A graph in a reference cycle is collected by gc in the middle of another capture."""
    from cgraw._cuda import defer

    x = torch.randn(1000, device="cuda")
    for _ in range(5):
        with cgraw.capture() as g1:
            y1 = x * 2.0
        holder = {"g": g1, "y": y1}
        holder["self"] = holder  # a cycle: only gc frees it
        del g1, y1, holder
        with cgraw.capture() as g2:
            y2 = torch.sin(x)
            gc.collect()  # the cycle (graph, its pool, its MemPool) dies here, inside the capture
            assert defer.pending() > 0, "nothing was deferred"
        assert defer.pending() == 0
        x.copy_(torch.randn(1000, device="cuda"))
        g2.replay()
        close(y2, torch.sin(x))
        del g2, y2


@scenario
def capturable_optimizer_step_captured_per_round():
    """A capturable Adam step captured again each round (graph rebound)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8).cuda()
    ref = torch.nn.Linear(32, 8).cuda()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2, capturable=True)
    x = torch.randn(16, 32, device="cuda")
    t = torch.randn(16, 8, device="cuda")

    def step(m, o):
        o.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(m(x), t)
        loss.backward()
        o.step()
        return loss.detach()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: optimizer state and grads exist before any capture
        for _ in range(3):
            step(model, opt)
            step(ref, ropt)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        with cgraw.capture() as g:
            loss = step(model, opt)
        for _ in range(2):
            g.replay()
            rl = step(ref, ropt)
            close(loss, rl, 1e-4)
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4)


class _Background:
    """``with _Background(step) as errors:`` runs ``step(errors)`` in a loop on another thread for
    the duration of the block; what it raises is appended to ``errors`` too. After the block the
    thread has stopped (``hung`` says whether it failed to within 60 s)."""

    def __init__(self, step):
        self.step, self.errors, self.hung = step, [], False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self):
        try:
            while not self._stop.is_set():
                self.step(self.errors)
        except BaseException as e:  # noqa: BLE001 - reported by the scenario
            self.errors.append(repr(e))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)
        self.hung = self._thread.is_alive()
        return False


@scenario
def capture_while_another_thread_allocates():
    """Captures rebinding ``g`` while another thread allocates and frees torch memory."""

    def allocate(errors):
        a = torch.randn(1 << 14, device="cuda")
        if not torch.equal(a * 2.0, a + a):
            errors.append("wrong result in the other thread")
        del a

    with _Background(allocate) as bg:
        x = torch.randn(4096, device="cuda")
        for i in range(60):
            with cgraw.capture() as g:
                y = torch.exp(x) - float(i % 3)
            x.copy_(torch.randn(4096, device="cuda"))
            g.replay()
            close(y, torch.exp(x) - float(i % 3))
    assert not bg.hung, "the other thread hung"
    assert not bg.errors, bg.errors


@scenario
def other_thread_calls_torch_memory_apis_during_500_captures():
    """Another thread calls torch's memory APIs and allocates in a tight loop while this
    one runs 500 captures (and a graphed function): no hang, both threads correct."""
    f = cgraw.graphed(lambda v: v * 3.0 + 1.0)
    v = torch.randn(256, device="cuda")
    f(v)  # this thread's tree of device 0
    counts = {"n": 0}

    def memory_apis(errors):
        torch.cuda.memory_allocated()
        torch.cuda.memory_stats()
        torch.cuda.memory_reserved()
        if counts["n"] % 50 == 0:
            torch.cuda.empty_cache()
        a = torch.randn(1 << 12, device="cuda")
        if not torch.equal(a * 3.0, a + a + a):
            errors.append("wrong result in the other thread")
        if counts["n"] % 100 == 0:
            cgraw.reset()  # the calling thread's trees only (it has none): no hang, no error
        counts["n"] += 1

    with _Background(memory_apis) as bg:
        x = torch.randn(2048, device="cuda")
        for i in range(500):
            with cgraw.capture() as g:
                y = torch.tanh(x) * 2.0
                c = cp.sqrt(cp.abs(cp.from_dlpack(y)))
            if i % 25 == 0:
                x.copy_(torch.randn(2048, device="cuda"))
                g.replay()
                close(y, torch.tanh(x) * 2.0)
                assert cp.allclose(c, cp.sqrt(cp.abs(cp.from_dlpack(torch.tanh(x) * 2.0))), atol=1e-6)
                w = torch.randn(256, device="cuda")
                close(f(w), w * 3.0 + 1.0)
    assert not bg.hung, "the other thread hung"
    assert counts["n"] > 0, "the other thread never ran"
    assert not bg.errors, bg.errors[:3]
    from cgraw.trees.graphed import _managers

    s = _managers[0].stats[f.fn_id]  # the other thread's reset() left this thread's tree alone
    assert (s.recordings, s.rerecords) == (1, 0), s


@scenario
def refused_restore_falls_back_to_a_fresh_pool():
    """A function that stashes a tensor while it records, then a new sibling branch:
    torch's checkpoint restore would fail after freeing blocks (a process abort when the stale
    owners die); cgraw refuses it first, renews the tree's pool, and stays correct."""
    import logging

    stash = []
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Catch()
    logging.getLogger("cgraw").addHandler(handler)

    def a(x):
        return x * 2.0 + 1.0

    def b(y):
        z = torch.sin(y)
        stash.append(z * 1.0)  # memory of the tree the tree does not know about
        return z

    def c(y):
        return torch.cos(y)

    def d(y):
        return torch.tanh(y) * 3.0

    fa, branches = cgraw.graphed(a), [(cgraw.graphed(c), c), (cgraw.graphed(b), b), (cgraw.graphed(d), d)]
    try:
        for i in range(15):
            x = torch.randn(1 << 16, device="cuda")
            fn, body = branches[i % 3]
            z = fn(fa(x))
            n = len(stash)
            close(z, body(a(x)))
            del stash[n:]  # the reference call above stashed too
            cgraw.mark_step_begin()
    finally:
        logging.getLogger("cgraw").removeHandler(handler)
    assert any("cannot restore" in m for m in seen), seen
    for t in stash:  # what the function stashed stays valid memory (never freed twice)
        assert torch.isfinite(t).all()
    del stash[:]
    cgraw.mark_step_begin()
    cgraw.reset()
    gc.collect()
    torch.cuda.synchronize()


@scenario
def model_output_at_two_batch_sizes():
    """A graphed function returning a ModelOutput-like pytree (transformers registers
    its ModelOutput with torch's pytree) at two batch sizes."""
    import collections

    import torch.utils._pytree as pytree

    class Out(collections.OrderedDict):
        pass

    pytree.register_pytree_node(Out, lambda o: (list(o.values()), list(o.keys())),
                                lambda vals, keys: Out(zip(keys, vals)))
    w = torch.randn(32, 16, device="cuda")

    def fwd(x):
        h = x @ w
        return Out(logits=h, hidden=torch.relu(h))

    f = cgraw.graphed(fwd)
    for i in range(12):
        b = (1, 8)[i % 2]
        x = torch.randn(b, 32, device="cuda")
        out = f(x)
        assert type(out) is Out and list(out) == ["logits", "hidden"]
        close(out["logits"], x @ w)
        close(out["hidden"], torch.relu(x @ w))
    st = sys.modules["cgraw.trees.graphed"]._managers[0].stats[f.fn_id]
    assert st.recordings == 2 and st.warmups == 2 and not st.skip_reasons, (st.recordings, st.warmups)
    del out
    cgraw.mark_step_begin()
    cgraw.reset()


def main(names) -> int:
    torch.cuda.init()
    for name in names:
        settle()  # under CGRAW_GC_STRESS: stress collections cost what the scenario allocates
        try:
            SCENARIOS[name]()
            print(f"PASS {name}", flush=True)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            tb = traceback.format_exc().strip().splitlines()
            print(f"FAIL {name}: {exc!r} | " + " | ".join(tb[-6:]), flush=True)
        finally:
            try:
                cgraw.mark_step_begin()
                cgraw.reset()
            except Exception:
                pass
            gc.collect()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or list(SCENARIOS)))
