"""CPU tier: ``cgraw.while_loop`` and ``cgraw.cond`` captured into an emulated graph and replayed.

The capture path runs as on a GPU, with the driver calls faked (``tests/helpers/control_flow_fakes.FakeDriver``)
and the torch ops of each captured stretch logged by ``cpu_graph.GraphRecorder``: the enclosing
graph's ops before a node, the node, the bodies' ops, the ops after it. A replay runs the logged ops
again on the recorded tensors (fixed addresses, as a graph's), sets condition handles where the
set-condition kernel was captured, and runs WHILE bodies while their handle holds and IF bodies
by theirs. Replays with new inputs written in place are compared with the host loop: what Python
ran at capture time (the branch taken, the iteration count) cannot leak into the results."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cpu_graph  # noqa: E402
from control_flow_fakes import FakeDriver  # noqa: E402

import cgraw  # noqa: E402
from cgraw.control import nodes  # noqa: E402


class Emulator(FakeDriver):
    """``FakeDriver`` that also logs each captured stretch's ops into its graph's item list."""

    def __init__(self, monkeypatch, version=12080):
        super().__init__(monkeypatch, version)
        self.items: dict[str, list] = {"G": []}
        self.handle_values: dict[int, bool] = {}
        self.bodies: dict[str, list] = {}
        self.recorder = None
        monkeypatch.setattr(nodes, "_set_condition", self.set_condition)

    def start(self):
        """The enclosing capture begins recording (after the test made its inputs)."""
        self._start()

    def _start(self):
        self.recorder = cpu_graph.GraphRecorder()
        self.recorder.__enter__()

    def _stop(self, graph):
        rec, self.recorder = self.recorder, None
        rec.__exit__(None, None, None)
        rec.undo_writes()
        self.items.setdefault(graph, []).extend(("op", op) for op in rec.ops)

    def end(self, s):
        g = self.capturing
        self._stop(g)
        return super().end(s)

    def begin(self, s, graph, deps, mode):
        super().begin(s, graph, deps, mode)
        self.items.setdefault(graph, [])
        self._start()

    def add_node(self, graph, deps, h, kind, size, ctx):
        # the node joins the running capture: the ops recorded before it come first
        node, bodies = super().add_node(graph, deps, h, kind, size, ctx)
        self._stop(graph)
        self.items[graph].append(("node", kind, h, bodies))
        self._start()
        return node, bodies

    def set_condition(self, ordinal, handle, pred, negate, s):
        # the kernel is a captured op: flush the ops before it, log it, go on recording
        g = self.capturing
        self._stop(g)
        self.items[g].append(("set", handle, pred, negate))
        self._start()

    def finish(self):
        self._stop(self.capturing)

    def replay(self, graph="G"):
        with torch.no_grad():
            for item in self.items[graph]:
                if item[0] == "op":
                    op = item[1]
                    if op.kind in ("view", "skip"):
                        continue
                    res = op.func(*op.args, **op.kwargs)
                    if op.kind == "copy":
                        for old, new in zip(cpu_graph._tensors(op.out), cpu_graph._tensors(res), strict=True):
                            if old is not new:
                                old.copy_(new)
                elif item[0] == "set":
                    _, h, pred, negate = item
                    self.handle_values[h] = bool(pred) != bool(negate)
                else:
                    _, kind, h, bodies = item
                    if kind == "while":
                        guard = 0
                        while self.handle_values[h]:
                            self.replay(bodies[0])
                            guard += 1
                            assert guard < 10_000, "the emulated WHILE node never ended"
                    elif self.handle_values[h]:
                        self.replay(bodies[0])
                    elif len(bodies) == 2:
                        self.replay(bodies[1])


def test_emulated_while_loop_replays_like_the_host_loop(monkeypatch):
    emu = Emulator(monkeypatch)
    x0 = torch.rand(6) * 100
    n0 = torch.zeros((), dtype=torch.int64)

    def cond_fn(x, n):
        return ((x - 2).norm() > 1e-3) & (n < 500)

    def body_fn(x, n):
        return x * 0.5 + 1, n + 1

    emu.start()
    x, n = cgraw.while_loop(cond_fn, body_fn, (x0, n0))
    emu.finish()
    monkeypatch.undo()  # the host loop below runs outside the (fake) capture
    counts = set()
    for scale in (10.0, 1e3, 1e5):  # iteration counts about 7 apart
        x0.copy_(torch.rand(6) * scale)
        emu.replay()
        hx, hn = cgraw.while_loop(cond_fn, body_fn, (x0, n0))
        assert int(n) == int(hn) and torch.equal(x, hx)
        counts.add(int(n))
    assert len(counts) == 3 and int(n0) == 0  # three iteration counts from one capture


def test_emulated_swap_and_in_place_bodies(monkeypatch):
    emu = Emulator(monkeypatch)
    a0, b0 = torch.randn(4), torch.randn(4)
    k0 = torch.zeros((), dtype=torch.int32)

    def cond_fn(a, b, k, acc):
        return k < 9

    def body_fn(a, b, k, acc):
        acc.add_(a)  # in place on its own buffer
        return b, a + b, k + 1, acc

    acc0 = torch.zeros(4)
    emu.start()
    out = cgraw.while_loop(cond_fn, body_fn, (a0, b0, k0, acc0))
    emu.finish()
    monkeypatch.undo()
    for _ in range(2):
        a0.copy_(torch.randn(4))
        b0.copy_(torch.randn(4))
        emu.replay()
        ref = cgraw.while_loop(cond_fn, body_fn, (a0, b0, k0, torch.zeros(4)))
        for got, want in zip(out, ref):
            assert torch.equal(got, want)


@pytest.mark.parametrize("version", [12040, 12080])
def test_emulated_cond_takes_the_branch_of_each_replay(monkeypatch, version):
    emu = Emulator(monkeypatch, version)
    a = torch.randn(5)

    def t(v):
        return v.relu() * 2, v.sum()

    def f(v):
        return -v.abs(), v.mean()

    emu.start()
    y, s = cgraw.cond(a.sum() > 0, t, f, (a,))
    emu.finish()
    monkeypatch.undo()
    taken = []
    for sign in (1.0, -1.0, 1.0, -1.0):
        a.copy_(sign * torch.rand(5))
        emu.replay()
        ey, es = t(a) if a.sum() > 0 else f(a)
        assert torch.equal(y, ey) and torch.equal(s, es)
        taken.append(bool(a.sum() > 0))
    assert taken == [True, False, True, False]


def test_emulated_while_nested_in_cond(monkeypatch):
    emu = Emulator(monkeypatch)
    x0 = torch.randn(8) * 50
    n0 = torch.zeros((), dtype=torch.int64)

    def t(x):
        return cgraw.while_loop(lambda v, n: v.abs().max() > 1, lambda v, n: (v * 0.5, n + 1), (x, n0))

    def f(x):
        return x * 0, n0 - 1

    emu.start()
    y, n = cgraw.cond(x0[0] > 0, t, f, (x0,))
    emu.finish()
    monkeypatch.undo()
    for _ in range(6):
        x0.copy_(torch.randn(8) * float(torch.rand(()) * 100))
        emu.replay()
        ey, en = cgraw.cond(x0[0] > 0, t, f, (x0,))
        assert torch.equal(y, ey) and int(n) == int(en)


def test_emulated_cond_nested_in_while(monkeypatch):
    emu = Emulator(monkeypatch)
    x0 = torch.randn(3)
    k0 = torch.zeros((), dtype=torch.int64)

    def body_fn(x, k):
        x = cgraw.cond(x.sum() > 0, lambda v: v - 1.5, lambda v: v + 2.0, (x,))
        return x, k + 1

    emu.start()
    x, k = cgraw.while_loop(lambda x, k: k < 7, body_fn, (x0, k0))
    emu.finish()
    monkeypatch.undo()
    for _ in range(3):
        x0.copy_(torch.randn(3) * 4)
        emu.replay()
        hx, hk = cgraw.while_loop(lambda x, k: k < 7, body_fn, (x0, k0))
        assert torch.equal(x, hx) and int(k) == 7
