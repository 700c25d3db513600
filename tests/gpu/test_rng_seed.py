"""GPU tier: torch's and CuPy's seeds govern the random numbers graphs draw.

Graphed and captured draws follow the frameworks' generators as eager draws do: the same seed and
the same sequence of calls give the same numbers; another seed gives others; eager draws after a
graphed call start past the offsets the graph consumed; ``torch.random.fork_rng`` and
``torch.cuda.set_rng_state`` put the numbers back. Every test seeds explicitly, draws on fresh
inputs, and checks that the graphed function really replayed (a silent eager run would follow the
generator too). Bitwise checks compare a replay with ``cgraw.rng.plan``'s NumPy Philox at the key the
generator's state gives (``rng.plan.replay_key``).
"""

from __future__ import annotations

import concurrent.futures
import io
import re
import threading

import numpy as np
import pytest
from gpu_data import trand

import cgraw
from cgraw.rng import plan as rng, device as rng_device, reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
F = torch.nn.functional

N = 4099  # not a multiple of 4: the last Philox group is partial


# ---------------------------------------------------------------- helpers


def _stats(f, device: int = 0):
    from cgraw.trees.graphed import _managers

    return _managers[device].stats[f.fn_id]


def _stats_all(device: int = 0):
    from cgraw.trees.graphed import _managers

    return list(_managers[device].stats.values())


def _assert_replayed(f, replays: int, device: int = 0):
    st = _stats(f, device)
    text = cgraw.report(file=io.StringIO())
    assert not st.skip_reasons and st.eager_calls == 0 and st.rerecords == 0, text
    assert st.recordings == 1 and st.replays >= replays, (st.recordings, st.replays, text)


def _gen(device: int = 0):
    return torch.cuda.default_generators[device]


def _source(kind: str = rng.TORCH, device: int = 0) -> rng.Source:
    """The generator record the graphs this thread captures on ``device`` read."""
    return rng_device.source(device, kind, 0, threading.get_ident())


def _reference(seed: int, offset: int, call: int, n: int) -> np.ndarray:
    """What ``torch.rand(n)`` drawn at offset ``call`` within a graph gives when the replay starts
    at torch's state ``(seed, offset)``."""
    return reference.reference_uniform_f32(rng.replay_key(rng.torch_base(seed), offset), call, n)


def _assert_bitwise(got: torch.Tensor, want: np.ndarray, what: str):
    g = got.cpu().numpy()
    bad = np.flatnonzero(g.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{what}: {bad.size} of {want.size} differ, first at {bad[:5].tolist()}"


def _draws(x):
    """Three kinds of draws and a deterministic part."""
    return x * 2.0, torch.rand_like(x), F.dropout(torch.ones_like(x), 0.5, training=True), torch.randn(7, device="cuda")


def _host(out) -> list:
    return [t.detach().cpu() for t in out]


def _same(a: list, b: list) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def _none_same(a: list, b: list) -> bool:
    return not any(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def _warm(f, x, calls: int = 3):
    for _ in range(calls):
        f(x)


# ---------------------------------------------------------------- @cgraw.graphed


def test_torch_manual_seed_reproduces_warm_graphed_calls():
    f = cgraw.graphed(lambda x: torch.rand_like(x) + x)
    x = trand(N)
    _warm(f, x)

    def three(seed):
        torch.manual_seed(seed)
        return [f(x).clone().cpu() for _ in range(3)]

    a = three(0)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])
    assert _same(three(0), a)
    b = three(1)
    assert _none_same(a, b)
    _assert_replayed(f, 9)
    torch.cuda.manual_seed(0)  # the CUDA generator alone
    assert _same([f(x).clone().cpu() for _ in range(3)], a)
    torch.cuda.manual_seed_all(1)
    assert _same([f(x).clone().cpu() for _ in range(3)], b)


def test_torch_manual_seed_reproduces_a_graphed_functions_first_calls_warm_up_included():
    """A program seeded once and run twice from the start draws the same numbers call by call:
    the warm-up draws with cgraw's kernels at the offsets the recording takes, so it draws what a
    replay from the same generator state draws (bitwise against the reference) and moves the
    generator as a replay does."""
    f = cgraw.graphed(_draws)

    def run(seed, calls=4):
        torch.manual_seed(seed)
        return [_host(f(x)) for x in xs[:calls]]

    torch.manual_seed(123)
    xs = [trand(N) for _ in range(4)]
    torch.manual_seed(9)
    before = _gen().get_offset()
    first = _host(f(xs[0]))  # the warm-up
    assert _gen().get_offset() == before + 4 * 3  # three draws, as a replay moves it
    _assert_bitwise(first[1], _reference(9, before, 0, N), "the warm-up's rand_like")
    rest = [_host(f(x)) for x in xs[1:]]
    assert _stats(f).warmups == 1 and _stats(f).replays >= 2
    again = run(9)  # replays only, now
    assert all(_same(a, b) for a, b in zip([first] + rest, again, strict=True))
    assert _none_same(first[1:], again[1][1:])  # every call draws fresh numbers
    assert all(_none_same(a[1:], b[1:]) for a, b in zip(again, run(10), strict=True))
    _assert_replayed(f, 6)


@pytest.mark.parametrize("loop", ["cgraw", "torch"])
def test_a_graphed_loop_that_draws_repeats_its_numbers_after_the_same_seed_warm_up_included(loop):
    """A ``cgraw.while_loop`` (or torch's ``while_loop``) whose body draws: its warm-up runs the
    loop on the host, drawing at the offsets and keys the recording's WHILE node draws at, so a
    program seeded once and run twice from the start draws the same tables call by call, the
    warm-up's too."""
    from torch._higher_order_ops import while_loop as torch_while_loop

    run_loop = cgraw.while_loop if loop == "cgraw" else torch_while_loop

    def table(h):
        i0 = torch.zeros((), dtype=torch.int64, device=h.device)

        def row(h, i):
            return torch.cat([h[1:], torch.rand(1, h.shape[1], device=h.device)]), i + 1

        return run_loop(lambda h, i: i < 6, row, (h, i0))[0]

    f = cgraw.graphed(table)
    h0 = trand(6, 512) - 2  # every row is replaced by the loop

    def run(seed):
        torch.manual_seed(seed)
        return [f(h0).clone() for _ in range(4)]  # the first run: warm-up, recording, replays

    first = run(3)
    again = run(3)  # replays only, now
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    for t in first:
        assert len({tuple(r) for r in t.tolist()}) == 6 and bool(((t >= 0) & (t < 1)).all())
    assert not torch.equal(first[0], first[1])
    _assert_replayed(f, 5)


def test_graphed_calls_draw_at_the_generators_state_and_advance_it():
    """Bitwise: a replay's numbers are those of its key at torch's (seed, offset) before it; the
    offset moves by 4 per draw; back-to-back replays write no generator record."""
    f = cgraw.graphed(lambda x: (x + 1.0, torch.rand_like(x), torch.rand(N, device="cuda")))
    x = trand(N)
    _warm(f, x)
    torch.manual_seed(5)
    writes = _source().writes
    for i in range(4):
        before = _gen().get_offset()
        _, u, v = f(x)
        assert _gen().get_offset() == before + 8
        _assert_bitwise(u, _reference(5, before, 0, N), f"call {i}, first draw")
        _assert_bitwise(v, _reference(5, before, 1, N), f"call {i}, second draw")
    assert _source().writes == writes + 1  # once, for the re-seed
    _assert_replayed(f, 4)


def test_eager_draws_see_the_offset_graphed_calls_consume():
    f = cgraw.graphed(lambda x: F.dropout(x, 0.3, training=True))
    x = torch.ones(N, device="cuda")
    _warm(f, x)
    torch.manual_seed(2)
    without = torch.rand(N, device="cuda")
    torch.manual_seed(2)
    f(x)
    after = torch.rand(N, device="cuda")
    assert not torch.equal(after, without)
    torch.manual_seed(2)
    f(x)
    assert torch.equal(torch.rand(N, device="cuda"), after)

    def sequence():  # graphed and eager draws interleaved, the generator moved between calls
        torch.manual_seed(4)
        out = [f(x).clone(), torch.rand(N, device="cuda"), f(x).clone(), f(x).clone(),
               torch.randn(N, device="cuda"), f(x).clone()]
        return _host(out)

    s1, s2 = sequence(), sequence()
    assert _same(s1, s2)
    masks = [s1[i] for i in (0, 2, 3, 5)]
    assert all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i))
    _assert_replayed(f, 10)


def test_an_eager_draw_before_a_graphed_call_changes_its_numbers():
    f = cgraw.graphed(lambda x: torch.rand_like(x) * x)
    x = torch.ones(N, device="cuda")
    _warm(f, x)
    torch.manual_seed(8)
    plain = f(x).clone()
    torch.manual_seed(8)
    torch.rand(3, device="cuda")
    moved = f(x).clone()
    assert not torch.equal(plain, moved)


def test_fork_rng_and_set_rng_state_put_the_numbers_back():
    f = cgraw.graphed(lambda x: _draws(x))
    x = trand(N)
    _warm(f, x)
    torch.manual_seed(3)
    f(x)
    state = torch.cuda.get_rng_state()
    first = _host(f(x)) + _host(f(x))
    torch.cuda.set_rng_state(state)
    assert _same(_host(f(x)) + _host(f(x)), first)
    with torch.random.fork_rng(devices=[0]):
        inside = _host(f(x))
        torch.rand(5, device="cuda")
        f(x)
    assert _same(_host(f(x)), inside)  # fork_rng restored the state the block started from
    with torch.random.fork_rng(devices=[0]):
        torch.manual_seed(99)
        other = _host(f(x))
    assert not torch.equal(other[1], inside[1])
    _assert_replayed(f, 8)


def test_replays_on_a_side_stream_draw_the_same_numbers():
    """The numbers are a function of the generator's state, whichever stream replays (the
    record's write goes on the replay's stream, ahead of the launch)."""
    f = cgraw.graphed(lambda x: torch.rand_like(x) - x)
    x = trand(N)
    _warm(f, x)
    torch.manual_seed(6)
    here = [f(x).clone().cpu() for _ in range(3)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.manual_seed(6)
        there = [f(x).clone() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(s)
    assert _same([t.cpu() for t in there], here)


def test_backward_graphs_and_dropout_follow_the_seed():
    lin = torch.nn.Linear(64, 64).cuda()
    f = cgraw.graphed(lambda x: F.dropout(lin(x), 0.5, training=True))
    x = trand(32, 64)

    def step():
        y = f(x)
        y.square().sum().backward()
        g = lin.weight.grad.clone()
        lin.zero_grad()
        return [y.detach().clone(), g]

    for _ in range(6):  # forward and backward warmed up and recorded
        step()

    def run(seed):
        torch.manual_seed(seed)
        return [t.cpu() for _ in range(3) for t in step()]

    a = run(0)
    assert _same(run(0), a)
    assert not torch.equal(run(1)[0], a[0])
    st = _stats(f)
    assert st.eager_calls == 0 and not st.skip_reasons and st.replays >= 9, cgraw.report(file=io.StringIO())
    backward = [s for s in _stats_all() if s.name.endswith(".backward")]
    assert sum(s.replays for s in backward) >= 6, cgraw.report(file=io.StringIO())


def test_the_proof_of_rebinding_draws_as_one_replay_and_moves_the_generator_once():
    """The recording's first call replays twice to prove that an input can be read in place: the
    call's numbers are still those of one replay at the generator's state, and torch's offset
    moves by one replay's draws."""
    f = cgraw.graphed(lambda x: (x * 2.0, torch.rand(N, device="cuda")))
    x = trand(N)
    torch.manual_seed(12)
    f(x)  # warm-up: eager
    y = trand(N)  # an eager draw: made before the offset is read
    before = _gen().get_offset()
    _, u = f(y)  # recorded, then the proof
    assert _gen().get_offset() == before + 4
    _assert_bitwise(u, _reference(12, before, 0, N), "the recording's first call")
    text = cgraw.report(file=io.StringIO())
    counts = re.search(r", (\d+) input\(s\) rebound, (\d+) copied", text)
    assert counts is not None and counts.group(1) == "1", text  # the proof ran and held
    nxt = _gen().get_offset()
    _, u2 = f(x)
    _assert_bitwise(u2, _reference(12, nxt, 0, N), "the next call")


def test_threads_replaying_side_by_side_draw_apart():
    """Each thread records and replays on its own stream (its own tree, its own generator record);
    no two calls of any thread draw the same numbers."""
    f = cgraw.graphed(lambda x: torch.rand_like(x) + x)

    def work(_):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = torch.zeros(N, device="cuda")
            got = [f(x).clone() for _ in range(30)]
        s.synchronize()
        st = _stats(f)  # this thread's tree
        return [g.cpu() for g in got], (st.recordings, st.replays, st.eager_calls, dict(st.skip_reasons))

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:  # 4 trees, freed at shutdown
        results = list(pool.map(work, range(4)))
    assert [r[1] for r in results] == [(1, 28, 0, {})] * 4  # each thread: warm-up, recording, 28 replays
    rows = [tuple(t[:16].tolist()) for outs, _ in results for t in outs]
    assert len(rows) == 120 and len(set(rows)) == 120


# ---------------------------------------------------------------- cgraw.capture()


def test_captured_graphs_follow_the_seed_and_write_only_when_it_moved():
    x = trand(N)
    with cgraw.capture() as g:
        out = _draws(x)
    assert g.rng is not None and g.rng.draws == 3, g.rng

    def three(seed):
        torch.manual_seed(seed)
        res = []
        for _ in range(3):
            g.replay()
            res += _host(out)
        return res

    a = three(0)
    w = _source().writes
    assert _same(three(0), a) and _source().writes == w + 1
    assert _none_same(three(1)[1:4], a[1:4])
    torch.manual_seed(0)
    g.replay()
    assert _gen().get_offset() == 4 * g.rng.draws
    key, pos, base = rng_device.read_record(0, _source().slot)  # the record after the replay's last node
    assert (pos, base) == (4 * g.rng.draws, rng.torch_base(0)) and key == rng.replay_key(base, pos)


def test_a_capture_moves_no_generator_and_its_replays_do():
    torch.cuda.manual_seed(1)
    a = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(1)
    with cgraw.capture() as g:
        torch.rand(5, device="cuda")
        F.dropout(torch.ones(100, device="cuda"), 0.3, training=True)
    assert torch.equal(torch.rand(5, device="cuda"), a)  # capturing drew nothing
    torch.cuda.manual_seed(1)
    g.replay()
    g.replay()
    assert _gen().get_offset() == 2 * 4 * g.rng.draws
    assert not torch.equal(torch.rand(5, device="cuda"), a)


def test_two_graphs_share_the_generator():
    x = trand(N)
    with cgraw.capture() as g1:
        u1 = torch.rand_like(x)
    with cgraw.capture() as g2:
        u2 = torch.rand_like(x)
        torch.rand(3, device="cuda")
    torch.manual_seed(21)
    seen = []
    for g, u, o in ((g1, u1, 0), (g2, u2, 4), (g2, u2, 12), (g1, u1, 20)):
        assert _gen().get_offset() == o
        g.replay()
        _assert_bitwise(u, _reference(21, o, 0, N), f"replay at offset {o}")
        seen.append(u.cpu().clone())
    assert _gen().get_offset() == 24 and len({tuple(s[:8].tolist()) for s in seen}) == 4


# ---------------------------------------------------------------- CuPy


def test_cupy_seed_governs_captured_and_graphed_draws(cupy_mod):
    cp = cupy_mod
    x = cp.random.random(N)
    with cgraw.capture() as g:
        y = x + cp.random.random(N)
        z = cp.random.standard_normal(N, dtype=cp.float32)
    f = cgraw.graphed(lambda a: a + cp.random.random(N))
    _warm(f, x)

    def run(seed):
        cp.random.seed(seed)
        out = []
        for _ in range(2):
            g.replay()
            out += [cp.asnumpy(y), cp.asnumpy(z), cp.asnumpy(f(x))]
        return out

    a = run(7)
    assert all(np.array_equal(p, q) for p, q in zip(run(7), a, strict=True))
    b = run(8)
    assert not any(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not np.array_equal(a[0], a[3]) and not np.array_equal(a[2], a[5])
    _assert_replayed(f, 4)


def test_cupy_seed_reproduces_a_graphed_functions_first_calls_warm_up_included(cupy_mod):
    """As for torch: the warm-up draws CuPy's numbers with cgraw's kernels at the offsets the
    recording takes and moves ``_rk_seed`` as a replay does, so a program seeded once and run
    twice from the start draws the same numbers call by call, the warm-up's too."""
    cp = cupy_mod
    f = cgraw.graphed(lambda a: a + cp.random.random(N) + cp.random.gamma(2.0, size=N))
    xs = [cp.random.random(N) for _ in range(4)]

    def run(seed):
        cp.random.seed(seed)
        return [cp.asnumpy(f(x) - x) for x in xs]  # the numbers each call drew

    first = run(11)  # warm-up, recording, replays
    assert cp.random.get_random_state()._rk_seed == 11 + 4 * 2 * N  # every call moved it as a replay does
    again = run(11)  # replays only, now
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not any(np.array_equal(a, b) for a, b in zip(first, run(12), strict=True))
    assert len({a[:8].tobytes() for a in first}) == 4  # every call draws fresh numbers
    _assert_replayed(f, 6)


def test_cupy_replays_advance_rk_seed_and_leave_curand_alone(cupy_mod):
    cp = cupy_mod
    with cgraw.capture() as g:
        cp.random.random(1000)
        cp.random.gamma(2.0, size=24)
    cp.random.seed(5)
    plain_gamma = cp.random.gamma(2.0, size=50)
    plain_uniform = cp.random.random(10)
    cp.random.seed(5)
    rs = cp.random.get_random_state()
    g.replay()
    assert rs._rk_seed == 5 + 1024  # the elements drawn, as CuPy's own kernels advance it
    assert not np.array_equal(cp.asnumpy(cp.random.gamma(2.0, size=50)), cp.asnumpy(plain_gamma))
    # cuRAND's draws keep cuRAND's own offset: the replay did not touch it
    cp.testing.assert_array_equal(cp.random.random(10), plain_uniform)


# ---------------------------------------------------------------- several devices


def test_each_device_follows_its_own_generator():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    graphs = []
    for d in (0, 1):
        with torch.cuda.device(d):
            x = torch.zeros(N, device=f"cuda:{d}")
            with cgraw.capture(device=d) as g:
                u = torch.rand_like(x)
            graphs.append((g, u))

    def run():
        out = []
        for g, u in graphs * 2:
            with torch.cuda.device(u.device):
                g.replay()
            out.append(u.cpu().clone())
        return out

    torch.cuda.manual_seed_all(3)
    a = run()
    assert _gen(1).get_offset() == 8 and _gen(0).get_offset() == 8
    torch.cuda.manual_seed_all(3)
    assert _same(run(), a)
    torch.cuda.manual_seed_all(3)
    with torch.cuda.device(1):
        torch.cuda.manual_seed(4)  # device 1 only
    b = run()
    assert torch.equal(b[0], a[0]) and not torch.equal(b[1], a[1])
