"""GPU tier: torch.compile'd code under cgraw stays compiled. A compiled function captured with
cgraw.capture() or graphed as cgraw.graphed(torch.compile(f)) records Inductor's Triton kernels,
not torch's eager ATen kernels (the graph's node table names them), replays equal eager on fresh
random inputs, and random numbers drawn inside compiled code are fresh on every replay (Inductor's
seeds come from cgraw's generator)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import rng_stats as S
from gpu_data import trand

import cgraw

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
F = torch.nn.functional

CALLS = 6
N = 1 << 16


def _mgr():
    from cgraw.trees.graphed import _managers

    return _managers[0]


def _stats(f):
    return _mgr().stats[f.fn_id]


def _chain(x):
    return ((x.sin() * 2 + 1).cos() * x).relu()


def _kernels(graphs) -> list[str]:
    return [n.kernel for g in graphs for n in g.nodes() if n.kernel is not None]


def _recorded_graphs(f) -> list:
    return [n.recording.graph for n in _mgr().nodes() if n.fn.fn_id == f.fn_id and n.recording is not None]


def _assert_compiled_kernels(names):
    assert any("triton" in k for k in names), names
    assert not any("at6native" in k or "at::native" in k for k in names), names  # torch's eager ATen kernels


def test_compiled_function_captured_records_one_triton_kernel():
    fc = torch.compile(_chain)
    x = trand(N)
    torch.testing.assert_close(fc(x), _chain(x))  # compiles here, outside the capture
    with cgraw.capture() as g:
        y = fc(x)
    names = _kernels([g])
    _assert_compiled_kernels(names)
    assert len(names) == 1, names  # the six elementwise ops fused into one kernel
    assert "triton" in str(g)
    for _ in range(3):
        x.copy_(trand(N))
        g.replay()
        torch.testing.assert_close(y, _chain(x), rtol=1e-5, atol=1e-5)


def test_graphed_compiled_function_records_triton_kernels_and_equals_eager():
    f = cgraw.graphed(torch.compile(_chain))
    for _ in range(CALLS):
        x = trand(N)
        torch.testing.assert_close(f(x), _chain(x), rtol=1e-5, atol=1e-5)
    s = _stats(f)
    assert (s.warmups, s.recordings, s.replays, s.eager_calls) == (1, 1, CALLS - 2, 0), s.skip_reasons
    _assert_compiled_kernels(_kernels(_recorded_graphs(f)))


def test_random_numbers_inside_compiled_code_are_fresh_per_replay():
    def body(x):
        return F.dropout(x, 0.5, training=True), torch.rand_like(x)

    f = cgraw.graphed(torch.compile(body))
    masks, uniforms = [], []
    for _ in range(CALLS):
        x = trand(N).abs() + 0.5  # no zeros: a dropped element is told by its zero
        d, u = f(x)
        kept = d != 0
        torch.testing.assert_close(d[kept], x[kept] * 2.0)
        masks.append(kept.cpu().numpy())
        uniforms.append(u.cpu().numpy())
    s = _stats(f)
    assert (s.recordings, s.replays, s.eager_calls) == (1, CALLS - 2, 0), s.skip_reasons
    names = _kernels(_recorded_graphs(f))
    _assert_compiled_kernels(names)
    assert any(k.startswith("cgraw_fill_randint_i64") for k in names), names  # Inductor's seeds, cgraw's draw
    assert "random draw" in cgraw.report()
    for a, b in itertools.pairwise(masks[1:]):  # the recording's call and every replay differ
        assert not np.array_equal(a, b), "two replays drew the same dropout mask"
    for a, b in itertools.pairwise(uniforms[1:]):
        assert not np.array_equal(a, b), "two replays drew the same numbers"
    assert len({u.tobytes() for u in uniforms}) == CALLS
    S.frequency_check(int(masks[-1].sum()), N, 0.5, what="compiled dropout keep rate")
    S.ks_continuous(uniforms[-1], S.uniform_cdf(), what="compiled rand_like")


def test_a_compiled_training_step_is_graphed_after_its_optimizer_state_exists():
    """``cgraw.graphed(torch.compile(step))`` of a whole training step (forward, backward, SGD
    with momentum): its second call fails the guards of its first compile (the momentum buffers
    are made by the first step), so dynamo compiles during that call's recording, which breaks
    the capture. That call runs eagerly, the next warms up again, and the step is recorded and
    replayed from then on, equal to the same compiled step without cgraw."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
    twin = copy.deepcopy(model)

    def make_step(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    f = cgraw.graphed(torch.compile(make_step(model)))
    ref = torch.compile(make_step(twin))
    for _ in range(CALLS + 2):
        x, y = trand(32, 64), torch.randint(0, 10, (32,), device="cuda")
        torch.testing.assert_close(f(x, y), ref(x, y), rtol=1e-4, atol=1e-5)
        cgraw.mark_step_begin()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    s = _stats(f)
    assert s.recordings == 1 and s.replays >= CALLS - 3, (s.warmups, s.recordings, s.replays, s.skip_reasons)
    assert s.eager_calls <= 2 and all("torch.compile compiled code during the recording" in r for r in s.skip_reasons)
