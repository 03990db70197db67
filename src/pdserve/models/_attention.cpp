/* Native CPU attention for the engine (``pdserve.models.cpu_attention`` is the Python side,
 * which checks shapes, dtypes and strides and passes raw pointers here).
 *
 * ``prefill(...)``: causal attention of a prompt chunk's n queries over ctx keys (the queries
 * are the last n positions: query i sees keys 0 .. ctx - n + i), GQA, keys and values either
 * contiguous rows (this step's k/v) or paged cache blocks read through a block table.
 * ``decode(...)``: one query per sequence over its paged context, read in place (no gather,
 * no padding), long contexts split across threads and merged.
 *
 * Built twice (``setup.py``): a portable build (fp32 arithmetic, loops the compiler
 * vectorizes) and an AVX512-BF16 build (``_attention_avx512bf16``), whose bf16 kernels use
 * ``vdpbf16ps``; float32 runs the portable kernels in both. Threads: see
 * ``_attention_common.h`` (torch's own OpenMP team). The GIL is released while a kernel runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_attention_common.h"
#include "_attention_portable.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ATTN_HAVE_BF16_DOT 1
#include "_attention_avx512.h"
#else
#define ATTN_HAVE_BF16_DOT 0
#endif

#ifndef ATTENTION_NAME
#define ATTENTION_NAME _attention
#endif
#define ATTN_CAT2(a, b) a##b
#define ATTN_CAT(a, b) ATTN_CAT2(a, b)
#define ATTN_STR2(a) #a
#define ATTN_STR(a) ATTN_STR2(a)

enum { kFloat32 = 0, kBFloat16 = 1 };
static const int64_t kMaxHeadDim = 512;

/* Whether the AVX512-BF16 kernels take this head_dim (else the portable ones run). */
static bool bf16_dot_head_dim(int64_t hd) {
    return ATTN_HAVE_BF16_DOT && (hd == 32 || hd == 64 || hd == 96 || hd == 128);
}

static int64_t positions_per_item(int64_t g) { return g >= kRowsPerItem ? 1 : kRowsPerItem / g; }

/* -- prefill ---------------------------------------------------------------------------- */
template <typename T>
static int prefill_portable(const PrefillArgs &a) {
    const int64_t bq = positions_per_item(a.nh / a.kvh), nqt = (a.n + bq - 1) / bq;
    const size_t per = portable_prefill_floats(a.hd, bq * (a.nh / a.kvh));
    float *buf = (float *)scratch_get(per * sizeof(float) * (size_t)a.nthreads);
    if (!buf) return -1;
    /* Items in descending cost: the last query tiles see the most keys. */
    parallel_items(a.nthreads, nqt * a.kvh, [&](int64_t item, int tid) {
        const int64_t qt = nqt - 1 - item / a.kvh, hk = item % a.kvh;
        const int64_t i0 = qt * bq, i1 = i0 + bq < a.n ? i0 + bq : a.n;
        portable_prefill_item<T>(a, hk, i0, i1, buf + per * tid);
    });
    return 0;
}

#if ATTN_HAVE_BF16_DOT
template <int HD>
static int prefill_bf16_dot(const PrefillArgs &a) {
    const int64_t g = a.nh / a.kvh, bq = positions_per_item(g), nqt = (a.n + bq - 1) / bq;
    const int64_t ntiles = (a.ctx + kKeyTile - 1) / kKeyTile, tile = packed_tile_elems(HD);
    const size_t packed = (size_t)(2 * a.kvh * ntiles * tile) * sizeof(bf16);
    const size_t per = avx512_prefill_floats(HD, bq * g) * sizeof(float);
    char *mem = (char *)scratch_get(packed + per * (size_t)a.nthreads);
    if (!mem) return -1;
    bf16 *kpack = (bf16 *)mem, *vpack = kpack + a.kvh * ntiles * tile;
    float *bufs = (float *)(mem + packed);
    parallel_items(a.nthreads, a.kvh * ntiles, [&](int64_t item, int) {
        const int64_t hk = item / ntiles, kt = item % ntiles;
        avx512_pack_tile(a, hk, kt, kpack + (hk * ntiles + kt) * tile,
                         vpack + (hk * ntiles + kt) * tile);
    });
    parallel_items(a.nthreads, nqt * a.kvh, [&](int64_t item, int tid) {
        const int64_t qt = nqt - 1 - item / a.kvh, hk = item % a.kvh;
        const int64_t i0 = qt * bq, i1 = i0 + bq < a.n ? i0 + bq : a.n;
        avx512_prefill_item<HD>(a, kpack, vpack, ntiles, hk, i0, i1,
                                (float *)((char *)bufs + per * tid));
    });
    return 0;
}
#endif

static int run_prefill(const PrefillArgs &a, int dtype) {
    if (dtype == kFloat32) return prefill_portable<float>(a);
#if ATTN_HAVE_BF16_DOT
    switch (a.hd) {
    case 32: return prefill_bf16_dot<32>(a);
    case 64: return prefill_bf16_dot<64>(a);
    case 96: return prefill_bf16_dot<96>(a);
    case 128: return prefill_bf16_dot<128>(a);
    }
#endif
    return prefill_portable<bf16>(a);
}

/* -- decode ----------------------------------------------------------------------------- */
static int cmp_item_desc(const void *x, const void *y) {
    const DecodeItem *a = (const DecodeItem *)x, *b = (const DecodeItem *)y;
    const int64_t la = a->j1 - a->j0, lb = b->j1 - b->j0;
    return la < lb ? 1 : la > lb ? -1 : 0;
}

template <typename T>
static int run_decode_typed(const DecodeArgs &a, bool dot) {
    const int64_t g = a.nh / a.kvh;
    int64_t nitems = 0, nparts = 0;
    for (int64_t s = 0; s < a.D; s++) {
        const int64_t np = (a.ctx_lens[s] + kDecodePart - 1) / kDecodePart;
        nitems += np * a.kvh;
        if (np > 1) nparts += np * a.kvh;
    }
    const size_t per = decode_thread_floats(a.hd, g) * sizeof(float);
    const size_t items_bytes = ((size_t)nitems * sizeof(DecodeItem) + 63) & ~(size_t)63;
    const size_t parts_bytes = (size_t)(nparts * g * (a.hd + 2)) * sizeof(float);
    char *mem = (char *)scratch_get(items_bytes + parts_bytes + per * (size_t)a.nthreads);
    if (!mem) return -1;
    DecodeItem *items = (DecodeItem *)mem;
    float *parts = (float *)(mem + items_bytes);
    float *bufs = (float *)(mem + items_bytes + parts_bytes);
    int64_t k = 0, part = 0, total_keys = 0;
    for (int64_t s = 0; s < a.D; s++) {
        const int64_t ctx = a.ctx_lens[s], np = (ctx + kDecodePart - 1) / kDecodePart;
        total_keys += ctx;
        for (int64_t hk = 0; hk < a.kvh; hk++)
            for (int64_t p = 0; p < np; p++) {
                const int64_t j0 = p * kDecodePart;
                const int64_t j1 = j0 + kDecodePart < ctx ? j0 + kDecodePart : ctx;
                items[k++] = {s, hk, j0, j1, np > 1 ? part++ : -1};
            }
    }
    qsort(items, (size_t)nitems, sizeof(DecodeItem), cmp_item_desc);
    /* Small steps run on the calling thread: waking the team costs more than it saves. */
    DecodeArgs b = a;
    if (total_keys * a.kvh * a.hd < 64 * 1024) b.nthreads = 1;
    parallel_items(b.nthreads, nitems, [&](int64_t i, int tid) {
        float *buf = (float *)((char *)bufs + per * tid);
#if ATTN_HAVE_BF16_DOT
        if (dot) {
            switch (a.hd) {
            case 32: avx512_decode_item<32>(b, items[i], buf, parts); return;
            case 64: avx512_decode_item<64>(b, items[i], buf, parts); return;
            case 96: avx512_decode_item<96>(b, items[i], buf, parts); return;
            case 128: avx512_decode_item<128>(b, items[i], buf, parts); return;
            }
        }
#endif
        (void)dot;
        portable_decode_item<T>(b, items[i], buf, parts);
    });
    /* Parts were numbered in (seq, hk, part) order before the sort: merge each run. */
    for (int64_t s = 0, first = 0; nparts && s < a.D; s++) {
        const int64_t np = (a.ctx_lens[s] + kDecodePart - 1) / kDecodePart;
        if (np < 2) continue;
        for (int64_t hk = 0; hk < a.kvh; hk++, first += np) decode_merge<T>(a, s, hk, parts, first, np);
    }
    return 0;
}

static int run_decode(const DecodeArgs &a, int dtype) {
    if (dtype == kFloat32) return run_decode_typed<float>(a, false);
    return run_decode_typed<bf16>(a, bf16_dot_head_dim(a.hd));
}

/* -- Python bindings -------------------------------------------------------------------- */
static bool check_common(int64_t nh, int64_t kvh, int64_t hd, int dtype, int nthreads) {
    if (nh < 1 || kvh < 1 || nh % kvh || nh / kvh > kRowsPerItem) {
        PyErr_Format(PyExc_ValueError, "num_heads %lld must be a multiple of num_kv_heads %lld, "
                     "at most %lld times", (long long)nh, (long long)kvh, (long long)kRowsPerItem);
        return false;
    }
    if (hd < 1 || hd > kMaxHeadDim || hd % 2) {
        PyErr_Format(PyExc_ValueError, "head_dim must be even and at most %lld, got %lld",
                     (long long)kMaxHeadDim, (long long)hd);
        return false;
    }
    if (dtype != kFloat32 && dtype != kBFloat16) {
        PyErr_Format(PyExc_ValueError, "dtype code must be 0 (float32) or 1 (bfloat16)");
        return false;
    }
    if (nthreads < 1) {
        PyErr_Format(PyExc_ValueError, "num_threads must be >= 1");
        return false;
    }
    return true;
}

static bool check_table(const int64_t *table, int64_t nblocks, int64_t num_blocks) {
    for (int64_t b = 0; b < nblocks; b++)
        if (table[b] < 0 || table[b] >= num_blocks) {
            PyErr_Format(PyExc_ValueError, "block table entry %lld out of range [0, %lld)",
                         (long long)table[b], (long long)num_blocks);
            return false;
        }
    return true;
}

static int block_shift_of(long long block_size) {
    int shift = 0;
    while (((long long)1 << shift) < block_size) shift++;
    return ((long long)1 << shift) == block_size ? shift : -1;
}

PyDoc_STRVAR(prefill_doc,
             "prefill(out, q, q_stride, k, k_stride, v, v_stride, table, block_size, block_stride,"
             " num_blocks, n, ctx, nh, kvh, hd, scale, dtype, num_threads, /)\n"
             "Causal GQA attention of n queries over ctx keys; see cpu_attention.py.");

static PyObject *py_prefill(PyObject *, PyObject *args) {
    unsigned long long out, q, k, v, table;
    long long q_stride, k_stride, v_stride, block_size, block_stride, num_blocks;
    long long n, ctx, nh, kvh, hd;
    float scale;
    int dtype, nthreads;
    if (!PyArg_ParseTuple(args, "KKLKLKLKLLLLLLLLfii", &out, &q, &q_stride, &k, &k_stride, &v,
                          &v_stride, &table, &block_size, &block_stride, &num_blocks, &n, &ctx,
                          &nh, &kvh, &hd, &scale, &dtype, &nthreads))
        return nullptr;
    if (!check_common(nh, kvh, hd, dtype, nthreads)) return nullptr;
    if (n < 1 || ctx < n) {
        PyErr_Format(PyExc_ValueError, "need 1 <= n <= ctx, got n=%lld ctx=%lld", n, ctx);
        return nullptr;
    }
    const int shift = table ? block_shift_of(block_size) : 0;
    if (shift < 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be a power of two, got %lld", block_size);
        return nullptr;
    }
    if (table && !check_table((const int64_t *)table, (ctx + block_size - 1) >> shift, num_blocks))
        return nullptr;
    PrefillArgs a;
    a.out = (void *)out;
    a.q = (const void *)q;
    a.q_stride = q_stride;
    a.k = {(const void *)k, k_stride, (const int64_t *)table, block_stride, shift};
    a.v = {(const void *)v, v_stride, (const int64_t *)table, block_stride, shift};
    a.n = n, a.ctx = ctx, a.nh = nh, a.kvh = kvh, a.hd = hd;
    a.scale = scale;
    a.nthreads = nthreads;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run_prefill(a, dtype);
    scratch_trim();
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(decode_doc,
             "decode(out, q, q_stride, k_cache, v_cache, block_size, num_blocks, tables,"
             " tables_len, table_starts, ctx_lens, D, nh, kvh, hd, scale, dtype, num_threads, /)\n"
             "One query per sequence over its paged context; see cpu_attention.py.");

static PyObject *py_decode(PyObject *, PyObject *args) {
    unsigned long long out, q, kc, vc, tables, starts, ctx_lens;
    long long q_stride, block_size, num_blocks, tables_len, D, nh, kvh, hd;
    float scale;
    int dtype, nthreads;
    if (!PyArg_ParseTuple(args, "KKLKKLLKLKKLLLLfii", &out, &q, &q_stride, &kc, &vc, &block_size,
                          &num_blocks, &tables, &tables_len, &starts, &ctx_lens, &D, &nh, &kvh,
                          &hd, &scale, &dtype, &nthreads))
        return nullptr;
    if (!check_common(nh, kvh, hd, dtype, nthreads)) return nullptr;
    const int shift = block_shift_of(block_size);
    if (shift < 0 || D < 0 || tables_len < 0) {
        PyErr_Format(PyExc_ValueError, "bad decode geometry: block_size %lld (a power of two), "
                     "D %lld, tables_len %lld", block_size, D, tables_len);
        return nullptr;
    }
    const int64_t *lens = (const int64_t *)ctx_lens, *tbl = (const int64_t *)tables;
    const int64_t *first = (const int64_t *)starts;
    for (long long s = 0; s < D; s++) {
        const int64_t nb = (lens[s] + block_size - 1) >> shift;
        if (lens[s] < 1 || first[s] < 0 || first[s] + nb > tables_len) {
            PyErr_Format(PyExc_ValueError, "context length %lld of sequence %lld needs %lld "
                         "blocks from table offset %lld, past the %lld table entries",
                         (long long)lens[s], s, (long long)nb, (long long)first[s], tables_len);
            return nullptr;
        }
        if (!check_table(tbl + first[s], nb, num_blocks)) return nullptr;
    }
    DecodeArgs a;
    a.out = (void *)out;
    a.q = (const void *)q;
    a.q_stride = q_stride;
    a.k_cache = (const void *)kc;
    a.v_cache = (const void *)vc;
    a.block_shift = shift;
    a.tables = tbl;
    a.table_starts = first;
    a.ctx_lens = lens;
    a.D = D, a.nh = nh, a.kvh = kvh, a.hd = hd;
    a.scale = scale;
    a.nthreads = nthreads;
    int rc = 0;
    if (D) {
        Py_BEGIN_ALLOW_THREADS
        rc = run_decode(a, dtype);
        scratch_trim();
        Py_END_ALLOW_THREADS
    }
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_bf16_dot_head_dims(PyObject *, PyObject *) {
    PyObject *out = PyList_New(0);
    if (!out) return nullptr;
    for (int64_t hd = 16; hd <= kMaxHeadDim; hd += 16)
        if (bf16_dot_head_dim(hd)) {
            PyObject *v = PyLong_FromLongLong(hd);
            if (!v || PyList_Append(out, v)) {
                Py_XDECREF(v);
                Py_DECREF(out);
                return nullptr;
            }
            Py_DECREF(v);
        }
    return out;
}

static PyMethodDef methods[] = {
    {"prefill", py_prefill, METH_VARARGS, prefill_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {"bf16_dot_head_dims", py_bf16_dot_head_dims, METH_NOARGS,
     "Head dims whose bf16 kernels use AVX512-BF16 dot products in this build."},
    {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, ATTN_STR(ATTENTION_NAME), "Native CPU attention kernels.", -1, methods,
};

PyMODINIT_FUNC ATTN_CAT(PyInit_, ATTENTION_NAME)(void) { return PyModule_Create(&module); }
