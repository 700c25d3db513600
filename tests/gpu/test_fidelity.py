"""A replay runs what eager would run now: the settings that choose kernels select recordings of
their own, and the recorded function sees the caller's input layouts. Every call is compared with
eager under the same settings, on fresh random inputs; each test first shows that the setting or
layout changes eager's result, so that it could fail."""

from __future__ import annotations

import contextlib

import pytest
from gpu_data import crand, trand

import cgraw

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")
F = torch.nn.functional


def _stats(f):
    from cgraw.trees.graphed import _managers

    return _managers[0].stats[f.fn_id]


@contextlib.contextmanager
def _setting(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _alternate(f, eager, make_inputs, states, rounds=4, check=None):
    """Call ``f`` and ``eager`` under each state of ``states`` (context-manager factories) in
    turn, ``rounds`` times each, on fresh inputs; ``check(out, ref)`` compares."""
    for _ in range(rounds):
        for state in states:
            cgraw.mark_step_begin()
            with state():
                args = make_inputs()
                out = f(*args)
                ref = eager(*args)
            assert out.dtype == ref.dtype and out.shape == ref.shape and out.stride() == ref.stride()
            check(out, ref)


def _equal(out, ref):
    assert torch.equal(out, ref), (out - ref).abs().max().item()


def _close(out, ref):
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-5)


def test_autocast_state_selects_its_own_recording():
    lin = torch.nn.Linear(256, 256).cuda()
    f = cgraw.graphed(lin)
    x = trand(64, 256)
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert lin(x).dtype == torch.bfloat16
        states = [contextlib.nullcontext, lambda: torch.autocast("cuda", dtype=torch.bfloat16),
                  lambda: torch.autocast("cuda", dtype=torch.float16)]
        _alternate(f, lin, lambda: (trand(64, 256),), states, check=_close)
    s = _stats(f)
    assert s.recordings == 3 and s.rerecords == 0 and s.replays == 3 * 4 - 3 * 2


@pytest.mark.parametrize("flag", ["matmul", "precision"])
def test_tf32_flags_select_their_own_recording(flag):
    w = trand(1024, 1024)

    def mm(x):
        return x @ w

    if flag == "matmul":
        states = [lambda: _setting(torch.backends.cuda.matmul, "allow_tf32", False),
                  lambda: _setting(torch.backends.cuda.matmul, "allow_tf32", True)]
    else:
        def precision(p):
            @contextlib.contextmanager
            def ctx():
                old = torch.get_float32_matmul_precision()
                torch.set_float32_matmul_precision(p)
                try:
                    yield
                finally:
                    torch.set_float32_matmul_precision(old)
            return ctx
        states = [precision("highest"), precision("high")]
    x = trand(256, 1024)
    with states[0]():
        a = mm(x)
    with states[1]():
        b = mm(x)
    assert (a - b).abs().max().item() > 1e-3  # TF32 changes eager's result
    f = cgraw.graphed(mm)
    with torch.no_grad():
        _alternate(f, mm, lambda: (trand(256, 1024),), states, check=_close)
    assert _stats(f).recordings == 2


def test_cudnn_tf32_selects_its_own_recording():
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
    states = [lambda: _setting(torch.backends.cudnn, "allow_tf32", False),
              lambda: _setting(torch.backends.cudnn, "allow_tf32", True)]
    x = trand(4, 64, 32, 32)
    with torch.no_grad():
        with states[0]():
            a = conv(x)
        with states[1]():
            b = conv(x)
        assert (a - b).abs().max().item() > 1e-4  # TF32 changes eager's result (tolerance below: 2e-5)
        f = cgraw.graphed(conv)
        _alternate(f, conv, lambda: (trand(4, 64, 32, 32),), states, check=_close)
    assert _stats(f).recordings == 2


@torch.library.custom_op("cgrawtest::fidelity_attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v).contiguous()  # below the warm-up's dispatch mode: not seen


@attend.register_fake
def _(q, k, v):
    return q.new_empty(q.shape)


@pytest.mark.parametrize("op", [F.scaled_dot_product_attention, attend], ids=["aten op", "inside a custom op"])
def test_attention_backend_selects_its_own_recording(op):
    """The warm-up sees the attention op, or a custom op whose body it cannot see: either way the
    function is keyed on the attention flags."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attn(q, k, v):
        return op(q, k, v)

    def qkv():
        return tuple(trand(2, 8, 128, 64).half() for _ in range(3))

    states = [contextlib.nullcontext, lambda: sdpa_kernel(SDPBackend.MATH)]
    args = qkv()
    with torch.no_grad():
        with states[1]():
            math = attn(*args)
        assert not torch.equal(attn(*args), math)  # the backends' results differ
        f = cgraw.graphed(attn)
        _alternate(f, attn, qkv, states, check=_equal)
    assert _stats(f).recordings == 2


def test_deterministic_algorithms_select_their_own_recording():
    idx = torch.randint(0, 64, (4096,), device="cuda")

    def scatter(src):
        return torch.zeros(64, device="cuda").index_add_(0, idx, src)

    @contextlib.contextmanager
    def deterministic():
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(False)

    f = cgraw.graphed(scatter)
    with torch.no_grad():
        _alternate(f, scatter, lambda: (trand(4096),), [contextlib.nullcontext, deterministic], check=_close)
        with deterministic():  # deterministic: bitwise equal to eager
            cgraw.mark_step_begin()
            src = trand(4096)
            _equal(f(src), scatter(src))
    assert _stats(f).variants == 2


def test_default_dtype_selects_its_own_recording():
    def shift(x):
        return x + torch.ones(x.shape, device="cuda")

    @contextlib.contextmanager
    def double():
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(torch.float32)

    f = cgraw.graphed(shift)
    with torch.no_grad():
        _alternate(f, shift, lambda: (trand(1000),), [contextlib.nullcontext, double], check=_equal)
    assert _stats(f).recordings == 2


def test_inference_mode_outputs_are_what_eager_returns():
    def g(x):
        return torch.tanh(x) * 3

    f = cgraw.graphed(g)
    for _ in range(4):
        for mode in (torch.no_grad, torch.inference_mode):
            cgraw.mark_step_begin()
            x = trand(512)
            with mode():
                out, ref = f(x), g(x)
            assert out.is_inference() == ref.is_inference()
            _equal(out, ref)
            if not out.is_inference():
                (out.clone().requires_grad_() * 2).sum().backward()  # usable by autograd, as eager's


# ---------------------------------------------------------------------- layouts


def test_channels_last_input_keeps_eagers_layout_and_kernels():
    conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()

    def make():
        return (trand(8, 16, 28, 28).to(memory_format=torch.channels_last),)

    f = cgraw.graphed(conv)
    with torch.no_grad():
        x = make()[0]
        assert conv(x).is_contiguous(memory_format=torch.channels_last)
        assert not torch.equal(conv(x), conv(x.contiguous()))  # the layout picks another algorithm
        _alternate(f, conv, make, [contextlib.nullcontext], rounds=5, check=_equal)
    s = _stats(f)
    assert (s.recordings, s.replays) == (1, 3)


LAYOUTS = {
    "transposed": lambda: trand(64, 64).t(),
    "sliced": lambda: trand(64, 100)[:, 10:74],
    "mostly gaps": lambda: trand(64, 4096)[:, :128:2],
    "expanded": lambda: trand(64, 1).expand(64, 64),
    "offset": lambda: trand(64 * 64 + 3)[3:].view(64, 64),
    "far offset": lambda: trand(1 << 20)[(1 << 19) + 1:(1 << 19) + 1 + 64 * 64].view(64, 64),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_strided_inputs_keep_their_layout(name):
    w = trand(64, 48)

    def body(x):
        return torch.sin(x) * 2 + x.sum(dim=0) + x.t().contiguous().sum(dim=1)

    def mm(x):
        return x @ w

    def view(x):
        return x.t()  # an output that is a view of the input: rebuilt from the caller's tensor

    for fn in (body, mm, view):
        cgraw.reset()
        f = cgraw.graphed(fn)
        with torch.no_grad():
            x = LAYOUTS[name]()
            assert x.stride() != (64, 1) or x.storage_offset()  # not a plain contiguous tensor
            _alternate(f, fn, lambda: (LAYOUTS[name](),), [contextlib.nullcontext], rounds=5,
                       check=_equal if fn is not mm else _close)
        s = _stats(f)
        assert s.replays == 3 and not s.skip_reasons, (fn.__name__, s.skip_reasons)


def test_function_sees_the_callers_strides():
    seen = []

    def spy(x):
        seen.append((x.stride(), x.storage_offset() % 64))
        return x * 2

    f = cgraw.graphed(spy)
    base = trand(10, 130)
    x = base[:, 1:129]
    for _ in range(3):
        cgraw.mark_step_begin()
        _equal(f(x), x * 2)
    assert seen == [(x.stride(), x.storage_offset() % 64)] * 2  # the warm-up and the recording


def test_mutated_channels_last_input_is_written_back():
    def bump(x):
        x.mul_(2).add_(1)
        return x.sum(dim=(2, 3))

    f = cgraw.graphed(bump)
    for _ in range(5):
        cgraw.mark_step_begin()
        x = trand(4, 8, 6, 6).to(memory_format=torch.channels_last)
        x0 = x.clone()
        out = f(x)
        ref_x = x0.clone()
        ref = bump(ref_x)
        _equal(x, ref_x)
        torch.testing.assert_close(out, ref)
    s = _stats(f)
    assert s.recordings == 1 and not s.skip_reasons


def test_cupy_fortran_order_input_keeps_its_layout():
    seen = []

    def g(a):
        seen.append(a.strides)
        return cp.sin(a) * 2 + a.T.copy().T

    f = cgraw.graphed(g)
    for _ in range(5):
        cgraw.mark_step_begin()
        a = cp.asfortranarray(crand(128, 96))
        out, ref = f(a), g(a)
        assert out.strides == ref.strides
        assert cp.array_equal(out, ref)
    assert _stats(f).recordings == 1
    assert set(seen) == {a.strides}  # the warm-up, the recording and eager saw Fortran order


# ---------------------------------------------------------------------- gradients with respect to inputs


def _surface(x):
    return (torch.sin(x) * x).sum(dim=-1)


def _eager_grad(x):
    leaf = x.detach().clone().requires_grad_()
    _surface(leaf).sum().backward()
    return leaf.grad


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_gradients_with_respect_to_inputs_inside_a_graphed_function(how):
    def step(inp):
        r = _surface(inp)
        if how == "backward":
            r.sum().backward()
            g = inp.grad.clone()
            inp.grad = None
            return g
        (g,) = torch.autograd.grad(r.sum(), inp)
        return g * 1.0

    f = cgraw.graphed(step)
    for shape in ((64, 32), (16, 8)):
        for _ in range(5):
            cgraw.mark_step_begin()
            x = trand(*shape).requires_grad_()
            g = f(x)
            torch.testing.assert_close(g, _eager_grad(x), rtol=1e-5, atol=1e-5)
            assert x.grad is None  # as eager leaves it
    s = _stats(f)
    assert s.recordings == 2 and s.replays == 6 and not s.skip_reasons, s


def test_a_gradient_left_in_an_input_runs_eagerly_with_the_reason():
    def step(inp):
        _surface(inp).sum().backward()
        return inp.grad * 2

    f = cgraw.graphed(step)
    x = trand(32, 16).requires_grad_()
    ref = x.detach().clone().requires_grad_()
    for _ in range(4):
        cgraw.mark_step_begin()
        out = f(x)
        torch.testing.assert_close(out, step(ref))
        torch.testing.assert_close(x.grad, ref.grad)  # accumulated call after call, as eager
    s = _stats(f)
    assert s.recordings == 0 and any(".grad of eager input 0" in r for r in s.skip_reasons), s
