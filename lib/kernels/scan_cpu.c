/* Mamba's loops for the CPU (lessons 06 and 08): the selective scan, fused with what surrounds it in
 * a Mamba mixer, the mixer's causal depthwise convolution, and RMSNorm, each with its backward.
 * Compiled and loaded at run time by lib/kernels/scan_cpu.py (the scan) and called from there and
 * from lib/kernels/cpu_layers.py (the convolution and RMSNorm), which document them; see those files.
 *
 * The scan: the same computation as lib.scan.selective_scan_ref, per sequence b, channel d and
 * state entry n:
 *     Δ_t = softplus(dt_t + dtb)  (or dt_t + dtb without softplus; dtb a bias per channel)
 *     h_t = exp(Δ_t * A) * h_{t-1} + (Δ_t * x_t) * B_t      y_t = sum_n C_t[n] * h_t[n] + Dv * x_t
 *     out_t = y_t * silu(z_t)  (or y_t without z)
 * but the state of a block of channels stays in a small buffer (in the L1 cache) for the whole
 * sequence, so no (B, L, D, N) tensor is ever written: dt, x, B, C, z are read once and out written
 * once. That is the fused GPU kernel's idea (lib/kernels/scan.py), with the cache standing in for
 * SRAM; taking the softplus, the skip and the gate in as well is what the official kernel's
 * selective_scan_fn does (its delta_bias, delta_softplus, D and z), and saves as many passes of
 * small tensor operations over (B, L, D) on each side of the scan.
 *
 * Layout: every array is contiguous. x, dt, z, y, ypre (B, L, D); A (D, N); Bm, Cm (B, L, N); Dv,
 * dtb (D,); h0, hl (B, D, N) or NULL (no initial state: zeros; no final state wanted); z NULL (no
 * gate); ypre NULL or where y before the gate is kept for the backward; hc (B, D, ceil(L/K), N) or
 * NULL: with it, the state entering every K-th position (k·K, k = 0, 1, ...) is kept there, the
 * checkpoints the backward (below) restarts from. One call computes the "rows" (b, d) with
 * row_begin <= b * D + d < row_end; a row's result depends only on the row (the state buffer is
 * aligned the same way for every range), so the output is bit-for-bit the same whatever the split.
 *
 * Threads: compiled with -fopenmp, the *_omp entry points split the rows (or units) between
 * `threads` OpenMP threads. The shared library then needs libgomp.so.1, which the dynamic loader
 * resolves to the copy PyTorch has already loaded, so the loops run on PyTorch's own thread pool (a
 * second pool would fight PyTorch's threads, which spin for a while after each parallel operation).
 * Without OpenMP the Python side calls the range entry points from its own threads.
 *
 * The inner loops are vectorised (`omp simd`, needing only -fopenmp-simd, no OpenMP runtime). With
 * ONEMASK_LIBMVEC defined (x86-64 Linux with AVX2: the Python side decides), exp and log are
 * declared to have glibc's vector versions, so they are computed eight floats (four doubles) at a
 * time; without it they are scalar calls and the loops are still correct.
 *
 * Every entry point returns 0, or -1 if a working buffer could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(ONEMASK_LIBMVEC)
__attribute__((simd("notinbranch"))) float expf(float);
__attribute__((simd("notinbranch"))) double exp(double);
__attribute__((simd("notinbranch"))) float logf(float);
__attribute__((simd("notinbranch"))) double log(double);
#endif

#define BLOCK_D 64 /* channels whose state the forward holds at once: 64 x 16 floats = 4 KiB */
#define ALIGN 64   /* bytes: one cache line; each channel's state starts on one */

/* The elementwise functions around the scan, per dtype, as torch computes them:
 * softplus(v) = log(1 + e^v), and v itself above 20 (torch's threshold); its derivative is
 * sigmoid(v) (1 above 20). log1p(w) is taken as log(u) · w / (u − 1) with u = 1 + w rounded
 * (exact to a few ulp, Goldberg 1991): glibc has a vector log everywhere it has a vector exp, and
 * log(u) alone would lose the low bits of a small w. silu(z) = z · sigmoid(z), written z / (1 + e^-z)
 * as torch does. */
#define DEFINE_POINTWISE(SUF, T, EXP, LOG)                                                                   \
  static inline T softplus_##SUF(T v) {                                                                      \
    const T w = EXP(v), u = 1 + w;                                                                           \
    const T log1p_w = u == 1 ? w : LOG(u) * (w / (u - 1));                                                   \
    return v > 20 ? v : log1p_w;                                                                             \
  }                                                                                                          \
  static inline T sigmoid_##SUF(T v) { return 1 / (1 + EXP(-v)); }                                           \
  static inline T dsoftplus_##SUF(T v) { return v > 20 ? (T)1 : sigmoid_##SUF(v); }                          \
  static inline T silu_##SUF(T v) { return v / (1 + EXP(-v)); }                                              \
  static inline T dsilu_##SUF(T v) { /* d/dv v·σ(v) = σ(v) (1 + v (1 − σ(v))) */                             \
    const T s = sigmoid_##SUF(v);                                                                            \
    return s * (1 + v * (1 - s));                                                                            \
  }
DEFINE_POINTWISE(f32, float, expf, logf)
DEFINE_POINTWISE(f64, double, exp, log)

/* Subnormal numbers (below 1.2e-38 in fp32, 2.2e-308 in fp64) cost x86 cores a hundred cycles or
 * more per operation, and a trained Mamba makes them: a channel with a large Δ decays its state
 * through them on every step (measured: a lesson 06 model's training slowed 10x after a few hundred
 * steps). Each entry point therefore runs with flush-to-zero and denormals-are-zero set in its own
 * thread's MXCSR and restores it on return: a result changes only where a number is below those
 * magnitudes, far under any tolerance. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLUSH_SUBNORMALS(EXPR)                                                                               \
  do {                                                                                                       \
    const unsigned int csr_ = _mm_getcsr();                                                                  \
    _mm_setcsr(csr_ | 0x8040); /* FTZ (bit 15) | DAZ (bit 6) */                                              \
    status_ = (EXPR);                                                                                        \
    _mm_setcsr(csr_);                                                                                        \
  } while (0)
#else
#define FLUSH_SUBNORMALS(EXPR) (status_ = (EXPR))
#endif

/* ------------------------------------------------------------------------------------ the scan */
#define SCAN_PTRS(T) const T *x, const T *dt, const T *A, const T *Bm, const T *Cm, const T *h0,             \
                     const T *Dv, const T *dtb, const T *z, T *y, T *ypre, T *hl, T *hc
#define SCAN_SIZES int64_t softplus, int64_t K, int64_t L, int64_t D, int64_t N
#define SCAN_PASS x, dt, A, Bm, Cm, h0, Dv, dtb, z, y, ypre, hl, hc, softplus, K, L, D, N
#define DEFINE_SCAN(NAME, SUF, T, EXP, NN)                                                                   \
  static int NAME(SCAN_PTRS(T), SCAN_SIZES, int64_t row_begin, int64_t row_end) {                            \
    const int64_t nseg = (L + K - 1) / K; /* checkpoints per row */                                          \
    /* each channel's state padded to a whole number of cache lines */                                       \
    const int64_t stride = (N * (int64_t)sizeof(T) + ALIGN - 1) / ALIGN * ALIGN / (int64_t)sizeof(T);        \
    T *h = (T *)aligned_alloc(ALIGN, sizeof(T) * BLOCK_D * stride);                                          \
    if (h == NULL) return -1;                                                                                \
    T dl[BLOCK_D], ul[BLOCK_D], acc[BLOCK_D]; /* one position's Δ, Δ·x and C·h for the block */              \
    for (int64_t r = row_begin; r < row_end;) {                                                              \
      /* the next block: channels d0 .. d1-1 of sequence b, within this call's rows */                       \
      const int64_t b = r / D, d0 = r % D;                                                                   \
      int64_t d1 = d0 + BLOCK_D;                                                                             \
      if (d1 > D) d1 = D;                                                                                    \
      if (d1 - d0 > row_end - r) d1 = d0 + (row_end - r);                                                    \
      const int64_t bw = d1 - d0;                                                                            \
      for (int64_t j = 0; j < bw; j++)                                                                       \
        for (int64_t n = 0; n < NN; n++) h[j * stride + n] = h0 ? h0[(b * D + d0 + j) * N + n] : (T)0;       \
      for (int64_t t = 0; t < L; t++) {                                                                      \
        const int64_t pos = b * L + t;                                                                       \
        if (hc && t % K == 0) /* the state entering position t: checkpoint t / K */                          \
          for (int64_t j = 0; j < bw; j++)                                                                   \
            for (int64_t n = 0; n < NN; n++) hc[((b * D + d0 + j) * nseg + t / K) * N + n] = h[j * stride + n]; \
        const T *xt = x + pos * D + d0, *dtt = dt + pos * D + d0, *bias = dtb + d0;                          \
        const T *Bt = Bm + pos * N, *Ct = Cm + pos * N;                                                      \
        if (softplus) { /* Δ_t and Δ_t x_t for the block's channels */                                       \
          _Pragma("omp simd")                                                                                \
          for (int64_t j = 0; j < bw; j++) {                                                                 \
            dl[j] = softplus_##SUF(dtt[j] + bias[j]);                                                        \
            ul[j] = dl[j] * xt[j];                                                                           \
          }                                                                                                  \
        } else {                                                                                             \
          _Pragma("omp simd")                                                                                \
          for (int64_t j = 0; j < bw; j++) {                                                                 \
            dl[j] = dtt[j] + bias[j];                                                                        \
            ul[j] = dl[j] * xt[j];                                                                           \
          }                                                                                                  \
        }                                                                                                    \
        for (int64_t j = 0; j < bw; j++) {                                                                   \
          const T delta = dl[j], u = ul[j];                                                                  \
          const T *Ad = A + (d0 + j) * N;                                                                    \
          T *hd = h + j * stride;                                                                            \
          T sum = 0;                                                                                         \
          _Pragma("omp simd reduction(+:sum)")                                                               \
          for (int64_t n = 0; n < NN; n++) {                                                                 \
            const T hn = EXP(delta * Ad[n]) * hd[n] + Bt[n] * u; /* Ā_t h + B̄_t x_t */                      \
            hd[n] = hn;                                                                                      \
            sum += hn * Ct[n]; /* C_t · h_t */                                                               \
          }                                                                                                  \
          acc[j] = sum;                                                                                      \
        }                                                                                                    \
        /* the skip, then the gate (keeping y before it where the backward will need it) */                  \
        const T *Dd = Dv + d0, *zt = z ? z + pos * D + d0 : NULL;                                            \
        T *yt = y + pos * D + d0, *yp = ypre ? ypre + pos * D + d0 : NULL;                                   \
        if (zt && yp) {                                                                                      \
          _Pragma("omp simd")                                                                                \
          for (int64_t j = 0; j < bw; j++) {                                                                 \
            const T v = acc[j] + Dd[j] * xt[j];                                                              \
            yp[j] = v;                                                                                       \
            yt[j] = v * silu_##SUF(zt[j]);                                                                   \
          }                                                                                                  \
        } else if (zt) {                                                                                     \
          _Pragma("omp simd")                                                                                \
          for (int64_t j = 0; j < bw; j++) yt[j] = (acc[j] + Dd[j] * xt[j]) * silu_##SUF(zt[j]);             \
        } else {                                                                                             \
          _Pragma("omp simd")                                                                                \
          for (int64_t j = 0; j < bw; j++) yt[j] = acc[j] + Dd[j] * xt[j];                                   \
        }                                                                                                    \
      }                                                                                                      \
      if (hl)                                                                                                \
        for (int64_t j = 0; j < bw; j++)                                                                     \
          for (int64_t n = 0; n < NN; n++) hl[(b * D + d0 + j) * N + n] = h[j * stride + n];                 \
      r += bw;                                                                                               \
    }                                                                                                        \
    free(h);                                                                                                 \
    return 0;                                                                                                \
  }

/* The backward: the gradients of out (and of the final state) with respect to x, dt, A, B, C, the
 * skip Dv, the gate z and the initial state, by the chain rule run backwards in time. Per channel
 * d and state entry n, with a_t = exp(Δ_t A), u_t = Δ_t x_t, gy_t the gradient reaching y_t
 * (gout_t · silu(z_t) with a gate) and g_t the gradient reaching h_t (from y_t and from h_{t+1}):
 *     g_t    = gy_t C_t + a_{t+1} g_{t+1}          (g_L from the final state's gradient, or 0)
 *     gC_t  += gy_t h_t            gB_t += g_t u_t            gA += g_t a_t h_{t-1} Δ_t
 *     gΔ_t   = Σ_n g_t a_t h_{t-1} A  +  x_t Σ_n g_t B_t       gx_t = Δ_t Σ_n g_t B_t + Dv gy_t
 *     gdt_t  = gΔ_t softplus'(dt_t + dtb)  (gΔ_t without softplus; the bias's gradient is Σ_t gdt_t)
 *     gz_t   = gout_t ypre_t silu'(z_t)     gDv += gy_t x_t          gh0 = a_0 g_0
 * It needs h_{t-1} and h_t at every t, in reverse order, and keeps none of the (B, L, D, N) states:
 * the forward kept one state every K positions (hc), and each segment of K positions is recomputed
 * from its checkpoint into a buffer of K states of a block of channels, then walked backwards (the
 * official CUDA kernel's recomputation, Mamba §3.3.2, with the cache standing in for SRAM); the
 * recompute also keeps each a_t and Δ_t of the segment, so the walk back computes no exponential
 * inside its loop over n.
 *
 * Work is split into units: a sequence b and a block of `block` channels. B and C are shared by the
 * channels and A by the sequences, so a unit writes its own partial sums, gBp and gCp (B, nblk, L, N)
 * and gAp (B, D, N), which the Python side adds up (as gDp (B, D)); every other output has one
 * writer. A unit's result depends only on the unit, so the gradients are the same bits for any
 * number of threads. gy (B, L, D) is the gradient of out; ghl (B, D, N) or NULL (no gradient for
 * the final state); gz (B, L, D) is written where z is given; gx, gdt (B, L, D); gh0 (B, D, N).
 */
#define SCAN_BWD_PTRS(T) const T *x, const T *dt, const T *A, const T *Bm, const T *Cm, const T *Dv,         \
                         const T *dtb, const T *z, const T *ypre, const T *hc, const T *gy, const T *ghl,    \
                         T *gx, T *gdt, T *gAp, T *gBp, T *gCp, T *gDp, T *gz, T *gh0
#define SCAN_BWD_SIZES int64_t softplus, int64_t K, int64_t block, int64_t L, int64_t D, int64_t N
#define SCAN_BWD_PASS x, dt, A, Bm, Cm, Dv, dtb, z, ypre, hc, gy, ghl, gx, gdt, gAp, gBp, gCp, gDp, gz, gh0, \
                      softplus, K, block, L, D, N
#define DEFINE_SCAN_BWD(NAME, SUF, T, EXP, NN)                                                               \
  static int NAME(SCAN_BWD_PTRS(T), SCAN_BWD_SIZES, int64_t unit_begin, int64_t unit_end) {                  \
    const int64_t stride = (N * (int64_t)sizeof(T) + ALIGN - 1) / ALIGN * ALIGN / (int64_t)sizeof(T);        \
    const int64_t nseg = (L + K - 1) / K, nblk = (D + block - 1) / block;                                    \
    /* hs: the states h_{s-1} .. h_{e-1} of one segment [s, e) (K + 1 of them); as: its decays;              \
       dls: its Δ (K x block); g: the gradient reaching the current state; gA: this unit's sum for           \
       A, gAs the current segment's (summed in two levels, so fp32 rounding grows with K + L/K               \
       terms, not L); gBt, gCt: one position's; gyl, gdl: one position's gy and gΔ per channel */            \
    T *hs = (T *)aligned_alloc(ALIGN, sizeof(T) * (K + 1) * block * stride);                                 \
    T *as = (T *)aligned_alloc(ALIGN, sizeof(T) * K * block * stride);                                       \
    T *dls = (T *)malloc(sizeof(T) * K * block);                                                             \
    T *g = (T *)aligned_alloc(ALIGN, sizeof(T) * block * stride);                                            \
    T *gA = (T *)aligned_alloc(ALIGN, sizeof(T) * block * stride);                                           \
    T *gAs = (T *)aligned_alloc(ALIGN, sizeof(T) * block * stride);                                          \
    T *gBt = (T *)aligned_alloc(ALIGN, sizeof(T) * stride), *gCt = (T *)aligned_alloc(ALIGN, sizeof(T) * stride); \
    T *gyl = (T *)malloc(sizeof(T) * block), *gdl = (T *)malloc(sizeof(T) * block);                          \
    int status = (hs && as && dls && g && gA && gAs && gBt && gCt && gyl && gdl) ? 0 : -1;                   \
    for (int64_t unit = unit_begin; unit < unit_end && status == 0; unit++) {                                \
      const int64_t b = unit / nblk, blk = unit % nblk, d0 = blk * block;                                    \
      const int64_t d1 = d0 + block < D ? d0 + block : D, bw = d1 - d0;                                      \
      const T *bias = dtb + d0, *Dd = Dv + d0;                                                               \
      T *gDd = gDp + b * D + d0;                                                                             \
      for (int64_t j = 0; j < bw; j++) {                                                                     \
        gDd[j] = 0;                                                                                          \
        for (int64_t n = 0; n < NN; n++) {                                                                   \
          g[j * stride + n] = ghl ? ghl[(b * D + d0 + j) * N + n] : (T)0;                                    \
          gA[j * stride + n] = 0;                                                                            \
        }                                                                                                    \
      }                                                                                                      \
      for (int64_t seg = nseg - 1; seg >= 0; seg--) {                                                        \
        const int64_t s = seg * K, e = s + K < L ? s + K : L;                                                \
        /* recompute: hs[i] = h_{s-1+i}, from the checkpoint, as the forward computed them */                \
        for (int64_t j = 0; j < bw; j++)                                                                     \
          for (int64_t n = 0; n < NN; n++) {                                                                 \
            hs[j * stride + n] = hc[((b * D + d0 + j) * nseg + seg) * N + n];                                \
            gAs[j * stride + n] = 0;                                                                         \
          }                                                                                                  \
        for (int64_t t = s; t < e; t++) {                                                                    \
          const int64_t pos = b * L + t;                                                                     \
          const T *xt = x + pos * D + d0, *dtt = dt + pos * D + d0, *Bt = Bm + pos * N;                      \
          const T *prev = hs + (t - s) * block * stride;                                                     \
          T *cur = hs + (t - s + 1) * block * stride, *dlt = dls + (t - s) * block;                          \
          if (softplus) {                                                                                    \
            _Pragma("omp simd")                                                                              \
            for (int64_t j = 0; j < bw; j++) dlt[j] = softplus_##SUF(dtt[j] + bias[j]);                      \
          } else {                                                                                           \
            _Pragma("omp simd")                                                                              \
            for (int64_t j = 0; j < bw; j++) dlt[j] = dtt[j] + bias[j];                                      \
          }                                                                                                  \
          for (int64_t j = 0; j < bw; j++) {                                                                 \
            const T delta = dlt[j], u = delta * xt[j];                                                       \
            const T *Ad = A + (d0 + j) * N, *hp = prev + j * stride;                                         \
            T *hd = cur + j * stride, *ad = as + ((t - s) * block + j) * stride;                             \
            _Pragma("omp simd")                                                                              \
            for (int64_t n = 0; n < NN; n++) {                                                               \
              const T a = EXP(delta * Ad[n]);                                                                \
              ad[n] = a;                                                                                     \
              hd[n] = a * hp[n] + Bt[n] * u;                                                                 \
            }                                                                                                \
          }                                                                                                  \
        }                                                                                                    \
        /* walk the segment backwards */                                                                     \
        for (int64_t t = e - 1; t >= s; t--) {                                                               \
          const int64_t pos = b * L + t;                                                                     \
          const T *xt = x + pos * D + d0, *dtt = dt + pos * D + d0, *Bt = Bm + pos * N, *Ct = Cm + pos * N;  \
          const T *gyt = gy + pos * D + d0, *dlt = dls + (t - s) * block;                                    \
          const T *prev = hs + (t - s) * block * stride, *cur = hs + (t - s + 1) * block * stride;           \
          if (z) { /* through the gate: gy reaches y as gout · silu(z), and z gets its own */                \
            const T *zt = z + pos * D + d0, *yp = ypre + pos * D + d0;                                       \
            T *gzt = gz + pos * D + d0;                                                                      \
            _Pragma("omp simd")                                                                              \
            for (int64_t j = 0; j < bw; j++) {                                                               \
              gyl[j] = gyt[j] * silu_##SUF(zt[j]);                                                           \
              gzt[j] = gyt[j] * yp[j] * dsilu_##SUF(zt[j]);                                                  \
            }                                                                                                \
          } else {                                                                                           \
            for (int64_t j = 0; j < bw; j++) gyl[j] = gyt[j];                                                \
          }                                                                                                  \
          for (int64_t j = 0; j < bw; j++) gDd[j] += gyl[j] * xt[j];                                         \
          for (int64_t n = 0; n < NN; n++) gBt[n] = gCt[n] = 0;                                              \
          for (int64_t j = 0; j < bw; j++) {                                                                 \
            const T delta = dlt[j], xv = xt[j], u = delta * xv, gyv = gyl[j];                                \
            const T *Ad = A + (d0 + j) * N, *hp = prev + j * stride, *hd = cur + j * stride;                 \
            const T *ad = as + ((t - s) * block + j) * stride;                                               \
            T *gd = g + j * stride, *gAd = gAs + j * stride;                                                 \
            T via_a = 0, via_u = 0; /* Σ_n g a h_{t-1} A and Σ_n g B */                                      \
            _Pragma("omp simd reduction(+:via_a, via_u)")                                                    \
            for (int64_t n = 0; n < NN; n++) {                                                               \
              const T a = ad[n];                        /* kept by the recompute */                          \
              const T gn = gd[n] + gyv * Ct[n];         /* the gradient reaching h_t */                      \
              const T gah = gn * a * hp[n];             /* ... through a_t, times a_t */                     \
              gCt[n] += gyv * hd[n];                                                                         \
              gBt[n] += gn * u;                                                                              \
              gAd[n] += gah * delta;                                                                         \
              via_a += gah * Ad[n];                                                                          \
              via_u += gn * Bt[n];                                                                           \
              gd[n] = gn * a;                           /* the gradient reaching h_{t-1} */                  \
            }                                                                                                \
            gdl[j] = via_a + via_u * xv;                                                                     \
            gx[pos * D + d0 + j] = via_u * delta + gyv * Dd[j];                                              \
          }                                                                                                  \
          T *gdtt = gdt + pos * D + d0;                                                                      \
          if (softplus) {                                                                                    \
            _Pragma("omp simd")                                                                              \
            for (int64_t j = 0; j < bw; j++) gdtt[j] = gdl[j] * dsoftplus_##SUF(dtt[j] + bias[j]);           \
          } else {                                                                                           \
            for (int64_t j = 0; j < bw; j++) gdtt[j] = gdl[j];                                               \
          }                                                                                                  \
          T *gBo = gBp + ((b * nblk + blk) * L + t) * N, *gCo = gCp + ((b * nblk + blk) * L + t) * N;        \
          for (int64_t n = 0; n < NN; n++) {                                                                 \
            gBo[n] = gBt[n];                                                                                 \
            gCo[n] = gCt[n];                                                                                 \
          }                                                                                                  \
        }                                                                                                    \
        for (int64_t j = 0; j < bw; j++)                                                                     \
          for (int64_t n = 0; n < NN; n++) gA[j * stride + n] += gAs[j * stride + n];                        \
      }                                                                                                      \
      for (int64_t j = 0; j < bw; j++)                                                                       \
        for (int64_t n = 0; n < NN; n++) {                                                                   \
          gh0[(b * D + d0 + j) * N + n] = g[j * stride + n];                                                 \
          gAp[(b * D + d0 + j) * N + n] = gA[j * stride + n];                                                \
        }                                                                                                    \
    }                                                                                                        \
    free(hs);                                                                                                \
    free(as);                                                                                                \
    free(dls);                                                                                               \
    free(g);                                                                                                 \
    free(gA);                                                                                                \
    free(gAs);                                                                                               \
    free(gBt);                                                                                               \
    free(gCt);                                                                                               \
    free(gyl);                                                                                               \
    free(gdl);                                                                                               \
    return status;                                                                                           \
  }

/* Each scan loop is compiled twice: for any N, and for N = 16 (Mamba's d_state, the course's every
 * model) with the trip count known, so the n loop is two whole AVX vectors with no remainder code
 * (measured 1.3x faster here). The entry points pick one; both compute the same thing in the same
 * order. */
DEFINE_SCAN(scan_f32_any, f32, float, expf, N)
DEFINE_SCAN(scan_f32_16, f32, float, expf, 16)
DEFINE_SCAN(scan_f64_any, f64, double, exp, N)
DEFINE_SCAN(scan_f64_16, f64, double, exp, 16)
DEFINE_SCAN_BWD(scan_bwd_f32_any, f32, float, expf, N)
DEFINE_SCAN_BWD(scan_bwd_f32_16, f32, float, expf, 16)
DEFINE_SCAN_BWD(scan_bwd_f64_any, f64, double, exp, N)
DEFINE_SCAN_BWD(scan_bwd_f64_16, f64, double, exp, 16)

/* ---------------------------------------------------------------- the mixer's convolution */
/* The Mamba mixer's causal depthwise convolution, forward and backward, as plain loops, with the
 * SiLU that follows it in the mixer optionally fused (the official causal_conv1d_fn's
 * activation="silu"): PyTorch's grouped conv1d spends milliseconds on the tiny (B, E, T) inputs of
 * this course's models, most of it in its backward. Per sequence b, position t and channel e, with
 * K taps:
 *     pre[b, t, e] = bias[e] + Σ_k w[e, k] · win[b, t + k, e]        y = pre, or silu(pre)
 * where win is the K − 1 carried inputs (state (B, E, K − 1), or zeros) followed by x (B, T, E).
 * The channel loop is innermost (contiguous in x and y), so it vectorises. One call computes the
 * sequences b_begin <= b < b_end; the backward writes per-sequence partial sums for w and bias
 * (gwp (B, K, E), gbp (B, E)), added up by the Python side, so any split gives the same bits.
 * wt is w transposed, (K, E); bias (E,) or NULL; gstate (B, E, K − 1) or NULL. With silu, pre is
 * kept where the backward will need it (NULL otherwise) and the backward is given it (NULL: no
 * activation). */
#define CONV_PTRS(T) const T *x, const T *state, const T *wt, const T *bias, T *y, T *pre
#define CONV_SIZES int64_t silu, int64_t Tn, int64_t E, int64_t K
#define CONV_PASS x, state, wt, bias, y, pre, silu, Tn, E, K
#define CONV_BWD_PTRS(T) const T *x, const T *state, const T *wt, const T *pre, const T *gy, T *gx, T *gstate, \
                         T *gwp, T *gbp
#define CONV_BWD_SIZES int64_t Tn, int64_t E, int64_t K
#define CONV_BWD_PASS x, state, wt, pre, gy, gx, gstate, gwp, gbp, Tn, E, K
#define DEFINE_CONV(NAME, SUF, T)                                                                            \
  static int NAME(CONV_PTRS(T), CONV_SIZES, int64_t b_begin, int64_t b_end) {                                \
    for (int64_t b = b_begin; b < b_end; b++)                                                                \
      for (int64_t t = 0; t < Tn; t++) {                                                                     \
        T *yt = y + (b * Tn + t) * E;                                                                        \
        for (int64_t e = 0; e < E; e++) yt[e] = bias ? bias[e] : (T)0;                                       \
        for (int64_t k = 0; k < K; k++) {                                                                    \
          const int64_t s = t + k - (K - 1);                                                                 \
          const T *wk = wt + k * E;                                                                          \
          if (s >= 0) {                                                                                      \
            const T *xs = x + (b * Tn + s) * E;                                                              \
            _Pragma("omp simd")                                                                              \
            for (int64_t e = 0; e < E; e++) yt[e] += wk[e] * xs[e];                                          \
          } else if (state) {                                                                                \
            for (int64_t e = 0; e < E; e++) yt[e] += wk[e] * state[(b * E + e) * (K - 1) + (K - 1 + s)];     \
          }                                                                                                  \
        }                                                                                                    \
        if (silu) {                                                                                          \
          if (pre)                                                                                           \
            for (int64_t e = 0; e < E; e++) pre[(b * Tn + t) * E + e] = yt[e];                               \
          _Pragma("omp simd")                                                                                \
          for (int64_t e = 0; e < E; e++) yt[e] = silu_##SUF(yt[e]);                                         \
        }                                                                                                    \
      }                                                                                                      \
    return 0;                                                                                                \
  }                                                                                                          \
  static int NAME##_bwd(CONV_BWD_PTRS(T), CONV_BWD_SIZES, int64_t b_begin, int64_t b_end) {                  \
    /* with the activation, one sequence's gradient of pre: gy · silu'(pre) */                               \
    T *gpre = pre ? (T *)malloc(sizeof(T) * Tn * E) : NULL;                                                  \
    if (pre && gpre == NULL) return -1;                                                                      \
    for (int64_t b = b_begin; b < b_end; b++) {                                                              \
      const T *gyb = gy + b * Tn * E;                                                                        \
      if (pre) {                                                                                             \
        const T *pb = pre + b * Tn * E;                                                                      \
        _Pragma("omp simd")                                                                                  \
        for (int64_t i = 0; i < Tn * E; i++) gpre[i] = gyb[i] * dsilu_##SUF(pb[i]);                          \
        gyb = gpre;                                                                                          \
      }                                                                                                      \
      T *gw = gwp + b * K * E, *gb = gbp + b * E;                                                            \
      for (int64_t i = 0; i < K * E; i++) gw[i] = 0;                                                         \
      for (int64_t e = 0; e < E; e++) gb[e] = 0;                                                             \
      for (int64_t s = -(K - 1); s < Tn; s++) { /* the gradient of win[s]: from y[s .. s + K − 1] */         \
        T *gs = s >= 0 ? gx + (b * Tn + s) * E : NULL;                                                       \
        if (gs)                                                                                              \
          for (int64_t e = 0; e < E; e++) gs[e] = 0;                                                         \
        for (int64_t k = 0; k < K; k++) {                                                                    \
          const int64_t t = s - k + (K - 1);                                                                 \
          if (t < 0 || t >= Tn) continue;                                                                    \
          const T *gyt = gyb + t * E, *wk = wt + k * E;                                                      \
          T *gwk = gw + k * E;                                                                               \
          if (gs) {                                                                                          \
            const T *xs = x + (b * Tn + s) * E;                                                              \
            _Pragma("omp simd")                                                                              \
            for (int64_t e = 0; e < E; e++) {                                                                \
              gs[e] += gyt[e] * wk[e];                                                                       \
              gwk[e] += gyt[e] * xs[e];                                                                      \
            }                                                                                                \
          } else {                                                                                           \
            for (int64_t e = 0; e < E; e++) {                                                                \
              const T v = state ? state[(b * E + e) * (K - 1) + (K - 1 + s)] : (T)0;                         \
              gwk[e] += gyt[e] * v;                                                                          \
              if (gstate) gstate[(b * E + e) * (K - 1) + (K - 1 + s)] += gyt[e] * wk[e];                     \
            }                                                                                                \
          }                                                                                                  \
        }                                                                                                    \
      }                                                                                                      \
      for (int64_t t = 0; t < Tn; t++) {                                                                     \
        const T *gyt = gyb + t * E;                                                                          \
        for (int64_t e = 0; e < E; e++) gb[e] += gyt[e];                                                     \
      }                                                                                                      \
    }                                                                                                        \
    free(gpre);                                                                                              \
    return 0;                                                                                                \
  }
DEFINE_CONV(conv_f32, f32, float)
DEFINE_CONV(conv_f64, f64, double)

/* ------------------------------------------------------------------------------------ RMSNorm */
/* RMSNorm (Zhang & Sennrich 2019), as torch.nn.RMSNorm, over the last axis of C features: per row
 *     r = 1 / sqrt(mean(x²) + eps)        y = x · r · w
 * and its backward, with g the gradient of y:
 *     gx = r · (g w − x r² mean(g w x))   gw = Σ_rows g x r
 * PyTorch composes it from six tensor operations forward and a dozen backward, each a pass over the
 * activations; here a row is read once each way. rstd (R,) keeps r for the backward. The backward's
 * unit is a group of RMS_ROWS rows, writing its own partial sum of gw into gwp (units, C), added up
 * by the Python side: the same bits for any split. */
#define RMS_ROWS 16
#define RMS_PTRS(T) const T *x, const T *w, T *y, T *rstd
#define RMS_SIZES double eps, int64_t C
#define RMS_PASS x, w, y, rstd, eps, C
#define RMS_BWD_PTRS(T) const T *x, const T *w, const T *rstd, const T *gy, T *gx, T *gwp
#define RMS_BWD_SIZES int64_t R, int64_t C
#define RMS_BWD_PASS x, w, rstd, gy, gx, gwp, R, C
#define DEFINE_RMS(NAME, T, SQRT)                                                                            \
  static int NAME(RMS_PTRS(T), RMS_SIZES, int64_t row_begin, int64_t row_end) {                              \
    for (int64_t r = row_begin; r < row_end; r++) {                                                          \
      const T *xr = x + r * C;                                                                               \
      T *yr = y + r * C, ss = 0;                                                                             \
      _Pragma("omp simd reduction(+:ss)")                                                                    \
      for (int64_t c = 0; c < C; c++) ss += xr[c] * xr[c];                                                   \
      const T rs = 1 / SQRT(ss / C + (T)eps);                                                                \
      rstd[r] = rs;                                                                                          \
      _Pragma("omp simd")                                                                                    \
      for (int64_t c = 0; c < C; c++) yr[c] = xr[c] * rs * w[c];                                             \
    }                                                                                                        \
    return 0;                                                                                                \
  }                                                                                                          \
  static int NAME##_bwd(RMS_BWD_PTRS(T), RMS_BWD_SIZES, int64_t unit_begin, int64_t unit_end) {              \
    for (int64_t unit = unit_begin; unit < unit_end; unit++) {                                               \
      T *gw = gwp + unit * C;                                                                                \
      for (int64_t c = 0; c < C; c++) gw[c] = 0;                                                             \
      const int64_t r1 = (unit + 1) * RMS_ROWS < R ? (unit + 1) * RMS_ROWS : R;                              \
      for (int64_t r = unit * RMS_ROWS; r < r1; r++) {                                                       \
        const T *xr = x + r * C, *gr = gy + r * C, rs = rstd[r];                                             \
        T *gxr = gx + r * C, dot = 0;                                                                        \
        _Pragma("omp simd reduction(+:dot)")                                                                 \
        for (int64_t c = 0; c < C; c++) dot += gr[c] * w[c] * xr[c];                                         \
        const T k = rs * rs * dot / C;                                                                       \
        _Pragma("omp simd")                                                                                  \
        for (int64_t c = 0; c < C; c++) {                                                                    \
          gxr[c] = rs * (gr[c] * w[c] - xr[c] * k);                                                          \
          gw[c] += gr[c] * xr[c] * rs;                                                                       \
        }                                                                                                    \
      }                                                                                                      \
    }                                                                                                        \
    return 0;                                                                                                \
  }
DEFINE_RMS(rms_f32, float, sqrtf)
DEFINE_RMS(rms_f64, double, sqrt)

/* ------------------------------------------------------------------------ the entry points */
/* onemask_<kernel>_<dtype>(pointers, sizes, begin, end): the range [begin, end) of rows or units,
 * with subnormals flushed; the scan's pick the N = 16 loop where N is 16. */
#define DEFINE_ENTRY(NAME, PTRS, SIZES, CALL)                                                                \
  int NAME(PTRS, SIZES, int64_t begin, int64_t end) {                                                        \
    int status_;                                                                                             \
    FLUSH_SUBNORMALS(CALL);                                                                                  \
    return status_;                                                                                          \
  }
DEFINE_ENTRY(onemask_scan_f32, SCAN_PTRS(float), SCAN_SIZES,
             (N == 16 ? scan_f32_16 : scan_f32_any)(SCAN_PASS, begin, end))
DEFINE_ENTRY(onemask_scan_f64, SCAN_PTRS(double), SCAN_SIZES,
             (N == 16 ? scan_f64_16 : scan_f64_any)(SCAN_PASS, begin, end))
DEFINE_ENTRY(onemask_scan_bwd_f32, SCAN_BWD_PTRS(float), SCAN_BWD_SIZES,
             (N == 16 ? scan_bwd_f32_16 : scan_bwd_f32_any)(SCAN_BWD_PASS, begin, end))
DEFINE_ENTRY(onemask_scan_bwd_f64, SCAN_BWD_PTRS(double), SCAN_BWD_SIZES,
             (N == 16 ? scan_bwd_f64_16 : scan_bwd_f64_any)(SCAN_BWD_PASS, begin, end))
DEFINE_ENTRY(onemask_conv_f32, CONV_PTRS(float), CONV_SIZES, conv_f32(CONV_PASS, begin, end))
DEFINE_ENTRY(onemask_conv_f64, CONV_PTRS(double), CONV_SIZES, conv_f64(CONV_PASS, begin, end))
DEFINE_ENTRY(onemask_conv_bwd_f32, CONV_BWD_PTRS(float), CONV_BWD_SIZES, conv_f32_bwd(CONV_BWD_PASS, begin, end))
DEFINE_ENTRY(onemask_conv_bwd_f64, CONV_BWD_PTRS(double), CONV_BWD_SIZES, conv_f64_bwd(CONV_BWD_PASS, begin, end))
DEFINE_ENTRY(onemask_rms_f32, RMS_PTRS(float), RMS_SIZES, rms_f32(RMS_PASS, begin, end))
DEFINE_ENTRY(onemask_rms_f64, RMS_PTRS(double), RMS_SIZES, rms_f64(RMS_PASS, begin, end))
DEFINE_ENTRY(onemask_rms_bwd_f32, RMS_BWD_PTRS(float), RMS_BWD_SIZES, rms_f32_bwd(RMS_BWD_PASS, begin, end))
DEFINE_ENTRY(onemask_rms_bwd_f64, RMS_BWD_PTRS(double), RMS_BWD_SIZES, rms_f64_bwd(RMS_BWD_PASS, begin, end))

#ifdef _OPENMP
#include <omp.h>
/* onemask_<kernel>_<dtype>_omp(pointers, sizes, total, threads): all rows or units 0 .. total-1,
 * split into equal contiguous ranges, one per OpenMP thread */
#define DEFINE_OMP(NAME, RANGE_FN, PTRS, SIZES, PASS)                                                        \
  int NAME(PTRS, SIZES, int64_t total, int64_t threads) {                                                    \
    int failed = 0;                                                                                          \
    _Pragma("omp parallel num_threads((int)threads) reduction(|:failed)")                                    \
    {                                                                                                        \
      const int64_t k = omp_get_thread_num(), m = omp_get_num_threads();                                     \
      failed |= RANGE_FN(PASS, total * k / m, total * (k + 1) / m);                                          \
    }                                                                                                        \
    return failed;                                                                                           \
  }
DEFINE_OMP(onemask_scan_f32_omp, onemask_scan_f32, SCAN_PTRS(float), SCAN_SIZES, SCAN_PASS)
DEFINE_OMP(onemask_scan_f64_omp, onemask_scan_f64, SCAN_PTRS(double), SCAN_SIZES, SCAN_PASS)
DEFINE_OMP(onemask_scan_bwd_f32_omp, onemask_scan_bwd_f32, SCAN_BWD_PTRS(float), SCAN_BWD_SIZES, SCAN_BWD_PASS)
DEFINE_OMP(onemask_scan_bwd_f64_omp, onemask_scan_bwd_f64, SCAN_BWD_PTRS(double), SCAN_BWD_SIZES, SCAN_BWD_PASS)
DEFINE_OMP(onemask_conv_f32_omp, onemask_conv_f32, CONV_PTRS(float), CONV_SIZES, CONV_PASS)
DEFINE_OMP(onemask_conv_f64_omp, onemask_conv_f64, CONV_PTRS(double), CONV_SIZES, CONV_PASS)
DEFINE_OMP(onemask_conv_bwd_f32_omp, onemask_conv_bwd_f32, CONV_BWD_PTRS(float), CONV_BWD_SIZES, CONV_BWD_PASS)
DEFINE_OMP(onemask_conv_bwd_f64_omp, onemask_conv_bwd_f64, CONV_BWD_PTRS(double), CONV_BWD_SIZES, CONV_BWD_PASS)
DEFINE_OMP(onemask_rms_f32_omp, onemask_rms_f32, RMS_PTRS(float), RMS_SIZES, RMS_PASS)
DEFINE_OMP(onemask_rms_f64_omp, onemask_rms_f64, RMS_PTRS(double), RMS_SIZES, RMS_PASS)
DEFINE_OMP(onemask_rms_bwd_f32_omp, onemask_rms_bwd_f32, RMS_BWD_PTRS(float), RMS_BWD_SIZES, RMS_BWD_PASS)
DEFINE_OMP(onemask_rms_bwd_f64_omp, onemask_rms_bwd_f64, RMS_BWD_PTRS(double), RMS_BWD_SIZES, RMS_BWD_PASS)
#endif
