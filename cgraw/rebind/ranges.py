"""The device memory a recorded graph reaches, for ``rebind.proof``'s proof.

Layer L4: ``_cuda``, ``rng.device`` and ``interop.torch.private_api`` (L1); torch only when the user imported
it. ``Blocks`` knows allocations by address (torch's caching-allocator blocks of every pool, the
tree pool's live blocks, cgraw's generator records); ``ranges`` turns argument words and copy
addresses into the ranges they point into; ``merge`` joins overlapping ranges (never touching
ones: two allocations side by side cannot be copied as one); ``tables`` reads small ranges for
pointer tables; ``pool_at_record`` tells memory of the tree's pool (the tree's check, and a
rebound input's).
"""

from __future__ import annotations

import ctypes
import sys
from bisect import bisect_right

from cgraw import _cuda
from cgraw.rng import device as rng_device
from cgraw.interop.torch import private_api
from cgraw.rebind.scan import WORD
from cgraw.rng.plan import SOURCE_BYTES

TABLE_SCAN_LIMIT = 64 << 10  # ranges at most this large are read for pointer tables


def pool_at_record(pool, torch_pool):
    """``ptr -> bool``: whether memory lies in a segment the tree's pool (cgraw's part, and
    torch's ``torch_pool`` or None) holds now, by one bisect (also a rebound input's hot-path
    check, made at record time: segments added later hold nothing that recording writes)."""
    spans = sorted(pool.segment_ranges() + ([] if torch_pool is None else torch_pool.segments()))
    bases = [b for b, _ in spans]
    ends = [b + n for b, n in spans]

    def in_pool(p: int) -> bool:
        i = bisect_right(bases, p) - 1
        return i >= 0 and p < ends[i]
    return in_pool


class Blocks:
    """Allocations known by address: torch's caching-allocator blocks (every pool) and the tree
    pool's live blocks, cgraw's generator records; ``around(ptr)`` gives the block holding ``ptr``
    (among the records: the one record), or None."""

    def __init__(self, pool):
        spans = []
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            for seg in private_api.memory_segments():  # never torch.cuda.memory_snapshot(): see there
                addr = int(seg["address"])
                for b in seg.get("blocks", ()):
                    size = int(b["size"])
                    spans.append((int(b.get("address", addr)), size))
                    addr += size
        if pool is not None and not pool.closed:
            spans.extend((b.ptr, b.size) for b in pool.live_blocks())
        arenas = rng_device.arenas()
        spans.extend(arenas)
        spans.sort()
        self.arenas = {b for b, _ in arenas}  # a value there is one generator record (rng.plan.Source)
        self.bases = [s[0] for s in spans]
        self.spans = spans
        # device memory cgraw does not know of (CuPy's pool, a library's workspace) is looked for
        # near what it knows: within 1 TiB of it
        self.window = (spans[0][0] - (1 << 40), spans[-1][0] + spans[-1][1] + (1 << 40)) if spans else (0, 1 << 49)

    def around(self, ptr: int):
        i = bisect_right(self.bases, ptr) - 1
        if i >= 0:
            base, size = self.spans[i]
            if ptr < base + size:
                if base in self.arenas:
                    return ptr - (ptr - base) % SOURCE_BYTES, SOURCE_BYTES
                return base, size
        return None


def ranges(values, blocks: Blocks, phs: list, cache: dict) -> list[tuple[int, int]]:
    """The device ranges ``values`` point into (placeholders left out). A value is looked up in
    the known blocks and generator records; the driver (``cuMemGetAddressRange``) is asked only
    for a value near known device memory: argument words and table contents are mostly numbers,
    and one driver call per number (it releases the GIL) would make a proof take seconds."""
    out = []
    lo, hi = blocks.window
    for v in values:
        if v < 4096 or v >= 1 << 49:
            continue
        r = cache.get(v, False)
        if r is False:
            r = None
            if not any(base <= v < base + n for base, n in phs):
                r = blocks.around(v)
                if r is None and lo <= v < hi:
                    r = _cuda.mem_address_range(v)
            cache[v] = r
        if r is not None:
            out.append(r)
    return out


def merge(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for base, n in sorted(set(ranges)):
        if out and base < out[-1][0] + out[-1][1]:  # overlapping only: touching ranges may be two allocations
            out[-1][1] = max(out[-1][1], base + n - out[-1][0])
        else:
            out.append([base, n])
    return [(b, n) for b, n in out]


def tables(spans, phs: dict, blocks: Blocks, cache: dict) -> tuple[set, list]:
    """One level of pointer tables: small ranges read to the host; leaves whose placeholder a
    word points into, and the further ranges the words point at."""
    hit, more = set(), []
    for base, n in spans:
        if n > TABLE_SCAN_LIMIT or n < WORD:
            continue
        buf = (ctypes.c_uint64 * (n // WORD))()
        _cuda.memcpy_dtoh(ctypes.addressof(buf), base, (n // WORD) * WORD)
        words = set(buf)
        for leaf, (pb, pn) in phs.items():
            if any(pb <= w < pb + pn for w in words):
                hit.add(leaf)
        more.extend(ranges(words, blocks, list(phs.values()), cache))
    return hit, more
