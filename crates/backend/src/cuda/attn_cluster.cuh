// ---------------------------------------------------------------------------------------------
// Decode attention with the split merge inside a thread-block cluster (Hopper), included by
// kernels.cu after gemv_tma.cuh. EXPERIMENTAL: timed in scripts/gpu/layer_bench.cu, not yet
// launched by the engine.
//
// fl_attn_* merges a kv head's splits in the last of its blocks to finish: a fence, a global
// counter and the partials read back from L2, three dependent round trips after the slowest
// chunk (3.6 us of the 1B layer's 47 us). Here kv head h is one cluster of C blocks (grid (C,
// hkv), cluster (C, 1, 1)) of GROUPS groups of ATTN_THREADS threads; group j of block r takes
// chunk r·GROUPS + j (attn_chunk, unchanged). Each block folds its groups' partials in shared
// memory; block 0 then folds the C blocks' through distributed shared memory and writes out.
// C·GROUPS must cover the buffer's chunks (s_max / ATTN_CHUNK); the caller checks.
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The float at the same shared-memory offset as p in block `rank` of this cluster.
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
  unsigned a = smem_addr(p), r;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
  return v;
}
// (M, L, A) <- the online-softmax combination with (m, l, a); -inf maxima carry no keys.
__device__ __forceinline__ void fold_split(float& M, float& L, float& A, float m, float l, float a) {
  if (m == -INFINITY) return;
  float nm = fmaxf(M, m);
  float s1 = M == -INFINITY ? 0.f : __expf(M - nm), s2 = __expf(m - nm);
  A = A * s1 + a * s2;
  L = L * s1 + l * s2;
  M = nm;
}

#define CLUSTER_MAX 8
template <typename T, int D, int MG>
__device__ void attn_cluster(const T* q, T* kc, T* vc, const float* cos_t, const float* sin_t, const unsigned* pos_ptr,
                             unsigned pos_host, int G, long head_stride, int key_start, int s_max, int window,
                             float scale, float softcap, int interleaved, const T* k_new, const T* v_new, T* out) {
  TL_DECL
  extern __shared__ __align__(16) unsigned char cluster_smem[];
  int groups = blockDim.x / ATTN_THREADS, grp = threadIdx.x / ATTN_THREADS;
  auto* S = reinterpret_cast<AttnShared<D, MG>*>(cluster_smem);
  float* pm = reinterpret_cast<float*>(S + groups);  // [groups][MG]
  float* pl = pm + groups * MG;                       // [groups][MG]
  float* pa = pl + groups * MG;                       // [groups][MG][D]
  float* bm = pa + groups * MG * D;                   // this block's fold: [MG], [MG], [MG][D]
  float* bl = bm + MG;
  float* ba = bl + MG;
  int h = blockIdx.y, rank = blockIdx.x, C = gridDim.x;
  long qpos = (long)read_pos(pos_ptr, pos_host);
  attn_chunk<T, D, MG>(q, kc, vc, cos_t, sin_t, qpos, G, head_stride, key_start, s_max, window, scale, softcap,
                       interleaved, k_new, v_new, SplitOut{pm + grp * MG, pl + grp * MG, pa + grp * MG * D, 0, 1}, h,
                       rank * groups + grp, AttnGroup{(int)threadIdx.x % ATTN_THREADS, groups > 1 ? grp + 1 : 0}, S[grp],
                       [&] {
                         pdl_prologue();
                         TL_MARK(1)
                         TL_MARK(2)
                       });
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    int g = i / D, d = i % D;
    float M = -INFINITY, L = 0.f, A = 0.f;
    for (int j = 0; j < groups; j++) fold_split(M, L, A, pm[j * MG + g], pl[j * MG + g], pa[(j * MG + g) * D + d]);
    ba[g * D + d] = A;
    if (d == 0) bm[g] = M, bl[g] = L;
  }
  cluster_sync_all();  // every block's fold is in its shared memory
  if (rank == 0) {
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
      int g = i / D, d = i % D;
      float m[CLUSTER_MAX], l[CLUSTER_MAX], a[CLUSTER_MAX];
#pragma unroll
      for (int r = 0; r < CLUSTER_MAX; r++)
        if (r < C) m[r] = ld_cluster(bm + g, r), l[r] = ld_cluster(bl + g, r), a[r] = ld_cluster(ba + g * D + d, r);
      float M = -INFINITY, L = 0.f, A = 0.f;
#pragma unroll
      for (int r = 0; r < CLUSTER_MAX; r++)
        if (r < C) fold_split(M, L, A, m[r], l[r], a[r]);
      out[(size_t)(h * G + g) * D + d] = from_f<T>(L > 0.f ? A / L : 0.f);
    }
  }
  cluster_sync_all();  // block 0 has read every block's shared memory before any exits
  TL_END(3, G, D)
}

// Dynamic shared memory: GROUPS · sizeof(AttnShared<D, MG>) + (GROUPS + 1) · MG · (D + 2) · 4.
#define ATTN_CLUSTER_INSTANCE(T, NAME, D, MG)                                                                   \
  extern "C" __global__ void __launch_bounds__(5 * ATTN_THREADS) fl_attn_cluster_##NAME##_d##D##_g##MG(        \
      const T* q, T* kc, T* vc, const float* c, const float* s, const unsigned* pp, unsigned ph, int G, long hs, \
      int ks, int smax, int win, float scale, float cap, int inter, const T* kn, const T* vn, T* out) {          \
    attn_cluster<T, D, MG>(q, kc, vc, c, s, pp, ph, G, hs, ks, smax, win, scale, cap, inter, kn, vn, out);       \
  }
ATTN_CLUSTER_INSTANCE(bf16, bf16, 64, 4)
ATTN_CLUSTER_INSTANCE(bf16, bf16, 128, 4)
