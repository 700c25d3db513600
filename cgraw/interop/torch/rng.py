"""torch random numbers inside captures, drawn by cgraw's Philox kernels.

Layer L7: torch is imported lazily; kernels are reached through ``rng.device``.

torch's CUDA generator refuses to draw inside a capture it did not start ("Attempt to increase
offset for a CUDA generator not in capture mode": only ``torch.cuda.CUDAGraph`` can put it in
capture mode, and cgraw does not use that class). So while a cgraw capture runs, a
``TorchDispatchMode`` (below autograd: gradients of dropout and of ``multinomial``'s callers are
unchanged) answers torch's random-number ops on the capture's device with cgraw's kernels:

- factories ``rand``, ``randn``, ``randint`` and their ``_like`` forms, functional ``normal``;
- in place ``uniform_``, ``normal_``, ``exponential_``, ``log_normal_``, ``cauchy_``,
  ``geometric_``, ``bernoulli_``, ``random_``, and their functional forms, ``bernoulli``;
- ``multinomial`` (inverse CDF with replacement; keys ``p / Exp(1)`` and ``topk`` without);
- ``native_dropout`` (``F.dropout``, ``nn.Dropout``): one fused kernel writing output and mask.

``F.scaled_dot_product_attention`` with ``dropout_p > 0`` runs on torch's math backend during
the capture (its fused kernels draw from torch's generator inside the kernel), so its dropout is
the ``native_dropout`` above. Any other op that draws from torch's CUDA generator fails the
capture with a ``CaptureError`` naming it. CPU random numbers and other devices pass through.

The draws follow torch's default CUDA generator of the capture's device (``TorchRng.use``): each
replay reads its seed and offset and advances the offset, as eager draws do (``rng.plan.torch_sync``).
The ``generator=`` argument is ignored inside captures: every draw follows the default generator.

The mode is a ``interop.torch.modes.mode_base()`` mode: draws inside the bodies of higher-order operators
are routed too, and torch.compile'd code runs compiled; the seeds of Inductor's random numbers
(``aten.randint.low_out`` into an int64 buffer) are drawn here, so compiled code draws fresh
numbers on every replay.

Draws inside a ``torch.utils.checkpoint`` that restores torch's random state for its
recomputation fail the capture (``interop.torch.rng_patch.checkpoint_region``); the patches in place
while a capture routes (sdpa's backend, torch's generator state) are in ``interop.torch.rng_patch``.
"""

from __future__ import annotations

import sys
import threading

from cgraw import _cuda
from cgraw.rng import plan as rng, device as rng_device
from cgraw.errors import CaptureError
from cgraw.interop.torch import modes as torch_modes, rng_patch as torch_rng_patch

_mode_cls: list = [None]
_codes: dict = {}

NOT_COVERED_HINT = (
    "draw the random tensor outside the capture and pass it in, or use an op cgraw covers "
    "(rand, randn, randint, *_like, uniform_, normal_, bernoulli, exponential_, random_, "
    "multinomial, dropout)"
)
_SDPA_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
             "_efficient_attention_forward", "_scaled_dot_product_fused_attention_overrideable")


CHECKPOINT_HINT = (
    "draw the random tensor outside the checkpointed function and pass it in, or pass "
    "preserve_rng_state=False (its recomputation then draws fresh numbers, as it does eagerly)"
)


def not_covered(op: str, why: str = "it draws from torch's CUDA generator",
                hint: str = NOT_COVERED_HINT) -> CaptureError:
    return CaptureError(f"torch {op}", 0, "RNG_NOT_COVERED",
                        f"torch random numbers: {op} cannot be captured by cgraw ({why})", hint)


def _dtype_codes(torch) -> dict:
    if not _codes:
        _codes.update({torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
                       torch.bfloat16: "bf16", torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16",
                       torch.int32: "i32", torch.int64: "i64", torch.bool: "b8"})
    return _codes


class TorchRng:
    """Routes torch's random numbers to ``stream`` (an ``rng.plan.RngStream``) during one capture;
    ``source`` is the generator record the draws read (``rng.plan.Source``)."""

    def __init__(self, stream: rng.RngStream, source: rng.Source | None = None, *, eager: bool = False):
        self.stream = stream
        self.source = source
        self.eager = eager  # draws run now (a warm-up), not into a capture
        self._mode = None
        self.patch_sdpa = True  # F.scaled_dot_product_attention with dropout on the math backend (interop.torch.rng_patch)

    def use(self) -> rng.TorchUse:
        """What replays of the captured graph do with torch's default CUDA generator of its
        device: read its seed and offset, advance the offset (``rng.plan.torch_sync``)."""
        gen = sys.modules["torch"].cuda.default_generators[self.stream.device]
        return rng.TorchUse(gen, self.source, self.stream.calls, self.stream.elements)

    def enter(self) -> None:
        cls = _mode_cls[0]
        if cls is None:
            cls = _mode_cls[0] = _make_mode_class()
        self._mode = cls(self.stream, self.eager)
        torch_rng_patch.install(self.stream, sdpa=self.patch_sdpa)
        try:
            self._mode.__enter__()
        except BaseException:
            torch_rng_patch.remove(sdpa=self.patch_sdpa)
            raise

    def exit(self) -> None:
        try:
            if self._mode is not None:
                mode, self._mode = self._mode, None
                mode.__exit__(None, None, None)
        finally:
            torch_rng_patch.remove(sdpa=self.patch_sdpa)


# ----------------------------------------------------------------------------- the mode

def _bind(func, args, kwargs) -> dict:
    """The op's arguments by schema name (defaults filled in)."""
    d = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            d[a.name] = args[i]
        elif a.name in kwargs:
            d[a.name] = kwargs[a.name]
        elif a.has_default_value():
            d[a.name] = a.default_value
        else:
            d[a.name] = None
    return d


def _make_mode_class():
    torch = sys.modules["torch"]
    aten = torch.ops.aten
    codes = _dtype_codes(torch)
    T = torch.Tensor
    sdpa = {getattr(aten, n) for n in _SDPA_OPS if hasattr(aten, n)}

    scalar_types = {4: torch.int64, 6: torch.float32, 7: torch.float64, 3: torch.int32, 5: torch.float16,
                    15: torch.bfloat16, 11: torch.bool, 0: torch.uint8, 1: torch.int8, 2: torch.int16}

    def _as_dtype(dt):
        """A schema default arrives as a ScalarType number (randint's ``long``)."""
        return scalar_types.get(dt) if isinstance(dt, int) else dt

    def dense(t) -> bool:
        return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))

    class RngMode(torch_modes.mode_base()):
        def __init__(self, stream: rng.RngStream, eager: bool = False):
            super().__init__()
            self.rs = stream
            self.dev = stream.device
            self.eager = eager  # a warm-up: what cgraw cannot draw is drawn by torch, never refused

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.is_higher_order(func):
                return self.run_higher_order(func, args, kwargs)
            kwargs = kwargs or {}
            h = handlers.get(func.overloadpacket)
            if h is not None:
                d = _bind(func, args, kwargs)
                try:
                    # a warm-up honours an explicit generator= as eager code does
                    out = NotImplemented if self.eager and d.get("generator") is not None else h(self, func, d)
                except CaptureError:
                    if not self.eager:
                        raise
                    out = NotImplemented
                if out is not NotImplemented:
                    return out
            elif (not self.eager and func.overloadpacket in sdpa
                  and (_bind(func, args, kwargs).get("dropout_p") or 0) > 0):
                raise not_covered(str(func), "its fused attention kernel draws its dropout from torch's "
                                  "generator; call it as torch.nn.functional.scaled_dot_product_attention "
                                  "(cgraw runs that on the math backend inside captures) or use nn.Dropout")
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:
                msg = str(e)
                if "generator not in capture mode" in msg or "Offset increment outside graph capture" in msg:
                    raise not_covered(str(func)) from e
                raise

        # -- helpers
        def mine(self, t) -> bool:
            return isinstance(t, T) and t.is_cuda and t.device.index == self.dev

        def cu_stream(self):
            return _cuda.stream_handle(torch.cuda.current_stream(self.dev).cuda_stream)

        def replayable(self, op: str) -> None:
            """Refuse a draw that a checkpoint's recomputation would have to draw again."""
            where = torch_rng_patch.checkpoint_region()
            if where is not None:
                raise not_covered(op, f"it draws in the {where} of a torch.utils.checkpoint with preserve_rng_state="
                                  "True, whose recomputation must draw the same numbers again, which cgraw's "
                                  "graphed draws cannot do (they are drawn by cgraw's kernels when the graph "
                                  "replays)", CHECKPOINT_HINT)

        def fill(self, t, dist: str, *, a=0.0, b=0.0, p=None, lo=0, rng_range=0):
            """Draw into ``t`` (any layout): directly when dense, else through a dense copy."""
            code = codes.get(t.dtype)
            continuous = dist not in ("randint", "bernoulli", "bernoulli_t", "geometric")
            if code is None or (continuous and code not in ("f32", "f64", "f16", "bf16")):
                raise not_covered(f"{dist} into a {t.dtype} tensor", "cgraw draws float16/bfloat16/"
                                  "float32/float64 values and integer/bool tensors only")
            if t.numel() == 0:
                return t
            # per-element probabilities pair p[i] with out[i] in memory order: row-major only
            if not (t.is_contiguous() if p is not None else dense(t)):
                tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                self.fill(tmp, dist, a=a, b=b, p=p, lo=lo, rng_range=rng_range)
                t.copy_(tmp)
                return t
            self.replayable(f"a {dist} draw")
            pptr = 0
            if p is not None:
                p = p.to(device=t.device, dtype=torch.float32).expand(t.shape).contiguous()
                pptr = p.data_ptr()
            rng_device.fill(self.rs, dist, code, t.data_ptr(), t.numel(), self.cu_stream(), a=a, b=b, p=pptr,
                         lo=lo, rng_range=rng_range, wide=rng.is_wide(dist, code, rng_range))
            return t

        def factory(self, func, d, size):
            kw = {"dtype": _as_dtype(d.get("dtype")), "device": d.get("device"),
                  "pin_memory": d.get("pin_memory")}
            out = d.get("out")
            if out is not None:
                if not self.mine(out):
                    return None
                if tuple(out.shape) != tuple(size):
                    out.resize_(size)  # as torch's out= does
                return out
            t = torch.empty(size, **{k: v for k, v in kw.items() if v is not None})
            return t if self.mine(t) else None

        def like(self, d):
            src = d["self"]
            kw = {k: d.get(k) for k in ("device", "pin_memory", "memory_format")}
            kw["dtype"] = _as_dtype(d.get("dtype"))
            t = torch.empty_like(src, **{k: v for k, v in kw.items() if v is not None})
            return t if self.mine(t) else None

    # -- handlers: (mode, func, bound args) -> result, or NotImplemented to pass through
    def rand(m, func, d):
        t = m.factory(func, d, d["size"])
        return NotImplemented if t is None else m.fill(t, "uniform", a=0.0, b=1.0)

    def randn(m, func, d):
        t = m.factory(func, d, d["size"])
        return NotImplemented if t is None else m.fill(t, "normal", a=0.0, b=1.0)

    def randint(m, func, d):
        if _as_dtype(d.get("dtype")) is None and d.get("out") is None:
            d["dtype"] = torch.int64
        t = m.factory(func, d, d["size"])
        if t is None:
            return NotImplemented
        lo, r = rng.random_range(codes.get(t.dtype, "i64"), d.get("low") or 0, d["high"])
        return m.fill(t, "randint", lo=lo, rng_range=r)

    def rand_like(m, func, d):
        t = m.like(d)
        return NotImplemented if t is None else m.fill(t, "uniform", a=0.0, b=1.0)

    def randn_like(m, func, d):
        t = m.like(d)
        return NotImplemented if t is None else m.fill(t, "normal", a=0.0, b=1.0)

    def randint_like(m, func, d):
        if isinstance(d.get("high"), T):
            raise not_covered(str(func), "a tensor 'high' is not supported")
        t = m.like(d)
        if t is None:
            return NotImplemented
        lo, r = rng.random_range(codes.get(t.dtype, "i64"), d.get("low") or 0, d["high"])
        return m.fill(t, "randint", lo=lo, rng_range=r)

    def inplace(dist, a_name=None, b_name=None, a_default=0.0, b_default=0.0):
        def h(m, func, d):
            t = d["self"]
            if not m.mine(t):
                return NotImplemented
            if not func.overloadpacket.__name__.endswith("_"):  # functional form: a new tensor
                t = torch.empty_like(t)
            a = d.get(a_name, a_default) if a_name else a_default
            b = d.get(b_name, b_default) if b_name else b_default
            return m.fill(t, dist, a=float(a if a is not None else a_default),
                          b=float(b if b is not None else b_default))
        return h

    def random_(m, func, d):
        t = d["self"]
        if not m.mine(t):
            return NotImplemented
        if not func.overloadpacket.__name__.endswith("_"):
            t = torch.empty_like(t)
        code = codes.get(t.dtype)
        if code is None:
            raise not_covered(f"{func} on a {t.dtype} tensor")
        if "from" in d:
            lo, r = rng.random_range(code, d["from"], d.get("to"))
        elif "to" in d:
            lo, r = rng.random_range(code, 0, d["to"])
        else:
            lo, r = rng.random_range(code)
        return m.fill(t, "randint", lo=lo, rng_range=r)

    def bernoulli(m, func, d):
        src = d["self"]
        if not m.mine(src):
            return NotImplemented
        t = src if func.overloadpacket.__name__.endswith("_") else torch.empty_like(src)
        p = d.get("p", None)
        if isinstance(p, T):
            return m.fill(t, "bernoulli_t", p=p)
        if p is None:  # bernoulli(input): input holds the probabilities
            return m.fill(t, "bernoulli_t", p=src)
        return m.fill(t, "bernoulli", a=float(p))

    def normal(m, func, d):
        mean, std = d.get("mean", 0.0), d.get("std", 1.0)
        if isinstance(mean, T) or isinstance(std, T):
            ref = mean if isinstance(mean, T) else std
            if not m.mine(ref):
                return NotImplemented
            shape = torch.broadcast_shapes(*(x.shape for x in (mean, std) if isinstance(x, T)))
            dtype = ref.dtype
            z = m.fill(torch.empty(shape, dtype=dtype, device=ref.device), "normal", a=0.0, b=1.0)
            out = z.mul_(std).add_(mean) if isinstance(std, T) and isinstance(mean, T) else (
                z * std + mean)
            o = d.get("out")
            return o.copy_(out) if o is not None else out
        t = m.factory(func, d, d["size"])
        return NotImplemented if t is None else m.fill(t, "normal", a=float(mean), b=float(std))

    def multinomial(m, func, d):
        probs = d["self"]
        if not m.mine(probs):
            return NotImplemented
        k, replacement = int(d["num_samples"]), bool(d.get("replacement"))
        p = probs.double() if probs.dim() == 2 else probs.double().unsqueeze(0)
        rows, cats = p.shape
        if replacement:
            u = m.fill(torch.empty((rows, k), dtype=torch.float64, device=p.device), "uniform", a=0.0, b=1.0)
            c = p.cumsum(-1)
            idx = torch.searchsorted(c, u * c[:, -1:], right=True).clamp_(max=cats - 1)
        else:
            e = m.fill(torch.empty((rows, cats), dtype=torch.float64, device=p.device), "exponential", a=1.0)
            idx = (p / e).topk(k, dim=-1).indices
        out = idx if probs.dim() == 2 else idx.squeeze(0)
        o = d.get("out")
        return o.copy_(out) if o is not None else out

    def native_dropout(m, func, d):
        x, p, train = d["input"], float(d["p"]), d.get("train")
        if train is False or not m.mine(x):
            return NotImplemented
        code = codes.get(x.dtype)
        if code not in ("f32", "f64", "f16", "bf16"):
            raise not_covered(f"{func} on a {x.dtype} tensor")
        m.replayable(str(func))
        keep = 1.0 - p
        scale = 0.0 if keep == 0.0 else 1.0 / keep
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        rng_device.dropout(m.rs, code, x.data_ptr(), out.data_ptr(), mask.data_ptr(), x.numel(), keep, scale,
                        m.cu_stream())
        return out, mask

    handlers = {aten.rand: rand, aten.randn: randn, aten.randint: randint, aten.rand_like: rand_like,
                aten.randn_like: randn_like, aten.randint_like: randint_like, aten.normal: normal,
                aten.multinomial: multinomial, aten.native_dropout: native_dropout,
                aten.random_: random_, aten.random: random_,
                aten.bernoulli_: bernoulli, aten.bernoulli: bernoulli}
    for name, dist, an, bn, ad, bd in (("uniform", "uniform", "from", "to", 0.0, 1.0),
                                       ("normal", "normal", "mean", "std", 0.0, 1.0),
                                       ("exponential", "exponential", "lambd", None, 1.0, 0.0),
                                       ("log_normal", "log_normal", "mean", "std", 1.0, 2.0),
                                       ("cauchy", "cauchy", "median", "sigma", 0.0, 1.0),
                                       ("geometric", "geometric", "p", None, 0.5, 0.0)):
        for packet_name in (name + "_", name):
            packet = getattr(aten, packet_name, None)
            if packet is not None and packet not in handlers:
                handlers[packet] = inplace(dist, an, bn, ad, bd)
    return RngMode


class WarmDraws(rng_device.WarmUp):
    """A graphed function's warm-up draws torch's random numbers on ``device`` with cgraw's kernels,
    at the offsets its recording will take, and moves torch's generator as a replay does
    (``rng.plan.TorchWarm``): after the same seed, the warm-up's numbers are those a replay of the
    recording draws, so a sequence of calls repeats whether a call warmed up or replayed. A draw
    cgraw does not cover, one with an explicit ``generator=`` and one in a checkpointed region are
    torch's own, as eagerly. ``compiled``: leave ``F.scaled_dot_product_attention`` unpatched (as
    the recording of torch.compile'd code does)."""

    __slots__ = ()

    def __init__(self, device: int, compiled: bool = False):
        torch = sys.modules["torch"]
        thread = threading.get_ident()
        self._cu = _cuda.stream_handle(torch.cuda.current_stream(device).cuda_stream)
        src = rng_device.source(device, rng.TORCH, self._cu, thread)
        self._warm = rng.TorchWarm(torch.cuda.default_generators[device], src, self._cu)
        self._router = TorchRng(rng.WarmStream(src.slot, device, thread, self._warm), src, eager=True)
        self._router.patch_sdpa = not compiled



def router(stream: rng.RngStream, source: rng.Source) -> TorchRng:
    """The router of one capture (``capture`` makes one per framework it routes)."""
    return TorchRng(stream, source)
