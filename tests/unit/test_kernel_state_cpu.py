"""CPU tests of what makes a replay run what eager would run now: the kernel-choosing settings in
a call's key (``interop.torch.kernel_state``, ``calls.use_kernel_state``) and placeholders with the
caller's layout (``frameworks.Ops.empty_layout``, ``node_bytes``). The same scenarios on the
GPU, against eager, are in tests/gpu/test_fidelity.py."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from torch_cpu_backend import CpuTorchBackend, TorchFn, cpu_as_device0  # noqa: E402

from cgraw.trees import calls  # noqa: E402
from cgraw.trees.frameworks import TORCH, layout_offset, may_overlap, span_elements  # noqa: E402
from cgraw.interop.torch.kernel_state import COMPILED, GROUPS, OPAQUE, KernelState, groups_of, kernel_state  # noqa: E402
from cgraw.trees.manager import NodeState, TreeManager  # noqa: E402

pytestmark = pytest.mark.torch


@contextlib.contextmanager
def flipped(get, put, other=None):
    before = get()
    put((not before) if other is None else other)
    try:
        yield
    finally:
        put(before)


def _attr(obj, name):
    return (lambda: getattr(obj, name)), (lambda v: setattr(obj, name, v))


def _autocast(device, dtype=None):
    def put(v):
        torch.set_autocast_enabled(device, v)
        torch.set_autocast_dtype(device, dtype if dtype is not None and v else torch.bfloat16)
    return (lambda: torch.is_autocast_enabled(device)), put


CORE_FLIPS = {
    "autocast cuda": _autocast("cuda"),
    "autocast cpu": _autocast("cpu"),
    "autocast dtype": ((lambda: torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16),
                       _autocast("cpu", torch.float16)[1]),
    "matmul tf32": _attr(torch.backends.cuda.matmul, "allow_tf32"),
    "fp16 reduction": _attr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    "float32 matmul precision": ((lambda: torch.get_float32_matmul_precision() == "highest"),
                                 lambda v: torch.set_float32_matmul_precision("highest" if v else "high")),
    "deterministic algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    "default dtype": ((lambda: torch.get_default_dtype() == torch.float32),
                      lambda v: torch.set_default_dtype(torch.float32 if v else torch.float64)),
}
CUDNN_FLIPS = {name: _attr(torch.backends.cudnn, name) for name in ("enabled", "benchmark", "deterministic",
                                                                   "allow_tf32")}
SDP_FLIPS = {
    "flash sdp": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "math sdp": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    "mem-efficient sdp": (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
}


@pytest.mark.parametrize("name", list(CORE_FLIPS) + list(CUDNN_FLIPS) + list(SDP_FLIPS))
def test_each_setting_changes_the_state_and_back(name):
    ks = KernelState(torch)
    every = ks.getters(None)
    get, put = {**CORE_FLIPS, **CUDNN_FLIPS, **SDP_FLIPS}[name]
    before = ks.state(every)
    assert ks.state(every) == before
    with flipped(get, put):
        during = ks.state(every)
        assert ks.state(every) == during
    assert during != before
    assert ks.state(every) == before


@pytest.mark.parametrize("name", list(CUDNN_FLIPS) + list(SDP_FLIPS))
def test_cudnn_and_attention_flags_are_read_only_for_functions_that_need_them(name):
    ks = KernelState(torch)
    none, group = ks.getters(frozenset()), ks.getters(frozenset({"cudnn" if name in CUDNN_FLIPS else "sdp"}))
    get, put = {**CUDNN_FLIPS, **SDP_FLIPS}[name]
    a, b = ks.state(none), ks.state(group)
    with flipped(get, put):
        assert ks.state(none) == a
        assert ks.state(group) != b


def test_inference_mode_and_no_grad_are_different_states():
    """Grad mode itself joins the key as its own entry (``calls.use_grad_mode``)."""
    ks = kernel_state()
    g = ks.getters(frozenset())
    with torch.no_grad():
        no_grad = ks.state(g)
    with torch.inference_mode():
        inference = ks.state(g)
    assert no_grad != inference
    assert ks.state(g) == no_grad


def test_dynamos_guard_is_used_when_it_sees_the_settings():
    """On this torch the one-call guard notices autocast, TF32 and the default dtype, so the
    guarded settings are read only when it fails; alternating two states reuses both guards."""
    ks = KernelState(torch)
    assert ks._guard_cls is not None
    g = ks.getters(frozenset())
    a = ks.state(g)
    n_guards = len(ks.recent)
    for _ in range(5):
        with torch.autocast("cpu"):
            b = ks.state(g)
        assert ks.state(g) == a
    assert b != a and len(ks.recent) == n_guards + 1


def test_groups_of_ops():
    assert groups_of(["add.Tensor", "mm.default"]) == frozenset()
    assert groups_of(["convolution.default"]) == {"cudnn"}
    assert groups_of(["_native_batch_norm_legit_functional.default"]) == {"cudnn"}
    assert groups_of(["_scaled_dot_product_efficient_attention.default", "add.Tensor"]) == {"sdp"}
    assert groups_of(["aten::convolution.default", "higher_order::cond", "inductor::resize_storage_bytes_.default",
                      "prims::convert_element_type.default"]) == {"cudnn"}


def test_an_op_outside_torchs_namespaces_puts_its_function_in_every_group():
    """A custom op's body runs below the warm-up's dispatch mode: the settings it reads are unseen."""
    assert groups_of(["aten::add.Tensor", "demo::attn.default"]) == {*GROUPS, OPAQUE}
    assert groups_of(["torchvision::roi_align.default"]) == {*GROUPS, OPAQUE}


def test_compiled_code_reads_the_groups_it_fixed_when_an_op_out_of_sight_ran():
    ks = kernel_state()
    assert ks.getters({"sdp"}, COMPILED) == ks.getters(frozenset()) != ks.getters({"sdp"})
    assert ks.getters(groups_of(["demo::attn.default"]), COMPILED) == ks.getters(None) == ks.getters(GROUPS)


# ---------------------------------------------------------------------- the tree


class _GroupingBackend(CpuTorchBackend):
    """Warm-ups report the setting groups of the ops they ran (``groups``), as the warm-up observer does."""

    groups = frozenset()

    def warmup(self, fn, call, args, kwargs):
        w = super().warmup(fn, call, args, kwargs)
        w.groups = self.groups
        return w


@contextlib.contextmanager
def _grouping_tree(monkeypatch, groups=frozenset()):
    with cpu_as_device0(monkeypatch):
        be = _GroupingBackend()
        be.groups = groups
        mgr = TreeManager(be)
        be.mgr = mgr
        calls.use_kernel_state(kernel_state())
        try:
            yield mgr
        finally:
            calls.use_kernel_state(None)


@pytest.fixture
def tree(monkeypatch):
    with _grouping_tree(monkeypatch) as mgr:
        yield mgr


def test_a_call_under_other_settings_selects_a_recording_of_its_own(tree):
    f = TorchFn(lambda x: x @ x.t(), tree, name="gram")
    x = torch.randn(8, 8)
    with torch.no_grad():
        for _ in range(3):
            tree.mark_step_begin()
            torch.testing.assert_close(f(x), x @ x.t())
        for _ in range(3):
            tree.mark_step_begin()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = f(x)
                assert out.dtype == torch.bfloat16
                assert torch.equal(out, x @ x.t())
        tree.mark_step_begin()
        assert f(x).dtype == torch.float32
    be = tree.backend
    assert (be.count("warmup", "gram"), be.count("record", "gram"), be.count("replay", "gram")) == (2, 2, 5)
    assert len(tree.roots) == 2 and all(n.state is NodeState.RECORDED for n in tree.roots.values())


def test_a_warmed_node_keeps_its_place_when_its_setting_groups_are_learned(tree):
    """The first call reads every setting group; its warm-up shows the function needs none, and
    its node is filed under the key the next call has: recorded at the second call."""
    f = TorchFn(lambda x: x * 2, tree, name="double")
    x = torch.randn(16)
    with torch.no_grad():
        for _ in range(3):
            tree.mark_step_begin()
            f(x)
    assert f.kernel_groups == frozenset()
    be = tree.backend
    assert (be.count("warmup"), be.count("record"), be.count("replay")) == (1, 1, 2)


@pytest.mark.parametrize("compiled, groups", [(False, {"sdp"}), (True, {"sdp"}), (True, {*GROUPS, OPAQUE})],
                         ids=["eager code", "compiled code", "compiled code calling a custom op"])
def test_attention_flags_select_a_recording_unless_the_code_fixed_them_when_compiled(monkeypatch, compiled, groups):
    """Eager attention picks its backend from the flags at each call, so a switch selects a
    recording of its own; Inductor's code runs the backend it lowered to (``compiled_groups``), so
    its node replays under either, unless it calls an op whose body the warm-up did not see."""
    with _grouping_tree(monkeypatch, frozenset(groups)) as mgr:  # its warm-up ran an attention op
        f = TorchFn(lambda x: x * 2, mgr, name="attn")
        if compiled:
            f.compiled_groups = COMPILED
        get, put = SDP_FLIPS["flash sdp"]
        x = torch.randn(16)
        with torch.no_grad():
            for flash in (True, False, True, False):
                with flipped(get, put, flash):
                    for _ in range(2):
                        mgr.mark_step_begin()
                        torch.testing.assert_close(f(x), x * 2)
    be = mgr.backend
    assert f.kernel_groups == groups
    counts = be.count("warmup", "attn"), be.count("record", "attn"), be.count("replay", "attn")
    fixed = compiled and OPAQUE not in groups
    assert counts == ((1, 1, 7) if fixed else (2, 2, 6))  # a recording's first replay follows it


def test_the_backends_graphed_functions_leave_out_the_settings_inductor_fixes_when_it_compiles():
    from cgraw.interop.torch import backend

    assert backend.runtime().graphed(lambda x: x).compiled_groups == COMPILED == {"sdp"}
    assert backend.graphed(lambda x: x).compiled_groups == frozenset()


# ---------------------------------------------------------------------- layouts


LAYOUTS = {
    "contiguous": lambda: torch.randn(4, 5),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "transposed": lambda: torch.randn(6, 7).t(),
    "sliced": lambda: torch.randn(10, 10)[:, :6],
    "sparse slice": lambda: torch.randn(50, 50)[:, :3],
    "expanded": lambda: torch.randn(5, 1).expand(5, 8),
    "offset": lambda: torch.randn(100)[37:60],
    "far offset": lambda: torch.randn(10000)[5001:5011],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_placeholders_have_the_callers_layout(name):
    t = LAYOUTS[name]()
    ph = TORCH.empty_layout(t)
    assert (ph.shape, ph.stride(), ph.dtype) == (t.shape, t.stride(), t.dtype)
    if name == "far offset":
        assert ph.storage_offset() != t.storage_offset()
        assert (ph.storage_offset() * 4) % 256 == (t.storage_offset() * 4) % 256
    else:
        assert ph.storage_offset() == t.storage_offset()
    c = TORCH.clone_layout(t)
    assert c.stride() == t.stride() and torch.equal(c, t)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_memcpy_node_copies_an_input_unless_its_span_is_mostly_gaps(name):
    t = LAYOUTS[name]()
    n, span = TORCH.nbytes(t), TORCH.span(t)
    got = TORCH.node_bytes(t)
    assert got == (0 if name == "sparse slice" else span)
    if got:  # the copy over the span reproduces every element
        ph = TORCH.empty_layout(t)
        TORCH.flat_span(ph).copy_(TORCH.flat_span(t))
        assert torch.equal(ph, t)
    assert (span < n) == (name == "expanded")


def test_layout_arithmetic():
    assert span_elements((2, 3), (3, 1)) == 6
    assert span_elements((3, 2), (1, 3)) == 6
    assert span_elements((0, 4), (4, 1)) == 0
    assert span_elements((5, 8), (1, 0)) == 5
    assert layout_offset(37, 23, 4) == 37
    assert layout_offset(5001, 10, 4) == 5001 % 64
    assert not may_overlap((2, 3, 4), (12, 4, 1))
    assert may_overlap((5, 8), (1, 0))
    assert may_overlap((3, 3), (1, 1))
    assert not may_overlap((3, 1, 4), (4, 0, 1))  # a dimension of size 1 never overlaps
