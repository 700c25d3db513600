"""CPU tier on code nobody here wrote: transformers models built from small configs (random
weights), graphed through the real ``TreeManager`` on the CPU graph emulator
(``tests/helpers/cpu_graph.py``: a replay runs the recorded aten ops, not the Python), compared
bitwise with eager on new inputs at every call. Needs torch and transformers."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cpu_graph import CpuGraphBackend  # noqa: E402
from torch_cpu_backend import TorchFn, cpu_tree  # noqa: E402

pytestmark = pytest.mark.torch
V = 101  # vocabulary of every model here


def _ids(batch: int, length: int, seed: int):
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def _equal(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{what}[{i}]")
    elif hasattr(a, "to_tuple"):
        _equal(a.to_tuple(), b.to_tuple(), what)
    else:
        assert a == b, what


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, max_position_embeddings=64))


def _generating_llama():
    """A small Llama with the token ids ``generate()`` needs, in evaluation mode."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=0)).eval()


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_layer=2, n_head=2, n_embd=32,
                                                                n_positions=64))


MODELS = {
    "gpt2": (_gpt2, lambda i: ((_ids(2, 8, i),), {"use_cache": False})),
    "gpt2_padding_mask": (_gpt2, lambda i: ((_ids(2, 8, i),), {
        "use_cache": False, "attention_mask": (torch.rand(2, 8, generator=torch.Generator().manual_seed(i)) > 0.3).long()})),
    "llama": (_llama, lambda i: ((_ids(2, 8, i),), {"use_cache": False})),
    "bert": (lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=V, num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
        max_position_embeddings=64)), lambda i: ((_ids(2, 8, i),), {})),
    "t5": (lambda: transformers.T5Model(transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
        lambda i: ((), {"input_ids": _ids(2, 8, i), "decoder_input_ids": _ids(2, 5, i + 50), "use_cache": False})),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, max_position_embeddings=64)), lambda i: ((_ids(2, 8, i),), {"use_cache": False})),
    "gemma": (lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(
        vocab_size=V, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, head_dim=8, max_position_embeddings=64)),
        lambda i: ((_ids(2, 8, i),), {"use_cache": False})),
    "bart": (lambda: transformers.BartModel(transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
        lambda i: ((), {"input_ids": _ids(2, 8, i), "decoder_input_ids": _ids(2, 5, i + 50), "use_cache": False})),
    "deberta_v2": (lambda: transformers.DebertaV2Model(transformers.DebertaV2Config(
        vocab_size=V, num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
        max_position_embeddings=64)), lambda i: ((_ids(2, 8, i),), {})),
    "swin": (lambda: transformers.SwinModel(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=4)),
        lambda i: ((torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(i)),), {})),
    "vit": (lambda: transformers.ViTModel(transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64)), lambda i: ((torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(i)),), {})),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_graphed_transformers_forward_replays_and_equals_eager(name, monkeypatch):
    build, inputs = MODELS[name]
    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        torch.manual_seed(0)
        model = build().eval()
        f = TorchFn(lambda *a, **k: model(*a, **k), mgr, name=name)
        for i in range(5):
            args, kwargs = inputs(i)
            with torch.no_grad():
                ref = model(*args, **kwargs)
            _equal(f(*args, **kwargs), ref, f"{name} call {i}")
        st = mgr.stats[f.fn_id]
        assert (st.recordings, st.replays, st.eager_calls) == (1, 3, 0), [n.skip_reason for n in mgr.nodes()]


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_a_static_cache_decode_step_returning_the_model_output_replays_and_equals_eager(build, monkeypatch):
    """Greedy decoding over a ``StaticCache``, the step returning the model's output as it is (its
    ``past_key_values`` is the cache the step was given): recorded once, then replayed, with the
    caller's cache in every output and the tokens of eager decoding."""
    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        torch.manual_seed(0)
        model = build().eval()
        prompt = _ids(1, 5, 3)

        def decode(step, steps=10):
            cache = transformers.StaticCache(config=model.config, max_cache_len=32)
            with torch.no_grad():
                out = model(prompt, past_key_values=cache, use_cache=True)
            tok, toks = out.logits[:, -1:].argmax(-1), []
            for s in range(steps):
                toks.append(tok)
                out = step(tok, past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[prompt.shape[1] + s]]))
                assert out.past_key_values is cache
                tok = out.logits[:, -1:].argmax(-1)
            return torch.cat(toks, 1)

        ref = decode(lambda *a, **k: model(*a, **k))
        f = TorchFn(lambda *a, **k: model(*a, **k), mgr)
        assert torch.equal(decode(f), ref)
        st = mgr.stats[f.fn_id]
        assert (st.recordings, st.eager_calls) == (1, 0) and st.replays >= 8, [n.skip_reason for n in mgr.nodes()]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generate_with_a_graphed_forward_gives_eagers_tokens(cache, monkeypatch):
    """``model.generate()`` with ``model.forward`` graphed. With a ``StaticCache`` the decode step
    records and replays. With the default ``DynamicCache`` each step grows the cache in Python
    (``torch.cat`` into new tensors), which a replay would not redo: the forward runs eagerly with
    that reason, and the tokens are eager's in both cases."""
    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        torch.manual_seed(0)
        model = _generating_llama()
        prompt = _ids(1, 5, 3)
        kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
        if cache == "static":
            kw["cache_implementation"] = "static"
        with torch.no_grad():
            ref = model.generate(prompt, **kw)
            f = TorchFn(model.forward, mgr)
            model.forward = f
            got = model.generate(prompt, **kw)
        assert torch.equal(got, ref)
        st = mgr.stats[f.fn_id]
        if cache == "static":
            assert st.recordings == 1 and st.replays >= 8 and st.eager_calls == 0
        else:
            assert st.recordings == 0 and "DynamicCache" in f.unsafe_reason



def test_a_pipeline_ending_in_python_post_processing_of_the_tokens_runs_eagerly_with_the_reason(monkeypatch):
    """Embedding lookup, the model, argmax, then Python reading the tokens (``tolist()``, a copy to
    the host, which a capture refuses): the call runs eagerly with that reason, and each call's
    Python result is its own, not the first recording's."""
    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        torch.manual_seed(0)
        model = _llama().eval()
        emb = model.get_input_embeddings()

        def pipeline(ids):
            tok = model(inputs_embeds=emb(ids), use_cache=False).logits.argmax(-1)
            return {"tokens": tok, "words": [" ".join(f"w{t}" for t in row) for row in tok.tolist()]}

        f = TorchFn(pipeline, mgr)
        for i in range(4):
            x = _ids(2, 8, i)
            with torch.no_grad():
                ref = pipeline(x)
            got = f(x)
            assert torch.equal(got["tokens"], ref["tokens"]) and got["words"] == ref["words"], i
        st = mgr.stats[f.fn_id]
        assert st.replays == 0 and any("host" in r for r in st.skip_reasons), st.skip_reasons

_AUTOCAST = {
    "autocast_on_and_off": lambda i: torch.autocast("cpu", dtype=torch.bfloat16, enabled=(i // 2) % 2 == 1),
    "autocast_dtype_flipped": lambda i: torch.autocast("cpu", dtype=torch.bfloat16 if (i // 2) % 2 else torch.float16),
    "inference_mode_on_and_off": lambda i: torch.inference_mode((i // 2) % 2 == 1),
}


@pytest.mark.parametrize("settings", list(_AUTOCAST))
def test_a_graphed_forward_under_settings_that_change_between_calls_equals_eager(settings, monkeypatch):
    """Autocast switched on and off, its dtype changed, or inference mode toggled every two calls
    around a graphed Llama forward: each setting selects a recording of its own (the logits are
    bfloat16 under autocast, float32 without), as eager's kernels change with it."""
    ctx = _AUTOCAST[settings]
    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        torch.manual_seed(0)
        model = _llama().eval()
        f = TorchFn(lambda x: model(x, use_cache=False), mgr)
        for i in range(8):
            x = _ids(2, 8, i)
            with torch.no_grad(), ctx(i):
                ref = model(x, use_cache=False)
            with ctx(i):
                got = f(x)
            assert got.logits.dtype == ref.logits.dtype, f"call {i}"
            _equal(got, ref, f"{settings} call {i}")
        st = mgr.stats[f.fn_id]
        assert (st.recordings, st.replays, st.eager_calls) == (2, 4, 0), [n.skip_reason for n in mgr.nodes()]


def test_beam_search_with_a_static_cache_keeps_no_cache_of_an_earlier_step_alive(monkeypatch):
    """``generate(num_beams=3)`` with ``model.forward`` graphed and a static cache: tokens as eager's,
    and once ``generate()`` has returned, the caches' tensors of its steps are gone, as in eager."""
    import gc

    with cpu_tree(monkeypatch, CpuGraphBackend) as mgr:
        torch.manual_seed(0)
        model = _generating_llama()
        kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, cache_implementation="static", num_beams=3)
        prompt = _ids(1, 5, 3)

        def beam_caches() -> int:  # the key and value tensors of a 3-beam cache still alive
            gc.collect()
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dim() == 4
                       and (o.shape[0], o.shape[1], o.shape[3]) == (3, 2, 8))

        with torch.no_grad():
            ref = model.generate(prompt, **kw)
            f = TorchFn(model.forward, mgr)
            functools.update_wrapper(f, model.forward)  # generate() reads the forward's signature
            model.forward = f
            got = model.generate(prompt, **kw)
        assert torch.equal(got, ref)
        del got
        assert len(mgr.stats) == 1 and beam_caches() == 0, beam_caches()
