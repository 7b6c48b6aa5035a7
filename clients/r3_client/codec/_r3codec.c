/* r3_client._r3codec: the native backend of the routing codec's hot loops.
 *
 * The Python codec (r3_client.codec, numpy) is the reference; this module computes the
 * same bytes and the same arrays, faster, with the GIL released for every loop.  Python
 * keeps the frame logic (headers, CRCs through zlib, zstd through python-zstandard) and
 * calls these kernels per chunk; r3_client._native picks this module or the numpy code.
 *
 * Every kernel reads hostile input: each size is checked against the buffers it will
 * read and write before any loop runs, every table lookup is bounded by the table's
 * length, and a decoder that meets invalid data returns an error code (the caller then
 * asks the numpy reference for the exact exception).  Nothing here allocates more than
 * a fixed tile on the stack and the tables of set_tables().
 *
 * Array arguments are buffers (numpy arrays, possibly strided views): 3-D [rows, layers,
 * K] with the K axis contiguous.  Formats: b h i l q (signed), B H I (unsigned).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the routing format is little-endian; this backend assumes a little-endian host"
#endif

typedef unsigned __int128 u128;

#define KMAX 64     /* r3_client._routing.MAX_TOPK */
#define EMAX 65535  /* r3_client._routing.MAX_EXPERTS */
#define TILE 64     /* rows sorted together, column by column */
#define MBITS 5     /* mantissa bits of a set-rank bucket key */
#define NKEYS (1 + 128 * (1 << MBITS))

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
HOT int canonical_k(const Arr3 *src, Arr3 *out, int64_t e, Py_ssize_t *bad_at, const int ik,
                    const int ok) {
    Net net;
    int k = (int)src->k;
    int32_t cols[KMAX][TILE];
    build_net(k, &net);
    Py_ssize_t n = src->rows * src->layers;
    Pos rp = {0, 0}, wp = {0, 0};
    for (Py_ssize_t base = 0; base < n; base += TILE) {
        int m = (int)(n - base < TILE ? n - base : TILE);
        for (int t = 0; t < TILE; t++) {
            if (t >= m) {
                for (int j = 0; j < k; j++) cols[j][t] = INT32_MAX;
                continue;
            }
            const char *p = row_at(src, rp.r, rp.l);
            step(&rp, src->layers);
            for (int j = 0; j < k; j++) {
                int64_t v = load(p, ik, j);
                if (v < -1 || v >= e) {
                    *bad_at = base + t;
                    return R3_BAD_ID;
                }
                cols[j][t] = (int32_t)v;
            }
        }
        sort_tile(cols, m, &net);
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
            char *q = (char *)row_at(out, wp.r, wp.l);
            step(&wp, out->layers);
            for (int j = 0; j < k; j++) store(q, ok, j, cols[j][t]);
        }
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
typedef struct { uint64_t count; uint32_t id; } Pop;

static int pop_cmp(const void *x, const void *y) {
    const Pop *a = (const Pop *)x, *b = (const Pop *)y;
    if (a->count != b->count) return a->count > b->count ? -1 : 1;
    return a->id < b->id ? -1 : (a->id > b->id);
}

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
    Pop *pop = PyMem_RawMalloc(sizeof(Pop) * (size_t)e);
    uint64_t *counts = PyMem_RawCalloc((size_t)(s.layers * e), sizeof(uint64_t));
    if (pop == NULL || counts == NULL) {
        PyMem_RawFree(pop); PyMem_RawFree(counts);
        rel3(&s); PyBuffer_Release(&ob);
        return PyErr_NoMemory();
    }
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    if (s.kind == 2) bad = count_k(&s, e, counts, 2);
    else bad = count_k(&s, e, counts, 4);
    for (Py_ssize_t l = 0; l < s.layers && !bad; l++) {
        for (long long x = 0; x < e; x++) { pop[x].count = counts[l * e + x]; pop[x].id = (uint32_t)x; }
        qsort(pop, (size_t)e, sizeof(Pop), pop_cmp);
        for (long long x = 0; x < e; x++) {
            if (isz == 1) ((uint8_t *)ob.buf)[l * e + x] = (uint8_t)pop[x].id;
            else ((uint16_t *)ob.buf)[l * e + x] = (uint16_t)pop[x].id;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(pop);
    PyMem_RawFree(counts);
    rel3(&s); PyBuffer_Release(&ob);
    if (bad) { PyErr_SetString(PyExc_ValueError, "popularity: id outside [0, E)"); return NULL; }
    Py_RETURN_NONE;
}

/* ---- gap planes ----------------------------------------------------------------------- */
/* Layer-major gaps of canonical rows (relabelled and re-sorted when `rank` is given);
 * 16-bit gaps as a low-byte plane then a high-byte plane.  Returns 1 for rows that are
 * not canonical (never for the encoder's own rows). */
HOT int gaps_k(const Arr3 *s, int64_t e, const int32_t *rank, uint8_t *planes, const int ik,
               const int gsz) {
    Net net;
    int k = (int)s->k;
    int32_t gmax = (int32_t)(e - k + 1);
    int32_t cols[KMAX][TILE];
    Py_ssize_t n = s->rows * s->layers * k;
    uint8_t *lo8 = planes, *hi8 = planes + (gsz == 2 ? n : 0);
    build_net(k, &net);
    Py_ssize_t at = 0;
    for (Py_ssize_t l = 0; l < s->layers; l++) {
        const int32_t *lr = rank ? rank + l * e : NULL;
        for (Py_ssize_t base = 0; base < s->rows; base += TILE) {
            int m = (int)(s->rows - base < TILE ? s->rows - base : TILE);
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
                continue;
            }
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
            sort_tile(cols, m, &net);
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
    Py_ssize_t at = 0;
    for (Py_ssize_t r = 0; r < s.rows; r++)
        for (Py_ssize_t l = 0; l < s.layers; l++) {
            const char *p = row_at(&s, r, l);
            for (Py_ssize_t j = 0; j < s.k; j++, at++) {
                int64_t v = load(p, s.kind, j);
                if (isz == 1) ((uint8_t *)ob.buf)[at] = (uint8_t)v;
                else { uint16_t w = (uint16_t)v; memcpy((char *)ob.buf + 2 * at, &w, 2); }
            }
        }
    Py_END_ALLOW_THREADS
    rel3(&s); PyBuffer_Release(&ob);
    Py_RETURN_NONE;
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
    uint32_t sentinel = isz == 1 ? 0xFF : 0xFFFF;
    Py_BEGIN_ALLOW_THREADS
    int k = (int)o.k;
    Py_ssize_t at = 0;
    for (Py_ssize_t r = 0; r < o.rows && code == R3_OK; r++)
        for (Py_ssize_t l = 0; l < o.layers && code == R3_OK; l++, at += k) {
            int32_t row[KMAX];
            char *q = (char *)row_at(&o, r, l);
            int neg = 0;
            for (int j = 0; j < k; j++) {
                uint16_t u16;
                if (isz == 2) memcpy(&u16, (const char *)bb.buf + 2 * (at + j), 2);
                uint32_t u = isz == 1 ? ((const uint8_t *)bb.buf)[at + j] : u16;
                int32_t v = u == sentinel ? -1 : (int32_t)u;
                if (v >= e) code = R3_BAD_ID;
                neg += v < 0;
                row[j] = v;
                store(q, o.kind, j, v);
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
} Tables;

static Py_ssize_t tables_size(int e, int k) {
    return (Py_ssize_t)(k + 1) * (e + 1) * (Py_ssize_t)(sizeof(u128) + sizeof(uint64_t)) +
           (Py_ssize_t)(k + 1) * NKEYS * (Py_ssize_t)sizeof(uint16_t);
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

static int rank_any(const Arr3 *s, const Tables *t, u128 sentinel, int bits, BitW *lo,
                           BitW *hi) {
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
        for (int i = k; i >= 2; i--) {
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
    u128 sentinel = sentinel_of(&t);
    Py_ssize_t lo_len = bits > 64 ? n * 8 : bb.len;
    /* padding: the bits after the last field, in the last byte of each packed run */
    const uint8_t *in = (const uint8_t *)bb.buf;
    if (bits > 64) {
        Py_ssize_t used = n * (bits - 64);
        if (used % 8 && (in[bb.len - 1] >> (used % 8))) code = R3_PADDING;
    } else {
        Py_ssize_t used = n * bits;
        if (used % 8 && (in[bb.len - 1] >> (used % 8))) code = R3_PADDING;
    }
    BitR rlo = {in, lo_len, 0, 0, 0};
    BitR rhi = {in + lo_len, bb.len - lo_len, 0, 0, 0};
    if (code == R3_OK) {
        if (bits <= 64) code = unrank64_any(&o, &t, (uint64_t)sentinel, bits, &rlo);
        else code = unrank128(&o, &t, sentinel, bits, &rlo, &rhi);
    }
    Py_END_ALLOW_THREADS
    rel3(&o); PyBuffer_Release(&bb); PyBuffer_Release(&tb);
    return PyLong_FromLong(code);
fail:
    rel3(&o); PyBuffer_Release(&bb); PyBuffer_Release(&tb);
    return NULL;
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
    if (PyModule_AddIntConstant(m, "KMAX", KMAX) < 0 || PyModule_AddIntConstant(m, "ABI", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
