"""GPU tier: ``torch.compile(model, backend="cgraw")``. An inference graph of one partition is one
graphed function as a whole; other graphs' partitions (and every partition under
``options={"whole_graph": False}``) are graphed functions of cgraw's tree (warmed up, recorded,
replayed; named in ``cgraw.report()``). Their recordings hold Triton kernels, what Inductor cuts
out (a ``cudagraph_unsafe`` custom op, ``.item()``, ``nonzero``) runs between graphed pieces,
training graphs forward and backward, dynamic shapes record per shape, results equal eager on
fresh random inputs, the backend is found without ``import cgraw``, and a default
``torch.compile`` in the same process is untouched."""

from __future__ import annotations

import contextlib
import importlib
import re
import subprocess
import sys
import textwrap

import pytest
from gpu_data import trand

import cgraw

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees", "fresh_dynamo")]
torch = pytest.importorskip("torch")

import compile_scenarios as sc  # noqa: E402

graphed_mod = importlib.import_module("cgraw.trees.graphed")

CALLS = 6
TOL = {"rtol": 1e-4, "atol": 1e-4}  # Inductor's fused kernels against eager's, float32, TF32 off


def _assert_replayed(parts: dict, calls: int = CALLS):
    assert parts, "no partition ran as a graphed function\n" + _diagnosis()
    for name, s in parts.items():
        assert s.eager_calls == 0 and not s.skip_reasons, (name, s.skip_reasons, _diagnosis())
        assert s.recordings >= 1 and s.replays >= calls - 2, (name, s, _diagnosis())


def _diagnosis() -> str:
    """What a failure needs to be understood from a log: cgraw's report and dynamo's compiles."""
    import io

    return (graphed_mod.report(file=io.StringIO()) + f"\ndynamo: {dict(torch._dynamo.utils.counters['stats'])}"
            + f", recompiles: {dict(torch._dynamo.utils.counters['recompiles'])}")


def _mlp(d_in=64, d_hidden=128, d_out=32):
    return torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.ReLU(),
                               torch.nn.Linear(d_hidden, d_hidden), torch.nn.GELU(),
                               torch.nn.Linear(d_hidden, d_out)).cuda()


def _mlp_calls_equal_eager(name: str, calls: int = CALLS, **options) -> None:
    """``calls`` calls of ``_mlp()`` compiled with the backend (``name``, ``options``) under
    ``torch.no_grad()``, on fresh inputs, each equal to eager's."""
    m = _mlp()
    c = torch.compile(m, backend="cgraw", options={"name": name, **options})
    with torch.no_grad():
        for _ in range(calls):
            x = trand(16, 64)
            torch.testing.assert_close(c(x), m(x), **TOL)


def test_mlp_inference_partitions_replay_and_equal_eager_with_whole_graph_off():
    _mlp_calls_equal_eager("mlp", whole_graph=False)
    parts = sc.graphed_pieces("mlp")
    _assert_replayed(parts)
    assert all(re.fullmatch(r"mlp \[\d+/\d+\] (inference|forward)/partition \d+ of \d+", n) for n in parts), parts
    text = cgraw.report()
    for n in parts:
        assert n in text


@pytest.mark.parametrize("whole", [True, False], ids=["whole graph", "partitions"])
def test_a_model_called_under_inference_mode_replays_and_equals_eager(whole):
    """``torch.inference_mode()``, the serving default: the recording's outputs are inference
    tensors, which have no version counter; a piece of two outputs hands out new objects over
    them at every replay (reading the counter raised where eager runs)."""

    class TwoOutputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 128), torch.nn.Linear(128, 32)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h), h

    m = TwoOutputs().cuda()
    c = torch.compile(m, backend="cgraw", options={"name": "served", "whole_graph": whole})
    for _ in range(CALLS):
        with torch.inference_mode():
            x = trand(16, 64)
            for got, want in zip(c(x), m(x), strict=True):
                torch.testing.assert_close(got, want, **TOL)
    _assert_replayed(sc.graphed_pieces("served"))


def _kernels(names) -> list[str]:
    mgr = graphed_mod._managers[0]
    return [k.kernel for n in mgr.nodes() if n.fn.name in names and n.recording is not None
            for k in n.recording.graph.nodes() if k.kernel is not None]


def test_recorded_partitions_hold_triton_kernels():
    _mlp_calls_equal_eager("kern", 3)
    names = _kernels(set(sc.graphed_pieces("kern")))
    assert any("triton" in k for k in names), names  # Inductor's fused bias + activation kernels
    assert not any("at6native" in k or "at::native" in k for k in names), names  # no eager ATen elementwise


@torch.library.custom_op("cgrawtest::host_scale", mutates_args=(), tags=(torch._C.Tag.cudagraph_unsafe,))
def host_scale(x: torch.Tensor) -> torch.Tensor:
    return (x.cpu() * 2.0).to(x.device)  # a host round trip: no graph can hold it


@host_scale.register_fake
def _(x):
    return torch.empty_like(x)


class CutModel(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a = torch.nn.Linear(64, 128)
        self.b = torch.nn.Linear(128, 32)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.kind == "unsafe_op":
            h = host_scale(h) + 1.0
        elif self.kind == "item":
            if h.sum().item() < 0:  # never: a sum of relu outputs; dynamo breaks the graph at .item()
                h = -h
        elif self.kind == "nonzero":
            n = (h >= 0).nonzero().shape[0]  # every element: the count is the same on every call
            h = h * (n / h.numel())
        return torch.tanh(self.b(h))


def _last_compiles(parts: dict) -> list:
    """``[(pieces of a dynamo frame's last compile, calls it saw at least)]``. dynamo recompiles a
    frame whose guard fails: the frame resumed after ``.item()`` guards on the value it read (on the
    CPU, with TORCH_LOGS=recompiles: ``___stack0 == 455.59...``), so its first compile runs once and
    its second, with the value symbolic, runs from then on; each compile takes at least one call."""
    frames: dict = {}
    for n, s in parts.items():
        frame, compile_ = (int(v) for v in re.search(r"\[(\d+)/(\d+)\]", n).groups())
        frames.setdefault(frame, {}).setdefault(compile_, {})[n] = s
    return [(by_compile[max(by_compile)], CALLS - max(by_compile)) for by_compile in frames.values()]


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("kind", ["unsafe_op", "item", "nonzero"])
def test_a_cut_in_the_middle_leaves_both_sides_graphed(kind, whole):
    """With ``whole_graph`` on, dynamo's graphs on either side of a break may each be graphed whole;
    a graph Inductor cuts (around the unsafe op) never is."""
    m = CutModel(kind).cuda()
    name = f"cut_{kind}_{'whole' if whole else 'parts'}"  # one name per case: a repeated one gets "#2" in the report
    c = torch.compile(m, backend="cgraw", options={"name": name, "whole_graph": whole})
    with torch.no_grad():
        for _ in range(CALLS):
            x = trand(16, 64)
            torch.testing.assert_close(c(x), m(x), **TOL)
    parts = sc.graphed_pieces(name)
    for frame_parts, calls in _last_compiles(parts):
        _assert_replayed(frame_parts, calls)
    if kind == "unsafe_op":  # one dynamo graph cut by Inductor around the op: two pieces, never one whole graph
        assert len(parts) == 2 and all(n.endswith(("partition 0 of 2", "partition 1 of 2")) for n in parts), parts
    else:  # dynamo breaks the graph (or Inductor cuts it): a piece before and a piece after
        assert len(parts) >= 2, parts
    text = cgraw.report()
    for n in parts:
        assert n in text


def test_training_step_graphs_forward_and_backward():
    torch.manual_seed(0)
    m = _mlp()
    ref = _mlp()
    ref.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="cgraw", options={"name": "train", "whole_graph": True})
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for _ in range(CALLS):
        x, y = trand(16, 64), trand(16, 32)
        losses = []
        for o, run in ((opt, c), (ref_opt, ref)):
            o.zero_grad(set_to_none=True)  # the SGD step runs eagerly
            loss = torch.nn.functional.mse_loss(run(x), y)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=1e-5)
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=1e-4)
    parts = sc.graphed_pieces("train")
    _assert_replayed(parts)
    assert any(" forward/partition" in n for n in parts), parts
    assert any(" backward/partition" in n for n in parts), parts
    assert not _whole("train"), parts  # a training graph keeps its partitions


def test_a_training_forward_piece_hands_out_its_output_objects_again_and_a_held_one_is_poisoned():
    """The forward piece's outputs (the activations its backward reads, the prediction) are the same
    objects at every step while nothing holds them (``trees.outputs.Reuse``); the backward's
    gradients are new tensors at every step. A prediction kept past its step is poisoned, and the
    step after it makes new objects; every step's loss and parameters equal eager's."""
    torch.manual_seed(0)
    m, ref = _mlp(), _mlp()
    ref.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="cgraw", options={"name": "reuse", "whole_graph": False})
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    kept = None
    for step in range(2 * CALLS):
        x, y = trand(16, 64), trand(16, 32)
        losses = []
        for o, run in ((opt, c), (ref_opt, ref)):
            o.zero_grad(set_to_none=True)
            pred = run(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            loss.backward()
            o.step()
            losses.append(loss.detach())
            if run is c and step == CALLS:
                kept = pred  # held past its step
        del pred
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=1e-5)
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=1e-4)
    with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
        kept + 0
    parts = sc.graphed_pieces("reuse")
    _assert_replayed(parts, 2 * CALLS)
    nodes = [n for n in graphed_mod.tree_here(0).nodes() if n.fn.name.startswith("reuse [") and n.recording]
    forward = [n.recording.reuse for n in nodes if " forward/partition" in n.fn.name]
    backward = [n.recording.reuse for n in nodes if " backward/partition" in n.fn.name]
    assert forward and backward and all(r is None for r in backward), nodes
    # made at the first replay, again after the held prediction: twice, not once per step
    assert all(r is not None and r.made <= 3 for r in forward), [r and r.made for r in forward]


def test_gradient_accumulation_equals_eager_and_its_second_forward_runs_as_compiled():
    """Two micro-batches, then one backward: the second forward of each step begins while the
    first one's backward is pending, so it runs as Inductor compiled it (graphed, it would reuse
    the memory of the first one's saved activations); the gradients equal eager's."""
    torch.manual_seed(0)
    m = _mlp()
    ref = _mlp()
    ref.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="cgraw", options={"name": "accum"})
    for _ in range(CALLS):
        xs, ys = [trand(16, 64) for _ in range(2)], [trand(16, 32) for _ in range(2)]
        grads = []
        for run, model in ((c, m), (ref, ref)):
            model.zero_grad(set_to_none=True)
            loss = sum(torch.nn.functional.mse_loss(run(x), y) for x, y in zip(xs, ys))
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for g, r in zip(*grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-5)
    assert "runs as Inductor compiled it, without graphs, until a backward runs" in cgraw.report()
    parts = sc.graphed_pieces("accum")
    assert any(" backward/partition" in n and s.replays >= 1 for n, s in parts.items()), parts


def test_dynamic_batch_records_per_shape():
    m = _mlp()
    c = torch.compile(m, backend="cgraw", options={"name": "dyn", "whole_graph": True})
    with torch.no_grad():
        for i in range(2 * CALLS):
            x = trand(8 if i % 2 else 16, 64)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(c(x), m(x), **TOL)
    parts = sc.graphed_pieces("dyn")
    # dynamic sizes, under whole_graph too: partitions, which take the sizes as arguments
    assert parts and not _whole("dyn"), parts
    for name, s in parts.items():
        assert s.eager_calls == 0 and not s.skip_reasons, (name, s.skip_reasons)
        assert s.recordings >= 2 and s.replays >= 1, (name, s)  # one recording per batch size


def test_cupy_through_dlpack_inside_the_compiled_model():
    cp = pytest.importorskip("cupy")

    class WithCupy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64)
            self.b = torch.nn.Linear(64, 16)

        def forward(self, x):
            h = self.a(x)
            h = torch.from_dlpack(cp.tanh(cp.from_dlpack(h.contiguous())) * 3.0)  # dynamo breaks the graph here
            return self.b(h)

    m = WithCupy().cuda()
    c = torch.compile(m, backend="cgraw", options={"name": "cupy"})
    with torch.no_grad():
        for _ in range(CALLS):
            x = trand(16, 64)
            torch.testing.assert_close(c(x), m(x), **TOL)
    _assert_replayed(sc.graphed_pieces("cupy"))


def test_default_compile_in_the_same_process_is_untouched():
    from cgraw.interop.torch import private_api

    m = _mlp()
    c = torch.compile(m, backend="cgraw", options={"name": "first"})
    with torch.no_grad():
        for _ in range(3):
            x = trand(16, 64)
            torch.testing.assert_close(c(x), m(x), **TOL)
        assert private_api.partition_wrapper_slot().wrapper is None
        n_before = len(graphed_mod._managers[0].stats)
        d = torch.compile(_mlp())
        for _ in range(3):
            x = trand(16, 64)
            torch.testing.assert_close(d(x), d._orig_mod(x), **TOL)
        assert len(graphed_mod._managers[0].stats) == n_before  # no graphed function made for it


def test_backend_found_without_importing_cgraw():
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
        assert "cgraw" not in sys.modules
        c = torch.compile(m, backend="cgraw", options={"name": "fresh"})  # found through the entry point
        with torch.no_grad():
            for _ in range(5):
                x = torch.randn(4, 32, device="cuda")
                torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
        import cgraw
        text = cgraw.report()
        assert "fresh [0/0] inference/whole graph: 1 recording(s)" in text, text
        print("ok")
    """)
    _runs_in_a_fresh_process(code)


def test_a_compile_that_restarts_dynamos_analysis_in_a_fresh_process_equals_eager():
    """The process's first compile installs the hooks a tree watches module assignments with; a
    compile that restarts dynamo's analysis (``dynamic=True`` and a float module attribute that
    ``layer_norm``'s ``eps`` specializes) replays a trace that slices a ``ModuleList``, which runs
    those hooks: the replay meets the hooks the first trace met. The other float attribute stays
    symbolic: dynamo passes it as a 0-d CPU tensor, whose new value must reach the kernels."""
    code = textwrap.dedent("""
        import torch
        from torch._dynamo.utils import counters

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])
                self.eps, self.scale = 1e-5, 0.5

            def forward(self, x):
                for layer in self.layers[:2]:
                    x = torch.nn.functional.layer_norm(torch.relu(layer(x)) * self.scale, (64,), eps=self.eps)
                return x

        m = Net().cuda()
        c = torch.compile(m, backend="cgraw", dynamic=True, options={"name": "restarted"})
        with torch.no_grad():
            for rows, scale in ((3, 0.5), (5, 0.5), (7, 0.5), (5, 0.5), (3, 0.5), (5, 0.5), (3, 2.0), (5, 3.0)):
                m.scale = scale
                x = torch.randn(rows, 64, device="cuda")
                torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
        aot = counters["aot_autograd"]
        assert aot["total"] == aot["ok"] + 1, f"no restart of dynamo's analysis: {dict(aot)}"
        import cgraw
        text = cgraw.report()
        assert "restarted [0/0] inference/partition" in text, text
        print("ok")
    """)
    _runs_in_a_fresh_process(code)


def _runs_in_a_fresh_process(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")


def _cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)).cuda()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_conv_batchnorm_training_step_equals_eager(layout):
    """Inductor lays convolution outputs out channels_last for training; the backward must be
    compiled for the strides the forward gave its saved activations (the ResNet-18 training step
    failed a stride assertion at its first backward)."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    m = _cnn().to(memory_format=fmt)
    ref = _cnn().to(memory_format=fmt)
    ref.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="cgraw", options={"name": f"cnn_{layout}"})
    opt, ref_opt = (torch.optim.SGD(p.parameters(), lr=0.01) for p in (m, ref))
    for _ in range(CALLS):
        x, y = trand(8, 3, 16, 16).to(memory_format=fmt), trand(8, 10)
        for o, run in ((opt, c), (ref_opt, ref)):
            o.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(run(x), y).backward()
            o.step()
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=1e-3)
    parts = sc.graphed_pieces(f"cnn_{layout}")
    _assert_replayed(parts)
    assert any(" backward/partition" in n for n in parts), parts


def test_gradient_accumulation_after_a_recompile_equals_eager():
    """The second compile of a training graph (after ``torch._dynamo.reset()``, or in another
    process) must still tell its forward from its backward: AOT autograd's cache, which would serve
    it without saying, is off for the backend's compiles. Gradients of two micro-batches equal eager's."""
    torch.manual_seed(0)
    m = _mlp()
    ref = _mlp()
    ref.load_state_dict(m.state_dict())
    for attempt in range(2):
        torch._dynamo.reset()
        c = torch.compile(m, backend="cgraw", options={"name": f"again{attempt}"})
        for _ in range(3):
            xs, ys = [trand(16, 64) for _ in range(2)], [trand(16, 32) for _ in range(2)]
            grads = []
            for run, model in ((c, m), (ref, ref)):
                model.zero_grad(set_to_none=True)
                sum(torch.nn.functional.mse_loss(run(x), y) for x, y in zip(xs, ys)).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for g, r in zip(*grads, strict=True):
                torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-5)
        parts = sc.graphed_pieces(f"again{attempt}")
        assert any(" forward/partition" in n for n in parts), parts
        assert any(" backward/partition" in n for n in parts), parts


class Decoder(torch.nn.Module):
    """A decode step with a static key-value cache written at a position tensor."""

    def __init__(self, d=64, max_len=32, vocab=128):
        super().__init__()
        self.d, self.max_len = d, max_len
        self.emb = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, vocab)
        self.register_buffer("k_cache", torch.zeros(1, max_len, d))
        self.register_buffer("v_cache", torch.zeros(1, max_len, d))

    def forward(self, tok, pos):
        q, k, v = self.qkv(self.emb(tok)).chunk(3, dim=-1)
        self.k_cache.index_copy_(1, pos, k)
        self.v_cache[:, pos] = v
        att = (q @ self.k_cache.transpose(1, 2)) / self.d ** 0.5
        att = att.masked_fill(torch.arange(self.max_len, device=pos.device) > pos, float("-inf")).softmax(-1)
        return self.out(att @ self.v_cache).argmax(-1)


DECODE_STEPS = 16


def _decode_against_eager(name: str, whole: bool):
    """``DECODE_STEPS`` steps of ``tok = step(tok, pos)`` compiled with the backend (``name``,
    ``whole_graph=whole``), each token against an eager copy's; the compiled model and the copy."""
    torch.manual_seed(0)
    m = Decoder().cuda()
    ref = Decoder().cuda()
    ref.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="cgraw", options={"name": name, "whole_graph": whole})
    with torch.no_grad():
        tok = torch.randint(0, 128, (1, 1), device="cuda")
        for i in range(DECODE_STEPS):
            pos = torch.tensor([i], device="cuda")
            want = ref(tok, pos)  # eager on the same token (an output of the compiled step)
            tok = c(tok, pos)  # fed its own previous output
            torch.testing.assert_close(tok, want)
    return m, ref


def test_a_decode_loop_fed_its_own_token_replays_every_step():
    """``tok = step(tok, pos)``, the step writing its cache in place: every step after the recording
    replays (a call fed its previous output ran eagerly whenever it wrote any input)."""
    m, ref = _decode_against_eager("decode", False)
    torch.testing.assert_close(m.k_cache, ref.k_cache, **TOL)
    _assert_replayed(sc.graphed_pieces("decode"), DECODE_STEPS)


def _buffer_steps_against_eager(cls, name: str, buffer: str, **options) -> dict:
    """``CALLS`` calls of module ``cls`` compiled with the backend (``options``), each output and
    ``buffer`` after each call against an eager copy's; the graphed pieces named ``name``."""
    torch.manual_seed(0)
    m = cls().cuda()
    ref = cls().cuda()
    ref.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="cgraw", options={"name": name, **options})
    with torch.no_grad():
        for _ in range(CALLS):
            x = trand(16, 64)
            torch.testing.assert_close(c(x), ref(x), **TOL)
            torch.testing.assert_close(getattr(m, buffer), getattr(ref, buffer), **TOL)
    return sc.graphed_pieces(name)


@pytest.mark.parametrize("whole", [True, False])
def test_a_step_assigning_a_module_buffer_compiles_once_and_replays(monkeypatch, whole):
    """dynamo guards a frame that assigns a module attribute on torch.nn.Module's registration
    hooks; cgraw's are installed before the guards are built, so the frame compiles once and its
    partition replays (the Llama decode step compiled twice, its first compile's piece ran once).
    The buffer is a static input of the graph (dynamo marks module buffers so); from the second
    call on it holds the partition's output, memory of the tree's pool, so the recording takes it
    as an eager input (copied out of the pool first): no re-record. The same as one whole graph
    (``whole_graph`` on) and as its partition."""
    import collections

    from cgraw.interop.torch import observe

    module = torch.nn.modules.module
    for name in ("_global_buffer_registration_hooks", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks"):
        monkeypatch.setattr(module, name, collections.OrderedDict())  # as before any tree is made
    monkeypatch.setattr(observe, "_hooks_installed", [False])

    class Steps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen = self.seen + 1  # a buffer assigned, not written in place
            return self.lin(x) * self.seen

    parts = _buffer_steps_against_eager(Steps, f"steps{int(whole)}", "seen", whole_graph=whole)
    piece = "inference/whole graph" if whole else "inference/partition 0 of 1"
    assert list(parts) == [f"steps{int(whole)} [0/0] {piece}"], parts
    _assert_replayed(parts)
    (s,) = parts.values()
    assert s.rerecords == 0, (s.rerecord_reasons, _diagnosis())


@pytest.mark.parametrize("whole", [True, False])
def test_a_buffer_in_the_pool_that_the_graph_writes_in_place_equals_eager(whole):
    """A module buffer that the graph both writes in place and assigns a new tensor: from the
    second call on it holds the graph's output (the tree's pool). Graphed whole (the default) the
    call stages the buffer into the recording's copy and copies the graph's write back into it
    after the replay, so the piece replays. By partitions, a partition's copy out of the pool would
    take the graph's write instead of the buffer: the recording refuses the piece, which runs as
    Inductor compiled it, with the reason in ``report()``. Every output and the buffer equal
    eager's either way."""

    class Decay(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.register_buffer("acc", torch.zeros(64))

        def forward(self, x):
            self.acc.mul_(0.5)  # written in place
            y = self.lin(x) + self.acc
            self.acc = self.acc + y.mean(0)  # and assigned the piece's output
            return y

    parts = _buffer_steps_against_eager(Decay, f"decay{int(whole)}", "acc", whole_graph=whole)
    if whole:
        assert list(parts) == [f"decay{int(whole)} [0/0] inference/whole graph"], parts
        _assert_replayed(parts)
    else:
        reasons = [r for s in parts.values() for r in s.skip_reasons]
        assert any("which it writes in place" in r for r in reasons), (reasons, _diagnosis())


@pytest.mark.parametrize("partitions", ["all", "none"])
def test_an_input_written_in_place_at_an_unaligned_offset_equals_eager(partitions):
    """Compiled for an aligned input, called with one starting 4 bytes into its storage, which the
    graph writes in place: Inductor's kernels assume 16-byte alignment, and its ``post_compile``
    realigns such inputs, except once a partition wrapper is installed; the backend realigns them
    itself. Graphed (the input is copied into the recording's placeholder) or left out by
    ``options['partitions']`` (run as Inductor compiled it), the results equal eager's."""

    def f(x):
        x.mul_(2.0)
        return x + 1.0

    opts = {"name": f"unaligned_{partitions}"}
    if partitions == "none":
        opts["partitions"] = []
    c = torch.compile(f, backend="cgraw", dynamic=False, options=opts)
    for i in range(CALLS):
        base = trand(257)
        x = base[1:] if i % 2 else base[:256]  # unaligned, then aligned, alternately
        ref = x.clone()
        torch.testing.assert_close(c(x), f(ref), **TOL)
        torch.testing.assert_close(x, ref, **TOL)


# ---------------------------------------------------------------- inference graphs graphed whole (the default)


def _whole(prefix: str) -> dict:
    """``{name: FunctionStats}`` of the compiled code named ``prefix`` graphed as a whole."""
    return {n: s for n, s in sc.graphed_pieces(prefix).items() if n.endswith("/whole graph")}


def test_an_inference_graph_of_one_partition_replays_as_one_whole_graph_and_equals_eager():
    _mlp_calls_equal_eager("mlpw", whole_graph=True)
    whole = _whole("mlpw")
    assert all(re.fullmatch(r"mlpw \[\d+/\d+\] inference/whole graph", n) for n in whole), whole
    _assert_replayed(whole)
    assert sc.graphed_pieces("mlpw") == whole, "the partition ran through the tree besides the whole graph\n" + _diagnosis()


def test_a_decode_loop_writing_its_cache_in_place_replays_whole_and_equals_eager():
    """The step writes its module buffers (the cache) in place: the whole graph reads and writes them
    where they are, and every step after the recording replays."""
    m, ref = _decode_against_eager("decodew", True)
    torch.testing.assert_close(m.k_cache, ref.k_cache, **TOL)
    torch.testing.assert_close(m.v_cache, ref.v_cache, **TOL)
    _assert_replayed(_whole("decodew"), DECODE_STEPS)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(64, 3 * 64)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).sum(1)


@torch.library.custom_op("cgrawtest::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).contiguous()  # runs unseen


@attend.register_fake
def _(q, k, v):
    return q.new_empty(q.shape)


class CustomAttention(Attention):
    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        return attend(q, k, v).sum(1)


@pytest.mark.parametrize("custom", [False, True], ids=["aten op", "inside a custom op"])
def test_switching_attention_backends_runs_what_inductor_computes(custom):
    """Inductor lowers attention to the op of the backend the flags chose when it compiled, so its
    code does not read them when it runs: the backend's whole graph is not recorded again under
    other flags. A custom op it calls as it is, and the attention inside reads the flags at each
    call: the whole graph is recorded under each. Either way it equals Inductor's own code
    (compiled beside it) under each flag."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = (CustomAttention() if custom else Attention()).cuda().half()
    name = "cattn" if custom else "attn"
    c = torch.compile(m, backend="cgraw", options={"name": name})
    ind = torch.compile(m)  # Inductor without graphs: what the backend's graph must compute
    with torch.no_grad():
        x = trand(2, 128, 64).half()
        with sdpa_kernel(SDPBackend.MATH):
            math = m(x)
        assert not torch.equal(m(x), math), "the attention backends' results do not differ here"
        for state in [contextlib.nullcontext, lambda: sdpa_kernel(SDPBackend.MATH)] * 3:
            with state():
                x = trand(2, 128, 64).half()
                torch.testing.assert_close(c(x), ind(x), rtol=0, atol=0)
    whole = _whole(name)
    _assert_replayed(whole, calls=4 if custom else CALLS)
    recordings = 2 if custom else 1
    assert [s.recordings for s in whole.values()] == [recordings] * len(whole), (whole, _diagnosis())
