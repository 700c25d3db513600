"""CPU tier of cgraw's torch dispatch modes (the warm-up Observer, the random-number router) around
higher-order operators, functorch transforms, checkpoints and torch.compile'd code: nothing raises
that eager does not, results equal eager, and the ops inside operator bodies are still seen."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from cgraw.rng import plan as rng
from cgraw.interop.torch import observe, private_api, modes as torch_modes, rng as torch_rng
from cgraw.interop.torch.kernel_state import GROUPS, OPAQUE, groups_of

pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")

_lib = torch.library.Library("cgrawtest_modes", "DEF")  # noqa: TOR901 (kept alive for the module)
_lib.define("host_side(Tensor x) -> Tensor", tags=(torch._C.Tag.cudagraph_unsafe,))
_lib.impl("host_side", lambda x: x * 3.0, "CompositeExplicitAutograd")
host_side = torch.ops.cgrawtest_modes.host_side.default


def _observe(fn, *inputs):
    obs = observe.observer(inputs)
    with obs:
        out = fn(*inputs)
    return obs, out


def _both_branches(x):
    return x.sin() * 2.0


def _unsafe_branch(x):
    return host_side(x) + 1.0


def _random_branch(x):
    return x + torch.rand(x.shape)


def test_modes_declare_higher_order_operators_and_compiled_code():
    assert private_api.higher_order_operator_class() is torch._ops.HigherOrderOperator
    assert torch._ops.OperatorBase in private_api.operator_classes()
    for cls in (type(observe.observer(())), torch_rng._make_mode_class()):
        assert issubclass(cls, torch_modes.mode_base())
        assert cls.supports_higher_order_operators and cls.ignore_compile_internals()


@pytest.mark.parametrize("pred", [True, False])
def test_observer_sees_the_ops_inside_cond_branches(pred):
    x = torch.randn(6)
    p = torch.tensor(pred)
    obs, out = _observe(lambda x: torch.cond(p, _unsafe_branch, _both_branches, (x,)), x)
    torch.testing.assert_close(out, _unsafe_branch(x) if pred else _both_branches(x))
    assert (obs.unsafe == "cgrawtest_modes.host_side.default") is pred, obs.unsafe
    obs, _ = _observe(lambda x: torch.cond(p, _both_branches, _random_branch, (x,)), x)
    assert (obs.cpu_random is not None) is not pred, obs.cpu_random


@torch.library.custom_op("cgrawtest_modes::attend", mutates_args=())
def _attend(q: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, q, q)


def test_observer_names_ops_with_their_namespace_and_a_custom_ops_settings_are_unknown():
    """The attention inside a custom op runs below the mode: its function reads every setting group."""
    q = torch.randn(1, 2, 8, 4)
    obs, out = _observe(torch.nn.functional.scaled_dot_product_attention, q, q, q)
    assert all(n.startswith("aten::") for n in obs.ops) and groups_of(obs.ops) == {"sdp"}, obs.ops
    obs, out = _observe(_attend, q)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert obs.ops == {"cgrawtest_modes::attend.default"}
    assert groups_of(obs.ops) == {*GROUPS, OPAQUE}


def test_observer_sees_the_ops_inside_while_loop_and_scan():
    x = torch.randn(5)

    def step(i, y):
        return i + 1, host_side(y) * 0.5

    def loop(x):
        return torch._higher_order_ops.while_loop(lambda i, y: i < 3, step, (torch.tensor(0), x))

    obs, (n, y) = _observe(loop, x)
    assert int(n) == 3 and obs.unsafe is not None
    torch.testing.assert_close(y, x * 1.5 ** 3)

    def body(c, r):
        return c + r, c + torch.rand(c.shape)

    obs, (_, ys) = _observe(lambda x: torch._higher_order_ops.scan(body, torch.zeros(4), x), torch.randn(3, 4))
    assert obs.cpu_random is not None and ys.shape == (3, 4)


def test_observer_around_functorch_grad_and_vmap_equals_eager():
    x, w = torch.randn(4, 3), torch.randn(3)

    def loss(w, x):
        return (torch.tanh(x @ w) ** 2).sum()

    def fn(w, x):
        g = torch.func.grad(loss)(w, x)
        per_row = torch.vmap(lambda r: (r * w).sum())(x)
        noise = torch.vmap(lambda r: r + torch.rand(()), randomness="different")(per_row)
        return g, per_row, noise

    obs, (g, per_row, noise) = _observe(fn, w, x)
    want_g, want_rows, _ = fn(w, x)
    torch.testing.assert_close(g, want_g)
    torch.testing.assert_close(per_row, want_rows)
    assert noise.shape == (4,) and obs.cpu_random is not None  # the draw under vmap is seen


@pytest.mark.parametrize("reentrant", [True, False])
def test_observer_around_checkpoint_equals_eager_with_gradients(reentrant):
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(8, 8, requires_grad=True)

    def block(x):
        return torch.relu(x @ w) @ w

    def fn(x):
        return checkpoint(block, x, use_reentrant=reentrant).sum()

    x = torch.randn(4, 8, requires_grad=True)
    obs = observe.observer([x])
    with obs:
        y = fn(x)
        y.backward()  # the recomputation runs under the Observer as well
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    fn(x).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


class _Graphs:
    """A torch.compile backend that counts the graphs Dynamo hands it and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _mode_instances():
    stream = rng.RngStream(0, 0, threading.get_ident())
    return {"observer": observe.observer(()), "random": torch_rng._make_mode_class()(stream)}


@pytest.mark.parametrize("which", ["observer", "random"])
def test_dynamo_compiles_while_a_mode_is_on_the_stack(which):
    torch._dynamo.reset()
    backend = _Graphs()
    f = torch.compile(lambda x: (x.sin() * 2.0 + 1.0).cos(), backend=backend)
    x = torch.randn(16)
    with _mode_instances()[which]:
        y = f(x)
        f(x)  # the compiled code's guards hold with the mode on: no second compilation
    torch.testing.assert_close(y, (x.sin() * 2.0 + 1.0).cos())
    assert len(backend.graphs) == 1

    from torch.utils._python_dispatch import TorchDispatchMode

    class Plain(TorchDispatchMode):  # a mode that keeps Dynamo's default: frames run uncompiled
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()
    backend = _Graphs()
    f = torch.compile(lambda x: x.sin() + 1.0, backend=backend)
    with Plain():
        f(x)
    assert backend.graphs == []


def test_reentrant_checkpoint_in_the_outputs_history_is_named():
    from torch.utils.checkpoint import checkpoint

    from cgraw.interop.torch.autograd import reentrant_checkpoint

    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    before = checkpoint(lin, x, use_reentrant=True)  # made before the call: an input's history
    for reentrant, want in ((True, "use_reentrant=True"), (False, None)):
        out = checkpoint(lin, before, use_reentrant=reentrant).tanh()
        reason = reentrant_checkpoint([out, 3], [before])
        assert (reason is None) if want is None else (want in reason), reason
    with torch.no_grad():
        assert reentrant_checkpoint([checkpoint(lin, x, use_reentrant=True)], [x]) is None


def test_saving_hooks_step_aside_for_torch_func_and_come_back():
    from cgraw.interop.torch.autograd import saving_hooks

    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    x, w = torch.randn(4, 3), torch.randn(3, requires_grad=True)

    def loss(w):
        return (torch.tanh(x @ w) ** 2).sum()

    with saving_hooks(pack, lambda t: t):
        g = torch.func.grad(loss)(w)  # torch raises under any saved-tensor hooks; these step aside
        assert private_api.top_saved_tensors_hooks()[0] is pack
        (w * 2.0).sin().sum()  # saved outside the transform: seen
    torch.testing.assert_close(g, torch.func.grad(loss)(w))
    assert packed and private_api.top_saved_tensors_hooks() is None
    with saving_hooks(pack, lambda t: t), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with pytest.raises(RuntimeError, match="saved tensor hooks"):  # a user's own hooks: as eager
            torch.func.grad(loss)(w)


def test_observer_notes_a_backward_inside_the_function():
    w = torch.randn(3, requires_grad=True)
    obs, _ = _observe(lambda x: torch.func.grad(lambda v: (v * x).sin().sum())(w), torch.randn(3))
    assert obs.backward
    obs, _ = _observe(lambda x: (x * w).sin().sum(), torch.randn(3))
    assert not obs.backward


def test_observer_counts_a_closure_tensor_the_function_writes_in_place_as_external(monkeypatch):
    """An in-place op returns its argument: a closure buffer the function writes and reads
    (``self.acc.add_(x)``) was not made by the call, so it is external (its address is checked)."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the observer notes CUDA tensors
    acc, w, x = torch.zeros(3), torch.ones(3), torch.ones(3)

    def f(x):
        acc.add_(x)
        torch.mul(x, 2.0, out=w)
        return acc * 2.0 + w

    obs, out = _observe(f, x)
    ext = obs.external([x, out])
    assert any(t is acc for t in ext) and any(t is w for t in ext), ext


def test_a_recording_that_compiled_code_runs_eagerly_once_and_the_next_call_warms_up_again(monkeypatch):
    """``cgraw.graphed(torch.compile(step))`` where the step's second call fails the guards of its
    first compile (an optimizer's state made by its first step does): the recording at the second
    call compiles inside its capture, which breaks it (the CPU backend fails such a recording as a
    GPU capture fails). That call runs eagerly, the next one warms up again, the one after records,
    and the rest replay; before, the function ran eagerly from the second call on."""
    from torch_cpu_backend import TorchFn, cpu_tree

    from cgraw.trees.nodes import COMPILED_IN_CAPTURE

    torch._dynamo.reset()
    backend = _Graphs()
    state = {"first": True}

    @torch.compile(backend=backend)
    def scale(x):
        return x * (3.0 if state["first"] else 2.0)  # dynamo guards on the value

    def step(x):
        out = scale(x)
        state["first"] = False  # made by the first call, as an optimizer's momentum buffers
        return out + 1.0

    compiled_at = []
    with cpu_tree(monkeypatch) as mgr:
        f = TorchFn(step, mgr)
        for i in range(7):
            x = torch.randn(8)
            before = len(backend.graphs)
            torch.testing.assert_close(f(x), x * (3.0 if i == 0 else 2.0) + 1.0)
            compiled_at.append(len(backend.graphs) - before)
        st = mgr.stats[f.fn_id]
        (node,) = mgr.nodes()
    assert compiled_at == [1, 1, 0, 0, 0, 0, 0]  # the recompile: inside the second call's capture
    assert (st.warmups, st.recordings, st.replays, st.eager_calls) == (2, 1, 3, 1)
    assert list(st.skip_reasons) and all(r.startswith(COMPILED_IN_CAPTURE) for r in st.skip_reasons)
    assert node.rewarms == 1
    torch._dynamo.reset()
