"""allocator: a stream-aware caching pool over integer addresses, with snapshot and restore.

Layer A: pure Python, stdlib only; imports nothing from cgraw and nothing CUDA, so the whole
package is tested on machines without a GPU. Device memory and stream events come in through
the ``SegmentSource`` and ``StreamEvents`` protocols. This module only re-exports.
"""

from allocator.bins import round_up
from allocator.block import Block
from allocator.errors import (
    AllocatorError,
    InvalidFree,
    InvariantError,
    PoolClosed,
    PoolExhausted,
    SnapshotMismatch,
    SnapshotStale,
)
from allocator.pool import Pool, PoolStats
from allocator.snapshot import (
    BlockRecord,
    PendingRecord,
    PoolSnapshot,
    RestoreDelta,
    SegmentRecord,
    check_invariants,
)
from allocator.source import IntRangeSource, SegmentSource, StreamEvents

__all__ = [
    "AllocatorError",
    "Block",
    "BlockRecord",
    "IntRangeSource",
    "InvalidFree",
    "InvariantError",
    "PendingRecord",
    "Pool",
    "PoolClosed",
    "PoolExhausted",
    "PoolSnapshot",
    "PoolStats",
    "RestoreDelta",
    "SegmentRecord",
    "SegmentSource",
    "SnapshotMismatch",
    "SnapshotStale",
    "StreamEvents",
    "check_invariants",
    "round_up",
]
