// How long does a kernel boundary of the decode step cost, and would counters in global memory
// be cheaper than programmatic dependent launch's grid-completion wait? Times a chain of
// product-like kernels in one CUDA graph (each block streams its share of a weight matrix with
// its first loads issued before the wait, then needs the whole previous output, then writes its
// own value), with the boundary as:
//   wait+trigger   griddepcontrol.wait, then launch_dependents (the engine's order until 2026-12-05);
//   trigger+wait   launch_dependents first, so blocks can start two kernels ahead (the engine's since);
//   counters       launch_dependents first, no grid wait: thread 0 polls a counter that every
//                  block of the previous kernel adds 1 to (release) when its output is written.
// Every mode must give the same final outputs (a stale read would change them). Measured on an H100
// (2026-12-05), us per kernel at 13 / 15 / 63 MB: 5.16 / 5.93 / 33.8, 4.97 / 5.79 / 33.3, and counters
// 5.93 / 6.88 / 34.3: polling counters costs ~1 us more per boundary than the grid wait.
//   sync_probe [MB per kernel ...]   (nvcc -O3 -std=c++17 -arch=sm_90 -cudart static)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check.cuh"

constexpr int THREADS = 256, PRE = 8, IN = 1024, KERNELS = 64;

__device__ __forceinline__ float mix(uint4 v) {
  return __uint_as_float((v.x ^ v.y ^ v.z ^ v.w) & 0x3f7fffffu);  // in [0, 1)
}

// mode 0: wait+trigger, 1: trigger+wait, 2: counters.
__global__ void __launch_bounds__(THREADS) link(int mode, const uint4* w, int per_thread, const float* in, float* out,
                                                 const unsigned* wait_cnt, unsigned target, unsigned* signal_cnt) {
  const uint4* mine = w + ((size_t)blockIdx.x * THREADS + threadIdx.x) * per_thread;
  uint4 pre[PRE];
#pragma unroll
  for (int u = 0; u < PRE; u++) pre[u] = u < per_thread ? __ldcs(mine + u) : make_uint4(0, 0, 0, 0);
  if (mode == 0) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
  } else {
    asm volatile("griddepcontrol.launch_dependents;" :::);
    if (mode == 1) {
      asm volatile("griddepcontrol.wait;" ::: "memory");
    } else if (wait_cnt) {
      if (threadIdx.x == 0) {
        unsigned seen;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(wait_cnt) : "memory");
        } while (seen < target);
      }
      __syncthreads();
    }
  }
  // The whole previous output (4 KB), as a product's x.
  float x = 0.f;
  for (int i = threadIdx.x; i < IN; i += THREADS) x += __ldcg(in + i) * (float)(i % 7 + 1);
  float acc = 0.f;
#pragma unroll
  for (int u = 0; u < PRE; u++) acc += mix(pre[u]);
  for (int u = PRE; u < per_thread; u++) acc += mix(__ldcs(mine + u));
  acc = acc * 1e-3f + x;
  __shared__ float red[THREADS / 32];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < THREADS / 32; i++) s += red[i];
    for (int i = blockIdx.x; i < IN; i += gridDim.x) out[i] = s * 1e-4f + (float)(i & 3);
    if (mode == 2) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(signal_cnt) : "memory");
  }
}

int main(int argc, char** argv) {
  std::vector<double> mbs = {8, 16, 64};
  if (argc > 1) {
    mbs.clear();
    for (int i = 1; i < argc; i++) mbs.push_back(atof(argv[i]));
  }
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int blocks = 3 * sms;
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const char* names[3] = {"wait+trigger", "trigger+wait", "counters"};
  for (double mb : mbs) {
    int per_thread = std::max(PRE, (int)(mb * 1e6 / 16 / ((double)blocks * THREADS)));
    size_t vecs = (size_t)blocks * THREADS * per_thread;
    uint4* w;
    CK(cudaMalloc(&w, vecs * 16 * 2));  // two matrices, alternating, so L2 does not hold them
    CK(cudaMemset(w, 0x3c, vecs * 16 * 2));
    float* act;
    CK(cudaMalloc(&act, (size_t)(KERNELS + 1) * IN * 4));
    CK(cudaMemset(act, 0, (size_t)(KERNELS + 1) * IN * 4));
    unsigned* cnt;
    CK(cudaMalloc(&cnt, KERNELS * 4));
    std::vector<cudaGraphExec_t> ex(3);
    for (int mode = 0; mode < 3; mode++) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      CK(cudaMemsetAsync(cnt, 0, KERNELS * 4, st));
      for (int k = 0; k < KERNELS; k++) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = blocks;
        cfg.blockDim = THREADS;
        cfg.stream = st;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = k > 0 ? 1 : 0;  // the first waits for the memset in stream order
        const unsigned* wc = k > 0 ? cnt + k - 1 : nullptr;
        CK(cudaLaunchKernelEx(&cfg, link, mode, (const uint4*)(w + (k & 1) * vecs), per_thread,
                              (const float*)(act + (size_t)k * IN), act + (size_t)(k + 1) * IN, wc, (unsigned)blocks,
                              cnt + k));
      }
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&ex[mode], g, 0));
    }
    // Same outputs in every mode.
    std::vector<float> ref(IN), got(IN);
    for (int mode = 0; mode < 3; mode++) {
      CK(cudaMemset(act, 0, (size_t)(KERNELS + 1) * IN * 4));
      CK(cudaGraphLaunch(ex[mode], st));
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy((mode ? got : ref).data(), act + (size_t)KERNELS * IN, IN * 4, cudaMemcpyDeviceToHost));
      if (mode && got != ref) printf("MISMATCH: %s gives other outputs than %s\n", names[mode], names[0]);
    }
    // Timing: rounds alternate the modes; median of the rounds.
    std::vector<std::vector<float>> t(3);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int round = 0; round < 15; round++)
      for (int mode = 0; mode < 3; mode++) {
        CK(cudaEventRecord(a, st));
        for (int rep = 0; rep < 5; rep++) CK(cudaGraphLaunch(ex[mode], st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t[mode].push_back(ms * 1e3f / 5 / KERNELS);
      }
    printf("%.1f MB per kernel (%d blocks, %d vectors per thread):", vecs * 16 / 1e6, blocks, per_thread);
    for (int mode = 0; mode < 3; mode++) {
      std::sort(t[mode].begin(), t[mode].end());
      printf("  %s %.2f us", names[mode], t[mode][t[mode].size() / 2]);
    }
    printf("  (bytes alone at 4.25 TB/s: %.2f us)\n", vecs * 16 / 4.25e6);
    for (auto x : ex) CK(cudaGraphExecDestroy(x));
    CK(cudaFree(w));
    CK(cudaFree(act));
    CK(cudaFree(cnt));
  }
}
