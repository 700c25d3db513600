"""GPU tier on code nobody here wrote: transformers (GPT-2, Llama with a StaticCache), torchvision
(ResNet-18 inference and a whole training step), timm (a tiny ViT), cupyx.scipy (FFT, ndimage) and
kernels written with CuPy's own APIs (ElementwiseKernel, RawKernel, ReductionKernel, reductions).

Every test compares cgraw's result with eager execution of the same code on the same inputs, and
asserts that graphed functions really recorded and replayed (a silent eager fallback fails), or,
where a skip is the expected outcome, that its reason was reported. Models are built from configs
with random weights (never from a hub). Run alone with ``-m third_party``.
"""

from __future__ import annotations

import copy
import importlib

import numpy as np
import pytest
from gpu_data import crand, full_fp32, trand

pytestmark = [pytest.mark.gpu, pytest.mark.third_party, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")

# imported after the skips, so that a machine without torch reports this module as skipped, not as an error
cgraw = importlib.import_module("cgraw")

# float32 on the GPU: eager and replay run the same kernels, so most comparisons are exact in
# practice; 1e-4 leaves room for a different cuBLAS/cuDNN algorithm or attention kernel.
TOL = {"rtol": 1e-4, "atol": 1e-4}


# ---------------------------------------------------------------- helpers


def _stats(f):
    from cgraw.trees.graphed import _managers

    return _managers[0].stats[f.fn_id]


def _assert_graphed(f, *, recordings=1, replays=1):
    """``f`` recorded and replayed and never fell back to eager execution."""
    st = _stats(f)
    assert not st.skip_reasons, f"{f.name} ran eagerly: {st.skip_reasons}\n{cgraw.report()}"
    assert st.recordings >= recordings and st.replays >= replays, (
        f"{f.name}: {st.warmups} warm-up(s), {st.recordings} recording(s), {st.replays} replay(s)\n"
        f"{cgraw.report()}")
    return st




# ---------------------------------------------------------------- transformers: GPT-2

GPT2_VOCAB, GPT2_SEQ = 1000, 32


def _gpt2():
    """A 4-layer GPT-2 with random weights, eval mode, on the GPU.

    attn_implementation="sdpa" (transformers' default). Note: while a stream captures,
    transformers' ``is_tracing()`` is true (it asks ``torch.cuda.is_current_stream_capturing()``),
    so under capture it materialises the causal mask and passes it to SDPA instead of
    ``is_causal=True``, and skips its packed-sequence check (a host sync in eager mode). The graph
    therefore runs an equivalent but different attention kernel than eager: compare with TOL."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=GPT2_VOCAB, n_positions=128,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg).cuda().eval()


def _ids(batch):
    return torch.randint(0, GPT2_VOCAB, (batch, GPT2_SEQ), device="cuda")


def test_gpt2_graphed_logits_batch_1_and_8():
    model = _gpt2()
    f = cgraw.graphed(lambda ids: model(input_ids=ids).logits)
    calls = 5
    with torch.no_grad():
        for b in (1, 8):
            for _ in range(calls):
                ids = _ids(b)
                got = f(ids)
                assert got.shape == (b, GPT2_SEQ, GPT2_VOCAB)
                torch.testing.assert_close(got, model(input_ids=ids).logits, **TOL)
    # per batch size: warm-up, record, then replays
    _assert_graphed(f, recordings=2, replays=2 * (calls - 2))


def test_gpt2_capture_one_graph_per_batch_size():
    model = _gpt2()
    graphs = {}
    with torch.no_grad():
        for b in (1, 8):  # `g` is rebound on each pass: the dict keeps every graph
            ids = _ids(b)
            model(input_ids=ids)  # eager warm-up at this shape, outside the capture (as for torch.cuda.graph)
            with cgraw.capture() as g:
                out = model(input_ids=ids).logits
            graphs[b] = (g, ids, out)
        assert graphs[1][0] is not graphs[8][0]
        for _ in range(3):
            for b, (g, ids, out) in graphs.items():
                ids.copy_(_ids(b))
                g.replay()
                assert out.shape == (b, GPT2_SEQ, GPT2_VOCAB)
                torch.testing.assert_close(out, model(input_ids=ids).logits, **TOL)


def test_gpt2_graphed_model_output_alternating_batch_sizes():
    model = _gpt2()
    # use_cache=False: the output is a ModelOutput (CausalLMOutputWithCrossAttentions) with tensors
    # and None fields only, no DynamicCache object
    f = cgraw.graphed(lambda ids: model(input_ids=ids, use_cache=False))
    rounds = 4
    with torch.no_grad():
        for _ in range(rounds):
            for b in (1, 8):
                ids = _ids(b)
                got = f(ids)
                ref = model(input_ids=ids, use_cache=False)
                assert type(got) is type(ref), type(got)
                torch.testing.assert_close(got.logits, ref.logits, **TOL)
    st = _assert_graphed(f, recordings=2, replays=2 * (rounds - 2))
    assert st.warmups <= 3, f"warm-ups never end: {st.warmups}\n{cgraw.report()}"
    assert "recording" in cgraw.report()


# ---------------------------------------------------------------- transformers: Llama + StaticCache


def _small_llama(transformers, hidden: int):
    """A 2-layer transformers Llama with random weights (4 heads, 2 key-value heads), on the GPU."""
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=hidden, bos_token_id=0, eos_token_id=1,
                                   attn_implementation="sdpa")
    return cfg, transformers.LlamaForCausalLM(cfg).cuda().eval()


def test_llama_static_cache_greedy_decode():
    """Greedy decoding with a StaticCache: eager prefill, then one graphed decode step per token.

    transformers 5.17's StaticLayer keeps its write position in a device tensor
    (``cumulative_length``, advanced in place with ``add_``) and writes keys/values with
    ``index_copy_`` into preallocated tensors, and the forward no longer takes ``cache_position``
    (positions come from ``position_ids``). Expected: the decode step records once and replays
    (a CPU walk through the same code under "capturing" found no host synchronisation)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg, model = _small_llama(transformers, 256)
    prompt_len, new_tokens = 8, 16
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda")

    def decode_step(ids, cache_position, cache):
        out = model(input_ids=ids, position_ids=cache_position.unsqueeze(0), past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :]

    def generate(step):
        cache = transformers.StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1, :]  # eager prefill
        tokens, kept = [], []
        for i in range(new_tokens):
            tok = logits.argmax(-1, keepdim=True)  # [1, 1], eagerly, before the next step's call
            tokens.append(tok)
            if i == new_tokens - 1:
                break
            logits = step(tok, torch.tensor([prompt_len + i], device="cuda"), cache)
            kept.append(logits.clone())
        return torch.cat(tokens, dim=1), torch.stack(kept)

    f = cgraw.graphed(decode_step)
    with torch.no_grad():
        got_tokens, got_logits = generate(f)
        ref_tokens, ref_logits = generate(decode_step)
    torch.testing.assert_close(got_logits, ref_logits, **TOL)
    assert torch.equal(got_tokens, ref_tokens), (got_tokens, ref_tokens)
    st = _stats(f)
    if st.skip_reasons:
        # Not expected (see the docstring); tolerated if transformers synchronises with the host:
        # then the step must have run eagerly, correctly (checked above), with that reason reported.
        reasons = " ".join(st.skip_reasons)
        assert "host" in reasons, f"{reasons}\n{cgraw.report()}"
        assert st.recordings == 0 and st.eager_calls >= 1
    else:
        _assert_graphed(f, recordings=1, replays=new_tokens - 4)


def test_a_decode_step_returning_the_model_output_with_its_cache_replays():
    """A decode step that returns the model's output as it is (``out.past_key_values`` is the
    ``StaticCache`` it was given): the cache is the caller's object on every replay, and the step
    is recorded and replayed rather than run eagerly."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg, model = _small_llama(transformers, 128)
    prompt_len, new_tokens = 6, 12
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda")

    def decode_step(ids, cache_position, cache):
        return model(input_ids=ids, position_ids=cache_position.unsqueeze(0), past_key_values=cache, use_cache=True)

    def generate(step):
        cache = transformers.StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1, :]
        tokens = []
        for i in range(new_tokens - 1):
            tok = logits.argmax(-1, keepdim=True)
            tokens.append(tok)
            out = step(tok, torch.tensor([prompt_len + i], device="cuda"), cache)
            assert out.past_key_values is cache
            logits = out.logits[:, -1, :].clone()
        return torch.cat(tokens, dim=1)

    f = cgraw.graphed(decode_step)
    with torch.no_grad():
        got = generate(f)
        ref = generate(decode_step)
    assert torch.equal(got, ref), (got, ref)
    _assert_graphed(f, recordings=1, replays=new_tokens - 4)


def test_a_finished_generations_static_cache_is_freed_by_the_tree():
    """Two generations, each with a new ``StaticCache`` (as ``generate()`` makes one per call): the
    decode step is recorded and replayed in each, and once the first cache is dropped none of its
    tensors is kept alive by the tree (its recording reads them by address only)."""
    import gc
    import weakref

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg, model = _small_llama(transformers, 128)
    prompt_len, new_tokens = 6, 10

    def decode_step(ids, cache_position, cache):
        out = model(input_ids=ids, position_ids=cache_position.unsqueeze(0), past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :]

    def generate(step, prompt):
        cache = transformers.StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1, :]
        tokens = []
        for i in range(new_tokens - 1):
            tok = logits.argmax(-1, keepdim=True)
            tokens.append(tok)
            logits = step(tok, torch.tensor([prompt_len + i], device="cuda"), cache).clone()
        held = [weakref.ref(v) for layer in cache.layers for v in vars(layer).values() if isinstance(v, torch.Tensor)]
        return torch.cat(tokens, dim=1), held

    f = cgraw.graphed(decode_step)
    with torch.no_grad():
        for n in (1, 2):
            cgraw.mark_step_begin()
            prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda")
            got, held = generate(f, prompt)
            ref, _ = generate(decode_step, prompt)
            assert torch.equal(got, ref), (got, ref)
            gc.collect()
            assert held and all(r() is None for r in held), cgraw.report()
            st = _stats(f)
            assert st.recordings == n and st.replays >= n * (new_tokens - 4), cgraw.report()


# ---------------------------------------------------------------- torchvision


def test_torchvision_resnet18_inference():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).cuda().eval()
    # the model is an argument: its parameters and buffers are read in place
    f = cgraw.graphed(lambda m, x: m(x))
    with full_fp32(), torch.no_grad():
        for _ in range(5):
            x = trand(4, 3, 64, 64)
            got = f(model, x)
            assert got.shape == (4, 10)
            torch.testing.assert_close(got, model(x), **TOL)
    _assert_graphed(f, recordings=1, replays=3)


def test_torchvision_resnet18_training_step():
    """The whole step graphed (forward, loss, backward, SGD with momentum), step by step against eager.

    Eager training of this model is chaotic: cuDNN's convolution and batch-norm backward passes
    accumulate in a nondeterministic order, and with batch 8 BatchNorm amplifies the difference (on
    the H200 two eager twins were 9e-6 apart in loss at step 3 and 0.5 apart at step 6; a graph
    whose library calls pick another algorithm drifts the same way). Comparing trajectories
    therefore tests little after a few steps. Instead, before every step the graphed model's
    parameters, buffers and momentum buffers are set to the eager model's (in place: the graph
    reads them where they are), both take one step on the same fresh batch, and the loss and every
    parameter, buffer and momentum buffer must agree to float32 accuracy. A stale input, a race or
    an overwritten buffer shows up as an error many orders of magnitude larger."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).cuda().train()  # BatchNorm in train mode
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model_e, opt_e = copy.deepcopy((model, opt))
    assert opt_e.param_groups[0]["params"][0] is next(model_e.parameters())

    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # SGD's momentum buffers are created by the first step: the eager warm-up call
        return loss.detach()

    def pairs():
        yield from zip(model.state_dict().values(), model_e.state_dict().values(), strict=True)
        for p, p_e in zip(model.parameters(), model_e.parameters(), strict=True):
            if p in opt.state and p_e in opt_e.state:
                yield opt.state[p]["momentum_buffer"], opt_e.state[p_e]["momentum_buffer"]

    tol = {"rtol": 1e-4, "atol": 1e-5}
    f = cgraw.graphed(lambda x, y: step(model, opt, x, y))
    with full_fp32():
        for i in range(6):
            with torch.no_grad():
                for t, t_e in pairs():
                    t.copy_(t_e)
            x, y = trand(8, 3, 32, 32), torch.randint(0, 10, (8,), device="cuda")
            lg = f(x, y)
            le = step(model_e, opt_e, x, y)
            torch.testing.assert_close(lg, le, **tol, msg=lambda m, i=i: f"step {i}: loss: {m}")
            for k, (t, t_e) in enumerate(pairs()):
                torch.testing.assert_close(t, t_e, **tol, msg=lambda m, i=i, k=k: f"step {i}: state {k}: {m}")
    _assert_graphed(f, recordings=1, replays=3)


# ---------------------------------------------------------------- timm


def test_timm_vit_tiny_inference():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10).cuda().eval()
    f = cgraw.graphed(lambda x: model(x))
    with full_fp32(), torch.no_grad():
        for _ in range(5):
            x = trand(2, 3, 64, 64)
            got = f(x)
            assert got.shape == (2, 10)
            torch.testing.assert_close(got, model(x), **TOL)
    _assert_graphed(f, recordings=1, replays=3)


# ---------------------------------------------------------------- cupyx.scipy


def _ccomplex(n):
    return (crand(n) + 1j * crand(n)).astype(cp.complex64)


def test_cupyx_scipy_fft_graphed():
    cfft = pytest.importorskip("cupyx.scipy.fft")

    def spectra(z, x):
        zf = cfft.fft(z)
        return zf, cfft.ifft(zf), cp.fft.rfft(x, axis=-1)

    f = cgraw.graphed(spectra)
    for _ in range(5):
        z, x = _ccomplex(4096), crand(8, 256)
        got, ref = f(z, x), spectra(z, x)
        assert len(got) == 3
        for g_, r_ in zip(got, ref, strict=True):
            assert g_.shape == r_.shape and g_.dtype == r_.dtype
            # cuFFT's cached plan runs in both; values reach ~200, hence the atol
            cp.testing.assert_allclose(g_, r_, rtol=1e-5, atol=1e-4)
        cp.testing.assert_allclose(got[1], z, rtol=1e-4, atol=1e-4)  # ifft(fft(z)) == z
    _assert_graphed(f, recordings=1, replays=3)


def test_cupyx_scipy_ndimage_graphed_device_weights():
    ndimage = pytest.importorskip("cupyx.scipy.ndimage")
    w = crand(3, 3)  # weights on the device before the call, passed in: nothing is uploaded from the host

    def filters(img, w):
        return ndimage.uniform_filter(img, size=5), ndimage.convolve(img, w, mode="nearest")

    f = cgraw.graphed(filters)
    for _ in range(5):
        img = crand(64, 64)
        got, ref = f(img, w), filters(img, w)
        for g_, r_ in zip(got, ref, strict=True):
            cp.testing.assert_array_equal(g_, r_)  # the same elementwise kernels, one thread per output
    _assert_graphed(f, recordings=1, replays=3)


def test_cupyx_scipy_gaussian_filter_uploads_from_host():
    """gaussian_filter builds its weights with NumPy and uploads them (cupy.asarray) on every call:
    cgraw stages the upload through pinned memory the graph owns (CuPy 14.2 refuses it
    otherwise), so a capture replays equal to eager and a graphed function records. An upload
    outside ``cupy.asarray`` (``ndarray.set``) is still refused by name, leaves CuPy usable, and
    the next capture records and replays."""
    ndimage = pytest.importorskip("cupyx.scipy.ndimage")
    img = crand(64, 64)
    ndimage.gaussian_filter(img, sigma=1.5)  # eager first: its kernel is compiled outside any capture
    with cgraw.capture() as g:
        out = ndimage.gaussian_filter(img, sigma=1.5)
    for _ in range(3):
        img[...] = crand(64, 64)
        g.replay()
        cp.testing.assert_array_equal(out, ndimage.gaussian_filter(img, sigma=1.5))
    g.close()
    host = np.arange(16, dtype=np.float32)
    dev = cp.empty(16, dtype=cp.float32)
    with pytest.raises(cgraw.CaptureError, match="host-to-device upload"), cgraw.capture():
        dev.set(host)
    dev.set(host)  # CuPy still works
    cp.testing.assert_array_equal(dev, cp.arange(16, dtype=cp.float32))
    ndimage.uniform_filter(img, size=3)  # its size-3 kernel is compiled outside the capture
    with cgraw.capture() as g:
        out = ndimage.uniform_filter(img, size=3)
    img[...] = crand(64, 64)
    g.replay()
    cp.testing.assert_array_equal(out, ndimage.uniform_filter(img, size=3))

    def smooth(x):
        return ndimage.gaussian_filter(x, sigma=1.5)

    f = cgraw.graphed(smooth)
    for _ in range(5):
        x = crand(64, 64)
        cp.testing.assert_array_equal(f(x), smooth(x))
    _assert_graphed(f, recordings=1, replays=3)


# ---------------------------------------------------------------- CuPy's own kernel APIs

_SQ_PLUS_ONE = r"""
extern "C" __global__ void cgraw_tp_sq_plus_one(const float* x, float* y, const int n) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) {
        y[i] = x[i] * x[i] + 1.0f;
    }
}
"""


def _sq_plus_one(kernel, x):
    y = cp.empty_like(x)
    n = x.size
    kernel(((n + 255) // 256,), (256,), (x, y, cp.int32(n)))
    return y


def test_cupy_elementwise_kernel_graphed():
    fma = cp.ElementwiseKernel("T x, T y, float32 a", "T z", "z = a * x + y", "cgraw_tp_fma")

    def body(x, y):
        return fma(x, y, 2.5)

    f = cgraw.graphed(body)
    for _ in range(6):
        x, y = crand(10_000), crand(10_000)
        got = f(x, y)
        cp.testing.assert_array_equal(got, body(x, y))
        cp.testing.assert_allclose(got, 2.5 * x + y, rtol=1e-6, atol=1e-6)
    _assert_graphed(f, recordings=1, replays=4)


def test_cupy_raw_kernel_graphed():
    k = cp.RawKernel(_SQ_PLUS_ONE, "cgraw_tp_sq_plus_one")
    f = cgraw.graphed(lambda x: _sq_plus_one(k, x))
    for n in (5000,) * 6:
        x = crand(n)
        got = f(x)
        cp.testing.assert_array_equal(got, _sq_plus_one(k, x))
        cp.testing.assert_allclose(got, x * x + 1.0, rtol=1e-6, atol=1e-6)  # NVRTC may contract to an FMA
    _assert_graphed(f, recordings=1, replays=4)


def test_cupy_reductions_graphed():
    l2sq = cp.ReductionKernel("T x", "T y", "x * x", "a + b", "y = a", "0", "cgraw_tp_l2sq")

    def body(a):
        return l2sq(a), a.sum(axis=0), cp.max(a), cp.argmax(a)

    f = cgraw.graphed(body)
    for _ in range(6):
        a = crand(256, 128)
        got, ref = f(a), body(a)
        cp.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
        cp.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)
        cp.testing.assert_array_equal(got[2], ref[2])
        cp.testing.assert_array_equal(got[3], ref[3])
        a_np = cp.asnumpy(a).astype("float64")
        assert int(got[3]) == int(a_np.argmax())
        assert abs(float(got[0]) - float((a_np**2).sum())) <= 1e-4 * float((a_np**2).sum())
    _assert_graphed(f, recordings=1, replays=4)


def test_cupy_raw_kernel_capture_and_replay():
    k = cp.RawKernel(_SQ_PLUS_ONE, "cgraw_tp_sq_plus_one")
    x = crand(3000)
    first = _sq_plus_one(k, x)  # eager first: the module is compiled and loaded outside the capture
    with cgraw.capture() as g:
        y = _sq_plus_one(k, x)
    g.replay()
    cp.testing.assert_array_equal(y, first)
    for _ in range(4):
        x[...] = crand(3000)
        g.replay()
        cp.testing.assert_array_equal(y, _sq_plus_one(k, x))
