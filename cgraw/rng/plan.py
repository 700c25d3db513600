"""Graph-safe random numbers: generator records, per-graph draws, the host's mirror (pure).

Layer L1 (pure): no CUDA, no framework. The kernels are in ``rng.kernels`` and run through
``rng.device``; torch and CuPy calls reach them through ``interop.torch.rng`` and
``interop.cupy.rng``, which hand this module their generators.

Design. Graphed random numbers follow the frameworks' own generators, as eager draws do. Per
device and framework there is one **generator record** in device memory (``Source``): 32 bytes
holding the Philox key the kernels read, the generator position ``pos`` the key comes from, and
the ``base`` the generator's seed gives. A draw captured in a graph is a kernel that reads the key
and draws at its own offset within the graph (``RngStream.take``); the graph's last node moves the
record to ``pos + increment`` and recomputes the key (``replay_key``). So back-to-back replays draw
fresh numbers with no host write.

A ``cgraw.while_loop`` body takes its draws' offsets from the graph's, as any capture does, and
its last node moves the key on (``loop_key``): every iteration draws fresh numbers, no offset of
the graph draws twice under one key, and the generator moves by the body's offsets once per
replay, whatever the iteration count.

The host keeps a mirror of what the record will hold once the work queued so far has run
(``Source.seed``/``Source.pos``). Before a replay of a graph that draws, ``sync`` reads the
framework's generator: torch's ``(initial_seed(), get_offset())``, CuPy's ``RandomState._rk_seed``.
Equal to the mirror: the record already holds the right key, and only the generator is advanced
by the graph's increment, as its eager draws advance it. Different (``manual_seed``,
``set_rng_state``, a ``fork_rng`` restore, eager draws in between): one stream-ordered write of the
record on the replay's stream first. What a replay draws is a function of the generator's state
alone: same seed and same sequence of calls, same numbers.

Threads. A graph reads the record of the thread that captured it (``rng.device.source``: one record
per device, framework and thread), so threads that replay side by side, each on its own stream,
never race on one record. The step's read, compare and advance of the generator holds one
process-wide lock (``STEP``): two threads' replays never start from the same generator state.
"""

from __future__ import annotations

import threading

BLOCK = 256
_MASK64 = (1 << 64) - 1
UINT64_MAX = _MASK64  # CuPy advances RandomState._rk_seed modulo this (RandomState._update_seed)
SOURCE_BYTES = 32  # a generator record: key, pos, base, one spare word
TORCH, CUPY = "torch", "cupy"
KINDS = (TORCH, CUPY)
_TORCH_TAG = 0x746F7263685F726E  # keeps torch's keys apart from its own eager ones (key = seed)
CUPY_BASE = 0x2545F4914F6CDD1D  # CuPy's record: its state is one integer, the position
STEP = threading.RLock()  # held by every replay's read-compare-advance of a generator (and a proof's)


def splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele et al. 2014): a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def torch_base(seed: int) -> int:
    """The record's ``base`` for torch's generator seeded with ``seed``."""
    return splitmix64((seed & _MASK64) ^ _TORCH_TAG)


def replay_key(base: int, pos: int) -> int:
    """The Philox key of a replay at generator position ``pos`` (``rng.kernels.MIX`` on the
    device computes the same)."""
    return splitmix64(base ^ splitmix64(pos))


LOOP_TAG = 0x6C6F6F705F6B6579  # records.cu's cgraw_rng_step mixes it in: a loop's keys stay apart from replays'


def loop_key(key: int) -> int:
    """The key after one iteration of a ``cgraw.while_loop`` body that draws (the body's last
    node, ``cgraw_rng_step``). A body's draws keep the offsets they took in the graph, so each
    iteration draws fresh numbers from its own key; the position is untouched, and the graph's
    last node gives the next replay its key from the position as before."""
    return splitmix64(key ^ LOOP_TAG)


def increment(kind: str, calls: int, elements: int) -> int:
    """How far one replay moves its generator: torch's offset by 4 per offset the graph takes
    (torch keeps its offsets multiples of 4), CuPy's ``_rk_seed`` by the elements drawn, as
    CuPy's own kernels do (at least 1)."""
    return 4 * calls if kind == TORCH else max(1, elements)


def advance(kind: str, pos: int, inc: int) -> int:
    """The position after a replay (torch: modulo 2**64; CuPy: modulo 2**64 - 1, as CuPy)."""
    return (pos + inc) & _MASK64 if kind == TORCH else (pos + inc) % UINT64_MAX


class Source:
    """One generator record on one device and the host's mirror of it.

    ``seed``/``pos``: what the record will hold once the work queued so far has run (``pos`` -1:
    unknown, the next replay writes). ``write(stream, base, pos)`` is the stream-ordered write
    (``rng.device``); ``writes`` counts them."""

    __slots__ = ("_write", "device", "kind", "pos", "seed", "slot", "writes")

    def __init__(self, kind: str, device: int, slot: int, write):
        self.kind, self.device, self.slot = kind, device, slot
        self.seed = None
        self.pos = -1
        self.writes = 0
        self._write = write

    def set(self, stream, base: int, pos: int, seed) -> None:
        """Write the record for ``(seed, pos)`` on ``stream`` (before the replay's launch)."""
        self._write(stream, base, pos)
        self.seed, self.pos = seed, pos
        self.writes += 1

    def forget(self) -> None:
        """The record's content is unknown (a replay that did not launch): the next one writes."""
        self.seed, self.pos = None, -1

    def __repr__(self) -> str:
        return f"<cgraw {self.kind} generator record on device {self.device} at 0x{self.slot:x}>"


def torch_sync(gen, src: Source, inc: int):
    """The per-replay step of a graph that moves torch generator ``gen`` by ``inc``:
    ``sync(stream)`` before its launch on ``stream`` (the replays' hot path)."""
    seed_of, offset_of, set_offset = gen.initial_seed, gen.get_offset, gen.set_offset
    acquire, release = STEP.acquire, STEP.release

    def sync(stream) -> None:
        acquire()
        try:
            pos = offset_of()
            seed = seed_of()
            if pos != src.pos or seed != src.seed:
                src.set(stream, torch_base(seed), pos, seed)
            pos += inc
            set_offset(pos)
            src.pos = pos
        finally:
            release()

    return sync


def rk_sync(states, device: int, src: Source, inc: int, make_state):
    """``torch_sync`` for CuPy: ``states._random_states[device]`` is the generator (made with
    ``make_state(device)`` when missing, as ``cupy.random`` makes it), its ``_rk_seed`` the
    position (``cupy.random.seed`` sets it; CuPy's kernels advance it)."""
    acquire, release = STEP.acquire, STEP.release

    def sync(stream) -> None:
        rs = states._random_states.get(device)
        if rs is None:
            rs = make_state(device)
        acquire()
        try:
            pos = rs._rk_seed
            if pos != src.pos:
                src.set(stream, CUPY_BASE, pos, None)
            pos = (pos + inc) % UINT64_MAX
            rs._rk_seed = pos
            src.pos = pos
        finally:
            release()

    return sync


class TorchWarm:
    """The host's side of a graphed function's warm-up that draws torch's numbers with cgraw's
    kernels, as its replays will. Its draws take their offsets from 0, as a capture's do
    (``WarmStream``); each one first moves generator ``gen`` on by what it takes (``take``), under
    ``STEP`` as a replay's step, so threads drawing side by side never start from one state. The
    first also makes the record follow the generator (one write on ``stream`` when the mirror
    differs). Once the caller has launched the device's advance, ``end(inc)`` moves the mirror. So
    after the same seed, a warm-up draws the numbers a replay of its recording would draw, and
    leaves the generator where that replay would."""

    __slots__ = ("gen", "pos", "source", "stream")
    kind = TORCH

    def __init__(self, gen, source: Source, stream):
        self.gen, self.source, self.stream, self.pos = gen, source, stream, -1

    def take(self, steps: int, n: int = 0) -> None:
        with STEP:
            gen = self.gen
            if self.pos < 0:
                seed, pos = gen.initial_seed(), gen.get_offset()
                if pos != self.source.pos or seed != self.source.seed:
                    self.source.set(self.stream, torch_base(seed), pos, seed)
                self.pos = pos
            gen.set_offset(advance(TORCH, gen.get_offset(), 4 * steps))

    def end(self, inc: int) -> None:
        """After the device's advance of the record by ``inc`` was launched."""
        self.source.pos = advance(TORCH, self.pos, inc)


class RkWarm:
    """``TorchWarm`` for CuPy's generator: ``state()`` gives the ``RandomState`` whose ``_rk_seed``
    is the position (CuPy's own, not the warm-up's stand-in in CuPy's table). Each draw first moves
    ``_rk_seed`` on by the elements it draws, as a replay moves it by all of them (``rk_sync``), and
    the first makes the record follow it. After the same ``cupy.random.seed``, a warm-up draws the
    numbers a replay of its recording would draw."""

    __slots__ = ("pos", "source", "state", "stream")
    kind = CUPY

    def __init__(self, state, source: Source, stream):
        self.state, self.source, self.stream, self.pos = state, source, stream, -1

    def take(self, steps: int, n: int = 0) -> None:
        with STEP:
            rs = self.state()
            if self.pos < 0:
                pos = rs._rk_seed
                if pos != self.source.pos:
                    self.source.set(self.stream, CUPY_BASE, pos, None)
                self.pos = pos
            rs._rk_seed = (rs._rk_seed + n) % UINT64_MAX

    def end(self, inc: int) -> None:
        """After the device's advance of the record by ``inc`` was launched."""
        self.source.pos = advance(CUPY, self.pos, inc)


class TorchUse:
    """A graph's draws from torch's CUDA generator ``gen``: ``draws`` offsets per replay."""

    __slots__ = ("draws", "gen", "inc", "source", "sync")

    def __init__(self, gen, source: Source, draws: int, elements: int = 0):
        self.gen, self.source, self.draws = gen, source, draws
        self.inc = increment(TORCH, draws, elements)
        self.sync = torch_sync(gen, source, self.inc)

    def save(self):
        """The host's side of the generator (for a replay that is undone: the proof of rebinding)."""
        return self.gen.get_offset(), self.source.seed, self.source.pos

    def restore(self, saved) -> None:
        offset, self.source.seed, self.source.pos = saved
        self.gen.set_offset(offset)


class RkUse:
    """A graph's draws from CuPy's generator of ``device`` (``states``: ``cupy.random._generator``)."""

    __slots__ = ("device", "draws", "inc", "make_state", "source", "states", "sync")

    def __init__(self, states, device: int, source: Source, draws: int, elements: int, make_state):
        self.states, self.device, self.source, self.draws = states, device, source, draws
        self.make_state = make_state
        self.inc = increment(CUPY, draws, elements)
        self.sync = rk_sync(states, device, source, self.inc, make_state)

    def save(self):
        rs = self.states._random_states.get(self.device)
        return rs, (None if rs is None else rs._rk_seed), self.source.seed, self.source.pos

    def restore(self, saved) -> None:
        rs, pos, self.source.seed, self.source.pos = saved
        if rs is not None:
            rs._rk_seed = pos


class GraphRng:
    """What a graph draws (``Graph.rng``): one use per generator, ``sync`` for its replays."""

    __slots__ = ("sync", "uses")

    def __init__(self, uses):
        self.uses = tuple(uses)
        syncs = tuple(u.sync for u in self.uses)
        if len(syncs) == 1:
            self.sync = syncs[0]
        else:
            def sync(stream) -> None:
                for s in syncs:
                    s(stream)
            self.sync = sync

    @property
    def draws(self) -> int:
        """Offsets the graph's random-number kernels take per replay."""
        return sum(u.draws for u in self.uses)

    @property
    def sources(self) -> list:
        return [u.source for u in self.uses]

    def save(self) -> list:
        return [u.save() for u in self.uses]

    def restore(self, saved: list) -> None:
        for u, s in zip(self.uses, saved):
            u.restore(s)

    def forget(self) -> None:
        for u in self.uses:
            u.source.forget()

    def __repr__(self) -> str:
        parts = ", ".join(f"{u.source.kind} on device {u.source.device}: {u.draws} draw(s), +{u.inc}"
                          for u in self.uses)
        return f"<cgraw graph random numbers: {parts} per replay>"


class RngStream:
    """The random numbers of one capture from one generator: its record, the draws so far.

    ``take`` hands each draw its offset within the graph; ``elements`` counts the values drawn."""

    __slots__ = ("calls", "device", "elements", "kind", "slot", "thread")

    def __init__(self, slot: int, device: int, thread: int, kind: str = TORCH):
        self.slot = slot
        self.calls = 0
        self.elements = 0
        self.device = device
        self.thread = thread
        self.kind = kind

    def take(self, steps: int = 1, n: int = 0) -> int:
        """The offset within the graph of a draw of ``n`` values using ``steps`` offsets."""
        off = self.calls
        self.calls = off + steps
        self.elements += n
        return off

    @property
    def increment(self) -> int:
        return increment(self.kind, self.calls, self.elements)


class WarmStream(RngStream):
    """The ``RngStream`` of a warm-up: each draw moves its framework's generator first
    (``TorchWarm.take``, ``RkWarm.take``). Below ``until`` (a ``cgraw.while_loop`` body's later
    iterations on the host path, ``LoopDraws``) a draw takes the offset the first iteration took,
    without moving the generator again."""

    __slots__ = ("until", "warm")

    def __init__(self, slot: int, device: int, thread: int, warm):
        super().__init__(slot, device, thread, warm.kind)
        self.warm = warm
        self.until = -1

    def take(self, steps: int = 1, n: int = 0) -> int:
        off = self.calls
        if off + steps <= self.until:
            self.calls = off + steps
            return off
        self.warm.take(steps, n)
        return RngStream.take(self, steps, n)


class LoopDraws:
    """A ``cgraw.while_loop`` run on the host inside a warm-up that draws with cgraw's kernels
    (``stream``, a ``WarmStream``), drawing what the loop's WHILE node draws on the device: every
    iteration takes the offsets the first one took (the generator moves once), and after each
    iteration that drew the key moves on (``step(stream)``: the body's last node, ``loop_key``).
    So a warm-up's loop draws the numbers a replay of its recording draws. Made after the
    condition's first evaluation (which draws in the enclosing graph on the device)."""

    __slots__ = ("before", "end", "mark", "step", "stream")

    def __init__(self, stream: WarmStream, step):
        self.stream, self.step = stream, step
        self.mark = self.end = stream.calls
        self.before = stream.until  # an enclosing loop's: put back when this one ends

    def iteration_done(self) -> None:
        """After ``body_fn`` and the condition that follows it."""
        s = self.stream
        if s.calls != self.mark:
            self.step(s)
        self.end = max(self.end, s.calls)
        s.until, s.calls = self.end, self.mark

    def done(self) -> None:
        s = self.stream
        s.calls, s.until = self.end, self.before


def grid(n: int, per_group: int, sm_count: int) -> int:
    """Blocks for ``n`` outputs at ``per_group`` per thread-iteration (grid-stride loop: the
    numbers do not depend on it)."""
    groups = -(-n // per_group)
    return max(1, min(-(-groups // BLOCK), sm_count * 8))


# ----------------------------------------------------------------------------- argument rules

# significand bits of the float dtypes: torch's random_() on a float tensor draws [0, 2**digits]
_DIGITS = {"f32": 24, "f64": 53, "f16": 11, "bf16": 8}
_INT_MAX = {"i8": 127, "u8": 255, "i16": 32767, "i32": 2**31 - 1, "i64": 2**63 - 1, "b8": 1}


def random_range(dtype: str, low: int | None = None, high: int | None = None) -> tuple[int, int]:
    """``(lo, range)`` of ``Tensor.random_`` (and ``randint``) for a dtype code: ``[low, high)``;
    a missing ``high`` is the dtype's top (inclusive, as torch does); no arguments is
    ``[0, top]``."""
    top = 2 ** _DIGITS[dtype] if dtype in _DIGITS else _INT_MAX[dtype]
    lo = 0 if low is None else int(low)
    hi = top + 1 if high is None else int(high)
    if hi <= lo:
        raise ValueError(f"random_ expects 'from' < 'to', got from={lo} >= to={hi}")
    return lo, hi - lo


def is_wide(dist: str, dtype: str, rng_range: int = 0) -> bool:
    """Whether a draw needs 64 random bits per value: float64 continuous values, integer
    ranges wider than 2**32, and every Poisson and binomial draw."""
    if dist == "randint":
        return rng_range > 2**32
    if dist in ("bernoulli", "bernoulli_t"):
        return False
    if dist in ("poisson", "binomial"):
        return True  # 52-bit uniforms whatever the integer dtype
    return dtype == "f64"
