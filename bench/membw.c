// Read bandwidth of this machine, the CPU decode roofline: T threads each stream their share of
// a buffer much larger than the caches (sum of 64-byte vector loads, so nothing is written), best
// of R passes. Decode of a bandwidth-bound model cannot beat (weight + KV bytes) / this.
//   gcc -O3 -march=native -fopenmp bench/membw.c -o /tmp/membw && /tmp/membw [threads] [MiB]
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

int main(int argc, char** argv) {
  int threads = argc > 1 ? atoi(argv[1]) : omp_get_num_procs();
  size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 512;
  size_t n = mib << 20;
  // FERROLM_MEMBW_PAGES=4k: no transparent huge pages, as for a memory-mapped model file.
  char* buf = aligned_alloc(1 << 21, n);
  const char* pages = getenv("FERROLM_MEMBW_PAGES");
  int small = pages && strcmp(pages, "4k") == 0;
  madvise(buf, n, small ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
  memset(buf, 1, n);
  double best = 0;
  volatile float sink = 0;
  for (int pass = 0; pass < 10; pass++) {
    double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
    {
      int id = omp_get_thread_num(), nt = omp_get_num_threads();
      size_t per = n / nt / 256 * 256;
      const char* p = buf + per * id;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (size_t i = 0; i < per; i += 128) {
        a0 = _mm256_add_ps(a0, _mm256_load_ps((const float*)(p + i)));
        a1 = _mm256_add_ps(a1, _mm256_load_ps((const float*)(p + i + 32)));
        a2 = _mm256_add_ps(a2, _mm256_load_ps((const float*)(p + i + 64)));
        a3 = _mm256_add_ps(a3, _mm256_load_ps((const float*)(p + i + 96)));
      }
      __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
      float out[8];
      _mm256_storeu_ps(out, s);
      sink += out[0];
    }
    double gbs = n / (omp_get_wtime() - t0) / 1e9;
    if (gbs > best) best = gbs;
  }
  printf("threads %d buffer %zu MiB pages %s read %.1f GB/s (best of 10)\n", threads, mib, small ? "4k" : "huge", best);
  return 0;
}
