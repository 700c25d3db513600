"""A recording made in training mode is not replayed in evaluation mode (and back): switches of
``nn.Module.train``/``eval`` are counted (``interop.torch.observe.mode_epoch_now``), a recording from
another mode warms up again (``ModeRewarm``), and a loop that trains and evaluates in turn is
not pushed to eager by ``config.rewarm_limit``, while a function that switches modes inside
itself on every call is."""

from __future__ import annotations

import numpy as np
import pytest
from fake_tree_backend import FakeFn, FakeTreeBackend, new

from cgraw.trees.manager import NodeState, TreeManager
from cgraw.trees.config import config
from cgraw.trees.nodes import ModeRewarm


def test_train_and_eval_count_only_real_switches():
    torch = pytest.importorskip("torch")
    from cgraw.interop.torch import observe

    observe._patch_train(torch.nn.Module)
    observe._patch_train(torch.nn.Module)  # once only: the wrapper is not wrapped again
    assert getattr(torch.nn.Module.train, "_cgraw_counts_modes", False)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4))
    e = observe.mode_epoch_now[0]
    model.train()  # already training: no switch
    assert observe.mode_epoch_now[0] == e
    model.eval()
    assert observe.mode_epoch_now[0] == e + 1 and not model[1].training
    model.eval()
    assert observe.mode_epoch_now[0] == e + 1
    model[1].train()  # one submodule alone
    assert observe.mode_epoch_now[0] == e + 2 and model[1].training and not model[0].training
    model.train()
    assert observe.mode_epoch_now[0] == e + 3 and all(m.training for m in model.modules())
    with pytest.raises(ValueError):
        model.train("yes")  # torch's own check still runs
    assert observe.mode_epoch_now[0] == e + 3


def _setup():
    be = FakeTreeBackend()
    mgr = TreeManager(be)

    def affine(x):
        return new(x.value * 2.0 + 1.0)

    f = FakeFn(affine, mgr)
    return be, mgr, f, be.tensor(np.arange(8.0))


def test_a_mode_switch_warms_up_again_and_a_train_eval_loop_stays_graphed():
    be, mgr, f, x = _setup()
    for epoch in range(3 * (config.rewarm_limit + 2)):
        be.force_moved["affine"] = ModeRewarm("a module switched between training and evaluation")
        for _ in range(4):  # warm-up, record, replays: the function replays between switches
            np.testing.assert_allclose(f(x).value, np.arange(8.0) * 2.0 + 1.0)
    node = next(iter(mgr.roots.values()))
    st = mgr.stats[f.fn_id]
    assert node.state is NodeState.RECORDED and st.eager_calls == 0, st.skip_reasons
    assert st.rerecords == 3 * (config.rewarm_limit + 2) and "training and evaluation" in st.rerecord_reasons[-1]
    assert be.count("warmup") == 1 + st.rerecords  # each switch warms up again


def test_a_function_switching_modes_on_every_call_ends_eager():
    be, mgr, f, x = _setup()
    f(x)
    for _ in range(2 * (config.rewarm_limit + 2)):  # no replay between two switches
        be.force_moved["affine"] = ModeRewarm("a module switched between training and evaluation")
        np.testing.assert_allclose(f(x).value, np.arange(8.0) * 2.0 + 1.0)
    node = next(iter(mgr.roots.values()))
    assert node.state is NodeState.SKIPPED and "warmed up again" in node.skip_reason
