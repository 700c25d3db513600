"""CUDA C source of cgraw's random-number kernels (compiled with NVRTC at first use).

Layer L1 (pure): strings only. ``source(name)`` gives the source that defines the one kernel
``name``: the shared body below plus an ``extern "C"`` wrapper that instantiates it.

Every kernel draws from Philox4x32-10 (Salmon et al. 2011; the generator of torch and cuRAND) with
the 128-bit counter ``(group low, group high, call low, call high)`` and the 64-bit key it reads
from its generator record (``slot[0]``, see ``rng.Source``): ``call`` is the draw's offset within
the graph, fixed at capture, and the key is the replay's (``rng.replay_key`` of the generator's
position, which the graph's last node advances, ``ADVANCE``). A group is 4 outputs (2 for 64-bit
draws), so the numbers do not depend on the launch's grid. No header is included: half and
bfloat16 are converted with PTX or integer rounding, so NVRTC needs no CUDA include path.

Rejection samplers (``SAMPLERS``) draw a variable number of uniforms per output; their device code
and counter layout are in ``rng.samplers``.
"""

from __future__ import annotations

from cgraw.rng.samplers import SAMPLERS_SOURCE

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

COMMON = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
struct half_t { unsigned short b; };
struct bf16_t { unsigned short b; };
struct bool_t { unsigned char b; };
struct u4 { u32 x, y, z, w; };

__device__ __forceinline__ u4 philox(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
  for (int i = 0; i < 10; i++) {
    if (i) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
    u32 lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
    u32 lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
    u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
  }
  u4 r; r.x = c0; r.y = c1; r.z = c2; r.w = c3; return r;
}

// [0, 1) and (0, 1] from 24 (float) or 53 (double) bits
__device__ __forceinline__ float u24(u32 x) { return (float)(x >> 8) * 5.9604644775390625e-08f; }
__device__ __forceinline__ float u24c(u32 x) { return (float)((x >> 8) + 1u) * 5.9604644775390625e-08f; }
__device__ __forceinline__ double u53(u32 a, u32 b) {
  return ((double)(a >> 5) * 67108864.0 + (double)(b >> 6)) * 1.1102230246251565e-16;
}
__device__ __forceinline__ double u53c(u32 a, u32 b) {
  return ((double)(a >> 5) * 67108864.0 + (double)(b >> 6) + 1.0) * 1.1102230246251565e-16;
}

__device__ __forceinline__ unsigned short f2h(float v) {
  unsigned short r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v)); return r;
}
__device__ __forceinline__ float h2f(unsigned short h) {
  float r; asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h)); return r;
}
__device__ __forceinline__ unsigned short f2bf(float v) {
  u32 u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN stays NaN
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float bf2f(unsigned short b) { return __uint_as_float(((u32)b) << 16); }

template <typename T> struct Cv {
  static __device__ __forceinline__ T from(float v) { return (T)v; }
  static __device__ __forceinline__ T from(double v) { return (T)v; }
  static __device__ __forceinline__ T fromi(i64 v) { return (T)v; }
  static __device__ __forceinline__ double back(T v) { return (double)v; }
  static __device__ __forceinline__ float load(const T* p) { return (float)*p; }
};
template <> struct Cv<half_t> {
  static __device__ __forceinline__ half_t from(float v) { half_t r; r.b = f2h(v); return r; }
  static __device__ __forceinline__ half_t from(double v) { return from((float)v); }
  static __device__ __forceinline__ half_t fromi(i64 v) { return from((float)v); }
  static __device__ __forceinline__ double back(half_t v) { return (double)h2f(v.b); }
  static __device__ __forceinline__ float load(const half_t* p) { return h2f(p->b); }
};
template <> struct Cv<bf16_t> {
  static __device__ __forceinline__ bf16_t from(float v) { bf16_t r; r.b = f2bf(v); return r; }
  static __device__ __forceinline__ bf16_t from(double v) { return from((float)v); }
  static __device__ __forceinline__ bf16_t fromi(i64 v) { return from((float)v); }
  static __device__ __forceinline__ double back(bf16_t v) { return (double)bf2f(v.b); }
  static __device__ __forceinline__ float load(const bf16_t* p) { return bf2f(p->b); }
};
template <> struct Cv<bool_t> {
  static __device__ __forceinline__ bool_t from(float v) { bool_t r; r.b = v != 0.0f; return r; }
  static __device__ __forceinline__ bool_t from(double v) { bool_t r; r.b = v != 0.0; return r; }
  static __device__ __forceinline__ bool_t fromi(i64 v) { bool_t r; r.b = v != 0; return r; }
  static __device__ __forceinline__ double back(bool_t v) { return (double)v.b; }
  static __device__ __forceinline__ float load(const bool_t* p) { return (float)p->b; }
};

// store V values of a group; one vector store when the group is whole and aligned
template <typename T, int V>
__device__ __forceinline__ void store(T* out, i64 base, i64 n, const T* v, bool aligned) {
  if (aligned && base + V <= n) {
    if (sizeof(T) * V == 16) { *(uint4*)(out + base) = *(const uint4*)v; return; }
    if (sizeof(T) * V == 8) { *(uint2*)(out + base) = *(const uint2*)v; return; }
    if (sizeof(T) * V == 4) { *(u32*)(out + base) = *(const u32*)v; return; }
  }
#pragma unroll
  for (int j = 0; j < V; j++) if (base + j < n) out[base + j] = v[j];
}

// one uniform-derived value of a continuous distribution, in float (narrow) or double (wide)
template <int D, typename F>
__device__ __forceinline__ F shape(F u, F uc, double a, double b) {
  if (D == 0) return (F)a + ((F)b - (F)a) * u;
  if (D == 2) return -log(uc) / (F)a;
  if (D == 4) return (F)a + (F)b * tan((F)3.14159265358979323846 * (u - (F)0.5));
  if (D == 5) return ceil(log(uc) / (F)log1p(-a));
  return u;
}

"""

FILLS = r"""
template <typename T, int D, bool WIDE>
__device__ __forceinline__ void fill(T* out, i64 n, const u64* slot, u64 call, double a, double b,
                                     const float* p, i64 lo, u64 range) {
  if (D >= 9) { sample<T, D, WIDE>(out, n, slot, call, a, b); return; }
  const int V = WIDE ? 2 : 4;
  const u64 off = call, key = slot[0];
  const u32 k0 = (u32)key, k1 = (u32)(key >> 32);
  const i64 groups = (n + V - 1) / V;
  const bool aligned = ((u64)out % (sizeof(T) * V)) == 0;
  for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += (i64)gridDim.x * blockDim.x) {
    u4 r = philox((u32)g, (u32)((u64)g >> 32), (u32)off, (u32)(off >> 32), k0, k1);
    const i64 base = g * V;
    __align__(16) T v[V];
    if (D == 8) {  // randint: lo + x mod range
      if (WIDE) {
        v[0] = Cv<T>::fromi(lo + (i64)((((u64)r.x << 32) | r.y) % range));
        v[1] = Cv<T>::fromi(lo + (i64)((((u64)r.z << 32) | r.w) % range));
      } else {
        u32 rr = (u32)range;  // range == 2^32 is passed as 0: the word itself
        u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = Cv<T>::fromi(lo + (i64)(rr ? w[j] % rr : w[j]));
      }
    } else if (D == 6 || D == 7) {  // bernoulli: u < p, u with 32 bits
      u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        double pj = D == 6 ? a : (base + j < n ? (double)p[base + j] : 0.0);
        v[j] = Cv<T>::from((double)w[j] * 2.3283064365386963e-10 < pj ? 1.0f : 0.0f);
      }
    } else if (D == 1 || D == 3) {  // normal, log-normal: Box-Muller
      if (WIDE) {
        double rad = sqrt(-2.0 * log(u53c(r.x, r.y))), s, c;
        sincospi(2.0 * u53(r.z, r.w), &s, &c);
        double z0 = a + b * rad * c, z1 = a + b * rad * s;
        if (D == 3) { z0 = exp(z0); z1 = exp(z1); }
        v[0] = Cv<T>::from(z0); v[1] = Cv<T>::from(z1);
      } else {
        float z[4];
        float rad0 = sqrtf(-2.0f * logf(u24c(r.x))), rad1 = sqrtf(-2.0f * logf(u24c(r.z))), s, c;
        sincospif(2.0f * u24(r.y), &s, &c); z[0] = rad0 * c; z[1] = rad0 * s;
        sincospif(2.0f * u24(r.w), &s, &c); z[2] = rad1 * c; z[3] = rad1 * s;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          float x = (float)a + (float)b * z[j];
          v[j] = Cv<T>::from(D == 3 ? expf(x) : x);
        }
      }
    } else {  // uniform-derived
      if (WIDE) {
        double us[2] = {u53(r.x, r.y), u53(r.z, r.w)}, ucs[2] = {u53c(r.x, r.y), u53c(r.z, r.w)};
#pragma unroll
        for (int j = 0; j < 2; j++) {
          T t = Cv<T>::from(shape<D, double>(us[j], ucs[j], a, b));
          if (D == 0 && Cv<T>::back(t) >= b) t = Cv<T>::from(a);  // [a, b): a rounded-up b becomes a
          v[j] = t;
        }
      } else {
        u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
          T t = Cv<T>::from(shape<D, float>(u24(w[j]), u24c(w[j]), a, b));
          if (D == 0 && Cv<T>::back(t) >= b) t = Cv<T>::from(a);
          v[j] = t;
        }
      }
    }
    store<T, V>(out, base, n, v, aligned);
  }
}

// dropout: keep with probability `keep`, scale kept values; mask (bool) may be null
template <typename T>
__device__ __forceinline__ void dropout(const T* in, T* out, bool_t* mask, i64 n, const u64* slot,
                                        u64 call, float keep, float scale) {
  const u64 off = call, key = slot[0];
  const u32 k0 = (u32)key, k1 = (u32)(key >> 32);
  const i64 groups = (n + 3) / 4;
  const bool aligned = ((u64)out % (sizeof(T) * 4)) == 0 && ((u64)in % (sizeof(T) * 4)) == 0
                       && ((u64)mask % 4) == 0;
  for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += (i64)gridDim.x * blockDim.x) {
    u4 r = philox((u32)g, (u32)((u64)g >> 32), (u32)off, (u32)(off >> 32), k0, k1);
    const i64 base = g * 4;
    u32 w[4] = {r.x, r.y, r.z, r.w};
    __align__(16) T x[4];
    __align__(16) T y[4];
    __align__(4) bool_t m[4];
    if (aligned && base + 4 <= n) {
      if (sizeof(T) * 4 == 16) *(uint4*)x = *(const uint4*)(in + base);
      else if (sizeof(T) * 4 == 8) *(uint2*)x = *(const uint2*)(in + base);
      else { for (int j = 0; j < 4; j++) x[j] = in[base + j]; }
    } else {
      for (int j = 0; j < 4; j++) if (base + j < n) x[j] = in[base + j];
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
      bool k = u24(w[j]) < keep;
      m[j].b = k;
      y[j] = Cv<T>::from(k ? Cv<T>::load(x + j) * scale : 0.0f);
    }
    store<T, 4>(out, base, n, y, aligned);
    if (mask) store<bool_t, 4>(mask, base, n, m, aligned);
  }
}
"""

COMMON = COMMON + SAMPLERS_SOURCE + FILLS

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

# a generator record (rng.Source): slot[0] key, slot[1] position, slot[2] base; the key of a
# position is rng.replay_key (splitmix64(base ^ splitmix64(pos)))
MIX = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 cgraw_splitmix64(u64 x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
"""

# the graph's last node: the position moves by the replay's increment (modulo 2**64, or 2**64 - 1
# with mod1, as CuPy's _rk_seed), and the key follows it
ADVANCE = MIX + r"""
extern "C" __global__ void cgraw_rng_advance(u64* slot, u64 inc, u64 mod1) {
  u64 p = slot[1], s = p + inc;
  if (mod1) {
    if (s < p) s += 1;  // 2**64 is 1 modulo 2**64 - 1
    if (s == ~0ull) s = 0;
  }
  slot[1] = s;
  slot[0] = cgraw_splitmix64(slot[2] ^ cgraw_splitmix64(s));
}
"""

# the host's write when the generator moved outside the graphs (a seed, a state restored, eager draws)
SET = MIX + r"""
extern "C" __global__ void cgraw_rng_set(u64* slot, u64 base, u64 pos) {
  slot[2] = base;
  slot[1] = pos;
  slot[0] = cgraw_splitmix64(base ^ cgraw_splitmix64(pos));
}
"""


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


def source(name: str) -> str:
    """The CUDA C source defining the kernel ``name`` (one of the names above)."""
    if name == ADVANCE_NAME:
        return ADVANCE
    if name == SET_NAME:
        return SET
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
