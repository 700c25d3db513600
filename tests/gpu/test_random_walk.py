"""GPU tier of the differential random walk.

For each seed, a random program (tests/helpers/programs.py: 3 to 6 elementwise torch, CuPy and
mixed torch/CuPy functions, host-side data-dependent branches, explicit and inferred
generations, ``h = f(h)``, in-place updates of tree outputs) is walked for at least 2,000 calls
through ``@cgraw.graphed``, then the same walk is run eagerly on the plain functions. Asserted:
- every output equals the eager one bitwise (host copies taken right after each call);
- every read of a torch output kept past its generation raised "overwritten by a subsequent run"
  when the output lives in the tree's pool (a replay's), and equals the eager value when it is a
  warm-up's (ordinary memory, never poisoned);
- nothing was skipped or re-recorded;
- the tree pool's reserved bytes (cgraw's and torch's parts) at call 500 equal those at the end.
"""

from __future__ import annotations

import sys
import time

import programs
import pytest

import cgraw

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")

N_CALLS = 2000
SETTLE = 500  # the pool must not grow after this many calls




def _mgr():
    return sys.modules["cgraw.trees.graphed"]._managers[0]


def _owned_by_tree(x) -> bool:
    """Whether an output lives in the tree's pool (a replay's output), not in ordinary memory (a
    warm-up's): only the former is poisoned when its generation ends."""
    ptr = x.data_ptr() if isinstance(x, torch.Tensor) else int(x.data.ptr)
    return _mgr().backend._pool_owner()(ptr)


def _probe():
    """(tree pool reserved bytes, cgraw's part plus torch's; recordings so far)."""
    mgr = _mgr()
    pool = mgr.backend.pool
    return (pool.stats().reserved_bytes + pool.torch_reserved_bytes,
            sum(s.recordings for s in mgr.stats.values()))


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_matches_eager(seed):
    assert cgraw.config.generation_cloning is None, "the walk expects torch outputs to be poisoned"
    prog = programs.generate(seed)
    ns = programs.real_namespace(torch, cp)
    ns.owned_by_tree = _owned_by_tree

    t0 = time.perf_counter()
    try:
        got = programs.run(prog, ns, N_CALLS, graphed=True, mark_step_begin=cgraw.mark_step_begin,
                           graphed_decorator=cgraw.graphed, probe=_probe, probe_at=(SETTLE,))
    except Exception as exc:
        if hasattr(exc, "add_note"):
            exc.add_note(prog.describe() + "\n" + cgraw.tree_text(0))
        raise
    t1 = time.perf_counter()
    final_bytes, final_recordings = _probe()
    mgr = _mgr()
    stats = list(mgr.stats.values())
    nodes = len(mgr.nodes())
    del mgr
    ref = programs.run(prog, ns, N_CALLS, graphed=False)
    t2 = time.perf_counter()

    settle_bytes, settle_recordings = got.probes[SETTLE]
    recordings = sum(s.recordings for s in stats)
    print(f"\nseed {seed}: {got.calls} calls ({got.steps} steps, {len(got.paths)} paths, {nodes} tree nodes), "
          f"{recordings} recordings ({final_recordings - settle_recordings} after call {SETTLE}), "
          f"{sum(s.replays for s in stats)} replays, {sum(s.warmups for s in stats)} warm-ups, "
          f"{got.raised} raised reads of {got.expected_raises} expected, "
          f"{sum(got.recurrent.values())} h=f(h), {got.marks} marks, "
          f"pool {settle_bytes / 2**20:.1f} MiB at call {SETTLE} -> {final_bytes / 2**20:.1f} MiB, "
          f"graphed {t1 - t0:.2f} s, eager {t2 - t1:.2f} s")

    problems = programs.compare(got, ref)
    assert not problems, "\n".join(problems) + "\n" + prog.describe()
    assert got.calls == ref.calls >= N_CALLS
    assert got.raised == got.expected_raises
    assert got.expected_raises + got.kept_valid == ref.expected_raises
    skipped = {s.name: s.skip_reasons for s in stats if s.skip_reasons}
    assert not skipped, f"graphed functions ran eagerly: {skipped}\n{prog.describe()}"
    rerecords = {s.name: s.rerecord_reasons for s in stats if s.rerecords}
    assert not rerecords, f"re-recorded: {rerecords}\n{prog.describe()}"
    assert final_bytes == settle_bytes, (
        f"the tree pool grew after call {SETTLE}: {settle_bytes} -> {final_bytes} bytes "
        f"({final_recordings - settle_recordings} recordings after it)\n{prog.describe()}")
