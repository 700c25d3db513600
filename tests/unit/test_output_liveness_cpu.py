"""CPU tests of how a graph tree sees that memory it handed out is still used: a view or a
``.detach()`` alias of an output keeps the output's memory in use after the output object itself
is gone (``frameworks.Ops.users``, ``trees.outputs.PathOutputs``, ``trees.outputs.memory_in_use``), so a
path whose outputs survive only as aliases is not ended and its memory is not handed out again."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from cgraw.trees.frameworks import TORCH  # noqa: E402
from cgraw.trees.outputs import PathOutputs, memory_in_use, versions_of, written_since  # noqa: E402

pytestmark = pytest.mark.torch


def _alias(t, how):
    if how == "detach":
        return t.detach()
    if how == "view":
        return t[2:]
    return t.data if how == "data" else None


@pytest.mark.parametrize("alias", ["detach", "view", "data", "none"])
def test_an_alias_of_a_warm_up_output_keeps_its_memory_in_use(alias):
    outs = PathOutputs()
    t = torch.randn(16)
    outs.hand("f", [t])
    kept = _alias(t, alias)
    del t
    gc.collect()
    assert outs.alive() == (alias != "none")
    del kept
    gc.collect()
    assert not outs.alive()


def test_a_recordings_outputs_are_in_use_above_their_baseline():
    out = torch.randn(8, 8)  # what a recording holds
    users = TORCH.users(out)
    rec_users = [(users, users())]
    assert not memory_in_use(rec_users)
    handed = out.detach()  # a replay's alias, dropped by the caller
    assert memory_in_use(rec_users)
    del handed
    assert not memory_in_use(rec_users)
    kept = out.detach()[1:].t()  # a view of the alias the caller keeps
    assert memory_in_use(rec_users)
    del kept
    assert not memory_in_use(rec_users)


def test_users_do_not_keep_the_memory_alive():
    t = torch.randn(1 << 10)
    users = TORCH.users(t)
    assert users() > 0
    del t
    gc.collect()
    assert users() == 0


def test_the_arguments_a_call_wrote_are_found_with_the_views_its_output_made_of_them():
    """``written_since``: of the ending generation's outputs a call got, the ones it wrote in place
    (a version moved, or the function declares the write, as Inductor's kernels write without
    moving it), with the output's views of them; not one it only read, nor an output over other
    memory, nor an inference tensor it did not declare (no version to tell)."""
    cache, token, state = torch.randn(8, 4), torch.randn(4), torch.randn(6)
    with torch.inference_mode():
        served = torch.randn(3)
    items = [("prefill", cache), ("decode", token), ("init", state), ("served", served)]
    versions = versions_of(items)
    assert versions[3] is None
    cache[2].copy_(token)  # written by an op: its version moves
    out = (cache[:3], token * 2.0, state.view(2, 3), served)
    found = written_since(items, versions, {id(state)}, out)
    assert [id(t) for _, t in found] == [id(cache), id(state), id(out[0]), id(out[2])]
    assert [n for n, _ in found] == ["prefill", "init", "prefill", "prefill"]
    assert written_since(items, versions_of(items), set(), out) == []
    assert [id(t) for _, t in written_since(items, versions, {id(served)}, None)] == [id(cache), id(served)]
