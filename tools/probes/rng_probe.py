"""``python3 -m tools.probes.rng_probe`` (from the repository root): one-process probe of graph-safe
random numbers.

Not a timing benchmark: fourteen checks beside the GPU tests, kept because two of them show what
no GPU test does: ``graphsafe_state_experiment`` (torch's
generator with ``graphsafe_set_state`` and no ``torch.cuda.CUDAGraph`` still refuses to draw in
a cgraw capture) and ``compiled_inside_capture`` (a ``torch.compile``d function with dropout
called inside a capture: no recompilation, and Inductor's seeds come from cgraw, so the mask is
fresh per replay). Writes ``smoke.json`` to ``$OUT`` (or ``/tmp``). Needs torch, CuPy and
transformers.
"""
# ruff: noqa: F841  (arrays made inside captures are bound to names to keep them alive)
import json
import os
import time
import traceback

t0 = time.time()
import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F

import cgraw
from cgraw.rng import plan as rng, reference

R = {}
def case(name):
    def deco(fn):
        t = time.time()
        try:
            out = fn()
            R[name] = ("PASS", out, round(time.time() - t, 2))
        except Exception as e:
            R[name] = ("FAIL", traceback.format_exc()[-1500:], round(time.time() - t, 2))
        print(name, R[name][0], R[name][1] if R[name][0] == "PASS" else "\n" + R[name][1], flush=True)
    return deco

@case("compile_all")
def _():
    from cgraw.rng import kernels as K
    from cgraw._cuda import kernels
    names = [K.ADVANCE_NAME, K.SET_NAME] + [K.dropout_name(d) for d in K.FLOATS] + [K.fill_name(d, t, w) for d in K.DISTS for t in K.CTYPES for w in (False, True)]
    t = time.time()
    for n in names[:3]:
        kernels.compile_image(K.source(n), n, (9, 0))
    return f"{len(names)} kernels; first 3 compiled in {time.time()-t:.3f}s"

@case("rand_bitwise")
def _():
    n = 1_000_003
    with cgraw.capture() as g:
        a = torch.rand(n, device="cuda")
        b = torch.rand(7, device="cuda")
    outs = []
    gen = torch.cuda.default_generators[0]
    for r in range(3):
        seed, offset = gen.initial_seed(), gen.get_offset()  # the replay's key comes from these
        g.replay(); torch.cuda.synchronize()
        key = rng.replay_key(rng.torch_base(seed), offset)
        ra = reference.reference_uniform_f32(key, 0, n)
        rb = reference.reference_uniform_f32(key, 1, 7)
        assert np.array_equal(a.cpu().numpy(), ra), (a[:5], ra[:5])
        assert np.array_equal(b.cpu().numpy(), rb)
        assert gen.get_offset() == offset + 4 * g.rng.draws
        outs.append(a.clone())
    assert not torch.equal(outs[0], outs[1])
    return repr(g.rng)

@case("dtypes_moments")
def _():
    res = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        with cgraw.capture() as g:
            u = torch.rand(1 << 20, device="cuda", dtype=dt)
            z = torch.randn(1 << 20, device="cuda", dtype=dt)
        g.replay(); torch.cuda.synchronize()
        uf, zf = u.double(), z.double()
        res[str(dt)] = (round(uf.mean().item(), 4), round(uf.var().item(), 4), uf.min().item(), uf.max().item(), round(zf.mean().item(), 4), round(zf.var().item(), 4))
        assert abs(uf.mean().item() - .5) < .005 and abs(zf.var().item() - 1) < .01 and uf.max().item() < 1, res
    return res

@case("misc_ops")
def _():
    x = torch.empty(1 << 20, device="cuda"); xi = torch.empty(1 << 20, device="cuda", dtype=torch.int32)
    p = torch.rand(1 << 20, device="cuda")
    with cgraw.capture() as g:
        ri = torch.randint(-5, 7, (1 << 20,), device="cuda")
        u = torch.empty(1 << 20, device="cuda").uniform_(-2, 3)
        nn_ = torch.empty(1 << 20, device="cuda").normal_(1.5, 0.5)
        ex = torch.empty(1 << 20, device="cuda").exponential_(2.0)
        be = torch.empty(1 << 20, device="cuda").bernoulli_(0.3)
        bt = torch.bernoulli(p)
        rr = xi.random_(0, 10)
        ln = torch.empty(1 << 20, device="cuda").log_normal_(0, 0.25)
        ge = torch.empty(1 << 20, device="cuda").geometric_(0.25)
        ca = torch.empty(1 << 20, device="cuda").cauchy_()
        rl = torch.rand_like(x); nl = torch.randn_like(x); il = torch.randint_like(x, 3)
        nf = torch.normal(torch.zeros(1000, device="cuda"), torch.ones(1000, device="cuda") * 2)
    g.replay(); torch.cuda.synchronize()
    out = dict(ri=(ri.min().item(), ri.max().item(), ri.float().mean().item()), u=(u.min().item(), u.max().item(), u.mean().item()),
               n=(nn_.mean().item(), nn_.std().item()), ex=ex.mean().item(), be=be.mean().item(), bt=(bt == (torch.rand(1, device='cuda') * 0 + bt)).all().item(),
               bt_corr=((bt - p)).mean().item(), rr=(rr.min().item(), rr.max().item()), ln=ln.mean().item(), ge=ge.mean().item(), ca=ca.median().item(),
               rl=rl.mean().item(), nl=nl.std().item(), il=(il.min().item(), il.max().item()), nf=nf.std().item(), draws=g.rng.draws)
    return out

@case("dropout_backward")
def _():
    x = torch.randn(4096, device="cuda", requires_grad=True)
    with cgraw.capture() as g:
        y = F.dropout(x, 0.25, training=True)
        y.sum().backward()
    outs = []
    for _ in range(2):
        x.grad = None if False else x.grad
        g.replay(); torch.cuda.synchronize()
        keep = (y != 0)
        assert torch.allclose(y[keep], x.detach()[keep] / 0.75)
        outs.append(keep.float().mean().item())
    return outs

@case("multinomial")
def _():
    probs = torch.softmax(torch.randn(2, 50, device="cuda"), -1)
    with cgraw.capture() as g:
        s1 = torch.multinomial(probs, 20000, replacement=True)
        s2 = torch.multinomial(probs, 10, replacement=False)
    g.replay(); torch.cuda.synchronize()
    freq = torch.stack([torch.bincount(s1[i], minlength=50).float() / 20000 for i in range(2)])
    err = (freq - probs).abs().max().item()
    uniq = all(len(set(s2[i].tolist())) == 10 for i in range(2))
    assert err < 0.02 and uniq, (err, uniq)
    return err

@case("sdpa_dropout")
def _():
    q = torch.randn(2, 4, 32, 16, device="cuda", requires_grad=True)
    with cgraw.capture() as g:
        o = F.scaled_dot_product_attention(q, q, q, dropout_p=0.2)
        o.sum().backward()
    g.replay(); torch.cuda.synchronize()
    a = o.clone(); g.replay(); torch.cuda.synchronize()
    assert not torch.equal(a, o)
    return "ok"

@case("graphed_dropout")
def _():
    lin = torch.nn.Linear(64, 64).cuda()
    @cgraw.graphed
    def f(x):
        return F.dropout(lin(x), 0.5, training=True)
    outs = [f(torch.randn(32, 64, device="cuda")).clone() for _ in range(6)]
    torch.cuda.synchronize()
    rep = cgraw.report()
    return rep[-1500:]

@case("cupy_random")
def _():
    cp.random.seed(5); a = cp.random.random(7)
    cp.random.seed(5)
    with cgraw.capture() as g:
        r1 = cp.random.random(1 << 20); r2 = cp.random.rand(100, dtype=cp.float32); r3 = cp.random.randn(1 << 20)
        r4 = cp.random.standard_normal(1000, dtype=cp.float32); r5 = cp.random.normal(2, 3, 1 << 20); r6 = cp.random.uniform(-1, 1, 1000)
        r7 = cp.random.randint(0, 10, 1 << 16); r8 = cp.random.choice(10, 1 << 16); r9 = cp.random.choice(10, 1 << 16, p=cp.arange(10) / 45.)
        r10 = cp.random.choice(100, 10, replace=False)
    b = cp.random.random(7)
    assert cp.array_equal(a, b), "cupy eager disturbed"
    g.replay(); cp.cuda.runtime.deviceSynchronize()
    x1 = r1.copy(); g.replay(); cp.cuda.runtime.deviceSynchronize()
    assert not cp.array_equal(x1, r1)
    return dict(r1=float(r1.mean()), r3=float(r3.var()), r5=float(r5.mean()), r7=(int(r7.min()), int(r7.max())), r9=cp.bincount(r9, minlength=10).tolist(), r10=len(set(r10.tolist())))

@case("torch_eager_follows_replays")
def _():
    torch.cuda.manual_seed(1); a = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(1)
    with cgraw.capture() as g:
        y = torch.rand(100, device="cuda")
    assert torch.equal(a, torch.rand(5, device="cuda"))  # the capture drew nothing
    torch.cuda.manual_seed(1)
    g.replay()
    b = torch.rand(5, device="cuda")
    assert not torch.equal(a, b)  # the replay moved the generator
    return "ok"

@case("randperm_error")
def _():
    try:
        with cgraw.capture() as g:
            torch.randperm(10, device="cuda")
    except cgraw.CaptureError as e:
        assert "randperm" in str(e), str(e)
        return str(e)[:400]
    raise AssertionError("no error")

@case("graphsafe_state_experiment")
def _():
    gen = torch.cuda.default_generators[0]
    st = gen.graphsafe_get_state()
    try:
        gen.graphsafe_set_state(gen.clone_state())
        with cgraw.capture(random=False) as g:
            torch.rand(4, device="cuda")
        return "captured?!"
    except Exception as e:
        return type(e).__name__ + ": " + str(e)[:300]
    finally:
        gen.graphsafe_set_state(st)

@case("compiled_inside_capture")
def _():
    import torch._dynamo
    from torch._dynamo.utils import counters
    f = torch.compile(lambda x: torch.sin(x) * 2 + F.dropout(x, 0.5, training=True))
    x = torch.randn(100000, device="cuda")
    f(x); f(x)
    before = dict(counters["stats"])
    with cgraw.capture() as g:
        y = f(x)
    g.replay(); torch.cuda.synchronize()
    y1 = y.clone(); g.replay(); torch.cuda.synchronize()
    dropped = ((y - torch.sin(x) * 2).abs() < 1e-6).float().mean().item()
    return dict(before=before, after=dict(counters["stats"]), dropped=dropped, differs=not torch.equal(y1, y), draws=g.rng.draws if g.rng else 0)

@case("gpt2_dropout_train")
def _():
    import transformers
    cgraw.mark_step_begin(); cgraw.reset()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    m = transformers.GPT2LMHeadModel(cfg).cuda().train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True)
    @cgraw.graphed
    def step(ids):
        opt.zero_grad(set_to_none=False)
        loss = m(ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()
    ls = [step(torch.randint(0, 512, (4, 32), device="cuda")).item() for _ in range(8)]
    return dict(losses=ls, report=cgraw.report()[-1200:])

print("SMOKE SUMMARY", json.dumps({k: v[0] for k, v in R.items()}), f"{time.time()-t0:.1f}s")
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump({k: [v[0], str(v[1]), v[2]] for k, v in R.items()}, open(os.path.join(os.environ.get("OUT", "/tmp"), "smoke.json"), "w"), indent=1)
