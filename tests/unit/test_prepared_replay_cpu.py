"""CPU tests of the prepared replay of a whole graph's root node (``cgraw.trees.prepared``): the real
``TreeManager`` over the CPU graph emulator (tests/helpers/cpu_graph.py, which refuses to replay a
recording whose input read in place moved), calls keyed as ``CudaBackend`` keys them. A call that
matches its root node's prepared replay skips classification; any other call takes the generic path.
The same script of calls, run with the prepared replay and without it, gives results equal to eager
and the same tree, and the prepared replay serves the calls it matches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cpu_graph import CpuGraphBackend  # noqa: E402
from torch_cpu_backend import TorchFn, cpu_tree  # noqa: E402

from cgraw.trees import calls  # noqa: E402
from cgraw.trees import manager as manager_mod  # noqa: E402
from cgraw.trees.prepared import Prepared  # noqa: E402

pytestmark = pytest.mark.torch


class Whole(TorchFn):
    """As ``interop.torch.whole_graph.graphed_whole`` makes one: a root function whose inputs dynamo guards."""

    inputs_guarded = True
    static_positions = ()


def body(tok, pos, w, b, state):
    """A decode step's shape: parameters read in place, a token fed back, a state written in place."""
    state.add_(pos)
    return torch.tanh(tok @ w + b + state)


class Model:
    """The tensors of one run: parameters, a state written in place, the positions."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(4, 4, generator=g), requires_grad=False)
        self.b = torch.nn.Parameter(torch.randn(1, 4, generator=g), requires_grad=False)
        self.state = torch.randn(1, 4, generator=g)
        self.positions = torch.randn(64, 1, generator=g)
        self.tok = torch.randn(1, 4, generator=g)


def _script(tree, f, m: Model, blocks: list) -> list:
    """The calls of a user's loop, varied as users vary them; each result cloned (for eager, ``tree``
    and ``f`` are None and ``body`` runs). ``blocks`` gets the indices of each run of plain calls."""
    call = body if f is None else f
    outs = []
    i = 0

    def step(*args, **kwargs):
        nonlocal i
        out = call(*args, **kwargs)
        outs.append(out.clone())
        i += 1
        return out

    def decode(n):
        blocks.append(list(range(i, i + n)))
        for _ in range(n):
            m.tok = step(m.tok, m.positions[i:i + 1], m.w, m.b, m.state)  # the output fed back

    decode(6)
    m.w.data = m.w.data * 0.5  # a parameter at a new address: the node is recorded again
    decode(4)
    if tree is not None:
        tree.mark_step_begin()  # the path begins anew: no step to begin at the next call
    decode(3)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium" if prev != "medium" else "high")  # other kernels: other node
    decode(3)
    torch.set_float32_matmul_precision(prev)
    decode(3)
    marked = calls.mark_static(m.tok.clone())  # a tensor marked static as an input
    m.tok = step(marked, m.positions[i:i + 1], m.w, m.b, m.state)
    decode(3)
    m.tok = step(torch.nn.Parameter(m.tok.clone(), requires_grad=False), m.positions[i:i + 1], m.w, m.b, m.state)
    decode(3)
    m.tok = step(m.tok, m.positions[i:i + 1], m.w, m.b, state=m.state)  # a keyword argument
    decode(3)
    with torch.enable_grad():
        m.tok = step(m.tok, m.positions[i:i + 1], m.w, m.b, m.state)
    decode(3)
    if tree is not None:
        tree.reset()
    decode(4)
    return outs


def _run(monkeypatch, prepared: bool):
    """The script against eager: ``(results, eager results, per-function stats, the indices of the
    calls the prepared replay served, the runs of plain calls)``."""
    served, count = [], [0]
    real = manager_mod.call_of  # made only for a call the prepared replay serves

    def counted(p, args, ptrs):
        served.append(count[0])
        return real(p, args, ptrs)

    monkeypatch.setattr(manager_mod, "call_of", counted)
    if not prepared:
        monkeypatch.setattr(manager_mod, "prepare", lambda fn, node, args, device: Prepared(fn, node))
    blocks: list = []
    with cpu_tree(monkeypatch, CpuGraphBackend) as tree:
        f = Whole(body, tree, name="whole")

        def call(*args, **kwargs):
            try:
                return f(*args, **kwargs)
            finally:
                count[0] += 1

        got = _script(tree, call, Model(7), blocks)
        stats = {(s.name, s.warmups, s.recordings, s.rerecords, s.replays, s.eager_calls) for s in tree.stats.values()}
    want = _script(None, None, Model(7), [])
    return got, want, stats, served, blocks


def test_a_whole_graphs_calls_give_the_same_results_and_tree_with_and_without_the_prepared_replay(monkeypatch):
    got, want, stats, served, blocks = _run(monkeypatch, prepared=True)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, msg=lambda m, k=k: f"call {k}: {m}")
    with monkeypatch.context() as mp:
        got_off, _, stats_off, served_off, _ = _run(mp, prepared=False)
    for a, b in zip(got, got_off, strict=True):
        torch.testing.assert_close(a, b)
    assert stats == stats_off and served_off == []
    plain = {k for block in blocks for k in block}
    assert set(served) <= plain, sorted(set(served) - plain)  # a varied call never
    # a run of plain calls: its first may record (or re-record) its node, its second replays it and
    # prepares it; every later one is served
    for block in blocks:
        assert set(block[2:]) <= set(served), (block, served)


def test_a_prepared_replay_is_made_once_per_recorded_root_node(monkeypatch):
    made = []
    real = manager_mod.prepare

    def spy(fn, node, args, device):
        p = real(fn, node, args, device)
        made.append((node, p.usable, p.why))
        return p

    monkeypatch.setattr(manager_mod, "prepare", spy)
    with cpu_tree(monkeypatch, CpuGraphBackend) as tree:
        f = Whole(body, tree, name="whole")
        m = Model(3)
        for i in range(12):
            m.tok = f(m.tok, m.positions[i:i + 1], m.w, m.b, m.state)
        (node,) = tree.roots.values()
        assert [(n, u) for n, u, _ in made] == [(node, True)], made
        assert tree.prepared[f.fn_id].node is node
        assert node.stats.replays == 11 - 1  # warm-up, recording (its first replay), replays


def test_a_function_switching_root_nodes_at_every_call_stops_being_prepared(monkeypatch):
    """Calls alternating between two settings that choose kernels alternate between two root nodes:
    after ``PREPARE_LIMIT`` rebuilds the generic path serves them, with the same results."""
    with cpu_tree(monkeypatch, CpuGraphBackend) as tree:
        f = Whole(body, tree, name="whole")
        m, ref = Model(5), Model(5)
        prev = torch.get_float32_matmul_precision()
        try:
            for i in range(2 * manager_mod.PREPARE_LIMIT + 8):
                torch.set_float32_matmul_precision("medium" if i % 2 else "highest")
                m.tok = f(m.tok, m.positions[i:i + 1], m.w, m.b, m.state)
                ref.tok = body(ref.tok, ref.positions[i:i + 1], ref.w, ref.b, ref.state)
                torch.testing.assert_close(m.tok, ref.tok)
        finally:
            torch.set_float32_matmul_precision(prev)
        p = tree.prepared[f.fn_id]
        assert not p.usable and p.builds == manager_mod.PREPARE_LIMIT
        assert len(tree.roots) == 2


def test_inputs_sharing_memory_with_a_written_one_take_the_generic_path_and_run_eagerly(monkeypatch):
    """A function that writes an input, called with that input also as another argument: the generic
    path warms that call up and refuses to record it (a recording's copies would not see each other's
    writes): it runs eagerly. The plain calls after it fit the root node prepared before, which serves
    them at once."""
    served = []
    real = manager_mod.call_of
    monkeypatch.setattr(manager_mod, "call_of", lambda p, args, ptrs: served.append(i) or real(p, args, ptrs))
    with cpu_tree(monkeypatch, CpuGraphBackend) as tree:
        f = Whole(body, tree, name="whole")
        m, ref = Model(9), Model(9)
        for i in range(12):
            shared = i in (5, 6, 7)
            for t, call in ((m, f), (ref, body)):
                t.tok = call(t.state if shared else t.tok, t.positions[i:i + 1], t.w, t.b, t.state)
            torch.testing.assert_close(m.tok, ref.tok)
            torch.testing.assert_close(m.state, ref.state)
        (s,) = tree.stats.values()
        assert s.eager_calls == 2 and any("share memory" in r for r in s.skip_reasons), s
    assert served == [2, 3, 4, 8, 9, 10, 11], served


def test_a_call_while_a_backward_is_pending_takes_the_generic_path_and_the_next_ones_are_served(monkeypatch):
    """A training step's forward through another graphed function leaves its backward pending (once
    that function has run a backward): the whole graph's call then begins no step and extends the
    path, as the generic path decides; once the backward has run, its calls are served again."""
    served = []
    real = manager_mod.call_of
    monkeypatch.setattr(manager_mod, "call_of", lambda p, args, ptrs: served.append(i) or real(p, args, ptrs))
    with cpu_tree(monkeypatch, CpuGraphBackend) as tree:
        f = Whole(body, tree, name="whole")
        loss = TorchFn(lambda x: (x * x).sum(), tree, name="loss")
        m, ref = Model(11), Model(11)
        x = torch.randn(3, requires_grad=True)
        for i in range(14):
            train = 5 <= i < 10
            if train:
                with torch.enable_grad():
                    out = loss(x)
                assert bool(tree.book.tickets and tree.book.pending()) == (i > 5)
            for t, call in ((m, f), (ref, body)):
                t.tok = call(t.tok, t.positions[i:i + 1], t.w, t.b, t.state)
            torch.testing.assert_close(m.tok, ref.tok)
            if train:
                x.grad = None
                out.backward()
                torch.testing.assert_close(x.grad, 2 * x.detach())
    assert served == [2, 3, 4, 5, 10, 11, 12, 13], served
