"""Test doubles and reference checks for ``allocator.Pool`` (CPU only, no cgraw, no CUDA).

Imported by tests/unit/test_pool*.py; tests/conftest.py puts tests/helpers on ``sys.path``.
"""

from __future__ import annotations

from collections import defaultdict

from allocator import PoolSnapshot


class FakeEvents:
    """A ``StreamEvents`` double in which each stream is a queue of work the test completes.

    ``launch(s)`` enqueues work on stream ``s``; ``finish(s)`` completes everything enqueued on
    it so far. A token is ``(stream, work enqueued at record time)``, done once that much work
    has finished, like a CUDA event.
    """

    def __init__(self) -> None:
        self.launched: defaultdict[int, int] = defaultdict(int)
        self.finished: defaultdict[int, int] = defaultdict(int)
        self.recorded: list[tuple[int, int]] = []
        self.queries = 0

    def launch(self, stream: int) -> None:
        self.launched[stream] += 1

    def finish(self, stream: int) -> None:
        self.finished[stream] = self.launched[stream]

    def record(self, stream_id: int) -> tuple[int, int]:
        token = (stream_id, self.launched[stream_id])
        self.recorded.append(token)
        return token

    def query(self, token: tuple[int, int]) -> bool:
        self.queries += 1
        stream, count = token
        return self.finished[stream] >= count


class NoRecordEvents(FakeEvents):
    """Events that can never be recorded (as while a capture runs): ``record`` returns None."""

    def record(self, stream_id: int) -> None:
        return None


def expected_best_fit(snap: PoolSnapshot, stream: int, size: int) -> int | None:
    """Reference best fit: the smallest block free on ``stream`` of >= ``size`` bytes, lowest
    address among equals; None when none fits."""
    fits = [(b.size, b.ptr) for b in snap.blocks if b.is_free and b.stream == stream and b.size >= size]
    return min(fits)[1] if fits else None


def assert_disjoint(ranges: list[tuple[int, int]]) -> None:
    """Assert that no two ``(ptr, size)`` ranges overlap."""
    ordered = sorted(ranges)
    for (p0, s0), (p1, _) in zip(ordered, ordered[1:], strict=False):
        assert p0 + s0 <= p1, f"ranges 0x{p0:x}+{s0} and 0x{p1:x} overlap"


def segment_blocks(snap: PoolSnapshot) -> dict[int, list]:
    """Segment base -> its block records, in address order."""
    out: dict[int, list] = {seg.base: [] for seg in snap.segments}
    ends = {seg.base: seg.base + seg.nbytes for seg in snap.segments}
    bases = sorted(out)
    i = 0
    for rec in snap.blocks:
        while rec.ptr >= ends[bases[i]]:
            i += 1
        out[bases[i]].append(rec)
    return out
