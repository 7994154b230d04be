/*
 * router._kvcore — the hot loops of the KV-aware router, in C.
 *
 * Same semantics as the pure-Python fallbacks in router/hashing.py and router/kv_index.py
 * (tests check that both give identical values); the Python modules choose this one when it
 * imports. Uses xxHash 0.8.2 (BSD-2, vendored in router/_vendor/xxhash, see NOTICE there).
 *
 *   chain_hashes(tokens, block_size, seed=1337, parent=None) -> list[int]
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
 *   kv_scores(endpoints, overlaps, isl, hashed_block_size, overlap_weight) -> {worker_id: score}
 *       Dynamo's routing cost per endpoint, normalised to [0, 1]; the formula is in
 *       router/plugins/kv.py, whose Python version gives bit-identical floats.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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
    static char *kwlist[] = {"tokens", "block_size", "seed", "parent", NULL};
    PyObject *tokens, *seed_obj = NULL, *parent_obj = Py_None;
    Py_ssize_t block_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|OO", kwlist, &tokens, &block_size, &seed_obj, &parent_obj))
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
    PyObject *out = PyList_New(nblocks);
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
                else if (token_u32(items[b * block_size + j], &t) < 0)
                    goto fail;
                buf[j] = big ? XXH_swap32(t) : t;
            }
            block = buf;
        }
        uint64_t local = XXH3_64bits_withSeed(block, (size_t)block_size * 4, seed);
        uint64_t h = (b == 0 && !has_parent) ? local : chain_step(prev, local, big);
        prev = h;
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

static int
table_alloc(MaskTable *t, Py_ssize_t cap, int words)
{
    uint64_t *old = t->data;
    Py_ssize_t oldcap = t->cap;
    int oldwords = t->words;
    uint64_t *data = PyMem_Calloc((size_t)cap * (size_t)(words + 1), sizeof(uint64_t));
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
        PyMem_Free(old);
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
mask_to_long(const MaskTable *t, const uint64_t *mask)
{
    if (t->words == 1)
        return PyLong_FromUnsignedLongLong(mask[0]);
    PyObject *acc = PyLong_FromLong(0), *sh = PyLong_FromLong(64);
    for (int w = t->words - 1; acc && sh && w >= 0; w--) {
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
    PyMem_Free(t->data);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
MaskTable_len(MaskTable *t)
{
    return t->used;
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
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *had = PyList_New(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; had && k < n; k++) {
        uint64_t key;
        if (key_of(items[k], &key) < 0)
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
                if (PyList_Append(had, items[k]) < 0)
                    goto fail;
                continue;
            }
        }
        e[w] |= bit;
    }
    Py_DECREF(seq);
    return had;
fail:
    Py_XDECREF(had);
    Py_DECREF(seq);
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
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t key;
        if (key_of(items[k], &key) < 0) {
            Py_DECREF(seq);
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
    Py_DECREF(seq);
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
    return mask_to_long(t, ENTRY(t, i) + 1);
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

/* match(keys) -> [(depth, mask)]: see the header comment */
static PyObject *
MaskTable_match(MaskTable *t, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    const int W = t->words;
    uint64_t stack[16];
    uint64_t *active = W <= 8 ? stack : PyMem_Malloc(sizeof(uint64_t) * 2 * W);
    uint64_t *dropped = active + W;
    PyObject *out = PyList_New(0);
    if (active == NULL || out == NULL)
        goto fail;
    uint64_t key;
    Py_ssize_t i;
    if (n == 0)
        goto done;
    if (key_of(items[0], &key) < 0)
        goto fail;
    i = find(t, key);
    if (i < 0)
        goto done;
    memcpy(active, ENTRY(t, i) + 1, sizeof(uint64_t) * W);
    for (Py_ssize_t k = 1; k < n; k++) {
        if (key_of(items[k], &key) < 0)
            goto fail;
        i = find(t, key);
        const uint64_t *m = i < 0 ? NULL : ENTRY(t, i) + 1;
        int changed = 0, left = 0;
        for (int w = 0; w < W; w++) {
            uint64_t kept = m ? (m[w] & active[w]) : 0;
            dropped[w] = active[w] & ~kept;
            changed |= dropped[w] != 0;
            active[w] = kept;
            left |= kept != 0;
        }
        if (changed && emit(out, k, mask_to_long(t, dropped)) < 0)
            goto fail;
        if (!left)
            goto done;
    }
    if (emit(out, n, mask_to_long(t, active)) < 0)
        goto fail;
done:
    if (active != stack)
        PyMem_Free(active);
    Py_DECREF(seq);
    return out;
fail:
    if (active != stack)
        PyMem_Free(active);
    Py_XDECREF(out);
    Py_DECREF(seq);
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
    {"match", (PyCFunction)MaskTable_match, METH_O, "match(keys) -> [(depth, mask)]"},
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

/* ---- kv_scores: Dynamo's cost per endpoint, normalised to [0, 1] (router/plugins/kv.py) ---- */

static PyObject *
kv_scores(PyObject *self, PyObject *args)
{
    PyObject *endpoints, *overlaps;
    long long isl, hashed;
    double weight;
    if (!PyArg_ParseTuple(args, "O!O!LLd", &PyList_Type, &endpoints, &PyDict_Type, &overlaps, &isl, &hashed, &weight))
        return NULL;
    static PyObject *s_wid, *s_bs, *s_load, *s_pf, *s_ab;
    if (s_wid == NULL) {
        s_wid = PyUnicode_InternFromString("worker_id");
        s_bs = PyUnicode_InternFromString("block_size");
        s_load = PyUnicode_InternFromString("load");
        s_pf = PyUnicode_InternFromString("prefill_tokens");
        s_ab = PyUnicode_InternFromString("active_blocks");
        if (!s_wid || !s_bs || !s_load || !s_pf || !s_ab)
            return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(endpoints);
    double stackl[128];
    PyObject *stackw[128];
    double *logit = n <= 128 ? stackl : PyMem_Malloc(sizeof(double) * (size_t)n);
    PyObject **wids = n <= 128 ? stackw : PyMem_Calloc((size_t)n, sizeof(PyObject *));
    PyObject *out = NULL;
    Py_ssize_t got = 0, nw = 0;
    if (logit == NULL || wids == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    int any_overlap = PyDict_GET_SIZE(overlaps) > 0;
    for (; got < n; got++) {
        PyObject *ep = PyList_GET_ITEM(endpoints, got);
        PyObject *wid = PyObject_GetAttr(ep, s_wid);
        if (wid == NULL)
            goto cleanup;
        wids[got] = wid;
        nw = got + 1;
        PyObject *bso = PyObject_GetAttr(ep, s_bs);
        long long bs = bso ? PyLong_AsLongLong(bso) : -1;
        Py_XDECREF(bso);
        if (bs == -1 && PyErr_Occurred())
            goto cleanup;
        if (bs <= 0) {
            PyErr_SetString(PyExc_ValueError, "endpoint block_size must be positive");
            goto cleanup;
        }
        long long ov = 0;
        if (any_overlap && bs == hashed) {
            PyObject *o = PyDict_GetItemWithError(overlaps, wid);
            if (o == NULL && PyErr_Occurred())
                goto cleanup;
            if (o != NULL && (ov = PyLong_AsLongLong(o)) == -1 && PyErr_Occurred())
                goto cleanup;
        }
        PyObject *load = PyObject_GetAttr(ep, s_load);
        if (load == NULL)
            goto cleanup;
        PyObject *pfo = PyObject_GetAttr(load, s_pf), *abo = PyObject_GetAttr(load, s_ab);
        Py_DECREF(load);
        double pf = pfo ? PyFloat_AsDouble(pfo) : -1.0, ab = abo ? PyFloat_AsDouble(abo) : -1.0;
        Py_XDECREF(pfo);
        Py_XDECREF(abo);
        if (PyErr_Occurred())
            goto cleanup;
        long long nb = (isl + bs - 1) / bs;
        logit[got] = weight * ((double)(isl - ov * bs) + pf) / (double)bs + ((double)(nb - ov) + ab);
    }
    double lo = 0, hi = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i == 0 || logit[i] < lo)
            lo = logit[i];
        if (i == 0 || logit[i] > hi)
            hi = logit[i];
    }
    double span = hi - lo, inv = span > 0 ? 1.0 / span : 0.0;
    out = PyDict_New();
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyFloat_FromDouble(span > 0 ? (hi - logit[i]) * inv : 1.0);
        if (v == NULL || PyDict_SetItem(out, wids[i], v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(v);
    }
cleanup:
    for (Py_ssize_t i = 0; i < nw; i++)
        Py_DECREF(wids[i]);
    if (logit != stackl)
        PyMem_Free(logit);
    if (wids != stackw)
        PyMem_Free(wids);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_VARARGS | METH_KEYWORDS,
     "chain_hashes(tokens, block_size, seed=1337, parent=None) -> list of chained 64-bit block hashes"},
    {"kv_scores", kv_scores, METH_VARARGS,
     "kv_scores(endpoints, overlaps, isl, hashed_block_size, overlap_weight) -> {worker_id: score in [0, 1]}"},
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
