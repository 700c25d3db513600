"""CPU tier: the whole-graph probe's ``Split`` (tools/probes/whole_graph_probe.py), which the device
runs around cgraw's call: it counts a class's method and a module's function while active, nested
calls inclusively, and puts the originals back; and its ``backend_fixed_token`` system, which feeds
each step's token from one tensor."""

from __future__ import annotations

import sys
import time
import types

import pytest

from tools.probes import whole_graph_probe as probe


def test_split_times_methods_and_functions_inclusively_and_puts_them_back():
    mod = types.ModuleType("split_fixture")

    def leaf(x):
        time.sleep(0.002)
        return x + 1

    class Outer:
        def run(self, x):
            return mod.leaf(x) * 2

    mod.leaf, mod.Outer = leaf, Outer
    sys.modules["split_fixture"] = mod
    try:
        parts = (("outer", "split_fixture", "Outer.run"), ("  leaf", "split_fixture", "leaf"))
        with probe.Split(parts) as split:
            assert [Outer().run(i) for i in range(3)] == [2, 4, 6]
        assert split.calls == {"outer": 3, "  leaf": 3}
        assert split.ns["outer"] >= split.ns["  leaf"] >= 3 * 2_000_000  # inclusive: the outer holds the leaf
        assert mod.leaf is leaf and Outer.__dict__["run"] is not None and Outer().run(1) == 4
        assert "timed" not in Outer.run.__qualname__ and mod.leaf.__qualname__.endswith("leaf")
        assert split.overhead_ns >= 0
    finally:
        del sys.modules["split_fixture"]


def test_split_parts_name_callables_that_exist():
    import importlib

    for _, module, attr in probe.SPLIT_PARTS:
        owner = importlib.import_module(module)
        for name in attr.split("."):
            owner = getattr(owner, name)
        assert callable(owner), (module, attr)


def test_the_train_step_split_keeps_the_parts_that_exist_and_names_the_others():
    """``train_step_probe --split`` times what this torch and cgraw have: every cgraw part of
    ``STEP_PARTS`` exists; a part whose module or attribute is missing is named, not timed."""
    from tools.probes import train_step_probe as tp

    extra = (("no attribute", "cgraw.trees.graphed", "NoSuch.call"), ("no module", "cgraw.no_such_module", "f"))
    have, missing = tp.present(tp.STEP_PARTS + extra)
    assert missing[-2:] == ["no attribute", "no module"]
    cgraw_parts = [p for p in tp.STEP_PARTS if p[1].startswith("cgraw.")]
    assert cgraw_parts and all(p in have for p in cgraw_parts)
    assert set(missing[:-2]) <= {label.strip() for label, module, _ in tp.STEP_PARTS if module.startswith("torch.")}


def test_the_split_wraps_every_present_part_and_puts_each_back_inherited_ones_included():
    """``Split`` times a method a class inherits (the manager's ``_with_backward`` comes from its
    autograd base) by the subclass's name, and on exit leaves every owner's attributes as they were."""
    import importlib

    from tools.probes import train_step_probe as tp

    have, _ = tp.present(tp.STEP_PARTS)
    assert ("      with backward", "cgraw.trees.manager", "TreeManager._with_backward") in have

    def owner_and_name(module, attr):
        owner = importlib.import_module(module)
        *classes, name = attr.split(".")
        for cls in classes:
            owner = getattr(owner, cls)
        return owner, name

    before = [dict(vars(owner_and_name(m, a)[0])) for _, m, a in have]
    with probe.Split(have) as split:
        for (_, m, a), saved in zip(have, before):
            owner, name = owner_and_name(m, a)
            assert name in vars(owner) and vars(owner)[name] is not saved.get(name), (m, a)
    assert [dict(vars(owner_and_name(m, a)[0])) for _, m, a in have] == before
    assert set(split.ns) == {label for label, _, _ in have}


def test_the_train_step_split_times_the_steps_eager_parts_and_the_probe_saves_its_record(tmp_path, monkeypatch):
    """A training step's ``zero_grad``, ``backward()`` and SGD step are each timed once per step
    (the split patches ``torch.autograd.backward``, which ``Tensor.backward`` calls, and the
    optimizer classes); ``save`` writes the record with the run's environment to ``$OUT``."""
    import json

    torch = pytest.importorskip("torch")
    from tools.probes import train_step_probe as tp

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # a CPU step: nothing to wait for
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(3, 4)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        opt.step()

    split = tp.split_step("cpu", step, steps=4)
    parts = split["parts"]
    for label in ("zero_grad", "backward()", "optimizer step"):
        assert parts[label][1] == 1.0 and parts[label][0] > 0, (label, parts)
    assert "compiled model call" not in parts  # not called: not listed
    assert split["step_us"] >= parts["backward()"][0]

    monkeypatch.setenv("OUT", str(tmp_path))
    path = tp.save({"cpu": {"split": split}})
    doc = json.loads(open(path).read())
    assert path == str(tmp_path / "train_step_probe.json")
    assert doc["benchmark"] == "train_step_probe" and doc["environment"]["run_id"]
    assert doc["systems"]["cpu"]["split"]["parts"]["zero_grad"][1] == 1.0


def test_the_fixed_token_system_feeds_every_step_from_one_tensor_with_each_steps_token():
    torch = pytest.importorskip("torch")
    seen = []

    def step(tok, pos):  # a decode step: the next token from this one and the position
        seen.append((tok.data_ptr(), tok.item()))
        return tok * 3 + pos

    fixed = probe._fixed_token(step)
    tok, positions = torch.tensor([[2]]), torch.arange(10, 14)
    got = []
    for i in range(4):
        tok = fixed(tok, positions[i:i + 1])
        got.append(tok.item())
    want, t = [], 2
    for i in range(4):
        t = t * 3 + 10 + i
        want.append(t)
    assert got == want
    assert len({ptr for ptr, _ in seen}) == 1  # one address: the graph's copy node never moves
    assert [v for _, v in seen] == [2] + want[:-1]


@pytest.mark.parametrize("hold", [True, False])
def test_the_split_runs_with_the_gpu_held_or_free_and_says_which(hold, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    slept = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    from benchmarks import models

    n = models.LLAMA_NEW  # the decode loop's steps; the probe divides by its positions
    wl = types.SimpleNamespace(positions=torch.arange(n), prefill=lambda cache: torch.tensor([[1]]))
    calls = []

    def call(tok, pos):
        calls.append(pos.item())
        return tok + pos

    probe._split(call, wl, None, hold=hold)
    out = capsys.readouterr().out
    assert calls == list(range(n)) * 3  # three decodes of every position
    assert len(slept) == (3 if hold else 0)
    assert ("host alone" in out) == hold and ("the GPU free" in out) == (not hold)
    assert "classify and key" in out
