"""CPU tier of zero-copy input planning: the scan of argument words and the patch."""

from __future__ import annotations

import pytest

from cgraw.rebind.scan import ArgWord, Placeholder, Plan, scan


def w64(*values: int) -> bytes:
    return b"".join(v.to_bytes(8, "little") for v in values)


A = Placeholder(0, 0x7F0000001000, 4096)
B = Placeholder(3, 0x7F0000002000, 256)  # right after A: A's end is B's start


def test_scan_finds_pointers_into_placeholders_at_any_aligned_offset():
    # an OffsetCalculator-like struct: output pointer, input pointer, then sizes
    kernels = [
        (0, [(0, (4096).to_bytes(4, "little")), (1, w64(0x7F0000009000, A.base + 64, 1024, 7))]),
        (5, [(0, w64(B.base)), (2, w64(A.base + 4095))]),
    ]
    words, refs = scan(kernels, [A, B])
    assert words == [ArgWord(0, 1, 8, 0, 64), ArgWord(5, 0, 0, 3, 0), ArgWord(5, 2, 0, 0, 4095)]
    assert refs == []


def test_scan_leaves_out_end_pointers_small_params_and_misaligned_words():
    end_of_b = B.base + B.nbytes
    misaligned = b"\x00" * 4 + w64(A.base) + b"\x00" * 4
    kernels = [(1, [(0, w64(end_of_b)), (1, A.base.to_bytes(8, "little")[:4]), (2, misaligned)])]
    words, _ = scan(kernels, [A, B])
    assert words == []
    # A's end is B's start: attributed to B (delta 0), never to A at delta 4096
    words, _ = scan([(2, [(0, w64(A.base + A.nbytes))])], [A, B])
    assert words == [ArgWord(2, 0, 0, 3, 0)]


def test_scan_memcpy_and_memset_addresses():
    _, refs = scan([], [A, B], copies=[(7, "src", A.base + 8), (8, "dst", 0x1000), (9, "dst", B.base)])
    assert [(r.node, r.field, r.leaf, r.delta) for r in refs] == [(7, "src", 0, 8), (9, "dst", 3, 0)]


def test_overlapping_placeholders_are_refused():
    with pytest.raises(ValueError, match="overlap"):
        scan([], [A, Placeholder(1, A.base + 100, 8)])


def test_plan_patches_only_the_moved_inputs_words():
    kernels = [(0, [(0, w64(A.base + 16, B.base + 8)), (1, w64(42))]), (4, [(0, w64(A.base))])]
    plan = Plan(*scan(kernels, [A, B]))
    assert plan.leaves == [0, 3] and plan.nodes_of(0) == [0, 4] and plan.nodes_of(3) == [0]
    params = [p for _, p in kernels[0][1]]
    moved = plan.patch(0, params, {0: 0x7E0000000000})
    assert moved[0] == w64(0x7E0000000000 + 16, B.base + 8) and moved[1] == w64(42)
    both = plan.patch(0, params, {0: 0x10000, 3: 0x20000})
    assert both[0] == w64(0x10000 + 16, 0x20000 + 8)
    assert plan.patch(0, params, {}) == params  # nothing moved: bytes unchanged
    assert plan.patch(9, [w64(1)], {0: 5}) == [w64(1)]  # a node with no planned word


def test_restricted_plan_keeps_only_proven_inputs():
    kernels = [(0, [(0, w64(A.base, B.base))])]
    plan = Plan(*scan(kernels, [A, B], copies=[(3, "src", B.base)]))
    only_a = plan.restricted([0])
    assert only_a.leaves == [0] and [w.leaf for w in only_a.words] == [0] and only_a.refs == []
    assert only_a.patch(0, [w64(A.base, B.base)], {0: 0x100, 3: 0x200}) == [w64(0x100, B.base)]
    assert plan.summary()[3] == "1 argument word(s) in 1 kernel node(s), 1 copy/set address(es)"
