// Philox4x32-10, the conversions of its words to each distribution and dtype, and the helpers the
// fills and samplers share (rng/kernels.py's docstring gives the counter layout). No header is
// included: half and bfloat16 are converted with PTX or integer rounding.
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

