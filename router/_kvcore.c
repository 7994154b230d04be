/*
 * router._kvcore — the hot loops of the KV-aware router, in C.
 *
 * Same semantics as the pure-Python fallbacks in router/hashing.py and router/kv_index.py
 * (tests check that both give identical values); the Python modules choose this one when it
 * imports. Uses xxHash 0.8.2 (BSD-2, vendored in router/_vendor/xxhash, see NOTICE there).
 *
 *   chain_hashes(tokens, block_size, seed=1337, parent=None, packed=False) -> list[int]
 *       (packed=True: bytes of native uint64, for memoryview(...).cast("Q"); no int objects)
 *       local[i] = xxh3_64(LE u32 tokens of full block i, seed)
 *       seq[0]   = local[0]                                    (parent is None)
 *                = xxh3_64(LE u64 parent || LE u64 local[0], 1337)   (parent given)
 *       seq[i]   = xxh3_64(LE u64 seq[i-1] || LE u64 local[i], 1337)
 *       A trailing partial block is not hashed. tokens: list/tuple of ints in [0, 2^32),
 *       or a buffer of native uint32 (array('I'), numpy uint32).
 *
 *   MaskTable(): u64 block hash -> bitmask of worker slots, open addressing with linear probing
 *   and backward-shift deletion (no tombstones), at most 3/4 full; masks grow 64 slots at a time.
 *       add(keys, slot) -> keys that already had the slot's bit (the caller refcounts those)
 *       remove(keys, slot)       clears the bit; an entry left with no bit is deleted
 *       match(keys) -> [(depth, mask)]
 *           active = mask(keys[0]); for k >= 1: kept = mask(keys[k]) & active; where kept != active
 *           the workers in active & ~kept matched exactly k blocks -> (k, active & ~kept); stops when
 *           nothing is active; the workers active after the last key matched all: (len(keys), active).
 *
 *   kv_scores(endpoints, overlaps, isl, hashed_block_size, overlap_weight, reuse_weight=1.0, request_weight=0.0) -> {worker_id: score}
 *       Dynamo's routing cost per endpoint, normalised to [0, 1]; the formula is in
 *       router/plugins/kv.py, whose Python version gives bit-identical floats.
 *   rank_by_score(scores, endpoints, r) -> endpoints, highest score first (missing: 0.0), ties in
 *       input order, except that the leaders tied for first are rotated by r % their count.
 *   kv_rank(endpoints, overlaps, isl, hashed_block_size, overlap_weight, reuse_weight, request_weight, r)
 *       -> (rank_by_score(kv_scores(...), endpoints, r), the scores as bytes of native doubles in endpoint order)
 *   merge_loads(endpoints, own_loads) -> None: for each endpoint with an entry in own_loads,
 *       copy the scraped engine fields into that entry and make it the endpoint's load.
 *   msgpack_u32(buf) -> bytes of native uint32, or None: `buf` (bytes-like) must be exactly one msgpack array whose
 *       items are all ints in [0, 2^32) (any int encoding); else None (the caller decodes it the general way). How a
 *       KV event's token ids are read without an int object each (workers/vllm/kv_events.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

#include <structmember.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define CHAIN_SEED 1337ULL

static int
is_big_endian(void)
{
    const uint16_t one = 1;
    return *(const uint8_t *)&one == 0;
}

/* One token id -> uint32, with a fast path for small exact ints. */
static inline int
token_u32(PyObject *o, uint32_t *out)
{
    if (PyLong_CheckExact(o)) {
#if PY_VERSION_HEX < 0x030C0000
        Py_ssize_t sz = Py_SIZE(o);
        if (sz == 1) {
            *out = (uint32_t)((PyLongObject *)o)->ob_digit[0]; /* one 30-bit digit */
            return 0;
        }
        if (sz == 0) {
            *out = 0;
            return 0;
        }
#else
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)o);
            if (v >= 0 && (unsigned long long)v <= 0xFFFFFFFFULL) {
                *out = (uint32_t)v;
                return 0;
            }
        }
#endif
    }
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "token ids must be ints, got %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (v > 0xFFFFFFFFULL) {
        PyErr_SetString(PyExc_OverflowError, "token id does not fit in uint32");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static inline uint64_t
chain_step(uint64_t parent, uint64_t local, int big)
{
    uint64_t pair[2] = {parent, local};
    if (big) {
        pair[0] = XXH_swap64(pair[0]);
        pair[1] = XXH_swap64(pair[1]);
    }
    return XXH3_64bits_withSeed(pair, sizeof pair, CHAIN_SEED);
}

static PyObject *
chain_hashes(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"tokens", "block_size", "seed", "parent", "packed", NULL};
    PyObject *tokens, *seed_obj = NULL, *parent_obj = Py_None;
    Py_ssize_t block_size;
    int packed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|OOp", kwlist, &tokens, &block_size, &seed_obj, &parent_obj, &packed))
        return NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    uint64_t seed = CHAIN_SEED;
    if (seed_obj != NULL && seed_obj != Py_None) {
        seed = PyLong_AsUnsignedLongLong(seed_obj);
        if (seed == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    int has_parent = parent_obj != Py_None;
    uint64_t prev = 0;
    if (has_parent) {
        prev = PyLong_AsUnsignedLongLong(parent_obj);
        if (prev == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    const int big = is_big_endian();

    Py_buffer view;
    int have_view = 0;
    PyObject *seq = NULL;
    Py_ssize_t n;
    const uint32_t *raw = NULL;
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens) && PyObject_CheckBuffer(tokens)) {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        have_view = 1;
        const char *f = view.format ? view.format : "B";
        if (*f == '=' || *f == '@' || (*f == '<' && !big))
            f++;
        if (view.itemsize != 4 || (strcmp(f, "I") != 0 && strcmp(f, "L") != 0)) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "a token buffer must hold native uint32 items");
            return NULL;
        }
        raw = (const uint32_t *)view.buf;
        n = view.len / 4;
    }
    else {
        seq = PySequence_Fast(tokens, "tokens must be a list, tuple or uint32 buffer");
        if (seq == NULL)
            return NULL;
        n = PySequence_Fast_GET_SIZE(seq);
    }

    Py_ssize_t nblocks = n / block_size;
    PyObject *out = packed ? PyBytes_FromStringAndSize(NULL, nblocks * 8) : PyList_New(nblocks);
    uint32_t stackbuf[512];
    uint32_t *buf = stackbuf;
    if (out == NULL)
        goto fail;
    if (block_size > 512) {
        buf = PyMem_Malloc(sizeof(uint32_t) * (size_t)block_size);
        if (buf == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
    }
    PyObject **items = seq ? PySequence_Fast_ITEMS(seq) : NULL;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        const uint32_t *block;
        if (raw != NULL && !big) {
            block = raw + b * block_size;
        }
        else {
            for (Py_ssize_t j = 0; j < block_size; j++) {
                uint32_t t;
                if (raw != NULL)
                    t = raw[b * block_size + j];
                else {
                    Py_ssize_t at = b * block_size + j;
                    if (at + 16 < n)
                        __builtin_prefetch(items[at + 16]); /* the int objects are scattered: overlap the misses */
                    if (token_u32(items[at], &t) < 0)
                        goto fail;
                }
                buf[j] = big ? XXH_swap32(t) : t;
            }
            block = buf;
        }
        uint64_t local = XXH3_64bits_withSeed(block, (size_t)block_size * 4, seed);
        uint64_t h = (b == 0 && !has_parent) ? local : chain_step(prev, local, big);
        prev = h;
        if (packed) {
            memcpy(PyBytes_AS_STRING(out) + b * 8, &h, 8); /* native byte order, as memoryview.cast("Q") reads it */
            continue;
        }
        PyObject *v = PyLong_FromUnsignedLongLong(h);
        if (v == NULL)
            goto fail;
        PyList_SET_ITEM(out, b, v);
    }
    if (buf != stackbuf)
        PyMem_Free(buf);
    Py_XDECREF(seq);
    if (have_view)
        PyBuffer_Release(&view);
    return out;
fail:
    if (buf != stackbuf)
        PyMem_Free(buf);
    Py_XDECREF(out);
    Py_XDECREF(seq);
    if (have_view)
        PyBuffer_Release(&view);
    return NULL;
}

/* ---- MaskTable: open-addressing map u64 hash -> bitmask of worker slots ------------------- */

typedef struct {
    PyObject_HEAD
    uint64_t *data;     /* cap entries of `stride` words: [key, mask word 0, mask word 1, ...] */
    Py_ssize_t cap;     /* power of two */
    Py_ssize_t used;
    int shift;          /* 64 - log2(cap) */
    int words;          /* mask words per entry */
    uint64_t salt;
} MaskTable;

#define STRIDE(t) ((t)->words + 1)
#define ENTRY(t, i) ((t)->data + (size_t)(i) * STRIDE(t))

static inline int
entry_used(const MaskTable *t, const uint64_t *e)
{
    for (int w = 1; w <= t->words; w++)
        if (e[w])
            return 1;
    return 0;
}

static inline Py_ssize_t
home(const MaskTable *t, uint64_t key)
{
    return (Py_ssize_t)(((key ^ t->salt) * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

/* Index of key, or -(insertion index) - 1 when absent. */
static inline Py_ssize_t
find(const MaskTable *t, uint64_t key)
{
    Py_ssize_t m = t->cap - 1, i = home(t, key);
    for (;;) {
        const uint64_t *e = ENTRY(t, i);
        if (!entry_used(t, e))
            return -i - 1;
        if (e[0] == key)
            return i;
        i = (i + 1) & m;
    }
}

/* Tables of 4 MiB and more get their own mapping, with transparent huge pages where the kernel
 * allows (fewer TLB misses on the random probes of a big table). */
#define BIG_TABLE (4u << 20)

static void *
table_calloc(size_t bytes)
{
#ifdef MAP_ANONYMOUS
    if (bytes >= BIG_TABLE) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return NULL;
#ifdef MADV_HUGEPAGE
        madvise(p, bytes, MADV_HUGEPAGE);
#endif
        return p; /* zero-filled */
    }
#endif
    return PyMem_Calloc(bytes, 1);
}

static void
table_free(void *p, size_t bytes)
{
    if (p == NULL)
        return;
#ifdef MAP_ANONYMOUS
    if (bytes >= BIG_TABLE) {
        munmap(p, bytes);
        return;
    }
#endif
    PyMem_Free(p);
}

static int
table_alloc(MaskTable *t, Py_ssize_t cap, int words)
{
    uint64_t *old = t->data;
    Py_ssize_t oldcap = t->cap;
    int oldwords = t->words;
    uint64_t *data = table_calloc((size_t)cap * (size_t)(words + 1) * sizeof(uint64_t));
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int log2 = 0;
    while (((Py_ssize_t)1 << log2) < cap)
        log2++;
    t->data = data;
    t->cap = cap;
    t->shift = 64 - log2;
    t->words = words;
    if (old != NULL) {
        for (Py_ssize_t i = 0; i < oldcap; i++) {
            const uint64_t *e = old + (size_t)i * (oldwords + 1);
            int live = 0;
            for (int w = 1; w <= oldwords; w++)
                live |= e[w] != 0;
            if (!live)
                continue;
            Py_ssize_t j = -find(t, e[0]) - 1;
            uint64_t *d = ENTRY(t, j);
            d[0] = e[0];
            memcpy(d + 1, e + 1, sizeof(uint64_t) * oldwords);
        }
        table_free(old, (size_t)oldcap * (size_t)(oldwords + 1) * sizeof(uint64_t));
    }
    return 0;
}

static int
key_of(PyObject *o, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static PyObject *
mask_to_long(int words, const uint64_t *mask)
{
    if (words == 1)
        return PyLong_FromUnsignedLongLong(mask[0]);
    PyObject *acc = PyLong_FromLong(0), *sh = PyLong_FromLong(64);
    for (int w = words - 1; acc && sh && w >= 0; w--) {
        PyObject *shifted = PyNumber_Lshift(acc, sh);
        PyObject *word = PyLong_FromUnsignedLongLong(mask[w]);
        Py_SETREF(acc, (shifted && word) ? PyNumber_Or(shifted, word) : NULL);
        Py_XDECREF(shifted);
        Py_XDECREF(word);
    }
    Py_XDECREF(sh);
    return acc;
}

static int
check_slot(MaskTable *t, PyObject *slot_obj, Py_ssize_t *slot)
{
    *slot = PyLong_AsSsize_t(slot_obj);
    if (*slot == -1 && PyErr_Occurred())
        return -1;
    if (*slot < 0 || *slot >= (1 << 16)) {
        PyErr_SetString(PyExc_ValueError, "slot must be in [0, 65536)");
        return -1;
    }
    return 0;
}

static PyObject *
MaskTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (!PyArg_ParseTuple(args, ":MaskTable"))
        return NULL;
    MaskTable *t = (MaskTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->salt = (uint64_t)(uintptr_t)t * 0xD6E8FEB86659FD93ULL ^ 0x2545F4914F6CDD1DULL;
    if (table_alloc(t, 1024, 1) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
MaskTable_dealloc(MaskTable *t)
{
    table_free(t->data, (size_t)t->cap * (size_t)STRIDE(t) * sizeof(uint64_t));
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
MaskTable_len(MaskTable *t)
{
    return t->used;
}

/* Keys: a list/tuple of ints, or a buffer of native uint64 (what chain_hashes(packed=True) returns,
 * viewed as memoryview(...).cast("Q")): the router's hot path hands hashes over without int objects. */
typedef struct {
    PyObject *seq;
    Py_buffer view;
    const uint64_t *raw;
    PyObject **items;
    Py_ssize_t n;
} Keys;

static int
keys_open(PyObject *obj, Keys *k)
{
    memset(k, 0, sizeof *k);
    if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj) && PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &k->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        const char *f = k->view.format ? k->view.format : "B";
        if (*f == '=' || *f == '@')
            f++;
        if (k->view.itemsize != 8 || (strcmp(f, "Q") != 0 && strcmp(f, "L") != 0)) {
            PyBuffer_Release(&k->view);
            PyErr_SetString(PyExc_TypeError, "a key buffer must hold native uint64 items");
            return -1;
        }
        k->raw = (const uint64_t *)k->view.buf;
        k->n = k->view.len / 8;
        return 0;
    }
    k->seq = PySequence_Fast(obj, "keys must be a sequence of ints or a uint64 buffer");
    if (k->seq == NULL)
        return -1;
    k->items = PySequence_Fast_ITEMS(k->seq);
    k->n = PySequence_Fast_GET_SIZE(k->seq);
    return 0;
}

static inline int
keys_get(const Keys *k, Py_ssize_t i, uint64_t *out)
{
    if (k->raw != NULL) {
        *out = k->raw[i];
        return 0;
    }
    return key_of(k->items[i], out);
}

static PyObject *
keys_item(const Keys *k, Py_ssize_t i)
{
    if (k->raw != NULL)
        return PyLong_FromUnsignedLongLong(k->raw[i]);
    Py_INCREF(k->items[i]);
    return k->items[i];
}

static void
keys_close(Keys *k)
{
    if (k->raw != NULL)
        PyBuffer_Release(&k->view);
    Py_XDECREF(k->seq);
}

/* Walks over many keys (add, remove, match) request the home slot of the key PREFETCH places ahead from memory
 * first, so the cache misses of a big table overlap instead of adding up. */
#define PREFETCH 32

static inline void
prefetch_key(const MaskTable *t, const Keys *ks, Py_ssize_t k)
{
    uint64_t key;
    if (k < ks->n) {
        if (ks->raw != NULL)
            __builtin_prefetch(ENTRY(t, home(t, ks->raw[k])));
        else if (key_of(ks->items[k], &key) == 0)
            __builtin_prefetch(ENTRY(t, home(t, key)));
        else
            PyErr_Clear(); /* reported when the key itself is reached */
    }
}

/* add(keys, slot) -> keys that already had the slot's bit */
static PyObject *
MaskTable_add(MaskTable *t, PyObject *args)
{
    PyObject *keys, *slot_obj;
    Py_ssize_t slot;
    if (!PyArg_ParseTuple(args, "OO", &keys, &slot_obj) || check_slot(t, slot_obj, &slot) < 0)
        return NULL;
    int need = (int)(slot / 64) + 1;
    if (need > t->words && table_alloc(t, t->cap, need) < 0)
        return NULL;
    int w = (int)(slot / 64) + 1;
    uint64_t bit = 1ULL << (slot % 64);
    Keys ks;
    if (keys_open(keys, &ks) < 0)
        return NULL;
    PyObject *had = PyList_New(0);
    for (Py_ssize_t k = 0; k < PREFETCH; k++)
        prefetch_key(t, &ks, k);
    for (Py_ssize_t k = 0; had && k < ks.n; k++) {
        uint64_t key;
        prefetch_key(t, &ks, k + PREFETCH);
        if (keys_get(&ks, k, &key) < 0)
            goto fail;
        if ((t->used + 1) * 4 > t->cap * 3 && table_alloc(t, t->cap * 2, t->words) < 0)
            goto fail;
        Py_ssize_t i = find(t, key);
        uint64_t *e;
        if (i < 0) {
            e = ENTRY(t, -i - 1);
            e[0] = key;
            t->used++;
        }
        else {
            e = ENTRY(t, i);
            if (e[w] & bit) {
                PyObject *item = keys_item(&ks, k);
                int rc = item == NULL ? -1 : PyList_Append(had, item);
                Py_XDECREF(item);
                if (rc < 0)
                    goto fail;
                continue;
            }
        }
        e[w] |= bit;
    }
    keys_close(&ks);
    return had;
fail:
    Py_XDECREF(had);
    keys_close(&ks);
    return NULL;
}

static void
delete_at(MaskTable *t, Py_ssize_t i)
{
    Py_ssize_t m = t->cap - 1, j = i;
    for (;;) { /* backward-shift deletion keeps probe chains intact without tombstones */
        j = (j + 1) & m;
        uint64_t *ej = ENTRY(t, j);
        if (!entry_used(t, ej))
            break;
        Py_ssize_t h = home(t, ej[0]);
        int movable = (j > i) ? (h <= i || h > j) : (h <= i && h > j);
        if (movable) {
            memcpy(ENTRY(t, i), ej, sizeof(uint64_t) * STRIDE(t));
            i = j;
        }
    }
    memset(ENTRY(t, i), 0, sizeof(uint64_t) * STRIDE(t));
    t->used--;
}

/* remove(keys, slot) -> None: clears the slot's bit; entries left with no bit are deleted */
static PyObject *
MaskTable_remove(MaskTable *t, PyObject *args)
{
    PyObject *keys, *slot_obj;
    Py_ssize_t slot;
    if (!PyArg_ParseTuple(args, "OO", &keys, &slot_obj) || check_slot(t, slot_obj, &slot) < 0)
        return NULL;
    if (slot / 64 + 1 > t->words)
        Py_RETURN_NONE;
    int w = (int)(slot / 64) + 1;
    uint64_t bit = 1ULL << (slot % 64);
    Keys ks;
    if (keys_open(keys, &ks) < 0)
        return NULL;
    for (Py_ssize_t k = 0; k < PREFETCH; k++)
        prefetch_key(t, &ks, k);
    for (Py_ssize_t k = 0; k < ks.n; k++) {
        uint64_t key;
        prefetch_key(t, &ks, k + PREFETCH);
        if (keys_get(&ks, k, &key) < 0) {
            keys_close(&ks);
            return NULL;
        }
        Py_ssize_t i = find(t, key);
        if (i < 0)
            continue;
        uint64_t *e = ENTRY(t, i);
        e[w] &= ~bit;
        if (!entry_used(t, e))
            delete_at(t, i);
    }
    keys_close(&ks);
    Py_RETURN_NONE;
}

/* get(key) -> the key's mask (0 when absent) */
static PyObject *
MaskTable_get(MaskTable *t, PyObject *key_obj)
{
    uint64_t key;
    if (key_of(key_obj, &key) < 0)
        return NULL;
    Py_ssize_t i = find(t, key);
    if (i < 0)
        return PyLong_FromLong(0);
    return mask_to_long(t->words, ENTRY(t, i) + 1);
}

static int
emit(PyObject *out, Py_ssize_t depth, PyObject *mask)
{
    if (mask == NULL)
        return -1;
    PyObject *pair = Py_BuildValue("(nN)", depth, mask);
    if (pair == NULL)
        return -1;
    int rc = PyList_Append(out, pair);
    Py_DECREF(pair);
    return rc;
}

/* match(keys, also=None) -> [(depth, mask)]: see the header comment; with `also` (another MaskTable) each key's
 * mask is the OR of both tables' (the index's pending predictions beside its event-fed entries). The keys are
 * converted first, then probed with prefetch (above). */
static PyTypeObject MaskTableType;

static inline int
mask_of(const MaskTable *t, const MaskTable *o, uint64_t key, uint64_t *m, int W, const uint64_t *active)
{
    /* m = t's mask | o's mask for key; with `active`, o is only probed when t's mask lacks some active bit (the
     * walk ANDs m with active, so o could add nothing else): a prefix the events know costs one probe per block */
    int any = 0;
    memset(m, 0, sizeof(uint64_t) * (size_t)W);
    Py_ssize_t i = find(t, key);
    if (i >= 0) {
        memcpy(m, ENTRY(t, i) + 1, sizeof(uint64_t) * (size_t)t->words);
        any = 1;
    }
    if (o == NULL)
        return any;
    if (active != NULL) {
        int covered = 1;
        for (int w = 0; w < W; w++)
            covered &= (m[w] & active[w]) == active[w];
        if (covered)
            return any;
    }
    if ((i = find(o, key)) >= 0) {
        const uint64_t *e = ENTRY(o, i) + 1;
        for (int w = 0; w < o->words; w++)
            m[w] |= e[w];
        any = 1;
    }
    return any;
}

static PyObject *
MaskTable_match(MaskTable *t, PyObject *args)
{
    PyObject *keys, *also = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &keys, &also))
        return NULL;
    if (also != Py_None && !PyObject_TypeCheck(also, &MaskTableType)) {
        PyErr_SetString(PyExc_TypeError, "match: `also` must be a MaskTable or None");
        return NULL;
    }
    const MaskTable *o = (also == Py_None || ((MaskTable *)also)->used == 0) ? NULL : (MaskTable *)also;
    Keys ks;
    if (keys_open(keys, &ks) < 0)
        return NULL;
    Py_ssize_t n = ks.n;
    const int W = o != NULL && o->words > t->words ? o->words : t->words;
    uint64_t stack[24], kstack[512];
    uint64_t *active = W <= 8 ? stack : PyMem_Malloc(sizeof(uint64_t) * 3 * W);
    uint64_t *hk = ks.raw != NULL ? (uint64_t *)ks.raw : n <= 512 ? kstack : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    uint64_t *dropped = active ? active + W : NULL, *m = active ? active + 2 * W : NULL;
    PyObject *out = PyList_New(0);
    if (active == NULL || hk == NULL || out == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    if (n == 0)
        goto done;
    for (Py_ssize_t k = 0; ks.raw == NULL && k < n; k++)
        if (key_of(ks.items[k], &hk[k]) < 0)
            goto fail;
    for (Py_ssize_t k = 1; k < n && k < PREFETCH; k++)
        __builtin_prefetch(ENTRY(t, home(t, hk[k])));
    if (!mask_of(t, o, hk[0], active, W, NULL))
        goto done;
    for (Py_ssize_t k = 1; k < n; k++) {
        if (k + PREFETCH < n)
            __builtin_prefetch(ENTRY(t, home(t, hk[k + PREFETCH])));
        mask_of(t, o, hk[k], m, W, active);
        int changed = 0, left = 0;
        for (int w = 0; w < W; w++) {
            uint64_t kept = m[w] & active[w];
            dropped[w] = active[w] & ~kept;
            changed |= dropped[w] != 0;
            active[w] = kept;
            left |= kept != 0;
        }
        if (changed && emit(out, k, mask_to_long(W, dropped)) < 0)
            goto fail;
        if (!left)
            goto done;
    }
    if (emit(out, n, mask_to_long(W, active)) < 0)
        goto fail;
done:
    if (active != stack)
        PyMem_Free(active);
    if (hk != kstack && hk != ks.raw)
        PyMem_Free(hk);
    keys_close(&ks);
    return out;
fail:
    if (active != stack)
        PyMem_Free(active);
    if (hk != kstack && hk != ks.raw)
        PyMem_Free(hk);
    Py_XDECREF(out);
    keys_close(&ks);
    return NULL;
}

static PyObject *
MaskTable_nbytes(MaskTable *t, void *closure)
{
    return PyLong_FromSsize_t(t->cap * STRIDE(t) * (Py_ssize_t)sizeof(uint64_t));
}

static PyMethodDef MaskTable_methods[] = {
    {"add", (PyCFunction)MaskTable_add, METH_VARARGS, "add(keys, slot) -> keys that already had the slot's bit"},
    {"remove", (PyCFunction)MaskTable_remove, METH_VARARGS, "remove(keys, slot) -> None"},
    {"get", (PyCFunction)MaskTable_get, METH_O, "get(key) -> mask (0 when absent)"},
    {"match", (PyCFunction)MaskTable_match, METH_VARARGS, "match(keys, also=None) -> [(depth, mask)]"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef MaskTable_getset[] = {
    {"nbytes", (getter)MaskTable_nbytes, NULL, "bytes held by the table", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods MaskTable_as_sequence = {.sq_length = (lenfunc)MaskTable_len};

static PyTypeObject MaskTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._kvcore.MaskTable",
    .tp_basicsize = sizeof(MaskTable),
    .tp_dealloc = (destructor)MaskTable_dealloc,
    .tp_as_sequence = &MaskTable_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "u64 block hash -> bitmask of worker slots (open addressing, linear probing)",
    .tp_methods = MaskTable_methods,
    .tp_getset = MaskTable_getset,
    .tp_new = MaskTable_new,
};

/* ---- reading dataclass(slots=True) fields fast ---------------------------------------------
 * Endpoint and EndpointLoad are slotted dataclasses: each field is a member descriptor at a fixed
 * offset in the object. The offsets are looked up once per (type, type version) and read
 * directly; any other type (or an unset slot) goes through the ordinary getattr. */

typedef struct {
    PyTypeObject *type;
    unsigned int version;
    int ok;
    Py_ssize_t off[4];
} SlotCache;

static int
slot_cache_fill(SlotCache *c, PyTypeObject *tp, PyObject *const *names, int n)
{
    c->type = tp;
    c->version = tp->tp_version_tag;
    c->ok = 0;
    if (!(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG))
        return 0;
    for (int i = 0; i < n; i++) {
        PyObject *d = _PyType_Lookup(tp, names[i]);
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type))
            return 0;
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY))
            return 0;
        c->off[i] = m->offset;
    }
    c->ok = 1;
    return 0;
}

/* New reference to obj.<names[i]>. */
static inline PyObject *
slot_get(SlotCache *c, PyObject *obj, PyObject *const *names, int n, int i)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp != c->type || tp->tp_version_tag != c->version)
        slot_cache_fill(c, tp, names, n);
    if (c->ok) {
        PyObject *v = *(PyObject **)((char *)obj + c->off[i]);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(obj, names[i]);
}

static PyObject *EP_NAMES[3], *LOAD_NAMES[3]; /* worker_id, block_size, load; prefill_tokens, active_blocks, inflight_requests */
static SlotCache ep_cache, load_cache;

static int
as_double(PyObject *o, double *out)
{
    if (PyLong_CheckExact(o)) {
        long long v = PyLong_AsLongLong(o);
        if (v == -1 && PyErr_Occurred())
            return -1;
        *out = (double)v;
        return 0;
    }
    *out = PyFloat_AsDouble(o);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* ---- kv_scores / kv_rank: Dynamo's cost per endpoint, normalised to [0, 1] (router/plugins/kv.py) ---- */

typedef struct {
    PyObject *endpoints, *overlaps;
    long long isl, hashed;
    double weight, reuse, per_request;
} KvArgs;

static int
kv_parse(PyObject *args, const char *fmt, KvArgs *a, unsigned long long *r)
{
    a->reuse = 1.0;
    a->per_request = 0.0;
    if (r != NULL)
        return PyArg_ParseTuple(args, fmt, &PyList_Type, &a->endpoints, &PyDict_Type, &a->overlaps, &a->isl, &a->hashed, &a->weight,
                                &a->reuse, &a->per_request, r);
    return PyArg_ParseTuple(args, fmt, &PyList_Type, &a->endpoints, &PyDict_Type, &a->overlaps, &a->isl, &a->hashed, &a->weight,
                            &a->reuse, &a->per_request);
}

/* score[k] of every endpoint, in endpoint order: logit(w) (lower is better), then (hi - logit) / (hi - lo), all 1.0
 * when the logits are equal. With wids != NULL each worker_id (a new reference) goes to wids[k], *nw of them filled
 * (also on failure, for the caller to release). Returns -1 with an exception set on failure. */
static int
kv_scores_c(const KvArgs *a, double *score, PyObject **wids, Py_ssize_t *nw)
{
    const long long isl = a->isl, hashed = a->hashed;
    const double weight = a->weight, reuse = a->reuse, per_request = a->per_request;
    Py_ssize_t n = PyList_GET_SIZE(a->endpoints);
    PyObject *wid = NULL, *bso = NULL, *load = NULL, *pfo = NULL, *abo = NULL, *rqo = NULL;
    int rc = -1;
    *nw = 0;
    int any_overlap = PyDict_GET_SIZE(a->overlaps) > 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *ep = PyList_GET_ITEM(a->endpoints, k);
        if ((wid = slot_get(&ep_cache, ep, EP_NAMES, 3, 0)) == NULL)
            goto cleanup;
        bso = slot_get(&ep_cache, ep, EP_NAMES, 3, 1);
        long long bs = bso ? PyLong_AsLongLong(bso) : -1;
        Py_CLEAR(bso);
        if (bs == -1 && PyErr_Occurred())
            goto cleanup;
        if (bs <= 0) {
            PyErr_SetString(PyExc_ValueError, "endpoint block_size must be positive");
            goto cleanup;
        }
        long long ov = 0;
        if (any_overlap && bs == hashed) {
            PyObject *o = PyDict_GetItemWithError(a->overlaps, wid);
            if (o == NULL && PyErr_Occurred())
                goto cleanup;
            if (o != NULL && (ov = PyLong_AsLongLong(o)) == -1 && PyErr_Occurred())
                goto cleanup;
        }
        if (wids != NULL)
            wids[(*nw)++] = wid;
        else
            Py_DECREF(wid);
        wid = NULL;
        double pf, ab, rq = 0.0;
        if ((load = slot_get(&ep_cache, ep, EP_NAMES, 3, 2)) == NULL)
            goto cleanup;
        if ((pfo = slot_get(&load_cache, load, LOAD_NAMES, 3, 0)) == NULL || as_double(pfo, &pf) < 0)
            goto cleanup;
        if ((abo = slot_get(&load_cache, load, LOAD_NAMES, 3, 1)) == NULL || as_double(abo, &ab) < 0)
            goto cleanup;
        if (per_request != 0.0 && ((rqo = slot_get(&load_cache, load, LOAD_NAMES, 3, 2)) == NULL || as_double(rqo, &rq) < 0))
            goto cleanup;
        Py_CLEAR(load);
        Py_CLEAR(pfo);
        Py_CLEAR(abo);
        Py_CLEAR(rqo);
        long long nb = (isl + bs - 1) / bs;
        /* reuse credit: each cached token offsets (reuse - 1) tokens of this worker's pending prefill, down to
           none pending; it never outweighs decode load (router/plugins/kv.py) */
        double credit = (reuse - 1.0) * (double)(ov * bs), pfe = pf - credit;
        if (credit > 0 && pfe < 0)
            pfe = pf < 0 ? pf : 0.0;
        score[k] = weight * ((double)(isl - ov * bs) + pfe) / (double)bs + ((double)(nb - ov) + ab);
        if (per_request != 0.0) /* each request in flight holds a batch slot beyond its blocks */
            score[k] += per_request * rq;
    }
    double lo = 0, hi = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i == 0 || score[i] < lo)
            lo = score[i];
        if (i == 0 || score[i] > hi)
            hi = score[i];
    }
    double span = hi - lo, inv = span > 0 ? 1.0 / span : 0.0;
    for (Py_ssize_t i = 0; i < n; i++)
        score[i] = span > 0 ? (hi - score[i]) * inv : 1.0;
    rc = 0;
cleanup:
    Py_XDECREF(wid);
    Py_XDECREF(bso);
    Py_XDECREF(load);
    Py_XDECREF(pfo);
    Py_XDECREF(abo);
    Py_XDECREF(rqo);
    return rc;
}

static PyObject *
kv_scores(PyObject *self, PyObject *args)
{
    KvArgs a;
    if (!kv_parse(args, "O!O!LLd|dd", &a, NULL))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(a.endpoints), nw = 0;
    double stacks[128];
    PyObject *stackw[128];
    double *score = n <= 128 ? stacks : PyMem_Malloc(sizeof(double) * (size_t)n);
    PyObject **wids = n <= 128 ? stackw : PyMem_Malloc(sizeof(PyObject *) * (size_t)n);
    PyObject *out = NULL;
    if (score == NULL || wids == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    if (kv_scores_c(&a, score, wids, &nw) < 0)
        goto cleanup;
    out = _PyDict_NewPresized(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyFloat_FromDouble(score[i]);
        if (v == NULL || PyDict_SetItem(out, wids[i], v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(v);
    }
cleanup:
    for (Py_ssize_t i = 0; i < nw; i++)
        Py_DECREF(wids[i]);
    if (score != stacks)
        PyMem_Free(score);
    if (wids != stackw)
        PyMem_Free(wids);
    return out;
}

/* ---- merge_loads: the router's own load bookkeeping into each endpoint (router/router.py) ---- */

static PyObject *ENGINE_NAMES[2]; /* engine_waiting, engine_kv_usage */

static PyObject *
merge_loads(PyObject *self, PyObject *args)
{
    PyObject *endpoints, *own_loads;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &endpoints, &PyDict_Type, &own_loads))
        return NULL;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(endpoints); k++) {
        PyObject *ep = PyList_GET_ITEM(endpoints, k);
        PyObject *wid = slot_get(&ep_cache, ep, EP_NAMES, 3, 0);
        if (wid == NULL)
            return NULL;
        PyObject *own = PyDict_GetItemWithError(own_loads, wid);
        Py_DECREF(wid);
        if (own == NULL) {
            if (PyErr_Occurred())
                return NULL;
            continue; /* nothing booked there yet: the scraped load stands (own counters 0) */
        }
        PyObject *scraped = slot_get(&ep_cache, ep, EP_NAMES, 3, 2);
        if (scraped == NULL)
            return NULL;
        int rc = 0;
        if (scraped != own) {
            for (int i = 0; rc == 0 && i < 2; i++) {
                PyObject *v = PyObject_GetAttr(scraped, ENGINE_NAMES[i]);
                rc = v == NULL ? -1 : PyObject_SetAttr(own, ENGINE_NAMES[i], v);
                Py_XDECREF(v);
            }
            if (rc == 0)
                rc = PyObject_SetAttr(ep, EP_NAMES[2], own);
        }
        Py_DECREF(scraped);
        if (rc < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- rank_by_score: the max-score picker's ranking (router/plugins/pickers.py) -------------- */

typedef struct {
    double v;
    Py_ssize_t i;
} Ranked;

static int
ranked_cmp(const void *a, const void *b)
{
    const Ranked *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1; /* higher score first */
    return x->i < y->i ? -1 : (x->i > y->i); /* then input order: a stable sort */
}

/* The endpoints by rk[k].v, highest first, ties in input order, the leaders tied for first rotated by r % ties. */
static PyObject *
ranked_list(Ranked *rk, Py_ssize_t n, PyObject *endpoints, unsigned long long r)
{
    qsort(rk, (size_t)n, sizeof(Ranked), ranked_cmp);
    Py_ssize_t ties = 1;
    while (ties < n && rk[ties].v == rk[0].v)
        ties++;
    Py_ssize_t rot = ties > 1 ? (Py_ssize_t)(r % (unsigned long long)ties) : 0;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t k = 0; out && k < n; k++) {
        Py_ssize_t src = k < ties ? rk[(k + rot) % ties].i : rk[k].i;
        PyObject *ep = PyList_GET_ITEM(endpoints, src);
        Py_INCREF(ep);
        PyList_SET_ITEM(out, k, ep);
    }
    return out;
}

static PyObject *
rank_by_score(PyObject *self, PyObject *args)
{
    PyObject *scores, *endpoints;
    unsigned long long r;
    if (!PyArg_ParseTuple(args, "O!O!K", &PyDict_Type, &scores, &PyList_Type, &endpoints, &r))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(endpoints);
    Ranked stack[128];
    Ranked *rk = n <= 128 ? stack : PyMem_Malloc(sizeof(Ranked) * (size_t)n);
    PyObject *out = NULL;
    if (rk == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *wid = slot_get(&ep_cache, PyList_GET_ITEM(endpoints, k), EP_NAMES, 3, 0);
        if (wid == NULL)
            goto done;
        PyObject *s = PyDict_GetItemWithError(scores, wid);
        Py_DECREF(wid);
        rk[k].i = k;
        rk[k].v = 0.0;
        if ((s == NULL && PyErr_Occurred()) || (s != NULL && as_double(s, &rk[k].v) < 0))
            goto done;
    }
    out = ranked_list(rk, n, endpoints, r);
done:
    if (rk != stack)
        PyMem_Free(rk);
    return out;
}

/* ---- kv_rank: kv_scores then rank_by_score in one pass, no score objects (Router.route's fast path) ---- */

static PyObject *
kv_rank(PyObject *self, PyObject *args)
{
    KvArgs a;
    unsigned long long r;
    if (!kv_parse(args, "O!O!LLdddK", &a, &r))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(a.endpoints), nw = 0;
    if (n == 0)
        return Py_BuildValue("(Ny#)", PyList_New(0), "", (Py_ssize_t)0);
    double stacks[128];
    Ranked stackr[128];
    double *score = n <= 128 ? stacks : PyMem_Malloc(sizeof(double) * (size_t)n);
    Ranked *rk = n <= 128 ? stackr : PyMem_Malloc(sizeof(Ranked) * (size_t)n);
    PyObject *ranked = NULL, *out = NULL;
    if (score == NULL || rk == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (kv_scores_c(&a, score, NULL, &nw) < 0)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        rk[k].i = k;
        rk[k].v = score[k];
    }
    if ((ranked = ranked_list(rk, n, a.endpoints, r)) == NULL)
        goto done;
    /* the scores as native doubles in endpoint order (RoutingDecision builds its dict from them only if asked) */
    out = Py_BuildValue("(Ny#)", ranked, (const char *)score, (Py_ssize_t)(sizeof(double) * (size_t)n));
done:
    if (score != stacks)
        PyMem_Free(score);
    if (rk != stackr)
        PyMem_Free(rk);
    return out;
}

/* msgpack_u32: see the header. Big-endian reads of the msgpack integer encodings. */
static inline uint64_t
be_read(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

static PyObject *
msgpack_u32(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = (const unsigned char *)view.buf, *end = p + view.len;
    PyObject *out = NULL;
    uint64_t n;
    if (p >= end)
        goto none;
    if ((*p & 0xf0) == 0x90) {
        n = *p & 0x0f;
        p += 1;
    } else if (*p == 0xdc && end - p >= 3) {
        n = be_read(p + 1, 2);
        p += 3;
    } else if (*p == 0xdd && end - p >= 5) {
        n = be_read(p + 1, 4);
        p += 5;
    } else {
        goto none;
    }
    if (n > (uint64_t)(end - p)) /* every item takes at least one byte */
        goto none;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 4));
    if (out == NULL)
        goto done;
    uint32_t *dst = (uint32_t *)PyBytes_AS_STRING(out);
    for (uint64_t i = 0; i < n; i++) {
        if (p >= end)
            goto none;
        unsigned char b = *p++;
        uint64_t v;
        int64_t sv;
        int width;
        if (b <= 0x7f) {
            dst[i] = b;
            continue;
        }
        switch (b) {
        case 0xcc: width = 1; break;
        case 0xcd: width = 2; break;
        case 0xce: width = 4; break;
        case 0xcf: width = 8; break;
        case 0xd0: width = -1; break;
        case 0xd1: width = -2; break;
        case 0xd2: width = -4; break;
        case 0xd3: width = -8; break;
        default: goto none; /* a negative fixint, or not an int */
        }
        int w = width < 0 ? -width : width;
        if (end - p < w)
            goto none;
        v = be_read(p, w);
        p += w;
        if (width < 0) { /* signed: sign-extend from w bytes */
            if (w < 8 && (v >> (8 * w - 1)) & 1)
                goto none;
            sv = (int64_t)v;
            if (sv < 0)
                goto none;
        }
        if (v > 0xffffffffULL)
            goto none;
        dst[i] = (uint32_t)v;
    }
    if (p != end)
        goto none;
    goto done;
none:
    Py_XDECREF(out);
    out = Py_None;
    Py_INCREF(out);
done:
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_VARARGS | METH_KEYWORDS,
     "chain_hashes(tokens, block_size, seed=1337, parent=None) -> list of chained 64-bit block hashes"},
    {"msgpack_u32", msgpack_u32, METH_O,
     "msgpack_u32(buf) -> bytes of native uint32, or None unless buf is exactly a msgpack array of ints in [0, 2^32)"},
    {"merge_loads", merge_loads, METH_VARARGS,
     "merge_loads(endpoints, own_loads) -> None: ep.load = own_loads[ep.worker_id] with the scraped engine fields"},
    {"rank_by_score", rank_by_score, METH_VARARGS,
     "rank_by_score(scores, endpoints, r) -> endpoints by score, highest first; the tied leaders rotated by r % ties"},
    {"kv_rank", kv_rank, METH_VARARGS,
     "kv_rank(endpoints, overlaps, isl, hashed_block_size, overlap_weight, reuse_weight, request_weight, r) -> (ranked, scores as "
     "native doubles in endpoint order): kv_scores then rank_by_score, in one pass"},
    {"kv_scores", kv_scores, METH_VARARGS,
     "kv_scores(endpoints, overlaps, isl, hashed_block_size, overlap_weight, reuse_weight=1.0, request_weight=0.0) -> {worker_id: score in [0, 1]}"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "router._kvcore", "C hot loops of the KV-aware router (block hashing, prefix matching).", -1, methods,
};

PyMODINIT_FUNC
PyInit__kvcore(void)
{
    if (PyType_Ready(&MaskTableType) < 0)
        return NULL;
    const char *ep_names[3] = {"worker_id", "block_size", "load"}, *load_names[3] = {"prefill_tokens", "active_blocks",
                                                                              "inflight_requests"};
    for (int i = 0; i < 3; i++)
        if ((EP_NAMES[i] = PyUnicode_InternFromString(ep_names[i])) == NULL)
            return NULL;
    for (int i = 0; i < 3; i++)
        if ((LOAD_NAMES[i] = PyUnicode_InternFromString(load_names[i])) == NULL)
            return NULL;
    if ((ENGINE_NAMES[0] = PyUnicode_InternFromString("engine_waiting")) == NULL ||
        (ENGINE_NAMES[1] = PyUnicode_InternFromString("engine_kv_usage")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MaskTableType);
    if (PyModule_AddObject(m, "MaskTable", (PyObject *)&MaskTableType) < 0) {
        Py_DECREF(&MaskTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
