// ferrolm's CUDA kernels, compiled to PTX by build.rs (feature `cuda`) and loaded through candle's
// custom-module cache. Every kernel takes raw device pointers; `T` is float or __nv_bfloat16 and
// all arithmetic is in float. Positions can come from the host (`pos_host`) or from a device
// word (`pos_ptr`, non-null), so that one captured CUDA graph serves every decode step.
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ unsigned read_pos(const unsigned* pos_ptr, unsigned pos_host) {
  return pos_ptr ? *pos_ptr : pos_host;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// The rotation of one pair, written without contraction so every kernel rounds it identically.
__device__ __forceinline__ void rotate(float a, float b, float c, float s, float* o1, float* o2) {
  *o1 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  *o2 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

// ---------------------------------------------------------------------------------------------
// RMSNorm, optionally fused with the residual add: sum = x + r (rounded to T, written to
// sum_out), out = sum / sqrt(mean(sum²) + eps) * w. One block per row.
template <typename T>
__device__ void rmsnorm(const T* x, const T* r, T* sum_out, T* out, const float* w, int cols, float eps) {
  size_t row = blockIdx.x;
  x += row * cols;
  out += row * cols;
  if (r) {
    r += row * cols;
    sum_out += row * cols;
  }
  float ss = 0.f;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) {
    float v = to_f(x[i]);
    if (r) {
      T s = from_f<T>(v + to_f(r[i]));
      sum_out[i] = s;
      v = to_f(s);
    }
    ss += v * v;
  }
  ss = block_sum(ss);
  float inv = rsqrtf(ss / (float)cols + eps);
  for (int i = threadIdx.x; i < cols; i += blockDim.x) {
    float v = r ? to_f(sum_out[i]) : to_f(x[i]);
    out[i] = from_f<T>(v * inv * w[i]);
  }
}

extern "C" __global__ void fl_rmsnorm_bf16(const bf16* x, const bf16* r, bf16* sum_out, bf16* out, const float* w, int cols, float eps) {
  rmsnorm<bf16>(x, r, sum_out, out, w, cols, eps);
}
extern "C" __global__ void fl_rmsnorm_f32(const float* x, const float* r, float* sum_out, float* out, const float* w, int cols, float eps) {
  rmsnorm<float>(x, r, sum_out, out, w, cols, eps);
}

// ---------------------------------------------------------------------------------------------
// RoPE over x [tokens, heads, dim] (contiguous); token t sits at position pos + t. cos/sin are
// [max_positions, dim/2] f32 tables. interleaved: pairs (2i, 2i+1); else (i, i + dim/2).
template <typename T>
__device__ void rope(const T* x, T* out, const float* cos_t, const float* sin_t, const unsigned* pos_ptr,
                     unsigned pos_host, int tokens, int heads, int dim, int interleaved) {
  int half = dim / 2;
  size_t total = (size_t)tokens * heads * half;
  unsigned p0 = read_pos(pos_ptr, pos_host);
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
    int i = (int)(idx % half);
    size_t th = idx / half;
    int t = (int)(th / heads);
    const T* src = x + th * dim;
    T* dst = out + th * dim;
    size_t row = (size_t)(p0 + t) * half + i;
    int ai = interleaved ? 2 * i : i;
    int bi = interleaved ? 2 * i + 1 : i + half;
    float o1, o2;
    rotate(to_f(src[ai]), to_f(src[bi]), cos_t[row], sin_t[row], &o1, &o2);
    dst[ai] = from_f<T>(o1);
    dst[bi] = from_f<T>(o2);
  }
}

extern "C" __global__ void fl_rope_bf16(const bf16* x, bf16* out, const float* c, const float* s, const unsigned* pp,
                                        unsigned ph, int tokens, int heads, int dim, int inter) {
  rope<bf16>(x, out, c, s, pp, ph, tokens, heads, dim, inter);
}
extern "C" __global__ void fl_rope_f32(const float* x, float* out, const float* c, const float* s, const unsigned* pp,
                                       unsigned ph, int tokens, int heads, int dim, int inter) {
  rope<float>(x, out, c, s, pp, ph, tokens, heads, dim, inter);
}

// ---------------------------------------------------------------------------------------------
// Appends one token's keys and values at position pos of caches [kv_heads, cap, dim] (head
// stride cap*dim): k is rotated on the way (when cos_t is non-null), v copied. k, v: [kv_heads, dim].
// grid: kv_heads, block: dim/2 threads.
template <typename T>
__device__ void kv_append(const T* k, const T* v, T* kc, T* vc, const float* cos_t, const float* sin_t,
                          const unsigned* pos_ptr, unsigned pos_host, int dim, int cap, int interleaved) {
  unsigned p = read_pos(pos_ptr, pos_host);
  if (p >= (unsigned)cap) return;  // the host reserves capacity before any step; never taken
  int h = blockIdx.x, half = dim / 2;
  const T* ks = k + (size_t)h * dim;
  const T* vs = v + (size_t)h * dim;
  size_t o = ((size_t)h * cap + p) * dim;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    int ai = interleaved ? 2 * i : i;
    int bi = interleaved ? 2 * i + 1 : i + half;
    if (cos_t) {
      size_t row = (size_t)p * half + i;
      float o1, o2;
      rotate(to_f(ks[ai]), to_f(ks[bi]), cos_t[row], sin_t[row], &o1, &o2);
      kc[o + ai] = from_f<T>(o1);
      kc[o + bi] = from_f<T>(o2);
    } else {
      kc[o + ai] = ks[ai];
      kc[o + bi] = ks[bi];
    }
    vc[o + ai] = vs[ai];
    vc[o + bi] = vs[bi];
  }
}

extern "C" __global__ void fl_kv_append_bf16(const bf16* k, const bf16* v, bf16* kc, bf16* vc, const float* c, const float* s,
                                             const unsigned* pp, unsigned ph, int dim, int cap, int inter) {
  kv_append<bf16>(k, v, kc, vc, c, s, pp, ph, dim, cap, inter);
}
extern "C" __global__ void fl_kv_append_f32(const float* k, const float* v, float* kc, float* vc, const float* c, const float* s,
                                            const unsigned* pp, unsigned ph, int dim, int cap, int inter) {
  kv_append<float>(k, v, kc, vc, c, s, pp, ph, dim, cap, inter);
}

// ---------------------------------------------------------------------------------------------
// Single-query attention over a KV cache (flash-decoding). q: [hq, D]; kc, vc: [hkv, *, D] with
// head stride `head_stride` and token stride D; query head h*G+g uses kv head h. The query sits
// at absolute position qpos; key j (0-based in the view) is at key_start + j and is visible when
// lo <= j < hi (causal, optional sliding window), j < s_max. Keys are split in chunks of
// `chunk`; block (h, split) writes each of its G heads' running max, sum and weighted values to
// the partial buffers, and attn_combine merges the splits. When cos_t is non-null q is rotated
// first (at qpos). 128 threads = 4 warps; each warp takes every 4th key; lanes hold D/32
// consecutive elements.
#define ATTN_WARPS 4
#define ATTN_MAX_G 8

template <typename T, int D>
__device__ void attn_partial(const T* q, const T* kc, const T* vc, const float* cos_t, const float* sin_t,
                             const unsigned* pos_ptr, unsigned pos_host, int G, long head_stride, int key_start,
                             int s_max, int window, int chunk, float scale, float softcap, int interleaved,
                             float* part_m, float* part_l, float* part_acc) {
  constexpr int E = D / 32;
  __shared__ float qs[ATTN_MAX_G][D];
  __shared__ float sm[ATTN_WARPS][ATTN_MAX_G];
  __shared__ float sl[ATTN_WARPS][ATTN_MAX_G];
  __shared__ float sacc[ATTN_WARPS][ATTN_MAX_G][D];
  int h = blockIdx.x, split = blockIdx.y, nsplit = gridDim.y;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  long qpos = (long)read_pos(pos_ptr, pos_host);
  long hi = qpos + 1 - key_start;
  if (hi > s_max) hi = s_max;
  long lo = 0;
  if (window > 0) {
    lo = qpos + 1 - window - key_start;
    if (lo < 0) lo = 0;
  }
  long begin = (long)split * chunk, end = begin + chunk;
  if (begin < lo) begin = lo;
  if (end > hi) end = hi;

  // q (rotated, scaled) into shared memory.
  int half = D / 2;
  for (int idx = threadIdx.x; idx < G * half; idx += blockDim.x) {
    int g = idx / half, i = idx % half;
    const T* src = q + (size_t)(h * G + g) * D;
    int ai = interleaved ? 2 * i : i;
    int bi = interleaved ? 2 * i + 1 : i + half;
    float a = to_f(src[ai]), b = to_f(src[bi]);
    if (cos_t) {
      size_t row = (size_t)qpos * half + i;
      float o1, o2;
      rotate(a, b, cos_t[row], sin_t[row], &o1, &o2);
      // Round like the separately rotated q of the host-position path.
      a = to_f(from_f<T>(o1));
      b = to_f(from_f<T>(o2));
    }
    qs[g][ai] = a * scale;
    qs[g][bi] = b * scale;
  }
  __syncthreads();

  float qr[ATTN_MAX_G][E];
  float m[ATTN_MAX_G], l[ATTN_MAX_G], acc[ATTN_MAX_G][E];
#pragma unroll
  for (int g = 0; g < ATTN_MAX_G; g++) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; e++) {
      qr[g][e] = g < G ? qs[g][lane * E + e] : 0.f;
      acc[g][e] = 0.f;
    }
  }
  const T* kh = kc + (size_t)h * head_stride;
  const T* vh = vc + (size_t)h * head_stride;
  for (long j = begin + warp; j < end; j += ATTN_WARPS) {
    float kr[E], vr[E];
    const T* krow = kh + (size_t)j * D + lane * E;
    const T* vrow = vh + (size_t)j * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; e++) {
      kr[e] = to_f(krow[e]);
      vr[e] = to_f(vrow[e]);
    }
#pragma unroll
    for (int g = 0; g < ATTN_MAX_G; g++) {
      if (g >= G) break;
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < E; e++) s += qr[g][e] * kr[e];
      s = warp_sum(s);
      if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
      float mn = fmaxf(m[g], s);
      float corr = __expf(m[g] - mn);
      float p = __expf(s - mn);
      l[g] = l[g] * corr + p;
#pragma unroll
      for (int e = 0; e < E; e++) acc[g][e] = acc[g][e] * corr + p * vr[e];
      m[g] = mn;
    }
  }
  for (int g = 0; g < G; g++) {
    if (lane == 0) {
      sm[warp][g] = m[g];
      sl[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; e++) sacc[warp][g][lane * E + e] = acc[g][e];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    int g = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int w = 0; w < ATTN_WARPS; w++) M = fmaxf(M, sm[w][g]);
    float L = 0.f, A = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < ATTN_WARPS; w++) {
        if (sm[w][g] == -INFINITY) continue;
        float f = __expf(sm[w][g] - M);
        L += sl[w][g] * f;
        A += sacc[w][g][d] * f;
      }
    }
    size_t slot = (size_t)(h * G + g) * nsplit + split;
    part_acc[slot * D + d] = A;
    if (d == 0) {
      part_m[slot] = M;
      part_l[slot] = L;
    }
  }
}

#define ATTN_INSTANCE(T, NAME, D)                                                                                  \
  extern "C" __global__ void __launch_bounds__(128) fl_attn_##NAME##_d##D(                                         \
      const T* q, const T* kc, const T* vc, const float* c, const float* s, const unsigned* pp, unsigned ph, int G, \
      long hs, int ks, int smax, int win, int chunk, float scale, float cap, int inter, float* pm, float* pl,        \
      float* pa) {                                                                                                 \
    attn_partial<T, D>(q, kc, vc, c, s, pp, ph, G, hs, ks, smax, win, chunk, scale, cap, inter, pm, pl, pa);       \
  }
ATTN_INSTANCE(bf16, bf16, 64)
ATTN_INSTANCE(bf16, bf16, 128)
ATTN_INSTANCE(bf16, bf16, 256)
ATTN_INSTANCE(float, f32, 64)
ATTN_INSTANCE(float, f32, 128)
ATTN_INSTANCE(float, f32, 256)

// Merges the splits of attn_partial: grid hq, block D threads; out [hq, D].
template <typename T>
__device__ void attn_combine(const float* part_m, const float* part_l, const float* part_acc, T* out, int nsplit, int D) {
  int hq = blockIdx.x, d = threadIdx.x;
  if (d >= D) return;
  const float* pm = part_m + (size_t)hq * nsplit;
  const float* pl = part_l + (size_t)hq * nsplit;
  float M = -INFINITY;
  for (int s = 0; s < nsplit; s++) M = fmaxf(M, pm[s]);
  float num = 0.f, den = 0.f;
  if (M != -INFINITY) {
    for (int s = 0; s < nsplit; s++) {
      if (pm[s] == -INFINITY) continue;
      float f = __expf(pm[s] - M);
      den += pl[s] * f;
      num += part_acc[((size_t)hq * nsplit + s) * D + d] * f;
    }
  }
  out[(size_t)hq * D + d] = from_f<T>(den > 0.f ? num / den : 0.f);
}

extern "C" __global__ void fl_attn_combine_bf16(const float* pm, const float* pl, const float* pa, bf16* out, int nsplit, int D) {
  attn_combine<bf16>(pm, pl, pa, out, nsplit, D);
}
extern "C" __global__ void fl_attn_combine_f32(const float* pm, const float* pl, const float* pa, float* out, int nsplit, int D) {
  attn_combine<float>(pm, pl, pa, out, nsplit, D);
}

// ---------------------------------------------------------------------------------------------
// silu(gate) * up, elementwise.
template <typename T>
__device__ void silu_mul(const T* g, const T* u, T* out, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float x = to_f(g[i]);
    out[i] = from_f<T>(x / (1.f + __expf(-x)) * to_f(u[i]));
  }
}
extern "C" __global__ void fl_silu_mul_bf16(const bf16* g, const bf16* u, bf16* out, size_t n) { silu_mul<bf16>(g, u, out, n); }
extern "C" __global__ void fl_silu_mul_f32(const float* g, const float* u, float* out, size_t n) { silu_mul<float>(g, u, out, n); }

// ---------------------------------------------------------------------------------------------
// y[n] = sum_k x[k] * W[n, k] for one bf16 row x [K] and W [N, K] bf16 row-major (K % 8 == 0):
// one warp per output row, 16-byte loads, four in flight per lane. y is bf16 or f32.
template <typename TO>
__device__ void gemv_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w, TO* __restrict__ y, int N, int K) {
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int n = blockIdx.x * (blockDim.x >> 5) + warp;
  if (n >= N) return;
  const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)n * K);
  const uint4* xr = reinterpret_cast<const uint4*>(x);
  int nv = K / 8;
  float acc = 0.f;
  int i = lane;
  for (; i + 96 < nv; i += 128) {
    uint4 wv[4], xv[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      wv[u] = __ldg(wr + i + 32 * u);
      xv[u] = __ldg(xr + i + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv[u]);
      const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv[u]);
#pragma unroll
      for (int e = 0; e < 4; e++) {
        float2 a = __bfloat1622float2(wp[e]);
        float2 b = __bfloat1622float2(xp[e]);
        acc = fmaf(a.x, b.x, acc);
        acc = fmaf(a.y, b.y, acc);
      }
    }
  }
  for (; i < nv; i += 32) {
    uint4 wv = __ldg(wr + i), xv = __ldg(xr + i);
    const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
    const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
    for (int e = 0; e < 4; e++) {
      float2 a = __bfloat1622float2(wp[e]);
      float2 b = __bfloat1622float2(xp[e]);
      acc = fmaf(a.x, b.x, acc);
      acc = fmaf(a.y, b.y, acc);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) y[n] = from_f<TO>(acc);
}
extern "C" __global__ void __launch_bounds__(256) fl_gemv_bf16(const bf16* x, const bf16* w, bf16* y, int N, int K) {
  gemv_bf16<bf16>(x, w, y, N, K);
}
extern "C" __global__ void __launch_bounds__(256) fl_gemv_bf16_f32out(const bf16* x, const bf16* w, float* y, int N, int K) {
  gemv_bf16<float>(x, w, y, N, K);
}

// The same product with x staged once per block in shared memory (the eight warps of a block
// stop re-reading it through L1) and eight 16-byte weight loads in flight per lane, read with
// the streaming hint (weights are used once per step; keep L2 for activations and the KV cache).
// Needs K/8 uint4 of dynamic shared memory.
__device__ __forceinline__ float dot8(uint4 wv, uint4 xv, float acc) {
  const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
  const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
  for (int e = 0; e < 4; e++) {
    float2 a = __bfloat1622float2(wp[e]);
    float2 b = __bfloat1622float2(xp[e]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}
template <typename TO>
__device__ void gemv_smem_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w, TO* __restrict__ y, int N, int K) {
  extern __shared__ uint4 xs[];
  int nv = K / 8;
  const uint4* xg = reinterpret_cast<const uint4*>(x);
  for (int i = threadIdx.x; i < nv; i += blockDim.x) xs[i] = xg[i];
  __syncthreads();
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int n = blockIdx.x * (blockDim.x >> 5) + warp;
  if (n >= N) return;
  const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)n * K);
  float acc = 0.f;
  int i = lane;
  for (; i + 224 < nv; i += 256) {
    uint4 wv[8];
#pragma unroll
    for (int u = 0; u < 8; u++) wv[u] = __ldcs(wr + i + 32 * u);
#pragma unroll
    for (int u = 0; u < 8; u++) acc = dot8(wv[u], xs[i + 32 * u], acc);
  }
  for (; i < nv; i += 32) acc = dot8(__ldcs(wr + i), xs[i], acc);
  acc = warp_sum(acc);
  if (lane == 0) y[n] = from_f<TO>(acc);
}
extern "C" __global__ void __launch_bounds__(256) fl_gemv_smem_bf16(const bf16* x, const bf16* w, bf16* y, int N, int K) {
  gemv_smem_bf16<bf16>(x, w, y, N, K);
}

// ---------------------------------------------------------------------------------------------
// Causal (and windowed, soft-capped) softmax of raw attention scores for a prefill: scores
// [rows, S] with row r the query at position query_start + r % T; key j sits at key_start + j and
// is visible when kpos <= qpos and (no window, or kpos + window > qpos). probs = softmax(scale ·
// score, soft-capped) over the visible keys, 0 elsewhere. One block per row, arithmetic in f32.
template <typename T>
__device__ void masked_softmax(const T* scores, T* probs, int S, int T_, unsigned query_start, unsigned key_start,
                               int window, float scale, float softcap) {
  size_t row = blockIdx.x;
  const T* x = scores + row * S;
  T* out = probs + row * S;
  long qpos = (long)query_start + (long)(row % T_);
  long hi = qpos - (long)key_start + 1;  // keys [lo, hi) are visible
  if (hi > S) hi = S;
  long lo = window > 0 ? qpos + 1 - window - (long)key_start : 0;
  if (lo < 0) lo = 0;
  __shared__ float red[32];
  float m = -INFINITY;
  for (long j = lo + threadIdx.x; j < hi; j += blockDim.x) {
    float v = to_f(x[j]) * scale;
    if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
    m = fmaxf(m, v);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : -INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  m = red[0];
  __syncthreads();
  float sum = 0.f;
  for (long j = lo + threadIdx.x; j < hi; j += blockDim.x) {
    float v = to_f(x[j]) * scale;
    if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
    sum += __expf(v - m);
  }
  sum = block_sum(sum);
  float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (long j = threadIdx.x; j < S; j += blockDim.x) {
    float p = 0.f;
    if (j >= lo && j < hi) {
      float v = to_f(x[j]) * scale;
      if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
      p = __expf(v - m) * inv;
    }
    out[j] = from_f<T>(p);
  }
}
extern "C" __global__ void fl_masked_softmax_bf16(const bf16* x, bf16* o, int S, int T_, unsigned qs, unsigned ks, int w, float sc, float cap) {
  masked_softmax<bf16>(x, o, S, T_, qs, ks, w, sc, cap);
}
extern "C" __global__ void fl_masked_softmax_f32(const float* x, float* o, int S, int T_, unsigned qs, unsigned ks, int w, float sc, float cap) {
  masked_softmax<float>(x, o, S, T_, qs, ks, w, sc, cap);
}

// ---------------------------------------------------------------------------------------------
// Index of the largest of n floats (the first one on ties; NaN counts as smallest) into dst[0].
// One block of 1024 threads.
extern "C" __global__ void __launch_bounds__(1024) fl_argmax_f32(const float* x, unsigned* dst, int n) {
  __shared__ float bv[1024];
  __shared__ int bi[1024];
  float best = -INFINITY;
  int idx = 0x7fffffff;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = x[i];
    if (v > best || (idx == 0x7fffffff && !(v != v))) {
      best = v;
      idx = i;
    }
  }
  bv[threadIdx.x] = best;
  bi[threadIdx.x] = idx;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if ((int)threadIdx.x < s) {
      float ov = bv[threadIdx.x + s];
      int oi = bi[threadIdx.x + s];
      if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
        bv[threadIdx.x] = ov;
        bi[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) dst[0] = bi[0] == 0x7fffffff ? 0u : (unsigned)bi[0];
}

// p[0] += 1 (the decode position, advanced inside the captured step).
extern "C" __global__ void fl_increment_u32(unsigned* p) { p[0] += 1u; }
