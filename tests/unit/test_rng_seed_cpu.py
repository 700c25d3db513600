"""CPU tier: graphed random numbers follow the frameworks' generators. The host's side (the
mirror of each generator record, when a replay writes the record, how it advances the generator)
runs here on stand-in generators and a model of the device record that applies each write and
each graph's advance in stream order, as the kernels do (``rng.kernels.SET``, ``ADVANCE``)."""

from __future__ import annotations

import threading
import time
import types

import pytest

from cgraw.rng import plan as rng

# ----------------------------------------------------------------------------- stand-ins


class TorchGen:
    """torch's CUDA generator as the replays see it: seed, offset (a multiple of 4), state."""

    def __init__(self, seed: int = 67280421310721):
        self.seed, self.offset = seed, 0

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        if offset % 4:
            raise RuntimeError("offset must be a multiple of 4")
        self.offset = offset

    def manual_seed(self, seed: int) -> None:  # torch: set_current_seed resets the offset
        self.seed, self.offset = seed, 0

    def get_state(self) -> tuple:
        return self.seed, self.offset

    def set_state(self, state: tuple) -> None:
        self.seed, self.offset = state

    def eager(self, n: int = 1) -> tuple:
        """An eager draw: the numbers come from (seed, offset); the offset moves on by 4 per call."""
        drawn = (self.seed, self.offset)
        self.offset += 4 * n
        return drawn


class Record:
    """The device's 32-byte generator record; ``write`` is ``rng.device``'s, applied in stream order."""

    def __init__(self, kind: str):
        self.kind = kind
        self.key = self.pos = self.base = 0
        self.streams = []

    def write(self, stream, base: int, pos: int) -> None:
        self.streams.append(stream)
        self.base, self.pos, self.key = base, pos, rng.replay_key(base, pos)

    def advance(self, inc: int) -> None:  # cgraw_rng_advance
        self.pos = rng.advance(self.kind, self.pos, inc)
        self.key = rng.replay_key(self.base, self.pos)


class FakeGraph:
    """A captured graph: ``draws`` offsets per replay read the record's key; its last node advances
    the record. ``replay`` runs the host's step, then the device's work in order."""

    def __init__(self, use, record: Record, draws: int):
        self.use, self.record, self.draws = use, record, draws

    def replay(self, stream: int = 7, fail: bool = False) -> list:
        self.use.sync(stream)
        if fail:  # the launch failed: nothing ran on the device
            rng.GraphRng([self.use]).forget()
            return []
        out = [(self.record.key, call) for call in range(self.draws)]
        self.record.advance(self.use.inc)
        return out


def torch_graph(gen, record=None, draws: int = 3, src=None):
    record = record or Record(rng.TORCH)
    src = src or rng.Source(rng.TORCH, 0, 0x1000, record.write)
    return FakeGraph(rng.TorchUse(gen, src, draws), record, draws), src


def in_sync(src: rng.Source, rec: Record, gen=None) -> bool:
    """The mirror's invariant: what the host believes the record holds, it holds."""
    if src.pos != rec.pos or (src.kind == rng.TORCH and rng.torch_base(src.seed) != rec.base):
        return False
    return gen is None or gen.get_offset() == src.pos


# ----------------------------------------------------------------------------- torch


def test_first_replay_writes_then_back_to_back_replays_only_advance_the_generator():
    gen = TorchGen(seed=5)
    g, src = torch_graph(gen, draws=3)
    first = g.replay()
    assert src.writes == 1 and g.record.streams == [7]  # on the replay's stream
    assert first == [(rng.replay_key(rng.torch_base(5), 0), c) for c in range(3)]
    assert gen.offset == 12 and in_sync(src, g.record, gen)
    keys = {first[0][0]}
    for r in range(1, 6):
        out = g.replay()
        assert out[0][0] == rng.replay_key(rng.torch_base(5), 12 * r)  # the generator's state alone
        keys.add(out[0][0])
    assert src.writes == 1 and gen.offset == 72 and len(keys) == 6 and in_sync(src, g.record, gen)


def test_manual_seed_reproduces_and_another_seed_differs():
    gen = TorchGen()
    g, src = torch_graph(gen)

    def run(seed):
        gen.manual_seed(seed)
        return [g.replay() for _ in range(3)]

    a = run(0)
    writes = src.writes
    assert run(0) == a and src.writes == writes + 1  # one write, at the re-seed
    b = run(1)
    assert all(x != y for x, y in zip(a, b))
    assert run(0) == a and in_sync(src, g.record, gen)


def test_eager_draws_see_the_offset_replays_consume_and_replays_see_eager_draws():
    gen = TorchGen()
    g, src = torch_graph(gen, draws=2)
    gen.manual_seed(3)
    without = gen.eager()
    gen.manual_seed(3)
    g.replay()
    after = gen.eager()
    assert after != without and after == (3, 8)  # the eager draw starts past the replay's offsets

    def sequence():
        gen.manual_seed(3)
        out = [g.replay(), gen.eager(), g.replay(), g.replay(), gen.eager(2), g.replay()]
        return out, src.writes

    s1, w1 = sequence()
    s2, w2 = sequence()
    assert s1 == s2
    assert w2 - w1 == 3  # the re-seed and the two eager draws moved the generator: three writes
    replays = [s1[i] for i in (0, 2, 3, 5)]
    assert len({r[0][0] for r in replays}) == 4 and in_sync(src, g.record, gen)


def warm_up(gen, src, record: Record, draws: int, eager_between: int = 0, *, thread: int = 1) -> list:
    """A warm-up drawing with cgraw's kernels (``rng.TorchWarm``, ``rng.WarmStream``): each draw takes
    its offset (the first makes the record follow the generator) and reads the record's key; then
    the device advances the record and the host its mirror. ``eager_between``: torch's own draws
    after the first (a draw cgraw does not cover)."""
    w = rng.TorchWarm(gen, src, 9)
    s = rng.WarmStream(src.slot, 0, thread, w)
    out = []
    for i in range(draws):
        call = s.take()
        out.append((record.key, call))
        if i == 0:
            for _ in range(eager_between):
                gen.eager()
    if s.calls:
        record.advance(s.increment)
        w.end(s.increment)
    return out


def test_a_warm_up_draws_what_a_replay_from_the_same_generator_state_draws():
    gen = TorchGen()
    g, src = torch_graph(gen, draws=3)

    def run(seed):  # a warm-up, then replays of the recording
        gen.manual_seed(seed)
        return [warm_up(gen, src, g.record, 3)] + [g.replay() for _ in range(3)]

    first = run(0)
    assert in_sync(src, g.record, gen) and gen.offset == 48
    gen.manual_seed(0)
    assert [g.replay() for _ in range(4)] == first  # replays only: call by call, the warm-up's numbers too
    assert len({c[0][0] for c in first}) == 4  # every call draws fresh numbers
    assert run(1) != first and run(0) == first


def test_a_warm_up_with_torchs_own_draws_leaves_the_mirror_true_and_the_generator_past_both():
    gen = TorchGen()
    g, src = torch_graph(gen, draws=2)
    gen.manual_seed(4)
    warm_up(gen, src, g.record, 2, eager_between=1)
    assert gen.offset == 4 + 4 + 4  # its first draw, torch's, its second
    assert src.pos == g.record.pos == 8 and rng.torch_base(src.seed) == g.record.base  # the mirror is the record
    writes = src.writes
    g.replay()  # the generator is not where the record is: the replay writes it first
    assert src.writes == writes + 1 and in_sync(src, g.record, gen)


def test_a_warm_up_that_draws_nothing_leaves_the_generator_and_the_record_alone():
    gen = TorchGen()
    g, src = torch_graph(gen)
    gen.manual_seed(2)
    assert warm_up(gen, src, g.record, 0) == []
    assert gen.offset == 0 and src.writes == 0


def test_warm_ups_and_replays_of_threads_side_by_side_never_draw_from_one_state():
    """A replay on another thread between two draws of a warm-up starts past the warm-up's first
    draw, so no (key, offset) is drawn twice."""
    gen = TorchGen()
    rec_a, rec_b = Record(rng.TORCH), Record(rng.TORCH)
    src_a = rng.Source(rng.TORCH, 0, 0x1000, rec_a.write)
    g_b, _ = torch_graph(gen, record=rec_b, draws=3)
    w = rng.TorchWarm(gen, src_a, 9)
    s = rng.WarmStream(src_a.slot, 0, 1, w)
    drawn = [(rec_a.key, s.take())]
    drawn += g_b.replay()  # the other thread's replay, between the warm-up's draws
    drawn += [(rec_a.key, s.take()), (rec_a.key, s.take())]
    assert len(set(drawn)) == len(drawn) == 6
    assert gen.offset == 4 * 6


def test_set_rng_state_and_fork_rng_restore_the_numbers():
    gen = TorchGen()
    g, _ = torch_graph(gen)
    gen.manual_seed(11)
    g.replay()
    saved = gen.get_state()  # fork_rng: get_rng_state on entry ...
    inside = [g.replay(), gen.eager(), g.replay()]
    gen.set_state(saved)  # ... set_rng_state on exit
    assert [g.replay(), gen.eager(), g.replay()] == inside


def test_same_offset_under_another_seed_is_seen():
    """The seed is read too: a state whose offset equals the mirror's is not enough."""
    gen = TorchGen()
    g, src = torch_graph(gen, draws=1)
    gen.manual_seed(0)
    g.replay()  # offset 4, mirror (0, 4)
    gen.manual_seed(1)
    gen.eager()  # offset 4 again, seed 1
    out = g.replay()
    assert out[0][0] == rng.replay_key(rng.torch_base(1), 4) and src.writes == 2
    gen.set_state((0, 8))
    gen_state_before = src.writes
    g.replay()  # mirror (1, 8), generator (0, 8)
    assert src.writes == gen_state_before + 1


def test_graphs_sharing_a_generator_take_turns_without_writes():
    gen = TorchGen(seed=9)
    record = Record(rng.TORCH)
    g1, src = torch_graph(gen, record, draws=2)
    g2, _ = torch_graph(gen, record, draws=5, src=src)
    outs = [g1.replay(), g2.replay(), g2.replay(), g1.replay()]
    assert src.writes == 1 and gen.offset == 2 * 8 + 2 * 20
    assert len({o[0][0] for o in outs}) == 4 and in_sync(src, record, gen)


def test_a_launch_that_fails_makes_the_next_replay_write():
    gen = TorchGen(seed=2)
    g, src = torch_graph(gen)
    g.replay()
    g.replay(fail=True)
    assert src.pos == -1
    out = g.replay()
    assert src.writes == 2 and out[0][0] == rng.replay_key(rng.torch_base(2), gen.offset - 12)
    assert in_sync(src, g.record, gen)


def test_a_replay_undone_with_its_record_draws_again_what_it_drew():
    """The proof of rebinding: the device ranges (the record among them) and the host's side are
    put back, the graph replays again; the generator moves once."""
    gen = TorchGen(seed=4)
    g, src = torch_graph(gen)
    g.replay()
    gen.eager()  # the next replay writes
    graph_rng = rng.GraphRng([g.use])
    host = graph_rng.save()
    device = (g.record.key, g.record.pos, g.record.base)
    a = g.replay()
    g.record.key, g.record.pos, g.record.base = device
    graph_rng.restore(host)
    b = g.replay()
    assert a == b and gen.offset == 4 + 12 + 12 and in_sync(src, g.record, gen)


def test_graph_rng_runs_every_use_and_describes_them():
    gen = TorchGen(seed=1)
    t_rec, c_rec = Record(rng.TORCH), Record(rng.CUPY)
    tsrc = rng.Source(rng.TORCH, 1, 0x1000, t_rec.write)
    states, rs = _cupy_states(device=1, seed=6)
    csrc = rng.Source(rng.CUPY, 1, 0x1020, c_rec.write)
    both = rng.GraphRng([rng.TorchUse(gen, tsrc, 2), rng.RkUse(states, 1, csrc, 3, 700, _no_state)])
    assert both.draws == 5 and both.sources == [tsrc, csrc]
    both.sync(3)
    assert gen.offset == 8 and rs._rk_seed == 706 and t_rec.streams == c_rec.streams == [3]
    assert "torch on device 1: 2 draw(s), +8" in repr(both) and "cupy on device 1: 3 draw(s), +700" in repr(both)
    both.forget()
    assert tsrc.pos == csrc.pos == -1
    one = rng.GraphRng([rng.TorchUse(gen, tsrc, 1)])
    assert one.sync is one.uses[0].sync  # one generator: its step itself, no loop


# ----------------------------------------------------------------------------- CuPy


class RandomState:
    """CuPy's RandomState as the replays see it: ``_rk_seed`` (set by seed, advanced by draws)."""

    def __init__(self, seed: int):
        self.seed(seed)

    def seed(self, seed: int) -> None:
        self._rk_seed = seed

    def _update_seed(self, size: int) -> None:  # CuPy's own kernels (gamma, beta, ...)
        self._rk_seed = (self._rk_seed + size) % rng.UINT64_MAX


def _cupy_states(device: int = 0, seed: int = 0):
    rs = RandomState(seed)
    return types.SimpleNamespace(_random_states={device: rs}), rs


def _no_state(device):
    raise AssertionError("the state exists")


def cupy_graph(states, elements: int = 100, draws: int = 2, make_state=_no_state):
    record = Record(rng.CUPY)
    src = rng.Source(rng.CUPY, 0, 0x1020, record.write)
    return FakeGraph(rng.RkUse(states, 0, src, draws, elements, make_state), record, draws), src


def test_cupy_seed_governs_replays_and_its_kernels_see_what_they_consumed():
    states, rs = _cupy_states(seed=42)
    g, src = cupy_graph(states, elements=100)

    def run(seed):
        states._random_states[0].seed(seed)
        return [g.replay() for _ in range(3)]

    a = run(42)
    assert rs._rk_seed == 342 and src.writes == 1  # advanced by the elements drawn, as CuPy's kernels
    assert a[0][0][0] == rng.replay_key(rng.CUPY_BASE, 42)
    assert run(42) == a and src.writes == 2
    b = run(43)
    assert all(x != y for x, y in zip(a, b))
    rs.seed(42)
    g.replay()
    rs._update_seed(10)  # an eager gamma draw: the next replay starts past it
    assert g.replay()[0][0] == rng.replay_key(rng.CUPY_BASE, 152) and in_sync(src, g.record)


def test_cupy_state_made_on_first_use_and_after_reset_states():
    made = []

    def make_state(device):
        rs = RandomState(1000 + len(made))
        states._random_states[device] = rs
        made.append(rs)
        return rs

    states = types.SimpleNamespace(_random_states={})
    g, src = cupy_graph(states, elements=5, make_state=make_state)
    g.replay()
    assert len(made) == 1 and made[0]._rk_seed == 1005
    states._random_states = {}  # cupy.random.reset_states() replaces the table
    out = g.replay()
    assert len(made) == 2 and out[0][0] == rng.replay_key(rng.CUPY_BASE, 1001) and src.writes == 2


def test_cupy_position_wraps_as_cupy_does():
    states, rs = _cupy_states(seed=rng.UINT64_MAX - 2)
    g, src = cupy_graph(states, elements=5)
    g.replay()
    g.replay()
    assert rs._rk_seed == 8 and g.record.pos == 8 and src.writes == 1 and in_sync(src, g.record)


def cupy_warm_up(states, src, record: Record, sizes, eager_between: int = 0) -> list:
    """A warm-up drawing CuPy's numbers with cgraw's kernels (``rng.RkWarm``, ``rng.WarmStream``): a
    draw per entry of ``sizes`` (its elements); ``eager_between``: elements CuPy's own kernels draw
    after the first."""
    w = rng.RkWarm(lambda: states._random_states[0], src, 9)
    s = rng.WarmStream(src.slot, 0, 1, w)
    out = []
    for i, n in enumerate(sizes):
        call = s.take(1, n)
        out.append((record.key, call))
        if i == 0 and eager_between:
            states._random_states[0]._update_seed(eager_between)
    if s.calls:
        record.advance(s.increment)
        w.end(s.increment)
    return out


def test_a_cupy_warm_up_draws_what_a_replay_after_the_same_seed_draws():
    states, rs = _cupy_states(seed=42)
    g, src = cupy_graph(states, elements=100, draws=2)

    def run(seed):  # a warm-up, then replays of the recording
        rs.seed(seed)
        return [cupy_warm_up(states, src, g.record, (60, 40))] + [g.replay() for _ in range(3)]

    first = run(42)
    assert rs._rk_seed == 42 + 400 and in_sync(src, g.record)  # as four replays would leave it
    rs.seed(42)
    assert [g.replay() for _ in range(4)] == first  # replays only: the warm-up's numbers too
    assert len({c[0][0] for c in first}) == 4 and run(43) != first and run(42) == first


def test_a_cupy_warm_up_with_cupys_own_draws_leaves_the_mirror_true():
    states, rs = _cupy_states(seed=5)
    g, src = cupy_graph(states, elements=30, draws=2)
    cupy_warm_up(states, src, g.record, (10, 20), eager_between=7)
    assert rs._rk_seed == 5 + 10 + 7 + 20 and src.pos == g.record.pos == 35  # the mirror is the record
    writes = src.writes
    g.replay()  # CuPy's generator is past the record: the replay writes it first
    assert src.writes == writes + 1 and in_sync(src, g.record) and rs._rk_seed == 42 + 30


def test_cupy_save_and_restore():
    states, rs = _cupy_states(seed=3)
    g, src = cupy_graph(states)
    use = g.use
    saved = use.save()
    g.replay()
    use.restore(saved)
    assert rs._rk_seed == 3 and src.pos == -1
    empty = rng.RkUse(types.SimpleNamespace(_random_states={}), 0, src, 1, 1, _no_state)
    empty.restore(empty.save())  # no state yet: nothing to put back


# ----------------------------------------------------------------------------- the replays' hooks


def test_graph_replay_runs_the_generators_step_before_its_launch(monkeypatch):
    import cgraw
    from cgraw.runtime import graph as graph_mod

    events = []
    monkeypatch.setattr(graph_mod, "_launch", lambda exec_, ptr: events.append(("launch", ptr)) or (0,))
    monkeypatch.setattr(graph_mod._streams, "current_getter", lambda ordinal: 0x77)
    g = graph_mod.Graph._pending(cgraw.Device(0), None, None)
    g._exec = "exec"
    g.replay()
    g._set_rng(types.SimpleNamespace(sync=lambda ptr: events.append(("sync", ptr))))
    g.replay()
    assert events == [("launch", 0x77), ("sync", 0x77), ("launch", 0x77)]
    g._exec = None
    g.close()
    assert g.rng is None and g._rng_sync is None


def test_a_failed_launch_forgets_the_records(monkeypatch):
    import cgraw
    from cgraw import _cuda
    from cgraw.runtime import graph as graph_mod
    from cgraw.errors import CudaError

    monkeypatch.setattr(graph_mod, "_launch", lambda exec_, ptr: (_cuda.CUresult.CUDA_ERROR_INVALID_VALUE,))
    monkeypatch.setattr(graph_mod._streams, "current_getter", lambda ordinal: 0x77)
    gen = TorchGen(seed=3)
    rec = Record(rng.TORCH)
    src = rng.Source(rng.TORCH, 0, 0x1000, rec.write)
    g = graph_mod.Graph._pending(cgraw.Device(0), None, None)
    g._exec = "exec"
    g._set_rng(rng.GraphRng([rng.TorchUse(gen, src, 1)]))
    with pytest.raises(CudaError):
        g.replay()
    assert src.writes == 1 and src.pos == -1  # written, then unknown: the next replay writes again
    g._exec = None


def test_recording_replay_runs_the_step_on_its_launch_stream(monkeypatch):
    from cgraw.trees import recording
    from cgraw.runtime import stream as _streams
    from cgraw.trees.recording import Recording

    events = []
    monkeypatch.setattr(recording, "_launch", lambda exec_, ptr: events.append(("launch", ptr)) or (0,))
    monkeypatch.setattr(_streams, "current_getter", lambda ordinal: 0x5000 + ordinal)
    rec = Recording("f")
    rec.exec_, rec.ordinal, rec.out_spec, rec.out_leaves = "exec", 2, None, []
    rec.out_kinds, rec.out_alias = [], []
    rec.alias0 = lambda: "out"
    rec.rng_sync = lambda ptr: events.append(("sync", ptr))
    call = types.SimpleNamespace(rows=None, ptrs=[], leaves=[])
    assert rec.replay(call)[0] == "out"
    rec.bucket, rec.out_rows = 8, []
    rec.out_spec = ("seq", tuple, [])
    rec.replay(types.SimpleNamespace(rows=3, ptrs=[], leaves=[]))
    assert events == [("sync", 0x5002), ("launch", 0x5002)] * 2


def test_a_write_that_fails_leaves_the_mirror_and_the_generator_as_they_were():
    gen = TorchGen(seed=1)

    def refuse(stream, base, pos):
        raise RuntimeError("launch refused")

    src = rng.Source(rng.TORCH, 0, 0x1000, refuse)
    use = rng.TorchUse(gen, src, 1)
    with pytest.raises(RuntimeError):
        use.sync(0)
    assert src.pos == -1 and src.seed is None and src.writes == 0 and gen.offset == 0


# ----------------------------------------------------------------------------- threads


def test_each_thread_gets_its_own_record_on_each_device(monkeypatch):
    from cgraw.rng import device as rng_device

    allocs, zeroed = [], []
    monkeypatch.setattr(rng_device, "_sources", {})
    monkeypatch.setattr(rng_device, "_arenas", {})
    monkeypatch.setattr(rng_device, "_taken", {})
    monkeypatch.setattr(rng_device._cuda, "mem_alloc", lambda n: allocs.append(n) or 0x10000 * len(allocs))
    monkeypatch.setattr(rng_device._cuda, "stream_synchronize", lambda s: None)
    monkeypatch.setattr(rng_device._k, "memset_d32_async", lambda p, v, n, s: zeroed.append((p, n * 4)))
    monkeypatch.setattr(rng_device, "_writer", lambda device, slot: None)
    a = rng_device.source(0, rng.TORCH, 0, thread=1)
    assert rng_device.source(0, rng.TORCH, 0, thread=1) is a  # the same thread: the same record
    b = rng_device.source(0, rng.TORCH, 0, thread=2)
    c = rng_device.source(0, rng.CUPY, 0, thread=1)
    d = rng_device.source(1, rng.TORCH, 0, thread=1)
    assert a.slot == 0x10000 and b.slot == 0x10020 and c.slot == 0x10040 and d.slot == 0x20000
    assert allocs == [32 * rng_device.RECORDS] * 2 and zeroed == [(0x10000, 1024), (0x20000, 1024)]
    for t in range(3, rng_device.RECORDS):  # with a, b and c: the first arena full
        rng_device.source(0, rng.TORCH, 0, thread=t)
    assert len(allocs) == 2
    e = rng_device.source(0, rng.TORCH, 0, thread=1000)
    assert e.slot == 0x30000 and len(allocs) == 3
    assert sorted(rng_device.arenas()) == [(0x10000, 1024), (0x20000, 1024), (0x30000, 1024)]
    slots = [s.slot for s in rng_device._sources.values()]
    assert len(set(slots)) == len(slots)


class SlowGen(TorchGen):
    """A generator whose reads let other threads run (as a thread switch between torch's calls)."""

    def get_offset(self) -> int:
        time.sleep(0)
        off = self.offset
        time.sleep(0.0002)
        return off


def test_replays_of_several_threads_never_start_from_one_generator_state():
    gen = SlowGen(seed=1)
    starts, errors = [], []

    def worker():
        try:
            rec = Record(rng.TORCH)  # the thread's own record
            src = rng.Source(rng.TORCH, 0, 0x1000, rec.write)
            g = FakeGraph(rng.TorchUse(gen, src, 1), rec, 1)
            for _ in range(40):
                starts.append(g.replay()[0][0])
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(starts) == 120 and len(set(starts)) == 120  # 120 replays, 120 keys
    assert gen.offset == 120 * 4


# ----------------------------------------------------------------------------- a loop in a warm-up


def test_a_warm_ups_loop_draws_what_the_device_loop_of_its_recording_draws():
    """A graphed function drawing once, then in a three-iteration ``while_loop`` body twice, then
    once more. On the device the body's two draws keep their offsets and the key moves on after
    each iteration (``loop_key``); the warm-up runs the loop on the host (``LoopDraws``) and must
    draw the same (key, offset) pairs and move the generator as one replay does."""
    gen = TorchGen()
    record = Record(rng.TORCH)
    src = rng.Source(rng.TORCH, 0, 0x1000, record.write)

    def device_replay():  # the recording: offsets 0 | 1, 2 in the body | 3 after it
        rng.TorchUse(gen, src, 4).sync(7)
        key = record.key
        drawn = [(key, 0)]
        for _ in range(3):
            drawn += [(key, 1), (key, 2)]
            key = rng.loop_key(key)
        drawn.append((key, 3))
        record.advance(16)
        return drawn

    def warm_up_run():
        w = rng.TorchWarm(gen, src, 9)
        s = rng.WarmStream(src.slot, 0, 1, w)
        drawn = []

        def draw():  # a kernel reads the key the record holds when it runs, after its take
            off = s.take()
            drawn.append((record.key, off))

        def step(stream):
            record.key = rng.loop_key(record.key)

        draw()
        loop = rng.LoopDraws(s, step)  # after the condition's first evaluation (it draws nothing)
        for _ in range(3):
            draw()
            draw()
            loop.iteration_done()
        loop.done()
        draw()
        record.advance(s.increment)
        w.end(s.increment)
        return drawn

    gen.manual_seed(5)
    warm = warm_up_run()
    assert gen.offset == 16 and in_sync(src, record, gen)  # as one replay moves it
    gen.manual_seed(5)
    assert device_replay() == warm
    assert len(set(warm)) == len(warm)  # every (key, offset) once


def test_nested_loops_in_a_warm_up_repeat_each_bodys_offsets():
    gen = TorchGen()
    record = Record(rng.TORCH)
    src = rng.Source(rng.TORCH, 0, 0x1000, record.write)
    w = rng.TorchWarm(gen, src, 9)
    s = rng.WarmStream(src.slot, 0, 1, w)
    steps = []
    outer = rng.LoopDraws(s, lambda stream: steps.append("outer"))
    offsets = []
    for _ in range(2):
        offsets.append(s.take())  # the outer body draws at 0
        inner = rng.LoopDraws(s, lambda stream: steps.append("inner"))
        for _ in range(3):
            offsets.append(s.take())  # the inner body at 1
            inner.iteration_done()
        inner.done()
        outer.iteration_done()
    outer.done()
    assert offsets == [0, 1, 1, 1, 0, 1, 1, 1]
    assert steps == ["inner"] * 3 + ["outer"] + ["inner"] * 3 + ["outer"]
    assert s.calls == 2 and gen.offset == 8 and s.until == -1  # the generator moved for 2 offsets, once
