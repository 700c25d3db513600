"""Size rounding and ``Arena``: the best-fit free lists of one stream.

Layer A: pure Python, stdlib only (imports nothing; works on ints). The pool keeps one arena
per stream id. An arena maps each free size to the sorted addresses of the free blocks of that
size, plus a sorted list of the sizes, so best fit is one ``bisect`` and ties go to the lowest
address.
"""

from __future__ import annotations

from bisect import bisect_left, insort


def round_up(nbytes: int, multiple: int) -> int:
    """``nbytes`` rounded up to a multiple of ``multiple`` (both positive ints)."""
    return -(-nbytes // multiple) * multiple


class Arena:
    """Free blocks of one stream, indexed by size then address.

    Attributes:
        sizes: sorted distinct sizes that have at least one free block.
        bins: size -> ascending addresses of the free blocks of that size (never empty).
    """

    __slots__ = ("sizes", "bins")

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.bins: dict[int, list[int]] = {}

    def insert(self, size: int, ptr: int) -> None:
        ptrs = self.bins.get(size)
        if ptrs is None:
            self.bins[size] = [ptr]
            insort(self.sizes, size)
        else:
            insort(ptrs, ptr)

    def remove(self, size: int, ptr: int) -> None:
        ptrs = self.bins[size]
        if len(ptrs) == 1:
            del self.bins[size]
            sizes = self.sizes
            del sizes[bisect_left(sizes, size)]
        else:
            del ptrs[bisect_left(ptrs, ptr)]

    def pop_best_fit(self, size: int) -> int | None:
        """Remove and return the address of the smallest free block >= ``size`` (lowest
        address among equals), or None when nothing fits."""
        sizes = self.sizes
        i = bisect_left(sizes, size)
        if i == len(sizes):
            return None
        found = sizes[i]
        ptrs = self.bins[found]
        if len(ptrs) == 1:
            del self.bins[found]
            del sizes[i]
            return ptrs[0]
        return ptrs.pop(0)

    @property
    def largest(self) -> int:
        """Size of the largest free block, 0 when empty."""
        return self.sizes[-1] if self.sizes else 0

    def __len__(self) -> int:
        return sum(len(p) for p in self.bins.values())

    def ptrs(self) -> list[int]:
        """Every free address in this arena, ascending."""
        return sorted(p for ptrs in self.bins.values() for p in ptrs)
