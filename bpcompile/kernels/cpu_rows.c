/* y = x w^T for a few rows of x in float32 on x86-64 CPUs with AVX-512: the products of a batch-1 decode step
 * (one row) and of a speculative tree verify (2-16 rows: a tree, or a batch of them). Why hand-written: at 2
 * threads the BLAS and oneDNN kernels read the weights at full bandwidth for one row, but for 6 rows they cost
 * 1.5-2x as much (they are built for larger batches); this kernel reads each weight row once for all rows of x
 * and (for several rows) prefetches ahead so that the FMAs hide under the weight stream. Every output is one dot
 * product accumulated in the same order whatever the number of rows, so a row's result does not depend on the
 * rows beside it.
 *
 * x: R x K, w: N x K, y: R x N, all row-major and contiguous; 1 <= R <= 16. Built with -fopenmp: linked into a
 * process that has loaded PyTorch it shares PyTorch's OpenMP runtime (same soname) and thread count. */
#include <immintrin.h>

#ifndef __AVX512F__
#error "cpu_rows needs AVX-512F"
#endif

#define PF 2048 /* floats ahead (8 KiB) to prefetch in each weight stream */

static inline __attribute__((always_inline)) void block(const float *x, long K, const float *w, float *y, long N,
                                                        long n0, const int R, const int NB)
{
    __m512 acc[8][16], wv[8];
    _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++)
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[b][r] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) {
            wv[b] = _mm512_loadu_ps(w + (n0 + b) * K + k);
            if (R > 1) /* one row is bandwidth-bound: the hardware prefetchers do better alone */
                _mm_prefetch((const char *)(w + (n0 + b) * K + k + PF), _MM_HINT_T0);
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_loadu_ps(x + r * K + k);
            _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) acc[b][r] = _mm512_fmadd_ps(xv, wv[b], acc[b][r]);
        }
    }
    if (k < K) { /* the last K % 16 columns, masked */
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) wv[b] = _mm512_maskz_loadu_ps(m, w + (n0 + b) * K + k);
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + k);
            _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) acc[b][r] = _mm512_fmadd_ps(xv, wv[b], acc[b][r]);
        }
    }
    _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++)
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) y[r * N + n0 + b] = _mm512_reduce_add_ps(acc[b][r]);
}

/* NB weight rows at a time, as many as leave registers for R x NB accumulators. */
#define RUN(R, NB)                                                                                             \
    {                                                                                                          \
        long nb = N / NB;                                                                                      \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (long i = 0; i < nb; i++)        \
            block(x, K, w, y, N, i * NB, R, NB);                                                               \
        for (long n = nb * NB; n < N; n++) block(x, K, w, y, N, n, R, 1);                                      \
        return 0;                                                                                              \
    }

int bpc_rows_matmul(const float *x, long R, long K, const float *w, long N, float *y, int threads)
{
    switch (R) {
    case 1: RUN(1, 8)
    case 2: RUN(2, 6)
    case 3: RUN(3, 4)
    case 4: RUN(4, 4)
    case 5: RUN(5, 3)
    case 6: RUN(6, 3)
    case 7: RUN(7, 2)
    case 8: RUN(8, 2)
    case 9: RUN(9, 2)
    case 10: RUN(10, 2)
    case 11: RUN(11, 2)
    case 12: RUN(12, 2)
    case 13: RUN(13, 1)
    case 14: RUN(14, 1)
    case 15: RUN(15, 1)
    case 16: RUN(16, 1)
    }
    return 1;
}
