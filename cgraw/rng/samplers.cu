// CUDA C source of cgraw's rejection samplers (gamma, beta, poisson, binomial).
//
// Joined into ``rng.kernels.COMMON`` after ``philox.cu`` (it uses its ``philox``, ``u4`` and ``Cv``);
// ``fill`` (``fills.cu``) hands distributions 9 to 12 to ``sample`` below.
//
// Rejection samplers (``rng.kernels.SAMPLERS``) need a variable number of
// uniforms per output, so each element ``i`` has its own stream of Philox blocks: block ``j`` of
// element ``i`` is counter ``(i low, (i >> 32) | j << 8, offset low, offset high)``, which holds
// ``i < 2**40`` (``rng.kernels.SAMPLE_MAX``) and ``j < 2**24`` (the iteration caps below use at most 1,537
// blocks), under the replay's key. The ``offset`` words are the call's own within the graph
// (``RngStream.take(SAMPLER_STEPS[dist])``): no other call draws at them, so these counters meet no
// other draw of the graph, and within the call two elements or two blocks never share one; the
// numbers do not depend on the grid either. Beta takes two offsets: X ~ Gamma(a) draws at
// ``offset``, Y ~ Gamma(b) at ``offset + 1``. Uniforms are open, (0, 1): 32 bits for float32 gamma
// and beta, 52 bits otherwise. Every rejection loop stops after ``CGRAW_CAP`` (1024) tries and then
// writes NaN (float) or -1 (integer); each try accepts with probability above 0.2 (gamma: 0.95,
// PTRS and BTRS: about 0.8 or more, inversion: a restart only past the bound of 10 standard
// deviations), so the cap is not reached in practice.
// ---- rejection samplers: one stream of Philox blocks per element (see above)
#define CGRAW_CAP 1024
struct Ws {
  u32 c0, c1, c2, c3, k0, k1, blk, pos;
  u4 r;
  double spare;
  bool has, wide;
};

__device__ __forceinline__ void ws_init(Ws& s, i64 i, u64 off, u32 k0, u32 k1, bool wide) {
  s.c0 = (u32)i; s.c1 = (u32)((u64)i >> 32); s.c2 = (u32)off; s.c3 = (u32)(off >> 32);
  s.k0 = k0; s.k1 = k1; s.blk = 0; s.pos = 4; s.has = false; s.wide = wide; s.spare = 0.0;
}

__device__ __forceinline__ u32 ws_word(Ws& s) {
  if (s.pos == 4) {
    s.r = philox(s.c0, s.c1 | (s.blk << 8), s.c2, s.c3, s.k0, s.k1);
    s.blk++;
    s.pos = 0;
  }
  u32 w = s.pos == 0 ? s.r.x : s.pos == 1 ? s.r.y : s.pos == 2 ? s.r.z : s.r.w;
  s.pos++;
  return w;
}

// (0, 1), never 0 or 1: 32 bits + 1/2, or 52 bits + 1/2 (exact in double)
__device__ __forceinline__ double ws_u(Ws& s) {
  if (!s.wide) return ((double)ws_word(s) + 0.5) * 2.3283064365386963e-10;
  u32 a = ws_word(s), b = ws_word(s);
  return ((double)(a >> 6) * 67108864.0 + (double)(b >> 6) + 0.5) * 2.220446049250313e-16;
}

// Box-Muller: two normals per pair of uniforms, the second kept for the next call
__device__ __forceinline__ double ws_normal(Ws& s) {
  if (s.has) { s.has = false; return s.spare; }
  double rad = sqrt(-2.0 * log(ws_u(s))), sn, cs;
  sincospi(2.0 * ws_u(s), &sn, &cs);
  s.spare = rad * sn;
  s.has = true;
  return rad * cs;
}

__device__ __forceinline__ double qnan() { return __longlong_as_double(0x7ff8000000000000LL); }

// Gamma(a) = g * exp(*lb): Marsaglia & Tsang (2000) for a >= 1; a < 1 boosts G(a + 1) by
// U^(1/a), kept as its log so beta's ratio survives tiny shapes. NaN if the cap is hit.
__device__ double ws_gamma(Ws& s, double a, double* lb) {
  *lb = 0.0;
  if (a < 1.0) { *lb = log(ws_u(s)) / a; a += 1.0; }
  const double d = a - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
  for (int it = 0; it < CGRAW_CAP; it++) {
    const double x = ws_normal(s);
    double v = 1.0 + c * x;
    if (v <= 0.0) continue;
    v = v * v * v;
    const double u = ws_u(s), x2 = x * x;
    if (u < 1.0 - 0.0331 * x2 * x2 || log(u) < 0.5 * x2 + d * (1.0 - v + log(v))) return d * v;
  }
  return qnan();
}

// Poisson(lam): Knuth's multiplication for lam < 10, else Hoermann's PTRS (1993). -1 at the cap.
__device__ double ws_poisson(Ws& s, double lam) {
  if (!(lam > 0.0)) return 0.0;
  if (lam < 10.0) {
    const double e = exp(-lam);
    double prod = 1.0;
    for (int k = 0; k < CGRAW_CAP; k++) {
      prod *= ws_u(s);
      if (prod <= e) return (double)k;
    }
    return -1.0;
  }
  const double slam = sqrt(lam), loglam = log(lam), b = 0.931 + 2.53 * slam, a = -0.059 + 0.02483 * b;
  const double linvalpha = log(1.1239 + 1.1328 / (b - 3.4)), vr = 0.9277 - 3.6224 / (b - 2.0);
  for (int it = 0; it < CGRAW_CAP; it++) {
    const double u = ws_u(s) - 0.5, v = ws_u(s), us = 0.5 - fabs(u);
    const double k = floor((2.0 * a / us + b) * u + lam + 0.43);
    if (us >= 0.07 && v <= vr) return k;
    if (k < 0.0 || (us < 0.013 && v > us)) continue;
    if (log(v) + linvalpha - log(a / (us * us) + b) <= -lam + k * loglam - lgamma(k + 1.0)) return k;
  }
  return -1.0;
}

// log(k!) - [(k + 1/2) log(k + 1) - (k + 1) + log(2 pi) / 2]: exact for small k, series above
__device__ __forceinline__ double stirling_tail(double k) {
  if (k < 10.0) return lgamma(k + 1.0) - (k + 0.5) * log(k + 1.0) + (k + 1.0) - 0.91893853320467274;
  const double kp1sq = (k + 1.0) * (k + 1.0);
  return (1.0 / 12 - (1.0 / 360 - 1.0 / 1260 / kp1sq) / kp1sq) / (k + 1.0);
}

// Binomial(n, p), p <= 1/2: inversion for n p < 10, else Hoermann's BTRS (1993). -1 at the cap.
__device__ double ws_binomial_low(Ws& s, double n, double p) {
  const double q = 1.0 - p;
  if (n * p < 10.0) {
    const double qn = exp(n * log1p(-p)), np = n * p, bound = fmin(n, np + 10.0 * sqrt(np * q + 1.0));
    double x = 0.0, px = qn, u = ws_u(s);
    for (int it = 0; it < CGRAW_CAP; it++) {
      if (u <= px) return x;
      x += 1.0;
      if (x > bound) { x = 0.0; px = qn; u = ws_u(s); }
      else { u -= px; px = ((n - x + 1.0) * p * px) / (x * q); }
    }
    return -1.0;
  }
  const double spq = sqrt(n * p * q), b = 1.15 + 2.53 * spq, a = -0.0873 + 0.0248 * b + 0.01 * p;
  const double c = n * p + 0.5, vr = 0.92 - 4.2 / b, r = p / q, alpha = (2.83 + 5.1 / b) * spq;
  const double m = floor((n + 1.0) * p);
  for (int it = 0; it < CGRAW_CAP; it++) {
    const double u = ws_u(s) - 0.5, v = ws_u(s), us = 0.5 - fabs(u);
    const double k = floor((2.0 * a / us + b) * u + c);
    if (k < 0.0 || k > n) continue;
    if (us >= 0.07 && v <= vr) return k;
    const double lv = log(v * alpha / (a / (us * us) + b));
    const double ub = (m + 0.5) * log((m + 1.0) / (r * (n - m + 1.0))) + (n + 1.0) * log((n - m + 1.0) / (n - k + 1.0))
                      + (k + 0.5) * log(r * (n - k + 1.0) / (k + 1.0)) + stirling_tail(m) + stirling_tail(n - m)
                      - stirling_tail(k) - stirling_tail(n - k);
    if (lv <= ub) return k;
  }
  return -1.0;
}

__device__ __forceinline__ double ws_binomial(Ws& s, double n, double p) {
  if (n <= 0.0 || p <= 0.0) return 0.0;
  if (p >= 1.0) return n;
  if (p <= 0.5) return ws_binomial_low(s, n, p);
  const double k = ws_binomial_low(s, n, 1.0 - p);  // by symmetry
  return k < 0.0 ? k : n - k;
}

template <typename T, int D, bool WIDE>
__device__ __forceinline__ void sample(T* out, i64 n, const u64* slot, u64 call, double a, double b) {
  const u64 off = call, key = slot[0];
  const u32 k0 = (u32)key, k1 = (u32)(key >> 32);
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    Ws s;
    ws_init(s, i, off, k0, k1, WIDE);
    if (D == 9) {
      double lb, g = ws_gamma(s, a, &lb);
      out[i] = Cv<T>::from(b * g * exp(lb));
    } else if (D == 10) {  // X / (X + Y) = 1 / (1 + Y / X), in logs
      double la, lb, x = ws_gamma(s, a, &la);
      Ws t;
      ws_init(t, i, off + 1, k0, k1, WIDE);
      double y = ws_gamma(t, b, &lb);
      out[i] = Cv<T>::from(1.0 / (1.0 + exp((log(y) + lb) - (log(x) + la))));
    } else if (D == 11) {
      out[i] = Cv<T>::fromi((i64)ws_poisson(s, a));
    } else {
      out[i] = Cv<T>::fromi((i64)ws_binomial(s, a, b));
    }
  }
}

