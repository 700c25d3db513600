"""CPU tier: graphed functions replayed by an emulator of CUDA-graph replay (tests/helpers/cpu_graph.py).

The emulator records a function's aten ops once and replays the ops, not the Python: Python
scalars stay as recorded, a Python branch stays as taken, and tensors are read at the addresses
the recording read. So results compared with eager torch show what a replay on the GPU returns
where Python would have computed something else. First the emulator itself, then scenarios
through the real ``TreeManager`` with ``CpuGraphBackend`` (no grad: calls autograd records go to
``CpuTorchBackend``), each compared with eager, bitwise (the same CPU kernels run).
"""

from __future__ import annotations

import copy
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import test_shared_inputs_cpu as shared  # noqa: E402
from cpu_graph import CannotEmulate, CpuGraphBackend, GraphRecording, HostRead, record  # noqa: E402
from torch_cpu_backend import TorchFn, cpu_tree  # noqa: E402

from cgraw.trees.manager import NodeState  # noqa: E402

pytestmark = pytest.mark.torch
GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "graph-trees.md"


def same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.fixture
def mgr(monkeypatch):
    with cpu_tree(monkeypatch, CpuGraphBackend) as m:
        torch.manual_seed(7)
        yield m


def counts(mgr, f):
    st = mgr.stats[f.fn_id]
    return st.warmups, st.recordings, st.replays, st.eager_calls


def graph_replays(mgr) -> int:
    return sum(g.replays for g in mgr.backend.graphs)


# ---------------------------------------------------------------------- the emulator


def test_a_replay_recomputes_every_op_from_the_new_contents_of_its_inputs():
    x, w = torch.randn(4, 3), torch.randn(3, 5)

    def f(x):
        y = torch.tanh(x @ w).relu() + x.sum(dim=1, keepdim=True)
        return y, y[1:, :2].t(), torch.cat([x, x]).amax(dim=0), x.index_select(0, torch.tensor([2, 0]))

    g, out = record(f, x)
    for _ in range(3):
        x.copy_(torch.randn(4, 3))
        g.replay()
        for a, b in zip(out, f(x), strict=True):
            same(a, b)
    assert g.replays == 3


def test_a_reshape_that_copies_under_inference_mode_runs_again_on_every_replay():
    """Under inference mode ``reshape`` reaches the recorder whole (autograd, which decomposes it,
    is off); of an expanded tensor it copies (transformers' ``repeat_kv``), and a replay runs that
    copy again as a graph runs its kernel."""
    x = torch.randn(2, 3, 4)

    def f(x):
        return x[:, None].expand(2, 2, 3, 4).reshape(4, 3, 4) * 2, x.reshape(6, 4)

    with torch.inference_mode():
        g, out = record(f, x)
        for _ in range(3):
            x.copy_(torch.randn(2, 3, 4))
            g.replay()
            for a, b in zip(out, f(x), strict=True):
                same(a, b)


def test_a_python_scalar_read_at_record_time_stays_baked_in():
    settings = {"scale": 2.0}
    x = torch.randn(5)
    g, out = record(lambda x: x * settings["scale"] + 1.0, x)
    settings["scale"] = 10.0
    x.copy_(torch.randn(5))
    g.replay()
    same(out, x * 2.0 + 1.0)


def test_a_python_branch_stays_as_taken_at_record_time():
    flag = [True]
    x = torch.randn(5)
    g, out = record(lambda x: x.sin() if flag[0] else x.cos(), x)
    flag[0] = False
    g.replay()
    same(out, x.sin())


def test_in_place_and_out_ops_on_inputs_run_again_on_every_replay():
    x, acc, dst = torch.randn(6), torch.zeros(6), torch.empty(6)

    def f(x):
        x.mul_(2.0)
        acc.add_(x)
        torch.mul(x, 3.0, out=dst)
        return x[:3] + 1.0

    x0 = x.clone()
    g, out = record(f, x)
    same(x, x0)  # a recording runs nothing that outlives it (a capture runs nothing)
    same(acc, torch.zeros(6))
    for k in (1, 2):
        g.replay()
        same(x, x0 * 2.0 ** k)
        same(acc, x0 * (2.0 if k == 1 else 6.0))
        same(dst, x * 3.0)
        same(out, x[:3] + 1.0)


def test_a_closure_tensor_changed_in_place_is_read_anew():
    w = torch.randn(3, 3)
    x = torch.randn(2, 3)
    g, out = record(lambda x: x @ w.t(), x)
    w.mul_(-1.0)
    w[0, 0] = 5.0
    g.replay()
    same(out, x @ w.t())


def test_what_the_emulator_cannot_replay_is_refused_with_a_reason():
    x = torch.randn(4)
    with pytest.raises(HostRead, match="_local_scalar_dense"):
        record(lambda x: x.sum().item(), x)
    with pytest.raises(HostRead, match="value"):
        record(lambda x: x[x > 0], x)
    with pytest.raises(CannotEmulate, match="random numbers"):
        record(lambda x: x + torch.rand(4), x)
    w = torch.randn(4)
    g, _ = record(lambda x: x * w, x)
    w.set_(torch.randn(4).untyped_storage())  # a new storage: a graph would read the old address
    with pytest.raises(CannotEmulate, match="moved"):
        g.replay()



@pytest.mark.parametrize("read", [
    lambda y: y.tolist(), lambda y: y.numpy().sum(), lambda y: np.asarray(y), lambda y: f"{y!r}", lambda y: str(y),
], ids=["tolist", "numpy", "asarray", "repr", "str"])
def test_a_copy_to_the_host_that_bypasses_the_dispatcher_is_refused_as_a_capture_refuses_it(read):
    x = torch.randn(4)
    with pytest.raises(HostRead, match="to the host"):
        record(lambda x: read(x * 2.0), x)
    assert isinstance(x.tolist(), list) and repr(x).startswith("tensor")  # only while recording

# ---------------------------------------------------------------------- through the tree


@pytest.mark.parametrize("scenario, replays", [
    (shared.test_a_written_input_and_a_view_of_it_run_eagerly_and_separate_tensors_replay, True),
    (shared.test_the_same_tensor_passed_twice_to_a_writer_matches_eager, False),  # eager: shared memory
    (shared.test_a_function_that_writes_nothing_keeps_replaying_overlapping_inputs, True),
    (shared.test_a_plain_object_argument_whose_attribute_is_set_anew_selects_another_recording, True),
], ids=["written_input_and_its_view", "same_tensor_twice", "overlapping_inputs_read_only", "plain_object"])
def test_the_shared_input_scenarios_hold_when_replays_run_no_python(mgr, scenario, replays):
    scenario(mgr)
    assert (graph_replays(mgr) > 0) == replays


@pytest.mark.parametrize("step_marks", [True, False], ids=["mark_step_begin", "inference_rule"])
def test_several_functions_in_a_step_with_outputs_fed_back_match_eager(mgr, step_marks):
    w = torch.randn(8, 8)

    def enc(x):
        return torch.tanh(x @ w)

    def cell(h, e):
        return h * 0.5 + e.sin()

    def head(h):
        return h.sum(dim=1), h.abs().amax()

    E, C, H = (TorchFn(f, mgr) for f in (enc, cell, head))
    for _ in range(5):
        if step_marks:
            mgr.mark_step_begin()
        x = torch.randn(4, 8)
        e = E(x)
        h = torch.zeros(4, 8)
        for _ in range(3):
            h = C(h, e)
        s, m = H(h)
        eh = torch.zeros(4, 8)
        for _ in range(3):
            eh = cell(eh, enc(x))
        same(h, eh)
        same(s, head(eh)[0])
        same(m, head(eh)[1])
    for f in (E, C, H):
        assert counts(mgr, f)[2] >= 3, counts(mgr, f)


def test_a_state_carried_across_steps_by_a_root_function_matches_eager(mgr):
    f = TorchFn(lambda h, x: torch.tanh(h + x) * 0.9, mgr, name="step")
    h, ref = torch.zeros(6), torch.zeros(6)
    for _ in range(8):
        x = torch.randn(6)
        h = f(h, x)
        ref = torch.tanh(ref + x) * 0.9
        same(h, ref)
    assert counts(mgr, f)[2] >= 5


def _mlp():
    g = torch.Generator().manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for p in m.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


@pytest.mark.parametrize("how", ["closure", "argument"])
def test_parameters_updated_in_place_by_an_optimizer_step_are_read_anew(mgr, how):
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    f = TorchFn((lambda x: model(x)) if how == "closure" else (lambda m, x: m(x)), mgr, name="forward")
    for _ in range(6):
        x = torch.randn(5, 8)
        out = f(x) if how == "closure" else f(model, x)
        same(out, ref(x))
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        opt_ref.step()
    assert counts(mgr, f)[1:] == (1, 4, 0)


def test_a_python_float_argument_that_changes_selects_its_own_recording(mgr):
    f = TorchFn(lambda x, a: x * a + a * a, mgr)
    for a in (0.5, 0.5, 0.5, 1.5, 1.5, 1.5, 0.5, 1.5):
        x = torch.randn(8)
        same(f(x, a), x * a + a * a)
    st = mgr.stats[f.fn_id]
    assert st.variants == 2 and st.replays >= 4 and st.eager_calls == 0


def test_a_change_inside_a_plain_object_attribute_selects_another_recording_as_the_guide_says(mgr):
    f = TorchFn(lambda x, s: x * s.scale + s.offsets[0], mgr)
    s = shared._Settings(2.0)
    for _ in range(3):
        x = torch.randn(8)
        same(f(x, s), x * 2.0 + 0.5)
    s.offsets[0] = 1.5  # an element changed in place: the attributes' values are the key
    for _ in range(3):
        x = torch.randn(8)
        same(f(x, s), x * 2.0 + 1.5)
    assert mgr.stats[f.fn_id].replays >= 2
    assert "So `settings.scale = 3.0` or `settings.offsets[0] = 0.9`\n  selects another recording" in GUIDE.read_text()


SCALE = 2.0  # a module global a graphed function reads


def _scaled(x):
    return x * SCALE


def test_a_closure_python_float_that_changes_keeps_its_recorded_value_as_the_guide_says(mgr):
    """A Python number read through the closure (a module global) is part of the recording: a graph
    replays without running Python. The graph-trees guide says so, next to the closure tensors."""
    global SCALE
    f = TorchFn(_scaled, mgr)
    try:
        for scale in (2.0, 2.0, 2.0, 3.0):
            SCALE = scale
            x = torch.randn(8)
            out = f(x)
        baked = torch.equal(out, x * 2.0)
    finally:
        SCALE = 2.0
    assert counts(mgr, f) == (1, 1, 2, 0) and baked  # the replay after the change kept 2.0
    closure = GUIDE.read_text().split("- **Closure tensors**")[1].split("\n- **")[0]
    assert "number" in closure or "scalar" in closure, closure


def test_a_python_branch_on_a_tensor_value_runs_eagerly_with_the_reason(mgr):
    def branchy(x):
        if x.sum().item() > 0:
            return x * 2.0
        return x - 1.0

    f = TorchFn(branchy, mgr)
    for sign in (1, -1, 1, -1, -1, 1):
        x = torch.rand(6) * sign
        same(f(x), branchy(x))
    st = mgr.stats[f.fn_id]
    assert st.replays == 0 and st.eager_calls >= 4
    assert any("host synchronisation" in r for r in st.skip_reasons), st.skip_reasons
    assert graph_replays(mgr) == 0


def test_a_function_writing_its_eager_inputs_in_place_matches_eager(mgr):
    def upd(x, y):
        x.mul_(0.5)
        y.add_(x)
        return (x * y).sum(), y[:2]

    f = TorchFn(upd, mgr)
    for _ in range(6):
        mgr.mark_step_begin()
        x, y = torch.randn(5), torch.randn(5)
        rx, ry = x.clone(), y.clone()
        s, head = f(x, y)
        rs, rhead = upd(rx, ry)
        same(x, rx)
        same(y, ry)
        same(s, rs)
        same(head, rhead)
        assert head.data_ptr() == y.data_ptr()  # a view of the input, rebuilt from the caller's
    assert counts(mgr, f)[2] >= 4


def test_a_tree_output_written_in_place_then_read_by_the_next_function_matches_eager(mgr):
    def foo(x):
        return x + 1.0

    def mut(t):
        t.add_(2.0)
        return t

    def tail(t):
        return t * 3.0

    F, M, T = (TorchFn(f, mgr) for f in (foo, mut, tail))
    for _ in range(5):
        mgr.mark_step_begin()
        x = torch.randn(4)
        a = F(x)
        b = M(a)
        ref = mut(foo(x))
        same(T(b), tail(ref))
        same(a, ref)
        assert b is a
    assert counts(mgr, T)[2] >= 2


def test_a_closure_buffer_updated_in_place_and_returned_matches_eager(mgr):
    buf, ref = torch.zeros(4), torch.zeros(4)

    def acc(x):
        buf.add_(x)
        return buf, buf * 2.0

    f = TorchFn(acc, mgr)
    for _ in range(6):
        mgr.mark_step_begin()
        x = torch.randn(4)
        b, twice = f(x)
        ref.add_(x)
        assert b is buf  # a closure tensor is returned as it is
        same(buf, ref)
        same(twice, ref * 2.0)
    assert counts(mgr, f)[2] >= 4


def test_a_closure_buffer_written_in_place_then_given_new_storage_warms_up_again(mgr):
    """A buffer the function only writes in place and reads (``self.acc.add_(x)``), then given new
    storage between calls (``acc.data = ...``): the recording reads it by address, so the call
    warms up again, as for a weight that moved, and matches eager."""
    m, ref = torch.nn.Module(), torch.nn.Module()
    m.register_buffer("acc", torch.zeros(3))
    ref.register_buffer("acc", torch.zeros(3))

    def step(mod, x):
        mod.acc.add_(x)
        return mod.acc * 2.0

    f = TorchFn(lambda x: step(m, x), mgr)
    for i in range(6):
        if i == 3:
            m.acc.data = torch.full((3,), 10.0)
            ref.acc.data = torch.full((3,), 10.0)
        x = torch.randn(3)
        same(f(x), step(ref, x))
        same(m.acc, ref.acc)
    assert any("reads through its closure moved" in r for r in mgr.stats[f.fn_id].rerecord_reasons)


def test_outputs_returned_twice_or_as_views_of_each_other_follow_each_replay(mgr):
    def dup(x):
        y = x * 20.0
        return y, y, y[1:], x

    f = TorchFn(dup, mgr)
    for _ in range(5):
        mgr.mark_step_begin()
        x = torch.randn(6)
        a, b, tail, c = f(x)
        same(a, x * 20.0)
        same(b, x * 20.0)
        same(tail, x[1:] * 20.0)
        assert c is x
    rec = [n.recording for n in mgr.nodes() if n.state is NodeState.RECORDED]
    assert len(rec) == 1 and isinstance(rec[0], GraphRecording)


class _KVCache:
    """A decode step's cache as transformers' ``StaticCache`` is: a plain object holding
    preallocated tensors that each step writes in place."""

    def __init__(self, rows: int, width: int):
        self.keys = torch.zeros(rows, width)
        self.length = torch.zeros((), dtype=torch.long)


def test_a_step_returning_the_cache_object_it_was_given_replays_and_returns_the_callers_object(mgr):
    """``out = step(tok, cache)`` returning ``{"logits": ..., "cache": cache}`` (a decode step
    handing back its ``past_key_values``): the object is the caller's argument, so every replay
    returns the caller's object, as eager does, and the step is recorded rather than run eagerly."""
    w = torch.randn(4, 4)

    def step(tok, cache):
        cache.keys.index_copy_(0, cache.length.view(1), (tok @ w).view(1, 4))
        cache.length.add_(1)
        return {"logits": cache.keys.sum(0) * 2.0, "cache": cache}

    mine, ref = _KVCache(16, 4), _KVCache(16, 4)
    f = TorchFn(step, mgr)
    for _ in range(8):
        mgr.mark_step_begin()
        tok = torch.randn(1, 4)
        out = f(tok, mine)
        want = step(tok, ref)
        assert out["cache"] is mine
        same(out["logits"], want["logits"])
        same(mine.keys, ref.keys)
    assert counts(mgr, f)[1:] == (1, 6, 0)


def test_a_returned_object_that_is_not_an_argument_still_runs_eagerly_with_the_reason(mgr):
    """An object cgraw cannot take apart and that the call did not pass (made anew in the
    function) would be the recording's object on every replay: the function runs eagerly."""

    class Result:
        def __init__(self, t):
            self.t = t

    f = TorchFn(lambda x: Result(x * 2.0), mgr)
    for _ in range(4):
        mgr.mark_step_begin()
        x = torch.randn(3)
        same(f(x).t, x * 2.0)
    assert counts(mgr, f)[1] == 0
    assert any("cannot take apart" in (n.skip_reason or "") for n in mgr.nodes())


def test_a_function_growing_a_list_argument_runs_eagerly_with_the_reason(mgr):
    """``f(x, log)`` appending to ``log`` (as a transformers ``DynamicCache`` grows by
    ``torch.cat``): a replay runs the device work alone and would not append, so after a second
    warm-up that changes the argument the function runs eagerly, with results and list equal to
    eager's."""

    def f(x, log):
        y = x * 2.0
        log.append(y.sum())
        return y

    mine, ref = [], []
    g = TorchFn(f, mgr)
    for _ in range(6):
        mgr.mark_step_begin()
        x = torch.randn(4)
        same(g(x, mine), f(x, ref))
    assert len(mine) == len(ref) == 6
    for a, b in zip(mine, ref):
        same(a, b)
    assert counts(mgr, g)[1:3] == (0, 0)
    assert "changes the Python state of its argument 1 (list)" in g.unsafe_reason


def test_an_attribute_set_on_the_first_call_only_still_lets_the_function_replay(mgr):
    """State an argument gets on first use (a buffer made lazily, as a ``StaticCache`` makes its
    tensors at its first update) changes it once: the node warms up again, then records and
    replays, equal to eager."""

    class Lazy:
        buf = None

    def f(x, state):
        if state.buf is None:
            state.buf = torch.zeros(4)
        state.buf.add_(x)
        return state.buf * 2.0

    mine, ref = Lazy(), Lazy()
    g = TorchFn(f, mgr)
    for _ in range(6):
        mgr.mark_step_begin()
        x = torch.randn(4)
        same(g(x, mine), f(x, ref))
        same(mine.buf, ref.buf)
    warmups, recordings, replays, eager = counts(mgr, g)
    assert (warmups, recordings, eager) == (2, 1, 0) and replays >= 3


def test_a_view_of_a_tree_output_returned_by_the_next_function_is_invalidated_with_it(mgr):
    """``y = f(x); a, v = g(y)`` with ``v = y[0]``, a view of f's output in the tree's memory: the
    next generation overwrites it, so it is handed out (poisoned when the generation ends) as
    g's own outputs are, never read stale."""
    f = TorchFn(lambda x: x * 2.0, mgr)
    g = TorchFn(lambda y: (y + 1.0, y[1:]), mgr)
    kept = []
    for _ in range(5):
        x = torch.randn(4)
        y = f(x)
        a, v = g(y)
        same(v, (x * 2.0)[1:])
        kept.append((v, (x * 2.0)[1:]))
        mgr.mark_step_begin()
        for old, want in kept:
            assert any(old is p for p in mgr.backend.poisoned) or torch.equal(old, want)
    assert mgr.stats[g.fn_id].replays >= 2


def test_a_forward_hook_runs_only_when_the_function_runs_python(mgr):
    """As the graph-trees guide says: a replay runs no Python, so a module's forward hook (one that
    collects features) runs at the warm-up and the recording, not at the replays; the results are
    eager's."""
    lin = torch.nn.Linear(4, 4)
    seen = []
    lin.register_forward_hook(lambda m, i, o: seen.append(o))
    f = TorchFn(lambda x: lin(x).relu(), mgr)
    with torch.no_grad():
        for _ in range(5):
            mgr.mark_step_begin()
            x = torch.randn(2, 4)
            same(f(x), lin(x).relu())
    assert counts(mgr, f)[:3] == (1, 1, 3)
    assert len(seen) == 2 + 5  # the warm-up and the recording, then the eager references' five


def test_a_graphed_function_called_inside_another_runs_inline_and_matches_eager(mgr):
    """``outer`` calls graphed ``inner``: inner runs inline in outer's warm-up and recording (its ops
    are outer's), so outer's replays recompute it from the new input; inner called on its own
    between steps is a tree call of its own."""
    inner_fn = lambda x: x * 2.0 + 1.0  # noqa: E731
    inner = TorchFn(inner_fn, mgr, name="inner")
    outer = TorchFn(lambda x: inner(x).relu() * 3.0, mgr, name="outer")
    for i in range(6):
        mgr.mark_step_begin()
        x = torch.randn(64)
        assert torch.equal(outer(x), inner_fn(x).relu() * 3.0), i
        assert torch.equal(inner(x), inner_fn(x)), i
    so, si = mgr.stats[outer.fn_id], mgr.stats[inner.fn_id]
    assert (so.warmups, so.recordings, so.replays) == (1, 1, 4)
    assert si.warmups + si.recordings + si.replays + si.eager_calls == 6  # its own calls only
    assert mgr.busy == 0


def test_a_function_updating_a_tree_output_then_given_the_callers_tensor_begins_at_the_root(mgr):
    """As the GPU test of the same scenario: ``mut`` warmed up, recorded and replayed on a tree
    output it updates in place, then called on the caller's own tensor (a clone of it) once the
    tree output is dead. The path is dead at that call, so ``mut`` begins at the root, where it
    warms up once and records at the next call, rather than first re-warming the node recorded on
    the tree output and then warming up again at the root. (Each replay here hands out an alias
    over the recording's own storage, so the test keeps no earlier output: on the GPU an output of
    an ended generation is not a user of the recording's memory.)"""

    def make(x):
        return x * 2.0

    def mut(y):
        y.add_(2.0)
        return y * 1.0

    fm, fmu = TorchFn(make, mgr), TorchFn(mut, mgr)
    for _ in range(2):
        mgr.mark_step_begin()
        fm(torch.randn(64))
    for _ in range(4):
        mgr.mark_step_begin()
        x = torch.randn(64)
        same(fmu(fm(x)), x * 2.0 + 2.0)
    for _ in range(4):
        mgr.mark_step_begin()
        x = torch.randn(64)
        mine = fm(x).clone()
        same(fmu(mine), x * 2.0 + 2.0)
        same(mine, x * 2.0 + 2.0)
    warmups, recordings, replays, eager = counts(mgr, fmu)
    assert (warmups, recordings, eager) == (2, 2, 0) and replays >= 4, (warmups, recordings, replays)


def test_a_strided_inputs_placeholder_keeps_its_gaps_so_a_reshape_of_it_is_a_copy(mgr):
    """The recording sees a view with gaps (``x[::2]``) in a placeholder of the caller's layout, as
    on the GPU: its ``reshape`` copies there too, so the replayed output is the recording's own
    tensor (not rebuilt from the caller's input with the copy's strides), and a view of the input
    is rebuilt as a view of the caller's tensor."""
    def f(x):
        v = x.unsqueeze(0).squeeze(0)
        return v.reshape(-1).reshape(x.shape), v

    F = TorchFn(f, mgr)
    for _ in range(4):
        mgr.mark_step_begin()
        x = torch.randn(10, 4)[::2]
        copied, view = F(x)
        want = f(x)
        same(copied, want[0])
        same(view, want[1])
        assert copied.stride() == (4, 1) and view.stride() == (8, 1) and view.data_ptr() == x.data_ptr()
    assert counts(mgr, F)[2] >= 2


def test_an_expanded_input_the_function_writes_is_copied_back_by_its_span(mgr):
    """An input whose elements overlap (``expand``) that the function writes (a self ``copy_``,
    which moves its version): its copy back covers its span's bytes, as the graph's memcpy node
    does, and every call matches eager."""
    def f(x):
        x.copy_(x)
        return x.neg()

    F = TorchFn(f, mgr)
    for _ in range(4):
        mgr.mark_step_begin()
        base = torch.randn(1, 4)
        x, twin = base.expand(5, 4), base.clone().expand(5, 4)
        same(F(x), f(twin))
        same(x, twin)
    assert counts(mgr, F)[2] >= 2
