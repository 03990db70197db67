/* Copy a KV buffer into shared memory and return the XXH3-64 of its bytes, in one pass;
 * and hash a buffer without the GIL (the reader's checks).
 *
 * ``hash_copy(dst, src, piece_bytes) -> int``: ``src`` is read ``piece_bytes`` at a time;
 * each piece is hashed first (which brings it into this core's cache) and then copied from
 * cache to ``dst`` with non-temporal stores (SSE2 ``movntdq``), which write memory without
 * reading the destination lines first. A plain ``memcpy`` into a fresh shm mapping reads
 * every destination line before overwriting it, and hashing the destination afterwards reads
 * it once more: three passes over memory for two of payload. This makes it two, as a large
 * ``memcpy`` does (which also streams its stores), so the sender's rate approaches memcpy's.
 *
 * The checksum is over the source bytes: what the sender means to send. The receiver hashes
 * what it finds in the segment and compares, so a torn or corrupted write is still caught.
 * The result equals ``xxhash.xxh3_64_intdigest(src)`` (the same algorithm, vendored header in
 * ``third_party/xxhash``); without SSE2 (not x86-64) the copy is a plain ``memcpy``.
 *
 * Both buffers must be C-contiguous and of the same length; the GIL is released while it
 * runs, so two threads copy two layers at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#if defined(__SSE2__)
#include <emmintrin.h>

/* Copy ``n`` bytes with streaming stores: an unaligned head and tail by memcpy, the 16-byte
 * aligned middle 64 bytes at a time. */
static void stream_copy(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}

/* Streaming stores are weakly ordered: make them visible before anything written after the
 * call (the layer's ready mark, on this thread or, after a lock, on another). */
static void stream_fence(void) { _mm_sfence(); }
#else
static void stream_copy(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
static void stream_fence(void) {}
#endif

/* Below this many bytes a hash takes less time than handing the GIL over and back. */
#define GIL_FREE_BYTES (64 * 1024)

static PyObject *hash_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    Py_ssize_t piece;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*n:hash_copy", &dst, &src, &piece)) return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "dst has %zd bytes, src %zd: they must be equal",
                     dst.len, src.len);
    } else if (piece < 1) {
        PyErr_Format(PyExc_ValueError, "piece_bytes must be >= 1, got %zd", piece);
    } else {
        XXH3_state_t state;
        XXH64_hash_t digest;
        char *d = (char *)dst.buf;
        const char *s = (const char *)src.buf;
        size_t n = (size_t)src.len, step = (size_t)piece;
        Py_BEGIN_ALLOW_THREADS
        XXH3_64bits_reset(&state);
        for (size_t off = 0; off < n; off += step) {
            size_t len = n - off < step ? n - off : step;
            XXH3_64bits_update(&state, s + off, len);
            stream_copy(d + off, s + off, len);
        }
        stream_fence();
        digest = XXH3_64bits_digest(&state);
        Py_END_ALLOW_THREADS
        result = PyLong_FromUnsignedLongLong((unsigned long long)digest);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* ``hash64(data) -> int``: the XXH3-64 of a buffer, the GIL released while it runs (the
 * ``xxhash`` package holds it), so that a reader's two threads hash K and V at once. */
static PyObject *hash64(PyObject *self, PyObject *arg) {
    Py_buffer data;
    XXH64_hash_t digest;
    (void)self;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0) return NULL;
    if (data.len < GIL_FREE_BYTES) {
        digest = XXH3_64bits(data.buf, (size_t)data.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        digest = XXH3_64bits(data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong((unsigned long long)digest);
}

static PyMethodDef methods[] = {
    {"hash_copy", hash_copy, METH_VARARGS,
     "hash_copy(dst, src, piece_bytes) -> int: copy src into dst (streaming stores) and "
     "return the XXH3-64 of its bytes, hashed piece by piece from cache."},
    {"hash64", hash64, METH_O,
     "hash64(data) -> int: the XXH3-64 of a C-contiguous buffer, without the GIL."},
    {NULL, NULL, 0, NULL},
};

/* The module's name: ``setup.py`` builds this file as ``_hashcopy`` (the baseline
 * instruction set: SSE2 on x86-64) and, through ``_hashcopy_avx2.c``, as ``_hashcopy_avx2``
 * (``-mavx2``: XXH3's AVX2 loop); ``checksum.py`` imports that one only on a CPU with AVX2. */
#ifndef HASHCOPY_NAME
#define HASHCOPY_NAME _hashcopy
#endif
#define HC_STR2(x) #x
#define HC_STR(x) HC_STR2(x)
#define HC_CAT2(a, b) a##b
#define HC_CAT(a, b) HC_CAT2(a, b)

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, HC_STR(HASHCOPY_NAME),
    "One-pass copy and XXH3-64 of a KV buffer into shared memory; GIL-free XXH3-64.", -1,
    methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC HC_CAT(PyInit_, HASHCOPY_NAME)(void) { return PyModule_Create(&module); }
