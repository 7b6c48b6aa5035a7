/* r3_client._r3codec: the native backend of the routing codec's hot loops.
 *
 * The Python codec (r3_client.codec, numpy) is the reference; this module computes the
 * same bytes and the same arrays, faster, with the GIL released for every loop.  Python
 * keeps the frame logic (headers, CRCs); decode_chunks decodes a whole frame's chunks in
 * one call (inflating set-zstd chunks with libzstd where the build has it), the other
 * kernels take one body each; r3_client._kernels.native picks this module or numpy.
 *
 * Every kernel reads hostile input: each size is checked against the buffers it will
 * read and write before any loop runs, every table lookup is bounded by the table's
 * length, and a decoder that meets invalid data returns an error code (the caller then
 * asks the numpy reference for the exact exception).  Nothing here allocates more than
 * a fixed tile on the stack, the tables of set_tables() and decode_chunks' one inflated
 * chunk (its size bounded by the output it fills).
 *
 * Array arguments are buffers (numpy arrays, possibly strided views): 3-D [rows, layers,
 * K] with the K axis contiguous.  Formats: b h i l q (signed), B H I (unsigned).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#ifdef R3_HAVE_ZSTD
/* libzstd's one-shot decompression into a buffer of the declared size (setup.py defines
 * R3_HAVE_ZSTD and links -lzstd where zstd.h is installed: Debian's libzstd-dev). */
#include <zstd.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the routing format is little-endian; this backend assumes a little-endian host"
#endif

typedef unsigned __int128 u128;

#define KMAX 64     /* r3_client._routing.MAX_TOPK */
#define EMAX 65535  /* r3_client._routing.MAX_EXPERTS */
#define TILE 64     /* rows sorted together, column by column */
#define MBITS 5     /* mantissa bits of a set-rank bucket key */
#define NKEYS (1 + 128 * (1 << MBITS))
#ifndef DK_MBITS
#define DK_MBITS 6  /* mantissa bits of the decode table's key */
#endif
#define DK_ENTS (65 << DK_MBITS) /* keys of a 64-bit rank: (bit length) << DK_MBITS | mantissa */
#define DK_ENT 4    /* u64 per entry: C(c, i), C(c + 1, i), C(c + 2, i), c */
#define DK_KMAX 16
_Static_assert(DK_ENT * sizeof(uint64_t) == 32, "dk_level computes 32-byte entry offsets");

/* ---- errors the kernels report (the caller maps them; see r3_client._native) ---- */
enum {
    R3_OK = 0,
    R3_BAD_ID = 1,       /* id outside [-1, E) */
    R3_PARTIAL = 2,      /* a row mixes -1 and ids */
    R3_DUPLICATE = 3,    /* an id twice in a row */
    R3_LENGTH = 4,       /* body length differs from what the shape needs */
    R3_PADDING = 5,      /* non-zero padding bits */
    R3_RANK = 6,         /* set rank above C(E, K) or not decomposing */
    R3_GAP = 7,          /* malformed set-zstd gaps */
    R3_ZSTD = 8,         /* a set-zstd chunk is not one zstd frame of exactly its payload */
    R3_UNSUPPORTED = 9,  /* set-zstd in a build without libzstd: the caller decodes it */
    R3_CRC = 10,         /* a chunk's CRC-32C differs from the one its header lists */
};

/* ---- 3-D buffers ---------------------------------------------------------------------- */
typedef struct {
    Py_buffer view;
    char *buf;
    Py_ssize_t rows, layers, k;
    Py_ssize_t s0, s1; /* byte strides of rows and layers */
    int kind;          /* itemsize, negative when unsigned */
    int held;
} Arr3;

static int kind_of(const char *fmt, Py_ssize_t itemsize) {
    if (fmt == NULL) return 0;
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0') return 0;
    switch (fmt[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q':
        return (int)itemsize;
    case 'B': case 'H': case 'I':
        return -(int)itemsize;
    default:
        return 0;
    }
}

/* Take a 3-D buffer with a contiguous last axis; kinds: bitmask of accepted kinds. */
static int get3(PyObject *obj, int writable, Arr3 *a, const char *what) {
    memset(a, 0, sizeof(*a));
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) < 0) return -1;
    a->held = 1;
    if (a->view.ndim != 3) {
        PyErr_Format(PyExc_ValueError, "%s must be 3-D", what);
        return -1;
    }
    a->kind = kind_of(a->view.format, a->view.itemsize);
    int sz = a->kind < 0 ? -a->kind : a->kind;
    if (a->kind == 0 || (sz != 1 && sz != 2 && sz != 4 && sz != 8) || a->kind == -8) {
        PyErr_Format(PyExc_TypeError, "%s has an unsupported item format", what);
        return -1;
    }
    if (a->view.strides[2] != a->view.itemsize && a->view.shape[2] > 1) {
        PyErr_Format(PyExc_ValueError, "%s must be contiguous along its last axis", what);
        return -1;
    }
    a->buf = (char *)a->view.buf;
    a->rows = a->view.shape[0];
    a->layers = a->view.shape[1];
    a->k = a->view.shape[2];
    a->s0 = a->view.strides[0];
    a->s1 = a->view.strides[1];
    if (a->k < 1 || a->k > KMAX) {
        PyErr_Format(PyExc_ValueError, "%s: top-k must be in [1, %d]", what, KMAX);
        return -1;
    }
    return 0;
}

static void rel3(Arr3 *a) {
    if (a->held) PyBuffer_Release(&a->view);
    a->held = 0;
}

#define HOT static inline __attribute__((always_inline))


/* Call F(kind) with `kind` a constant, so each instance is compiled for one item type. */
#define BY_KIND(kind, F)                  \
    switch (kind) {                       \
    case 1: F(1); break;                  \
    case 2: F(2); break;                  \
    case 4: F(4); break;                  \
    case 8: F(8); break;                  \
    case -1: F(-1); break;                \
    case -2: F(-2); break;                \
    default: F(-4); break;                \
    }

/* Walks rows of an [R, L, K] array in (row, layer) order without a division per row. */
typedef struct { Py_ssize_t r, l; } Pos;

static inline void step(Pos *p, Py_ssize_t layers) {
    if (++p->l == layers) { p->l = 0; p->r++; }
}

static inline const char *row_at(const Arr3 *a, Py_ssize_t r, Py_ssize_t l) {
    return a->buf + r * a->s0 + l * a->s1;
}

/* One element of a row, widened to int64. */
/* One element of a row, widened to int64.  memcpy: a buffer may sit at any address (a
 * frame's body inside a bytes object), and the compiler makes these plain moves. */
HOT int64_t load(const char *p, int kind, Py_ssize_t j) {
    switch (kind) {
    case 1: return ((const int8_t *)p)[j];
    case 2: { int16_t v; memcpy(&v, p + 2 * j, 2); return v; }
    case 4: { int32_t v; memcpy(&v, p + 4 * j, 4); return v; }
    case 8: { int64_t v; memcpy(&v, p + 8 * j, 8); return v; }
    case -1: return ((const uint8_t *)p)[j];
    case -2: { uint16_t v; memcpy(&v, p + 2 * j, 2); return v; }
    default: { uint32_t v; memcpy(&v, p + 4 * j, 4); return v; }
    }
}

HOT void store(char *p, int kind, Py_ssize_t j, int32_t v) {
    if (kind == 2) {
        int16_t w = (int16_t)v;
        memcpy(p + 2 * j, &w, 2);
    } else {
        memcpy(p + 4 * j, &v, 4);
    }
}

/* ---- encode helpers: SSE2 (the x86-64 baseline) for rows of K <= 8, else plain C ------ */
#if defined(__SSE2__) && defined(__x86_64__) && !defined(R3_NO_SIMD)
#include <emmintrin.h>
#define ENC_SIMD 1
#else
#define ENC_SIMD 0
#endif

#if ENC_SIMD
/* Comparators of the network build_net(k) makes, k = 1..8 (any network sorts alike). */
static const unsigned char enc_net[8][19][2] = {
    {{0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}},
    {{0, 1}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}},
    {{0, 1}, {0, 2}, {1, 2}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}},
    {{0, 1}, {2, 3}, {0, 2}, {1, 3}, {1, 2}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}},
    {{0, 1}, {2, 3}, {0, 2}, {1, 3}, {1, 2}, {0, 4}, {2, 4}, {1, 2}, {3, 4}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}},
    {{0, 1}, {2, 3}, {4, 5}, {0, 2}, {1, 3}, {1, 2}, {0, 4}, {1, 5}, {2, 4}, {3, 5}, {1, 2}, {3, 4}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}},
    {{0, 1}, {2, 3}, {4, 5}, {0, 2}, {1, 3}, {4, 6}, {1, 2}, {5, 6}, {0, 4}, {1, 5}, {2, 6}, {2, 4}, {3, 5}, {1, 2}, {3, 4}, {5, 6}, {0, 0}, {0, 0}, {0, 0}},
    {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {1, 2}, {5, 6}, {0, 4}, {1, 5}, {2, 6}, {3, 7}, {2, 4}, {3, 5}, {1, 2}, {3, 4}, {5, 6}},
};
static const unsigned char enc_nn[8] = {0, 1, 3, 5, 9, 12, 16, 19};

typedef __m128i V;

/* 8x8 transpose of int16 lanes: x[i] lane j <-> x[j] lane i. */
HOT void enc_tr8(V *x) {
    V a0 = _mm_unpacklo_epi16(x[0], x[1]), a1 = _mm_unpackhi_epi16(x[0], x[1]);
    V a2 = _mm_unpacklo_epi16(x[2], x[3]), a3 = _mm_unpackhi_epi16(x[2], x[3]);
    V a4 = _mm_unpacklo_epi16(x[4], x[5]), a5 = _mm_unpackhi_epi16(x[4], x[5]);
    V a6 = _mm_unpacklo_epi16(x[6], x[7]), a7 = _mm_unpackhi_epi16(x[6], x[7]);
    V b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    V b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    V b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    V b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    x[0] = _mm_unpacklo_epi64(b0, b4); x[1] = _mm_unpackhi_epi64(b0, b4);
    x[2] = _mm_unpacklo_epi64(b1, b5); x[3] = _mm_unpackhi_epi64(b1, b5);
    x[4] = _mm_unpacklo_epi64(b2, b6); x[5] = _mm_unpackhi_epi64(b2, b6);
    x[6] = _mm_unpacklo_epi64(b3, b7); x[7] = _mm_unpackhi_epi64(b3, b7);
}

/* Sort the 8 lanes of columns c[0..K) (one row per lane), K a constant. */
HOT void enc_sort8(V *c, const int K) {
#pragma GCC unroll 19
    for (int n = 0; n < 19; n++) {
        if (n >= enc_nn[K - 1]) break;
        int a = enc_net[K - 1][n][0], b = enc_net[K - 1][n][1];
        V lo = _mm_min_epi16(c[a], c[b]);
        c[b] = _mm_max_epi16(c[a], c[b]);
        c[a] = lo;
    }
}

/* All ones in lanes < K. */
HOT V enc_lanes(const int K) {
    return _mm_setr_epi16(0 < K ? -1 : 0, 1 < K ? -1 : 0, 2 < K ? -1 : 0, 3 < K ? -1 : 0,
                          4 < K ? -1 : 0, 5 < K ? -1 : 0, 6 < K ? -1 : 0, 7 < K ? -1 : 0);
}

/* Lanes >= K of a row set to INT16_MAX (they sort last). */
HOT V enc_pad(V x, const int K) {
    if (K >= 8) return x;
    const V keep = enc_lanes(K);
    return _mm_or_si128(_mm_and_si128(x, keep), _mm_andnot_si128(keep, _mm_set1_epi16(INT16_MAX)));
}

/* One row of K <= 8 ids as int16 lanes (lanes >= K: INT16_MAX).  A value outside int16
 * saturates to INT16_MIN or INT16_MAX, which stay outside [-1, E) for E <= 32767.  ik = 0:
 * any kind (`kind`), element by element. */
HOT V enc_row16(const char *p, const int ik, const int K, int kind) {
    V x = _mm_setzero_si128();
    if (ik == -1) {
        memcpy(&x, p, (size_t)K);
        x = _mm_unpacklo_epi8(x, _mm_setzero_si128());
    } else if (ik == 1) {
        memcpy(&x, p, (size_t)K);
        x = _mm_srai_epi16(_mm_unpacklo_epi8(x, x), 8);
    } else if (ik == 2) {
        memcpy(&x, p, (size_t)K * 2);
    } else if (ik == 4) {
        V hi = _mm_setzero_si128();
        memcpy(&x, p, (size_t)(K < 4 ? K : 4) * 4);
        if (K > 4) memcpy(&hi, p + 16, (size_t)(K - 4) * 4);
        x = _mm_packs_epi32(x, hi);
    } else {
        int16_t t[8] = {0};
        for (int j = 0; j < K; j++) {
            int64_t v = load(p, kind, j);
            t[j] = (int16_t)(v < INT16_MIN ? INT16_MIN : v > INT16_MAX ? INT16_MAX : v);
        }
        memcpy(&x, t, sizeof(t));
    }
    return enc_pad(x, K);
}

HOT int enc_any(V m) { return _mm_movemask_epi8(m) != 0; }
#endif

/* Ask for the cache lines of row r's layers [l0, l0 + nl) (`ahead` rows before they are
 * read: a chunk's rows are a short run every few hundred bytes, which the hardware
 * prefetchers of some CPUs do not follow).  Only a hint: never faults, any address. */
static inline void enc_prefetch(const Arr3 *a, Py_ssize_t r, Py_ssize_t l0, Py_ssize_t nl) {
    if (r >= a->rows || nl < 1) return;
    const char *p = a->buf + r * a->s0 + l0 * a->s1;
    const char *q = p + (nl - 1) * a->s1 + (a->k * (a->kind < 0 ? -a->kind : a->kind)) - 1;
    if (a->s1 < 0) { const char *x = p; p = q; q = x; }
    for (uintptr_t c = (uintptr_t)p & ~(uintptr_t)63; c <= (uintptr_t)q; c += 64)
        __builtin_prefetch((const void *)c);
}

#define ENC_AHEAD 32 /* rows */

/* ---- sorting network (the comparators r3_client._sortnet uses) ------------------------ */
typedef struct {
    int n;
    unsigned char a[1024], b[1024];
} Net;

static void build_net(int k, Net *net) {
    int size = 1;
    net->n = 0;
    while (size < k) size *= 2;
    for (int p = 1; p < size; p *= 2)
        for (int kk = p; kk >= 1; kk /= 2)
            for (int j = kk % p; j < size - kk; j += 2 * kk)
                for (int i = 0; i < kk && i < size - j - kk; i++) {
                    int x = i + j, y = i + j + kk;
                    if (x / (2 * p) == y / (2 * p) && y < k && net->n < 1024) {
                        net->a[net->n] = (unsigned char)x;
                        net->b[net->n] = (unsigned char)y;
                        net->n++;
                    }
                }
}

/* Sort each of `n` tile rows (columns cols[0..k)); whole columns per comparator so the
 * compiler vectorises min/max across rows. */
static void sort_tile(int32_t cols[][TILE], int n, const Net *net) {
    for (int c = 0; c < net->n; c++) {
        int32_t *x = cols[net->a[c]], *y = cols[net->b[c]];
        for (int t = 0; t < TILE; t++) {
            int32_t lo = x[t] < y[t] ? x[t] : y[t];
            int32_t hi = x[t] < y[t] ? y[t] : x[t];
            x[t] = lo;
            y[t] = hi;
        }
    }
    (void)n;
}

/* ---- canonical rows: validate and sort ------------------------------------------------ */
/* One tile of up to TILE rows from flat row `base`, element by element (the reference
 * order of checks: a bad id anywhere in the tile first, then partial and duplicate rows). */
HOT int enc_canon_tile(const Arr3 *src, Arr3 *out, int64_t e, Py_ssize_t *bad_at,
                       const int ik, const int ok, const Net *net, Py_ssize_t base, int m,
                       Pos *rp, Pos *wp) {
    int k = (int)src->k;
    int32_t cols[KMAX][TILE];
    for (int t = 0; t < TILE; t++) {
        if (t >= m) {
            for (int j = 0; j < k; j++) cols[j][t] = INT32_MAX;
            continue;
        }
        const char *p = row_at(src, rp->r, rp->l);
        step(rp, src->layers);
        for (int j = 0; j < k; j++) {
            int64_t v = load(p, ik, j);
            if (v < -1 || v >= e) {
                *bad_at = base + t;
                return R3_BAD_ID;
            }
            cols[j][t] = (int32_t)v;
        }
    }
    sort_tile(cols, m, net);
    for (int t = 0; t < m; t++) {
        if (cols[0][t] == -1 && cols[k - 1][t] != -1) {
            *bad_at = base + t;
            return R3_PARTIAL;
        }
        for (int j = 1; j < k; j++)
            if (cols[j][t] == cols[j - 1][t] && cols[j][t] != -1) {
                *bad_at = base + t;
                return R3_DUPLICATE;
            }
        char *q = (char *)row_at(out, wp->r, wp->l);
        step(wp, out->layers);
        for (int j = 0; j < k; j++) store(q, ok, j, cols[j][t]);
    }
    return R3_OK;
}

#if ENC_SIMD
/* A whole tile (TILE rows) of K <= 8 ids into int16 rows, 8 rows per pass: rows to int16
 * lanes, transposed to columns, sorted by the network across 8 rows at once, checked
 * (range, partial, duplicate) and transposed back.  Returns 0 when the tile holds
 * something invalid (the caller reruns it element by element for the exact error). */
HOT int enc_canon_fast(const Arr3 *src, Arr3 *out, int64_t e, const int ik, const int K,
                       Pos *rp, Pos *wp) {
    const V neg1 = _mm_set1_epi16(-1), top = _mm_set1_epi16((short)(e - 1));
    for (int g = 0; g < TILE; g += 8) {
        V c[8];
        for (int t = 0; t < 8; t++) {
            c[t] = enc_row16(row_at(src, rp->r, rp->l), ik, K, src->kind);
            step(rp, src->layers);
        }
        enc_tr8(c);
        enc_sort8(c, K);
        /* c[0] is each row's least id, c[K-1] its greatest */
        V bad = _mm_or_si128(_mm_cmplt_epi16(c[0], neg1), _mm_cmpgt_epi16(c[K - 1], top));
        V empty = _mm_cmpeq_epi16(c[0], neg1);
        bad = _mm_or_si128(bad, _mm_andnot_si128(_mm_cmpeq_epi16(c[K - 1], neg1), empty));
        for (int j = 1; j < K; j++)
            bad = _mm_or_si128(bad, _mm_andnot_si128(empty, _mm_cmpeq_epi16(c[j], c[j - 1])));
        if (enc_any(bad)) return 0;
        enc_tr8(c);
        for (int t = 0; t < 8; t++) {
            memcpy((char *)row_at(out, wp->r, wp->l), &c[t], (size_t)K * 2);
            step(wp, out->layers);
        }
    }
    return 1;
}

/* enc_canon_fast for the kind `ik` (0: any) and K as constants. */
static int enc_canon_fast_any(const Arr3 *src, Arr3 *out, int64_t e, Pos *rp, Pos *wp) {
    int ik = src->kind;
#define ENC_CF(IK)                                                        \
    switch (src->k) {                                                     \
    case 1: return enc_canon_fast(src, out, e, IK, 1, rp, wp);            \
    case 2: return enc_canon_fast(src, out, e, IK, 2, rp, wp);            \
    case 3: return enc_canon_fast(src, out, e, IK, 3, rp, wp);            \
    case 4: return enc_canon_fast(src, out, e, IK, 4, rp, wp);            \
    case 5: return enc_canon_fast(src, out, e, IK, 5, rp, wp);            \
    case 6: return enc_canon_fast(src, out, e, IK, 6, rp, wp);            \
    case 7: return enc_canon_fast(src, out, e, IK, 7, rp, wp);            \
    default: return enc_canon_fast(src, out, e, IK, 8, rp, wp);           \
    }
    switch (ik) {
    case -1: ENC_CF(-1)
    case 1: ENC_CF(1)
    case 2: ENC_CF(2)
    case 4: ENC_CF(4)
    default: ENC_CF(0)
    }
#undef ENC_CF
}
#endif

HOT int canonical_k(const Arr3 *src, Arr3 *out, int64_t e, Py_ssize_t *bad_at, const int ik,
                    const int ok) {
    Net net;
    build_net((int)src->k, &net);
    Py_ssize_t n = src->rows * src->layers;
    Pos rp = {0, 0}, wp = {0, 0};
#if ENC_SIMD
    int fast = ok == 2 && src->k <= 8 && e <= INT16_MAX;
#endif
    for (Py_ssize_t base = 0; base < n; base += TILE) {
        int m = (int)(n - base < TILE ? n - base : TILE);
#if ENC_SIMD
        if (fast && m == TILE) {
            Pos r0 = rp, w0 = wp;
            if (enc_canon_fast_any(src, out, e, &rp, &wp)) continue;
            rp = r0, wp = w0;
        }
#endif
        int code = enc_canon_tile(src, out, e, bad_at, ik, ok, &net, base, m, &rp, &wp);
        if (code != R3_OK) return code;
    }
    return R3_OK;
}

static int canonical_core(const Arr3 *src, Arr3 *out, int64_t e, Py_ssize_t *bad_at) {
    int code = R3_OK;
#define CANON_OUT2(K) code = canonical_k(src, out, e, bad_at, K, 2)
#define CANON_OUT4(K) code = canonical_k(src, out, e, bad_at, K, 4)
    if (out->kind == 2) { BY_KIND(src->kind, CANON_OUT2) }
    else { BY_KIND(src->kind, CANON_OUT4) }
    return code;
}

static int same_shape(const Arr3 *a, const Arr3 *b) {
    return a->rows == b->rows && a->layers == b->layers && a->k == b->k;
}

static int out_kind_ok(const Arr3 *o) {
    if (o->kind != 2 && o->kind != 4) {
        PyErr_SetString(PyExc_TypeError, "output must be int16 or int32");
        return 0;
    }
    return 1;
}

/* canonical(src, out, e) -> (code, flat row index) */
static PyObject *py_canonical(PyObject *self, PyObject *args) {
    PyObject *so, *oo;
    long long e;
    Arr3 src, out;
    if (!PyArg_ParseTuple(args, "OOL", &so, &oo, &e)) return NULL;
    if (get3(so, 0, &src, "src") < 0) { rel3(&src); return NULL; }
    if (get3(oo, 1, &out, "out") < 0) { rel3(&src); rel3(&out); return NULL; }
    if (!same_shape(&src, &out) || !out_kind_ok(&out) || e < 1 || e > EMAX) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "canonical: shapes or E differ");
        rel3(&src); rel3(&out);
        return NULL;
    }
    int code;
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    code = canonical_core(&src, &out, e, &bad);
    Py_END_ALLOW_THREADS
    rel3(&src); rel3(&out);
    return Py_BuildValue("in", code, bad);
}

/* ---- popularity: per layer, experts by descending count, ties by id ------------------- */
HOT int count_k(const Arr3 *s, int64_t e, uint64_t *counts, const int ik) {
    for (Py_ssize_t r = 0; r < s->rows; r++)
        for (Py_ssize_t l = 0; l < s->layers; l++) {
            const char *p = row_at(s, r, l);
            uint64_t *c = counts + l * e;
            for (Py_ssize_t j = 0; j < s->k; j++) {
                int64_t v = load(p, ik, j);
                if (v >= e) return 1;
                if (v >= 0) c[v]++;
            }
        }
    return 0;
}

/* The same counts, 32-bit (when rows * K < 2^32), two more slots per layer: [L, E + 2];
 * negative ids go to slot E and ids >= E to slot E + 1 (an error, checked after), so no
 * element waits on a test.  K a constant when K <= 8 (0: any). */
HOT int enc_count32(const Arr3 *s, int64_t e, uint32_t *counts, const int ik, const int K) {
    int k = K ? K : (int)s->k;
    Py_ssize_t w = e + 2;
    for (Py_ssize_t r = 0; r < s->rows; r++) {
        const char *p = s->buf + r * s->s0;
        uint32_t *c = counts;
        for (Py_ssize_t l = 0; l < s->layers; l++, p += s->s1, c += w) {
            for (int j = 0; j < k; j++) {
                int64_t v = load(p, ik, j);
                c[v >= e ? e + 1 : v < 0 ? e : v]++;
            }
        }
    }
    for (Py_ssize_t l = 0; l < s->layers; l++)
        if (counts[l * w + e + 1]) return 1;
    return 0;
}

#if ENC_SIMD
/* enc_count32 for int16 rows of K <= 8 with L * (E + 2) < 2^16: each row's slots (clamped
 * as above, plus the layer's offset) computed 8 at a time, then K increments. */
HOT int enc_count16(const Arr3 *s, int64_t e, uint32_t *counts, const int K) {
    Py_ssize_t w = e + 2;
    const V top = _mm_set1_epi16((short)(e - 1)), zero = _mm_setzero_si128();
    const V ev = _mm_set1_epi16((short)e), e1 = _mm_set1_epi16((short)(e + 1));
    for (Py_ssize_t r = 0; r < s->rows; r++) {
        const char *p = s->buf + r * s->s0;
        V off = zero;
        const V step_w = _mm_set1_epi16((short)w);
        for (Py_ssize_t l = 0; l < s->layers; l++, p += s->s1, off = _mm_add_epi16(off, step_w)) {
            V v = enc_row16(p, 2, K, 2);
            V neg = _mm_cmplt_epi16(v, zero), big = _mm_cmpgt_epi16(v, top);
            V idx = _mm_andnot_si128(_mm_or_si128(neg, big), v);
            idx = _mm_or_si128(idx, _mm_and_si128(neg, ev));
            idx = _mm_or_si128(idx, _mm_and_si128(big, e1));
            idx = _mm_add_epi16(idx, off);
            uint16_t at[8];
            memcpy(at, &idx, sizeof(at));
            for (int j = 0; j < K; j++) counts[at[j]]++;
        }
    }
    for (Py_ssize_t l = 0; l < s->layers; l++)
        if (counts[l * w + e + 1]) return 1;
    return 0;
}
#endif

static int enc_count_any(const Arr3 *s, int64_t e, uint32_t *counts) {
#define ENC_CNT(IK)                                            \
    switch (s->k) {                                            \
    case 1: return enc_count32(s, e, counts, IK, 1);           \
    case 2: return enc_count32(s, e, counts, IK, 2);           \
    case 4: return enc_count32(s, e, counts, IK, 4);           \
    case 6: return enc_count32(s, e, counts, IK, 6);           \
    case 8: return enc_count32(s, e, counts, IK, 8);           \
    default: return enc_count32(s, e, counts, IK, 0);          \
    }
#if ENC_SIMD
    if (s->kind == 2 && s->k <= 8 && s->layers * (e + 2) < 65536) {
        switch (s->k) {
        case 1: return enc_count16(s, e, counts, 1);
        case 2: return enc_count16(s, e, counts, 2);
        case 3: return enc_count16(s, e, counts, 3);
        case 4: return enc_count16(s, e, counts, 4);
        case 5: return enc_count16(s, e, counts, 5);
        case 6: return enc_count16(s, e, counts, 6);
        case 7: return enc_count16(s, e, counts, 7);
        default: return enc_count16(s, e, counts, 8);
        }
    }
#endif
    if (s->kind == 2) { ENC_CNT(2) }
    ENC_CNT(4)
#undef ENC_CNT
}

/* Sort keys ascending (bottom-up merge sort through tmp); returns where they ended. */
static uint64_t *enc_msort(uint64_t *a, uint64_t *tmp, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i + 1 < n; i += 2)
        if (a[i] > a[i + 1]) { uint64_t x = a[i]; a[i] = a[i + 1]; a[i + 1] = x; }
    for (Py_ssize_t w = 2; w < n; w *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * w) {
            Py_ssize_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            Py_ssize_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) tmp[o++] = a[j] < a[i] ? a[j++] : a[i++];
            while (i < mid) tmp[o++] = a[i++];
            while (j < hi) tmp[o++] = a[j++];
        }
        uint64_t *x = a; a = tmp; tmp = x;
    }
    return a;
}

/* popularity(srt, e, table) ; table [L, E] as u1 (E <= 255) or <u2 */
static PyObject *py_popularity(PyObject *self, PyObject *args) {
    PyObject *so;
    Py_buffer ob;
    long long e;
    Arr3 s;
    if (!PyArg_ParseTuple(args, "OLw*", &so, &e, &ob)) return NULL;
    if (get3(so, 0, &s, "srt") < 0) { rel3(&s); PyBuffer_Release(&ob); return NULL; }
    Py_ssize_t isz = e <= 255 ? 1 : 2;
    if (e < 1 || e > EMAX || ob.len != s.layers * e * isz || (s.kind != 2 && s.kind != 4)) {
        PyErr_SetString(PyExc_ValueError, "popularity: table size, E or dtype is wrong");
        rel3(&s); PyBuffer_Release(&ob);
        return NULL;
    }
    /* counts [L, E + 2] (32-bit unless a count could pass 2^32 - 1), then per layer the
     * sort keys (count descending, id ascending) in two buffers of E */
    int wide = s.rows > (Py_ssize_t)(UINT32_MAX / (uint32_t)s.k); /* a count is at most rows * K */
    size_t cells = (size_t)(s.layers * (e + 2));
    void *counts = PyMem_RawCalloc(cells, wide ? sizeof(uint64_t) : sizeof(uint32_t));
    uint64_t *keys = PyMem_RawMalloc(2 * sizeof(uint64_t) * (size_t)e);
    if (keys == NULL || counts == NULL) {
        PyMem_RawFree(keys); PyMem_RawFree(counts);
        rel3(&s); PyBuffer_Release(&ob);
        return PyErr_NoMemory();
    }
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    if (wide) {
        uint64_t *c64 = counts; /* count_k's layout: [L, E] */
        if (s.kind == 2) bad = count_k(&s, e, c64, 2);
        else bad = count_k(&s, e, c64, 4);
    } else {
        bad = enc_count_any(&s, e, counts);
    }
    for (Py_ssize_t l = 0; l < s.layers && !bad; l++) {
        /* key: (2^48 - 1 - count) << 16 | id; a count is below 2^48 (the array's size) */
        for (long long x = 0; x < e; x++) {
            uint64_t n = wide ? ((uint64_t *)counts)[l * e + x]
                              : ((uint32_t *)counts)[l * (e + 2) + x];
            keys[x] = ((((uint64_t)1 << 48) - 1 - n) << 16) | (uint64_t)x;
        }
        const uint64_t *sorted = enc_msort(keys, keys + e, (Py_ssize_t)e);
        for (long long x = 0; x < e; x++) {
            if (isz == 1) ((uint8_t *)ob.buf)[l * e + x] = (uint8_t)sorted[x];
            else ((uint16_t *)ob.buf)[l * e + x] = (uint16_t)sorted[x];
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(keys);
    PyMem_RawFree(counts);
    rel3(&s); PyBuffer_Release(&ob);
    if (bad) { PyErr_SetString(PyExc_ValueError, "popularity: id outside [0, E)"); return NULL; }
    Py_RETURN_NONE;
}

/* ---- gap planes ----------------------------------------------------------------------- */
/* Layer-major gaps of canonical rows (relabelled and re-sorted when `rank` is given);
 * 16-bit gaps as a low-byte plane then a high-byte plane.  Returns 1 for rows that are
 * not canonical (never for the encoder's own rows). */
/* Rows [base, base + m) of layer l (m <= TILE), their gaps from `at`: the reference code. */
HOT int enc_gaps_rows(const Arr3 *s, int64_t e, const int32_t *lr, uint8_t *lo8, uint8_t *hi8,
                      Py_ssize_t l, Py_ssize_t base, int m, Py_ssize_t at, const Net *net,
                      const int ik, const int gsz) {
    int k = (int)s->k;
    int32_t gmax = (int32_t)(e - k + 1);
    if (!lr) { /* already ascending: gaps straight from the rows */
        for (int t = 0; t < m; t++, at += k) {
            const char *p = row_at(s, base + t, l);
            int32_t prev = (int32_t)load(p, ik, 0);
            if (prev < 0) {
                lo8[at] = (uint8_t)gmax;
                if (gsz == 2) hi8[at] = (uint8_t)(gmax >> 8);
                for (int j = 1; j < k; j++) {
                    lo8[at + j] = 0;
                    if (gsz == 2) hi8[at + j] = 0;
                }
                continue;
            }
            if (prev >= e) return 1;
            lo8[at] = (uint8_t)prev;
            if (gsz == 2) hi8[at] = (uint8_t)(prev >> 8);
            for (int j = 1; j < k; j++) {
                int32_t v = (int32_t)load(p, ik, j);
                if (v <= prev || v >= e) return 1;
                int32_t g = v - prev - 1;
                lo8[at + j] = (uint8_t)g;
                if (gsz == 2) hi8[at + j] = (uint8_t)(g >> 8);
                prev = v;
            }
        }
        return 0;
    }
    int32_t cols[KMAX][TILE];
    for (int t = 0; t < TILE; t++) {
        const char *p = t < m ? row_at(s, base + t, l) : NULL;
        for (int j = 0; j < k; j++) {
            int32_t v = p ? (int32_t)load(p, ik, j) : INT32_MAX;
            if (p && v >= 0) {
                if (v >= e) return 1;
                v = lr[v];
                if (v < 0 || v >= e) return 1;
            }
            cols[j][t] = v;
        }
    }
    sort_tile(cols, m, net);
    for (int t = 0; t < m; t++, at += k) {
        if (cols[0][t] < 0) {
            lo8[at] = (uint8_t)gmax;
            if (gsz == 2) hi8[at] = (uint8_t)(gmax >> 8);
            for (int j = 1; j < k; j++) {
                lo8[at + j] = 0;
                if (gsz == 2) hi8[at + j] = 0;
            }
            continue;
        }
        lo8[at] = (uint8_t)cols[0][t];
        if (gsz == 2) hi8[at] = (uint8_t)(cols[0][t] >> 8);
        for (int j = 1; j < k; j++) {
            int32_t g = cols[j][t] - cols[j - 1][t] - 1;
            if (g < 0) return 1;
            lo8[at + j] = (uint8_t)g;
            if (gsz == 2) hi8[at + j] = (uint8_t)(g >> 8);
        }
    }
    return 0;
}

#define ENC_TMAX 8192 /* relabel lookups on the stack: E <= ENC_TMAX - 2 */

#if ENC_SIMD
/* The gaps of 8 rows [base, base + 8) of layer l (K <= 8, E <= 32767), written at `at`:
 * rows to int16 lanes (through the relabel lookup T when given: T[id + 1], T[0] = -1,
 * INT16_MIN for anything the reference refuses), transposed to columns, sorted by the
 * network when relabelled, gaps by saturating differences, transposed back and narrowed
 * to the byte planes.  A pass that meets anything unusual goes the reference way. */
HOT int enc_gaps8(const Arr3 *s, int64_t e, const int32_t *lr, const int16_t *T,
                  uint8_t *lo8, uint8_t *hi8, Py_ssize_t l, Py_ssize_t base, Py_ssize_t at,
                  const Net *net, const int ik, const int gsz, const int K) {
    const V zero = _mm_setzero_si128(), one = _mm_set1_epi16(1), neg1 = _mm_set1_epi16(-1);
    const V top = _mm_set1_epi16((short)(e - 1)), gmaxv = _mm_set1_epi16((short)(e - K + 1));
    const V lowb = _mm_set1_epi16(0xFF), minv = _mm_set1_epi16(INT16_MIN);
    V c[8], bad;
    if (T) {
        int16_t row[8][8] __attribute__((aligned(16)));
        V out = zero;
        for (int t = 0; t < 8; t++) { /* every id in [-1, E), or the reference way */
            const char *p = row_at(s, base + t, l);
            V v = enc_row16(p, ik, K, ik);
            out = _mm_or_si128(out, _mm_or_si128(_mm_cmplt_epi16(v, neg1), _mm_cmpgt_epi16(v, top)));
        }
        out = _mm_and_si128(out, enc_lanes(K)); /* not the padding lanes */
        if (enc_any(out)) return enc_gaps_rows(s, e, lr, lo8, hi8, l, base, 8, at, net, ik, gsz);
        for (int t = 0; t < 8; t++) {
            const char *p = row_at(s, base + t, l);
            for (int j = 0; j < 8; j++)
                row[t][j] = j < K ? T[load(p, ik, j) + 1] : INT16_MAX;
        }
        for (int t = 0; t < 8; t++) c[t] = _mm_load_si128((const V *)row[t]);
        enc_tr8(c);
        enc_sort8(c, K);
        bad = _mm_cmpeq_epi16(c[0], minv);
    } else {
        for (int t = 0; t < 8; t++) {
            const char *p = row_at(s, base + t, l);
            c[t] = enc_row16(p, ik, K, ik);
        }
        enc_tr8(c);
        bad = _mm_cmpgt_epi16(c[K - 1], top);
    }
    V empty = _mm_cmplt_epi16(c[0], zero);
    V g[8];
    g[0] = _mm_or_si128(_mm_and_si128(empty, gmaxv), _mm_andnot_si128(empty, c[0]));
    for (int j = 1; j < 8; j++) {
        if (j >= K) { g[j] = zero; continue; }
        V d = _mm_subs_epi16(_mm_subs_epi16(c[j], c[j - 1]), one);
        bad = _mm_or_si128(bad, _mm_cmplt_epi16(d, zero));
        g[j] = d;
    }
    bad = _mm_andnot_si128(empty, bad);
    if (T) bad = _mm_or_si128(bad, _mm_cmpeq_epi16(c[0], minv));
    if (enc_any(bad)) return enc_gaps_rows(s, e, lr, lo8, hi8, l, base, 8, at, net, ik, gsz);
    for (int j = 1; j < K; j++) g[j] = _mm_andnot_si128(empty, g[j]);
    enc_tr8(g);
    uint8_t lo[64] __attribute__((aligned(16))), hi[64] __attribute__((aligned(16)));
    for (int t = 0; t < 8; t += 2) {
        if (gsz == 1) {
            _mm_store_si128((V *)(lo + 8 * t), _mm_packus_epi16(g[t], g[t + 1]));
        } else {
            _mm_store_si128((V *)(lo + 8 * t), _mm_packus_epi16(_mm_and_si128(g[t], lowb),
                                                                _mm_and_si128(g[t + 1], lowb)));
            _mm_store_si128((V *)(hi + 8 * t), _mm_packus_epi16(_mm_srli_epi16(g[t], 8),
                                                                _mm_srli_epi16(g[t + 1], 8)));
        }
    }
    if (K == 8) {
        memcpy(lo8 + at, lo, 64);
        if (gsz == 2) memcpy(hi8 + at, hi, 64);
    } else {
        for (int t = 0; t < 8; t++) {
            memcpy(lo8 + at + t * K, lo + 8 * t, (size_t)K);
            if (gsz == 2) memcpy(hi8 + at + t * K, hi + 8 * t, (size_t)K);
        }
    }
    return 0;
}

/* Layers [l0, l0 + nl) (their lookups at T + (l - l0) * (E + 2) when relabelled), rows
 * [0, rows - rows % 8): row groups outside, layers inside, so the rows are read in order. */
HOT int enc_gaps_band(const Arr3 *s, int64_t e, const int32_t *rank, const int16_t *T,
                      uint8_t *lo8, uint8_t *hi8, Py_ssize_t l0, Py_ssize_t nl, const Net *net,
                      const int ik, const int gsz, const int K) {
    Py_ssize_t full = s->rows - s->rows % 8;
    for (Py_ssize_t base = 0; base < full; base += 8) {
        for (int t = 0; t < 8; t++) enc_prefetch(s, base + ENC_AHEAD + t, l0, nl);
        for (Py_ssize_t l = l0; l < l0 + nl; l++) {
            const int32_t *lr = rank ? rank + l * e : NULL;
            const int16_t *tl = rank ? T + (l - l0) * (e + 2) : NULL;
            Py_ssize_t at = (l * s->rows + base) * K;
            if (enc_gaps8(s, e, lr, tl, lo8, hi8, l, base, at, net, ik, gsz, K)) return 1;
        }
    }
    return 0;
}

static int enc_gaps_band_any(const Arr3 *s, int64_t e, const int32_t *rank, const int16_t *T,
                             uint8_t *lo8, uint8_t *hi8, Py_ssize_t l0, Py_ssize_t nl,
                             const Net *net, const int ik, const int gsz) {
    switch (s->k) {
#define ENC_GB(K) case K: return enc_gaps_band(s, e, rank, T, lo8, hi8, l0, nl, net, ik, gsz, K);
    ENC_GB(1) ENC_GB(2) ENC_GB(3) ENC_GB(4) ENC_GB(5) ENC_GB(6) ENC_GB(7)
    default: return enc_gaps_band(s, e, rank, T, lo8, hi8, l0, nl, net, ik, gsz, 8);
#undef ENC_GB
    }
}
#endif

/* Layer-major gaps of canonical rows (relabelled and re-sorted when `rank` is given);
 * 16-bit gaps as a low-byte plane then a high-byte plane.  Returns 1 for rows that are
 * not canonical (never for the encoder's own rows). */
HOT int gaps_k(const Arr3 *s, int64_t e, const int32_t *rank, uint8_t *planes, const int ik,
               const int gsz) {
    Net net;
    int k = (int)s->k;
    Py_ssize_t n = s->rows * s->layers * k;
    uint8_t *lo8 = planes, *hi8 = planes + (gsz == 2 ? n : 0);
    build_net(k, &net);
    Py_ssize_t l0 = 0, band = s->layers, full = 0;
#if ENC_SIMD
    int16_t T[ENC_TMAX];
    if (k <= 8 && (rank ? e <= ENC_TMAX - 2 : e <= INT16_MAX)) {
        full = s->rows - s->rows % 8;
        if (rank) band = ENC_TMAX / (e + 2);
    }
#endif
    for (; l0 < s->layers; l0 += band) {
        Py_ssize_t nl = s->layers - l0 < band ? s->layers - l0 : band;
#if ENC_SIMD
        if (full) {
            if (rank)
                for (Py_ssize_t l = 0; l < nl; l++) {
                    const int32_t *lr = rank + (l0 + l) * e;
                    int16_t *tl = T + l * (e + 2);
                    tl[0] = -1;
                    for (int64_t v = 0; v < e; v++)
                        tl[v + 1] = (int16_t)(lr[v] >= 0 && lr[v] < e ? lr[v] : INT16_MIN);
                    tl[e + 1] = INT16_MIN;
                }
            if (enc_gaps_band_any(s, e, rank, T, lo8, hi8, l0, nl, &net, ik, gsz)) return 1;
        }
#endif
        for (Py_ssize_t l = l0; l < l0 + nl; l++) {
            const int32_t *lr = rank ? rank + l * e : NULL;
            for (Py_ssize_t base = full; base < s->rows; base += TILE) {
                int m = (int)(s->rows - base < TILE ? s->rows - base : TILE);
                Py_ssize_t at = (l * s->rows + base) * k;
                if (enc_gaps_rows(s, e, lr, lo8, hi8, l, base, m, at, &net, ik, gsz)) return 1;
            }
        }
    }
    return 0;
}

static int gaps_any(const Arr3 *s, int64_t e, const int32_t *rank, uint8_t *planes,
                           int gsz) {
    if (s->kind == 2 && gsz == 1) return gaps_k(s, e, rank, planes, 2, 1);
    if (s->kind == 2) return gaps_k(s, e, rank, planes, 2, 2);
    if (gsz == 1) return gaps_k(s, e, rank, planes, 4, 1);
    return gaps_k(s, e, rank, planes, 4, 2);
}

/* gap_payload(srt, e, to_rank (int32 [L, E] buffer) or None, out) : layer-major gaps. */
static PyObject *py_gap_payload(PyObject *self, PyObject *args) {
    PyObject *so, *ro;
    Py_buffer ob, rb;
    long long e;
    Arr3 s;
    int have_rank;
    if (!PyArg_ParseTuple(args, "OLOw*", &so, &e, &ro, &ob)) return NULL;
    have_rank = ro != Py_None;
    memset(&rb, 0, sizeof(rb));
    if (have_rank && PyObject_GetBuffer(ro, &rb, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&ob);
        return NULL;
    }
    if (get3(so, 0, &s, "srt") < 0) goto fail;
    int k = (int)s.k;
    long long gmax = e - k + 1;
    Py_ssize_t gsz = gmax <= 255 ? 1 : 2;
    Py_ssize_t n = s.rows * s.layers * k;
    if (e < k || e > EMAX || ob.len != n * gsz || (s.kind != 2 && s.kind != 4) ||
        (have_rank && rb.len != s.layers * e * (Py_ssize_t)sizeof(int32_t))) {
        PyErr_SetString(PyExc_ValueError, "gap_payload: sizes, E or dtype are wrong");
        goto fail;
    }
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    const int32_t *rank = have_rank ? (const int32_t *)rb.buf : NULL;
    uint8_t *planes = (uint8_t *)ob.buf;
    bad = gaps_any(&s, e, rank, planes, (int)gsz);
    Py_END_ALLOW_THREADS
    rel3(&s); PyBuffer_Release(&ob);
    if (have_rank) PyBuffer_Release(&rb);
    if (bad) { PyErr_SetString(PyExc_ValueError, "gap_payload: rows are not canonical"); return NULL; }
    Py_RETURN_NONE;
fail:
    rel3(&s); PyBuffer_Release(&ob);
    if (have_rank) PyBuffer_Release(&rb);
    return NULL;
}

/* Gap planes (layer-major) to token-major ids in `o`, through the relabel table `o8`/`o16`
 * ([L, E], rank -> expert) when one is given; R3_GAP for gaps valid routing cannot have.
 * Rows go in tiles of DEC_ZROWS, every layer of a tile before the next tile: the output is
 * token-major, so a tile's rows stay in cache while its layers are filled in. */
#define DEC_ZROWS 64

HOT int ids_k(Arr3 *o, int64_t e, const uint8_t *planes, const uint8_t *o8,
              const uint16_t *o16, const int ok, const int gsz, const int kc) {
    int k = kc ? kc : (int)o->k; /* kc: K as a constant (0: any K) */
    uint32_t gmax = (uint32_t)(e - k + 1);
    Py_ssize_t n = o->rows * o->layers * k;
    const uint8_t *lo8 = planes, *hi8 = planes + (gsz == 2 ? n : 0);
    for (Py_ssize_t r0 = 0; r0 < o->rows; r0 += DEC_ZROWS) {
        Py_ssize_t r1 = o->rows - r0 < DEC_ZROWS ? o->rows : r0 + DEC_ZROWS;
        for (Py_ssize_t l = 0; l < o->layers; l++) {
            const uint8_t *t8 = o8 ? o8 + l * e : NULL;
            const uint16_t *t16 = o16 ? o16 + l * e : NULL;
            Py_ssize_t at = (l * o->rows + r0) * k;
            for (Py_ssize_t r = r0; r < r1; r++, at += k) {
                char *q = (char *)row_at(o, r, l);
                uint32_t g0 = lo8[at] | (gsz == 2 ? (uint32_t)hi8[at] << 8 : 0);
                if (g0 == gmax) {
                    uint32_t any = 0;
                    for (int j = 1; j < k; j++) any |= lo8[at + j] | (gsz == 2 ? hi8[at + j] : 0);
                    if (any) return R3_GAP;
                    for (int j = 0; j < k; j++) store(q, ok, j, -1);
                    continue;
                }
                /* one pass: ids into a row buffer, the checks gathered (every gap within
                 * gmax, the last id below E), then the row written */
                int32_t ids[KMAX];
                uint32_t id = g0, worst = g0;
                ids[0] = (int32_t)g0;
                for (int j = 1; j < k; j++) {
                    uint32_t g = lo8[at + j] | (gsz == 2 ? (uint32_t)hi8[at + j] << 8 : 0);
                    worst = g > worst ? g : worst;
                    id += g + 1;
                    ids[j] = (int32_t)id;
                }
                if (worst > gmax || id >= (uint32_t)e) return R3_GAP;
                if (t8)
                    for (int j = 0; j < k; j++) store(q, ok, j, t8[ids[j]]);
                else if (t16)
                    for (int j = 0; j < k; j++) store(q, ok, j, t16[ids[j]]);
                else
                    for (int j = 0; j < k; j++) store(q, ok, j, ids[j]);
            }
        }
    }
    return R3_OK;
}

static int ids_any(Arr3 *o, int64_t e, const uint8_t *planes, const void *o8,
                          const void *o16, int gsz) {
    const uint8_t *t8 = (const uint8_t *)o8;
    const uint16_t *t16 = (const uint16_t *)o16;
    /* common shapes with K a constant: the per-row loops unroll */
    if (o->kind == 2 && o->k == 8)
        return gsz == 1 ? ids_k(o, e, planes, t8, t16, 2, 1, 8) : ids_k(o, e, planes, t8, t16, 2, 2, 8);
    if (o->kind == 2 && o->k == 4)
        return gsz == 1 ? ids_k(o, e, planes, t8, t16, 2, 1, 4) : ids_k(o, e, planes, t8, t16, 2, 2, 4);
    if (o->kind == 2) return gsz == 1 ? ids_k(o, e, planes, t8, t16, 2, 1, 0)
                                      : ids_k(o, e, planes, t8, t16, 2, 2, 0);
    return gsz == 1 ? ids_k(o, e, planes, t8, t16, 4, 1, 0) : ids_k(o, e, planes, t8, t16, 4, 2, 0);
}

/* zset_decode(payload, e, order (u1/<u2 [L, E] buffer) or None, out) -> code
 * Layer-major gap planes to token-major ids, relabelled by `order` when given. */
static PyObject *py_zset_decode(PyObject *self, PyObject *args) {
    Py_buffer pb, tb;
    PyObject *to, *oo;
    long long e;
    Arr3 o;
    if (!PyArg_ParseTuple(args, "y*LOO", &pb, &e, &to, &oo)) return NULL;
    int have_order = to != Py_None;
    memset(&tb, 0, sizeof(tb));
    if (have_order && PyObject_GetBuffer(to, &tb, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&pb);
        return NULL;
    }
    if (get3(oo, 1, &o, "out") < 0) goto fail;
    if (!out_kind_ok(&o)) goto fail;
    int k = (int)o.k;
    long long gmax = e - k + 1;
    Py_ssize_t gsz = gmax <= 255 ? 1 : 2;
    Py_ssize_t tsz = e <= 255 ? 1 : 2;
    Py_ssize_t n = o.rows * o.layers * k;
    if (e < k || e > EMAX || (have_order && tb.len != o.layers * e * tsz)) {
        PyErr_SetString(PyExc_ValueError, "zset_decode: E, K or table size is wrong");
        goto fail;
    }
    if (pb.len != n * gsz) {
        rel3(&o); PyBuffer_Release(&pb);
        if (have_order) PyBuffer_Release(&tb);
        return PyLong_FromLong(R3_LENGTH);
    }
    int code = R3_OK;
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *planes = (const uint8_t *)pb.buf;
    const void *order = have_order ? tb.buf : NULL;
    code = ids_any(&o, e, planes, tsz == 1 ? order : NULL, tsz == 2 ? order : NULL, (int)gsz);
    Py_END_ALLOW_THREADS
    rel3(&o); PyBuffer_Release(&pb);
    if (have_order) PyBuffer_Release(&tb);
    return PyLong_FromLong(code);
fail:
    rel3(&o); PyBuffer_Release(&pb);
    if (have_order) PyBuffer_Release(&tb);
    return NULL;
}

/* ---- raw ------------------------------------------------------------------------------ */
/* Ids as written, narrowed to `osz` bytes (truncated: -1 becomes the maximum); rows that
 * follow each other in memory as one run, so the loop vectorises. */
HOT void enc_raw_k(const Arr3 *s, uint8_t *out, const int ik, const int osz) {
    Py_ssize_t isz = ik < 0 ? -ik : ik, k = s->k;
    Py_ssize_t run = k, at = 0;
    if (s->s1 == k * isz || s->layers == 1) {
        run = k * s->layers;
        if (s->s0 == run * isz || s->rows == 1) run *= s->rows;
    }
    Py_ssize_t rows = (s->rows * s->layers * k) / (run ? run : 1);
    for (Py_ssize_t i = 0; i < rows; i++) {
        Py_ssize_t n0 = i * run; /* flat element index of the run's first id */
        Py_ssize_t r = n0 / (k * s->layers), l = (n0 / k) % s->layers;
        const char *p = row_at(s, r, l);
        if (l == 0 && run <= k * s->layers) enc_prefetch(s, r + ENC_AHEAD, 0, s->layers);
        if (osz == 1) {
            for (Py_ssize_t j = 0; j < run; j++) out[at + j] = (uint8_t)load(p, ik, j);
        } else {
            for (Py_ssize_t j = 0; j < run; j++) {
                uint16_t w = (uint16_t)load(p, ik, j);
                memcpy(out + 2 * (at + j), &w, 2);
            }
        }
        at += run;
    }
}
#define ENC_RAW1(K) enc_raw_k(&s, (uint8_t *)ob.buf, K, 1)
#define ENC_RAW2(K) enc_raw_k(&s, (uint8_t *)ob.buf, K, 2)

/* raw_encode(src, e, out bytes-like) : ids as u1/<u2, -1 as the dtype's max, as written. */
static PyObject *py_raw_encode(PyObject *self, PyObject *args) {
    PyObject *so;
    Py_buffer ob;
    long long e;
    Arr3 s;
    if (!PyArg_ParseTuple(args, "OLw*", &so, &e, &ob)) return NULL;
    if (get3(so, 0, &s, "src") < 0) { rel3(&s); PyBuffer_Release(&ob); return NULL; }
    Py_ssize_t isz = e <= 255 ? 1 : 2;
    if (e < 1 || e > EMAX || ob.len != s.rows * s.layers * s.k * isz) {
        PyErr_SetString(PyExc_ValueError, "raw_encode: sizes or E are wrong");
        rel3(&s); PyBuffer_Release(&ob);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (isz == 1) { BY_KIND(s.kind, ENC_RAW1) }
    else { BY_KIND(s.kind, ENC_RAW2) }
    Py_END_ALLOW_THREADS
    rel3(&s); PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

/* A raw body (ids as u1/<u2 of `isz` bytes, the dtype's maximum for -1; exactly
 * rows x layers x K of them) into o, every row checked (range, partial, duplicates). */
static int raw_core(const uint8_t *body, Py_ssize_t isz, int64_t e, Arr3 *o) {
    int code = R3_OK;
    uint32_t sentinel = isz == 1 ? 0xFF : 0xFFFF;
    int k = (int)o->k;
    Py_ssize_t at = 0;
    for (Py_ssize_t r = 0; r < o->rows && code == R3_OK; r++)
        for (Py_ssize_t l = 0; l < o->layers && code == R3_OK; l++, at += k) {
            int32_t row[KMAX];
            char *q = (char *)row_at(o, r, l);
            int neg = 0;
            for (int j = 0; j < k; j++) {
                uint16_t u16 = 0;
                if (isz == 2) memcpy(&u16, body + 2 * (at + j), 2);
                uint32_t u = isz == 1 ? body[at + j] : u16;
                int32_t v = u == sentinel ? -1 : (int32_t)u;
                if (v >= e) code = R3_BAD_ID;
                neg += v < 0;
                row[j] = v;
                store(q, o->kind, j, v);
            }
            if (neg && neg != k) code = R3_PARTIAL;
            if (neg || code != R3_OK) continue;
            for (int j = 1; j < k; j++) { /* insertion sort of a copy for the duplicate check */
                int32_t v = row[j];
                int i = j - 1;
                while (i >= 0 && row[i] > v) { row[i + 1] = row[i]; i--; }
                row[i + 1] = v;
            }
            for (int j = 1; j < k; j++)
                if (row[j] == row[j - 1]) code = R3_DUPLICATE;
        }
    return code;
}

/* raw_decode(body, e, out) -> code : checks every row (range, partial, duplicates). */
static PyObject *py_raw_decode(PyObject *self, PyObject *args) {
    Py_buffer bb;
    PyObject *oo;
    long long e;
    Arr3 o;
    if (!PyArg_ParseTuple(args, "y*LO", &bb, &e, &oo)) return NULL;
    if (get3(oo, 1, &o, "out") < 0 || !out_kind_ok(&o)) { rel3(&o); PyBuffer_Release(&bb); return NULL; }
    Py_ssize_t isz = e <= 255 ? 1 : 2;
    if (e < 1 || e > EMAX) {
        PyErr_SetString(PyExc_ValueError, "raw_decode: E is wrong");
        rel3(&o); PyBuffer_Release(&bb);
        return NULL;
    }
    if (bb.len != o.rows * o.layers * o.k * isz) {
        rel3(&o); PyBuffer_Release(&bb);
        return PyLong_FromLong(R3_LENGTH);
    }
    int code = R3_OK;
    Py_BEGIN_ALLOW_THREADS
    code = raw_core((const uint8_t *)bb.buf, isz, e, &o);
    Py_END_ALLOW_THREADS
    rel3(&o); PyBuffer_Release(&bb);
    return PyLong_FromLong(code);
}

/* ---- set ranks ------------------------------------------------------------------------ */
/* Tables for (E, K): C(n, i) for i in [0, K], n in [0, E] as u128, saturating, with the
 * guard C(E, i) = max (as r3_client.codec.setrank); then per i a bucket table over the
 * rank's leading bits: the largest c in [i-1, E-1] with C(c, i) <= the bucket's least
 * value, where unranking starts its search. */
typedef struct {
    int e, k;
    const u128 *binom;      /* [(K+1) * (E+1)] */
    const uint64_t *binom64; /* the same, saturated at 2**64 - 1 */
    const uint16_t *bucket; /* [(K+1) * NKEYS] */
    const uint64_t *ent;    /* DK_ENTS per level i in [2, K], or NULL: see dk_ents */
} Tables;

static Py_ssize_t bucket_end(int e, int k) {
    Py_ssize_t n = (Py_ssize_t)(k + 1) * (e + 1) * (Py_ssize_t)(sizeof(u128) + sizeof(uint64_t)) +
                   (Py_ssize_t)(k + 1) * NKEYS * (Py_ssize_t)sizeof(uint16_t);
    return (n + 31) & ~(Py_ssize_t)31;
}

/* Whether (E, K) gets the one-load decode table: C(E, K) < 2**64 and K <= DK_KMAX. */
static int has_ents(int e, int k) {
    if (k > DK_KMAX || k < 2) return 0;
    u128 c = 1; /* C(E, K) exactly, as long as it stays below 2**64 */
    int kk = k < e - k ? k : e - k;
    for (int j = 1; j <= kk; j++) {
        c = c * (u128)(e - kk + j) / (u128)j;
        if (c > (u128)UINT64_MAX) return 0;
    }
    return c < (u128)UINT64_MAX;
}

static Py_ssize_t tables_size(int e, int k) {
    Py_ssize_t n = bucket_end(e, k);
    if (has_ents(e, k)) n += (Py_ssize_t)(k - 1) * DK_ENTS * DK_ENT * (Py_ssize_t)sizeof(uint64_t);
    return n;
}

static inline int key_of64(uint64_t r) {
    if (r == 0) return 0;
    int b = 63 - __builtin_clzll(r);
    unsigned m = b >= MBITS ? (unsigned)(r >> (b - MBITS)) & ((1u << MBITS) - 1)
                            : (unsigned)(r << (MBITS - b)) & ((1u << MBITS) - 1);
    return 1 + b * (1 << MBITS) + (int)m;
}

/* The same key for a rank of up to 128 bits (its leading bit is then past MBITS). */
static inline int key_of(u128 r) {
    uint64_t hi = (uint64_t)(r >> 64);
    if (hi == 0) return key_of64((uint64_t)r);
    int b = 127 - __builtin_clzll(hi);
    return 1 + b * (1 << MBITS) + (int)((unsigned)(r >> (b - MBITS)) & ((1u << MBITS) - 1));
}

static inline u128 key_min(int key) {
    if (key == 0) return 0;
    int b = (key - 1) >> MBITS;
    u128 top = ((u128)1 << MBITS) | (u128)((key - 1) & ((1 << MBITS) - 1));
    return b >= MBITS ? top << (b - MBITS) : top >> (MBITS - b);
}

/* The decode table's key of a 64-bit rank x: its bit length b (0 for x = 0) above the
 * DK_MBITS bits after its leading one. */
static inline int dk_key(uint64_t x) {
    int s = __builtin_clzll(x | 1);
    return ((64 - s) << DK_MBITS) + (int)((x << s) >> (63 - DK_MBITS)) - (1 << DK_MBITS);
}

/* The least rank with that key. */
static inline uint64_t dk_min(int key) {
    int b = key >> DK_MBITS; /* bit length */
    if (b <= 1) return key == (1 << DK_MBITS) ? 1 : 0;
    u128 top = ((u128)1 << DK_MBITS) | (u128)(key & ((1 << DK_MBITS) - 1));
    return (uint64_t)((top << (b - 1)) >> DK_MBITS);
}

static PyObject *py_set_tables(PyObject *self, PyObject *args) {
    int e, k;
    if (!PyArg_ParseTuple(args, "ii", &e, &k)) return NULL;
    if (e < 1 || e > EMAX || k < 1 || k > KMAX || k > e) {
        PyErr_SetString(PyExc_ValueError, "set_tables: E or K out of range");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, tables_size(e, k));
    if (out == NULL) return NULL;
    char *base = PyBytes_AS_STRING(out);
    Py_ssize_t cells = (Py_ssize_t)(k + 1) * (e + 1);
    u128 *binom = (u128 *)base;
    uint64_t *binom64 = (uint64_t *)(base + cells * sizeof(u128));
    uint16_t *bucket = (uint16_t *)(base + cells * (sizeof(u128) + sizeof(uint64_t)));
    const u128 MAX = ~(u128)0;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i <= k; i++)
        for (int n = 0; n <= e; n++) {
            u128 v;
            if (i == 0) v = 1;
            else if (n == 0) v = 0;
            else {
                u128 a = binom[(i - 1) * (e + 1) + n - 1], b = binom[i * (e + 1) + n - 1];
                v = (a == MAX || b == MAX || a > MAX - b) ? MAX : a + b;
            }
            binom[i * (e + 1) + n] = v;
        }
    for (int i = 0; i <= k; i++) binom[i * (e + 1) + e] = MAX;
    for (Py_ssize_t c = 0; c < cells; c++)
        binom64[c] = binom[c] > (u128)UINT64_MAX ? UINT64_MAX : (uint64_t)binom[c];
    for (int i = 0; i <= k; i++) {
        const u128 *row = binom + i * (e + 1);
        for (int key = 0; key < NKEYS; key++) {
            u128 r = key_min(key);
            int lo = i > 0 ? i - 1 : 0, hi = e - 1; /* largest c in [lo, hi] with row[c] <= r */
            if (lo > hi) lo = hi;
            while (lo < hi) {
                int mid = lo + (hi - lo + 1) / 2;
                if (row[mid] <= r) lo = mid;
                else hi = mid - 1;
            }
            bucket[i * NKEYS + key] = (uint16_t)lo;
        }
    }
    if (has_ents(e, k)) {
        uint64_t *ent = (uint64_t *)(base + bucket_end(e, k));
        for (int i = 2; i <= k; i++) {
            const uint64_t *row = binom64 + i * (e + 1);
            for (int key = 0; key < DK_ENTS; key++) {
                uint64_t r = dk_min(key);
                r = r - (r >> 50) - (r != 0); /* and the ranks a double rounds up to it */
                int lo = i - 1, hi = e - 1;
                while (lo < hi) {
                    int mid = lo + (hi - lo + 1) / 2;
                    if (row[mid] <= r) lo = mid;
                    else hi = mid - 1;
                }
                uint64_t *en = ent + ((Py_ssize_t)(i - 2) * DK_ENTS + key) * DK_ENT;
                en[0] = row[lo];
                en[1] = row[lo + 1];
                en[2] = lo + 2 <= e ? row[lo + 2] : UINT64_MAX;
                en[3] = (uint64_t)lo;
            }
        }
    }
    Py_END_ALLOW_THREADS
    return out;
}

static int tables_from(Py_buffer *tb, int e, int k, Tables *t) {
    if (e < 1 || e > EMAX || k < 1 || k > KMAX || k > e || tb->len != tables_size(e, k)) {
        PyErr_SetString(PyExc_ValueError, "set tables do not match E and K");
        return -1;
    }
    t->e = e;
    t->k = k;
    Py_ssize_t cells = (Py_ssize_t)(k + 1) * (e + 1);
    t->binom = (const u128 *)tb->buf;
    t->binom64 = (const uint64_t *)((const char *)tb->buf + cells * sizeof(u128));
    t->bucket = (const uint16_t *)((const char *)tb->buf + cells * (sizeof(u128) + sizeof(uint64_t)));
    t->ent = has_ents(e, k) ? (const uint64_t *)((const char *)tb->buf + bucket_end(e, k)) : NULL;
    return 0;
}

/* C(E, K), the "-1 row" rank: the table's C(E, i) entries are guards, so it is summed from
 * C(E-1, K-1) + C(E-1, K) (both below it, so never saturated when it fits 128 bits). */
static u128 sentinel_of(const Tables *t) {
    int e = t->e, k = t->k;
    return t->binom[(k - 1) * (e + 1) + e - 1] + t->binom[k * (e + 1) + e - 1];
}

static Py_ssize_t packed_len(Py_ssize_t n, int bits) {
    if (bits > 64) return n * 8 + (n * (bits - 64) + 7) / 8;
    return (n * bits + 7) / 8;
}

/* Append `width`-bit fields LSB-first; out has exactly packed bytes for all fields. */
typedef struct { uint8_t *out; Py_ssize_t at; u128 acc; int nacc; } BitW;

static inline void bw_put(BitW *w, uint64_t v, int width) {
    w->acc |= (u128)v << w->nacc;
    w->nacc += width;
    if (w->nacc >= 64) {
        uint64_t word = (uint64_t)w->acc;
        memcpy(w->out + w->at, &word, 8);
        w->at += 8;
        w->acc >>= 64;
        w->nacc -= 64;
    }
}

static inline void bw_flush(BitW *w) {
    while (w->nacc > 0) {
        w->out[w->at++] = (uint8_t)w->acc;
        w->acc >>= 8;
        w->nacc -= 8;
    }
}

typedef struct { const uint8_t *in; Py_ssize_t len, at; u128 acc; int nacc; } BitR;

static inline uint64_t br_get(BitR *r, int width) {
    if (r->nacc < width) {
        uint64_t word = 0;
        Py_ssize_t left = r->len - r->at;
        if (left >= 8) memcpy(&word, r->in + r->at, 8), r->at += 8;
        else if (left > 0) memcpy(&word, r->in + r->at, (size_t)left), r->at += left;
        r->acc |= (u128)word << r->nacc;
        r->nacc += left >= 8 ? 64 : (int)(left > 0 ? left * 8 : 0);
    }
    uint64_t v = width == 64 ? (uint64_t)r->acc : (uint64_t)r->acc & ((1ULL << width) - 1);
    r->acc >>= width;
    r->nacc -= width;
    return v;
}

/* Ranks of canonical rows into the bit writers (lo: 64-bit or all, hi: the rest). */
HOT int rank_k(const Arr3 *s, const Tables *t, u128 sentinel, int bits, BitW *lo, BitW *hi,
               const int ik) {
    int k = (int)s->k, e = t->e;
    for (Py_ssize_t r = 0; r < s->rows; r++)
        for (Py_ssize_t l = 0; l < s->layers; l++) {
            const char *p = row_at(s, r, l);
            int64_t first = load(p, ik, 0);
            if (bits <= 64) {
                uint64_t v = 0;
                if (first < 0) v = (uint64_t)sentinel;
                else
                    for (int i = 1; i <= k; i++) {
                        int64_t c = load(p, ik, i - 1);
                        if (c < 0 || c >= e) return 1;
                        v += t->binom64[i * (e + 1) + c];
                    }
                bw_put(lo, v, bits);
                continue;
            }
            u128 v = 0;
            if (first < 0) v = sentinel;
            else
                for (int i = 1; i <= k; i++) {
                    int64_t c = load(p, ik, i - 1);
                    if (c < 0 || c >= e) return 1;
                    v += t->binom[i * (e + 1) + c];
                }
            bw_put(lo, (uint64_t)v, 64);
            bw_put(hi, (uint64_t)(v >> 64), bits - 64);
        }
    return 0;
}

/* rank_k for ranks of at most 64 bits, the bit writer in a 64-bit word (K a constant when
 * K <= 8, 0: any).  A rank wider than `bits` (only rows that are not canonical can sum to
 * one) hands the rest to rank_k's writer, which keeps its spilled bits. */
HOT int enc_rank64(const Arr3 *s, const Tables *t, u128 sentinel, int bits, BitW *lo,
                   BitW *hi, const int ik, const int K) {
    int k = K ? K : (int)s->k, e = t->e;
    const uint64_t *col[KMAX];
    for (int i = 0; i < k; i++) col[i] = t->binom64 + (i + 1) * (e + 1);
    uint64_t acc = 0, over = bits == 64 ? 0 : ~(uint64_t)0 << bits;
    int nacc = 0;
    uint8_t *out = lo->out;
    Py_ssize_t at = 0;
    for (Py_ssize_t r = 0; r < s->rows; r++)
        for (Py_ssize_t l = 0; l < s->layers; l++) {
            const char *p = row_at(s, r, l);
            if (l == 0) enc_prefetch(s, r + ENC_AHEAD, 0, s->layers);
            uint64_t v = 0;
            if (load(p, ik, 0) < 0) v = (uint64_t)sentinel;
            else {
                int bad = 0;
#if ENC_SIMD
                if (ik == 2 && K && e <= INT16_MAX) {
                    V x = enc_row16(p, 2, K, 2);
                    V out = _mm_or_si128(_mm_cmplt_epi16(x, _mm_setzero_si128()),
                                         _mm_cmpgt_epi16(x, _mm_set1_epi16((short)(e - 1))));
                    bad = enc_any(_mm_and_si128(out, enc_lanes(K)));
                } else
#endif
                    for (int i = 0; i < k; i++) bad |= (uint64_t)load(p, ik, i) >= (uint64_t)e;
                if (bad) return 1;
                for (int i = 0; i < k; i++) v += col[i][load(p, ik, i)];
            }
            if (v & over) { /* the rest the reference way, from this row */
                lo->at = at, lo->acc = acc, lo->nacc = nacc;
                Arr3 rest = *s;
                rest.buf = (char *)p;
                rest.rows = 1, rest.layers = s->layers - l;
                if (rank_k(&rest, t, sentinel, bits, lo, hi, ik)) return 1;
                if (r + 1 == s->rows) return 0;
                rest.buf = (char *)row_at(s, r + 1, 0);
                rest.rows = s->rows - r - 1, rest.layers = s->layers;
                return rank_k(&rest, t, sentinel, bits, lo, hi, ik);
            }
            acc |= v << nacc;
            nacc += bits;
            if (nacc >= 64) {
                memcpy(out + at, &acc, 8);
                at += 8;
                nacc -= 64;
                acc = nacc ? v >> (bits - nacc) : 0;
            }
        }
    lo->at = at, lo->acc = acc, lo->nacc = nacc;
    return 0;
}

static int rank_any(const Arr3 *s, const Tables *t, u128 sentinel, int bits, BitW *lo,
                           BitW *hi) {
    if (bits <= 64) {
#define ENC_RK(IK)                                                             \
        switch (s->k) {                                                        \
        case 1: return enc_rank64(s, t, sentinel, bits, lo, hi, IK, 1);        \
        case 2: return enc_rank64(s, t, sentinel, bits, lo, hi, IK, 2);        \
        case 4: return enc_rank64(s, t, sentinel, bits, lo, hi, IK, 4);        \
        case 6: return enc_rank64(s, t, sentinel, bits, lo, hi, IK, 6);        \
        case 8: return enc_rank64(s, t, sentinel, bits, lo, hi, IK, 8);        \
        default: return enc_rank64(s, t, sentinel, bits, lo, hi, IK, 0);       \
        }
        if (s->kind == 2) { ENC_RK(2) }
        ENC_RK(4)
#undef ENC_RK
    }
    if (s->kind == 2) return rank_k(s, t, sentinel, bits, lo, hi, 2);
    return rank_k(s, t, sentinel, bits, lo, hi, 4);
}

/* set_encode(srt, e, tables, bits, out) : ranks of canonical rows, bit-packed. */
static PyObject *py_set_encode(PyObject *self, PyObject *args) {
    PyObject *so;
    Py_buffer tb, ob;
    int e, bits;
    Arr3 s;
    Tables t;
    if (!PyArg_ParseTuple(args, "Oiy*iw*", &so, &e, &tb, &bits, &ob)) return NULL;
    if (get3(so, 0, &s, "srt") < 0) goto fail;
    if (tables_from(&tb, e, (int)s.k, &t) < 0) goto fail;
    Py_ssize_t n = s.rows * s.layers;
    if (bits < 1 || bits > 128 || ob.len != packed_len(n, bits) || (s.kind != 2 && s.kind != 4)) {
        PyErr_SetString(PyExc_ValueError, "set_encode: bits, sizes or dtype are wrong");
        goto fail;
    }
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    u128 sentinel = sentinel_of(&t);
    BitW lo = {(uint8_t *)ob.buf, 0, 0, 0};
    BitW hi = {(uint8_t *)ob.buf + n * 8, 0, 0, 0};
    bad = rank_any(&s, &t, sentinel, bits, &lo, &hi);
    bw_flush(&lo);
    if (bits > 64) bw_flush(&hi);
    Py_END_ALLOW_THREADS
    rel3(&s); PyBuffer_Release(&tb); PyBuffer_Release(&ob);
    if (bad) { PyErr_SetString(PyExc_ValueError, "set_encode: rows are not canonical"); return NULL; }
    Py_RETURN_NONE;
fail:
    rel3(&s); PyBuffer_Release(&tb); PyBuffer_Release(&ob);
    return NULL;
}

/* Unrank ranks that fit 64 bits: for i = K..2 the largest c with C(c, i) <= r, from the
 * bucket table's start and a short scan up; then c_1 = r.  Eight rows at a time, each step
 * of the eight chains side by side: the rows are independent, so the CPU overlaps them. */
#define LANES 8

/* GCC's -O3 unroll-and-jam would fuse two levels of one lane (a dependent chain) where
 * the decode loops step many independent lanes side by side: off for them. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-loop-unroll-and-jam")
#endif

/* Field n (bits <= 64 wide) of an LSB-first bit stream of `len` bytes that holds it. */
HOT uint64_t dec_field(const uint8_t *in, Py_ssize_t len, Py_ssize_t n, int bits,
                       uint64_t mask) {
    Py_ssize_t p = n * (Py_ssize_t)bits, at = p >> 3;
    int sh = (int)(p & 7);
    uint64_t w = 0;
    if (at + 8 <= len) memcpy(&w, in + at, 8);
    else memcpy(&w, in + at, (size_t)(len - at));
    uint64_t v = w >> sh;
    if (sh + bits > 64) v |= (uint64_t)in[at + 8] << (64 - sh);
    return v & mask;
}

/* Unranking, DEC_LANES rows at a time: for i = K..2 the largest c with C(c, i) <= r, from
 * the bucket table's start and a short scan up (as before); then c_1 = r.  Each step of
 * the lanes' chains side by side (the rows are independent, so the CPU overlaps them),
 * ids collected per level and written out row by row with the reference's checks. */
#ifndef DEC_LANES
#define DEC_LANES 16
#endif

/* Each lane's row (ids c_1..c_K in cols[0..K)[g]) into its output row, or -1s for an
 * empty one, with the reference's checks: ids strictly ascending and c_K < E (c_1 >= 0
 * holds: it is a remainder).  Returns nonzero when a row breaks them. */
HOT int dec_emit(char *const *q, const int *empty, int m, int k, int e,
                 int32_t cols[][DEC_LANES], const int ok) {
    int worse = 0;
    for (int g = 0; g < m; g++) {
        if (empty[g]) {
            for (int j = 0; j < k; j++) store(q[g], ok, j, -1);
            continue;
        }
        int bad = cols[k - 1][g] >= e;
        for (int j = 1; j < k; j++) bad |= cols[j - 1][g] >= cols[j][g];
        worse |= bad;
        for (int j = 0; j < k; j++) store(q[g], ok, j, cols[j][g]);
    }
    return worse;
}

/* One level for all lanes: c = the largest with C(c, i) <= r, from the entry at r's key:
 * (C(c0, i), C(c0 + 1, i), C(c0 + 2, i), c0), so c is c0 or c0 + 1 but where r reaches
 * C(c0 + 2, i) (a bucket holding two boundaries: rare, a predicted branch). */
HOT void dk_level(uint64_t *r, int32_t *out, const uint64_t *ent, const uint64_t *row, int e,
                  const int fk) {
#pragma GCC unroll 16
    for (int g = 0; g < DEC_LANES; g++) {
        uint64_t x = r[g];
        const uint64_t *en;
        if (fk) { /* dk_key's byte offset from the double nearest x|1 (x < 2**63): its
                   * exponent and leading mantissa bits; exact below 2**53, and where
                   * rounding gives the next key, the entries are built for it (dk_min's
                   * margin in set_tables) */
            double d = (double)(int64_t)(x | 1);
            uint64_t u;
            memcpy(&u, &d, 8);
            en = (const uint64_t *)((const char *)ent +
                                    (Py_ssize_t)(((u >> (52 - DK_MBITS - 5)) & ~(uint64_t)31) -
                                                 ((uint64_t)1022 << (DK_MBITS + 5))));
        } else
            en = ent + dk_key(x) * DK_ENT;
        uint64_t t0 = en[0], t1 = en[1];
        int ge = x >= t1;
        int c = (int)en[3] + ge;
        uint64_t sub = ge ? t1 : t0;
        if (__builtin_expect(x >= en[2], 0)) {
            while (c < e - 1 && row[c + 1] <= x) c++;
            sub = row[c];
        }
        out[g] = c;
        r[g] = x - sub;
    }
}

#if ENC_SIMD
/* dec_emit for int16 rows of K = 8, all DEC_LANES lanes, E <= INT16_MAX: the checks four
 * lanes at a time, and an 8x4 transpose of 16-bit ids per four rows. */
HOT int dec_emit8_i16(char *const *q, const int *empty, int e, int32_t cols[][DEC_LANES]) {
    V bad = _mm_setzero_si128(), one = _mm_set1_epi32(1), emax = _mm_set1_epi32(e - 1);
    for (int g = 0; g < DEC_LANES; g += 4) {
        V a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm_loadu_si128((const V *)&cols[j][g]);
        V emp = _mm_loadu_si128((const V *)&empty[g]); /* 0 or 1 */
        emp = _mm_sub_epi32(_mm_setzero_si128(), emp);  /* 0 or -1 */
        V b = _mm_cmpgt_epi32(a[7], emax);
        for (int j = 1; j < 8; j++) b = _mm_or_si128(b, _mm_cmpgt_epi32(_mm_add_epi32(a[j - 1], one), a[j]));
        bad = _mm_or_si128(bad, _mm_andnot_si128(emp, b));
        V b0 = _mm_packs_epi32(a[0], a[4]), b1 = _mm_packs_epi32(a[1], a[5]);
        V b2 = _mm_packs_epi32(a[2], a[6]), b3 = _mm_packs_epi32(a[3], a[7]);
        V c0 = _mm_unpacklo_epi16(b0, b1), c1 = _mm_unpackhi_epi16(b0, b1);
        V c2 = _mm_unpacklo_epi16(b2, b3), c3 = _mm_unpackhi_epi16(b2, b3);
        V d0 = _mm_unpacklo_epi32(c0, c2), d1 = _mm_unpackhi_epi32(c0, c2);
        V d2 = _mm_unpacklo_epi32(c1, c3), d3 = _mm_unpackhi_epi32(c1, c3);
        _mm_storeu_si128((V *)q[g], _mm_or_si128(_mm_unpacklo_epi64(d0, d2), _mm_shuffle_epi32(emp, 0x00)));
        _mm_storeu_si128((V *)q[g + 1], _mm_or_si128(_mm_unpackhi_epi64(d0, d2), _mm_shuffle_epi32(emp, 0x55)));
        _mm_storeu_si128((V *)q[g + 2], _mm_or_si128(_mm_unpacklo_epi64(d1, d3), _mm_shuffle_epi32(emp, 0xaa)));
        _mm_storeu_si128((V *)q[g + 3], _mm_or_si128(_mm_unpackhi_epi64(d1, d3), _mm_shuffle_epi32(emp, 0xff)));
    }
    return _mm_movemask_epi8(bad);
}
#endif

HOT int dec_unrank64_k(Arr3 *o, const Tables *t, uint64_t sentinel, int bits,
                       const uint8_t *in, Py_ssize_t len, const int ok, const int kc) {
    int k = kc ? kc : (int)o->k, e = t->e; /* kc: K as a constant (0: any K) */
    Py_ssize_t n = o->rows * o->layers;
    uint64_t mask = bits == 64 ? ~(uint64_t)0 : ((uint64_t)1 << bits) - 1;
    Pos pos = {0, 0};
    for (Py_ssize_t base = 0; base < n; base += DEC_LANES) {
        int m = (int)(n - base < DEC_LANES ? n - base : DEC_LANES);
        uint64_t r[DEC_LANES];
        int empty[DEC_LANES];
        char *q[DEC_LANES];
        int32_t cols[KMAX][DEC_LANES];
        int bad = 0;
        for (int g = 0; g < DEC_LANES; g++) {
            uint64_t x = sentinel;
            if (g < m) {
                x = dec_field(in, len, base + g, bits, mask);
                q[g] = (char *)row_at(o, pos.r, pos.l);
                step(&pos, o->layers);
            }
            bad |= x > sentinel;
            empty[g] = x == sentinel;
            r[g] = empty[g] ? 0 : x;
        }
        if (bad) return R3_RANK;
        if (t->ent && bits <= 63) {
            for (int i = k; i >= 2; i--)
                dk_level(r, cols[i - 1], t->ent + (Py_ssize_t)(i - 2) * DK_ENTS * DK_ENT,
                         t->binom64 + i * (e + 1), e, 1);
        } else if (t->ent) {
            for (int i = k; i >= 2; i--)
                dk_level(r, cols[i - 1], t->ent + (Py_ssize_t)(i - 2) * DK_ENTS * DK_ENT,
                         t->binom64 + i * (e + 1), e, 0);
        }
        else for (int i = k; i >= 2; i--) {
            const uint64_t *row = t->binom64 + i * (e + 1);
            const uint16_t *bucket = t->bucket + i * NKEYS;
            int32_t *out = cols[i - 1];
            for (int g = 0; g < DEC_LANES; g++) {
                uint64_t x = r[g];
                int c = bucket[key_of64(x)];
                /* row[E] is the saturated guard: row[c + 1] is always inside the table.
                 * A compare-and-add, then a scan that is almost never taken (a branch
                 * the CPU predicts): branchless selects here measured slower. */
                c += row[c + 1] <= x;
                while (row[c + 1] <= x) c++;
                if (c > e - 1) c = e - 1;
                out[g] = c;
                r[g] = x - row[c];
            }
        }
        /* c_1 is the remainder; clamped so that a bad one (caught below) fits int32 */
        for (int g = 0; g < DEC_LANES; g++) cols[0][g] = r[g] >= (uint64_t)e ? e : (int32_t)r[g];
#if ENC_SIMD
        if (kc == 8 && ok == 2 && m == DEC_LANES && e <= INT16_MAX) {
            if (dec_emit8_i16(q, empty, e, cols)) return R3_RANK;
            continue;
        }
#endif
        if (dec_emit(q, empty, m, k, e, cols, ok)) return R3_RANK;
    }
    return R3_OK;
}

static int unrank64_any(Arr3 *o, const Tables *t, uint64_t sentinel, int bits, BitR *in) {
    const uint8_t *p = in->in;
    Py_ssize_t len = in->len;
    /* common shapes with K a constant: the level loop and the row writes unroll */
    if (o->kind == 2 && o->k == 8) return dec_unrank64_k(o, t, sentinel, bits, p, len, 2, 8);
    if (o->kind == 2 && o->k == 4) return dec_unrank64_k(o, t, sentinel, bits, p, len, 2, 4);
    if (o->kind == 2) return dec_unrank64_k(o, t, sentinel, bits, p, len, 2, 0);
    return dec_unrank64_k(o, t, sentinel, bits, p, len, 4, 0);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* The same for ranks of up to 128 bits (a 64-bit run, then a run of the high bits). */
static int unrank128(Arr3 *o, const Tables *t, u128 sentinel, int bits, BitR *rlo, BitR *rhi) {
    int k = (int)o->k, e = t->e;
    for (Py_ssize_t r0 = 0; r0 < o->rows; r0++)
        for (Py_ssize_t l = 0; l < o->layers; l++) {
            u128 r = br_get(rlo, 64);
            r |= (u128)br_get(rhi, bits - 64) << 64;
            char *q = (char *)row_at(o, r0, l);
            if (r > sentinel) return R3_RANK;
            if (r == sentinel) {
                for (int j = 0; j < k; j++) store(q, o->kind, j, -1);
                continue;
            }
            int32_t cols[KMAX];
            for (int i = k; i >= 2; i--) {
                const u128 *row = t->binom + i * (e + 1);
                int c = t->bucket[i * NKEYS + key_of(r)];
                while (c + 1 <= e - 1 && row[c + 1] <= r) c++;
                cols[i - 1] = c;
                r -= row[c];
            }
            if (r >= (u128)e) return R3_RANK;
            cols[0] = (int32_t)r;
            for (int j = 1; j < k; j++)
                if (cols[j - 1] >= cols[j]) return R3_RANK;
            for (int j = 0; j < k; j++) store(q, o->kind, j, cols[j]);
        }
    return R3_OK;
}

/* A set body of exactly packed_len(rows x layers, bits) bytes into o: ascending rows, -1
 * for the sentinel; the padding bits after the last field must be zero. */
static int set_core(const uint8_t *in, Py_ssize_t len, const Tables *t, int bits, Arr3 *o) {
    int code = R3_OK;
    Py_ssize_t n = o->rows * o->layers;
    u128 sentinel = sentinel_of(t);
    Py_ssize_t lo_len = bits > 64 ? n * 8 : len;
    /* padding: the bits after the last field, in the last byte of each packed run */
    Py_ssize_t used = bits > 64 ? n * (bits - 64) : n * bits;
    if (used % 8 && (in[len - 1] >> (used % 8))) code = R3_PADDING;
    BitR rlo = {in, lo_len, 0, 0, 0};
    BitR rhi = {in + lo_len, len - lo_len, 0, 0, 0};
    if (code == R3_OK) {
        if (bits <= 64) code = unrank64_any(o, t, (uint64_t)sentinel, bits, &rlo);
        else code = unrank128(o, t, sentinel, bits, &rlo, &rhi);
    }
    return code;
}

/* set_decode(body, e, tables, bits, out) -> code : ascending rows, -1 for the sentinel. */
static PyObject *py_set_decode(PyObject *self, PyObject *args) {
    PyObject *oo;
    Py_buffer bb, tb;
    int e, bits;
    Arr3 o;
    Tables t;
    if (!PyArg_ParseTuple(args, "y*iy*iO", &bb, &e, &tb, &bits, &oo)) return NULL;
    if (get3(oo, 1, &o, "out") < 0 || !out_kind_ok(&o)) goto fail;
    if (tables_from(&tb, e, (int)o.k, &t) < 0) goto fail;
    if (bits < 1 || bits > 128) {
        PyErr_SetString(PyExc_ValueError, "set_decode: bits out of range");
        goto fail;
    }
    Py_ssize_t n = o.rows * o.layers;
    if (bb.len != packed_len(n, bits)) {
        rel3(&o); PyBuffer_Release(&bb); PyBuffer_Release(&tb);
        return PyLong_FromLong(R3_LENGTH);
    }
    int code = R3_OK;
    Py_BEGIN_ALLOW_THREADS
    code = set_core((const uint8_t *)bb.buf, bb.len, &t, bits, &o);
    Py_END_ALLOW_THREADS
    rel3(&o); PyBuffer_Release(&bb); PyBuffer_Release(&tb);
    return PyLong_FromLong(code);
fail:
    rel3(&o); PyBuffer_Release(&bb); PyBuffer_Release(&tb);
    return NULL;
}

/* ---- CRC-32C, the v3 chunk checksum ------------------------------------------------- */
/* Computed here so that decode_chunks checks a frame's chunks without the GIL (Python's
 * google-crc32c holds it, and its C library is neither exposed to extensions nor packaged
 * by Debian 12).  The CPU's crc32 instruction (SSE4.2) where it has one, else a table;
 * tests/client/test_codec_native.py holds both to google-crc32c. */
static uint32_t crc32c_table[256];

static void crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int j = 0; j < 8; j++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_table[i] = c;
    }
}

static uint32_t crc32c_sw(const uint8_t *p, Py_ssize_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (Py_ssize_t i = 0; i < n; i++) c = crc32c_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return ~c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(R3_NO_SIMD)
#include <nmmintrin.h>
#define CRC_HW 1
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(const uint8_t *p, Py_ssize_t n) {
    uint64_t c = 0xFFFFFFFFu;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    uint32_t c32 = (uint32_t)c;
    for (; n > 0; p++, n--) c32 = _mm_crc32_u8(c32, *p);
    return ~c32;
}
#else
#define CRC_HW 0
#endif

static int crc_hw; /* set at import: the CPU has SSE4.2 */

static uint32_t crc32c_of(const uint8_t *p, Py_ssize_t n) {
#if CRC_HW
    if (crc_hw) return crc32c_hw(p, n);
#endif
    return crc32c_sw(p, n);
}

/* crc32c(data) -> int: what decode_chunks checks (for the differential tests). */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = crc32c_of((const uint8_t *)b.buf, b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* ---- a whole frame's chunks in one call --------------------------------------------- */
#define DESC_COLS 7 /* offset, length, rows, first row in out, first layer in out, layers,
                        * the chunk's CRC-32C (-1: not checked here) */

/* One chunk of `len` bytes at `src` decoded into `sub` (its rows x layers of an int16 /
 * int32 array): codec 0 raw, 1 set (`t`, `bits`), 2 set-zstd (inflated into `zbuf`, which
 * holds the chunk's payload, with `dctx`; `rows8`: the relabel rows of the chunk's first
 * layer or NULL).  `tsz`: bytes per raw id; `gsz`: bytes per gap.  Runs without the GIL. */
static int chunk_core(const uint8_t *src, Py_ssize_t len, int codec, int64_t e, int k,
                      const Tables *t, int bits, const uint8_t *rows8, Py_ssize_t tsz,
                      Py_ssize_t gsz, uint8_t *zbuf, void *dctx, Arr3 *sub) {
    Py_ssize_t ids = sub->rows * sub->layers * k;
    if (codec == 0) return len != ids * tsz ? R3_LENGTH : raw_core(src, tsz, e, sub);
    if (codec == 1)
        return len != packed_len(sub->rows * sub->layers, bits) ? R3_LENGTH
                                                               : set_core(src, len, t, bits, sub);
#ifdef R3_HAVE_ZSTD
    size_t want = (size_t)(ids * gsz);
    unsigned long long declared = ZSTD_getFrameContentSize(src, (size_t)len);
    size_t whole = ZSTD_findFrameCompressedSize(src, (size_t)len);
    if (declared != (unsigned long long)want || ZSTD_isError(whole) || whole != (size_t)len)
        return R3_ZSTD;
    size_t got = ZSTD_decompressDCtx((ZSTD_DCtx *)dctx, zbuf, want, src, (size_t)len);
    if (ZSTD_isError(got) || got != want) return R3_ZSTD;
    return ids_any(sub, e, zbuf, tsz == 1 ? rows8 : NULL, tsz == 2 ? rows8 : NULL, (int)gsz);
#else
    (void)zbuf; (void)dctx; (void)rows8; (void)gsz;
    return R3_UNSUPPORTED;
#endif
}

/* decode_chunks(body, desc, out, e, codec, order, tables, bits) -> (code, chunk)
 * Every chunk `desc` lists (int64 [n, DESC_COLS]: where its bytes are in `body`, the
 * rows x layers of `out` it fills, its CRC-32C or -1) checked and decoded into `out`
 * ([R, L, K] int16/int32, any strides)
 * in one call, the GIL released from the first chunk to the last: the per-chunk Python of
 * a v2/v3 frame (inflate, kernel, back into the interpreter) handed the GIL over twice per
 * chunk.  codec: 0 raw, 1 set (`tables` from set_tables, `bits`), 2 set-zstd (inflated
 * here: one complete zstd frame declaring exactly its payload, into a buffer of that size;
 * `order`: None or the frame's [L, E] relabel rows, u1 / <u2, row l for out's layer l).
 * code: R3_OK, or the first failing chunk's code and index (R3_CRC: its checksum;
 * R3_ZSTD: the zstd frame;
 * R3_UNSUPPORTED: set-zstd in a build without libzstd).  A desc outside the buffers is a
 * caller's error (ValueError), checked before anything is read. */
static PyObject *py_decode_chunks(PyObject *self, PyObject *args) {
    Py_buffer bb, db, ob, tb;
    PyObject *oo, *to, *tbo;
    long long e;
    int codec, bits;
    Arr3 o;
    Tables t;
    memset(&ob, 0, sizeof(ob));
    memset(&tb, 0, sizeof(tb));
    memset(&o, 0, sizeof(o));
    int have_order = 0, have_tables = 0;
    uint8_t *scratch = NULL;
    if (!PyArg_ParseTuple(args, "y*y*OLiOOi", &bb, &db, &oo, &e, &codec, &to, &tbo, &bits))
        return NULL;
    if (get3(oo, 1, &o, "out") < 0 || !out_kind_ok(&o)) goto fail;
    int k = (int)o.k;
    if (e < k || e > EMAX || codec < 0 || codec > 2 || db.len % (DESC_COLS * 8)) {
        PyErr_SetString(PyExc_ValueError, "decode_chunks: E, codec or desc size is wrong");
        goto fail;
    }
    Py_ssize_t tsz = e <= 255 ? 1 : 2;
    Py_ssize_t gsz = e - k + 1 <= 255 ? 1 : 2;
    if (to != Py_None) {
        if (PyObject_GetBuffer(to, &ob, PyBUF_SIMPLE) < 0) goto fail;
        have_order = 1;
        if (codec != 2 || ob.len != o.layers * e * tsz) {
            PyErr_SetString(PyExc_ValueError, "decode_chunks: order is not [L, E] of set-zstd");
            goto fail;
        }
    }
    if (codec == 1) {
        if (PyObject_GetBuffer(tbo, &tb, PyBUF_SIMPLE) < 0) goto fail;
        have_tables = 1;
        if (tables_from(&tb, (int)e, k, &t) < 0) goto fail;
        if (bits < 1 || bits > 128) {
            PyErr_SetString(PyExc_ValueError, "decode_chunks: bits out of range");
            goto fail;
        }
    }
    Py_ssize_t n = db.len / (DESC_COLS * 8);
    const int64_t *d = (const int64_t *)db.buf;
    Py_ssize_t most = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *c = d + i * DESC_COLS;
        if (c[0] < 0 || c[1] < 0 || c[0] > bb.len || c[1] > bb.len - c[0] || c[2] < 1 || c[6] < -1 ||
            c[6] > 0xFFFFFFFFLL ||
            c[5] < 1 || c[3] < 0 || c[3] > o.rows - c[2] || c[4] < 0 || c[4] > o.layers - c[5]) {
            PyErr_Format(PyExc_ValueError, "decode_chunks: chunk %zd lies outside body or out", i);
            goto fail;
        }
        Py_ssize_t payload = (Py_ssize_t)(c[2] * c[5]) * k * gsz; /* within out: no overflow */
        if (payload > most) most = payload;
    }
    if (codec == 2) {
#ifdef R3_HAVE_ZSTD
        scratch = (uint8_t *)PyMem_RawMalloc(most ? (size_t)most : 1);
        if (scratch == NULL) { PyErr_NoMemory(); goto fail; }
#else
        rel3(&o); PyBuffer_Release(&bb); PyBuffer_Release(&db);
        if (have_order) PyBuffer_Release(&ob);
        return Py_BuildValue("(in)", R3_UNSUPPORTED, (Py_ssize_t)0);
#endif
    }
    int code = R3_OK;
    Py_ssize_t bad = 0;
    Py_BEGIN_ALLOW_THREADS
#ifdef R3_HAVE_ZSTD
    ZSTD_DCtx *dctx = codec == 2 ? ZSTD_createDCtx() : NULL;
    if (codec == 2 && dctx == NULL) code = R3_ZSTD;
#endif
    for (Py_ssize_t i = 0; i < n && code == R3_OK; i++) {
        const int64_t *c = d + i * DESC_COLS;
        const uint8_t *src = (const uint8_t *)bb.buf + c[0];
        Py_ssize_t len = (Py_ssize_t)c[1];
        Arr3 sub = o;
        sub.held = 0;
        sub.buf = o.buf + c[3] * o.s0 + c[4] * o.s1;
        sub.rows = (Py_ssize_t)c[2];
        sub.layers = (Py_ssize_t)c[5];
        if (c[6] >= 0 && crc32c_of(src, len) != (uint32_t)c[6]) {
            code = R3_CRC;
        } else {
            const uint8_t *rows8 = have_order ? (const uint8_t *)ob.buf + c[4] * e * tsz : NULL;
#ifdef R3_HAVE_ZSTD
            code = chunk_core(src, len, (int)codec, e, k, &t, bits, rows8, tsz, gsz, scratch, dctx, &sub);
#else
            code = chunk_core(src, len, (int)codec, e, k, &t, bits, rows8, tsz, gsz, scratch, NULL, &sub);
#endif
        }
        if (code != R3_OK) bad = i;
    }
#ifdef R3_HAVE_ZSTD
    if (dctx != NULL) ZSTD_freeDCtx(dctx);
#endif
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scratch);
    rel3(&o); PyBuffer_Release(&bb); PyBuffer_Release(&db);
    if (have_order) PyBuffer_Release(&ob);
    if (have_tables) PyBuffer_Release(&tb);
    return Py_BuildValue("(in)", code, bad);
fail:
    PyMem_RawFree(scratch);
    rel3(&o); PyBuffer_Release(&bb); PyBuffer_Release(&db);
    if (have_order) PyBuffer_Release(&ob);
    if (have_tables) PyBuffer_Release(&tb);
    return NULL;
}

/* ---- decode_into: a micro-batch's frames straight into a rank's int64 targets ------------ */
#define INTO_MAX_IDS ((Py_ssize_t)1 << 26) /* ids per chunk: 512 rows x 48 layers x 64 is 1.5M */

typedef struct {
    Py_buffer body, desc, order, tables, lmap;
    int have_order, have_tables, have_lmap, have_body, have_desc;
    Arr3 out;
    int64_t e;
    int k, codec, bits;
    Py_ssize_t row_lo, n, frame_layers, tsz, gsz, ssz;
    Tables t;
} IntoJob;

static void into_release(IntoJob *j) {
    rel3(&j->out);
    if (j->have_body) PyBuffer_Release(&j->body);
    if (j->have_desc) PyBuffer_Release(&j->desc);
    if (j->have_order) PyBuffer_Release(&j->order);
    if (j->have_tables) PyBuffer_Release(&j->tables);
    if (j->have_lmap) PyBuffer_Release(&j->lmap);
}

/* One job's arguments taken and checked against its buffers (the GIL held). */
static int into_job(PyObject *item, IntoJob *j, Py_ssize_t *most) {
    PyObject *bo, *dob, *oo, *to, *tbo, *lo;
    long long e, row_lo;
    if (!PyTuple_Check(item) ||
        !PyArg_ParseTuple(item, "OOOLiOOiLO", &bo, &dob, &oo, &e, &j->codec, &to, &tbo, &j->bits,
                          &row_lo, &lo))
        return -1;
    if (PyObject_GetBuffer(bo, &j->body, PyBUF_SIMPLE) < 0) return -1;
    j->have_body = 1;
    if (PyObject_GetBuffer(dob, &j->desc, PyBUF_SIMPLE) < 0) return -1;
    j->have_desc = 1;
    if (PyObject_GetBuffer(lo, &j->lmap, PyBUF_SIMPLE) < 0) return -1;
    j->have_lmap = 1;
    if (get3(oo, 1, &j->out, "out") < 0) return -1;
    j->k = (int)j->out.k;
    j->e = e;
    j->row_lo = (Py_ssize_t)row_lo;
    if (j->out.kind != 8 || e < j->k || e > EMAX || j->codec < 0 || j->codec > 2 ||
        j->desc.len % (DESC_COLS * 8) || j->lmap.len % 4 || j->lmap.len == 0 || row_lo < 0 ||
        row_lo > ((long long)1 << 40)) {
        PyErr_SetString(PyExc_ValueError, "decode_into: out is not int64, or E, codec, desc or "
                                          "the layer map is wrong");
        return -1;
    }
    j->frame_layers = j->lmap.len / 4;
    const int32_t *lm = (const int32_t *)j->lmap.buf;
    for (Py_ssize_t l = 0; l < j->frame_layers; l++)
        if (lm[l] < -1 || lm[l] >= j->out.layers) {
            PyErr_SetString(PyExc_ValueError, "decode_into: the layer map names a layer out lacks");
            return -1;
        }
    j->tsz = e <= 255 ? 1 : 2;
    j->gsz = e - j->k + 1 <= 255 ? 1 : 2;
    j->ssz = e <= 32767 ? 2 : 4;
    if (to != Py_None) {
        if (PyObject_GetBuffer(to, &j->order, PyBUF_SIMPLE) < 0) return -1;
        j->have_order = 1;
        if (j->codec != 2 || j->order.len != j->frame_layers * e * j->tsz) {
            PyErr_SetString(PyExc_ValueError, "decode_into: order is not [L, E] of set-zstd");
            return -1;
        }
    }
    if (j->codec == 1) {
        if (PyObject_GetBuffer(tbo, &j->tables, PyBUF_SIMPLE) < 0) return -1;
        j->have_tables = 1;
        if (tables_from(&j->tables, (int)e, j->k, &j->t) < 0) return -1;
        if (j->bits < 1 || j->bits > 128) {
            PyErr_SetString(PyExc_ValueError, "decode_into: bits out of range");
            return -1;
        }
    }
    j->n = j->desc.len / (DESC_COLS * 8);
    const int64_t *d = (const int64_t *)j->desc.buf;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        const int64_t *c = d + i * DESC_COLS;
        if (c[0] < 0 || c[1] < 0 || c[0] > j->body.len || c[1] > j->body.len - c[0] || c[2] < 1 ||
            c[2] > INTO_MAX_IDS || c[3] < 0 || c[3] > ((int64_t)1 << 40) || c[4] < 0 || c[5] < 1 ||
            c[5] > INTO_MAX_IDS || /* (both bounded first: their product below cannot overflow) */
            c[4] > j->frame_layers - c[5] || c[6] < -1 || c[6] > 0xFFFFFFFFLL ||
            c[2] * c[5] * j->k > INTO_MAX_IDS) {
            PyErr_Format(PyExc_ValueError, "decode_into: chunk %zd lies outside body or frame", i);
            return -1;
        }
        Py_ssize_t ids = (Py_ssize_t)(c[2] * c[5]) * j->k;
        if (ids > *most) *most = ids;
    }
    return 0;
}

/* decode_into(jobs) -> (code, job, chunk)
 * Each job (body, desc, out, e, codec, order, tables, bits, row_lo, lmap) is one frame's
 * chunks (desc as decode_chunks', its rows and layers the frame's own) decoded into `out`,
 * an int64 [R, L, K] window of a rank's targets (any strides): frame row `row_lo + r` is
 * out's row r, frame layer l out's layer lmap[l] (int32; -1: not wanted).  Only the chunks
 * holding a wanted row and layer are checked (CRC-32C) and decoded, each into a scratch tile
 * and widened into out.  The GIL is released once, from the first job to the last: a
 * rank's micro-batch in one call.  code: R3_OK, or the first failing chunk's code (jobs
 * after it not run).  A desc outside the buffers is a caller's error (ValueError). */
static PyObject *py_decode_into(PyObject *self, PyObject *args) {
    PyObject *jo;
    if (!PyArg_ParseTuple(args, "O", &jo)) return NULL;
    PyObject *seq = PySequence_Fast(jo, "decode_into: jobs must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t nj = PySequence_Fast_GET_SIZE(seq);
    IntoJob *jobs = (IntoJob *)PyMem_Calloc(nj ? (size_t)nj : 1, sizeof(IntoJob));
    uint8_t *tile = NULL, *zbuf = NULL;
    PyObject *ret = NULL;
    Py_ssize_t ready = 0, most = 0;
    int any_zstd = 0;
    if (jobs == NULL) { PyErr_NoMemory(); goto done; }
    for (; ready < nj; ready++) {
        if (into_job(PySequence_Fast_GET_ITEM(seq, ready), &jobs[ready], &most) < 0) {
            ready++; /* its buffers too */
            goto done;
        }
        if (jobs[ready].codec == 2) any_zstd = 1;
    }
#ifndef R3_HAVE_ZSTD
    if (any_zstd) { ret = Py_BuildValue("(inn)", R3_UNSUPPORTED, (Py_ssize_t)0, (Py_ssize_t)0); goto done; }
#endif
    tile = (uint8_t *)PyMem_RawMalloc((size_t)(most ? most : 1) * 4);
    zbuf = (uint8_t *)PyMem_RawMalloc((size_t)(most ? most : 1) * 2);
    if (tile == NULL || zbuf == NULL) { PyErr_NoMemory(); goto done; }
    int code = R3_OK;
    Py_ssize_t bad_job = 0, bad_chunk = 0;
    Py_BEGIN_ALLOW_THREADS
    void *dctx = NULL;
#ifdef R3_HAVE_ZSTD
    if (any_zstd) {
        dctx = ZSTD_createDCtx();
        if (dctx == NULL) code = R3_ZSTD;
    }
#endif
    for (Py_ssize_t jn = 0; jn < nj && code == R3_OK; jn++) {
        IntoJob *j = &jobs[jn];
        const int64_t *d = (const int64_t *)j->desc.buf;
        const int32_t *lm = (const int32_t *)j->lmap.buf;
        Py_ssize_t k = j->k;
        for (Py_ssize_t i = 0; i < j->n && code == R3_OK; i++) {
            const int64_t *c = d + i * DESC_COLS;
            Py_ssize_t r0 = (Py_ssize_t)c[3], rows = (Py_ssize_t)c[2];
            Py_ssize_t l0 = (Py_ssize_t)c[4], nl = (Py_ssize_t)c[5];
            Py_ssize_t lo = r0 > j->row_lo ? r0 : j->row_lo;
            Py_ssize_t hi = r0 + rows < j->row_lo + j->out.rows ? r0 + rows : j->row_lo + j->out.rows;
            if (lo >= hi) continue; /* none of its rows wanted */
            int wanted = 0;
            for (Py_ssize_t l = 0; l < nl; l++) wanted |= lm[l0 + l] >= 0;
            if (!wanted) continue;
            const uint8_t *src = (const uint8_t *)j->body.buf + c[0];
            Py_ssize_t len = (Py_ssize_t)c[1];
            if (c[6] >= 0 && crc32c_of(src, len) != (uint32_t)c[6]) {
                code = R3_CRC;
            } else {
                Arr3 sc;
                memset(&sc, 0, sizeof(sc));
                sc.buf = (char *)tile;
                sc.rows = rows;
                sc.layers = nl;
                sc.k = k;
                sc.s1 = k * j->ssz;
                sc.s0 = nl * sc.s1;
                sc.kind = (int)j->ssz;
                const uint8_t *rows8 =
                    j->have_order ? (const uint8_t *)j->order.buf + l0 * j->e * j->tsz : NULL;
                code = chunk_core(src, len, j->codec, j->e, (int)k, &j->t, j->bits, rows8, j->tsz,
                                  j->gsz, zbuf, dctx, &sc);
                if (code == R3_OK) {
                    for (Py_ssize_t r = lo; r < hi; r++) {
                        const char *srow = sc.buf + (r - r0) * sc.s0;
                        char *drow = j->out.buf + (r - j->row_lo) * j->out.s0;
                        for (Py_ssize_t l = 0; l < nl; l++) {
                            int32_t tl = lm[l0 + l];
                            if (tl < 0) continue;
                            int64_t *dst = (int64_t *)(drow + tl * j->out.s1);
                            if (j->ssz == 2) {
                                const int16_t *sv = (const int16_t *)(srow + l * sc.s1);
                                for (Py_ssize_t q = 0; q < k; q++) dst[q] = sv[q];
                            } else {
                                const int32_t *sv = (const int32_t *)(srow + l * sc.s1);
                                for (Py_ssize_t q = 0; q < k; q++) dst[q] = sv[q];
                            }
                        }
                    }
                }
            }
            if (code != R3_OK) { bad_job = jn; bad_chunk = i; }
        }
    }
#ifdef R3_HAVE_ZSTD
    if (dctx != NULL) ZSTD_freeDCtx((ZSTD_DCtx *)dctx);
#endif
    Py_END_ALLOW_THREADS
    ret = Py_BuildValue("(inn)", code, bad_job, bad_chunk);
done:
    PyMem_RawFree(tile);
    PyMem_RawFree(zbuf);
    if (jobs != NULL)
        for (Py_ssize_t i = 0; i < ready; i++) into_release(&jobs[i]);
    PyMem_Free(jobs);
    Py_DECREF(seq);
    return ret;
}

static PyMethodDef methods[] = {
    {"canonical", py_canonical, METH_VARARGS,
     "canonical(src, out, e) -> (code, row): validate rows and write them sorted into out."},
    {"popularity", py_popularity, METH_VARARGS,
     "popularity(srt, e, table): per layer, experts by descending count (ties by id)."},
    {"gap_payload", py_gap_payload, METH_VARARGS,
     "gap_payload(srt, e, to_rank, out): layer-major gap planes of canonical rows."},
    {"zset_decode", py_zset_decode, METH_VARARGS,
     "zset_decode(payload, e, order, out) -> code: gap planes to token-major ids."},
    {"raw_encode", py_raw_encode, METH_VARARGS, "raw_encode(src, e, out): ids as u1/u2."},
    {"raw_decode", py_raw_decode, METH_VARARGS, "raw_decode(body, e, out) -> code."},
    {"set_tables", py_set_tables, METH_VARARGS, "set_tables(e, k) -> bytes: rank tables."},
    {"set_encode", py_set_encode, METH_VARARGS, "set_encode(srt, e, tables, bits, out)."},
    {"set_decode", py_set_decode, METH_VARARGS, "set_decode(body, e, tables, bits, out) -> code."},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data) -> int: CRC-32C (Castagnoli)."},
    {"decode_chunks", py_decode_chunks, METH_VARARGS,
     "decode_chunks(body, desc, out, e, codec, order, tables, bits) -> (code, chunk)."},
    {"decode_into", py_decode_into, METH_VARARGS,
     "decode_into(jobs) -> (code, job, chunk): frames' chunks into int64 target windows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_r3codec",
    "Native kernels of the routing codec (see r3_client._native).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__r3codec(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    crc32c_init();
#if CRC_HW
    __builtin_cpu_init();
    crc_hw = __builtin_cpu_supports("sse4.2");
#endif
#ifdef R3_HAVE_ZSTD
    const int have_zstd = 1;
#else
    const int have_zstd = 0;
#endif
    if (PyModule_AddIntConstant(m, "KMAX", KMAX) < 0 || PyModule_AddIntConstant(m, "ABI", 1) < 0 ||
        PyModule_AddIntConstant(m, "HAVE_ZSTD", have_zstd) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
