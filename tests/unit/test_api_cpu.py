"""CPU tier: argument checking of the public API and the node table's layout (no driver calls)."""

from __future__ import annotations

import pytest

import cgraw
from cgraw.runtime.graph import Graph, NodeInfo


def test_capture_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        cgraw.capture(mode="bogus")
    with pytest.raises(TypeError, match="DevicePool"):
        cgraw.capture(pool=object())
    with pytest.raises(TypeError, match="warmup"):
        cgraw.capture(warmup=3)


def test_graphed_rejects_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        cgraw.graphed(3)
    with pytest.raises(ValueError, match="static_argnums"):
        cgraw.graphed(lambda x: x, static_argnums=(-1,))
    with pytest.raises(ValueError, match="mutates"):
        cgraw.graphed(lambda x: x, mutates=("a",))
    f = cgraw.graphed(lambda x, y: x, static_argnums=1, mutates=(0,))
    assert f.static_argnums == frozenset({1}) and f.mutates == (0,)


def test_config_is_checked():
    with pytest.raises(ValueError, match="generation_cloning"):
        cgraw.config.generation_cloning = "always"
    with pytest.raises(AttributeError, match="no setting"):
        cgraw.config.dynamic_shape_limit = 3
    assert cgraw.config.dynamic_shape_warn_limit == 8


def test_unsafe_marks_and_still_runs_eagerly():
    @cgraw.unsafe(reason="talks to the host")
    def host(x):
        return x + 1

    assert host(41) == 42
    assert cgraw.graphed(host).unsafe_reason == "marked @cgraw.unsafe (talks to the host)"


def test_graph_summary_table_layout():
    g = Graph._pending(cgraw.Device(0), None, None)
    g._exec = object()  # stands in for an executable: the table needs no driver once nodes are known
    g.num_nodes = 2
    long_name = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_"
    g._nodes = [
        NodeInfo(0, "KERNEL", long_name, (32, 20, 1), (64, 1, 1), 19200, 0x564604539520, ()),
        NodeInfo(1, "MEMCPY", handle=0x564604539C88, depends_on=(0,)),
    ]
    text = g.summary()
    lines = text.splitlines()
    assert lines[0] == "cgraw.Graph on device 0: 2 node(s)"
    assert "| NODE 0: KERNEL" in text and "| NODE 1: MEMCPY" in text
    assert "<<<{32,20},64,19200>>>" in text
    assert "Node handle: 0x0000564604539520" in text and "after: NODE 0" in text
    assert len({len(line) for line in lines[1:]}) == 1  # every box line has the same width
    joined = "".join(line.strip("| ").replace("Kernel: ", "") for line in lines if "Kernel:" in line or
                     (line.startswith("|   ") and "NODE" not in line))
    assert long_name[:40] in joined
    g._exec = None
    assert str(g) == "cgraw.Graph (closed)"
