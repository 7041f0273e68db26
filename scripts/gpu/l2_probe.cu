// Does a weight range pulled into L2 beforehand make the decode matrix-vector kernel faster, and
// which way of pulling works? Times fl_gemv_fused_bf16 on bf16 weights in a real shape after:
// a flush of L2 (cold), a bulk (TMA) L2 prefetch of the first X MB, a per-line prefetch.global.L2
// of it, and plain loads of it; each prefetch waited for before the product starts.
//   l2_probe [N K X_MB [tma]]   (tma: the engine's fl_gemv_tma2_bf16, 3 blocks per SM)   (nvcc -O3 -std=c++17 -arch=sm_90 -cudart static, as build_layer_bench.sh)
// Measured on an H200 (2026-12-04, N 16384 K 2048 = 67 MB, X 16.8 / 41.9 MB): cold 24.7 us, bulk
// prefetch 23.6, line prefetch 23.7, plain loads 22.1 / 21.3, the whole W read just before 21.9:
// a product whose weights are largely in L2 is barely faster, so prefetching the next kernel's
// weights into L2 (tried from the attention kernel and the products' tails: 0-8% slower per
// layer) is not the way to fill the memory system's idle time; see bench/results/gpu-h200.md.
// The bulk-copy product (tma, 2026-12-04 session 18): cold 26.6-27.6 us, 33.6 MB prefetched
// 22.2-25.0; prefetches issued inside the step (bulk or per-line, by the attention or the O
// product's blocks, 8-48 MB of the next gate|up) were again slower: 52.6-69 against 48.6 us per
// 1B layer.
#include "../../crates/backend/src/cuda/kernels.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "check.cuh"

__global__ void fill(bf16* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16(((unsigned)(i * 2654435761u) >> 8) / 16777216.f - 0.5f);
}
// Reads n uint4 with ordinary loads (allocating in L2); sums into *sink so nothing is dropped.
__global__ void touch(const uint4* p, size_t n, unsigned* sink) {
  unsigned s = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v = p[i];
    s ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (s == 0x12345678u) *sink = s;
}
// Bulk L2 prefetch of [p, p + n), split over the grid's warps (64 KB per instruction).
__global__ void bulk_prefetch(const char* p, size_t n) {
  size_t per = (n / gridDim.x + 15) & ~(size_t)15, lo = blockIdx.x * per, hi = lo + per < n ? lo + per : n;
  for (size_t o = lo + threadIdx.x * 65536; o < hi; o += 32 * 65536) {
    unsigned len = (unsigned)(hi - o < 65536 ? hi - o : 65536);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + o), "r"(len) : "memory");
  }
}
__global__ void line_prefetch(const char* p, size_t n) {
  for (size_t o = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * 128; o < n; o += (size_t)gridDim.x * blockDim.x * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

int main(int argc, char** argv) {
  int N = 16384, K = 2048;
  double xmb = 16;
  if (argc >= 4) N = atoi(argv[1]), K = atoi(argv[2]), xmb = atof(argv[3]);
  bool tma = argc >= 5 && std::string(argv[4]) == "tma";
  size_t wn = (size_t)N * K, wbytes = wn * 2, xb = std::min(wbytes, (size_t)(xmb * 1048576) & ~(size_t)15);
  size_t flush_n = (size_t)512 << 20;  // bytes
  bf16 *w, *x, *y;
  uint4* fl;
  unsigned* sink;
  CK(cudaMalloc(&w, wbytes));
  CK(cudaMalloc(&x, K * 2));
  CK(cudaMalloc(&y, N * 2));
  CK(cudaMalloc(&fl, flush_n));
  CK(cudaMalloc(&sink, 4));
  fill<<<1024, 256>>>(w, wn);
  fill<<<8, 256>>>(x, K);
  CK(cudaMemset(fl, 1, flush_n));
  float* nw;
  CK(cudaMalloc(&nw, K * 4));
  std::vector<float> ones(K, 1.f);
  CK(cudaMemcpy(nw, ones.data(), K * 4, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1, e2;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&e2));
  // The engine's bulk-copy product: 2 stages, as many blocks per SM as fit (3 on an H200).
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  size_t tma_smem = K * 2 + 2 * 8 * GEMV_BATCH * 16;
  CK(cudaFuncSetAttribute(fl_gemv_tma2_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)tma_smem));
  int tma_blocks = std::min(3 * sms, (N + 7) / 8);
  auto gemv = [&] {
    if (tma)
      fl_gemv_tma2_bf16<<<tma_blocks, 256, tma_smem, st>>>(x, nullptr, nw, 1e-5f, 1, w, nullptr, y, N, K, GEMV_OUT_BF16, nullptr, nullptr,
                                                          nullptr, nullptr);
    else
      fl_gemv_fused_bf16<<<(N + 7) / 8, 256, K * 2, st>>>(x, nullptr, nw, 1e-5f, 1, w, nullptr, y, N, K);
  };
  auto flush = [&] { touch<<<1024, 512, 0, st>>>(fl, flush_n / 16, sink); };
  const char* names[] = {"cold (L2 flushed)", "bulk prefetch of X", "line prefetch of X", "plain loads of X",
                         "whole W read just before", "bulk prefetch, no wait"};
  for (int mode = 0; mode < 6; mode++) {
    std::vector<float> tg, tp;
    for (int r = 0; r < 21; r++) {
      flush();
      CK(cudaEventRecord(e0, st));
      if (mode == 1 || mode == 5) bulk_prefetch<<<264, 32, 0, st>>>((const char*)w, xb);
      if (mode == 2) line_prefetch<<<264, 256, 0, st>>>((const char*)w, xb);
      if (mode == 3) touch<<<1024, 512, 0, st>>>((const uint4*)w, xb / 16, sink);
      if (mode == 4) touch<<<1024, 512, 0, st>>>((const uint4*)w, wbytes / 16, sink);
      CK(cudaEventRecord(e1, st));
      if (mode != 5) {
        CK(cudaEventSynchronize(e1));
        // Let a bulk prefetch (asynchronous even after its kernel ends) land.
        if (mode == 1) {
          for (volatile int s = 0; s < 200000; s++) {}
        }
        CK(cudaEventRecord(e1, st));
      }
      gemv();
      CK(cudaEventRecord(e2, st));
      CK(cudaEventSynchronize(e2));
      float a, b;
      CK(cudaEventElapsedTime(&a, e0, e1));
      CK(cudaEventElapsedTime(&b, e1, e2));
      tp.push_back(a * 1000);
      tg.push_back(b * 1000);
    }
    std::sort(tg.begin(), tg.end());
    std::sort(tp.begin(), tp.end());
    printf("%s N %d K %d (%.1f MB), X %.1f MB: %-26s gemv %7.2f us (%5.0f GB/s)  before it %7.2f us\n", tma ? "tma" : "fused", N, K, wbytes / 1e6,
           xb / 1e6, names[mode], tg[10], wbytes / (tg[10] * 1e3), tp[10]);
  }
  return 0;
}
