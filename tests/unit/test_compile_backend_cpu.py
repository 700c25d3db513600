"""CPU tier: the decisions of ``torch.compile(m, backend="cgraw")``: options, names, what runs
without graphs and why, the entry point, and the partition wrapper's list-argument adaptation
(with a fake graphed function). On torch's CPU build Inductor cuts no partition: the hook's
installation and the fallback are checked there as it is; the last part runs the whole partition
path on the CPU through ``tests/helpers/compile_cpu.py`` (CPU nodes count as graphable, the
partitions are graphed functions of trees over the CPU stand-in backend). The graphs themselves
are checked on the GPU (tests/gpu/test_compile_backend.py)."""

from __future__ import annotations

import copy
import importlib
import pathlib
import re
import subprocess
import sys
import threading

import pytest

from cgraw.interop.torch import backend as cb, partitions as tcomp, whole_graph as wg

graphed_mod = importlib.import_module("cgraw.trees.graphed")  # the module (cgraw.graphed is also the decorator)

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_notes():
    graphed_mod.forget_without_graphs()
    yield
    graphed_mod.forget_without_graphs()


# ---------------------------------------------------------------- options and names


def test_options_default_and_checked():
    o = cb.Options.parse(None)
    assert (o.name, o.partitions, o.fallback, o.inductor, o.whole_graph) == (None, "all", "inductor", None, True)
    assert cb.Options.parse({"whole_graph": False}).whole_graph is False
    assert o.select(0) is None and o.select(7) is None
    o = cb.Options.parse({"name": "mlp", "partitions": [0, 2], "fallback": "raise",
                          "inductor": {"max_autotune": False}})
    assert (o.name, o.partitions, o.fallback, o.inductor) == ("mlp", frozenset({0, 2}), "raise",
                                                              {"max_autotune": False})
    assert o.select(0) is None and o.select(2) is None
    assert "left out by options['partitions'] ([0, 2])" == o.select(1)


@pytest.mark.parametrize("bad, match", [
    ({"nme": "x"}, r"no option\(s\) \['nme'\]"),
    ({"name": ""}, "non-empty str"),
    ({"partitions": "0"}, "'all' or partition indices"),
    ({"partitions": [0, -1]}, "non-negative ints"),
    ({"partitions": [True]}, "non-negative ints"),
    ({"fallback": "eager"}, "must be one of"),
    ({"inductor": [("a", 1)]}, "dict of torch._inductor.config"),
    ({"whole_graph": 1}, "True or False"),
    (["name"], "options as a dict"),
])
def test_options_refused_with_the_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        cb.Options.parse(bad)


def test_labels_name_the_frame():
    assert cb.label(cb.Options.parse({"name": "mlp"}), "0/1") == "mlp [0/1]"
    assert cb.label(cb.Options(), "2/0") == "compiled [2/0]"
    a, b = cb.label(cb.Options(), None), cb.label(cb.Options(), None)
    assert a != b and a.startswith("compiled [") and b.startswith("compiled [")


def test_entry_point_is_declared_and_resolves():
    import tomllib

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch_dynamo_backends"]
    assert eps == {"cgraw": "cgraw.interop.torch.backend:cgraw_backend"}
    module, _, attr = eps["cgraw"].partition(":")
    assert getattr(importlib.import_module(module), attr) is cb.cgraw_backend


def test_backend_module_imports_no_framework():
    code = ("import sys\nimport cgraw.interop.torch.backend, cgraw.interop.torch.partitions\n"
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, sorted(sys.modules)\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_report_lists_code_without_graphs(capsys):
    graphed_mod.note_without_graphs("mlp [0/0] forward/partition 1 of 3", "left out")
    text = graphed_mod.report()
    assert "compiled code that runs without cgraw's graphs:" in text
    assert "  mlp [0/0] forward/partition 1 of 3: left out" in text
    assert graphed_mod.without_graphs() == {"mlp [0/0] forward/partition 1 of 3": "left out"}


# ---------------------------------------------------------------- the wrapper, with fakes


class FakeGraphed:
    def __init__(self, fn):
        self.fn = fn
        self.name = fn.__qualname__
        self.calls = []

    def __call__(self, *xs):
        self.calls.append(xs)
        return self.fn(*xs)


class FakeTree:
    def __init__(self, owner):
        self.owner_thread = owner
        self.calls = []
        self.held = set()

    def hold_step(self, owner):
        self.held.add(owner)

    def release_step(self, owner):
        self.held.clear()

    def call_here(self, fn, args, kwargs):
        self.calls.append((fn, args, kwargs))
        return fn(*args, **kwargs)


class Arg(float):
    """A partition's argument on device 0."""

    def get_device(self):
        return 0


class Meta:
    def __init__(self, n, i):
        self.num_partitions, self.partition_index = n, i


def _runtime(made, notes, tree=None):
    def graphed(fn):
        g = FakeGraphed(fn)
        made.append(g)
        return g

    return tcomp.Runtime(graphed, lambda ordinal: tree, lambda name, why: notes.append((name, why)))


def _partition(seen):
    def partition_0(args):
        a, b, n = args
        args.clear()  # Inductor's partitions unpack and clear their list
        seen.append((a, b, n))
        return (a + b * n,)

    return partition_0


def test_wrapper_graphs_a_partition_and_adapts_its_list_argument():
    made, notes, seen = [], [], []
    w = tcomp.Wrapping("mlp [0/0]", _runtime(made, notes), cb.Options().select)
    w.phase.value = "forward"
    wrapped = w(_partition(seen), Meta(3, 1))
    assert len(made) == 1 and made[0].name == "mlp [0/0] forward/partition 1 of 3"
    assert wrapped.cgraw_graphed is made[0] and w.wrapped == [made[0].name] and w.seen == 1
    args = [2.0, 5.0, 3]
    assert wrapped(args) == (17.0,)
    assert args == []  # cleared, as the partition itself clears it
    assert made[0].calls == [(2.0, 5.0, 3)] and seen == [(2.0, 5.0, 3)]  # positional, in order
    assert notes == []


class CpuArg(float):
    """A partition's 0-d argument on the CPU (a Python float dynamo passes as a tensor)."""

    shape, dtype = (), "torch.float64"

    def get_device(self):
        return -1


def test_a_partition_given_a_cpu_tensor_beside_gpu_ones_runs_as_compiled_and_names_the_argument():
    """dynamo passes a Python float it keeps symbolic as a 0-d CPU tensor, which Inductor's kernel
    launches read: a graph would fix its value, and a recording copies inputs on the GPU (it failed
    with ``CUDA_ERROR_INVALID_VALUE``). The first call tells where each argument lives for every
    later one; such a partition's graphed function runs it as Inductor compiled it, naming the
    argument."""
    made, notes, seen = [], [], []
    w = tcomp.Wrapping("m [0/0]", _runtime(made, notes), cb.Options().select)
    wrapped = w(_partition(seen), Meta(1, 0))
    assert wrapped([Arg(2.0), Arg(5.0), 3]) == (17.0,)
    assert getattr(made[0], "unsafe_reason", None) is None  # all on one device
    wrapped = w(_partition(seen), Meta(1, 0))
    assert wrapped([Arg(2.0), CpuArg(0.5), 3]) == (3.5,)
    why = made[1].unsafe_reason
    assert why.startswith("argument 1 (shape (), torch.float64) lives on the CPU beside GPU tensors"), why
    assert "runs as Inductor compiled it" in why
    assert tcomp.cpu_beside_gpu([CpuArg(1.0), CpuArg(2.0), 4]) is None  # all on the CPU: not this case
    assert tcomp.cpu_beside_gpu([Arg(1.0), 4, None]) is None


def test_partitions_left_out_run_as_compiled_with_the_reason():
    made, notes, seen = [], [], []
    w = tcomp.Wrapping("m [1/0]", _runtime(made, notes), cb.Options.parse({"partitions": [0]}).select)
    fn = _partition(seen)
    assert w(fn, Meta(2, 1)) is fn and made == []
    assert notes == [("m [1/0]/partition 1 of 2", "left out by options['partitions'] ([0])")]
    assert w(fn, Meta(2, 0)) is not fn and len(made) == 1


def test_a_wrapper_failure_leaves_the_partition_as_compiled():
    notes, seen = [], []

    def broken(fn):
        raise RuntimeError("no tree today")

    rt = tcomp.Runtime(broken, lambda o: None, lambda name, why: notes.append((name, why)))
    w = tcomp.Wrapping("m [0/0]", rt, cb.Options().select)
    fn = _partition(seen)
    assert w(fn, Meta(1, 0)) is fn
    assert notes == [("m [0/0]/partition 0 of 1", "not graphed: RuntimeError: no tree today")]
    notes.clear()
    assert w(fn, object()) is fn  # metadata without the fields
    assert notes and "metadata is unreadable" in notes[0][1]


def test_backward_partitions_run_in_the_tree_of_their_forward():
    made, notes, seen = [], [], []
    tree = FakeTree(owner=-1)  # owned by another thread
    home = tcomp.Home()
    rt = _runtime(made, notes, tree)
    in_backward = [False]
    fwd = tcomp.adapt(_partition(seen), FakeGraphed(tcomp.graph_body(_partition(seen), "f")), home, rt,
                      lambda: in_backward[0])
    assert fwd([Arg(1.0), Arg(2.0), 1]) == (3.0,)
    assert home.tree is tree and tree.calls == []  # the forward ran on its own thread's tree
    in_backward[0] = True
    gb = FakeGraphed(tcomp.graph_body(_partition(seen), "b"))
    bwd = tcomp.adapt(_partition(seen), gb, home, rt, lambda: in_backward[0])
    assert bwd([Arg(1.0), Arg(1.0), 2]) == (3.0,)
    assert [(c[0], c[1]) for c in tree.calls] == [(gb, (1.0, 1.0, 2))]
    tree.owner_thread = threading.get_ident()  # the same thread: the ordinary call
    assert bwd([Arg(1.0), Arg(1.0), 2]) == (3.0,) and len(tree.calls) == 1


def test_the_inputs_a_compiled_graph_writes_are_declared_to_its_partitions():
    """``mutated_input_idxs`` of the graph, through each partition's ``input_index_mapping``
    (``None``: an input made by an earlier piece), become the graphed partitions' ``mutates``;
    a partition left out (not in ``made``) and one writing nothing are left alone."""
    from types import SimpleNamespace

    maps = [SimpleNamespace(input_index_mapping=[0, 2, None]), SimpleNamespace(input_index_mapping=[None, 1, 3]),
            SimpleNamespace(input_index_mapping=[4])]
    compiled = SimpleNamespace(partition_maps=maps, mutated_input_idxs={1, 2})
    made = {i: SimpleNamespace(mutates=(), writes_inputs=False) for i in (0, 1, 2)}
    tcomp.declare_mutations(compiled, made)
    assert [(made[i].mutates, made[i].writes_inputs) for i in (0, 1, 2)] == [((1,), True), ((1,), True), ((), False)]
    assert tcomp.graph_positions([None, 5, 5], {5}) == (1, 2)
    tcomp.declare_mutations(SimpleNamespace(partition_maps=None, mutated_input_idxs={0}), made)  # no partitions
    tcomp.declare_mutations(SimpleNamespace(), {})


def test_the_static_inputs_of_a_compiled_graph_are_declared_to_its_partitions():
    """``static_input_idxs`` of a forward or inference graph (parameters, module buffers, tensors
    marked static), through each partition's ``input_index_mapping``, become the graphed partitions'
    ``static_positions``; nothing is declared without partitions or static inputs."""
    from types import SimpleNamespace

    maps = [SimpleNamespace(input_index_mapping=[0, 2, None]), SimpleNamespace(input_index_mapping=[None, 1, 3])]
    made = {i: SimpleNamespace(static_positions=()) for i in (0, 1)}
    tcomp.declare_static(SimpleNamespace(partition_maps=maps), made, [0, 3])
    assert [made[i].static_positions for i in (0, 1)] == [(0,), (2,)]
    fresh = {0: SimpleNamespace(static_positions=())}
    tcomp.declare_static(SimpleNamespace(partition_maps=maps), fresh, ())
    tcomp.declare_static(SimpleNamespace(partition_maps=None), fresh, [0])
    assert fresh[0].static_positions == ()


def test_a_declared_static_input_in_the_trees_pool_becomes_an_eager_input():
    """A declared static input whose memory is the tree's pool (a buffer assigned a compiled piece's
    output, kept past its generation) is an eager input from then on, at this call and the next
    (the checkpoint restore before a recording may free its block; eager inputs there are copied
    out first). Declared ones outside the pool, and tree outputs, stay as they are; one the
    function writes in place is refused, with the reason."""
    from types import SimpleNamespace

    from cgraw.trees.arrays import EAGER, STATIC, TREE
    from cgraw.trees.input_plan import demote_in_pool

    spans = [(0, 1), (1, 1), (2, 1), (3, 1)]
    fn = SimpleNamespace(static_positions=(0, 1, 3), mutates=(0, 2))
    call = SimpleNamespace(kinds=[STATIC, STATIC, EAGER, TREE], ptrs=[0x100, 0x9000, 0x200, 0x9100], arg_spans=spans)
    in_pool = lambda p: p >= 0x9000  # noqa: E731 -- the pool's segments start at 0x9000
    assert demote_in_pool(fn, call, in_pool) is None
    assert call.kinds == [STATIC, EAGER, EAGER, TREE]
    assert fn.static_positions == (0, 3)
    assert demote_in_pool(fn, call, in_pool) is None  # nothing left to demote
    assert call.kinds == [STATIC, EAGER, EAGER, TREE] and fn.static_positions == (0, 3)
    assert demote_in_pool(SimpleNamespace(), call, in_pool) is None  # a function declaring nothing
    # one the function writes in place: nothing is demoted, and the reason it cannot be recorded
    # (its copy out of the pool would take the write, not the caller's buffer) is given
    fn = SimpleNamespace(static_positions=(0, 1), mutates=(1,))
    call = SimpleNamespace(kinds=[STATIC, STATIC], ptrs=[0x9200, 0x9000], arg_spans=spans[:2])
    why = demote_in_pool(fn, call, in_pool)
    assert "static input(s) [1] of the compiled graph, which it writes in place" in why
    assert call.kinds == [STATIC, STATIC] and fn.static_positions == (0, 1)


def test_graph_body_is_named_for_the_report():
    body = tcomp.graph_body(lambda args: tuple(args), "m [0/0] backward/partition 0 of 1")
    assert body.__qualname__ == "m [0/0] backward/partition 0 of 1"
    assert body(1, 2) == (1, 2)
    assert graphed_mod._name_of(body) == "m [0/0] backward/partition 0 of 1"


# ---------------------------------------------------------------- with torch's CPU build


def test_hook_installed_only_inside_and_previous_put_back():
    pytest.importorskip("torch")
    from cgraw.interop.torch import private_api

    slot = private_api.partition_wrapper_slot()
    assert slot is not None

    def theirs(fn, meta):
        return fn

    setter = private_api.private("torch._inductor.utils.set_customized_partition_wrappers")
    setter(theirs)
    try:
        mine = tcomp.Wrapping("x", _runtime([], []), cb.Options().select)
        with tcomp.installed(mine):
            assert slot.wrapper is mine
            with tcomp.installed(mine):
                assert slot.wrapper is mine
            assert slot.wrapper is mine
        assert slot.wrapper is theirs
        with pytest.raises(KeyError), tcomp.installed(mine):
            raise KeyError("body")
        assert slot.wrapper is theirs
    finally:
        setter(None)


def test_config_patches_keep_graphs_cgraws():
    pytest.importorskip("torch")
    import torch._inductor.config as cfg

    p = tcomp.config_patches({"max_autotune": False, "triton.cudagraphs": True}, "reduce-overhead")
    assert p["triton.cudagraphs"] is False and p["graph_partition"] is True and p["max_autotune"] is False
    if hasattr(cfg, "custom_should_partition_ops"):
        assert p["custom_should_partition_ops"][-1] == tcomp.CACHE_MARKER
        assert cfg.custom_should_partition_ops == []  # the process's config is untouched
    else:
        assert p["fx_graph_cache"] is False


def _mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_compile_runs_inductor_with_the_wrapper_installed(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch._inductor.scheduler import Scheduler

    from cgraw.interop.torch import private_api

    slot = private_api.partition_wrapper_slot()
    real = Scheduler.codegen
    during = []  # the wrapper installed while Inductor generates each graph's code

    def spy(self):
        during.append(slot.wrapper)
        return real(self)

    monkeypatch.setattr(Scheduler, "codegen", spy)
    with torch._inductor.config.patch(force_disable_caches=True):  # a cache hit generates nothing
        _compile_with_and_without(torch, during, slot)


def _compile_with_and_without(torch, during, slot):
    torch._dynamo.reset()
    m = _mlp()
    c = torch.compile(m, backend="cgraw", options={"name": "mlp"})
    x = torch.randn(3, 8)
    torch.testing.assert_close(c(x), m(x))
    assert during and all(isinstance(w, tcomp.Wrapping) and w.label.startswith("mlp [") for w in during)
    assert slot.wrapper is None  # put back once the compile ended
    notes = graphed_mod.without_graphs()
    assert any(k.startswith("mlp [") and "no partition" in v for k, v in notes.items()), notes
    # a default compile afterwards runs without the hook
    during.clear()
    torch._dynamo.reset()
    c2 = torch.compile(m)
    torch.testing.assert_close(c2(x), m(x))
    assert during and all(w is None for w in during)
    torch._dynamo.reset()


def test_unsupported_torch_falls_back_to_inductor_with_the_reason(monkeypatch):
    torch = pytest.importorskip("torch")
    from cgraw.interop.torch import private_api

    def missing():
        raise private_api.TorchApiError("cgraw needs torch._inductor.utils.set_customized_partition_wrappers")

    monkeypatch.setattr(tcomp, "check", missing)
    torch._dynamo.reset()
    m = _mlp()
    x = torch.randn(3, 8)
    c = torch.compile(m, backend="cgraw", options={"name": "old"})
    torch.testing.assert_close(c(x), m(x))
    notes = graphed_mod.without_graphs()
    key = next(k for k in notes if k.startswith("old ["))
    assert notes[key].startswith("compiled by Inductor without graphs: TorchApiError: cgraw needs")
    torch._dynamo.reset()
    c = torch.compile(m, backend="cgraw", options={"fallback": "raise"})
    with pytest.raises(Exception, match="set_customized_partition_wrappers"):
        c(x)
    torch._dynamo.reset()


def test_a_forward_while_an_earlier_backward_is_pending_runs_as_compiled():
    """Gradient accumulation: forward, forward, backward. The second forward of a training graph
    would begin a new generation and reuse the memory of the first one's saved activations, so it
    runs the partitions as Inductor compiled them (with the reason in the report) until a backward
    runs; the next forward is graphed again. The reason is noted under the name the report lists the
    piece by."""
    made, notes, seen = [], [], []
    home = tcomp.Home()
    rt = _runtime(made, notes)
    in_backward = [False]

    def forward_part(i):
        fn = _partition(seen)
        # a second compile under the same name: the report lists its pieces as "...#2"
        gf = FakeGraphed(tcomp.graph_body(fn, f"t [0/0] forward/partition {i} of 2#2"))
        return fn, gf, tcomp.adapt(fn, gf, home, rt, lambda: in_backward[0], phase="forward", index=i)

    (_, g0, p0), (_, g1, p1) = forward_part(0), forward_part(1)
    gb = FakeGraphed(tcomp.graph_body(_partition(seen), "b"))
    pb = tcomp.adapt(_partition(seen), gb, home, rt, lambda: in_backward[0], phase="backward", index=0)

    def forward():
        return p1([p0([1.0, 2.0, 1])[0], 1.0, 1])

    def backward():
        in_backward[0] = True
        try:
            return pb([1.0, 1.0, 1])
        finally:
            in_backward[0] = False

    assert forward() == (4.0,) and (len(g0.calls), len(g1.calls)) == (1, 1)  # graphed
    assert forward() == (4.0,) and (len(g0.calls), len(g1.calls)) == (1, 1)  # the first's backward waits
    assert [n for n, _ in notes] == ["t [0/0] forward/partition 0 of 2#2", "t [0/0] forward/partition 1 of 2#2"]
    assert all(why == tcomp.PENDING for _, why in notes)
    backward()
    backward()
    assert len(gb.calls) == 2  # backwards are graphed either way
    assert forward() == (4.0,) and (len(g0.calls), len(g1.calls)) == (2, 2)  # graphed again
    backward()
    assert forward() == (4.0,) and (len(g0.calls), len(g1.calls)) == (3, 3)  # one backward per forward


def test_a_training_forward_holds_its_trees_step_open_until_its_backward_runs():
    """The backward of a training graph reads its forward pieces' outputs (AOT autograd's saved
    activations): from the forward's first call no other root call may begin a generation, which
    would invalidate them, until that backward has run. An inference graph holds nothing."""
    made, notes, seen = [], [], []
    tree = FakeTree(owner=threading.get_ident())
    home, other = tcomp.Home(), tcomp.Home()
    rt = _runtime(made, notes, tree)
    in_backward = [False]
    fwd = tcomp.adapt(_partition(seen), FakeGraphed(tcomp.graph_body(_partition(seen), "f")), home, rt,
                      lambda: in_backward[0], phase="forward")
    bwd = tcomp.adapt(_partition(seen), FakeGraphed(tcomp.graph_body(_partition(seen), "b")), home, rt,
                      lambda: in_backward[0], phase="backward")
    inf = tcomp.adapt(_partition(seen), FakeGraphed(tcomp.graph_body(_partition(seen), "i")), other, rt,
                      lambda: False, phase="inference")
    assert inf([Arg(1.0), Arg(2.0), 1]) == (3.0,) and tree.held == set()
    assert fwd([Arg(1.0), Arg(2.0), 1]) == (3.0,) and tree.held == {home}  # the very first forward holds
    assert inf([Arg(1.0), Arg(2.0), 1]) == (3.0,) and tree.held == {home}
    in_backward[0] = True
    bwd([Arg(1.0), Arg(1.0), 2])
    in_backward[0] = False
    assert tree.held == set()


def test_a_root_call_while_a_step_is_held_extends_the_path_and_begins_one_once_released(monkeypatch):
    """``TreeManager.hold_step``: while held, a call of a root function deepens the path (its node
    a child of the one under way) instead of beginning a generation; one backward releases every
    hold and the call begins one again; ``mark_step_begin()`` begins one anyway and drops the hold."""
    torch = pytest.importorskip("torch")
    from torch_cpu_backend import TorchFn, cpu_tree

    owner, other = object(), object()
    with cpu_tree(monkeypatch) as tree:
        f = TorchFn(lambda x: x * 2, tree, name="f")
        x = torch.randn(4)
        f(x)
        y = f(x)  # alive, as a forward's saved activations are
        gen = tree.generation
        tree.hold_step(owner)
        z = f(x)
        assert tree.generation == gen and tree.current.parent is not None  # a child: the path deepened
        torch.testing.assert_close(y, x * 2)
        torch.testing.assert_close(z, x * 2)
        tree.hold_step(other)  # a second forward whose backward never runs
        tree.release_step(owner)  # one backward ends every hold, as torch's trees wait for one
        assert tree.book.held == set()
        f(x)
        assert tree.generation == gen + 1 and tree.current.parent is None
        tree.hold_step(owner)
        tree.mark_step_begin()
        assert tree.book.held == set() and tree.generation == gen + 2
        f(x)
        f(x)  # nothing holds the step now: a root call begins a generation again
        assert tree.generation == gen + 3 and tree.current.parent is None


def test_inference_graphs_never_wait_for_a_backward():
    made, notes, seen = [], [], []
    home = tcomp.Home()
    gf = FakeGraphed(tcomp.graph_body(_partition(seen), "i"))
    p = tcomp.adapt(_partition(seen), gf, home, _runtime(made, notes), lambda: False, phase="inference", index=0)
    for _ in range(3):
        assert p([1.0, 2.0, 1]) == (3.0,)
    assert len(gf.calls) == 3 and notes == []


# ---------------------------------------------------------------- the partition path on the CPU


@pytest.fixture
def inductor(monkeypatch):
    pytest.importorskip("torch")
    from compile_cpu import cpu_partitions

    with cpu_partitions(monkeypatch) as h:
        yield h


def _assert_replayed(parts: dict, calls: int):
    assert parts, "no partition ran as a graphed function"
    for name, s in parts.items():
        assert s.eager_calls == 0 and not s.skip_reasons, (name, s.skip_reasons)
        assert s.recordings == 1 and s.replays == calls - 2, (name, s)


def _mlp_calls_equal_eager(inductor, name: str, **options) -> None:
    """Six calls of ``_mlp()`` compiled with the backend (``name``, ``options``) on fresh inputs,
    each equal to eager's."""
    import torch

    m = _mlp()
    c = inductor.compile(m, name=name, **options)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(3, 8)
            torch.testing.assert_close(c(x), m(x))


def test_cpu_partitions_replay_and_equal_eager(inductor):

    _mlp_calls_equal_eager(inductor, "mlp")
    parts = inductor.partitions("mlp [")
    assert list(parts) == ["mlp [0/0] inference/partition 0 of 1"]
    _assert_replayed(parts, 6)
    assert "mlp [0/0] inference/partition 0 of 1: 1 recording(s)" in graphed_mod.report()
    assert not any(k.startswith("mlp [") for k in graphed_mod.without_graphs())


def _fake_graph(fn, *shapes, device="cuda"):
    """``fn`` traced into an ATen FX graph over fake tensors of ``device`` (no GPU needed), as
    Inductor gets it; a shape environment gives data-dependent sizes and values symbols."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        args = [torch.empty(s, device=device) for s in shapes]
    return make_fx(fn, tracing_mode="fake")(*args)


@pytest.mark.parametrize("case, match", [
    ("cuda", None),
    ("attention", None),  # a multi-output op, its outputs taken with getitem
    ("cpu", "CPU tensors"),
    ("nonzero", "depends on data"),
    ("item", "depends on data"),
    ("unsafe", "cudagraph_unsafe"),
    ("two_devices", "2 devices"),
    ("dynamic", "dynamic .*size"),
])
def test_what_may_run_outside_inductors_partitions_is_named(case, match):
    """An inference graph is one graphed function as a whole only where none of its ops can run
    outside Inductor's partitions: CPU tensors, another device, a size or value that depends on
    data, an op tagged ``cudagraph_unsafe``, dynamic input sizes each say why not."""
    torch = pytest.importorskip("torch")

    def cuda(x, w):
        return torch.nn.functional.gelu(x @ w).softmax(-1)

    fns = {
        "cuda": cuda,
        "attention": lambda x, w: torch.ops.aten._scaled_dot_product_flash_attention(
            *(cuda(x, w).half().view(1, 1, 4, 8),) * 3)[0].float() * 2,
        "cpu": lambda x, w: cuda(x, w).cpu() * 2,
        "nonzero": lambda x, w: torch.nonzero(cuda(x, w) > 0.1),
        "item": lambda x, w: cuda(x, w) * cuda(x, w).sum().item(),
        "unsafe": lambda x, w: torch.ops.cgrawtest_cpu.host_step(cuda(x, w)),
        "two_devices": lambda x, w: cuda(x, w).to("cuda:1"),
    }
    if case == "unsafe" and not hasattr(torch.ops.cgrawtest_cpu, "host_step"):
        lib = torch.library.Library("cgrawtest_cpu", "FRAGMENT")
        lib.define("host_step(Tensor x) -> Tensor", tags=(torch._C.Tag.cudagraph_unsafe,))
        lib.impl("host_step", lambda x: x.clone(), "Meta")
        _LIBS.append(lib)
    # fake CUDA tensors have no nonzero without a GPU: that graph is traced on the CPU, and the size
    # that depends on data is named before the device is looked at
    if case == "dynamic":  # symbolic sizes (traced on the CPU: the sizes are named before the device)
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = make_fx(cuda, tracing_mode="symbolic")(torch.randn(4, 8), torch.randn(8, 8))
    else:
        gm = _fake_graph(fns[case], (4, 8), (8, 8), device="cpu" if case == "nonzero" else "cuda")
    why = wg.outside_partitions(gm)
    if match is None:
        assert why is None
    else:
        assert why is not None and re.search(match, why), why


_LIBS: list = []  # the custom op's library lives as long as the process


def _one_partition_wrapping(made=None, notes=None):
    """A ``Wrapping`` that saw one inference graph of two inputs and graphed its one partition."""
    w = tcomp.Wrapping("m [0/0]", _runtime([] if made is None else made, [] if notes is None else notes),
                       cb.Options.parse(None).select)
    w.phases, w.outside, w.seen, w.wrapped = {"inference"}, None, 1, ["m [0/0] inference/partition 0 of 1"]
    w.inner_inputs = 2
    return w


def test_only_an_inference_graph_of_one_partition_with_nothing_outside_it_is_graphed_whole():
    w, two = _one_partition_wrapping(), (object(), 3)
    marker = {"custom_should_partition_ops": [tcomp.CACHE_MARKER]}  # the backend's own: cuts nothing
    assert wg.reason(w, marker, two) is None and wg.reason(w, {}, two) is None
    w.outside = "it holds CPU tensors (Inductor runs their ops outside its partitions)"
    assert wg.reason(w, marker, two) == w.outside
    w.outside, w.seen, w.wrapped = None, 2, w.wrapped + ["m [0/0] inference/partition 1 of 2"]
    assert "2 partition(s)" in wg.reason(w, marker, two)
    w.seen, w.wrapped, w.phases = 1, w.wrapped[:1], {"forward", "backward"}
    assert "not as one inference graph" in wg.reason(w, marker, two)
    w.phases = {"inference"}
    w.outside = "not looked at"  # a compile whose graph was never read is not graphed whole
    assert wg.reason(w, marker, two) == "not looked at"
    w.outside = None  # AOT autograd merged two aliased inputs into one base: its wrapper runs each call
    assert "passes its graph 2 inputs for the 3" in wg.reason(w, marker, (*two, object()))


def test_a_tensor_subclass_input_keeps_a_graph_from_being_graphed_whole():
    torch = pytest.importorskip("torch")

    class Tagged(torch.Tensor):
        pass

    w = _one_partition_wrapping()
    x = torch.randn(3)
    assert wg.reason(w, {}, (x, torch.nn.Parameter(x))) is None
    why = wg.reason(w, {}, (x, x.as_subclass(Tagged)))
    assert why is not None and "Tagged" in why and "subclass" in why


def test_a_registered_op_that_inductor_cuts_at_keeps_a_graph_from_being_graphed_whole():
    pytest.importorskip("torch")
    w, two = _one_partition_wrapping(), (object(), 3)
    markers = [tcomp.CACHE_MARKER, "cgraw::cpu_partitions_2"]  # name no op: they only key caches apart
    assert wg.reason(w, {"custom_should_partition_ops": markers}, two) is None
    why = wg.reason(w, {"custom_should_partition_ops": ["aten::nonzero", *markers]}, two)
    assert why is not None and "aten::nonzero" in why and "cpu_partitions" not in why


def test_a_graph_graphed_whole_is_named_and_reads_dynamos_static_inputs_in_place():
    torch = pytest.importorskip("torch")
    made, notes = [], []
    rt = _runtime(made, notes)
    buf, x = torch.randn(3), torch.randn(3)
    buf._dynamo_static_input_type = "unguarded"
    whole = wg.graphed_whole(lambda *a: [a[0] + a[1]], [x, buf], rt, "m [0/0] inference/whole graph")
    gf = whole.cgraw_graphed
    assert made == [gf] and gf.inputs_guarded and gf.static_positions == (1,)
    assert gf.fn.__qualname__ == whole.__qualname__ == "m [0/0] inference/whole graph"
    torch.testing.assert_close(whole(x, buf)[0], x + buf)
    assert gf.calls == [(x, buf)]


def test_a_graph_graphed_whole_is_called_with_grad_disabled_and_grad_mode_is_put_back():
    """dynamo calls an inference graph with its caller's grad mode, and the graph never makes an
    output that requires grad: the graphed function is called with grad disabled (no gradient
    entry in its key, no autograd bookkeeping in its recording), and the caller's grad mode is as
    it was afterwards, also when the call raises."""
    torch = pytest.importorskip("torch")
    modes = []

    def body(x, fail=False):
        modes.append(torch.is_grad_enabled())
        if fail:
            raise RuntimeError("the compiled graph failed")
        return [x * 2]

    whole = wg.graphed_whole(body, [torch.randn(3)], _runtime([], []), "m [0/0] inference/whole graph")
    p = torch.nn.Parameter(torch.randn(3))
    assert torch.is_grad_enabled()
    out = whole(p)
    assert not out[0].requires_grad and torch.is_grad_enabled()
    with torch.no_grad():
        whole(p)
        assert not torch.is_grad_enabled()
    with pytest.raises(RuntimeError, match="compiled graph failed"):
        whole(p, True)
    assert torch.is_grad_enabled() and modes == [False, False, False]


def test_whole_graph_on_the_cpu_falls_back_to_partitions_that_replay_and_equal_eager(inductor):
    """On the CPU the graph's tensors are not CUDA tensors: ``whole_graph`` leaves it to the
    partitions, which replay as without the option."""

    _mlp_calls_equal_eager(inductor, "mlp_whole", whole_graph=True)
    parts = inductor.partitions("mlp_whole [")
    assert list(parts) == ["mlp_whole [0/0] inference/partition 0 of 1"]
    _assert_replayed(parts, 6)
    assert "whole graph" not in graphed_mod.report()


def test_a_graph_graphed_whole_replays_and_equals_eager(inductor, monkeypatch):
    """The CPU's tensors standing for one GPU's (``outside_partitions`` finds nothing outside the
    partition), ``whole_graph`` makes the compiled graph one graphed function: it warms up, records
    and replays, and its results equal eager's. (On the CPU a replay runs the function's Python
    again, which calls its partition as a graphed function of its own; on a GPU a replay is one
    launch, and the partition runs only inline in the whole graph's warm-up and recording.)"""

    monkeypatch.setattr(wg, "outside_partitions", lambda gm: None)
    _mlp_calls_equal_eager(inductor, "whole_cpu", whole_graph=True)
    whole = _whole(inductor, "whole_cpu [")
    assert list(whole) == ["whole_cpu [0/0] inference/whole graph"]
    _assert_replayed(whole, 6)
    assert "whole_cpu [0/0] inference/whole graph: 1 recording(s)" in graphed_mod.report()


def test_a_whole_graph_whose_recording_fails_runs_as_compiled_and_its_partition_is_graphed(inductor, monkeypatch):
    """Where the whole graph's recording fails, the graph runs as Inductor compiled it, with the
    reason in its statistics, and the partition it calls is a graphed function of its own that
    records and replays; every result equals eager's."""
    import compile_cpu

    from cgraw.errors import SkipCall

    monkeypatch.setattr(wg, "outside_partitions", lambda gm: None)
    real = compile_cpu.CompileCpuBackend.record

    def record(self, fn, call, warm):
        if fn.name.endswith("/whole graph"):
            raise SkipCall("the capture failed (the test's stand-in)")
        return real(self, fn, call, warm)

    monkeypatch.setattr(compile_cpu.CompileCpuBackend, "record", record)
    _mlp_calls_equal_eager(inductor, "whole_fails", whole_graph=True)
    (whole,) = _whole(inductor, "whole_fails [").values()
    assert whole.recordings == 0 and whole.eager_calls == 5, whole
    assert "the capture failed (the test's stand-in)" in whole.skip_reasons
    parts = inductor.partitions("whole_fails [")
    assert list(parts) == ["whole_fails [0/0] inference/partition 0 of 1"]
    _assert_replayed(parts, 5)  # its first call is the whole graph's warm-up, inline


def _whole(inductor, prefix: str) -> dict:
    return {s.name: s for s in inductor.tree.stats.values() if s.name.startswith(prefix) and s.name.endswith("/whole graph")}


@pytest.mark.parametrize("case", ["resized_input", "offset_input_written", "aliased_inputs_written"])
def test_a_graph_is_graphed_whole_only_where_aot_autograds_wrapper_has_nothing_to_redo(inductor, monkeypatch,
                                                                                       case, caplog):
    """An input resized in place (``x.unsqueeze_(0)``) is resized by dynamo's own code around the
    graph, so the graph is graphed whole and the caller's tensor ends as eager leaves it; so is an
    input written in place, a view at an offset of its storage one call in two. A graph
    writing one of two inputs that share memory takes them merged into one base, which AOT
    autograd's wrapper makes at every call: it is graphed by partitions, the reason logged. The
    results equal eager's both ways."""
    import logging

    import torch

    monkeypatch.setattr(wg, "outside_partitions", lambda gm: None)

    def resized_input(x, y):
        x.unsqueeze_(0)
        return (x * 2 + y).relu()

    def offset_input_written(x, y):
        x.mul_(2.0)
        return x + y

    def aliased_inputs_written(x, y):
        x.add_(1.0)
        return (y * 2).relu()

    fn = {"resized_input": resized_input, "offset_input_written": offset_input_written,
          "aliased_inputs_written": aliased_inputs_written}[case]
    c = inductor.compile(fn, name=f"aot_{case}", whole_graph=True)
    with caplog.at_level(logging.INFO, logger="cgraw"):
        for i in range(5):
            base = torch.randn(2, 8)
            if case == "resized_input":
                args, ref = (base[0].clone(), base[1].clone()), (base[0].clone(), base[1].clone())
            elif case == "offset_input_written":
                flat = torch.randn(17)
                x = flat[1:] if i % 2 else flat[:16]
                args, ref = (x, base.reshape(16)), (x.clone(), base.reshape(16).clone())
            else:
                b2 = base.clone()
                args, ref = (base, base[1]), (b2, b2[1])
            out, want = c(*args), fn(*ref)
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(args[0], ref[0])
            assert args[0].shape == ref[0].shape
    whole = _whole(inductor, f"aot_{case} [")
    if case != "aliased_inputs_written":
        assert len(whole) == 1 and all(s.replays >= 3 for s in whole.values()), inductor.tree.stats
    else:
        assert not whole, inductor.tree.stats
        assert any("passes its graph" in r.getMessage() and "not as a whole" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_aot_autograds_work_around_a_graph_is_read_from_its_metadata():
    """``private_api.aot_runtime_work`` names what AOT autograd's wrapper would redo in Python around
    the graph it compiles (read from the tracing context's ``fw_metadata``): an input's sizes,
    strides or storage changed, ops with side effects; None for a graph with none of it, and a
    reason when there is no metadata to read."""
    pytest.importorskip("torch")
    from types import SimpleNamespace as NS

    from torch._guards import TracingContext, tracing

    from cgraw.interop.torch import private_api

    def meta(*infos, tokens=None):
        return NS(input_info=[NS(mutates_metadata=m, mutates_storage_metadata=st) for m, st in infos],
                  tokens=tokens or {}, is_rng_op_functionalized=False)

    cases = [(meta((False, False), (False, False)), None),
             (meta((False, False), (True, False)), "graph input(s) [1]"),
             (meta((True, True)), "graph input(s) [0]"),
             (meta((False, False), tokens={0: object()}), "side effects")]
    for m, expect in cases:
        ctx = TracingContext(None)
        ctx.fw_metadata = m
        with tracing(ctx):
            why = private_api.aot_runtime_work()
        assert (why is None) if expect is None else (why is not None and expect in why), (m, why)
    with tracing(None):
        assert "could not be read" in private_api.aot_runtime_work()


def test_cpu_training_step_graphs_forward_and_backward(inductor):
    import torch

    m, ref = _mlp(), _mlp()
    c = inductor.compile(m, name="train")
    opt, ref_opt = (torch.optim.SGD(p.parameters(), lr=0.05, momentum=0.9) for p in (m, ref))
    for _ in range(6):
        x, y = torch.randn(3, 8), torch.randn(3, 4)
        for o, run in ((opt, c), (ref_opt, ref)):
            o.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(run(x), y).backward()
            o.step()
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q)
    parts = inductor.partitions("train [")
    assert sorted(parts) == ["train [0/0] backward/partition 0 of 1", "train [0/0] forward/partition 0 of 1"]
    _assert_replayed(parts, 6)


def test_a_teacher_called_between_a_students_forward_and_backward_runs_in_the_same_step(inductor):
    """Distillation: the student's compiled training forward, the teacher's compiled inference under
    ``torch.no_grad()`` (evaluated alone before, so it begins steps of its own), then the student's
    backward. The teacher's call there must not begin a step, which would invalidate the outputs of
    the student's forward piece that AOT autograd's backward reads as saved activations (on the CPU
    nothing is poisoned, so the step count shows it): it runs one node deeper in the path, and the
    gradients equal eager's."""
    import torch

    student, ref, teacher = _mlp(), _mlp(), _mlp()
    cs = inductor.compile(student, name="student")
    ct = inductor.compile(teacher, name="teacher")
    with torch.no_grad():
        for _ in range(3):  # the teacher evaluated alone first: a root function of the tree
            ct(torch.randn(3, 8))
    began = []
    for _ in range(5):
        x = torch.randn(3, 8)
        out = cs(x)
        gen = inductor.tree.generation
        with torch.no_grad():
            t = ct(x)
        began.append(inductor.tree.generation != gen)
        torch.nn.functional.mse_loss(out, t).backward()
        torch.nn.functional.mse_loss(ref(x), teacher(x).detach()).backward()
        for p, q in zip(student.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None
    assert began == [False] * 5, began
    parts = inductor.partitions("teacher [")
    assert parts and all(s.eager_calls == 0 and s.replays >= 1 for s in parts.values()), parts


def _cnn():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_backward_reads_saved_activations_with_the_strides_the_forward_gave_them(inductor, layout):
    """Inductor lays a convolution's output out ``channels_last`` on the CPU (and on the GPU for
    training), where eager's is contiguous. Once a partition wrapper is installed its
    ``post_compile`` returns before it reports the forward's output strides to AOT autograd, so the
    backward was compiled for eager's strides of the saved activations and its stride assertion
    failed at the first backward (the ResNet-18 training step); the backend reports them itself."""
    import torch

    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    m, ref = _cnn().to(memory_format=fmt), _cnn().to(memory_format=fmt)
    opt, ref_opt = (torch.optim.SGD(p.parameters(), lr=0.05) for p in (m, ref))
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached backward would hide the compile
        c = inductor.compile(m, name="cnn")
        for _ in range(4):
            x, y = torch.randn(4, 3, 8, 8).to(memory_format=fmt), torch.randn(4, 4)
            for o, run in ((opt, c), (ref_opt, ref)):
                o.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(run(x), y).backward()
                o.step()
            for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    parts = inductor.partitions("cnn [")
    assert any(" backward/partition" in n for n in parts), parts
    _assert_replayed(parts, 4)


def test_module_buffers_written_by_a_training_forward_are_read_in_place_and_match_eager(inductor):
    """A BatchNorm's running statistics and batch count are graph inputs that the forward writes;
    dynamo gives them to Inductor as static inputs (as it does the parameters), and the backend
    declares them so to the forward's partition: its calls read them in place, as torch's trees
    do, where they were eager inputs copied in and back on every call. After each step every
    buffer and parameter equals eager's."""
    import torch

    from cgraw.trees.arrays import EAGER, STATIC

    m, ref = _cnn(), _cnn()
    opt, ref_opt = (torch.optim.SGD(p.parameters(), lr=0.05) for p in (m, ref))
    c = inductor.compile(m, name="bn")
    for _ in range(4):
        x, y = torch.randn(4, 3, 8, 8), torch.randn(4, 4)
        for o, run in ((opt, c), (ref_opt, ref)):
            o.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(run(x), y).backward()
            o.step()
        for (name, b), r in zip(m.named_buffers(), ref.buffers(), strict=True):
            torch.testing.assert_close(b, r, rtol=1e-4, atol=1e-5, msg=name)
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    _assert_replayed(inductor.partitions("bn ["), 4)
    (fwd,) = [n for n in inductor.tree.roots.values() if "forward" in n.fn.name]
    n_state = len(list(m.parameters())) + len(list(m.buffers()))
    assert fwd.plan.kinds.count(STATIC) == n_state and fwd.plan.kinds.count(EAGER) == 1, fwd.plan.kinds
    assert fwd.mutated == ()  # the buffers it writes are read in place: nothing to copy back


def test_gradient_accumulation_from_a_warm_cache_equals_eager(inductor):
    """A second compile of the same training graph (another process, or after ``torch._dynamo.reset()``)
    was served by AOT autograd's cache, whose hit applies the partition wrapper without saying
    which graph is the forward: the second micro-batch's forward was graphed, began a generation
    and overwrote the first one's saved activations (gradients off by 0.5 here), and the pieces
    were named without their phase. The backend's compiles run with that cache off."""
    import torch

    for attempt in range(2):  # the second compile finds the first one's cache entries
        torch._dynamo.reset()
        m, ref = _mlp(), _mlp()
        c = inductor.compile(m, name=f"accum{attempt}")
        for _ in range(3):
            xs, ys = [torch.randn(3, 8) for _ in range(2)], [torch.randn(3, 4) for _ in range(2)]
            grads = []
            for run, model in ((c, m), (ref, ref)):
                model.zero_grad(set_to_none=True)
                sum(torch.nn.functional.mse_loss(run(x), y) for x, y in zip(xs, ys)).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for g, r in zip(*grads, strict=True):
                torch.testing.assert_close(g, r)
        parts = inductor.partitions(f"accum{attempt} [")
        assert sorted(parts) == [f"accum{attempt} [0/0] backward/partition 0 of 1",
                                 f"accum{attempt} [0/0] forward/partition 0 of 1"], parts
        assert parts[f"accum{attempt} [0/0] backward/partition 0 of 1"].replays >= 1


class _Decoder:
    """A decode step in the style of Llama with a static key-value cache: the new key and value are
    written into preallocated buffers at the position given as a tensor, attention reads the
    cache up to it, and the next token is the argmax."""

    def __new__(cls, d=16, max_len=16, vocab=32):
        import torch

        class Decoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.emb = torch.nn.Embedding(vocab, d)
                self.qkv = torch.nn.Linear(d, 3 * d)
                self.out = torch.nn.Linear(d, vocab)
                self.register_buffer("k_cache", torch.zeros(1, max_len, d))
                self.register_buffer("v_cache", torch.zeros(1, max_len, d))

            def forward(self, tok, pos):
                q, k, v = self.qkv(self.emb(tok)).chunk(3, dim=-1)
                self.k_cache.index_copy_(1, pos, k)
                self.v_cache[:, pos] = v
                att = (q @ self.k_cache.transpose(1, 2)) / d ** 0.5
                att = att.masked_fill(torch.arange(max_len) > pos, float("-inf")).softmax(-1)
                return self.out(att @ self.v_cache).argmax(-1)

        return Decoder()


def test_a_decode_loop_fed_its_own_token_replays_every_step(inductor):
    """``tok = step(tok, pos)`` with the step writing its key-value cache in place: the token is
    an output of the ending generation, the written inputs are the caches. Each step after the
    recording replays (it ran eagerly every other step: a call fed its previous output was taken
    for ``h = f(h)`` whatever input it wrote), and every token equals eager's."""
    import torch

    m, ref = _Decoder(), _Decoder()
    c = inductor.compile(m, name="decode")
    steps = 12
    with torch.no_grad():
        tok = torch.tensor([[3]])
        for i in range(steps):
            pos = torch.tensor([i])
            want = ref(tok, pos)  # eager on the same token
            tok = c(tok, pos)  # fed its own previous output
            assert torch.equal(tok, want), i
        torch.testing.assert_close(m.k_cache, ref.k_cache)
        torch.testing.assert_close(m.v_cache, ref.v_cache)
    parts = inductor.partitions("decode [")
    assert len(parts) == 1, parts
    _assert_replayed(parts, steps)


def test_a_model_called_under_inference_mode_replays_its_pieces_and_equals_eager(inductor):
    """``torch.inference_mode()`` around the compiled model's calls, the serving default: its
    piece's two outputs are inference tensors, which the piece cannot hand out again (they have
    no version counter; reading it raised where eager runs). Every call equals eager and the piece
    replays."""
    import torch

    class TwoOutputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h), h

    m = TwoOutputs()
    c = inductor.compile(m, name="served")
    for _ in range(6):
        with torch.inference_mode():
            x = torch.randn(3, 8)
            for got, want in zip(c(x), m(x), strict=True):
                torch.testing.assert_close(got, want)
    assert _replays(inductor, "served [") == 4


def _replays(inductor, prefix: str) -> int:
    return sum(s.replays for s in inductor.partitions(prefix).values())


@pytest.fixture
def no_module_hooks(monkeypatch):
    """As in a process where no tree is made yet: none of cgraw's module registration hooks installed."""
    import collections

    torch = pytest.importorskip("torch")

    from cgraw.interop.torch import observe

    module = torch.nn.modules.module
    for name in ("_global_buffer_registration_hooks", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks"):
        monkeypatch.setattr(module, name, collections.OrderedDict())
    monkeypatch.setattr(observe, "_hooks_installed", [False])


def test_the_llama_decode_step_compiles_once_and_replays(no_module_hooks, inductor, monkeypatch):
    """The benchmark's transformers Llama decode step with a ``StaticCache``, on the CPU: one dynamo
    compile (it was two: the step assigns module attributes, see the test below), its partition
    replays every step after the recording, and the tokens equal eager's."""
    pytest.importorskip("transformers")
    from benchmarks import models

    monkeypatch.setattr(models, "DEVICE", "cpu")
    monkeypatch.setattr(models, "LLAMA_NEW", 8)
    wl = models._build("llama_decode")
    cache = wl.new_cache()
    compiled = inductor.compile(wl.step, name="llama", dynamic=False)

    def call(tok, pos):
        return compiled(tok, pos, cache).clone()

    for _ in range(2):
        tokens = models._decode(call, wl.prefill(cache), wl.positions, collect=True)
        assert tokens == wl.reference_tokens()
    parts = inductor.partitions("llama [")
    assert list(parts) == ["llama [0/0] inference/partition 0 of 1"], parts
    _assert_replayed(parts, 2 * 8)


@pytest.mark.parametrize("workload", ["llama_decode", "gpt2_b1"])
def test_the_benchmarks_transformers_graphs_hold_nothing_outside_their_partition_but_cpu_tensors(
        no_module_hooks, inductor, monkeypatch, workload):
    """``whole_graph``'s reading of a real model's inference graph (transformers Llama with a
    ``StaticCache``, GPT-2; the benchmark's workloads on the CPU): every op is one Inductor puts in
    its partition, and only the device (the CPU's here, a GPU's there) keeps it from being graphed
    whole: with the CPU's tensors standing for one GPU's, it is graphed whole (AOT autograd's
    wrapper has nothing to redo around it) and its results equal eager's."""
    pytest.importorskip("transformers")
    import torch

    from benchmarks import models

    monkeypatch.setattr(models, "DEVICE", "cpu")
    monkeypatch.setattr(models, "LLAMA_NEW", 4)
    read, reasons = wg.outside_partitions, []
    monkeypatch.setattr(wg, "outside_partitions", lambda gm: reasons.append(read(gm)))
    wl = models._build(workload)
    if workload == "llama_decode":
        cache = wl.new_cache()
        c = inductor.compile(wl.step, name=workload, dynamic=False, whole_graph=True)
        tokens = models._decode(lambda t, pos: c(t, pos, cache).clone(), wl.prefill(cache), wl.positions, collect=True)
        assert tokens == wl.reference_tokens()
    else:
        c = inductor.compile(wl.fn, name=workload, dynamic=False, whole_graph=True)
        with torch.no_grad():
            x = wl.inputs()
            torch.testing.assert_close(c(*x), wl.fn(*x))
    assert reasons == ["it holds CPU tensors (Inductor runs their ops outside its partitions)"]
    assert list(_whole(inductor, f"{workload} [")) == [f"{workload} [0/0] inference/whole graph"], inductor.tree.stats


def test_a_compile_that_restarts_dynamos_analysis_before_any_tree_exists_equals_eager(no_module_hooks, inductor):
    """The first compile in a process installs the hooks a tree watches module assignments with
    (``interop.torch.observe``). Inductor's compile can restart dynamo's analysis (here a float
    module attribute that ``layer_norm``'s ``eps`` specializes, under ``dynamic=True``), and the
    restarted trace must meet the hooks the first one met: a ``ModuleList`` sliced in the frame
    runs them through ``add_module``. Installed before Inductor's compile returned, they made dynamo
    raise ``SpeculationLogDivergence`` where eager and Inductor run (transformers' Qwen2 with
    ``dynamic=True`` did)."""
    import torch
    from torch._dynamo.utils import counters

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
            self.eps, self.scale = 1e-5, 0.5

        def forward(self, x):
            for layer in self.layers[:2]:
                x = torch.nn.functional.layer_norm(torch.relu(layer(x)) * self.scale, (8,), eps=self.eps)
            return x

    m = Net()
    counters.clear()
    c = inductor.compile(m, name="restarted", dynamic=True)
    with torch.no_grad():
        for rows in (3, 5, 7, 5, 3, 5, 3):  # each size warms up, records, then replays
            x = torch.randn(rows, 8)
            torch.testing.assert_close(c(x), m(x))
    aot = counters["aot_autograd"]
    assert aot["total"] == aot["ok"] + 1, ("the compile did not restart dynamo's analysis once: the test no longer "
                                           f"checks the restarted trace ({dict(aot)})")
    parts = inductor.partitions("restarted [")
    assert parts and sum(s.replays for s in parts.values()) == 2, parts


def test_a_step_assigning_a_module_buffer_compiles_once_and_replays(no_module_hooks, inductor):
    """dynamo guards the frame on torch.nn.Module's registration hooks when its code assigns a
    module attribute (a buffer here; transformers' Llama decode step too). A tree installs its
    hooks (module assignments, ``interop.torch.observe``) when it is made: at the first
    partition's call, after the guards were built, so the second call recompiled the frame and
    the first compile's partition ran once (Llama decoding: "2 partitions, 1 recorded"). The
    backend installs them before dynamo builds the guards. The buffer is one of the graph's static
    inputs (dynamo marks module buffers so); a new tensor at each call moves it, so after one
    re-record it is an eager input of the partition, which then replays every call."""
    import torch

    m, ref = _assigning_steps(), _assigning_steps()
    calls = 8
    parts = _steps_against_eager(inductor, m, ref, "steps", calls)
    torch.testing.assert_close(m.seen, ref.seen)
    assert list(parts) == ["steps [0/0] inference/partition 0 of 1"], parts  # one compile
    (s,) = parts.values()
    assert s.eager_calls == 0 and not s.skip_reasons, s
    # warm-up, recording, the buffer moved (an eager input from then on): warm-up, recording, replays
    assert (s.warmups, s.recordings, s.rerecords, s.replays) == (2, 2, 1, calls - 4), s
    assert "a static input of the compiled graph" in s.rerecord_reasons[0], s.rerecord_reasons


def _assigning_steps(two: bool = False):
    """A module whose forward assigns a new tensor to its buffer ``seen`` (and with ``two`` to
    ``total`` too), not written in place."""
    import torch

    class Steps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("seen", torch.zeros(()))
            self.register_buffer("total", torch.zeros(8))

        def forward(self, x):
            self.seen = self.seen + 1
            out = self.lin(x) * self.seen
            if two:
                self.total = self.total + x.sum(0)
                out = out + self.total
            return out

    return Steps()


def _steps_against_eager(inductor, m, ref, name: str, calls: int) -> dict:
    """``m`` compiled by the backend as ``name``, called ``calls`` times without grad on fresh
    (2, 8) inputs, each result equal to eager ``ref``'s; the stats of its partitions."""
    import torch

    c = inductor.compile(m, name=name)
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(2, 8)
            torch.testing.assert_close(c(x), ref(x))
    return inductor.partitions(f"{name} [")


def test_a_step_assigning_two_buffers_re_records_once(no_module_hooks, inductor):
    """Two static inputs of the graph (module buffers) that move at the same call become eager
    inputs together: one re-record, then a replay at every call, each equal to eager."""
    import torch

    m, ref = _assigning_steps(two=True), _assigning_steps(two=True)
    calls = 8
    (s,) = _steps_against_eager(inductor, m, ref, "twice", calls).values()
    torch.testing.assert_close(m.total, ref.total)
    assert s.eager_calls == 0 and not s.skip_reasons, s
    assert (s.warmups, s.recordings, s.rerecords, s.replays) == (2, 2, 1, calls - 4), s
    assert "with 1 other(s)" in s.rerecord_reasons[0], s.rerecord_reasons


def _cut_model(kind: str):
    import torch

    if not hasattr(torch.ops.cgrawcpu, "host_scale"):
        @torch.library.custom_op("cgrawcpu::host_scale", mutates_args=(), tags=(torch._C.Tag.cudagraph_unsafe,),
                                 schema="(Tensor x) -> Tensor")
        def host_scale(x):
            return x * 2.0

        @host_scale.register_fake
        def _(x):
            return torch.empty_like(x)

    class CutModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(16, 32)
            self.b = torch.nn.Linear(32, 8)

        def forward(self, x):
            h = torch.relu(self.a(x))
            if kind == "unsafe_op":
                h = torch.ops.cgrawcpu.host_scale(h) + 1.0
            elif kind == "item":
                if h.sum().item() < 0:  # never: dynamo breaks the graph at .item()
                    h = -h
            elif kind == "nonzero":
                h = h * ((h >= 0).nonzero().shape[0] / h.numel())
            return torch.tanh(self.b(h))

    return CutModel()


@pytest.mark.parametrize("kind", ["unsafe_op", "item", "nonzero"])
def test_a_cut_in_the_middle_leaves_both_sides_graphed(inductor, kind):
    """The GPU test of the same name on the CPU: Inductor cuts around a ``cudagraph_unsafe`` op (the
    harness keeps that cut), dynamo breaks the graph at ``.item()`` and ``nonzero``; the pieces on
    both sides replay. After ``.item()`` the resumed frame guards on the value read: its first
    compile runs once, its second from then on."""
    import re

    import torch

    m = _cut_model(kind)
    c = inductor.compile(m, name=f"cut_{kind}")
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 16)
            torch.testing.assert_close(c(x), m(x))
    parts = inductor.partitions(f"cut_{kind} [")
    compiles: dict = {}
    for name, s in parts.items():
        frame, compile_ = (int(v) for v in re.search(r"\[(\d+)/(\d+)\]", name).groups())
        compiles.setdefault(frame, {}).setdefault(compile_, {})[name] = s
    assert len(compiles) == (1 if kind == "unsafe_op" else 2), parts
    for by_compile in compiles.values():
        last = max(by_compile)
        for name, s in by_compile[last].items():
            assert s.eager_calls == 0 and s.recordings == 1 and s.replays == 6 - last - 2, (name, s)
    if kind == "unsafe_op":
        assert sorted(parts) == ["cut_unsafe_op [0/0] inference/partition 0 of 2",
                                 "cut_unsafe_op [0/0] inference/partition 1 of 2"]
    if kind == "item":
        assert len(compiles[1]) == 2, parts  # the value read is guarded, then symbolic


def test_a_later_piece_of_a_compiled_graph_never_begins_a_step(inductor):
    """After a cut, Inductor may recompute in the second piece what the first made (here from the
    graph's input), so nothing of the first piece is the second's input and the path looks dead
    when it is called. It still never ends the path nor becomes a root function: a call of it
    would end the step while Inductor's frame may hold the first piece's outputs (on the H200 its
    recording then found their memory held and moved the tree to a fresh pool at every call). It
    is the first piece's child from its first call, and both replay."""
    import torch

    _cut_model("unsafe_op")  # registers the op

    def f(x):
        y = torch.relu(x) * 2.0
        z = torch.ops.cgrawcpu.host_scale(y) + 1.0
        return torch.tanh(z) + y

    c = inductor.compile(f, name="recompute")
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(64)
            torch.testing.assert_close(c(x), f(x))
    mgr = inductor.tree
    ids = {s.name: fid for fid, s in mgr.stats.items() if s.name.startswith("recompute [")}
    first, second = (ids[f"recompute [0/0] inference/partition {i} of 2"] for i in (0, 1))
    assert first in mgr.root_fns and second not in mgr.root_fns
    seconds = [n for n in mgr.nodes() if n.fn.fn_id == second]
    assert seconds and all(n.parent is not None and n.parent.fn.fn_id == first for n in seconds)
    assert all(s.replays >= 2 and s.eager_calls == 0 for s in inductor.partitions("recompute [").values())


def test_a_token_viewing_the_state_the_step_writes_computes_what_inductor_computes(inductor):
    """The step writes its state buffer in place and is given a view of that buffer as its token.
    Eager reads the token after the write; the graph Inductor compiles reads it before (torch's
    semantics for an input aliasing a buffer the graph mutates). The backend computes what Inductor
    computes: such a call runs as Inductor compiled it, with the shared memory named as the reason,
    and the plain calls after it replay."""
    import torch

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("state", torch.randn(1, 8))

        def forward(self, tok, pos):
            self.state.add_(pos)
            return torch.tanh(self.lin(tok) + self.state)

    torch.manual_seed(0)
    m = Step()
    plain, ref = copy.deepcopy(m), copy.deepcopy(m)
    c, ind = inductor.compile(m, name="aliased"), torch.compile(plain)
    with torch.no_grad():
        for _ in range(3):  # compiled on plain calls first
            x, pos = torch.randn(1, 8), torch.randn(1)
            for f in (c, ind, ref):
                f(x, pos)
        for i in range(4):
            pos = torch.randn(1)
            got, want = c(m.state.view(1, 8), pos), ind(plain.state.view(1, 8), pos)
            eager = ref(ref.state.view(1, 8), pos)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(m.state, plain.state)
            torch.testing.assert_close(m.state, ref.state)
            assert (got - eager).abs().max() > 1e-3, i  # read before the write, not after
        (before,) = (s.replays for s in inductor.partitions("aliased [").values())
        for _ in range(3):
            x, pos = torch.randn(1, 8), torch.randn(1)
            torch.testing.assert_close(c(x, pos), ref(x, pos))
    (s,) = inductor.partitions("aliased [").values()
    (reason,) = s.skip_reasons
    assert "share memory and the function writes input" in reason and s.skip_reasons[reason] >= 3
    assert s.replays == before + 3
