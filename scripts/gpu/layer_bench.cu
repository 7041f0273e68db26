// Side-by-side timing of one decode step's layers on random bf16 weights in a real shape, for L
// layers, each variant captured in a CUDA graph and replayed, rounds alternating: the five
// separate kernels per layer (norm+QKV, attention, O, norm+gate|up, silu·up+down) with the
// register-fed (fl_gemv_fused) or bulk-copy (fl_gemv_tma*) products, with and without
// programmatic dependent launch (PDL) and the SwiGLU epilogue; the decode-layer kernel
// (fl_decode_layer_d*); each product and the attention alone; a plain read of the weights.
// Checks first that every variant's output (final residual stream, appended cache rows) is
// bit-identical to the first. Built here with nvcc (scripts/gpu/build_layer_bench.sh; with
// EXTRA=-DFL_TIMELINE it also prints a per-kernel timeline of the best variants: how early each
// kernel's blocks started, the gap to the release of its wait, its input staging, and the rest),
// run on the GPU machine:
//   layer_bench [hidden hq hkv D inter layers context]   (default: the Llama-3.2-1B shape)
#include "../../crates/backend/src/cuda/kernels.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "check.cuh"

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

// Reads n uint4 with ordinary loads; the xor lands in *sink only on an impossible value.
__global__ void touch_bytes(const uint4* p, size_t n, unsigned* sink) {
  unsigned s = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v = __ldcs(p + i);
    s ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (s == 0x9e3779b9u) *sink = s;
}

// Launches through cudaLaunchKernelEx, with programmatic dependent launch when g_pdl is set.
static bool g_pdl = false;
static int g_tma_ns = 0, g_tma_bps = 1;  // see `gemv`
static bool g_swiglu = false;            // TMA gate|up with the SwiGLU epilogue, plain down
static int g_qkv_bps = 0;                // > 0: the QKV product's own TMA blocks per SM
static bool g_no_merge = false;          // timing only: attention without its split merge
static bool g_fit_stages = false;        // TMA blocks get only the stage buffers their rows need
// A cooperative launch (all blocks resident: the decode-layer kernel's grid barriers) when coop.
template <typename... P, typename... A>
void launch_ex(bool coop, void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute at[2];
  int n = 0;
  if (g_pdl) {
    at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (coop) {
    at[n].id = cudaLaunchAttributeCooperative;
    at[n++].val.cooperative = 1;
  }
  cfg.attrs = at;
  cfg.numAttrs = n;
  CK(cudaLaunchKernelEx(&cfg, k, (P)args...));
}
template <typename... P, typename... A>
void launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, A... args) {
  launch_ex(false, k, grid, block, smem, st, args...);
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
  // Counters that never reach the last split: the attention kernel then skips its merge (its
  // output is left stale; for timing the merge's share only).
  unsigned* cnt_never = dalloc<unsigned>(HKV);
  {
    std::vector<unsigned> big(HKV, 1u << 30);
    CK(cudaMemcpy(cnt_never, big.data(), HKV * 4, cudaMemcpyHostToDevice));
  }
  long long* clocks = nullptr;  // set for one timed run below

  auto attn_kernel = G <= 4 ? (D == 64 ? fl_attn_bf16_d64_g4 : fl_attn_bf16_d128_g4) : (D == 64 ? fl_attn_bf16_d64 : fl_attn_bf16_d128);
  bool g4 = G <= 4;
  auto layer_kernel = D == 64 ? (g4 ? fl_decode_layer_d64_g4 : fl_decode_layer_d64_g8)
                              : (g4 ? fl_decode_layer_d128_g4 : fl_decode_layer_d128_g8);
  size_t attn_smem = D == 64 ? (g4 ? sizeof(AttnShared<64, 4>) : sizeof(AttnShared<64, 8>))
                             : (g4 ? sizeof(AttnShared<128, 4>) : sizeof(AttnShared<128, 8>));
  size_t layer_smem = std::max<size_t>((size_t)std::max(H, std::max(HQ * D, I)) * 2, LAYER_GROUPS * attn_smem);
  CK(cudaFuncSetAttribute(layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)layer_smem));
  const bool coop = getenv("NO_COOP") == nullptr;

  // The separate kernels, one layer: x -> y. The products are fl_gemv_fused_bf16, or with
  // g_tma_ns > 0 fl_gemv_tma<g_tma_ns>_bf16 on g_tma_bps blocks per SM (at most one per 8 rows).
  for (auto f : {fl_gemv_tma2_bf16, fl_gemv_tma3_bf16})
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
  auto gemv = [&](cudaStream_t st, const bf16* a, const bf16* a2, const float* nw, int pro, const bf16* w, const bf16* res,
                  bf16* out, int n, int k) {
    if (g_tma_ns > 0) {
      int blocks = std::min((n + 7) / 8, g_tma_bps * sms);
      auto f = g_tma_ns == 2 ? fl_gemv_tma2_bf16 : fl_gemv_tma3_bf16;
      int stages = g_tma_ns;
      if (g_fit_stages) stages = std::min(stages, ((n + blocks - 1) / blocks + 7) / 8 * ((k / 8 + GEMV_BATCH - 1) / GEMV_BATCH));
      launch(f, blocks, 256, (size_t)stages * 8 * GEMV_BATCH * 16 + k * 2, st, a, a2, nw, eps, pro, w, res, out, n, k, 0, nullptr, nullptr, nullptr, nullptr);
    } else {
      launch(fl_gemv_fused_bf16, (n + 7) / 8, 256, k * 2, st, a, a2, nw, eps, pro, w, res, out, n, k);
    }
  };
  auto separate = [&](cudaStream_t st, const Layer& y, const bf16* x, bf16* out) {
    int bps = g_tma_bps;
    if (g_qkv_bps > 0) g_tma_bps = g_qkv_bps;
    gemv(st, x, nullptr, y.n1, 1, y.wqkv, nullptr, qkv, NQKV, H);
    g_tma_bps = bps;
    launch(attn_kernel, dim3(HKV, nsplit), ATTN_THREADS, 0, st, qkv, y.kc, y.vc, cos_t, sin_t, pos, 0u, G, (long)cap * D, 0,
           cap, 0, scale, 0.f, 0, pm, pl, pa, qkv + HQ * D, qkv + (HQ + HKV) * D, g_no_merge ? cnt_never : cnt, attn);
    gemv(st, attn, nullptr, nullptr, 0, y.wo, x, xm, H, HQ * D);
    if (g_swiglu && g_tma_ns > 0) {
      int blocks = std::min(I / 4, g_tma_bps * sms);
      auto f = g_tma_ns == 2 ? fl_gemv_tma2_bf16 : fl_gemv_tma3_bf16;
      launch(f, blocks, 256, (size_t)g_tma_ns * 8 * GEMV_BATCH * 16 + H * 2, st, (const bf16*)xm, (const bf16*)nullptr,
             (const float*)y.n2, eps, 1, (const bf16*)y.wgu, (const bf16*)nullptr, act, 2 * I, H, 1, nullptr, nullptr,
             nullptr, nullptr);
      gemv(st, act, nullptr, nullptr, 0, y.wdown, xm, out, H, I);
    } else {
      gemv(st, xm, nullptr, y.n2, 1, y.wgu, nullptr, gu, 2 * I, H);
      gemv(st, gu, gu + I, nullptr, 2, y.wdown, xm, out, H, I);
    }
  };
  auto fused = [&](cudaStream_t st, const Layer& y, const bf16* x, bf16* out) {
    DecodeLayer a{x, xm, out, y.n1, y.n2, eps, H, y.wqkv, qkv, NQKV, y.kc, y.vc, (long)cap * D, cap, nsplit,
                  cos_t, sin_t, 0, pos, HQ, HKV, scale, 0, 0.f, pm, pl, pa, cnt, attn, y.wo, y.wgu, I, act, y.wdown,
                  bar, clocks};
    launch_ex(coop, layer_kernel, dim3(sms), dim3(LAYER_THREADS), layer_smem, st, a);
  };
  // L layers from x0; returns the final buffer. variant < 0: the decode-layer kernel; else the
  // separate kernels, variant = 2 * (16 * TMA stages + TMA blocks per SM; 0: fl_gemv_fused) + PDL.
  auto step = [&](cudaStream_t st, int variant) -> bf16* {
    g_pdl = variant >= 0 && variant % 2 == 1;
    g_tma_ns = variant >= 0 ? variant / 2 / 16 % 4 : 0;
    g_tma_bps = variant >= 0 ? std::max(1, variant / 2 % 16) : 1;
    g_swiglu = variant >= 0 && variant / 2 / 64 == 1;
    const bf16* x = x0;
    bf16* out = xa;
    for (int l = 0; l < L; l++) {
      if (variant < 0) fused(st, layers2[l], x, out);
      else separate(st, layers[l], x, out);
      x = out;
      out = out == xa ? xb : xa;
    }
    g_pdl = false;
    g_tma_ns = 0;
    g_swiglu = false;
    return const_cast<bf16*>(x);
  };
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  // Correctness: one step each.
  std::vector<uint16_t> r1(H), r2(H);
  int l2;
  CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  printf("L2 %d MB\n", l2 >> 20);
  bf16* o1 = step(st, 0);
  CK(cudaStreamSynchronize(st));
  CK(cudaMemcpy(r1.data(), o1, H * 2, cudaMemcpyDeviceToHost));
  bf16* o2 = step(st, -1);
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

  // Programmatic dependent launch and the TMA products give the same outputs.
  // variant = 2 * (64 * swiglu + 16 * TMA stages + TMA blocks per SM) + PDL.
  auto code = [](int ns, int bps, int pdl, int sw = 0) { return 2 * (64 * sw + 16 * ns + bps) + pdl; };
  const int tma_configs[][2] = {{2, 2}, {2, 3}};
  std::vector<int> separate_variants = {0, 1};
  for (auto& c : tma_configs)
    for (int pdl = 0; pdl < 2; pdl++) separate_variants.push_back(code(c[0], c[1], pdl));
  for (auto& c : tma_configs) separate_variants.push_back(code(c[0], c[1], 1, 1));
  auto variant_name = [](int v) {
    char name[80];
    int ns = v / 2 / 16 % 4, bps = v / 2 % 16, sw = v / 2 / 64;
    if (ns == 0) snprintf(name, sizeof name, "separate kernels%s", v % 2 ? " with PDL" : "");
    else snprintf(name, sizeof name, "separate, TMA %d stages %d/SM%s%s", ns, bps, sw ? " swiglu" : "", v % 2 ? " with PDL" : "");
    return std::string(name);
  };
  for (int v : separate_variants) {
    std::vector<uint16_t> r3(H);
    bf16* o3 = step(st, v);
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(r3.data(), o3, H * 2, cudaMemcpyDeviceToHost));
    int d3 = 0;
    for (int i = 0; i < H; i++) d3 += r1[i] != r3[i];
    printf("check: %s: %d of %d outputs differ\n", variant_name(v).c_str(), d3, H);
  }
  // Timing: each variant captured once, replayed; rounds alternate. Besides the whole layers,
  // each kernel of the separate variant alone (once per layer, on that layer's weights), a plain
  // streaming read of the same weight bytes, and the separate kernels' variants.
  auto each_layer = [&](auto f) { return [&, f](cudaStream_t st) { for (int l = 0; l < L; l++) f(st, layers[l]); }; };
  unsigned* sink = dalloc<unsigned>(1);
  struct Variant {
    std::string name;
    std::function<void(cudaStream_t)> run;
  };
  std::vector<Variant> variants = {
      {"decode-layer kernel", [&](cudaStream_t st) { step(st, -1); }},
      {"attention kernel only", each_layer([&](cudaStream_t st, const Layer& y) {
         attn_kernel<<<dim3(HKV, nsplit), ATTN_THREADS, 0, st>>>(qkv, y.kc, y.vc, cos_t, sin_t, pos, 0, G, (long)cap * D,
                                                                 0, cap, 0, scale, 0.f, 0, pm, pl, pa, qkv + HQ * D,
                                                                 qkv + (HQ + HKV) * D, cnt, attn);
       })},
      {"plain read of the weights", each_layer([&](cudaStream_t st, const Layer& y) {
         touch_bytes<<<1056, 512, 0, st>>>((const uint4*)y.wqkv, (size_t)NQKV * H / 8, sink);
         touch_bytes<<<1056, 512, 0, st>>>((const uint4*)y.wo, (size_t)H * HQ * D / 8, sink);
         touch_bytes<<<1056, 512, 0, st>>>((const uint4*)y.wgu, (size_t)2 * I * H / 8, sink);
         touch_bytes<<<1056, 512, 0, st>>>((const uint4*)y.wdown, (size_t)H * I / 8, sink);
       })},
  };
  for (int v : separate_variants) variants.push_back({variant_name(v), [&, v](cudaStream_t st) { step(st, v); }});
  // The best of them with the QKV product on fewer blocks per SM (room for the attention blocks
  // that programmatic dependent launch starts early), and without the attention's merge.
  for (int qb : {1, 2}) {
    char name[80];
    snprintf(name, sizeof name, "%s, qkv %d/SM", variant_name(code(2, 3, 1, 1)).c_str(), qb);
    variants.push_back({name, [&, qb](cudaStream_t st) {
                          g_qkv_bps = qb;
                          step(st, code(2, 3, 1, 1));
                          g_qkv_bps = 0;
                        }});
  }
  variants.push_back({variant_name(code(2, 3, 1, 1)) + ", stage buffers fitted", [&](cudaStream_t st) {
                        g_fit_stages = true;
                        step(st, code(2, 3, 1, 1));
                        g_fit_stages = false;
                      }});
  variants.push_back({variant_name(code(2, 3, 1, 1)) + ", attention without merge (timing only)", [&](cudaStream_t st) {
                        g_no_merge = true;
                        step(st, code(2, 3, 1, 1));
                        g_no_merge = false;
                      }});
  // Each product alone, fused (ns 0) and by TMA.
  const int alone_configs[][2] = {{0, 0}, {2, 2}, {2, 3}};
  for (auto& c : alone_configs) {
    int ns = c[0], bps = c[1];
    auto alone = [&, ns, bps](const char* what, auto f) {
      char name[64];
      if (ns) snprintf(name, sizeof name, "%s only, TMA %d stages %d/SM", what, ns, bps);
      else snprintf(name, sizeof name, "%s only, fused", what);
      variants.push_back({name, [&, ns, bps, f](cudaStream_t st) {
                            g_tma_ns = ns;
                            g_tma_bps = bps;
                            for (int l = 0; l < L; l++) f(st, layers[l]);
                            g_tma_ns = 0;
                          }});
    };
    alone("norm+qkv", [&](cudaStream_t st, const Layer& y) { gemv(st, x0, nullptr, y.n1, 1, y.wqkv, nullptr, qkv, NQKV, H); });
    alone("o", [&](cudaStream_t st, const Layer& y) { gemv(st, attn, nullptr, nullptr, 0, y.wo, x0, xm, H, HQ * D); });
    alone("gate|up", [&](cudaStream_t st, const Layer& y) { gemv(st, xm, nullptr, y.n2, 1, y.wgu, nullptr, gu, 2 * I, H); });
    alone("down", [&](cudaStream_t st, const Layer& y) { gemv(st, gu, gu + I, nullptr, 2, y.wdown, xm, xa, H, I); });
  }
  const int NV = (int)variants.size();
  std::vector<cudaGraphExec_t> ex(NV);
  for (int v = 0; v < NV; v++) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    variants[v].run(st);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ex[v], g, 0));
  }
  double bytes = (double)L * 2 * ((double)NQKV * H + (double)H * HQ * D + 3.0 * I * H + 2.0 * HKV * CTX * D);
  std::vector<std::vector<float>> t(NV);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int reps = 50;
  for (int round = 0; round < 7; round++)
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
#ifdef FL_TIMELINE
  // Timeline of one replay of each of these separate-kernel variants (graph, after warm-up):
  // per kernel of a layer (mean over the middle layers, µs), when its first block started
  // before the previous kernel's last block ended ("early"), the gap from that end to the wait's
  // release ("gap"), the input staging after the release, and the release-to-last-block-end time.
  for (int v : {code(2, 3, 1), code(2, 3, 1, 1), code(2, 2, 1, 1)}) {
    int vi = -1;
    for (int i = 0; i < NV; i++)
      if (variants[i].name == variant_name(v)) vi = i;
    if (vi < 0) continue;
    const unsigned cap_rec = 1 << 20;
    TlRecord* buf;
    CK(cudaMalloc(&buf, cap_rec * sizeof(TlRecord)));
    unsigned zero = 0;
    CK(cudaMemcpyToSymbol(fl_tl_buf, &buf, sizeof buf));
    CK(cudaMemcpyToSymbol(fl_tl_cap, &cap_rec, 4));
    CK(cudaMemcpyToSymbol(fl_tl_count, &zero, 4));
    CK(cudaGraphLaunch(ex[vi], st));
    CK(cudaStreamSynchronize(st));
    TlRecord* none = nullptr;
    CK(cudaMemcpyToSymbol(fl_tl_buf, &none, sizeof none));
    unsigned n;
    CK(cudaMemcpyFromSymbol(&n, fl_tl_count, 4));
    n = std::min(n, cap_rec);
    std::vector<TlRecord> r(n);
    CK(cudaMemcpy(r.data(), buf, n * sizeof(TlRecord), cudaMemcpyDeviceToHost));
    CK(cudaFree(buf));
    std::sort(r.begin(), r.end(), [](const TlRecord& a, const TlRecord& b) { return a.t[1] < b.t[1]; });
    struct Inst {
      int kind, n, k;
      unsigned long long start = ~0ull, rel = ~0ull, end = 0;
      std::vector<double> staging;
    };
    std::vector<Inst> in;
    for (auto& x : r) {
      if (in.empty() || in.back().kind != x.kind || in.back().n != x.n || in.back().k != x.k)
        in.push_back(Inst{x.kind, x.n, x.k});
      Inst& c = in.back();
      c.start = std::min(c.start, x.t[0]);
      c.rel = std::min(c.rel, x.t[1]);
      c.end = std::max(c.end, x.t[3]);
      c.staging.push_back((x.t[2] - x.t[1]) / 1e3);
    }
    printf("timeline of '%s': %u records, %zu kernels (expect %d)\n", variant_name(v).c_str(), n, in.size(), 5 * L);
    if ((int)in.size() != 5 * L) continue;
    const char* kn[5] = {"norm+qkv", "attention", "o+residual", "norm+gate|up", "silu+down+res"};
    double sum_all = 0;
    for (int j = 0; j < 5; j++) {
      double early = 0, gap = 0, stg = 0, body = 0;
      int cnt = 0;
      for (int l = 1; l < L - 1; l++) {
        Inst& c = in[5 * l + j];
        Inst& p = in[5 * l + j - 1];
        early += ((double)p.end - (double)c.start) / 1e3;
        gap += ((double)c.rel - (double)p.end) / 1e3;
        std::sort(c.staging.begin(), c.staging.end());
        stg += c.staging[c.staging.size() / 2];
        body += ((double)c.end - (double)c.rel) / 1e3;
        cnt++;
      }
      printf("  %-14s early %6.2f  gap %5.2f  staging %5.2f  release->end %6.2f\n", kn[j], early / cnt, gap / cnt,
             stg / cnt, body / cnt);
      sum_all += (gap + body) / cnt;
    }
    printf("  sum of gap + release->end per layer: %.2f us\n", sum_all);
  }
#endif
  // Phase marks of one eager step of the last layer: mean and max over blocks of each interval.
  size_t nitems = (size_t)HKV * nsplit;
  CK(cudaMalloc(&clocks, ((size_t)sms * LAYER_MARKS + nitems * 4) * 8));
  step(st, -1);
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
  for (int v = 0; v < NV; v++) {
    const char* name = variants[v].name.c_str();
    std::sort(t[v].begin(), t[v].end());
    float med = t[v][t[v].size() / 2];
    printf("%-36s %8.1f us per step (%5.1f per layer), %6.0f GB/s over %.0f MB\n", name, med, med / L,
           bytes / (med * 1e3), bytes / 1e6);
  }
  return 0;
}
