"""CPU tests of how a graphed call's key treats eager inputs that require grad (``calls``): which
ones require grad, and which autograd leaves already hold a ``.grad`` that a backward inside the
function would add to, are part of the key. The GPU scenarios (gradients with respect to inputs
inside a graphed function, against eager) are in tests/gpu/test_fidelity.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch_cpu_backend import TorchFn, cpu_as_device0  # noqa: E402

from cgraw.trees import calls  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def _grad_mode(monkeypatch):
    with cpu_as_device0(monkeypatch):
        calls.use_grad_mode(torch.is_grad_enabled)
        try:
            yield
        finally:
            calls.use_grad_mode(None)


def _key(*args):
    fn = TorchFn(lambda *a: None, None)
    return calls.inspect(fn, args, {}, {}, 0).key


def test_an_input_holding_a_grad_has_a_key_of_its_own():
    x = torch.randn(4, 3, requires_grad=True)
    y = torch.randn(4, 3)
    fresh = _key(x, y)
    x.grad = torch.ones_like(x)
    held = _key(x, y)
    x.grad = None
    assert _key(x, y) == fresh != held


def test_under_no_grad_the_key_notes_which_inputs_require_grad_but_not_their_grads():
    """A function may branch on ``x.requires_grad`` under ``no_grad`` too; a held ``.grad`` is
    read only by a backward, which does not run with grad disabled."""
    y = torch.randn(4, 3)
    with torch.no_grad():
        z = torch.randn(4, 3, requires_grad=True)
        fresh = _key(z, y)
        z.grad = torch.ones_like(z)
        assert _key(z, y) == fresh != _key(torch.randn(4, 3), y)
        assert _key(torch.randn(4, 3), y) == _key(torch.randn(4, 3), y)


def test_a_non_leaf_input_is_never_read_for_its_grad(recwarn):
    x = torch.randn(4, 3, requires_grad=True) * 2  # not a leaf: reading .grad would warn
    _key(x)
    assert not [w for w in recwarn if ".grad" in str(w.message)]
