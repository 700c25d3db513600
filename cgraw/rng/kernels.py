"""The CUDA C of cgraw's random-number kernels (compiled with NVRTC at first use).

Layer L1 (pure): text only. The device code lives in this package's ``.cu`` files: ``philox.cu``
(the generator and the conversions), ``samplers.cu`` (rejection samplers), ``fills.cu`` (the fill and
dropout bodies) and ``records.cu`` (the generator records' kernels). ``source(name)`` gives the
source that defines the one kernel ``name``: the shared body plus an ``extern "C"`` wrapper that
instantiates it.

Every kernel draws from Philox4x32-10 (Salmon et al. 2011; the generator of torch and cuRAND) with
the 128-bit counter ``(group low, group high, call low, call high)`` and the 64-bit key it reads
from its generator record (``slot[0]``, see ``rng.plan.Source``): ``call`` is the draw's offset within
the graph, fixed at capture, and the key is the replay's (``rng.plan.replay_key`` of the generator's
position, which the graph's last node advances, ``ADVANCE``). A group is 4 outputs (2 for 64-bit
draws), so the numbers do not depend on the launch's grid. No header is included: half and
bfloat16 are converted with PTX or integer rounding, so NVRTC needs no CUDA include path.

Rejection samplers (``SAMPLERS``) draw a variable number of uniforms per output; their device code
and counter layout are in ``samplers.cu``.
"""

from __future__ import annotations

from importlib import resources


def _source(name: str) -> str:
    """The text of the CUDA C file ``name`` of this package."""
    return resources.files(__package__).joinpath(name).read_text()


# distribution -> (index in the source, whether it has a 64-bit (wide) variant for every dtype)
DISTS = {
    "uniform": 0,
    "normal": 1,
    "exponential": 2,
    "log_normal": 3,
    "cauchy": 4,
    "geometric": 5,
    "bernoulli": 6,      # scalar probability a
    "bernoulli_t": 7,    # per-element probability p[i] (float32, contiguous)
    "randint": 8,        # lo + x mod range
    "gamma": 9,          # samplers (per-element streams): scale b times Gamma(shape a)
    "beta": 10,          # Beta(a, b)
    "poisson": 11,       # Poisson(lam a)
    "binomial": 12,      # Binomial(n a, p b)
}
SAMPLERS = ("gamma", "beta", "poisson", "binomial")
SAMPLER_STEPS = {"gamma": 1, "beta": 2, "poisson": 1, "binomial": 1}  # offsets a call takes
SAMPLE_MAX = 1 << 40  # elements of one sampler call (the counter's element bits)

# dtype code -> C type in the source
CTYPES = {
    "f32": "float", "f64": "double", "f16": "half_t", "bf16": "bf16_t",
    "i8": "signed char", "u8": "unsigned char", "i16": "short", "i32": "int", "i64": "long long",
    "b8": "bool_t",
}
FLOATS = ("f32", "f64", "f16", "bf16")

COMMON = _source("philox.cu") + _source("samplers.cu") + _source("fills.cu")

FILL_WRAPPER = r"""
extern "C" __global__ void __launch_bounds__(256) {name}({t}* out, long long n, const unsigned long long* slot,
    unsigned long long call, double a, double b, const float* p, long long lo, unsigned long long range) {{
  fill<{t}, {d}, {wide}>(out, n, slot, call, a, b, p, lo, range);
}}
"""

DROPOUT_WRAPPER = r"""
extern "C" __global__ void __launch_bounds__(256) {name}(const {t}* in, {t}* out, bool_t* mask, long long n,
    const unsigned long long* slot, unsigned long long call, float keep, float scale) {{
  dropout<{t}>(in, out, mask, n, slot, call, keep, scale);
}}
"""

# the generator records' kernels: cgraw_rng_advance (the graph's last node), cgraw_rng_set (the
# host's write when the generator moved outside the graphs) and cgraw_rng_step (a loop body's last
# node), in one source
ADVANCE = SET = STEP = _source("records.cu")


def fill_name(dist: str, dtype: str, wide: bool) -> str:
    if dist not in DISTS:
        raise KeyError(f"unknown distribution {dist!r}")
    if dtype not in CTYPES:
        raise KeyError(f"unknown dtype code {dtype!r}")
    return f"cgraw_fill_{dist}_{dtype}_{'w' if wide else 'n'}"


def dropout_name(dtype: str) -> str:
    if dtype not in FLOATS:
        raise KeyError(f"dropout has no kernel for {dtype!r}")
    return f"cgraw_dropout_{dtype}"


ADVANCE_NAME = "cgraw_rng_advance"
SET_NAME = "cgraw_rng_set"
STEP_NAME = "cgraw_rng_step"


def source(name: str) -> str:
    """The CUDA C source defining the kernel ``name`` (one of the names above)."""
    if name == ADVANCE_NAME:
        return ADVANCE
    if name == SET_NAME:
        return SET
    if name == STEP_NAME:
        return STEP
    parts = name.split("_")
    if name.startswith("cgraw_dropout_"):
        dtype = parts[2]
        return COMMON + DROPOUT_WRAPPER.format(name=name, t=CTYPES[dtype])
    if name.startswith("cgraw_fill_"):
        width = parts[-1]
        dtype = parts[-2]
        dist = "_".join(parts[2:-2])
        if fill_name(dist, dtype, width == "w") != name:
            raise KeyError(name)
        return COMMON + FILL_WRAPPER.format(name=name, t=CTYPES[dtype], d=DISTS[dist],
                                            wide="true" if width == "w" else "false")
    raise KeyError(f"no cgraw kernel named {name!r}")
