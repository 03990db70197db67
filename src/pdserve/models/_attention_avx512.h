/* bfloat16 attention with AVX512-BF16 dot products (``vdpbf16ps``: 16 lanes, each adding
 * the two products of a pair of bf16 to an fp32 accumulator). Products of bf16 are exact in
 * fp32 and every sum is fp32; probabilities are rounded to bf16 for P.V, as torch's own CPU
 * flash-attention kernel does for bf16.
 *
 * Prefill: K and V of the whole context are first packed, 32 keys a tile, into the pair layouts
 * the dot product wants (K tile ``[hd/2][32 keys][2]``: a vector holds one dim pair of 16 keys;
 * V tile ``[16 key pairs][hd][2]``: a vector holds 16 dims of one key pair), then each work
 * item walks its query rows 4 at a time over the key tiles: S = Q.K^T for 4 rows x 32 keys in
 * 8 registers, the online-softmax update, then O += P.V with O in registers for the tile.
 * Decode: per key, the dot products of each query head in 16-lane partial sums, reduced 16
 * keys at a time by a transpose-add tree; P.V in fp32 FMAs over the bf16 values.
 */
#ifndef PDSERVE_ATTENTION_AVX512_H
#define PDSERVE_ATTENTION_AVX512_H

#include <immintrin.h>

#include "_attention_common.h"

static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5337580407503992e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339986571110785e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618519805371761e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550329014658928e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022646248340607e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471824645996e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

static inline __m512i bcast_pair(const bf16 *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline __m512 load_bf16_as_f32(const bf16 *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store_f32_as_bf16(bf16 *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}

/* bf16 elements of one packed K (or V) tile. */
static inline int64_t packed_tile_elems(int64_t hd) { return hd * kKeyTile; }

/* Pack keys [kt*32, kt*32 + 32) of KV head hk; keys past ctx are zero. */
static void avx512_pack_tile(const PrefillArgs &a, int64_t hk, int64_t kt, bf16 *kp, bf16 *vp) {
    const int64_t hd = a.hd, key0 = kt * kKeyTile;
    uint32_t *kp32 = (uint32_t *)kp;
    for (int64_t j = 0; j < kKeyTile; j++) {
        if (key0 + j < a.ctx) {
            const bf16 *kr = kv_row<bf16>(a.k, key0 + j, hk * hd);
            for (int64_t p = 0; p < hd / 2; p++) {
                uint32_t pair;
                memcpy(&pair, kr + 2 * p, 4);
                kp32[p * kKeyTile + j] = pair;
            }
        } else {
            for (int64_t p = 0; p < hd / 2; p++) kp32[p * kKeyTile + j] = 0;
        }
    }
    for (int64_t q = 0; q < kKeyTile / 2; q++) {
        for (int e = 0; e < 2; e++) {
            const int64_t t = key0 + 2 * q + e;
            bf16 *dst = vp + q * hd * 2 + e;
            if (t < a.ctx) {
                const bf16 *vr = kv_row<bf16>(a.v, t, hk * hd);
                for (int64_t d = 0; d < hd; d++) dst[2 * d] = vr[d];
            } else {
                for (int64_t d = 0; d < hd; d++) dst[2 * d] = 0;
            }
        }
    }
}

/* Per-thread floats an AVX-512 prefill item needs: O, l (16 lanes a row), m, alpha, and P
 * (4 rows of 32 bf16). */
static inline size_t avx512_prefill_floats(int64_t hd, int64_t rows) {
    return (size_t)((rows + 4) * (hd + 16) + 2 * (rows + 4) + 4 * 16);
}

/* O[rows] = O * alpha + P[rows] . V for PR rows of 16*NV dims (PR*NV accumulators). */
template <int NV, int PR>
static inline void pv_rows(float *o, const float *alpha, const uint32_t *P, const bf16 *vp,
                           int64_t hd) {
    __m512 acc[PR][NV];
    for (int r = 0; r < PR; r++) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
        for (int v = 0; v < NV; v++)
            acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * hd + v * 16), al);
    }
    for (int q = 0; q < kKeyTile / 2; q++) {
        __m512i vv[NV];
        for (int v = 0; v < NV; v++)
            vv[v] = _mm512_loadu_si512((const void *)(vp + (q * hd + v * 16) * 2));
        for (int r = 0; r < PR; r++) {
            const __m512i pb = _mm512_set1_epi32((int32_t)P[r * 16 + q]);
            for (int v = 0; v < NV; v++) acc[r][v] = dot2(acc[r][v], pb, vv[v]);
        }
    }
    for (int r = 0; r < PR; r++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + r * hd + v * 16, acc[r][v]);
}

template <int HD>
static void avx512_prefill_item(const PrefillArgs &a, const bf16 *kpack, const bf16 *vpack,
                                int64_t ntiles, int64_t hk, int64_t i0, int64_t i1, float *buf) {
    constexpr int NV = HD / 16;
    constexpr int PR = NV <= 4 ? 4 : 2;
    const int64_t g = a.nh / a.kvh, R = (i1 - i0) * g, p0 = a.ctx - a.n;
    const int64_t Rp = (R + 3) & ~(int64_t)3;
    float *o = buf, *l = o + Rp * HD, *m = l + Rp * 16, *al = m + Rp;
    uint32_t *P = (uint32_t *)(al + Rp); /* [4 rows][16 pairs] */
    const bf16 *qrow[kRowsPerItem + 4];
    int64_t pos[kRowsPerItem + 4];
    for (int64_t r = 0; r < Rp; r++) {
        const int64_t rr = r < R ? r : R - 1; /* padding rows repeat the last row */
        pos[r] = i0 + rr / g;
        qrow[r] = (const bf16 *)a.q + pos[r] * a.q_stride + (hk * g + rr % g) * HD;
        m[r] = -INFINITY;
    }
    memset(o, 0, Rp * HD * sizeof(float));
    memset(l, 0, Rp * 16 * sizeof(float));
    const __m512 c = _mm512_set1_ps(a.scale * kLog2e);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const int64_t nkt = (p0 + i1 + kKeyTile - 1) / kKeyTile;
    for (int64_t kt = 0; kt < nkt; kt++) {
        const bf16 *kp = kpack + (hk * ntiles + kt) * packed_tile_elems(HD);
        const bf16 *vp = vpack + (hk * ntiles + kt) * packed_tile_elems(HD);
        const int64_t key0 = kt * kKeyTile;
        for (int64_t rb = 0; rb < Rp; rb += 4) {
            if (key0 > p0 + pos[rb + 3]) continue; /* no row of the block sees this tile */
            __m512 s[4][2];
            for (int r = 0; r < 4; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
            for (int p = 0; p < HD / 2; p++) {
                const __m512i k0 = _mm512_loadu_si512((const void *)(kp + p * 64));
                const __m512i k1 = _mm512_loadu_si512((const void *)(kp + p * 64 + 32));
                for (int r = 0; r < 4; r++) {
                    const __m512i qb = bcast_pair(qrow[rb + r] + 2 * p);
                    s[r][0] = dot2(s[r][0], qb, k0);
                    s[r][1] = dot2(s[r][1], qb, k1);
                }
            }
            const bool diagonal = key0 + kKeyTile - 1 > p0 + pos[rb];
            for (int r = 0; r < 4; r++) {
                __m512 x0 = _mm512_mul_ps(s[r][0], c), x1 = _mm512_mul_ps(s[r][1], c);
                __mmask16 v0 = 0xffff, v1 = 0xffff;
                if (diagonal) {
                    const int64_t lim = p0 + pos[rb + r] - key0; /* keys j <= lim visible */
                    const uint32_t bits = lim >= 31 ? 0xffffffffu
                                          : lim < 0 ? 0u
                                                    : (uint32_t)((1ull << (lim + 1)) - 1);
                    v0 = (__mmask16)(bits & 0xffff);
                    v1 = (__mmask16)(bits >> 16);
                    x0 = _mm512_mask_mov_ps(neg_inf, v0, x0);
                    x1 = _mm512_mask_mov_ps(neg_inf, v1, x1);
                }
                const float mx = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
                const float mold = m[rb + r], mnew = mx > mold ? mx : mold;
                const __m512 mv = _mm512_set1_ps(mnew);
                const __m512 e0 = _mm512_maskz_mov_ps(v0, exp2_ps(_mm512_sub_ps(x0, mv)));
                const __m512 e1 = _mm512_maskz_mov_ps(v1, exp2_ps(_mm512_sub_ps(x1, mv)));
                /* mold = -inf (first tile): 2^-126 times the zero l and O. */
                const __m512 alpha = exp2_ps(_mm512_set1_ps(mold - mnew));
                float *lr = l + (rb + r) * 16; /* the row's sum, kept in 16 lanes */
                _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), alpha,
                                                     _mm512_add_ps(e0, e1)));
                m[rb + r] = mnew;
                al[rb + r] = _mm512_cvtss_f32(alpha);
                _mm512_storeu_si512((void *)(P + r * 16), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
            for (int r = 0; r < 4; r += PR)
                pv_rows<NV, PR>(o + (rb + r) * HD, al + rb + r, P + r * 16, vp, HD);
        }
    }
    const int64_t nh = a.nh;
    for (int64_t r = 0; r < R; r++) {
        bf16 *dst = (bf16 *)a.out + (i0 + r / g) * nh * HD + (hk * g + r % g) * HD;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + r * 16)));
        for (int v = 0; v < NV; v++)
            store_f32_as_bf16(dst + v * 16,
                              _mm512_mul_ps(_mm512_loadu_ps(o + r * HD + v * 16), inv));
    }
}

/* Lane i of the result = the sum of the 16 lanes of v[i] (a transpose-add tree). */
static inline __m512 hsum16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int k = 0; k < 8; k++)
        w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
        x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int k = 0; k < 2; k++)
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                         _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
}

/* o[h] += sum_j p[h][j] * V[j] over keys [j0, j0 + n) for HC heads (HC * NV accumulators). */
template <int NV, int HC>
static inline void decode_pv(float *o, const float *s, const bf16 *const *vrows, int64_t n,
                             int64_t hd) {
    __m512 acc[HC][NV];
    for (int h = 0; h < HC; h++)
        for (int v = 0; v < NV; v++) acc[h][v] = _mm512_loadu_ps(o + h * hd + v * 16);
    for (int64_t j = 0; j < n; j++) {
        if (j + 8 < n)
            for (int b = 0; b < NV * 32; b += 64) _mm_prefetch((const char *)vrows[j + 8] + b, _MM_HINT_T0);
        __m512 vf[NV];
        for (int v = 0; v < NV; v++) vf[v] = load_bf16_as_f32(vrows[j] + v * 16);
        for (int h = 0; h < HC; h++) {
            const __m512 p = _mm512_set1_ps(s[h * kDecodePart + j]);
            for (int v = 0; v < NV; v++) acc[h][v] = _mm512_fmadd_ps(p, vf[v], acc[h][v]);
        }
    }
    for (int h = 0; h < HC; h++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + h * hd + v * 16, acc[h][v]);
}

template <int HD>
static void avx512_decode_item(const DecodeArgs &a, const DecodeItem &it, float *buf,
                               float *parts) {
    constexpr int NQ = HD / 32, NV = HD / 16, HC = NV <= 4 ? 4 : 2;
    const int64_t g = a.nh / a.kvh, n = it.j1 - it.j0;
    float *o = buf, *s = o + g * HD, *m = s + g * kDecodePart, *l = m + g;
    const bf16 *krows[kDecodePart], *vrows[kDecodePart];
    const int64_t *table = a.tables + a.table_starts[it.seq];
    const int64_t tok = a.kvh * HD, bstride = tok << a.block_shift;
    const int64_t bmask = ((int64_t)1 << a.block_shift) - 1;
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = it.j0 + j;
        const int64_t off = table[t >> a.block_shift] * bstride + (t & bmask) * tok + it.hk * HD;
        krows[j] = (const bf16 *)a.k_cache + off;
        vrows[j] = (const bf16 *)a.v_cache + off;
    }
    const bf16 *qh = (const bf16 *)a.q + it.seq * a.q_stride + it.hk * g * HD;
    const __m512 c = _mm512_set1_ps(a.scale * kLog2e);
    for (int64_t h = 0; h < g; h++) {
        __m512i qv[NQ];
        for (int k = 0; k < NQ; k++) qv[k] = _mm512_loadu_si512((const void *)(qh + h * HD + 32 * k));
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t jb = 0; jb < n; jb += 16) {
            __m512 acc[16];
            const int64_t cnt = n - jb < 16 ? n - jb : 16;
            for (int64_t k = jb + 16; h == 0 && k < jb + 32 && k < n; k++) /* the next 16 keys */
                for (int b = 0; b < HD * 2; b += 64) _mm_prefetch((const char *)krows[k] + b, _MM_HINT_T0);
            for (int k = 0; k < 16; k++) {
                const bf16 *kr = krows[jb + (k < cnt ? k : cnt - 1)];
                __m512 a0 = dot2(_mm512_setzero_ps(), qv[0], _mm512_loadu_si512((const void *)kr));
                for (int q = 1; q < NQ; q++)
                    a0 = dot2(a0, qv[q], _mm512_loadu_si512((const void *)(kr + 32 * q)));
                acc[k] = a0;
            }
            const __mmask16 valid = (__mmask16)(cnt == 16 ? 0xffff : (1u << cnt) - 1);
            const __m512 sc = _mm512_mul_ps(hsum16(acc), c);
            mx = _mm512_mask_max_ps(mx, valid, mx, sc);
            _mm512_storeu_ps(s + h * kDecodePart + jb, sc);
        }
        const float mh = _mm512_reduce_max_ps(mx);
        const __m512 mv = _mm512_set1_ps(mh);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t jb = 0; jb < n; jb += 16) {
            const int64_t cnt = n - jb < 16 ? n - jb : 16;
            const __mmask16 valid = (__mmask16)(cnt == 16 ? 0xffff : (1u << cnt) - 1);
            float *sp = s + h * kDecodePart + jb;
            const __m512 e = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sp), mv)));
            _mm512_storeu_ps(sp, e);
            sum = _mm512_add_ps(sum, e);
        }
        m[h] = mh;
        l[h] = _mm512_reduce_add_ps(sum);
    }
    memset(o, 0, g * HD * sizeof(float));
    int64_t h = 0;
    for (; h + HC <= g; h += HC) decode_pv<NV, HC>(o + h * HD, s + h * kDecodePart, vrows, n, HD);
    for (; h < g; h++) decode_pv<NV, 1>(o + h * HD, s + h * kDecodePart, vrows, n, HD);
    if (it.part < 0) {
        bf16 *dst = (bf16 *)a.out + it.seq * a.nh * HD + it.hk * g * HD;
        for (int64_t hh = 0; hh < g; hh++) {
            const __m512 inv = _mm512_set1_ps(1.0f / l[hh]);
            for (int v = 0; v < NV; v++)
                store_f32_as_bf16(dst + hh * HD + v * 16,
                                  _mm512_mul_ps(_mm512_loadu_ps(o + hh * HD + v * 16), inv));
        }
    } else {
        float *p = parts + it.part * g * (HD + 2);
        memcpy(p, m, g * sizeof(float));
        memcpy(p + g, l, g * sizeof(float));
        memcpy(p + 2 * g, o, g * HD * sizeof(float));
    }
}

#endif
