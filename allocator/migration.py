"""Cross-stream reuse: handing blocks freed on one stream to a malloc on another.

Layer A: pure Python, stdlib plus ``allocator.bins``/``allocator.block``; must not import
cgraw, anything CUDA, or ``allocator.pool`` (it works on a ``Pool``'s fields, under its lock).

The scheme. Every free stamps the block with ``seq`` (the pool's free count). When a malloc on
stream B finds nothing in B's arena and the pool has ``events``, each other stream A with free
blocks is visited in stream-id order. A holds at most one pending event: if it has none, one is
recorded now (``events.record(A)``) and stamped with the current free count. The event is
queried right away and on every later miss. Once it reports done, each block free on A with
``seq <= stamp`` was freed before the record, so A's work on it has finished: it moves to B's
arena (keeping its seq) and merges with B's free neighbours, and the event is dropped. Blocks
merged on A take the newest seq, so a merge can only delay a move. ``record`` may return None
("cannot record now"); that stream is then skipped, as are the pool's pinned streams (whose
freed blocks are still used by other work, ``Pool._pinned_streams``). With ``events=None`` none
of this runs.

A plan is computed without touching the pool, and committed only once the malloc is certain to
succeed, so a ``PoolExhausted`` leaves the pool (pending events included) unchanged.
"""

from __future__ import annotations

from typing import Any

from allocator.bins import Arena
from allocator.block import Block


class MigrationPlan:
    """Cross-stream work decided on a miss.

    Attributes:
        new_pending: ``(stream, token, stamp)`` events recorded now and not yet done.
        done_streams: streams whose pending event is done (to drop after the move).
        blocks: blocks to move, by address.
        fits: whether the moved blocks, merged with the target stream's free blocks, give a
            block big enough for the request.
    """

    __slots__ = ("new_pending", "done_streams", "blocks", "fits")

    def __init__(self, new_pending: list[tuple[int, object, int]], done_streams: list[int],
                 blocks: list[Block], fits: bool):
        self.new_pending = new_pending
        self.done_streams = done_streams
        self.blocks = blocks
        self.fits = fits


def plan_migration(pool: Any, stream: int, size: int) -> MigrationPlan | None:
    """Record/query events and pick the blocks that may move to ``stream``; change nothing in
    the pool. None when there is nothing to do."""
    events = pool._events
    new_pending: list[tuple[int, object, int]] = []
    done: list[tuple[int, int]] = []
    pinned = pool._pinned_streams()
    for other in sorted(s for s, a in pool._arenas.items() if s != stream and a.sizes and s not in pinned):
        pending = pool._pending.get(other)
        if pending is None:
            token = events.record(other)
            if token is None:
                continue
            pending = (token, pool._num_frees)
            if not events.query(token):
                new_pending.append((other, token, pool._num_frees))
                continue
        elif not events.query(pending[0]):
            continue
        done.append((other, pending[1]))
    if not new_pending and not done:
        return None
    blocks = [
        b
        for other, stamp in done
        for b in map(pool._blocks.__getitem__, pool._arenas[other].ptrs())
        if b.seq <= stamp
    ]
    blocks.sort(key=lambda b: b.ptr)
    return MigrationPlan(new_pending, [s for s, _ in done], blocks, _fits(blocks, stream, size))


def _fits(blocks: list[Block], stream: int, size: int) -> bool:
    """Whether some run of adjacent blocks, each free on ``stream`` or moving, reaches ``size``."""
    moving = set(map(id, blocks))
    for b in blocks:
        total = b.size
        p = b.prev
        while p is not None and p.is_free and (p.stream == stream or id(p) in moving):
            total += p.size
            p = p.prev
        n = b.next
        while n is not None and n.is_free and (n.stream == stream or id(n) in moving):
            total += n.size
            n = n.next
        if total >= size:
            return True
    return False


def commit_migration(pool: Any, plan: MigrationPlan, stream: int) -> None:
    """Apply ``plan``: store the new pending events, drop the done ones, move the blocks."""
    for other, token, stamp in plan.new_pending:
        pool._pending[other] = (token, stamp)
    for other in plan.done_streams:
        pool._pending.pop(other, None)
    if not plan.blocks:
        return
    arena = pool._arenas.get(stream)
    if arena is None:
        arena = pool._arenas[stream] = Arena()
    for b in plan.blocks:  # address order: each is untouched until its turn
        if pool._blocks.get(b.ptr) is not b:
            continue  # its segment was released by the limit path meanwhile
        pool._arenas[b.stream].remove(b.size, b.ptr)
        b.stream = stream  # seq is kept: no work on ``stream`` has touched it
        merge_insert(pool, b, arena)


def merge_insert(pool: Any, block: Block, arena: Arena) -> None:
    """Merge a newly free block with its neighbours free on the same stream, then file it in
    ``arena``. (``Pool.free`` inlines this for speed; keep the two in step.)"""
    stream = block.stream
    blocks = pool._blocks
    prev = block.prev
    if prev is not None and prev.is_free and prev.stream == stream:
        arena.remove(prev.size, prev.ptr)
        del blocks[block.ptr]
        prev.size += block.size
        nxt = prev.next = block.next
        if nxt is not None:
            nxt.prev = prev
        if block.seq > prev.seq:
            prev.seq = block.seq
        block = prev
    nxt = block.next
    if nxt is not None and nxt.is_free and nxt.stream == stream:
        arena.remove(nxt.size, nxt.ptr)
        del blocks[nxt.ptr]
        block.size += nxt.size
        after = block.next = nxt.next
        if after is not None:
            after.prev = block
        if nxt.seq > block.seq:
            block.seq = nxt.seq
    arena.insert(block.size, block.ptr)
