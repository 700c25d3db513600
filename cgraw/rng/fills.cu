// The fill and dropout bodies every cgraw_fill_* and cgraw_dropout_* kernel instantiates
// (rng/kernels.py adds the extern "C" wrapper of each).
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
