"""The graphed-call benchmark's driver floors, on a recording whose input is copied and on one
whose input is read in place (no copy node), with the driver calls recorded instead of made."""

import ctypes
import types

import pytest

from benchmarks.graphed_call import _floors
from cgraw.trees.recording import InputCopy, InputRebind

A, B = 0xA000, 0xB000  # the two inputs' addresses
PLACEHOLDER = 0xF000


@pytest.fixture
def driver(monkeypatch):
    """The driver calls the floors make, in order, as tuples."""
    from cgraw import _cuda
    from cgraw.runtime import stream as _streams

    calls = []
    monkeypatch.setattr(_cuda, "graph_launch_raw", lambda exec_, stream: calls.append(("launch", exec_, stream)))
    monkeypatch.setattr(_cuda, "memcpy_node_set_1d_raw", lambda *a: calls.append(("memcpy", *a[1:5])))
    monkeypatch.setattr(_cuda, "drv", types.SimpleNamespace(
        cuGraphExecKernelNodeSetParams=lambda exec_, node, q: calls.append(("kernel", exec_, node, q.value))))
    monkeypatch.setattr(_streams, "current_ptr", lambda ordinal: 7)
    return calls


def _recording(copies=(), rebinds=(), notes=None):
    return types.SimpleNamespace(copies=list(copies), rebinds=list(rebinds), input_notes=notes or {},
                                 graph=types.SimpleNamespace(_exec="exec"),
                                 setter=types.SimpleNamespace(exec_="exec_rt"))


def _sets(a=A, b=B):
    return [[types.SimpleNamespace(data_ptr=lambda p=p: p)] for p in (a, b)]


@pytest.mark.parametrize("held", [A, B])
def test_a_copied_input_floor_repoints_its_memcpy_node_and_ends_where_the_recording_left_it(driver, held):
    copy = InputCopy(0, "copy-node", PLACEHOLDER, held, 4096, 0, False)
    floors, what = _floors(_recording(copies=[copy]), _sets())
    assert "memcpy node" in what
    for _ in range(4):
        floors["floor_patch_and_launch"]()
    other = B if held == A else A
    assert driver == [c for p in (other, held, other, held)
                      for c in (("memcpy", "copy-node", PLACEHOLDER, p, 4096), ("launch", "exec", 7))]
    assert copy.ptr == held
    driver.clear()
    floors["floor_raw_launch"]()
    assert driver == [("launch", "exec", 7)]


def test_an_input_read_in_place_floor_repoints_its_kernel_and_memcpy_nodes(driver):
    """No copy node: the floor rewrites the recording's own argument words and hands them to each
    kernel node, re-points its 1-D copies, and leaves the words at the recording's address."""
    word = ctypes.c_uint64(PLACEHOLDER + 16)
    kernel = types.SimpleNamespace(exec_="exec", node="kernel-node", q=word)  # q: what the driver is handed
    copy_node = ("memcpy-node", None, 8, 0xD000, PLACEHOLDER + 8, 64)  # reads the input 8 bytes in
    rebind = InputRebind(0, PLACEHOLDER, [(word, 16)], [kernel], [copy_node])
    rebind.ptr = A
    floors, what = _floors(_recording(rebinds=[rebind]), _sets())
    assert "1 kernel node(s)" in what and "1 memcpy node(s)" in what and "read in place" in what
    floors["floor_patch_and_launch"]()
    floors["floor_patch_and_launch"]()
    assert driver == [("kernel", "exec", "kernel-node", B + 16), ("memcpy", "memcpy-node", 0xD000, B + 8, 64),
                      ("launch", "exec", 7),
                      ("kernel", "exec", "kernel-node", A + 16), ("memcpy", "memcpy-node", 0xD000, A + 8, 64),
                      ("launch", "exec", 7)]
    assert word.value == A + 16 and rebind.ptr == A


def test_an_input_neither_copied_nor_read_in_place_has_only_the_raw_launch_floor(driver):
    floors, what = _floors(_recording(notes={0: "non-contiguous: copied eagerly"}), _sets())
    assert list(floors) == ["floor_raw_launch"]
    assert what.startswith("none: input 0") and "non-contiguous" in what
