"""Zero-copy inputs on the CPU tier: the plan's decisions over a fake graph, the proof's two
outcomes (kept in place / back to the copies) with the device work faked, the hot path's
re-pointing, and the range bookkeeping (``cgraw.rebind.proof``, ``cgraw.trees.recording.InputRebind``)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

pytest.importorskip("cuda.bindings")

from cgraw import _cuda
from cgraw.rebind import proof as rebind_proof, ranges as rebind_ranges
from cgraw.trees import recording  # noqa: E402
from cgraw.trees.recording import InputCopy, InputRebind, Recording  # noqa: E402
from cgraw.trees.config import Config  # noqa: E402

T = _cuda.NodeType
KERNEL, MEMCPY, MEMSET, HOST = (int(T.CU_GRAPH_NODE_TYPE_KERNEL), int(T.CU_GRAPH_NODE_TYPE_MEMCPY),
                                int(T.CU_GRAPH_NODE_TYPE_MEMSET), int(T.CU_GRAPH_NODE_TYPE_HOST))
PH_A, PH_B = 0x7F00_0000_0000, 0x7F00_0001_0000  # placeholders of leaves 0 and 1 (4 KiB each)
CALLER = 0x7E00_0000_0000


def word(v: int) -> bytes:
    return v.to_bytes(8, "little")


class FakeKernelArgs:
    """``_cuda.KernelArgs`` without the driver: buffers, word views, and a log of hand-overs."""

    log: list = []

    def __init__(self, exec_, node, params, args):
        self.node = node
        self.bufs = [ctypes.create_string_buffer(bytes(a), max(len(a), 1)) for a in args]

    def word(self, param, offset):
        return ctypes.c_uint64.from_address(ctypes.addressof(self.bufs[param]) + offset)

    def value(self, param, offset):
        return int.from_bytes(self.bufs[param].raw[offset:offset + 8], "little")

    def __call__(self):
        FakeKernelArgs.log.append(self.node)


class FakeGraph:
    """Nodes: ``(type, payload)``; kernel payload = argument bytes, memcpy = (dst, src, n),
    memset = (dst, n)."""

    def __init__(self, nodes):
        self.nodes = nodes

    def node_handles(self):
        return list(range(len(self.nodes)))


@pytest.fixture
def fake_graph(monkeypatch):
    holder = {}

    def graph(nodes):
        holder["g"] = FakeGraph(nodes)
        return holder["g"]

    monkeypatch.setattr(_cuda, "graph_node_get_type", lambda i: holder["g"].nodes[i][0])
    monkeypatch.setattr(_cuda, "graph_kernel_node_args",
                        lambda i: (None, None if holder["g"].nodes[i][1] is None
                                   else list(enumerate(holder["g"].nodes[i][1]))))
    monkeypatch.setattr(_cuda, "graph_memcpy_node_extent", lambda i: holder["g"].nodes[i][1])
    monkeypatch.setattr(_cuda, "graph_memcpy_node_dst_src", lambda i: holder["g"].nodes[i][1][:2])
    monkeypatch.setattr(_cuda, "graph_memset_node_extent", lambda i: holder["g"].nodes[i][1])
    monkeypatch.setattr(_cuda, "KernelArgs", FakeKernelArgs)
    monkeypatch.setattr(_cuda, "rt_node_handle", lambda i: ("rt", i))
    monkeypatch.setattr(_cuda, "native", lambda h: h if isinstance(h, int) else h[1])
    FakeKernelArgs.log = []
    return graph


class Counted:
    """A framework's ops whose arrays count their writes (torch's version counter). An array's
    address and its block's: ``ptr`` and ``base`` of a ``Window``, else both 0 (the whole block)."""

    @staticmethod
    def version(t):
        return 0

    @staticmethod
    def ptr(t):
        return getattr(t, "ptr", 0)

    @staticmethod
    def base_ptr(t):
        return getattr(t, "base", 0)


class Uncounted(Counted):
    """A framework's ops that keep no count of writes (CuPy)."""

    @staticmethod
    def version(t):
        return None


class Window:
    """An array viewing its block at ``ptr``, the block starting at ``base``."""

    def __init__(self, ptr, base):
        self.ptr, self.base = ptr, base


def make_rec(copies, bucket=None, ops=Counted):
    rec = Recording("f")
    rec.exec_ = "exec"
    rec.copies = copies
    n = 1 + max((c.leaf for c in copies), default=0)
    call = SimpleNamespace(bucket=bucket, ops=[ops] * n, leaves=[object()] * n)
    return rec, call


def copy_in(leaf, node, ph):
    return InputCopy(leaf, node, ph, CALLER + leaf * 0x10000, 4096, 0, back=False)


def test_plan_finds_words_per_input_and_shares_kernel_buffers(fake_graph):
    g = fake_graph([
        (MEMCPY, (PH_A, CALLER, 4096)),  # 0: input copy of leaf 0
        (MEMCPY, (PH_B, CALLER + 0x10000, 4096)),  # 1: input copy of leaf 1
        (KERNEL, [word(PH_A + 64) + word(7), word(PH_B), b"\x01\x00\x00\x00"]),  # 2: reads both
        (KERNEL, [word(PH_A)]),  # 3: reads leaf 0
        (MEMCPY, (0x7D00_0000_0000, PH_B + 8, 16)),  # 4: a 1-D copy out of leaf 1
    ])
    rec, call = make_rec([copy_in(0, 0, PH_A), copy_in(1, 1, PH_B)])
    rebind_proof.plan(rec, g, call, {0: "ph0", 1: "ph1"}, Config(rebind_node_margin=1))  # each read twice
    assert rec.input_notes == {0: None, 1: None}
    p = rec.proof
    assert p is not None and [r.leaf for r in p.rebinds] == [0, 1]
    r0, r1 = p.rebinds
    assert sorted(d for _, d in r0.words) == [0, 64] and len(r0.kernels) == 2
    assert [d for _, d in r1.words] == [0] and len(r1.kernels) == 1
    assert r1.memcpys == [(("rt", 4), None, 8, 0x7D00_0000_0000, PH_B + 8, 16)]
    shared = [k for k in r0.kernels if k in r1.kernels]
    assert len(shared) == 1 and shared[0].node == 2  # one buffer per node, both inputs' words in it
    assert {PH_A + 64, 7, PH_B, PH_A, CALLER} <= p.values


def test_plan_keeps_the_copy_of_an_input_fed_back_from_the_pool(fake_graph):
    """An input that was memory of the tree's pool when the graph was recorded (an earlier call's
    output fed back, as a decoded token is) keeps its copy node with the reason; the other input
    read by as few nodes is still a candidate for reading in place. With nothing fed back both are."""
    nodes = [
        (MEMCPY, (PH_A, CALLER, 4096)),  # 0: input copy of leaf 0
        (MEMCPY, (PH_B, CALLER + 0x10000, 4096)),  # 1: input copy of leaf 1
        (KERNEL, [word(PH_A)]),  # 2: reads leaf 0
        (KERNEL, [word(PH_B)]),  # 3: reads leaf 1
    ]
    for fed_back, want in (([0], [1]), ([], [0, 1])):
        g = fake_graph(nodes)
        rec, call = make_rec([copy_in(0, 0, PH_A), copy_in(1, 1, PH_B)])
        rebind_proof.plan(rec, g, call, {0: "ph0", 1: "ph1"}, Config(), fed_back)
        assert [r.leaf for r in rec.proof.rebinds] == want
        assert rec.input_notes == {0: rebind_proof.FED_BACK if fed_back else None, 1: None}
    g = fake_graph(nodes[:1] + nodes[2:3])  # the fed-back input alone: no proof to make
    rec, call = make_rec([copy_in(0, 0, PH_A)])
    rebind_proof.plan(rec, g, call, {0: "ph0"}, Config(), [0])
    assert rec.proof is None and rec.input_notes == {0: rebind_proof.FED_BACK}


@pytest.mark.parametrize("ops", [Counted, Uncounted])
def test_plan_keeps_the_copy_of_a_small_read_only_window_into_a_larger_block(fake_graph, ops):
    """A small input viewing its block at an offset (``positions[i:i+1]``) keeps its copy node with
    the reason: the next window is a few bytes further and would be staged by a driver copy before
    each launch. Read in place instead: the same input at its block's start, a window of 64 KiB
    or more, and a window the function writes (its copy back would run on every call too)."""
    nodes = [
        (MEMCPY, (PH_A, CALLER + 8, 8)),  # 0: input copy of leaf 0, 8 bytes
        (MEMCPY, (PH_B, CALLER + 0x10000, 4096)),  # 1: input copy of leaf 1
        (KERNEL, [word(PH_A)]),  # 2: reads leaf 0
        (KERNEL, [word(PH_B)]),  # 3: reads leaf 1
    ]

    def planned(leaf0, count=8, back=False):
        g = fake_graph(nodes + ([(MEMCPY, (CALLER + 8, PH_A, count))] if back else []))
        copies = [InputCopy(0, 0, PH_A, CALLER + 8, count, 0, back=False), copy_in(1, 1, PH_B)]
        if back:
            copies.append(InputCopy(0, 4, PH_A, CALLER + 8, count, 0, back=True))
        rec, call = make_rec(copies, ops=ops)
        call.leaves = [leaf0, Window(CALLER + 0x10000, CALLER + 0x10000)]
        rebind_proof.plan(rec, g, call, {0: "ph0", 1: "ph1"}, Config(rebind_node_margin=2))
        return rec

    rec = planned(Window(CALLER + 8, CALLER))
    assert rec.input_notes == {0: rebind_proof.WINDOW, 1: None}
    assert [r.leaf for r in rec.proof.rebinds] == [1]
    for rec in (planned(Window(CALLER, CALLER)), planned(Window(CALLER + 8, CALLER), count=64 << 10),
                planned(Window(CALLER + 8, CALLER), back=True)):
        assert rec.input_notes[0] is None and 0 in [r.leaf for r in rec.proof.rebinds]


def test_plan_decides_by_node_count_whatever_the_framework(fake_graph):
    """A small input read by three kernels keeps its copy (re-pointing costs more than updating
    it), whether its framework counts writes or not, with or without a copy back; with a margin
    that allows the nodes it is offered for reading in place. A staged copy is copied back only
    where the recording copies the input back: a CuPy feedback loop (``u = step(u)``, its input the
    memory of the new output) must not have the old input written over the new output."""
    nodes = [(MEMCPY, (PH_A, CALLER, 4096)), (KERNEL, [word(PH_A)]), (KERNEL, [word(PH_A + 8)]),
             (KERNEL, [word(PH_A + 16)]), (MEMCPY, (CALLER, PH_A, 4096))]
    cback = InputCopy(0, 4, PH_A, CALLER, 4096, 0, back=True)
    for ops in (Counted, Uncounted):
        g = fake_graph(nodes[:4])
        rec, call = make_rec([copy_in(0, 0, PH_A)], ops=ops)
        rebind_proof.plan(rec, g, call, {0: "ph"}, Config())
        assert "read by 3 graph nodes" in rec.input_notes[0] and rec.proof is None
        g = fake_graph(nodes[:4])
        rec, call = make_rec([copy_in(0, 0, PH_A)], ops=ops)
        rebind_proof.plan(rec, g, call, {0: "ph"}, Config(rebind_node_margin=2))
        (r,) = rec.proof.rebinds
        assert rec.input_notes == {0: None} and not r.back
        g = fake_graph(nodes)
        rec, call = make_rec([copy_in(0, 0, PH_A), cback], ops=ops)
        rebind_proof.plan(rec, g, call, {0: "ph"}, Config())
        assert "read by 3 graph nodes" in rec.input_notes[0] and rec.proof is None
        g = fake_graph(nodes)
        rec, call = make_rec([copy_in(0, 0, PH_A), cback], ops=ops)
        rebind_proof.plan(rec, g, call, {0: "ph"}, Config(rebind_node_margin=2))
        (r,) = rec.proof.rebinds
        assert rec.input_notes == {0: None} and r.back and len(r.kernels) == 3


def test_plan_reasons(fake_graph):
    base = [(MEMCPY, (PH_A, CALLER, 4096)), (KERNEL, [word(PH_A)])]
    cases = [
        (base + [(MEMSET, (PH_A + 128, 64))], rebind_proof.MEMSET),
        (base + [(HOST, None)], "host node"),
        (base + [(KERNEL, None)], "packed"),
        (base + [(MEMCPY, (PH_B, PH_A, 64))], None),  # leaf 1 is not an input here: a plain copy out
    ]
    for nodes, want in cases:
        g = fake_graph(nodes)
        rec, call = make_rec([copy_in(0, 0, PH_A)])
        rebind_proof.plan(rec, g, call, {0: "ph"}, Config(rebind_node_margin=1))  # the copy out reads it too
        if want is None:
            assert rec.input_notes == {0: None} and rec.proof is not None
        else:
            assert want in rec.input_notes[0] and rec.proof is None
    g = fake_graph(base)
    rec, call = make_rec([copy_in(0, 0, PH_A)])
    rebind_proof.plan(rec, g, call, {0: "ph"}, Config(rebind_inputs=False))
    assert rec.input_notes == {0: rebind_proof.OFF} and rec.proof is None
    rec, call = make_rec([copy_in(0, 0, PH_A)], bucket=8)
    rebind_proof.plan(rec, g, call, {0: "ph"}, Config())
    assert rec.input_notes == {0: rebind_proof.PADDED}


def test_plan_copy_between_two_inputs_keeps_both_copies(fake_graph):
    g = fake_graph([(MEMCPY, (PH_A, CALLER, 4096)), (MEMCPY, (PH_B, CALLER + 0x10000, 4096)),
                    (MEMCPY, (PH_B, PH_A, 4096))])
    rec, call = make_rec([copy_in(0, 0, PH_A), copy_in(1, 1, PH_B)])
    rebind_proof.plan(rec, g, call, {0: "a", 1: "b"}, Config())
    assert rec.input_notes == {0: rebind_proof.TWO_INPUTS, 1: rebind_proof.TWO_INPUTS} and rec.proof is None


def test_input_rebind_patch_points_words_kernels_and_copies():
    k = FakeKernelArgs("e", 5, None, [word(PH_A + 16) + word(PH_A)])
    FakeKernelArgs.log = []
    calls = []
    r = InputRebind(0, PH_A, [(k.word(0, 0), 16), (k.word(0, 8), 0)], [k],
                    [("n", None, 32, 0xD, PH_A + 32, 64), ("m", 8, None, PH_A + 8, 0xE, 64)])
    r.patch(lambda *a: calls.append(a), CALLER)
    assert (k.value(0, 0), k.value(0, 8)) == (CALLER + 16, CALLER)
    assert FakeKernelArgs.log == [5] and r.ptr == CALLER
    assert calls == [("n", 0xD, CALLER + 32, 64), ("m", CALLER + 8, 0xE, 64)]
    r.patch(lambda *a: calls.append(a), r.base)  # back to the placeholder: the recorded bytes
    assert (k.value(0, 0), k.value(0, 8)) == (PH_A + 16, PH_A)


def test_replay_repoints_only_moved_inputs(monkeypatch):
    launches = []
    monkeypatch.setattr(recording, "_launch", lambda exec_, stream: launches.append(exec_) or (0,))
    monkeypatch.setattr(recording._streams, "current_getter", lambda ordinal: 0)
    rec = Recording("f")
    rec.exec_, rec.setter = "exec", None
    moved = []

    class R(InputRebind):
        __slots__ = ()

        def patch(self, setter, ptr):
            moved.append(ptr)
            self.ptr = ptr

    rec.rebinds = [R(0, PH_A, [], [], [], back=True)]
    rec.out_leaves, rec.out_kinds, rec.out_alias = [], [], []
    rec.alias0 = lambda: "out"
    pool = 0x7C00_0000_0000
    rec.in_pool = lambda p: pool <= p < pool + (1 << 20)
    staged = []

    def stage(rec_, call, r):  # cuda_backend's: a fresh, aligned copy of the input; None: copy back
        staged.append("back" if r is None else call.ptrs[r.leaf])
        if r is None:
            return None
        rec_.staged.append((r, "copy"))
        return 0x7B00_0000_0000 + 512 * len(staged)

    rec.stage = stage
    for p in (CALLER, CALLER, CALLER + 4096, CALLER + 4096, CALLER):
        assert rec.replay(SimpleNamespace(ptrs=[p], leaves=[None]))[0] == "out"
    assert moved == [CALLER, CALLER + 4096, CALLER] and len(launches) == 5 and staged == []
    # a view 4 bytes off the recorded alignment, and memory of the tree's pool: read from copies,
    # which the function's writes go back from after the launch
    for p in (CALLER + 4, pool + 512):
        rec.replay(SimpleNamespace(ptrs=[p], leaves=[None]))
    assert staged == [CALLER + 4, "back", pool + 512, "back"]
    assert moved[-2:] == [0x7B00_0000_0000 + 512, 0x7B00_0000_0000 + 1536]
    rec.replay(SimpleNamespace(ptrs=[CALLER], leaves=[None]))  # aligned again: in place, nothing staged
    assert moved[-1] == CALLER and rec.staged == [] and staged[-1] == "back"


def test_staged_calls_on_one_stream_copy_into_one_kept_buffer_and_repoint_once(monkeypatch):
    """The CUDA backend's staging (``CudaBackend._stage``) under ``Recording.replay``: calls whose
    input is less aligned than the recording's copy it into a buffer at the recording's alignment,
    made by the first such call and kept, so the graph is re-pointed once and later such calls on
    that stream only copy; a call on another stream gets a buffer of its own (the first stream's
    launch may still read the kept one); an aligned call reads the caller's tensor in place."""
    torch = pytest.importorskip("torch")
    from cgraw.trees import cuda_backend
    from cgraw.trees.frameworks import TORCH

    stream = [7]
    monkeypatch.setattr(recording, "_launch", lambda exec_, s: (0,))
    monkeypatch.setattr(recording._streams, "current_getter", lambda ordinal: stream[0])
    monkeypatch.setattr(cuda_backend._streams, "current_getter", lambda ordinal: stream[0])
    copies = []

    def memcpy(dst, src, nbytes, target):  # the driver's stream-ordered copy, on host memory here
        copies.append(target)
        ctypes.memmove(dst, src, nbytes)

    monkeypatch.setattr(cuda_backend._cuda, "memcpy_dtod_async", memcpy)
    current = [0xC0]  # the thread's current context
    monkeypatch.setattr(cuda_backend._cuda, "ctx_get_current", lambda: current[0])
    torch_copies = []

    def copy_on(dst, src, ops, target):  # torch's copy: another device's context is current
        torch_copies.append(target)
        dst.copy_(src)

    monkeypatch.setattr(cuda_backend, "_copy_on", copy_on)
    made = []
    real_empty = TORCH.empty_layout
    monkeypatch.setattr(type(TORCH), "empty_layout",
                        lambda self, t, align=None: made.append(align) or real_empty(t, align=align))
    backend = SimpleNamespace(device=SimpleNamespace(ordinal=0, context=0xC0))
    rec = Recording("f")
    rec.exec_, rec.setter = "exec", None
    rec.in_pool = lambda p: False
    rec.stage = lambda r_, call, r: cuda_backend.CudaBackend._stage(backend, r_, call, r)
    rec.out_leaves, rec.out_kinds, rec.out_alias = [], [], []
    rec.alias0 = lambda: "out"
    src = torch.arange(64, dtype=torch.float32)
    base = src[8:16].data_ptr()  # the recording's placeholder: 32 bytes into its block
    patched = []

    class R(InputRebind):
        __slots__ = ()

        def patch(self, setter, ptr):
            patched.append(ptr)
            self.ptr = ptr

    r = R(0, base, [], [], [])
    rec.rebinds = [r]

    def call(view):
        rec.replay(SimpleNamespace(ptrs=[view.data_ptr()], leaves=[view], ops=[TORCH]))
        return rec.staged[-1][1] if rec.staged else None

    a = call(src[1:9])  # 4 bytes into its block: staged
    b = call(src[3:11])
    assert a is b and torch.equal(b, src[3:11]) and made == [base & 255]
    assert patched == [a.data_ptr()] and a.storage_offset() * 4 == base & 255  # at the recording's alignment
    stream[0] = 9  # another stream: a buffer of its own
    c = call(src[5:13])
    assert c is not a and torch.equal(c, src[5:13]) and len(made) == 2 and patched[-1] == c.data_ptr()
    assert copies == [7, 7, 9]
    current[0] = 0xC1  # another device's context is current: torch's copy, on the same kept buffer
    d = call(src[7:15])
    assert d is c and torch.equal(d, src[7:15]) and torch_copies == [9] and len(copies) == 3
    aligned = src[8:16]  # the recording's alignment: read in place, nothing copied
    assert call(aligned) is None and patched[-1] == aligned.data_ptr() and len(copies) == 3 and len(torch_copies) == 1


def test_merge_and_blocks():
    assert rebind_ranges.merge([(100, 10), (105, 10), (200, 8), (108, 1)]) == [(100, 15), (200, 8)]
    # touching ranges stay apart: they may be two allocations, and one copy across both is refused
    assert rebind_ranges.merge([(100, 10), (110, 10)]) == [(100, 10), (110, 10)]
    pool = SimpleNamespace(closed=False, live_blocks=lambda: [SimpleNamespace(ptr=1000, size=100)])
    b = rebind_ranges.Blocks(pool)
    assert b.around(1050) == (1000, 100) and b.around(1100) is None and b.around(10) is None


def test_ranges_skip_placeholders_and_non_pointers(monkeypatch):
    asked = []
    monkeypatch.setattr(_cuda, "mem_address_range",
                        lambda v: asked.append(v) or ((v & ~0xFFF, 0x1000) if v >= 0x7000_0000_0000 else None))
    blocks = SimpleNamespace(around=lambda v: None, window=(0x7000_0000_0000, 0x8000_0000_0000))
    floats = 0x3F80_0000_BF80_0000  # two floats read as one word: never asked about
    got = rebind_ranges.ranges({3, 4096 * 5, PH_A + 8, CALLER + 12, floats}, blocks, [(PH_A, 4096)], {})
    assert got == [(CALLER, 0x1000)] and asked == [CALLER + 12]


class ProofRig:
    """``prove`` with the device faked: replays counted with the mode they ran in."""

    def __init__(self, monkeypatch, equal: bool):
        self.events = []
        self.enabled = {}
        monkeypatch.setattr(_cuda, "stream_handle", lambda p: "stream")
        monkeypatch.setattr(rebind_proof._streams, "current_getter", lambda o: 0)
        monkeypatch.setattr(_cuda, "ctx_synchronize", lambda: None)
        monkeypatch.setattr(_cuda, "stream_synchronize", lambda s: None)
        monkeypatch.setattr(_cuda, "mem_get_info", lambda: (1 << 34, 1 << 35))
        monkeypatch.setattr(_cuda, "mem_alloc", lambda n: 0xA000_0000 + 0x1000_0000 * len(self.events))
        monkeypatch.setattr(_cuda, "mem_free", lambda p: self.events.append("free"))
        monkeypatch.setattr(rebind_proof._k, "memset_d8_async",
                            lambda p, v, n, s: self.events.append(("poison", p, v)) if p == PH_A else None)
        monkeypatch.setattr(rebind_proof._mem, "Blocks", lambda pool: SimpleNamespace(around=lambda v: None))
        monkeypatch.setattr(rebind_proof._mem, "ranges", lambda values, blocks, phs, cache: [(CALLER, 4096)])
        monkeypatch.setattr(rebind_proof._mem, "tables", lambda ranges, phs, blocks, cache: (set(), []))
        monkeypatch.setattr(rebind_proof, "_pack", lambda r, buf, s, out: self.events.append(("pack", out)))
        monkeypatch.setattr(rebind_proof, "_equal", lambda *a: equal)
        monkeypatch.setattr(_cuda, "graph_exec_node_set_enabled",
                            lambda e, n, on: self.enabled.__setitem__(n, on))


class _Rec(Recording):
    __slots__ = ("replay",)


def _rig_rec(monkeypatch, equal):
    rig = ProofRig(monkeypatch, equal)
    rec = _Rec("f")
    rec.exec_, rec.setter = "exec", lambda *a: None
    cin, cback = copy_in(0, "in", PH_A), InputCopy(0, "back", PH_A, CALLER, 4096, 0, back=True)
    rec.copies = [cin, cback]
    k = FakeKernelArgs("exec", 9, None, [word(PH_A)])
    r = InputRebind(0, PH_A, [(k.word(0, 0), 0)], [k], [])
    rec.input_notes = {0: None}
    rec.proof = rebind_proof.Pending([r], {0: ("ph", PH_A, 4096)}, {PH_A, CALLER}, {0: [cin, cback]})
    modes = []

    def replay(call, first=False):
        assert first, "the proof's replays are the recording's first call: nothing to check"
        for rb in rec.rebinds:  # what Recording.replay does before its launch
            if call.ptrs[rb.leaf] != rb.ptr:
                rb.patch(rec.setter, call.ptrs[rb.leaf])
        modes.append(("copy" if rec.copies else "in place", k.value(0, 0)))
        return ("out", len(modes)), ()

    rec.replay = replay
    dropped = []
    backend = SimpleNamespace(pool=None, drop_placeholders=lambda rec, phs: dropped.append(phs))
    return rig, rec, k, modes, dropped, backend, (cin, cback)


def test_proof_kept_in_place(monkeypatch):
    rig, rec, k, modes, dropped, backend, (cin, cback) = _rig_rec(monkeypatch, equal=True)
    out = rebind_proof.prove(backend, rec, SimpleNamespace(ptrs=[CALLER]))
    assert modes == [("copy", PH_A), ("in place", CALLER)] and out == (("out", 2), ())
    assert rec.copies == [] and [r.leaf for r in rec.rebinds] == [0] and rec.proof is None
    assert rig.enabled == {"in": False, "back": False} and dropped == [["ph"]]
    assert rec.input_notes == {0: None}
    assert ("poison", PH_A, 0) in rig.events  # the placeholder "ph" has no float dtype: zeros
    packs = [e for e in rig.events if isinstance(e, tuple) and e[0] == "pack"]
    assert packs == [("pack", True), ("pack", True), ("pack", False), ("pack", True)]


def test_proof_refuted_goes_back_to_the_copies(monkeypatch):
    rig, rec, k, modes, dropped, backend, (cin, cback) = _rig_rec(monkeypatch, equal=False)
    out = rebind_proof.prove(backend, rec, SimpleNamespace(ptrs=[CALLER]))
    # A (copies), B (in place), then the ranges put back and the call run once more as recorded
    assert modes == [("copy", PH_A), ("in place", CALLER), ("copy", PH_A)] and out == (("out", 3), ())
    assert rec.copies == [cin, cback] and rec.rebinds == [] and dropped == []
    assert rig.enabled == {"in": True, "back": True}
    assert rec.input_notes == {0: rebind_proof.DIFFER}
    packs = [e for e in rig.events if isinstance(e, tuple) and e[0] == "pack"]
    assert packs[-1] == ("pack", False)  # the saved ranges restored before the last replay


@pytest.mark.parametrize("equal", [True, False])
def test_proof_puts_the_generators_back_with_the_ranges(monkeypatch, equal):
    """A graph that draws random numbers: the host's side of its generators is saved before the
    first replay and put back whenever the device ranges (its generator records among them) are,
    so every replay of the proof draws what the first drew and the generators move once."""
    rig, rec, _, _, _, backend, _ = _rig_rec(monkeypatch, equal=equal)
    replay = rec.replay

    class Generators:
        def save(self):
            rig.events.append("save")
            return "host state"

        def restore(self, saved):
            rig.events.append(("restore", saved))

    def replay_logged(call, first=False):
        rig.events.append("replay")
        return replay(call, first)

    rec.replay = replay_logged
    rec.rng_sync = lambda ptr: None
    rec.graph = SimpleNamespace(rng=Generators())
    rebind_proof.prove(backend, rec, SimpleNamespace(ptrs=[CALLER]))
    seq = [e for e in rig.events if e in ("save", "replay") or isinstance(e, tuple) and e[0] in ("pack", "restore")]
    want = ["save", "replay", ("pack", True), ("pack", False), ("restore", "host state"), "replay", ("pack", True)]
    if not equal:  # refuted: ranges and generators put back once more before the call's one run
        want += [("pack", False), ("restore", "host state"), "replay"]
    assert seq[seq.index("save"):] == want


def test_proof_too_much_memory_keeps_copies(monkeypatch):
    rig, rec, k, modes, dropped, backend, _ = _rig_rec(monkeypatch, equal=True)
    monkeypatch.setattr(_cuda, "mem_get_info", lambda: (1 << 20, 1 << 35))  # 1 MiB free: limit 256 KiB
    monkeypatch.setattr(rebind_proof._mem, "ranges", lambda values, blocks, phs, cache: [(CALLER, 1 << 20)])
    rebind_proof.prove(backend, rec, SimpleNamespace(ptrs=[CALLER]))
    assert modes == [("copy", PH_A)] and "more than cgraw saves" in rec.input_notes[0]


def test_proof_pointer_table_keeps_copy(monkeypatch):
    rig, rec, k, modes, dropped, backend, _ = _rig_rec(monkeypatch, equal=True)
    monkeypatch.setattr(rebind_proof._mem, "tables", lambda ranges, phs, blocks, cache: ({0}, []))
    rebind_proof.prove(backend, rec, SimpleNamespace(ptrs=[CALLER]))
    assert modes == [("copy", PH_A)] and rec.input_notes[0] == rebind_proof.POINTER_TABLE


def test_tables_find_a_pointer_to_a_placeholder(monkeypatch):
    table = (ctypes.c_uint64 * 2)(PH_A + 256, 5)

    def dtoh(dst, src, n):
        ctypes.memmove(dst, ctypes.addressof(table), n)

    monkeypatch.setattr(_cuda, "memcpy_dtoh", dtoh)
    monkeypatch.setattr(rebind_proof._mem, "ranges", lambda values, blocks, phs, cache: [])
    hit, more = rebind_ranges.tables([(CALLER, 16), (CALLER + 4096, 1 << 20)], {0: (PH_A, 4096), 1: (PH_B, 64)},
                                   None, {})
    assert hit == {0}


def test_poison_byte_by_dtype():
    torch = pytest.importorskip("torch")
    assert rebind_proof._poison(torch.empty(2)) == 0xFF
    assert rebind_proof._poison(torch.empty(2, dtype=torch.complex64)) == 0xFF
    assert rebind_proof._poison(torch.empty(2, dtype=torch.int64)) == 0
    assert rebind_proof._poison(torch.empty(2, dtype=torch.bool)) == 0
    np = pytest.importorskip("numpy")
    assert rebind_proof._poison(np.empty(2, np.float16)) == 0xFF and rebind_proof._poison(np.empty(2, np.int32)) == 0


def test_plan_copies_a_small_input_read_by_more_nodes_than_its_copy_has(fake_graph):
    """Re-pointing a moved input costs a driver call per node reading it, its copy one per copy node:
    a small input read by two kernels keeps its copy, one read by one kernel is read in place, and
    so is a 1 MiB one whatever the count; ``rebind_node_margin`` allows more nodes."""
    kernels = [(KERNEL, [word(PH_A)]) for _ in range(2)]
    nodes = [(MEMCPY, (PH_A, CALLER, 4096))] + kernels
    rec, call = make_rec([copy_in(0, 0, PH_A)])
    rebind_proof.plan(rec, fake_graph(nodes), call, {0: "ph"}, Config())
    assert "read by 2 graph nodes" in rec.input_notes[0] and "1 copy node(s)" in rec.input_notes[0]
    assert rec.proof is None
    rec, call = make_rec([copy_in(0, 0, PH_A)])
    rebind_proof.plan(rec, fake_graph(nodes[:-1]), call, {0: "ph"}, Config())
    assert rec.input_notes == {0: None} and rec.proof is not None
    rec, call = make_rec([InputCopy(0, 0, PH_A, CALLER, 1 << 20, 0, back=False)])
    rebind_proof.plan(rec, fake_graph(nodes), call, {0: "ph"}, Config())
    assert rec.input_notes == {0: None}
    four = [(MEMCPY, (PH_A, CALLER, 4096))] + [(KERNEL, [word(PH_A)]) for _ in range(4)]
    rec, call = make_rec([copy_in(0, 0, PH_A)])
    rebind_proof.plan(rec, fake_graph(four), call, {0: "ph"}, Config(rebind_node_margin=3))
    assert rec.input_notes == {0: None} and rec.proof is not None
    rec, call = make_rec([copy_in(0, 0, PH_A)])
    rebind_proof.plan(rec, fake_graph(four), call, {0: "ph"}, Config(rebind_node_margin=2))
    assert "read by 4 graph nodes" in rec.input_notes[0]


def test_dearer_counts_a_written_inputs_copy_back():
    """A function that writes its input has a copy in and a copy back: re-pointing two nodes costs
    what updating them costs, so it is read in place; three nodes keep the copies."""
    assert rebind_proof.dearer(2, 2, 4096, 0) is None
    assert "read by 3 graph nodes" in rebind_proof.dearer(3, 2, 4096, 0)
    assert rebind_proof.dearer(1, 1, 4096, 0) is None
    assert "its 8 bytes" in rebind_proof.dearer(2, 1, 8, 0) and "its 4 KiB" in rebind_proof.dearer(2, 1, 4096, 0)
    assert rebind_proof.dearer(9, 1, rebind_proof.BIG_INPUT, 0) is None
    assert rebind_proof.dearer(9, 1, rebind_proof.BIG_INPUT - 1, 7) is not None
    assert rebind_proof.dearer(9, 1, rebind_proof.BIG_INPUT - 1, 8) is None


def test_rebind_node_margin_takes_non_negative_ints():
    cfg = Config()
    assert cfg.rebind_node_margin == 0
    cfg.rebind_node_margin = 4
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="rebind_node_margin"):
            cfg.rebind_node_margin = bad
    assert cfg.rebind_node_margin == 4


def test_blocks_give_one_generator_record_among_a_devices_records(monkeypatch):
    monkeypatch.setattr(rebind_ranges.rng_device, "arenas", lambda: [(0x9000, 64)])  # two 32-byte records
    b = rebind_ranges.Blocks(SimpleNamespace(closed=True))
    assert b.around(0x9000) == (0x9000, 32) and b.around(0x9000 + 8) == (0x9000, 32)
    assert b.around(0x9000 + 40) == (0x9020, 32) and b.around(0x9000 + 64) is None


def test_dropped_placeholders_lose_their_torch_owner():
    """A placeholder read in place no more has an owner in torch's pool bookkeeping, so its block
    is freed (the owner would keep a 64 MiB placeholder for the recording's life)."""
    torch = pytest.importorskip("torch")
    import weakref

    from cgraw.trees.cuda_backend import CudaBackend

    ph, kept = torch.randn(16), torch.randn(16)
    owners = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in (ph, kept)}
    tts = SimpleNamespace(owners=owners, spans=lambda ts: [(t.untyped_storage().data_ptr(), 64) for t in ts])
    rec = SimpleNamespace(keep=([ph, kept], None), out_leaves=[], owned_idx=[], spans=None)
    CudaBackend.drop_placeholders(SimpleNamespace(_tts=tts), rec, [ph])
    assert list(owners) == [kept.untyped_storage().data_ptr()]
    assert rec.keep[0] == [kept] and rec.spans == [(kept.untyped_storage().data_ptr(), 64)]
    gone = weakref.ref(ph)
    del ph
    assert gone() is None
