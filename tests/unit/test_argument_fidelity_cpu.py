"""CPU tier: a graphed call returns what eager returns, whatever its arguments and outputs are.

Two ways in. ``calls.inspect`` directly (the call's signature key and kinds, CPU tensors on
"device 0") and the real ``TreeManager`` with the CPU stand-in of the CUDA backend
(``torch_cpu_backend.CpuTorchBackend``). The stand-in re-runs the function's Python on every
replay, with the arguments its recording was made with (``replace_leaves`` at record time), so it
shows a Python value baked into a recording, but not one read through an object at replay time:
where the CUDA backend would differ from it, a test checks the piece of the CUDA backend that
decides (``TORCH.empty_layout``: a placeholder; ``CudaBackend._output_kinds``: how an output is
handed out; ``InputAlias.rebuild``; ``out_spec``) and its docstring says what the GPU does.

Behaviour that matches eager has a passing test; a divergence is an ``xfail(strict=True)`` whose
reason names its cause.
"""

from __future__ import annotations

import collections
import pathlib
import enum
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from addresses import at_reused_address  # noqa: E402
from torch_cpu_backend import TorchFn, cpu_as_device0, cpu_tree  # noqa: E402

import cgraw  # noqa: E402
from cgraw.errors import SkipCall  # noqa: E402
from cgraw.trees import calls  # noqa: E402
from cgraw.trees.arrays import out_spec  # noqa: E402
from cgraw.trees.cuda_backend import CudaBackend  # noqa: E402
from cgraw.trees.frameworks import TORCH  # noqa: E402
from cgraw.trees.recording import InputAlias  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def dev0(monkeypatch):
    with cpu_as_device0(monkeypatch):
        yield


@pytest.fixture
def mgr(monkeypatch):
    with cpu_tree(monkeypatch) as m:
        yield m


_PLAIN = cgraw.graphed(lambda *a, **k: None)


def _key(*args, fn=_PLAIN, **kwargs):
    return calls.inspect(fn, args, kwargs, {}, 0).key


def _calls(f, make_args, n=3, kwargs=None):
    """``n`` calls of ``f`` (warm-up, recording, replays), each on fresh arguments: the results."""
    return [f(*make_args(), **(kwargs or {})) for _ in range(n)]


def _output_kinds(call, placeholders, outs):
    """How the CUDA backend hands out ``outs`` of a recording of ``call`` (every placeholder in the pool)."""
    fake = types.SimpleNamespace(_pool_owner=lambda: (lambda ptr: True))
    return CudaBackend._output_kinds(fake, call, placeholders, outs)


class _Color(enum.Enum):
    RED = 1
    BLUE = 2


class _Settings:
    """A plain object argument (equal only to itself)."""

    def __init__(self, scale):
        self.scale = scale
        self.offsets = [0.5]


# ---------------------------------------------------------------------- keys: what matches eager


def test_bool_int_and_float_arguments_that_compare_equal_select_separate_recordings(dev0):
    x = torch.randn(4)
    keys = {_key(x, True), _key(x, 1), _key(x, 1.0), _key(x, 1 + 0j)}
    assert len(keys) == 4  # the value's type is keyed with it: x * True, x * 1 and x * 1.0 differ in dtype
    assert _key(x, (True, 2)) != _key(x, (1, 2))  # inside containers too
    assert _key(x, _Color.RED) != _key(x, 1) and _key(x, _Color.RED) != _key(x, _Color.BLUE)


def test_dtype_device_size_and_string_arguments_are_keyed_by_value(dev0):
    x = torch.randn(4)
    assert _key(x, torch.float16) == _key(x, torch.float16) != _key(x, torch.bfloat16)
    assert _key(x, torch.device("cpu")) != _key(x, torch.device("meta"))
    assert _key(x, torch.Size([2, 3])) != _key(x, torch.Size([3, 2]))
    assert _key(x, torch.Size([2, 3])) != _key(x, (2, 3))
    assert _key(x, "mean") != _key(x, "sum")


def test_call_shapes_that_eager_tells_apart_have_different_keys(dev0):
    x, y = torch.randn(4), torch.randn(4)
    assert _key(x, None) != _key(x) != _key(x, s=None)  # None, missing, and by keyword
    assert _key(x, y) != _key(x, s=y) != _key(x, t=y)  # positional or keyword, and the name
    assert _key(x, ()) != _key(x, []) and _key(x, (y,)) != _key(x, [y]) != _key(x, y)
    assert _key(x, y, 1) != _key(x, 1, y)  # tensors at different positions
    assert _key([[x], y]) != _key([[x, y]]) and _key([x, [1]]) != _key([[x], 1])
    assert _key({"a": x, "b": y}) != _key({"b": y, "a": x})  # dict order: the function sees it
    nt = collections.namedtuple("nt", "a b")
    assert _key(nt(x, y)) != _key((x, y))


def test_tensor_layouts_dtypes_and_strides_are_keyed(dev0):
    x = torch.randn(4, 6)
    layouts = [x, x.t(), x[:, ::2], x[1:], x[0, 0], x[:0], torch.randn(1, 6).expand(4, 6),
               x.to(torch.int64), x > 0, x.to(torch.complex64)]
    keys = [_key(t) for t in layouts]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("make", [
    lambda: (torch.tensor(2.5),),                                  # 0-dim
    lambda: (torch.randn(0, 3),),                                  # zero elements
    lambda: (torch.randn(6, 5).t(),),                              # transposed
    lambda: (torch.randn(4, 8)[:, 1::3],),                         # gaps between elements
    lambda: (torch.randn(1, 5).expand(4, 5),),                     # stride 0
    lambda: (torch.randn(64)[40:48],),                             # far into its storage
    lambda: (torch.arange(6), torch.tensor([True, False] * 3)),    # integer and bool
    lambda: (torch.randn(5, dtype=torch.complex64),),              # complex
], ids=["0-dim", "zero-size", "transposed", "gaps", "expanded", "offset", "int-bool", "complex"])
def test_unusual_tensor_inputs_replay_what_eager_returns(mgr, make):
    def fn(*ts):
        return tuple(t * 2 + 1 for t in ts)

    f = TorchFn(fn, mgr)
    for _ in range(4):
        args = make()
        got = f(*args)
        for g, want in zip(got, fn(*args)):
            assert g.dtype == want.dtype and g.shape == want.shape and g.stride() == want.stride()
            torch.testing.assert_close(g, want)
    st = mgr.stats[f.fn_id]
    assert (st.recordings, st.replays) == (1, 2)


def test_the_same_tensor_in_two_positions_is_read_as_eager_reads_it(mgr):
    f = TorchFn(lambda a, b: a * 2 + b.sum(), mgr)
    for _ in range(4):
        x = torch.randn(8)
        torch.testing.assert_close(f(x, x), x * 2 + x.sum())


def test_outputs_with_none_scalars_dicts_and_namedtuples_keep_their_structure(mgr):
    Pair = collections.namedtuple("Pair", "lo hi")

    def fn(x, n):
        return {"pair": Pair(x.min(), x.max()), "n": n, "none": None, "rows": x.shape[0], "list": [x + 1]}

    f = TorchFn(fn, mgr)
    for n in (1, 1, 1, 2, 2):
        x = torch.randn(5)
        got, want = f(x, n), fn(x, n)
        assert type(got["pair"]) is Pair and got["n"] == n and got["none"] is None and got["rows"] == 5
        torch.testing.assert_close(got["pair"].hi, want["pair"].hi)
        torch.testing.assert_close(got["list"][0], want["list"][0])


def test_an_output_that_is_an_input_or_a_view_of_one_is_rebuilt_from_the_callers_input(dev0):
    """``CudaBackend._output_kinds``: the input itself, and a same-dtype view of it, are handed out
    from the caller's tensor on every call, sharing its memory as eager's do."""
    x = torch.randn(4, 3)
    call = calls.inspect(_PLAIN, (x,), {}, {}, 0)
    ph = TORCH.empty_layout(x)
    same, view = _output_kinds(call, {0: ph}, [ph, ph.t()[1:]])
    assert isinstance(same, InputAlias) and same.rebuild(x) is x
    v = view.rebuild(x)
    assert torch.equal(v, x.t()[1:]) and v.data_ptr() == x.t()[1:].data_ptr()


# ---------------------------------------------------------------------- keys: divergences


@pytest.mark.parametrize("zero", [float, np.float64], ids=["float", "numpy.float64"])
def test_negative_zero_argument_selects_its_own_recording(mgr, zero):
    f = TorchFn(lambda x, s: torch.full_like(x, s), mgr)
    for s in (0.0, 0.0, -0.0):  # warm-up and recording with 0.0, then -0.0
        out = f(torch.randn(3), zero(s))
    assert torch.signbit(out).all()  # eager: torch.full_like(x, -0.0) is -0.0


def test_a_nan_argument_replays(mgr):
    f = TorchFn(lambda x, s: torch.nan_to_num(x, nan=0.0) + s, mgr)
    for _ in range(5):
        out = f(torch.randn(3), float("nan"))
        assert torch.isnan(out).all()
    st = mgr.stats[f.fn_id]
    assert st.replays >= 1 and len(mgr.roots) == 1, (st.warmups, st.recordings, len(mgr.roots))


def test_a_plain_object_made_anew_per_call_with_the_same_attributes_replays(mgr):
    f = TorchFn(lambda x, s: x * s.scale, mgr)
    for _ in range(4):
        x = torch.randn(3)
        torch.testing.assert_close(f(x, _Settings(2.0)), x * 2.0)
    assert mgr.stats[f.fn_id].replays >= 1 and len(mgr.roots) == 1


def test_a_plain_object_holding_nested_values_made_anew_per_call_replays(mgr):
    inner = collections.namedtuple("inner", "lo hi")

    class Cfg:
        def __init__(self):
            self.dims = {"lo": -1.0, "hi": 1.0}
            self.sub = _Settings(0.5)
            self.kind = torch.float32
            self.bounds = inner(-1.0, 1.0)

    f = TorchFn(lambda x, c: (x * c.sub.scale).clamp(c.dims["lo"], c.dims["hi"]).to(c.kind), mgr)
    for _ in range(4):
        x = torch.randn(3)
        torch.testing.assert_close(f(x, Cfg()), (x * 0.5).clamp(-1.0, 1.0))
    assert mgr.stats[f.fn_id].replays >= 1 and len(mgr.roots) == 1


def test_a_torch_size_argument_and_output_stay_torch_sizes(mgr):
    """torch's pytree flattens a ``torch.Size`` and gives back a plain tuple: a function that
    receives or returns one gets a ``torch.Size``, as in eager."""
    def fn(x, size):
        return x.sum() + (1.0 if isinstance(size, torch.Size) else 0.0), size, x.shape

    f = TorchFn(fn, mgr)
    for _ in range(4):
        x = torch.randn(3, 2)
        out, size, shape = f(x, torch.Size([2, 5]))
        torch.testing.assert_close(out, x.sum() + 1.0)
        assert type(size) is torch.Size and size == (2, 5) and type(shape) is torch.Size and shape == (3, 2)
    assert mgr.stats[f.fn_id].replays >= 1


def _clears(args):
    x = args[0]
    args.clear()  # torch's cudagraphify convention: the callee frees its inputs
    return x + 1


def _notes(d):
    d["seen"] = d.get("seen", 0) + 1
    return d["x"] * 2


def _counts(x, s):
    s.calls = getattr(s, "calls", 0) + 1
    return x * s.scale


@pytest.mark.parametrize("fn, make, check", [
    (_clears, lambda: ([torch.randn(3)],), lambda args: args[0] == []),
    (_notes, lambda: ({"x": torch.randn(3)},), lambda args: args[0]["seen"] == 1),
    (_counts, lambda: (torch.randn(3), _Settings(2.0)), lambda args: args[1].calls == 1),
], ids=["list-cleared", "dict-item-set", "attribute-counted"])
def test_a_function_changing_an_argument_in_place_runs_eagerly_with_the_reason(monkeypatch, fn, make, check):
    """A replay runs no Python: the change would not happen. The warm-up sees it (a snapshot of
    what the arguments reach differs after the call); after a second warm-up that sees it, every
    call runs eagerly (on the CPU graph emulator)."""
    from cpu_graph import CpuGraphBackend

    with cpu_tree(monkeypatch, CpuGraphBackend) as m:
        f = TorchFn(fn, m)
        for _ in range(4):
            args = make()
            f(*args)
            assert check(args)
        st = m.stats[f.fn_id]
        assert st.replays == 0 and "changes the Python state of its argument" in next(iter(st.skip_reasons))


def test_a_function_reading_container_and_object_arguments_keeps_replaying(monkeypatch):
    from cpu_graph import CpuGraphBackend

    with cpu_tree(monkeypatch, CpuGraphBackend) as m:
        f = TorchFn(lambda xs, d, s: xs[0] * d["k"] + s.scale, m)
        for _ in range(4):
            x = torch.randn(3)
            torch.testing.assert_close(f([x], {"k": 2.0}, _Settings(1.0)), x * 2.0 + 1.0)
        assert m.stats[f.fn_id].replays == 2


def test_keyword_arguments_reach_the_function_in_the_callers_order(mgr):
    f = TorchFn(lambda **kw: torch.stack(list(kw.values())), mgr)
    for _ in range(3):
        b, a = torch.zeros(2), torch.ones(2)
        torch.testing.assert_close(f(b=b, a=a), torch.stack([b, a]))


def test_a_plain_object_attribute_set_to_an_equal_number_of_another_type_selects_another_recording(mgr):
    s = _Settings(1)
    f = TorchFn(lambda x, s: x * s.scale, mgr)
    for _ in range(2):
        assert f(torch.arange(4), s).dtype == torch.int64
    s.scale = 1.0
    assert f(torch.arange(4), s).dtype == torch.float32  # eager: int tensor * 1.0 is float


def test_a_plain_object_attribute_replaced_by_a_list_at_a_reused_address_selects_another_recording(dev0):
    x, s = torch.randn(4), _Settings(1.0)
    old = id(s.offsets)
    first = _key(x, s)
    s.offsets = at_reused_address(lambda: setattr(s, "offsets", None), old, lambda: [0.9])
    assert _key(x, s) != first


def test_a_module_argument_counts_by_itself_and_its_tensors_as_the_guide_says(dev0):
    """A module argument is keyed by itself, its parameters and its buffers; its other attributes
    (LeakyReLU.negative_slope, Dropout.p) are numbers of the closure kind, which keep their
    recorded value: the graph-trees guide says so."""
    x, act = torch.randn(4), torch.nn.LeakyReLU(0.1)
    before = _key(x, act)
    act.negative_slope = 0.3
    assert _key(x, act) == before
    guide = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "graph-trees.md").read_text()
    assert "its other attributes, such as a dropout's `p`,\n  are numbers of the closure kind" in guide


def test_a_module_made_anew_at_a_reused_address_selects_another_recording(dev0):
    x = torch.randn(4)
    act = torch.nn.LeakyReLU(0.1)
    old, first = id(act), _key(x, act)
    holder = [act]
    del act
    new = at_reused_address(holder.clear, old, lambda: torch.nn.LeakyReLU(0.5))
    assert _key(x, new) != first


def test_a_plain_object_argument_beside_a_padded_tensor_is_accepted(mgr):
    class PadFn(TorchFn):
        pad_buckets = (4, 8)
        plain = False

    f = PadFn(lambda s, x: x * s.scale, mgr)
    s = _Settings(2.0)
    for _ in range(3):
        x = torch.randn(3, 2)
        torch.testing.assert_close(f(s, x), x * 2.0)


# ---------------------------------------------------------------------- tensors: divergences


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_a_conjugate_or_negative_view_input_runs_eagerly_with_the_reason(dev0, bit):
    """A conjugate or negative view has its base's memory: a recording's copy of its bytes would read
    the base's values. Such a call runs eagerly, with the reason, on every path of ``calls.inspect``."""
    if bit == "conj":
        base = torch.randn(4, dtype=torch.complex64)
        view = base.conj()
    else:
        base = torch.randn(4)
        view = torch._neg_view(base)
    for args in ((view,), (view, base), ([view],)):
        with pytest.raises(SkipCall, match="conjugate or negative view"):
            calls.inspect(_PLAIN, args, {}, {}, 0)


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_an_output_that_is_a_conjugate_or_negative_view_of_an_input_keeps_its_values(dev0, bit):
    x = torch.randn(4, dtype=torch.complex64) if bit == "conj" else torch.randn(4)
    call = calls.inspect(_PLAIN, (x,), {}, {}, 0)
    ph = TORCH.clone_layout(x)
    out = ph.conj() if bit == "conj" else torch._neg_view(ph)
    (kind,) = _output_kinds(call, {0: ph}, [out])
    assert not isinstance(kind, InputAlias)  # as_strided would drop the bit: handed out as the recording's view
    want = x.conj() if bit == "conj" else -x
    assert torch.equal(out.detach(), want)  # the placeholder holds x on every replay: the view's values follow


_RETYPED = {
    "int32": (lambda: torch.randn(4, 6), lambda t: t.view(torch.int32)),
    "int32-rows": (lambda: torch.randn(4, 6), lambda t: t[1:].view(torch.int32)[:, 2:]),
    "uint8": (lambda: torch.randn(4, 6), lambda t: t.view(torch.uint8)),
    "half-pairs": (lambda: torch.randn(4, 6), lambda t: t.view(torch.float16)),
    "float64": (lambda: torch.randn(4, 6), lambda t: t.view(torch.float64)),
    "real": (lambda: torch.randn(5, dtype=torch.complex64), lambda t: t.real),
    "imag": (lambda: torch.randn(5, dtype=torch.complex64), lambda t: t.imag),
    "view_as_real": (lambda: torch.randn(5, dtype=torch.complex64), torch.view_as_real),
    "view_as_complex": (lambda: torch.randn(5, 2), torch.view_as_complex),
    "offset-real": (lambda: torch.randn(9, dtype=torch.complex128)[3:], lambda t: t.real[1:]),
}


@pytest.mark.parametrize("name", sorted(_RETYPED))
def test_an_output_that_views_an_input_as_another_dtype_shares_the_callers_memory(dev0, name):
    """``CudaBackend._output_kinds`` hands such an output out as an ``InputAlias``: rebuilt over
    the caller's input of each call, it is eager's view of that input (values, layout, memory)."""
    make, view = _RETYPED[name]
    x = make()
    call = calls.inspect(_PLAIN, (x,), {}, {}, 0)
    ph = TORCH.clone_layout(x)
    (kind,) = _output_kinds(call, {0: ph}, [view(ph)])
    assert isinstance(kind, InputAlias)
    for _ in range(2):
        y = make()  # another call's input, at another address
        got, want = kind.rebuild(y), view(y)
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        assert got.data_ptr() == want.data_ptr()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_a_real_view_of_a_complex_input_that_requires_grad_carries_its_gradient(dev0):
    x = torch.randn(5, dtype=torch.complex64)
    call = calls.inspect(_PLAIN, (x,), {}, {}, 0)
    ph = TORCH.clone_layout(x)
    (kind,) = _output_kinds(call, {0: ph}, [torch.view_as_real(ph)])
    y = torch.randn(5, dtype=torch.complex64, requires_grad=True)
    g = torch.randn(5, 2)
    (kind.rebuild(y) * g).sum().backward()
    got, y.grad = y.grad, None
    (torch.view_as_real(y) * g).sum().backward()
    torch.testing.assert_close(got, y.grad)


def test_a_returned_int_view_of_an_input_is_written_through_as_eager(monkeypatch):
    """The emulator's replay hands the view out over the caller's input: a write through it
    reaches the input, and it stays valid after the next step, as eager's does."""
    from cpu_graph import CpuGraphBackend

    with cpu_tree(monkeypatch, CpuGraphBackend) as m:
        f = TorchFn(lambda x: (x * 2, x.view(torch.int32)), m)
        for _ in range(4):
            x = torch.randn(6)
            y, bits = f(x)
            torch.testing.assert_close(y, x * 2)
            assert bits.data_ptr() == x.data_ptr()
            bits[0] = 0
            assert x[0].item() == 0.0
            m.mark_step_begin()
            assert torch.equal(bits, x.view(torch.int32))  # not poisoned: it is the caller's memory


def test_under_padding_buckets_an_input_returned_as_it_is_is_the_callers_tensor(dev0):
    f = cgraw.graphed(lambda x, scale: (x * scale, scale), pad_buckets=(4, 8))
    x, scale = torch.randn(3, 2), torch.tensor(2.0)
    call = calls.inspect(f, (x, scale), {}, {}, 0)
    assert call.bucket == 4 and call.padded == {0}
    ph_x, ph_scale = TORCH.empty((4, 2), x), TORCH.empty_layout(scale)
    _, kind = _output_kinds(call, {0: ph_x, 1: ph_scale}, [ph_x * ph_scale, ph_scale])
    assert isinstance(kind, InputAlias) and kind.rebuild(scale) is scale


_W = torch.randn(4, 5)


@pytest.mark.parametrize("fn, replays", [
    (lambda x: (x @ _W, x, _W), True),  # rows in the first dimension, an input, a closure tensor
    (lambda x: (x * 2.0, x.shape[0]), False),  # a Python value that follows the rows
    (lambda x: (x * 2.0).t(), False),  # rows in the second dimension, the first is the bucket's size
    (lambda x: x @ _W[:, :4], True),  # (rows, 4): 4, the bucket, is also its second dimension
], ids=["rowwise", "row-count", "transposed", "square"])
def test_under_padding_buckets_every_call_returns_eagers_shapes_and_values(monkeypatch, fn, replays):
    """The CPU graph emulator with padding (as ``cuda_backend``): the outputs to cut back to the
    call's rows are those whose first dimension followed the rows between the warm-up (3 rows) and
    the recording (the bucket's 4); a Python value or another dimension that followed them runs the
    function eagerly, with the reason."""
    from cpu_graph import CpuGraphBackend

    class PadFn(TorchFn):
        pad_buckets = (4, 8)
        plain = False

    def check(got, want):
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want, strict=True):
            if isinstance(w, torch.Tensor):
                assert g.shape == w.shape
                torch.testing.assert_close(g, w)
            else:
                assert g == w

    with cpu_tree(monkeypatch, CpuGraphBackend) as m:
        f = PadFn(fn, m)
        for n in (3, 3, 3, 2, 4, 3):
            x = torch.randn(n, 4)
            check(f(x), fn(x))
        st = m.stats[f.fn_id]
        assert (st.replays >= 3) == replays, (st.replays, st.skip_reasons)
        assert replays or "pad_buckets" in next(iter(st.skip_reasons))


@pytest.mark.parametrize("view", [
    lambda x: x[:, 1:], lambda x: x[:, 0], lambda x: x.unsqueeze(1), lambda x: x.view(x.shape[0], 2, 2),
], ids=["columns", "column", "unsqueeze", "split-rows"])
def test_under_padding_buckets_a_row_view_of_an_input_is_the_callers_memory(monkeypatch, view):
    """As eager's view: written through to the input, and not poisoned when the generation ends."""
    from cpu_graph import CpuGraphBackend

    class PadFn(TorchFn):
        pad_buckets = (4, 8)
        plain = False

    with cpu_tree(monkeypatch, CpuGraphBackend) as m:
        f = PadFn(lambda x: (x * 2.0, view(x)), m)
        for n in (3, 3, 3, 2, 4, 3):
            x = torch.randn(n, 4)
            y, v = f(x)
            want = view(x)
            assert v.shape == want.shape and v.stride() == want.stride() and v.data_ptr() == want.data_ptr()
            torch.testing.assert_close(y, x * 2.0)
            assert not any(v is p for p in m.backend.poisoned)
        assert m.stats[f.fn_id].replays >= 3


def test_bucket_output_rows_follow_the_warm_up_shapes():
    from cgraw.trees import buckets

    outs = [torch.empty(4, 3), torch.empty(4, 4), torch.empty(5)]
    assert buckets.out_rows(outs, 4) == [0, 1]  # without a warm-up: every first dimension of 4
    assert buckets.out_rows(outs, 4, (2, [(2, 3), (4, 4), (5,)], [])) == [0]
    with pytest.raises(SkipCall, match="cannot be cut back"):
        buckets.out_rows(outs, 4, (2, [(2, 3), (4, 2), (5,)], []))
    with pytest.raises(SkipCall, match="Python value"):
        buckets.out_rows(outs[:1], 4, (2, [(2, 3)], [2]), ("seq", tuple, [("t",), ("v", 4)]))


def test_a_tensor_subclass_argument_runs_eagerly_with_the_reason(dev0):
    """A subclass with behaviour of its own would run as a plain tensor in a recording (its
    placeholder is plain): such a call runs eagerly, with the reason; a parameter subclass is a
    static input (below)."""

    class Tagged(torch.Tensor):
        pass

    t = torch.randn(4).as_subclass(Tagged)
    for args in ((t,), (t, torch.randn(4)), ([t],)):
        with pytest.raises(SkipCall, match="tensor subclass input"):
            calls.inspect(_PLAIN, args, {}, {}, 0)


def test_a_parameter_subclass_argument_is_a_static_input(dev0):
    class MyParam(torch.nn.Parameter):
        pass

    p = MyParam(torch.randn(3))
    call = calls.inspect(_PLAIN, (p, torch.randn(3)), {}, {}, 0)
    assert call.kinds == [calls.STATIC, calls.EAGER]


def test_an_input_that_requires_grad_is_seen_requiring_grad_under_no_grad(mgr):
    f = TorchFn(lambda x: x * (2.0 if x.requires_grad else 3.0), mgr)
    for _ in range(3):
        x = torch.randn(4).requires_grad_()
        torch.testing.assert_close(f(x), x.detach() * 2.0)


def test_calls_whose_inputs_do_and_do_not_require_grad_under_no_grad_select_their_own_recordings(monkeypatch):
    """On the CPU graph emulator (the branch is Python, taken once at record time, as on the GPU)."""
    from cpu_graph import CpuGraphBackend

    def fn(x, y):
        return x * (2.0 if x.requires_grad else 3.0) + (1.0 if y.requires_grad else 0.0)

    with cpu_tree(monkeypatch, CpuGraphBackend) as m:
        f = TorchFn(fn, m)
        for rx, ry in [(True, False)] * 3 + [(False, False)] * 3 + [(False, True)] * 3 + [(True, False)]:
            x, y = torch.randn(4).requires_grad_(rx), torch.randn(4).requires_grad_(ry)
            out = f(x, y)
            torch.testing.assert_close(out, fn(x, y))
            assert not out.requires_grad
        assert m.stats[f.fn_id].replays >= 4


@pytest.mark.parametrize("warm, write", [
    (lambda: torch.rand(6), lambda x: x.clamp_(min=0.0)),  # positive at warm-up: nothing to clamp
    (lambda: torch.zeros(6), lambda x: x.mul_(0.5)),  # zeros at warm-up: zeros again
    (lambda: torch.rand(6), lambda x: x[2:4].abs_()),  # through a view, positive at warm-up
], ids=["clamp-positive", "scale-zeros", "view-abs-positive"])
def test_an_input_written_with_its_own_values_at_warm_up_reaches_the_caller_later(monkeypatch, warm, write):
    """The warm-up finds the write by the input's version counter, not only by its contents: the
    recording copies the input back, so a later call whose write changes values reaches the caller
    (on the CPU graph emulator, which replays the ops as a graph does)."""
    from cpu_graph import CpuGraphBackend

    def fn(x):
        write(x)
        return x * 2.0

    with cpu_tree(monkeypatch, CpuGraphBackend) as m:
        f = TorchFn(fn, m)
        for i in range(5):
            x = warm() if i == 0 else torch.randn(6)
            ref = x.clone()
            want = fn(ref)
            torch.testing.assert_close(f(x), want)
            torch.testing.assert_close(x, ref)
        assert m.stats[f.fn_id].replays >= 2


@pytest.mark.parametrize("write, expected", [
    (lambda x: x.clamp_(min=0.0), (0,)),  # its values as they were, its version count moved
    (lambda x: x.add_(1.0), (0,)),  # its values changed
    (lambda x: x.clone().clamp_(min=0.0), ()),  # a copy written: the input is not
], ids=["same-values", "new-values", "copy"])
def test_the_cuda_backends_warm_up_finds_the_inputs_written(dev0, write, expected):
    """``warmup.run`` (the CUDA backend's warm-up, outside the pool here) on a positive input."""
    from cgraw.trees import warmup

    f = cgraw.graphed(lambda x: write(x) * 2.0)
    x = torch.rand(5)
    call = calls.inspect(f, (x,), {}, {}, 0)
    backend = types.SimpleNamespace(_torch=torch, _tts=None, warm_in_pool=False)
    assert tuple(warmup.run(backend, f, call, (x,), {}).mutated) == expected


@pytest.mark.parametrize("guarded", [False, True], ids=["user code", "compiled piece"])
def test_a_warm_up_warns_of_a_non_contiguous_input_written_only_in_user_code(dev0, guarded, caplog):
    """A function that writes a non-contiguous eager input is warned of at its warm-up; a piece of
    compiled code (``inputs_guarded``) is not: Inductor's backward reuses the saved activations it
    owns, which are eager inputs of its warm-up. The write is found either way."""
    import logging

    from cgraw.trees import warmup

    f = cgraw.graphed(lambda x: x.add_(1.0) * 2.0)
    f.inputs_guarded = guarded
    x = torch.rand(4, 6)[:, ::2]
    call = calls.inspect(f, (x,), {}, {}, 0)
    backend = types.SimpleNamespace(_torch=torch, _tts=None, warm_in_pool=False)
    with caplog.at_level(logging.WARNING, logger="cgraw"):
        assert tuple(warmup.run(backend, f, call, (x,), {}).mutated) == (0,)
    warned = [r.getMessage() for r in caplog.records if "mutates non-contiguous eager input 0" in r.getMessage()]
    assert len(warned) == (0 if guarded else 1), warned


def test_a_function_turning_grad_on_inside_a_no_grad_call_runs_eagerly_with_the_reason(mgr):
    """``torch.enable_grad()`` inside, called under ``no_grad``: eager's output requires grad and
    its backward reaches the input; a recording made with grad off would hand out a detached one."""
    def fn(x):
        with torch.enable_grad():
            return x * 2.0

    f = TorchFn(fn, mgr)
    for _ in range(4):
        x = torch.randn(3, requires_grad=True)
        y = f(x)
        assert y.requires_grad
        with torch.enable_grad():
            y.sum().backward()
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    st = mgr.stats[f.fn_id]
    assert st.replays == 0 and "grad mode is off at the call" in next(iter(st.skip_reasons))


# ---------------------------------------------------------------------- outputs: divergences


def test_an_output_object_holding_tensors_is_not_handed_out_again_unchanged():
    y = torch.randn(3)
    leaves: list = []
    try:
        spec = out_spec(types.SimpleNamespace(y=y), leaves)
    except SkipCall:
        return  # runs eagerly, with the reason: matches eager
    assert spec[0] != "v" and leaves == [y]


def test_a_view_of_a_closure_parameter_is_a_new_view_on_every_call(dev0):
    """``recording.output_kinds``: an output viewing a tensor outside the tree's pool (a closure
    parameter's ``weight.T``) is made anew per call, as eager's is: a hook a caller registers on
    one call's view does not reach the next call's gradient."""
    from cgraw.trees.recording import ClosureView, output_kinds

    w = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(3)
    call = calls.inspect(_PLAIN, (x,), {}, {}, 0)
    ph = TORCH.clone_layout(x)
    with torch.enable_grad():
        (kind,) = output_kinds(call, {0: ph}, [w.T], lambda ptr: ptr == ph.data_ptr())
        assert isinstance(kind, ClosureView)
        first, second = kind.rebuild(), kind.rebuild()
        assert first is not second and torch.equal(first, w.T) and first.data_ptr() == w.data_ptr()
        first.register_hook(lambda g: g * 10.0)
        first.sum().backward()
        torch.testing.assert_close(w.grad, torch.full((4, 3), 10.0))
        w.grad = None
        second.sum().backward()
        torch.testing.assert_close(w.grad, torch.ones(4, 3))


def test_a_view_of_a_closure_parameter_that_requires_grad_recorded_with_grad_on_runs_eagerly(dev0):
    """``recording.output_kinds`` with grad on: a view of a closure tensor that requires grad
    (``weight.T``) would reach the caller without a path to the tensor through the graphed
    backward (on the H200 a hook on it changed nothing and its gradient was lost), so the
    recording is refused with the reason and the function runs eagerly; with grad off, or a
    tensor that does not require grad, it stays a new view per call."""
    from cgraw.trees.recording import CLOSURE_VIEW_GRAD, ClosureView, output_kinds

    w = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(3)
    call = calls.inspect(_PLAIN, (x,), {}, {}, 0)
    ph = TORCH.clone_layout(x)
    call.grad = True
    with pytest.raises(SkipCall, match="requires grad") as info:
        output_kinds(call, {0: ph}, [w.T], lambda ptr: ptr == ph.data_ptr())
    assert str(info.value) == CLOSURE_VIEW_GRAD
    (kind,) = output_kinds(call, {0: ph}, [w.detach().T], lambda ptr: ptr == ph.data_ptr())
    assert isinstance(kind, ClosureView)
    call.grad = False
    (kind,) = output_kinds(call, {0: ph}, [w.T], lambda ptr: ptr == ph.data_ptr())
    assert isinstance(kind, ClosureView)


def test_views_of_a_closure_parameter_are_eagers_views_on_every_replay(monkeypatch):
    """torch's trees: test_alias_of_parameter, test_aliasing_static_ref, on the CPU graph emulator."""
    from cpu_graph import CpuGraphBackend

    class AliasMod(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.param = torch.nn.Parameter(torch.rand(5, 5))

        def forward(self, x):
            return self.param[0], self.param, self.param + x, self.param.T

    mod = AliasMod()
    with cpu_tree(monkeypatch, CpuGraphBackend) as m:
        f = TorchFn(lambda x: mod(x), m)
        before = None
        for _ in range(4):
            x = torch.rand(5, 5)
            row, param, plus, t = f(x)
            assert param is mod.param and row.data_ptr() == t.data_ptr() == mod.param.data_ptr()
            for got, want in zip((row, plus, t), (mod.param[0], mod.param + x, mod.param.T)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert before is None or (row is not before[0] and t is not before[1])
            before = (row, t)
        assert m.stats[f.fn_id].replays >= 2


def test_the_same_tensor_returned_twice_is_one_object():
    """The CUDA backend notes output leaves that are one object (``repeated_leaves``), and a
    replay hands that object out once for all of them, as eager returns it."""
    from cgraw.trees.recording import OWNED, Recording, repeated_leaves

    y = torch.randn(3)
    rec = Recording("f")
    rec.out_spec = out_spec((y, y), rec.out_leaves)
    rec.out_kinds, rec.out_alias = [OWNED, OWNED], [t.detach for t in rec.out_leaves]
    rec.out_same = repeated_leaves(rec.out_leaves)
    a, b = rec._outputs(None)
    assert a is b


@pytest.mark.parametrize("make", [
    lambda a, b, c, arg: a,  # one tensor
    lambda a, b, c, arg: (a, b, c),  # a flat tuple: Inductor's partitions return one
    lambda a, b, c, arg: [a, arg, b, arg, c],  # a flat list handing out an argument object twice
    lambda a, b, c, arg: (a, (b, [c]), {"k": a}),  # nested
    lambda a, b, c, arg: (a, 3, "label"),  # plain values
], ids=["single", "flat", "flat_with_arguments", "nested", "values"])
def test_an_output_builder_gives_what_unflatten_gives(make):
    from cgraw.trees.arrays import argument_objects, builder, flatten, out_spec, unflatten

    a, b, c, arg = torch.randn(2), torch.randn(3), torch.randn(4), torch.randn(5)
    leaves, parts, kinds, ptrs, ops = [], [], [], [], []
    specs = [flatten(arg, leaves, parts, kinds, ptrs, ops, None)]
    objects = argument_objects(specs, {})
    out_leaves: list = []
    spec = out_spec(make(a, b, c, arg), out_leaves, objects)
    fresh = [t.clone() for t in out_leaves]  # a replay's new output objects
    want = unflatten(spec, iter(fresh), objects)
    got = builder(spec)(fresh, objects)
    assert type(got) is type(want) and repr(got) == repr(want)
    if isinstance(want, (tuple, list)):
        assert all(x is y for x, y in zip(got, want) if isinstance(x, torch.Tensor))
