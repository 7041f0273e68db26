// ---------------------------------------------------------------------------------------------
// One Llama-style decoder layer for one token in one persistent kernel (included by kernels.cu;
// launched by cuda/layer.rs when FERROLM_CUDA_LAYER=1, off by default: see the end).
//
// Separate kernels leave the memory system idle at every boundary: the last blocks of one
// kernel drain, the next launches, and its first weight loads only then start a DRAM round trip.
// Here one block per SM runs the layer's five phases, separated by grid barriers:
//
//   1. x' = RMSNorm(x)·n1; qkv = Wqkv·x'
//   2. attention over the cache, the new key (rotated) and value appended first (fl_attn's items
//      and merge, run by ATTN_THREADS-thread groups)
//   3. x_mid = x + Wo·attn
//   4. x' = RMSNorm(x_mid)·n2; act = silu(gate·x')·(up·x')   (gate row i and up row i per warp)
//   5. x_out = x_mid + Wdown·act
//
// Between the two halves of each barrier every warp issues the loads of its first LAYER_CHUNKS
// weight chunks of the next phase (weights never depend on this step), so their latency overlaps
// the wait and the staging of the phase's input. Every value is computed and rounded as the
// separate kernels compute it (fl_gemv_fused_bf16 and fl_attn_*): the results are bit-identical.
//
// Activations written in one phase are read in a later one by other blocks: those reads go
// through L2 (ld.cg), never through an SM's L1, which is not coherent within a kernel.
//
// Measured on an H200 (scripts/gpu/layer_bench.cu, 1B shape, 2k tokens, per layer): 60.5 µs
// against 57.2 for the separate kernels. Per phase (mean over blocks): norm+QKV 6.2, barrier 2.0,
// attention 5.8 (the merging groups 11.5), O 1.9, gate|up 15.8 and down 8.0 with ~5 µs of
// prefetch+barrier before each: the products stream ~3.1-3.3 TB/s through the registers of 16
// warps per SM (more chunks in flight per warp, or 384 threads with 4, were slower). What is
// left: stream the weights through shared memory with bulk asynchronous copies (TMA: no
// registers held per load in flight, and the copies can run ahead across barriers), and a merge
// that does not wait for the slowest chunk.
#ifndef LAYER_THREADS
#define LAYER_THREADS 512
#endif
#define LAYER_WARPS (LAYER_THREADS / 32)
#define LAYER_GROUPS (LAYER_THREADS / ATTN_THREADS)

struct DecodeLayer {
  const bf16* x;  // the residual stream in, [hidden]
  bf16* x_mid;    // after attention
  bf16* x_out;    // after the MLP
  const float* n1;
  const float* n2;
  float eps;
  int hidden;
  const bf16* wqkv;  // [nqkv, hidden]: q rows, then k, then v
  bf16* qkv;         // [nqkv]
  int nqkv;
  bf16* kc;  // caches [hkv, s_max, D] (head stride head_stride)
  bf16* vc;
  long head_stride;
  int s_max;
  int nsplit;  // ceil(s_max / ATTN_CHUNK)
  const float* cos_t;
  const float* sin_t;
  int interleaved;
  const unsigned* pos;  // the token's position (device word)
  int hq, hkv;
  float scale;
  int window;
  float softcap;
  float* part_m;  // [hq * nsplit]
  float* part_l;
  float* part_acc;     // [hq * nsplit * D]
  unsigned* counters;  // [hkv], zero between steps
  bf16* attn;          // [hq * D]
  const bf16* wo;      // [hidden, hq * D]
  const bf16* wgu;     // [2 * inter, hidden]: gate rows, then up rows
  int inter;
  bf16* act;           // [inter]
  const bf16* wdown;   // [hidden, inter]
  unsigned* bar;       // grid barrier: arrivals, generation (zero-initialized once)
  long long* clocks;   // non-null: each block's SM clock at the phase marks (LAYER_MARKS per block)
};

#define LAYER_MARKS 10
__device__ __forceinline__ void mark(const DecodeLayer& L, int k) {
  if (L.clocks && threadIdx.x == 0) L.clocks[blockIdx.x * LAYER_MARKS + k] = clock64();
}

// A grid-wide barrier in two halves, so that loads issued between them (the next phase's
// weights) overlap the wait: a fence would wait for them, so the only fence is in the arrival.
// All blocks must be co-resident (cooperative launch). Every write before grid_arrive is visible
// to every block after grid_wait. bar = {arrivals, generation}; arrivals return to zero.
__device__ __forceinline__ unsigned grid_arrive(unsigned* bar) {
  __syncthreads();
  unsigned g = 0;
  if (threadIdx.x == 0) {
    g = *(volatile unsigned*)(bar + 1);  // cannot move before every block, this one too, arrives
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicExch(bar + 1, g + 1);
    }
  }
  return g;
}
__device__ __forceinline__ void grid_wait(unsigned* bar, unsigned g) {
  if (threadIdx.x == 0) {
    unsigned now;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar + 1) : "memory");
    } while (now == g);
  }
  __syncthreads();
}

// The rows of one product phase that a warp takes: row j of warp gw is gw + j·W (W warps).
struct PlainRows {
  int n, gw, w;
  __device__ __forceinline__ int row(int j) const {
    int r = gw + j * w;
    return r < n ? r : -1;
  }
};
// The gate|up phase: warp rows come in pairs, gate row i then up row inter + i.
struct PairRows {
  int inter, gw, w;
  __device__ __forceinline__ int row(int j) const {
    int i = gw + (j >> 1) * w;
    return i < inter ? (j & 1 ? inter + i : i) : -1;
  }
};

// A warp's stream of weight chunks: chunk c is batch c % nb (GEMV_BATCH vectors) of its row
// c / nb. LAYER_CHUNKS chunks are in flight at any time, in the warp's buffers (registers):
// a chunk's buffer is refilled with the chunk LAYER_CHUNKS later as soon as it is consumed.
#ifndef LAYER_CHUNKS
#define LAYER_CHUNKS 2  // 3 was measured slower (1B: 67.6 vs 63.2 us per layer)
#endif
typedef uint4 ChunkBuffers[LAYER_CHUNKS][8];
template <typename Rows>
struct ChunkStream {
  Rows rows;
  const uint4* w;
  int nv, nb, lane;
  __device__ __forceinline__ bool valid(int c) const { return rows.row(c / nb) >= 0; }
  __device__ __forceinline__ void load(int c, uint4 (&buf)[8]) const {
    // Every path writes all of buf: the compiler then knows the previous phase's chunks are
    // dead (else it keeps them in registers across the attention phase, which then spills).
    int r = rows.row(c / nb);
    const uint4* wr = w + (size_t)max(r, 0) * nv;
    int base = (c % nb) * GEMV_BATCH;
#pragma unroll
    for (int u = 0; u < 8; u++) {
      int i = base + lane + 32 * u;
      buf[u] = r >= 0 && i < nv ? __ldcs(wr + i) : make_uint4(0, 0, 0, 0);
    }
  }
  __device__ __forceinline__ void prefetch(ChunkBuffers& bufs) const {
#pragma unroll
    for (int k = 0; k < LAYER_CHUNKS; k++) load(k, bufs[k]);
  }
  // Accumulates chunk c (held in buf) into acc, as fl_gemv_fused_bf16 does; at the end of a row
  // calls done(j, row, warp sum). Then refills buf with chunk c + LAYER_CHUNKS.
  template <typename Done>
  __device__ __forceinline__ void step(int c, uint4 (&buf)[8], const uint4* xs, float& acc, Done& done) const {
    int base = (c % nb) * GEMV_BATCH;
#pragma unroll
    for (int u = 0; u < 8; u++) {
      int i = base + lane + 32 * u;
      if (i < nv) acc = dot8(buf[u], xs[i], acc);
    }
    if (c % nb == nb - 1) {
      int j = c / nb;
      done(j, rows.row(j), warp_sum(acc));
      acc = 0.f;
    }
    load(c + LAYER_CHUNKS, buf);
  }
  template <typename Done>
  __device__ void run(ChunkBuffers& bufs, const uint4* xs, Done done) const {
    float acc = 0.f;
    for (int c = 0;; c += LAYER_CHUNKS) {
#pragma unroll
      for (int k = 0; k < LAYER_CHUNKS; k++) {
        if (!valid(c + k)) return;
        step(c + k, bufs[k], xs, acc, done);
      }
    }
  }
};

template <typename Rows>
__device__ __forceinline__ ChunkStream<Rows> chunk_stream(Rows rows, const bf16* w, int k) {
  int nv = k / 8;
  return ChunkStream<Rows>{rows, reinterpret_cast<const uint4*>(w), nv, (nv + GEMV_BATCH - 1) / GEMV_BATCH,
                           (int)(threadIdx.x & 31)};
}

// xs = RMSNorm(x)·nw (k values), rounded to bf16, as gemv_fused's prologue 1 computes it: the
// sum of squares runs over the first 256 threads with its stride, so it adds in the same order.
__device__ void stage_normed(const bf16* x, const float* nw, float eps, int k, uint4* xs) {
  int nv = k / 8, tid = threadIdx.x;
  const uint4* xg = reinterpret_cast<const uint4*>(x);
  float ss = 0.f;
  if (tid < 256) {
    for (int i = tid; i < nv; i += 256) {
      uint4 v = __ldcg(xg + i);
      xs[i] = v;
      ss = sumsq8(v, ss);
    }
  }
  ss = block_sum(ss);
  float inv = rsqrtf(ss / (float)k + eps);
  if (tid < 256)
    for (int i = tid; i < nv; i += 256) {
      const float4* wv = reinterpret_cast<const float4*>(nw) + 2 * i;
      xs[i] = norm8(xs[i], inv, wv[0], wv[1]);
    }
  __syncthreads();
}

__device__ void stage_plain(const bf16* x, int k, uint4* xs) {
  const uint4* xg = reinterpret_cast<const uint4*>(x);
  for (int i = threadIdx.x; i < k / 8; i += LAYER_THREADS) xs[i] = __ldcg(xg + i);
  __syncthreads();
}

// y[r] = bf16(acc), or bf16(res[r] + bf16(acc)) with a residual: gemv_fused's epilogue.
struct StoreRow {
  bf16* y;
  const bf16* res;
  __device__ __forceinline__ void operator()(int, int r, float acc) const {
    if ((threadIdx.x & 31) != 0) return;
    float v = res ? __bfloat162float(__ldcg(res + r)) + __bfloat162float(__float2bfloat16(acc)) : acc;
    y[r] = __float2bfloat16(v);
  }
};
// act[i] = silu(gate_i)·up_i from the bf16-rounded products, as silu_mul8 computes it. Rows
// come as PairRows orders them: gate row i (kept), then up row inter + i.
struct StoreSiluMul {
  bf16* act;
  int inter;
  float gate;
  __device__ __forceinline__ void operator()(int j, int r, float acc) {
    float v = __bfloat162float(__float2bfloat16(acc));
    if ((j & 1) == 0) {
      gate = v;
      return;
    }
    if ((threadIdx.x & 31) == 0) act[r - inter] = __float2bfloat16(gate / (1.f + __expf(-gate)) * v);
  }
};

// The grid barrier before a product phase, with the phase's first weight chunks loaded inside it.
template <typename Rows>
__device__ __forceinline__ void barrier_prefetching(const DecodeLayer& L, const ChunkStream<Rows>& s, ChunkBuffers& bufs) {
  unsigned gen = grid_arrive(L.bar);
  s.prefetch(bufs);
  grid_wait(L.bar, gen);
}

// Phase 2: the attention items (kv head, split), one per ATTN_THREADS-thread group at a time,
// behind the grid barrier after the QKV product; each group's first item's cached rows are
// prefetched into L2 inside the barrier. With L.clocks, each item's duration is recorded.
template <int D, int MG>
__device__ __forceinline__ void attention_phase(const DecodeLayer& L) {
  extern __shared__ uint4 layer_smem[];
  int grp = threadIdx.x / ATTN_THREADS, gtid = threadIdx.x % ATTN_THREADS;
  int nblocks = gridDim.x;
  int gg = grp * nblocks + blockIdx.x, ng = nblocks * LAYER_GROUPS;
  int nitems = L.hkv * L.nsplit, G = L.hq / L.hkv;
  long qpos = (long)*L.pos;
  unsigned gen = grid_arrive(L.bar);
  if (gg < nitems) {
    int h = gg % L.hkv, split = gg / L.hkv;
    long j = (long)split * ATTN_CHUNK + gtid / 2;
    if (j <= qpos && j < L.s_max) {
      const bf16* base = (gtid & 1 ? L.vc : L.kc) + (size_t)h * L.head_stride + (size_t)j * D;
#pragma unroll
      for (int o = 0; o < D * 2; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + o / 2));
    }
  }
  grid_wait(L.bar, gen);
  mark(L, 2);
  AttnShared<D, MG>* S = reinterpret_cast<AttnShared<D, MG>*>(layer_smem);
  const bf16* k_new = L.qkv + (size_t)L.hq * D;
  const bf16* v_new = k_new + (size_t)L.hkv * D;
  for (int it = gg; it < nitems; it += ng) {
    long long t0 = clock64();
    attn_item<bf16, D, MG, LAYER_MERGE_BATCH>(L.qkv, L.kc, L.vc, L.cos_t, L.sin_t, qpos, G, L.head_stride, 0, L.s_max, L.window, L.scale,
                           L.softcap, L.interleaved, L.part_m, L.part_l, L.part_acc, k_new, v_new, L.counters, L.attn,
                           it % L.hkv, it / L.hkv, L.nsplit, AttnGroup{gtid, 1 + grp}, S[grp], [] {});
    if (L.clocks && gtid == 0) {
      long long* g = L.clocks + (size_t)gridDim.x * LAYER_MARKS + (size_t)it * 4;
      g[0] = clock64() - t0;
      g[1] = S[grp].last;
      g[2] = (it / L.hkv) == qpos / ATTN_CHUNK;
      g[3] = it;
    }
  }
}

template <int D, int MG>
__device__ __forceinline__ void decode_layer(const DecodeLayer& L) {
  extern __shared__ uint4 layer_smem[];
  uint4* xs = layer_smem;
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  if (smem_bytes < LAYER_GROUPS * sizeof(AttnShared<D, MG>) || smem_bytes < 2u * max(max(L.hidden, L.hq * D), L.inter)) __trap();
  int warp = threadIdx.x >> 5, nblocks = gridDim.x;
  int gw = warp * nblocks + blockIdx.x;  // consecutive rows go to different SMs
  int nw = nblocks * LAYER_WARPS;
  ChunkBuffers bufs;
  mark(L, 0);

  // 1. norm + QKV
  auto qkv = chunk_stream(PlainRows{L.nqkv, gw, nw}, L.wqkv, L.hidden);
  qkv.prefetch(bufs);
  stage_normed(L.x, L.n1, L.eps, L.hidden, xs);
  qkv.run(bufs, xs, StoreRow{L.qkv, nullptr});
  mark(L, 1);

  // 2. attention
  attention_phase<D, MG>(L);

  // 3. O + residual
  mark(L, 3);
  int kattn = L.hq * D;
  auto o = chunk_stream(PlainRows{L.hidden, gw, nw}, L.wo, kattn);
  barrier_prefetching(L, o, bufs);
  mark(L, 4);
  stage_plain(L.attn, kattn, xs);
  o.run(bufs, xs, StoreRow{L.x_mid, L.x});
  mark(L, 5);

  // 4. norm + gate|up, silu·up
  auto gu = chunk_stream(PairRows{L.inter, gw, nw}, L.wgu, L.hidden);
  barrier_prefetching(L, gu, bufs);
  mark(L, 6);
  stage_normed(L.x_mid, L.n2, L.eps, L.hidden, xs);
  gu.run(bufs, xs, StoreSiluMul{L.act, L.inter, 0.f});
  mark(L, 7);

  // 5. down + residual
  auto down = chunk_stream(PlainRows{L.hidden, gw, nw}, L.wdown, L.inter);
  barrier_prefetching(L, down, bufs);
  mark(L, 8);
  stage_plain(L.act, L.inter, xs);
  down.run(bufs, xs, StoreRow{L.x_out, L.x_mid});
  mark(L, 9);
}

#define DECODE_LAYER(D, MG)                                                                          \
  extern "C" __global__ void __launch_bounds__(LAYER_THREADS, 1) fl_decode_layer_d##D##_g##MG(DecodeLayer L) { \
    decode_layer<D, MG>(L);                                                                            \
  }
DECODE_LAYER(64, 4)
DECODE_LAYER(64, 8)
DECODE_LAYER(128, 4)
DECODE_LAYER(128, 8)
