// ---------------------------------------------------------------------------------------------
// The fused decode matrix-vector product (gemv_fused's prologues and epilogue, the same per-row
// arithmetic, so bit-identical results) with its weights streamed into shared memory by the
// Hopper bulk-copy engine (TMA: cp.async.bulk + mbarrier), over a fixed grid of a few blocks per
// SM. Included by kernels.cu.
//
// Why: gemv_fused holds every load in flight in registers, and each of its short blocks stages
// x' again. Here a block takes a contiguous range of rows, stages x' once, and keeps NS stages
// of weights in flight through shared memory with no registers held per load; its first stages
// are issued before the wait for the previous kernel (weights never depend on it), which with
// programmatic dependent launch overlaps the previous kernel's tail. Measured in the engine on an
// H200 with PDL on: 1B 1,054 against 1,034 tok/s for gemv_fused, 8B 228 against 220 (without PDL
// it is slower: it wins by starting before the wait); the SwiGLU output below is its own.
//
// Stage s of a block is chunk c = s % nb (B vectors: 4 KB for the default 256) of the eight rows of round
// s / nb; warp w takes row w of each round, lane l the vectors l + 32u of each chunk, exactly as
// gemv_fused's warp and lane do. Stage buffers are refilled after a block barrier (every warp
// done with the stage); a barrier per 32 KB stage costs far less than the round trip it hides.
//
// The output, by `mode`:
//   GEMV_OUT_BF16: y [N] bf16, as gemv_fused writes it.
//   GEMV_OUT_SWIGLU: W holds 2·I rows, gate rows then up rows, and y gets I bf16 values
//     silu(gate_i·x')·(up_i·x'), each product rounded to bf16 first: exactly what gemv_fused's
//     prologue 2 computes from the two products' bf16 outputs, so the down product that follows
//     only copies its input. Warps then take gate row i and up row i side by side (warp 2j, 2j+1).
//   GEMV_OUT_F32: y [N] f32 holding the bf16-rounded values (an output head's logits, without a
//     separate conversion kernel). With `am` (a zeroed u32 scratch of 1 + 2 * gridDim.x) it also
//     writes the logits' argmax to am_dst[0] and adds 1 to am_advance[0] when that is non-null:
//     the greedy end of a decode step in the head's own kernel (head_argmax below). With
//     am_mirror too (mapped host memory, MIRROR_SLOTS u64 slots) it also stores (new position << 32 |
//     token) into slot position % MIRROR_SLOTS, where the host reads it without a copy or event
//     between steps.
#define GEMV_OUT_BF16 0
#define GEMV_OUT_SWIGLU 1
#define GEMV_OUT_F32 2
// The token mirror's slots (crate::graph::MIRROR_SLOTS): a graph of up to MIRROR_SLOTS / 2 steps
// can run while the host reads the tokens of the one before.
#define MIRROR_SLOTS 8u

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}
// bytes (a multiple of 16) from global src to shared dst, completing on bar; evict-first in L2
// (weights are read once per step: keep L2 for activations and the KV cache).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar,
                                          unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// The argmax of a head's logits across its blocks (first index on ties, NaN never chosen, as
// fl_argmax_*): each block's best of its rows goes to the scratch, and the last block to finish
// (one acquire-release atomic, as attn_item) reduces them, writes the token, advances the
// position and leaves the counter at zero for the next step. Every thread of the block calls it.
__device__ void head_argmax(unsigned* am, unsigned* dst, unsigned* advance, unsigned long long* mirror, float best, int idx) {
  __shared__ bool last;
  float* pv = reinterpret_cast<float*>(am + 1);
  int* pi = reinterpret_cast<int*>(am + 1 + gridDim.x);
  argmax_block(&best, &idx);
  if (threadIdx.x == 0) {
    pv[blockIdx.x] = best;
    pi[blockIdx.x] = idx;
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(am) : "memory");
    last = before == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  best = -INFINITY;
  idx = 0x7fffffff;
  for (int i = threadIdx.x; i < (int)gridDim.x; i += blockDim.x) {
    float v = __ldcg(pv + i);
    int j = __ldcg(pi + i);
    if (argmax_better(v, j, best, idx)) best = v, idx = j;
  }
  argmax_block(&best, &idx);
  if (threadIdx.x == 0) {
    unsigned token = idx == 0x7fffffff ? 0u : (unsigned)idx;
    dst[0] = token;
    if (advance) {
      unsigned pos = advance[0] + 1u;
      advance[0] = pos;
      // One 8-byte store over PCIe: the host never sees the tag without its token.
      if (mirror) asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(mirror + (pos % MIRROR_SLOTS)), "l"(((unsigned long long)pos << 32) | token) : "memory");
    }
    am[0] = 0u;
  }
}

// Rounds of rows whose residual is loaded early (gemv_tma): two cover the 1B's and 8B's O and
// down products over three blocks per SM (6 and 11 rows per block). -DRES_EARLY=0: the load at
// each row's end. Measured on an H100 (2026-12-06, same tokens), 1B after a 2k prompt: together
// with stage_input's norm kept in registers 968.0 / 968.2 against 958.5 / 958.8 tok/s for neither
// (+1.0%; 8B +0.4%); the register norm alone 962.6 / 963.3; this alone, with the norm staged
// through shared memory (before commit d1adf7c), 950.7 / 950.8 (slower): keep the two together.
#ifndef RES_EARLY
#define RES_EARLY 2
#endif

// NS: stages in flight per block. B: 16-byte vectors of a row's chunk in one stage (a multiple of
// 32: lane l takes l + 32u); 256 = 4 KB, a 32 KB stage of 8 rows, the engine's default; 128 halves
// each block's stage buffers, so that the next kernel's blocks fit beside it (ops.rs
// FERROLM_CUDA_TMA_BATCH). Every B gives the same sums (each lane's vectors in the same order).
template <int NS, int B>
__device__ void gemv_tma(const bf16* x, const bf16* x2, const float* nw, float eps, int pro, const bf16* w, const bf16* res,
                         void* out, int N, int K, int mode, unsigned* am, unsigned* am_dst, unsigned* am_advance,
                         unsigned long long* am_mirror) {
  bool pair = mode == GEMV_OUT_SWIGLU;
  bf16* y = static_cast<bf16*>(out);
  TL_DECL
  extern __shared__ __align__(128) uint4 tma_smem[];
  __shared__ __align__(8) unsigned long long full[NS];
  constexpr int ROWS = 8;  // warps per block: one row each per round
  __shared__ float up_sums[2][ROWS / 2];  // pair mode: each round's up products (double-buffered)
  int nv = K / 8, nb = (nv + B - 1) / B;
  uint4* xs = tma_smem;          // [K/8]
  uint4* slots = tma_smem + nv;  // [NS][ROWS][B] (a block with fewer stages uses fewer)
  // The block's rows [r0, r1): pair mode splits whole pairs (rows counted as gate, up, gate, ...).
  int units = pair ? N / 2 : N, per = pair ? 2 : 1;
  int r0 = per * (int)((long long)units * blockIdx.x / gridDim.x);
  int r1 = per * (int)((long long)units * (blockIdx.x + 1) / gridDim.x);
  int rounds = (r1 - r0 + ROWS - 1) / ROWS, stages = rounds * nb;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Row r of the block's order in W: pair mode interleaves the gate and up halves.
  auto w_row = [&](int r) { return pair ? (r & 1 ? N / 2 : 0) + (r >> 1) : r; };
  unsigned long long policy = 0;
  // Stage s into its slot: thread 0 announces the bytes, then issues one copy per row.
  auto issue = [&](int s) {
    if (s >= stages) return;
    int round = s / nb, c = s % nb, slot = s % NS;
    int first = r0 + round * ROWS, rows = min(ROWS, r1 - first);
    int vecs = min(B, nv - c * B);
    mbar_expect_tx(&full[slot], (unsigned)(rows * vecs * 16));
    for (int r = 0; r < rows; r++)
      bulk_copy(slots + (slot * ROWS + r) * B, w + (size_t)w_row(first + r) * K + (size_t)c * B * 8,
                (unsigned)(vecs * 16), &full[slot], policy);
  };
  if (threadIdx.x == 0) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int i = 0; i < NS; i++) mbar_init(&full[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int s = 0; s < NS; s++) issue(s);
  }
  NormPre pre = preload_norm(nw, pro, K);
  pdl_prologue();
  TL_MARK(1)
  // The residuals of this warp's rows in its first RES_EARLY rounds, loaded right after the wait
  // beside x's loads, so that they are in registers when the rows end instead of costing one more
  // L2 round trip at the block's tail (res comes from an earlier kernel of the chain: not before
  // the wait). Kept raw, converted where used.
  bf16 res_early[RES_EARLY > 0 ? RES_EARLY : 1];
#pragma unroll
  for (int u = 0; u < RES_EARLY; u++) {
    int n = r0 + u * ROWS + warp;
    if (res && lane == 0 && n < r1) res_early[u] = res[n];
  }
  stage_input(x, x2, nw, pre, eps, pro, K, xs);  // ends with a barrier: the mbarriers are initialized
  TL_MARK(2)
  float acc = 0.f, gate = 0.f;
  float best = -INFINITY;  // head_argmax: lane 0's best row of its warp
  int best_row = 0x7fffffff;
  for (int s = 0; s < stages; s++) {
    int round = s / nb, c = s % nb, slot = s % NS;
    int n = r0 + round * ROWS + warp;
    bool row_done = n < r1 && c == nb - 1;
    mbar_wait(&full[slot], (unsigned)((s / NS) & 1));
    if (n < r1) {
      const uint4* buf = slots + (slot * ROWS + warp) * B;
      int base = c * B;
#pragma unroll
      for (int u = 0; u < B / 32; u++) {
        int i = base + lane + 32 * u;
        if (i < nv) acc = dot8(buf[lane + 32 * u], xs[i], acc);
      }
      if (row_done) {
        acc = warp_sum(acc);
        if (!pair) {
          if (lane == 0) {
            float v = round_bf16(acc);
            if (res) {
              bf16 r;
              bool early = false;
#pragma unroll
              for (int u = 0; u < RES_EARLY; u++)
                if (round == u) r = res_early[u], early = true;
              if (!early) r = res[n];  // a row past the early rounds
              v = round_bf16(__bfloat162float(r) + v);
            }
            if (mode != GEMV_OUT_F32) y[n] = __float2bfloat16(v);
            else static_cast<float*>(out)[n] = v;
            if (argmax_better(v, n, best, best_row)) best = v, best_row = n;
          }
        } else if (warp & 1) {
          if (lane == 0) up_sums[round & 1][warp >> 1] = acc;
        } else {
          gate = acc;
        }
        acc = 0.f;
      }
    }
    __syncthreads();  // every warp is done with the slot (and the round's up products are out)
    if (threadIdx.x == 0) issue(s + NS);
    if (pair && row_done && !(warp & 1) && lane == 0) {
      float g = round_bf16(gate), u = round_bf16(up_sums[round & 1][warp >> 1]);
      y[n >> 1] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
    }
  }
  if (am) head_argmax(am, am_dst, am_advance, am_mirror, best, best_row);
  TL_END(1, N, K)
}

// Dynamic shared memory: K * 2 bytes of x', then NS * 8 * B * 16 bytes of stage buffers
// (only min(NS, its stages) of them are touched by a block).
#define GEMV_TMA(NS, B, SUFFIX)                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) fl_gemv_tma##NS##SUFFIX##_bf16(                                 \
      const bf16* x, const bf16* x2, const float* nw, float eps, int pro, const bf16* w, const bf16* res, void* y, \
      int N, int K, int mode, unsigned* am, unsigned* am_dst, unsigned* am_advance, unsigned long long* am_mirror) { \
    gemv_tma<NS, B>(x, x2, nw, eps, pro, w, res, y, N, K, mode, am, am_dst, am_advance, am_mirror);                 \
  }
GEMV_TMA(2, 256, )  // the engine's (ops.rs); 3 stages measured no faster (2 blocks per SM, 1B and 8B shapes)
GEMV_TMA(3, 256, )
GEMV_TMA(2, 128, _b128)
GEMV_TMA(3, 128, _b128)
