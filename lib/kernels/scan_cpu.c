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
 * (B, D, N) or NULL (no initial state: zeros; no final state wanted); hc (B, D, ceil(L/K), N) or
 * NULL: with it, the state entering every K-th position (k·K, k = 0, 1, ...) is kept there, the
 * checkpoints the backward (below) restarts from. One call computes the "rows"
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

#define SCAN_ARGS(T) const T *x, const T *dt, const T *A, const T *Bm, const T *Cm, const T *h0, T *y, T *hl, \
                     T *hc, int64_t K, int64_t L, int64_t D, int64_t N, int64_t row_begin, int64_t row_end
#define DEFINE_SCAN(NAME, T, EXP, NN)                                                                   \
  static int NAME(SCAN_ARGS(T)) {                                                                 \
    const int64_t nseg = (L + K - 1) / K; /* checkpoints per row */                                 \
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
        for (int64_t n = 0; n < NN; n++) h[(d - d0) * stride + n] = h0 ? h0[(b * D + d) * N + n] : (T)0; \
      for (int64_t t = 0; t < L; t++) {                                                             \
        const int64_t pos = b * L + t;                                                              \
        if (hc && t % K == 0) /* the state entering position t: checkpoint t / K */                 \
          for (int64_t d = d0; d < d1; d++)                                                         \
            for (int64_t n = 0; n < NN; n++) hc[((b * D + d) * nseg + t / K) * N + n] = h[(d - d0) * stride + n]; \
        const T *xt = x + pos * D, *dtt = dt + pos * D, *Bt = Bm + pos * N, *Ct = Cm + pos * N;     \
        T *yt = y + pos * D;                                                                        \
        for (int64_t d = d0; d < d1; d++) {                                                         \
          const T delta = dtt[d], u = delta * xt[d]; /* Δ_t and Δ_t x_t for channel d */            \
          const T *Ad = A + d * N;                                                                  \
          T *hd = h + (d - d0) * stride;                                                            \
          T acc = 0;                                                                                \
          _Pragma("omp simd reduction(+:acc)")                                                     \
          for (int64_t n = 0; n < NN; n++) {                                                         \
            const T hn = EXP(delta * Ad[n]) * hd[n] + Bt[n] * u; /* Ā_t h + B̄_t x_t */              \
            hd[n] = hn;                                                                             \
            acc += hn * Ct[n]; /* C_t · h_t */                                                      \
          }                                                                                         \
          yt[d] = acc;                                                                              \
        }                                                                                           \
      }                                                                                             \
      if (hl)                                                                                       \
        for (int64_t d = d0; d < d1; d++)                                                           \
          for (int64_t n = 0; n < NN; n++) hl[(b * D + d) * N + n] = h[(d - d0) * stride + n];      \
      r += d1 - d0;                                                                                 \
    }                                                                                               \
    free(h);                                                                                        \
    return 0;                                                                                       \
  }

/* Subnormal numbers (below 1.2e-38 in fp32, 2.2e-308 in fp64) cost x86 cores a hundred cycles or
 * more per operation, and a trained Mamba makes them: a channel with a large Δ decays its state
 * through them on every step (measured: a lesson 06 model's training slowed 10x after a few hundred
 * steps). Each entry point therefore runs with flush-to-zero and denormals-are-zero set in its own
 * thread's MXCSR and restores it on return: a result changes only where a number is below those
 * magnitudes, far under any tolerance. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLUSH_SUBNORMALS(EXPR)                                \
  do {                                                        \
    const unsigned int csr_ = _mm_getcsr();                   \
    _mm_setcsr(csr_ | 0x8040); /* FTZ (bit 15) | DAZ (bit 6) */ \
    status_ = (EXPR);                                         \
    _mm_setcsr(csr_);                                         \
  } while (0)
#else
#define FLUSH_SUBNORMALS(EXPR) (status_ = (EXPR))
#endif

/* Each loop is compiled twice: for any N, and for N = 16 (Mamba's d_state, the course's every model)
 * with the trip count known, so the n loop is two whole AVX vectors with no remainder code (measured
 * 1.3x faster here). The entry points pick one; both compute the same thing in the same order. */
DEFINE_SCAN(scan_f32_any, float, expf, N)
DEFINE_SCAN(scan_f32_16, float, expf, 16)
DEFINE_SCAN(scan_f64_any, double, exp, N)
DEFINE_SCAN(scan_f64_16, double, exp, 16)
#define SCAN_PASS x, dt, A, Bm, Cm, h0, y, hl, hc, K, L, D, N, row_begin, row_end
/* an entry point: the N = 16 loop or the general one, with subnormals flushed */
#define DEFINE_ENTRY(NAME, ARGS, FN_16, FN_ANY, PASS)           \
  int NAME(ARGS) {                                              \
    int status_;                                                \
    FLUSH_SUBNORMALS((N == 16 ? FN_16 : FN_ANY)(PASS));         \
    return status_;                                             \
  }
DEFINE_ENTRY(onemask_scan_f32, SCAN_ARGS(float), scan_f32_16, scan_f32_any, SCAN_PASS)
DEFINE_ENTRY(onemask_scan_f64, SCAN_ARGS(double), scan_f64_16, scan_f64_any, SCAN_PASS)

/* The backward: the gradients of y (and of the final state) with respect to x, Δ, A, B, C and
 * the initial state, by the chain rule run backwards in time. Per channel d and state entry n,
 * with a_t = exp(Δ_t A), u_t = Δ_t x_t and g_t the gradient reaching h_t (from y_t and from h_{t+1}):
 *     g_t    = gy_t C_t + a_{t+1} g_{t+1}          (g_L from the final state's gradient, or 0)
 *     gC_t  += gy_t h_t            gB_t += g_t u_t            gA += g_t a_t h_{t-1} Δ_t
 *     gΔ_t   = Σ_n g_t a_t h_{t-1} A  +  x_t Σ_n g_t B_t       gx_t = Δ_t Σ_n g_t B_t
 *     gh0    = a_0 g_0
 * It needs h_{t-1} and h_t at every t, in reverse order, and keeps none of the (B, L, D, N) states:
 * the forward kept one state every K positions (hc), and each segment of K positions is recomputed
 * from its checkpoint into a buffer of K states of a block of channels, then walked backwards (the
 * official CUDA kernel's recomputation, Mamba §3.3.2, with the cache standing in for SRAM); the recompute
 * also keeps each a_t of the segment, so the walk back computes no exponential.
 *
 * Work is split into units: a sequence b and a block of `block` channels. B and C are shared by the
 * channels and A by the sequences, so a unit writes its own partial sums, gBp and gCp (B, nblk, L, N)
 * and gAp (B, D, N), which the Python side adds up; every other output has one writer. A unit's
 * result depends only on the unit, so the gradients are the same bits for any number of threads.
 * gy (B, L, D); ghl (B, D, N) or NULL (no gradient for the final state); gx, gdt (B, L, D);
 * gh0 (B, D, N). Returns 0, or -1 if a buffer could not be allocated.
 */
#define SCAN_BWD_ARGS(T) const T *x, const T *dt, const T *A, const T *Bm, const T *Cm, const T *hc, const T *gy, \
                         const T *ghl, T *gx, T *gdt, T *gAp, T *gBp, T *gCp, T *gh0, int64_t K, int64_t block, \
                         int64_t L, int64_t D, int64_t N, int64_t unit_begin, int64_t unit_end
#define DEFINE_SCAN_BWD(NAME, T, EXP, NN)                                                               \
  static int NAME(SCAN_BWD_ARGS(T)) {                                                             \
    const int64_t stride = (N * (int64_t)sizeof(T) + ALIGN - 1) / ALIGN * ALIGN / (int64_t)sizeof(T); \
    const int64_t nseg = (L + K - 1) / K, nblk = (D + block - 1) / block;                           \
    /* hs: the states h_{s-1} .. h_{e-1} of one segment [s, e) (K + 1 of them); g: the gradient     \
       reaching the current state; gA: this unit's sum for A, gAs the current segment's (summed     \
       in two levels, so fp32 rounding grows with K + L/K terms, not L); gBt, gCt: one position's */ \
    T *hs = (T *)aligned_alloc(ALIGN, sizeof(T) * (K + 1) * block * stride);                        \
    T *as = (T *)aligned_alloc(ALIGN, sizeof(T) * K * block * stride); /* the segment's decays a_t */ \
    T *g = (T *)aligned_alloc(ALIGN, sizeof(T) * block * stride);                                   \
    T *gA = (T *)aligned_alloc(ALIGN, sizeof(T) * block * stride);                                  \
    T *gAs = (T *)aligned_alloc(ALIGN, sizeof(T) * block * stride);                                 \
    T *gBt = (T *)aligned_alloc(ALIGN, sizeof(T) * stride), *gCt = (T *)aligned_alloc(ALIGN, sizeof(T) * stride); \
    int status = (hs && as && g && gA && gAs && gBt && gCt) ? 0 : -1;                               \
    for (int64_t unit = unit_begin; unit < unit_end && status == 0; unit++) {                       \
      const int64_t b = unit / nblk, blk = unit % nblk, d0 = blk * block;                           \
      const int64_t d1 = d0 + block < D ? d0 + block : D, bw = d1 - d0;                             \
      for (int64_t j = 0; j < bw; j++)                                                              \
        for (int64_t n = 0; n < NN; n++) {                                                           \
          g[j * stride + n] = ghl ? ghl[(b * D + d0 + j) * N + n] : (T)0;                           \
          gA[j * stride + n] = 0;                                                                   \
        }                                                                                           \
      for (int64_t seg = nseg - 1; seg >= 0; seg--) {                                               \
        const int64_t s = seg * K, e = s + K < L ? s + K : L;                                       \
        /* recompute: hs[i] = h_{s-1+i}, from the checkpoint, as the forward computed them */      \
        for (int64_t j = 0; j < bw; j++)                                                            \
          for (int64_t n = 0; n < NN; n++) {                                                         \
            hs[j * stride + n] = hc[((b * D + d0 + j) * nseg + seg) * N + n];                       \
            gAs[j * stride + n] = 0;                                                                \
          }                                                                                         \
        for (int64_t t = s; t < e; t++) {                                                           \
          const int64_t pos = b * L + t;                                                            \
          const T *xt = x + pos * D, *dtt = dt + pos * D, *Bt = Bm + pos * N;                       \
          const T *prev = hs + (t - s) * block * stride;                                            \
          T *cur = hs + (t - s + 1) * block * stride;                                               \
          for (int64_t j = 0; j < bw; j++) {                                                        \
            const int64_t d = d0 + j;                                                               \
            const T delta = dtt[d], u = delta * xt[d];                                              \
            const T *Ad = A + d * N, *hp = prev + j * stride;                                       \
            T *hd = cur + j * stride, *ad = as + ((t - s) * block + j) * stride;                    \
            _Pragma("omp simd")                                                                    \
            for (int64_t n = 0; n < NN; n++) {                                                      \
              const T a = EXP(delta * Ad[n]);                                                       \
              ad[n] = a;                                                                            \
              hd[n] = a * hp[n] + Bt[n] * u;                                                        \
            }                                                                                       \
          }                                                                                         \
        }                                                                                           \
        /* walk the segment backwards */                                                            \
        for (int64_t t = e - 1; t >= s; t--) {                                                      \
          const int64_t pos = b * L + t;                                                            \
          const T *xt = x + pos * D, *dtt = dt + pos * D, *Bt = Bm + pos * N, *Ct = Cm + pos * N;   \
          const T *gyt = gy + pos * D;                                                              \
          const T *prev = hs + (t - s) * block * stride, *cur = hs + (t - s + 1) * block * stride;  \
          for (int64_t n = 0; n < NN; n++) gBt[n] = gCt[n] = 0;                                      \
          for (int64_t j = 0; j < bw; j++) {                                                        \
            const int64_t d = d0 + j;                                                               \
            const T delta = dtt[d], xv = xt[d], u = delta * xv, gyv = gyt[d];                       \
            const T *Ad = A + d * N, *hp = prev + j * stride, *hd = cur + j * stride;               \
            const T *ad = as + ((t - s) * block + j) * stride;                                      \
            T *gd = g + j * stride, *gAd = gAs + j * stride;                                         \
            T via_a = 0, via_u = 0; /* Σ_n g a h_{t-1} A and Σ_n g B */                             \
            _Pragma("omp simd reduction(+:via_a, via_u)")                                          \
            for (int64_t n = 0; n < NN; n++) {                                                       \
              const T a = ad[n];                        /* kept by the recompute */                 \
              const T gn = gd[n] + gyv * Ct[n];       /* the gradient reaching h_t */               \
              const T gah = gn * a * hp[n];           /* ... through a_t, times a_t */              \
              gCt[n] += gyv * hd[n];                                                                \
              gBt[n] += gn * u;                                                                     \
              gAd[n] += gah * delta;                                                                \
              via_a += gah * Ad[n];                                                                 \
              via_u += gn * Bt[n];                                                                  \
              gd[n] = gn * a;                         /* the gradient reaching h_{t-1} */           \
            }                                                                                       \
            gdt[pos * D + d] = via_a + via_u * xv;                                                  \
            gx[pos * D + d] = via_u * delta;                                                        \
          }                                                                                         \
          T *gBo = gBp + ((b * nblk + blk) * L + t) * N, *gCo = gCp + ((b * nblk + blk) * L + t) * N; \
          for (int64_t n = 0; n < NN; n++) {                                                         \
            gBo[n] = gBt[n];                                                                        \
            gCo[n] = gCt[n];                                                                        \
          }                                                                                         \
        }                                                                                           \
        for (int64_t j = 0; j < bw; j++)                                                            \
          for (int64_t n = 0; n < NN; n++) gA[j * stride + n] += gAs[j * stride + n];                \
      }                                                                                             \
      for (int64_t j = 0; j < bw; j++)                                                              \
        for (int64_t n = 0; n < NN; n++) {                                                           \
          gh0[(b * D + d0 + j) * N + n] = g[j * stride + n];                                        \
          gAp[(b * D + d0 + j) * N + n] = gA[j * stride + n];                                       \
        }                                                                                           \
    }                                                                                               \
    free(hs);                                                                                       \
    free(as);                                                                                       \
    free(g);                                                                                        \
    free(gA);                                                                                       \
    free(gAs);                                                                                      \
    free(gBt);                                                                                      \
    free(gCt);                                                                                      \
    return status;                                                                                  \
  }

#define SCAN_BWD_PASS x, dt, A, Bm, Cm, hc, gy, ghl, gx, gdt, gAp, gBp, gCp, gh0, K, block, L, D, N, unit_begin, unit_end
DEFINE_SCAN_BWD(scan_bwd_f32_any, float, expf, N)
DEFINE_SCAN_BWD(scan_bwd_f32_16, float, expf, 16)
DEFINE_SCAN_BWD(scan_bwd_f64_any, double, exp, N)
DEFINE_SCAN_BWD(scan_bwd_f64_16, double, exp, 16)
DEFINE_ENTRY(onemask_scan_bwd_f32, SCAN_BWD_ARGS(float), scan_bwd_f32_16, scan_bwd_f32_any, SCAN_BWD_PASS)
DEFINE_ENTRY(onemask_scan_bwd_f64, SCAN_BWD_ARGS(double), scan_bwd_f64_16, scan_bwd_f64_any, SCAN_BWD_PASS)

#ifdef _OPENMP
#include <omp.h>
/* all rows 0 .. rows-1, split into equal contiguous ranges, one per thread */
#define DEFINE_SCAN_OMP(NAME, ROWS_FN, T)                                                               \
  int NAME(const T *x, const T *dt, const T *A, const T *Bm, const T *Cm, const T *h0, T *y, T *hl,     \
           T *hc, int64_t K, int64_t L, int64_t D, int64_t N, int64_t rows, int64_t threads) {          \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads((int)threads) reduction(|:failed)")                               \
    {                                                                                                   \
      const int64_t k = omp_get_thread_num(), m = omp_get_num_threads();                                \
      failed |= ROWS_FN(x, dt, A, Bm, Cm, h0, y, hl, hc, K, L, D, N, rows * k / m, rows * (k + 1) / m);       \
    }                                                                                                   \
    return failed;                                                                                      \
  }
DEFINE_SCAN_OMP(onemask_scan_f32_omp, onemask_scan_f32, float)
DEFINE_SCAN_OMP(onemask_scan_f64_omp, onemask_scan_f64, double)
/* all units 0 .. units-1, split into equal contiguous ranges, one per thread */
#define DEFINE_SCAN_BWD_OMP(NAME, UNITS_FN, T)                                                          \
  int NAME(const T *x, const T *dt, const T *A, const T *Bm, const T *Cm, const T *hc, const T *gy,     \
           const T *ghl, T *gx, T *gdt, T *gAp, T *gBp, T *gCp, T *gh0, int64_t K, int64_t block,         \
           int64_t L, int64_t D, int64_t N, int64_t units, int64_t threads) {                           \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads((int)threads) reduction(|:failed)")                               \
    {                                                                                                   \
      const int64_t k = omp_get_thread_num(), m = omp_get_num_threads();                                \
      failed |= UNITS_FN(x, dt, A, Bm, Cm, hc, gy, ghl, gx, gdt, gAp, gBp, gCp, gh0, K, block, L, D, N,   \
                         units * k / m, units * (k + 1) / m);                                           \
    }                                                                                                   \
    return failed;                                                                                      \
  }
DEFINE_SCAN_BWD_OMP(onemask_scan_bwd_f32_omp, onemask_scan_bwd_f32, float)
DEFINE_SCAN_BWD_OMP(onemask_scan_bwd_f64_omp, onemask_scan_bwd_f64, double)
#endif

/* The Mamba mixer's causal depthwise convolution (lesson 06), forward and backward, as plain loops:
 * PyTorch's grouped conv1d spends milliseconds on the tiny (B, E, T) inputs of this course's
 * models, most of it in its backward. Per sequence b, position t and channel e, with K taps:
 *     y[b, t, e] = bias[e] + Σ_k w[e, k] · win[b, t + k, e]
 * where win is the K − 1 carried inputs (state (B, E, K − 1), or zeros) followed by x (B, T, E).
 * The channel loop is innermost (contiguous in x and y), so it vectorises. One call computes the
 * sequences b_begin <= b < b_end; the backward writes per-sequence partial sums for w and bias
 * (gwp (B, K, E), gbp (B, E)), added up by the Python side, so any split gives the same bits.
 * wt is w transposed, (K, E). gstate (B, E, K − 1) or NULL. */
#define DEFINE_CONV(NAME, T)                                                                        \
  static inline T NAME##_win(const T *x, const T *state, int64_t b, int64_t s, int64_t e,         \
                             int64_t Tn, int64_t E, int64_t K) {                                  \
    if (s >= 0) return x[(b * Tn + s) * E + e];                                                   \
    return state ? state[(b * E + e) * (K - 1) + (K - 1 + s)] : (T)0;                             \
  }                                                                                               \
  int NAME(const T *x, const T *state, const T *wt, const T *bias, T *y, int64_t Tn, int64_t E,   \
           int64_t K, int64_t b_begin, int64_t b_end) {                                           \
    for (int64_t b = b_begin; b < b_end; b++)                                                     \
      for (int64_t t = 0; t < Tn; t++) {                                                          \
        T *yt = y + (b * Tn + t) * E;                                                             \
        for (int64_t e = 0; e < E; e++) yt[e] = bias ? bias[e] : (T)0;                            \
        for (int64_t k = 0; k < K; k++) {                                                         \
          const int64_t s = t + k - (K - 1);                                                      \
          const T *wk = wt + k * E;                                                               \
          if (s >= 0) {                                                                           \
            const T *xs = x + (b * Tn + s) * E;                                                   \
            _Pragma("omp simd")                                                                  \
            for (int64_t e = 0; e < E; e++) yt[e] += wk[e] * xs[e];                               \
          } else if (state) {                                                                     \
            for (int64_t e = 0; e < E; e++) yt[e] += wk[e] * state[(b * E + e) * (K - 1) + (K - 1 + s)]; \
          }                                                                                       \
        }                                                                                         \
      }                                                                                           \
    return 0;                                                                                     \
  }                                                                                               \
  int NAME##_bwd(const T *x, const T *state, const T *wt, const T *gy, T *gx, T *gstate, T *gwp,  \
                 T *gbp, int64_t Tn, int64_t E, int64_t K, int64_t b_begin, int64_t b_end) {      \
    for (int64_t b = b_begin; b < b_end; b++) {                                                   \
      T *gw = gwp + b * K * E, *gb = gbp + b * E;                                                 \
      for (int64_t i = 0; i < K * E; i++) gw[i] = 0;                                              \
      for (int64_t e = 0; e < E; e++) gb[e] = 0;                                                  \
      for (int64_t s = -(K - 1); s < Tn; s++) { /* the gradient of win[s]: from y[s .. s + K − 1] */ \
        T *gs = s >= 0 ? gx + (b * Tn + s) * E : NULL;                                            \
        if (gs)                                                                                   \
          for (int64_t e = 0; e < E; e++) gs[e] = 0;                                              \
        for (int64_t k = 0; k < K; k++) {                                                         \
          const int64_t t = s - k + (K - 1);                                                      \
          if (t < 0 || t >= Tn) continue;                                                         \
          const T *gyt = gy + (b * Tn + t) * E, *wk = wt + k * E;                                 \
          T *gwk = gw + k * E;                                                                    \
          if (gs) {                                                                               \
            const T *xs = x + (b * Tn + s) * E;                                                   \
            _Pragma("omp simd")                                                                  \
            for (int64_t e = 0; e < E; e++) {                                                     \
              gs[e] += gyt[e] * wk[e];                                                            \
              gwk[e] += gyt[e] * xs[e];                                                           \
            }                                                                                     \
          } else {                                                                                \
            for (int64_t e = 0; e < E; e++) {                                                     \
              const T v = NAME##_win(x, state, b, s, e, Tn, E, K);                                \
              gwk[e] += gyt[e] * v;                                                               \
              if (gstate) gstate[(b * E + e) * (K - 1) + (K - 1 + s)] += gyt[e] * wk[e];          \
            }                                                                                     \
          }                                                                                       \
        }                                                                                         \
      }                                                                                           \
      for (int64_t t = 0; t < Tn; t++) {                                                          \
        const T *gyt = gy + (b * Tn + t) * E;                                                     \
        for (int64_t e = 0; e < E; e++) gb[e] += gyt[e];                                          \
      }                                                                                           \
    }                                                                                             \
    return 0;                                                                                     \
  }

DEFINE_CONV(onemask_conv_f32, float)
DEFINE_CONV(onemask_conv_f64, double)
