"""GPU tier of hardening against real programs: one regression test per failure mode, written
from the scenario that aborted, hung or gave a wrong result, on fresh random data, compared with
eager. Scenarios that could abort or hang the process run in a child process
(``tests/helpers/scenarios.py``), so a regression fails one test instead of the whole run."""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from gpu_data import crand, rng, trand

import cgraw
from cgraw import _cuda
from cgraw._cuda import defer

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")

SCENARIOS = pathlib.Path(__file__).resolve().parents[1] / "helpers" / "scenarios.py"


def _mgr():
    return sys.modules["cgraw.trees.graphed"]._managers[0]


def _stats(f):
    return _mgr().stats[f.fn_id]


def _run_scenarios(*names, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(SCENARIOS.parents[2]))
    try:
        out = subprocess.run([sys.executable, str(SCENARIOS), *names], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"scenarios {names} hung (no exit after {timeout} s); output so far:\n{exc.stdout}")
    lines = out.stdout.splitlines()
    passed = {ln.split()[1] for ln in lines if ln.startswith("PASS ")}
    failed = [ln for ln in lines if ln.startswith("FAIL ")]
    assert out.returncode == 0 and "DONE" in lines, (
        f"the child process ended with status {out.returncode} (negative: killed by a signal, 134: "
        f"abort) after {sorted(passed)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    assert not failed, "\n".join(failed)
    assert passed == set(names)


# ---------------------------------------------------------------- aborts and hangs


def test_graphs_and_pools_dying_during_a_capture_never_abort():
    _run_scenarios("capture_loop_rebinding_g", "graph_collected_by_gc_inside_a_capture",
                   "capturable_optimizer_step_captured_per_round", "capture_while_another_thread_allocates")


def test_other_thread_in_torch_memory_apis_during_500_captures_no_hang():
    _run_scenarios("other_thread_calls_torch_memory_apis_during_500_captures", timeout=300)


def test_refused_restore_and_model_output_never_abort():
    _run_scenarios("refused_restore_falls_back_to_a_fresh_pool", "model_output_at_two_batch_sizes")


def test_release_inside_a_capture_waits_in_process(pool):
    """The same rule in this process: a graph closed inside a capture is destroyed after it."""
    x = trand(100)
    with cgraw.capture() as g1:
        y1 = x + 1.0
    with cgraw.capture(pool=pool) as g2:
        y2 = x * 3.0
        g1.close()
        del y1
        assert defer.pending() >= 1
    assert defer.pending() == 0
    x.copy_(trand(100))
    g2.replay()
    torch.testing.assert_close(y2, x * 3.0)
    g2.close()


# ---------------------------------------------------------------- streams


def test_replay_runs_on_torchs_current_stream():
    n = 1 << 22
    x = trand(n)
    with cgraw.capture() as g:
        y = torch.sin(x) * 2.0 + x
    s = torch.cuda.Stream()
    for _ in range(20):
        with torch.cuda.stream(s):
            x.copy_(torch.randn(n, device="cuda"))
            x.mul_(1.5).add_(0.25)  # keep the side stream busy right before the replay
            g.replay()
            ref = torch.sin(x) * 2.0 + x
        s.synchronize()
        torch.testing.assert_close(y, ref)


def test_replay_runs_on_cupys_current_stream():
    n = 1 << 22
    x = crand(n)
    with cgraw.capture() as g:
        y = cp.sqrt(cp.abs(x)) + x
    cs = cp.cuda.Stream(non_blocking=True)
    for _ in range(20):
        with cs:
            x[...] = cp.asarray(rng.standard_normal(n).astype(np.float32))
            x *= 1.5
            g.replay()
            ref = cp.sqrt(cp.abs(x)) + x
        cs.synchronize()
        assert cp.array_equal(y, ref)


def test_explicit_stream_wins_and_torch_wins_over_cupy():
    from cgraw.runtime import stream as streams

    x = trand(1 << 20)
    with cgraw.capture() as g:
        y = x * 4.0
    s = torch.cuda.Stream()
    cs = cp.cuda.Stream(non_blocking=True)
    with cs:
        assert streams.current_ptr(0) == cs.ptr
        with torch.cuda.stream(s):
            assert streams.current_ptr(0) == s.cuda_stream  # both set: torch's wins
    with torch.cuda.stream(s):
        x.copy_(torch.randn(1 << 20, device="cuda"))
    g.replay(stream=s)  # explicit: on s, after its copy
    s.synchronize()
    torch.testing.assert_close(y, x * 4.0)
    g.replay(stream=cs)
    g.replay(stream=cgraw.Stream.of(s))
    g.replay(stream=s.cuda_stream)
    torch.cuda.synchronize()
    cs.synchronize()


def test_graphed_calls_on_a_side_stream_with_noncontiguous_inputs():
    def body(a, b):
        return torch.relu(a) * b + 1.0

    f = cgraw.graphed(body)
    s = torch.cuda.Stream()
    for i in range(20):
        with torch.cuda.stream(s):
            a = torch.randn(512, 256, device="cuda").t()  # non-contiguous: copied before the replay
            b = torch.randn(256, 512, device="cuda")
            got = f(a, b)
            ref = body(a, b)
        s.synchronize()
        torch.testing.assert_close(got, ref)
    st = _stats(f)
    assert st.recordings == 1 and st.replays >= 17


# ---------------------------------------------------------------- static inputs that move


class Shifted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.register_buffer("shift", torch.randn(32))

    def forward(self, x):
        return self.lin(x) + self.shift


@pytest.mark.parametrize("how", ["module_argument", "sequential_argument", "closure", "closure_data_swap"])
def test_swapping_parameters_and_buffers_rerecords_correctly(how):
    torch.manual_seed(1)
    if how == "sequential_argument":
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32)).cuda().eval()
    else:
        m = Shifted().cuda()
    f = cgraw.graphed((lambda x: m(x)) if how.startswith("closure") else (lambda mod, x: mod(x)))
    call = (lambda x: f(x)) if how.startswith("closure") else (lambda x: f(m, x))
    lin = m.lin if isinstance(m, Shifted) else m[0]
    for i in range(8):
        if i == 4:
            if how == "closure_data_swap":
                lin.weight.data = torch.randn(32, 32, device="cuda")  # same object, new address
            else:
                lin.bias = torch.nn.Parameter(torch.randn(32, device="cuda"))
                if isinstance(m, Shifted):
                    m.shift = torch.randn(32, device="cuda")
                else:
                    m[1].running_mean = torch.randn(32, device="cuda")
        x = trand(4, 32)
        with torch.no_grad():
            got, ref = call(x), m(x)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        cgraw.mark_step_begin()
    st = _stats(f)
    assert st.rerecords >= 1 and st.recordings >= 2, cgraw.report(file=open(os.devnull, "w"))


# ---------------------------------------------------------------- CPU results


def test_cpu_outputs_and_cpu_random_numbers_run_eagerly():
    def rand_out(x):
        return x * 2.0, torch.rand(3)

    def scaled(x):
        return x * torch.rand(1).item()

    def arange_out(x):
        return x + 1.0, torch.arange(4)

    for body in (rand_out, scaled, arange_out):
        f = cgraw.graphed(body)
        prev = None
        for i in range(5):
            x = trand(64)
            torch.manual_seed(100 + i)
            got = f(x)
            torch.manual_seed(100 + i)
            ref = body(x)
            for g_, r_ in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
                torch.testing.assert_close(g_, r_)
            if body is rand_out:
                if prev is not None:
                    assert not torch.equal(prev, got[1])  # fresh numbers every call, never stale
                prev = got[1]
            cgraw.mark_step_begin()
        st = _stats(f)
        assert st.recordings == 0 and any("CPU" in r for r in st.skip_reasons), st.skip_reasons


# ---------------------------------------------------------------- memory stays valid


def test_eager_arrays_from_a_pool_never_get_graph_memory():
    pool = cgraw.DevicePool(name="shared")
    x = crand(1 << 16)
    with cgraw.capture(pool=pool) as g:
        t1 = cp.exp(x)  # temporaries freed inside the capture: the graph writes them on replay
        t2 = cp.sin(t1) * 2.0
        y = t2 + t1
        del t1, t2
    z = cp.cos(y)  # eager, not in the pool
    del y  # an output dying: its block is still written by every replay
    with cp.cuda.using_allocator(pool.cupy_allocator()):
        eager = [cp.full(1 << 16, 7.0, dtype=cp.float32) for _ in range(4)]
    before = [a.copy() for a in eager]
    for _ in range(5):
        x[...] = crand(1 << 16)
        g.replay()
    cp.cuda.Device().synchronize()
    for a, b in zip(eager, before):
        assert cp.array_equal(a, b), "a replay overwrote an eager array of the same pool"
    del eager, before, z
    g.close()
    pool.close()


def test_reset_keeps_live_cupy_outputs_valid():
    def body(a):
        return cp.tanh(a) * 3.0 + a

    f = cgraw.graphed(body)
    kept = []
    for _ in range(4):
        a = crand(4096)
        out = f(a)
        kept.append((out, body(a)))
        cgraw.mark_step_begin()
    last, ref = kept[-1]
    cgraw.reset()
    gc.collect()
    junk = [crand(4096) for _ in range(16)]  # new allocations must not land on `last`
    g = cgraw.graphed(lambda a: a * 5.0)
    for _ in range(3):
        g(crand(4096))
    assert cp.array_equal(last, ref)
    del junk, kept


def test_fresh_pool_fallback_keeps_live_outputs_valid():
    def body(a):
        return cp.exp(cp.clip(a, -2, 2))

    f = cgraw.graphed(body)
    for _ in range(3):
        a = crand(2048)
        out = f(a)
    ref = body(a)
    _mgr()._renew()  # what a refused restore does
    junk = [crand(2048) for _ in range(16)]
    for _ in range(3):
        f(crand(2048))
    assert cp.array_equal(out, ref)
    del junk


# ---------------------------------------------------------------- persistent outputs


def test_parameters_closures_and_inputs_returned_are_never_poisoned():
    lin = torch.nn.Linear(16, 16).cuda()
    cache = torch.zeros(16, device="cuda")

    def returns_param(x):
        return lin(x), lin.weight

    def returns_closure(x):
        cache.add_(x.sum(0))
        return cache

    def returns_input(h):
        h.mul_(0.5)
        return h

    fp, fc, fi = cgraw.graphed(returns_param), cgraw.graphed(returns_closure), cgraw.graphed(returns_input)
    ref_cache = cache.clone()
    h = trand(8, 16)
    for i in range(6):
        x = trand(8, 16)
        with torch.no_grad():
            y, w = fp(x)
            torch.testing.assert_close(y, lin(x))
        assert w is lin.weight or w.data_ptr() == lin.weight.data_ptr()
        c = fc(x)
        ref_cache += x.sum(0)
        torch.testing.assert_close(c, ref_cache)
        h0 = h.clone()
        h = fi(h)
        torch.testing.assert_close(h, h0 * 0.5)
        cgraw.mark_step_begin()
        # a new generation: none of these is the tree's memory, all stay usable
        assert torch.isfinite(lin.weight).all() and torch.isfinite(cache).all() and torch.isfinite(h).all()
        with torch.no_grad():
            lin(x)  # the model still works
    assert _stats(fp).replays >= 3 and _stats(fc).replays >= 3 and _stats(fi).replays >= 3

    def make(x):
        return x * 2.0

    def use(y):
        return y + 1.0

    fm, fu = cgraw.graphed(make), cgraw.graphed(use)
    for _ in range(5):
        x = trand(32)
        y = fm(x)
        y.add_(3.0)  # in-place update of a returned tree output, then further calls
        torch.testing.assert_close(fu(y), x * 2.0 + 4.0)
        cgraw.mark_step_begin()


def test_recurrent_state_in_tuples():
    cell = torch.nn.LSTMCell(24, 32).cuda()

    def step(x, h, c):
        return cell(x, (h, c))

    f = cgraw.graphed(step)
    h, c = trand(4, 32), trand(4, 32)
    rh, rc = h.clone(), c.clone()
    with torch.no_grad():
        for _ in range(10):
            x = trand(4, 24)
            h, c = f(x, h, c)
            rh, rc = cell(x, (rh, rc))
            torch.testing.assert_close(h, rh, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(c, rc, rtol=1e-4, atol=1e-5)
    st = _stats(f)
    assert st.recordings >= 1 and st.replays >= 6, (st.recordings, st.replays, st.skip_reasons)


# ---------------------------------------------------------------- containers


Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Batch:
    x: object
    scale: float


class Outputs(collections.OrderedDict):
    pass


def test_namedtuples_dataclasses_and_dict_subclasses_are_flattened():
    def body(p, batch):
        s = p.a * batch.x + p.b
        out = Outputs()
        out["sum"] = s * batch.scale
        out["pair"] = Pair(s.sin(), s.cos())
        return out

    f = cgraw.graphed(body)
    for i in range(12):
        p = Pair(trand(128), trand(128))
        batch = Batch(trand(128), 0.5)
        got, ref = f(p, batch), body(p, batch)
        assert type(got) is Outputs and type(got["pair"]) is Pair
        torch.testing.assert_close(got["sum"], ref["sum"])
        torch.testing.assert_close(got["pair"].a, ref["pair"].a)
        torch.testing.assert_close(got["pair"].b, ref["pair"].b)
        cgraw.mark_step_begin()
    st = _stats(f)
    assert st.warmups == 1 and st.recordings == 1 and st.replays == 10, (st.warmups, st.recordings)
    got = f(Pair(trand(128), trand(128)), Batch(trand(128), 0.5))
    cgraw.mark_step_begin()
    with pytest.raises(RuntimeError, match="overwritten"):
        print(got["pair"].a)  # outputs inside containers are tracked (poisoned) like any other


def test_packed_sequence_runs_eagerly_with_a_reason_and_no_growth():
    lstm = torch.nn.LSTM(8, 16).cuda()

    def body(seq):
        out, _ = lstm(seq)
        return out.data

    f = cgraw.graphed(body)
    for _ in range(12):
        lengths = [7, 5, 2]
        data = [trand(n, 8) for n in lengths]
        seq = torch.nn.utils.rnn.pack_sequence(data)
        with torch.no_grad():
            torch.testing.assert_close(f(seq), body(seq))
    st = _stats(f)
    assert st.warmups == 0 and st.recordings == 0 and any("CPU" in r for r in st.skip_reasons)


# ---------------------------------------------------------------- failures named


def test_host_to_device_copy_is_named():
    for body in (lambda: torch.tensor([1.0, 2.0], device="cuda") * 2.0, lambda: torch.randn(3).cuda() + 1.0):
        with pytest.raises(cgraw.CaptureError, match="host-to-device copy from pageable memory"):
            with cgraw.capture():
                body()
    x = trand(10)
    with pytest.raises(cgraw.CaptureError, match="host synchronisation"):
        with cgraw.capture():
            (x * 2).sum().item()


def test_cupy_upload_random_cublas_and_sparse_are_named():
    import cupyx.scipy.ndimage as nd

    a = cp.asarray(rng.standard_normal((32, 32)).astype(np.float32))
    nd.gaussian_filter(a, 1.5)
    with cgraw.capture() as g:  # its weights' upload is staged by cgraw
        nd.gaussian_filter(a, 1.5)
    g.close()
    with pytest.raises(cgraw.CaptureError, match="host-to-device upload"):
        with cgraw.capture():
            a.set(rng.standard_normal((32, 32)).astype(np.float32))  # not through cupy.asarray: refused
    gen = sys.modules["cupy.random._generator"]
    gen._random_states.clear()  # first use of cupy.random inside the capture
    # random=False: cuRAND itself inside the capture (cgraw's own generator is tests/gpu/test_rng.py)
    with pytest.raises(cgraw.CaptureError, match="cupy.random"):
        with cgraw.capture(random=False):
            cp.random.random(100)
    assert cp.random.random(10).shape == (10,)  # CuPy stays usable
    with pytest.raises(cgraw.CaptureError, match="cupy.random"):
        with cgraw.capture(random=False):
            cp.random.random(100)
    assert float(cp.random.random(1000).mean()) > 0.3
    with pytest.raises(cgraw.CaptureError, match="cupy.random.vonmises"):  # not covered: named
        with cgraw.capture():
            cp.random.vonmises(0.0, 1.0, size=100)
    assert float(cp.random.random(1000).mean()) > 0.3
    import cupy.cublas

    v = cp.asarray(rng.standard_normal(64).astype(np.float32))
    with pytest.raises(cgraw.CaptureError, match="cuBLAS") as ei:  # isamax: a cuBLAS call cgraw does not route
        with cgraw.capture():
            cupy.cublas.iamax(v)
    assert isinstance(ei.value.__cause__, NotImplementedError), repr(ei.value.__cause__)
    m = cp.asarray(rng.standard_normal((8, 8)).astype(np.float32))
    with cgraw.capture() as g:  # a matrix product is (tests/gpu/test_cupy_libs.py)
        mm = m @ m
    g.replay()
    cp.testing.assert_allclose(mm, m @ m, rtol=1e-5, atol=1e-5)
    g.close()

    def sparse_out(x):
        return (x * 2.0).to_sparse()

    f = cgraw.graphed(sparse_out)
    for _ in range(3):
        x = trand(4, 4)
        torch.testing.assert_close(f(x).to_dense(), x * 2.0)
    assert any("sparse" in r for r in _stats(f).skip_reasons)


def test_host_functions_become_host_nodes():
    calls = {"cupy": 0, "cgraw": 0}

    def bump(key):
        calls[key] += 1

    x = crand(256)
    with cgraw.capture() as g:
        y = x * 2.0
        cp.cuda.get_current_stream().launch_host_func(bump, "cupy")
        g.capture_stream.launch_host_func(bump, "cgraw")
    for i in range(3):
        g.replay()
        cp.cuda.Device().synchronize()
        assert calls == {"cupy": i + 1, "cgraw": i + 1}
    assert cp.array_equal(y, x * 2.0)
    g.close()
    s = cgraw.Stream.create()
    s.launch_host_func(bump, "cgraw")  # outside a capture: runs once
    s.synchronize()
    assert calls["cgraw"] == 4


# ---------------------------------------------------------------- CuPy's own graph tests


def _h1(a):
    a = a + 3
    a = a * 7.6
    return a**2


def _h2(a):
    a = 3 * cp.sin(a)
    return cp.sqrt(a)


def _h3(a):
    a = a * cp.fft.fft(a)
    return cp.fft.ifft(a)


@pytest.mark.parametrize("mode", ["thread_local", "relaxed", "global"])
@pytest.mark.parametrize("helper", [_h1, _h2, _h3], ids=["arith", "math", "fft"])
def test_cupy_graph_test_helpers_capture(helper, mode):
    a = cp.asarray(rng.random(100))
    with cgraw.capture(mode=mode) as g:
        out = helper(a)
    for _ in range(3):
        a[...] = cp.asarray(rng.random(100))
        g.replay()
        ref = helper(a)
        assert cp.allclose(out, ref, equal_nan=True)
    g.close()


def test_cupy_stream_is_capturing_fork_join_and_failures():
    a = cp.asarray(rng.random(100))
    e1, e2 = cp.cuda.Event(), cp.cuda.Event()
    s2 = cp.cuda.Stream(non_blocking=True)
    with cgraw.capture() as g:
        s = cp.cuda.get_current_stream()
        assert s.is_capturing() and not cp.cuda.Stream.null.is_capturing()
        out1 = a * 100
        e1.record(s)
        s2.wait_event(e1)
        with s2:
            out2 = 3 * out1 + 1
            e2.record(s2)
        s.wait_event(e2)
    a[...] = cp.asarray(rng.random(100))
    g.replay()
    cp.cuda.Device().synchronize()
    assert cp.allclose(out2, 3 * (a * 100) + 1)
    g.close()

    def needs_sync(a):
        result = cp.zeros((1,), dtype=cp.int32)
        if a.sum() > 0:
            result += 1
        return result

    with pytest.raises(cgraw.CaptureError, match="host synchronisation"):
        with cgraw.capture():
            needs_sync(a)
    m = cp.asarray(rng.random((33, 33)))  # up to 32x32 svd captures (the Jacobi routine)
    with pytest.raises(cgraw.CaptureError, match="cuSOLVER"):
        with cgraw.capture():
            cp.linalg.svd(m + m.T)
    import cupyx.scipy.sparse as sp

    sm = cp.zeros((3, 4))
    sm[0] = 1
    sm = sp.csr_matrix(sm)
    sm.has_canonical_format
    with pytest.raises(cgraw.CaptureError, match="cuSPARSE"):
        with cgraw.capture():
            sm * sm.T
    with cgraw.capture() as g:  # and capture works again afterwards
        y = cp.sin(a)
    g.replay()
    assert cp.array_equal(y, cp.sin(a))
    g.close()


# ---------------------------------------------------------------- interrupts, threads, devices


def test_interrupt_right_after_the_capture_began(monkeypatch, pool):
    calls = {"n": 0}
    real = defer.gc_stress

    def stress():
        calls["n"] += 1
        if calls["n"] == 2:  # the one right after cuStreamBeginCapture
            raise KeyboardInterrupt
        real()

    monkeypatch.setattr(defer, "gc_stress", stress)
    x = trand(64)
    with pytest.raises(KeyboardInterrupt):
        with cgraw.capture(pool=pool):
            pass
    monkeypatch.undo()
    assert pool.capture_stream.capture_status == 0 and not defer.active()
    with cgraw.capture(pool=pool) as g:
        y = x + 2.0
    g.replay()
    torch.testing.assert_close(y, x + 2.0)
    g.close()


def test_capture_restores_the_current_device_and_context(pool):
    torch.cuda.set_device(0)
    before = _cuda.native(_cuda.ctx_get_current())
    x = trand(16)
    with cgraw.capture(device=0) as g:
        y = x * 2.0
    assert torch.cuda.current_device() == 0
    assert _cuda.native(_cuda.ctx_get_current()) == before
    g.replay()
    torch.testing.assert_close(y, x * 2.0)
    g.close()


# ---------------------------------------------------------------- reports and custom ops


def test_report_names_modules_by_class():
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)]).cuda()
    f1, f2 = cgraw.graphed(model), cgraw.graphed(torch.nn.Sequential(torch.nn.ReLU()).cuda())
    with torch.no_grad():
        f1(trand(2, 16))
        f2(trand(2, 16))
    text = cgraw.report(file=open(os.devnull, "w"))
    assert f1.name.startswith("Sequential") and f2.name.startswith("Sequential#") and f1.name != f2.name
    assert "Linear(in_features" not in text and len(text.splitlines()) < 20, text


def test_custom_ops_tagged_cudagraph_unsafe_run_eagerly():
    @torch.library.custom_op("cgrawtest::modify", mutates_args=(), tags=(torch._C.Tag.cudagraph_unsafe,))
    def modify(pic: torch.Tensor) -> torch.Tensor:
        pic1 = pic + 1
        pic1_cpu = (pic1.cpu() + 1) * 2
        return pic1_cpu.cuda() + pic

    @modify.register_fake
    def _(pic):
        return torch.empty_like(pic)

    def body(x):
        return modify(x * 2.0) - 1.0

    f = cgraw.graphed(body)
    for _ in range(4):
        x = trand(32)
        torch.testing.assert_close(f(x), body(x))
    st = _stats(f)
    assert st.recordings == 0
    assert any("cgrawtest.modify" in r and "cudagraph_unsafe" in r for r in st.skip_reasons), st.skip_reasons


def test_gc_stress_flag_is_read_from_the_environment():
    from cgraw._cuda import defer

    assert defer.CGRAW_GC_STRESS == (os.environ.get("CGRAW_GC_STRESS", "") in ("1", "true", "yes", "on"))


@pytest.fixture(autouse=True)
def _quiet_cgraw_warnings(caplog):
    with caplog.at_level(logging.ERROR, logger="cgraw"):
        yield
