"""Zero-copy inputs: which argument words of a recording point into an eager input (pure).

Layer L1 (pure): no CUDA, no framework. Zero-copy eager inputs, planning half; the backend reads
kernel nodes' argument buffers (``cuGraphKernelNodeGetParams`` + ``cuFuncGetParamInfo``) and
writes patched ones (``cuGraphExecKernelNodeSetParams``).

A kernel node's arguments are bytes at known offsets. Today an eager input is copied into a
placeholder by a memcpy node before the graph's work. ``scan`` finds every pointer-sized,
8-byte-aligned word of every kernel argument (and every memcpy/memset address) whose value lies
in a placeholder, ``[base, base + nbytes)``. One past the end is left out on purpose: it is also
the address of whatever the pool placed next, and rewriting a word that points there would aim
a kernel at the caller's memory; a kernel that does take an end pointer fails the proof below
and its input keeps the copy. ``Plan`` groups them per input and
per node and computes the patched argument bytes for new input addresses, so a call whose input
moved rewrites those words instead of copying.

What a scan cannot see (an address computed on the device, or read from a pointer table in
device memory) is why a plan is only a proposal: the recording proves it by a replay with the
inputs at other addresses, compared with eager, and every input whose proof fails keeps the copy
(``Plan.restricted``).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

WORD = 8


@dataclass(frozen=True, slots=True)
class Placeholder:
    """Where an eager input lives during the recording: ``nbytes`` from ``base``."""

    leaf: int
    base: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ArgWord:
    """One word of a kernel argument pointing into input ``leaf``: ``base + delta``."""

    node: int  # index of the node among the graph's nodes
    param: int  # the kernel parameter's index
    offset: int  # byte offset of the word inside that parameter
    leaf: int
    delta: int


@dataclass(frozen=True, slots=True)
class AddrRef:
    """A memcpy or memset node's address (``field``: ``"src"`` or ``"dst"``) into input ``leaf``."""

    node: int
    field: str
    leaf: int
    delta: int


class _Ranges:
    """Placeholders by base address, for ``find(value)``; rejects overlapping ones."""

    def __init__(self, placeholders):
        ps = sorted(placeholders, key=lambda p: p.base)
        for a, b in zip(ps, ps[1:]):
            if a.base + a.nbytes > b.base:
                raise ValueError(f"placeholders of inputs {a.leaf} and {b.leaf} overlap")
        self.ps = ps
        self.bases = [p.base for p in ps]

    def find(self, value: int):
        """The placeholder ``value`` points into, or None."""
        i = bisect_right(self.bases, value) - 1
        if i < 0:
            return None
        p = self.ps[i]
        return p if value < p.base + p.nbytes else None


def scan(kernels, placeholders, copies=()) -> tuple[list[ArgWord], list[AddrRef]]:
    """Words pointing into ``placeholders``.

    ``kernels``: ``(node, [(param index, argument bytes), ...])`` per kernel node.
    ``copies``: ``(node, field, address)`` for memcpy and memset nodes, the input copies
    themselves left out (they are what rebinding removes).
    Only 8-byte-aligned words of parameters of at least 8 bytes are read: a device pointer
    inside a kernel's argument struct is 8-byte aligned (the C ABI), and a 4-byte parameter
    cannot hold one.
    """
    ranges = _Ranges(placeholders)
    words: list[ArgWord] = []
    for node, params in kernels:
        for index, blob in params:
            for off in range(0, len(blob) - WORD + 1, WORD):
                value = int.from_bytes(blob[off:off + WORD], "little")
                p = ranges.find(value)
                if p is not None:
                    words.append(ArgWord(node, index, off, p.leaf, value - p.base))
    refs = []
    for node, field, address in copies:
        p = ranges.find(address)
        if p is not None:
            refs.append(AddrRef(node, field, p.leaf, address - p.base))
    return words, refs


class Plan:
    """The words to rewrite for each input, and per node the words of all inputs."""

    __slots__ = ("words", "refs", "leaves", "by_node")

    def __init__(self, words: list[ArgWord], refs: list[AddrRef] = ()):
        self.words = list(words)
        self.refs = list(refs)
        self.leaves = sorted({w.leaf for w in self.words} | {r.leaf for r in self.refs})
        self.by_node: dict[int, list[ArgWord]] = {}
        for w in self.words:
            self.by_node.setdefault(w.node, []).append(w)

    def nodes_of(self, leaf: int) -> list[int]:
        """Kernel nodes to re-set when input ``leaf`` moves."""
        return sorted({w.node for w in self.words if w.leaf == leaf})

    def restricted(self, leaves) -> "Plan":
        """The plan for ``leaves`` only (the others keep their copies)."""
        keep = set(leaves)
        return Plan([w for w in self.words if w.leaf in keep], [r for r in self.refs if r.leaf in keep])

    def patch(self, node: int, params: list[bytes], addresses: dict[int, int]) -> list[bytes]:
        """``params`` (argument bytes by parameter index) of ``node`` with every planned word of
        the inputs in ``addresses`` (leaf -> new base) rewritten; the others unchanged."""
        out = [bytearray(b) for b in params]
        for w in self.by_node.get(node, ()):
            base = addresses.get(w.leaf)
            if base is not None:
                out[w.param][w.offset:w.offset + WORD] = (base + w.delta).to_bytes(WORD, "little")
        return [bytes(b) for b in out]

    def summary(self) -> dict[int, str]:
        """Per input, in words: what the recording's report says about it."""
        out = {}
        for leaf in self.leaves:
            ws = [w for w in self.words if w.leaf == leaf]
            rs = [r for r in self.refs if r.leaf == leaf]
            out[leaf] = (f"{len(ws)} argument word(s) in {len({w.node for w in ws})} kernel node(s), "
                         f"{len(rs)} copy/set address(es)")
        return out
