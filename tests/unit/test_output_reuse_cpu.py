"""CPU tests of the output objects a recording of compiled code hands out again (``trees.outputs.Reuse``):
the real ``TreeManager``, ``Reuse`` and torch's probe (``frameworks.Ops.reuse_probe``) over CPU torch,
a replay writing each result into the recording's tensors as a graph does (tests/helpers/torch_cpu_backend.py).
An object is handed out again only while nothing holds it (a Python reference, autograd's saved
tensors in C++) and nothing changed it in place; a held one is poisoned when its generation ends,
as every output is."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from torch_cpu_backend import ReusingBackend, TorchFn, cpu_tree  # noqa: E402

from cgraw.trees.outputs import Reuse, memory_in_use, reuse_for  # noqa: E402

pytestmark = pytest.mark.torch


def piece(x, w):
    return x * w, x + w, (x - w).sum(0)


@pytest.fixture
def tree(monkeypatch):
    with cpu_tree(monkeypatch, ReusingBackend) as mgr:
        yield mgr


def compiled(mgr, fn=piece, reuse=True):
    """A graphed function as the backend makes one of a forward piece of Inductor's code."""
    f = TorchFn(fn, mgr)
    f.inputs_guarded = True
    f.continues_step = False
    f.reuse_outputs = reuse
    return f


def step(mgr, f, w):
    """One step: a new generation, fresh random inputs, the piece's outputs checked against eager."""
    mgr.mark_step_begin()
    x = torch.randn(4, 3)
    outs = f(x, w)
    for got, want in zip(outs, [t.clone() for t in f.fn(x, w)], strict=True):
        assert torch.equal(got, want)
    return outs


def warmed(mgr, fn=piece, reuse=True):
    """A compiled piece past its warm-up, recording and first replay: ``(f, w)``."""
    w = torch.randn(4, 3)
    f = compiled(mgr, fn, reuse)
    for _ in range(4):
        step(mgr, f, w)
    return f, w


def recording(mgr, f):
    (node,) = [n for n in mgr.nodes() if n.fn is f]
    return node.recording


def test_a_piece_hands_out_its_last_output_objects_again_when_nothing_holds_them(tree):
    f, w = warmed(tree)
    ids = [id(t) for t in step(tree, f, w)]
    for _ in range(5):
        assert [id(t) for t in step(tree, f, w)] == ids
    assert recording(tree, f).reuse.made == 1
    assert list(tree.backend.poisoned) == []


def test_under_inference_mode_a_piece_hands_out_new_objects_at_every_replay(tree):
    """Outputs made under ``torch.inference_mode()`` are inference tensors: they have no version
    counter (reading one raised ``Inference tensors do not track version counter``) and may be
    written in place unseen, so they are never handed out again; each replay equals eager."""
    with torch.inference_mode():  # the recording's tensors, and the objects over them, are inference tensors
        f, w = warmed(tree)
        made = recording(tree, f).reuse.made
        for _ in range(4):
            outs = step(tree, f, w)
            assert all(t.is_inference() for t in outs)
    assert recording(tree, f).reuse.made == made + 4


def with_input(x, w):
    return x, x * w, x + w  # the input handed back, as AOT autograd's forward returns an input it saves


def test_an_input_handed_back_is_made_per_call_beside_the_reused_outputs(tree):
    f, w = warmed(tree, fn=with_input)
    first = step(tree, f, w)
    ids = [id(t) for t in first[1:]]
    del first
    outs = step(tree, f, w)
    assert [id(t) for t in outs[1:]] == ids
    rec = recording(tree, f)
    assert rec.owned_idx == [1, 2] and rec.reuse.made == 1


def test_a_function_that_does_not_allow_it_hands_out_new_objects_at_every_replay(tree):
    f, w = warmed(tree, reuse=False)
    held = step(tree, f, w)
    again = step(tree, f, w)
    assert all(a is not b for a, b in zip(held, again))
    assert recording(tree, f).reuse is None


def test_an_output_the_caller_holds_is_poisoned_and_the_next_replay_makes_new_objects(tree):
    f, w = warmed(tree)
    kept = step(tree, f, w)[1]
    outs = step(tree, f, w)  # the generation's end finds `kept` held
    assert all(t is not kept for t in outs)
    assert [t for t in tree.backend.poisoned] == [kept]
    assert recording(tree, f).reuse.made == 2
    ids = [id(t) for t in outs]
    del outs
    assert [id(t) for t in step(tree, f, w)] == ids  # the new ones, dropped, come back


class Saves(torch.autograd.Function):
    """Saves its second argument for its backward: autograd holds it in C++, with no Python reference."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(s)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return g * s.sum(), None


def test_an_output_autograd_saved_in_cpp_is_held_though_no_python_reference_remains(tree):
    f, w = warmed(tree)
    outs = step(tree, f, w)
    saved = id(outs[2])
    x = torch.randn(3, requires_grad=True)
    with torch.enable_grad():
        y = Saves.apply(x, outs[2])
    del outs
    gc.collect()
    again = step(tree, f, w)
    assert id(again[2]) != saved  # autograd's saved tensor is not handed out again
    assert saved in {id(t) for t in tree.backend.poisoned}
    del y


class Hands(torch.autograd.Function):
    """Returns a piece's output as its own, as AOT autograd's forward returns Inductor's outputs:
    autograd gives that very object a ``grad_fn``."""

    box: list = []  # the output, taken by the forward (not an argument: autograd would hand out a view)

    @staticmethod
    def forward(ctx, x):
        return Hands.box.pop()

    @staticmethod
    def backward(ctx, g):
        return g


def hands(x, out):
    Hands.box.append(out)
    return Hands.apply(x)


def test_an_output_autograd_made_its_own_at_every_step_is_handed_out_again(tree):
    f, w = warmed(tree)
    ids = None
    for _ in range(4):
        outs = step(tree, f, w)
        x = torch.randn(4, 3, requires_grad=True)
        with torch.enable_grad():
            y = hands(x, outs[0])
            assert y is outs[0] and y.grad_fn is not None
            y.sum().backward()
        assert torch.equal(x.grad, torch.ones(4, 3))
        ids = ids or [id(t) for t in outs]
        assert [id(t) for t in outs] == ids
        del outs, y
    assert recording(tree, f).reuse.made == 1  # a grad_fn autograd replaces at every step spoils nothing


@pytest.mark.parametrize("change", ["squeeze_", "unsqueeze_", "data", "requires_grad_", "retain_grad", "add_"])
def test_an_output_changed_in_place_and_dropped_is_not_handed_out_again(tree, change):
    f, w = warmed(tree)
    outs = step(tree, f, w)
    t = outs[0]
    if change == "squeeze_":
        t.unsqueeze_(0).squeeze_(0)  # the same sizes, a moved version counter
    elif change == "unsqueeze_":
        t.unsqueeze_(0)
    elif change == "data":
        t.data = torch.zeros(4, 3)
    elif change == "requires_grad_":
        t.requires_grad_()
    elif change == "retain_grad":
        with torch.enable_grad():
            assert hands(torch.randn(4, 3, requires_grad=True), t) is t
        t.retain_grad()  # the next backward would add to its .grad
    else:
        with torch.no_grad():
            t.add_(1.0)
    changed = id(t)
    del t, outs
    gc.collect()
    again = step(tree, f, w)  # equal to eager (step checks): a fresh object, not the changed one
    assert id(again[0]) != changed
    assert again[0].shape == (4, 3) and not again[0].requires_grad
    assert recording(tree, f).reuse.made == 2


def test_a_view_of_a_handed_out_output_keeps_its_memory_in_use(tree):
    f, w = warmed(tree)
    outs = step(tree, f, w)
    rec = recording(tree, f)
    view = outs[0][1:]
    del outs
    gc.collect()
    assert memory_in_use(rec.users) and tree.outs.alive()  # the view holds its base, the handed-out object
    del view
    gc.collect()
    assert not memory_in_use(rec.users) and not tree.outs.alive()


def test_a_discarded_recording_lets_go_of_its_objects(tree):
    f, w = warmed(tree)
    rec = recording(tree, f)
    assert rec.reuse.objs is not None
    tree.reset()
    assert rec.reuse.objs is None


class Rec:
    """The attributes ``reuse_for`` reads of a recording."""

    def __init__(self, outs):
        self.out_leaves = outs
        self.owned_idx = list(range(len(outs)))
        self.out_alias = [t.detach for t in outs]
        self.tree_views, self.out_same, self.out_args, self.bucket = (), (), False, None


def test_only_two_or_more_owned_outputs_of_a_function_that_allows_it_are_handed_out_again():
    """And a function whose other outputs are not the tree's memory (an input handed back) hands
    out the owned ones again (``test_an_input_handed_back_is_made_per_call_beside_the_reused_outputs``)."""
    class Fn:
        reuse_outputs = True

    outs = [torch.randn(3), torch.randn(3)]
    assert isinstance(reuse_for(Fn, Rec(outs)), Reuse)
    assert reuse_for(object(), Rec(outs)) is None  # no reuse_outputs
    assert reuse_for(Fn, Rec(outs[:1])) is None  # one output: the single-alias path
    for attr, value in (("out_same", ((1, 0),)), ("tree_views", (0,)), ("out_args", True), ("owned_idx", [1])):
        rec = Rec(outs)
        setattr(rec, attr, value)
        assert reuse_for(Fn, rec) is None, attr


def test_an_attribute_set_on_a_handed_out_output_stays_on_the_object_handed_out_again(tree):
    """The documented difference from eager (docs/guides/torch-compile.md): the object is the same."""
    f, w = warmed(tree)
    outs = step(tree, f, w)
    outs[0].tag = 1
    del outs
    assert step(tree, f, w)[0].tag == 1


def test_with_user_visible_cloning_a_held_output_keeps_its_values_and_the_next_replay_makes_new_objects(
        tree, saved_config):
    """``config.generation_cloning = "user_visible"``: the output held past its step is moved to a
    private copy (not poisoned), keeps the values it had, and is never handed out again."""
    saved_config.generation_cloning = "user_visible"
    f, w = warmed(tree)
    outs = step(tree, f, w)
    kept, want = outs[0], outs[0].clone()
    del outs
    again = step(tree, f, w)
    assert all(t is not kept for t in again) and torch.equal(kept, want)
    assert not torch.equal(again[0], want)  # fresh random inputs: the replay wrote new values
    assert list(tree.backend.poisoned) == [] and recording(tree, f).reuse.made == 2
