"""CPU tier: benchmarks.rebind's pure parts: the functions it times (exactly K ops read the input),
how it reads ``cgraw.report()``'s line for a recording, its statistics and verdicts, and its
``cgraw.config.rebind_inputs`` switch on runtimes with and without the setting."""

from __future__ import annotations

import pytest

from benchmarks import rebind as rb

REPORT = """device 0: pool reserved 2.0 MiB (+0.0 MiB through torch), 3 tree node(s)
  reads_x_1: 1 recording(s), 0 re-record(s), 3 replay(s), 1 warm-up(s), 0 eager call(s), 1 input signature(s)
    node reads_x_1 depth 0: 1 graph nodes, 1 input(s) rebound, 0 copied
    node reads_x_1#2 depth 0: 2 graph nodes, 0 input(s) rebound, 1 copied
    node reads_x_2 depth 0: 4 graph nodes
    node reads_x_4 depth 0: 8 graph nodes, 11 input(s) rebound, 0 copied
"""


@pytest.mark.parametrize("k", rb.KS)
def test_exactly_k_ops_read_the_input_and_the_rest_read_temporaries(k):
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.randn(64)
    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(any(a is x for a in args))
            return func(*args, **(kwargs or {}))

    with Count():
        out = rb.reads(k)(x)
    assert sum(ops) == k and len(ops) == 2 * k - 1
    want = x * 2.0 + sum(t for t in (x.sin(), x.cos(), x.exp())[: k - 1]) if k > 1 else x * 2.0
    torch.testing.assert_close(out, want)
    assert rb.reads(k).__qualname__ == f"reads_x_{k}"


def test_reads_refuses_other_counts():
    for k in (0, 5):
        with pytest.raises(ValueError):
            rb.reads(k)


def test_report_line_is_the_named_functions_own():
    assert rb.report_line(REPORT, "reads_x_1").endswith("1 input(s) rebound, 0 copied")
    assert rb.report_line(REPORT, "reads_x_1#2").endswith("0 input(s) rebound, 1 copied")
    assert rb.report_line(REPORT, "reads_x_3") is None
    assert rb.rebound_counts(rb.report_line(REPORT, "reads_x_1#2")) == (0, 1)
    assert rb.rebound_counts(rb.report_line(REPORT, "reads_x_2")) is None
    assert rb.rebound_counts(None) is None


@pytest.mark.parametrize("name, rebind_ok, copy_ok", [
    ("reads_x_1", True, False),  # rebound
    ("reads_x_1#2", False, True),  # copied
    ("reads_x_2", False, True),  # a runtime whose report does not say (the copy path)
    ("reads_x_4", False, False),  # 11 is not 1
    ("missing", False, True),
])
def test_check_report_per_system(name, rebind_ok, copy_ok):
    line = rb.report_line(REPORT, name)
    for system, ok in (("rebind", rebind_ok), ("copy", copy_ok)):
        if ok:
            rb.check_report(system, line)
        else:
            with pytest.raises(rb.CheckFailed):
                rb.check_report(system, line)


def test_summarise_pools_blocks_and_gives_a_verdict():
    s = rb.summarise([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]], limit=5.0)
    assert s["median"] == 2.0 and s["blocks"] == 2 and s["samples"] == 6 and s["verdict"] == "met"
    assert s["ci95"][0] <= 2.0 <= s["ci95"][1]
    assert rb.summarise([[9.0, 10.0, 11.0]], limit=1.0)["verdict"] == "missed"
    empty = rb.summarise([], limit=1.0)
    assert empty["median"] is None and empty["verdict"] == "not measured"
    assert "verdict" not in rb.summarise([[1.0]])
    assert rb.flat("delta", s) == {"delta_us": 2.0, "delta_p90_us": s["p90"], "delta_ci95": s["ci95"],
                                   "delta_verdict": "met"}
    assert set(rb.flat("r", rb.summarise([[1.0]]), "")) == {"r", "r_p90", "r_ci95"}


def test_paired_is_per_round_within_each_block():
    assert rb.paired([[4.0, 6.0], [9.0]], [[2.0, 3.0], [3.0]], lambda a, b: a / b) == [[2.0, 2.0], [3.0]]
    with pytest.raises(ValueError):
        rb.paired([[1.0]], [[1.0, 2.0]], lambda a, b: a - b)


def test_overall_verdict_and_met():
    assert rb.overall(["met", "met", "met"]) == "met"
    assert rb.overall(["met", "missed", "not measured"]) == "missed"
    assert rb.overall(["met", "unresolved"]) == "unresolved"
    assert rb.overall(["met", "not measured"]) == "not measured"
    assert rb.overall([]) == "not measured"
    assert (rb.met("met"), rb.met("missed"), rb.met("unresolved")) == (True, False, None)


def test_blocks_rotate_the_systems():
    assert rb.block_order(0) == ("rebind", "copy", "chosen")
    assert rb.block_order(1) == ("copy", "chosen", "rebind")
    assert rb.block_order(3) == rb.block_order(0)
    assert rb.block_order(0, rb.LARGE_SYSTEMS) == ("rebind", "copy")
    assert rb.block_order(1, rb.LARGE_SYSTEMS) == ("copy", "rebind")


@pytest.mark.parametrize("k, margin, name, ok", [
    (1, 0, "reads_x_1", True),  # one node: read in place
    (1, 0, "reads_x_1#2", False),
    (2, 0, "reads_x_1#2", True),  # two nodes, one copy node: copied
    (2, 0, "reads_x_1", False),
    (2, 1, "reads_x_1", True),  # the margin allows one node more
    (4, 1, "reads_x_1#2", True),
    (2, 0, "reads_x_2", False),  # the report does not say
])
def test_check_report_of_the_defaults_follows_the_node_count(k, margin, name, ok):
    line = rb.report_line(REPORT, name)
    if ok:
        rb.check_report("chosen", line, k, margin)
    else:
        with pytest.raises(rb.CheckFailed):
            rb.check_report("chosen", line, k, margin)


class _Settings:
    """A ``cgraw.config`` stand-in: unknown settings raise, as the real one's do."""

    def __init__(self, names):
        object.__setattr__(self, "_names", names)

    def __setattr__(self, name, value):
        if name not in self._names:
            raise AttributeError(f"cgraw.config has no setting {name!r}")
        object.__setattr__(self, name, value)


def test_set_rebind_switches_the_setting(monkeypatch):
    import cgraw

    cfg = _Settings({"rebind_inputs", "rebind_node_margin"})
    monkeypatch.setattr(cgraw, "config", cfg)
    assert rb._set_rebind("rebind", 0) is True and cfg.rebind_inputs is True
    assert cfg.rebind_node_margin == rb.REPOINT_ALL
    assert rb._set_rebind("copy", 0) is True and cfg.rebind_inputs is False and cfg.rebind_node_margin == 0
    assert rb._set_rebind("chosen", 2) is True and cfg.rebind_inputs is True and cfg.rebind_node_margin == 2
    old = _Settings({"rebind_inputs"})  # a runtime that reads every provable input in place
    monkeypatch.setattr(cgraw, "config", old)
    assert rb._set_rebind("rebind") is True and old.rebind_inputs is True
    with pytest.raises(rb.CheckFailed, match="rebind_node_margin"):
        rb._set_rebind("chosen")


def test_set_rebind_on_a_runtime_without_the_setting(monkeypatch):
    import cgraw

    monkeypatch.setattr(cgraw, "config", _Settings(set()))
    assert rb._set_rebind("copy") is False  # copying is then the only path: still measurable
    with pytest.raises(rb.CheckFailed, match="no rebind_inputs"):
        rb._set_rebind("rebind")
