"""The scenarios of torch's graph-tree tests (test/inductor/test_cudagraph_trees.py) that exercise
``mode="reduce-overhead"``, written for ``torch.compile(backend="cgraw")``: each function is one
behaviour, run by tests/gpu/test_compile_backend_trees.py on the GPU and, where the CPU harness
(tests/helpers/compile_cpu.py) can show it, by tests/unit/test_compile_backend_trees_cpu.py.

A scenario takes an ``Env``: the device, ``compile(fn, name, **options)``, fresh random inputs, the
graphed pieces' statistics (partitions, and on a GPU inference graphs graphed whole), and
``overwritten(t)``: whether the tree invalidated ``t`` (on the GPU, reading it raises cgraw's
error; on the CPU, the tree handed it to its backend to poison).
Results are compared with eager on fresh random inputs. The docstrings name the torch tests with
the same behaviour; where cgraw deliberately differs from torch's trees, the scenario checks
cgraw's behaviour (docs/guides/torch-compile.md says the difference).
"""

from __future__ import annotations

import importlib

import torch

import cgraw

graphed_mod = importlib.import_module("cgraw.trees.graphed")

TOL = {"rtol": 1e-4, "atol": 1e-4}
WRITES_KEPT = "it writes, in place, an output of the ending generation it gets as an input (h = f(h))"


class Env:
    """What a scenario needs of its tier (see the module docstring)."""

    def __init__(self, device: str, compile_fn, overwritten):
        self.device = device
        self._compile = compile_fn
        self.overwritten = overwritten

    def compile(self, fn, name: str, *, dynamic=None, **options):
        """``torch.compile(fn, backend=<cgraw>, dynamic=dynamic, options={"name": name, **options})``."""
        return self._compile(fn, dynamic, {"name": name, **options})

    def rand(self, *shape, requires_grad=False):
        return torch.randn(*shape, device=self.device, requires_grad=requires_grad)

    def tree(self):
        return graphed_mod._managers[0]

    def partitions(self, prefix: str) -> dict:
        """The graphed pieces of ``prefix``: its partitions, and its inference graphs graphed whole."""
        return graphed_pieces(prefix)


def graphed_pieces(prefix: str) -> dict:
    """``{name: FunctionStats}`` of the graphed pieces of the compiled code named ``prefix`` (names
    ``<prefix> [frame/compile] ...``) in the calling thread's tree on device 0: its partitions, and
    its inference graphs graphed whole."""
    mgr = graphed_mod.tree_here(0)
    if mgr is None:
        return {}
    return {s.name: s for s in mgr.stats.values() if s.name.startswith(prefix + " [")
            and ("/partition " in s.name or s.name.endswith("/whole graph"))}


def replayed(env: Env, prefix: str, *, at_least: int = 1) -> dict:
    """The graphed pieces of ``prefix``: none ran eagerly, each was recorded and replayed ``at_least`` times."""
    parts = env.partitions(prefix)
    assert parts, f"no partition of {prefix!r} ran as a graphed function"
    for name, s in parts.items():
        assert s.eager_calls == 0 and not s.skip_reasons, (name, s.skip_reasons)
        assert s.recordings >= 1 and s.replays >= at_least, (name, s)
    return parts


def close(a, b):
    torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------- recording and replay


def each_input_shape_records_its_own_graph(env: Env):
    """test_run_simple: a call with another shape (``dynamic=False``: a new compile) is recorded
    apart; the first shape's recording keeps replaying."""

    def cube(x):
        return x * x * x

    c = env.compile(cube, "shapes", dynamic=False)
    for shape in ((4, 4), (5, 5), (4, 4), (5, 5), (4, 4), (5, 5)):
        x = env.rand(*shape)
        close(c(x), cube(x))
    parts = replayed(env, "shapes")
    assert len(parts) == 2 and all(s.recordings == 1 for s in parts.values()), parts


def results_follow_warm_up_recording_and_replay(env: Env):
    """test_execution_into_recording: a data-dependent branch (dynamo breaks the graph at it) takes
    either side from call to call; every call's result equals eager's."""

    def branch(x):
        y = x + x
        if y.sum() > 0:
            return y + 10
        return y - 10

    c = env.compile(branch, "branch")
    for sign in (1, 1, 1, -1, -1, -1, 1, -1):
        x = env.rand(4, 4).abs() * sign
        close(c(x), branch(x))
    replayed(env, "branch")


def pieces_called_twice_in_one_step_form_a_path(env: Env):
    """test_function_compiled_multiple_times: ``h(h(x))`` where ``h`` breaks the graph: its pieces
    run twice per call, as successive nodes of one path; results equal eager's."""

    def h(x):
        y = torch.sin(x) * 2.0
        torch._dynamo.graph_break()
        return y * y + 1.0

    def outer(x):
        return h(h(x))

    c = env.compile(outer, "twice")
    for _ in range(5):
        x = env.rand(8)
        close(c(x), outer(x))
    replayed(env, "twice")
    depths = [n.depth for n in env.tree().nodes() if n.fn.name.startswith("twice [")]
    assert max(depths) >= 1, depths


# ---------------------------------------------------------------- outputs of ended steps


def an_output_overwritten_by_a_later_replay_is_invalid(env: Env):
    """test_error_on_dealloc_use: the output of a replayed step is invalid once the next call of
    the compiled function has begun a new step; reading it raises cgraw's error naming the fix
    (on the CPU: the tree hands it to its backend to poison)."""

    def cube(x):
        return x * x * x

    c = env.compile(cube, "dealloc")
    x = env.rand(4)
    c(x)  # warm-up
    out = c(x)  # recorded
    close(out, cube(x))
    out2 = c(x)  # replayed: a new step
    assert env.overwritten(out)
    assert not env.overwritten(out2)
    close(out2, cube(x))
    c(x)
    assert env.overwritten(out2)


def cloned_outputs_stay_valid(env: Env):
    """The documented way to keep an output across steps (torch's error text says the same):
    ``.clone()`` before the next call."""

    def cube(x):
        return x * x * x

    c = env.compile(cube, "clone")
    x = env.rand(4)
    kept = [c(x).clone() for _ in range(5)]
    for k in kept:
        close(k, cube(x))
    replayed(env, "clone")


def mark_step_begin_lets_a_later_piece_write_an_earlier_output(env: Env):
    """test_mutation_cudagraph_managed_tensors: within a step (``cgraw.mark_step_begin()`` at its
    start), a compiled function writes in place the output of another one; both replay, and the
    results equal eager's. (torch's trees take ``torch.compiler.cudagraph_mark_step_begin()``;
    cgraw's step marker is ``cgraw.mark_step_begin()``.)"""

    def plus1(x):
        return x + 1

    def add2_(x):
        x.add_(2)
        return x

    f, g = env.compile(plus1, "produce"), env.compile(add2_, "consume")
    for _ in range(5):
        cgraw.mark_step_begin()
        x = env.rand(4)
        close(g(f(x)), x + 3)
    replayed(env, "produce")
    replayed(env, "consume")


def state_one_function_makes_and_another_writes_stays_valid(env: Env):
    """A static key-value cache (transformers' ``generate(cache_implementation="static")``): one
    compiled function makes the state and hands it out, the caller keeps it, and another compiled
    function writes it in place at every call, each call beginning a step (here once
    ``cgraw.config.path_repeat_limit`` makes it a root function, as in a long decode loop). The
    state is an output of an ended generation the step's call writes: it moves out of the tree's
    memory, is never invalidated, and every result equals eager's, over two rounds, each with a
    new state. (torch's trees invalidate an output only when a later replay overwrites its memory.)"""

    def prefill(x):
        return torch.cat([x, torch.zeros(7, x.shape[1], device=x.device)]) * 0.5

    def decode(state, t, pos):
        state.index_copy_(0, pos, t)
        return torch.tanh(state).sum(0)

    p, d = env.compile(prefill, "prefill"), env.compile(decode, "decode")
    limit = cgraw.config.path_repeat_limit
    cgraw.config.path_repeat_limit = 3
    try:
        for _ in range(2):
            x = env.rand(1, 16)
            state, ref = p(x), prefill(x)
            for i in range(10):
                t, pos = env.rand(1, 16), torch.tensor([i % 8], device=x.device)
                close(d(state, t, pos), decode(ref, t, pos))
                assert not env.overwritten(state), i
                close(state, ref)
    finally:
        cgraw.config.path_repeat_limit = limit
    parts = env.partitions("decode")  # the call that moves a round's state runs eagerly, once a round
    assert sum(st.replays for st in parts.values()) >= 6, parts
    for name, st in parts.items():
        assert st.eager_calls <= 2 and set(st.skip_reasons) <= {WRITES_KEPT}, (name, st)


# ---------------------------------------------------------------- mutation


def an_input_written_in_place_is_graphed_and_written_back(env: Env):
    """test_mutation_on_inp. torch's trees run a graph that writes an eager input without CUDA
    graphs ("skipping cudagraphs due to mutation on input"); cgraw records it, with the write
    copied back to the caller's tensor after each replay: the input and the output equal eager's."""

    def add2_(x):
        x.add_(2)
        return x * 3

    c = env.compile(add2_, "mut_input")
    for _ in range(5):
        x = env.rand(10)
        ref = x.clone()
        close(c(x), add2_(ref))
        close(x, ref)
    replayed(env, "mut_input")


def an_input_write_that_changed_nothing_at_the_warm_up_is_still_written_back(env: Env):
    """An input clamped in place (``clamp_``): the warm-up's and the recording's values lie inside
    the bounds, so the write leaves them as they were and no data shows it; later calls' values
    lie outside, and the caller's tensor must be clamped as eager clamps it. Inductor knows the
    graph writes its input; the backend declares it to the partition, whose replays copy it back."""

    def clamp_(x):
        x.clamp_(-3.0, 3.0)
        return x * 2

    c = env.compile(clamp_, "clamp_input")
    for i in range(5):
        x = env.rand(64) * (0.5 if i < 2 else 10.0)  # in bounds for the warm-up and the recording
        ref = x.clone()
        close(c(x), clamp_(ref))
        close(x, ref)
    assert float(x.abs().max()) == 3.0  # the last call's write clipped values
    replayed(env, "clamp_input")


def a_module_buffer_written_in_place_is_graphed(env: Env):
    """test_mutation_on_inp (its module part): a buffer updated in place by the module; the
    buffer and the outputs equal eager's after each call."""

    class Accumulate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("acc", torch.zeros(10))

        def forward(self, x):
            self.acc.add_(x)
            return self.acc * 2 + x

    m, ref = Accumulate().to(env.device), Accumulate().to(env.device)
    c = env.compile(m, "mut_buffer")
    with torch.no_grad():
        for _ in range(5):
            x = env.rand(10)
            close(c(x), ref(x))
            close(m.acc, ref.acc)
    replayed(env, "mut_buffer")


# ---------------------------------------------------------------- aliasing


def outputs_viewing_one_another_share_storage(env: Env):
    """test_output_alias, test_aliased_storage_single_weakref: outputs that are views of one
    output share its storage on every call, warm-up, recording and replay alike."""

    def views(x):
        y = x * 20
        return y, y[0], y[2:]

    c = env.compile(views, "alias")
    for _ in range(5):
        x = env.rand(6, 6)
        outs = c(x)
        ptrs = {o.untyped_storage().data_ptr() for o in outs}
        assert len(ptrs) == 1, ptrs
        for got, want in zip(outs, views(x), strict=True):
            close(got, want)
    replayed(env, "alias")


def outputs_aliasing_a_parameter_are_the_parameter(env: Env):
    """test_alias_of_parameter, test_aliasing_static_ref: a module returning its parameter and a
    view of it returns the parameter's own storage on every call, never a copy in the tree."""

    class AliasMod(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.param = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return self.param[0], self.param, self.param + x

    m = AliasMod().to(env.device)
    c = env.compile(m, "param_alias")
    with torch.no_grad():
        for _ in range(5):
            x = env.rand(8, 8)
            row, whole, summed = c(x)
            assert whole.untyped_storage().data_ptr() == m.param.untyped_storage().data_ptr()
            assert row.untyped_storage().data_ptr() == m.param.untyped_storage().data_ptr()
            close(summed, m.param + x)
    replayed(env, "param_alias")


# ---------------------------------------------------------------- autograd


def a_forward_and_its_backward_are_recorded(env: Env):
    """test_forward_backward: the forward and the backward pieces are recorded and replayed, and
    the gradients equal eager's."""

    def f(x):
        return torch.sin(x * 2) * x

    c = env.compile(f, "fwd_bwd")
    for _ in range(5):
        x = env.rand(4, 4, requires_grad=True)
        ref = x.detach().clone().requires_grad_()
        c(x).sum().backward()
        f(ref).sum().backward()
        close(x.grad, ref.grad)
    parts = replayed(env, "fwd_bwd")
    assert any(" backward/partition" in n for n in parts), parts


def a_backward_of_one_output_only_keeps_the_next_steps_right(env: Env):
    """test_forward_backward_not_called: two outputs from either side of a graph break, the
    backward run through one of them only; the next steps' gradients still equal eager's. torch's
    trees record the second piece's forward again deeper in the path while its backward is
    pending; cgraw runs it as Inductor compiled it, without graphs, while an earlier forward of
    the same graph waits for its backward (here: always after its first call), and says so in
    ``report()``. The first piece's forward and backward replay."""

    def f(x, y):
        x_out = x * x * x
        torch._dynamo.graph_break()
        y_out = y * y * y
        return x_out, y_out

    c = env.compile(f, "half_bwd")
    for _ in range(5):
        x, y = env.rand(6, 6, requires_grad=True), env.rand(6, 6, requires_grad=True)
        x_out, y_out = c(x, y)
        close(y_out, (y * y * y).detach())
        x_out.sum().backward()
        close(x.grad, 3 * x.detach() ** 2)
        assert y.grad is None
    parts = env.partitions("half_bwd")
    first = {n: s for n, s in parts.items() if n.startswith("half_bwd [0/")}
    second = [n for n in parts if n.startswith("half_bwd [1/") and " forward/" in n]
    assert any(" backward/" in n for n in first), parts
    for name, s in first.items():
        assert s.eager_calls == 0 and s.recordings == 1 and s.replays >= 1, (name, s)
    assert second, parts
    for name in second:
        assert parts[name].warmups == 1 and parts[name].replays == 0, parts[name]
        assert "until a backward runs" in graphed_mod.without_graphs()[name]


def a_retained_graph_backward_twice_accumulates(env: Env):
    """test_accumulate_grad: ``backward(retain_graph=True)`` then ``backward()`` through one
    forward accumulate the gradient, as eager does."""

    def f(x):
        return x * x

    c = env.compile(f, "retain")
    for _ in range(4):
        x = env.rand(5, 5, requires_grad=True)
        g = env.rand(5, 5)
        y = c(x)
        y.backward(g, retain_graph=True)
        first = x.grad.clone()
        y.backward(g)
        close(first, 2 * x.detach() * g)
        close(x.grad, 2 * first)


# ---------------------------------------------------------------- inputs and shapes


def dynamic_sizes_record_one_graph_per_size(env: Env):
    """Dynamic shapes (``mark_dynamic``): the size reaches each piece as an int, and each size has a
    recording of its own (torch's trees record per distinct size too); all replay."""

    def f(x):
        return torch.tanh(x) * x.shape[0]

    c = env.compile(f, "dynamic")
    for i in range(8):
        x = env.rand(8 if i % 2 else 16, 4)
        torch._dynamo.mark_dynamic(x, 0)
        close(c(x), f(x))
    parts = env.partitions("dynamic")
    assert parts
    for name, s in parts.items():
        assert s.eager_calls == 0 and s.recordings >= 2 and s.replays >= 1, (name, s)


def unaligned_inputs_give_eager_results(env: Env):
    """test_unaligned_static_input: inputs starting 20 bytes into their storage (Inductor's
    kernels assume 16-byte alignment unless told otherwise) give eager's results, alternating
    with aligned ones."""

    def f(x, y):
        return x + y

    c = env.compile(f, "unaligned", dynamic=False)
    for i in range(6):
        if i % 2:
            x, y = env.rand(6, 5)[1:], env.rand(6, 5)[1:]
        else:
            x, y = env.rand(5, 5), env.rand(5, 5)
        close(c(x, y), f(x, y))


def expanded_inputs_give_eager_results(env: Env):
    """test_expanded_inputs: an input with a zero stride (``expand``)."""

    def f(x):
        return x + 4 + torch.ones(4, 512, device=x.device)

    c = env.compile(f, "expanded")
    for _ in range(4):
        x = env.rand(1, 512).expand(4, 512)
        close(c(x), f(x))
    replayed(env, "expanded")


def empty_outputs_keep_their_shapes(env: Env):
    """test_empty_storage: outputs with no elements beside one with some."""

    def f(x):
        return x + x + x, torch.zeros(0, device=x.device), torch.zeros(100, device=x.device)[0:0]

    c = env.compile(f, "empty")
    for _ in range(4):
        x = env.rand(4)
        a, b, e = c(x)
        close(a, 3 * x)
        assert b.shape == (0,) and e.shape == (0,)


def random_numbers_follow_the_generator(env: Env):
    """test_rng_trees (``fallback_random``): after ``manual_seed`` the compiled function's draws
    repeat those of the first run, call by call, warm-up and replays alike."""

    def draw():
        return torch.rand(20, device=env.device) * 2.0

    c = env.compile(draw, "rng", inductor={"fallback_random": True})
    torch.manual_seed(0)
    first = [c().clone() for _ in range(4)]
    torch.manual_seed(0)
    again = [c().clone() for _ in range(4)]
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(first[2], first[3])


SCENARIOS = [
    each_input_shape_records_its_own_graph,
    results_follow_warm_up_recording_and_replay,
    pieces_called_twice_in_one_step_form_a_path,
    an_output_overwritten_by_a_later_replay_is_invalid,
    cloned_outputs_stay_valid,
    mark_step_begin_lets_a_later_piece_write_an_earlier_output,
    state_one_function_makes_and_another_writes_stays_valid,
    an_input_written_in_place_is_graphed_and_written_back,
    an_input_write_that_changed_nothing_at_the_warm_up_is_still_written_back,
    a_module_buffer_written_in_place_is_graphed,
    outputs_viewing_one_another_share_storage,
    outputs_aliasing_a_parameter_are_the_parameter,
    a_forward_and_its_backward_are_recorded,
    a_backward_of_one_output_only_keeps_the_next_steps_right,
    a_retained_graph_backward_twice_accumulates,
    dynamic_sizes_record_one_graph_per_size,
    unaligned_inputs_give_eager_results,
    expanded_inputs_give_eager_results,
    empty_outputs_keep_their_shapes,
    random_numbers_follow_the_generator,
]
