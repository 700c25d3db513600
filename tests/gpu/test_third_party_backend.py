"""GPU tier: ``torch.compile(model, backend="cgraw")`` on code nobody here wrote, the models of
``benchmarks/models.py`` built from configs with random weights: transformers GPT-2 (batch 1 and
8), Llama greedy decoding with a ``StaticCache`` and transformers' ``generate`` with a static cache
made inside the compiled forward, torchvision ResNet-18 (inference and a whole
training step with SGD and momentum), timm ViT-tiny. Inference runs by partitions and with
``options={"whole_graph": True}``. Every result is compared with eager's on fresh inputs (the
training step's with Inductor's without graphs), and the compiled code's graphed pieces must
have recorded and replayed (a silent fallback to Inductor's code without graphs fails)."""

from __future__ import annotations

import importlib
import io

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.third_party, pytest.mark.usefixtures("fresh_trees", "fresh_dynamo")]
torch = pytest.importorskip("torch")

import compile_scenarios as sc  # noqa: E402

models = importlib.import_module("benchmarks.models")
graphed_mod = importlib.import_module("cgraw.trees.graphed")

CALLS = 5
TOL = {"rtol": 1e-3, "atol": 1e-3}  # Inductor's fused kernels against eager's, float32, TF32 off


def _compile(fn, name: str, whole: bool):
    return torch.compile(fn, backend="cgraw", dynamic=False, options={"name": name, "whole_graph": whole})


def _assert_replayed(prefix: str, whole: bool, replays: int) -> dict:
    pieces = sc.graphed_pieces(prefix)
    report = graphed_mod.report(file=io.StringIO())
    assert pieces, f"no graphed piece of {prefix}\n{report}"
    for name, s in pieces.items():
        assert s.eager_calls == 0 and not s.skip_reasons, (name, s.skip_reasons, report)
        assert s.recordings >= 1 and s.replays >= replays, (name, s, report)
    if whole:  # dynamo's graphs of the model: at least one graphed whole
        assert any(n.endswith("/whole graph") for n in pieces), (list(pieces), report)
    return pieces


@pytest.mark.parametrize("whole", [False, True], ids=["partitions", "whole_graph"])
@pytest.mark.parametrize("workload", ["gpt2_b1", "gpt2_b8", "resnet18_b8", "vit_tiny_b8"])
def test_an_inference_model_compiled_with_the_backend_equals_eager(workload, whole):
    wl = models._build(workload)
    name = f"{workload}_{int(whole)}"
    c = _compile(wl.fn, name, whole)
    for _ in range(CALLS):
        xs = wl.inputs()
        torch.testing.assert_close(c(*xs), wl.fn(*xs), **TOL)
    _assert_replayed(name, whole, CALLS - 2)


@pytest.mark.parametrize("whole", [False, True], ids=["partitions", "whole_graph"])
def test_llama_greedy_decoding_with_a_static_cache_gives_eagers_tokens(whole):
    wl = models._build("llama_decode")
    ref = wl.reference_tokens()
    cache = wl.new_cache()
    name = f"llama_{int(whole)}"
    c = _compile(wl.step, name, whole)
    for _ in range(3):  # the compile, warm-up and recording, then decodes that only replay
        got = models._decode(lambda tok, pos: c(tok, pos, cache), wl.prefill(cache), wl.positions, collect=True)
        assert got == ref
    _assert_replayed(name, whole, 2 * len(wl.positions))


def test_a_resnet18_training_step_compiled_with_the_backend_equals_inductors():
    """Forward and backward compiled (their partitions graphed), cross-entropy and SGD with momentum
    eager, gradients set to None between steps (they are outputs of the backward's graph); after
    each step the loss and every parameter equal those of a copy compiled by Inductor without
    graphs (Inductor's training numerics differ from eager's by more than the graphs', which
    ``benchmarks/models.py`` measured: 0.0076 in a gradient)."""
    wl = models._build("resnet18_train")
    # cuDNN's deterministic algorithms for both (TF32 stays off, as ``fresh_dynamo`` set it; the
    # flags would otherwise turn it on): with cuDNN free to choose (an algorithm per call, which a
    # recording and the reference's calls may choose apart, some with atomics) the first
    # convolution's weights differed by up to 6e-4 after a step on an H200, the loss equal
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        step = wl.new_step(lambda m: _compile(m, "resnet_train", True), set_to_none=True)
        ref = wl.new_step(lambda m: torch.compile(m, dynamic=False), set_to_none=True)
        for _ in range(CALLS):
            x, y = wl.inputs()
            torch.testing.assert_close(step(x, y), ref(x, y), rtol=1e-4, atol=1e-5)
            for p, q in zip(step.model.parameters(), ref.model.parameters(), strict=True):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)
    pieces = _assert_replayed("resnet_train", False, CALLS - 2)
    assert any(" forward/partition" in n for n in pieces) and any(" backward/partition" in n for n in pieces), pieces


@pytest.mark.parametrize("whole", [False, True], ids=["partitions", "whole_graph"])
def test_generate_with_a_static_cache_made_inside_the_compiled_forward_gives_eagers_tokens(whole):
    """transformers' ``generate(cache_implementation="static")`` with the model's forward compiled:
    the prefill's compile makes the cache (lazily, inside the compiled forward) and hands it out; the
    decode compile writes it in place at every token, and past ``cgraw.config.path_repeat_limit``
    tokens its calls begin the steps. The cache is never invalidated (reading it raised), and the
    tokens of two generations equal eager's."""
    import copy

    import cgraw

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).cuda().eval()
    ref = copy.deepcopy(model)
    name = f"generate_{int(whole)}"
    model.forward = _compile(model.forward, name, whole)
    new = cgraw.config.path_repeat_limit + 8
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True)  # (not transformers' own compile)
    for _ in range(2):
        ids = torch.randint(1, cfg.vocab_size, (1, 6), device="cuda")
        assert torch.equal(model.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))
    pieces = sc.graphed_pieces(name)
    assert sum(s.replays for s in pieces.values()) >= new, pieces
