// ---------------------------------------------------------------------------------------------
// Prefill attention without the T×S scores (flash attention on bf16 tensor cores, through WMMA).
// Included by kernels.cu.
//
// Why: the candle composition it replaces materialized the raw scores and the probabilities of
// every (query head, query, key): 268 MB each per layer for a 2,048-token Llama-3.2-1B prompt,
// ~1 ms per layer, half the prefill. Here a block takes FP_ROWS queries of one query head and
// walks the key tiles they can see, holding its queries, one tile of keys and values, and each
// query's running max, sum and output in shared memory (the online softmax); nothing of size
// T×S is ever written.
//
// q [T, HQ, D] bf16 (contiguous); k, v [HKV, S, D] bf16 with token stride D and head stride
// `head_stride` (a view of the cache buffers: no copy); out [T, HQ·D] bf16. Query i sits at
// query_start + i, key j at key_start + j; key j is visible to query i when its position is not
// after the query's and (window > 0) fewer than `window` positions behind. Scores are scaled,
// then soft-capped (softcap > 0), in f32; probabilities are rounded to bf16 for the P·V product
// (as the composition's bf16 probabilities were), its sums kept in f32.
//
// Layout of a block: FP_WARPS warps, warp w owns queries 16w .. 16w+15 of the block's tile. Per
// key tile: S = Q·Kᵀ (16×64 per warp, tensor cores) into shared memory; two lanes per query
// row (alternate columns) apply scale, cap and mask and update the row's max and sum; the warp
// rescales its output rows; then O += P·V (tensor cores, the output rows loaded and stored as
// accumulators).
#include <mma.h>

#define FP_WARPS 4
#define FP_ROWS (16 * FP_WARPS)  // queries per block
#define FP_KEYS 64               // keys per tile

// Rows are padded (by 16 bytes for bf16, 16 for f32) so that the rows the lanes of a warp touch
// at once fall in different shared-memory banks.
template <int D>
struct FlashShared {
  static constexpr int DP = D + 8, SP = FP_KEYS + 4, PP = FP_KEYS + 8, OP = D + 4;
  bf16 q[FP_ROWS][DP];
  bf16 k[FP_KEYS][DP];
  bf16 v[FP_KEYS][DP];
  float s[FP_WARPS][16][SP];
  bf16 p[FP_WARPS][16][PP];
  float o[FP_WARPS][16][OP];
  float m[FP_WARPS][16], l[FP_WARPS][16];
};

// ROWS rows of D bf16 (row r at src + r·stride; rows at or past `valid` as zeros) moved into
// shared memory in two halves: fetch issues every load of the thread into registers at once,
// store writes them (rows DP apart). Fetching the next key tile before computing on this one
// keeps its memory latency off the critical path.
template <int D, int ROWS>
struct FpRows {
  static constexpr int V8 = D / 8, PER = ROWS * V8 / (32 * FP_WARPS);
  static_assert(ROWS * V8 % (32 * FP_WARPS) == 0, "whole vectors per thread");
  uint4 buf[PER];
  __device__ __forceinline__ void fetch(const bf16* src, long stride, long valid) {
#pragma unroll
    for (int u = 0; u < PER; u++) {
      int i = threadIdx.x + u * 32 * FP_WARPS, r = i / V8, c = i % V8;
      buf[u] = r < valid ? *reinterpret_cast<const uint4*>(src + r * stride + c * 8) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  template <int DP>
  __device__ __forceinline__ void store(bf16 (*dst)[DP]) const {
#pragma unroll
    for (int u = 0; u < PER; u++) {
      int i = threadIdx.x + u * 32 * FP_WARPS, r = i / V8, c = i % V8;
      *reinterpret_cast<uint4*>(&dst[r][c * 8]) = buf[u];
    }
  }
};

template <int D>
__device__ void flash_prefill(const bf16* q, const bf16* k, const bf16* v, bf16* out, int T, int HQ, int G, long head_stride,
                              int S, unsigned query_start, unsigned key_start, int window, float scale, float softcap) {
  using namespace nvcuda;
  extern __shared__ __align__(128) unsigned char fp_raw[];
  using Sh = FlashShared<D>;
  constexpr int DP = Sh::DP, SP = Sh::SP, PP = Sh::PP, OP = Sh::OP;
  Sh& sh = *reinterpret_cast<Sh*>(fp_raw);
  int h = blockIdx.y, t0 = blockIdx.x * FP_ROWS;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bf16* kh = k + (size_t)(h / G) * head_stride;
  const bf16* vh = v + (size_t)(h / G) * head_stride;
  {
    FpRows<D, FP_ROWS> qr;
    qr.fetch(q + ((size_t)t0 * HQ + h) * D, (long)HQ * D, T - t0);
    qr.store(sh.q);
  }
  // The warp's output rows: in registers as accumulators for D <= 128 (loaded and stored
  // through shared memory on every tile otherwise).
  constexpr bool REG_O = D <= 128;
  constexpr int OREG = REG_O ? D / 16 : 1;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> oreg[OREG];
#pragma unroll
  for (int n = 0; n < OREG; n++) wmma::fill_fragment(oreg[n], 0.f);
  for (int i = lane; i < 16 * D; i += 32) sh.o[warp][i / D][i % D] = 0.f;
  if (lane < 16) sh.m[warp][lane] = -INFINITY, sh.l[warp][lane] = 0.f;

  // The key tiles some query of the block can see: up to the last query's position, from the
  // first query's window start (tile-aligned).
  long q_first = (long)query_start + t0, q_last = (long)query_start + min(t0 + FP_ROWS, T) - 1;
  long j_end = min((long)S, q_last - (long)key_start + 1);
  long j_begin = window > 0 ? max(0L, q_first + 1 - window - (long)key_start) : 0L;
  j_begin -= j_begin % FP_KEYS;
  // Lanes 2r and 2r+1 take query row r of the warp, alternate columns of a tile. The row sees
  // keys [row_lo, row_hi] (empty past T).
  int r = lane >> 1, half = lane & 1;
  long qpos = (long)query_start + t0 + warp * 16 + r;
  long row_hi = t0 + warp * 16 + r < T ? min((long)S - 1, qpos - (long)key_start) : -1;
  long row_lo = window > 0 ? qpos + 1 - window - (long)key_start : 0;
  // Key and value tiles: the next one is fetched into registers while this one is computed on
  // (for D <= 128; D = 256 would hold 128 registers per thread for it).
  constexpr bool AHEAD = D <= 128;
  FpRows<D, FP_KEYS> kr, vr;
  if (AHEAD && j_begin < j_end) kr.fetch(kh + j_begin * D, D, S - j_begin), vr.fetch(vh + j_begin * D, D, S - j_begin);
  for (long j0 = j_begin; j0 < j_end; j0 += FP_KEYS) {
    __syncthreads();  // every warp is done with the previous tile (and q is in place)
    if (!AHEAD) kr.fetch(kh + j0 * D, D, S - j0), vr.fetch(vh + j0 * D, D, S - j0);
    kr.store(sh.k);
    vr.store(sh.v);
    __syncthreads();
    long next = j0 + FP_KEYS;
    if (AHEAD && next < j_end) kr.fetch(kh + next * D, D, S - next), vr.fetch(vh + next * D, D, S - next);
    // This tile's visible columns of the lane's row: [lo, hi], in 32-bit arithmetic below.
    int lo = (int)max(-1L, min((long)FP_KEYS, row_lo - j0)), hi = (int)max(-1L, min((long)FP_KEYS, row_hi - j0));
    {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FP_KEYS / 16];
#pragma unroll
      for (int n = 0; n < FP_KEYS / 16; n++) wmma::fill_fragment(acc[n], 0.f);
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
        wmma::load_matrix_sync(a, &sh.q[warp * 16][kk * 16], DP);
#pragma unroll
        for (int n = 0; n < FP_KEYS / 16; n++) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b;
          wmma::load_matrix_sync(b, &sh.k[n * 16][kk * 16], DP);
          wmma::mma_sync(acc[n], a, b, acc[n]);
        }
      }
#pragma unroll
      for (int n = 0; n < FP_KEYS / 16; n++)
        wmma::store_matrix_sync(&sh.s[warp][0][n * 16], acc[n], SP, wmma::mem_row_major);
    }
    __syncwarp();
    {
      float x[32], mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < 32; c++) {
        int col = 2 * c + half;
        float s = sh.s[warp][r][col] * scale;
        if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
        x[c] = col >= lo && col <= hi ? s : -INFINITY;
        mx = fmaxf(mx, x[c]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      float m_old = sh.m[warp][r], m_new = fmaxf(m_old, mx);
      float alpha = m_new == -INFINITY ? 1.f : __expf(m_old - m_new);
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < 32; c++) {
        float p = m_new == -INFINITY ? 0.f : __expf(x[c] - m_new);
        sh.p[warp][r][2 * c + half] = __float2bfloat16(p);
        sum += p;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      __syncwarp();  // both lanes of the row have read its old max
      if (half == 0) sh.m[warp][r] = m_new, sh.l[warp][r] = sh.l[warp][r] * alpha + sum;
      if (REG_O) {
        // Accumulator element i of a lane is in row lane/4 + 8·(i/2 % 2) (sm_80+ layout of the
        // 16x16 f32 fragment: two m16n8 halves); the self-checks would catch another layout.
        float a0 = __shfl_sync(0xffffffffu, alpha, 2 * (lane >> 2)), a1 = __shfl_sync(0xffffffffu, alpha, 2 * (lane >> 2) + 16);
#pragma unroll
        for (int n = 0; n < OREG; n++)
#pragma unroll
          for (int i = 0; i < 8; i++) oreg[n].x[i] *= (i >> 1) & 1 ? a1 : a0;
      } else {
        // The output rows rescaled by their alpha, each row by the whole warp.
        for (int row = 0; row < 16; row++) {
          float a = __shfl_sync(0xffffffffu, alpha, 2 * row);
          for (int d = lane; d < D; d += 32) sh.o[warp][row][d] *= a;
        }
      }
    }
    __syncwarp();
    {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> pa[FP_KEYS / 16];
#pragma unroll
      for (int kk = 0; kk < FP_KEYS / 16; kk++) wmma::load_matrix_sync(pa[kk], &sh.p[warp][0][kk * 16], PP);
#pragma unroll
      for (int n = 0; n < D / 16; n++) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
        if (REG_O) o = oreg[n % OREG];
        else wmma::load_matrix_sync(o, &sh.o[warp][0][n * 16], OP, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < FP_KEYS / 16; kk++) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
          wmma::load_matrix_sync(b, &sh.v[kk * 16][n * 16], DP);
          wmma::mma_sync(o, pa[kk], b, o);
        }
        if (REG_O) oreg[n % OREG] = o;
        else wmma::store_matrix_sync(&sh.o[warp][0][n * 16], o, OP, wmma::mem_row_major);
      }
    }
    __syncwarp();
  }
  if (REG_O)
#pragma unroll
    for (int n = 0; n < OREG; n++) wmma::store_matrix_sync(&sh.o[warp][0][n * 16], oreg[n], OP, wmma::mem_row_major);
  __syncwarp();
  for (int i = lane; i < 16 * D; i += 32) {
    int row = i / D, d = i % D, t = t0 + warp * 16 + row;
    float l = sh.l[warp][row];
    if (t < T) out[((size_t)t * HQ + h) * D + d] = __float2bfloat16(l > 0.f ? sh.o[warp][row][d] / l : 0.f);
  }
}

#define FLASH_PREFILL(D)                                                                                                \
  extern "C" __global__ void __launch_bounds__(32 * FP_WARPS) fl_flash_prefill_bf16_d##D(                               \
      const bf16* q, const bf16* k, const bf16* v, bf16* out, int T, int HQ, int G, long head_stride, int S,              \
      unsigned query_start, unsigned key_start, int window, float scale, float softcap) {                               \
    pdl_prologue();                                                                                                     \
    flash_prefill<D>(q, k, v, out, T, HQ, G, head_stride, S, query_start, key_start, window, scale, softcap);           \
  }
FLASH_PREFILL(64)
FLASH_PREFILL(128)
FLASH_PREFILL(256)
