"""CPU tier: random torch programs (tests/helpers/op_programs.py) graphed through the real
``TreeManager`` on the CPU graph emulator, which replays the recorded ops and not the Python,
against eager on twins of the same inputs: every call's outputs equal bitwise, with eager's
shapes, strides and dtypes, and every input written as eager writes it. The programs mix views,
in-place writes into inputs and into views of them, indexing and reductions, over inputs that
are transposed, strided with gaps, offset, expanded or permuted. The same programs also go
through ``torch.compile(backend="cgraw")`` on the CPU harness (tests/helpers/compile_cpu.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import op_programs  # noqa: E402
from cpu_graph import CpuGraphBackend  # noqa: E402
from torch_cpu_backend import TorchFn, cpu_tree  # noqa: E402

pytestmark = pytest.mark.torch
BLOCKS = range(6)  # 100 programs each
CALLS = 6


def _same(got, want, what: str) -> None:
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype), (
        what, (got.shape, got.stride(), got.dtype), (want.shape, want.stride(), want.dtype))
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan()), what


def _walk(program, monkeypatch) -> tuple:
    """Run ``program`` graphed for ``CALLS`` calls, each on fresh inputs, against eager on twins;
    returns its counters, or None when eager refuses the program (and so did the graphed call)."""
    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        f = TorchFn(program, mgr, name=f"program_{program.seed}")
        for call in range(CALLS):
            mgr.mark_step_begin()
            xs = op_programs.inputs(program, program.seed * 100 + call)
            ts = op_programs.twins(xs)
            try:
                want = program(*ts)
            except RuntimeError:  # eager refuses (a write into an expanded input): so must the graphed call
                with pytest.raises(RuntimeError):
                    f(*xs)
                return None
            got = f(*xs)
            g, w = op_programs.leaves(got), op_programs.leaves(want)
            assert len(g) == len(w) and type(got) is type(want), program.describe()
            for i, (a, b) in enumerate(zip(g, w)):
                _same(a, b, f"{program.describe()}: call {call}, output {i}")
            for i, (x, t) in enumerate(zip(xs, ts)):
                assert torch.equal(x, t), f"{program.describe()}: call {call}, input {i} not written as eager writes it"
        st = mgr.stats[f.fn_id]
        return st.recordings, st.replays, st.eager_calls


@pytest.mark.parametrize("block", BLOCKS)
def test_random_programs_replay_what_eager_returns_and_writes(block, monkeypatch):
    """Every program eager runs is warmed up, recorded once and replayed on every later call."""
    walked = 0
    for seed in range(block * 100, block * 100 + 100):
        program = op_programs.generate(seed)
        counts = _walk(program, monkeypatch)
        monkeypatch.undo()
        if counts is not None:
            walked += 1
            assert counts == (1, CALLS - 2, 0), f"{program.describe()}: (recordings, replays, eager calls) {counts}"
    assert walked >= 80  # the others write into an expanded input, which eager refuses


@pytest.mark.parametrize("marks", [True, False], ids=["mark_step_begin", "inference_rule"])
def test_a_programs_output_fed_to_another_in_the_same_step_replays_what_eager_returns(marks, monkeypatch):
    """Two programs per step, the first's output (a tree output once recorded) the second's first
    input, which it may read, view or write in place; with ``mark_step_begin()`` before each step,
    or the first program a root function beginning each one."""
    walked = 0
    for seed in range(200):
        first = op_programs.generate(2 * seed + 10_000)
        first = op_programs.Program(first.seed, first.layouts, first.steps, first.outs[:1], "single")
        second = op_programs.generate(2 * seed + 10_001)
        second = op_programs.Program(second.seed, ("contiguous",) + second.layouts[1:], second.steps, second.outs,
                                     second.result)
        with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
            f, g = TorchFn(first, mgr, name="first"), TorchFn(second, mgr, name="second")
            for call in range(CALLS):
                if marks:
                    mgr.mark_step_begin()
                xs = op_programs.inputs(first, seed * 100 + call)
                ys = op_programs.inputs(second, seed * 100 + call + 50)[1:]
                ts, us = op_programs.twins(xs), op_programs.twins(ys)
                try:
                    a_want = first(*ts)
                    b_want = second(a_want, *us)
                except (RuntimeError, IndexError):  # eager refuses: a write into an expanded input, a 0-d value
                    break
                a = f(*xs)
                b = g(a, *ys)
                what = f"{first.describe()}; {second.describe()}: call {call}"
                _same(a, a_want, f"{what}: the first's output")
                for i, (got, want) in enumerate(zip(op_programs.leaves(b), op_programs.leaves(b_want), strict=True)):
                    _same(got, want, f"{what}: output {i}")
                for x, t in zip(xs + ys, ts + us):
                    assert torch.equal(x, t), f"{what}: an input is not written as eager writes it"
            else:
                walked += 1
                stats = [mgr.stats[h.fn_id] for h in (f, g)]
                assert all(st.recordings == 1 and st.eager_calls == 0 and st.replays >= CALLS - 3 for st in stats), (
                    [(st.recordings, st.replays, st.eager_calls) for st in stats])
        monkeypatch.undo()
    assert walked >= 160


def test_outputs_cloned_at_each_generations_end_keep_eagers_values_layouts_and_aliasing(monkeypatch):
    """``generation_cloning = "user_visible"``: every output of every call is kept while later
    calls run; at the end each still has eager's values and strides, and the outputs of one call
    share memory exactly where eager's do."""
    from cgraw.trees.config import config

    def sharing(ts):
        return [[a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in ts] for a in ts]

    walked = 0
    config.generation_cloning = "user_visible"
    try:
        for seed in range(300):
            program = op_programs.generate(seed)
            kept = []
            with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
                f = TorchFn(program, mgr, name=f"program_{seed}")
                for call in range(CALLS):
                    if call % 2:
                        mgr.mark_step_begin()  # else the inference rule begins the generation
                    xs = op_programs.inputs(program, seed * 100 + call)
                    try:
                        want = op_programs.leaves(program(*op_programs.twins(xs)))
                    except (RuntimeError, IndexError):
                        break
                    kept.append((op_programs.leaves(f(*xs)), [(w.clone(), w.stride()) for w in want], sharing(want)))
                else:
                    walked += 1
                    mgr.mark_step_begin()
                for call, (outs, want, shared) in enumerate(kept):
                    what = f"{program.describe()}: call {call}"
                    for i, (o, (w, stride)) in enumerate(zip(outs, want, strict=True)):
                        assert torch.equal(o.nan_to_num(), w.nan_to_num()), f"{what}, output {i}"
                        assert o.stride() == stride, f"{what}, output {i}: strides {o.stride()}, eager's {stride}"
                    assert sharing(outs) == shared, what
            monkeypatch.undo()
    finally:
        config.generation_cloning = None
    assert walked >= 250


def test_random_programs_trained_through_the_tree_give_eagers_gradients(monkeypatch):
    """With grad enabled and inputs that require it, a weighted sum of each program's outputs is
    differentiated through the graphed function's recorded backward (``CpuTorchBackend``: the
    real ``interop.torch.autograd``): the outputs and every input's gradient equal eager's."""
    from torch_cpu_backend import CpuTorchBackend, cpu_as_device0

    from cgraw.trees import config as tree_config
    from cgraw.trees.manager import TreeManager

    walked = 0
    for seed in range(300):
        program = op_programs.generate(seed)
        with cpu_as_device0(monkeypatch), torch.enable_grad():
            tree_config.grad_probe(torch.is_grad_enabled)
            be = CpuTorchBackend()
            mgr = be.mgr = TreeManager(be)
            f = TorchFn(program, mgr, name=f"program_{seed}")
            try:
                for call in range(CALLS):
                    mgr.mark_step_begin()
                    what = f"{program.describe()}: call {call}"
                    try:
                        _same_gradients(f, program, program.seed * 100 + call, what)
                    except _Refused:  # eager refuses, or nothing requires grad
                        break
                else:
                    walked += 1
                    st = mgr.stats[f.fn_id]
                    assert (st.recordings, st.eager_calls) == (1, 0) and st.replays >= CALLS - 2, what
            finally:
                tree_config.grad_probe(None)
        monkeypatch.undo()
    assert walked >= 150


class _Refused(Exception):
    """The reference refused the program (or nothing of it requires grad): nothing to compare."""


def _same_gradients(f, reference, seed: int, what: str, program=None) -> None:
    """``f`` and ``reference`` on twins of ``program``'s inputs (``reference``'s, when it is the
    program) that require grad, each followed by a backward of ``_weighted``: the outputs and
    every input's gradient equal bitwise. ``_Refused`` when the reference raises."""
    base = op_programs.inputs(program or reference, seed)
    xs = [b.detach().clone().requires_grad_() for b in base]
    ts = [b.detach().clone().requires_grad_() for b in base]
    try:
        want = op_programs.leaves(reference(*ts))
        _weighted(want).backward()
    except Exception as exc:  # noqa: BLE001 -- eager's or Inductor's refusal
        raise _Refused from exc
    got = op_programs.leaves(f(*xs))
    _weighted(got).backward()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        _same(a.detach(), b.detach(), f"{what}, output {i}")
    for i, (x, t) in enumerate(zip(xs, ts)):
        assert (x.grad is None) == (t.grad is None), f"{what}, input {i}"
        if t.grad is not None:
            _same(x.grad, t.grad, f"{what}, gradient of input {i}")


def _weighted(outs):
    """A scalar of the floating outputs, each weighted by its position (so each gets its own gradient)."""
    terms = [(o * (i + 1)).sum() for i, o in enumerate(outs) if o.is_floating_point()]
    loss = sum(terms)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise AttributeError("no output requires grad")
    return loss


def test_random_programs_compiled_by_the_backend_match_eager(monkeypatch):
    """``torch.compile(program, backend="cgraw")`` on the CPU harness (Inductor's partitions as
    graphed functions): outputs and inputs written in place equal eager's within Inductor's
    rounding on every call, from the warm-up to the replays; a program torch's own compile refuses
    (``aot_eager``: a write into an expanded input) is refused the same way, never only by cgraw."""
    from compile_cpu import cpu_partitions

    walked = 0
    for seed in range(100, 160):
        program = op_programs.generate(seed)
        torch._dynamo.reset()
        with cpu_partitions(monkeypatch) as h:
            c = h.compile(lambda *xs, p=program: p(*xs), name=f"program_{seed}")
            for call in range(5):
                xs = op_programs.inputs(program, seed * 100 + call)
                ts = op_programs.twins(xs)
                try:
                    want = program(*ts)
                except (RuntimeError, IndexError):
                    break  # eager refuses it
                try:
                    got = c(*xs)
                except Exception:  # noqa: BLE001 -- torch's own compile must refuse it too
                    torch._dynamo.reset()
                    with pytest.raises(Exception):  # noqa: B017
                        torch.compile(lambda *a, p=program: p(*a), backend="aot_eager")(*op_programs.twins(xs))
                    break
                what = f"{program.describe()}: call {call}"
                pairs = [(f"output {i}", a, b) for i, (a, b) in
                         enumerate(zip(op_programs.leaves(got), op_programs.leaves(want), strict=True))]
                pairs += [(f"input {i}", x, t) for i, (x, t) in enumerate(zip(xs, ts))]
                for name, a, b in pairs:
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True,
                                               msg=lambda m, name=name: f"{what}, {name}: {m}")
            else:
                walked += 1
        monkeypatch.undo()
    assert walked >= 50


def test_random_programs_trained_through_the_backend_equal_inductors_bitwise(monkeypatch):
    """With grad: ``torch.compile(program, backend="cgraw")`` (forward and backward partitions as
    graphed functions) against ``torch.compile(program)`` on twins of the same inputs: the same
    Inductor kernels, so outputs and input gradients equal bitwise on every call."""
    from compile_cpu import cpu_partitions

    walked = 0
    for seed in range(40):
        program = op_programs.generate(seed)
        torch._dynamo.reset()
        with cpu_partitions(monkeypatch) as h, torch.enable_grad():
            c = h.compile(lambda *xs, p=program: p(*xs), name=f"program_{seed}")
            inductor = torch.compile(lambda *xs, p=program: p(*xs))
            for call in range(5):
                try:
                    _same_gradients(c, inductor, seed * 100 + call, f"{program.describe()}: call {call}", program)
                except _Refused:  # Inductor (or eager) refuses the program, or nothing requires grad
                    break
            else:
                walked += 1
        monkeypatch.undo()
    assert walked >= 20


def test_the_generator_is_deterministic_and_covers_every_op_and_layout():
    programs = [op_programs.generate(s) for s in range(len(BLOCKS) * 100)]
    assert programs == [op_programs.generate(s) for s in range(len(BLOCKS) * 100)]
    used = {step[1] for p in programs for step in p.steps}
    assert used == set(op_programs.UNARY) | set(op_programs.BINARY)
    assert {layout for p in programs for layout in p.layouts} == set(op_programs.LAYOUTS)
    assert {p.result for p in programs} == set(op_programs.RESULTS)
