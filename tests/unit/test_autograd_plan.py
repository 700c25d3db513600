"""CPU tests of the pending-backward bookkeeping and the generation rule (``cgraw.trees.autograd``).

The fake backend (tests/helpers/fake_tree_backend.py) simulates autograd: a call made with grad
enabled issues a ticket, ``FakeTreeBackend.backward(out, grad)`` runs what ``loss.backward()``
would for that call (through the tree, where the backward node reads the forward capture's saved
tensors in place, as a captured backward does; eagerly; or recomputed). Gradients are compared
with the eager formula, so a forward replay that overwrote saved activations shows as a wrong
gradient. The ``scenario_*`` functions are also run with the rule removed, and must then fail.
"""

from __future__ import annotations

import logging
import threading
import types

import numpy as np
import pytest
from fake_tree_backend import GRAD, FakeFn, FakeTreeBackend, Overwritten, new, save

from allocator import check_invariants
from cgraw.trees import calls
from cgraw.trees.autograd import AutogradBook, BackwardPlan, plan_backward
from cgraw.trees.calls import GRAD as GRAD_MARK
from cgraw.errors import CgrawError
from cgraw.trees.manager import NodeState, TreeManager
from cgraw.trees.config import config

# ---------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(autouse=True)
def _grad_mode():
    calls.use_grad_mode(GRAD.probe)
    GRAD.enabled = True
    yield
    calls.use_grad_mode(None)
    GRAD.enabled = True


@pytest.fixture(autouse=True)
def _restore_config(saved_config):
    """cgraw.config put back after each test (tests/conftest.py)."""


class Tree:
    def __init__(self):
        self.be = FakeTreeBackend()
        self.mgr = TreeManager(self.be)
        self.be.mgr = self.mgr
        self.rng = np.random.default_rng(16)

    def x(self, n=64, requires_grad=True):
        v = self.rng.uniform(0.5, 2.0, n) * self.rng.choice([-1.0, 1.0], n)
        return self.be.tensor(v, requires_grad=requires_grad)

    def kinds(self, name):
        """The backward plans of ``name``'s calls so far, in order."""
        return [e[2] for e in self.be.log if e[0] == "backward" and e[1] == name]

    def recorded(self) -> set:
        return {tuple(n.fn.name for n in node.path()) for node in self.mgr.nodes()
                if node.state is NodeState.RECORDED}

    def node(self, *names):
        level, node = list(self.mgr.roots.values()), None
        for name in names:
            found = [n for n in level if n.fn.name == name]
            assert len(found) == 1, f"{len(found)} nodes named {name!r} at {names}"
            node = found[0]
            level = list(node.children.values())
        return node


@pytest.fixture
def tree():
    t = Tree()
    yield t
    check_invariants(t.be.pool)


def cube(x):
    s = new(x.value * x.value)  # saved for the backward, like an activation
    save(s)
    return new(s.value * x.value)


def cube_fn(tree, name="cube", **kw):
    """x**3, its gradient 3 x**2 g from the input (eager) or from the saved x**2 (captured)."""
    return FakeFn(cube, tree.mgr, name=name,
                  backward=lambda g, x: new(g.value * 3.0 * (x.value * x.value)),
                  backward_saved=lambda g, s: new(g.value * 3.0 * s.value), **kw)


def check_forward(out, x):
    assert np.array_equal(out.value, (x.value * x.value) * x.value)


def check_backward(tree, out, x):
    """Run the backward of ``out`` with a fresh incoming gradient and compare with eager."""
    g = tree.rng.uniform(0.5, 1.5, x.nbytes // 8)
    grad = tree.be.backward(out, g)
    np.testing.assert_array_equal(grad.value, g * 3.0 * (x.value * x.value))


def train_step(tree, f):
    x = tree.x()
    out = f(x)
    check_forward(out, x)
    check_backward(tree, out, x)


def call_after_training(tree, steps: int = 3):
    """``(f, x, out)``: a call of ``cube`` made after ``steps`` training steps (forward and backward
    replaying by then), its backward not run yet."""
    f = cube_fn(tree)
    for _ in range(steps):
        train_step(tree, f)
    x = tree.x()
    return f, x, f(x)


# ---------------------------------------------------------------------- scenarios (also run without the rule)


def scenario_forward_twice_before_one_backward(tree):
    """``a = f(x1); b = f(x2); backward of both``: the second call extends the path (``f -> f``), so
    the first forward's saved activations survive until its backward replays."""
    f = cube_fn(tree)
    train_step(tree, f)  # f trains from now on
    for step in range(5):
        gen = tree.mgr.generation
        x1, x2 = tree.x(), tree.x()
        a = f(x1)
        assert tree.mgr.generation == gen + 1  # nothing pending: the root call began a step
        b = f(x2)
        assert tree.mgr.generation == gen + 1, "a pending backward must keep the generation open"
        assert tree.mgr.current.fn is f and tree.mgr.current.parent.fn is f
        check_forward(a, x1)
        check_forward(b, x2)
        check_backward(tree, b, x2)
        check_backward(tree, a, x1)
    assert tree.mgr.stats[f.fn_id].replays >= 6
    assert tree.node("cube").state is NodeState.RECORDED
    assert tree.node("cube", "cube").state is NodeState.RECORDED
    # from the second step on (the first warmed f -> f up: eager), every backward ran through
    # the tree, none recomputed
    assert tree.kinds("cube")[-8:] == ["tree"] * 8
    assert tree.be.orphaned == []  # no forward was left without its backward


def scenario_backward_after_a_second_forward(tree):
    """torch's "backward called after a second forward": the earlier output's backward runs first."""
    f = cube_fn(tree)
    train_step(tree, f)
    for _ in range(4):
        x1, x2 = tree.x(), tree.x()
        a = f(x1)
        b = f(x2)
        check_backward(tree, a, x1)  # the second forward did not touch a's activations
        check_backward(tree, b, x2)
    assert tree.kinds("cube")[-4:] == ["tree"] * 4
    assert tree.be.orphaned == []


def scenario_pending_backward_holds_the_generation(tree):
    """While a forward's backward is pending, calls of root functions extend the path; after the
    backward the next root call begins a generation."""
    f, g = cube_fn(tree, "f"), cube_fn(tree, "g")
    train_step(tree, f)
    tree.mgr.mark_step_begin()
    train_step(tree, g)  # g begins a generation: a root function too
    assert {f.fn_id, g.fn_id} <= tree.mgr.root_fns
    for _ in range(3):
        gen = tree.mgr.generation
        x = tree.x()
        out = f(x)
        assert tree.mgr.book.pending() == [out.ticket]
        y = g(tree.x())
        assert tree.mgr.generation == gen + 1 and tree.mgr.current.parent.fn is f
        check_backward(tree, y, y_input(y))
        check_backward(tree, out, x)
        assert tree.mgr.book.pending() == []
    gen = tree.mgr.generation
    f(tree.x())
    assert tree.mgr.generation == gen + 1


def y_input(y):
    return y.ticket.data["inputs"][0]


SCENARIOS = [scenario_forward_twice_before_one_backward, scenario_backward_after_a_second_forward,
             scenario_pending_backward_holds_the_generation]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_scenario(tree, scenario):
    scenario(tree)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_scenario_fails_without_the_rule(monkeypatch, scenario):
    """The scenarios test the rule: with no backward ever pending, each of them fails."""
    monkeypatch.setattr(AutogradBook, "pending", lambda self: [])
    with pytest.raises(AssertionError):
        scenario(Tree())


# ---------------------------------------------------------------------- lifecycle of a backward


def test_training_steps_warm_up_record_and_replay_the_backward(tree):
    f = cube_fn(tree)
    for step in range(6):
        gen = tree.mgr.generation
        train_step(tree, f)
        assert tree.mgr.generation == (gen + 1 if step else gen)  # each step's root call begins one
    # forward: warm-up, recording; its backward: eager (the forward ran eagerly), then as a node of
    # the path: warm-up, recording, replays
    assert tree.kinds("cube") == ["eager"] + ["tree"] * 5
    bwd = tree.node("cube", "cube.backward")
    st = tree.mgr.stats[bwd.fn.fn_id]
    assert bwd.state is NodeState.RECORDED and (st.warmups, st.recordings, st.replays) == (1, 1, 3)
    assert tree.mgr.stats[f.fn_id].replays == 4
    assert all(t.ran == 1 for t in tree.be.tickets)


def test_handed_out_outputs_of_the_step_are_poisoned_when_the_next_begins(tree):
    f, x, out = call_after_training(tree)
    check_backward(tree, out, x)
    f(tree.x())  # the backward ran: this root call begins a generation
    with pytest.raises(Overwritten):
        _ = out.value


def test_mark_step_begin_always_begins_a_generation(tree, caplog):
    """Even with a backward pending: the pending forward is orphaned, and its backward (after the
    next generation overwrote its activations) recomputes eagerly with a logged reason."""
    f, x, out = call_after_training(tree)
    assert tree.mgr.book.pending() == [out.ticket]
    gen = tree.mgr.generation
    tree.mgr.mark_step_begin()
    assert tree.mgr.generation == gen + 1 and out.ticket.orphaned and tree.mgr.book.pending() == []
    f(tree.x())  # replays over the orphan's saved activations (out itself is poisoned; its graph lives)
    with caplog.at_level(logging.WARNING, logger="cgraw"):
        check_backward(tree, out, x)
    assert tree.kinds("cube")[-1] == "recompute"
    reasons = [r for r in tree.mgr.stats[f.fn_id].skip_reasons if r.startswith("backward ran recompute")]
    assert len(reasons) == 1 and "generation ended" in reasons[0]
    assert sum("generation ended" in r.getMessage() for r in caplog.records) == 1


def test_backward_of_one_output_of_two_does_not_hold_the_step(tree):
    """torch's "backward never called": ``x_out, y_out`` from two graphed pieces, only ``x_out``
    gets a backward. A backward ran after y's forward, so the next step begins a generation (y's
    forward is orphaned); the tree stays two deep with three recordings, as torch's does."""
    fx, fy = cube_fn(tree, "fx"), cube_fn(tree, "fy")
    for _ in range(6):
        x, y = tree.x(), tree.x()
        x_out, y_out = fx(x), fy(y)
        check_forward(y_out, y)
        check_backward(tree, x_out, x)
    assert tree.recorded() == {("fx",), ("fx", "fy"), ("fx", "fy", "fx.backward")}
    assert max(len(n.path()) for n in tree.mgr.nodes()) == 3
    assert tree.mgr.generation == 5
    assert all(t.orphaned for t in tree.be.orphaned) and {t.name for t in tree.be.orphaned} == {"fy"}


def test_dynamic_shapes_under_backward(tree):
    """Each input signature is a forward node of its own with a backward node of its own."""
    f = cube_fn(tree)
    for _ in range(4):
        for n in (16, 48, 32):
            x = tree.x(n)
            out = f(x)
            check_forward(out, x)
            check_backward(tree, out, x)
    roots = [n for n in tree.mgr.roots.values()]
    assert len(roots) == 3 and all(r.state is NodeState.RECORDED for r in roots)
    for r in roots:
        (b,) = [c for c in r.children.values() if c.fn.name == "cube.backward"]
        assert b.state is NodeState.RECORDED


def test_create_graph_recomputes_eagerly(tree):
    f, x, out = call_after_training(tree)
    grad = tree.be.backward(out, np.ones(64), create_graph=True)
    np.testing.assert_array_equal(grad.value, np.ones(64) * 3.0 * (x.value * x.value))
    assert tree.kinds("cube")[-1] == "recompute"
    assert any("create_graph" in r for r in tree.mgr.stats[f.fn_id].skip_reasons)


def test_backward_from_another_thread(tree):
    """Autograd's device thread runs the backward while the owning thread waits in backward()."""
    f, x, out = call_after_training(tree)
    errors = []
    worker = threading.Thread(target=lambda: _capture(errors, check_backward, tree, out, x))
    worker.start()
    worker.join()
    assert errors == []
    assert tree.kinds("cube")[-1] == "tree"


def _capture(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # reported to the test's thread
        errors.append(exc)


# ---------------------------------------------------------------------- grad mode and evaluation


def test_no_grad_evaluation_selects_its_own_recording(tree):
    f = cube_fn(tree, params_require_grad=True)
    for _ in range(5):
        train_step(tree, f)
        with GRAD.off():
            xv = tree.x(requires_grad=False)
            out = f(xv)
            check_forward(out, xv)
            assert not out.requires_grad and out.ticket is None
    keys = [k for (_fid, k) in tree.mgr.roots]
    assert len(keys) == 2
    grad_key = [k for k in keys if k and type(k[-1]) is tuple and k[-1][0] is GRAD_MARK]
    assert len(grad_key) == 1 and grad_key[0][-1] == (GRAD_MARK, (0,), ())  # leaf 0 requires grad, holds none
    assert all(r.state is NodeState.RECORDED for r in tree.mgr.roots.values())
    assert tree.mgr.stats[f.fn_id].recordings == 2 and tree.mgr.stats[f.fn_id].rerecords == 0
    assert tree.mgr.generation == 9  # every call of the root function began a step


def test_evaluation_between_forward_and_backward_extends_the_path(tree):
    f = cube_fn(tree, params_require_grad=True)
    train_step(tree, f)
    for _ in range(4):
        gen = tree.mgr.generation
        x = tree.x()
        out = f(x)
        with GRAD.off():
            xv = tree.x(requires_grad=False)
            check_forward(f(xv), xv)
        assert tree.mgr.generation == gen + 1 and tree.mgr.current.parent is not None
        check_backward(tree, out, x)
    assert tree.kinds("cube")[-2:] == ["tree", "tree"]


def test_requires_grad_of_the_inputs_is_part_of_the_key(tree):
    f = cube_fn(tree)
    for rg in (True, False, True, False):
        x = tree.x(requires_grad=rg)
        out = f(x)
        assert out.requires_grad is rg
        if rg:
            check_backward(tree, out, x)
    assert len(tree.mgr.roots) == 2


def test_evaluation_with_grad_enabled_deepens_the_path_at_most_once(tree):
    """Outputs that require grad, dropped without a backward (evaluation without no_grad): the
    function stops holding generations open, so the inference rule goes on as before."""
    f = cube_fn(tree, params_require_grad=True)
    for _ in range(2):
        train_step(tree, f)
    prev = None
    for _ in range(12):
        out = f(tree.x(requires_grad=False))
        if prev is not None:
            prev.ticket.freed()  # the user's variable now holds the new output: the old graph goes
        prev = out
    assert max(len(n.path()) for n in tree.mgr.nodes()) <= 3  # f, f -> f (once), f -> backward
    assert tree.mgr.book.trains[f.fn_id] is False
    train_step(tree, f)  # a backward: f trains again
    assert tree.mgr.book.trains[f.fn_id] is True


def scenario_a_live_graph_keeps_the_path(tree):
    """``loss = f(x).sum()``: f's output object is gone, its autograd graph (and a pending
    backward) lives. The path is in use: the next function extends it, and f's saved activations
    survive until the backward. Once the graph is freed and g's output dropped, everything the
    path made is dead and the next new function starts from a root."""
    f = cube_fn(tree)
    train_step(tree, f)  # f trains from now on
    g = FakeFn(lambda z: new(z.value * 2.0 - 1.0), tree.mgr, name="g")
    h = FakeFn(lambda z: new(z.value + 0.5), tree.mgr, name="h")
    for _ in range(4):
        x = tree.x()
        loss = types.SimpleNamespace(ticket=f(x).ticket)  # holds the graph, not the output
        assert tree.mgr.book.pending() == [loss.ticket]
        z = tree.x(requires_grad=False)
        yg = g(z)
        np.testing.assert_array_equal(yg.value, z.value * 2.0 - 1.0)
        assert [n.fn.name for n in tree.mgr.current.path()] == ["cube", "g"]
        check_backward(tree, loss, x)
        loss.ticket.freed()
        del loss, yg
        z = tree.x(requires_grad=False)
        np.testing.assert_array_equal(h(z).value, z.value + 0.5)
        assert [n.fn.name for n in tree.mgr.current.path()] == ["h"]
    assert tree.kinds("cube")[-3:] == ["tree"] * 3
    assert tree.mgr.stats[g.fn_id].replays == 2 and tree.mgr.stats[h.fn_id].replays == 2


def test_a_live_graph_keeps_the_path(tree):
    scenario_a_live_graph_keeps_the_path(tree)


def test_a_live_graph_keeps_the_path_fails_without_the_rule(monkeypatch):
    monkeypatch.setattr(AutogradBook, "graphs_alive", lambda self: False)
    with pytest.raises(AssertionError):
        scenario_a_live_graph_keeps_the_path(Tree())


def test_code_without_autograd_keeps_its_keys_and_generations(tree):
    calls.use_grad_mode(None)
    f = cube_fn(tree)
    for _ in range(4):
        x = tree.x()
        out = f(x)
        check_forward(out, x)
        assert not out.requires_grad
    assert tree.be.tickets == [] and tree.mgr.generation == 3
    assert not any(type(p) is tuple and p and p[0] is GRAD_MARK for (_f, k) in tree.mgr.roots for p in k)
    # a probe, but nothing requires grad: keys gain the grad entry, every ticket is never needed
    calls.use_grad_mode(GRAD.probe)
    for _ in range(3):
        f(tree.x(requires_grad=False))
    assert tree.be.tickets and all(not t.needed for t in tree.be.tickets)
    assert tree.mgr.generation == 6 and tree.be.orphaned == []


# ---------------------------------------------------------------------- orphans


def chain(tree):
    """g1 -> g2, g2 reading g1's output in place (a tree-output input)."""
    g1 = FakeFn(lambda x: new(x.value * 2.0 + 1.0), tree.mgr, name="g1", params_require_grad=True,
                backward=lambda g, x: new(g.value * 2.0), backward_saved=lambda g: new(g.value * 2.0))
    g2 = cube_fn(tree, "g2")
    return g1, g2


def test_orphan_keeps_tree_output_inputs_for_the_recompute(tree):
    g1, g2 = chain(tree)
    for _ in range(3):
        y = g1(tree.x(requires_grad=False))
        out = g2(y)
        check_backward(tree, out, y)
    y = g1(tree.x(requires_grad=False))
    out = g2(y)
    assert out.ticket.pool_inputs and out.ticket.recording is not None
    y_before = y.value
    tree.mgr.mark_step_begin()
    kept = out.ticket.data["kept"][0]
    assert kept is not y and np.array_equal(kept.value, y_before)
    g2(g1(tree.x(requires_grad=False)))  # the next generation overwrites y and the activations
    with pytest.raises(Overwritten):
        _ = y.value
    g = np.ones(64)
    grad = tree.be.backward(out, g)
    np.testing.assert_array_equal(grad.value, g * 3.0 * (kept.value * kept.value))
    assert tree.kinds("g2")[-1] == "recompute"


def test_orphan_that_cannot_be_kept_raises_naming_the_reason(tree):
    g1, g2 = chain(tree)
    for _ in range(3):
        g2(g1(tree.x(requires_grad=False)))
    out = g2(g1(tree.x(requires_grad=False)))
    tree.be.lose_orphans = "out of memory copying the inputs"
    tree.mgr.mark_step_begin()
    with pytest.raises(CgrawError, match="out of memory copying"):
        tree.be.backward(out, np.ones(64))


def test_path_repeat_limit_ends_a_generation_a_pending_backward_held(tree, caplog):
    """``h = f(h)`` with grad enabled and no backward: the path deepens up to the limit, then f
    begins a generation anyway, orphaning, with a warning that names the fixes."""
    config.path_repeat_limit = 4
    f = cube_fn(tree)
    train_step(tree, f)
    h = tree.x()
    with caplog.at_level(logging.WARNING, logger="cgraw"):
        for _ in range(12):
            h = f(fresh_input(tree, h))
    assert max(len(n.path()) for n in tree.mgr.nodes()) <= 4 + 1
    notes = [r.getMessage() for r in caplog.records if "while a backward of the step was pending" in r.getMessage()]
    assert len(notes) >= 1 and "torch.no_grad()" in notes[0] and "path_repeat_limit" in notes[0]
    assert tree.be.orphaned


def fresh_input(tree, h):
    """``h`` as a fresh eager input that requires grad (keeps values small: x**3 of |x|<1.2)."""
    return tree.be.tensor(np.clip(h.value, -1.2, 1.2), requires_grad=True)


def test_reset_orphans_every_live_ticket(tree):
    f, x, out = call_after_training(tree)
    tree.mgr.reset()
    assert out.ticket.orphaned
    check_backward(tree, out, x)
    assert tree.kinds("cube")[-1] == "recompute"


# ---------------------------------------------------------------------- the book and the plan, alone


class _Node:
    def __init__(self, recording):
        self.recording = recording


def test_pending_rule_of_the_book():
    book = AutogradBook()
    t1 = book.issue(1, "f", None, None, False)
    assert book.pending() == []  # f has never trained
    t1.backward_ran()
    t2 = book.issue(1, "f", None, None, False)
    t3 = book.issue(2, "g", None, None, False)
    assert book.pending() == [t2]  # g has never trained
    t2.freed()  # dropped unused: f stops holding generations open
    assert book.pending() == [] and book.trains[1] is False
    t4 = book.issue(2, "g", None, None, False)
    t4.backward_ran()  # g trains; t3 was issued before this backward of the generation
    assert book.pending() == []
    t5 = book.issue(2, "g", None, None, False)
    assert book.pending() == [t5]
    t6 = book.issue(2, "g", None, None, False)
    t6.never_needed()
    assert book.pending() == [t5] and t6 not in book.tickets
    orphans = book.end_generation()  # every live ticket is orphaned; returned: those never run
    assert orphans == [t3, t5] and all(t.orphaned for t in (t1, t3, t4, t5))
    assert book.pending() == [] and book.tickets == []
    t3.backward_ran()  # a backward of the ended generation does not count for the new one
    t7 = book.issue(2, "g", None, None, False)
    assert book.pending() == [t7]


def test_plan_of_each_case():
    book = AutogradBook()
    rec = object()
    node = _Node(rec)
    t = book.issue(1, "f", node, rec, False)
    assert plan_backward(t) == (BackwardPlan.TREE, None)
    assert plan_backward(t, grad_enabled=True)[0] is BackwardPlan.RECOMPUTE
    node.recording = object()
    kind, why = plan_backward(t)
    assert kind is BackwardPlan.RECOMPUTE and "replaced" in why
    node.recording = rec
    t.orphaned = True
    kind, why = plan_backward(t)
    assert kind is BackwardPlan.RECOMPUTE and "mark_step_begin" in why
    t.lost = "gone"
    assert plan_backward(t) == (BackwardPlan.ERROR, "gone")
    eager = book.issue(1, "f", None, None, True)
    assert plan_backward(eager) == (BackwardPlan.EAGER, None)
    assert plan_backward(eager, grad_enabled=True) == (BackwardPlan.EAGER, None)
    eager.orphaned = True
    assert plan_backward(eager)[0] is BackwardPlan.RECOMPUTE
    clean = book.issue(1, "f", None, None, False)
    clean.orphaned = True
    assert plan_backward(clean) == (BackwardPlan.EAGER, None)


def test_config_autograd_installs_the_grad_probe_only_while_on():
    """``cgraw.config.autograd`` (True by default) decides whether grad mode joins the key."""
    from cgraw.trees import config as tree_config

    assert config.autograd is True
    calls.use_grad_mode(None)
    config.autograd = False
    tree_config.grad_probe(GRAD.probe)
    try:
        assert calls._grad_mode[0] is None
        config.autograd = True
        assert calls._grad_mode[0] == GRAD.probe
        config.autograd = False
        assert calls._grad_mode[0] is None
    finally:
        config.autograd = True
        tree_config.grad_probe(None)
