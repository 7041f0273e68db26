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

// Programmatic dependent launch: let the next kernel be scheduled now, and wait until the
// previous kernel's writes are visible before reading anything. Both are no-ops for a launch
// without the PDL attribute. Every kernel starts with this.
//
// The trigger comes first, so a kernel's blocks may be scheduled two kernels ahead where shared
// memory allows (correctness still rests on each kernel's wait, which completes only after the
// previous kernel, itself waiting on the one before, has finished). Measured on an H100 against
// wait-then-trigger (FL_WAIT_FIRST, the order until 2026-12-05), alternating, same tokens: 1B
// after a 2,048-token prompt 944.8 / 944.9 against 923.5 / 922.8 tok/s, from a 16-token prompt
// 1,006.5 / 1,006.6 against 972.8 / 972.8; 8B 174.1 / 174.4 against 175.4 / 175.4.
__device__ __forceinline__ void pdl_prologue() {
#ifdef FL_WAIT_FIRST
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#else
  asm volatile("griddepcontrol.launch_dependents;" :::);
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Timeline probes, compiled only into scripts/gpu/layer_bench.cu (-DFL_TIMELINE): each block of
// an instrumented kernel appends its kernel kind, shape and the global timer at its marks (entry,
// after the wait for the previous kernel, after its input is staged, exit) to fl_tl_buf.
#ifdef FL_TIMELINE
struct TlRecord {
  int kind, n, k, block;
  unsigned long long t[4];
};
__device__ TlRecord* fl_tl_buf;
__device__ unsigned fl_tl_count, fl_tl_cap;
__device__ __forceinline__ unsigned long long tl_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
#define TL_DECL unsigned long long tl_t[4] = {tl_now(), 0, 0, 0};
#define TL_MARK(i) tl_t[i] = tl_now();
#define TL_END(KIND, N, K)                                                              \
  if (threadIdx.x == 0 && fl_tl_buf) {                                                  \
    tl_t[3] = tl_now();                                                                 \
    unsigned i_ = atomicAdd(&fl_tl_count, 1u);                                          \
    if (i_ < fl_tl_cap)                                                                 \
      fl_tl_buf[i_] = TlRecord{KIND, N, K, (int)blockIdx.x + (int)blockIdx.y * 65536, {tl_t[0], tl_t[1], tl_t[2], tl_t[3]}}; \
  }
#else
#define TL_DECL
#define TL_MARK(i)
#define TL_END(KIND, N, K)
#endif

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

// block_sum's result with one barrier: every warp folds the warps' partials itself, in warp 0's
// order (the same value, bit for bit). Called once per kernel: `part` is not reused.
__device__ float block_sum_all(float v) {
  __shared__ float part[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) part[warp] = v;
  __syncthreads();
  float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
  return warp_sum(s);
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

extern "C" __global__ void fl_rmsnorm_bf16(const bf16* x, const bf16* r, bf16* sum_out, bf16* out, const float* w, int cols, float eps) { pdl_prologue();
  rmsnorm<bf16>(x, r, sum_out, out, w, cols, eps);
}
extern "C" __global__ void fl_rmsnorm_f32(const float* x, const float* r, float* sum_out, float* out, const float* w, int cols, float eps) { pdl_prologue();
  rmsnorm<float>(x, r, sum_out, out, w, cols, eps);
}

// The same for bf16 rows with cols % 8 == 0 and cols <= 8 * RMS_VECS * blockDim.x: 16-byte loads,
// the row kept in registers (one read of x and r, no read-back of the sum). A single decode row
// is latency-bound: up to 1024 threads, every load of a thread issued before the reduction.
#define RMS_VECS 4
extern "C" __global__ void __launch_bounds__(1024) fl_rmsnorm_vec_bf16(const bf16* x, const bf16* r, bf16* sum_out, bf16* out,
                                                                       const float* w, int cols, float eps) { pdl_prologue();
  size_t row = blockIdx.x;
  int nv = cols / 8;
  const uint4* xv = reinterpret_cast<const uint4*>(x + row * cols);
  const uint4* rv = r ? reinterpret_cast<const uint4*>(r + row * cols) : nullptr;
  uint4* sv = r ? reinterpret_cast<uint4*>(sum_out + row * cols) : nullptr;
  uint4* ov = reinterpret_cast<uint4*>(out + row * cols);
  uint4 xs[RMS_VECS], rs[RMS_VECS];
#pragma unroll
  for (int u = 0; u < RMS_VECS; u++) {
    int i = threadIdx.x + u * blockDim.x;
    if (i < nv) {
      xs[u] = xv[i];
      if (rv) rs[u] = rv[i];
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < RMS_VECS; u++) {
    int i = threadIdx.x + u * blockDim.x;
    if (i >= nv) continue;
    bf16* e = reinterpret_cast<bf16*>(&xs[u]);
    if (rv) {
      const bf16* re = reinterpret_cast<const bf16*>(&rs[u]);
#pragma unroll
      for (int k = 0; k < 8; k++) e[k] = __float2bfloat16(__bfloat162float(e[k]) + __bfloat162float(re[k]));
      sv[i] = xs[u];
    }
#pragma unroll
    for (int k = 0; k < 8; k++) {
      float v = __bfloat162float(e[k]);
      ss += v * v;
    }
  }
  ss = block_sum(ss);
  float inv = rsqrtf(ss / (float)cols + eps);
#pragma unroll
  for (int u = 0; u < RMS_VECS; u++) {
    int i = threadIdx.x + u * blockDim.x;
    if (i >= nv) continue;
    const bf16* e = reinterpret_cast<const bf16*>(&xs[u]);
    const float4* wv = reinterpret_cast<const float4*>(w) + 2 * i;
    float4 w0 = wv[0], w1 = wv[1];
    float ws[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    uint4 o;
    bf16* oe = reinterpret_cast<bf16*>(&o);
#pragma unroll
    for (int k = 0; k < 8; k++) oe[k] = __float2bfloat16(__bfloat162float(e[k]) * inv * ws[k]);
    ov[i] = o;
  }
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
                                        unsigned ph, int tokens, int heads, int dim, int inter) { pdl_prologue();
  rope<bf16>(x, out, c, s, pp, ph, tokens, heads, dim, inter);
}
extern "C" __global__ void fl_rope_f32(const float* x, float* out, const float* c, const float* s, const unsigned* pp,
                                       unsigned ph, int tokens, int heads, int dim, int inter) { pdl_prologue();
  rope<float>(x, out, c, s, pp, ph, tokens, heads, dim, inter);
}

// ---------------------------------------------------------------------------------------------
// One token's key (rotated at position p when cos_t is non-null, rounded to T) and value, from
// ks, vs into the cache rows kr, vr (dim values each); the block's threads share the pairs.
// With ks_copy/vs_copy (shared memory) the row is also written there.
template <typename T>
__device__ void write_kv_row(const T* ks, const T* vs, T* kr, T* vr, int dim, size_t p, const float* cos_t,
                             const float* sin_t, int interleaved, int tid, int nthreads, T* ks_copy = nullptr,
                             T* vs_copy = nullptr) {
  int half = dim / 2;
  for (int i = tid; i < half; i += nthreads) {
    int ai = interleaved ? 2 * i : i;
    int bi = interleaved ? 2 * i + 1 : i + half;
    T ka = ks[ai], kb = ks[bi], va = vs[ai], vb = vs[bi];
    if (cos_t) {
      size_t row = p * half + i;
      float o1, o2;
      rotate(to_f(ka), to_f(kb), cos_t[row], sin_t[row], &o1, &o2);
      ka = from_f<T>(o1);
      kb = from_f<T>(o2);
    }
    kr[ai] = ka;
    kr[bi] = kb;
    vr[ai] = va;
    vr[bi] = vb;
    if (ks_copy) {
      ks_copy[ai] = ka;
      ks_copy[bi] = kb;
      vs_copy[ai] = va;
      vs_copy[bi] = vb;
    }
  }
}

// Appends one token's keys and values at position pos of caches [kv_heads, cap, dim] (head
// stride cap*dim): k is rotated on the way (when cos_t is non-null), v copied. k, v: [kv_heads, dim].
// grid: kv_heads, block: dim/2 threads.
template <typename T>
__device__ void kv_append(const T* k, const T* v, T* kc, T* vc, const float* cos_t, const float* sin_t,
                          const unsigned* pos_ptr, unsigned pos_host, int dim, int cap, int interleaved) {
  unsigned p = read_pos(pos_ptr, pos_host);
  if (p >= (unsigned)cap) return;  // the host reserves capacity before any step; never taken
  int h = blockIdx.x;
  size_t o = ((size_t)h * cap + p) * dim;
  write_kv_row(k + (size_t)h * dim, v + (size_t)h * dim, kc + o, vc + o, dim, p, cos_t, sin_t, interleaved, threadIdx.x,
               blockDim.x);
}

extern "C" __global__ void fl_kv_append_bf16(const bf16* k, const bf16* v, bf16* kc, bf16* vc, const float* c, const float* s,
                                             const unsigned* pp, unsigned ph, int dim, int cap, int inter) { pdl_prologue();
  kv_append<bf16>(k, v, kc, vc, c, s, pp, ph, dim, cap, inter);
}
extern "C" __global__ void fl_kv_append_f32(const float* k, const float* v, float* kc, float* vc, const float* c, const float* s,
                                            const unsigned* pp, unsigned ph, int dim, int cap, int inter) { pdl_prologue();
  kv_append<float>(k, v, kc, vc, c, s, pp, ph, dim, cap, inter);
}

// ---------------------------------------------------------------------------------------------
// Single-query attention over a KV cache (flash-decoding). q: [hq, D]; kc, vc: [hkv, *, D] with
// head stride `head_stride` and token stride D; query head h*G+g uses kv head h. The query sits
// at absolute position qpos; key j (0-based in the view) is at key_start + j and is visible when
// lo <= j < hi (causal, optional sliding window), j < s_max. Block (h, split) takes the
// ATTN_CHUNK keys from split*ATTN_CHUNK and writes each of its G heads' max, sum and weighted
// values to the partial buffers; attn_merge combines the splits. When cos_t is non-null q is
// rotated first (at qpos).
//
// Decode attention is bound by memory latency, not bandwidth (a few MB per layer), so the block
// keeps many loads in flight: scores first (two threads per key, each with all its 16-byte K
// loads issued at once), then the chunk's softmax in shared memory, then P·V with D/8 threads
// per key row and every V load of a thread unrolled. Masked keys are never loaded; their
// weight is exactly 0, so a view and the whole buffer give bit-identical sums.
#define ATTN_THREADS 128
#define ATTN_CHUNK 64
#define ATTN_MAX_G 8

// The threads that work on one (kv head, split) item: a whole block of ATTN_THREADS in
// fl_attn_*, or one of several ATTN_THREADS-thread groups of a larger block (the decode-layer
// kernel), synchronized by their own named barrier.
struct AttnGroup {
  int tid;  // 0 .. ATTN_THREADS-1
  int id;   // 0: the whole block; else named barrier `id`
  __device__ __forceinline__ void sync() const {
    if (id == 0) __syncthreads();
    else asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(ATTN_THREADS) : "memory");
  }
};

// Shared memory of one item's chunk, for up to MG query heads per kv head.
template <int D, int MG>
struct AttnShared {
  static constexpr int SLOTS = ATTN_THREADS / (D / 8);
  uint4 knew[D / 4], vnew[D / 4];  // the appended row (as T: bf16 uses the first half)
  float qs[MG][D];
  float ps[MG][ATTN_CHUNK];
  float sm[MG], sl[MG];
  float pacc[SLOTS][MG][D];
  bool last;
};

template <typename T> struct Vec8;
template <> struct Vec8<bf16> {
  uint4 raw;
  __device__ __forceinline__ void load(const bf16* p) { raw = *reinterpret_cast<const uint4*>(p); }
  __device__ __forceinline__ float get(int i) const {
    return __bfloat162float(reinterpret_cast<const bf16*>(&raw)[i]);
  }
};
template <> struct Vec8<float> {
  float4 a, b;
  __device__ __forceinline__ void load(const float* p) {
    a = reinterpret_cast<const float4*>(p)[0];
    b = reinterpret_cast<const float4*>(p)[1];
  }
  __device__ __forceinline__ float get(int i) const {
    const float* f = i < 4 ? &a.x : &b.x;
    return f[i & 3];
  }
};

// One block's chunk: keys [split*ATTN_CHUNK, +ATTN_CHUNK) of kv head h for its G query heads,
// written as each head's max, sum and weighted values to the partial buffers.
//
// Order matters more than arithmetic here: the block's K and V loads go out first, before the
// wait for the previous kernel (programmatic dependent launch) and before q is staged, since
// cached rows never depend on the kernels of this step, so their memory latency overlaps
// everything else. The block whose chunk holds the new token (`appends`) writes that row after
// the wait and loads it after writing it.
//
// `wait()` is called exactly once, after the cached rows' loads are issued and before anything
// written by the previous kernel (or phase) is read.
template <typename T, int D, int MG, typename Wait>
__device__ void attn_chunk(const T* q, T* kc, T* vc, const float* cos_t, const float* sin_t, long qpos, int G,
                           long head_stride, int key_start, int s_max, int window, float scale, float softcap,
                           int interleaved, const T* k_new, const T* v_new, float* part_m, float* part_l,
                           float* part_acc, int h, int split, int nsplit, const AttnGroup& grp, AttnShared<D, MG>& S,
                           Wait wait) {
  constexpr int V8 = D / 8;                 // 8-element vectors per row
  constexpr int HALF_V = V8 / 2;            // vectors per score thread
  constexpr int SLOTS = ATTN_THREADS / V8;  // key rows in flight in P·V
  constexpr int PER = ATTN_CHUNK / SLOTS;   // P·V rows per thread
  constexpr bool EARLY_V = D <= 128;        // V in registers from the start (else after softmax)
  auto& qs = S.qs;
  auto& ps = S.ps;
  auto& sm = S.sm;
  auto& sl = S.sl;
  static_assert(ATTN_CHUNK == 64 && ATTN_THREADS == 2 * ATTN_CHUNK, "two score threads per key, two keys per softmax lane");
  long hi = qpos + 1 - key_start;
  if (hi > s_max) hi = s_max;
  long lo = 0;
  if (window > 0) {
    lo = qpos + 1 - window - key_start;
    if (lo < 0) lo = 0;
  }
  long begin = (long)split * ATTN_CHUNK, end = begin + ATTN_CHUNK;
  long first = begin > lo ? begin : lo, last = end < hi ? end : hi;
  if (first >= last) {
    wait();
    for (int g = grp.tid; g < G; g += ATTN_THREADS) {
      size_t slot = (size_t)(h * G + g) * nsplit + split;
      part_m[slot] = -INFINITY;
      part_l[slot] = 0.f;
    }
    return;
  }
  long jn = qpos - key_start;  // the new token's row
  bool appends = k_new && jn >= begin && jn < end && jn < s_max;
  T* kh = kc + (size_t)h * head_stride;
  T* vh = vc + (size_t)h * head_stride;
  int tid = grp.tid;

  // Registers: this thread's K vectors (score phase: threads 2k and 2k+1 share key begin+k,
  // half p takes vectors p, p+2, ...) and V vectors (P·V: thread (slot, c) takes vector c of
  // keys slot, slot + SLOTS, ...).
  int sk = tid >> 1, sp = tid & 1;
  bool s_live = begin + sk >= first && begin + sk < last;
  int slot = tid / V8, c = tid % V8;
  Vec8<T> kv[HALF_V];
  Vec8<T> vv[PER];
  // The block that appends loads every other row first and the new row only after writing it,
  // so that only that row's latency follows the write.
  long skip = appends ? jn : -1;
  // The new row is read from shared memory (S.knew / S.vnew), the others from the cache.
  const T* k_row_new = reinterpret_cast<const T*>(S.knew);
  const T* v_row_new = reinterpret_cast<const T*>(S.vnew);
  auto load_k = [&](bool new_row) {
    if (s_live && (begin + sk == skip) == new_row) {
      const T* row = new_row ? k_row_new : kh + (size_t)(begin + sk) * D;
#pragma unroll
      for (int u = 0; u < HALF_V; u++) kv[u].load(row + (2 * u + sp) * 8);
    }
  };
  auto load_v = [&](bool new_row) {
#pragma unroll
    for (int r = 0; r < PER; r++) {
      long j = begin + slot + r * SLOTS;
      if (j >= first && j < last && (j == skip) == new_row) vv[r].load((new_row ? v_row_new : vh + (size_t)j * D) + c * 8);
    }
  };
  load_k(false);
  if (EARLY_V) load_v(false);
  wait();

  // q's pairs of this thread, loaded before the new row is read so that both loads (outputs of
  // the previous kernel) share one round trip.
  int half = D / 2;
  constexpr int QPER = (MG * D / 2 + ATTN_THREADS - 1) / ATTN_THREADS;
  float qa[QPER], qb[QPER];
#pragma unroll
  for (int u = 0; u < QPER; u++) {
    int idx = tid + u * ATTN_THREADS;
    if (idx < G * half) {
      int g = idx / half, i = idx % half;
      const T* src = q + (size_t)(h * G + g) * D;
      qa[u] = to_f(src[interleaved ? 2 * i : i]);
      qb[u] = to_f(src[interleaved ? 2 * i + 1 : i + half]);
    }
  }
  if (appends) {
    // The new token's row, written by the one block whose chunk holds it (fl_kv_append's work),
    // and kept in shared memory for this block's own scores and P·V (no reload from the cache).
    write_kv_row<T>(k_new + (size_t)h * D, v_new + (size_t)h * D, kh + (size_t)jn * D, vh + (size_t)jn * D, D, qpos,
                    cos_t, sin_t, interleaved, tid, ATTN_THREADS, reinterpret_cast<T*>(S.knew),
                    reinterpret_cast<T*>(S.vnew));
  }

  // q (rotated, scaled) into shared memory.
#pragma unroll
  for (int u = 0; u < QPER; u++) {
    int idx = tid + u * ATTN_THREADS;
    if (idx >= G * half) break;
    int g = idx / half, i = idx % half;
    int ai = interleaved ? 2 * i : i;
    int bi = interleaved ? 2 * i + 1 : i + half;
    float a = qa[u], b = qb[u];
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
  grp.sync();  // qs (and the new row) ready
  if (appends) {
    load_k(true);
    if (EARLY_V) load_v(true);
  }

  // Scores.
#pragma unroll
  for (int g = 0; g < MG; g++) {
    if (g >= G) break;
    float s = 0.f;
    if (s_live) {
#pragma unroll
      for (int u = 0; u < HALF_V; u++) {
        const float* qv = &qs[g][(2 * u + sp) * 8];
#pragma unroll
        for (int e = 0; e < 8; e++) s = fmaf(qv[e], kv[u].get(e), s);
      }
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    if (s_live && softcap > 0.f) s = tanhf(s / softcap) * softcap;
    if (sp == 0) ps[g][sk] = s_live ? s : -INFINITY;
  }
  grp.sync();

  // Softmax over the chunk: warp w takes heads w, w+4, ...
  {
    int warp = tid >> 5, lane = tid & 31;
    for (int g = warp; g < G; g += ATTN_THREADS / 32) {
      float a = ps[g][lane], b = ps[g][lane + 32];
      float m = fmaxf(a, b);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float ea = __expf(a - m), eb = __expf(b - m);
      ps[g][lane] = ea;
      ps[g][lane + 32] = eb;
      float l = warp_sum(ea + eb);
      if (lane == 0) {
        sm[g] = m;
        sl[g] = l;
      }
    }
  }
  grp.sync();

  // P·V, then the SLOTS partial sums of each output added in shared memory.
  auto& pacc = S.pacc;
  {
    if (!EARLY_V) {
      load_v(false);
      load_v(true);
    }
    float acc[MG][8];
#pragma unroll
    for (int g = 0; g < MG; g++)
#pragma unroll
      for (int e = 0; e < 8; e++) acc[g][e] = 0.f;
#pragma unroll
    for (int r = 0; r < PER; r++) {
      int k = slot + r * SLOTS;
      long j = begin + k;
      if (j < first || j >= last) continue;
#pragma unroll
      for (int g = 0; g < MG; g++) {
        if (g >= G) break;
        float w = ps[g][k];
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = fmaf(w, vv[r].get(e), acc[g][e]);
      }
    }
#pragma unroll
    for (int g = 0; g < MG; g++) {
      if (g >= G) break;
#pragma unroll
      for (int e = 0; e < 8; e++) pacc[slot][g][c * 8 + e] = acc[g][e];
    }
  }
  grp.sync();
  for (int idx = tid; idx < G * D; idx += ATTN_THREADS) {
    int g = idx / D, d = idx % D;
    float a = 0.f;
#pragma unroll
    for (int r = 0; r < SLOTS; r++) a += pacc[r][g][d];
    size_t slot = (size_t)(h * G + g) * nsplit + split;
    part_acc[slot * D + d] = a;
    if (d == 0) {
      part_m[slot] = sm[g];
      part_l[slot] = sl[g];
    }
  }
}

// Merges the splits of kv head h's G query heads into out [hq, D] (run by the last block of the
// head to finish). Partials are read past L1 (other blocks wrote them). The merge sits on the
// step's critical path after the slowest chunk, so it is one pass of independent loads: each
// thread takes a (head, 4 outputs) pair and every share-th split, loads B splits' max, sum and
// values at once, and folds them in with an online softmax; the `share` lanes of a pair then
// combine theirs by shuffles. Splits with no visible key (max -inf) wrote no values: they are
// skipped, their garbage never multiplied.
//
// B sets the number of dependent rounds of loads, and the rounds are what costs: with 18 the
// 1B's merge after a 2k prompt (34 splits, 17 per thread) is one round instead of three, +1.4%
// decode on an H100 (8B +1.1%, two rounds instead of five), bit-identical tokens; 16 (two rounds)
// gained nothing. The decode-layer kernel keeps 8 (its register budget: 18 spills there).
#ifndef MERGE_BATCH
#define MERGE_BATCH 18
#endif
#define LAYER_MERGE_BATCH 8
__device__ __forceinline__ float4 fma4(float4 a, float s, float4 b, float t) {
  return make_float4(a.x * s + b.x * t, a.y * s + b.y * t, a.z * s + b.z * t, a.w * s + b.w * t);
}
// (M, L, A) <- the online-softmax combination of (M, L, A) and (m, l, a).
__device__ __forceinline__ void merge_into(float& M, float& L, float4& A, float m, float l, float4 a) {
  float nm = fmaxf(M, m);
  if (nm == -INFINITY) return;
  float s1 = M == -INFINITY ? 0.f : __expf(M - nm);
  float s2 = m == -INFINITY ? 0.f : __expf(m - nm);
  A = fma4(A, s1, a, s2);
  L = L * s1 + l * s2;
  M = nm;
}
template <typename T, int D, int B>
__device__ void attn_merge(const float* part_m, const float* part_l, const float* part_acc, T* out, int h, int G, int nsplit,
                           const AttnGroup& grp) {
  constexpr int D4 = D / 4;
  int tid = grp.tid;
  int pairs = G * D4;
  int share = 1;  // a power of two, so that the shares of a pair are aligned lanes (full warps)
  while (2 * share * pairs <= ATTN_THREADS) share *= 2;
  int sub = tid % share;
  for (int pair = tid / share; pair < pairs; pair += ATTN_THREADS / share) {
    int g = pair / D4, d4 = pair % D4;
    size_t row = (size_t)(h * G + g) * nsplit;
    const float4* pa = reinterpret_cast<const float4*>(part_acc + row * D) + d4;
    float M = -INFINITY, L = 0.f;
    float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int base = sub; base < nsplit; base += B * share) {
      float m[B], l[B];
      float4 a[B];
#pragma unroll
      for (int b = 0; b < B; b++) {
        int s = base + b * share;
        bool in = s < nsplit;
        m[b] = in ? __ldcg(part_m + row + s) : -INFINITY;
        l[b] = in ? __ldcg(part_l + row + s) : 0.f;
        a[b] = in ? __ldcg(pa + (size_t)s * D4) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int b = 0; b < B; b++)
        if (m[b] != -INFINITY) merge_into(M, L, A, m[b], l[b], a[b]);
    }
    for (int o = 1; o < share; o <<= 1) {
      float m2 = __shfl_xor_sync(0xffffffffu, M, o), l2 = __shfl_xor_sync(0xffffffffu, L, o);
      float4 a2 = make_float4(__shfl_xor_sync(0xffffffffu, A.x, o), __shfl_xor_sync(0xffffffffu, A.y, o),
                              __shfl_xor_sync(0xffffffffu, A.z, o), __shfl_xor_sync(0xffffffffu, A.w, o));
      merge_into(M, L, A, m2, l2, a2);
    }
    if (sub == 0) {
      float inv = L > 0.f ? 1.f / L : 0.f;
      T* dst = out + (size_t)(h * G + g) * D + (size_t)d4 * 4;
      dst[0] = from_f<T>(A.x * inv);
      dst[1] = from_f<T>(A.y * inv);
      dst[2] = from_f<T>(A.z * inv);
      dst[3] = from_f<T>(A.w * inv);
    }
  }
}

// One (kv head h, split) item: the chunk, then, if this is the last of head h's items to finish,
// the merge (B splits per round). Every thread of the group must call it.
template <typename T, int D, int MG, int B, typename Wait>
__device__ void attn_item(const T* q, T* kc, T* vc, const float* cos_t, const float* sin_t, long qpos, int G,
                          long head_stride, int key_start, int s_max, int window, float scale, float softcap,
                          int interleaved, float* part_m, float* part_l, float* part_acc, const T* k_new, const T* v_new,
                          unsigned* counters, T* out, int h, int split, int nsplit, const AttnGroup& grp,
                          AttnShared<D, MG>& S, Wait wait) {
  attn_chunk<T, D, MG>(q, kc, vc, cos_t, sin_t, qpos, G, head_stride, key_start, s_max, window, scale, softcap, interleaved,
                   k_new, v_new, part_m, part_l, part_acc, h, split, nsplit, grp, S, wait);
  // One acquire-release atomic by the group's thread 0 after the barrier: release publishes
  // every thread's partials (the barrier orders them before it; PTX release is cumulative),
  // acquire makes the other items' partials visible to the merge (ordered for the other threads
  // by the barriers below). Measured against a fence per thread around a relaxed atomic: 1B
  // attention 9.3 against 10.1 us per layer, its layer 46.7 against 47.0 (layer_bench).
  grp.sync();
  if (grp.tid == 0) {
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counters + h) : "memory");
    S.last = before == (unsigned)nsplit - 1;
  }
  grp.sync();
  bool last = S.last;
  grp.sync();  // S.last is read by all before the group's next item may overwrite it
  if (!last) return;
  attn_merge<T, D, B>(part_m, part_l, part_acc, out, h, G, nsplit, grp);
  if (grp.tid == 0) counters[h] = 0u;
}

// MG: the most query heads per kv head the instance handles (its shared memory and registers
// scale with it): 8, or 4 for the common G <= 4 (Llama 3's 32/8), which leaves room on an SM for
// the neighbouring kernels' blocks that programmatic dependent launch starts early.
template <typename T, int D, int MG>
__device__ void attn_decode(const T* q, T* kc, T* vc, const float* cos_t, const float* sin_t, const unsigned* pos_ptr,
                            unsigned pos_host, int G, long head_stride, int key_start, int s_max, int window, float scale,
                            float softcap, int interleaved, float* part_m, float* part_l, float* part_acc, const T* k_new,
                            const T* v_new, unsigned* counters, T* out) {
  TL_DECL
  __shared__ AttnShared<D, MG> S;
  long qpos = (long)read_pos(pos_ptr, pos_host);
  attn_item<T, D, MG, MERGE_BATCH>(q, kc, vc, cos_t, sin_t, qpos, G, head_stride, key_start, s_max, window, scale, softcap, interleaved,
                      part_m, part_l, part_acc, k_new, v_new, counters, out, blockIdx.x, blockIdx.y, gridDim.y,
                      AttnGroup{(int)threadIdx.x, 0}, S, [&] {
                        pdl_prologue();
                        TL_MARK(1)
                        TL_MARK(2)
                      });
  TL_END(2, G, D)
}

// Blocks of the decode attention that must fit on an SM by registers (__launch_bounds__' second
// argument; 1 leaves the compiler free: 162 registers for the bf16 d64 g4 instance).
#ifndef ATTN_MIN_BLOCKS
#define ATTN_MIN_BLOCKS 1
#endif
#define ATTN_INSTANCE(T, NAME, D, MG, SUFFIX)                                                                      \
  extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_MIN_BLOCKS) fl_attn_##NAME##_d##D##SUFFIX(       \
      const T* q, T* kc, T* vc, const float* c, const float* s, const unsigned* pp, unsigned ph, int G, long hs,    \
      int ks, int smax, int win, float scale, float cap, int inter, float* pm, float* pl, float* pa, const T* kn,   \
      const T* vn, unsigned* cnt, T* out) {                                                                        \
    attn_decode<T, D, MG>(q, kc, vc, c, s, pp, ph, G, hs, ks, smax, win, scale, cap, inter, pm, pl, pa, kn, vn, cnt, \
                          out);                                                                                    \
  }
ATTN_INSTANCE(bf16, bf16, 64, ATTN_MAX_G, )
ATTN_INSTANCE(bf16, bf16, 128, ATTN_MAX_G, )
ATTN_INSTANCE(bf16, bf16, 256, ATTN_MAX_G, )
ATTN_INSTANCE(bf16, bf16, 64, 4, _g4)
ATTN_INSTANCE(bf16, bf16, 128, 4, _g4)
ATTN_INSTANCE(bf16, bf16, 256, 4, _g4)
ATTN_INSTANCE(float, f32, 64, ATTN_MAX_G, )
ATTN_INSTANCE(float, f32, 128, ATTN_MAX_G, )
ATTN_INSTANCE(float, f32, 256, ATTN_MAX_G, )

// A batch of decode rows, one token of each of B sequences, each over its own cache buffers
// (`[Hkv, capacity, D]`, capacity > its position): blockIdx.z is the sequence. Per sequence,
// `seqs` holds BATCH_FIELDS 64-bit words: K buffer, V buffer, head stride (elements), position,
// and the offset of its first partial row (its partial rows are hq * nsplit from there). The
// sequence's new key and value (k_new, v_new: rows of Hkv·D, unrotated, q_row / k_row / v_row
// elements apart: read in place from the QKV product) are rotated and written
// at its position, q (`[B, Hq, D]`, unrotated) rotated, and keys 0..=position attended: one
// launch for the whole batch instead of rope, append and attention per sequence. Each (sequence,
// kv head, split) item is exactly the single-sequence kernel's, so a row's output does not
// depend on the rest of the batch. Grid: (hkv, the largest nsplit, B); items past a sequence's
// own nsplit return at once.
#define BATCH_FIELDS 5
template <typename T, int D, int MG>
__device__ void attn_decode_batch(const T* q, const long long* seqs, const float* cos_t, const float* sin_t, int G,
                                  int hkv, int window, float scale, float softcap, int interleaved, float* part_m,
                                  float* part_l, float* part_acc, const T* k_new, const T* v_new, unsigned* counters,
                                  T* out, long q_row, long k_row, long v_row) {
  const long long* p = seqs + (size_t)blockIdx.z * BATCH_FIELDS;
  long qpos = (long)p[3];
  int s_max = (int)(qpos + 1);
  int nsplit = (s_max + ATTN_CHUNK - 1) / ATTN_CHUNK;
  if ((int)blockIdx.y >= nsplit) return;
  __shared__ AttnShared<D, MG> S;
  size_t b = blockIdx.z, hq = (size_t)hkv * G, part = (size_t)p[4];
  attn_item<T, D, MG, MERGE_BATCH>(q + b * q_row, reinterpret_cast<T*>(p[0]), reinterpret_cast<T*>(p[1]), cos_t, sin_t,
                                   qpos, G, (long)p[2], 0, s_max, window, scale, softcap, interleaved, part_m + part,
                                   part_l + part, part_acc + part * D, k_new + b * k_row, v_new + b * v_row,
                                   counters + b * hkv, out + b * hq * D, blockIdx.x, blockIdx.y, nsplit,
                                   AttnGroup{(int)threadIdx.x, 0}, S, [&] { pdl_prologue(); });
}
#define ATTN_BATCH_INSTANCE(T, NAME, D, MG, SUFFIX)                                                                  \
  extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_MIN_BLOCKS) fl_attn_batch_##NAME##_d##D##SUFFIX(   \
      const T* q, const long long* seqs, const float* c, const float* s, int G, int hkv, int win, float scale,        \
      float cap, int inter, float* pm, float* pl, float* pa, const T* kn, const T* vn, unsigned* cnt, T* out,         \
      long qr, long kr, long vr) {                                                                                    \
    attn_decode_batch<T, D, MG>(q, seqs, c, s, G, hkv, win, scale, cap, inter, pm, pl, pa, kn, vn, cnt, out, qr, kr,  \
                                vr);                                                                                  \
  }
ATTN_BATCH_INSTANCE(bf16, bf16, 64, ATTN_MAX_G, )
ATTN_BATCH_INSTANCE(bf16, bf16, 128, ATTN_MAX_G, )
ATTN_BATCH_INSTANCE(bf16, bf16, 256, ATTN_MAX_G, )
ATTN_BATCH_INSTANCE(bf16, bf16, 64, 4, _g4)
ATTN_BATCH_INSTANCE(bf16, bf16, 128, 4, _g4)
ATTN_BATCH_INSTANCE(bf16, bf16, 256, 4, _g4)
ATTN_BATCH_INSTANCE(float, f32, 64, ATTN_MAX_G, )
ATTN_BATCH_INSTANCE(float, f32, 128, ATTN_MAX_G, )
ATTN_BATCH_INSTANCE(float, f32, 256, ATTN_MAX_G, )

// ---------------------------------------------------------------------------------------------
// silu(gate) * up, elementwise.
template <typename T>
__device__ void silu_mul(const T* g, const T* u, T* out, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float x = to_f(g[i]);
    out[i] = from_f<T>(x / (1.f + __expf(-x)) * to_f(u[i]));
  }
}
extern "C" __global__ void fl_silu_mul_bf16(const bf16* g, const bf16* u, bf16* out, size_t n) { pdl_prologue(); silu_mul<bf16>(g, u, out, n); }
extern "C" __global__ void fl_silu_mul_f32(const float* g, const float* u, float* out, size_t n) { pdl_prologue(); silu_mul<float>(g, u, out, n); }

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
extern "C" __global__ void __launch_bounds__(256) fl_gemv_bf16(const bf16* x, const bf16* w, bf16* y, int N, int K) { pdl_prologue();
  gemv_bf16<bf16>(x, w, y, N, K);
}
extern "C" __global__ void __launch_bounds__(256) fl_gemv_bf16_f32out(const bf16* x, const bf16* w, float* y, int N, int K) { pdl_prologue();
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
extern "C" __global__ void __launch_bounds__(256) fl_gemv_smem_bf16(const bf16* x, const bf16* w, bf16* y, int N, int K) { pdl_prologue();
  gemv_smem_bf16<bf16>(x, w, y, N, K);
}

// The shared-memory product with the step before and after it fused in, for one decode row
// (removing a kernel launch and a round trip through memory each):
//   pro 0: x' = x;
//   pro 1: x' = RMSNorm(x) · nw (eps), rounded to bf16 as fl_rmsnorm rounds it;
//   pro 2: x' = silu(x) · x2, rounded to bf16 as fl_silu_mul rounds it;
//   res non-null: y = bf16(res + bf16(W·x')), the residual add of the unfused composition.
// Every block prepares x' in shared memory itself (x is a few KB in L2; the block's weight rows
// are tens of KB from HBM). Needs K/8 uint4 of dynamic shared memory.
__device__ __forceinline__ uint4 norm8(uint4 v, float inv, float4 w0, float4 w1) {
  const bf16* e = reinterpret_cast<const bf16*>(&v);
  float ws[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  uint4 o;
  bf16* oe = reinterpret_cast<bf16*>(&o);
#pragma unroll
  for (int k = 0; k < 8; k++) oe[k] = __float2bfloat16(__bfloat162float(e[k]) * inv * ws[k]);
  return o;
}
// ss + the sum of squares of 8 bf16 values, added in order.
__device__ __forceinline__ float sumsq8(uint4 v, float ss) {
  const bf16* e = reinterpret_cast<const bf16*>(&v);
#pragma unroll
  for (int k = 0; k < 8; k++) {
    float f = __bfloat162float(e[k]);
    ss += f * f;
  }
  return ss;
}
__device__ __forceinline__ uint4 silu_mul8(uint4 g, uint4 u) {
  const bf16* ge = reinterpret_cast<const bf16*>(&g);
  const bf16* ue = reinterpret_cast<const bf16*>(&u);
  uint4 o;
  bf16* oe = reinterpret_cast<bf16*>(&o);
#pragma unroll
  for (int k = 0; k < 8; k++) {
    float a = __bfloat162float(ge[k]);
    oe[k] = __float2bfloat16(a / (1.f + __expf(-a)) * __bfloat162float(ue[k]));
  }
  return o;
}
// Weights are read with the streaming hint (CS) or through the read-only path; the variants are
// measured against each other on the GPU. One warp per row: splitting long rows over several
// warps (one batch of loads each) was measured slower (1B 845 vs 909 tok/s, 8B 159 vs 204): every
// block stages the whole x', so four times the blocks is four times the staging.
//
// Each warp's first batch of weight loads (eight 16-byte vectors per lane: the whole row for
// K <= 2048) is issued before anything else: weights never depend on the previous kernel, so
// their memory latency overlaps the wait for it (programmatic dependent launch) and the staging
// of x'. Lanes past the end of the row load nothing and add nothing.
#define GEMV_BATCH 256  // vectors per warp batch: 32 lanes x 8
// The RMSNorm weights of a thread's first NORM_PRE vectors of x' (prologue 1), loaded before the
// wait for the previous kernel (they never depend on it), so that the normalization after the
// block's sum of squares does not wait for another round trip. Later vectors (K > 8 * NORM_PRE *
// blockDim) read theirs in place.
#define NORM_PRE 2
struct NormPre {
  float4 w[NORM_PRE][2];
};
__device__ __forceinline__ NormPre preload_norm(const float* nw, int pro, int K) {
  NormPre p = {};
  if (pro != 1) return p;
  const float4* wv = reinterpret_cast<const float4*>(nw);
#pragma unroll
  for (int u = 0; u < NORM_PRE; u++) {
    int i = threadIdx.x + u * blockDim.x;
    if (i < K / 8) p.w[u][0] = wv[2 * i], p.w[u][1] = wv[2 * i + 1];
  }
  return p;
}

// x' (K values, see gemv_fused) into shared memory xs, by the whole block; ends with a barrier.
// pre: this thread's norm weights from preload_norm (prologue 1).
__device__ void stage_input(const bf16* x, const bf16* x2, const float* nw, const NormPre& pre, float eps, int pro, int K,
                            uint4* xs) {
  int nv = K / 8;
  const uint4* xg = reinterpret_cast<const uint4*>(x);
  if (pro == 1) {
    // The first NORM_PRE vectors of each thread stay in registers (all of x for K <= 4096 at 256
    // threads): their loads go out together, no raw copy goes through shared memory, and the
    // reduction takes one barrier. Bit-identical to staging x raw and normalizing it in place;
    // with gemv_tma's early residuals +1.0% 1B decode on an H100 (figures at RES_EARLY).
    uint4 xv[NORM_PRE];
#pragma unroll
    for (int u = 0; u < NORM_PRE; u++) {
      int i = threadIdx.x + u * blockDim.x;
      if (i < nv) xv[u] = xg[i];
    }
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < NORM_PRE; u++)
      if (threadIdx.x + u * blockDim.x < nv) ss = sumsq8(xv[u], ss);
    for (int i = threadIdx.x + NORM_PRE * blockDim.x; i < nv; i += blockDim.x) {
      uint4 v = xg[i];
      xs[i] = v;
      ss = sumsq8(v, ss);
    }
    ss = block_sum_all(ss);
    float inv = rsqrtf(ss / (float)K + eps);
#pragma unroll
    for (int u = 0; u < NORM_PRE; u++) {
      int i = threadIdx.x + u * blockDim.x;
      if (i < nv) xs[i] = norm8(xv[u], inv, pre.w[u][0], pre.w[u][1]);
    }
    const float4* wv = reinterpret_cast<const float4*>(nw);
    for (int i = threadIdx.x + NORM_PRE * blockDim.x; i < nv; i += blockDim.x) xs[i] = norm8(xs[i], inv, wv[2 * i], wv[2 * i + 1]);
  } else if (pro == 2) {
    const uint4* ug = reinterpret_cast<const uint4*>(x2);
    for (int i = threadIdx.x; i < nv; i += blockDim.x) xs[i] = silu_mul8(xg[i], ug[i]);
  } else {
    for (int i = threadIdx.x; i < nv; i += blockDim.x) xs[i] = xg[i];
  }
  __syncthreads();
}

template <bool CS>
__device__ void gemv_fused(const bf16* x, const bf16* x2, const float* nw, float eps, int pro, const bf16* w, const bf16* res,
                           bf16* y, int N, int K) {
  extern __shared__ uint4 xs[];
  int nv = K / 8;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int n = blockIdx.x * (blockDim.x >> 5) + warp;
  bool has_row = n < N;
  const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)min(n, N - 1) * K);
  uint4 wv[8];
  auto load_batch = [&](int base) {
#pragma unroll
    for (int u = 0; u < 8; u++) {
      int i = base + lane + 32 * u;
      wv[u] = has_row && i < nv ? (CS ? __ldcs(wr + i) : __ldg(wr + i)) : make_uint4(0, 0, 0, 0);
    }
  };
  load_batch(0);
  NormPre pre = preload_norm(nw, pro, K);
  pdl_prologue();

  stage_input(x, x2, nw, pre, eps, pro, K, xs);
  if (!has_row) return;
  float acc = 0.f;
  for (int base = 0;;) {
#pragma unroll
    for (int u = 0; u < 8; u++) {
      int i = base + lane + 32 * u;
      if (i < nv) acc = dot8(wv[u], xs[i], acc);
    }
    base += GEMV_BATCH;
    if (base >= nv) break;
    load_batch(base);
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    float v = res ? __bfloat162float(res[n]) + __bfloat162float(__float2bfloat16(acc)) : acc;
    y[n] = __float2bfloat16(v);
  }
}
#define GEMV_FUSED(NAME, CS)                                                                                      \
  extern "C" __global__ void __launch_bounds__(256) NAME(const bf16* x, const bf16* x2, const float* nw, float eps, \
                                                         int pro, const bf16* w, const bf16* res, bf16* y, int N, int K) { \
    gemv_fused<CS>(x, x2, nw, eps, pro, w, res, y, N, K);                                                         \
  }
GEMV_FUSED(fl_gemv_fused_bf16, true)
GEMV_FUSED(fl_gemv_fused_ldg_bf16, false)

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
extern "C" __global__ void fl_masked_softmax_bf16(const bf16* x, bf16* o, int S, int T_, unsigned qs, unsigned ks, int w, float sc, float cap) { pdl_prologue();
  masked_softmax<bf16>(x, o, S, T_, qs, ks, w, sc, cap);
}
extern "C" __global__ void fl_masked_softmax_f32(const float* x, float* o, int S, int T_, unsigned qs, unsigned ks, int w, float sc, float cap) { pdl_prologue();
  masked_softmax<float>(x, o, S, T_, qs, ks, w, sc, cap);
}

// ---------------------------------------------------------------------------------------------
// Index of the largest of n floats (the first one on ties; NaN counts as smallest) into dst[0],
// in two passes: fl_argmax_partial (many blocks, each over a contiguous range) writes each
// block's best value and index, fl_argmax_final (one block) reduces them. A single block over a
// 128k vocabulary is a long serial scan.
__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
  if (v != v || i == 0x7fffffff) return false;
  return bi == 0x7fffffff || v > bv || (v == bv && i < bi);
}
__device__ void argmax_block(float* best, int* idx) {
  __shared__ float bv[32];
  __shared__ int bi[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, *best, o);
    int oi = __shfl_xor_sync(0xffffffffu, *idx, o);
    if (argmax_better(ov, oi, *best, *idx)) { *best = ov; *idx = oi; }
  }
  if (lane == 0) { bv[warp] = *best; bi[warp] = *idx; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); w++)
      if (argmax_better(bv[w], bi[w], *best, *idx)) { *best = bv[w]; *idx = bi[w]; }
  }
}
extern "C" __global__ void __launch_bounds__(256) fl_argmax_partial_f32(const float* x, float* pv, int* pi, int n, int per) { pdl_prologue();
  int lo = blockIdx.x * per, hi = min(n, lo + per);
  float best = -INFINITY;
  int idx = 0x7fffffff;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float v = x[i];
    if (argmax_better(v, i, best, idx)) { best = v; idx = i; }
  }
  argmax_block(&best, &idx);
  if (threadIdx.x == 0) { pv[blockIdx.x] = best; pi[blockIdx.x] = idx; }
}
// advance non-null: also advance[0] += 1 (the decode position; saves a kernel per step).
extern "C" __global__ void __launch_bounds__(256) fl_argmax_final(const float* pv, const int* pi, unsigned* dst, int parts,
                                                                  unsigned* advance) { pdl_prologue();
  float best = -INFINITY;
  int idx = 0x7fffffff;
  for (int i = threadIdx.x; i < parts; i += blockDim.x)
    if (argmax_better(pv[i], pi[i], best, idx)) { best = pv[i]; idx = pi[i]; }
  argmax_block(&best, &idx);
  if (threadIdx.x == 0) {
    dst[0] = idx == 0x7fffffff ? 0u : (unsigned)idx;
    if (advance) advance[0] += 1u;
  }
}

// ---------------------------------------------------------------------------------------------
// The argmax of each row of f32 `x [rows, n]` (first index on ties, NaN never chosen; 0 for a row
// of NaN), as fl_argmax_partial / fl_argmax_final per row: grid (parts, rows), then (rows).
extern "C" __global__ void __launch_bounds__(256) fl_argmax_rows_partial_f32(const float* x, float* pv, int* pi, int n, int per) { pdl_prologue();
  const float* row = x + (size_t)blockIdx.y * n;
  int lo = blockIdx.x * per, hi = min(n, lo + per);
  float best = -INFINITY;
  int idx = 0x7fffffff;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float v = row[i];
    if (argmax_better(v, i, best, idx)) { best = v; idx = i; }
  }
  argmax_block(&best, &idx);
  if (threadIdx.x == 0) { pv[blockIdx.y * gridDim.x + blockIdx.x] = best; pi[blockIdx.y * gridDim.x + blockIdx.x] = idx; }
}
extern "C" __global__ void __launch_bounds__(256) fl_argmax_rows_final(const float* pv, const int* pi, unsigned* dst, int parts) { pdl_prologue();
  const float* v = pv + (size_t)blockIdx.x * parts;
  const int* ix = pi + (size_t)blockIdx.x * parts;
  float best = -INFINITY;
  int idx = 0x7fffffff;
  for (int i = threadIdx.x; i < parts; i += blockDim.x)
    if (argmax_better(v[i], ix[i], best, idx)) { best = v[i]; idx = ix[i]; }
  argmax_block(&best, &idx);
  if (threadIdx.x == 0) dst[blockIdx.x] = idx == 0x7fffffff ? 0u : (unsigned)idx;
}

// ---------------------------------------------------------------------------------------------
// Token embeddings: out [n, hidden] = rows ids [n] of table [rows, hidden] (bf16, hidden % 8 ==
// 0), one block per id, each times `scale` when it is nonzero (Gemma's sqrt(hidden), already
// rounded to bf16: one rounding of the product, as candle's bf16 affine). The ids stay on the
// device, so a captured step reads the token its previous step sampled; an id past the table
// gives a zero row (ids from the host are checked there, device ids come from an argmax).
extern "C" __global__ void fl_embed_rows_bf16(const bf16* table, const unsigned* ids, bf16* out, int rows, int hidden,
                                              float scale) {
  pdl_prologue();
  unsigned id = ids[blockIdx.x];
  const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)id * hidden);
  uint4* dst = reinterpret_cast<uint4*>(out + (size_t)blockIdx.x * hidden);
  for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) {
    uint4 v = id < (unsigned)rows ? src[i] : make_uint4(0u, 0u, 0u, 0u);
    if (scale != 0.f) {
      bf16* e = reinterpret_cast<bf16*>(&v);
#pragma unroll
      for (int k = 0; k < 8; k++) e[k] = __float2bfloat16(__bfloat162float(e[k]) * scale);
    }
    dst[i] = v;
  }
}

// silu(gate) · up over bf16 rows with their own strides (in elements; cols % 8 == 0): the gate and
// up halves of a stacked prefill product read in place (no copies), 8 values per thread, with
// silu_mul's arithmetic (silu_mul8), so the results are the same bits.
extern "C" __global__ void fl_silu_mul_rows_bf16(const bf16* g, long gs, const bf16* u, long us, bf16* out, int rows,
                                                 int cols) {
  pdl_prologue();
  size_t vc = cols / 8, n = (size_t)rows * vc;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    size_t r = i / vc, c = i % vc;
    uint4 a = *reinterpret_cast<const uint4*>(g + r * gs + c * 8);
    uint4 b = *reinterpret_cast<const uint4*>(u + r * us + c * 8);
    reinterpret_cast<uint4*>(out)[i] = silu_mul8(a, b);
  }
}

// p[0] += 1 (the decode position, advanced inside the captured step).
extern "C" __global__ void fl_increment_u32(unsigned* p) { pdl_prologue(); p[0] += 1u; }

#include "decode_layer.cuh"
#include "gemv_tma.cuh"
#include "flash_prefill.cuh"

