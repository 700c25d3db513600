"""GPU tier for graph trees (@cgraw.graphed): every call is compared with eager execution on
fresh random inputs."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
from gpu_data import rng, trand

import cgraw

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")


def _mgr():
    from cgraw.trees.graphed import _managers

    return _managers[0]


def _stats(f):
    return _mgr().stats[f.fn_id]


def test_lifecycle_warmup_record_replay():
    def body(x, w):
        return torch.relu(x @ w) + 1.0

    f = cgraw.graphed(body)
    for i in range(6):
        x, w = trand(32, 64), trand(64, 16)
        y = f(x, w)
        torch.testing.assert_close(y, body(x, w), rtol=1e-5, atol=1e-5)
    s = _stats(f)
    assert (s.warmups, s.recordings, s.replays) == (1, 1, 4)


def test_seed_four_graphs_tree_and_max_of_paths_memory():
    n = 4 << 20  # 16 MiB tensors, so each branch's memory is visible in the pool

    def e1(x):
        return x * x * x

    def e2(y):
        return torch.sin(y) * 2.0

    def e3(y):
        return torch.cos(y.abs()) + 1.0

    def e4(z):
        return z * 3.0 + 1.0

    g1, g2, g3, g4 = (cgraw.graphed(fn) for fn in (e1, e2, e3, e4))

    def step(x, branch):
        y = g1(x)
        z = g2(y) if branch else g3(y)
        return g4(z)

    def eager(x, branch):
        y = e1(x)
        return e4(e2(y) if branch else e3(y))

    # one path only: the memory of a single branch
    for _ in range(4):
        x = trand(n)
        torch.testing.assert_close(step(x, True), eager(x, True))
    one_path = _mgr().backend.pool.torch_reserved_bytes + _mgr().backend.pool.stats().reserved_bytes
    branches = [True, False] * 4
    random.shuffle(branches)
    for b in branches + [False, True, False]:
        x = trand(n)
        torch.testing.assert_close(step(x, b), eager(x, b))
    both = _mgr().backend.pool.torch_reserved_bytes + _mgr().backend.pool.stats().reserved_bytes
    assert both <= 1.1 * one_path, (both, one_path)
    # the tree is 1 -> 2 -> 4 and 1 -> 3 -> 4
    mgr = _mgr()
    assert len(mgr.roots) == 1
    (root,) = mgr.roots.values()
    assert root.fn is g1
    kids = {c.fn for c in root.children.values()}
    assert kids == {g2, g3}
    for c in root.children.values():
        assert [gc_.fn for gc_ in c.children.values()] == [g4]
        assert all(gc_.recording is not None for gc_ in c.children.values())
    text = cgraw.tree_text(0)
    assert "e1" in text and "e2" in text and "e3" in text and "e4" in text


def test_my_model_overwritten_output_raises():
    def my_model(x):
        return torch.matmul(x, x)

    f = cgraw.graphed(my_model)
    x = trand(10, 10)
    for _ in range(2):  # warm-up, then record: the next calls replay
        f(x)
    y1 = f(x)
    y2 = f(x)
    with pytest.raises(RuntimeError, match="overwritten by a subsequent run") as ei:
        print(y1)
    assert "my_model" in str(ei.value) and "mark_step_begin" in str(ei.value)
    torch.testing.assert_close(y2, x @ x)


def test_mark_step_begin_and_generation_cloning():
    def body(x):
        return x + 1.0

    f = cgraw.graphed(body)
    x = trand(100)
    for _ in range(3):
        f(x)
    cgraw.config.generation_cloning = "user_visible"
    try:
        y1 = f(x)
        v1 = (x + 1.0).clone()
        x.copy_(trand(100))
        cgraw.mark_step_begin()
        y2 = f(x)
        torch.testing.assert_close(y1, v1)  # cloned out of the pool, still readable
        torch.testing.assert_close(y2, x + 1.0)
    finally:
        cgraw.config.generation_cloning = None


def test_cloned_outputs_keep_eagers_layouts_and_stay_views_of_one_another():
    """With ``user_visible`` cloning, outputs that view one another (a transpose, a strided slice,
    a row of a larger buffer) are cloned together at the generation's end: each keeps eager's
    values and strides, the views still share memory with what they view, and later replays
    leave them alone."""
    def body(x):
        y = x * 2.0 + 1.0
        big = x.repeat(64, 1)
        return y, y.t(), y[1:, ::2], big[5]

    f = cgraw.graphed(body)
    cgraw.config.generation_cloning = "user_visible"
    try:
        kept = []
        for i in range(6):
            cgraw.mark_step_begin()
            x = trand(8, 8)
            outs = f(x)
            want = body(x)
            kept.append((outs, [w.clone() for w in want], [w.stride() for w in want]))
        cgraw.mark_step_begin()  # the last call's outputs are cloned out too
        torch.cuda.synchronize()
        for i, (outs, want, strides) in enumerate(kept):
            for j, (o, w) in enumerate(zip(outs, want)):
                assert torch.equal(o, w), f"call {i}, output {j} changed after its generation ended"
            assert [o.stride() for o in outs] == strides, f"call {i}: strides {[o.stride() for o in outs]}"
            y, yt, ys, row = outs
            assert yt.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() == ys.untyped_storage().data_ptr()
            assert row.untyped_storage().nbytes() < 64 * 8 * 4  # its row, not the whole buffer
        st = _stats(f)
        assert st.replays >= 3 and st.eager_calls == 0
    finally:
        cgraw.config.generation_cloning = None


def test_input_mutation_static_tree_output_and_eager():
    p = torch.nn.Parameter(trand(256), requires_grad=False)

    def upd(p, g):
        p.add_(g)
        return p.sum()

    fu = cgraw.graphed(upd)
    ref = p.detach().clone()
    for _ in range(5):
        g = trand(256)
        fu(p, g)
        ref += g
        torch.testing.assert_close(p.detach(), ref)

    def make(x):
        return x * 2.0

    def mut(y):
        y.add_(2.0)
        return y * 1.0

    fm, fmu = cgraw.graphed(make), cgraw.graphed(mut)
    for _ in range(5):
        cgraw.mark_step_begin()
        x = trand(64)
        y = fm(x)
        out = fmu(y)  # y is a tree output: mutated in place
        torch.testing.assert_close(y, x * 2.0 + 2.0)
        torch.testing.assert_close(out, x * 2.0 + 2.0)

    def mut_eager(x):
        x.mul_(2.0)
        return x + 1.0

    fe = cgraw.graphed(mut_eager)
    for _ in range(5):
        cgraw.mark_step_begin()
        x = trand(128)
        x0 = x.clone()
        out = fe(x)
        torch.testing.assert_close(x, x0 * 2.0)  # the mutation reached the caller's tensor
        torch.testing.assert_close(out, x0 * 2.0 + 1.0)


@pytest.mark.parametrize("mutates", [(), (0,)], ids=["found", "declared"])
def test_an_input_updated_in_place_reaches_the_caller_after_a_warm_up_on_a_tree_output(mutates):
    """A function first warmed up and replayed on a tree output, which it updates in place, then
    called with the caller's own tensor: it warms up again and records with a copy back, so every
    call updates the caller's tensor as eager code does."""

    def make(x):
        return x * 2.0

    def mut(y):
        y.add_(2.0)
        return y * 1.0

    fm, fmu = cgraw.graphed(make), cgraw.graphed(mut, mutates=mutates)
    for _ in range(2):  # make is recorded before mut's first call: mut's warm-up sees a tree output
        cgraw.mark_step_begin()
        fm(trand(64))
    for _ in range(4):
        cgraw.mark_step_begin()
        x = trand(64)
        y = fm(x)
        torch.testing.assert_close(fmu(y), x * 2.0 + 2.0)
        torch.testing.assert_close(y, x * 2.0 + 2.0)
    for _ in range(4):  # the caller's tensor: a warm-up, a recording, replays
        cgraw.mark_step_begin()
        x = trand(64)
        mine = fm(x).clone()
        out = fmu(mine)
        torch.testing.assert_close(mine, x * 2.0 + 2.0)
        torch.testing.assert_close(out, x * 2.0 + 2.0)
    from cgraw.trees.graphed import _managers

    st = _managers[0].stats[fmu.fn_id]
    assert st.warmups == 2 and st.replays >= 4, cgraw.report()


def test_inputs_sharing_memory_with_a_written_input_match_eager():
    """``f(x, x[2:])`` with ``f`` writing its first argument: the recording's separate copies would
    not see each other's writes, so such calls run eagerly (with the reason in ``report()``) while
    calls on separate tensors replay."""

    def upd(a, b):
        a.add_(1.0)
        return b * 2.0

    f = cgraw.graphed(upd)

    def separate():
        cgraw.mark_step_begin()
        x, y = trand(4096), trand(4096)
        x0 = x.clone()
        torch.testing.assert_close(f(x, y), y * 2.0)
        torch.testing.assert_close(x, x0 + 1.0)

    for _ in range(3):
        separate()
    for view in (lambda t: t[2:], lambda t: t):
        for _ in range(3):
            cgraw.mark_step_begin()
            x = trand(4096)
            ref_x = x.clone()
            ref_out = upd(ref_x, view(ref_x))
            out = f(x, view(x))
            torch.testing.assert_close(x, ref_x)
            torch.testing.assert_close(out, ref_out)
    for _ in range(2):
        separate()
    assert "share memory" in cgraw.report()


def test_a_closure_buffer_written_in_place_then_given_new_storage_matches_eager():
    """A buffer the function only writes in place and reads (``self.acc.add_(x)``), given new
    storage between calls (``acc.data = ...``): the call warms up again instead of replaying into
    the old address."""
    m = torch.nn.Module().cuda()
    m.register_buffer("acc", torch.zeros(256, device="cuda"))
    ref = torch.zeros(256, device="cuda")

    def step(x):
        m.acc.add_(x)
        return m.acc * 2.0

    f = cgraw.graphed(step)
    for i in range(7):
        if i == 4:
            fresh = trand(256)
            m.acc.data = fresh.clone()
            ref = fresh.clone()
        x = trand(256)
        ref = ref + x
        torch.testing.assert_close(f(x), ref * 2.0, rtol=0, atol=0)
        torch.testing.assert_close(m.acc, ref, rtol=0, atol=0)
    assert any("reads through its closure moved" in r for r in _stats(f).rerecord_reasons), cgraw.report()


def test_a_plain_object_argument_set_anew_matches_eager():
    """An argument that is a plain object (equal only to itself): its attributes are part of the
    call's signature, so one set anew selects another recording instead of replaying the old value."""

    class Settings:
        def __init__(self):
            self.scale = 2.0

    f = cgraw.graphed(lambda x, s: x * s.scale + 1.0)
    s = Settings()
    for scale in (2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 2.0):
        s.scale = scale
        x = trand(1024)
        torch.testing.assert_close(f(x, s), x * scale + 1.0)


def test_a_function_growing_a_list_argument_matches_eager_and_runs_eagerly():
    """A function appending to a list it is given (as a DynamicCache grows): a replay would not
    append, so the function runs eagerly after its second warm-up, with the reason reported."""

    def f(x, log):
        y = x * 2.0
        log.append(y.sum())
        return y

    g = cgraw.graphed(f)
    mine, ref = [], []
    for _ in range(6):
        cgraw.mark_step_begin()
        x = trand(256)
        torch.testing.assert_close(g(x, mine), f(x, ref))
    assert len(mine) == len(ref) == 6
    torch.testing.assert_close(torch.stack(mine), torch.stack(ref))
    assert _stats(g).recordings == 0 and "Python state" in cgraw.report()


def test_a_returned_argument_object_is_the_callers_on_every_replay():
    """A step returning the state object it was given (a decode step returning its cache): each
    replay returns the caller's object, and the step replays."""

    class Cache:
        def __init__(self):
            self.keys = torch.zeros(16, 8, device="cuda")
            self.length = torch.zeros((), dtype=torch.long, device="cuda")

    def step(tok, cache):
        cache.keys.index_copy_(0, cache.length.view(1), tok.view(1, 8))
        cache.length.add_(1)
        return {"total": cache.keys.sum(0), "cache": cache}

    g = cgraw.graphed(step)
    mine, ref = Cache(), Cache()
    for _ in range(8):
        cgraw.mark_step_begin()
        tok = trand(8)
        out, want = g(tok, mine), step(tok, ref)
        assert out["cache"] is mine
        torch.testing.assert_close(out["total"], want["total"])
    torch.testing.assert_close(mine.keys, ref.keys)
    assert _stats(g).recordings == 1 and _stats(g).replays >= 5


def test_a_plain_object_made_anew_per_call_replays_and_matches_eager():
    """A settings object made anew per call with equal attributes (a list among them) replays the
    recording; one whose list holds another value selects another recording."""

    class Settings:
        def __init__(self, shift):
            self.scale = 2.0
            self.shifts = [shift]

    def body(x, s):
        return x * s.scale + s.shifts[0]

    f = cgraw.graphed(body)
    for shift in (1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0):
        x = trand(1024)
        torch.testing.assert_close(f(x, Settings(shift)), body(x, Settings(shift)))
    assert _stats(f).replays >= 3


def test_an_output_viewing_an_input_as_another_dtype_is_the_callers_memory():
    """``x.view(torch.int32)`` and ``torch.view_as_real(z)`` returned: on every call they view the
    caller's input (same address, eager's values), and stay valid after the next step."""

    def body(x, z):
        return x * 2.0, x.view(torch.int32), torch.view_as_real(z)

    f = cgraw.graphed(body)
    for _ in range(5):
        x, z = trand(64), torch.randn(32, dtype=torch.complex64, device="cuda")
        y, bits, zr = f(x, z)
        want = body(x, z)
        torch.testing.assert_close(y, want[0])
        assert bits.data_ptr() == x.data_ptr() and torch.equal(bits, want[1])
        assert zr.data_ptr() == z.data_ptr() and torch.equal(zr, want[2])
        cgraw.mark_step_begin()
        assert torch.equal(bits, x.view(torch.int32))  # the caller's memory: never poisoned


def test_under_padding_buckets_returned_inputs_and_closure_tensors_are_eagers():
    """Under ``pad_buckets`` an input returned as it is (padded or not) is the caller's tensor,
    and a closure tensor with the bucket's rows is returned whole, not cut to the call's rows."""
    table = trand(8, 4)

    def body(x, scale):
        return x * scale, x, scale, table

    f = cgraw.graphed(body, pad_buckets=(8,))
    for n in (3, 3, 3, 5, 5, 5):
        x, scale = trand(n, 4), trand(())
        y, same_x, same_scale, t = f(x, scale)
        torch.testing.assert_close(y, x * scale)
        assert same_x is x and same_scale is scale and t is table


def test_a_branch_on_requires_grad_under_no_grad_matches_eager():
    """Under ``torch.no_grad()`` an input that requires grad still says so: the recording's
    placeholder requires grad too, and calls whose inputs do not select their own recording."""

    def body(x):
        return x * (2.0 if x.requires_grad else 3.0)

    f = cgraw.graphed(body)
    with torch.no_grad():
        for requires in (True, True, True, False, False, False, True):
            x = trand(256).requires_grad_(requires)
            torch.testing.assert_close(f(x), body(x))
    assert _stats(f).replays >= 3


def test_a_double_backward_through_a_graphed_forward_matches_eager():
    """The second derivative through a replayed forward reaches its input (the recomputed
    backward differentiates from the input itself)."""

    def body(x):
        return torch.sin(x) * 2.0

    f = cgraw.graphed(body)
    for _ in range(5):
        x = trand(128).requires_grad_()
        (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        (g_ref,) = torch.autograd.grad(body(x).sum(), x, create_graph=True)
        (gg_ref,) = torch.autograd.grad(g_ref.sum(), x)
        torch.testing.assert_close(g, g_ref)
        torch.testing.assert_close(gg, gg_ref)
        cgraw.mark_step_begin()


def test_an_input_written_with_unchanged_values_at_warm_up_reaches_the_caller_later():
    """``x.clamp_(min=0)`` warmed up on positive values leaves them as they were, but its version
    counter moves: the recording copies the input back, so later calls clamp the caller's tensor."""

    def body(x):
        x.clamp_(min=0.0)
        return x * 2.0

    f = cgraw.graphed(body)
    for i in range(6):
        x = trand(512).abs() if i == 0 else trand(512)
        ref = x.clone()
        want = body(ref)
        torch.testing.assert_close(f(x), want)
        torch.testing.assert_close(x, ref)
    assert _stats(f).replays >= 3


def test_a_hook_on_a_returned_view_of_a_parameter_stays_with_its_call():
    """A model returning ``weight.T`` (tied weights): a hook registered on each step's returned
    view scales that step's gradient only, as in eager (the view is made anew on every call)."""
    lin = torch.nn.Linear(16, 8).cuda()

    def body(x):
        return lin(x), lin.weight.T

    f = cgraw.graphed(body)
    for _ in range(5):
        x = trand(4, 16)
        y, wt = f(x)
        wt.register_hook(lambda g: g * 3.0)
        (y.sum() + wt.sum()).backward()
        got = lin.weight.grad.clone()
        lin.weight.grad = None
        y_ref, wt_ref = body(x)
        wt_ref.register_hook(lambda g: g * 3.0)
        (y_ref.sum() + wt_ref.sum()).backward()
        torch.testing.assert_close(got, lin.weight.grad)
        lin.weight.grad = None
        cgraw.mark_step_begin()


def test_a_function_clearing_its_list_argument_runs_eagerly_and_matches_eager():
    """torch's cudagraphify convention (``args.clear()`` inside the callee): a replay would run no
    Python and leave the caller's list full, so every call runs eagerly, with the reason."""

    def body(args):
        x = args[0]
        args.clear()
        return x * 2.0

    f = cgraw.graphed(body)
    for _ in range(4):
        x = trand(64)
        args = [x]
        torch.testing.assert_close(f(args), x * 2.0)
        assert args == []
    assert _stats(f).replays == 0 and "changes the Python state of its argument" in cgraw.report()


def test_a_module_passed_as_an_argument_trains_as_eager():
    """``f(model, x)``: the module's parameters get eager's gradients on every call (recorded and
    replayed ones included), and two outputs' separate backwards run as eager's."""
    lin = torch.nn.Linear(16, 8).cuda()
    ref = torch.nn.Linear(16, 8).cuda()
    ref.load_state_dict(lin.state_dict())

    def body(mod, x):  # two outputs with graphs of their own: each backward runs its own
        return torch.tanh(mod(x)), mod(x * 2.0) * 3.0

    f = cgraw.graphed(body)
    for _ in range(5):
        x = trand(4, 16)
        a, b = f(lin, x)
        a.sum().backward()
        b.sum().backward()
        a_ref, b_ref = body(ref, x)
        a_ref.sum().backward()
        b_ref.sum().backward()
        torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad)
        cgraw.mark_step_begin()
    assert _stats(f).replays >= 2


def test_a_view_of_a_tree_output_returned_by_the_next_function_raises_once_overwritten():
    """``v = g(f(x))[1]`` is ``y[1:]`` of f's output ``y``, in the tree's memory: read after the
    next step it raises the overwritten-output error instead of showing the next step's values."""
    f = cgraw.graphed(lambda x: x * 2.0)
    g = cgraw.graphed(lambda y: (y + 1.0, y[1:]))
    kept = None
    for i in range(5):
        x = trand(64)
        a, v = g(f(x))
        torch.testing.assert_close(v, (x * 2.0)[1:])
        if i == 3:
            kept = v
        cgraw.mark_step_begin()
    with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
        kept.sum()


def test_grad_turned_on_inside_a_no_grad_call_matches_eager():
    """``torch.enable_grad()`` inside a function called under ``no_grad``: its output requires grad
    and its backward reaches the input, on every call (such calls run eagerly, with the reason)."""

    def body(x):
        with torch.enable_grad():
            return torch.sin(x) * 2.0

    f = cgraw.graphed(body)
    for _ in range(4):
        x = trand(128).requires_grad_()
        with torch.no_grad():
            y = f(x)
        assert y.requires_grad
        y.sum().backward()
        torch.testing.assert_close(x.grad, 2.0 * torch.cos(x.detach()))
    assert "grad mode is off at the call" in cgraw.report()


def test_a_graphed_function_called_inside_another_matches_eager():
    """``outer`` calls graphed ``inner``: inner runs inside outer's warm-up and recording (its work
    is part of outer's graph), outer replays, and every call equals eager, with inner also called
    on its own between steps."""
    inner_fn = lambda x: x * 2.0 + 1.0  # noqa: E731
    inner = cgraw.graphed(inner_fn)
    outer = cgraw.graphed(lambda x: inner(x).relu() * 3.0)
    for _ in range(6):
        cgraw.mark_step_begin()
        x = trand(512)
        torch.testing.assert_close(outer(x), inner_fn(x).relu() * 3.0)
        torch.testing.assert_close(inner(x), inner_fn(x))
    assert _stats(outer).replays >= 3


def test_a_graphed_function_called_inside_a_capture_matches_eager():
    """A graphed function called inside ``cgraw.capture()``: the capture's replays compute what
    eager does with the new contents of the captured input."""
    inner_fn = lambda x: torch.tanh(x) * 2.0  # noqa: E731
    inner = cgraw.graphed(inner_fn)
    x = trand(512)
    for _ in range(3):  # warm the function up and record it outside the capture
        cgraw.mark_step_begin()
        inner(x)
    with cgraw.capture() as g:
        y = inner(x) + 1.0
    for _ in range(3):
        x.copy_(trand(512))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, inner_fn(x) + 1.0)


def test_a_tensor_returned_twice_is_one_object_on_every_call():
    def twice(x):
        y = x * 2.0
        return y, y, x

    f = cgraw.graphed(twice)
    for _ in range(4):
        cgraw.mark_step_begin()
        x = trand(64)
        a, b, c = f(x)
        assert a is b and c is x
        torch.testing.assert_close(a, x * 2.0)


def test_a_state_written_in_place_and_fed_back_matches_eager():
    """``h = f(h)`` with ``f`` writing ``h`` in place: ``h`` is the previous generation's output, in
    the memory where a replay writes its own output; such calls run eagerly, and every result
    equals eager's."""

    def f(h):
        out = h * 2.0
        h.add_(1.0)
        return out

    g = cgraw.graphed(f)
    h = trand(256)
    ref = h.clone()
    for _ in range(6):
        h, ref = g(h), f(ref)
        torch.testing.assert_close(h, ref)


def test_a_cache_written_in_place_with_the_previous_output_fed_back_replays():
    """``h = f(h, cache)`` with ``f`` writing ``cache``, not ``h``: every call after the recording
    replays, and every result and the cache equal eager's."""

    def f(h, cache):
        cache.add_(h)
        return cache * 0.5 + h

    g = cgraw.graphed(f)
    h, cache = trand(256), trand(256)
    ref_h, ref_cache = h.clone(), cache.clone()
    for _ in range(6):
        h, ref_h = g(h, cache), f(ref_h, ref_cache)
        torch.testing.assert_close(h, ref_h)
        torch.testing.assert_close(cache, ref_cache)
    st = _stats(g)
    assert (st.recordings, st.replays, st.eager_calls) == (1, 4, 0), st


def test_cupy_graphed_and_mixed():
    def body(a):
        return cp.tanh(a) * 2.0 + a

    f = cgraw.graphed(body)
    for _ in range(5):
        a = cp.asarray(rng.standard_normal(1000).astype(np.float32))
        assert cp.array_equal(f(a), body(a))

    def mixed(t):
        c = cp.exp(cp.from_dlpack(t))
        return torch.from_dlpack(c).sum(0)

    fm = cgraw.graphed(mixed)
    for _ in range(5):
        cgraw.mark_step_begin()
        t = trand(50, 20)
        torch.testing.assert_close(fm(t), torch.exp(t).sum(0), rtol=1e-5, atol=1e-4)


def test_dynamic_shapes_and_limits(caplog):
    def body(x):
        return x.softmax(-1)

    f = cgraw.graphed(body)
    for n in (4, 8, 4, 8, 4, 8):
        x = trand(n, 16)
        torch.testing.assert_close(f(x), body(x))
    assert _stats(f).variants == 2 and _stats(f).recordings == 2
    old = cgraw.config.dynamic_shape_warn_limit
    cgraw.config.dynamic_shape_warn_limit = 2
    try:
        with caplog.at_level(logging.WARNING, logger="cgraw"):
            x = trand(12, 16)
            torch.testing.assert_close(f(x), body(x))
        assert "input signatures" in caplog.text
        cgraw.config.skip_dynamic_graphs = True
        x = trand(20, 16)
        torch.testing.assert_close(f(x), body(x))
        x = trand(20, 16)
        torch.testing.assert_close(f(x), body(x))
        assert any("dynamic shapes" in r for r in _stats(f).skip_reasons)
    finally:
        cgraw.config.dynamic_shape_warn_limit = old
        cgraw.config.skip_dynamic_graphs = False


@pytest.mark.parametrize("kind", ["item", "cpu_input", "rng", "unsafe"])
def test_skips_run_eagerly_with_reason(kind, caplog):
    @cgraw.unsafe
    def host_side(x):
        return x * 2.0

    bodies = {
        "item": lambda x: x * float((x > 0).sum().item()),
        "cpu_input": lambda x: x * 2.0,
        "rng": lambda x: x + torch.randperm(x.numel(), device=x.device).reshape(x.shape).to(x.dtype) * 0.0,
        "unsafe": lambda x: host_side(x) + 1.0,
    }
    body = bodies[kind]
    f = cgraw.graphed(body)
    with caplog.at_level(logging.WARNING, logger="cgraw"):
        for _ in range(4):
            cgraw.mark_step_begin()
            x = torch.randn(64) if kind == "cpu_input" else trand(64)
            torch.testing.assert_close(f(x), body(x))
    s = _stats(f)
    assert s.eager_calls >= 2 and s.recordings == 0
    reasons = " ".join(s.skip_reasons)
    expect = {"item": "host synchronisation", "cpu_input": "CPU tensors", "rng": "random",
              "unsafe": "unsafe"}[kind]
    assert expect in reasons, reasons
    assert caplog.text.count("skipping cudagraphs") == 1
    assert expect in cgraw.report()


def test_static_argnums_address_change_rerecords():
    def body(x, w):
        return x @ w

    f = cgraw.graphed(body, static_argnums=(1,))
    w1, w2 = trand(32, 32), trand(32, 32)
    for w in (w1, w1, w1, w2, w2, w1):
        x = trand(8, 32)
        torch.testing.assert_close(f(x, w), x @ w, rtol=1e-5, atol=1e-5)
    s = _stats(f)
    assert s.rerecords == 2 and "moved" in s.rerecord_reasons[0]


def test_training_step_matches_eager():
    torch.manual_seed(0)

    def make():
        torch.manual_seed(1234)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    m_e, opt_e = make()
    m_g, opt_g = make()

    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    g = cgraw.graphed(lambda x, y: step(m_g, opt_g, x, y))
    for _ in range(20):
        x, y = trand(16, 32), trand(16, 4)
        le = step(m_e, opt_e, x, y)
        lg = g(x, y)
        torch.testing.assert_close(lg, le, rtol=1e-4, atol=1e-5)
    for pe, pg in zip(m_e.parameters(), m_g.parameters()):
        torch.testing.assert_close(pg, pe, rtol=1e-4, atol=1e-5)
    assert _mgr().stats[g.fn_id].recordings == 1


def test_report_and_reset():
    f = cgraw.graphed(lambda x: x * 5.0)
    for _ in range(3):
        x = trand(10)
        torch.testing.assert_close(f(x), x * 5.0)
    text = cgraw.report()
    assert "1 recording(s)" in text and "replay" in text
    cgraw.mark_step_begin()
    cgraw.reset()
    x = trand(10)
    torch.testing.assert_close(f(x), x * 5.0)  # a fresh tree warms up again


def test_other_thread_runs_in_a_tree_of_its_own():
    import threading

    f = cgraw.graphed(lambda x: x + 1.0)
    f(trand(4))
    seen = {}

    def other():
        try:
            for _ in range(4):
                x = trand(4)
                torch.testing.assert_close(f(x), x + 1.0)
            from cgraw.trees.graphed import _managers

            s = _managers[0].stats[f.fn_id]
            seen["counts"] = (s.warmups, s.recordings, s.replays)
        except Exception as e:  # noqa: BLE001 - reported below
            seen["error"] = repr(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen.get("counts") == (1, 1, 2), seen  # its own warm-up, recording and replays


def test_recurrent_state_loop():
    """A solver/RL loop feeding each step's output back in: h = f(h)."""

    def step(h):
        return torch.tanh(h) * 0.9 + 0.1

    f = cgraw.graphed(step)
    h = trand(512)
    ref = h.clone()
    for _ in range(10):
        prev = h
        h = f(h)
        ref = step(ref)
        torch.testing.assert_close(h, ref)
    with pytest.raises(RuntimeError, match="overwritten"):
        prev.sum()
    assert _stats(f).replays >= 7


def test_decode_loop_after_one_prefill_becomes_a_root(caplog):
    """The README's bound on path growth: ``prefill`` once, then ``tok = decode(tok)`` in a loop
    that never calls ``prefill`` again. Past ``config.path_repeat_limit`` nodes of ``decode`` on
    the path it becomes a root (one warning): recorded once, replayed, every token equal to
    eager; a token kept from an earlier call raises when read, as the generation rules say."""
    w = trand(256, 256) * 0.05

    def prefill(x):
        return torch.tanh(x @ w)

    def decode(h):
        return torch.tanh(h @ w) * 0.9 + 0.1

    p, d = cgraw.graphed(prefill), cgraw.graphed(decode)
    limit, cgraw.config.path_repeat_limit = cgraw.config.path_repeat_limit, 8
    try:
        x = trand(4, 256)
        h, ref = p(x), prefill(x)
        torch.testing.assert_close(h, ref)
        kept = None
        with caplog.at_level(logging.WARNING, logger="cgraw"):
            for i in range(40):
                h, ref = d(h), decode(ref)
                torch.testing.assert_close(h, ref)
                if i == 20:
                    kept = h
        s = _stats(d)
        assert s.promoted and s.recordings == 1 and s.replays == 40 - 8 - 2
        assert sum("path_repeat_limit" in r.getMessage() for r in caplog.records) == 1
        with pytest.raises(RuntimeError, match="overwritten"):
            kept.sum()
    finally:
        cgraw.config.path_repeat_limit = limit


def test_containers_scalars_and_none():
    def body(d, scale, flag):
        a, rest = d["a"], d["b"]
        out = a * scale + rest[0]
        if flag is None:
            out = out - 1.0
        return {"sum": out, "pair": (out * 2.0, rest[1])}

    f = cgraw.graphed(body)
    for scale in (2.0, 2.0, 2.0, 3.0, 3.0, 3.0):
        cgraw.mark_step_begin()
        d = {"a": trand(64), "b": [trand(64), 7]}
        got, ref = f(d, scale, None), body(d, scale, None)
        torch.testing.assert_close(got["sum"], ref["sum"])
        torch.testing.assert_close(got["pair"][0], ref["pair"][0])
        assert got["pair"][1] == 7
    assert _stats(f).variants == 2 and _stats(f).recordings == 2  # a changed scalar re-keys


def test_nccl_all_reduce_one_process_group(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_nccl_available():
        pytest.fail("torch was built without NCCL")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        def body(x):
            y = x * x
            dist.all_reduce(y, op=dist.ReduceOp.SUM)
            return torch.nn.functional.silu(x) * y

        f = cgraw.graphed(body)
        for _ in range(5):
            x = trand(1024)
            torch.testing.assert_close(f(x), body(x))
        assert _stats(f).recordings == 1 and _stats(f).replays == 3
    finally:
        dist.destroy_process_group()


def test_model_switched_between_train_and_eval_is_never_replayed_in_the_other_mode():
    """A graphed model called in training mode, then ``model.eval()``, then ``model.train()`` again,
    for several rounds (a train/validate loop): every call equals an eager twin in the same mode
    (batch norm with batch statistics and updates in training, with running statistics in
    evaluation; dropout only in training), the running statistics stay equal to the twin's, and
    the loop never falls back to eager (a switch warms up again; it does not count towards
    ``config.rewarm_limit`` while the function replays in between)."""
    def make():
        torch.manual_seed(7)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                   torch.nn.Dropout(0.5), torch.nn.Linear(32, 8)).cuda()

    m_e, m_g = make(), make()
    f = cgraw.graphed(m_g)
    rounds = cgraw.config.rewarm_limit + 3
    for r in range(rounds):
        for mode in ("train", "eval"):
            getattr(m_e, mode)()
            getattr(m_g, mode)()
            for i in range(4):
                cgraw.mark_step_begin()
                x = trand(64, 16)
                got = f(x).clone()
                if mode == "eval":
                    torch.testing.assert_close(got, m_e(x), rtol=1e-5, atol=1e-5,
                                               msg=lambda s, r=r, i=i: f"round {r} eval call {i}: {s}")
                else:  # dropout draws other masks on the same input; the twin's statistics see x twice too
                    cgraw.mark_step_begin()
                    again = f(x).clone()
                    m_e(x)
                    m_e(x)
                    assert not torch.equal(got, again), f"round {r} train call {i}: dropout inactive"
            torch.testing.assert_close(m_g[1].running_mean, m_e[1].running_mean, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(m_g[1].running_var, m_e[1].running_var, rtol=1e-4, atol=1e-5)
    st = _stats(f)
    assert st.eager_calls == 0 and not st.skip_reasons, st.skip_reasons
    assert st.replays >= rounds * 2 * 3, (st.replays, st.rerecord_reasons[-3:])
    assert any("training and evaluation" in r for r in st.rerecord_reasons)


def test_more_than_256_mempools_and_no_pool_id_handed_to_torchs_snapshot(device, monkeypatch):
    """The one-process GPU tier would abort in this file once the process had made
    more than 256 torch MemPools. torch 2.11's _cuda_memorySnapshot releases a reference it never
    took to each item of a (pool id, include_traces) tuple, so MemPool.snapshot() frees its id's
    int (mortal above 256 on Python 3.12) while the id still holds it. cgraw asks with None.
    This test makes the ids mortal first, then runs a plain capture and a tree (checkpoints,
    spans, the in-pool check) and checks torch was never handed a tuple."""
    import ctypes
    import sys

    from cgraw.interop.torch import private_api

    while torch.cuda.MemPool().id[1] <= 300:  # each MemPool takes the next id; these die at once
        pass
    probe = torch.cuda.MemPool()
    x = probe.id[1]
    assert x > 256
    t, keep = (0, x, False), [x, x]  # references enough that one taken by torch frees nothing
    before = sys.getrefcount(x)
    torch._C._cuda_memorySnapshot(t)  # what torch does with a tuple (for the log)
    dropped = before - sys.getrefcount(x)
    for _ in range(max(dropped, 0)):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(x))  # give back what torch took: this process stays sound
    del t, keep
    print(f"torch {torch.__version__}: _cuda_memorySnapshot dropped {dropped} reference(s) of a pool id's int")
    real, args = torch._C._cuda_memorySnapshot, []

    def spy(arg=None):
        args.append(arg)
        return real(arg)

    monkeypatch.setattr(torch._C, "_cuda_memorySnapshot", spy)
    private_api._reset()  # the private-API table caches functions
    try:
        pool = cgraw.DevicePool(device, name="mortal ids")
        a, b = trand(64, 64), trand(64, 32)
        with cgraw.capture(pool=pool) as g:
            y = torch.relu(a @ b)
        assert pool.torch_state.id[1] > 256 and pool.torch_reserved_bytes > 0
        for _ in range(3):
            a.copy_(trand(64, 64))
            g.replay()
            torch.testing.assert_close(y, torch.relu(a @ b))

        def body(x, w):
            return torch.tanh(x @ w) * 2.0

        f = cgraw.graphed(body)
        for n in (8, 8, 8, 16, 16, 8):  # warm-up, recordings, replays, a second shape
            xs, w = trand(n, 32), trand(32, 32)
            torch.testing.assert_close(f(xs, w), body(xs, w), rtol=1e-5, atol=1e-5)
        assert _stats(f).recordings >= 2 and "recording" in cgraw.report()
        del y
        pool.close()
        assert args and all(arg is None for arg in args), f"torch was handed {[a for a in args if a is not None][:3]}"
    finally:
        monkeypatch.undo()
        private_api._reset()
