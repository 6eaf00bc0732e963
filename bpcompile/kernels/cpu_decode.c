/* Attention of a few queries of one sequence on CPU (a decode step, a speculative tree verify), in one call: put
 * the new tokens' keys and values into the sequence's cache, then attend over its entries with grouped query
 * heads. Why hand-written: at batch 1 the PyTorch path is one to two dozen small ops a layer (index writes,
 * views, batched products, a mask, a softmax; with a plan's exact entries a gather and a concatenation too)
 * whose dispatch costs more than their arithmetic (on an Intel Xeon at 2 threads ~50-100 us a layer for a few
 * hundred entries of SmolLM2, 2-3 ms of a 35-40 ms step); this does the same arithmetic in 5-20 us.
 *
 * The entries are a run [a0, a1) of a float32 cache K, V [KV, S, D] (head stride hs floats: entry j of head g at
 * K + g * hs + j * D) followed by m columns cols[] of an FP16 cache Kh, Vh [KV, C, D] (head stride hsh): a
 * plan's dense copy of its stored codes and its exact FP16 copies (sink and recent window); either may be
 * empty. q: [T, H, D], T queries; query head h reads KV head h / (H / KV); out: [T, H, D]. mask: [T, n] bytes,
 * query t sees entry j (run first, then columns) where mask[t * n + j] is non-zero, or NULL: every query sees
 * every entry; a query that sees none gets zeros. knew, vnew [T, KV, D] (or NULL): the new entries, written
 * first at entries wa[t] of the float32 cache (rounded through IEEE half precision when round16, so that it holds
 * what an FP16 store returns) or at columns wb[t] of the FP16 cache (wa, wb: NULL for none). Scores are
 * q . k * scale in float32, a max-subtracted softmax in float32, then the weighted sum of values: PyTorch's
 * arithmetic, summed in another order. Built with -fopenmp: it shares PyTorch's OpenMP runtime and takes its
 * thread count. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the vector path: AVX-512 with byte and 128-bit forms (the mask compare); elsewhere portable C */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BPC_AVX512 1
#include <immintrin.h>
#endif

#if defined(__FLT16_MAX__)
static inline float half_round(float x) { return (float)(_Float16)x; }
static inline uint16_t to_half(float x)
{
    _Float16 h = (_Float16)x;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}
static inline float from_half(uint16_t u)
{
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float)h;
}
#elif defined(__F16C__)
#include <immintrin.h>
static inline float half_round(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }
static inline uint16_t to_half(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
static inline float from_half(uint16_t u) { return _cvtsh_ss(u); }
#else
#error "cpu_decode needs _Float16 or F16C"
#endif

/* the entries one KV head reads: a run of a float32 cache and columns of an FP16 one */
typedef struct {
    const float *K, *V; /* at the run's first entry */
    long na;
    const uint16_t *Kh, *Vh;
    const long *cols;
    long m;
} entries;

/* e^x for x <= 0 (a softmax's shifted scores): Cephes' expf polynomial with a power of two put into the exponent
 * bits, within 8.5e-8 relative of e^x over [-87, 0] (measured against double precision at 2e7 points; libm's
 * expf is a call per element, this is plain arithmetic, and exp_neg16 below is the same on 16 lanes, equal to it
 * bit for bit). Below -87 it returns 0 (e^-87 ~ 1.6e-38 is 0 next to the maximum's e^0 = 1), so a masked entry's
 * -inf score weighs exactly 0. */
static inline float exp_neg(float x)
{
    if (x < -87.0f)
        return 0.0f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } s = {.i = ((int32_t)n + 127) << 23};
    return p * s.f;
}

#ifdef BPC_AVX512
/* lane i of the result = the sum of v[i]'s lanes: 16 horizontal sums in 45 shuffles and adds (one reduction
 * each would take ~8) */
static inline __m512 sum16(__m512 v[16])
{
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* each 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* each 128-bit lane: the lane's sums of v4i .. v4i+3 */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) /* [v8i..+3 lanes 0+1, lanes 2+3, v8i+4..+7 lanes 0+1, lanes 2+3] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp_neg on 16 lanes, the same arithmetic (scalef multiplies by 2^n as the exponent bits do) */
static inline __m512 exp_neg16(__m512 x)
{
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* the T x rep query heads of one KV head over its entries, D a multiple of 16 known at compile time (the call
 * sites pass 64 and 128) so that a query and its accumulators stay in registers. The run is taken a block at a
 * time for every query head of the group: a block is read from memory once and by the other heads from the L1
 * cache (reading each entry once per query head made the kernel bound by L2 bandwidth). q, out: the group's first
 * head, qs floats from one query to the next; w: T x rep x n. */
static inline __attribute__((always_inline)) void group16(const float *q, long qs, entries e, const unsigned char *mask,
                                                          const int D, int T, int rep, float scale, float *w,
                                                          float *out)
{
    enum { BLK = 32 };
    const int B = D / 16, Q = T * rep;
    const long na = e.na, n = e.na + e.m;
    float m[Q], sum[Q];
    for (int i = 0; i < Q; i++) m[i] = -INFINITY;
    __m512 acc[16];
    long j = 0;
    for (; j + 16 <= na; j += 16) /* 16 scores at a time */
        for (int t = 0; t < T; t++) {
            __mmask16 hide = 0;
            if (mask != NULL)
                hide = _mm_cmpeq_epi8_mask(_mm_loadu_si128((const __m128i *)(mask + t * n + j)), _mm_setzero_si128());
            for (int r = 0; r < rep; r++) {
                __m512 qv[B];
                for (int b = 0; b < B; b++)
                    qv[b] = _mm512_mul_ps(_mm512_loadu_ps(q + t * qs + r * D + 16 * b), _mm512_set1_ps(scale));
                for (int i = 0; i < 16; i++) {
                    const float *k = e.K + (j + i) * D;
                    acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
                    for (int b = 1; b < B; b++) acc[i] = _mm512_fmadd_ps(qv[b], _mm512_loadu_ps(k + 16 * b), acc[i]);
                }
                __m512 sc = _mm512_mask_mov_ps(sum16(acc), hide, _mm512_set1_ps(-INFINITY));
                int i = t * rep + r;
                m[i] = fmaxf(m[i], _mm512_reduce_max_ps(sc));
                _mm512_storeu_ps(w + i * n + j, sc);
            }
        }
    for (; j < n; j++) { /* the run's tail, then the FP16 columns */
        __m512 kv[B];
        for (int b = 0; b < B; b++)
            kv[b] = j < na ? _mm512_loadu_ps(e.K + j * D + 16 * b)
                           : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(e.Kh + e.cols[j - na] * D + 16 * b)));
        for (int t = 0; t < T; t++)
            for (int r = 0; r < rep; r++) {
                int i = t * rep + r;
                if (mask != NULL && !mask[t * n + j]) {
                    w[i * n + j] = -INFINITY;
                    continue;
                }
                __m512 a = _mm512_setzero_ps();
                for (int b = 0; b < B; b++)
                    a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(q + t * qs + r * D + 16 * b), _mm512_set1_ps(scale)),
                                        kv[b], a);
                float s = _mm512_reduce_add_ps(a);
                w[i * n + j] = s;
                m[i] = s > m[i] ? s : m[i];
            }
    }
    for (int i = 0; i < Q; i++) {
        float *wi = w + i * n;
        if (m[i] == -INFINITY) { /* sees nothing */
            for (j = 0; j < n; j++) wi[j] = 0.0f;
            sum[i] = 1.0f;
            continue;
        }
        __m512 sv = _mm512_setzero_ps();
        for (j = 0; j + 16 <= n; j += 16) {
            __m512 x = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(wi + j), _mm512_set1_ps(m[i])));
            sv = _mm512_add_ps(sv, x);
            _mm512_storeu_ps(wi + j, x);
        }
        sum[i] = _mm512_reduce_add_ps(sv);
        for (; j < n; j++) {
            wi[j] = exp_neg(wi[j] - m[i]);
            sum[i] += wi[j];
        }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < rep; r++)
            for (int b = 0; b < B; b++) _mm512_storeu_ps(out + t * qs + r * D + 16 * b, _mm512_setzero_ps());
    for (long j0 = 0; j0 < na; j0 += BLK) {
        long j1 = j0 + BLK < na ? j0 + BLK : na;
        for (int t = 0; t < T; t++)
            for (int r = 0; r < rep; r++) {
                const float *wi = w + (t * rep + r) * n;
                float *o_ = out + t * qs + r * D;
                __m512 o[2][B]; /* two entries in flight: one accumulator chain would wait on each FMA's latency */
                for (int b = 0; b < B; b++) {
                    o[0][b] = _mm512_loadu_ps(o_ + 16 * b);
                    o[1][b] = _mm512_setzero_ps();
                }
                for (j = j0; j + 2 <= j1; j += 2)
                    for (int u = 0; u < 2; u++) {
                        __m512 p = _mm512_set1_ps(wi[j + u]);
                        for (int b = 0; b < B; b++)
                            o[u][b] = _mm512_fmadd_ps(p, _mm512_loadu_ps(e.V + (j + u) * D + 16 * b), o[u][b]);
                    }
                if (j < j1) {
                    __m512 p = _mm512_set1_ps(wi[j]);
                    for (int b = 0; b < B; b++)
                        o[0][b] = _mm512_fmadd_ps(p, _mm512_loadu_ps(e.V + j * D + 16 * b), o[0][b]);
                }
                for (int b = 0; b < B; b++) _mm512_storeu_ps(o_ + 16 * b, _mm512_add_ps(o[0][b], o[1][b]));
            }
    }
    for (j = 0; j < e.m; j++) {
        __m512 vv[B];
        for (int b = 0; b < B; b++)
            vv[b] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(e.Vh + e.cols[j] * D + 16 * b)));
        for (int t = 0; t < T; t++)
            for (int r = 0; r < rep; r++) {
                __m512 p = _mm512_set1_ps(w[(t * rep + r) * n + na + j]);
                float *o_ = out + t * qs + r * D;
                for (int b = 0; b < B; b++)
                    _mm512_storeu_ps(o_ + 16 * b, _mm512_fmadd_ps(p, vv[b], _mm512_loadu_ps(o_ + 16 * b)));
            }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < rep; r++) {
            float *o_ = out + t * qs + r * D;
            __m512 inv = _mm512_set1_ps(1.0f / sum[t * rep + r]);
            for (int b = 0; b < B; b++) _mm512_storeu_ps(o_ + 16 * b, _mm512_mul_ps(_mm512_loadu_ps(o_ + 16 * b), inv));
        }
}
#endif

/* key or value j of the entries, as float32 */
static inline float at(const float *F, const uint16_t *Hh, const long *cols, long na, long j, int D, int d)
{
    return j < na ? F[j * D + d] : from_half(Hh[cols[j - na] * D + d]);
}

/* one query head over the entries it sees (vis: n bytes or NULL), any head size: the portable path */
static void one_head(const float *q, entries e, const unsigned char *vis, int D, float scale, float *w, float *out)
{
    const long n = e.na + e.m;
    float qs[256], o[256] = {0};
    for (int d = 0; d < D; d++) qs[d] = q[d] * scale;
    float m = -INFINITY;
    for (long j = 0; j < n; j++) {
        if (vis != NULL && !vis[j]) {
            w[j] = -INFINITY;
            continue;
        }
        float s = 0.0f;
        for (int d = 0; d < D; d++) s += qs[d] * at(e.K, e.Kh, e.cols, e.na, j, D, d);
        w[j] = s;
        m = s > m ? s : m;
    }
    if (m == -INFINITY) { /* sees nothing */
        for (int d = 0; d < D; d++) out[d] = 0.0f;
        return;
    }
    float sum = 0.0f;
    for (long j = 0; j < n; j++) {
        w[j] = exp_neg(w[j] - m);
        sum += w[j];
    }
    for (long j = 0; j < n; j++)
        if (w[j] != 0.0f)
            for (int d = 0; d < D; d++) o[d] += w[j] * at(e.V, e.Vh, e.cols, e.na, j, D, d);
    for (int d = 0; d < D; d++) out[d] = o[d] / sum;
}

int bpc_attention(const float *q, int T, int H, int KV, int D, float scale, float *K, float *V, long hs, long a0,
                  long a1, uint16_t *Kh, uint16_t *Vh, long hsh, const long *cols, long m, const unsigned char *mask,
                  const float *knew, const float *vnew, const long *wa, const long *wb, int round16, float *out,
                  int threads)
{
    if (T < 1 || KV < 1 || H % KV || D < 1 || D > 256 || a0 < 0 || a1 < a0 || m < 0 || a1 - a0 + m < 1)
        return 1;
    if (knew != NULL)
        for (int t = 0; t < T; t++)
            for (int g = 0; g < KV; g++)
                for (int d = 0; d < D; d++) {
                    float k = knew[(t * KV + g) * D + d], v = vnew[(t * KV + g) * D + d];
                    if (wa != NULL) {
                        K[g * hs + wa[t] * D + d] = round16 ? half_round(k) : k;
                        V[g * hs + wa[t] * D + d] = round16 ? half_round(v) : v;
                    }
                    if (wb != NULL) {
                        Kh[g * hsh + wb[t] * D + d] = to_half(k);
                        Vh[g * hsh + wb[t] * D + d] = to_half(v);
                    }
                }
    const long n = a1 - a0 + m;
    int rep = H / KV, bad = 0;
    /* a few hundred entries: forking threads costs more than it saves */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && KV > 1 && T * n * H * D >= (1L << 18))
    for (int g = 0; g < KV; g++) {
        float *w = malloc((size_t)T * rep * n * sizeof(float));
        if (w == NULL) {
#pragma omp atomic write
            bad = 1;
            continue;
        }
        entries e = {K + g * hs + a0 * D, V + g * hs + a0 * D, a1 - a0,
                     m ? Kh + g * hsh : NULL, m ? Vh + g * hsh : NULL, cols, m};
        const float *qg = q + g * rep * D;
        float *og = out + g * rep * D;
#ifdef BPC_AVX512
        if (D == 64)
            group16(qg, (long)H * D, e, mask, 64, T, rep, scale, w, og);
        else if (D == 128)
            group16(qg, (long)H * D, e, mask, 128, T, rep, scale, w, og);
        else
#endif
            for (int t = 0; t < T; t++)
                for (int r = 0; r < rep; r++)
                    one_head(qg + t * H * D + r * D, e, mask == NULL ? NULL : mask + t * n, D, scale, w,
                             og + t * H * D + r * D);
        free(w);
    }
    return bad ? 2 : 0;
}
