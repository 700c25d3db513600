"""CPU tier of graph-safe random numbers: the Philox reference, seeds and keys, argument rules,
kernel sources, and the routers' pass-through paths (no GPU needed)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cgraw.errors import CaptureError
from cgraw.rng import plan as rng, kernels as K, reference

# Random123's published known answers for Philox4x32-10 (its tests/kat_vectors)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_reference_matches_random123(ctr, key, want):
    assert tuple(int(x) for x in reference.philox4x32_10(ctr, key)) == want


def test_philox_reference_is_vectorised_consistently():
    ctrs = np.array([c for c, _, _ in KAT[:2]], dtype=np.uint32)
    both = reference.philox4x32_10(ctrs, (0, 0))
    assert tuple(int(x) for x in both[0]) == KAT[0][2]
    assert tuple(both[1]) != tuple(reference.philox4x32_10(ctrs[1], (0xFFFFFFFF, 0xFFFFFFFF)))  # key matters


def test_reference_uniform_layout():
    key = 0x0123456789ABCDEF
    u = reference.reference_uniform_f32(key, 5, 10)
    words = reference.reference_words(key, 5, 3)
    assert u.dtype == np.float32 and u.shape == (10,)
    assert np.all((u >= 0) & (u < 1))
    # element i is word i of the flattened (group, word) table, top 24 bits
    np.testing.assert_array_equal(u, (words.reshape(-1)[:10] >> 8).astype(np.float32) / np.float32(2 ** 24))
    assert not np.array_equal(u, reference.reference_uniform_f32(key, 6, 10))  # offset matters
    assert not np.array_equal(u, reference.reference_uniform_f32(key ^ 1, 5, 10))  # key matters
    # the counter's high words carry the offset: offsets past 2**32 differ from their low half
    assert not np.array_equal(reference.reference_words(key, 1 << 32, 2), reference.reference_words(key, 0, 2))


def test_splitmix64_known_first_output():
    assert rng.splitmix64(0) == 0xE220A8397B1DCDAF


def test_a_loop_bodys_keys_are_new_per_iteration_and_apart_from_replay_keys():
    from cgraw.rng import kernels as K

    key = rng.replay_key(rng.torch_base(0), 8)
    chain = [key]
    for _ in range(1000):
        chain.append(rng.loop_key(chain[-1]))
    assert len(set(chain)) == len(chain)  # 1000 iterations, 1000 keys
    replays = {rng.replay_key(rng.torch_base(0), p) for p in range(0, 4 * 2000, 4)}
    assert replays.isdisjoint(chain[1:])
    # the device's step mixes in the same tag as this reference
    assert f"{rng.LOOP_TAG:#X}".replace("0X", "0x") + "ull" in K.source(K.STEP_NAME)


def test_replay_keys_depend_on_seed_and_position_alone():
    base = rng.torch_base(7)
    assert rng.replay_key(base, 12) == rng.replay_key(rng.torch_base(7), 12)  # a pure function
    keys = {rng.replay_key(rng.torch_base(s), p) for s in (0, 1, 7, (1 << 64) - 1) for p in (0, 4, 8, 1 << 40)}
    assert len(keys) == 16  # another seed or another position: another key
    assert rng.torch_base(-1) == rng.torch_base((1 << 64) - 1)  # torch's seeds are 64-bit words
    assert rng.replay_key(rng.CUPY_BASE, 5) not in keys
    # torch's eager kernels key Philox with the seed itself: a replay's key is never that
    assert all(rng.replay_key(rng.torch_base(s), 0) != s for s in range(100))


def test_increments_and_positions_follow_each_framework():
    assert rng.increment(rng.TORCH, 3, 1000) == 12  # torch keeps its offsets multiples of 4
    assert rng.increment(rng.CUPY, 3, 1000) == 1000  # CuPy: the elements drawn, as its kernels
    assert rng.increment(rng.CUPY, 1, 0) == 1
    assert rng.advance(rng.TORCH, (1 << 64) - 4, 8) == 4
    top = rng.UINT64_MAX  # CuPy's _update_seed: modulo 2**64 - 1
    assert rng.advance(rng.CUPY, top - 1, 1) == 0 and rng.advance(rng.CUPY, top, 5) == 5
    assert rng.advance(rng.CUPY, 10, 5) == 15


def _device_advance(pos: int, inc: int, mod1: bool) -> int:
    """``cgraw_rng_advance``'s arithmetic on 64-bit words, as written in ``rng.kernels.ADVANCE``."""
    s = (pos + inc) & ((1 << 64) - 1)
    if mod1:
        if s < pos:
            s += 1
        if s == (1 << 64) - 1:
            s = 0
    return s


@pytest.mark.parametrize("pos,inc", [(0, 1), (10, 7), ((1 << 64) - 2, 1), ((1 << 64) - 1, 3),
                                     ((1 << 64) - 5, 9), ((1 << 64) - 2, (1 << 63))])
def test_the_device_advance_matches_the_host(pos, inc):
    assert _device_advance(pos, inc, True) == rng.advance(rng.CUPY, pos, inc)
    assert _device_advance(pos, inc, False) == rng.advance(rng.TORCH, pos, inc)
    assert "if (s < p) s += 1;" in K.ADVANCE and "if (s == ~0ull) s = 0;" in K.ADVANCE
    assert "cgraw_splitmix64(slot[2] ^ cgraw_splitmix64(s))" in K.ADVANCE
    assert "cgraw_splitmix64(base ^ cgraw_splitmix64(pos))" in K.SET


def test_cgraw_has_no_seed_of_its_own():
    import cgraw

    assert not hasattr(cgraw, "manual_seed") and not hasattr(cgraw, "initial_seed")
    with pytest.raises(AttributeError, match=r"torch.manual_seed\(s\).*cupy.random.seed\(s\)"):
        cgraw.manual_seed(0)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cgraw.nope  # noqa: B018


def test_stream_hands_out_offsets_and_counts_elements():
    s = rng.RngStream(slot=0x1000, device=0, thread=threading.get_ident())
    assert s.calls == 0 and s.kind == rng.TORCH
    assert s.take() == 0 and s.take(1, 10) == 1 and s.take(2, 5) == 2 and s.calls == 4 and s.elements == 15
    assert s.increment == 16
    c = rng.RngStream(0x1020, 0, 0, rng.CUPY)
    c.take(1, 300)
    assert c.increment == 300


@pytest.mark.parametrize("dtype,args,want", [
    ("f32", (), (0, 2 ** 24 + 1)), ("bf16", (), (0, 257)), ("f64", (), (0, 2 ** 53 + 1)),
    ("i8", (), (0, 128)), ("u8", (), (0, 256)), ("b8", (), (0, 2)), ("i64", (), (0, 2 ** 63)),
    ("i32", (-5, 7), (-5, 12)), ("f16", (3, None), (3, 2 ** 11 + 1 - 3)),
])
def test_random_ranges_follow_torch(dtype, args, want):
    assert rng.random_range(dtype, *args) == want


def test_random_range_rejects_empty():
    with pytest.raises(ValueError):
        rng.random_range("i32", 5, 5)


def test_wide_draws():
    assert rng.is_wide("uniform", "f64") and not rng.is_wide("uniform", "f32")
    assert not rng.is_wide("bernoulli", "f64")
    assert rng.is_wide("randint", "i64", 2 ** 32 + 1) and not rng.is_wide("randint", "i64", 2 ** 32)


def test_grid_is_bounded_and_covers():
    assert rng.grid(1, 4, 132) == 1
    assert rng.grid(4 * 256 * 3, 4, 132) == 3
    assert rng.grid(10 ** 9, 4, 132) == 132 * 8


def test_every_kernel_name_has_a_source_defining_it():
    names = [K.ADVANCE_NAME, K.SET_NAME, K.STEP_NAME] + [K.dropout_name(d) for d in K.FLOATS]
    names += [K.fill_name(d, t, w) for d in K.DISTS for t in K.CTYPES for w in (False, True)]
    assert len(set(names)) == len(names)
    for n in names:
        src = K.source(n)
        assert src.count(f" {n}(") == 1, n
        assert "#include" not in src  # NVRTC needs no include path
    with pytest.raises(KeyError):
        K.source("cgraw_fill_zipf_f32_n")
    with pytest.raises(KeyError):
        K.fill_name("uniform", "c64", False)
    with pytest.raises(KeyError):
        K.dropout_name("i32")


def test_capture_names_an_uncovered_random_op():
    from cgraw import capture
    from cgraw.interop.torch import rng as torch_rng

    err = torch_rng.not_covered("aten.randperm.default")
    msg = capture(pool=None)._classify(err, 0, 0)
    assert "randperm" in msg and "outside the capture" in msg


# ----------------------------------------------------------------------------- torch routers (CPU)

def _torch():
    return pytest.importorskip("torch")


def test_bind_fills_defaults_by_schema_name():
    torch = _torch()
    from cgraw.interop.torch import rng as torch_rng

    d = torch_rng._bind(torch.ops.aten.randint.low, (0, 10, [5]), {"device": "cpu"})
    assert d["low"] == 0 and d["high"] == 10 and list(d["size"]) == [5] and d["device"] == "cpu"
    d = torch_rng._bind(torch.ops.aten.uniform_.default, (torch.empty(3),), {"to": 4.0})
    assert d["from"] == 0.0 and d["to"] == 4.0


def test_mode_passes_cpu_random_numbers_through_unchanged():
    torch = _torch()
    from cgraw.interop.torch import rng as torch_rng

    torch.manual_seed(11)
    want = (torch.rand(5), torch.randn(3), torch.randint(0, 9, (4,)), torch.empty(6).bernoulli_(0.5))
    torch.manual_seed(11)
    r = torch_rng.TorchRng(rng.RngStream(0, 0, threading.get_ident()))
    r.enter()
    try:
        got = (torch.rand(5), torch.randn(3), torch.randint(0, 9, (4,)), torch.empty(6).bernoulli_(0.5))
        y = torch.nn.functional.dropout(torch.ones(8), 0.5, training=True)  # CPU: torch's own dropout
    finally:
        r.exit()
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert y.shape == (8,)
    assert r.stream.calls == 0  # nothing drawn from cgraw's stream


def test_sdpa_patch_is_only_in_place_during_captures():
    torch = _torch()
    from cgraw.interop.torch import rng as torch_rng

    orig = torch.nn.functional.scaled_dot_product_attention
    a = torch_rng.TorchRng(rng.RngStream(0, 0, 0))
    b = torch_rng.TorchRng(rng.RngStream(8, 0, 0))
    a.enter()
    b.enter()  # overlapping captures (two threads): one patch, counted
    assert torch.nn.functional.scaled_dot_product_attention.__wrapped__ is orig
    b.exit()
    assert torch.nn.functional.scaled_dot_product_attention is not orig
    q = torch.randn(1, 2, 4, 8)
    torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, q, q), orig(q, q, q))
    a.exit()
    assert torch.nn.functional.scaled_dot_product_attention is orig


# ----------------------------------------------------------------------------- CuPy stand-in (CPU)

class _FakeState:
    def __init__(self):
        self.calls = []

    def random_sample(self, size=None, dtype=float):
        self.calls.append(("random_sample", size))
        return "eager"

    def vonmises(self, *a, **k):
        return "eager vonmises"

    def gamma(self, *a, **k):
        return "eager gamma"


def test_cupy_stand_in_forwards_other_threads_and_names_uncovered_calls():
    from cgraw.errors import CaptureError
    from cgraw.interop.cupy import rng as cupy_rng

    orig = _FakeState()
    sub = cupy_rng.CaptureRandomState(rng.RngStream(0, 0, threading.get_ident()), orig, 0)
    with pytest.raises(CaptureError, match="cupy.random.vonmises"):
        sub.vonmises(0.0, 1.0)
    out = {}

    def other():
        out["r"] = sub.random_sample(size=3)
        out["v"] = sub.vonmises(0.0, 1.0)
        out["g"] = sub.gamma(1.0)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert out == {"r": "eager", "v": "eager vonmises", "g": "eager gamma"}
    assert orig.calls == [("random_sample", 3)]


def test_sampler_kernels_are_named_and_generated():
    assert set(K.SAMPLER_STEPS) == set(K.SAMPLERS) and set(K.SAMPLERS) <= set(K.DISTS)
    assert K.SAMPLER_STEPS["beta"] == 2  # X ~ Gamma(a) and Y ~ Gamma(b) at two offsets
    for d in K.SAMPLERS:
        for t in ("f32", "f64", "i32", "i64"):
            for w in (False, True):
                name = K.fill_name(d, t, w)
                src = K.source(name)
                assert src.count(f" {name}(") == 1 and f"fill<{K.CTYPES[t]}, {K.DISTS[d]}, " in src, name
                assert "sample<T, D, WIDE>" in src and "CGRAW_CAP" in src
    assert rng.is_wide("poisson", "i32") and rng.is_wide("binomial", "i64")
    assert rng.is_wide("gamma", "f64") and not rng.is_wide("beta", "f32")


class _FakeKernels:
    """Stands in for ``_cuda.kernels`` in ``rng.device``: records launches."""

    ARG_PTR = ARG_I64 = ARG_U64 = ARG_F64 = ARG_F32 = 0

    def __init__(self):
        self.launches = []

    def function(self, device, name, source):
        source(name)  # the name has a source
        return name

    def launch(self, func, grid, block, args, types, stream):
        self.launches.append((func, grid, block, args))


@pytest.fixture
def fake_kernels(monkeypatch):
    from cgraw.rng import device as rng_device

    fk = _FakeKernels()
    monkeypatch.setattr(rng_device, "_k", fk)
    monkeypatch.setattr(rng_device, "_sm_count", lambda device: 132)
    return fk


def test_sampler_calls_reserve_their_offset_steps(fake_kernels):
    from cgraw.rng import device as rng_device

    s = rng.RngStream(slot=0x2000, device=0, thread=threading.get_ident())
    rng_device.sample(s, "gamma", "f32", 0x100, 1000, None, 2.0, 1.0)
    rng_device.sample(s, "beta", "f64", 0x200, 10, None, 0.5, 0.5, wide=True)
    rng_device.sample(s, "poisson", "i64", 0x300, 1, None, 4.0, wide=True)
    rng_device.sample(s, "binomial", "i32", 0x400, 0, None, 10.0, 0.3, wide=True)  # empty: no launch, no offset
    assert s.calls == 4  # gamma 1, beta 2, poisson 1
    names = [f for f, *_ in fake_kernels.launches]
    assert names == ["cgraw_fill_gamma_f32_n", "cgraw_fill_beta_f64_w", "cgraw_fill_poisson_i64_w"]
    calls = [args[3] for *_, args in fake_kernels.launches]
    assert calls == [0, 1, 3]
    assert s.elements == 1011
    func, grid, block, args = fake_kernels.launches[0]
    assert grid == rng.grid(1000, 1, 132) == 4 and block == rng.BLOCK  # one thread per element
    assert args[:3] == (0x100, 1000, 0x2000) and args[4:6] == (2.0, 1.0)  # the key is the record's
    with pytest.raises(ValueError, match="at most"):
        rng_device.sample(s, "gamma", "f32", 0x100, K.SAMPLE_MAX, None, 2.0, 1.0)
    assert s.calls == 4


def test_the_last_node_advances_by_the_replays_increment(fake_kernels):
    from cgraw.rng import device as rng_device

    t = rng.RngStream(slot=0x2000, device=0, thread=0)
    rng_device.fill(t, "uniform", "f32", 0x100, 10, None)
    rng_device.dropout(t, "f32", 0x100, 0x200, 0x300, 20, 0.9, 1 / 0.9, None)
    c = rng.RngStream(0x2020, 0, 0, rng.CUPY)
    rng_device.fill(c, "normal", "f64", 0x100, 1000, None, wide=True)
    rng_device.advance(t, None)
    rng_device.advance(c, None)
    (_, _, _, dargs), adv_t, adv_c = (fake_kernels.launches[i] for i in (1, 3, 4))
    assert dargs[4:6] == (0x2000, 1)  # the record, then the draw's offset within the graph
    assert adv_t == ("cgraw_rng_advance", 1, 1, (0x2000, 8, 0))  # torch: 4 per offset, modulo 2**64
    assert adv_c == ("cgraw_rng_advance", 1, 1, (0x2020, 1000, 1))  # CuPy: the elements, modulo 2**64 - 1


class _FakeArray:
    def __init__(self, shape, dtype):
        import types

        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(self.shape)) if self.shape else 1
        self.data = types.SimpleNamespace(ptr=0xA000)


def _install_fake_cupy(monkeypatch) -> None:
    """A ``cupy`` module with ``empty`` and a current stream, in ``sys.modules``."""
    import sys
    import types

    from cgraw.interop.cupy import rng as cupy_rng

    fake = types.ModuleType("cupy")
    fake.empty = lambda shape, dtype: _FakeArray(shape, dtype)
    fake.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cupy_rng._cuda, "stream_handle", lambda ptr: None)


@pytest.fixture
def fake_cupy(monkeypatch):
    """A fake ``cupy`` module, and ``rng.device.sample`` recorded."""
    from cgraw.rng import device as rng_device
    from cgraw.interop.cupy import rng as cupy_rng

    _install_fake_cupy(monkeypatch)
    calls = []

    def sample(stream, dist, dtype, out, n, cu_stream, a, b=0.0, *, wide=False):
        calls.append((dist, dtype, n, a, b, wide))

    monkeypatch.setattr(rng_device, "sample", sample)
    sub = cupy_rng.CaptureRandomState(rng.RngStream(0, 0, threading.get_ident()), None, 0)
    return sub, calls


def test_cupy_samplers_dispatch_with_cupy_signatures(fake_cupy):
    sub, calls = fake_cupy
    out = sub.gamma(2.5, 3.0, size=(2, 3))
    assert out.shape == (2, 3) and out.dtype == np.float64
    assert sub.standard_gamma(0.5, size=7, dtype=np.float32).dtype == np.float32
    assert sub.beta(2, 5, 4).shape == (4,)
    x = sub.poisson(size=5)
    assert x.dtype == np.int64 and x.shape == (5,)  # dtype=int: int64 on Linux, lam=1.0
    assert sub.poisson(np.float32(30.0), 3, dtype=np.int32).dtype == np.int32
    assert sub.binomial(1000, 0.7, size=None).shape == ()  # size None: one draw, shape ()
    assert calls == [("gamma", "f64", 6, 2.5, 3.0, True), ("gamma", "f32", 7, 0.5, 1.0, False),
                     ("beta", "f64", 4, 2.0, 5.0, True), ("poisson", "i64", 5, 1.0, 0.0, True),
                     ("poisson", "i32", 3, 30.0, 0.0, True), ("binomial", "i64", 1, 1000.0, 0.7, True)]
    assert sub.gamma(0.0, size=2).shape == (2,)  # shape 0 is allowed (NumPy: all zeros)


@pytest.mark.parametrize("call,match", [
    (lambda s: s.standard_gamma(-1.0, 3), "shape < 0"),
    (lambda s: s.gamma(-0.5, 1.0, 3), "shape < 0"),
    (lambda s: s.gamma(1.0, -1.0, 3), "scale < 0"),
    (lambda s: s.gamma(float("nan"), 1.0, 3), "shape < 0"),
    (lambda s: s.beta(0.0, 1.0, 3), "a <= 0"),
    (lambda s: s.beta(1.0, -2.0, 3), "b <= 0"),
    (lambda s: s.poisson(-1.0, 3), "lam < 0"),
    (lambda s: s.poisson(1e19, 3), "too large"),
    (lambda s: s.binomial(-1, 0.5, 3), "n < 0"),
    (lambda s: s.binomial(10, -0.1, 3), "p < 0"),
    (lambda s: s.binomial(10, 1.5, 3), "p > 1"),
    (lambda s: s.binomial(10, float("nan"), 3), "p is nan"),
])
def test_cupy_samplers_check_arguments_like_numpy(fake_cupy, call, match):
    sub, calls = fake_cupy
    with pytest.raises(ValueError, match=match):
        call(sub)
    assert calls == []


def test_cupy_samplers_refuse_array_parameters_and_other_dtypes(fake_cupy):
    from cgraw.errors import CaptureError
    from cgraw.interop.cupy import rng as cupy_rng

    sub, calls = fake_cupy
    for call, name in ((lambda: sub.gamma(np.ones(3)), "gamma"), (lambda: sub.beta(1.0, np.ones(3)), "beta"),
                       (lambda: sub.poisson(np.ones(3)), "poisson"),
                       (lambda: sub.binomial(np.ones(3, int), 0.5), "binomial"),
                       (lambda: sub.poisson(3.0, 4, dtype=np.int16), "poisson"),
                       (lambda: sub.binomial(2 ** 60, 0.5, 4), "binomial"),
                       (lambda: sub.poisson(3e9, 4, dtype=np.int32), "poisson"),  # would wrap in int32
                       (lambda: sub.binomial(2 ** 31, 0.5, 4, dtype=np.int32), "binomial")):
        with pytest.raises(CaptureError, match=f"cupy.random.{name}"):
            call()
    with pytest.raises(TypeError):
        sub.gamma(1.0, size=3, dtype=np.int32)
    assert calls == []
    sub.poisson(3e9, 4, dtype=np.int64)
    sub.binomial(2 ** 31, 0.0, 4, dtype=np.int32)  # p = 0: every draw is 0
    assert len(calls) == 2
    assert {"standard_gamma", "gamma", "beta", "poisson", "binomial"} <= set(cupy_rng.COVERED)


def test_cupy_shape_rules():
    from cgraw.interop.cupy import rng as cupy_rng

    assert cupy_rng._shape(None) == () and cupy_rng._shape(5) == (5,) and cupy_rng._shape((2, 3)) == (2, 3)
    assert cupy_rng._shape(np.int64(4)) == (4,)


# ----------------------------------------------------------------------------- torch routing logic
# The mode's handlers run on CPU tensors here, with fake kernels that write a known pattern, so
# the argument handling (shapes, dtypes, out=, layouts, ranges, multinomial, dropout's mask and
# scale) is checked without a GPU. The kernels themselves are tested on the GPU (test_rng.py).

_NP = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "i8": np.int8, "u8": np.uint8,
       "i16": np.int16, "i32": np.int32, "i64": np.int64, "b8": np.uint8}


def _view(ptr, n, code):
    import ctypes

    dt = np.dtype(_NP[code])
    buf = (ctypes.c_char * (n * dt.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dt)


def _fake_fill(stream, dist, dtype, out, n, cu_stream, *, a=0.0, b=0.0, p=0, lo=0, rng_range=0, wide=False):
    stream.take(1)
    i = np.arange(n)
    v = {"uniform": lambda: a + (b - a) * ((i % 7) / 7.0),
         "normal": lambda: a + b * ((i % 5) - 2.0),
         "exponential": lambda: (1.0 + i % 3) / a,
         "bernoulli": lambda: ((i % 10) < 10 * a).astype(np.float64),
         "bernoulli_t": lambda: (_view(p, n, "f32") > 0.5).astype(np.float64),
         "randint": lambda: lo + (i % rng_range)}[dist]()
    _view(out, n, dtype)[:] = v.astype(_NP[dtype])


def _fake_dropout(stream, dtype, src, out, mask, n, keep, scale, cu_stream):
    stream.take(1)
    m = (np.arange(n) % 2 == 0)
    _view(mask, n, "b8")[:] = m
    _view(out, n, dtype)[:] = np.where(m, _view(src, n, dtype) * np.float32(scale), 0)


@pytest.fixture
def cpu_mode(monkeypatch):
    torch = _torch()
    from cgraw.rng import device as rng_device
    from cgraw.interop.torch import rng as torch_rng

    monkeypatch.setattr(rng_device, "fill", _fake_fill)
    monkeypatch.setattr(rng_device, "dropout", _fake_dropout)
    base = torch_rng._make_mode_class()

    class CpuMode(base):
        def mine(self, t):
            return isinstance(t, torch.Tensor) and t.device.type == "cpu"

        def cu_stream(self):
            return None

    stream = rng.RngStream(0, 0, threading.get_ident())
    return torch, CpuMode(stream), stream


def test_routed_factories_shapes_dtypes_and_out(cpu_mode):
    torch, mode, stream = cpu_mode
    o = torch.empty(3)
    with mode:
        u = torch.rand(3, 4)
        z = torch.randn(10, dtype=torch.float64)
        r = torch.randint(-5, 7, (24,))
        like = torch.rand_like(u, dtype=torch.float16)
        torch.rand(5, out=o)  # out= of another size is resized, as torch does
    assert u.shape == (3, 4) and u.dtype == torch.float32
    np.testing.assert_allclose(u.flatten().numpy(), (np.arange(12) % 7) / 7.0, rtol=1e-6)
    assert z.dtype == torch.float64 and z.tolist()[:5] == [-2.0, -1.0, 0.0, 1.0, 2.0]
    assert r.dtype == torch.int64 and r.tolist()[:13] == list(range(-5, 7)) + [-5]
    assert like.dtype == torch.float16 and like.shape == (3, 4)
    assert o.shape == (5,)
    assert stream.calls == 5  # one draw each
    with pytest.raises(Exception, match="cannot be captured"), mode:
        torch.randn(3, dtype=torch.complex64)


def test_routed_random_ranges(cpu_mode):
    torch, mode, _ = cpu_mode
    with mode:
        a = torch.empty(40, dtype=torch.int32).random_(3, 9)
        b = torch.empty(40, dtype=torch.int64).random_(7)
        c = torch.empty(300, dtype=torch.int8).random_()
    assert sorted(set(a.tolist())) == list(range(3, 9))
    assert sorted(set(b.tolist())) == list(range(7))
    assert min(c.tolist()) == 0 and max(c.tolist()) == 127


def test_routed_bernoulli_pairs_probabilities_with_elements_in_any_layout(cpu_mode):
    torch, mode, _ = cpu_mode
    p = torch.rand(2, 3, 4, 5)
    t = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)  # dense, not row-major
    with mode:
        t.bernoulli_(p)
        q = torch.bernoulli(p)  # the input holds the probabilities
        s = torch.empty(20).bernoulli_(0.3)
    want = (p > 0.5).float()
    assert torch.equal(t, want) and torch.equal(q, want)
    assert s.sum().item() == 6.0


def test_routed_normal_with_tensor_parameters_broadcasts(cpu_mode):
    torch, mode, _ = cpu_mode
    mean = torch.arange(3.0).reshape(3, 1)
    std = torch.full((1, 4), 2.0)
    with mode:
        out = torch.normal(mean, std)
    z = torch.tensor(((np.arange(12) % 5) - 2.0).reshape(3, 4), dtype=torch.float32)
    assert torch.equal(out, mean + std * z)


def test_routed_multinomial_inverse_cdf_and_topk(cpu_mode):
    torch, mode, _ = cpu_mode
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.0, 0.1, 0.4]])
    with mode:
        w = torch.multinomial(probs, 7, replacement=True)
        wo = torch.multinomial(probs, 2, replacement=False)
        one = torch.multinomial(probs[0], 3, replacement=True)
    u = ((np.arange(14) % 7) / 7.0).reshape(2, 7)
    c = np.cumsum(probs.double().numpy(), axis=1)
    want = np.stack([np.searchsorted(c[i], u[i] * c[i, -1], side="right") for i in range(2)])
    assert w.dtype == torch.int64 and w.tolist() == want.tolist()
    assert 1 not in w[1].tolist()  # a zero-probability category is never drawn
    e = (1.0 + np.arange(8) % 3).reshape(2, 4)  # the fake Exp(1) keys
    keys = probs.double().numpy() / e
    assert wo.tolist() == np.argsort(-keys, axis=1, kind="stable")[:, :2].tolist()
    assert one.shape == (3,)


def test_routed_dropout_mask_scale_and_gradient(cpu_mode):
    torch, mode, stream = cpu_mode
    x = torch.randn(4, 6, requires_grad=True)
    with mode:
        y, mask = torch.native_dropout(x, 0.2, True)  # what F.dropout runs on the GPU
        y.sum().backward()
        e, _ = torch.native_dropout(x, 0.2, False)
    keep = (torch.arange(24) % 2 == 0).reshape(4, 6)
    scale = torch.tensor(np.float32(1 / 0.8))
    assert mask.dtype == torch.bool and torch.equal(mask, keep)
    assert torch.equal(y, torch.where(keep, x.detach() * scale, torch.zeros(())))
    assert torch.equal(x.grad, torch.where(keep, scale, torch.zeros(())))  # autograd's own backward
    assert torch.equal(e, x)  # evaluation draws nothing
    assert stream.calls == 1


def test_routed_unfused_dropout_goes_through_bernoulli(cpu_mode):
    torch, mode, stream = cpu_mode
    x, f = torch.randn(2, 10), torch.randn(1, 10, 3, 3)
    with mode:  # on the CPU (and for feature dropout) torch decomposes dropout into bernoulli_
        y = torch.nn.functional.dropout(x, 0.3, training=True)
        z = torch.nn.functional.dropout2d(f, 0.3, training=True)
    noise = torch.tensor(((np.arange(20) % 10) < 7).astype(np.float32)).reshape(2, 10)
    torch.testing.assert_close(y, x * noise / 0.7)
    kept = (z != 0).flatten(2).all(-1) | (z == 0).flatten(2).all(-1)  # whole channels kept or dropped
    assert z.shape == (1, 10, 3, 3) and bool(kept.all()) and stream.calls == 2


# ----------------------------------------------------------------------------- higher-order operators, compiled code

def test_routed_draws_inside_cond_and_scan_bodies(cpu_mode):
    torch, mode, stream = cpu_mode
    x = torch.randn(3, 5)

    def noisy(x):
        return x + torch.rand(x.shape)

    def plain(x):
        return x * 2.0

    with mode:  # the bodies run with the mode pushed again: their draws come from the stream
        hi = torch.cond(torch.tensor(True), noisy, plain, (x,))
        lo = torch.cond(torch.tensor(False), noisy, plain, (x,))
        carry, ys = torch._higher_order_ops.scan(lambda c, r: (c + r, c + torch.rand(c.shape)), torch.zeros(5), x)
    u = torch.tensor((np.arange(15) % 7) / 7.0, dtype=torch.float32)
    torch.testing.assert_close(hi, x + u.reshape(3, 5))
    torch.testing.assert_close(lo, x * 2.0)
    torch.testing.assert_close(carry, x.sum(0))
    assert ys.shape == (3, 5) and stream.calls >= 1 + 3  # one in cond, one per scan step (and any shape probe)


def test_inductor_seed_buffer_is_drawn_from_the_stream(cpu_mode, monkeypatch):
    torch, mode, stream = cpu_mode
    from cgraw.rng import device as rng_device

    seen = []

    def record(rs, dist, dtype, out, n, cu_stream, *, lo=0, rng_range=0, wide=False, **kw):
        rs.take(1)
        seen.append((dist, dtype, n, lo, rng_range, wide))

    monkeypatch.setattr(rng_device, "fill", record)
    buf = torch.empty(3, dtype=torch.int64)
    limits = torch.iinfo(torch.int64)
    with mode:  # the call Inductor's generated code makes for the seeds of its random numbers
        torch.ops.aten.randint.low_out(limits.min, limits.max, [3], out=buf)
    assert seen == [("randint", "i64", 3, limits.min, limits.max - limits.min, True)]
    assert stream.calls == 1


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("how", ["reentrant", "non_reentrant"])
def test_draws_inside_a_checkpoint_that_restores_random_state_are_refused(cpu_mode, how):
    torch, mode, stream = cpu_mode
    from torch.utils.checkpoint import checkpoint

    from cgraw.errors import CaptureError

    def body(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 2.0

    x = torch.randn(4, 8, requires_grad=True)
    reentrant = how == "reentrant"
    with pytest.raises(CaptureError, match="checkpoint") as ei, mode:
        checkpoint(body, x, use_reentrant=reentrant)
    assert "preserve_rng_state=False" in ei.value.hint
    with mode:  # torch restores nothing for these: cgraw's draws are as good as eager's
        a = checkpoint(body, x, use_reentrant=reentrant, preserve_rng_state=False)
        with torch.no_grad():
            b = checkpoint(body, x.detach(), use_reentrant=reentrant)
        c = body(x)
    assert a.shape == b.shape == c.shape == (4, 8) and stream.calls == 3


def test_generator_state_answers_from_the_routing_start_only_while_capturing():
    from cgraw.interop.torch import rng_patch as torch_rng_patch

    class FakeCuda:
        capturing = False

        def __init__(self):
            self.state = np.arange(16, dtype=np.uint8)
            self.sets = []

        def get_rng_state(self, device="cuda"):
            if self.capturing:
                raise RuntimeError("Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture")
            return self.state.copy()

        def set_rng_state(self, new_state, device="cuda"):
            if self.capturing:
                raise RuntimeError("Cannot call CUDAGeneratorImpl::set_current_seed during CUDA graph capture")
            self.sets.append(new_state)

        def is_current_stream_capturing(self):
            return self.capturing

        def current_device(self):
            return 0

    class Held(np.ndarray):
        def clone(self):
            return self.copy()

    cuda = FakeCuda()
    (orig_get, get), (_, set_) = torch_rng_patch._patch_generator_state(cuda)
    assert cuda.get_rng_state is get and get.__wrapped__ == orig_get
    held = np.full(16, 7, dtype=np.uint8).view(Held)
    torch_rng_patch._held[0] = held
    try:
        assert list(get()) == list(range(16))  # not capturing: torch's own answer
        cuda.capturing = True
        assert list(get("cuda:0")) == [7] * 16 and list(get(0)) == [7] * 16
        assert set_(held) is None and cuda.sets == []  # nothing reads torch's generator in the capture
        with pytest.raises(RuntimeError, match="current_seed"):
            get(1)  # no state held for that device
        cuda.capturing = False
        set_(held)
        assert len(cuda.sets) == 1
    finally:
        torch_rng_patch._held.pop(0, None)


def test_generator_state_patch_only_while_routing():
    torch = _torch()
    from cgraw.interop.torch import rng as torch_rng

    get, set_ = torch.cuda.get_rng_state, torch.cuda.set_rng_state
    r = torch_rng.TorchRng(rng.RngStream(0, 0, 0))
    r.enter()
    try:
        assert torch.cuda.get_rng_state.__wrapped__ is get and torch.cuda.set_rng_state.__wrapped__ is set_
    finally:
        r.exit()
    assert torch.cuda.get_rng_state is get and torch.cuda.set_rng_state is set_


def test_kernel_sources_are_package_data_files():
    """The CUDA C lives in ``cgraw/rng/*.cu``, read at import, and ships as package data."""
    import pathlib
    import tomllib

    from cgraw.rng import kernels as K

    root = pathlib.Path(K.__file__).resolve().parents[2]
    cu = sorted(p.name for p in (root / "cgraw" / "rng").glob("*.cu"))
    assert cu == ["fills.cu", "philox.cu", "records.cu", "samplers.cu"]
    for name in cu:
        assert (root / "cgraw" / "rng" / name).read_text() in K.COMMON + K.ADVANCE, name
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert data["cgraw.rng"] == ["*.cu"]
    assert "__global__ void cgraw_rng_advance" in K.source(K.ADVANCE_NAME)
    assert "__global__ void cgraw_rng_set" in K.source(K.SET_NAME)
    assert "__global__ void cgraw_rng_step" in K.source(K.STEP_NAME)


@pytest.fixture
def cpu_is_routed(monkeypatch, fake_kernels):
    """The router's mode takes CPU tensors as its device's (its kernels are ``fake_kernels``)."""
    torch = _torch()
    from cgraw.interop.torch import rng as torch_rng

    torch_rng.TorchRng(rng.RngStream(0, 0, threading.get_ident()))  # the mode class, made once
    r = torch_rng.TorchRng(rng.RngStream(0, 0, threading.get_ident()))
    r.enter()
    cls = type(r._mode)
    r.exit()
    monkeypatch.setattr(cls, "mine", lambda self, t: isinstance(t, torch.Tensor) and t.device.type == "cpu")
    monkeypatch.setattr(cls, "cu_stream", lambda self: None)
    return torch, torch_rng


@pytest.mark.parametrize("eager", [False, True], ids=["capture", "warm-up"])
def test_a_warm_up_draws_what_cgraw_covers_and_leaves_the_rest_to_torch(cpu_is_routed, fake_kernels, eager):
    """The router of a warm-up (``eager``) draws covered calls with cgraw's kernels, as a capture's
    does; a draw cgraw cannot make (a dtype it does not cover) and one with an explicit
    ``generator=`` are torch's own there, where a capture refuses the first and ignores the second."""
    torch, torch_rng = cpu_is_routed
    r = torch_rng.TorchRng(rng.RngStream(0, 0, threading.get_ident()), eager=eager)
    g = torch.Generator().manual_seed(3)
    want = torch.rand(6, generator=torch.Generator().manual_seed(3))
    r.enter()
    try:
        torch.rand(5)
        with_gen = torch.rand(6, generator=g)
        if eager:
            uncovered = torch.empty(4, dtype=torch.complex64).normal_()
        else:
            with pytest.raises(CaptureError, match="cannot be captured"):
                torch.empty(4, dtype=torch.complex64).normal_()
    finally:
        r.exit()
    assert torch.equal(with_gen, want) == eager  # a capture draws its own numbers instead
    assert r.stream.calls == (1 if eager else 2)
    assert [f for f, *_ in fake_kernels.launches][0] == "cgraw_fill_uniform_f32_n"
    if eager:
        assert uncovered.dtype == torch.complex64 and bool(torch.isfinite(torch.view_as_real(uncovered)).all())


# ----------------------------------------------------------------------------- CuPy's warm-up state


class _CupysOwn:
    """CuPy's own RandomState: every call is answered with its name."""

    def __getattr__(self, name):
        return lambda *a, **k: ("cupy's own", name)


@pytest.fixture
def cupy_draws(monkeypatch):
    """A fake ``cupy`` module; ``rng.device``'s fills and samples recorded as ``(dist, dtype
    code, n, offset)``."""
    from cgraw.rng import device as rng_device

    _install_fake_cupy(monkeypatch)
    drawn = []
    monkeypatch.setattr(rng_device, "fill", lambda s, dist, code, out, n, cu, **kw: drawn.append(
        (dist, code, n, s.take(1, n))))
    monkeypatch.setattr(rng_device, "sample", lambda s, dist, code, out, n, cu, a, b=0.0, **kw: drawn.append(
        (dist, code, n, s.take(1, n))))
    return drawn


def test_a_warm_ups_cupy_state_draws_what_cgraw_covers_and_leaves_the_rest_to_cupy(cupy_draws):
    from cgraw.interop.cupy import rng as cupy_rng

    def state(cls):
        return cls(rng.RngStream(0x40, 0, threading.get_ident(), rng.CUPY), _CupysOwn(), 0)

    warm = state(cupy_rng.WarmRandomState)
    assert warm.rand(3, 4).shape == (3, 4) and cupy_draws[-1] == ("uniform", "f64", 12, 0)
    warm.gamma(2.0, size=5)
    assert cupy_draws[-1] == ("gamma", "f64", 5, 1)
    # what cgraw does not cover is CuPy's own in a warm-up (it runs the function eagerly)...
    assert warm.vonmises(0.0, 1.0) == ("cupy's own", "vonmises")
    assert warm.gamma(_FakeArray((5,), np.float64)) == ("cupy's own", "gamma")  # an array parameter
    assert len(cupy_draws) == 2
    # ...where a capture refuses it, naming it
    capturing = state(cupy_rng.CaptureRandomState)
    with pytest.raises(CaptureError, match="vonmises"):
        capturing.vonmises(0.0, 1.0)
    with pytest.raises(CaptureError, match="array shape"):
        capturing.gamma(_FakeArray((5,), np.float64))


def test_a_cupy_warm_up_moves_cupys_own_generator_not_its_stand_in(cupy_draws, monkeypatch):
    """While a warm-up runs, CuPy's table holds the warm-up's stand-in state; the draws move the
    position of CuPy's own ``RandomState`` (which replays read), as a replay would."""
    import types

    from cgraw.interop.cupy import rng as cupy_rng
    from cgraw.rng import device as rng_device

    class Own:  # CuPy's RandomState as the replays see it
        _rk_seed = 100

    own = Own()
    table = types.SimpleNamespace(_random_states={0: own})
    writes, sources = [], []

    def source(device, kind, stream, thread):
        sources.append(rng.Source(kind, device, 0x40, lambda s, base, pos: writes.append(pos)))
        return sources[-1]

    monkeypatch.setattr(cupy_rng, "_generator_module", lambda: table)
    monkeypatch.setattr(rng_device, "source", source)
    monkeypatch.setattr(rng_device, "advance", lambda stream, cu: None)
    with cupy_rng.WarmDraws(0):
        stand_in = table._random_states[0]
        assert isinstance(stand_in, cupy_rng.WarmRandomState)
        stand_in.rand(3, 4)  # what cupy.random.rand does: the table's state draws
        stand_in.gamma(2.0, size=5)
    assert table._random_states[0] is own and own._rk_seed == 100 + 12 + 5
    assert writes == [100]  # the record followed CuPy's generator once, at the first draw
    assert sources[0].pos == 117  # the mirror: where the record is once the advance has run
