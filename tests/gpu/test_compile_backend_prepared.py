"""GPU tier: the prepared replay of a whole compiled graph (``torch.compile(backend="cgraw")``, an
inference graph graphed whole). A step fed its own output, as a decode loop calls it, varied as users
vary it: a parameter moved to a new address, a setting that chooses kernels switched and back, calls
while a training step's backward is pending, an input that shares memory with the one the step
writes. Every result equals eager's; a varied call takes the generic path and the plain calls after
it are served by the prepared replay again (``cgraw.trees.manager.call_of`` runs only for a call the
prepared replay serves)."""

from __future__ import annotations

import copy
import importlib

import pytest
from gpu_data import trand

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees", "fresh_dynamo")]
torch = pytest.importorskip("torch")

import compile_scenarios as sc  # noqa: E402

manager_mod = importlib.import_module("cgraw.trees.manager")

TOL = {"rtol": 1e-4, "atol": 1e-4}  # Inductor's fused kernels against eager's, float32, TF32 off
D = 64


class Step(torch.nn.Module):
    """A decode step's shape: a parameter read in place, a state buffer written in place, the token fed back."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.register_buffer("state", trand(1, D) * 0.1)

    def forward(self, tok, pos):
        self.state.add_(pos)
        return torch.tanh(self.lin(tok) + self.state)


@pytest.fixture
def served(monkeypatch):
    """The indices (``served.i`` at the time) of the calls the prepared replay serves."""

    class Served(list):
        i = 0

    got = Served()
    real = manager_mod.call_of
    monkeypatch.setattr(manager_mod, "call_of", lambda p, args, ptrs: got.append(got.i) or real(p, args, ptrs))
    return got


def _pair(name: str):
    """A ``Step``, its eager copy and the step compiled with the backend (graphed whole)."""
    m = Step().cuda()
    ref = copy.deepcopy(m)
    return m, ref, torch.compile(m, backend="cgraw", options={"name": name})


class Loop:
    """``tok = step(tok, positions[i:i + 1])`` for the compiled step and its eager copy, every
    token and state compared; ``served.i`` counts the calls."""

    def __init__(self, name: str, served):
        self.m, self.ref, self.c = _pair(name)
        self.name, self.served = name, served
        self.positions = trand(64, 1) * 0.1
        self.tok = self.tok_ref = trand(1, D)

    def run(self, n: int) -> list:
        """``n`` steps; their call indices."""
        out = []
        with torch.no_grad():
            for _ in range(n):
                i = self.served.i
                pos = self.positions[i:i + 1]  # a new address at every step
                self.tok = self.c(self.tok, pos)
                self.tok_ref = self.ref(self.tok_ref, pos)
                torch.testing.assert_close(self.tok, self.tok_ref, **TOL, msg=lambda m, i=i: f"call {i}: {m}")
                torch.testing.assert_close(self.m.state, self.ref.state, **TOL)
                out.append(i)
                self.served.i += 1
        return out

    def whole(self):
        """The stats of the step's one whole graph (a second one would be a recompile)."""
        (s,) = [s for n, s in sc.graphed_pieces(self.name).items() if n.endswith("/whole graph")]
        return s


def test_a_moved_parameter_is_read_at_its_new_address_by_the_prepared_replay(served):
    loop = Loop("moved", served)
    first = loop.run(6)
    assert set(first[2:]) <= set(served), served  # warm-up, recording, a replay that prepares; then served
    with torch.no_grad():
        for mod in (loop.m, loop.ref):
            mod.lin.weight.data = mod.lin.weight.data * 0.5  # same Parameter, new address: no recompile
    before = loop.whole().rerecords + loop.whole().recordings
    after = loop.run(6)
    s = loop.whole()
    assert s.rerecords + s.recordings > before, s  # the node was recorded again for the new address
    assert after[0] not in served and set(after[2:]) <= set(served), (after, served)
    assert s.eager_calls == 0, s.skip_reasons


def test_a_switched_setting_that_chooses_kernels_records_its_own_node_and_switching_back_replays_the_first(served):
    """``allow_fp16_accumulation`` is read by cgraw's settings id but not by dynamo's guards: the
    compiled frame stays, and the prepared replay must not serve a call made under other settings."""
    matmul = torch.backends.cuda.matmul
    assert hasattr(matmul, "allow_fp16_accumulation"), "this torch has no allow_fp16_accumulation"
    loop = Loop("switch", served)
    loop.run(5)
    recordings = loop.whole().recordings
    prev = matmul.allow_fp16_accumulation
    try:
        matmul.allow_fp16_accumulation = not prev
        switched = loop.run(4)
    finally:
        matmul.allow_fp16_accumulation = prev
    s = loop.whole()  # one whole graph: dynamo did not recompile
    assert s.recordings == recordings + 1, s  # a node of its own for the other settings
    assert switched[0] not in served, served
    back = loop.run(4)
    assert loop.whole().recordings == recordings + 1  # switching back replays the first node
    assert set(back[2:]) <= set(served), (back, served)


def test_calls_while_a_backward_is_pending_take_the_generic_path_and_gradients_equal_eager(served):
    """A compiled training forward leaves its backward pending from its first call (its backward reads
    the forward piece's outputs); the whole graph's calls meanwhile begin no step, so those outputs
    stay valid and the gradients equal eager's; after the backward they are served again."""
    loop = Loop("pending", served)
    net = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.GELU(), torch.nn.Linear(D, 1)).cuda()
    net_ref = copy.deepcopy(net)
    train = torch.compile(net, backend="cgraw", options={"name": "pending-train"})
    loop.run(4)
    pending = []
    for k in range(5):
        x = trand(8, D)
        loss = train(x).sum()
        loss_ref = net_ref(x).sum()
        torch.testing.assert_close(loss, loss_ref, **TOL)
        pending += loop.run(1)
        for mod in (net, net_ref):
            mod.zero_grad(set_to_none=True)
        loss.backward()
        loss_ref.backward()
        for p, q in zip(net.parameters(), net_ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL)
    later = loop.run(5)
    assert not set(pending) & set(served), (pending, served)
    assert set(later[1:]) <= set(served), (later, served)
    assert loop.whole().eager_calls == 0


def test_a_call_whose_token_shares_memory_with_the_written_state_computes_what_inductor_computes(served):
    """The step writes its state in place; a call given a view of that state as its token. The
    backend must compute what the same model compiled by Inductor without cgraw computes (which
    path dynamo, AOT autograd and cgraw take for such a call is theirs to choose); the plain calls
    after it equal eager's and are served by the prepared replay again."""
    loop = Loop("shared", served)
    plain = copy.deepcopy(loop.ref)
    inductor = torch.compile(plain)  # the reference for compiled semantics: Inductor, no graphs
    loop.run(5)
    with torch.no_grad():
        for i in range(5):  # compiled on plain calls first, as the backend's step was
            inductor(trand(1, D), loop.positions[i:i + 1])
        plain.load_state_dict(loop.ref.state_dict())  # in place: the state the others have now
        for _ in range(3):
            i = served.i
            pos = loop.positions[i:i + 1]
            got = loop.c(loop.m.state.view(1, D), pos)
            want = inductor(plain.state.view(1, D), pos)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, i=i: f"call {i}: {m}")
            torch.testing.assert_close(loop.m.state, plain.state, **TOL)
            served.i += 1
        loop.ref.load_state_dict(plain.state_dict())
        loop.tok, loop.tok_ref = got.clone(), want.clone()
    later = loop.run(5)
    assert set(later[2:]) <= set(served), (later, served)
