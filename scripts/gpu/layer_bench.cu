// Side-by-side check and timing of the decode-layer kernel (fl_decode_layer_d*) against the
// five separate kernels it replaces (norm+QKV, attention, O, norm+gate|up, silu·up+down), on
// random bf16 weights in a real shape, for L layers, each variant captured in a CUDA graph.
// Built here with nvcc (scripts/gpu/build_layer_bench.sh), run on the GPU machine:
//   layer_bench [hidden hq hkv D inter layers context]   (default: the Llama-3.2-1B shape)
// Prints whether the outputs (final residual stream, appended cache rows) are bit-identical,
// and µs per step of each variant with its effective bandwidth over the bytes read.
#include "../../crates/backend/src/cuda/kernels.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

__global__ void fill_bf16(bf16* p, size_t n, unsigned seed, float scale, float offset) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed * 2246822519u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(offset + scale * ((h & 0xffffff) / 16777216.f - 0.5f));
  }
}

template <typename T>
T* dalloc(size_t n) {
  T* p;
  CK(cudaMalloc(&p, n * sizeof(T)));
  CK(cudaMemset(p, 0, n * sizeof(T)));
  return p;
}
bf16* rand_bf16(size_t n, unsigned seed, float scale, float offset = 0.f) {
  bf16* p = dalloc<bf16>(n);
  fill_bf16<<<1024, 256>>>(p, n, seed, scale, offset);
  CK(cudaGetLastError());
  return p;
}
float* upload(const std::vector<float>& v) {
  float* p = dalloc<float>(v.size());
  CK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return p;
}

struct Layer {
  bf16 *wqkv, *wo, *wgu, *wdown, *kc, *vc;
  float *n1, *n2;
};

int main(int argc, char** argv) {
  int H = 2048, HQ = 32, HKV = 8, D = 64, I = 8192, L = 16, CTX = 2048;
  if (argc >= 8) {
    H = atoi(argv[1]), HQ = atoi(argv[2]), HKV = atoi(argv[3]), D = atoi(argv[4]), I = atoi(argv[5]);
    L = atoi(argv[6]), CTX = atoi(argv[7]);
  }
  int cap = CTX + 128, NQKV = (HQ + 2 * HKV) * D, nsplit = (cap + ATTN_CHUNK - 1) / ATTN_CHUNK, G = HQ / HKV;
  float eps = 1e-5f, scale = 1.f / sqrtf((float)D);
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  printf("shape hidden %d heads %d/%d dim %d inter %d layers %d context %d (cache %d), %d SMs\n", H, HQ, HKV, D, I, L,
         CTX, cap, sms);

  // Weights, caches (separate for each variant, same contents), rotary tables.
  std::vector<Layer> layers(L), layers2(L);
  size_t kv = (size_t)HKV * cap * D;
  for (int l = 0; l < L; l++) {
    Layer& y = layers[l];
    unsigned s = 100 * l;
    y.wqkv = rand_bf16((size_t)NQKV * H, s + 1, 0.08f);
    y.wo = rand_bf16((size_t)H * HQ * D, s + 2, 0.08f);
    y.wgu = rand_bf16((size_t)2 * I * H, s + 3, 0.08f);
    y.wdown = rand_bf16((size_t)H * I, s + 4, 0.04f);
    y.kc = rand_bf16(kv, s + 5, 2.f);
    y.vc = rand_bf16(kv, s + 6, 2.f);
    std::vector<float> n(H);
    for (int i = 0; i < H; i++) n[i] = 1.f + 0.1f * sinf(i + l);
    y.n1 = upload(n);
    for (int i = 0; i < H; i++) n[i] = 1.f + 0.1f * cosf(i + l);
    y.n2 = upload(n);
    layers2[l] = y;
    layers2[l].kc = dalloc<bf16>(kv);
    layers2[l].vc = dalloc<bf16>(kv);
    CK(cudaMemcpy(layers2[l].kc, y.kc, kv * 2, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(layers2[l].vc, y.vc, kv * 2, cudaMemcpyDeviceToDevice));
  }
  std::vector<float> cs((size_t)cap * D / 2), sn(cs.size());
  for (int p = 0; p < cap; p++)
    for (int i = 0; i < D / 2; i++) {
      double f = p * pow(500000.0, -2.0 * i / D);
      cs[(size_t)p * D / 2 + i] = (float)cos(f);
      sn[(size_t)p * D / 2 + i] = (float)sin(f);
    }
  float *cos_t = upload(cs), *sin_t = upload(sn);
  unsigned* pos = dalloc<unsigned>(1);
  unsigned p0 = CTX;
  CK(cudaMemcpy(pos, &p0, 4, cudaMemcpyHostToDevice));

  // Activations: x ping-pongs between two buffers per layer.
  bf16* x0 = rand_bf16(H, 7, 2.f);
  bf16 *xa = dalloc<bf16>(H), *xb = dalloc<bf16>(H), *xm = dalloc<bf16>(H), *qkv = dalloc<bf16>(NQKV);
  bf16 *attn = dalloc<bf16>(HQ * D), *gu = dalloc<bf16>(2 * I), *act = dalloc<bf16>(I);
  float *pm = dalloc<float>(HQ * nsplit), *pl = dalloc<float>(HQ * nsplit), *pa = dalloc<float>((size_t)HQ * nsplit * D);
  unsigned *cnt = dalloc<unsigned>(HKV), *bar = dalloc<unsigned>(2);
  long long* clocks = nullptr;  // set for one timed run below

  auto attn_kernel = D == 64 ? fl_attn_bf16_d64 : fl_attn_bf16_d128;
  bool g4 = G <= 4;
  auto layer_kernel = D == 64 ? (g4 ? fl_decode_layer_d64_g4 : fl_decode_layer_d64_g8)
                              : (g4 ? fl_decode_layer_d128_g4 : fl_decode_layer_d128_g8);
  size_t attn_smem = D == 64 ? (g4 ? sizeof(AttnShared<64, 4>) : sizeof(AttnShared<64, 8>))
                             : (g4 ? sizeof(AttnShared<128, 4>) : sizeof(AttnShared<128, 8>));
  size_t layer_smem = std::max<size_t>((size_t)std::max(H, std::max(HQ * D, I)) * 2, LAYER_GROUPS * attn_smem);
  CK(cudaFuncSetAttribute(layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)layer_smem));
  const bool coop = getenv("NO_COOP") == nullptr;

  // The separate kernels, one layer: x -> y.
  auto separate = [&](cudaStream_t st, const Layer& y, const bf16* x, bf16* out) {
    fl_gemv_fused_bf16<<<(NQKV + 7) / 8, 256, H * 2, st>>>(x, nullptr, y.n1, eps, 1, y.wqkv, nullptr, qkv, NQKV, H);
    attn_kernel<<<dim3(HKV, nsplit), ATTN_THREADS, 0, st>>>(qkv, y.kc, y.vc, cos_t, sin_t, pos, 0, G, (long)cap * D, 0,
                                                            cap, 0, scale, 0.f, 0, pm, pl, pa, qkv + HQ * D,
                                                            qkv + (HQ + HKV) * D, cnt, attn);
    fl_gemv_fused_bf16<<<(H + 7) / 8, 256, HQ * D * 2, st>>>(attn, nullptr, nullptr, 0.f, 0, y.wo, x, xm, H, HQ * D);
    fl_gemv_fused_bf16<<<(2 * I + 7) / 8, 256, H * 2, st>>>(xm, nullptr, y.n2, eps, 1, y.wgu, nullptr, gu, 2 * I, H);
    fl_gemv_fused_bf16<<<(H + 7) / 8, 256, I * 2, st>>>(gu, gu + I, nullptr, 0.f, 2, y.wdown, xm, out, H, I);
  };
  auto fused = [&](cudaStream_t st, const Layer& y, const bf16* x, bf16* out) {
    DecodeLayer a{x, xm, out, y.n1, y.n2, eps, H, y.wqkv, qkv, NQKV, y.kc, y.vc, (long)cap * D, cap, nsplit,
                  cos_t, sin_t, 0, pos, HQ, HKV, scale, 0, 0.f, pm, pl, pa, cnt, attn, y.wo, y.wgu, I, act, y.wdown,
                  bar, clocks};
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(sms);
    cfg.blockDim = dim3(LAYER_THREADS);
    cfg.dynamicSmemBytes = layer_smem;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeCooperative;
    at[0].val.cooperative = 1;
    cfg.attrs = at;
    cfg.numAttrs = coop ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, layer_kernel, a));
  };
  // L layers from x0; returns the final buffer.
  auto step = [&](cudaStream_t st, bool use_fused) -> bf16* {
    const bf16* x = x0;
    bf16* out = xa;
    for (int l = 0; l < L; l++) {
      if (use_fused) fused(st, layers2[l], x, out);
      else separate(st, layers[l], x, out);
      x = out;
      out = out == xa ? xb : xa;
    }
    return const_cast<bf16*>(x);
  };

  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  // Correctness: one step each.
  std::vector<uint16_t> r1(H), r2(H);
  bf16* o1 = step(st, false);
  CK(cudaStreamSynchronize(st));
  CK(cudaMemcpy(r1.data(), o1, H * 2, cudaMemcpyDeviceToHost));
  bf16* o2 = step(st, true);
  CK(cudaStreamSynchronize(st));
  CK(cudaMemcpy(r2.data(), o2, H * 2, cudaMemcpyDeviceToHost));
  int diff = 0;
  for (int i = 0; i < H; i++) diff += r1[i] != r2[i];
  int kv_diff = 0;
  for (int l = 0; l < L; l++) {
    std::vector<uint16_t> a(D), b(D);
    for (int h = 0; h < HKV; h++)
      for (int which = 0; which < 2; which++) {
        size_t off = ((size_t)h * cap + CTX) * D;
        CK(cudaMemcpy(a.data(), (which ? layers[l].vc : layers[l].kc) + off, D * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), (which ? layers2[l].vc : layers2[l].kc) + off, D * 2, cudaMemcpyDeviceToHost));
        kv_diff += memcmp(a.data(), b.data(), D * 2) != 0;
      }
  }
  auto f = [](uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
  };
  printf("check: %d of %d outputs differ, %d of %d appended cache rows differ (x[0..3] %g %g %g / %g %g %g)\n", diff, H,
         kv_diff, L * HKV * 2, f(r1[0]), f(r1[1]), f(r1[2]), f(r2[0]), f(r2[1]), f(r2[2]));

  // Timing: each variant captured once, replayed; rounds alternate.
  // Variant 2: the separate attention kernel alone, once per layer (its share of variant 0).
  auto attention_only = [&](cudaStream_t st) {
    for (int l = 0; l < L; l++)
      attn_kernel<<<dim3(HKV, nsplit), ATTN_THREADS, 0, st>>>(qkv, layers[l].kc, layers[l].vc, cos_t, sin_t, pos, 0, G,
                                                              (long)cap * D, 0, cap, 0, scale, 0.f, 0, pm, pl, pa,
                                                              qkv + HQ * D, qkv + (HQ + HKV) * D, cnt, attn);
  };
  const int NV = 3;
  cudaGraphExec_t ex[NV];
  for (int v = 0; v < NV; v++) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    if (v == 2) attention_only(st);
    else step(st, v == 1);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ex[v], g, 0));
  }
  double bytes = (double)L * 2 * ((double)NQKV * H + (double)H * HQ * D + 3.0 * I * H + 2.0 * HKV * CTX * D);
  std::vector<float> t[NV];
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int reps = 50;
  for (int round = 0; round < 5; round++)
    for (int v = 0; v < NV; v++) {
      CK(cudaGraphLaunch(ex[v], st));
      CK(cudaEventRecord(e0, st));
      for (int r = 0; r < reps; r++) CK(cudaGraphLaunch(ex[v], st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t[v].push_back(ms * 1000.f / reps);
    }
  // Phase marks of one eager step of the last layer: mean and max over blocks of each interval.
  size_t nitems = (size_t)HKV * nsplit;
  CK(cudaMalloc(&clocks, ((size_t)sms * LAYER_MARKS + nitems * 4) * 8));
  step(st, true);
  CK(cudaStreamSynchronize(st));
  std::vector<long long> ck((size_t)sms * LAYER_MARKS + nitems * 4);
  CK(cudaMemcpy(ck.data(), clocks, ck.size() * 8, cudaMemcpyDeviceToHost));
  int khz;
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  const char* marks[LAYER_MARKS - 1] = {"norm+qkv", "barrier 1", "attention", "prefetch+barrier 2", "o", "prefetch+barrier 3",
                                        "gate|up", "prefetch+barrier 4", "down"};
  printf("phases of the last layer (us, SM clock %d MHz): ", khz / 1000);
  for (int k = 0; k + 1 < LAYER_MARKS; k++) {
    double sum = 0, mx = 0;
    for (int b = 0; b < sms; b++) {
      double us = (ck[(size_t)b * LAYER_MARKS + k + 1] - ck[(size_t)b * LAYER_MARKS + k]) / (khz / 1000.0);
      sum += us;
      mx = std::max(mx, us);
    }
    printf("%s %.2f/%.2f  ", marks[k], sum / sms, mx);
  }
  printf("\n");
  // Attention items of the last layer: cycles from the group's start to its end, by kind.
  {
    double sum[4] = {0, 0, 0, 0}, mx[4] = {0, 0, 0, 0};
    int n[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < nitems; i++) {
      const long long* g = &ck[(size_t)sms * LAYER_MARKS + i * 4];
      int kind = g[1] ? (g[2] ? 3 : 1) : (g[2] ? 2 : 0);
      double us = g[0] / (khz / 1000.0);
      sum[kind] += us;
      mx[kind] = std::max(mx[kind], us);
      n[kind]++;
    }
    const char* kinds[4] = {"plain", "merging", "appending", "appending+merging"};
    printf("attention items (us mean/max, count): ");
    for (int k = 0; k < 4; k++)
      if (n[k]) printf("%s %.2f/%.2f (%d)  ", kinds[k], sum[k] / n[k], mx[k], n[k]);
    printf("\n");
  }
  const char* name[NV] = {"separate kernels", "decode-layer kernel", "attention kernel only"};
  for (int v = 0; v < NV; v++) {
    std::sort(t[v].begin(), t[v].end());
    float med = t[v][t[v].size() / 2];
    printf("%-20s %8.1f us per step (%5.1f per layer), %6.0f GB/s over %.0f MB\n", name[v], med, med / L,
           bytes / (med * 1e3), bytes / 1e6);
  }
  return 0;
}
