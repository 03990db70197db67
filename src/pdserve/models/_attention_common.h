/* Shared pieces of the CPU attention kernels (``_attention.cpp``): argument structs, the
 * key/value row addressing (contiguous or paged), bf16 conversions, exp2, scratch memory and
 * the parallel loop.
 *
 * Threads: the loops run in ``#pragma omp parallel`` regions, but this module is linked
 * WITHOUT an OpenMP library. Its ``GOMP_*`` / ``omp_*`` references are resolved at import
 * time against the OpenMP runtime torch has already loaded into the process (torch loads
 * its ``libgomp`` with RTLD_GLOBAL), so the kernels run on torch's own thread team: one
 * runtime, no second pool competing for the cores. Without torch loaded first, the import
 * fails (undefined symbol) and the Python side falls back to torch's attention.
 */
#ifndef PDSERVE_ATTENTION_COMMON_H
#define PDSERVE_ATTENTION_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

static const float kLog2e = 1.4426950408889634f;

/* Queries per prefill work item: rows = positions x query heads of one KV head. */
static const int64_t kRowsPerItem = 64;
/* Keys per prefill tile (two 16-lane vectors of scores per row). */
static const int64_t kKeyTile = 32;
/* Keys per decode work item at most: a long context is split (flash-decoding) so that its
 * parts spread over the threads, then the parts are merged. */
static const int64_t kDecodePart = 256;

/* K or V rows: token ``t`` of KV head ``h`` starts at element
 *   contiguous: base + t * tok_stride + h * hd
 *   paged:      base + table[t / block_size] * block_stride + (t % block_size) * tok_stride
 *               + h * hd                                      (block_size a power of two) */
struct KVSrc {
    const void *base;
    int64_t tok_stride;
    const int64_t *table; /* nullptr: contiguous */
    int64_t block_stride;
    int64_t block_shift; /* log2(block_size) */
};

template <typename T>
static inline const T *kv_row(const KVSrc &s, int64_t t, int64_t head_off) {
    const T *b = (const T *)s.base;
    if (!s.table) return b + t * s.tok_stride + head_off;
    const int64_t mask = ((int64_t)1 << s.block_shift) - 1;
    return b + s.table[t >> s.block_shift] * s.block_stride + (t & mask) * s.tok_stride +
           head_off;
}

struct PrefillArgs {
    void *out;     /* [n, nh, hd] contiguous */
    const void *q; /* [n, nh, hd], token stride q_stride, head stride hd */
    int64_t q_stride;
    KVSrc k, v; /* ctx keys of each KV head */
    int64_t n, ctx, nh, kvh, hd;
    float scale;
    int nthreads;
};

struct DecodeArgs {
    void *out;     /* [D, nh, hd] contiguous */
    const void *q; /* [D, nh, hd], token stride q_stride */
    int64_t q_stride;
    const void *k_cache, *v_cache; /* [num_blocks, block_size, kvh, hd] contiguous */
    int64_t block_shift;
    const int64_t *tables;       /* every sequence's block table, one after another */
    const int64_t *table_starts; /* [D] where each sequence's table starts in ``tables`` */
    const int64_t *ctx_lens; /* [D] */
    int64_t D, nh, kvh, hd;
    float scale;
    int nthreads;
};

/* One decode work item: keys [j0, j1) of sequence ``seq``'s KV head ``hk``. ``part`` indexes
 * the partial results (m, l, o) when the sequence is split, or is -1 when the item covers
 * the whole context and writes the output itself. */
struct DecodeItem {
    int64_t seq, hk, j0, j1, part;
};

static inline float bf16_to_f(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's ``.to(torch.bfloat16)`` does (NaN stays NaN). */
static inline bf16 f_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

template <typename T> static inline float to_f(T x);
template <> inline float to_f<float>(float x) { return x; }
template <> inline float to_f<bf16>(bf16 x) { return bf16_to_f(x); }

template <typename T> static inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline bf16 from_f<bf16>(float x) { return f_to_bf16(x); }

/* 2^x for x <= 0 (softmax arguments), relative error ~1e-7; x below -126 (and -inf) gives
 * 2^-126, which callers zero where the key is masked. Branch-free so loops vectorize. */
static inline float exp2_approx(float x) {
    x = x < -126.0f ? -126.0f : x;
    const float n = nearbyintf(x);
    const float f = x - n; /* [-0.5, 0.5] */
    float p = 1.5337580407503992e-4f;
    p = p * f + 1.339986571110785e-3f;
    p = p * f + 9.618519805371761e-3f;
    p = p * f + 5.550329014658928e-2f;
    p = p * f + 2.4022646248340607e-1f;
    p = p * f + 6.931471824645996e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, 4);
    return p;
}

/* Per-calling-thread scratch memory, grown on demand: the packed K/V of a prefill, per-thread
 * buffers, decode partials. Kept between calls (a step calls once per layer) unless large. */
struct Scratch {
    void *ptr = nullptr;
    size_t size = 0;
    ~Scratch() { free(ptr); }
};
static thread_local Scratch tls_scratch;
static const size_t kScratchKeep = (size_t)64 << 20;

static void *scratch_get(size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    if (bytes > tls_scratch.size) {
        free(tls_scratch.ptr);
        tls_scratch.ptr = aligned_alloc(64, bytes);
        tls_scratch.size = tls_scratch.ptr ? bytes : 0;
    }
    return tls_scratch.ptr;
}

static void scratch_trim(void) {
    if (tls_scratch.size > kScratchKeep) {
        free(tls_scratch.ptr);
        tls_scratch.ptr = nullptr;
        tls_scratch.size = 0;
    }
}

/* body(item, thread) for item in [0, nitems), items handed out one at a time in order (the
 * callers put the costliest first), on up to ``nthreads`` threads of torch's team. */
template <typename F>
static void parallel_items(int nthreads, int64_t nitems, F body) {
    if (nthreads > nitems) nthreads = (int)nitems;
    if (nthreads <= 1) {
        for (int64_t i = 0; i < nitems; i++) body(i, 0);
        return;
    }
    int64_t next = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num();
        for (;;) {
            const int64_t i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (i >= nitems) break;
            body(i, tid);
        }
    }
}

#endif
