/* The selective scan as one fused loop for the CPU (lesson 06). Compiled and loaded at run time by
 * lib/kernels/scan_cpu.py, which is its only caller and documents it; see that file.
 *
 * The same computation as lib.ssm.selective_scan_ref, per sequence b, channel d and state entry n:
 *     h_t = exp(dt_t * A) * h_{t-1} + (dt_t * x_t) * B_t        y_t = sum_n C_t[n] * h_t[n]
 * but the state of a block of channels stays in a small buffer (in the L1 cache) for the whole
 * sequence, so no (B, L, D, N) tensor is ever written: Δ, x, B, C are read once and y written once.
 * That is the fused GPU kernel's idea (lib/kernels/scan.py), with the cache standing in for SRAM.
 *
 * Layout: every array is contiguous. x, dt, y (B, L, D); A (D, N); Bm, Cm (B, L, N); h0, hl
 * (B, D, N) or NULL (no initial state: zeros; no final state wanted). One call computes the "rows"
 * (b, d) with row_begin <= b * D + d < row_end; the Python side gives each thread its own range.
 * A row's result depends only on the row (the state buffer is aligned the same way for every
 * range), so the output is bit-for-bit the same whatever the number of threads.
 *
 * Threads: compiled with -fopenmp, the *_omp entry points split the rows between `threads` OpenMP
 * threads. The shared library then needs libgomp.so.1, which the dynamic loader resolves to the
 * copy PyTorch has already loaded, so the scan runs on PyTorch's own thread pool (a second pool
 * would fight PyTorch's threads, which spin for a while after each parallel operation). Without
 * OpenMP the Python side calls the row-range entry points from its own threads.
 *
 * The inner loop over n is vectorised (`omp simd`, needing only -fopenmp-simd, no OpenMP
 * runtime). With ONEMASK_LIBMVEC defined (x86-64 Linux with AVX2: the Python side decides),
 * expf/exp are declared to have glibc's vector versions, so the exponentials are computed eight
 * (four for double) at a time; without it they are scalar calls and the loop is still correct.
 *
 * Returns 0, or -1 if the state buffer could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(ONEMASK_LIBMVEC)
__attribute__((simd("notinbranch"))) float expf(float);
__attribute__((simd("notinbranch"))) double exp(double);
#endif

#define BLOCK_D 64 /* channels whose state is held at once: 64 x 16 floats = 4 KiB */
#define ALIGN 64   /* bytes: one cache line; each channel's state starts on one */

#define DEFINE_SCAN(NAME, T, EXP)                                                                   \
  int NAME(const T *x, const T *dt, const T *A, const T *Bm, const T *Cm, const T *h0, T *y, T *hl, \
           int64_t L, int64_t D, int64_t N, int64_t row_begin, int64_t row_end) {                   \
    /* each channel's state padded to a whole number of cache lines */                            \
    const int64_t stride = (N * (int64_t)sizeof(T) + ALIGN - 1) / ALIGN * ALIGN / (int64_t)sizeof(T); \
    T *h = (T *)aligned_alloc(ALIGN, sizeof(T) * BLOCK_D * stride);                                 \
    if (h == NULL) return -1;                                                                       \
    for (int64_t r = row_begin; r < row_end;) {                                                     \
      /* the next block: channels d0 .. d1-1 of sequence b, within this call's rows */              \
      const int64_t b = r / D, d0 = r % D;                                                          \
      int64_t d1 = d0 + BLOCK_D;                                                                    \
      if (d1 > D) d1 = D;                                                                           \
      if (d1 - d0 > row_end - r) d1 = d0 + (row_end - r);                                           \
      for (int64_t d = d0; d < d1; d++)                                                             \
        for (int64_t n = 0; n < N; n++) h[(d - d0) * stride + n] = h0 ? h0[(b * D + d) * N + n] : (T)0; \
      for (int64_t t = 0; t < L; t++) {                                                             \
        const int64_t pos = b * L + t;                                                              \
        const T *xt = x + pos * D, *dtt = dt + pos * D, *Bt = Bm + pos * N, *Ct = Cm + pos * N;     \
        T *yt = y + pos * D;                                                                        \
        for (int64_t d = d0; d < d1; d++) {                                                         \
          const T delta = dtt[d], u = delta * xt[d]; /* Δ_t and Δ_t x_t for channel d */            \
          const T *Ad = A + d * N;                                                                  \
          T *hd = h + (d - d0) * stride;                                                            \
          T acc = 0;                                                                                \
          _Pragma("omp simd reduction(+:acc)")                                                     \
          for (int64_t n = 0; n < N; n++) {                                                         \
            const T hn = EXP(delta * Ad[n]) * hd[n] + Bt[n] * u; /* Ā_t h + B̄_t x_t */              \
            hd[n] = hn;                                                                             \
            acc += hn * Ct[n]; /* C_t · h_t */                                                      \
          }                                                                                         \
          yt[d] = acc;                                                                              \
        }                                                                                           \
      }                                                                                             \
      if (hl)                                                                                       \
        for (int64_t d = d0; d < d1; d++)                                                           \
          for (int64_t n = 0; n < N; n++) hl[(b * D + d) * N + n] = h[(d - d0) * stride + n];      \
      r += d1 - d0;                                                                                 \
    }                                                                                               \
    free(h);                                                                                        \
    return 0;                                                                                       \
  }

DEFINE_SCAN(onemask_scan_f32, float, expf)
DEFINE_SCAN(onemask_scan_f64, double, exp)

#ifdef _OPENMP
#include <omp.h>
/* all rows 0 .. rows-1, split into equal contiguous ranges, one per thread */
#define DEFINE_SCAN_OMP(NAME, ROWS_FN, T)                                                               \
  int NAME(const T *x, const T *dt, const T *A, const T *Bm, const T *Cm, const T *h0, T *y, T *hl,     \
           int64_t L, int64_t D, int64_t N, int64_t rows, int64_t threads) {                            \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads((int)threads) reduction(|:failed)")                               \
    {                                                                                                   \
      const int64_t k = omp_get_thread_num(), m = omp_get_num_threads();                                \
      failed |= ROWS_FN(x, dt, A, Bm, Cm, h0, y, hl, L, D, N, rows * k / m, rows * (k + 1) / m);       \
    }                                                                                                   \
    return failed;                                                                                      \
  }
DEFINE_SCAN_OMP(onemask_scan_f32_omp, onemask_scan_f32, float)
DEFINE_SCAN_OMP(onemask_scan_f64_omp, onemask_scan_f64, double)
#endif
