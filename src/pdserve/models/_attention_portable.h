/* Attention in plain C++ over float32 or bfloat16 inputs, fp32 arithmetic throughout: the path
 * for float32 models and for CPUs without AVX512-BF16. The loops are written so the compiler
 * vectorizes them (inner loops over 32 keys or over head_dim, no reductions across lanes).
 *
 * Prefill (flash-attention style): a work item is up to ``kRowsPerItem`` query rows
 * (consecutive positions x the query heads sharing one KV head); it walks key tiles of
 * ``kKeyTile`` keys up to its last position, keeping a running max ``m``, sum ``l`` and
 * unnormalised output ``o`` per row (the online softmax), and masks keys past each row's own
 * position inside the diagonal tile. Decode: a work item scores its keys, takes the softmax
 * in two passes over a score buffer, and sums the values; split sequences are merged after.
 */
#ifndef PDSERVE_ATTENTION_PORTABLE_H
#define PDSERVE_ATTENTION_PORTABLE_H

#include "_attention_common.h"

/* Vectors as the build's widest float registers (GCC vector extensions): 16 lanes with
 * AVX-512, 8 with AVX, 4 otherwise (SSE2, NEON). */
#if defined(__AVX512F__)
#define ATTN_VW 16
#define ATTN_BLOCK 4 /* 32 registers: 4 x 4 accumulators */
#elif defined(__AVX__)
#define ATTN_VW 8
#define ATTN_BLOCK 2 /* 16 registers: 2 x 4 accumulators */
#else
#define ATTN_VW 4
#define ATTN_BLOCK 2
#endif
typedef float vf __attribute__((vector_size(ATTN_VW * 4)));
typedef int32_t vi __attribute__((vector_size(ATTN_VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(ATTN_VW * 4), aligned(4)));
static const int kVW = ATTN_VW;
static const int kRowVecs = 4; /* row vectors per register block */

static inline vf vload(const float *p) { return *(const vf_unaligned *)p; }
static inline void vstore(float *p, vf x) { *(vf_unaligned *)p = x; }
static inline vf vsplat(float x) { return x - (vf){}; }

/* exp2_approx on a vector (round-to-nearest by the 1.5 * 2^23 trick; |x| < 2^22 here). */
static inline vf vexp2(vf x) {
    x = x < vsplat(-126.0f) ? vsplat(-126.0f) : x;
    const vf n = (x + 12582912.0f) - 12582912.0f;
    const vf f = x - n;
    vf p = vsplat(1.5337580407503992e-4f);
    p = p * f + 1.339986571110785e-3f;
    p = p * f + 9.618519805371761e-3f;
    p = p * f + 5.550329014658928e-2f;
    p = p * f + 2.4022646248340607e-1f;
    p = p * f + 6.931471824645996e-1f;
    p = p * f + 1.0f;
    return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
}

/* Per-thread floats a portable prefill item needs (rows padded to whole vectors):
 * Q^T, O^T [hd][rows]; S^T/P^T [32][rows]; m, l, alpha, key limit [rows]; K, V tile rows. */
static inline size_t portable_prefill_floats(int64_t hd, int64_t rows) {
    const int64_t rp = (rows + kVW - 1) / kVW * kVW;
    return (size_t)(2 * hd * rp + kKeyTile * rp + 4 * rp + 2 * kKeyTile * hd);
}

/* S^T[j][rows] = K[j] . Q^T for KB keys x RB row vectors (rows as lanes: no horizontal sums). */
template <int KB, int RB>
static inline void st_block(float *st, const float *qt, const float *kf, int64_t hd, int64_t rp) {
    vf acc[KB][RB] = {};
    for (int64_t d = 0; d < hd; d++) {
        vf qv[RB];
        for (int v = 0; v < RB; v++) qv[v] = vload(qt + d * rp + v * kVW);
        for (int k = 0; k < KB; k++) {
            const float kd = kf[k * hd + d];
            for (int v = 0; v < RB; v++) acc[k][v] += kd * qv[v];
        }
    }
    for (int k = 0; k < KB; k++)
        for (int v = 0; v < RB; v++) vstore(st + k * rp + v * kVW, acc[k][v]);
}

/* O^T[d][rows] = O^T * alpha + sum_j V[j][d] * P^T[j] for DB dims x RB row vectors. */
template <int DB, int RB>
static inline void ot_block(float *ot, const float *alpha, const float *pt, const float *vf_,
                            int64_t nk, int64_t hd, int64_t rp) {
    vf acc[DB][RB];
    for (int dd = 0; dd < DB; dd++)
        for (int v = 0; v < RB; v++)
            acc[dd][v] = vload(ot + dd * rp + v * kVW) * vload(alpha + v * kVW);
    for (int64_t j = 0; j < nk; j++) {
        vf pv[RB];
        for (int v = 0; v < RB; v++) pv[v] = vload(pt + j * rp + v * kVW);
        for (int dd = 0; dd < DB; dd++) {
            const float vd = vf_[j * hd + dd];
            for (int v = 0; v < RB; v++) acc[dd][v] += vd * pv[v];
        }
    }
    for (int dd = 0; dd < DB; dd++)
        for (int v = 0; v < RB; v++) vstore(ot + dd * rp + v * kVW, acc[dd][v]);
}

/* A work item: query rows = positions i0 .. i1 x the g query heads of KV head hk, held
 * transposed (rows as vector lanes), so the online softmax is lane-wise. */
template <typename T>
static void portable_prefill_item(const PrefillArgs &a, int64_t hk, int64_t i0, int64_t i1,
                                  float *buf) {
    const int64_t hd = a.hd, g = a.nh / a.kvh, R = (i1 - i0) * g, p0 = a.ctx - a.n;
    const int64_t rv = (R + kVW - 1) / kVW, rp = rv * kVW;
    float *qt = buf, *ot = qt + hd * rp, *st = ot + hd * rp, *m = st + kKeyTile * rp;
    float *l = m + rp, *al = l + rp, *lim = al + rp, *kf = lim + rp, *vf_ = kf + kKeyTile * hd;
    const float c = a.scale * kLog2e;
    for (int64_t r = 0; r < rp; r++) {
        const int64_t rr = r < R ? r : R - 1; /* padding rows repeat the last row */
        const int64_t pos = i0 + rr / g;
        const T *src = (const T *)a.q + pos * a.q_stride + (hk * g + rr % g) * hd;
        for (int64_t d = 0; d < hd; d++) {
            qt[d * rp + r] = to_f<T>(src[d]) * c;
            ot[d * rp + r] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
        lim[r] = (float)(p0 + pos); /* the row's last visible key */
    }
    const int64_t nkeys = p0 + i1;
    for (int64_t key0 = 0; key0 < nkeys; key0 += kKeyTile) {
        const int64_t nk = nkeys - key0 < kKeyTile ? nkeys - key0 : kKeyTile;
        for (int64_t j = 0; j < kKeyTile; j++) { /* the tile's K and V rows in fp32 */
            const T *kr = j < nk ? kv_row<T>(a.k, key0 + j, hk * hd) : nullptr;
            const T *vr = j < nk ? kv_row<T>(a.v, key0 + j, hk * hd) : nullptr;
            for (int64_t d = 0; d < hd; d++) {
                kf[j * hd + d] = kr ? to_f<T>(kr[d]) : 0.0f;
                vf_[j * hd + d] = vr ? to_f<T>(vr[d]) : 0.0f;
            }
        }
        for (int64_t j = 0; j < kKeyTile; j += ATTN_BLOCK) {
            int64_t v = 0;
            for (; v + kRowVecs <= rv; v += kRowVecs)
                st_block<ATTN_BLOCK, kRowVecs>(st + j * rp + v * kVW, qt + v * kVW, kf + j * hd, hd, rp);
            for (; v < rv; v++)
                st_block<ATTN_BLOCK, 1>(st + j * rp + v * kVW, qt + v * kVW, kf + j * hd, hd, rp);
        }
        for (int64_t v = 0; v < rv; v++) { /* online softmax, lane-wise */
            const vf limit = vload(lim + v * kVW) - (float)key0;
            const vf mold = vload(m + v * kVW);
            vf mx = mold;
            for (int64_t j = 0; j < kKeyTile; j++) {
                float *sj = st + j * rp + v * kVW;
                const vf s = (vsplat((float)j) <= limit) ? vload(sj) : vsplat(-INFINITY);
                vstore(sj, s);
                mx = s > mx ? s : mx;
            }
            vf sum = {};
            for (int64_t j = 0; j < kKeyTile; j++) {
                float *sj = st + j * rp + v * kVW;
                const vf e = (vsplat((float)j) <= limit) ? vexp2(vload(sj) - mx) : vf{};
                vstore(sj, e);
                sum += e;
            }
            const vf alpha = (mold == vsplat(-INFINITY)) ? vf{} : vexp2(mold - mx);
            vstore(l + v * kVW, vload(l + v * kVW) * alpha + sum);
            vstore(m + v * kVW, mx);
            vstore(al + v * kVW, alpha);
        }
        for (int64_t d = 0; d < hd; d += ATTN_BLOCK) {
            const bool whole = d + ATTN_BLOCK <= hd;
            int64_t v = 0;
            for (; whole && v + kRowVecs <= rv; v += kRowVecs)
                ot_block<ATTN_BLOCK, kRowVecs>(ot + d * rp + v * kVW, al + v * kVW,
                                               st + v * kVW, vf_ + d, nk, hd, rp);
            for (; v < rv; v++)
                for (int64_t dd = d; dd < d + ATTN_BLOCK && dd < hd; dd++)
                    ot_block<1, 1>(ot + dd * rp + v * kVW, al + v * kVW, st + v * kVW, vf_ + dd,
                                   nk, hd, rp);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        T *dst = (T *)a.out + (i0 + r / g) * a.nh * hd + (hk * g + r % g) * hd;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < hd; d++) dst[d] = from_f<T>(ot[d * rp + r] * inv);
    }
}

/* Per-thread floats a decode item needs: q rows, one key, one value, scores, outputs. */
static inline size_t decode_thread_floats(int64_t hd, int64_t g) {
    const int64_t hp = (hd + kVW - 1) / kVW * kVW;
    return (size_t)(2 * g * hp + 2 * hp + g * kDecodePart + 2 * g + 16);
}

/* The sum of a vector's lanes, as a tree (independent adds, not one chain). */
static inline float vhsum(vf x) {
    float t[kVW];
    memcpy(t, &x, sizeof(t));
    for (int w = kVW / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}

/* One decode item: writes out (normalised) when it.part < 0, else partials
 * ``part = [g m][g l][g * hd o]`` at ``parts + it.part * g * (hd + 2)``. */
template <typename T>
static void portable_decode_item(const DecodeArgs &a, const DecodeItem &it, float *buf,
                                 float *parts) {
    const int64_t hd = a.hd, hp = (hd + kVW - 1) / kVW * kVW, nv = hp / kVW;
    const int64_t g = a.nh / a.kvh, n = it.j1 - it.j0;
    float *qf = buf, *o = qf + g * hp, *kf = o + g * hp, *vr_f = kf + hp;
    float *s = vr_f + hp, *m = s + g * kDecodePart, *l = m + g;
    const float c = a.scale * kLog2e;
    const T *qs = (const T *)a.q + it.seq * a.q_stride + it.hk * g * hd;
    for (int64_t h = 0; h < g; h++)
        for (int64_t d = 0; d < hp; d++) {
            qf[h * hp + d] = d < hd ? to_f<T>(qs[h * hd + d]) * c : 0.0f;
            o[h * hp + d] = 0.0f;
        }
    for (int64_t d = hd; d < hp; d++) kf[d] = vr_f[d] = 0.0f;
    KVSrc ks = {a.k_cache, a.kvh * hd, a.tables + a.table_starts[it.seq],
                (a.kvh * hd) << a.block_shift, a.block_shift};
    KVSrc vs = ks;
    vs.base = a.v_cache;
    const int64_t ahead = 8; /* keys prefetched ahead: rows are strided, blocks scattered */
    const int64_t row_bytes = hd * (int64_t)sizeof(T);
    for (int64_t j = 0; j < n; j++) {
        if (j + ahead < n) {
            const char *next = (const char *)kv_row<T>(ks, it.j0 + j + ahead, it.hk * hd);
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b);
        }
        const T *kr = kv_row<T>(ks, it.j0 + j, it.hk * hd);
        for (int64_t d = 0; d < hd; d++) kf[d] = to_f<T>(kr[d]);
        for (int64_t h = 0; h < g; h++) {
            vf acc = {};
            for (int64_t v = 0; v < nv; v++) acc += vload(qf + h * hp + v * kVW) * vload(kf + v * kVW);
            s[h * kDecodePart + j] = vhsum(acc);
        }
    }
    for (int64_t h = 0; h < g; h++) {
        float *sh = s + h * kDecodePart, mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;
        vf sum = {};
        for (int64_t j = 0; j < n; j += kVW) { /* kDecodePart is whole vectors */
            vf lane = {};
            for (int i = 0; i < kVW; i++) lane[i] = (float)(j + i);
            const vf e = lane < (float)n ? vexp2(vload(sh + j) - mx) : vf{};
            vstore(sh + j, e);
            sum += e;
        }
        m[h] = mx;
        l[h] = vhsum(sum);
    }
    for (int64_t j = 0; j < n; j++) {
        if (j + ahead < n) {
            const char *next = (const char *)kv_row<T>(vs, it.j0 + j + ahead, it.hk * hd);
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b);
        }
        const T *vr = kv_row<T>(vs, it.j0 + j, it.hk * hd);
        for (int64_t d = 0; d < hd; d++) vr_f[d] = to_f<T>(vr[d]);
        for (int64_t h = 0; h < g; h++) {
            const float p = s[h * kDecodePart + j];
            float *oh = o + h * hp;
            for (int64_t v = 0; v < nv; v++)
                vstore(oh + v * kVW, vload(oh + v * kVW) + p * vload(vr_f + v * kVW));
        }
    }
    if (it.part < 0) {
        T *dst = (T *)a.out + it.seq * a.nh * hd + it.hk * g * hd;
        for (int64_t h = 0; h < g; h++) {
            const float inv = 1.0f / l[h];
            for (int64_t d = 0; d < hd; d++) dst[h * hd + d] = from_f<T>(o[h * hp + d] * inv);
        }
    } else {
        float *p = parts + it.part * g * (hd + 2);
        memcpy(p, m, g * sizeof(float));
        memcpy(p + g, l, g * sizeof(float));
        for (int64_t h = 0; h < g; h++) memcpy(p + 2 * g + h * hd, o + h * hp, hd * sizeof(float));
    }
}

/* Merge the partials of sequence ``seq``'s KV head ``hk`` (parts first .. first + count). */
template <typename T>
static void decode_merge(const DecodeArgs &a, int64_t seq, int64_t hk, const float *parts,
                         int64_t first, int64_t count) {
    const int64_t hd = a.hd, g = a.nh / a.kvh, w = g * (hd + 2);
    T *dst = (T *)a.out + seq * a.nh * hd + hk * g * hd;
    for (int64_t h = 0; h < g; h++) {
        float mx = -INFINITY;
        for (int64_t p = 0; p < count; p++) {
            const float mp = parts[(first + p) * w + h];
            mx = mp > mx ? mp : mx;
        }
        float acc[512], sum = 0.0f; /* hd <= 512 (checked by the caller) */
        for (int64_t d = 0; d < hd; d++) acc[d] = 0.0f;
        for (int64_t p = 0; p < count; p++) {
            const float *pp = parts + (first + p) * w;
            const float f = exp2_approx(pp[h] - mx);
            sum += pp[g + h] * f;
            const float *op = pp + 2 * g + h * hd;
            for (int64_t d = 0; d < hd; d++) acc[d] += op[d] * f;
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < hd; d++) dst[h * hd + d] = from_f<T>(acc[d] * inv);
    }
}

#endif
