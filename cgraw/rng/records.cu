// A generator record (rng.plan.Source): slot[0] key, slot[1] position, slot[2] base; the key of a
// position is rng.plan.replay_key (splitmix64(base ^ splitmix64(pos))); a loop body's step is
// rng.plan.loop_key.
typedef unsigned long long u64;
__device__ __forceinline__ u64 cgraw_splitmix64(u64 x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// the graph's last node: the position moves by the replay's increment (modulo 2**64, or 2**64 - 1
// with mod1, as CuPy's _rk_seed), and the key follows it
extern "C" __global__ void cgraw_rng_advance(u64* slot, u64 inc, u64 mod1) {
  u64 p = slot[1], s = p + inc;
  if (mod1) {
    if (s < p) s += 1;  // 2**64 is 1 modulo 2**64 - 1
    if (s == ~0ull) s = 0;
  }
  slot[1] = s;
  slot[0] = cgraw_splitmix64(slot[2] ^ cgraw_splitmix64(s));
}

// the host's write when the generator moved outside the graphs (a seed, a state restored, eager draws)
extern "C" __global__ void cgraw_rng_set(u64* slot, u64 base, u64 pos) {
  slot[2] = base;
  slot[1] = pos;
  slot[0] = cgraw_splitmix64(base ^ cgraw_splitmix64(pos));
}

// the last node of a cgraw.while_loop body that draws: the key moves on, so the next iteration's
// draws, at the offsets the body took, are fresh; the position stays, and the graph's last node
// makes the key the next replay's again
extern "C" __global__ void cgraw_rng_step(u64* slot) {
  slot[0] = cgraw_splitmix64(slot[0] ^ 0x6C6F6F705F6B6579ull);
}
