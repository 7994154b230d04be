/*
 * orchestrator._relaycore — the SSE relay's per-chunk step in C.
 *
 * Every streamed token of every stream passes here (orchestrator/service.py feeds it from the engine socket's
 * read callback), so this is kvyard's token data plane. The pure-Python `SseRelay` in orchestrator/streaming.py is
 * the reference: the same constructor, the same bytes out for the same bytes in however the stream is cut into
 * reads, the same callbacks in the same order, the same StreamStats at the end of each feed() (tests run both).
 *
 *   SseRelay(stats, forward_usage, on_first_token, on_gap, on_content=None, transform=None, forward_done=True,
 *            strip_ids=False, gap_bounds=None, on_gaps=None, gap_every=64)
 *       feed(chunk: bytes) -> bytes   the complete events of what arrived, each followed by a blank line; b"" when
 *                                     none is complete yet (the rest waits for the next chunk)
 *       flush()                       hands on any gaps counted but not yet reported (gap_bounds mode)
 *       pipe(write, chunk)            write(feed(chunk)) when that is not empty (the read callback's whole step)
 *
 *   Per event (events end at a blank line, b"\n\n"; empty ones are skipped):
 *     "data: [DONE]"                  stats.done = True; forwarded if forward_done
 *     a usage-only chunk              ("data: {" with "usage" and "choices":[] / "choices": []) stats.usage =
 *                                     json.loads(payload)["usage"] (kept as it was if that fails); forwarded
 *                                     if forward_usage
 *     any other "data: " event        content: stats.first_token_at / last_token_at (CLOCK_MONOTONIC, i.e.
 *                                     time.perf_counter(); read once per feed), on_first_token() for the first,
 *                                     the gap since the last one for the others; content_events += 1;
 *                                     on_content(event) as the engine wrote it; then the event is rewritten by
 *                                     transform(event) (None drops it) or, with strip_ids, every
 *                                     `token_ids":[...]` becomes `token_ids":null` (migration.strip_token_ids)
 *     anything else (comments, "event:" lines)  forwarded as it is
 *   Gaps: with gap_bounds (a histogram's ascending upper bounds, +Inf last) each gap is counted in the bucket
 *   bisect_left(gap_bounds, gap) and on_gaps(counts: list[int], sum: float, n: int) is called every gap_every
 *   gaps and by flush(); without, on_gap(gap) is called per gap.
 *   When the output is exactly the chunk (events forwarded unchanged, nothing held back) the chunk object itself is
 *   returned: no copy.
 *
 * Also here, for the same path (each with its Python twin, below): EventBuffer, the migration tracker's raw events,
 * and ChunkWriter, the write of a piece onto the client's connection. With both, a relayed token runs no Python
 * frame between the engine client's body callback and the client's socket. And token_cuts, the check that lets the
 * frontend learn a prompt's ids from the engine's (orchestrator/token_cache.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>  /* PyMemberDef, T_PYSSIZET (Python 3.11) */
#include <stddef.h>
#include <string.h>
#include <time.h>

static PyObject *json_loads;  /* json.loads */
static PyObject *s_done, *s_content_events, *s_first_token_at, *s_last_token_at, *s_usage;

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Buf;

static int
buf_reserve(Buf *b, Py_ssize_t extra)
{
    if (b->len + extra <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra)
        cap *= 2;
    char *p = PyMem_Realloc(b->p, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int
buf_put(Buf *b, const char *s, Py_ssize_t n)
{
    if (buf_reserve(b, n) < 0)
        return -1;
    memcpy(b->p + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

typedef struct {
    PyObject_HEAD
    PyObject *stats, *on_first_token, *on_gap, *on_content, *transform, *on_gaps;
    int forward_usage, forward_done, strip_ids;
    double *bounds;
    long long *counts;
    Py_ssize_t nbounds, gap_every, gap_n;
    double gap_sum;
    Buf tail;  /* an unterminated event, waiting for the rest */
    Buf out;   /* scratch for the output */
    int have_first, done;
    double first_at, last_at;
    Py_ssize_t content_events;
} Relay;

static double
mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int
report_gaps(Relay *self)
{
    if (self->gap_n == 0 || self->on_gaps == NULL)
        return 0;
    PyObject *counts = PyList_New(self->nbounds);
    if (counts == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < self->nbounds; i++) {
        PyObject *k = PyLong_FromLongLong(self->counts[i]);
        if (k == NULL) {
            Py_DECREF(counts);
            return -1;
        }
        PyList_SET_ITEM(counts, i, k);
    }
    double sum = self->gap_sum;
    Py_ssize_t n = self->gap_n;
    memset(self->counts, 0, sizeof(long long) * (size_t)self->nbounds);
    self->gap_sum = 0.0;
    self->gap_n = 0;
    PyObject *r = PyObject_CallFunction(self->on_gaps, "Ndn", counts, sum, n);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int
record_gap(Relay *self, double gap)
{
    if (self->bounds == NULL) {
        PyObject *g = PyFloat_FromDouble(gap);
        if (g == NULL)
            return -1;
        PyObject *r = PyObject_CallOneArg(self->on_gap, g);
        Py_DECREF(g);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        return 0;
    }
    Py_ssize_t lo = 0, hi = self->nbounds;  /* bisect_left: the first bound >= gap */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (self->bounds[mid] < gap)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo >= self->nbounds)  /* no +Inf bound given: the last bucket takes it */
        lo = self->nbounds - 1;
    self->counts[lo] += 1;
    self->gap_sum += gap;
    self->gap_n += 1;
    if (self->gap_n >= self->gap_every)
        return report_gaps(self);
    return 0;
}

static const char DONE_EV[] = "data: [DONE]";
static const char IDS_OPEN[] = "token_ids\":[";  /* 12 bytes; kept up to and including `token_ids":` (11) */

/* The first `needle` (m bytes) in hay (n bytes), found by memchr on its byte k: a byte that is rare in an SSE chunk
   of JSON (`\n`, `[`, `]`, `g`), so few candidates need a memcmp. glibc's memmem builds a shift table on every call,
   which costs more than the search on a ~200-byte chunk (measured: 5% of the frontend's CPU at concurrency 256). */
static const char *
find_by(const char *hay, Py_ssize_t n, const char *needle, Py_ssize_t m, Py_ssize_t k)
{
    if (n < m)
        return NULL;
    const char *p = hay + k, *end = hay + (n - m) + k + 1;  /* where needle[k] can be */
    while (p < end && (p = memchr(p, (unsigned char)needle[k], (size_t)(end - p))) != NULL) {
        if (memcmp(p - k, needle, (size_t)m) == 0)
            return p - k;
        p++;
    }
    return NULL;
}

static inline const char *
find_blank(const char *hay, Py_ssize_t n)
{
    return find_by(hay, n, "\n\n", 2, 0);
}

static inline const char *
find_ids(const char *hay, Py_ssize_t n)
{
    return find_by(hay, n, IDS_OPEN, 12, 11);
}

static int
is_usage_event(const char *ev, Py_ssize_t n)
{
    return find_by(ev, n, "\"usage\"", 7, 4) != NULL
        && (find_by(ev, n, "\"choices\":[]", 12, 11) != NULL || find_by(ev, n, "\"choices\": []", 13, 12) != NULL);
}

/* every int array that `opener` (m bytes: a key's tail, its colon and `[`; byte k rare) opens, written null, into out
   (migration._null_arrays, byte for byte): the key's quotes cannot occur inside a JSON string and the arrays hold only
   ints, so the first `]` ends each */
static int
put_nulled(Buf *out, const char *ev, Py_ssize_t n, const char *opener, Py_ssize_t m, Py_ssize_t k)
{
    Py_ssize_t start = 0;
    const char *hit = find_by(ev, n, opener, m, k);
    while (hit != NULL) {
        Py_ssize_t i = hit - ev;
        const char *close = memchr(ev + i, ']', (size_t)(n - i));
        if (close == NULL)
            break;
        if (buf_put(out, ev + start, i + m - 1 - start) < 0 || buf_put(out, "null", 4) < 0)
            return -1;
        start = (close - ev) + 1;
        hit = start < n ? find_by(ev + start, n - start, opener, m, k) : NULL;
    }
    return buf_put(out, ev + start, n - start);
}

/* every `token_ids":[...]` -> `token_ids":null` (migration.strip_token_ids) */
static inline int
put_stripped(Buf *out, const char *ev, Py_ssize_t n)
{
    return put_nulled(out, ev, n, IDS_OPEN, 12, 11);
}

static int
set_usage(Relay *self, const char *payload, Py_ssize_t n)
{
    PyObject *raw = PyBytes_FromStringAndSize(payload, n);
    if (raw == NULL)
        return -1;
    PyObject *obj = PyObject_CallOneArg(json_loads, raw);
    Py_DECREF(raw);
    PyObject *usage = NULL;
    if (obj != NULL) {
        usage = PyObject_GetItem(obj, s_usage);
        Py_DECREF(obj);
    }
    if (usage == NULL) {  /* as the reference: ValueError, KeyError, TypeError leave stats.usage as it was */
        if (PyErr_ExceptionMatches(PyExc_ValueError) || PyErr_ExceptionMatches(PyExc_KeyError)
            || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    int rc = PyObject_SetAttr(self->stats, s_usage, usage);
    Py_DECREF(usage);
    return rc;
}

static int
sync_stats(Relay *self, int had_first, int was_done, Py_ssize_t events_before)
{
    if (self->done != was_done && PyObject_SetAttr(self->stats, s_done, self->done ? Py_True : Py_False) < 0)
        return -1;
    if (self->content_events != events_before) {
        PyObject *v = PyLong_FromSsize_t(self->content_events);
        if (v == NULL)
            return -1;
        int rc = PyObject_SetAttr(self->stats, s_content_events, v);
        Py_DECREF(v);
        if (rc < 0)
            return -1;
        v = PyFloat_FromDouble(self->last_at);
        if (v == NULL)
            return -1;
        rc = PyObject_SetAttr(self->stats, s_last_token_at, v);
        if (rc == 0 && !had_first)
            rc = PyObject_SetAttr(self->stats, s_first_token_at, v);
        Py_DECREF(v);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* One event (without its blank line). *verbatim stays 1 while the output so far is the input so far. Returns -1 on
   error. `src`/`ev_start` let the first change copy the verbatim prefix into out. */
static int
handle_event(Relay *self, const char *ev, Py_ssize_t n, double *now, int *verbatim, const char *src)
{
    Buf *out = &self->out;
#define FORWARD_AS_IS()                                                                          \
    do {                                                                                         \
        if (!*verbatim && (buf_put(out, ev, n) < 0 || buf_put(out, "\n\n", 2) < 0))              \
            return -1;                                                                           \
    } while (0)
#define LEAVE_VERBATIM()                                                                         \
    do {                                                                                         \
        if (*verbatim) {                                                                         \
            *verbatim = 0;                                                                       \
            if (buf_put(out, src, ev - src) < 0)                                                 \
                return -1;                                                                       \
        }                                                                                        \
    } while (0)

    if (n == 12 && memcmp(ev, DONE_EV, 12) == 0) {
        self->done = 1;
        if (self->forward_done)
            FORWARD_AS_IS();
        else
            LEAVE_VERBATIM();
        return 0;
    }
    if (n >= 7 && memcmp(ev, "data: {", 7) == 0 && is_usage_event(ev, n)) {
        if (set_usage(self, ev + 6, n - 6) < 0)
            return -1;
        if (self->forward_usage)
            FORWARD_AS_IS();
        else
            LEAVE_VERBATIM();
        return 0;
    }
    if (n >= 6 && memcmp(ev, "data: ", 6) == 0) {
        if (*now < 0)
            *now = mono_now();
        if (!self->have_first) {
            self->have_first = 1;
            self->first_at = *now;
            PyObject *r = PyObject_CallNoArgs(self->on_first_token);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
        }
        else if (record_gap(self, *now - self->last_at) < 0)
            return -1;
        self->last_at = *now;
        self->content_events += 1;
        PyObject *evb = NULL;
        if (self->on_content != NULL || self->transform != NULL) {
            evb = PyBytes_FromStringAndSize(ev, n);
            if (evb == NULL)
                return -1;
        }
        if (self->on_content != NULL) {
            PyObject *r = PyObject_CallOneArg(self->on_content, evb);
            if (r == NULL) {
                Py_DECREF(evb);
                return -1;
            }
            Py_DECREF(r);
        }
        if (self->transform != NULL) {
            PyObject *r = PyObject_CallOneArg(self->transform, evb);
            Py_DECREF(evb);
            if (r == NULL)
                return -1;
            LEAVE_VERBATIM();
            if (r == Py_None) {
                Py_DECREF(r);
                return 0;
            }
            if (!PyBytes_Check(r)) {
                Py_DECREF(r);
                PyErr_SetString(PyExc_TypeError, "transform must return bytes or None");
                return -1;
            }
            int rc = buf_put(out, PyBytes_AS_STRING(r), PyBytes_GET_SIZE(r));
            Py_DECREF(r);
            if (rc < 0 || buf_put(out, "\n\n", 2) < 0)
                return -1;
            return 0;
        }
        Py_XDECREF(evb);
        if (self->strip_ids && find_ids(ev, n) != NULL) {
            LEAVE_VERBATIM();
            if (put_stripped(out, ev, n) < 0 || buf_put(out, "\n\n", 2) < 0)
                return -1;
            return 0;
        }
        FORWARD_AS_IS();
        return 0;
    }
    FORWARD_AS_IS();
    return 0;
#undef FORWARD_AS_IS
#undef LEAVE_VERBATIM
}

static PyObject *
Relay_feed(Relay *self, PyObject *chunk)
{
    if (!PyBytes_Check(chunk)) {
        PyErr_SetString(PyExc_TypeError, "feed() takes bytes");
        return NULL;
    }
    const char *data = PyBytes_AS_STRING(chunk);
    Py_ssize_t n = PyBytes_GET_SIZE(chunk);
    int from_tail = self->tail.len > 0;
    if (from_tail) {
        if (buf_put(&self->tail, data, n) < 0)
            return NULL;
        data = self->tail.p;
        n = self->tail.len;
    }
    const char *blank = find_blank(data, n);
    if (blank == NULL) {  /* nothing complete yet */
        if (!from_tail && buf_put(&self->tail, data, n) < 0)
            return NULL;
        return PyBytes_FromStringAndSize(NULL, 0);
    }
    int had_first = self->have_first, was_done = self->done;
    Py_ssize_t events_before = self->content_events;
    int verbatim = !from_tail;
    double now = -1.0;
    self->out.len = 0;
    const char *pos = data;
    int rc = 0;
    for (; blank != NULL; blank = find_blank(pos, n - (pos - data))) {
        if (blank == pos) {  /* an empty event: skipped */
            if (verbatim) {
                verbatim = 0;
                if (buf_put(&self->out, data, pos - data) < 0) {
                    rc = -1;
                    break;
                }
            }
            pos += 2;
            continue;
        }
        if ((rc = handle_event(self, pos, blank - pos, &now, &verbatim, data)) < 0)
            break;
        pos = blank + 2;
    }
    const char *end = pos;  /* past the last blank line */
    if (rc < 0)  /* a callback failed: the events after it are dropped, as the reference drops them */
        for (const char *b = find_blank(end, n - (end - data)); b != NULL; b = find_blank(end, n - (end - data)))
            end = b + 2;
    PyObject *result = NULL;
    if (rc == 0) {
        Py_ssize_t rest = n - (end - data);
        if (verbatim && rest == 0) {
            Py_INCREF(chunk);
            result = chunk;
        }
        else if (verbatim)
            result = PyBytes_FromStringAndSize(data, end - data);
        else
            result = PyBytes_FromStringAndSize(self->out.p, self->out.len);
    }
    /* what follows the last blank line waits for the next chunk (kept even on error, as the reference's buffer) */
    Py_ssize_t rest = n - (end - data);
    if (from_tail) {
        memmove(self->tail.p, end, (size_t)rest);
        self->tail.len = rest;
    }
    else {
        self->tail.len = 0;
        if (rest && buf_put(&self->tail, end, rest) < 0) {
            Py_XDECREF(result);
            return NULL;
        }
    }
    if (self->out.cap > (1 << 16)) {  /* a rare large chunk: do not keep its scratch for the stream's life */
        PyMem_Free(self->out.p);
        self->out.p = NULL;
        self->out.cap = self->out.len = 0;
    }
    if (sync_stats(self, had_first, was_done, events_before) < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

/* pipe(write, chunk): write(feed(chunk)) when that is not empty: the read callback's whole step, with no Python frame
   between the engine's bytes and the client's socket when `write` is a ChunkWriter */
static PyObject *
Relay_pipe(Relay *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pipe() takes (write, chunk)");
        return NULL;
    }
    PyObject *out = Relay_feed(self, args[1]);
    if (out == NULL)
        return NULL;
    PyObject *r = PyBytes_GET_SIZE(out) > 0 ? PyObject_CallOneArg(args[0], out) : Py_NewRef(Py_None);
    Py_DECREF(out);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *
Relay_flush(Relay *self, PyObject *Py_UNUSED(ignored))
{
    if (report_gaps(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int
Relay_traverse(Relay *self, visitproc visit, void *arg)
{
    Py_VISIT(self->stats);
    Py_VISIT(self->on_first_token);
    Py_VISIT(self->on_gap);
    Py_VISIT(self->on_content);
    Py_VISIT(self->transform);
    Py_VISIT(self->on_gaps);
    return 0;
}

static int
Relay_clear(Relay *self)
{
    Py_CLEAR(self->stats);
    Py_CLEAR(self->on_first_token);
    Py_CLEAR(self->on_gap);
    Py_CLEAR(self->on_content);
    Py_CLEAR(self->transform);
    Py_CLEAR(self->on_gaps);
    return 0;
}

static void
Relay_dealloc(Relay *self)
{
    PyObject_GC_UnTrack(self);
    Relay_clear(self);
    PyMem_Free(self->tail.p);
    PyMem_Free(self->out.p);
    PyMem_Free(self->bounds);
    PyMem_Free(self->counts);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
none_to_null(PyObject *o)
{
    return (o == NULL || o == Py_None) ? NULL : o;
}

static int
Relay_init(Relay *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"stats", "forward_usage", "on_first_token", "on_gap", "on_content", "transform",
                            "forward_done", "strip_ids", "gap_bounds", "on_gaps", "gap_every", NULL};
    PyObject *stats, *on_first_token, *on_gap, *on_content = NULL, *transform = NULL, *bounds = NULL, *on_gaps = NULL;
    int forward_usage, forward_done = 1, strip_ids = 0;
    Py_ssize_t gap_every = 64;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OpOO|OOppOOn", names, &stats, &forward_usage, &on_first_token, &on_gap,
                                     &on_content, &transform, &forward_done, &strip_ids, &bounds, &on_gaps, &gap_every))
        return -1;
    bounds = none_to_null(bounds);
    on_gaps = none_to_null(on_gaps);
    if (bounds != NULL) {
        if (on_gaps == NULL || gap_every < 1) {
            PyErr_SetString(PyExc_ValueError, "gap_bounds needs on_gaps and gap_every >= 1");
            return -1;
        }
        PyObject *seq = PySequence_Fast(bounds, "gap_bounds must be a sequence of floats");
        if (seq == NULL)
            return -1;
        Py_ssize_t nb = PySequence_Fast_GET_SIZE(seq);
        if (nb < 1) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "gap_bounds must not be empty");
            return -1;
        }
        double *b = PyMem_Calloc((size_t)nb, sizeof(double));
        long long *c = PyMem_Calloc((size_t)nb, sizeof(long long));
        if (b == NULL || c == NULL) {
            PyMem_Free(b);
            PyMem_Free(c);
            Py_DECREF(seq);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < nb; i++) {
            b[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
            if (b[i] == -1.0 && PyErr_Occurred()) {
                PyMem_Free(b);
                PyMem_Free(c);
                Py_DECREF(seq);
                return -1;
            }
        }
        Py_DECREF(seq);
        PyMem_Free(self->bounds);
        PyMem_Free(self->counts);
        self->bounds = b;
        self->counts = c;
        self->nbounds = nb;
    }
    Py_INCREF(stats);
    Py_XSETREF(self->stats, stats);
    Py_INCREF(on_first_token);
    Py_XSETREF(self->on_first_token, on_first_token);
    Py_INCREF(on_gap);
    Py_XSETREF(self->on_gap, on_gap);
    on_content = none_to_null(on_content);
    Py_XINCREF(on_content);
    Py_XSETREF(self->on_content, on_content);
    transform = none_to_null(transform);
    Py_XINCREF(transform);
    Py_XSETREF(self->transform, transform);
    Py_XINCREF(on_gaps);
    Py_XSETREF(self->on_gaps, on_gaps);
    self->forward_usage = forward_usage;
    self->forward_done = forward_done;
    self->strip_ids = strip_ids;
    self->gap_every = gap_every;
    return 0;
}

static PyMethodDef Relay_methods[] = {
    {"feed", (PyCFunction)Relay_feed, METH_O, "feed(chunk) -> the complete events relayed now (bytes)"},
    {"flush", (PyCFunction)Relay_flush, METH_NOARGS, "hand on the gaps counted and not yet reported"},
    {"pipe", (PyCFunction)(void (*)(void))Relay_pipe, METH_FASTCALL, "pipe(write, chunk): write(feed(chunk)) if not empty"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "orchestrator._relaycore.SseRelay",
    .tp_basicsize = sizeof(Relay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The SSE relay's per-chunk step (orchestrator/streaming.py's SseRelay, in C).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Relay_init,
    .tp_dealloc = (destructor)Relay_dealloc,
    .tp_traverse = (traverseproc)Relay_traverse,
    .tp_clear = (inquiry)Relay_clear,
    .tp_methods = Relay_methods,
};

/* ---- EventBuffer: the migration tracker's raw events (orchestrator/resilience/migration.py) ---------------------

   EventBuffer(limit, on_full, big=4096, on_prompt_ids=None)
       feed(ev: bytes)   keeps ev, with each `"prompt_token_ids":[...]` written null when ev is longer than `big`
                         (migration.without_prompt_ids); once the bytes kept pass `limit`, calls on_full().
                         With on_prompt_ids: the first such cut array that parses (migration.parse_u32_array) is
                         handed to on_prompt_ids(ids: bytes, native uint32s) before the event is kept, once per
                         buffer; an exception it raises is reported as unraisable, never raised into the relay
       take() -> list    the events kept, oldest first; the buffer is then empty
       len(buffer)       how many are kept; buffer.nbytes: their bytes
   The Python twin is migration._EventBuffer; the tracker hands `feed` to the relay as its on_content, so a relayed
   token costs no Python frame here. */

static const char PROMPT_IDS_OPEN[] = "\"prompt_token_ids\":[";  /* 20 bytes; `[` (19) is the rare byte */

typedef struct {
    PyObject_HEAD
    PyObject *events;  /* list[bytes] */
    PyObject *on_full;
    PyObject *on_prompt_ids;  /* NULL once called (or never given) */
    Py_ssize_t nbytes, limit, big;
} EventBuffer;

static inline int
json_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* The n bytes between an int array's brackets as native uint32s (a bytes object), or NULL with no error set when they
   are not exactly that: non-negative decimal ints < 2**32 without signs or exponents, comma-separated, JSON whitespace
   around them; an empty array gives NULL too (migration.parse_u32_array, byte for byte) */
static PyObject *
parse_u32(const char *p, Py_ssize_t n)
{
    Py_ssize_t commas = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        commas += p[i] == ',';
    PyObject *out = PyBytes_FromStringAndSize(NULL, (commas + 1) * (Py_ssize_t)sizeof(uint32_t));
    if (out == NULL)
        return NULL;
    uint32_t *ids = (uint32_t *)PyBytes_AS_STRING(out);
    Py_ssize_t i = 0, k = 0;
    for (;;) {
        while (i < n && json_space(p[i]))
            i++;
        if (i == n || p[i] < '0' || p[i] > '9')
            goto bad;
        uint64_t v = 0;
        Py_ssize_t digits = 0;
        while (i < n && p[i] >= '0' && p[i] <= '9') {
            v = v * 10 + (uint64_t)(p[i++] - '0');
            if (++digits > 10)
                goto bad;
        }
        if (v > 0xFFFFFFFFu)
            goto bad;
        ids[k++] = (uint32_t)v;
        while (i < n && json_space(p[i]))
            i++;
        if (i == n)
            break;
        if (p[i++] != ',')
            goto bad;
    }
    if (k != commas + 1)
        goto bad;
    return out;
bad:
    Py_DECREF(out);
    return NULL;
}

/* hands the first parsable prompt_token_ids array of ev (n bytes; `hit`: the first opener in it) to on_prompt_ids,
   once */
static void
offer_prompt_ids(EventBuffer *self, const char *ev, Py_ssize_t n, const char *hit)
{
    while (hit != NULL && self->on_prompt_ids != NULL) {
        const char *start = hit + 20;
        const char *close = memchr(start, ']', (size_t)(n - (start - ev)));
        if (close == NULL)
            return;
        PyObject *ids = parse_u32(start, close - start);
        if (ids == NULL) {
            if (PyErr_Occurred())  /* memory: reported, the event is still kept */
                PyErr_WriteUnraisable(self->on_prompt_ids);
        }
        else {
            PyObject *callback = self->on_prompt_ids;
            self->on_prompt_ids = NULL;  /* once, even if it fails */
            PyObject *r = PyObject_CallOneArg(callback, ids);
            if (r == NULL)
                PyErr_WriteUnraisable(callback);
            Py_XDECREF(r);
            Py_DECREF(callback);
            Py_DECREF(ids);
            return;
        }
        Py_ssize_t at = (close - ev) + 1;
        hit = at < n ? find_by(ev + at, n - at, PROMPT_IDS_OPEN, 20, 19) : NULL;
    }
}

static PyObject *
EventBuffer_feed(EventBuffer *self, PyObject *ev)
{
    if (!PyBytes_Check(ev)) {
        PyErr_SetString(PyExc_TypeError, "feed() takes bytes");
        return NULL;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(ev);
    PyObject *kept;
    const char *hit = n > self->big ? find_by(PyBytes_AS_STRING(ev), n, PROMPT_IDS_OPEN, 20, 19) : NULL;
    if (hit != NULL) {
        if (self->on_prompt_ids != NULL)
            offer_prompt_ids(self, PyBytes_AS_STRING(ev), n, hit);
        Buf cut = {NULL, 0, 0};  /* rare and large: not kept for the stream's life */
        kept = put_nulled(&cut, PyBytes_AS_STRING(ev), n, PROMPT_IDS_OPEN, 20, 19) < 0
            ? NULL : PyBytes_FromStringAndSize(cut.p, cut.len);
        PyMem_Free(cut.p);
        if (kept == NULL)
            return NULL;
    }
    else {
        Py_INCREF(ev);
        kept = ev;
    }
    int rc = PyList_Append(self->events, kept);
    self->nbytes += PyBytes_GET_SIZE(kept);
    Py_DECREF(kept);
    if (rc < 0)
        return NULL;
    if (self->nbytes > self->limit) {
        PyObject *r = PyObject_CallNoArgs(self->on_full);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *
EventBuffer_take(EventBuffer *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL)
        return NULL;
    PyObject *taken = self->events;
    self->events = fresh;
    self->nbytes = 0;
    return taken;
}

static Py_ssize_t
EventBuffer_len(EventBuffer *self)
{
    return PyList_GET_SIZE(self->events);
}

static int
EventBuffer_init(EventBuffer *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"limit", "on_full", "big", "on_prompt_ids", NULL};
    Py_ssize_t limit, big = 4096;
    PyObject *on_full, *on_prompt_ids = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nO|nO", names, &limit, &on_full, &big, &on_prompt_ids))
        return -1;
    if (!PyCallable_Check(on_full) || (on_prompt_ids != Py_None && !PyCallable_Check(on_prompt_ids))) {
        PyErr_SetString(PyExc_TypeError, "on_full and on_prompt_ids must be callable");
        return -1;
    }
    if (on_prompt_ids == Py_None)
        Py_CLEAR(self->on_prompt_ids);
    else {
        Py_INCREF(on_prompt_ids);
        Py_XSETREF(self->on_prompt_ids, on_prompt_ids);
    }
    PyObject *events = PyList_New(0);
    if (events == NULL)
        return -1;
    Py_XSETREF(self->events, events);
    Py_INCREF(on_full);
    Py_XSETREF(self->on_full, on_full);
    self->limit = limit;
    self->big = big;
    self->nbytes = 0;
    return 0;
}

static int
EventBuffer_traverse(EventBuffer *self, visitproc visit, void *arg)
{
    Py_VISIT(self->events);
    Py_VISIT(self->on_full);
    Py_VISIT(self->on_prompt_ids);
    return 0;
}

static int
EventBuffer_clear(EventBuffer *self)
{
    Py_CLEAR(self->events);
    Py_CLEAR(self->on_full);
    Py_CLEAR(self->on_prompt_ids);
    return 0;
}

static void
EventBuffer_dealloc(EventBuffer *self)
{
    PyObject_GC_UnTrack(self);
    EventBuffer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef EventBuffer_methods[] = {
    {"feed", (PyCFunction)EventBuffer_feed, METH_O, "keep one event (see the type's doc)"},
    {"take", (PyCFunction)EventBuffer_take, METH_NOARGS, "the events kept, oldest first; empties the buffer"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef EventBuffer_members[] = {
    {"nbytes", T_PYSSIZET, offsetof(EventBuffer, nbytes), READONLY, "bytes kept"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods EventBuffer_as_sequence = {.sq_length = (lenfunc)EventBuffer_len};

static PyTypeObject EventBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "orchestrator._relaycore.EventBuffer",
    .tp_basicsize = sizeof(EventBuffer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The migration tracker's raw events (orchestrator/resilience/migration.py's _EventBuffer, in C).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)EventBuffer_init,
    .tp_dealloc = (destructor)EventBuffer_dealloc,
    .tp_traverse = (traverseproc)EventBuffer_traverse,
    .tp_clear = (inquiry)EventBuffer_clear,
    .tp_methods = EventBuffer_methods,
    .tp_members = EventBuffer_members,
    .tp_as_sequence = &EventBuffer_as_sequence,
};

/* ---- ChunkWriter: a streamed body's piece onto the client's connection (orchestrator/direct_body.py) -------------

   ChunkWriter(transport, cycle)(data: bytes)
       unless data is empty, cycle.disconnected is true or transport.is_closing(): transport.write() of data framed
       as one HTTP/1.1 chunk, b"%x\r\n%b\r\n" % (len(data), data): DirectBody.write, byte for byte. */

static PyObject *s_disconnected, *s_write, *s_is_closing;

typedef struct {
    PyObject_HEAD
    PyObject *cycle, *write, *is_closing;
} ChunkWriter;

static PyObject *
ChunkWriter_call(ChunkWriter *self, PyObject *args, PyObject *kw)
{
    PyObject *data;
    if (kw != NULL && PyDict_GET_SIZE(kw) != 0) {
        PyErr_SetString(PyExc_TypeError, "ChunkWriter takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "ChunkWriter", 1, 1, &data))
        return NULL;
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "ChunkWriter takes bytes");
        return NULL;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    if (n == 0)
        Py_RETURN_NONE;
    PyObject *gone = PyObject_GetAttr(self->cycle, s_disconnected);
    if (gone == NULL)
        return NULL;
    int is_gone = PyObject_IsTrue(gone);
    Py_DECREF(gone);
    if (is_gone != 0)
        return is_gone < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *closing = PyObject_CallNoArgs(self->is_closing);
    if (closing == NULL)
        return NULL;
    int is_closing = PyObject_IsTrue(closing);
    Py_DECREF(closing);
    if (is_closing != 0)
        return is_closing < 0 ? NULL : Py_NewRef(Py_None);
    char head[24];
    int hn = snprintf(head, sizeof head, "%zx\r\n", n);
    PyObject *framed = PyBytes_FromStringAndSize(NULL, hn + n + 2);
    if (framed == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(framed);
    memcpy(p, head, (size_t)hn);
    memcpy(p + hn, PyBytes_AS_STRING(data), (size_t)n);
    memcpy(p + hn + n, "\r\n", 2);
    PyObject *r = PyObject_CallOneArg(self->write, framed);
    Py_DECREF(framed);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static int
ChunkWriter_init(ChunkWriter *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"transport", "cycle", NULL};
    PyObject *transport, *cycle;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO", names, &transport, &cycle))
        return -1;
    PyObject *write = PyObject_GetAttr(transport, s_write);
    if (write == NULL)
        return -1;
    PyObject *is_closing = PyObject_GetAttr(transport, s_is_closing);
    if (is_closing == NULL) {
        Py_DECREF(write);
        return -1;
    }
    Py_XSETREF(self->write, write);
    Py_XSETREF(self->is_closing, is_closing);
    Py_INCREF(cycle);
    Py_XSETREF(self->cycle, cycle);
    return 0;
}

static int
ChunkWriter_traverse(ChunkWriter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cycle);
    Py_VISIT(self->write);
    Py_VISIT(self->is_closing);
    return 0;
}

static int
ChunkWriter_clear(ChunkWriter *self)
{
    Py_CLEAR(self->cycle);
    Py_CLEAR(self->write);
    Py_CLEAR(self->is_closing);
    return 0;
}

static void
ChunkWriter_dealloc(ChunkWriter *self)
{
    PyObject_GC_UnTrack(self);
    ChunkWriter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ChunkWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "orchestrator._relaycore.ChunkWriter",
    .tp_basicsize = sizeof(ChunkWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A streamed body's piece as one HTTP/1.1 chunk onto the client's connection (DirectBody.write, in C).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ChunkWriter_init,
    .tp_dealloc = (destructor)ChunkWriter_dealloc,
    .tp_traverse = (traverseproc)ChunkWriter_traverse,
    .tp_clear = (inquiry)ChunkWriter_clear,
    .tp_call = (ternaryfunc)ChunkWriter_call,
};

/* ---- token_cuts: do token ids spell a text, with a token boundary at each cut? (orchestrator/token_cache.py) -------

   token_cuts(ids, starts, lens, blob, text, cuts) -> list[int] | None
       ids: native uint32s; starts, lens: int64s per id (a token's bytes are blob[starts[id]:starts[id] + lens[id]],
       lens 0 for an unknown id); text: bytes; cuts: ascending byte offsets into text, the last len(text). The ids'
       bytes end to end must be exactly text and each cut must fall between two tokens: then the number of tokens
       before each cut, else None. The Python twin is token_cache._token_cuts (numpy): ChunkedTokenizer.learn runs
       this once per learned prompt (~15k ids), where the twin gathers every byte with numpy. */

static PyObject *
token_cuts(PyObject *Py_UNUSED(mod), PyObject *args)
{
    Py_buffer ids, starts, lens, blob, text;
    PyObject *cuts, *out = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*O!", &ids, &starts, &lens, &blob, &text, &PyList_Type, &cuts))
        return NULL;
    Py_ssize_t n = ids.len / 4, vocab = lens.len / 8, ncuts = PyList_GET_SIZE(cuts), pos = 0, k = 0, next = -1;
    const uint32_t *id = ids.buf;
    const int64_t *start = starts.buf, *len = lens.buf;
    const char *b = blob.buf, *t = text.buf;
    if (starts.len != lens.len)
        goto done;  /* None */
    if (ncuts && (next = PyLong_AsSsize_t(PyList_GET_ITEM(cuts, 0))) < 0 && PyErr_Occurred())
        goto fail;
    if ((out = PyList_New(0)) == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = id[i];
        if ((Py_ssize_t)v >= vocab || len[v] <= 0 || pos + len[v] > text.len || start[v] + len[v] > blob.len
            || memcmp(b + start[v], t + pos, (size_t)len[v]) != 0)
            goto none;
        pos += len[v];
        if (next >= 0 && next < pos)
            goto none;  /* the cut falls inside this token */
        if (next == pos) {
            PyObject *count = PyLong_FromSsize_t(i + 1);
            if (count == NULL || PyList_Append(out, count) < 0) {
                Py_XDECREF(count);
                goto fail;
            }
            Py_DECREF(count);
            next = ++k < ncuts ? PyLong_AsSsize_t(PyList_GET_ITEM(cuts, k)) : -1;
            if (next < 0 && PyErr_Occurred())
                goto fail;
        }
    }
    if (pos == text.len && k == ncuts)
        goto done;
none:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&blob);
    PyBuffer_Release(&text);
    if (out == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return out;
fail:
    Py_CLEAR(out);
    goto done;
}

static PyMethodDef relaycore_functions[] = {
    {"token_cuts", token_cuts, METH_VARARGS, "do token ids spell a text with a boundary at each cut (see above)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef relaycore_module = {
    PyModuleDef_HEAD_INIT, "orchestrator._relaycore", "The SSE relay's per-chunk step in C.", -1, relaycore_functions,
};

PyMODINIT_FUNC
PyInit__relaycore(void)
{
    if (PyType_Ready(&RelayType) < 0 || PyType_Ready(&EventBufferType) < 0 || PyType_Ready(&ChunkWriterType) < 0)
        return NULL;
    PyObject *json = PyImport_ImportModule("json");
    if (json == NULL)
        return NULL;
    json_loads = PyObject_GetAttrString(json, "loads");
    Py_DECREF(json);
    if (json_loads == NULL)
        return NULL;
    if ((s_done = PyUnicode_InternFromString("done")) == NULL
        || (s_content_events = PyUnicode_InternFromString("content_events")) == NULL
        || (s_first_token_at = PyUnicode_InternFromString("first_token_at")) == NULL
        || (s_last_token_at = PyUnicode_InternFromString("last_token_at")) == NULL
        || (s_usage = PyUnicode_InternFromString("usage")) == NULL
        || (s_disconnected = PyUnicode_InternFromString("disconnected")) == NULL
        || (s_write = PyUnicode_InternFromString("write")) == NULL
        || (s_is_closing = PyUnicode_InternFromString("is_closing")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&relaycore_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "SseRelay", (PyObject *)&RelayType) < 0
        || PyModule_AddObjectRef(m, "EventBuffer", (PyObject *)&EventBufferType) < 0
        || PyModule_AddObjectRef(m, "ChunkWriter", (PyObject *)&ChunkWriterType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
